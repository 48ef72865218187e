// Decode attention over the paged KV cache, in place, with AVX-512 (see models/paged_decode.py).
//
// One work item per (sequence, kv head), spread over torch's own intra-op threads
// (at::parallel_for), so the op runs on the engine thread's OpenMP team and starts no threads
// of its own. An item serves the g query heads that share its kv head:
//
//   scores[j, p] = (q[j] * scale) . k_p          one fused-multiply-add chain per 16 lanes
//   w[j, p]      = exp(scores[j, p] - max_j)      16 positions at a time
//   out[j]       = (sum_p w[j, p] v_p) / sum_p w[j, p]
//
// Every sum runs in an order fixed by the sequence's own length, never by the batch, the
// thread count or a buffer's address, so a sequence gets the same bits alone or batched.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace {

constexpr int kLanes = 16;

// exp(x) for x <= 0: 2^n * e^r with n = round(x / ln 2) and a degree-6 polynomial in r.
inline __m512 exp_nonpositive(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-104.0f));  // e^-104 is 0 in float32
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(p, n);
}

// Sixteen elements of a cache row as float32: bfloat16 bits shifted into the upper half of a
// 32-bit word (exact), or float32 as it is.
template <typename T>
inline __m512 load16(const T* src);

template <>
inline __m512 load16<uint16_t>(const uint16_t* src) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

template <>
inline __m512 load16<float>(const float* src) {
  return _mm512_loadu_ps(src);
}

struct Layout {
  int64_t block_size, block_stride, pos_stride, head_dim, group;
};

// Sixteen vectors in, one out: lane i holds the sum of v[i]'s lanes. Halves, then quarters,
// then pairs, then single lanes of two sources are added at each level; a fixed tree.
inline __m512 sum_lanes16(__m512 v[16]) {
  __m512 u[8], w[4], z[2];
  for (int i = 0; i < 8; ++i)
    u[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
  for (int i = 0; i < 4; ++i)
    w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], 0xDD));
  for (int i = 0; i < 2; ++i)
    z[i] = _mm512_add_ps(_mm512_shuffle_ps(w[2 * i], w[2 * i + 1], 0x44),
                         _mm512_shuffle_ps(w[2 * i], w[2 * i + 1], 0xEE));
  const __m512 f = _mm512_add_ps(_mm512_shuffle_ps(z[0], z[1], 0x88), _mm512_shuffle_ps(z[0], z[1], 0xDD));
  // f holds the sources in lane order 0 4 8 12 1 5 9 13 2 6 10 14 3 7 11 15.
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return _mm512_permutexvar_ps(order, f);
}

inline __mmask16 first(int64_t count) {
  return count >= kLanes ? (__mmask16)0xFFFF : (__mmask16)((1u << count) - 1);
}

// One (sequence, kv head), with NC = head_dim / 16: q points at the group's g query rows, out
// at its g output rows. The sequence's positions go 16 at a time (fewer at a block's end):
// their rows are widened once into `rows`, then each query head takes them from there.
template <typename T, int NC>
void attend_item(const float* q, const T* kc, const T* vc, const int64_t* table, int64_t length,
                 int64_t kv_head, float scale, const Layout& lay, float* scores, float* out) {
  constexpr int64_t hd = NC * kLanes;
  const int64_t g = lay.group, bs = lay.block_size, stride = (length + kLanes - 1) / kLanes * kLanes;
  alignas(64) float rows[kLanes * hd];
  alignas(64) float qs[8 * hd];
  alignas(64) float acc[8 * hd];
  for (int64_t i = 0; i < g * hd; ++i) qs[i] = q[i] * scale;

  // Widen positions [p, p + count) of `cache` into rows (count <= 16).
  auto widen = [&](const T* cache, int64_t p, int64_t count) {
    const T* block = cache + table[p / bs] * lay.block_stride + kv_head * hd;
    for (int64_t i = 0; i < count; ++i) {
      const T* row = block + (p % bs + i) * lay.pos_stride;
      for (int c = 0; c < NC; ++c) _mm512_store_ps(rows + i * hd + c * kLanes, load16(row + c * kLanes));
    }
  };
  // Spans of at most 16 positions that never cross a block.
  auto span = [&](int64_t p) { return std::min({(int64_t)kLanes, length - p, bs - p % bs}); };

  for (int64_t p = 0; p < length; p += span(p)) {
    const int64_t count = span(p);
    widen(kc, p, count);
    for (int64_t j = 0; j < g; ++j) {
      __m512 qv[NC], dots[kLanes];
      for (int c = 0; c < NC; ++c) qv[c] = _mm512_load_ps(qs + j * hd + c * kLanes);
      for (int64_t i = 0; i < kLanes; ++i) {
        if (i >= count) {
          dots[i] = _mm512_setzero_ps();
          continue;
        }
        __m512 d = _mm512_mul_ps(qv[0], _mm512_load_ps(rows + i * hd));
        for (int c = 1; c < NC; ++c) d = _mm512_fmadd_ps(qv[c], _mm512_load_ps(rows + i * hd + c * kLanes), d);
        dots[i] = d;
      }
      _mm512_mask_storeu_ps(scores + j * stride + p, first(count), sum_lanes16(dots));
    }
  }

  // Softmax weights, unnormalised; each head's total.
  float totals[8];
  for (int64_t j = 0; j < g; ++j) {
    float* s = scores + j * stride;
    __m512 best = _mm512_set1_ps(-__builtin_inff());
    for (int64_t p = 0; p < length; p += kLanes)
      best = _mm512_mask_max_ps(best, first(length - p), best, _mm512_loadu_ps(s + p));
    const __m512 top = _mm512_set1_ps(_mm512_reduce_max_ps(best));
    __m512 total = _mm512_setzero_ps();
    for (int64_t p = 0; p < length; p += kLanes) {
      const __mmask16 m = first(length - p);
      const __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, s + p), top));
      _mm512_mask_storeu_ps(s + p, m, e);
      total = _mm512_mask_add_ps(total, m, total, e);
    }
    totals[j] = _mm512_reduce_add_ps(total);
  }

  // Weighted values: each head's sums stay in registers over a span of positions.
  for (int64_t i = 0; i < g * hd; ++i) acc[i] = 0.0f;
  for (int64_t p = 0; p < length; p += span(p)) {
    const int64_t count = span(p);
    widen(vc, p, count);
    for (int64_t j = 0; j < g; ++j) {
      __m512 a[NC];
      for (int c = 0; c < NC; ++c) a[c] = _mm512_load_ps(acc + j * hd + c * kLanes);
      const float* w = scores + j * stride + p;
      for (int64_t i = 0; i < count; ++i) {
        const __m512 wi = _mm512_set1_ps(w[i]);
        for (int c = 0; c < NC; ++c) a[c] = _mm512_fmadd_ps(wi, _mm512_load_ps(rows + i * hd + c * kLanes), a[c]);
      }
      for (int c = 0; c < NC; ++c) _mm512_store_ps(acc + j * hd + c * kLanes, a[c]);
    }
  }
  for (int64_t j = 0; j < g; ++j) {
    const __m512 inv = _mm512_set1_ps(1.0f / totals[j]);
    for (int c = 0; c < NC; ++c)
      _mm512_storeu_ps(out + j * hd + c * kLanes, _mm512_mul_ps(_mm512_load_ps(acc + j * hd + c * kLanes), inv));
  }
}

