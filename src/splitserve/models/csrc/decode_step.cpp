// A whole decode step of a llama-family model in one call, for a few sequences of one new
// token each (models/decode_step.py): float32 on panel.h's products, or bfloat16 on amx.h's
// where the build has AMX. It runs the same kernels, in the same order, as the model's torch
// path on packed weights does op by op (the products, rows.h's norms, RoPE and activation,
// attend.h's attention), so its logits are bit for bit the torch path's; what it saves is the
// ~300 op dispatches and tensor allocations of a step, about a third of a batch-1 step's time
// on two cores. In bfloat16, as on the torch path, attention takes its queries widened to
// float32 and its output is rounded to bfloat16; every other op computes in float32 and rounds
// each output once.
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
#include <type_traits>
#include <vector>

#include "attend.h"
#include "panel.h"
#include "rows.h"

#if defined(SPLITSERVE_AMX)  // (vec16.h)
#include "amx.h"
#endif

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
  const void* packed;  // float32 panels [count, in, 16], or bfloat16 tiles [out / 16, in / 32, 16, 32]
  int64_t in, out, count;
  const float* bias;  // or null (a bfloat16 model's widened once)
};

// float32 as float, bfloat16 as its bits.
template <typename T>
const T* typed(const void* p) {
  return static_cast<const T*>(p);
}

struct DecodeModel : torch::CustomClassHolder {
  std::vector<at::Tensor> held;  // keeps every tensor below alive
  std::vector<at::Tensor> widened;  // the biases in float32
  std::vector<const void*> in_norm, post_norm;
  std::vector<Product> qkv, o, gate_up, down;
  const void *embed, *final_norm;
  Product lm_head;
  at::ScalarType dtype;  // float32 or bfloat16: the weights', the cache's and the RoPE tables'
  int64_t layers, heads, kv_heads, head_dim, hidden, inter, vocab;
  float eps, scale;
  attn::DecodeFn<float> attend;
  attn::DecodeFn<uint16_t> attend_bf16;

  DecodeModel(std::vector<at::Tensor> weights, at::Tensor embed_t, at::Tensor final_norm_t,
              at::Tensor lm_head_t, std::vector<int64_t> dims, double eps_, double scale_)
      : held(std::move(weights)) {
    TORCH_CHECK(dims.size() == 3, "dims: heads, kv_heads, head_dim");
    heads = dims[0], kv_heads = dims[1], head_dim = dims[2];
    TORCH_CHECK(!held.empty() && held.size() % kPerLayer == 0, "weights: 8 tensors per layer");
    layers = static_cast<int64_t>(held.size()) / kPerLayer;
    TORCH_CHECK(embed_t.dim() == 2, "embed: [vocab, hidden]");
    vocab = embed_t.size(0), hidden = embed_t.size(1);
    dtype = embed_t.scalar_type();
    TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "weights: float32 or bfloat16");
#if defined(SPLITSERVE_AMX)
    TORCH_CHECK(dtype == at::kFloat || amx::ready(), "bfloat16: the OS gave no AMX tile state");
#else
    TORCH_CHECK(dtype == at::kFloat, "bfloat16 steps need a build with AMX (this CPU has none)");
#endif
    TORCH_CHECK(heads % kv_heads == 0 && heads / kv_heads <= attn::kMaxGroup &&
                    head_dim % (2 * rows::kLanes) == 0,
                "at most 8 query heads per kv head and head_dim a multiple of 32");
    attend = attn::decode_fn<float>(head_dim);
    attend_bf16 = attn::decode_fn<uint16_t>(head_dim);
    TORCH_CHECK(attend != nullptr, "head_dim: 32, 64, 96, 128 or 256");
    const int64_t q = heads * head_dim, kv = kv_heads * head_dim;
    embed = vector(embed_t, vocab * hidden, "embed");
    final_norm = vector(final_norm_t, hidden, "final norm");
    lm_head = product(lm_head_t, at::Tensor(), hidden, vocab, "output projection");
    inter = held[kGateUp].size(0) * panel::kCols / 2;  // 16 columns a panel or a tile
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

  const void* vector(const at::Tensor& t, int64_t n, const char* what) const {
    TORCH_CHECK(t.scalar_type() == dtype && t.is_contiguous() && t.numel() == n && t.device().is_cpu(),
                what, ": contiguous on CPU in the model's dtype with ", n, " elements");
    return t.data_ptr();
  }

