"""Llama-family decoder (Llama 2/3, SmolLM2, Qwen2, Qwen3, Mistral, Seed-OSS) over the paged KV cache; the base of
the other families."""
from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Union

import torch
from torch import nn
from transformers import PretrainedConfig

from lmdeploy.pytorch.config import ModelConfig
from lmdeploy.pytorch.distributed.parallel_state import Shard
from lmdeploy.pytorch.nn.attention import PagedAttention
from lmdeploy.pytorch.nn.decoder_stack import LayerWeights, NativeDecoderStack, layer_weights
from lmdeploy.pytorch.nn.embedding import LMHead, VocabParallelEmbedding
from lmdeploy.pytorch.nn.linear import GateUpLinear, Linear, MergedLinear, QKVLinear, RowLinear
from lmdeploy.pytorch.nn.moe import Fp32Router, FusedExperts
from lmdeploy.pytorch.nn.quant import LinearOptions, layout_of
from lmdeploy.pytorch.nn.norm import RMSNorm
from lmdeploy.pytorch.nn.rotary import RotaryEmbedding, apply_rope, position_query_scale, rotary_dim, scale_queries
from lmdeploy.pytorch.step_context import StepContext
from lmdeploy.pytorch.weights.safetensors_loader import TensorPart, WeightSource, read_shard

KVCache = tuple[torch.Tensor, ...]  # see PagedAttention
QKV_BIAS_MODEL_TYPES = ('qwen2', 'qwen2_vl_text', 'qwen2_5_vl_text', 'glm4v_text')
QK_NORM_MODEL_TYPES = ('qwen3', 'qwen3_moe', 'qwen3_vl_text', 'qwen3_vl_moe_text')
DECODE_INT4_LAYERS = ('qkv_proj', 'o_proj', 'gate_up_proj', 'down_proj')
# a merged layer -> the projections it stacks, in order; checkpoints may hold it fused (Phi-3, GLM)
FUSED_PROJECTIONS = {'qkv_proj': ('q_proj', 'k_proj', 'v_proj'), 'gate_up_proj': ('gate_proj', 'up_proj')}
# what a checkpoint tensor fills: a whole parameter (its name) or one shard of a merged one (name, shard)
WeightKey = Union[str, tuple[str, str]]
# the tensor or slice to fill, what it fills, and which part of the checkpoint tensor fills it
WeightTarget = tuple[torch.Tensor, WeightKey, Union[Shard, None]]


def layer_window(hf_config: PretrainedConfig, layer_index: int) -> int | None:
    """The sliding window of layer ``layer_index``, None for full attention: the layers that
    ``layer_types`` marks ``sliding_attention``, or without ``layer_types`` every layer when the config
    has a ``sliding_window`` (and ``use_sliding_window`` is not False)."""
    window = getattr(hf_config, 'sliding_window', None)
    if not window:
        return None
    layer_types = getattr(hf_config, 'layer_types', None)
    if layer_types is not None:
        return window if layer_types[layer_index] == 'sliding_attention' else None
    return window if getattr(hf_config, 'use_sliding_window', True) else None


