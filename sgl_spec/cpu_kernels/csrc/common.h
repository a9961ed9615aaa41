// Helpers shared by the native CPU kernels' sources (ops.cpp, linear.cpp, drafter*.cpp).
#pragma once

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <optional>

namespace sgl_spec_kernels {

inline void check_f32(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kFloat, "sgl_spec_native: ", name, " must be float32");
  TORCH_CHECK(t.device().is_cpu(), "sgl_spec_native: ", name, " must be on CPU");
}

constexpr int kLanes = 16;

// Sum of a[i] * b[i] with kLanes independent partial sums (the compiler vectorises the lanes),
// folded pairwise.
inline float dot(const float* a, const float* b, int64_t n) {
  float acc[kLanes] = {0.f};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int j = 0; j < kLanes; ++j) acc[j] += a[i + j] * b[i + j];
  for (int w = kLanes / 2; w > 0; w /= 2)
    for (int j = 0; j < w; ++j) acc[j] += acc[j + w];
  float tail = 0.f;
  for (; i < n; ++i) tail += a[i] * b[i];
  return acc[0] + tail;
}

// exp(x) in plain float arithmetic the compiler vectorises (with -fno-trapping-math): x
// clamped to [-87, 88], a Cody-Waite reduction by ln 2 and Cephes' degree-6 polynomial;
// within a few ulp of expf where the result is a normal float.
__attribute__((always_inline)) inline float exp_clamped(float x) {
  x = std::min(std::max(x, -87.0f), 88.0f);
  // round(x / ln 2): the shifted value is positive, so truncation is floor
  const int32_t k = static_cast<int32_t>(x * 1.44269504088896341f + 128.5f) - 128;
  const float n = static_cast<float>(k);
  const float r = (x - n * 0.693359375f) - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = (p * (r * r) + r) + 1.0f;
  return p * std::bit_cast<float>((k + 127) << 23);
}

// Element ``i`` of a contiguous int32 or int64 index tensor.
inline int64_t index_at(const at::Tensor& t, int64_t i) {
  return t.scalar_type() == at::kInt ? static_cast<int64_t>(t.data_ptr<int32_t>()[i])
                                     : t.data_ptr<int64_t>()[i];
}

// cache[loc[t]] = src[t] for each row t of ``src`` ([rows, heads, dim], unit inner stride;
// ``cache`` [pool, heads, dim]): the new K/V of a decode, the KV stores of a forward. ``loc``
// may be any view (a draft step's column of a [bs, steps] slot table): read contiguously.
inline void write_rows(at::Tensor& cache, const at::Tensor& src, const at::Tensor& loc_view) {
  const int64_t rows = src.size(0), heads = src.size(1), dim = src.size(2);
  TORCH_CHECK(loc_view.numel() >= rows &&
                  (loc_view.scalar_type() == at::kInt || loc_view.scalar_type() == at::kLong),
              "sgl_spec_native: one int32/int64 KV row index per new token");
  const at::Tensor loc = loc_view.contiguous();
  const float* sp = src.data_ptr<float>();
  float* cp = cache.data_ptr<float>();
  for (int64_t t = 0; t < rows; ++t) {
    const int64_t row = index_at(loc, t);
    TORCH_CHECK(row >= 0 && row < cache.size(0), "sgl_spec_native: KV row out of range");
    for (int64_t h = 0; h < heads; ++h)
      std::copy_n(sp + t * src.stride(0) + h * src.stride(1), dim,
                  cp + row * cache.stride(0) + h * cache.stride(1));
  }
}

// silu(g) = g / (1 + exp(-g)), through exp_clamped (vectorisable; no overflow to inf).
__attribute__((always_inline)) inline float silu(float g) { return g / (1.f + exp_clamped(-g)); }

// y = x Wᵀ through sgl_spec_native::packed_linear (linear.cpp), W packed by
// pack_linear_weight: for kernels of one source that call another's.
inline at::Tensor linear(const at::Tensor& x, const at::Tensor& packed, int64_t out) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("sgl_spec_native::packed_linear", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&, int64_t,
                                         const std::optional<at::Tensor>&)>();
  return op.call(x, packed, out, std::nullopt);
}

// RMSNorm of one row of n floats: out[i] = (x[i] / rms(x)) * w[i] (out may be x).
inline void rms_row(const float* x, const float* w, float* out, int64_t n, float eps) {
  const float inv = 1.f / std::sqrt(dot(x, x, n) / static_cast<float>(n) + eps);
  for (int64_t i = 0; i < n; ++i) out[i] = (x[i] * inv) * w[i];
}

// rms_row over ``rows`` contiguous rows.
inline void rms_rows(const float* x, const float* w, float* out, int64_t rows, int64_t n, float eps) {
  for (int64_t r = 0; r < rows; ++r) rms_row(x + r * n, w, out + r * n, n, eps);
}

// neox RoPE of one head of 2 * half floats at ``a`` into ``o`` (o may be a); ``cos`` holds
// half cosines followed by half sines.
inline void rope_head(const float* a, float* o, int64_t half, const float* cos) {
  const float* sin = cos + half;
  for (int64_t i = 0; i < half; ++i) {
    const float x1 = a[i];
    const float x2 = a[i + half];
    o[i] = x1 * cos[i] + x2 * (-sin[i]);
    o[i + half] = x2 * cos[i] + x1 * sin[i];
  }
}

}  // namespace sgl_spec_kernels
