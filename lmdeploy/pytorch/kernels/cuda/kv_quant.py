"""Writing and reading int8/int4 KV-cache rows in the Triton kernels (``kernels/kv_quant.py`` states the layout)."""
import triton
import triton.language as tl

from lmdeploy.pytorch.kernels.kv_quant import MIN_SCALE

_MIN_SCALE = tl.constexpr(MIN_SCALE)  # compiled kernels read only constexpr globals


@triton.jit
def quantize_store(x_ptr, cache_ptr, sz_ptr, d, dst, sz_dst, hvalid, head_dim, BITS: tl.constexpr):
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
def load_dequantized(cache_ptr, sz_ptr, rows, slots, row_mask, d, dmask, head_dim, BITS: tl.constexpr):
    """fp32 values of cache rows: ``rows`` are the rows' element offsets in the codes, ``slots`` their
    indices into the ``(scale, zero)`` pairs, both shaped to broadcast against ``d`` (the dimensions)."""
    mask = row_mask & dmask
    if BITS == 8:
        codes = tl.load(cache_ptr + rows + d, mask=mask, other=0)
    else:
        half = head_dim // 2
        codes = tl.load(cache_ptr + rows + d % half, mask=mask, other=0)
        codes = (codes >> ((d // half) * 4).to(tl.uint8)) & 15
    scale = tl.load(sz_ptr + slots * 2, mask=row_mask, other=0.0)
    zero = tl.load(sz_ptr + slots * 2 + 1, mask=row_mask, other=0.0)
    return codes.to(tl.float32) * scale + zero
