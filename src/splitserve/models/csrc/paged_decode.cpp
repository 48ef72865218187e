// Attention over the paged KV cache, in place (see models/paged_decode.py): decode rows (one
// query per sequence) and prefill chunks (many queries of one sequence).
//
// Both run one routine, `attend`, on a run of queries of one sequence that share a kv head:
// query q sees positions [0, first + q). For each query head j that shares the kv head:
//
//   scores[j, p] = (q[j] * scale) . k_p          one fused-multiply-add chain per 16 lanes
//   w[j, p]      = exp(scores[j, p] - max_j)      16 positions at a time
//   out[j]       = (sum_p w[j, p] v_p) / sum_p w[j, p]
//
// Every sum runs in an order fixed by the query's own position: never by the batch, the
// chunk it came in, the thread count or a buffer's address. So a token gets the same bits
// as a decode row or anywhere in a prefill chunk, alone or batched. A run's queries share
// each K/V row (bfloat16 widened once, float32 read in place), so a prefill chunk reads and
// widens its context once per 16 queries.
// Work items go over torch's own intra-op threads (at::parallel_for): the op runs on the
// engine thread's OpenMP team and starts no threads of its own.
//
// The routine computes on 16-float vectors (`Vec`, lanes.h): one AVX-512 register where
// models/native.py builds with SPLITSERVE_AVX512, two AVX2 registers with SPLITSERVE_AVX2.
// Both take the same operations in the same order (the same lane-sum trees), so the two
// builds are meant to give the same bits.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <utility>
#include <vector>

#include "vec16.h"