  Product product(const at::Tensor& packed, const at::Tensor& bias, int64_t in, int64_t out,
                  const char* what) {
    if (dtype == at::kFloat) {
      TORCH_CHECK(packed.scalar_type() == at::kFloat && packed.dim() == 3 && packed.is_contiguous() &&
                      packed.size(1) == in && packed.size(2) == panel::kCols &&
                      packed.size(0) * panel::kCols == out &&
                      reinterpret_cast<uintptr_t>(packed.data_ptr()) % 64 == 0,
                  what, ": 64-byte aligned float32 panels [", out / panel::kCols, ", ", in, ", 16]");
    } else {
      TORCH_CHECK(packed.scalar_type() == at::kBFloat16 && packed.dim() == 4 &&
                      packed.is_contiguous() && packed.size(0) * 16 == out &&
                      packed.size(1) * 32 == in && packed.size(2) == 16 && packed.size(3) == 32,
                  what, ": bfloat16 tiles [", out / 16, ", ", in / 32, ", 16, 32]");
    }
    const float* b = nullptr;
    if (bias.defined() && bias.numel() > 0) {
      vector(bias, out, what);
      widened.push_back(bias.to(at::kFloat).contiguous());  // the sums take it in float32
      b = widened.back().data_ptr<float>();
    }
    return {packed.data_ptr(), in, out, packed.size(0), b};
  }

  // y [n, out / 2] = silu(x gate^T) * (x up^T) in one product, for bfloat16 tiles whose gate
  // and up halves are whole panels; false where it does not apply (y untouched).
  template <typename T>
  static bool silu_product(const Product& p, const T* x, int64_t n, T* y) {
#if defined(SPLITSERVE_AMX)
    if constexpr (std::is_same_v<T, uint16_t>) {
      if (p.out % 32 == 0 && p.bias == nullptr) {
        amx::product<true>(x, n, p.in, typed<uint16_t>(p.packed), p.out, nullptr, y);
        return true;
      }
    }
#endif
    return false;
  }

  template <typename T>
  static void run(const Product& p, const T* x, int64_t n, T* y) {
    if constexpr (std::is_same_v<T, float>) {
      panel::product(x, n, p.in, typed<float>(p.packed), p.count, p.out, p.bias, y);
    } else {
#if defined(SPLITSERVE_AMX)
      amx::product(x, n, p.in, typed<uint16_t>(p.packed), p.out, p.bias, y);
#endif
    }
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
    TORCH_CHECK(cos.scalar_type() == dtype && sin.scalar_type() == dtype && cos.is_contiguous() &&
                    sin.is_contiguous() && cos.dim() == 2 && cos.size(1) == hd &&
                    sin.sizes() == cos.sizes(),
                "cos, sin: contiguous [positions, head_dim] in the model's dtype");
    const int64_t positions = cos.size(0);
    TORCH_CHECK(kv_cache.scalar_type() == dtype && kv_cache.is_contiguous() && kv_cache.dim() == 6 &&
                    kv_cache.size(0) == layers && kv_cache.size(1) == 2 &&
                    kv_cache.size(4) == kv_heads && kv_cache.size(5) == hd,
                "kv_cache: contiguous [layers, 2, blocks, block_size, kv_heads, head_dim] in the "
                "model's dtype");
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
    at::Tensor logits = at::empty({n, vocab}, cos.options().dtype(at::kFloat));
    if (n == 0) return logits;
    if (dtype == at::kFloat)
      layers_of<float>(n, idp, sp, tp, width, lp, cos, sin, kv_cache, logits);
    else
      layers_of<uint16_t>(n, idp, sp, tp, width, lp, cos, sin, kv_cache, logits);
    return logits;
  }

