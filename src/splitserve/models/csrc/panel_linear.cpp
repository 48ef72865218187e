// The torch op over panel.h's product: splitserve::panel_linear (models/panel_linear.py).

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cstdint>
#include <optional>

#include "panel.h"

namespace {

// x [M, K] float32, panels [P, K, 16] float32 (64-byte aligned), bias [N] or none:
// y [M, N] with N = out_features <= 16 P.
at::Tensor panel_linear(const at::Tensor& x, const at::Tensor& panels,
                        const std::optional<at::Tensor>& bias, int64_t out_features) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous(),
              "x: contiguous float32 [rows, in]");
  TORCH_CHECK(panels.scalar_type() == at::kFloat && panels.dim() == 3 && panels.is_contiguous() &&
                  panels.size(1) == x.size(1) && panels.size(2) == panel::kCols &&
                  reinterpret_cast<uintptr_t>(panels.data_ptr()) % 64 == 0,
              "panels: 64-byte aligned contiguous float32 [P, in, 16]");
  const int64_t M = x.size(0), K = x.size(1), P = panels.size(0), N = out_features;
  TORCH_CHECK(N > (P - 1) * panel::kCols && N <= P * panel::kCols,
              "out_features does not match the panels");
  const float* b = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N,
                "bias: contiguous float32 [out]");
    b = bias->data_ptr<float>();
  }
  at::Tensor y = at::empty({M, N}, x.options());
  panel::product(x.data_ptr<float>(), M, K, panels.data_ptr<float>(), P, N, b, y.data_ptr<float>());
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(splitserve, m) {
  m.def("panel_linear(Tensor x, Tensor panels, Tensor? bias, int out_features) -> Tensor");
}

TORCH_LIBRARY_IMPL(splitserve, CPU, m) { m.impl("panel_linear", &panel_linear); }
