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

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <optional>

#include "vec16.h"

namespace {

using namespace vec16;

constexpr int64_t kCols = 16;        // a panel's columns: one Vec
constexpr int64_t kRows = 6;         // rows of a micro-kernel
constexpr int64_t kBlockFloats = 1 << 16;  // x rows per block: about 256 KB of them

// Rows [0, R) of x (row stride xs) times one panel, into columns [0, cols) of y.
template <int R>
void micro(const float* x, int64_t xs, const float* panel, int64_t K, const float* bias, float* y,
           int64_t ys, int64_t cols) {
  Vec acc[R];
  for (int r = 0; r < R; ++r) acc[r] = zero();
  for (int64_t k = 0; k < K; ++k) {
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

using MicroFn = void (*)(const float*, int64_t, const float*, int64_t, const float*, float*, int64_t,
                         int64_t);
constexpr MicroFn kMicro[kRows + 1] = {nullptr,   micro<1>, micro<2>, micro<3>,
                                       micro<4>, micro<5>, micro<6>};

// x [M, K] float32, panels [P, K, 16] float32 (64-byte aligned), bias [N] or none:
// y [M, N] with N = out_features <= 16 P.
at::Tensor panel_linear(const at::Tensor& x, const at::Tensor& panels,
                        const std::optional<at::Tensor>& bias, int64_t out_features) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous(),
              "x: contiguous float32 [rows, in]");
  TORCH_CHECK(panels.scalar_type() == at::kFloat && panels.dim() == 3 && panels.is_contiguous() &&
                  panels.size(1) == x.size(1) && panels.size(2) == kCols &&
                  reinterpret_cast<uintptr_t>(panels.data_ptr()) % 64 == 0,
              "panels: 64-byte aligned contiguous float32 [P, in, 16]");
  const int64_t M = x.size(0), K = x.size(1), P = panels.size(0), N = out_features;
  TORCH_CHECK(N > (P - 1) * kCols && N <= P * kCols, "out_features does not match the panels");
  const float* b = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N,
                "bias: contiguous float32 [out]");
    b = bias->data_ptr<float>();
  }
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0) return y;
  const float* xp = x.data_ptr<float>();
  const float* wp = panels.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t block = std::max<int64_t>(kRows, kBlockFloats / K / kRows * kRows);
  at::parallel_for(0, P, 1, [&](int64_t begin, int64_t end) {
    for (int64_t m0 = 0; m0 < M; m0 += block) {
      const int64_t m1 = std::min(M, m0 + block);
      for (int64_t p = begin; p < end; ++p) {
        const int64_t col = p * kCols, cols = std::min(kCols, N - col);
        const float* panel = wp + p * K * kCols;
        const float* pb = b == nullptr ? nullptr : b + col;
        for (int64_t r = m0; r < m1; r += kRows) {
          const int64_t rows = std::min(kRows, m1 - r);
          kMicro[rows](xp + r * K, K, panel, K, pb, yp + r * N + col, N, cols);
        }
      }
    }
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(splitserve, m) {
  m.def("panel_linear(Tensor x, Tensor panels, Tensor? bias, int out_features) -> Tensor");
}

TORCH_LIBRARY_IMPL(splitserve, CPU, m) { m.impl("panel_linear", &panel_linear); }