namespace {

using namespace vec16;

constexpr int kLanes = 16;  // a Vec's; positions per span
constexpr int64_t kMaxGroup = 8;   // query heads per kv head
constexpr int64_t kQueryRun = 16;  // prefill queries per work item

struct Layout {
  int64_t block_size, block_stride, pos_stride, head_dim, group;
};

// A run of `nq` queries of one sequence on one kv head, with NC = head_dim / 16. Query q
// (rows q * qstride of `q` and `out`, its g heads contiguous) sees positions
// [0, first + q). `scores` has room for nq * g * round16(first + nq - 1) floats.
template <typename T, int NC>
void attend(const float* q, int64_t qstride, int64_t nq, int64_t first, const T* kc, const T* vc,
            const int64_t* table, int64_t kv_head, float scale, const Layout& lay, float* scores,
            float* out) {
  constexpr int64_t hd = NC * kLanes;
  const int64_t g = lay.group, bs = lay.block_size, longest = first + nq - 1;
  const int64_t stride = (longest + kLanes - 1) / kLanes * kLanes;
  alignas(64) float rows[kLanes * hd];
  alignas(64) float qs[kQueryRun * kMaxGroup * hd];
  alignas(64) float acc[kQueryRun * kMaxGroup * hd];
  for (int64_t r = 0; r < nq; ++r)
    for (int64_t i = 0; i < g * hd; ++i) qs[r * g * hd + i] = q[r * qstride + i] * scale;
  auto length = [&](int64_t r) { return first + r; };
  auto sc = [&](int64_t r, int64_t j) { return scores + (r * g + j) * stride; };

  // Positions [p, p + count) of `cache` as float32 rows (count <= 16, within one block):
  // float32 rows where they are, bfloat16 ones widened into `rows`. Returns the first row
  // and the distance between rows.
  auto widen = [&](const T* cache, int64_t p, int64_t count) -> std::pair<const float*, int64_t> {
    const T* first = cache + table[p / bs] * lay.block_stride + (p % bs) * lay.pos_stride + kv_head * hd;
    if constexpr (std::is_same_v<T, float>) {
      return {first, lay.pos_stride};
    } else {
      for (int64_t i = 0; i < count; ++i)
        for (int c = 0; c < NC; ++c)
          store(rows + i * hd + c * kLanes, load_row(first + i * lay.pos_stride + c * kLanes));
      return {rows, hd};
    }
  };
  // Spans of at most 16 positions that never cross a block; for a shorter query the same
  // spans, its last one cut at its length.
  auto span = [&](int64_t p) { return std::min({(int64_t)kLanes, longest - p, bs - p % bs}); };

  for (int64_t p = 0; p < longest; p += span(p)) {
    const auto [krows, kstride] = widen(kc, p, span(p));
    for (int64_t r = std::max<int64_t>(0, p - first + 1); r < nq; ++r) {
      const int64_t count = std::min(span(p), length(r) - p);
      for (int64_t j = 0; j < g; ++j) {
        Vec qv[NC], dots[kLanes];
        for (int c = 0; c < NC; ++c) qv[c] = load(qs + (r * g + j) * hd + c * kLanes);
        for (int64_t i = 0; i < count; ++i) {
          Vec d = mul(qv[0], loadu(krows + i * kstride));
          for (int c = 1; c < NC; ++c) d = fmadd(qv[c], loadu(krows + i * kstride + c * kLanes), d);
          dots[i] = d;
        }
        for (int64_t i = count; i < kLanes; ++i) dots[i] = zero();
        store_first(sc(r, j) + p, first_lanes(count), sum_lanes16(dots));
      }
    }
  }

  // Softmax weights, unnormalised; each head's total.
  float totals[kQueryRun * kMaxGroup];
  for (int64_t r = 0; r < nq; ++r) {
    const int64_t len = length(r);
    for (int64_t j = 0; j < g; ++j) {
      float* s = sc(r, j);
      Vec best = set1(-__builtin_inff());
      for (int64_t p = 0; p < len; p += kLanes)
        best = max_first(best, first_lanes(len - p), loadu(s + p));
      const Vec top = set1(reduce_max(best));
      Vec total = zero();
      for (int64_t p = 0; p < len; p += kLanes) {
        const Mask m = first_lanes(len - p);
        const Vec e = exp_nonpositive(sub(load_first(m, s + p), top));
        store_first(s + p, m, e);
        total = add_first(total, m, e);
      }
      totals[r * g + j] = reduce_add(total);
    }
  }

  // Weighted values: each head's sums stay in registers over a span of positions.
  for (int64_t i = 0; i < nq * g * hd; ++i) acc[i] = 0.0f;
  for (int64_t p = 0; p < longest; p += span(p)) {
    const auto [vrows, vstride] = widen(vc, p, span(p));
    for (int64_t r = std::max<int64_t>(0, p - first + 1); r < nq; ++r) {
      const int64_t count = std::min(span(p), length(r) - p);
      for (int64_t j = 0; j < g; ++j) {
        float* a_row = acc + (r * g + j) * hd;
        Vec a[NC];
        for (int c = 0; c < NC; ++c) a[c] = load(a_row + c * kLanes);
        const float* w = sc(r, j) + p;
        // Even and odd positions in two chains (one fused multiply-add waits for the last),
        // joined at the span's end.
        Vec b[NC];
        for (int c = 0; c < NC; ++c) b[c] = zero();
        int64_t i = 0;
        for (; i + 1 < count; i += 2) {
          const Vec wi = set1(w[i]), wn = set1(w[i + 1]);
          for (int c = 0; c < NC; ++c) {
            a[c] = fmadd(wi, loadu(vrows + i * vstride + c * kLanes), a[c]);
            b[c] = fmadd(wn, loadu(vrows + (i + 1) * vstride + c * kLanes), b[c]);
          }
        }
        if (i < count) {
          const Vec wi = set1(w[i]);
          for (int c = 0; c < NC; ++c) a[c] = fmadd(wi, loadu(vrows + i * vstride + c * kLanes), a[c]);
        }
        for (int c = 0; c < NC; ++c) store(a_row + c * kLanes, add(a[c], b[c]));
      }
    }
  }
  for (int64_t r = 0; r < nq; ++r)
    for (int64_t j = 0; j < g; ++j) {
      const Vec inv = set1(1.0f / totals[r * g + j]);
      const float* a_row = acc + (r * g + j) * hd;
      for (int c = 0; c < NC; ++c)
        storeu(out + r * qstride + j * hd + c * kLanes, mul(load(a_row + c * kLanes), inv));
    }
}

template <typename T>
using AttendFn = void (*)(const float*, int64_t, int64_t, int64_t, const T*, const T*, const int64_t*,
                          int64_t, float, const Layout&, float*, float*);

template <typename T>
AttendFn<T> attend_fn(int64_t head_dim) {
  switch (head_dim / kLanes) {
    case 1: return attend<T, 1>;
    case 2: return attend<T, 2>;
    case 4: return attend<T, 4>;
    case 6: return attend<T, 6>;
    case 8: return attend<T, 8>;
    case 16: return attend<T, 16>;
    default: return nullptr;
  }
}

struct Caches {
  const void* k;
  const void* v;
  Layout lay;
};

Caches check_caches(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache) {
  TORCH_CHECK(q.scalar_type() == at::kFloat && q.dim() == 3 && q.is_contiguous(),
              "q: contiguous float32 [n, h, hd]");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  k_cache.sizes() == v_cache.sizes() && k_cache.scalar_type() == v_cache.scalar_type(),
              "caches: two contiguous [blocks, block_size, kv_heads, head_dim] of one type");
  TORCH_CHECK(k_cache.scalar_type() == at::kBFloat16 || k_cache.scalar_type() == at::kFloat,
              "caches: bfloat16 or float32");
  const int64_t hd = q.size(2), kvh = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == hd && attend_fn<float>(hd) != nullptr,
              "head_dim: 16, 32, 64, 96, 128 or 256");
  TORCH_CHECK(q.size(1) % kvh == 0 && q.size(1) / kvh <= kMaxGroup, "at most 8 query heads per kv head");
  return {k_cache.data_ptr(), v_cache.data_ptr(),
          Layout{k_cache.size(1), k_cache.stride(0), k_cache.stride(1), hd, q.size(1) / kvh}};
}

