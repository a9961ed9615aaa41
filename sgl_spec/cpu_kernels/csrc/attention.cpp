// Native float32 paged attention for the CPU engine (sgl_spec.cpu_kernels): decodes and the
// short extends of verify and draft passes, as SGLang's IntelAMXAttnBackend calls them
// (attention.py, attention_native.py), plus the extend with its KV store in the same call
// (patches/cpu_attention_store.py). Part of the library of ops.cpp, registered in the same
// torch.ops.sgl_spec_native namespace.
//
// Numerics: float32; a query's dot products and softmax sum in a fixed order whatever the
// batch (chunks of kChunk keys merged in order), so a row's result does not depend on what
// else shares the call; they agree with ATen's attention to float32 rounding.

#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <limits>
#include <optional>
#include <vector>

#include "common.h"

namespace {

using sgl_spec_kernels::check_f32;
using sgl_spec_kernels::dot;
using sgl_spec_kernels::exp_clamped;
using sgl_spec_kernels::write_rows;

constexpr int64_t kChunk = 64;   // keys per attention task
constexpr int64_t kTransposeMin = 4;  // query rows per KV head from which keys are transposed

// Outputs held in vector registers across a loop: kBlock floats as kVecs vectors of 8, enough
// independent sums to hide the adder's latency (no fused multiply-adds: -ffp-contract=off),
// few enough not to spill (AVX2: 16 registers). Each output element still sums in order, so
// the block width never changes a result.
typedef float vec8 __attribute__((vector_size(8 * sizeof(float))));
constexpr int64_t kVecs = 8;
constexpr int64_t kBlock = 8 * kVecs;
static_assert(kChunk % kBlock == 0);

inline vec8 load8(const float* p) {
  vec8 v;
  __builtin_memcpy(&v, p, sizeof(v));
  return v;
}

inline void store8(float* p, vec8 v) { __builtin_memcpy(p, &v, sizeof(v)); }

// sc[j] = sum over d, in order, of q[d] * kt[d * kChunk + j], for j < kBlock: one query's dot
// products with kBlock keys of a transposed chunk.
inline void transposed_scores(const float* q, const float* kt, int64_t dim, float* sc) {
  vec8 s[kVecs] = {};
  for (int64_t d = 0; d < dim; ++d) {
    const vec8 qd = vec8{} + q[d];
    const float* kd = kt + d * kChunk;
    for (int64_t u = 0; u < kVecs; ++u) s[u] += qd * load8(kd + 8 * u);
  }
  for (int64_t u = 0; u < kVecs; ++u) store8(sc + 8 * u, s[u]);
}

// a[d0 + 8u + l] = sum over j < nk, in order, of p[j] * rows[j][d0 + 8u + l], for u < V.
template <int V>
inline void weighted_block(const float* p, const float* const* rows, int64_t nk, float* a,
                           int64_t d0) {
  vec8 t[V] = {};
  for (int64_t j = 0; j < nk; ++j) {
    const vec8 pj = vec8{} + p[j];
    const float* v = rows[j] + d0;
    for (int u = 0; u < V; ++u) t[u] += pj * load8(v + 8 * u);
  }
  for (int u = 0; u < V; ++u) store8(a + d0 + 8 * u, t[u]);
}

// a[d] = sum over j < nk, in order, of p[j] * rows[j][d]: a softmax chunk's weighted values.
inline void weighted_sum(const float* p, const float* const* rows, int64_t nk, float* a,
                         int64_t vdim) {
  int64_t d0 = 0;
  for (; d0 + kBlock <= vdim; d0 += kBlock) weighted_block<kVecs>(p, rows, nk, a, d0);
  for (; d0 + 8 <= vdim; d0 += 8) weighted_block<1>(p, rows, nk, a, d0);
  for (; d0 < vdim; ++d0) {
    float t = 0.f;
    for (int64_t j = 0; j < nk; ++j) t += p[j] * rows[j][d0];
    a[d0] = t;
  }
}

// GCC 12 and clang have __builtin_shufflevector; an older compiler transposes element-wise.
#if defined(__has_builtin)
#if __has_builtin(__builtin_shufflevector)
#define SGLSPEC_HAS_SHUFFLEVECTOR 1
#endif
#endif
#ifndef SGLSPEC_HAS_SHUFFLEVECTOR
#define SGLSPEC_HAS_SHUFFLEVECTOR 0
#endif

// kt[d * kChunk + j] = keys[j][d] for j < nk, d < dim (the rest of kt untouched): 8 x 8 tiles
// transposed in registers, the remainder one element at a time. A copy: no arithmetic.
inline void transpose_keys(const float* const* keys, int64_t nk, int64_t dim, float* kt) {
  int64_t j0 = 0;
#if SGLSPEC_HAS_SHUFFLEVECTOR
  for (; j0 + 8 <= nk; j0 += 8) {
    int64_t d0 = 0;
    for (; d0 + 8 <= dim; d0 += 8) {
      vec8 r[8];
      for (int u = 0; u < 8; ++u) r[u] = load8(keys[j0 + u] + d0);
      vec8 t[8], c[8];
      for (int u = 0; u < 8; u += 2) {  // pairs of rows interleaved
        t[u] = __builtin_shufflevector(r[u], r[u + 1], 0, 8, 1, 9, 4, 12, 5, 13);
        t[u + 1] = __builtin_shufflevector(r[u], r[u + 1], 2, 10, 3, 11, 6, 14, 7, 15);
      }
      for (int u = 0; u < 8; u += 4) {  // then pairs of pairs
        c[u] = __builtin_shufflevector(t[u], t[u + 2], 0, 1, 8, 9, 4, 5, 12, 13);
        c[u + 1] = __builtin_shufflevector(t[u], t[u + 2], 2, 3, 10, 11, 6, 7, 14, 15);
        c[u + 2] = __builtin_shufflevector(t[u + 1], t[u + 3], 0, 1, 8, 9, 4, 5, 12, 13);
        c[u + 3] = __builtin_shufflevector(t[u + 1], t[u + 3], 2, 3, 10, 11, 6, 7, 14, 15);
      }
      // c[u] holds dims d0+u and d0+u+4 of rows j0..j0+3 (c[0..3]) or j0+4..j0+7 (c[4..7])
      for (int u = 0; u < 4; ++u) {
        store8(kt + (d0 + u) * kChunk + j0,
               __builtin_shufflevector(c[u], c[u + 4], 0, 1, 2, 3, 8, 9, 10, 11));
        store8(kt + (d0 + u + 4) * kChunk + j0,
               __builtin_shufflevector(c[u], c[u + 4], 4, 5, 6, 7, 12, 13, 14, 15));
      }
    }
    for (; d0 < dim; ++d0)
      for (int64_t j = j0; j < j0 + 8; ++j) kt[d0 * kChunk + j] = keys[j][d0];
  }
#endif
  for (int64_t j = j0; j < nk; ++j)
    for (int64_t d = 0; d < dim; ++d) kt[d * kChunk + j] = keys[j][d];
}

// max over j < n of x[j] where vis[j] != 0 (-inf if none), NaN scores skipped as std::max
// skips them. Max is exact, so lanes of 8 give the sequential loop's value (up to the sign of
// a zero maximum, which no output sees: x - (+0) and x - (-0) agree but for x = -0, whose
// exp is 1 either way); a running max kept in one scalar was a loop-carried chain through
// memory, most of a short extend's time.
inline float visible_max(const float* x, const float* vis, int64_t n) {
  const float neg_inf = -std::numeric_limits<float>::infinity();
  const vec8 none = vec8{} + neg_inf;
  vec8 m8 = none;
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    const vec8 c = load8(vis + j) != 0.f ? load8(x + j) : none;
    m8 = m8 < c ? c : m8;
  }
  float m = neg_inf;
  for (int u = 0; u < 8; ++u) m = std::max(m, m8[u]);
  for (; j < n; ++j)
    if (vis[j] != 0.f) m = std::max(m, x[j]);
  return m;
}

