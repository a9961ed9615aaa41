// One decoder layer of a small drafter in one native call (sgl_spec/specblock/fast_layer.py).
//
// A SpecBlock drafter forward runs one or two Llama layers over a few rows (a tree round's
// blocks, an extend's), attending to a workspace of cached context keys. Served as PyTorch ops
// that is ~20 calls a layer (norms, views, RoPE, the workspace copies, SDPA with a boolean
// mask, the residual adds), each of which costs more than its arithmetic at these sizes. This
// kernel does the whole layer: RMSNorm, the packed q/k/v product, neox RoPE, the new keys and
// values written into the workspace behind its visible columns, masked attention over the
// visible columns and the layer's own rows, the packed output projection and residual,
// RMSNorm, the packed gate/up product, SiLU-and-mul, the packed down projection and residual.
//
// Numerics: float32; the linear layers are ``packed_linear`` (linear.cpp), RoPE and SiLU as in
// ops.cpp. The attention sums in its own order (not SDPA's), so the layer equals the PyTorch
// one to float32 rounding; a drafter only proposes tokens the target verifies.

#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <vector>

#include "common.h"

namespace {

using sgl_spec_kernels::check_f32;
using sgl_spec_kernels::exp_clamped;
using sgl_spec_kernels::linear;
using sgl_spec_kernels::rms_row;
using sgl_spec_kernels::rms_rows;
using sgl_spec_kernels::rope_head;
using sgl_spec_kernels::silu;

struct Workspace {
  float* k;
  float* v;
  int64_t s0, s1, s2;  // strides of [bs, capacity, n_kv, hd] (unit inner)
};

typedef float vec16 __attribute__((vector_size(16 * sizeof(float))));
constexpr int64_t kLanes16 = 16;
constexpr int64_t kRowTile = 8;  // query rows whose scores share each loaded key chunk

inline vec16 load16(const float* p) {
  vec16 v;
  __builtin_memcpy(&v, p, sizeof(v));
  return v;
}

inline void store16(float* p, vec16 v) { __builtin_memcpy(p, &v, sizeof(v)); }

// Keys 0..cols-1 of request b, kv head g, transposed into kt [hd, padded] (padded: cols
// rounded up to 16, the pad zero): scores are then vertical multiply-adds over the columns.
void transpose_keys(const Workspace& ws, int64_t b, int64_t g, int64_t cols, int64_t padded,
                    int64_t hd, float* kt) {
  for (int64_t d = 0; d < hd; ++d) std::fill(kt + d * padded + cols, kt + (d + 1) * padded, 0.f);
  for (int64_t j = 0; j < cols; ++j) {
    const float* kr = ws.k + b * ws.s0 + j * ws.s1 + g * ws.s2;
    for (int64_t d = 0; d < hd; ++d) kt[d * padded + j] = kr[d];
  }
}

// scores[r, :] = q_r · kt for the ``count`` (<= kRowTile) query rows ``q[r]``, 16 columns at a
// time, each loaded key chunk used by every row.
__attribute__((optimize("fp-contract=fast"))) void tile_scores(
    const float* const* q, int64_t count, const float* kt, int64_t padded, int64_t hd,
    float* scores) {
  for (int64_t j = 0; j < padded; j += kLanes16) {
    vec16 acc[kRowTile];
    for (int64_t r = 0; r < kRowTile; ++r) acc[r] = vec16{};
    for (int64_t d = 0; d < hd; ++d) {
      const vec16 kv = load16(kt + d * padded + j);
      for (int64_t r = 0; r < count; ++r) acc[r] += q[r][d] * kv;
    }
    for (int64_t r = 0; r < count; ++r) store16(scores + r * padded + j, acc[r]);
  }
}

// Softmax of one query row's scores over its visible columns (mask row ``m``, column stride
// ``ms``) into ``p`` (0 where hidden); false when nothing is visible.
bool softmax_row(float* sc, const bool* m, int64_t ms, int64_t cols, float scale, float* p) {
  float best = -std::numeric_limits<float>::infinity();
  for (int64_t j = 0; j < cols; ++j) {
    sc[j] = m[j * ms] ? sc[j] * scale : -std::numeric_limits<float>::infinity();
    best = std::max(best, sc[j]);
  }
  if (best == -std::numeric_limits<float>::infinity()) return false;
  for (int64_t j = 0; j < cols; ++j) p[j] = exp_clamped(sc[j] - best);
  float total = 0.f;
  for (int64_t j = 0; j < cols; ++j) {
    p[j] = m[j * ms] ? p[j] : 0.f;
    total += p[j];
  }
  const float inv = 1.f / total;
  for (int64_t j = 0; j < cols; ++j) p[j] *= inv;
  return true;
}

// out[:hd] = sum_j p[j] v_j over the values of request b, kv head g (hd a multiple of 16).
__attribute__((optimize("fp-contract=fast"))) void weighted_values(
    const float* p, const Workspace& ws, int64_t b, int64_t g, int64_t cols, int64_t hd,
    float* out) {
  constexpr int64_t kMaxVecs = 16;  // head_dim up to 256
  vec16 acc[kMaxVecs];
  const int64_t vecs = hd / kLanes16;
  for (int64_t v = 0; v < vecs; ++v) acc[v] = vec16{};
  for (int64_t j = 0; j < cols; ++j) {
    if (p[j] == 0.f) continue;
    const float* vr = ws.v + b * ws.s0 + j * ws.s1 + g * ws.s2;
    for (int64_t v = 0; v < vecs; ++v) acc[v] += p[j] * load16(vr + v * kLanes16);
  }
  for (int64_t v = 0; v < vecs; ++v) store16(out + v * kLanes16, acc[v]);
}

at::Tensor drafter_layer(const at::Tensor& hidden, const at::Tensor& positions,
                         const at::Tensor& cos_sin, const at::Tensor& ln1, double eps1,
                         const at::Tensor& qkv_packed, int64_t q_width, int64_t kv_width,
                         const at::Tensor& o_packed, const at::Tensor& ln2, double eps2,
                         const at::Tensor& gate_up_packed, int64_t inter,
                         const at::Tensor& down_packed, at::Tensor& k_ws, at::Tensor& v_ws,
                         int64_t length, const at::Tensor& mask, double scaling) {
  check_f32(hidden, "hidden");
  check_f32(cos_sin, "cos_sin");
  check_f32(k_ws, "key workspace");
  check_f32(v_ws, "value workspace");
  TORCH_CHECK(hidden.dim() == 2 && hidden.is_contiguous(), "sgl_spec_native: hidden [rows, d]");
  const int64_t rows = hidden.size(0), d = hidden.size(1);
  TORCH_CHECK(k_ws.dim() == 4 && k_ws.sizes() == v_ws.sizes() && k_ws.strides() == v_ws.strides() &&
                  k_ws.stride(3) == 1,
              "sgl_spec_native: workspaces [bs, capacity, n_kv, hd], unit inner stride");
  const int64_t bs = k_ws.size(0), hd = k_ws.size(3), n_kv = k_ws.size(2);
  TORCH_CHECK(bs > 0 && rows % bs == 0, "sgl_spec_native: rows split evenly over the batch");
  const int64_t n = rows / bs, cols = length + n;
  TORCH_CHECK(length >= 0 && cols <= k_ws.size(1), "sgl_spec_native: workspace too small");
  TORCH_CHECK(kv_width == n_kv * hd && q_width % hd == 0 && (q_width / hd) % n_kv == 0 &&
                  hd % 16 == 0 && hd <= 256,
              "sgl_spec_native: head widths (head_dim a multiple of 16, at most 256)");
  const int64_t heads = q_width / hd, group = heads / n_kv;
  TORCH_CHECK(cos_sin.size(-1) == hd && cos_sin.stride(-1) == 1, "sgl_spec_native: rope table");
  TORCH_CHECK(mask.scalar_type() == at::kBool && mask.dim() == 4 &&
                  (mask.size(0) == 1 || mask.size(0) == bs) && mask.size(2) == n &&
                  mask.size(3) == cols,
              "sgl_spec_native: mask [bs|1, 1, n, length + n] bool");
  const at::Tensor pos = positions.reshape({-1}).to(at::kLong).contiguous();
  TORCH_CHECK(pos.numel() == rows, "sgl_spec_native: one position per row");
  const int64_t* pp = pos.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r)
    TORCH_CHECK(pp[r] >= 0 && pp[r] < cos_sin.size(0), "sgl_spec_native: position out of range");

