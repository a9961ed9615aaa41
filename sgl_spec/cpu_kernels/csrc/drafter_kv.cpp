// SPECBLOCK's drafter KV pool (sgl_spec/specblock/draft_kv.py, DrafterKVPool on the CPU) in one
// call each: a step's context gathered into its workspace (per request row, the positions the
// workspace still holds from the last gather are kept, the rest copied) with the mask of which
// context columns the drafter sees; the mask alone; a forward's new blocks written to the pool.
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

at::Tensor visibility(const at::Tensor& num_tokens, int64_t t, int64_t k, bool last_slot_only) {
  const int64_t bs = num_tokens.numel();
  const int64_t* np = num_tokens.data_ptr<int64_t>();
  at::Tensor visible = at::empty({bs, t * k}, num_tokens.options().dtype(at::kBool));
  bool* vp = visible.data_ptr<bool>();
  for (int64_t b = 0; b < bs; ++b)
    for (int64_t p = 0; p < t; ++p)
      for (int64_t s = 0; s < k; ++s)
        vp[(b * t + p) * k + s] = p < np[b] && !(last_slot_only && p == np[b] - 1 && s > 0);
  return visible;
}

// Positions at the head of a row the workspace still holds: same location as the last gather
// put there, among the real entries of both gathers, and not written since (``generation``).
int64_t kept_prefix(const int64_t* locs, const int64_t* seen, int64_t limit,
                    const int64_t* written_at, int64_t generation) {
  int64_t p = 0;
  while (p < limit && locs[p] == seen[p] && written_at[locs[p]] <= generation) ++p;
  return p;
}

