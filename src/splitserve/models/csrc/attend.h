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
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

#include "vec16.h"

#if defined(SPLITSERVE_AMX)  // (vec16.h)
#include "amx.h"
#endif

namespace attn {

using namespace vec16;

constexpr int kLanes = 16;  // a Vec's; positions per span
constexpr int64_t kMaxGroup = 8;   // query heads per kv head
constexpr int64_t kQueryRun = 16;  // prefill queries per work item

struct Layout {
  int64_t block_size, block_stride, pos_stride, head_dim, group;
};

// The row at `at` of the table's block `block` in `cache`, kv head kv_head's columns (head_dim
// 16 NC).
template <int NC, typename T>
const T* cache_row(const T* cache, const int64_t* table, const Layout& lay, int64_t kv_head,
                   int64_t block, int64_t at) {
  return cache + table[block] * lay.block_stride + at * lay.pos_stride + kv_head * NC * kLanes;
}

// A run of `nq` queries of one sequence on one kv head, with NC = head_dim / 16: query q (rows
// q * qstride of `q` and `out`, its g heads contiguous) sees positions [0, first + q).
// `scores` has room for nq * g * round16(first + nq - 1) floats. What the two kinds of run
// below (Run, TileRun) share.
template <typename T, int NC, typename Q>
class RunBase {
 public:
  static constexpr int64_t hd = NC * kLanes;

  RunBase(const Q* q, int64_t qstride, int64_t nq, int64_t first, const T* kc, const T* vc,
          const int64_t* table, int64_t kv_head, float scale, const Layout& lay, float* scores)
      : q_(q), qstride_(qstride), nq_(nq), first_(first), kc_(kc), vc_(vc), table_(table),
        kv_head_(kv_head), scale_(scale), lay_(lay), scores_(scores), g_(lay.group),
        longest_(first + nq - 1), stride_((longest_ + kLanes - 1) / kLanes * kLanes) {}

  int64_t longest() const { return longest_; }

 protected:
  const T* row_at(const T* cache, int64_t block, int64_t at) const {
    return cache_row<NC>(cache, table_, lay_, kv_head_, block, at);
  }
  const T* row_of(const T* cache, int64_t p) const {
    return row_at(cache, p / lay_.block_size, p % lay_.block_size);
  }

  const Q* q_;
  int64_t qstride_, nq_, first_;
  const T *kc_, *vc_;
  const int64_t* table_;
  int64_t kv_head_;
  float scale_;
  const Layout& lay_;
  float* scores_;
  int64_t g_, longest_, stride_;
};

// The members a run takes from RunBase (a dependent base: named here once).
#define SPLITSERVE_RUN_MEMBERS(Base)                                                              \
  using Base::q_, Base::qstride_, Base::nq_, Base::first_, Base::kc_, Base::vc_, Base::table_,   \
      Base::kv_head_, Base::scale_, Base::lay_, Base::scores_, Base::g_, Base::longest_,          \
      Base::stride_, Base::row_at, Base::row_of

// Attention on 16-float vectors. `attend` below runs its three parts in order; a decode row
// with few work items to share (`decode`) runs them on several threads, each part's every
// element computed exactly as here.
template <typename T, int NC>
class Run : public RunBase<T, NC, float> {
  using Base = RunBase<T, NC, float>;
  SPLITSERVE_RUN_MEMBERS(Base);

 public:
  using Base::Base;
  using Base::hd;

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
    const T* first = row_of(cache, p);
    if constexpr (std::is_same_v<T, float>) {
      return {first, lay_.pos_stride};
    } else {
      for (int64_t i = 0; i < count; ++i)
        for (int64_t c = c0; c < c0 + nc; ++c)
          store(rows + i * hd + c * kLanes, load_row(first + i * lay_.pos_stride + c * kLanes));
      return {rows, hd};
    }
  }
};


