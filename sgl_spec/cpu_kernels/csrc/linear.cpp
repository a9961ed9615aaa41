// Native float32 CPU kernels for small-batch linear layers (sgl_spec.cpu_kernels), built into
// the same library as ops.cpp and registered in the same torch.ops.sgl_spec_native namespace.
//
// Numerics: each output is one float32 sum over its inputs in order, whatever the row count or
// the other rows of the call, so a verify row equals a decode row in these layers.

#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <optional>
#include <vector>

#include "common.h"

namespace {

using sgl_spec_kernels::check_f32;
using sgl_spec_kernels::dot;

// ---- small-batch linear layers (packed float32 weights) ---------------------------------
//
// y = x Wᵀ (+ bias) for the few rows of decode, verify and draft passes. MKL's GEMM spends
// 1.4-2.5x the 1-row time on 4-16 rows of a model's layers, where reading the weights once
// should bound the cost. Weights are packed once into panels of kOutBlock output features
// ([blocks, in, kOutBlock]); a task streams its panels from memory once and keeps a tile of
// up to kMaxTileRows rows' partial sums in vector registers, so one tile costs about one pass
// over the weights; further tiles pass over the same panels while they sit in L2. Each output is one float32 sum over the input features in order, with fused
// multiply-adds, whatever the row count: a row's result does not depend on the other rows.

// A panel is kOutBlock outputs, one vector register wide: a generic vector wider than the
// hardware's is kept in memory by the compiler, every accumulation a load and a store.
#if defined(__AVX512F__)
constexpr int64_t kOutBlock = 16;
constexpr int64_t kMaxTileRows = 16;  // 32 vector registers: rows x panels accumulators
inline constexpr int panels_for(int rows) { return rows <= 4 ? 4 : 2; }
#else
constexpr int64_t kOutBlock = 8;  // AVX2: 16 registers of 8 floats
constexpr int64_t kMaxTileRows = 6;  // 12 accumulators, 2 weight panels, the broadcast row value
// more panels for fewer rows measured slower here (1-4 rows: 1.2-2.8x), so always two
inline constexpr int panels_for(int) { return 2; }
#endif
typedef float vblock __attribute__((vector_size(kOutBlock * sizeof(float))));

at::Tensor pack_linear_weight(const at::Tensor& weight) {
  check_f32(weight, "weight");
  TORCH_CHECK(weight.dim() == 2, "sgl_spec_native: a linear weight is [out, in]");
  const at::Tensor w = weight.contiguous();
  const int64_t out = w.size(0), in = w.size(1), blocks = (out + kOutBlock - 1) / kOutBlock;
  at::Tensor packed = at::zeros({blocks, in, kOutBlock}, w.options());
  const float* wp = w.data_ptr<float>();
  float* pp = packed.data_ptr<float>();
  at::parallel_for(0, blocks, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t b = lo; b < hi; ++b)
      for (int64_t j = 0; j < std::min(kOutBlock, out - b * kOutBlock); ++j)
        for (int64_t i = 0; i < in; ++i)
          pp[(b * in + i) * kOutBlock + j] = wp[(b * kOutBlock + j) * in + i];
  });
  return packed;
}

// ROWS rows of x against panels first..first+count-1 (count <= PANELS).
template <int ROWS, int PANELS>
__attribute__((optimize("fp-contract=fast"))) void linear_tile(
    const float* x, const float* packed, const float* bias, float* y, int64_t in, int64_t out,
    int64_t first, int64_t count) {
  vblock acc[ROWS][PANELS];
  for (int r = 0; r < ROWS; ++r)
    for (int b = 0; b < PANELS; ++b) acc[r][b] = vblock{};
  const float* panel[PANELS];
  for (int b = 0; b < PANELS; ++b)  // a missing panel re-reads the last one; never stored
    panel[b] = packed + (first + std::min<int64_t>(b, count - 1)) * in * kOutBlock;
  for (int64_t i = 0; i < in; ++i) {
    vblock w[PANELS];
    for (int b = 0; b < PANELS; ++b) __builtin_memcpy(&w[b], panel[b] + i * kOutBlock, sizeof(vblock));
    for (int r = 0; r < ROWS; ++r) {
      const float xi = x[r * in + i];
      for (int b = 0; b < PANELS; ++b) acc[r][b] += xi * w[b];
    }
  }
  for (int b = 0; b < count; ++b) {
    const int64_t o0 = (first + b) * kOutBlock, n = std::min(kOutBlock, out - o0);
    for (int r = 0; r < ROWS; ++r) {
      float sums[kOutBlock];
      __builtin_memcpy(sums, &acc[r][b], sizeof(vblock));
      float* dst = y + r * out + o0;
      if (bias != nullptr)
        for (int64_t j = 0; j < n; ++j) dst[j] = sums[j] + bias[o0 + j];
      else
        std::copy_n(sums, n, dst);
    }
  }
}

