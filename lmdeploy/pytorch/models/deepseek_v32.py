"""DeepSeek-V3.2 (``DeepseekV32ForCausalLM``: V3.2-Exp, V3.2, V3.2-Speciale) and GLM-5 (``GlmMoeDsaForCausalLM``):
DeepSeek-V3's layers whose multi-head latent attention is sparse (DeepSeek Sparse Attention). Each layer's
lightning indexer scores every earlier token with keys of its own, which the paged cache holds beside the latent
(``ModelConfig.index_key_dim``), and each query attends only to its ``index_topk`` best tokens
(``kernels/dsa.py``). GLM-5 turns the indexer's rotary features in neighbouring pairs where V3.2 turns halves, and
its ``shared`` layers (``indexer_types``) have no indexer: they reuse the selection of the last layer with one."""
from __future__ import annotations

import torch
from torch import nn

from lmdeploy.pytorch.config import ModelConfig
from lmdeploy.pytorch.kernels.dsa import TokenSelection, decode_selection, fill_index_keys, prefill_selection
from lmdeploy.pytorch.models.deepseek_v3 import DeepseekV3Attention, DeepseekV3DecoderLayer, DeepseekV3ForCausalLM
from lmdeploy.pytorch.models.glm4_moe import Glm4MoeLiteForCausalLM
from lmdeploy.pytorch.models.llama import KVCache
from lmdeploy.pytorch.nn.linear import Linear
from lmdeploy.pytorch.nn.moe import Fp32Router
from lmdeploy.pytorch.nn.norm import LayerNorm
from lmdeploy.pytorch.nn.rotary import apply_rope
from lmdeploy.pytorch.step_context import StepContext

INDEXER_NORM_EPS = 1e-6  # the indexer's key LayerNorm (transformers' DeepseekV32Indexer.k_norm)


class DsaIndexer(nn.Module):
    """The lightning indexer: ``index_n_heads`` query heads from the attention's low-rank query, one key a token
    (``wk``, a LayerNorm with bias), rotary over the first ``qk_rope_head_dim`` features of each (in halves, or
    neighbouring pairs with ``interleaved_rope``), per-head weights from an fp32 projection of the layer's input.
    Every tensor-parallel rank runs all of it (it is small), so that each rank selects the same tokens."""

    def __init__(self, cfg: ModelConfig, interleaved_rope: bool):
        super().__init__()
        hf = cfg.hf_config
        self.num_heads, self.head_dim, self.top_k = hf.index_n_heads, hf.index_head_dim, hf.index_topk
        self.interleaved_rope = interleaved_rope
        self.wq_b = Linear(hf.q_lora_rank, self.num_heads * self.head_dim)
        self.wk = Linear(cfg.hidden_size, self.head_dim)
        self.k_norm = LayerNorm(self.head_dim, INDEXER_NORM_EPS, bias=True)
        self.weights_proj = Fp32Router(cfg.hidden_size, self.num_heads)  # fp32, as the checkpoints keep it
        self.scale = self.head_dim**-0.5

    def forward(self, x: torch.Tensor, q_lora: torch.Tensor, key_cache: torch.Tensor,
                ctx: StepContext) -> TokenSelection:
        """Caches this step's keys and selects the keys of each query of ``x [T, hidden]`` (``q_lora``: the
        attention's normed low-rank query ``[T, q_lora_rank]``)."""
        q = apply_rope(self.wq_b(q_lora).view(-1, self.num_heads, self.head_dim), ctx.cos, ctx.sin,
                       self.interleaved_rope)
        k = apply_rope(self.k_norm(self.wk(x)).unsqueeze(1), ctx.cos, ctx.sin, self.interleaved_rope).squeeze(1)
        fill_index_keys(k, key_cache, ctx.kv_blocks, ctx.kv_offsets)
        weights = self.weights_proj(x) * self.num_heads**-0.5
        num_prefill = ctx.num_prefill_tokens
        prefill = decode = None
        if ctx.prefill_q_len is not None:
            prefill = prefill_selection(q[:num_prefill], weights[:num_prefill], key_cache, ctx.prefill_block_table,
                                        ctx.prefill_q_start, ctx.prefill_q_len, ctx.prefill_ctx_len, self.top_k,
                                        self.scale)
        if ctx.decode_blocks is not None:
            decode = decode_selection(q[num_prefill:], weights[num_prefill:], key_cache, ctx.decode_blocks,
                                      ctx.decode_kv_lens, self.top_k, self.scale)
        return TokenSelection(prefill, decode)


class DsaAttention(DeepseekV3Attention):
    """DeepSeek-V3's latent attention over the tokens the layer's :class:`DsaIndexer` selects (or, without one,
    the tokens the last layer with one selected). Its cache is the latent's tensors, then the indexer's keys."""

    def __init__(self, cfg: ModelConfig, has_indexer: bool, interleaved_index_rope: bool):
        super().__init__(cfg)
        if not self.q_lora:
            raise ValueError('DeepSeek Sparse Attention needs q_lora_rank: its indexer reads the low-rank query')
        self.indexer = DsaIndexer(cfg, interleaved_index_rope) if has_indexer else None

    def native_attention(self, small_step: bool = False) -> None:
        """None: the native decoder stack has no sparse attention, so these layers never run in it."""
        return None

    def forward(self, x: torch.Tensor, kv_cache: KVCache, ctx: StepContext) -> torch.Tensor:
        q_lora, q_nope, q_rope, latent = self.queries_and_latent(x, ctx)
        if self.indexer is not None:
            ctx.token_selection = self.indexer(x, q_lora, kv_cache[-1], ctx)
        out = self.attn(q_nope, q_rope, latent, self.kv_b_proj.weight, kv_cache[:-1], ctx, ctx.token_selection)
        return self.o_proj(out)


class DeepseekV32ForCausalLM(DeepseekV3ForCausalLM):
    """DeepSeek-V3.2: DeepSeek-V3's model whose every layer's attention has an indexer turning its rotary
    features in halves; dense first ``first_k_dense_replace`` layers (as ``mlp_layer_types`` says)."""

    interleaved_index_rope = False
    make_mlp = Glm4MoeLiteForCausalLM.make_mlp  # dense or sparse per ``mlp_layer_types``

    def make_layer(self, cfg: ModelConfig, layer_index: int) -> nn.Module:
        attn = DsaAttention(cfg, self.has_indexer(cfg, layer_index), self.interleaved_index_rope)
        return DeepseekV3DecoderLayer(cfg, self.make_mlp(cfg, layer_index), attn)

    def has_indexer(self, cfg: ModelConfig, layer_index: int) -> bool:
        """Whether the layer selects its own tokens (every V3.2 layer does)."""
        return True


class GlmMoeDsaForCausalLM(DeepseekV32ForCausalLM):
    """GLM-5: DeepSeek-V3.2's model with the indexer's rotary features turned in neighbouring pairs; the layers
    ``indexer_types`` marks ``shared`` have no indexer and reuse the last full layer's selection."""

    interleaved_index_rope = True

    def has_indexer(self, cfg: ModelConfig, layer_index: int) -> bool:
        kinds = cfg.hf_config.indexer_types
        if kinds[0] != 'full':
            raise ValueError(f"indexer_types {kinds}: the first layer must be 'full' (a 'shared' layer reuses the "
                             'selection of a full layer before it)')
        return kinds[layer_index] == 'full'
