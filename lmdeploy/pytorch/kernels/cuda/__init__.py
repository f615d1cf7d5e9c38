"""Triton kernels for CUDA tensors; each mirrors the torch function of the same name in ``kernels/``
(``argmax`` is torch's own, already a fast CUDA kernel)."""
from lmdeploy.pytorch.kernels.cuda.decode_attention import decode_attention
from lmdeploy.pytorch.kernels.cuda.elementwise import apply_rotary, rms_norm, silu_and_mul
from lmdeploy.pytorch.kernels.cuda.fill_kv_cache import fill_kv_cache
from lmdeploy.pytorch.kernels.cuda.fused_moe import fused_moe, moe_routing
from lmdeploy.pytorch.kernels.cuda.gated_delta import gated_delta_decode
from lmdeploy.pytorch.kernels.cuda.mla import fill_latent_cache, mla_decode_attention, mla_prefill_attention
from lmdeploy.pytorch.kernels.cuda.prefill_attention import prefill_attention
from lmdeploy.pytorch.kernels.cuda.w8a8 import w8a8_linear
from lmdeploy.pytorch.kernels.sampling import argmax

__all__ = ['apply_rotary', 'argmax', 'decode_attention', 'fill_kv_cache', 'fused_moe', 'moe_routing',
           'prefill_attention', 'rms_norm', 'silu_and_mul', 'w8a8_linear', 'fill_latent_cache',
           'mla_decode_attention', 'mla_prefill_attention', 'gated_delta_decode']