// out[j] = head ``hk``'s part of key or value row j, whose offset is ``ext_offset`` in an extend
// row and ``pool_offset`` in a pool row: the same for every query of a chunk.
inline void head_rows(const float* const* rows, const bool* ext, int64_t nk, int64_t ext_offset,
                      int64_t pool_offset, const float** out) {
  for (int64_t j = 0; j < nk; ++j) out[j] = rows[j] + (ext[j] ? ext_offset : pool_offset);
}

enum class Visible { kCausal, kAll, kTree };

// One request: queries q0..q0+n-1 (rows of q and o) at positions prefix..prefix+n-1; keys at
// positions [key_start, len), read from the pool through ``row_map`` or, for positions >=
// prefix when extend K/V are given, from extend rows q0.. .
struct Req {
  int64_t q0, n, prefix, len, key_start;
  int64_t chunk0;  // first chunk (task) of this request
  int64_t part0;   // first softmax partial
  int64_t tree0;   // offset of its [n, n] tree mask
  const char* row_map;
  int64_t chunks() const { return (len - key_start + kChunk - 1) / kChunk; }
};

struct Problem {
  const float* q;
  int64_t qs0, qs1;
  float* o;
  int64_t os0, os1;
  const float *kbuf, *vbuf;
  int64_t ks0, ks1, vs0, vs1, pool;
  const float *kext = nullptr, *vext = nullptr;  // null: extend keys come from the pool
  int64_t kes0 = 0, kes1 = 0, ves0 = 0, ves1 = 0;
  bool i32;
  int64_t heads, group, dim, vdim;
  float scale, vscale, cap;
  int64_t window;
  const float* sink = nullptr;
  Visible visible = Visible::kCausal;
  const uint8_t* tree = nullptr;  // per request [n, n]: query row, extend key column
};