class LlamaAttention(nn.Module):
    """Self-attention with rotary queries and keys: all of each head's features, the first
    ``partial_rotary_factor`` of them, or none (``use_rope=False``); ``interleaved_rope`` turns
    neighbouring pairs (GLM) instead of halves; with ``scaled_queries`` the rotated queries are multiplied by
    their token's factor in ``ctx.q_scale`` (Ministral 3). ``scale`` defaults to ``head_dim ** -0.5``;
    ``sliding_window`` and ``logit_softcap`` go to :class:`PagedAttention`. ``qk_norm`` (None: the config's
    choice) gives queries and keys an RMSNorm with weights before the rotation, of epsilon ``qk_norm_eps`` (None:
    the config's ``rms_norm_eps``). ``qkv_bias`` and ``o_bias``
    default to the config's ``attention_bias`` (``attention_out_bias`` for ``o_proj`` where the config has one:
    Seed-OSS)."""

    def __init__(self, cfg: ModelConfig, use_rope: bool = True, interleaved_rope: bool = False,
                 o_bias: bool | None = None, scale: float | None = None, sliding_window: int | None = None,
                 logit_softcap: float | None = None, qk_norm: bool | None = None, scaled_queries: bool = False,
                 qkv_bias: bool | None = None, qk_norm_eps: float | None = None):
        super().__init__()
        self.scaled_queries = scaled_queries
        hf = cfg.hf_config
        self.head_dim = cfg.head_dim
        self.use_rope, self.interleaved_rope = use_rope, interleaved_rope
        self.rotary_dim = rotary_dim(hf, self.head_dim)
        attention_bias = bool(getattr(hf, 'attention_bias', False))
        o_bias = bool(getattr(hf, 'attention_out_bias', attention_bias)) if o_bias is None else o_bias
        if qkv_bias is None:
            qkv_bias = attention_bias or bool(getattr(hf, 'qkv_bias', False)) or hf.model_type in QKV_BIAS_MODEL_TYPES
        self.qkv_proj = QKVLinear(cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, self.head_dim, bias=qkv_bias)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.o_proj = RowLinear.over_heads(self.qkv_proj, cfg.hidden_size, bias=o_bias)
        if qk_norm is None:
            qk_norm = hf.model_type in QK_NORM_MODEL_TYPES or bool(getattr(hf, 'use_qk_norm', False))
        self.qk_norm = qk_norm
        if self.qk_norm:
            eps = hf.rms_norm_eps if qk_norm_eps is None else qk_norm_eps
            self.q_norm = RMSNorm(self.head_dim, eps)
            self.k_norm = RMSNorm(self.head_dim, eps)
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, self.head_dim,
                                   self.head_dim**-0.5 if scale is None else scale, cfg.quant_policy,
                                   sliding_window=sliding_window, logit_softcap=logit_softcap)

    def forward(self, x: torch.Tensor, kv_cache: KVCache, ctx: StepContext) -> torch.Tensor:
        return self.o_proj(self.attend(x, kv_cache, ctx))

    def attend(self, x: torch.Tensor, kv_cache: KVCache, ctx: StepContext) -> torch.Tensor:
        """The attention's output before ``o_proj`` (where a family gates it)."""
        heads = self.num_heads + 2 * self.num_kv_heads
        qkv = self.qkv_proj(x).view(-1, heads, self.head_dim)
        qk, v = qkv[:, :self.num_heads + self.num_kv_heads], qkv[:, self.num_heads + self.num_kv_heads:]
        if self.qk_norm:
            qk = torch.cat((self.q_norm(qk[:, :self.num_heads]), self.k_norm(qk[:, self.num_heads:])), dim=1)
        if self.use_rope:
            qk = apply_rope(qk, ctx.cos, ctx.sin, self.interleaved_rope)
        q, k = qk[:, :self.num_heads], qk[:, self.num_heads:]
        if self.scaled_queries:
            q = scale_queries(q, ctx.q_scale)
        return self.attn(q, k, v, kv_cache, ctx)


class LlamaMLP(nn.Module):

    def __init__(self, cfg: ModelConfig, intermediate_size: int | None = None, activation: str = 'silu',
                 bias: bool | None = None):
        super().__init__()
        hf = cfg.hf_config
        bias = bool(getattr(hf, 'mlp_bias', False)) if bias is None else bias
        intermediate_size = intermediate_size or hf.intermediate_size
        self.gate_up_proj = GateUpLinear(cfg.hidden_size, intermediate_size, bias=bias, activation=activation)
        self.down_proj = RowLinear.after(self.gate_up_proj, cfg.hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.gate_up_proj(x))


