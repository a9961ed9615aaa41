// Native float32 CPU kernels for the per-layer ops of a served forward (sgl_spec.cpu_kernels).
//
// At decode sizes (one to a few rows of 512-4096 floats) a served forward spends more time in
// per-op overhead than in arithmetic: PyTorch's RMSNorm is five ATen calls, RoPE four per
// tensor, SiLU-and-mul four, a speculative step's KV slot table update a dozen. These kernels
// do each of those in one call (paged attention is in attention.cpp, linear layers in
// linear.cpp). They are registered under torch.ops.sgl_spec_native; the Python ops
// (layers.py, kvcache.py, spec_ops.py) call them for the cases they cover and keep their
// PyTorch path for the rest.
//
// Numerics: float32 throughout, one row at a time in the same order whatever the batch, so a
// row's result does not depend on what else shares the call. Built with -ffp-contract=off:
// the element-wise kernels (RoPE, the residual add) then round exactly as the PyTorch ops do;
// RMSNorm's mean square sums in a different order than ATen's, and SiLU's exp is our own
// polynomial (exp_clamped, through common.h's silu), so those two agree with ATen to float32
// rounding.

#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <tuple>
#include <vector>

#include "common.h"

namespace {

using sgl_spec_kernels::check_f32;
using sgl_spec_kernels::rms_row;
using sgl_spec_kernels::rope_head;
using sgl_spec_kernels::silu;
using sgl_spec_kernels::write_rows;

// ---- RMSNorm ---------------------------------------------------------------------------

at::Tensor rmsnorm(const at::Tensor& input, const at::Tensor& weight, double eps) {
  check_f32(input, "input");
  check_f32(weight, "weight");
  const int64_t n = input.size(-1);
  TORCH_CHECK(weight.numel() == n && weight.is_contiguous(), "sgl_spec_native: weight shape");
  at::Tensor x = input.contiguous();
  at::Tensor out = at::empty_like(x);
  const int64_t rows = n == 0 ? 0 : x.numel() / n;
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, rows, 64, [&](int64_t lo, int64_t hi) {
    for (int64_t r = lo; r < hi; ++r) rms_row(xp + r * n, wp, op + r * n, n, (float)eps);
  });
  return out;
}

// residual <- input + residual; input <- rmsnorm(residual). Both contiguous, in place.
void fused_add_rmsnorm(at::Tensor& input, at::Tensor& residual, const at::Tensor& weight,
                       double eps) {
  check_f32(input, "input");
  check_f32(residual, "residual");
  check_f32(weight, "weight");
  TORCH_CHECK(input.is_contiguous() && residual.is_contiguous(),
              "sgl_spec_native: fused_add_rmsnorm needs contiguous input and residual");
  TORCH_CHECK(input.numel() == residual.numel(), "sgl_spec_native: input/residual sizes");
  const int64_t n = input.size(-1);
  TORCH_CHECK(weight.numel() == n && weight.is_contiguous(), "sgl_spec_native: weight shape");
  const int64_t rows = n == 0 ? 0 : input.numel() / n;
  float* xp = input.data_ptr<float>();
  float* rp = residual.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  at::parallel_for(0, rows, 64, [&](int64_t lo, int64_t hi) {
    for (int64_t r = lo; r < hi; ++r) {
      float* x = xp + r * n;
      float* res = rp + r * n;
      for (int64_t i = 0; i < n; ++i) res[i] = x[i] + res[i];
      rms_row(res, wp, x, n, (float)eps);
    }
  });
}

// ---- KV rows ----------------------------------------------------------------------------

// cache.view(-1, row_dim)[indices[t]] = src[t]; src is [tokens, row_dim] with unit inner
// stride (a view of the fused QKV output).
void store_rows(const at::Tensor& src, at::Tensor& cache, const at::Tensor& indices) {
  check_f32(src, "src");
  check_f32(cache, "cache");
  TORCH_CHECK(src.dim() == 2 && src.stride(1) == 1 && cache.is_contiguous() &&
                  indices.numel() == src.size(0),
              "sgl_spec_native: store_rows layout");
  const int64_t row_dim = src.size(1);
  TORCH_CHECK(row_dim > 0 && cache.numel() % row_dim == 0, "sgl_spec_native: row_dim");
  at::Tensor rows = cache.view({-1, 1, row_dim});
  write_rows(rows, src.unsqueeze(1), indices);
}

// ---- RoPE (neox layout, rotary over the whole head) --------------------------------------

