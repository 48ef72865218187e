// A whole decode step of a llama-family model in one call, float32, for a few sequences of
// one new token each (models/decode_step.py). It runs the same kernels, in the same order, as
// the model's torch path on packed weights does op by op (panel.h's products, rows.h's norms,
// RoPE and activation, attend.h's attention), so its logits are bit for bit the torch path's;
// what it saves is the ~300 op dispatches and tensor allocations of a step, about a third of
// a batch-1 step's time on two cores.
//
// Per layer: RMSNorm, qkv product (+ bias), RoPE and the K/V writes, attention over the block
// table (GQA), output product (+ bias), residual add and RMSNorm, gate/up product, SiLU * up,
// down product, residual add. Then the final RMSNorm and the output projection. Products and
// attention go over torch's intra-op threads, and so do the elementwise steps once a step has
// more rows than rows::grain gives one thread (a few rows cost less than waking a thread).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "attend.h"
#include "panel.h"
#include "rows.h"

namespace {

// fn(r) for every row r < n of `width` floats.
template <typename F>
void each_row(int64_t n, int64_t width, const F& fn) {
  at::parallel_for(0, n, rows::grain(width), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) fn(r);
  });
}

// A layer's weights, in the order the constructor takes them (a bias absent: an empty tensor).
enum Slot { kInNorm, kQkv, kQkvBias, kO, kOBias, kPostNorm, kGateUp, kDown, kPerLayer };

struct Product {
  const float* panels;
  int64_t in, out, count;  // count: panels
  const float* bias;       // or null
};

struct DecodeModel : torch::CustomClassHolder {
  std::vector<at::Tensor> held;  // keeps every tensor below alive
  std::vector<const float*> in_norm, post_norm;
  std::vector<Product> qkv, o, gate_up, down;
  const float *embed, *final_norm;
  Product lm_head;
  int64_t layers, heads, kv_heads, head_dim, hidden, inter, vocab;
  float eps, scale;
  attn::DecodeFn<float> attend;

  DecodeModel(std::vector<at::Tensor> weights, at::Tensor embed_t, at::Tensor final_norm_t,
              at::Tensor lm_head_t, std::vector<int64_t> dims, double eps_, double scale_)
      : held(std::move(weights)) {
    TORCH_CHECK(dims.size() == 3, "dims: heads, kv_heads, head_dim");
    heads = dims[0], kv_heads = dims[1], head_dim = dims[2];
    TORCH_CHECK(!held.empty() && held.size() % kPerLayer == 0, "weights: 8 tensors per layer");
    layers = static_cast<int64_t>(held.size()) / kPerLayer;
    TORCH_CHECK(embed_t.dim() == 2, "embed: [vocab, hidden]");
    vocab = embed_t.size(0), hidden = embed_t.size(1);
    TORCH_CHECK(heads % kv_heads == 0 && heads / kv_heads <= attn::kMaxGroup &&
                    head_dim % (2 * rows::kLanes) == 0,
                "at most 8 query heads per kv head and head_dim a multiple of 32");
    attend = attn::decode_fn<float>(head_dim);
    TORCH_CHECK(attend != nullptr, "head_dim: 32, 64, 96, 128 or 256");
    const int64_t q = heads * head_dim, kv = kv_heads * head_dim;
    embed = vector(embed_t, vocab * hidden, "embed");
    final_norm = vector(final_norm_t, hidden, "final norm");
    lm_head = product(lm_head_t, at::Tensor(), hidden, vocab, "output projection");
    inter = held[kGateUp].size(0) * panel::kCols / 2;
    for (int64_t l = 0; l < layers; ++l) {
      const at::Tensor* w = held.data() + l * kPerLayer;
      in_norm.push_back(vector(w[kInNorm], hidden, "input norm"));
      qkv.push_back(product(w[kQkv], w[kQkvBias], hidden, q + 2 * kv, "qkv"));
      o.push_back(product(w[kO], w[kOBias], q, hidden, "o"));
      post_norm.push_back(vector(w[kPostNorm], hidden, "post-attention norm"));
      gate_up.push_back(product(w[kGateUp], at::Tensor(), hidden, 2 * inter, "gate/up"));
      down.push_back(product(w[kDown], at::Tensor(), inter, hidden, "down"));
    }
    held.insert(held.end(), {embed_t, final_norm_t, lm_head_t});
    eps = static_cast<float>(eps_), scale = static_cast<float>(scale_);
  }

