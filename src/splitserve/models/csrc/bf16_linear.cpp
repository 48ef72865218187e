// bfloat16 weight products whose every row gets the bits it gets alone (see models/llama.py).
//
// oneDNN's own bfloat16 products pick their kernel, and with it a row's summation order, by the
// row count, so a token's result would depend on the batch and chunk around it. Here the weight
// is packed once into blocks of 64 output columns (VNNI layout, at::native::cpublas::pack) and
// every product runs the same micro-kernel, at::native::cpublas::brgemm (AMX where the CPU has
// it), on at most 32 rows at a time, accumulating in float32 over the whole input dimension in
// one call: a row's sums never depend on the rows beside it, nor on the thread count. A block of
// the weight stays in cache while all the row tiles take it.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/native/CPUBlas.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <vector>

namespace {

constexpr int64_t kCols = 64;  // output columns of a packed block
constexpr int64_t kRows = 32;  // rows of x a micro-kernel call takes

// 64 float32 sums (+ bias) rounded to bfloat16, to nearest even as at::BFloat16 rounds.
inline void store_row(const float* sums, const at::BFloat16* bias, at::BFloat16* dst) {
#if defined(__AVX512F__)
  for (int64_t j = 0; j < kCols; j += 16) {
    __m512 v = _mm512_loadu_ps(sums + j);
    if (bias != nullptr) {
      const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bias + j));
      v = _mm512_add_ps(v, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16)));
    }
    const __m512i bits = _mm512_castps_si512(v);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7FFF)), odd), 16);
    // NaN stays a (quiet) NaN.
    const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    rounded = _mm512_mask_mov_epi32(rounded, nan, _mm512_set1_epi32(0x7FC0));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + j), _mm512_cvtepi32_epi16(rounded));
  }
#else
  for (int64_t j = 0; j < kCols; ++j)
    dst[j] = at::BFloat16(sums[j] + (bias == nullptr ? 0.0f : static_cast<float>(bias[j])));
#endif
}

// weight [N, K] bfloat16 -> [N / 64, K, 64], each block packed for the micro-kernel.
at::Tensor bf16_pack(const at::Tensor& weight) {
  TORCH_CHECK(weight.scalar_type() == at::kBFloat16 && weight.dim() == 2, "weight: bfloat16 [N, K]");
  const int64_t n = weight.size(0), k = weight.size(1);
  TORCH_CHECK(n % kCols == 0 && k % 2 == 0, "weight: N a multiple of 64, K even");
  const at::Tensor wt = weight.t().contiguous();  // [K, N]
  at::Tensor out = at::empty({n / kCols, k, kCols}, weight.options());
  const auto* src = wt.data_ptr<at::BFloat16>();
  auto* dst = out.data_ptr<at::BFloat16>();
  for (int64_t b = 0; b < n / kCols; ++b)
    at::native::cpublas::pack(k, kCols, n, kCols, at::kBFloat16, at::kBFloat16, src + b * kCols,
                              dst + b * k * kCols);
  return out;
}

// x [M, K] bfloat16 times a bf16_pack'ed weight (+ bias [N]) -> [M, N] bfloat16.
at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.dim() == 2 && x.is_contiguous(), "x: contiguous bfloat16 [M, K]");
  TORCH_CHECK(packed.dim() == 3 && packed.size(1) == x.size(1) && packed.size(2) == kCols, "packed: bf16_pack of a [N, K] weight");
  const int64_t m = x.size(0), k = x.size(1), blocks = packed.size(0), n = blocks * kCols;
  const at::BFloat16* bp = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kBFloat16 && bias->numel() == n && bias->is_contiguous(), "bias: bfloat16 [N]");
    bp = bias->data_ptr<at::BFloat16>();
  }
  at::Tensor out = at::empty({m, n}, x.options());
  if (m == 0) return out;
  const auto* a = x.data_ptr<at::BFloat16>();
  const auto* b = packed.data_ptr<at::BFloat16>();
  auto* o = out.data_ptr<at::BFloat16>();
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> c(kRows * kCols);
    for (int64_t blk = begin; blk < end; ++blk) {
      for (int64_t m0 = 0; m0 < m; m0 += kRows) {
        const int64_t rows = std::min(kRows, m - m0);
        at::native::cpublas::brgemm(rows, kCols, k, k, kCols, kCols, false, a + m0 * k, b + blk * k * kCols, c.data());
        for (int64_t i = 0; i < rows; ++i)
          store_row(c.data() + i * kCols, bp == nullptr ? nullptr : bp + blk * kCols, o + (m0 + i) * n + blk * kCols);
      }
    }
    at::native::cpublas::brgemm_release();
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(splitserve, m) {
  m.def("bf16_pack(Tensor weight) -> Tensor");
  m.def("bf16_linear(Tensor x, Tensor packed, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(splitserve, CPU, m) {
  m.impl("bf16_pack", &bf16_pack);
  m.impl("bf16_linear", &bf16_linear);
}
