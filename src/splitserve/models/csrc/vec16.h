// Sixteen float32 lanes for the kernels in this directory: one AVX-512 register
// (SPLITSERVE_AVX512) or two AVX2 registers, low lanes 0-7 and high lanes 8-15
// (SPLITSERVE_AVX2, with FMA). models/native.py picks one by the CPU's flags.
//
// Each operation does the same arithmetic on every lane in both builds, and the reductions
// follow one tree: lane i + lane i+8, then + i+4, then + i+2, then + i+1 (GCC's
// _mm512_reduce_add_ps, and sum_lanes16's levels). So the two builds are meant to give the
// same bits; within one build a result never depends on anything but its inputs.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

namespace vec16 {

// Set where the build may use AMX tiles for bfloat16 (amx.h; attend.h's bfloat16 attention),
// and with them AVX-512 BF16's conversions (every CPU with AMX-BF16 has them).
#if defined(SPLITSERVE_AVX512) && defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define SPLITSERVE_AMX 1
#endif

#if defined(SPLITSERVE_AVX512)
#if !defined(__AVX512F__)
#error "SPLITSERVE_AVX512 needs -mavx512f"
#endif

using Vec = __m512;
using Mask = __mmask16;  // which lanes an operation touches

inline Vec zero() { return _mm512_setzero_ps(); }
inline Vec set1(float x) { return _mm512_set1_ps(x); }
inline Vec load(const float* src) { return _mm512_load_ps(src); }  // 64-byte aligned
inline Vec loadu(const float* src) { return _mm512_loadu_ps(src); }
inline void store(float* dst, Vec v) { _mm512_store_ps(dst, v); }  // 64-byte aligned
inline void storeu(float* dst, Vec v) { _mm512_storeu_ps(dst, v); }
inline Vec add(Vec a, Vec b) { return _mm512_add_ps(a, b); }
inline Vec sub(Vec a, Vec b) { return _mm512_sub_ps(a, b); }
inline Vec mul(Vec a, Vec b) { return _mm512_mul_ps(a, b); }
inline Vec max(Vec a, Vec b) { return _mm512_max_ps(a, b); }
inline Vec fmadd(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }   // a * b + c
inline Vec fnmadd(Vec a, Vec b, Vec c) { return _mm512_fnmadd_ps(a, b, c); }  // c - a * b
inline Vec div(Vec a, Vec b) { return _mm512_div_ps(a, b); }
// a where x >= 0, b elsewhere (and where x is NaN).
inline Vec select_nonnegative(Vec x, Vec a, Vec b) {
  return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_GE_OQ), b, a);
}

inline Mask first_lanes(int64_t count) {
  return count >= 16 ? (Mask)0xFFFF : (Mask)((1u << count) - 1);
}
// The masked lanes of src, zeros elsewhere; lanes outside the mask are not read.
inline Vec load_first(Mask m, const float* src) { return _mm512_maskz_loadu_ps(m, src); }
inline void store_first(float* dst, Mask m, Vec v) { _mm512_mask_storeu_ps(dst, m, v); }
// acc op x on the masked lanes, acc elsewhere.
inline Vec max_first(Vec acc, Mask m, Vec x) { return _mm512_mask_max_ps(acc, m, acc, x); }
inline Vec add_first(Vec acc, Mask m, Vec x) { return _mm512_mask_add_ps(acc, m, acc, x); }
inline float reduce_max(Vec v) { return _mm512_reduce_max_ps(v); }
inline float reduce_add(Vec v) { return _mm512_reduce_add_ps(v); }

// x * 2^n for integral n (exact but for the final rounding).
inline Vec scale_by_pow2(Vec x, Vec n) { return _mm512_scalef_ps(x, n); }
inline Vec round_nearest(Vec x) {
  return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}

// Sixteen bfloat16 values widened to float32: their bits in the upper half of a word (exact).
inline Vec widen_bf16(__m256i bits) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}
inline Vec load_bf16(const uint16_t* src) {
  return widen_bf16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src)));
}