#if defined(SPLITSERVE_AMX)
// out (16 x 16 floats, rows 16 apart) = the 16 floats at rows[i] + offset (zeros where rows[i]
// is null), i < 16, transposed: unpacks of 32 and 64 bits, then two rounds of 128-bit lane
// shuffles. (It moves 32-bit words: bfloat16 pairs as well as floats.)
inline void transpose16(const float* const rows[16], int64_t offset, float* out) {
  __m512 r[16], t[16];
  for (int i = 0; i < 16; ++i) r[i] = rows[i] ? _mm512_loadu_ps(rows[i] + offset) : _mm512_setzero_ps();
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);  // per 128-bit lane: a0 b0 a1 b1
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);  // a2 b2 a3 b3
  }
  for (int i = 0; i < 16; i += 4)  // r[i + j], lane L: column 4L + j of rows i .. i + 3
    for (int h = 0; h < 2; ++h) {
      const __m512d x = _mm512_castps_pd(t[i + h]), y = _mm512_castps_pd(t[i + h + 2]);
      r[i + 2 * h] = _mm512_castpd_ps(_mm512_unpacklo_pd(x, y));
      r[i + 2 * h + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(x, y));
    }
  for (int j = 0; j < 4; ++j) {
    const __m512 a = _mm512_shuffle_f32x4(r[j], r[4 + j], 0x44), b = _mm512_shuffle_f32x4(r[j], r[4 + j], 0xEE);
    const __m512 c = _mm512_shuffle_f32x4(r[8 + j], r[12 + j], 0x44),
                 d = _mm512_shuffle_f32x4(r[8 + j], r[12 + j], 0xEE);
    _mm512_storeu_ps(out + 16 * j, _mm512_shuffle_f32x4(a, c, 0x88));
    _mm512_storeu_ps(out + 16 * (4 + j), _mm512_shuffle_f32x4(a, c, 0xDD));
    _mm512_storeu_ps(out + 16 * (8 + j), _mm512_shuffle_f32x4(b, d, 0x88));
    _mm512_storeu_ps(out + 16 * (12 + j), _mm512_shuffle_f32x4(b, d, 0xDD));
  }
}

// A row's lines (head_dim 16 NC bfloat16), asked for early.
template <int NC>
void prefetch_row(const uint16_t* row) {
  const char* bytes = reinterpret_cast<const char*>(row);
  for (int64_t line = 0; line < NC * kLanes * 2; line += 64) _mm_prefetch(bytes + line, _MM_HINT_T1);
}

// Columns [16 c0, 16 (c0 + nd)) of kv head `kv_head`'s v rows at positions [p0, end) of a
// sequence (table: its blocks), paired into the tiles the weighted sums read: dims
// [16d, 16d + 16) at dst + (d - c0) * tile, chunk c (32 positions) at + 512 c, its row i holding
// positions 32c + 2i and 32c + 2i + 1 interleaved. Positions [rows, end) are zero (p0 and end
// even, p0 <= rows).
template <int NC>
void pair_rows(const uint16_t* vc, const int64_t* table, int64_t kv_head, const Layout& lay,
               int64_t p0, int64_t rows, int64_t end, int64_t c0, int64_t nd, uint16_t* dst,
               int64_t tile) {
  constexpr int64_t kAhead = 48;  // positions fetched ahead
  // Pairs of 16-bit lanes: a's i-th, then b's i-th.
  const __m512i mix = _mm512_setr_epi32(0x00100000, 0x00110001, 0x00120002, 0x00130003,
                                        0x00140004, 0x00150005, 0x00160006, 0x00170007,
                                        0x00180008, 0x00190009, 0x001A000A, 0x001B000B,
                                        0x001C000C, 0x001D000D, 0x001E000E, 0x001F000F);
  auto row_at = [&](int64_t block, int64_t at) { return cache_row<NC>(vc, table, lay, kv_head, block, at); };
  int64_t block = p0 / lay.block_size, at = p0 % lay.block_size;  // the next row's place
  auto next = [&]() {
    const uint16_t* row = row_at(block, at);
    if (++at == lay.block_size) at = 0, ++block;
    return row;
  };
  int64_t ahead_block = block, ahead_at = at, fetched = p0;  // rows asked for early
  auto fetch = [&]() {
    prefetch_row<NC>(row_at(ahead_block, ahead_at));
    if (++ahead_at == lay.block_size) ahead_at = 0, ++ahead_block;
    ++fetched;
  };
  while (fetched < std::min(p0 + kAhead, rows)) fetch();
  for (int64_t p = p0; p < end; p += 2) {
    for (int k = 0; k < 2 && fetched < rows; ++k) fetch();
    const uint16_t* a = p < rows ? next() : nullptr;
    const uint16_t* b = p + 1 < rows ? next() : nullptr;
    for (int64_t d = c0; d < c0 + nd; ++d) {
      const __m256i lo = a ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + d * 16))
                           : _mm256_setzero_si256();
      const __m256i hi = b ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + d * 16))
                           : _mm256_setzero_si256();
      const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
      _mm512_storeu_si512(dst + (d - c0) * tile + p * 16, _mm512_permutexvar_epi16(mix, both));
    }
  }
}

