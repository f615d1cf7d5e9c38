"""Llama-style decoder layers in one native call per step on the CPU (``kernels/cpu/decoder_stack.cpp``),
on projections in bf16 or W8A8 (each its own kernel's weight, see ``LinearKernel.native_projection``), a GGUF
file's Q4_K, Q5_K and Q6_K blocks, an AWQ or GPTQ checkpoint's grid (the native int4 GEMV; torch's int4 kernel where
it is not built), or a stacked layer's parts each on its own (``nn/quant/parts.py``); steps of a few tokens on the
4-bit copies of ``decode_int4``. A MoE family's sparse MLP runs as a ``MoEBlock`` (``kernels/cpu/moe_block.cpp``,
see ``SparseMoeBlock.native_moe``, and for DeepSeek-V3's routing (GLM-4.5's) and DeepSeek-V2's
``DeepseekV3MoE.native_moe``): its router, the routing and each routed expert on the kernel
its Python path calls; ERNIE 4.5 MoE's (``Ernie4_5MoE.native_moe``) routes ``biased_softmax``, Llama 4's
(``Llama4MoE.native_moe``) ``sigmoid_scaled_input``; gpt-oss's (``SparseMoeBlock`` with biases) has a biased router,
biased experts (bf16, or MXFP4 on ``Mxfp4Kernel``'s two paths) and the clamped SwiGLU, its attention ``sinks``.
DeepSeek-V3's layers attend by their ``mla`` (:func:`latent_attention`, ``kernels/cpu/mla_layer.cpp``) over the
latent cache instead of a ``qkv`` projection.

The call runs the kernels of the layers' own forward, in the same order, so its results are
identical; it only drops the Python between them, which in a 64-row decode step cost about 5 ms of
70 (the interpreter runs three times slower than on its own, on caches the kernels have just flushed).
"""
from __future__ import annotations

from types import ModuleType
from typing import Any

import torch

from lmdeploy.pytorch.distributed.parallel_state import current_group
from lmdeploy.pytorch.kernels import cpu
from lmdeploy.pytorch.nn.linear import Linear
from lmdeploy.pytorch.step_context import StepContext, small_step

# A layer's weights, by name (``native.LayerWeights``, see :func:`layer_weights`).
LayerWeights = Any


def native_projections(projections: dict[str, Linear], small_step: bool) -> dict[str, Any] | None:
    """Each of ``projections`` as its kernel's native projection (``small_step``: the one for steps of at most
    ``small_step_rows`` tokens); None when one runs on no native GEMM."""
    native = {name: (proj.kernel.small_step_projection if small_step else proj.kernel.native_projection)(proj.bias)
              for name, proj in projections.items()}
    return None if any(projection is None for projection in native.values()) else native


def layer_weights(input_norm: torch.Tensor | None, post_norm: torch.Tensor | None, projections: dict[str, Linear],
                  small_step: bool = False, **options: Any) -> LayerWeights | None:
    """A Llama-style layer's weights for the stack: its norms' weights (None for a ``post_norms_only`` layer, the
    post-norm None for a ``parallel_block`` one) and its ``qkv``, ``o``, ``gate_up`` and ``down`` projections
    (without the last two where ``options`` holds its ``moe`` block), each as its kernel's native projection
    (``small_step``: the one for steps of at most ``small_step_rows`` tokens); ``options`` are the other fields of
    ``LayerWeights`` by name (its other norms, ``rotary_dim``, ``interleaved_rope``, ``sliding_window``,
    ``attention_chunk``, ``scaled_queries``, ``qk_norm_across_heads``, ``qk_norm_after_rope``, ``qk_l2_norm_eps``,
    ``post_norms_only``, ``parallel_block``, ``layer_norm`` (with ``input_norm_bias``, ``post_norm_bias``),
    ``ungated_mlp`` (``gate_up`` then the up projection) and its ``xielu`` coefficients, ``sinks``,
    ``moe``; see ``kernels/cpu/decoder_stack.h``). None when a projection runs on no native GEMM."""
    native = native_projections(projections, small_step)
    return None if native is None else cpu.native().LayerWeights(input_norm=input_norm, post_norm=post_norm,
                                                                  **native, **options)


def latent_attention(projections: dict[str, Linear], small_step: bool = False, **options: Any) -> Any | None:
    """DeepSeek's multi-head latent attention for a layer's ``mla`` (``native.LatentAttention``): its ``q`` and (with
    q_lora_rank) ``q_a`` projections as :func:`layer_weights` takes them, ``options`` its other fields by name (the
    native ``kv_a`` projection, ``q_a_norm``, ``kv_a_norm``, ``kv_b``, its sizes, ``interleaved_rope``, ``scale``,
    ``norm_eps``; see ``kernels/cpu/decoder_stack.h``). None when a projection runs on no native GEMM."""
    native = native_projections(projections, small_step)
    return None if native is None else cpu.native().LatentAttention(**native, **options)