// Sixteen float32 rounded to bfloat16 bits (to nearest, ties to even; a NaN to 0x7FC0), as
// torch's conversion rounds, each in the low half of its 32-bit lane.
inline __m512i round_bf16(Vec v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_srli_epi32(
      _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF))), 16);
  return _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
}
inline void store_bf16(uint16_t* dst, Vec v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), _mm512_cvtepi32_epi16(round_bf16(v)));
}
// v rounded to bfloat16 as round_bf16 rounds, as float32: what store_bf16 then load_bf16 give.
inline Vec round_to_bf16(Vec v) { return _mm512_castsi512_ps(_mm512_slli_epi32(round_bf16(v), 16)); }

// Sixteen vectors in, one out: lane i holds the sum of v[i]'s lanes. Halves, then quarters,
// then pairs, then single lanes of two sources are added at each level; a fixed tree.
inline Vec sum_lanes16(Vec v[16]) {
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
  const __m512 f = _mm512_add_ps(_mm512_shuffle_ps(z[0], z[1], 0x88),
                                 _mm512_shuffle_ps(z[0], z[1], 0xDD));
  // f holds the sources in lane order 0 4 8 12 1 5 9 13 2 6 10 14 3 7 11 15.
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return _mm512_permutexvar_ps(order, f);
}

#elif defined(SPLITSERVE_AVX2)
#if !defined(__AVX2__) || !defined(__FMA__)
#error "SPLITSERVE_AVX2 needs -mavx2 -mfma"
#endif

struct Vec {
  __m256 lo, hi;  // lanes 0-7, 8-15
};
struct Mask {
  __m256i lo, hi;  // all ones in the lanes touched
};

