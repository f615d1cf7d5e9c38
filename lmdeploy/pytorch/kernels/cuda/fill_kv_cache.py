"""Triton kernel writing a step's new K/V into their paged-cache slots (quantized when ``quant_policy``
is 8 or 4, as ``kernels/kv_quant.py`` describes)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from lmdeploy.pytorch.kernels.cuda.kv_quant import quantize_store


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
        quantize_store(k_ptr + tok * stride_kt + h[:, None] * stride_kh, kc_ptr, ksz_ptr, d[None, :], dst, sz_dst,
                        hvalid, head_dim, BITS)
        quantize_store(v_ptr + tok * stride_vt + h[:, None] * stride_vh, vc_ptr, vsz_ptr, d[None, :], dst, sz_dst,
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