  const float* xp = hidden.data_ptr<float>();
  at::Tensor normed = at::empty_like(hidden);
  rms_rows(xp, ln1.contiguous().data_ptr<float>(), normed.data_ptr<float>(), rows, d, eps1);
  at::Tensor qkv = linear(normed, qkv_packed, q_width + 2 * kv_width);
  float* qp = qkv.data_ptr<float>();
  const int64_t width = qkv.size(1);
  const float* table = cos_sin.data_ptr<float>();
  const Workspace ws{k_ws.data_ptr<float>(), v_ws.data_ptr<float>(), k_ws.stride(0),
                     k_ws.stride(1), k_ws.stride(2)};
  for (int64_t r = 0; r < rows; ++r) {  // RoPE, then the row's key and value into the workspace
    float* row = qp + r * width;
    const float* cos = table + pp[r] * cos_sin.stride(0);
    for (int64_t h = 0; h < heads + n_kv; ++h)  // q heads, then k heads: adjacent in the row
      rope_head(row + h * hd, row + h * hd, hd / 2, cos);
    const int64_t b = r / n, col = length + r % n;
    for (int64_t g = 0; g < n_kv; ++g) {
      std::copy_n(row + q_width + g * hd, hd, ws.k + b * ws.s0 + col * ws.s1 + g * ws.s2);
      std::copy_n(row + q_width + kv_width + g * hd, hd, ws.v + b * ws.s0 + col * ws.s1 + g * ws.s2);
    }
  }
  at::Tensor attn = at::empty({rows, q_width}, hidden.options());
  float* ap = attn.data_ptr<float>();
  const bool* mp = mask.data_ptr<bool>();
  const int64_t m0 = mask.size(0) == 1 ? 0 : mask.stride(0), m2 = mask.stride(2), m3 = mask.stride(3);
  const float scale = static_cast<float>(scaling);
  const int64_t padded = (cols + kLanes16 - 1) / kLanes16 * kLanes16;
  at::parallel_for(0, bs * n_kv, 1, [&](int64_t lo, int64_t hi) {
    std::vector<float> kt(hd * padded), scores(kRowTile * padded), probs(padded);
    for (int64_t t = lo; t < hi; ++t) {
      const int64_t b = t / n_kv, g = t % n_kv;
      transpose_keys(ws, b, g, cols, padded, hd, kt.data());
      for (int64_t u0 = 0; u0 < group * n; u0 += kRowTile) {  // u: (head in group, row)
        const int64_t count = std::min(kRowTile, group * n - u0);
        const float* q[kRowTile];
        for (int64_t u = 0; u < count; ++u) {
          const int64_t h = g * group + (u0 + u) / n, r = b * n + (u0 + u) % n;
          q[u] = qp + r * width + h * hd;
        }
        tile_scores(q, count, kt.data(), padded, hd, scores.data());
        for (int64_t u = 0; u < count; ++u) {
          const int64_t h = g * group + (u0 + u) / n, i = (u0 + u) % n, r = b * n + i;
          float* out = ap + r * q_width + h * hd;
          if (softmax_row(scores.data() + u * padded, mp + b * m0 + i * m2, m3, cols, scale,
                          probs.data()))
            weighted_values(probs.data(), ws, b, g, cols, hd, out);
          else
            std::fill_n(out, hd, 0.f);
        }
      }
    }
  });
  at::Tensor mid = linear(attn, o_packed, d);
  float* midp = mid.data_ptr<float>();
  for (int64_t i = 0; i < rows * d; ++i) midp[i] = xp[i] + midp[i];
  rms_rows(midp, ln2.contiguous().data_ptr<float>(), normed.data_ptr<float>(), rows, d, eps2);
  at::Tensor gate_up = linear(normed, gate_up_packed, 2 * inter);
  at::Tensor act = at::empty({rows, inter}, hidden.options());
  const float* gp = gate_up.data_ptr<float>();
  float* actp = act.data_ptr<float>();
  at::parallel_for(0, rows, 4, [&](int64_t lo, int64_t hi) {
    for (int64_t r = lo; r < hi; ++r) {
      const float* g = gp + r * 2 * inter;
      const float* u = g + inter;
      float* o = actp + r * inter;
      for (int64_t i = 0; i < inter; ++i) o[i] = silu(g[i]) * u[i];
    }
  });
  at::Tensor out = linear(act, down_packed, d);
  float* outp = out.data_ptr<float>();
  for (int64_t i = 0; i < rows * d; ++i) outp[i] = midp[i] + outp[i];
  return out;
}