def linear_attention_weights(input_norm: torch.Tensor, post_norm: torch.Tensor, in_projections: list[Linear],
                             projections: dict[str, Linear], linear_attn: dict[str, Any],
                             **options: Any) -> LayerWeights | None:
    """A Gated DeltaNet layer's weights for the stack's decode-only steps (each projection's for small steps, which
    decode rows are): its ``in_projections`` (their outputs side by side as the layer's ``qkv``, each on its native
    GEMM), ``projections`` (``o``: its out_proj, and its MLP's) and ``linear_attn``, the fields of
    ``native.LinearAttention`` by name (see ``kernels/cpu/linear_attention.h``). None without the native delta rule
    (AVX-512) or where a projection runs on no native GEMM."""
    native = cpu.gated_delta()
    parts = [(proj.kernel.small_step_projection if proj.kernel.small_step_rows else proj.kernel.router_projection)(
        proj.bias) for proj in in_projections]
    if native is None or any(part is None for part in parts):
        return None
    return layer_weights(input_norm, post_norm, projections, small_step=True, qkv=native.Projection(parts=parts),
                         linear_attn=native.LinearAttention(**linear_attn), **options)


class NativeDecoderStack:
    """Every decoder layer of a model in one native call: small steps (decode rows in an engine step, else steps
    of at most ``small_step_rows`` tokens: see :func:`~lmdeploy.pytorch.step_context.small_step`) on the layers'
    small-step weights (``small``; without it those steps take the layers' Python forward), the others on their
    weights for any step (``large``); with ``decode_only`` (layers with linear attention) only steps whose every
    sequence has one new token."""

    def __init__(self, native: ModuleType, large: Any, small: Any | None, small_step_rows: int,
                 decode_only: bool = False):
        self.native = native
        self.large, self.small = large, small
        self.small_step_rows = small_step_rows
        self.decode_only = decode_only

    @classmethod
    def build(cls, layers: list[LayerWeights | None], small_layers: list[LayerWeights | None] | None,
              num_heads: int, num_kv_heads: int, head_dim: int, eps: float, scale: float, small_step_rows: int,
              quant_policy: int = 0, decode_only: bool = False) -> NativeDecoderStack | None:
        """The stack of ``layers`` (each from a layer's ``native_weights``: its projections are on native
        GEMM weights, so the native kernels are loaded) and, for steps of at most ``small_step_rows`` tokens,
        of ``small_layers`` (unless a layer cannot run in it); None when a layer of ``layers`` cannot run in
        it or the layers are tensor-parallel (the stack has no collectives). ``quant_policy`` is the KV
        cache's; ``decode_only``: see the class."""
        if current_group().world_size > 1 or any(weights is None for weights in layers):
            return None
        native = cpu.native()

        def stack(weights: list[LayerWeights]) -> Any:
            return native.DecoderStack(layers=weights, num_heads=num_heads, num_kv_heads=num_kv_heads,
                                       head_dim=head_dim, eps=eps, scale=scale, quant_policy=quant_policy)

        small = None
        if small_layers is not None and all(weights is not None for weights in small_layers):
            small = stack(small_layers)
        return cls(native, stack(layers), small, small_step_rows, decode_only)

    def runs(self, num_tokens: int, num_prefill_tokens: int = 0) -> bool:
        """Whether a step of ``num_tokens`` tokens, the first ``num_prefill_tokens`` of them prefill, runs in the
        stack."""
        if self.decode_only and num_prefill_tokens:
            return False
        return self.small is not None or not small_step(num_tokens, self.small_step_rows)

    def __call__(self, x: torch.Tensor, kv_caches: list[tuple[torch.Tensor, ...]], ctx: StepContext,
                 local_rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The embeddings ``x`` through every layer: ``(hidden states, residual)``; each layer's cache as
        :class:`~lmdeploy.pytorch.nn.attention.PagedAttention` takes it. ``local_rope``: the ``(cos, sin)``
        of the layers with ``local_rope`` (Gemma 3's local layers), the others turn by ``ctx``'s."""
        local_cos, local_sin = local_rope or (None, None)
        step = self.native.StepTensors(
            cos=ctx.cos, sin=ctx.sin, kv_blocks=ctx.kv_blocks, kv_offsets=ctx.kv_offsets,
            num_prefill_tokens=ctx.num_prefill_tokens, prefill_block_table=ctx.prefill_block_table,
            prefill_q_start=ctx.prefill_q_start, prefill_q_len=ctx.prefill_q_len, prefill_ctx_len=ctx.prefill_ctx_len,
            prefill_max_q_len=ctx.prefill_max_q_len, decode_blocks=ctx.decode_blocks,
            decode_kv_lens=ctx.decode_kv_lens, local_cos=local_cos, local_sin=local_sin,
            window_kv_blocks=ctx.window_kv_blocks, window_prefill_block_table=ctx.window_prefill_block_table,
            window_decode_blocks=ctx.window_decode_blocks, prefill_key_limit=ctx.prefill_key_limit,
            q_scale=ctx.q_scale, state_decode_slots=ctx.state_decode_slots)
        stack = self.small if small_step(x.shape[0], self.small_step_rows) else self.large
        return stack.forward(x, kv_caches, step)