// ``x`` as [tokens, heads * head_size] rows with a row stride and unit inner stride.
at::Tensor rope_one(const at::Tensor& x, const int64_t* pos, const float* cache,
                    int64_t cache_stride, int64_t tokens, int64_t head_size) {
  TORCH_CHECK(x.stride(-1) == 1, "sgl_spec_native: rope needs a unit inner stride");
  const int64_t width = x.numel() / std::max<int64_t>(tokens, 1);
  TORCH_CHECK(width % head_size == 0, "sgl_spec_native: rope width");
  TORCH_CHECK(x.dim() == 2 || (x.dim() == 3 && x.stride(1) == head_size),
              "sgl_spec_native: rope needs [tokens, width] or [tokens, heads, head_size]");
  const int64_t row_stride = x.stride(0);
  at::Tensor out = at::empty(x.sizes(), x.options());
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t heads = width / head_size;
  const int64_t half = head_size / 2;
  at::parallel_for(0, tokens, 16, [&](int64_t lo, int64_t hi) {
    for (int64_t t = lo; t < hi; ++t) {
      const float* cos = cache + pos[t] * cache_stride;
      for (int64_t h = 0; h < heads; ++h)
        rope_head(xp + t * row_stride + h * head_size, op + t * width + h * head_size, half, cos);
    }
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor> rope_neox(const at::Tensor& positions, const at::Tensor& query,
                                             const at::Tensor& key, int64_t head_size,
                                             const at::Tensor& cos_sin_cache) {
  check_f32(query, "query");
  check_f32(key, "key");
  check_f32(cos_sin_cache, "cos_sin_cache");
  TORCH_CHECK(cos_sin_cache.size(-1) == head_size && cos_sin_cache.stride(-1) == 1,
              "sgl_spec_native: rope covers the whole head");
  at::Tensor pos = positions.reshape({-1}).to(at::kLong).contiguous();
  const int64_t tokens = pos.numel();
  const int64_t* pp = pos.data_ptr<int64_t>();
  const int64_t max_pos = cos_sin_cache.size(0);
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(pp[t] >= 0 && pp[t] < max_pos, "sgl_spec_native: position out of range");
  const float* cache = cos_sin_cache.data_ptr<float>();
  const int64_t cs = cos_sin_cache.stride(0);
  return {rope_one(query, pp, cache, cs, tokens, head_size),
          rope_one(key, pp, cache, cs, tokens, head_size)};
}

// ---- SiLU and multiply (the gated MLP's activation) ---------------------------------------

// out[t] = silu(x[t, :d]) * x[t, d:] for rows t of ``x`` [tokens, 2d] (unit inner stride),
// silu(g) = g / (1 + exp(-g)); element by element, so a row does not depend on the others.
at::Tensor silu_and_mul(const at::Tensor& input) {
  check_f32(input, "input");
  TORCH_CHECK(input.dim() >= 1 && input.stride(-1) == 1 && input.size(-1) % 2 == 0,
              "sgl_spec_native: silu_and_mul takes [..., 2d] with unit inner stride");
  const at::Tensor x = input.dim() == 2 ? input : input.reshape({-1, input.size(-1)});
  const int64_t rows = x.size(0), d = x.size(1) / 2, stride = x.stride(0);
  std::vector<int64_t> shape(input.sizes().begin(), input.sizes().end());
  shape.back() = d;
  at::Tensor out = at::empty(shape, input.options());
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, rows, 16, [&](int64_t lo, int64_t hi) {
    for (int64_t t = lo; t < hi; ++t) {
      const float* g = xp + t * stride;
      const float* u = g + d;
      float* o = op + t * d;
      for (int64_t i = 0; i < d; ++i) o[i] = silu(g[i]) * u[i];
    }
  });
  return out;
}

// ---- speculative bookkeeping ----------------------------------------------------------------

// req_to_token[req_pool_indices[i], start[i]:end[i]] = out_cache_loc[packed segment i]: the KV
// slots of each request's new tokens, segments packed in request order (spec_ops.py holds the
// PyTorch version).
void assign_req_to_token_pool(const at::Tensor& req_pool_indices, at::Tensor& req_to_token,
                              const at::Tensor& start_offset, const at::Tensor& end_offset,
                              const at::Tensor& out_cache_loc, int64_t pool_len) {
  TORCH_CHECK(req_to_token.is_contiguous() &&
                  (req_to_token.scalar_type() == at::kInt ||
                   req_to_token.scalar_type() == at::kLong),
              "sgl_spec_native: req_to_token is a contiguous int32/int64 table");
  const at::Tensor rpi = req_pool_indices.to(at::kLong).contiguous();
  const at::Tensor start = start_offset.to(at::kLong).contiguous();
  const at::Tensor end = end_offset.to(at::kLong).contiguous();
  const at::Tensor slots = out_cache_loc.to(at::kLong).contiguous();
  const int64_t bs = rpi.numel(), total = req_to_token.numel(), given = slots.numel();
  TORCH_CHECK(start.numel() >= bs && end.numel() >= bs, "sgl_spec_native: one segment per request");
  const int64_t* sp = slots.data_ptr<int64_t>();
  const bool i32 = req_to_token.scalar_type() == at::kInt;
  int64_t packed = 0;
  for (int64_t b = 0; b < bs; ++b) {
    const int64_t s = start.data_ptr<int64_t>()[b];
    const int64_t n = std::max<int64_t>(end.data_ptr<int64_t>()[b] - s, 0);
    const int64_t first = rpi.data_ptr<int64_t>()[b] * pool_len + s;
    TORCH_CHECK(first >= 0 && first + n <= total && packed + n <= given,
                "sgl_spec_native: KV slot table index out of range");
    if (i32) {
      int32_t* row = req_to_token.data_ptr<int32_t>() + first;
      for (int64_t j = 0; j < n; ++j) row[j] = static_cast<int32_t>(sp[packed + j]);
    } else {
      std::copy_n(sp + packed, n, req_to_token.data_ptr<int64_t>() + first);
    }
    packed += n;
  }
}

// Row src_loc[i] -> row tgt_loc[i] of every buffer, each given by its base address and row
// stride in bytes (SGLang's ``copy_all_layer_kv_cache`` contract; kvcache.py holds the PyTorch
// version). Each buffer's sources are all read before any of its targets is written, so an
// overlapping move (accepted tree tokens compacted to the front) copies the old rows.
void copy_kv_rows(const at::Tensor& data_ptrs, const at::Tensor& strides,
                  const at::Tensor& tgt_loc, const at::Tensor& src_loc) {
  const at::Tensor ptrs = data_ptrs.to(at::kLong).contiguous();
  const at::Tensor row_bytes = strides.to(at::kLong).contiguous();
  const at::Tensor tgt = tgt_loc.to(at::kLong).contiguous();
  const at::Tensor src = src_loc.to(at::kLong).contiguous();
  const int64_t buffers = ptrs.numel(), n = tgt.numel();
  TORCH_CHECK(row_bytes.numel() == buffers && src.numel() == n,
              "sgl_spec_native: copy_kv_rows needs one stride per buffer, one source per target");
  const int64_t* tp = tgt.data_ptr<int64_t>();
  const int64_t* sp = src.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(tp[i] >= 0 && sp[i] >= 0, "sgl_spec_native: copy_kv_rows location below 0");
  std::vector<uint8_t> staged;
  for (int64_t b = 0; b < buffers; ++b) {
    uint8_t* base = reinterpret_cast<uint8_t*>(ptrs.data_ptr<int64_t>()[b]);
    const int64_t stride = row_bytes.data_ptr<int64_t>()[b];
    TORCH_CHECK(stride > 0, "sgl_spec_native: copy_kv_rows row stride must be positive");
    staged.resize(static_cast<size_t>(n * stride));
    for (int64_t i = 0; i < n; ++i)
      std::copy_n(base + sp[i] * stride, stride, staged.data() + i * stride);
    for (int64_t i = 0; i < n; ++i)
      std::copy_n(staged.data() + i * stride, stride, base + tp[i] * stride);
  }
}

}  // namespace

TORCH_LIBRARY(sgl_spec_native, m) {
  m.def("rmsnorm(Tensor input, Tensor weight, float eps) -> Tensor");
  m.def("store_rows(Tensor src, Tensor(a!) cache, Tensor indices) -> ()");
  m.def("fused_add_rmsnorm(Tensor(a!) input, Tensor(b!) residual, Tensor weight, float eps) -> ()");
  m.def("rope_neox(Tensor positions, Tensor query, Tensor key, int head_size,"
      " Tensor cos_sin_cache) -> (Tensor, Tensor)");
  m.def("silu_and_mul(Tensor input) -> Tensor");
  m.def("assign_req_to_token_pool(Tensor req_pool_indices, Tensor(a!) req_to_token,"
      " Tensor start_offset, Tensor end_offset, Tensor out_cache_loc, int pool_len) -> ()");
  m.def("copy_kv_rows(Tensor data_ptrs, Tensor strides, Tensor tgt_loc, Tensor src_loc) -> ()");
}

// CPU kernels, not catch-all ones: an op with a CPU kernel can carry a fake (meta)
// implementation, which torch.compile needs to trace through it.
TORCH_LIBRARY_IMPL(sgl_spec_native, CPU, m) {
  m.impl("rmsnorm", &rmsnorm);
  m.impl("store_rows", &store_rows);
  m.impl("fused_add_rmsnorm", &fused_add_rmsnorm);
  m.impl("rope_neox", &rope_neox);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("assign_req_to_token_pool", &assign_req_to_token_pool);
  m.impl("copy_kv_rows", &copy_kv_rows);
}
