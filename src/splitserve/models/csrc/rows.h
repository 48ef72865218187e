// A decoder layer's elementwise steps on one row each (models/fused_ops.py), on rows of float32
// or of bfloat16 (T = uint16_t, its bits): computed in float32 either way, a bfloat16 input
// widened exactly and each bfloat16 output rounded once, to nearest even (vec16's store_n):
//
//   norm_row:      y = (x * 1/sqrt(mean(x^2) + eps)) * w
//   add_norm_row:  x += d in place, then y = norm_row(x)
//   rope_row:      RoPE on the q and k heads of a qkv row in place (x * cos + swap(x) * sin,
//                  the sign of rotate_half folded into sin), then k and v into their slot of
//                  the paged caches
//   silu_mul_row:  y = silu(gate) * up
//   argmax_row:    the index of the largest element (greedy sampling)
//
// A row's sum of squares runs in 16-float vectors over its columns in order, then one fixed
// lane-sum tree: its result depends on the row alone, never on the batch or the threads.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "vec16.h"

namespace rows {

using namespace vec16;

constexpr int64_t kLanes = 16;

// Rows of `width` floats per thread before a second thread joins: waking one costs about what
// a few thousand floats' elementwise work does.
inline int64_t grain(int64_t width) { return std::max<int64_t>(1, 4096 / std::max<int64_t>(1, width)); }

template <typename T>
inline void norm_row(const T* x, const T* w, int64_t n, float eps, T* y) {
  Vec acc = zero();
  for (int64_t c = 0; c < n; c += kLanes) {
    const Vec v = load_n(x + c, n - c);
    acc = fmadd(v, v, acc);
  }
  const Vec inv = set1(1.0f / std::sqrt(reduce_add(acc) / static_cast<float>(n) + eps));
  for (int64_t c = 0; c < n; c += kLanes)
    store_n(y + c, n - c, mul(mul(load_n(x + c, n - c), inv), load_n(w + c, n - c)));
}

template <typename T>
inline void add_norm_row(T* x, const T* d, const T* w, int64_t n, float eps, T* y) {
  for (int64_t c = 0; c < n; c += kLanes)
    store_n(x + c, n - c, add(load_n(x + c, n - c), load_n(d + c, n - c)));
  norm_row(x, w, n, eps, y);
}

// qkv: one token's (heads + 2 kv_heads) * hd values; cos, sin: its hd values each (hd a
// multiple of 32); k and v go to row `slot` (kv_heads * hd values) of k_cache and v_cache.
template <typename T>
inline void rope_row(T* qkv, const T* cos, const T* sin, int64_t heads, int64_t kv_heads, int64_t hd,
                     T* k_cache, T* v_cache, int64_t slot) {
  const int64_t half = hd / 2, row = kv_heads * hd;
  for (int64_t head = 0; head < heads + kv_heads; ++head) {
    T* x = qkv + head * hd;
    for (int64_t i = 0; i < half; i += kLanes) {
      const Vec lo = load_row(x + i), hi = load_row(x + half + i);
      store_n(x + i, kLanes, add(mul(lo, load_row(cos + i)), mul(hi, load_row(sin + i))));
      store_n(x + half + i, kLanes,
              add(mul(hi, load_row(cos + half + i)), mul(lo, load_row(sin + half + i))));
    }
  }
  const T* k = qkv + heads * hd;
  std::memcpy(k_cache + slot * row, k, row * sizeof(T));
  std::memcpy(v_cache + slot * row, k + row, row * sizeof(T));
}

// silu(g) = g / (1 + e^-g), as g / (1 + e) for g >= 0 and g e / (1 + e) below, e = e^-|g|:
// exp_nonpositive's range either way.
inline Vec silu_times(Vec g, Vec up) {
  const Vec e = exp_nonpositive(sub(zero(), max(g, sub(zero(), g))));
  return mul(div(select_nonnegative(g, g, mul(g, e)), add(set1(1.0f), e)), up);
}

template <typename T>
inline void silu_mul_row(const T* gate, const T* up, int64_t n, T* y) {
  for (int64_t c = 0; c < n; c += kLanes)
    store_n(y + c, n - c, silu_times(load_n(gate + c, n - c), load_n(up + c, n - c)));
}

// The index of x's largest element, the first among equals, a NaN counting as the largest:
// torch.argmax's answer. One vector pass over chunks of 1,024 finds the largest value (NaNs
// skipped) and the first chunk holding it, and notes whether any element is NaN or infinite
// (x - x is NaN for those); then that chunk is searched for the value. A row with a NaN or an
// infinity takes one plain pass instead.
inline int64_t argmax_row(const float* x, int64_t n) {
  constexpr int64_t kChunk = 1024;
  float top = -__builtin_inff();
  int64_t from = 0;
  Vec spread = zero();
  for (int64_t c0 = 0; c0 < n; c0 += kChunk) {
    const int64_t c1 = std::min(n, c0 + kChunk), full = c0 + (c1 - c0) / kLanes * kLanes;
    Vec best[2] = {set1(-__builtin_inff()), set1(-__builtin_inff())};
    int64_t c = c0;
    for (; c + 2 * kLanes <= full; c += 2 * kLanes) {
      for (int j = 0; j < 2; ++j) {
        const Vec v = loadu(x + c + j * kLanes);
        best[j] = max(v, best[j]);  // the second operand where either is NaN
        spread = add(spread, sub(v, v));
      }
    }
    for (; c < full; c += kLanes) {
      const Vec v = loadu(x + c);
      best[0] = max(v, best[0]);
      spread = add(spread, sub(v, v));
    }
    float chunk_top = reduce_max(max(best[0], best[1]));
    for (; c < c1; ++c) {
      chunk_top = x[c] > chunk_top ? x[c] : chunk_top;
      spread = add(spread, set1(x[c] - x[c]));
    }
    if (chunk_top > top) top = chunk_top, from = c0;
  }
  if (std::isnan(reduce_add(spread))) {
    int64_t at = 0;
    for (int64_t c = 0; c < n; ++c) {
      if (std::isnan(x[c])) return c;
      if (x[c] > x[at]) at = c;
    }
    return at;
  }
  for (int64_t c = from; c < n; ++c)
    if (x[c] == top) return c;
  return 0;  // not reached: top is one of the elements
}

}  // namespace rows