// Rows r0.. of one tile (ROWS of them) against blocks first..first+count-1, PANELS at a time.
template <int ROWS>
void linear_tile_blocks(const float* x, const float* packed, const float* bias, float* y,
                        int64_t in, int64_t out, int64_t first, int64_t count) {
  constexpr int PANELS = panels_for(ROWS);
  for (int64_t b = 0; b < count; b += PANELS)
    linear_tile<ROWS, PANELS>(x, packed, bias, y, in, out, first + b,
                              std::min<int64_t>(PANELS, count - b));
}

// output blocks per task (64 outputs): its panels stay in L2 while every row tile passes over them
constexpr int64_t kTaskBlocks = 64 / kOutBlock;

// x [rows, in] contiguous; packed from pack_linear_weight of an [out, in] weight.
at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& packed, int64_t out,
                         const std::optional<at::Tensor>& bias) {
  check_f32(x, "x");
  check_f32(packed, "packed weight");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && packed.is_contiguous() && packed.dim() == 3 &&
                  packed.size(1) == x.size(1) && packed.size(2) == kOutBlock &&
                  packed.size(0) == (out + kOutBlock - 1) / kOutBlock,
              "sgl_spec_native: packed_linear shapes");
  at::Tensor b;
  if (bias.has_value()) {
    b = bias->contiguous();
    check_f32(b, "bias");
    TORCH_CHECK(b.numel() == out, "sgl_spec_native: one bias per output feature");
  }
  const int64_t rows = x.size(0), in = x.size(1), blocks = packed.size(0);
  at::Tensor y = at::empty({rows, out}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* pp = packed.data_ptr<float>();
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  const int64_t tasks = (blocks + kTaskBlocks - 1) / kTaskBlocks;
  at::parallel_for(0, tasks, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t t = lo; t < hi; ++t) {
      const int64_t first = t * kTaskBlocks, count = std::min(kTaskBlocks, blocks - first);
      for (int64_t r0 = 0; r0 < rows; r0 += kMaxTileRows) {
        const float* xs = xp + r0 * in;
        float* ys = yp + r0 * out;
        switch (std::min(kMaxTileRows, rows - r0)) {
#define SGL_SPEC_ROWS(R) \
  case R: linear_tile_blocks<R>(xs, pp, bp, ys, in, out, first, count); break;
          SGL_SPEC_ROWS(1) SGL_SPEC_ROWS(2) SGL_SPEC_ROWS(3) SGL_SPEC_ROWS(4) SGL_SPEC_ROWS(5)
          SGL_SPEC_ROWS(6)
#if defined(__AVX512F__)
          SGL_SPEC_ROWS(7) SGL_SPEC_ROWS(8) SGL_SPEC_ROWS(9) SGL_SPEC_ROWS(10) SGL_SPEC_ROWS(11)
          SGL_SPEC_ROWS(12) SGL_SPEC_ROWS(13) SGL_SPEC_ROWS(14) SGL_SPEC_ROWS(15) SGL_SPEC_ROWS(16)
#endif
#undef SGL_SPEC_ROWS
          default: TORCH_CHECK(false, "sgl_spec_native: row tile");
        }
      }
    }
  });
  return y;
}