template <typename T>
using ItemFn = void (*)(const float*, const T*, const T*, const int64_t*, int64_t, int64_t, float,
                        const Layout&, float*, float*);

template <typename T>
ItemFn<T> item_fn(int64_t head_dim) {
  switch (head_dim / kLanes) {
    case 1: return attend_item<T, 1>;
    case 2: return attend_item<T, 2>;
    case 4: return attend_item<T, 4>;
    case 6: return attend_item<T, 6>;
    case 8: return attend_item<T, 8>;
    case 16: return attend_item<T, 16>;
    default: return nullptr;
  }
}

template <typename T>
void attend_all(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                const at::Tensor& tables, const at::Tensor& lens, double scale, at::Tensor& out) {
  const int64_t n = q.size(0), h = q.size(1), hd = q.size(2), kvh = k_cache.size(2);
  const Layout lay{k_cache.size(1), k_cache.stride(0), k_cache.stride(1), hd, h / kvh};
  const float* qp = q.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const T* kc = static_cast<const T*>(k_cache.data_ptr());
  const T* vc = static_cast<const T*>(v_cache.data_ptr());
  const int64_t* tp = tables.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  const int64_t width = tables.size(1);
  const ItemFn<T> attend_item_t = item_fn<T>(hd);
  at::parallel_for(0, n * kvh, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t r = item / kvh, kh = item % kvh, length = lp[r];
      scores.resize(static_cast<size_t>(lay.group * ((length + kLanes - 1) / kLanes * kLanes)));
      const int64_t row = (r * h + kh * lay.group) * hd;
      attend_item_t(qp + row, kc, vc, tp + r * width, length, kh, static_cast<float>(scale), lay,
                     scores.data(), op + row);
    }
  });
}

at::Tensor paged_decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                        const at::Tensor& tables, const at::Tensor& lens, double scale) {
  TORCH_CHECK(q.scalar_type() == at::kFloat && q.dim() == 3 && q.is_contiguous(),
              "q: contiguous float32 [n, h, hd]");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  k_cache.sizes() == v_cache.sizes() && k_cache.scalar_type() == v_cache.scalar_type(),
              "caches: two contiguous [blocks, block_size, kv_heads, head_dim] of one type");
  const int64_t hd = q.size(2), kvh = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == hd && item_fn<float>(hd) != nullptr,
              "head_dim: 16, 32, 64, 96, 128 or 256");
  TORCH_CHECK(q.size(1) % kvh == 0 && q.size(1) / kvh <= 8, "at most 8 query heads per kv head");
  TORCH_CHECK(tables.scalar_type() == at::kLong && tables.is_contiguous() && tables.dim() == 2 &&
                  lens.scalar_type() == at::kLong && lens.is_contiguous() &&
                  tables.size(0) == q.size(0) && lens.size(0) == q.size(0),
              "tables [n, w] and lens [n]: contiguous int64");
  at::Tensor out = at::empty_like(q);
  if (k_cache.scalar_type() == at::kBFloat16)
    attend_all<uint16_t>(q, k_cache, v_cache, tables, lens, scale, out);
  else if (k_cache.scalar_type() == at::kFloat)
    attend_all<float>(q, k_cache, v_cache, tables, lens, scale, out);
  else
    TORCH_CHECK(false, "caches: bfloat16 or float32");
  return out;
}

}  // namespace

TORCH_LIBRARY(splitserve, m) {
  m.def("paged_decode(Tensor q, Tensor k_cache, Tensor v_cache, Tensor tables, Tensor lens, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(splitserve, CPU, m) {
  m.impl("paged_decode", &paged_decode);
}