// Keys are split into chunks of kChunk positions, each a task (so one request still uses
// every thread); a task streams whole pool rows (all KV heads at once, which the hardware
// prefetcher follows) and keeps a softmax partial per (query, head); partials merge in chunk
// order. Chunking depends only on the request's lengths, so a row's result does not depend on
// the batch or the thread count.
void paged_attention(const Problem& P, std::vector<Req>& reqs) {
  const int64_t H = P.heads;
  const int64_t kv_heads = H / P.group;
  int64_t chunks = 0, parts = 0, queries = 0;
  for (Req& r : reqs) {
    r.chunk0 = chunks;
    r.part0 = parts;
    chunks += r.chunks();
    parts += r.chunks() * r.n * H;
    queries += r.n;
  }
  std::vector<int64_t> chunk_req(chunks), query_req(queries), query_idx(queries);
  for (size_t k = 0, qn = 0; k < reqs.size(); ++k) {
    std::fill_n(chunk_req.begin() + reqs[k].chunk0, reqs[k].chunks(), (int64_t)k);
    for (int64_t i = 0; i < reqs[k].n; ++i, ++qn) {
      query_req[qn] = k;
      query_idx[qn] = i;
    }
  }
  const float neg_inf = -std::numeric_limits<float>::infinity();
  std::vector<float> part_max(parts, neg_inf), part_den(parts, 0.f);
  std::vector<float> part_acc(parts * P.vdim, 0.f);

  at::parallel_for(0, chunks, 1, [&](int64_t lo, int64_t hi) {
    const float* krows[kChunk];
    const float* vrows[kChunk];
    const float* vhead[kChunk];
    const float* khead[kChunk];
    bool ext_key[kChunk];
    std::vector<float> scores, kt;
    std::vector<float> vis;  // 1 where the (query, key) pair is visible, else 0
    for (int64_t c = lo; c < hi; ++c) {
      const Req& r = reqs[chunk_req[c]];
      const int64_t p0 = r.key_start + (c - r.chunk0) * kChunk;
      const int64_t nk = std::min<int64_t>(kChunk, r.len - p0);
      for (int64_t j = 0; j < nk; ++j) {
        const int64_t kpos = p0 + j;
        ext_key[j] = P.kext != nullptr && kpos >= r.prefix;
        if (ext_key[j]) {
          const int64_t e = r.q0 + (kpos - r.prefix);
          krows[j] = P.kext + e * P.kes0;
          vrows[j] = P.vext + e * P.ves0;
        } else {
          const int64_t row = P.i32 ? reinterpret_cast<const int32_t*>(r.row_map)[kpos]
                                    : reinterpret_cast<const int64_t*>(r.row_map)[kpos];
          TORCH_CHECK(row >= 0 && row < P.pool, "sgl_spec_native: KV row out of range");
          krows[j] = P.kbuf + row * P.ks0;
          vrows[j] = P.vbuf + row * P.vs0;
        }
      }
      // which (query, key) pairs are visible: the same for every head; padding keys are not
      vis.assign(r.n * kChunk, 0.f);
      for (int64_t i = 0; i < r.n; ++i) {
        const int64_t qpos = r.prefix + i;
        for (int64_t j = 0; j < nk; ++j) {
          const int64_t kpos = p0 + j;
          bool v = P.window <= 0 || qpos - kpos < P.window;
          if (v && kpos >= r.prefix) {
            const int64_t e = kpos - r.prefix;
            if (P.visible == Visible::kCausal) v = e <= i;
            else if (P.visible == Visible::kTree) v = P.tree[r.tree0 + i * r.n + e] != 0;
          }
          vis[i * kChunk + j] = v ? 1.f : 0.f;
        }
      }
      scores.assign(r.n * H * kChunk, 0.f);
      const int64_t part = r.part0 + (c - r.chunk0) * r.n * H;
      float* mx = part_max.data() + part;
      float* den = part_den.data() + part;
      float* acc = part_acc.data() + part * P.vdim;
      // scores. With few query rows per KV head (a decode) one dot product per key; with
      // more, per KV head the chunk's keys transposed ([dim][kChunk], zero padded), so each
      // query's kChunk dot products are vector multiply-adds over keys, with no horizontal sums.
      const bool transpose = r.n * P.group >= kTransposeMin;
      if (transpose) kt.assign(P.dim * kChunk, 0.f);
      for (int64_t hk = 0; hk < kv_heads; ++hk) {
        head_rows(krows, ext_key, nk, hk * P.kes1, hk * P.ks1, khead);
        if (transpose) transpose_keys(khead, nk, P.dim, kt.data());
        for (int64_t i = 0; i < r.n; ++i) {
          const float* qrow = P.q + (r.q0 + i) * P.qs0;
          const float* vrow = vis.data() + i * kChunk;
          for (int64_t h = hk * P.group; h < (hk + 1) * P.group; ++h) {
            float sc[kChunk] = {0.f};
            const float* q = qrow + h * P.qs1;
            if (transpose) {
              for (int64_t j0 = 0; j0 < nk; j0 += kBlock)
                transposed_scores(q, kt.data() + j0, P.dim, sc + j0);
            } else {
              for (int64_t j = 0; j < nk; ++j)
                sc[j] = dot(q, khead[j], P.dim);
            }
            float* out = scores.data() + (i * H + h) * kChunk;
            if (P.cap > 0.f) {
              for (int64_t j = 0; j < nk; ++j) out[j] = P.cap * std::tanh(sc[j] * P.scale / P.cap);
            } else {
              for (int64_t j = 0; j < nk; ++j) out[j] = sc[j] * P.scale;
            }
            mx[i * H + h] = visible_max(out, vrow, nk);
          }
        }
      }
      for (int64_t hk = 0; hk < kv_heads; ++hk) {
        head_rows(vrows, ext_key, nk, hk * P.ves1, hk * P.vs1, vhead);
        for (int64_t i = 0; i < r.n; ++i) {
          for (int64_t h = hk * P.group; h < (hk + 1) * P.group; ++h) {
            float* p = scores.data() + (i * H + h) * kChunk;
            const float m = mx[i * H + h];
            const float* vrow = vis.data() + i * kChunk;
            for (int64_t j = 0; j < kChunk; ++j) {
              p[j] = exp_clamped(std::min(p[j] - m, 0.f)) * vrow[j];
            }
            float sum = 0.f;
            for (int64_t j = 0; j < nk; ++j) sum += p[j];
            den[i * H + h] = sum;
            weighted_sum(p, vhead, nk, acc + (i * H + h) * P.vdim, P.vdim);
          }
        }
      }
    }
  });

  // each (query, head): its chunks' partials in order, and the attention sink (a logit
  // without a value); a query that sees no key gets NaN, as the PyTorch path does
  at::parallel_for(0, queries * H, 16, [&](int64_t lo, int64_t hi) {
    for (int64_t task = lo; task < hi; ++task) {
      const int64_t qn = task / H, h = task % H;
      const Req& r = reqs[query_req[qn]];
      const int64_t i = query_idx[qn];
      float m = P.sink != nullptr ? P.sink[h] : neg_inf;
      for (int64_t c = 0; c < r.chunks(); ++c)
        m = std::max(m, part_max[r.part0 + (c * r.n + i) * H + h]);
      float denom = P.sink != nullptr ? std::exp(P.sink[h] - m) : 0.f;
      float* o = P.o + (r.q0 + i) * P.os0 + h * P.os1;
      std::fill(o, o + P.vdim, 0.f);
      for (int64_t c = 0; c < r.chunks(); ++c) {
        const int64_t k = r.part0 + (c * r.n + i) * H + h;
        if (part_max[k] == neg_inf) continue;  // nothing visible in this chunk
        const float w = std::exp(part_max[k] - m);
        denom += w * part_den[k];
        const float* a = part_acc.data() + k * P.vdim;
        for (int64_t d = 0; d < P.vdim; ++d) o[d] += w * a[d];
      }
      const float inv = P.vscale / denom;
      for (int64_t d = 0; d < P.vdim; ++d) o[d] *= inv;
    }
  });
}