  static const float* vector(const at::Tensor& t, int64_t n, const char* what) {
    TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous() && t.numel() == n &&
                    t.device().is_cpu(),
                what, ": contiguous float32 on CPU with ", n, " elements");
    return t.data_ptr<float>();
  }

  static Product product(const at::Tensor& panels, const at::Tensor& bias, int64_t in, int64_t out,
                         const char* what) {
    TORCH_CHECK(panels.scalar_type() == at::kFloat && panels.dim() == 3 && panels.is_contiguous() &&
                    panels.size(1) == in && panels.size(2) == panel::kCols &&
                    panels.size(0) * panel::kCols == out &&
                    reinterpret_cast<uintptr_t>(panels.data_ptr()) % 64 == 0,
                what, ": 64-byte aligned float32 panels [", out / panel::kCols, ", ", in, ", 16]");
    const float* b = nullptr;
    if (bias.defined() && bias.numel() > 0) b = vector(bias, out, what);
    return {panels.data_ptr<float>(), in, out, panels.size(0), b};
  }

  static void run(const Product& p, const float* x, int64_t n, float* y) {
    panel::product(x, n, p.in, p.panels, p.count, p.out, p.bias, y);
  }

  // ids [n]: each sequence's new token; cos, sin [P, head_dim]: the RoPE tables of positions
  // [0, P), of which a sequence takes row lens - 1; slots [n]: where its K/V go; tables [n, w],
  // lens [n]: its blocks and its length with the new token. kv_cache [layers, 2, blocks,
  // block_size, kv_heads, head_dim]. Returns logits [n, vocab].
  at::Tensor step(at::Tensor ids, at::Tensor cos, at::Tensor sin, at::Tensor slots,
                  at::Tensor tables, at::Tensor lens, at::Tensor kv_cache) {
    const int64_t n = ids.numel(), hd = head_dim;
    TORCH_CHECK(ids.scalar_type() == at::kLong && ids.is_contiguous() && slots.scalar_type() == at::kLong &&
                    slots.is_contiguous() && slots.numel() == n && lens.scalar_type() == at::kLong &&
                    lens.is_contiguous() && lens.numel() == n && tables.scalar_type() == at::kLong &&
                    tables.is_contiguous() && tables.dim() == 2 && tables.size(0) == n,
                "ids, slots, lens [n] and tables [n, w]: contiguous int64");
    TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat &&
                    cos.is_contiguous() && sin.is_contiguous() && cos.dim() == 2 &&
                    cos.size(1) == hd && sin.sizes() == cos.sizes(),
                "cos, sin: contiguous float32 [positions, head_dim]");
    const int64_t positions = cos.size(0);
    TORCH_CHECK(kv_cache.scalar_type() == at::kFloat && kv_cache.is_contiguous() &&
                    kv_cache.dim() == 6 && kv_cache.size(0) == layers && kv_cache.size(1) == 2 &&
                    kv_cache.size(4) == kv_heads && kv_cache.size(5) == hd,
                "kv_cache: contiguous float32 [layers, 2, blocks, block_size, kv_heads, head_dim]");
    const int64_t blocks = kv_cache.size(2), bs = kv_cache.size(3), width = tables.size(1);
    const int64_t *idp = ids.data_ptr<int64_t>(), *sp = slots.data_ptr<int64_t>();
    const int64_t *tp = tables.data_ptr<int64_t>(), *lp = lens.data_ptr<int64_t>();
    for (int64_t r = 0; r < n; ++r) {
      TORCH_CHECK(idp[r] >= 0 && idp[r] < vocab, "token id ", idp[r], " outside the vocabulary");
      TORCH_CHECK(sp[r] >= 0 && sp[r] < blocks * bs, "slot ", sp[r], " outside the cache");
      TORCH_CHECK(lp[r] >= 1 && lp[r] <= width * bs, "length ", lp[r], " outside its block table");
      TORCH_CHECK(lp[r] <= positions, "length ", lp[r], " past the RoPE tables");
      for (int64_t b = 0; b < (lp[r] + bs - 1) / bs; ++b)
        TORCH_CHECK(tp[r * width + b] >= 0 && tp[r * width + b] < blocks, "block outside the cache");
    }
    at::Tensor logits = at::empty({n, vocab}, cos.options());
    if (n == 0) return logits;

    const int64_t q = heads * hd, kv = kv_heads * hd, qkv_width = q + 2 * kv, g = heads / kv_heads;
    std::vector<float> x(n * hidden), h(n * hidden), d(n * hidden), qkvb(n * qkv_width), att(n * q),
        gu(n * 2 * inter), act(n * inter);
    each_row(n, hidden, [&](int64_t r) {
      std::memcpy(x.data() + r * hidden, embed + idp[r] * hidden, hidden * sizeof(float));
    });
    const float *cp = cos.data_ptr<float>(), *snp = sin.data_ptr<float>();
    float* cache = kv_cache.data_ptr<float>();
    const int64_t layer_stride = kv_cache.stride(0), kv_stride = kv_cache.stride(1);
    const attn::Layout lay{bs, kv_cache.stride(2), kv_cache.stride(3), hd, g};

    for (int64_t l = 0; l < layers; ++l) {
      float* kc = cache + l * layer_stride;
      float* vc = kc + kv_stride;
      each_row(n, hidden, [&](int64_t r) {
        rows::norm_row(x.data() + r * hidden, in_norm[l], hidden, eps, h.data() + r * hidden);
      });
      run(qkv[l], h.data(), n, qkvb.data());
      each_row(n, qkv_width, [&](int64_t r) {
        rows::rope_row(qkvb.data() + r * qkv_width, cp + (lp[r] - 1) * hd, snp + (lp[r] - 1) * hd,
                       heads, kv_heads, hd, kc, vc, sp[r]);
      });
      attend(qkvb.data(), qkv_width, att.data(), q, n, lp, kc, vc, tp, width, kv_heads, scale, lay);
      run(o[l], att.data(), n, d.data());
      each_row(n, hidden, [&](int64_t r) {
        rows::add_norm_row(x.data() + r * hidden, d.data() + r * hidden, post_norm[l], hidden, eps,
                           h.data() + r * hidden);
      });
      run(gate_up[l], h.data(), n, gu.data());
      each_row(n, 2 * inter, [&](int64_t r) {
        rows::silu_mul_row(gu.data() + r * 2 * inter, gu.data() + r * 2 * inter + inter, inter,
                           act.data() + r * inter);
      });
      run(down[l], act.data(), n, d.data());
      each_row(n, hidden, [&](int64_t r) {
        for (int64_t i = r * hidden; i < (r + 1) * hidden; ++i) x[i] += d[i];
      });
    }
    each_row(n, hidden, [&](int64_t r) {
      rows::norm_row(x.data() + r * hidden, final_norm, hidden, eps, h.data() + r * hidden);
    });
    run(lm_head, h.data(), n, logits.data_ptr<float>());
    return logits;
  }
};

}  // namespace

TORCH_LIBRARY_FRAGMENT(splitserve, m) {
  m.class_<DecodeModel>("DecodeModel")
      .def(torch::init<std::vector<at::Tensor>, at::Tensor, at::Tensor, at::Tensor,
                       std::vector<int64_t>, double, double>())
      .def("step", &DecodeModel::step);
}