// Run's three parts for a bfloat16 cache on AMX tiles, where head_dim is a multiple of 32:
//
//   scores[j, p] = q[j] . k_p            one tile sum per 32 dims, in order (q rows times k^T,
//                                        16 positions a tile), stored unscaled
//   w[j, p]      = exp(scores[j, p] * scale - max_j), rounded to bfloat16 (weight_bits),
//                  summed in float32
//   out[j]       = (sum_p w[j, p] v_p) / sum_p w[j, p]   one tile sum per 32 positions, in
//                                                         order from position 0
//
// A position's score depends on its own q and k only, and a weighted sum on the positions
// [32c, 32c + 32) in order, the positions past the query's length weighing zero: so, as in
// Run, a query gets the same bits alone, in a prefill chunk, batched, or split over threads.
// The queries must be bfloat16 values (they are, widened, in a bfloat16 model; Q = uint16_t
// reads and writes them as bfloat16). Every tile is 16 rows x 64 bytes; rows of the score sums
// and of the weighted sums are the (query, head) pairs, 16 at a time.
template <int NC, typename Q = float>
class TileRun : public RunBase<uint16_t, NC, Q> {
  using Base = RunBase<uint16_t, NC, Q>;
  SPLITSERVE_RUN_MEMBERS(Base);

 public:
  using Base::hd;
  static constexpr int64_t kChunks = hd / 32;

  TileRun(const Q* q, int64_t qstride, int64_t nq, int64_t first, const uint16_t* kc,
          const uint16_t* vc, const int64_t* table, int64_t kv_head, float scale, const Layout& lay,
          float* scores)
      : Base(q, qstride, nq, first, kc, vc, table, kv_head, scale, lay, scores),
        pairs_(nq * lay.group), groups_((pairs_ + 15) / 16), wstride_((this->longest_ + 31) / 32 * 32) {}

