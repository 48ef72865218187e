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
//
// The routine computes on 16-float vectors (`Vec`, vec16.h): one AVX-512 register where
// models/native.py builds with SPLITSERVE_AVX512, two AVX2 registers with SPLITSERVE_AVX2.
// Both take the same operations in the same order (the same lane-sum trees), so the two
// builds are meant to give the same bits.
#pragma once

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <utility>

#include "vec16.h"

namespace attn {

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
        store_n(sc(r, j) + p, count, sum_lanes16(dots));
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
        store_n(s + p, len - p, e);
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

}  // namespace attn
