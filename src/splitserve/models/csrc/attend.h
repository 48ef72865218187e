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

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <utility>
#include <vector>

#include "vec16.h"

namespace attn {

using namespace vec16;

constexpr int kLanes = 16;  // a Vec's; positions per span
constexpr int64_t kMaxGroup = 8;   // query heads per kv head
constexpr int64_t kQueryRun = 16;  // prefill queries per work item

struct Layout {
  int64_t block_size, block_stride, pos_stride, head_dim, group;
};

// A run of `nq` queries of one sequence on one kv head, with NC = head_dim / 16: query q (rows
// q * qstride of `q` and `out`, its g heads contiguous) sees positions [0, first + q).
// `scores` has room for nq * g * round16(first + nq - 1) floats. `attend` below runs its three
// parts in order; a decode row with few work items to share (`decode`) runs them on several
// threads, each part's every element computed exactly as here.
template <typename T, int NC>
class Run {
 public:
  static constexpr int64_t hd = NC * kLanes;

  Run(const float* q, int64_t qstride, int64_t nq, int64_t first, const T* kc, const T* vc,
      const int64_t* table, int64_t kv_head, float scale, const Layout& lay, float* scores)
      : q_(q), qstride_(qstride), nq_(nq), first_(first), kc_(kc), vc_(vc), table_(table),
        kv_head_(kv_head), scale_(scale), lay_(lay), scores_(scores), g_(lay.group),
        longest_(first + nq - 1), stride_((longest_ + kLanes - 1) / kLanes * kLanes) {}

  int64_t longest() const { return longest_; }

