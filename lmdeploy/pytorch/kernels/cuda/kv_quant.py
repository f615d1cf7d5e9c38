"""Reading int8/int4 KV-cache rows in the Triton attention kernels (``kernels/kv_quant.py`` states the layout)."""
import triton
import triton.language as tl


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