Problem make_problem(const at::Tensor& q, const at::Tensor& o, const at::Tensor& k_buf,
                     const at::Tensor& v_buf, const at::Tensor& req_to_token, double sm_scale,
                     double key_scale, double value_scale, double logit_cap, int64_t window,
                     const std::optional<at::Tensor>& sinks, at::Tensor& sinks_f) {
  for (const auto* t : {&q, &o, &k_buf, &v_buf}) {
    check_f32(*t, "attention tensor");
    TORCH_CHECK(t->dim() == 3 && t->stride(2) == 1,
                "sgl_spec_native: attention tensors are [rows, heads, dim], unit inner stride");
  }
  TORCH_CHECK(req_to_token.dim() == 2 && req_to_token.stride(1) == 1 &&
                  (req_to_token.scalar_type() == at::kInt ||
                   req_to_token.scalar_type() == at::kLong),
              "sgl_spec_native: req_to_token is [rows, context] int32/int64");
  Problem P;
  P.q = q.data_ptr<float>();
  P.qs0 = q.stride(0);
  P.qs1 = q.stride(1);
  P.o = const_cast<float*>(o.data_ptr<float>());
  P.os0 = o.stride(0);
  P.os1 = o.stride(1);
  P.kbuf = k_buf.data_ptr<float>();
  P.vbuf = v_buf.data_ptr<float>();
  P.ks0 = k_buf.stride(0);
  P.ks1 = k_buf.stride(1);
  P.vs0 = v_buf.stride(0);
  P.vs1 = v_buf.stride(1);
  P.pool = std::min(k_buf.size(0), v_buf.size(0));
  P.i32 = req_to_token.scalar_type() == at::kInt;
  P.heads = q.size(1);
  const int64_t kv_heads = k_buf.size(1);
  TORCH_CHECK(kv_heads > 0 && P.heads % kv_heads == 0 && v_buf.size(1) == kv_heads &&
                  o.size(1) == P.heads && k_buf.size(2) == q.size(2) && o.size(2) == v_buf.size(2),
              "sgl_spec_native: attention head counts / dims disagree");
  P.group = P.heads / kv_heads;
  P.dim = q.size(2);
  P.vdim = v_buf.size(2);
  P.scale = static_cast<float>(sm_scale * key_scale);
  P.vscale = static_cast<float>(value_scale);
  P.cap = static_cast<float>(logit_cap);
  P.window = window;
  if (sinks.has_value()) {
    sinks_f = sinks->to(at::kFloat).contiguous();
    TORCH_CHECK(sinks_f.numel() == P.heads, "sgl_spec_native: one sink per head");
    P.sink = sinks_f.data_ptr<float>();
  }
  return P;
}

