"""Triton kernel writing a step's new K/V into their paged-cache slots (quantized when ``quant_policy``
is 8 or 4, as ``kernels/kv_quant.py`` describes)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from lmdeploy.pytorch.kernels.kv_quant import MIN_SCALE

_MIN_SCALE = tl.constexpr(MIN_SCALE)  # compiled kernels read only constexpr globals


@triton.jit
def _quantize_store(x_ptr, cache_ptr, sz_ptr, d, dst, sz_dst, hvalid, head_dim, BITS: tl.constexpr):
    """Quantizes rows ``x_ptr + h * stride + d`` (``d`` a ``[1, BLOCK_D]`` offset; the rows are loaded
    again per half for int4) and stores codes and ``(scale, min)``."""
    hmask = hvalid[:, None]
    dmask = d < head_dim
    mask = hmask & dmask
    x = tl.load(x_ptr + d, mask=mask, other=0.0).to(tl.float32)
    low = tl.min(tl.where(dmask, x, float('inf')), axis=1)
    high = tl.max(tl.where(dmask, x, float('-inf')), axis=1)
    top = (1 << BITS) - 1
    scale = tl.maximum((high - low) / top, _MIN_SCALE)
    inv = 1.0 / scale
    if BITS == 8:
        codes = tl.minimum(tl.floor((x - low[:, None]) * inv[:, None] + 0.5), top)
        tl.store(cache_ptr + dst + d, codes.to(tl.uint8), mask=mask)
    else:
        half = head_dim // 2
        hd = d % half
        first = hd == d
        lo = tl.load(x_ptr + hd, mask=hmask & first, other=0.0).to(tl.float32)
        hi = tl.load(x_ptr + hd + half, mask=hmask & first, other=0.0).to(tl.float32)
        lo = tl.minimum(tl.floor((lo - low[:, None]) * inv[:, None] + 0.5), top).to(tl.uint8)
        hi = tl.minimum(tl.floor((hi - low[:, None]) * inv[:, None] + 0.5), top).to(tl.uint8)
        tl.store(cache_ptr + dst + hd, lo | (hi << 4), mask=hmask & first)
    tl.store(sz_ptr + sz_dst, scale, mask=hvalid)
    tl.store(sz_ptr + sz_dst + 1, low, mask=hvalid)


@triton.jit
def _fill_kv_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, ksz_ptr, vsz_ptr, blocks_ptr, offsets_ptr, num_kv_heads, head_dim,
                    stride_kt, stride_kh, stride_vt, stride_vh,
                    stride_cb, stride_ch, stride_cs,
                    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BITS: tl.constexpr):
    tok = tl.program_id(0).to(tl.int64)
    block = tl.load(blocks_ptr + tok).to(tl.int64)
    offset = tl.load(offsets_ptr + tok).to(tl.int64)
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    if BITS == 0:
        mask = (h[:, None] < num_kv_heads) & (d[None, :] < head_dim)
        dst = block * stride_cb + offset * stride_cs + h[:, None] * stride_ch + d[None, :]
        k = tl.load(k_ptr + tok * stride_kt + h[:, None] * stride_kh + d[None, :], mask=mask)
        v = tl.load(v_ptr + tok * stride_vt + h[:, None] * stride_vh + d[None, :], mask=mask)
        tl.store(kc_ptr + dst, k, mask=mask)
        tl.store(vc_ptr + dst, v, mask=mask)
    else:
        hvalid = h < num_kv_heads
        dst = (block * stride_cb + offset * stride_cs + h * stride_ch)[:, None]
        # scales and zeros: [num_blocks, H_kv, block_size, 2], contiguous
        sz_dst = ((block * num_kv_heads + h) * (stride_ch // stride_cs) + offset) * 2
        _quantize_store(k_ptr + tok * stride_kt + h[:, None] * stride_kh, kc_ptr, ksz_ptr, d[None, :], dst, sz_dst,
                        hvalid, head_dim, BITS)
        _quantize_store(v_ptr + tok * stride_vt + h[:, None] * stride_vh, vc_ptr, vsz_ptr, d[None, :], dst, sz_dst,
                        hvalid, head_dim, BITS)


def fill_kv_cache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  blocks: torch.Tensor, offsets: torch.Tensor, k_scales_zeros: torch.Tensor | None = None,
                  v_scales_zeros: torch.Tensor | None = None, quant_policy: int = 0) -> None:
    """Writes ``k, v [T, H_kv, D]`` (last dim contiguous); token ``i`` goes to ``(blocks[i], offsets[i])``."""
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    _fill_kv_kernel[(num_tokens,)](k, v, k_cache, v_cache, k_scales_zeros, v_scales_zeros, blocks, offsets,
                                   num_kv_heads, head_dim, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                                   k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
                                   BLOCK_H=triton.next_power_of_2(num_kv_heads),
                                   BLOCK_D=triton.next_power_of_2(head_dim), BITS=quant_policy)
