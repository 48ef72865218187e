// y = x W^T (+ bias) for float32 on a weight packed once into column panels (see
// models/panel_linear.py): panel p holds output columns [16p, 16p + 16) as K rows of 16
// floats, zero-padded past the last column.
//
// Each output element is one fused-multiply-add chain over k = 0, 1, ..., K-1 from zero, then
// + bias: the same bits for a row alone or among any others, in any row block, at any thread
// count. A micro-kernel holds R rows x 16 columns in registers (R = 6: twelve AVX2 registers
// or six AVX-512 ones) and streams its panel once per block of rows, so a decode step's few
// rows read each weight once and a prefill's many rows reuse a block of x from the cache.
// Panels go over torch's own intra-op threads (at::parallel_for).
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>

#include "vec16.h"

namespace panel {

using namespace vec16;

constexpr int64_t kCols = 16;              // a panel's columns: one Vec
constexpr int64_t kRows = 6;               // rows of a micro-kernel
constexpr int64_t kBlockFloats = 1 << 16;  // x rows per block: about 256 KB of them
constexpr int64_t kFetchRows = 24;  // more rows are compute-bound, and the fetch slowed them

// Rows [0, R) of x (row stride xs) times one panel, into columns [0, cols) of y; fetches one
// line of `ahead` (a panel to come, or this one) per k.
template <int R>
void micro(const float* x, int64_t xs, const float* panel, int64_t K, const float* bias, float* y,
           int64_t ys, int64_t cols, const float* ahead) {
  Vec acc[R];
  for (int r = 0; r < R; ++r) acc[r] = zero();
  for (int64_t k = 0; k < K; ++k) {
    __builtin_prefetch(ahead + k * kCols, 0, 3);
    const Vec w = load(panel + k * kCols);
    for (int r = 0; r < R; ++r) acc[r] = fmadd(set1(x[r * xs + k]), w, acc[r]);
  }
  if (bias != nullptr) {
    const Vec b = load_first(first_lanes(cols), bias);
    for (int r = 0; r < R; ++r) acc[r] = add(acc[r], b);
  }
  if (cols == kCols) {
    for (int r = 0; r < R; ++r) storeu(y + r * ys, acc[r]);
  } else {
    const Mask m = first_lanes(cols);
    for (int r = 0; r < R; ++r) store_first(y + r * ys, m, acc[r]);
  }
}

// Rows [0, R) of x times W adjacent full panels (columns [0, 16 W) of y): the same chain for
// each element as micro<R>, with R x W chains in flight. One row's single chain waits on the
// last fused multiply-add at every k, which on an AVX2 core holds a decode step's product
// well below the memory's speed; four panels' chains at once read ~1.3x faster.
template <int R, int W>
void micro_wide(const float* x, int64_t xs, const float* panel, int64_t K, const float* bias,
                float* y, int64_t ys) {
  Vec acc[R][W];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < W; ++j) acc[r][j] = zero();
  for (int64_t k = 0; k < K; ++k) {
    Vec w[W];
    for (int j = 0; j < W; ++j) w[j] = load(panel + (j * K + k) * kCols);
    for (int r = 0; r < R; ++r) {
      const Vec xr = set1(x[r * xs + k]);
      for (int j = 0; j < W; ++j) acc[r][j] = fmadd(xr, w[j], acc[r][j]);
    }
  }
  if (bias != nullptr) {
    for (int j = 0; j < W; ++j) {
      const Vec b = load_first(first_lanes(kCols), bias + j * kCols);
      for (int r = 0; r < R; ++r) acc[r][j] = add(acc[r][j], b);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < W; ++j) storeu(y + r * ys + j * kCols, acc[r][j]);
}

using MicroFn = void (*)(const float*, int64_t, const float*, int64_t, const float*, float*, int64_t,
                         int64_t, const float*);
constexpr MicroFn kMicro[kRows + 1] = {nullptr,   micro<1>, micro<2>, micro<3>,
                                       micro<4>, micro<5>, micro<6>};

#if defined(SPLITSERVE_AVX512)
// Above kFetchRows rows, two full panels a pass (micro_wide<R, 2>, the same chains): a
// one-panel pass loads its row's input for every FMA, and on AVX-512 those loads, not the FMAs,
// bound it; two panels share each. (On AVX2 two panels of six rows would need 24 registers.)
using PairFn = void (*)(const float*, int64_t, const float*, int64_t, const float*, float*, int64_t);
constexpr PairFn kPair[kRows + 1] = {nullptr,         micro_wide<1, 2>, micro_wide<2, 2>,
                                     micro_wide<3, 2>, micro_wide<4, 2>, micro_wide<5, 2>,
                                     micro_wide<6, 2>};
#endif

// y [M, N] = x [M, K] times panels [P, K, 16] (64-byte aligned, N <= 16 P), + bias [N] unless
// null; panels split over torch's intra-op threads.
inline void product(const float* x, int64_t M, int64_t K, const float* panels, int64_t P, int64_t N,
                    const float* bias, float* y) {
  if (M == 0) return;
  if (M <= 3) {  // a few rows: several panels at a time (micro_wide), same chains
    using WideFn = void (*)(const float*, int64_t, const float*, int64_t, const float*, float*, int64_t);
    const WideFn wide = M == 1 ? micro_wide<1, 4> : M == 2 ? micro_wide<2, 2> : micro_wide<3, 2>;
    const int64_t W = M == 1 ? 4 : 2, full = N / kCols;  // panels of 16 columns
    at::parallel_for(0, P, 1, [&](int64_t begin, int64_t end) {
      int64_t p = begin;
      for (; p + W <= std::min(end, full); p += W)
        wide(x, K, panels + p * K * kCols, K, bias == nullptr ? nullptr : bias + p * kCols,
             y + p * kCols, N);
      for (; p < end; ++p) {
        const int64_t col = p * kCols;
        kMicro[M](x, K, panels + p * K * kCols, K, bias == nullptr ? nullptr : bias + col, y + col, N,
                  std::min(kCols, N - col), panels + p * K * kCols);
      }
    });
    return;
  }
  const int64_t block = std::max<int64_t>(kRows, kBlockFloats / K / kRows * kRows);
  at::parallel_for(0, P, 1, [&](int64_t begin, int64_t end) {
    for (int64_t m0 = 0; m0 < M; m0 += block) {
      const int64_t m1 = std::min(M, m0 + block);
      for (int64_t p = begin; p < end; ++p) {
        const int64_t col = p * kCols, cols = std::min(kCols, N - col);
        const float* pp = panels + p * K * kCols;
        const float* pb = bias == nullptr ? nullptr : bias + col;
#if defined(SPLITSERVE_AVX512)
        if (M > kFetchRows && p + 1 < end && col + 2 * kCols <= N) {
          for (int64_t r = m0; r < m1; r += kRows)
            kPair[std::min(kRows, m1 - r)](x + r * K, K, pp, K, pb, y + r * N + col, N);
          ++p;  // the pair's second panel
          continue;
        }
#endif
        // Up to kFetchRows rows, the last pass over a panel fetches the thread's next one: the
        // passes before it read the panel from cache, and memory would idle through them.
        const float* next = p + 1 < end && M <= kFetchRows ? pp + K * kCols : pp;
        for (int64_t r = m0; r < m1; r += kRows) {
          const int64_t rows = std::min(kRows, m1 - r);
          kMicro[rows](x + r * K, K, pp, K, pb, y + r * N + col, N, cols, r + kRows >= m1 ? next : pp);
        }
      }
    }
  });
}

}  // namespace panel