const char* row_map(const at::Tensor& req_to_token, int64_t row) {
  TORCH_CHECK(row >= 0 && row < req_to_token.size(0), "sgl_spec_native: request row out of range");
  return static_cast<const char*>(req_to_token.data_ptr()) +
         row * req_to_token.stride(0) * req_to_token.element_size();
}

// One query token per request attends to its whole paged context (its new K/V written first).
void decode_attention(const at::Tensor& query, at::Tensor& k_cache, at::Tensor& v_cache,
                      at::Tensor& output, const std::optional<at::Tensor>& key,
                      const std::optional<at::Tensor>& value, const at::Tensor& loc,
                      const at::Tensor& req_to_token, const at::Tensor& req_pool_indices,
                      const at::Tensor& seq_lens, double sm_scale, double key_scale,
                      double value_scale, double logit_cap, int64_t window,
                      const std::optional<at::Tensor>& sinks) {
  at::Tensor sinks_f;
  Problem P = make_problem(query, output, k_cache, v_cache, req_to_token, sm_scale, key_scale,
                           value_scale, logit_cap, window, sinks, sinks_f);
  if (key.has_value() && value.has_value()) {
    for (const auto* t : {&*key, &*value}) {
      check_f32(*t, "new key/value");
      TORCH_CHECK(t->dim() == 3 && t->stride(2) == 1, "sgl_spec_native: new key/value layout");
    }
    write_rows(k_cache, *key, loc);
    write_rows(v_cache, *value, loc);
  }
  const int64_t bs = query.size(0);
  at::Tensor rpi = req_pool_indices.to(at::kLong).contiguous();
  at::Tensor lens = seq_lens.to(at::kLong).contiguous();
  TORCH_CHECK(rpi.numel() >= bs && lens.numel() >= bs, "sgl_spec_native: decode batch sizes");
  std::vector<Req> reqs(bs);
  for (int64_t b = 0; b < bs; ++b) {
    const int64_t len = lens.data_ptr<int64_t>()[b];
    TORCH_CHECK(len >= 1 && len <= req_to_token.size(1), "sgl_spec_native: seq_len out of range");
    Req& r = reqs[b];
    r.q0 = b;
    r.n = 1;
    r.prefix = len - 1;
    r.len = len;
    r.key_start = window > 0 ? std::max<int64_t>(0, len - window) : 0;
    r.tree0 = 0;
    r.row_map = row_map(req_to_token, rpi.data_ptr<int64_t>()[b]);
  }
  paged_attention(P, reqs);
}

