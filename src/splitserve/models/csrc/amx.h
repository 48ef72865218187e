// y = x W^T (+ bias) for bfloat16 on AMX tiles: the product of amx_linear.cpp
// (splitserve::amx_linear, models/amx_linear.py) and of decode_step.cpp's bfloat16 step.
//
// The weight [N, K] is packed once into tiles [N / 16, K / 32, 16, 32]: tile (p, c) holds
// output columns [16p, 16p + 16) times input features [32c, 32c + 32) as 16 rows of feature
// pairs, each row 16 columns x 2 features (the layout TDPBF16PS reads its second operand in).
//
// Each output element is one float32 sum from zero: a TDPBF16PS per 32 features, in the order
// c = 0, 1, ..., then + bias, rounded once to bfloat16 (to nearest even). A tile's rows are
// computed independently of each other, so a row gets the same bits alone or among any others,
// whatever the row count, the blocking and the thread count. Column panels go over torch's
// intra-op threads (at::parallel_for); a thread runs up to 32 rows x 32 columns a pass (four
// accumulator tiles, two of x, two of the weight).
#pragma once

#include <ATen/Parallel.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>

#include "rows.h"
#include "vec16.h"

#if !defined(SPLITSERVE_AMX)
#error "amx.h needs AMX-TILE, AMX-BF16 and the AVX-512 build"
#endif

namespace amx {

using namespace vec16;

constexpr int64_t kCols = 16;  // a tile's output columns
constexpr int64_t kDepth = 32;  // a tile's input features (16 pairs)
constexpr int64_t kTileRows = 16;
constexpr int64_t kGroupBytes = 1 << 20;  // weight a thread keeps in its cache over row blocks

// The memory layout LDTILECFG reads (palette 1).
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles: 0-3 sums (rows block r, column panel j at 2r + j), 4-5 x, 6-7 the weight.
inline TileConfig config(int rows0, int rows1) {
  TileConfig c;
  const int rows[2] = {rows0, rows1};
  for (int r = 0; r < 2; ++r) {
    const int n = std::max(rows[r], 1);  // an unused block keeps a valid shape
    for (int j = 0; j < 2; ++j) {
      c.rows[2 * r + j] = n;
      c.colsb[2 * r + j] = kCols * 4;
    }
    c.rows[4 + r] = n;
    c.colsb[4 + r] = kDepth * 2;
  }
  for (int j = 6; j < 8; ++j) {
    c.rows[j] = kDepth / 2;
    c.colsb[j] = kCols * 4;
  }
  return c;
}

// The float32 sums of one tile (rows x 16, row stride 16) plus bias, rounded into y; where
// add_to, y += them instead, as a bfloat16 add (the rounded sum widened, added, rounded again).
inline void emit(const float* sums, int rows, const float* bias, uint16_t* y, int64_t ys,
                 bool add_to) {
  const Vec b = bias == nullptr ? zero() : loadu(bias);
  for (int r = 0; r < rows; ++r) {
    const Vec v = add(loadu(sums + r * kCols), b);
    store_bf16(y + r * ys, add_to ? add(load_bf16(y + r * ys), round_to_bf16(v)) : v);
  }
}

// A gate/up block's float32 sums, stored from its accumulator tiles, waiting to be turned into
// silu(gate) * up rows of y (each sum rounded to bfloat16 first: the bits silu_mul gets from
// the two products). The next block's products run on the tiles meanwhile, and between its
// feature chunks `drain` computes a few of these rows, so that the vector units work while the
// tile unit does: the exp and the division of a row cost about what its products do.
struct SiluRows {
  alignas(64) float gate[2][kTileRows * kCols], up[2][kTileRows * kCols];  // per rows block
  uint16_t* y[2];
  int rows[2] = {0, 0};
  int64_t ys = 0;
  int left = 0, block = 0, row = 0;  // rows still to compute; the next one

