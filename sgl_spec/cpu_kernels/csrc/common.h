// Helpers shared by the native CPU kernels' sources (ops.cpp, linear.cpp).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

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

}  // namespace sgl_spec_kernels
