// The decoder stack of a Llama-family model for the few new tokens of a decoding step or a
// verification tree, in one call: RMSNorm, fused QKV, RoPE, the KV-cache write, attention over the
// cached prefix and the tree, the output projection and the gated MLP, layer after layer, with the
// small-batch linear kernels. From Python the same step costs ~20 framework operations per layer,
// each a few microseconds: as much as the weights take to stream once they are quantized.
//
// Every new token's row goes through the same instructions whatever the number of rows: the
// linear kernels never mix rows, and a row's attention visits the committed prefix and then its
// visible tree tokens in order, so a token verified in a tree gets bitwise the logits plain
// decoding gives it once its ancestors are committed.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "kernels.h"

namespace {

using jakiro::hsum;
using jakiro::load;
using jakiro::store;
using jakiro::vf;
using jakiro::VL;
typedef int32_t vi __attribute__((vector_size(VL * sizeof(int32_t))));

// e^x to about one ulp (Cephes' expf: x = n ln2 + r, a degree-6 polynomial in r, 2^n through the
// exponent bits); inputs below -87.3 give ~1e-38 instead of 0, which no softmax or SiLU notices
inline vf vexp(vf x) {
  const vf lo = vf{} - 87.3f, hi = vf{} + 88.3f;
  x = x < lo ? lo : x;
  x = x > hi ? hi : x;
  const vf t = x * 1.44269504088896341f;
  const vi n = __builtin_convertvector(t + (t >= 0.f ? vf{} + 0.5f : vf{} - 0.5f), vi);
  const vf nf = __builtin_convertvector(n, vf);
  const vf r = x - nf * 0.693359375f + nf * 2.12194440e-4f;
  vf p = vf{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  const vi bits = (n + 127) << 23;
  vf scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

inline float sexp(float x) {
  vf v = vf{} + x;
  v = vexp(v);
  return v[0];
}

// y = w * (x / rms(x)) over d values
void rmsnorm(const float* x, const float* w, float* y, int64_t d, float eps) {
  vf acc = vf{};
  int64_t i = 0;
  for (; i + VL <= d; i += VL) {
    const vf v = load(x + i);
    acc += v * v;
  }
  float ss = hsum(acc);
  for (; i < d; ++i) ss += x[i] * x[i];
  const float inv = 1.f / std::sqrt(ss / static_cast<float>(d) + eps);
  for (i = 0; i < d; ++i) y[i] = w[i] * (x[i] * inv);
}

// rotate-half RoPE of one head, in place (cos/sin rows hold the angle twice)
void rope(float* v, const float* cos, const float* sin, int64_t D) {
  const int64_t half = D / 2;
  for (int64_t i = 0; i < half; ++i) {
    const float a = v[i], b = v[i + half];
    v[i] = a * cos[i] - b * sin[i];
    v[i + half] = b * cos[i + half] + a * sin[i + half];
  }
}

inline float dot(const float* a, const float* b, int64_t D) {
  vf acc = vf{};
  int64_t i = 0;
  for (; i + VL <= D; i += VL) acc += load(a + i) * load(b + i);
  float s = hsum(acc);
  for (; i < D; ++i) s += a[i] * b[i];
  return s;
}

// The g query heads q [g][D] sharing one KV head attend its `past` cached keys and the visible new
// keys `slots` (positions past + c): out [g][D]. scores: scratch of g * (past + slots) floats.
void attend(const float* q, int64_t g, const float* K, const float* V, int64_t past,
            const std::vector<int64_t>& slots, int64_t D, float scale, float* out, float* scores) {
  const int64_t L = past + static_cast<int64_t>(slots.size());
  auto key = [&](int64_t i) { return i < past ? i : past + slots[i - past]; };
  for (int64_t i = 0; i < L; ++i) {
    const float* k = K + key(i) * D;
    for (int64_t h = 0; h < g; ++h) scores[h * L + i] = dot(q + h * D, k, D) * scale;
  }
  for (int64_t h = 0; h < g; ++h) {
    float* s = scores + h * L;
    float m = s[0];
    for (int64_t i = 1; i < L; ++i) m = std::max(m, s[i]);
    vf acc = vf{};
    int64_t i = 0;
    for (; i + VL <= L; i += VL) {
      const vf e = vexp(load(s + i) - m);
      store(s + i, e);
      acc += e;
    }
    float sum = hsum(acc);
    for (; i < L; ++i) {
      s[i] = sexp(s[i] - m);
      sum += s[i];
    }
    float* o = out + h * D;
    std::fill(o, o + D, 0.f);
    for (int64_t j = 0; j < L; ++j) {
      const float* v = V + key(j) * D;
      const float p = s[j];
      for (int64_t c = 0; c < D; ++c) o[c] += p * v[c];
    }
    const float inv = 1.f / sum;
    for (int64_t c = 0; c < D; ++c) o[c] *= inv;
  }
}

inline vf silu_times(vf g, vf u) { return g / (1.f + vexp(-g)) * u; }

struct LayerWeights {
  const float* input_norm;
  const float* post_norm;
  const at::Tensor* qkv;
  const float* qkv_bias;
  const at::Tensor* o;
  const at::Tensor* gate_up;
  const at::Tensor* down;
  const float* q_norm;
  const float* k_norm;
};

constexpr int64_t SLOTS = 9;  // weights per layer in the op's list

const float* optional_data(const c10::optional<at::Tensor>& t) {
  return t.has_value() && t->defined() ? t->data_ptr<float>() : nullptr;
}

at::Tensor decoder_layers(const at::Tensor& x_in, const std::vector<c10::optional<at::Tensor>>& weights,
                          at::IntArrayRef out_features, const at::Tensor& kv, int64_t past, const at::Tensor& cos,
                          const at::Tensor& sin, const c10::optional<at::Tensor>& tree_mask, int64_t H, int64_t Hkv,
                          double eps_d, double scale_d) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kFloat, "decoder_layers: x must be [n, d] float32");
  const int64_t layers = static_cast<int64_t>(weights.size()) / SLOTS;
  TORCH_CHECK(layers * SLOTS == static_cast<int64_t>(weights.size()) &&
                  static_cast<int64_t>(out_features.size()) == 4 * layers,
              "decoder_layers: 9 weights and 4 output sizes per layer");
  TORCH_CHECK(kv.dim() == 6 && kv.scalar_type() == at::kFloat && kv.size(0) == layers && kv.size(2) == 1 &&
                  kv.size(3) == Hkv && kv.stride(5) == 1 && kv.stride(4) == kv.size(5),
              "decoder_layers: the KV cache does not match the model");
  auto x = x_in.contiguous().clone();
  const int64_t n = x.size(0), d = x.size(1), D = kv.size(5), g = H / Hkv;
  TORCH_CHECK(H % Hkv == 0 && D % 2 == 0, "decoder_layers: head layout");
  TORCH_CHECK(past >= 0 && past + n <= kv.size(4), "decoder_layers: KV cache overflow");
  TORCH_CHECK(cos.dim() == 2 && cos.size(0) == n && cos.size(1) == D && cos.is_contiguous() && sin.sizes() == cos.sizes() &&
                  sin.is_contiguous(),
              "decoder_layers: cos/sin must be [n, head_dim]");
  const int64_t NQKV = (H + 2 * Hkv) * D;
  std::vector<LayerWeights> lw(layers);
  int64_t inter = 0;
  for (int64_t l = 0; l < layers; ++l) {
    const auto* w = &weights[l * SLOTS];
    for (int64_t s : {0, 1, 2, 4, 5, 6})
      TORCH_CHECK(w[s].has_value() && w[s]->defined(), "decoder_layers: layer ", l, " lacks weight ", s);
    const int64_t* N = &out_features[l * 4];
    TORCH_CHECK(N[0] == NQKV && N[1] == d && N[3] == d && N[2] % 2 == 0, "decoder_layers: layer ", l, " shapes");
    inter = N[2] / 2;
    TORCH_CHECK(jakiro::valid_linear(*w[2], N[0], d) && jakiro::valid_linear(*w[4], N[1], H * D) &&
                    jakiro::valid_linear(*w[5], N[2], d) && jakiro::valid_linear(*w[6], N[3], inter),
                "decoder_layers: layer ", l, " has a weight the kernels cannot take");
    lw[l] = {w[0]->data_ptr<float>(), w[1]->data_ptr<float>(), &*w[2], optional_data(w[3]), &*w[4], &*w[5], &*w[6],
             optional_data(w[7]), optional_data(w[8])};
  }
  std::vector<std::vector<int64_t>> visible(n);
  if (tree_mask.has_value() && tree_mask->defined()) {
    const auto m = tree_mask->to(at::kBool).contiguous();
    TORCH_CHECK(m.dim() == 2 && m.size(0) == n && m.size(1) == n, "decoder_layers: tree mask must be [n, n]");
    const bool* mp = m.data_ptr<bool>();
    for (int64_t r = 0; r < n; ++r)
      for (int64_t c = 0; c < n; ++c)
        if (mp[r * n + c]) visible[r].push_back(c);
  } else {
    for (int64_t r = 0; r < n; ++r)
      for (int64_t c = 0; c <= r; ++c) visible[r].push_back(c);
  }
  const float eps = static_cast<float>(eps_d), scale = static_cast<float>(scale_d);
  auto opts = x.options();
  auto h = at::empty({n, d}, opts), ob = at::empty({n, H * D}, opts), qkv = at::empty({n, NQKV}, opts), y = at::empty({n, d}, opts);
  auto gu = at::empty({n, 2 * inter}, opts), act = at::empty({n, inter}, opts);
  auto scores = at::empty({n * Hkv, g * (past + n)}, opts);
  float *xp = x.data_ptr<float>(), *hp = h.data_ptr<float>(), *op = ob.data_ptr<float>(), *qp = qkv.data_ptr<float>(), *yp = y.data_ptr<float>();
  float *gp = gu.data_ptr<float>(), *ap = act.data_ptr<float>(), *sp = scores.data_ptr<float>();
  const float *cp = cos.data_ptr<float>(), *snp = sin.data_ptr<float>();
  float* kvp = kv.data_ptr<float>();
  const int64_t s0 = kv.stride(0), s1 = kv.stride(1), s3 = kv.stride(3), s4 = kv.stride(4);
  const int64_t work = n * H * (past + n) * D;
  TORCH_CHECK(D <= 1024, "decoder_layers: head_dim above 1024");

  for (int64_t l = 0; l < layers; ++l) {
    const LayerWeights& L = lw[l];
    float* kc = kvp + l * s0;
    float* vc = kc + s1;
    for (int64_t r = 0; r < n; ++r) rmsnorm(xp + r * d, L.input_norm, hp + r * d, d, eps);
    jakiro::apply_linear(*L.qkv, NQKV, L.qkv_bias, hp, n, d, qp);
    for (int64_t r = 0; r < n; ++r) {
      float* row = qp + r * NQKV;
      for (int64_t a = 0; a < H + Hkv; ++a) {
        float* v = row + a * D;
        const float* nw = a < H ? L.q_norm : L.k_norm;
        if (nw) {
          float tmp[1024];
          rmsnorm(v, nw, tmp, D, eps);
          std::memcpy(v, tmp, D * sizeof(float));
        }
        rope(v, cp + r * D, snp + r * D, D);
      }
      for (int64_t j = 0; j < Hkv; ++j) {
        std::memcpy(kc + j * s3 + (past + r) * s4, row + (H + j) * D, D * sizeof(float));
        std::memcpy(vc + j * s3 + (past + r) * s4, row + (H + Hkv + j) * D, D * sizeof(float));
      }
    }
    // attention: one task per (row, KV head); its g query heads are consecutive in q
    const int64_t ld = g * (past + n);
    at::parallel_for(0, n * Hkv, work >= (1 << 16) ? 1 : n * Hkv, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t r = t / Hkv, j = t % Hkv;
        attend(qp + r * NQKV + j * g * D, g, kc + j * s3, vc + j * s3, past, visible[r], D, scale,
               op + r * H * D + j * g * D, sp + t * ld);
      }
    });
    jakiro::apply_linear(*L.o, d, nullptr, op, n, H * D, yp);
    for (int64_t i = 0; i < n * d; ++i) xp[i] += yp[i];
    for (int64_t r = 0; r < n; ++r) rmsnorm(xp + r * d, L.post_norm, yp + r * d, d, eps);
    jakiro::apply_linear(*L.gate_up, 2 * inter, nullptr, yp, n, d, gp);
    for (int64_t r = 0; r < n; ++r) {
      const float* gate = gp + r * 2 * inter;
      const float* up = gate + inter;
      float* a = ap + r * inter;
      int64_t i = 0;
      for (; i + VL <= inter; i += VL) store(a + i, silu_times(load(gate + i), load(up + i)));
      for (; i < inter; ++i) a[i] = gate[i] / (1.f + sexp(-gate[i])) * up[i];
    }
    jakiro::apply_linear(*L.down, d, nullptr, ap, n, inter, yp);
    for (int64_t i = 0; i < n * d; ++i) xp[i] += yp[i];
  }
  return x;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(jakiro_smallgemm, m) {
  m.def("decoder_layers(Tensor x, Tensor?[] weights, int[] out_features, Tensor kv, int past, Tensor cos, "
        "Tensor sin, Tensor? tree_mask, int num_heads, int num_kv_heads, float eps, float scale) -> Tensor",
        decoder_layers);
}