  // The scores of positions [p0, p1) (p0 a multiple of 16) for every query, unscaled (weigh
  // scales them).
  void score(int64_t p0, int64_t p1) {
    configure();
    // The tiles' first operand: the (query, head) pairs' q rows in bfloat16, 16 pairs a group
    // (zero past the last pair).
    thread_local std::vector<uint16_t> qrows;
    qrows.resize(static_cast<size_t>(groups_ * 16 * hd));
    for (int64_t pair = 0; pair < pairs_; ++pair) {
      const Q* row = q_ + (pair / g_) * qstride_ + (pair % g_) * hd;
      for (int64_t c = 0; c < NC; ++c) store_bf16(qrows.data() + pair * hd + c * kLanes, load_row(row + c * kLanes));
    }
    std::memset(qrows.data() + pairs_ * hd, 0, (groups_ * 16 - pairs_) * hd * 2);
    // The second: k^T, for chunk c row i holding dims 32c + 2i and 32c + 2i + 1 of the span's 16
    // positions (zero past its last).
    alignas(64) uint16_t kt[kChunks * 512];
    alignas(64) float sums[16 * 16];
    const float* rows[16];
    int64_t block = p0 / lay_.block_size, at = p0 % lay_.block_size;  // position p's place
    for (int64_t p = p0; p < p1; p += 16) {
      const int64_t n = std::min<int64_t>(16, p1 - p);
      for (int64_t i = 0; i < 16; ++i) {
        rows[i] = i < n ? reinterpret_cast<const float*>(row_at(kc_, block, at)) : nullptr;
        if (i < n && ++at == lay_.block_size) at = 0, ++block;
      }
      for (int64_t i = p + 16; i < std::min(p + 32, p1); ++i) prefetch_row<NC>(row_of(kc_, i));
      for (int64_t c = 0; c < kChunks; ++c) transpose16(rows, c * 16, reinterpret_cast<float*>(kt + c * 512));
      for (int64_t t0 = 0; t0 < groups_; t0 += 4) {
        const int64_t nt = std::min<int64_t>(4, groups_ - t0);
        const uint16_t* a = qrows.data() + t0 * 16 * hd;
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t c = 0; c < kChunks; ++c) {
          _tile_loadd(6, kt + c * 512, 64);
          _tile_loadd(4, a + c * 32, hd * 2);
          _tile_dpbf16ps(0, 4, 6);
          if (nt > 1) {
            _tile_loadd(5, a + 16 * hd + c * 32, hd * 2);
            _tile_dpbf16ps(1, 5, 6);
          }
          if (nt > 2) {
            _tile_loadd(4, a + 32 * hd + c * 32, hd * 2);
            _tile_dpbf16ps(2, 4, 6);
          }
          if (nt > 3) {
            _tile_loadd(5, a + 48 * hd + c * 32, hd * 2);
            _tile_dpbf16ps(3, 5, 6);
          }
        }
        for (int64_t k = 0; k < nt; ++k) {
          const int64_t t = t0 + k, last = std::min<int64_t>(16, pairs_ - t * 16);
          float* dst = scores_ + t * 16 * stride_ + p;
          if (last == 16) {
            store_sums(k, dst, stride_ * 4);
          } else {
            store_sums(k, sums, 64);
            for (int64_t row = 0; row < last; ++row) storeu(dst + row * stride_, load(sums + row * 16));
          }
        }
      }
    }
  }

  // The weights, rounded to bfloat16, into the run's own buffer (w is not used), and each
  // head's total of them into totals[r * g + j].
  void weigh(float*, float* totals) {
    thread_local std::vector<uint16_t> w;
    w.resize(static_cast<size_t>(groups_ * 16 * wstride_));
    weights_ = w.data();
    std::memset(weights_ + pairs_ * wstride_, 0, (groups_ * 16 - pairs_) * wstride_ * 2);
    for (int64_t pair = 0; pair < pairs_; ++pair) {
      const int64_t len = first_ + pair / g_;
      const float* s = scores_ + pair * stride_;
      uint16_t* out = weights_ + pair * wstride_;
      // The largest scaled score is the largest score scaled (scaling by scale > 0 keeps the
      // order, and its rounding too).
      const int64_t full = len / kLanes * kLanes;
      const Mask tail = first_lanes(len - full);
      Vec best = set1(-__builtin_inff());
      for (int64_t p = 0; p < full; p += kLanes) best = max(best, loadu(s + p));
      if (tail != 0) best = max_first(best, tail, loadu(s + full));
      const Vec scale = set1(scale_), top = set1(reduce_max(best) * scale_);
      Vec total = zero();
      for (int64_t p = 0; p < full; p += kLanes) {
        const __m256i bits = weight_bits(0xFFFF, sub(mul(loadu(s + p), scale), top));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + p), bits);
        total = add(total, widen_bf16(bits));
      }
      int64_t p = full;
      if (tail != 0) {  // lanes past len weigh zero
        const __m256i bits = weight_bits(tail, sub(mul(load_first(tail, s + p), scale), top));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + p), bits);
        total = add(total, widen_bf16(bits));
        p += kLanes;
      }
      std::memset(out + p, 0, (wstride_ - p) * 2);
      totals[pair] = reduce_add(total);
    }
  }

  // Output columns [16 c0, 16 (c0 + NP)) of every query and head (after weigh, on this thread).
  template <int NP>
  void values(int64_t c0, const float*, const float* totals, Q* out) {
    const int64_t tile = wstride_ / 32 * 512;
    thread_local std::vector<uint16_t> vt;
    vt.resize(static_cast<size_t>(NP * tile));
    pair_rows<NC>(vc_, table_, kv_head_, lay_, 0, longest_, wstride_, c0, NP, vt.data(), tile);
    values_from<NP>(c0, vt.data(), tile, totals, out);
  }

  // values' sums over v paired into tiles already (pair_rows, columns [16 c0, 16 (c0 + NP))
  // at vt, `tile` elements apart, covering positions [0, wstride)).
  template <int NP>
  void values_from(int64_t c0, const uint16_t* vt, int64_t tile, const float* totals, Q* out) {
    configure();
    const int64_t chunks = wstride_ / 32;
    alignas(64) float sums[16 * 16];
    float inv[kQueryRun * kMaxGroup];
    for (int64_t pair = 0; pair < pairs_; ++pair) inv[pair] = 1.0f / totals[pair];
    // Up to four column tiles at a time (sums in tiles 0-3), each group's weights loaded once
    // a chunk for all of them.
    for (int64_t d0 = c0; d0 < c0 + NP; d0 += 4) {
      const int64_t nd = std::min<int64_t>(4, c0 + NP - d0);
      const uint16_t* vd = vt + (d0 - c0) * tile;
      for (int64_t t = 0; t < groups_; ++t) {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t c = 0; c < chunks; ++c) {
          _tile_loadd(4, weights_ + t * 16 * wstride_ + c * 32, wstride_ * 2);
          _tile_loadd(5, vd + c * 512, 64);
          _tile_dpbf16ps(0, 4, 5);
          if (nd > 1) {
            _tile_loadd(6, vd + tile + c * 512, 64);
            _tile_dpbf16ps(1, 4, 6);
          }
          if (nd > 2) {
            _tile_loadd(5, vd + 2 * tile + c * 512, 64);
            _tile_dpbf16ps(2, 4, 5);
          }
          if (nd > 3) {
            _tile_loadd(6, vd + 3 * tile + c * 512, 64);
            _tile_dpbf16ps(3, 4, 6);
          }
        }
        for (int64_t k = 0; k < nd; ++k) {
          store_sums(k, sums, 64);
          for (int64_t row = 0; row < 16 && t * 16 + row < pairs_; ++row) {
            const int64_t pair = t * 16 + row;
            store_n(out + (pair / g_) * qstride_ + (pair % g_) * hd + (d0 + k) * kLanes, kLanes,
                    mul(load(sums + row * 16), set1(inv[pair])));
          }
        }
      }
    }
  }

 private:
  // exp(x) for x <= 0 in the lanes of m, as bfloat16 bits (zero elsewhere): 2^n 2^f with
  // n = round(x log2 e) and a degree-4 fit of 2^f on [-1/2, 1/2] (relative error 2.7e-6, far
  // below bfloat16's 2^-9), rounded to nearest even. The rounding flushes subnormals to zero:
  // a weight below 2^-126 adds nothing to a total of at least 1, and the tiles' products read
  // a subnormal as zero.
  static __m256i weight_bits(Mask m, Vec x) {
    const Vec t = mul(max(x, set1(-104.0f)), set1(1.44269504088896341f));
    const Vec n = round_nearest(t), f = sub(t, n);
    Vec e = set1(9.560510516166687e-3f);
    e = fmadd(e, f, set1(5.591703951358795e-2f));
    e = fmadd(e, f, set1(2.4024981260299683e-1f));
    e = fmadd(e, f, set1(6.931219696998596e-1f));
    e = fmadd(e, f, set1(9.999991655349731e-1f));
    return reinterpret_cast<__m256i>(_mm512_maskz_cvtneps_pbh(m, scale_by_pow2(e, n)));
  }
  // Every tile 16 rows x 64 bytes: 0 score sums, 1 k rows, 2 q^T; 0-3 weighted sums, 4
  // weights, 5-6 v rows (paired). Loaded on every call: amx.h's products release the tiles.
  static void configure() {
    amx::TileConfig c;
    for (int i = 0; i < 7; ++i) c.rows[i] = 16, c.colsb[i] = 64;
    _tile_loadconfig(&c);
  }
  // Tile k's (< 4) float32 sums (16 rows of 16) into `sums`, rows `bytes` apart.
  static void store_sums(int64_t k, float* sums, int64_t bytes) {
    switch (k) {
      case 0: _tile_stored(0, sums, bytes); break;
      case 1: _tile_stored(1, sums, bytes); break;
      case 2: _tile_stored(2, sums, bytes); break;
      default: _tile_stored(3, sums, bytes); break;
    }
  }
  int64_t pairs_, groups_, wstride_;
  uint16_t* weights_ = nullptr;
};

