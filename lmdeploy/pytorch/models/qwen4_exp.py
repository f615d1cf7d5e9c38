"""Qwen4-Exp (``Qwen4ExpForCausalLM``, and the language model of ``Qwen4ExpForConditionalGeneration``, whose vision
tower is skipped at load: text only): Qwen3.5-MoE's hybrid of Gated DeltaNet and gated attention (``qwen3_next.py``)
with three additions.

- Hyper-connections (transformers' ``Qwen4ExpTextGatedResidual``): the residual stream is ``hc_count`` streams of
  ``hidden_size``; before each mixer and each MLP a learned gate mixes the normed streams into the block's input,
  and the block's output is added to every stream, each by a learned weight. The final mixer of the streams feeds the
  LM head in place of a final norm.
- QSA: each full-attention layer's indexer picks the blocks of tokens each query attends (``kernels/qsa.py``), its
  raw keys cached beside K and V.
- Per-layer embeddings (PLE) on the linear-attention layers ``ple_layer_ids`` names: hashed embeddings of the
  2..``ngram_size``-grams ending at each token (the n-grams do not reach across an end-of-sequence token), gated by
  each stream and smoothed by a dilated depthwise convolution, added to the streams. Their recurrent state, beside
  the Gated DeltaNet's, is the last ``ngram_size - 1`` token ids and the convolution's last inputs.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.qwen4_exp.modeling_qwen4_exp import _build_layer_multipliers, _find_nth_prime_after

from lmdeploy.pytorch.config import ModelConfig
from lmdeploy.pytorch.kernels.activation import placeless
from lmdeploy.pytorch.kernels.dsa import TokenSelection, fill_index_keys
from lmdeploy.pytorch.kernels.qsa import context_keys, pooled_block_keys, select_tokens
from lmdeploy.pytorch.models.llama import KVCache, WeightTarget, WithoutNativeStack
from lmdeploy.pytorch.models.moe import MoEForCausalLM, SparseMoeBlock
from lmdeploy.pytorch.models.qwen3_next import (LINEAR_ATTENTION, MTP_PREFIX, CausalConv1d, GatedAttention,
                                                GatedDeltaNet, Qwen3NextForCausalLM)
from lmdeploy.pytorch.nn.linear import Linear
from lmdeploy.pytorch.nn.norm import GemmaRMSNorm
from lmdeploy.pytorch.nn.rotary import apply_rope
from lmdeploy.pytorch.step_context import StepContext
from lmdeploy.pytorch.weights.safetensors_loader import WeightSource

# the linear-attention layers' output-gate activation (``output_gate_type``, else ``hidden_act``)
OUTPUT_GATES = {'silu': F.silu, 'sigmoid': torch.sigmoid}
BlockRope = tuple[torch.Tensor, torch.Tensor]  # cos, sin of the first position of each indexer block
LANGUAGE_MODEL_PREFIX = 'model.language_model.'  # Qwen4ExpForConditionalGeneration's language model
VISION_PREFIX = 'model.visual.'


class StreamRMSNorm(nn.Module):
    """Gemma-style RMSNorm (``1 + weight``) of each ``size`` slice of ``groups * size`` features (each stream)."""

    def __init__(self, groups: int, size: int, eps: float):
        super().__init__()
        self.groups, self.size, self.eps = groups, size, eps
        self.weight = nn.Parameter(torch.zeros(groups * size), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        streams = x.float().unflatten(-1, (self.groups, self.size))
        inverse = placeless(torch.rsqrt, streams.pow(2).mean(-1, keepdim=True) + self.eps)
        return ((streams * inverse).flatten(-2) * (1.0 + self.weight.float())).to(x.dtype)


class HyperConnection(nn.Module):
    """Mixes ``hc_count`` streams ``[T, hc * H]`` into one block input ``[T, H]`` (a gate per feature, from a
    low-rank projection of the normed streams) and, with ``inject``, the weight ``[T, hc]`` by which the block's
    output joins each stream."""

    def __init__(self, cfg: ModelConfig, inject: bool = True):
        super().__init__()
        hf = cfg.hf_config
        self.count, width = hf.hc_count, hf.hc_count * cfg.hidden_size
        self.hc_norm = StreamRMSNorm(self.count, cfg.hidden_size, hf.rms_norm_eps)
        self.input_mix_weight_down = Linear(width, hf.hc_lowrank)
        self.input_mix_weight_up = Linear(hf.hc_lowrank, width)
        self.block_inject_weight = Linear(width, self.count) if inject else None

    def mix(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The block input ``[T, H]`` and the normed streams."""
        normed = self.hc_norm(streams)
        gate = placeless(F.silu, self.input_mix_weight_down(normed) / self.count)
        gate = placeless(torch.sigmoid, self.input_mix_weight_up(gate))
        mixed = (gate.unflatten(-1, (self.count, -1)) * normed.unflatten(-1, (self.count, -1))).mean(-2)
        return mixed, normed

    def forward(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The block input and each stream's weight of the block's output."""
        mixed, normed = self.mix(streams)
        return mixed, 2 * placeless(torch.sigmoid, self.block_inject_weight(normed) / self.count)


def inject(streams: torch.Tensor, out: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``streams [T, hc * H]`` plus the block's ``out [T, H]`` times each stream's ``weights [T, hc]``."""
    return streams + (out.unsqueeze(1) * weights.unsqueeze(-1)).flatten(1)


class NGramEmbedding(nn.Module):
    """Hashed embeddings of the n-grams (2 to ``ngram_size`` tokens) ending at each token: ``heads_per_ngram`` heads
    per order, each hashing into a table of its own (a prime number of rows, all heads' tables stacked in
    ``ngram_embedding``); a token before an end-of-sequence token reads as that token. The checkpoints split the
    table by rows into ``split_ngram_parts`` shards."""

    def __init__(self, cfg: ModelConfig, ple_index: int):
        super().__init__()
        hf = cfg.hf_config
        self.order, self.eos = hf.ngram_size, hf.eos_token_id
        self.eos = self.eos[0] if isinstance(self.eos, list) else self.eos
        self.per_order = hf.heads_per_ngram
        heads = (self.order - 1) * self.per_order
        sizes = [_find_nth_prime_after(hf.ngram_vocab_size_base - 1, ple_index * heads + head + 1)
                 for head in range(heads)]
        self.multipliers = _build_layer_multipliers(hf.vocab_size, self.order, ple_index, hf.seed)
        self.head_sizes = torch.tensor(sizes)
        self.head_offsets = torch.tensor([0] + sizes[:-1]).cumsum(0)
        divisor = hf.make_ngram_vocab_size_divisible_by
        rows = -(-sum(sizes) // divisor) * divisor
        self.ngram_embedding = nn.Parameter(torch.empty(rows, hf.ple_embed_dim // heads), requires_grad=False)
        self.shard_rows = [len(part) for part in torch.arange(rows).chunk(hf.split_ngram_parts)]

    def weight_shards(self) -> dict[str, list[str]]:
        """The checkpoint's shards of the table (see ``LlamaForCausalLM.required_weights``)."""
        return {'ngram_embedding': [f'shard_{index}' for index in range(len(self.shard_rows))]}

    def shard(self, index: int) -> torch.Tensor:
        """The rows of the table that shard ``index`` fills."""
        start = sum(self.shard_rows[:index])
        return self.ngram_embedding[start:start + self.shard_rows[index]]

    def forward(self, history: torch.Tensor, length: int) -> torch.Tensor:
        """``[B, length, E]``: the embeddings of the last ``length`` tokens of ``history [B, order - 1 + length]``
        (the tokens before them first)."""
        device = history.device
        shifted, valid = [history], torch.ones_like(history, dtype=torch.bool)
        for shift in range(1, self.order):
            earlier = F.pad(history, (shift, 0), value=self.eos)[:, :history.shape[1]]
            valid = valid & (earlier != self.eos)
            shifted.append(torch.where(valid, earlier, self.eos))
        multipliers = self.multipliers.to(device)
        sizes, offsets = self.head_sizes.to(device), self.head_offsets.to(device)
        ids, mixed = [], shifted[0] * multipliers[0]
        for order in range(2, self.order + 1):
            mixed = torch.bitwise_xor(mixed, shifted[order - 1] * multipliers[order - 1])
            heads = slice((order - 2) * self.per_order, (order - 1) * self.per_order)
            ids.append(torch.remainder(mixed.unsqueeze(-1), sizes[heads]) + offsets[heads])
        ids = torch.cat(ids, dim=-1)[:, -length:]
        return F.embedding(ids, self.ngram_embedding).flatten(-2)


class PerLayerEmbedding(nn.Module):
    """PLE (transformers' ``Qwen4ExpTextPLELayer``): a token's n-gram embedding projects to a value and a key per
    stream; each normed stream's product with its key gates the value; the gated values plus SiLU of a dilated
    depthwise convolution of them (normed) are added to the streams. State per sequence: the last ``ngram_size - 1``
    token ids and the convolution's last ``(kernel - 1) * ngram_size`` inputs."""

    def __init__(self, cfg: ModelConfig, ple_index: int):
        super().__init__()
        hf = cfg.hf_config
        self.count, self.hidden, width = hf.hc_count, cfg.hidden_size, hf.hc_count * cfg.hidden_size
        self.ple_embedding = NGramEmbedding(cfg, ple_index)
        self.key_proj = Linear(hf.ple_embed_dim, width)
        self.value_proj = Linear(hf.ple_embed_dim, cfg.hidden_size)
        self.norm_key, self.norm_query, self.norm_conv = (StreamRMSNorm(self.count, cfg.hidden_size, hf.rms_norm_eps)
                                                          for _ in range(3))
        self.kernel, self.dilation = hf.ple_conv_kernel_size, hf.ngram_size
        self.conv1d = CausalConv1d(width, self.kernel)
        self.conv_state_len = (self.kernel - 1) * self.dilation
        self.dtype = cfg.dtype

    def state_shapes(self) -> list[tuple[tuple[int, ...], torch.dtype]]:
        """One slot's last token ids and convolution inputs."""
        return [((self.ple_embedding.order - 1,), torch.long),
                ((self.count * self.hidden, self.conv_state_len), self.dtype)]

    def embed(self, input_ids: torch.Tensor, id_states: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        """``[T, E]`` n-gram embeddings of the step's tokens, each sequence's last ids carried in ``id_states``."""
        context = id_states.shape[1]
        parts = []
        for slot, start, length, fresh in ctx.state_prefill or ():
            before = torch.full_like(id_states[slot], self.ple_embedding.eos) if fresh else id_states[slot]
            history = torch.cat((before, input_ids[start:start + length]))
            parts.append(self.ple_embedding(history.unsqueeze(0), length)[0])
            id_states[slot] = history[-context:]
        if ctx.num_prefill_tokens < input_ids.shape[0]:
            slots = ctx.state_decode_slots
            history = torch.cat((id_states[slots], input_ids[ctx.num_prefill_tokens:].unsqueeze(1)), dim=1)
            parts.append(self.ple_embedding(history, 1)[:, 0])
            id_states[slots] = history[:, -context:]
        return torch.cat(parts)

    def convolve(self, x: torch.Tensor, conv_states: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        """SiLU of the dilated depthwise causal convolution of ``x [T, hc * H]``, each sequence's last inputs
        carried in ``conv_states``; a fixed order of sums, so that a row's result does not depend on its batch."""
        weight = self.conv1d.weight.squeeze(1).unsqueeze(-1)

        def taps(inputs: torch.Tensor, length: int) -> torch.Tensor:
            """``[..., C, length]`` of ``inputs [..., C, conv_state_len + length]``."""
            out = inputs[..., 0:length] * weight[:, 0]
            for tap in range(1, self.kernel):
                start = tap * self.dilation
                out = out + inputs[..., start:start + length] * weight[:, tap]
            return out

        parts = []
        for slot, start, length, fresh in ctx.state_prefill or ():
            before = torch.zeros_like(conv_states[slot]) if fresh else conv_states[slot]
            inputs = torch.cat((before, x[start:start + length].T), dim=1)
            parts.append(taps(inputs, length).T)
            conv_states[slot] = inputs[:, -self.conv_state_len:]
        if ctx.num_prefill_tokens < x.shape[0]:
            slots = ctx.state_decode_slots
            inputs = torch.cat((conv_states[slots], x[ctx.num_prefill_tokens:].unsqueeze(-1)), dim=-1)
            parts.append(taps(inputs, 1)[..., 0])
            conv_states[slots] = inputs[..., -self.conv_state_len:]
        return placeless(F.silu, torch.cat(parts))

    def forward(self, streams: torch.Tensor, input_ids: torch.Tensor, state: tuple[torch.Tensor, torch.Tensor],
                ctx: StepContext) -> torch.Tensor:
        """What the layer adds to ``streams [T, hc * H]``."""
        id_states, conv_states = state
        embeddings = self.embed(input_ids, id_states, ctx)
        keys = self.norm_key(self.key_proj(embeddings)).unflatten(-1, (self.count, self.hidden))
        queries = self.norm_query(streams).unflatten(-1, (self.count, self.hidden))
        gate = (keys * queries).sum(-1, keepdim=True) / self.hidden**0.5
        gate = gate.abs().clamp_min(1e-6).sqrt() * gate.sign()
        gated = (placeless(torch.sigmoid, gate) * self.value_proj(embeddings).unsqueeze(1)).flatten(1)
        return gated + self.convolve(self.norm_conv(gated), conv_states, ctx)


class QsaIndexer(nn.Module):
    """QSA's indexer: ``indexer_n_heads`` query heads and one key per token from one projection, Gemma-style
    norms, the attention's rotary; a query attends the ``indexer_budget`` tokens of its best complete blocks of
    ``indexer_compress_ratio`` tokens, and those after its last complete block (``kernels/qsa.py``)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        hf = cfg.hf_config
        if hf.indexer_kv_heads != 1:
            raise ValueError(f'indexer_kv_heads is {hf.indexer_kv_heads}: the QSA indexer has one key head')
        self.num_heads, self.head_dim, self.ratio = hf.indexer_n_heads, hf.indexer_head_dim, hf.indexer_compress_ratio
        self.block_top_k = hf.indexer_budget // self.ratio
        self.index_qk_proj = Linear(cfg.hidden_size, (self.num_heads + 1) * self.head_dim)
        self.q_layernorm = GemmaRMSNorm(self.head_dim, hf.rms_norm_eps)
        self.k_layernorm = GemmaRMSNorm(self.head_dim, hf.rms_norm_eps)

    def block_keys(self, keys: torch.Tensor, block_rope: BlockRope) -> torch.Tensor:
        """The normed and turned keys ``[len(keys) // ratio, D]`` of the complete blocks of ``keys [C, D]``."""
        pooled = self.k_layernorm(pooled_block_keys(keys, self.ratio)).unsqueeze(1)
        cos, sin = (table[:pooled.shape[0]] for table in block_rope)
        return apply_rope(pooled, cos, sin).squeeze(1)

    def forward(self, x: torch.Tensor, key_cache: torch.Tensor, ctx: StepContext,
                block_rope: BlockRope) -> TokenSelection:
        """Caches this step's raw keys and selects the keys of each query of ``x [T, hidden]``."""
        q, keys = self.index_qk_proj(x).split([self.num_heads * self.head_dim, self.head_dim], dim=-1)
        q = apply_rope(self.q_layernorm(q.unflatten(-1, (self.num_heads, self.head_dim))), ctx.cos, ctx.sin)
        fill_index_keys(keys, key_cache, ctx.kv_blocks, ctx.kv_offsets)
        num_prefill = ctx.num_prefill_tokens
        prefill = decode = None
        if ctx.prefill_q_len is not None:
            prefill = []
            for row, (start, length, context_len) in enumerate(zip(ctx.prefill_q_start.tolist(),
                                                                   ctx.prefill_q_len.tolist(),
                                                                   ctx.prefill_ctx_len.tolist())):
                blocks = self.block_keys(context_keys(key_cache, ctx.prefill_block_table[row], context_len),
                                         block_rope)
                q_pos = torch.arange(context_len - length, context_len, device=x.device)
                prefill.append(select_tokens(q[start:start + length], blocks, q_pos, context_len, self.ratio,
                                             self.block_top_k))
        if ctx.decode_blocks is not None:
            batch, num_blocks = ctx.decode_blocks.shape
            decode = torch.zeros(batch, num_blocks * key_cache.shape[1], dtype=torch.bool, device=x.device)
            for row, context_len in enumerate(ctx.decode_kv_lens.tolist()):
                blocks = self.block_keys(context_keys(key_cache, ctx.decode_blocks[row], context_len), block_rope)
                q_pos = torch.tensor([context_len - 1], device=x.device)
                decode[row, :context_len] = select_tokens(q[num_prefill + row:num_prefill + row + 1], blocks, q_pos,
                                                          context_len, self.ratio, self.block_top_k)[0]
        return TokenSelection(prefill, decode)


class QsaAttention(GatedAttention):
    """Qwen3.5's gated attention over the tokens its :class:`QsaIndexer` selects; its cache is K and V (and their
    scales), then the indexer's raw keys."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.indexer = QsaIndexer(cfg)

    def forward(self, x: torch.Tensor, kv_cache: KVCache, ctx: StepContext, block_rope: BlockRope) -> torch.Tensor:
        return super().forward(x, kv_cache[:-1], ctx, self.indexer(x, kv_cache[-1], ctx, block_rope))


class Qwen4ExpDecoderLayer(nn.Module):
    """PLE (on some linear-attention layers), then the mixer (:class:`GatedDeltaNet` or :class:`QsaAttention`) and
    the MoE block, each fed and injected by its :class:`HyperConnection`."""

    def __init__(self, cfg: ModelConfig, layer_index: int, mlp: nn.Module):
        super().__init__()
        hf = cfg.hf_config
        self.is_linear = hf.layer_types[layer_index] == LINEAR_ATTENTION
        if self.is_linear:
            self.linear_attn = GatedDeltaNet(cfg)
            self.linear_attn.norm.activation = OUTPUT_GATES[hf.output_gate_type or hf.hidden_act]
        else:
            self.self_attn = QsaAttention(cfg)
        ple_layers = hf.ple_layer_ids or []
        self.ple = PerLayerEmbedding(cfg, ple_layers.index(layer_index + 1)) if layer_index + 1 in ple_layers else None
        self.attn_hyper_connection = HyperConnection(cfg)
        self.mlp_hyper_connection = HyperConnection(cfg)
        self.mlp = mlp

    def state_shapes(self) -> list[tuple[tuple[int, ...], torch.dtype]] | None:
        """One slot's states: the Gated DeltaNet's, then PLE's; None for attention layers."""
        if not self.is_linear:
            return None
        return self.linear_attn.state_shapes() + (self.ple.state_shapes() if self.ple is not None else [])

    def forward(self, streams: torch.Tensor, input_ids: torch.Tensor, cache: tuple[torch.Tensor, ...],
                ctx: StepContext, block_rope: BlockRope) -> torch.Tensor:
        if self.ple is not None:
            streams = streams + self.ple(streams, input_ids, cache[2:], ctx)
        x, weights = self.attn_hyper_connection(streams)
        x = self.linear_attn(x, cache[:2], ctx) if self.is_linear else self.self_attn(x, cache, ctx, block_rope)
        streams = inject(streams, x, weights)
        x, weights = self.mlp_hyper_connection(streams)
        return inject(streams, self.mlp(x), weights)


class Qwen4ExpForCausalLM(WithoutNativeStack, MoEForCausalLM):
    """Qwen4-Exp's text decoder (see the module's docstring); every step runs the layers' own forward. Its final
    stream mixer, the checkpoints' ``hyper_connection_mixer``, is its ``norm``."""

    tensor_parallel_refusal = Qwen3NextForCausalLM.tensor_parallel_refusal
    recurrent_chunk = Qwen3NextForCausalLM.recurrent_chunk

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.streams = cfg.hf_config.hc_count
        self.index_ratio = cfg.hf_config.indexer_compress_ratio

    def make_layer(self, cfg: ModelConfig, layer_index: int) -> nn.Module:
        return Qwen4ExpDecoderLayer(cfg, layer_index, SparseMoeBlock(cfg))

    def make_norm(self, cfg: ModelConfig) -> nn.Module:
        return HyperConnection(cfg, inject=False)

    def forward(self, input_ids: torch.Tensor, kv_caches: list[KVCache], ctx: StepContext) -> torch.Tensor:
        ctx.cos, ctx.sin = self.rotary(ctx, self.cfg.dtype)
        longest = max(int(lens.max()) for lens in (ctx.prefill_ctx_len, ctx.decode_kv_lens) if lens is not None)
        starts = torch.arange(0, longest, self.index_ratio, device=input_ids.device)
        block_rope = self.rotary.at(starts, self.cfg.dtype)
        streams = self.embed(input_ids, ctx).repeat(1, self.streams)
        for layer, cache in zip(self.layers, kv_caches):
            streams = layer(streams, input_ids, cache, ctx, block_rope)
        return self.norm.mix(streams)[0]

    def weight_target(self, name: str) -> WeightTarget | None:
        if name.startswith(MTP_PREFIX) or ('.ple_embedding.' in name and not name.endswith('.weight')):
            return None  # the next-token-prediction layer; the n-gram hashes' constants, derived from the config
        owner, _, shard = name.removesuffix('.weight').rpartition('.ngram_embedding.')
        if owner:
            embedding = self.get_submodule(owner)
            return embedding.shard(int(shard.removeprefix('shard_'))), (f'{owner}.ngram_embedding', shard), None
        return super().weight_target(name.replace('hyper_connection_mixer.', 'norm.'))

    def split_fused(self, weights: Iterable[tuple[str, WeightSource]]) -> Iterator[tuple[str, WeightSource]]:
        """The language model's tensors (a ``Qwen4ExpForConditionalGeneration``'s under ``model.language_model.``, its
        vision tower's skipped)."""
        language_model = ((name.replace(LANGUAGE_MODEL_PREFIX, 'model.', 1), tensor) for name, tensor in weights
                          if not name.startswith(VISION_PREFIX))
        return super().split_fused(language_model)

    def recurrent_state_shapes(self) -> list[list[tuple[tuple[int, ...], torch.dtype]] | None]:
        """Per layer, one sequence's recurrent state (linear-attention layers) or None (KV-cache layers)."""
        return [layer.state_shapes() for layer in self.layers]