// Each request's extend tokens attend to its cached prefix and (causally, through the
// draft-tree mask, or all) to each other; for the short extends of verify and draft passes.
void extend_attention(const at::Tensor& q_extend, const std::optional<at::Tensor>& k_extend,
                      const std::optional<at::Tensor>& v_extend, at::Tensor& o_extend,
                      const at::Tensor& k_buffer, const at::Tensor& v_buffer,
                      const at::Tensor& req_to_token, const at::Tensor& req_pool_indices,
                      const at::Tensor& seq_lens, const at::Tensor& extend_seq_lens,
                      const at::Tensor& extend_start_loc, double sm_scale, double key_scale,
                      double value_scale, double logit_cap, int64_t window,
                      const std::optional<at::Tensor>& sinks,
                      const std::optional<at::Tensor>& tree_mask, bool is_causal) {
  at::Tensor sinks_f;
  Problem P = make_problem(q_extend, o_extend, k_buffer, v_buffer, req_to_token, sm_scale,
                           key_scale, value_scale, logit_cap, window, sinks, sinks_f);
  const int64_t tokens = q_extend.size(0);
  if (k_extend.has_value() && v_extend.has_value()) {
    for (const auto* t : {&*k_extend, &*v_extend}) {
      check_f32(*t, "k_extend/v_extend");
      TORCH_CHECK(t->dim() == 3 && t->stride(2) == 1 && t->size(0) >= tokens &&
                      t->size(1) == k_buffer.size(1),
                  "sgl_spec_native: extend K/V layout");
    }
    TORCH_CHECK(k_extend->size(2) == P.dim && v_extend->size(2) == P.vdim,
                "sgl_spec_native: extend K/V dims");
    P.kext = k_extend->data_ptr<float>();
    P.vext = v_extend->data_ptr<float>();
    P.kes0 = k_extend->stride(0);
    P.kes1 = k_extend->stride(1);
    P.ves0 = v_extend->stride(0);
    P.ves1 = v_extend->stride(1);
  }
  at::Tensor tree;
  if (tree_mask.has_value()) {
    TORCH_CHECK(window <= 0, "sgl_spec_native: tree mask with sliding window");
    tree = tree_mask->to(at::kBool).contiguous();
    P.tree = reinterpret_cast<const uint8_t*>(tree.data_ptr<bool>());
    P.visible = Visible::kTree;
  } else {
    P.visible = is_causal ? Visible::kCausal : Visible::kAll;
  }
  const int64_t bs = seq_lens.size(0);
  at::Tensor rpi = req_pool_indices.to(at::kLong).contiguous();
  at::Tensor lens = seq_lens.to(at::kLong).contiguous();
  at::Tensor ext = extend_seq_lens.to(at::kLong).contiguous();
  at::Tensor starts = extend_start_loc.to(at::kLong).contiguous();
  TORCH_CHECK(rpi.numel() == bs && ext.numel() == bs && starts.numel() == bs,
              "sgl_spec_native: extend batch sizes");
  std::vector<Req> reqs;
  int64_t tree0 = 0;
  for (int64_t b = 0; b < bs; ++b) {
    const int64_t len = lens.data_ptr<int64_t>()[b], n = ext.data_ptr<int64_t>()[b];
    const int64_t q0 = starts.data_ptr<int64_t>()[b];
    TORCH_CHECK(n >= 0 && n <= len && len <= req_to_token.size(1) && q0 >= 0 && q0 + n <= tokens,
                "sgl_spec_native: extend lengths out of range");
    if (n == 0) continue;
    Req r;
    r.q0 = q0;
    r.n = n;
    r.prefix = len - n;
    r.len = len;
    r.key_start = window > 0 ? std::max<int64_t>(0, r.prefix - window + 1) : 0;
    r.tree0 = tree0;
    r.row_map = row_map(req_to_token, rpi.data_ptr<int64_t>()[b]);
    reqs.push_back(r);
    tree0 += n * n;
  }
  TORCH_CHECK(!tree.defined() || tree.numel() >= tree0, "sgl_spec_native: tree mask too short");
  paged_attention(P, reqs);
}

