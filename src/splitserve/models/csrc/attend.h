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


#if defined(SPLITSERVE_AMX)
// out (16 x 16 floats) = in (16 x 16 floats) transposed: unpacks of 32 and 64 bits, then two
// rounds of 128-bit lane shuffles.
inline void transpose16(const float* in, float* out) {
  __m512 r[16], t[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_load_ps(in + 16 * i);
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
    _mm512_store_ps(out + 16 * j, _mm512_shuffle_f32x4(a, c, 0x88));
    _mm512_store_ps(out + 16 * (4 + j), _mm512_shuffle_f32x4(a, c, 0xDD));
    _mm512_store_ps(out + 16 * (8 + j), _mm512_shuffle_f32x4(b, d, 0x88));
    _mm512_store_ps(out + 16 * (12 + j), _mm512_shuffle_f32x4(b, d, 0xDD));
  }
}

// Run's three parts for a bfloat16 cache on AMX tiles, where head_dim is a multiple of 32:
//
//   scores[j, p] = (q[j] . k_p) * scale   one tile sum per 32 dims, in order (k rows read in
//                                         place: the tile's rows are 16 positions)
//   w[j, p]      = exp(scores[j, p] - max_j), rounded to bfloat16, summed in float32
//   out[j]       = (sum_p w[j, p] v_p) / sum_p w[j, p]   one tile sum per 32 positions, in
//                                                         order from position 0
//
// A position's score depends on its own q and k only, and a weighted sum on the positions
// [32c, 32c + 32) in order, the positions past the query's length weighing zero: so, as in
// Run, a query gets the same bits alone, in a prefill chunk, batched, or split over threads.
// The queries must be bfloat16 values (they are, widened, in a bfloat16 model). Every tile is
// 16 rows x 64 bytes; columns of the score sums and rows of the weighted sums are the
// (query, head) pairs, 16 at a time.
template <int NC>
class TileRun {
 public:
  static constexpr int64_t hd = NC * kLanes, kChunks = hd / 32;
  static constexpr int64_t kAhead = 48;  // positions of v fetched ahead

  TileRun(const float* q, int64_t qstride, int64_t nq, int64_t first, const uint16_t* kc,
          const uint16_t* vc, const int64_t* table, int64_t kv_head, float scale, const Layout& lay,
          float* scores)
      : q_(q), qstride_(qstride), nq_(nq), first_(first), kc_(kc), vc_(vc), table_(table),
        kv_head_(kv_head), scale_(scale), lay_(lay), scores_(scores), g_(lay.group),
        longest_(first + nq - 1), stride_((longest_ + kLanes - 1) / kLanes * kLanes),
        pairs_(nq * lay.group), groups_((pairs_ + 15) / 16),
        wstride_((longest_ + 31) / 32 * 32) {}

  int64_t longest() const { return longest_; }