class LlamaDecoderLayer(nn.Module):

    def __init__(self, cfg: ModelConfig, mlp: nn.Module, attn: LlamaAttention | None = None):
        super().__init__()
        eps = cfg.hf_config.rms_norm_eps
        self.self_attn = attn or LlamaAttention(cfg)
        self.mlp = mlp
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, kv_cache: KVCache, ctx: StepContext):
        x, residual = self.norm_input(x, residual)
        x = self.self_attn(x, kv_cache, ctx)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual

    def norm_input(self, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's normalized input and the residual stream with ``x`` added (``x`` itself in the first
        layer, where ``residual`` is None)."""
        if residual is None:
            return self.input_layernorm(x), x
        return self.input_layernorm(x, residual)

    def native_weights(self, small_step: bool = False) -> LayerWeights | None:
        """This layer's weights for :class:`NativeDecoderStack` (``small_step``: those of steps of at most
        ``small_step_rows`` tokens); None unless every projection runs on a native GEMM and the layer has
        no parts the stack lacks (another family's layer, a GeLU MLP)."""
        return self.stack_weights(small_step) if type(self) is LlamaDecoderLayer else None

    def stack_weights(self, small_step: bool, **norms: torch.Tensor) -> LayerWeights | None:
        """:meth:`native_weights` of a layer with this layer's forward, and ``norms`` (see ``layer_weights``)
        where a family's layer adds them."""
        attn = self.self_attn
        mlp = self.mlp_weights(small_step)
        if not isinstance(attn, LlamaAttention) or mlp is None:
            return None
        projections, moe = mlp
        projections.update(qkv=attn.qkv_proj, o=attn.o_proj)
        if attn.qk_norm:
            norms.update(q_norm=attn.q_norm.weight, k_norm=attn.k_norm.weight)
        return layer_weights(self.input_layernorm.weight, self.post_attention_layernorm.weight, projections,
                             small_step, rotary_dim=attn.rotary_dim if attn.use_rope else 0,
                             interleaved_rope=attn.interleaved_rope, sliding_window=attn.attn.sliding_window,
                             logit_softcap=attn.attn.logit_softcap, scaled_queries=attn.scaled_queries,
                             sinks=None if attn.attn.sinks is None else attn.attn.sinks.float(), **moe, **norms)

    def mlp_weights(self, small_step: bool) -> tuple[dict[str, Linear], dict[str, object]] | None:
        """The MLP's part of :meth:`stack_weights`: ``(its gate_up and down projections, {})``, for an ungated MLP
        its own ``stack_parts`` (models/arcee.py), or for a MoE block ``({}, {'moe': its native block})``; None where
        it cannot run in the stack."""
        mlp = self.mlp
        if isinstance(mlp, LlamaMLP) and mlp.gate_up_proj.gate_up_panels:
            return dict(gate_up=mlp.gate_up_proj, down=mlp.down_proj), {}
        if hasattr(mlp, 'stack_parts'):
            return mlp.stack_parts()
        moe = mlp.native_moe(small_step) if hasattr(mlp, 'native_moe') else None  # a MoE block (models/moe.py)
        return None if moe is None else ({}, {'moe': moe})


class LlamaForCausalLM(nn.Module):
    """Decoder stack plus LM head; ``forward`` returns hidden states, ``logits`` projects them."""

    # HF name fragment -> (merged parameter, part index)
    stacked_params = {
        'q_proj': ('qkv_proj', 0), 'k_proj': ('qkv_proj', 1), 'v_proj': ('qkv_proj', 2),
        'gate_proj': ('gate_up_proj', 0), 'up_proj': ('gate_up_proj', 1),
    }
    # why the model cannot be split over tensor-parallel ranks; None where it can
    tensor_parallel_refusal: str | None = None
    # whether CUDA graphs may capture its decode steps (False where a layer reads values back to the host)
    decode_graphs = True

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        hf = cfg.hf_config
        self.cfg = cfg
        self.query_scale = position_query_scale(hf)
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(self.make_layer(cfg, i) for i in range(cfg.num_layers))
        self.norm = self.make_norm(cfg)
        self.rotary = RotaryEmbedding(hf, cfg.head_dim)
        self.tie_word_embeddings = cfg.tie_word_embeddings
        self.lm_head = LMHead(cfg.hidden_size, cfg.vocab_size, self.embed_tokens if self.tie_word_embeddings else None)
        self.native_stack: NativeDecoderStack | None = None

    def make_layer(self, cfg: ModelConfig, layer_index: int) -> nn.Module:
        """One decoder layer; families with other layers override it."""
        attn = LlamaAttention(cfg, sliding_window=layer_window(cfg.hf_config, layer_index),
                              scaled_queries=self.query_scale is not None)
        return LlamaDecoderLayer(cfg, self.make_mlp(cfg, layer_index), attn)

    def make_mlp(self, cfg: ModelConfig, layer_index: int) -> nn.Module:
        """The feed-forward block of one decoder layer; MoE models override it."""
        return LlamaMLP(cfg)

    def make_norm(self, cfg: ModelConfig) -> nn.Module:
        """The norm after the last layer; families with another norm override it."""
        return RMSNorm(cfg.hidden_size, cfg.hf_config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, kv_caches: list[KVCache], ctx: StepContext) -> torch.Tensor:
        ctx.cos, ctx.sin = self.rotary(ctx, self.cfg.dtype)
        if self.query_scale is not None:
            ctx.q_scale = self.query_scale(ctx.positions).to(self.cfg.dtype)
        x = self.embed(input_ids, ctx)
        if self.native_stack is not None and self.native_stack.runs(x.shape[0], ctx.num_prefill_tokens):
            x, residual = self.native_stack(x, kv_caches, ctx)
        else:
            residual = None
            for layer, kv_cache in zip(self.layers, kv_caches):
                x, residual = layer(x, residual, kv_cache, ctx)
        x, _ = self.norm(x, residual)
        return x

    def embed(self, input_ids: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        """Input embeddings of the packed tokens; vision-language models fill in image features."""
        return self.embed_tokens(input_ids)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """``[T, vocab]`` logits in the model's dtype (fp32 for the fp16 LM head of one-row steps and for a W8A8
        model's int8 LM head on the CPU); None on the tensor-parallel ranks that do not sample."""
        return self.lm_head(hidden)

    def finalize_weights(self, pack_cpu: bool, small_step_int4: bool) -> None:
        """Lays the loaded weights out for their kernels (see :class:`LinearOptions`): bf16 CPU weights
        packed for their GEMM (and a copy of the LM head's); with ``small_step_int4`` the decoder's
        projections keep a 4-bit copy for small steps and one row's LM head runs on an 8-bit (a Q8_0 table)
        or fp16 copy (see :meth:`LMHead.enable_small_step_copy`). With
        native GEMM weights throughout, the decoder layers then run as one :class:`NativeDecoderStack`."""
        projections = [(name, module) for name, module in self.layers.named_modules() if isinstance(module, Linear)]
        for name, module in projections:
            module.finalize(LinearOptions(pack_cpu, small_step_int4 and name.endswith(DECODE_INT4_LAYERS), self.cfg.dtype))
        for module in self.layers.modules():
            if isinstance(module, FusedExperts):
                module.finalize(LinearOptions(pack_cpu, dtype=self.cfg.dtype))
            elif isinstance(module, Fp32Router):
                module.finalize()
        if small_step_int4:
            self.lm_head.enable_small_step_copy()
        self.lm_head.finalize(pack_cpu)
        if not pack_cpu:
            return
        attn = self.layers[0].self_attn
        experts = [module for module in self.layers.modules() if isinstance(module, FusedExperts)]
        rows = {module.kernel.small_step_rows for module in [m for _, m in projections] + experts} - {0}
        # decode rows take the small stack whatever the layers' bounds (4-bit copies: 2 tokens, GGUF GEMVs: 16 to
        # 96); outside an engine step, steps of up to the smallest
        small = [layer.native_weights(small_step=True) for layer in self.layers] if rows else None
        self.native_stack = NativeDecoderStack.build(
            [layer.native_weights() for layer in self.layers], small, attn.num_heads, attn.num_kv_heads,
            attn.head_dim, self.norm.eps, attn.attn.scale, min(rows, default=0), self.cfg.quant_policy)

    def weight_target(self, name: str) -> WeightTarget | None:
        """Where a Hugging Face tensor (name without ``model.``) goes: the tensor or slice to fill, what it
        fills (see :meth:`required_weights`) and the part of the tensor that fills it (None: all of it);
        None for tensors the model does not use."""
        if 'rotary_emb' in name or (self.tie_word_embeddings and name == 'lm_head.weight'):
            return None
        module_name, _, kind = name.rpartition('.')
        owner, _, proj = module_name.rpartition('.')
        if proj in self.stacked_params:
            merged, index = self.stacked_params[proj]
            module = self.get_submodule(f'{owner}.{merged}')
            if getattr(module, kind, None) is None:  # a tensor its weight format does not use
                return None
            part, shard = module.checkpoint_part(kind, index)
            return part, (f'{owner}.{merged}.{kind}', proj), shard
        try:
            param = self.get_parameter(name)
        except AttributeError:
            return None
        module = self.get_submodule(module_name)
        if not hasattr(module, 'checkpoint_part'):
            return param, name, None
        part, shard = module.checkpoint_part(kind)
        return part, name, shard

    def required_weights(self) -> set[WeightKey]:
        """What the checkpoint must fill: the name of each whole parameter, and ``(parameter, shard)``
        for each part of a merged one: every projection of a ``qkv_proj``/``gate_up_proj`` and every
        expert's matrices (modules with such parameters list their shards in ``weight_shards()``)."""
        merged_parts: dict[str, dict[int, str]] = {}
        for proj, (merged, index) in self.stacked_params.items():
            merged_parts.setdefault(merged, {})[index] = proj
        shards: dict[str, list[str]] = {}
        for module_name, module in self.named_modules():
            prefix = f'{module_name}.' if module_name else ''
            if isinstance(module, MergedLinear):
                parts = merged_parts[module_name.rpartition('.')[2]]
                for kind, _ in module.named_parameters(recurse=False):
                    shards[prefix + kind] = [parts[i] for i in range(len(module.offsets) - 1)]
            elif hasattr(module, 'weight_shards'):
                shards.update({prefix + kind: labels for kind, labels in module.weight_shards().items()})
        required: set[WeightKey] = set()
        for name, _ in self.named_parameters():
            required.update(((name, label) for label in shards[name]) if name in shards else (name,))
        return required

    def load_weights(self, weights: Iterable[tuple[str, WeightSource]]) -> None:
        """Loads Hugging Face-named tensors; raises naming what is missing afterwards, down to a single
        shard of a merged parameter (a ``k_proj``, one expert's ``up`` matrix) whose rows would otherwise
        be left uninitialized."""
        loaded: set[WeightKey] = set()
        for name, tensor in self.split_fused(weights):
            target = self.weight_target(name.removeprefix('model.'))
            if target is not None:
                dest, key, shard = target
                dest.copy_(read_shard(tensor, shard))
                loaded.add(key)
        missing = sorted(key if isinstance(key, str) else f'{key[0]} ({key[1]})'
                         for key in self.required_weights() - loaded)
        if missing:
            raise ValueError(f'weights are missing for {missing[:5]} ({len(missing)} in all)')

    def split_fused(self, weights: Iterable[tuple[str, WeightSource]]) -> Iterator[tuple[str, WeightSource]]:
        """The checkpoint's tensors, each fused one (a ``qkv_proj`` or ``gate_up_proj`` of a merged layer)
        as the projections it stacks, so that each rank reads only its own share of each."""
        for name, tensor in weights:
            module_name, _, kind = name.rpartition('.')
            owner, _, fused = module_name.rpartition('.')
            module = None
            if fused in FUSED_PROJECTIONS:
                try:
                    module = self.get_submodule(module_name.removeprefix('model.'))
                except AttributeError:  # a tensor the model does not use
                    pass
            if not isinstance(module, MergedLinear):
                yield name, tensor
                continue
            layout = layout_of(getattr(module, kind))
            start = 0
            for proj, size in zip(FUSED_PROJECTIONS[fused], module.out_sizes):
                part = f'{owner}.{proj}.{kind}'
                if layout.output_dim is None:
                    yield part, tensor
                    continue
                stop = start + size // layout.outputs_per_index
                yield part, TensorPart(tensor, layout.output_dim, start, stop)
                start = stop


class WithoutNativeStack:
    """For families whose layers the native decoder stack does not take: every step runs the layers' own forward."""

    def finalize_weights(self, pack_cpu: bool, small_step_int4: bool) -> None:
        """Lays the loaded weights out for their kernels (bf16 CPU weights packed for their GEMM)."""
        for module in self.modules():
            if isinstance(module, (Linear, FusedExperts)):
                module.finalize(LinearOptions(pack_cpu, dtype=self.cfg.dtype))
            elif isinstance(module, Fp32Router):
                module.finalize()
        self.lm_head.finalize(pack_cpu)
