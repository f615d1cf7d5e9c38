"""Compute kernels behind one interface; the torch versions run everywhere and are the reference."""
from lmdeploy.pytorch.kernels.activation import silu_and_mul
from lmdeploy.pytorch.kernels.attention import decode_attention, fill_kv_cache, prefill_attention
from lmdeploy.pytorch.kernels.norm import rms_norm
from lmdeploy.pytorch.kernels.rotary import apply_rotary

__all__ = ['apply_rotary', 'decode_attention', 'fill_kv_cache', 'prefill_attention', 'rms_norm', 'silu_and_mul']