// locs [bs, T] int64 (padding: any valid location); num_tokens [bs] real entries per row;
// seen_locs [bs, C >= T] / seen_num [bs]: what the workspace holds per row (seen_num 0: nothing;
// updated here); written_at [rows] the write stamp of each pool row; pools / buffers per layer,
// keys then values: [rows, K, n_kv, hd] and [bs, >= C*K, n_kv, hd], contiguous, one dtype.
// Returns the visible columns [bs, T*K] (with ``last_slot_only`` the last real position shows
// its slot 1 only).
at::Tensor drafter_gather(const at::Tensor& locs, const at::Tensor& num_tokens,
                          at::Tensor seen_locs, at::Tensor seen_num, const at::Tensor& written_at,
                          int64_t generation, at::TensorList pools, at::TensorList buffers,
                          bool last_slot_only) {
  TORCH_CHECK(locs.dim() == 2 && locs.scalar_type() == at::kLong && locs.is_contiguous(),
              "sgl_spec_native: drafter_gather locs must be contiguous int64 [bs, T]");
  const int64_t bs = locs.size(0), t = locs.size(1);
  for (const at::Tensor& s : {num_tokens, seen_num, written_at})
    TORCH_CHECK(s.scalar_type() == at::kLong && s.is_contiguous() && s.device().is_cpu(),
                "sgl_spec_native: drafter_gather bookkeeping must be contiguous int64 on CPU");
  TORCH_CHECK(num_tokens.numel() == bs && seen_num.numel() == bs,
              "sgl_spec_native: drafter_gather needs one count per row");
  TORCH_CHECK(seen_locs.scalar_type() == at::kLong && seen_locs.is_contiguous() &&
                  seen_locs.dim() == 2 && seen_locs.size(0) == bs && seen_locs.size(1) >= t,
              "sgl_spec_native: drafter_gather seen_locs must be int64 [bs, >= T]");
  TORCH_CHECK(pools.size() == buffers.size() && !pools.empty(),
              "sgl_spec_native: drafter_gather needs one buffer per pool");
  const int64_t rows = written_at.numel();
  const int64_t k = pools[0].size(1);
  const int64_t row_bytes = pools[0].numel() / std::max<int64_t>(pools[0].size(0), 1) *
                            pools[0].element_size();  // one location: K slots
  for (size_t i = 0; i < pools.size(); ++i) {
    TORCH_CHECK(pools[i].is_contiguous() && buffers[i].is_contiguous() &&
                    pools[i].scalar_type() == buffers[i].scalar_type() &&
                    pools[i].size(0) == rows && buffers[i].size(0) == bs &&
                    buffers[i].numel() / bs * buffers[i].element_size() >= t * row_bytes &&
                    pools[i].numel() * pools[i].element_size() == rows * row_bytes,
                "sgl_spec_native: drafter_gather pool/buffer ", i, " shape or layout");
  }
  const int64_t* lp = locs.data_ptr<int64_t>();
  for (int64_t i = 0; i < bs * t; ++i)
    TORCH_CHECK(lp[i] >= 0 && lp[i] < rows, "sgl_spec_native: drafter_gather location ", lp[i],
                " outside the pool of ", rows);
  const int64_t* np = num_tokens.data_ptr<int64_t>();
  int64_t* sp = seen_locs.data_ptr<int64_t>();
  int64_t* snp = seen_num.data_ptr<int64_t>();
  const int64_t* wp = written_at.data_ptr<int64_t>();
  const int64_t seen_stride = seen_locs.size(1);

  std::vector<int64_t> starts(bs);
  int64_t copies = 0;
  for (int64_t b = 0; b < bs; ++b) {
    TORCH_CHECK(np[b] >= 0 && np[b] <= t, "sgl_spec_native: drafter_gather count outside [0, T]");
    const int64_t limit = std::min(std::min(np[b], snp[b]), t);
    starts[b] = kept_prefix(lp + b * t, sp + b * seen_stride, limit, wp, generation);
    copies += t - starts[b];
  }
  auto copy_row = [&](int64_t b) {
    for (size_t i = 0; i < pools.size(); ++i) {
      const uint8_t* src = static_cast<const uint8_t*>(pools[i].data_ptr());
      uint8_t* dst = static_cast<uint8_t*>(buffers[i].data_ptr()) +
                     b * (buffers[i].numel() / bs) * buffers[i].element_size();
      for (int64_t p = starts[b]; p < t; ++p)
        std::memcpy(dst + p * row_bytes, src + lp[b * t + p] * row_bytes, row_bytes);
    }
    std::memcpy(sp + b * seen_stride + starts[b], lp + b * t + starts[b],
                (t - starts[b]) * sizeof(int64_t));
    snp[b] = np[b];
  };
  // a fresh workspace copies whole contexts (MBs): rows in parallel; a steady step's few
  // positions are cheaper in one thread
  if (copies * row_bytes * static_cast<int64_t>(pools.size()) > (1 << 20))
    at::parallel_for(0, bs, 1, [&](int64_t lo, int64_t hi) {
      for (int64_t b = lo; b < hi; ++b) copy_row(b);
    });
  else
    for (int64_t b = 0; b < bs; ++b) copy_row(b);

  return visibility(num_tokens, t, k, last_slot_only);
}

// Which of T positions' K slots [bs, T*K] a drafter forward sees (packing.context_visibility):
// the first ``num_tokens`` positions of each row, with ``last_slot_only`` the last of them
// slot 1 only.
at::Tensor drafter_visibility(const at::Tensor& num_tokens, int64_t t, int64_t k,
                              bool last_slot_only) {
  TORCH_CHECK(num_tokens.dim() == 1 && t >= 0 && k > 0,
              "sgl_spec_native: drafter_visibility needs [bs] counts, T >= 0, K > 0");
  return visibility(num_tokens.to(at::kLong).contiguous(), t, k, last_slot_only);
}