// The first-layer input of a drafter forward, Eqs. (1)-(2) with prefix broadcast, per row r
// of ``cond``: c = cond[r] (a tree round: the drafter's own state) or cond[r] W_condᵀ (an
// extend: the target's features, ``cond_packed``), t = embed[ids[r]];
// out[r, k] = [rms(c) * cond_norm, rms(t) * token_norm] W_prefixᵀ + query[k] for each of the
// K position queries' terms.
at::Tensor drafter_fuse(const at::Tensor& cond, const at::Tensor& ids, const at::Tensor& embed,
                        const std::optional<at::Tensor>& cond_packed, int64_t d,
                        const at::Tensor& cond_norm, double cond_eps,
                        const at::Tensor& token_norm, double token_eps,
                        const at::Tensor& prefix_packed, const at::Tensor& query) {
  check_f32(cond, "cond");
  check_f32(embed, "embed");
  check_f32(query, "query");
  TORCH_CHECK(cond.dim() == 2 && cond.is_contiguous() && embed.dim() == 2 &&
                  embed.is_contiguous() && query.dim() == 2 && query.size(1) == d &&
                  query.is_contiguous(),
              "sgl_spec_native: drafter_fuse shapes");
  const int64_t rows = cond.size(0), dt = embed.size(1), k = query.size(0);
  const at::Tensor tok = ids.reshape({-1}).to(at::kLong).contiguous();
  TORCH_CHECK(tok.numel() == rows, "sgl_spec_native: one token per row");
  const int64_t* tp = tok.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r)
    TORCH_CHECK(tp[r] >= 0 && tp[r] < embed.size(0), "sgl_spec_native: token id out of range");
  const at::Tensor context = cond_packed.has_value() ? linear(cond, *cond_packed, d) : cond;
  TORCH_CHECK(context.size(1) == d, "sgl_spec_native: condition width");
  at::Tensor both = at::empty({rows, d + dt}, cond.options());
  float* bp = both.data_ptr<float>();
  const float* cp = context.data_ptr<float>();
  const float* ep = embed.data_ptr<float>();
  const float* cw = cond_norm.contiguous().data_ptr<float>();
  const float* tw = token_norm.contiguous().data_ptr<float>();
  for (int64_t r = 0; r < rows; ++r) {
    rms_row(cp + r * d, cw, bp + r * (d + dt), d, cond_eps);
    rms_row(ep + tp[r] * dt, tw, bp + r * (d + dt) + d, dt, token_eps);
  }
  const at::Tensor prefix = linear(both, prefix_packed, d);
  at::Tensor out = at::empty({rows, k, d}, cond.options());
  const float* pp = prefix.data_ptr<float>();
  const float* qp = query.data_ptr<float>();
  float* op = out.data_ptr<float>();
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < k; ++j)
      for (int64_t i = 0; i < d; ++i) op[(r * k + j) * d + i] = pp[r * d + i] + qp[j * d + i];
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(sgl_spec_native, m) {
  m.def("drafter_layer(Tensor hidden, Tensor positions, Tensor cos_sin, Tensor ln1, float eps1,"
        " Tensor qkv_packed, int q_width, int kv_width, Tensor o_packed, Tensor ln2, float eps2,"
        " Tensor gate_up_packed, int inter, Tensor down_packed, Tensor(a!) k_ws, Tensor(b!) v_ws,"
        " int length, Tensor mask, float scaling) -> Tensor");
  m.def("drafter_fuse(Tensor cond, Tensor ids, Tensor embed, Tensor? cond_packed, int d,"
        " Tensor cond_norm, float cond_eps, Tensor token_norm, float token_eps,"
        " Tensor prefix_packed, Tensor query) -> Tensor");
}

TORCH_LIBRARY_IMPL(sgl_spec_native, CPU, m) {
  m.impl("drafter_layer", &drafter_layer);
  m.impl("drafter_fuse", &drafter_fuse);
}