  // The step on rows of T (float, or bfloat16 bits): logits [n, vocab] float32 filled.
  template <typename T>
  void layers_of(int64_t n, const int64_t* idp, const int64_t* sp, const int64_t* tp, int64_t width,
                 const int64_t* lp, const at::Tensor& cos, const at::Tensor& sin,
                 const at::Tensor& kv_cache, at::Tensor& logits) {
    constexpr bool kFloat32 = std::is_same_v<T, float>;
    const int64_t hd = head_dim, q = heads * hd, kv = kv_heads * hd, qkv_width = q + 2 * kv;
    const int64_t g = heads / kv_heads;
    std::vector<T> x(n * hidden), h(n * hidden), d(n * hidden), qkvb(n * qkv_width), att(n * q),
        gu(n * 2 * inter), act(n * inter);
    // bfloat16: the queries widened for attention, and its float32 output.
    std::vector<float> qf(kFloat32 ? 0 : n * q), af(kFloat32 ? 0 : n * q);
    const T* emb = typed<T>(embed);
    each_row(n, hidden, [&](int64_t r) {
      std::memcpy(x.data() + r * hidden, emb + idp[r] * hidden, hidden * sizeof(T));
    });
    const T *cp = typed<T>(cos.data_ptr()), *snp = typed<T>(sin.data_ptr());
    T* cache = static_cast<T*>(kv_cache.data_ptr());
    const int64_t layer_stride = kv_cache.stride(0), kv_stride = kv_cache.stride(1);
    const attn::Layout lay{kv_cache.size(3), kv_cache.stride(2), kv_cache.stride(3), hd, g};

    for (int64_t l = 0; l < layers; ++l) {
      T* kc = cache + l * layer_stride;
      T* vc = kc + kv_stride;
      each_row(n, hidden, [&](int64_t r) {
        rows::norm_row(x.data() + r * hidden, typed<T>(in_norm[l]), hidden, eps, h.data() + r * hidden);
      });
      run(qkv[l], h.data(), n, qkvb.data());
      each_row(n, qkv_width, [&](int64_t r) {
        rows::rope_row(qkvb.data() + r * qkv_width, cp + (lp[r] - 1) * hd, snp + (lp[r] - 1) * hd,
                       heads, kv_heads, hd, kc, vc, sp[r]);
      });
      if constexpr (kFloat32) {
        attend(qkvb.data(), qkv_width, att.data(), q, n, lp, kc, vc, tp, width, kv_heads, scale, lay);
      } else {
        each_row(n, q, [&](int64_t r) {
          for (int64_t c = 0; c < q; c += rows::kLanes)
            vec16::storeu(qf.data() + r * q + c, vec16::load_row(qkvb.data() + r * qkv_width + c));
        });
        attend_bf16(qf.data(), q, af.data(), q, n, lp, kc, vc, tp, width, kv_heads, scale, lay);
        each_row(n, q, [&](int64_t r) {
          for (int64_t c = 0; c < q; c += rows::kLanes)
            vec16::store_n(att.data() + r * q + c, rows::kLanes, vec16::loadu(af.data() + r * q + c));
        });
      }
      run(o[l], att.data(), n, d.data());
      each_row(n, hidden, [&](int64_t r) {
        rows::add_norm_row(x.data() + r * hidden, d.data() + r * hidden, typed<T>(post_norm[l]), hidden,
                           eps, h.data() + r * hidden);
      });
      if (!silu_product<T>(gate_up[l], h.data(), n, act.data())) {
        run(gate_up[l], h.data(), n, gu.data());
        each_row(n, 2 * inter, [&](int64_t r) {
          rows::silu_mul_row(gu.data() + r * 2 * inter, gu.data() + r * 2 * inter + inter, inter,
                             act.data() + r * inter);
        });
      }
      run(down[l], act.data(), n, d.data());
      each_row(n, hidden, [&](int64_t r) {
        T *xr = x.data() + r * hidden, *dr = d.data() + r * hidden;
        for (int64_t c = 0; c < hidden; c += rows::kLanes)
          vec16::store_n(xr + c, hidden - c,
                         vec16::add(vec16::load_n(xr + c, hidden - c), vec16::load_n(dr + c, hidden - c)));
      });
    }
    each_row(n, hidden, [&](int64_t r) {
      rows::norm_row(x.data() + r * hidden, typed<T>(final_norm), hidden, eps, h.data() + r * hidden);
    });
    float* out = logits.data_ptr<float>();
    if constexpr (kFloat32) {
      run(lm_head, h.data(), n, out);
    } else {  // the projection's bfloat16 logits, widened (exactly)
      std::vector<T> rounded(n * vocab);
      run(lm_head, h.data(), n, rounded.data());
      each_row(n, vocab, [&](int64_t r) {
        for (int64_t c = 0; c < vocab; c += rows::kLanes)
          vec16::store_n(out + r * vocab + c, vocab - c, vec16::load_n(rounded.data() + r * vocab + c, vocab - c));
      });
    }
  }
};

}  // namespace

TORCH_LIBRARY_FRAGMENT(splitserve, m) {
  m.class_<DecodeModel>("DecodeModel")
      .def(torch::init<std::vector<at::Tensor>, at::Tensor, at::Tensor, at::Tensor,
                       std::vector<int64_t>, double, double>())
      .def("step", &DecodeModel::step);
}
