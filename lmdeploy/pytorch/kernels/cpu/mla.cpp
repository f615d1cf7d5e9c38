// Multi-head latent attention over the paged latent cache [num_blocks, block_size, D] (kernels/mla.py):
// queries absorbed into the latent space attend like multi-query attention whose value is the first v_dim
// features of each cached row. Each task is one query row and a group of heads: every cached row it reads
// is widened to fp32 once for the group (dequantized, for an int8/int4 cache); scores, softmax and the
// weighted sum of latents are fp32.
#include "common.h"

namespace {

constexpr int64_t kHeadGroup = 8;

// The fp32 values of cached token `slot` (block * block_size + offset) of an int8/int4 latent cache: the
// latent's codes [:v_dim] then the rotary key's, each with its own (scale, zero) (kernels/mla.py).
template <int BITS>
struct LatentQuantRows {
  const uint8_t* codes;
  const float* scales_zeros;
  int64_t dim, v_dim;
  void operator()(int64_t slot, float* out) const {
    const uint8_t* row = codes + slot * dim * BITS / 8;
    const float* sz = scales_zeros + slot * 4;
    QuantRows<BITS>{row, sz, v_dim}(0, out);
    QuantRows<BITS>{row + v_dim * BITS / 8, sz + 2, dim - v_dim}(0, out + v_dim);
  }
};

// Query row `q` ([heads, dim]) over the first `n` tokens of the sequence whose blocks are `blocks`, whose
// cached rows `rows` widens to fp32; writes [heads, v_dim] to `out` (row stride `out_stride` between heads).
template <typename T, typename Rows>
void attend(const T* q, int64_t q_head_stride, int64_t heads, const Rows& rows, const int64_t* blocks, int64_t n,
            int64_t block_size, int64_t dim, int64_t v_dim, float scale, T* out, int64_t out_head_stride) {
  std::vector<float> qf(heads * dim), row(dim), scores(heads * n), acc(heads * v_dim, 0.f);
  for (int64_t h = 0; h < heads; ++h)
    for (int64_t d = 0; d < dim; ++d) qf[h * dim + d] = to_float(q[h * q_head_stride + d]) * scale;
  auto load = [&](int64_t t) { rows(blocks[t / block_size] * block_size + t % block_size, row.data()); };
  for (int64_t t = 0; t < n; ++t) {
    load(t);
    for (int64_t h = 0; h < heads; ++h) {
      const float* qh = qf.data() + h * dim;
      float s = 0.f;
#pragma omp simd reduction(+ : s)
      for (int64_t d = 0; d < dim; ++d) s += qh[d] * row[d];
      scores[h * n + t] = s;
    }
  }
  for (int64_t h = 0; h < heads; ++h) softmax(scores.data() + h * n, n);
  for (int64_t t = 0; t < n; ++t) {
    load(t);
    for (int64_t h = 0; h < heads; ++h) {
      const float p = scores[h * n + t];
      float* a = acc.data() + h * v_dim;
#pragma omp simd
      for (int64_t l = 0; l < v_dim; ++l) a[l] += p * row[l];
    }
  }
  for (int64_t h = 0; h < heads; ++h)
    for (int64_t l = 0; l < v_dim; ++l) out[h * out_head_stride + l] = from_float<T>(acc[h * v_dim + l]);
}

// Runs `rows` query rows of q [rows, H, D], row r over the first visible(r) tokens of sequence seq(r).
template <typename Visible, typename Seq>
torch::Tensor run_rows(torch::Tensor q, torch::Tensor cache, torch::Tensor block_table, int64_t v_dim, double scale,
                       const c10::optional<torch::Tensor>& scales_zeros, int64_t quant_policy, Visible visible,
                       Seq seq) {
  TORCH_CHECK(quant_policy == 0 || quant_policy == 4 || quant_policy == 8, "mla attention: quant_policy 0, 4 or 8");
  const int64_t bits = quant_policy ? quant_policy : 8;  // the width of a row's codes, not its dtype's
  TORCH_CHECK(q.dim() == 3 && cache.dim() == 3 && q.size(2) * bits / 8 == cache.size(2) && v_dim <= q.size(2),
              "mla attention: bad shapes");
  q = q.contiguous();
  torch::Tensor sz;
  if (quant_policy) {
    TORCH_CHECK(scales_zeros.has_value() && cache.scalar_type() == at::kByte, "mla attention: a quantized cache "
                "takes uint8 codes and scales_zeros");
    TORCH_CHECK(quant_policy == 8 || (v_dim % 2 == 0 && (q.size(2) - v_dim) % 2 == 0), "mla attention: odd int4 part");
    cache = cache.contiguous();
    sz = contiguous_as(*scales_zeros, at::kFloat);
    TORCH_CHECK(sz.numel() == cache.size(0) * cache.size(1) * 4, "mla attention: scales_zeros [blocks, size, 2, 2]");
  } else {
    cache = contiguous_as(cache, q.scalar_type());
  }
  block_table = contiguous_as(block_table, at::kLong);
  const int64_t rows = q.size(0), heads = q.size(1), dim = q.size(2), block_size = cache.size(1);
  const int64_t groups = (heads + kHeadGroup - 1) / kHeadGroup, width = block_table.size(1);
  auto out = torch::empty({rows, heads, v_dim}, q.options());
  const int64_t* table = block_table.data_ptr<int64_t>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "mla_attention", [&] {
    const scalar_t* qp = q.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    auto run = [&](const auto& cached) {
      at::parallel_for(0, rows * groups, 1, [&](int64_t begin, int64_t end) {
        for (int64_t task = begin; task < end; ++task) {
          const int64_t r = task / groups, h0 = (task % groups) * kHeadGroup;
          const int64_t n = visible(r);
          if (n <= 0) {
            for (int64_t h = h0; h < std::min(heads, h0 + kHeadGroup); ++h)
              std::fill_n(op + (r * heads + h) * v_dim, v_dim, scalar_t(0));
            continue;
          }
          attend(qp + (r * heads + h0) * dim, dim, std::min(kHeadGroup, heads - h0), cached, table + seq(r) * width,
                 n, block_size, dim, v_dim, static_cast<float>(scale), op + (r * heads + h0) * v_dim, v_dim);
        }
      });
    };
    if (quant_policy == 8) {
      run(LatentQuantRows<8>{cache.data_ptr<uint8_t>(), sz.data_ptr<float>(), dim, v_dim});
    } else if (quant_policy == 4) {
      run(LatentQuantRows<4>{cache.data_ptr<uint8_t>(), sz.data_ptr<float>(), dim, v_dim});
    } else {
      run(DenseRows<scalar_t>{cache.data_ptr<scalar_t>(), dim});
    }
  });
  return out;
}

}  // namespace