template <typename T>
void decode_rows(const at::Tensor& q, const Caches& c, int64_t kvh, const int64_t* tables,
                 int64_t width, const int64_t* lens, float scale, at::Tensor& out) {
  const int64_t n = q.size(0), h = q.size(1), hd = q.size(2), g = c.lay.group;
  const AttendFn<T> fn = attend_fn<T>(hd);
  at::parallel_for(0, n * kvh, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t r = item / kvh, kh = item % kvh, length = lens[r];
      scores.resize(static_cast<size_t>(g * ((length + kLanes - 1) / kLanes * kLanes)));
      const int64_t row = (r * h + kh * g) * hd;
      fn(q.data_ptr<float>() + row, h * hd, 1, length, static_cast<const T*>(c.k),
         static_cast<const T*>(c.v), tables + r * width, kh, scale, c.lay, scores.data(),
         out.data_ptr<float>() + row);
    }
  });
}

template <typename T>
void prefill_rows(const at::Tensor& q, const Caches& c, int64_t kvh, const int64_t* table,
                  int64_t start, float scale, at::Tensor& out) {
  const int64_t n = q.size(0), h = q.size(1), hd = q.size(2), g = c.lay.group;
  const int64_t runs = (n + kQueryRun - 1) / kQueryRun;
  const AttendFn<T> fn = attend_fn<T>(hd);
  // Later runs see more positions: runs are dealt from both ends, so that the contiguous
  // ranges at::parallel_for hands each thread carry similar work.
  at::parallel_for(0, runs * kvh, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t kh = item % kvh, k = item / kvh;
      const int64_t run = k % 2 == 0 ? k / 2 : runs - 1 - k / 2;
      const int64_t q0 = run * kQueryRun, nq = std::min(kQueryRun, n - q0);
      const int64_t longest = start + q0 + nq;
      scores.resize(static_cast<size_t>(nq * g * ((longest + kLanes - 1) / kLanes * kLanes)));
      const int64_t row = (q0 * h + kh * g) * hd;
      fn(q.data_ptr<float>() + row, h * hd, nq, start + q0 + 1, static_cast<const T*>(c.k),
         static_cast<const T*>(c.v), table, kh, scale, c.lay, scores.data(), out.data_ptr<float>() + row);
    }
  });
}

// Decode rows: q [n, h, hd] float32, row r one query at position lens[r] - 1 of the sequence
// whose blocks are tables[r] (int64 [n, w]).
at::Tensor paged_decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                        const at::Tensor& tables, const at::Tensor& lens, double scale) {
  const Caches c = check_caches(q, k_cache, v_cache);
  TORCH_CHECK(tables.scalar_type() == at::kLong && tables.is_contiguous() && tables.dim() == 2 &&
                  lens.scalar_type() == at::kLong && lens.is_contiguous() &&
                  tables.size(0) == q.size(0) && lens.size(0) == q.size(0),
              "tables [n, w] and lens [n]: contiguous int64");
  at::Tensor out = at::empty_like(q);
  const int64_t kvh = k_cache.size(2);
  if (k_cache.scalar_type() == at::kBFloat16)
    decode_rows<uint16_t>(q, c, kvh, tables.data_ptr<int64_t>(), tables.size(1), lens.data_ptr<int64_t>(),
                          static_cast<float>(scale), out);
  else
    decode_rows<float>(q, c, kvh, tables.data_ptr<int64_t>(), tables.size(1), lens.data_ptr<int64_t>(),
                       static_cast<float>(scale), out);
  return out;
}

// A prefill chunk: q [n, h, hd] float32, row i the query at position start + i of the
// sequence whose blocks are table (int64 [w]); the chunk's own K/V are in the cache already.
at::Tensor paged_prefill(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                         const at::Tensor& table, int64_t start, double scale) {
  const Caches c = check_caches(q, k_cache, v_cache);
  TORCH_CHECK(table.scalar_type() == at::kLong && table.is_contiguous() && table.dim() == 1 &&
                  table.size(0) * k_cache.size(1) >= start + q.size(0) && start >= 0,
              "table: contiguous int64 [w] covering the chunk");
  at::Tensor out = at::empty_like(q);
  const int64_t kvh = k_cache.size(2);
  if (k_cache.scalar_type() == at::kBFloat16)
    prefill_rows<uint16_t>(q, c, kvh, table.data_ptr<int64_t>(), start, static_cast<float>(scale), out);
  else
    prefill_rows<float>(q, c, kvh, table.data_ptr<int64_t>(), start, static_cast<float>(scale), out);
  return out;
}

}  // namespace

TORCH_LIBRARY(splitserve, m) {
  m.def("paged_decode(Tensor q, Tensor k_cache, Tensor v_cache, Tensor tables, Tensor lens, float scale) -> Tensor");
  m.def("paged_prefill(Tensor q, Tensor k_cache, Tensor v_cache, Tensor table, int start, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(splitserve, CPU, m) {
  m.impl("paged_decode", &paged_decode);
  m.impl("paged_prefill", &paged_prefill);
}