// Whether a run of T rows with head_dim 16 NC takes the tiles.
template <typename T, int NC>
bool tiles_for() {
  if constexpr (std::is_same_v<T, uint16_t> && NC % 2 == 0) return amx::ready();
  return false;
}
#else
template <typename T, int NC>
bool tiles_for() {
  return false;
}
#endif
#undef SPLITSERVE_RUN_MEMBERS  // Run and TileRun took their members

template <typename T, int NC>
void attend(const float* q, int64_t qstride, int64_t nq, int64_t first, const T* kc, const T* vc,
            const int64_t* table, int64_t kv_head, float scale, const Layout& lay, float* scores,
            float* out) {
  float totals[kQueryRun * kMaxGroup];
#if defined(SPLITSERVE_AMX)
  if constexpr (std::is_same_v<T, uint16_t> && NC % 2 == 0) {
    if (tiles_for<T, NC>()) {
      TileRun<NC> run(q, qstride, nq, first, kc, vc, table, kv_head, scale, lay, scores);
      run.score(0, run.longest());
      run.weigh(scores, totals);
      run.template values<NC>(0, scores, totals, out);
      return;
    }
  }
#endif
  Run<T, NC> run(q, qstride, nq, first, kc, vc, table, kv_head, scale, lay, scores);
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

// A prefill chunk: n queries of one sequence at positions [start, start + n), query i's heads at
// q + i * qs and its output at out + i * qs, the chunk's own K/V in the cache already. Work
// items, one per run of kQueryRun queries and kv head, go over torch's intra-op threads. Where
// the tiles take the rows, each kv head's v is paired into tiles once for the whole chunk
// (pair_rows), and every run reads its positions from there; q and out may then be bfloat16
// (Q = uint16_t: the values a float32 q and out would hold, rounded as torch rounds).
template <typename T, int NC, typename Q>
void prefill(const Q* q, int64_t qs, int64_t n, int64_t start, const T* kc, const T* vc,
             const int64_t* table, int64_t kv_heads, float scale, const Layout& lay, Q* out) {
  constexpr int64_t hd = NC * kLanes;
  const int64_t runs = (n + kQueryRun - 1) / kQueryRun, g = lay.group;
  // Later runs see more positions: runs are dealt from both ends, so that the contiguous
  // ranges at::parallel_for hands each thread carry similar work.
  auto each_run = [&](auto&& attend_run) {
    at::parallel_for(0, runs * kv_heads, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> scores;
      for (int64_t item = begin; item < end; ++item) {
        const int64_t kh = item % kv_heads, k = item / kv_heads;
        const int64_t run = k % 2 == 0 ? k / 2 : runs - 1 - k / 2;
        const int64_t q0 = run * kQueryRun, nq = std::min(kQueryRun, n - q0);
        const int64_t longest = start + q0 + nq;
        scores.resize(static_cast<size_t>(nq * g * ((longest + kLanes - 1) / kLanes * kLanes)));
        const int64_t row = q0 * qs + kh * g * hd;
        attend_run(q + row, nq, start + q0 + 1, kh, scores.data(), out + row);
      }
    });
  };
#if defined(SPLITSERVE_AMX)
  if constexpr (std::is_same_v<T, uint16_t> && NC % 2 == 0) {
    if (tiles_for<T, NC>()) {
      const int64_t chunks = (start + n + 31) / 32, tile = chunks * 512;
      std::vector<uint16_t> vt(static_cast<size_t>(kv_heads * NC * tile));
      at::parallel_for(0, kv_heads * chunks, 8, [&](int64_t begin, int64_t end) {
        for (int64_t item = begin; item < end; ++item) {
          const int64_t kh = item / chunks, p0 = item % chunks * 32;
          pair_rows<NC>(vc, table, kh, lay, p0, std::min(start + n, p0 + 32), p0 + 32, 0, NC,
                        vt.data() + kh * NC * tile, tile);
        }
      });
      each_run([&](const Q* qr, int64_t nq, int64_t first, int64_t kh, float* scores, Q* o) {
        float totals[kQueryRun * kMaxGroup];
        TileRun<NC, Q> run(qr, qs, nq, first, kc, vc, table, kh, scale, lay, scores);
        run.score(0, run.longest());
        run.weigh(scores, totals);
        run.template values_from<NC>(0, vt.data() + kh * NC * tile, tile, totals, o);
      });
      return;
    }
  }
#endif
  if constexpr (std::is_same_v<Q, float>) {
    each_run([&](const float* qr, int64_t nq, int64_t first, int64_t kh, float* scores, float* o) {
      attend<T, NC>(qr, qs, nq, first, kc, vc, table, kh, scale, lay, scores, o);
    });
  }
}