inline Vec zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline Vec set1(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
inline Vec load(const float* src) { return {_mm256_load_ps(src), _mm256_load_ps(src + 8)}; }
inline Vec loadu(const float* src) { return {_mm256_loadu_ps(src), _mm256_loadu_ps(src + 8)}; }
inline void store(float* dst, Vec v) {
  _mm256_store_ps(dst, v.lo);
  _mm256_store_ps(dst + 8, v.hi);
}
inline void storeu(float* dst, Vec v) {
  _mm256_storeu_ps(dst, v.lo);
  _mm256_storeu_ps(dst + 8, v.hi);
}
inline Vec add(Vec a, Vec b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
inline Vec sub(Vec a, Vec b) { return {_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; }
inline Vec mul(Vec a, Vec b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
inline Vec max(Vec a, Vec b) { return {_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)}; }
inline Vec fmadd(Vec a, Vec b, Vec c) {
  return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
}
inline Vec fnmadd(Vec a, Vec b, Vec c) {
  return {_mm256_fnmadd_ps(a.lo, b.lo, c.lo), _mm256_fnmadd_ps(a.hi, b.hi, c.hi)};
}
inline Vec div(Vec a, Vec b) { return {_mm256_div_ps(a.lo, b.lo), _mm256_div_ps(a.hi, b.hi)}; }
inline Vec select_nonnegative(Vec x, Vec a, Vec b) {
  const __m256 z = _mm256_setzero_ps();
  return {_mm256_blendv_ps(b.lo, a.lo, _mm256_cmp_ps(x.lo, z, _CMP_GE_OQ)),
          _mm256_blendv_ps(b.hi, a.hi, _mm256_cmp_ps(x.hi, z, _CMP_GE_OQ))};
}

inline Mask first_lanes(int64_t count) {
  const __m256i n = _mm256_set1_epi32(static_cast<int>(count < 16 ? count : 16));
  return {_mm256_cmpgt_epi32(n, _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)),
          _mm256_cmpgt_epi32(n, _mm256_setr_epi32(8, 9, 10, 11, 12, 13, 14, 15))};
}
inline Vec load_first(Mask m, const float* src) {
  return {_mm256_maskload_ps(src, m.lo), _mm256_maskload_ps(src + 8, m.hi)};
}
inline void store_first(float* dst, Mask m, Vec v) {
  _mm256_maskstore_ps(dst, m.lo, v.lo);
  _mm256_maskstore_ps(dst + 8, m.hi, v.hi);
}
inline Vec max_first(Vec acc, Mask m, Vec x) {
  return {_mm256_blendv_ps(acc.lo, _mm256_max_ps(acc.lo, x.lo), _mm256_castsi256_ps(m.lo)),
          _mm256_blendv_ps(acc.hi, _mm256_max_ps(acc.hi, x.hi), _mm256_castsi256_ps(m.hi))};
}
// Adding +0 where AVX-512 leaves a lane alone: the same bits, as the sums here are never -0.
inline Vec add_first(Vec acc, Mask m, Vec x) {
  return {_mm256_add_ps(acc.lo, _mm256_and_ps(x.lo, _mm256_castsi256_ps(m.lo))),
          _mm256_add_ps(acc.hi, _mm256_and_ps(x.hi, _mm256_castsi256_ps(m.hi)))};
}

// The tree of GCC's _mm512_reduce_{add,max}_ps: halves, quarters, pairs, then lanes 0 and 1.
#define VEC16_REDUCE(op)                                                                      \
  const __m256 h = _mm256_##op##_ps(v.lo, v.hi);                                              \
  const __m128 q = _mm_##op##_ps(_mm256_extractf128_ps(h, 1), _mm256_castps256_ps128(h));     \
  const __m128 p = _mm_##op##_ps(q, _mm_shuffle_ps(q, q, _MM_SHUFFLE(1, 0, 3, 2)));           \
  return _mm_cvtss_f32(_mm_##op##_ss(p, _mm_shuffle_ps(p, p, _MM_SHUFFLE(1, 1, 1, 1))))

inline float reduce_max(Vec v) { VEC16_REDUCE(max); }
inline float reduce_add(Vec v) { VEC16_REDUCE(add); }
#undef VEC16_REDUCE

// x * 2^n for integral n in [-150, 0] (exp_nonpositive's) and x in [0.5, 2], as
// _mm512_scalef_ps: 2^n as two normal factors; x times the first is exact, so the one
// rounding (into the subnormals for n below -126) is the second product's. (Checked: equal
// to std::ldexp for every such n on 160,000 random x each.)
inline __m256 scale_by_pow2(__m256 x, __m256 n) {
  const __m256i k = _mm256_cvtps_epi32(n);
  const __m256i half = _mm256_srai_epi32(k, 1);
  const __m256i rest = _mm256_sub_epi32(k, half);
  const __m256i bias = _mm256_set1_epi32(127);
  const __m256 a = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(half, bias), 23));
  const __m256 b = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(rest, bias), 23));
  return _mm256_mul_ps(_mm256_mul_ps(x, a), b);
}
inline Vec scale_by_pow2(Vec x, Vec n) {
  return {scale_by_pow2(x.lo, n.lo), scale_by_pow2(x.hi, n.hi)};
}
inline Vec round_nearest(Vec x) {
  constexpr int kMode = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  return {_mm256_round_ps(x.lo, kMode), _mm256_round_ps(x.hi, kMode)};
}

inline __m256 widen_bf16(const uint16_t* src) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
inline Vec load_bf16(const uint16_t* src) { return {widen_bf16(src), widen_bf16(src + 8)}; }

// Eight float32 rounded to bfloat16 bits (to nearest, ties to even; a NaN to 0x7FC0), as
// torch's conversion rounds, each in the low half of its 32-bit lane.
inline __m256i round_bf16(__m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_srli_epi32(
      _mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF))), 16);
  const __m256 nan = _mm256_cmp_ps(v, v, _CMP_UNORD_Q);
  return _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), _mm256_castps_si256(nan));
}
inline void store_bf16(uint16_t* dst, Vec v) {
  // packus interleaves the halves by 128-bit lane: lo 0-3, hi 0-3, lo 4-7, hi 4-7.
  const __m256i packed = _mm256_packus_epi32(round_bf16(v.lo), round_bf16(v.hi));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), _mm256_permute4x64_epi64(packed, 0xD8));
}

