// A drafter forward's heads in one native call (sgl_spec/specblock/fast_heads.py): the final
// RMSNorm, the packed LM head, each position's top candidates, the rank head. Float32; equal
// to the PyTorch modules to float32 rounding (a drafter only proposes tokens the target
// verifies).

#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <tuple>
#include <vector>

#include "common.h"

namespace {

using sgl_spec_kernels::check_f32;
using sgl_spec_kernels::dot;
using sgl_spec_kernels::linear;
using sgl_spec_kernels::rms_rows;
using sgl_spec_kernels::silu;

// The heads of a drafter forward and what a tree round reads of them, per row of ``hidden``:
// the final RMSNorm; the draft logits (the packed LM head); their top ``width`` draft ids,
// mapped to target ids by ``d2t``, with their log-probabilities, best first (ties by lower
// id); and, with a rank head, its bucket logits: the two-layer SiLU MLP over the normed state
// and the distribution summary psi(p) of specblock/rank.py (top-10 log-probabilities, the
// gaps from the top one to ranks 2, 3 and 5, the top probability, the entropy).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> drafter_heads(
    const at::Tensor& hidden, const at::Tensor& norm, double eps, const at::Tensor& lm_packed,
    int64_t vocab, const at::Tensor& d2t, int64_t width,
    const std::optional<at::Tensor>& rank_packed, const std::optional<at::Tensor>& rank_b1,
    int64_t rank_hidden, const std::optional<at::Tensor>& rank_w2,
    const std::optional<at::Tensor>& rank_b2) {
  check_f32(hidden, "hidden");
  TORCH_CHECK(hidden.dim() == 2 && hidden.is_contiguous(), "sgl_spec_native: hidden [rows, d]");
  TORCH_CHECK(d2t.scalar_type() == at::kLong && d2t.is_contiguous() && d2t.numel() == vocab,
              "sgl_spec_native: d2t holds one int64 target id per draft id");
  const int64_t rows = hidden.size(0), d = hidden.size(1), w = std::min(width, vocab);
  constexpr int64_t kTop = 10, kPsi = 15;
  const bool ranked = rank_packed.has_value();
  TORCH_CHECK(!ranked || (vocab >= kTop && rank_b1 && rank_w2 && rank_b2 &&
                          rank_w2->size(0) == 4 && rank_w2->size(1) == rank_hidden),
              "sgl_spec_native: rank head weights");
  at::Tensor normed = at::empty_like(hidden);
  rms_rows(hidden.data_ptr<float>(), norm.contiguous().data_ptr<float>(),
           normed.data_ptr<float>(), rows, d, eps);
  at::Tensor logits = linear(normed, lm_packed, vocab);
  at::Tensor top_ids = at::empty({rows, w}, d2t.options());
  at::Tensor top_lp = at::empty({rows, w}, hidden.options());
  at::Tensor features = ranked ? at::empty({rows, d + kPsi}, hidden.options()) : at::Tensor();
  const float* lp = logits.data_ptr<float>();
  const int64_t* map = d2t.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t lo, int64_t hi) {
    std::vector<int64_t> order(vocab);
    for (int64_t r = lo; r < hi; ++r) {
      const float* l = lp + r * vocab;
      const float best = *std::max_element(l, l + vocab);
      float total = 0.f;
      for (int64_t v = 0; v < vocab; ++v) total += std::exp(l[v] - best);
      const float lse = best + std::log(total);
      const int64_t keep = std::max(w, ranked ? kTop : int64_t{0});
      for (int64_t v = 0; v < vocab; ++v) order[v] = v;
      std::partial_sort(order.begin(), order.begin() + keep, order.end(),
                        [l](int64_t a, int64_t b) { return l[a] > l[b] || (l[a] == l[b] && a < b); });
      for (int64_t j = 0; j < w; ++j) {
        top_ids.data_ptr<int64_t>()[r * w + j] = map[order[j]];
        top_lp.data_ptr<float>()[r * w + j] = l[order[j]] - lse;
      }
      if (!ranked) continue;
      float* f = features.data_ptr<float>() + r * (d + kPsi);
      std::copy_n(normed.data_ptr<float>() + r * d, d, f);
      float* psi = f + d;
      const float tiny = std::numeric_limits<float>::min();
      for (int64_t j = 0; j < kTop; ++j)
        psi[j] = std::log(std::max(std::exp(l[order[j]] - lse), tiny));
      psi[10] = psi[0] - psi[1];
      psi[11] = psi[0] - psi[2];
      psi[12] = psi[0] - psi[4];
      psi[13] = std::exp(l[order[0]] - lse);
      float entropy = 0.f;
      for (int64_t v = 0; v < vocab; ++v) {
        const float p = std::exp(l[v] - lse);
        if (p > 0.f) entropy -= p * std::log(p);
      }
      psi[14] = entropy;
    }
  });
  at::Tensor rank = at::empty({rows, ranked ? 4 : 0}, hidden.options());
  if (ranked) {
    at::Tensor mid = linear(features, *rank_packed, rank_hidden);
    float* mp = mid.data_ptr<float>();
    const float* b1 = rank_b1->contiguous().data_ptr<float>();
    const at::Tensor w2t = rank_w2->contiguous();
    const float* w2 = w2t.data_ptr<float>();
    const float* b2 = rank_b2->contiguous().data_ptr<float>();
    float* rp = rank.data_ptr<float>();
    for (int64_t r = 0; r < rows; ++r) {
      float* a = mp + r * rank_hidden;
      for (int64_t i = 0; i < rank_hidden; ++i) a[i] = silu(a[i] + b1[i]);
      for (int64_t c = 0; c < 4; ++c) rp[r * 4 + c] = dot(a, w2 + c * rank_hidden, rank_hidden) + b2[c];
    }
  }
  return {logits, rank, top_ids, top_lp};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(sgl_spec_native, m) {
  m.def("drafter_heads(Tensor hidden, Tensor norm, float eps, Tensor lm_packed, int vocab,"
        " Tensor d2t, int width, Tensor? rank_packed, Tensor? rank_b1, int rank_hidden,"
        " Tensor? rank_w2, Tensor? rank_b2) -> (Tensor, Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(sgl_spec_native, CPU, m) { m.impl("drafter_heads", &drafter_heads); }