// Blocks of one drafter forward stored in the pool: block ``rows[i]`` (request rows[i] / S, its
// start rows[i] % S) of each layer's keys and values, [bs, n_kv, S*K, hd] with any strides, at
// location locs[i] of the pools [rows, K, n_kv, hd] (contiguous, the same dtype); the write
// stamp of those locations set to ``generation``.
void drafter_kv_write(const at::Tensor& locs, const at::Tensor& rows, at::TensorList new_kv,
                      at::TensorList pools, at::Tensor written_at, int64_t generation) {
  TORCH_CHECK(new_kv.size() == pools.size() && !pools.empty(),
              "sgl_spec_native: drafter_kv_write needs one pool per key/value tensor");
  const at::Tensor l = locs.to(at::kLong).contiguous(), r = rows.to(at::kLong).contiguous();
  const int64_t n = l.numel();
  TORCH_CHECK(r.numel() == n, "sgl_spec_native: drafter_kv_write needs one row per location");
  TORCH_CHECK(written_at.scalar_type() == at::kLong && written_at.is_contiguous(),
              "sgl_spec_native: drafter_kv_write written_at must be contiguous int64");
  const int64_t num_rows = written_at.numel();
  const int64_t* lp = l.data_ptr<int64_t>();
  const int64_t* rp = r.data_ptr<int64_t>();
  const int64_t bs = new_kv[0].size(0), n_kv = new_kv[0].size(1), hd = new_kv[0].size(3);
  const int64_t k = pools[0].size(1), starts = new_kv[0].size(2) / k;
  for (size_t i = 0; i < pools.size(); ++i)
    TORCH_CHECK(pools[i].is_contiguous() && pools[i].dim() == 4 && pools[i].size(0) == num_rows &&
                    pools[i].size(1) == k && pools[i].size(2) == n_kv && pools[i].size(3) == hd &&
                    new_kv[i].dim() == 4 && new_kv[i].size(0) == bs &&
                    new_kv[i].size(1) == n_kv && new_kv[i].size(2) == starts * k &&
                    new_kv[i].size(3) == hd &&
                    new_kv[i].scalar_type() == pools[i].scalar_type(),
                "sgl_spec_native: drafter_kv_write pool/new ", i, " shape or dtype");
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(lp[i] >= 0 && lp[i] < num_rows && rp[i] >= 0 && rp[i] < bs * starts,
                "sgl_spec_native: drafter_kv_write location or row out of range");
  for (size_t i = 0; i < pools.size(); ++i) {
    const at::Tensor& src = new_kv[i];
    const int64_t es = src.element_size();
    const int64_t s0 = src.stride(0), s1 = src.stride(1), s2 = src.stride(2), s3 = src.stride(3);
    const uint8_t* sbase = static_cast<const uint8_t*>(src.data_ptr());
    uint8_t* dbase = static_cast<uint8_t*>(pools[i].data_ptr());
    for (int64_t j = 0; j < n; ++j) {
      const int64_t b = rp[j] / starts, start = rp[j] % starts;
      for (int64_t slot = 0; slot < k; ++slot)
        for (int64_t h = 0; h < n_kv; ++h) {
          const uint8_t* from = sbase + (b * s0 + h * s1 + (start * k + slot) * s2) * es;
          uint8_t* to = dbase + (((lp[j] * k + slot) * n_kv + h) * hd) * es;
          if (s3 == 1) {
            std::memcpy(to, from, hd * es);
          } else {
            for (int64_t d = 0; d < hd; ++d) std::memcpy(to + d * es, from + d * s3 * es, es);
          }
        }
    }
  }
  int64_t* wp = written_at.data_ptr<int64_t>();
  for (int64_t j = 0; j < n; ++j) wp[lp[j]] = generation;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(sgl_spec_native, m) {
  m.def("drafter_gather(Tensor locs, Tensor num_tokens, Tensor(a!) seen_locs,"
        " Tensor(b!) seen_num, Tensor written_at, int generation, Tensor[] pools,"
        " Tensor(c!)[] buffers, bool last_slot_only) -> Tensor");
  m.def("drafter_visibility(Tensor num_tokens, int t, int k, bool last_slot_only) -> Tensor");
  m.def("drafter_kv_write(Tensor locs, Tensor rows, Tensor[] new_kv, Tensor(a!)[] pools,"
        " Tensor(b!) written_at, int generation) -> ()");
}

TORCH_LIBRARY_IMPL(sgl_spec_native, CPU, m) {
  m.impl("drafter_gather", &drafter_gather);
  m.impl("drafter_visibility", &drafter_visibility);
  m.impl("drafter_kv_write", &drafter_kv_write);
}