torch::Tensor mla_decode_attention(torch::Tensor q, torch::Tensor cache, torch::Tensor block_table,
                                   torch::Tensor kv_lens, double scale, int64_t v_dim,
                                   const c10::optional<torch::Tensor>& scales_zeros, int64_t quant_policy) {
  kv_lens = contiguous_as(kv_lens, at::kLong);
  const int64_t* lens = kv_lens.data_ptr<int64_t>();
  return run_rows(q, cache, block_table, v_dim, scale, scales_zeros, quant_policy, [&](int64_t r) { return lens[r]; },
                  [](int64_t r) { return r; });
}

torch::Tensor mla_prefill_attention(torch::Tensor q, const torch::Tensor& latent, torch::Tensor cache,
                                    torch::Tensor block_table, torch::Tensor q_start, torch::Tensor q_len,
                                    torch::Tensor ctx_len, int64_t max_q_len, double scale, int64_t v_dim,
                                    const c10::optional<torch::Tensor>& scales_zeros, int64_t quant_policy) {
  // Every chunk is already in the cache, so the fresh latents are not read.
  q_start = contiguous_as(q_start, at::kLong);
  q_len = contiguous_as(q_len, at::kLong);
  ctx_len = contiguous_as(ctx_len, at::kLong);
  std::vector<int64_t> seq_of(q.size(0), 0), visible(q.size(0), 0);
  for (int64_t s = 0; s < q_start.size(0); ++s) {
    const int64_t start = q_start.data_ptr<int64_t>()[s], length = q_len.data_ptr<int64_t>()[s];
    const int64_t prefix = ctx_len.data_ptr<int64_t>()[s] - length;
    for (int64_t i = 0; i < length; ++i) {
      seq_of[start + i] = s;
      visible[start + i] = prefix + i + 1;
    }
  }
  return run_rows(q, cache, block_table, v_dim, scale, scales_zeros, quant_policy,
                  [&](int64_t r) { return visible[r]; }, [&](int64_t r) { return seq_of[r]; });
}