// extend_attention after storing the extend K/V into the pool at ``loc`` (what the backend's
// set_kv_buffer would do first), in one call: the verify and draft passes of a step.
void store_extend_attention(const at::Tensor& q_extend, const at::Tensor& k_extend,
                            const at::Tensor& v_extend, at::Tensor& o_extend,
                            at::Tensor& k_buffer, at::Tensor& v_buffer, const at::Tensor& loc,
                            const at::Tensor& req_to_token, const at::Tensor& req_pool_indices,
                            const at::Tensor& seq_lens, const at::Tensor& extend_seq_lens,
                            const at::Tensor& extend_start_loc, double sm_scale,
                            double key_scale, double value_scale, double logit_cap,
                            int64_t window, const std::optional<at::Tensor>& sinks,
                            const std::optional<at::Tensor>& tree_mask, bool is_causal) {
  const int64_t tokens = q_extend.size(0);
  for (const at::Tensor* t : {&k_extend, &v_extend, static_cast<const at::Tensor*>(&k_buffer),
                              static_cast<const at::Tensor*>(&v_buffer)}) {
    check_f32(*t, "extend K/V and KV pool");
    TORCH_CHECK(t->dim() == 3 && t->stride(2) == 1, "sgl_spec_native: extend K/V layout");
  }
  TORCH_CHECK(k_extend.size(0) >= tokens && v_extend.size(0) >= tokens &&
                  loc.numel() == tokens && k_extend.size(1) == k_buffer.size(1) &&
                  k_extend.size(2) == k_buffer.size(2) && v_extend.size(1) == v_buffer.size(1) &&
                  v_extend.size(2) == v_buffer.size(2),
              "sgl_spec_native: one pool row per extend token, K/V shaped as the pool");
  write_rows(k_buffer, k_extend.narrow(0, 0, tokens), loc);
  write_rows(v_buffer, v_extend.narrow(0, 0, tokens), loc);
  extend_attention(q_extend, k_extend, v_extend, o_extend, k_buffer, v_buffer, req_to_token,
                   req_pool_indices, seq_lens, extend_seq_lens, extend_start_loc, sm_scale,
                   key_scale, value_scale, logit_cap, window, sinks, tree_mask, is_causal);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(sgl_spec_native, m) {
  m.def("decode_attention(Tensor query, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor(c!) output,"
      " Tensor? key, Tensor? value, Tensor loc, Tensor req_to_token, Tensor req_pool_indices,"
      " Tensor seq_lens, float sm_scale, float key_scale, float value_scale, float logit_cap,"
      " int window, Tensor? sinks) -> ()");
  m.def("extend_attention(Tensor q_extend, Tensor? k_extend, Tensor? v_extend, Tensor(a!) o_extend,"
      " Tensor k_buffer, Tensor v_buffer, Tensor req_to_token, Tensor req_pool_indices,"
      " Tensor seq_lens, Tensor extend_seq_lens, Tensor extend_start_loc, float sm_scale,"
      " float key_scale, float value_scale, float logit_cap, int window, Tensor? sinks,"
      " Tensor? tree_mask, bool is_causal) -> ()");
  m.def("store_extend_attention(Tensor q_extend, Tensor k_extend, Tensor v_extend,"
      " Tensor(a!) o_extend, Tensor(b!) k_buffer, Tensor(c!) v_buffer, Tensor loc,"
      " Tensor req_to_token, Tensor req_pool_indices, Tensor seq_lens, Tensor extend_seq_lens,"
      " Tensor extend_start_loc, float sm_scale, float key_scale, float value_scale,"
      " float logit_cap, int window, Tensor? sinks, Tensor? tree_mask, bool is_causal) -> ()");
}

// CPU kernels, not catch-all ones: an op with a CPU kernel can carry a fake (meta)
// implementation, which torch.compile needs to trace through it.
TORCH_LIBRARY_IMPL(sgl_spec_native, CPU, m) {
  m.impl("decode_attention", &decode_attention);
  m.impl("extend_attention", &extend_attention);
  m.impl("store_extend_attention", &store_extend_attention);
}