  // The scores of positions [p0, p1): q . k_p for each query that sees p.
  void score(int64_t p0, int64_t p1) {
    alignas(64) float rows[kLanes * hd];
    alignas(64) float qs[kQueryRun * kMaxGroup * hd];
    for (int64_t r = 0; r < nq_; ++r)
      for (int64_t i = 0; i < g_ * hd; ++i) qs[r * g_ * hd + i] = q_[r * qstride_ + i] * scale_;
    for (int64_t p = p0; p < p1; p += span(p, p1)) {
      const int64_t n = span(p, p1);
      const auto [krows, kstride] = widen(kc_, p, n, rows);
      for (int64_t r = std::max<int64_t>(0, p - first_ + 1); r < nq_; ++r) {
        const int64_t count = std::min(n, length(r) - p);
        for (int64_t j = 0; j < g_; ++j) {
          Vec qv[NC], dots[kLanes];
          for (int c = 0; c < NC; ++c) qv[c] = load(qs + (r * g_ + j) * hd + c * kLanes);
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
  }

  // Softmax weights, unnormalised, into `w` (laid out as the scores; it may be the scores
  // themselves), and each head's total into totals[r * g + j].
  void weigh(float* w, float* totals) const {
    for (int64_t r = 0; r < nq_; ++r) {
      const int64_t len = length(r);
      for (int64_t j = 0; j < g_; ++j) {
        const float* s = sc(r, j);
        float* e_out = w + (s - scores_);
        Vec best = set1(-__builtin_inff());
        for (int64_t p = 0; p < len; p += kLanes)
          best = max_first(best, first_lanes(len - p), loadu(s + p));
        const Vec top = set1(reduce_max(best));
        Vec total = zero();
        for (int64_t p = 0; p < len; p += kLanes) {
          const Mask m = first_lanes(len - p);
          const Vec e = exp_nonpositive(sub(load_first(m, s + p), top));
          store_n(e_out + p, len - p, e);
          total = add_first(total, m, e);
        }
        totals[r * g_ + j] = reduce_add(total);
      }
    }
  }

  // Output columns [16 c0, 16 (c0 + NP)) of every query and head: the weighted values over
  // `w` (weigh's), divided by the totals. Each head's sums stay in registers over a span.
  template <int NP>
  void values(int64_t c0, const float* w, const float* totals, float* out) const {
    alignas(64) float rows[kLanes * hd];
    alignas(64) float acc[kQueryRun * kMaxGroup * NP * kLanes];
    constexpr int64_t width = NP * kLanes;
    for (int64_t i = 0; i < nq_ * g_ * width; ++i) acc[i] = 0.0f;
    for (int64_t p = 0; p < longest_; p += span(p, longest_)) {
      const int64_t n = span(p, longest_);
      const auto [vrows_all, vstride] = widen(vc_, p, n, rows, c0, NP);
      const float* vrows = vrows_all + c0 * kLanes;
      for (int64_t r = std::max<int64_t>(0, p - first_ + 1); r < nq_; ++r) {
        const int64_t count = std::min(n, length(r) - p);
        for (int64_t j = 0; j < g_; ++j) {
          float* a_row = acc + (r * g_ + j) * width;
          Vec a[NP];
          for (int c = 0; c < NP; ++c) a[c] = load(a_row + c * kLanes);
          const float* wp = w + (sc(r, j) - scores_) + p;
          // Even and odd positions in two chains (one fused multiply-add waits for the last),
          // joined at the span's end.
          Vec b[NP];
          for (int c = 0; c < NP; ++c) b[c] = zero();
          int64_t i = 0;
          for (; i + 1 < count; i += 2) {
            const Vec wi = set1(wp[i]), wn = set1(wp[i + 1]);
            for (int c = 0; c < NP; ++c) {
              a[c] = fmadd(wi, loadu(vrows + i * vstride + c * kLanes), a[c]);
              b[c] = fmadd(wn, loadu(vrows + (i + 1) * vstride + c * kLanes), b[c]);
            }
          }
          if (i < count) {
            const Vec wi = set1(wp[i]);
            for (int c = 0; c < NP; ++c) a[c] = fmadd(wi, loadu(vrows + i * vstride + c * kLanes), a[c]);
          }
          for (int c = 0; c < NP; ++c) store(a_row + c * kLanes, add(a[c], b[c]));
        }
      }
    }
    for (int64_t r = 0; r < nq_; ++r)
      for (int64_t j = 0; j < g_; ++j) {
        const Vec inv = set1(1.0f / totals[r * g_ + j]);
        const float* a_row = acc + (r * g_ + j) * width;
        for (int c = 0; c < NP; ++c)
          storeu(out + r * qstride_ + j * hd + (c0 + c) * kLanes, mul(load(a_row + c * kLanes), inv));
      }
  }

 private:
  int64_t length(int64_t r) const { return first_ + r; }
  const float* sc(int64_t r, int64_t j) const { return scores_ + (r * g_ + j) * stride_; }
  float* sc(int64_t r, int64_t j) { return scores_ + (r * g_ + j) * stride_; }
  // Spans of at most 16 positions that never cross a block or `end`.
  int64_t span(int64_t p, int64_t end) const {
    return std::min({(int64_t)kLanes, end - p, lay_.block_size - p % lay_.block_size});
  }
  // Positions [p, p + count) of `cache` as float32 rows: float32 rows where they are,
  // bfloat16 ones (columns [16 c0, 16 (c0 + nc)) of them) widened into `rows`. Returns the
  // first row and the distance between rows.
  std::pair<const float*, int64_t> widen(const T* cache, int64_t p, int64_t count, float* rows,
                                         int64_t c0 = 0, int64_t nc = NC) const {
    const T* first = cache + table_[p / lay_.block_size] * lay_.block_stride +
                     (p % lay_.block_size) * lay_.pos_stride + kv_head_ * hd;
    if constexpr (std::is_same_v<T, float>) {
      return {first, lay_.pos_stride};
    } else {
      for (int64_t i = 0; i < count; ++i)
        for (int64_t c = c0; c < c0 + nc; ++c)
          store(rows + i * hd + c * kLanes, load_row(first + i * lay_.pos_stride + c * kLanes));
      return {rows, hd};
    }
  }

  const float* q_;
  int64_t qstride_, nq_, first_;
  const T *kc_, *vc_;
  const int64_t* table_;
  int64_t kv_head_;
  float scale_;
  const Layout& lay_;
  float* scores_;
  int64_t g_, longest_, stride_;
};

template <typename T, int NC>
void attend(const float* q, int64_t qstride, int64_t nq, int64_t first, const T* kc, const T* vc,
            const int64_t* table, int64_t kv_head, float scale, const Layout& lay, float* scores,
            float* out) {
  Run<T, NC> run(q, qstride, nq, first, kc, vc, table, kv_head, scale, lay, scores);
  float totals[kQueryRun * kMaxGroup];
  run.score(0, run.longest());
  run.weigh(scores, totals);
  run.template values<NC>(0, scores, totals, out);
}

template <typename T>
using AttendFn = void (*)(const float*, int64_t, int64_t, int64_t, const T*, const T*, const int64_t*,
                          int64_t, float, const Layout&, float*, float*);

// pick(std::integral_constant<int, NC>) for the head_dim's NC = head_dim / 16, or null where
// no build has that head_dim.
template <typename Pick>
auto by_head_dim(int64_t head_dim, const Pick& pick) -> decltype(pick(std::integral_constant<int, 1>{})) {
  switch (head_dim % kLanes == 0 ? head_dim / kLanes : 0) {
    case 1: return pick(std::integral_constant<int, 1>{});
    case 2: return pick(std::integral_constant<int, 2>{});
    case 4: return pick(std::integral_constant<int, 4>{});
    case 6: return pick(std::integral_constant<int, 6>{});
    case 8: return pick(std::integral_constant<int, 8>{});
    case 16: return pick(std::integral_constant<int, 16>{});
    default: return nullptr;
  }
}

template <typename T>
AttendFn<T> attend_fn(int64_t head_dim) {
  return by_head_dim(head_dim, [](auto nc) -> AttendFn<T> { return attend<T, decltype(nc)::value>; });
}

constexpr int64_t kSplitFrom = 512;  // positions; a shorter item's split costs what it saves

// Decode attention for n sequences, one query each: row r's heads at q + r * qs, its output at
// out + r * os, its length lens[r] and its block table at tables + r * width. Work items, one
// per sequence and kv head, go over torch's intra-op threads. Where there are fewer than two
// items a thread and a context of kSplitFrom positions or more, an item's scores are split
// over the threads by positions and its weighted values by columns (a barrier between the
// two), so that a batch-1 step's three kv heads keep two cores busy: each element is computed
// as `attend` computes it, so the bits are the same.
template <typename T, int NC>
void decode(const float* q, int64_t qs, float* out, int64_t os, int64_t n, const int64_t* lens,
            const T* kc, const T* vc, const int64_t* tables, int64_t width, int64_t kv_heads,
            float scale, const Layout& lay) {
  constexpr int64_t hd = NC * kLanes;
  constexpr int kParts = NC % 2 == 0 ? 2 : 1;  // column parts of an item's weighted values
  const int64_t items = n * kv_heads, g = lay.group, threads = at::get_num_threads();
  auto head = [&](int64_t item) { return (item / kv_heads) * qs + (item % kv_heads) * g * hd; };
  auto out_at = [&](int64_t item) { return out + (item / kv_heads) * os + (item % kv_heads) * g * hd; };
  auto run = [&](int64_t item, float* scores) {
    const int64_t r = item / kv_heads;
    return Run<T, NC>(q + head(item), qs, 1, lens[r], kc, vc, tables + r * width,
                      item % kv_heads, scale, lay, scores);
  };
  auto score_floats = [&](int64_t item) {
    return g * ((lens[item / kv_heads] + kLanes - 1) / kLanes * kLanes);
  };
  const int64_t longest = n == 0 ? 0 : *std::max_element(lens, lens + n);
  if (threads < 2 || items >= 2 * threads || kParts == 1 || longest < kSplitFrom) {
    at::parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> scores;
      for (int64_t item = begin; item < end; ++item) {
        const int64_t r = item / kv_heads;
        scores.resize(static_cast<size_t>(score_floats(item)));
        attend<T, NC>(q + head(item), qs, 1, lens[r], kc, vc, tables + r * width, item % kv_heads,
                      scale, lay, scores.data(), out_at(item));
      }
    });
    return;
  }
  std::vector<int64_t> offset(items + 1, 0);
  for (int64_t item = 0; item < items; ++item) offset[item + 1] = offset[item] + score_floats(item);
  std::vector<float> scores(static_cast<size_t>(offset[items]));
  at::parallel_for(0, items * threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t w = begin; w < end; ++w) {
      const int64_t item = w / threads, part = w % threads, len = lens[item / kv_heads];
      const int64_t per = ((len + threads - 1) / threads + kLanes - 1) / kLanes * kLanes;
      run(item, scores.data() + offset[item])
          .score(std::min(len, part * per), std::min(len, (part + 1) * per));
    }
  });
  at::parallel_for(0, items * kParts, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> weights;
    for (int64_t w = begin; w < end; ++w) {
      const int64_t item = w / kParts, part = w % kParts;
      weights.resize(static_cast<size_t>(score_floats(item)));
      float totals[kMaxGroup];
      const Run<T, NC> r = run(item, scores.data() + offset[item]);
      r.weigh(weights.data(), totals);
      r.template values<NC / kParts>(part * (NC / kParts), weights.data(), totals, out_at(item));
    }
  });
}

template <typename T>
using DecodeFn = void (*)(const float*, int64_t, float*, int64_t, int64_t, const int64_t*, const T*,
                          const T*, const int64_t*, int64_t, int64_t, float, const Layout&);

template <typename T>
DecodeFn<T> decode_fn(int64_t head_dim) {
  return by_head_dim(head_dim, [](auto nc) -> DecodeFn<T> { return decode<T, decltype(nc)::value>; });
}

}  // namespace attn