  // The scores of positions [p0, p1) (p0 a multiple of 16) for every query.
  void score(int64_t p0, int64_t p1) {
    configure();
    // q^T as the tiles' second operand: for group t and chunk c, row i holds dims 32c + 2i and
    // 32c + 2i + 1 of the group's 16 (query, head) pairs (zero past the last pair).
    thread_local std::vector<uint16_t> qt;
    qt.assign(static_cast<size_t>(groups_ * kChunks * 512), 0);
    for (int64_t pair = 0; pair < pairs_; ++pair) {
      const float* row = q_ + (pair / g_) * qstride_ + (pair % g_) * hd;
      uint16_t* tile = qt.data() + (pair / 16) * kChunks * 512;
      alignas(64) uint16_t bits[hd];
      for (int64_t c = 0; c < NC; ++c) store_bf16(bits + c * kLanes, loadu(row + c * kLanes));
      for (int64_t d = 0; d < hd; ++d)
        tile[(d / 32) * 512 + ((d % 32) / 2) * 32 + (pair % 16) * 2 + d % 2] = bits[d];
    }
    alignas(64) uint16_t gathered[16 * hd];
    alignas(64) float sums[16 * 16], columns[16 * 16];
    const __m512i lanes = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10,
                                                                11, 12, 13, 14, 15),
                                             _mm512_set1_epi32(16));
    for (int64_t p = p0; p < p1; p += 16 - p % 16) {
      const int64_t n = std::min(16 - p % 16, p1 - p);
      for (int64_t i = p + 16; i < std::min(p + 32, p1); ++i) prefetch(row_of(kc_, i));
      const uint16_t* rows = row_of(kc_, p);
      int64_t step = lay_.pos_stride * 2;
      if (n != 16 || p % lay_.block_size + 16 > lay_.block_size) {  // gather, zero-padded
        for (int64_t i = 0; i < 16; ++i) {
          if (i < n)
            std::memcpy(gathered + i * hd, row_of(kc_, p + i), hd * 2);
          else
            std::memset(gathered + i * hd, 0, hd * 2);
        }
        rows = gathered, step = hd * 2;
      }
      for (int64_t t = 0; t < groups_; ++t) {
        _tile_zero(0);
        for (int64_t c = 0; c < kChunks; ++c) {
          _tile_loadd(1, rows + c * 32, step);
          _tile_loadd(2, qt.data() + (t * kChunks + c) * 512, 64);
          _tile_dpbf16ps(0, 1, 2);
        }
        _tile_stored(0, sums, 64);
        const Vec s = set1(scale_);
        const int64_t cols = std::min<int64_t>(16, pairs_ - t * 16);
        if (cols > 4) transpose16(sums, columns);  // else a gather a column
        for (int64_t col = 0; col < cols; ++col) {
          const Vec v = cols > 4 ? load(columns + col * 16)
                                 : _mm512_i32gather_ps(_mm512_add_epi32(lanes, _mm512_set1_epi32(col)), sums, 4);
          store_n(scores_ + (t * 16 + col) * stride_ + p, n, mul(v, s));
        }
      }
    }
  }

  // The weights, rounded to bfloat16, into the run's own buffer (w is not used), and each
  // head's total of them into totals[r * g + j].
  void weigh(float*, float* totals) {
    thread_local std::vector<uint16_t> w;
    w.assign(static_cast<size_t>(groups_ * 16 * wstride_), 0);
    weights_ = w.data();
    for (int64_t pair = 0; pair < pairs_; ++pair) {
      const int64_t len = first_ + pair / g_;
      const float* s = scores_ + pair * stride_;
      uint16_t* out = weights_ + pair * wstride_;
      Vec best = set1(-__builtin_inff());
      for (int64_t p = 0; p < len; p += kLanes) best = max_first(best, first_lanes(len - p), loadu(s + p));
      const Vec top = set1(reduce_max(best));
      Vec total = zero();
      for (int64_t p = 0; p < len; p += kLanes) {
        const Mask m = first_lanes(len - p);
        store_n(out + p, len - p, exp_nonpositive(sub(load_first(m, s + p), top)));
        total = add_first(total, m, load_n(out + p, len - p));
      }
      totals[pair] = reduce_add(total);
    }
  }

  // Output columns [16 c0, 16 (c0 + NP)) of every query and head (after weigh, on this thread).
  template <int NP>
  void values(int64_t c0, const float*, const float* totals, float* out) {
    configure();
    const int64_t chunks = wstride_ / 32, tile = chunks * 512;
    thread_local std::vector<uint16_t> vt;
    vt.resize(static_cast<size_t>(NP * tile));
    alignas(64) float sums[16 * 16];
    // Pairs of 16-bit lanes: a's i-th, then b's i-th.
    const __m512i mix = _mm512_setr_epi32(0x00100000, 0x00110001, 0x00120002, 0x00130003,
                                          0x00140004, 0x00150005, 0x00160006, 0x00170007,
                                          0x00180008, 0x00190009, 0x001A000A, 0x001B000B,
                                          0x001C000C, 0x001D000D, 0x001E000E, 0x001F000F);
    // v's dims [16d, 16d + 16) as tiles (vt + (d - c0) * tile): row i of chunk c holds
    // positions 32c + 2i and 32c + 2i + 1, interleaved (zero past the longest query's length).
    int64_t block = 0, at = 0;  // position p's block in the table and its row there
    auto next = [&]() {
      const uint16_t* row = row_at(vc_, block, at);
      if (++at == lay_.block_size) at = 0, ++block;
      return row;
    };
    int64_t ahead_block = 0, ahead_at = 0;  // kAhead positions on: fetched early
    auto fetch = [&]() {
      prefetch(row_at(vc_, ahead_block, ahead_at));
      if (++ahead_at == lay_.block_size) ahead_at = 0, ++ahead_block;
    };
    int64_t fetched = 0;
    for (; fetched < std::min<int64_t>(kAhead, longest_); ++fetched) fetch();
    for (int64_t p = 0; p < wstride_; p += 2) {
      for (int k = 0; k < 2 && fetched < longest_; ++k, ++fetched) fetch();
      const uint16_t* a = p < longest_ ? next() : nullptr;
      const uint16_t* b = p + 1 < longest_ ? next() : nullptr;
      for (int64_t d = c0; d < c0 + NP; ++d) {
        const __m256i lo = a ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + d * 16))
                             : _mm256_setzero_si256();
        const __m256i hi = b ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + d * 16))
                             : _mm256_setzero_si256();
        const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
        _mm512_storeu_si512(vt.data() + (d - c0) * tile + p * 16, _mm512_permutexvar_epi16(mix, both));
      }
    }
    for (int64_t d = c0; d < c0 + NP; ++d) {
      const uint16_t* vd = vt.data() + (d - c0) * tile;
      for (int64_t t = 0; t < groups_; ++t) {
        _tile_zero(3);
        for (int64_t c = 0; c < chunks; ++c) {
          _tile_loadd(4, weights_ + t * 16 * wstride_ + c * 32, wstride_ * 2);
          _tile_loadd(5, vd + c * 512, 64);
          _tile_dpbf16ps(3, 4, 5);
        }
        _tile_stored(3, sums, 64);
        for (int64_t row = 0; row < 16 && t * 16 + row < pairs_; ++row) {
          const int64_t pair = t * 16 + row;
          const Vec inv = set1(1.0f / totals[pair]);
          storeu(out + (pair / g_) * qstride_ + (pair % g_) * hd + d * kLanes,
                 mul(load(sums + row * 16), inv));
        }
      }
    }
  }

 private:
  // Every tile 16 rows x 64 bytes: 0 score sums, 1 k rows, 2 q^T, 3 weighted sums, 4 weights,
  // 5 v rows (paired). Loaded on every call: amx.h's products release the tiles.
  static void configure() {
    amx::TileConfig c;
    for (int i = 0; i < 6; ++i) c.rows[i] = 16, c.colsb[i] = 64;
    _tile_loadconfig(&c);
  }
  // The row at `at` of the table's block `block` in `cache` (this run's kv head's columns).
  const uint16_t* row_at(const uint16_t* cache, int64_t block, int64_t at) const {
    return cache + table_[block] * lay_.block_stride + at * lay_.pos_stride + kv_head_ * hd;
  }
  const uint16_t* row_of(const uint16_t* cache, int64_t p) const {
    return row_at(cache, p / lay_.block_size, p % lay_.block_size);
  }
  // A row's lines, asked for early.
  static void prefetch(const uint16_t* row) {
    const char* bytes = reinterpret_cast<const char*>(row);
    for (int64_t line = 0; line < hd * 2; line += 64) _mm_prefetch(bytes + line, _MM_HINT_T1);
  }

  const float* q_;
  int64_t qstride_, nq_, first_;
  const uint16_t *kc_, *vc_;
  const int64_t* table_;
  int64_t kv_head_;
  float scale_;
  const Layout& lay_;
  float* scores_;
  int64_t g_, longest_, stride_, pairs_, groups_, wstride_;
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