// Eight vectors in, one out: lane i holds the sum of v[i]'s lanes, i + 4 then i + 2 then i + 1.
inline __m256 sum_lanes8(const __m256 v[8]) {
  __m256 u[4], w[2];
  for (int i = 0; i < 4; ++i)  // [v0's four sums of lanes i, i+4 | v1's]
    u[i] = _mm256_add_ps(_mm256_permute2f128_ps(v[2 * i], v[2 * i + 1], 0x20),
                         _mm256_permute2f128_ps(v[2 * i], v[2 * i + 1], 0x31));
  for (int i = 0; i < 2; ++i)
    w[i] = _mm256_add_ps(_mm256_shuffle_ps(u[2 * i], u[2 * i + 1], 0x44),
                         _mm256_shuffle_ps(u[2 * i], u[2 * i + 1], 0xEE));
  const __m256 f = _mm256_add_ps(_mm256_shuffle_ps(w[0], w[1], 0x88),
                                 _mm256_shuffle_ps(w[0], w[1], 0xDD));
  // f holds the sources in lane order 0 2 4 6 1 3 5 7.
  return _mm256_permutevar8x32_ps(f, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

// Sixteen vectors in, one out: lane i holds the sum of v[i]'s lanes; the first level adds
// each vector's two halves (lane i + lane i+8), then sum_lanes8.
inline Vec sum_lanes16(Vec v[16]) {
  __m256 lo[8], hi[8];
  for (int i = 0; i < 8; ++i) {
    lo[i] = _mm256_add_ps(v[i].lo, v[i].hi);
    hi[i] = _mm256_add_ps(v[8 + i].lo, v[8 + i].hi);
  }
  return {sum_lanes8(lo), sum_lanes8(hi)};
}

#else
#error "define SPLITSERVE_AVX512 or SPLITSERVE_AVX2 (models/native.py does)"
#endif

// The first `count` lanes of v to dst: a plain store where count >= 16, which AMD's cores run
// many times faster than a masked one.
inline void store_n(float* dst, int64_t count, Vec v) {
  if (count >= 16)
    storeu(dst, v);
  else
    store_first(dst, first_lanes(count), v);
}

// Sixteen values as float32 (a cache row's, a row's of rows.h): bfloat16 widened, float32 as
// it is.
inline Vec load_row(const uint16_t* src) { return load_bf16(src); }
inline Vec load_row(const float* src) { return loadu(src); }

// The first `count` lanes of a row, as load_row reads them; the rest 0.
inline Vec load_n(const float* src, int64_t count) {
  return count >= 16 ? load_row(src) : load_first(first_lanes(count), src);
}
inline Vec load_n(const uint16_t* src, int64_t count) {
  if (count >= 16) return load_row(src);
  uint16_t part[16] = {};
  std::memcpy(part, src, count * sizeof(uint16_t));
  return load_bf16(part);
}

// The first `count` lanes of v rounded to bfloat16 (see round_bf16) to dst.
inline void store_n(uint16_t* dst, int64_t count, Vec v) {
  if (count >= 16) return store_bf16(dst, v);
  uint16_t part[16];
  store_bf16(part, v);
  std::memcpy(dst, part, count * sizeof(uint16_t));
}

// exp(x) for x <= 0: 2^n * e^r with n = round(x / ln 2) and a degree-6 polynomial in r.
inline Vec exp_nonpositive(Vec x) {
  x = max(x, set1(-104.0f));  // e^-104 is 0 in float32
  const Vec n = round_nearest(mul(x, set1(1.44269504088896341f)));
  Vec r = fnmadd(n, set1(0.693359375f), x);
  r = fnmadd(n, set1(-2.12194440e-4f), r);
  Vec p = set1(1.9875691500e-4f);
  p = fmadd(p, r, set1(1.3981999507e-3f));
  p = fmadd(p, r, set1(8.3334519073e-3f));
  p = fmadd(p, r, set1(4.1665795894e-2f));
  p = fmadd(p, r, set1(1.6666665459e-1f));
  p = fmadd(p, r, set1(5.0000001201e-1f));
  p = fmadd(p, mul(r, r), add(r, set1(1.0f)));
  return scale_by_pow2(p, n);
}

}  // namespace vec16