  // Computes up to n more rows.
  void drain(int n) {
    for (n = std::min(n, left), left -= n; n > 0; --n) {
      store_bf16(y[block] + row * ys,
                 rows::silu_times(round_to_bf16(loadu(gate[block] + row * kCols)),
                                  round_to_bf16(loadu(up[block] + row * kCols))));
      if (++row == rows[block]) ++block, row = 0;
    }
  }
};

// Rows [0, rows0 + rows1) of x (rows1 may be 0) times panel p and, where W = 2, the panel
// `second` elements on (the next one, or up's beside gate's where kSilu), into y: both
// panels' columns, or silu(gate) * up where kSilu. Where kSilu, the rows go through `pending`,
// and the previous block's are computed meanwhile.
template <int W, bool kSilu = false>
void block(const uint16_t* x, int64_t K, int rows0, int rows1, const uint16_t* tiles,
           int64_t second, const float* bias, uint16_t* y, int64_t N, bool add_to,
           SiluRows* pending = nullptr) {
  static_assert(!kSilu || W == 2);
  const int64_t chunks = K / kDepth, xs = K * 2;
  const uint16_t* x1 = x + kTileRows * K;
  const int per_chunk = kSilu ? static_cast<int>((pending->left + chunks - 1) / chunks) : 0;
  _tile_zero(0);
  if (W == 2) _tile_zero(1);
  if (rows1 > 0) {
    _tile_zero(2);
    if (W == 2) _tile_zero(3);
  }
  for (int64_t c = 0; c < chunks; ++c) {
    const uint16_t* w = tiles + c * kTileRows * kDepth;
    _tile_loadd(4, x + c * kDepth, xs);
    _tile_loadd(6, w, kCols * 4);
    if (W == 2) _tile_loadd(7, w + second, kCols * 4);
    _tile_dpbf16ps(0, 4, 6);
    if (W == 2) _tile_dpbf16ps(1, 4, 7);
    if (rows1 > 0) {
      _tile_loadd(5, x1 + c * kDepth, xs);
      _tile_dpbf16ps(2, 5, 6);
      if (W == 2) _tile_dpbf16ps(3, 5, 7);
    }
    if constexpr (kSilu) pending->drain(per_chunk);
  }
  const int64_t step = kCols * 4;
  if constexpr (kSilu) {
    pending->drain(pending->left);
    _tile_stored(0, pending->gate[0], step);
    _tile_stored(1, pending->up[0], step);
    if (rows1 > 0) {
      _tile_stored(2, pending->gate[1], step);
      _tile_stored(3, pending->up[1], step);
    }
    pending->y[0] = y, pending->y[1] = y + kTileRows * N, pending->ys = N;
    pending->rows[0] = rows0, pending->rows[1] = rows1;
    pending->left = rows0 + rows1, pending->block = pending->row = 0;
    return;
  }
  alignas(64) float sums[kTileRows * kCols];
  _tile_stored(0, sums, step);
  emit(sums, rows0, bias, y, N, add_to);
  if (W == 2) {
    _tile_stored(1, sums, step);
    emit(sums, rows0, bias == nullptr ? nullptr : bias + kCols, y + kCols, N, add_to);
  }
  if (rows1 > 0) {
    uint16_t* y1 = y + kTileRows * N;
    _tile_stored(2, sums, step);
    emit(sums, rows1, bias, y1, N, add_to);
    if (W == 2) {
      _tile_stored(3, sums, step);
      emit(sums, rows1, bias == nullptr ? nullptr : bias + kCols, y1 + kCols, N, add_to);
    }
  }
}

// y [M, N] = x [M, K] times tiles [N / 16, K / 32, 16, 32] (+ bias [N] float32 unless null);
// where kSilu, the tiles are gate's panels then up's (N = 2 I, no bias) and y [M, I] =
// silu(x gate^T) * (x up^T); where add_to, y += the product (a bfloat16 add). A thread takes
// its panel pairs (gate's and up's of the same columns where kSilu) in groups of about
// kGroupBytes of weight, and runs every row block over a group before the next: the weight
// then comes from memory once, and from the cache for the other row blocks.
template <bool kSilu = false>
void product(const uint16_t* x, int64_t M, int64_t K, const uint16_t* tiles, int64_t N,
             const float* bias, uint16_t* y, bool add_to = false) {
  const int64_t P = N / kCols, pairs = (P + 1) / 2, panel = K / kDepth * kTileRows * kDepth;
  const int64_t group = std::max<int64_t>(1, kGroupBytes / (4 * panel));
  const int64_t ys = kSilu ? N / 2 : N;
  at::parallel_for(0, pairs, 1, [&](int64_t begin, int64_t end) {
    int loaded = -1;  // the (rows0, rows1) the thread's tile config holds
    SiluRows pending;
    for (int64_t g0 = begin; g0 < end; g0 += group) {
      const int64_t g1 = std::min(end, g0 + group);
      for (int64_t m0 = 0; m0 < M; m0 += 2 * kTileRows) {
        const int rows0 = static_cast<int>(std::min(kTileRows, M - m0));
        const int rows1 = static_cast<int>(std::clamp<int64_t>(M - m0 - kTileRows, 0, kTileRows));
        if (rows0 * 32 + rows1 != loaded) {
          const TileConfig c = config(rows0, rows1);
          _tile_loadconfig(&c);
          loaded = rows0 * 32 + rows1;
        }
        for (int64_t q = g0; q < g1; ++q) {
          if constexpr (kSilu) {
            block<2, true>(x + m0 * K, K, rows0, rows1, tiles + q * panel, pairs * panel, nullptr,
                           y + m0 * ys + q * kCols, ys, false, &pending);
            continue;
          }
          const int64_t p = 2 * q, col = p * kCols;
          const float* b = bias == nullptr ? nullptr : bias + col;
          if (p + 1 < P)
            block<2>(x + m0 * K, K, rows0, rows1, tiles + p * panel, panel, b, y + m0 * N + col, N,
                     add_to);
          else
            block<1>(x + m0 * K, K, rows0, rows1, tiles + p * panel, panel, b, y + m0 * N + col, N,
                     add_to);
        }
      }
    }
    pending.drain(pending.left);
    _tile_release();
  });
}

// Asks Linux for the AMX tile state (once a process); false where it is refused.
inline bool ready() {
  static const bool granted = [] {
    constexpr int kReqPerm = 0x1023, kTileData = 18;  // ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA
    return syscall(SYS_arch_prctl, kReqPerm, kTileData) == 0;
  }();
  return granted;
}

}  // namespace amx