template <typename T, typename Q>
using PrefillFn = void (*)(const Q*, int64_t, int64_t, int64_t, const T*, const T*, const int64_t*,
                           int64_t, float, const Layout&, Q*);

// prefill for this head_dim; for bfloat16 q and out (Q = uint16_t) only where the tiles take
// the rows, null elsewhere.
template <typename T, typename Q = float>
PrefillFn<T, Q> prefill_fn(int64_t head_dim) {
  return by_head_dim(head_dim, [](auto nc) -> PrefillFn<T, Q> {
    constexpr int NC = decltype(nc)::value;
    if constexpr (std::is_same_v<Q, float>) return prefill<T, NC, Q>;
    return tiles_for<T, NC>() ? prefill<T, NC, Q> : nullptr;
  });
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
  // Runs of type R (Run, or TileRun where the tiles take these rows) split over the threads.
  auto split = [&](auto* kind) {
    using R = std::remove_pointer_t<decltype(kind)>;
    auto run = [&](int64_t item, float* scores) {
      const int64_t r = item / kv_heads;
      return R(q + head(item), qs, 1, lens[r], kc, vc, tables + r * width, item % kv_heads, scale,
               lay, scores);
    };
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
        R r = run(item, scores.data() + offset[item]);
        r.weigh(weights.data(), totals);
        r.template values<NC / kParts>(part * (NC / kParts), weights.data(), totals, out_at(item));
      }
    });
  };
#if defined(SPLITSERVE_AMX)
  if constexpr (std::is_same_v<T, uint16_t> && NC % 2 == 0) {
    if (tiles_for<T, NC>()) return split(static_cast<TileRun<NC>*>(nullptr));
  }
#endif
  split(static_cast<Run<T, NC>*>(nullptr));
}

template <typename T>
using DecodeFn = void (*)(const float*, int64_t, float*, int64_t, int64_t, const int64_t*, const T*,
                          const T*, const int64_t*, int64_t, int64_t, float, const Layout&);

template <typename T>
DecodeFn<T> decode_fn(int64_t head_dim) {
  return by_head_dim(head_dim, [](auto nc) -> DecodeFn<T> { return decode<T, decltype(nc)::value>; });
}

}  // namespace attn