// ---- gated LoRA (MTP_LORA's mask rows) ---------------------------------------------------
//
// y[row] += (x[row] Aᵀ) Bᵀ on the gated rows of every block of `width` rows (rows first_gated..
// width - 1 of each block, sgl_spec/mtp/sglang_lora.py), in one call: a [R, in] stacks the
// fused parts' down projections, bt [R, out] is Bᵀ with the scaling folded in. B is block
// diagonal (each part's rank rows reach only that part's outputs): spans [R, 2] gives the
// output range [lo, hi) row j of bt may be non-zero in, and only that range is multiplied.
// Rows outside the gate are never read or written. A thread takes its rows together, so each
// row of A and of bt is read once per thread, not once per gated row. The delta of a row is
// summed whole, then added, as the PyTorch path does.
void gated_lora_add(const at::Tensor& x, at::Tensor& y, const at::Tensor& a, const at::Tensor& bt,
                    const at::Tensor& spans, int64_t width, int64_t first_gated) {
  for (const at::Tensor* t : {&x, static_cast<const at::Tensor*>(&y), &a, &bt})
    check_f32(*t, "gated LoRA tensor");
  TORCH_CHECK(x.dim() == 2 && y.dim() == 2 && x.size(0) == y.size(0) && x.stride(1) == 1 &&
                  y.stride(1) == 1,
              "sgl_spec_native: gated_lora_add takes x [rows, in] and y [rows, out], unit inner "
              "stride");
  TORCH_CHECK(a.dim() == 2 && bt.dim() == 2 && a.is_contiguous() && bt.is_contiguous() &&
                  a.size(0) == bt.size(0) && a.size(1) == x.size(1) && bt.size(1) == y.size(1),
              "sgl_spec_native: gated_lora_add factors a [R, in], bt [R, out]");
  TORCH_CHECK(width > 0 && 0 <= first_gated && first_gated <= width && x.size(0) % width == 0,
              "sgl_spec_native: gated_lora_add needs 0 <= first_gated <= width and rows in "
              "blocks of width");
  const int64_t gated = width - first_gated, count = x.size(0) / width * gated;
  const int64_t rank = a.size(0), in = a.size(1), out = bt.size(1);
  TORCH_CHECK(spans.scalar_type() == at::kLong && spans.is_contiguous() && spans.dim() == 2 &&
                  spans.size(0) == rank && spans.size(1) == 2,
              "sgl_spec_native: gated_lora_add spans are int64 [R, 2]");
  const int64_t* sp = spans.data_ptr<int64_t>();
  for (int64_t j = 0; j < rank; ++j)
    TORCH_CHECK(0 <= sp[2 * j] && sp[2 * j] <= sp[2 * j + 1] && sp[2 * j + 1] <= out,
                "sgl_spec_native: gated_lora_add span out of range");
  const int64_t xs = x.stride(0), ys = y.stride(0);
  const float* xp = x.data_ptr<float>();
  const float* ap = a.data_ptr<float>();
  const float* bp = bt.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, count, 4, [&](int64_t lo, int64_t hi) {
    const int64_t n = hi - lo;
    std::vector<const float*> xr(n);
    std::vector<float*> yr(n);
    for (int64_t m = 0; m < n; ++m) {
      const int64_t row = (lo + m) / gated * width + first_gated + (lo + m) % gated;
      xr[m] = xp + row * xs;
      yr[m] = yp + row * ys;
    }
    std::vector<float> low(n * rank), delta(n * out, 0.f);
    for (int64_t j = 0; j < rank; ++j)
      for (int64_t m = 0; m < n; ++m) low[m * rank + j] = dot(ap + j * in, xr[m], in);
    for (int64_t j = 0; j < rank; ++j) {
      const float* b = bp + j * out;
      const int64_t o0 = sp[2 * j], o1 = sp[2 * j + 1];
      for (int64_t m = 0; m < n; ++m) {
        const float lj = low[m * rank + j];
        float* d = delta.data() + m * out;
        for (int64_t o = o0; o < o1; ++o) d[o] += lj * b[o];
      }
    }
    for (int64_t m = 0; m < n; ++m) {
      const float* d = delta.data() + m * out;
      for (int64_t o = 0; o < out; ++o) yr[m][o] += d[o];
    }
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(sgl_spec_native, m) {
  m.def("pack_linear_weight(Tensor weight) -> Tensor");
  m.def("packed_linear(Tensor x, Tensor packed, int out, Tensor? bias) -> Tensor");
  m.def("gated_lora_add(Tensor x, Tensor(a!) y, Tensor a, Tensor bt, Tensor spans, int width,"
      " int first_gated) -> ()");
}

// CPU kernels, not catch-all ones: an op with a CPU kernel can carry a fake (meta)
// implementation, which torch.compile needs to trace through it.
TORCH_LIBRARY_IMPL(sgl_spec_native, CPU, m) {
  m.impl("pack_linear_weight", &pack_linear_weight);
  m.impl("packed_linear", &packed_linear);
  m.impl("gated_lora_add", &gated_lora_add);
}
