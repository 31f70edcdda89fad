// y = x @ W^T (+ b) for the few rows of a decoding step or a draft tree: memory-bound, so the
// kernel is built to stream each weight once at the machine's read bandwidth.
//
// W [N, K] is packed once into sub-panels of 16 output columns, [N/16][K][16]: a sub-panel is
// one sequential read. A group of S = 6 sub-panels is streamed together (six concurrent read
// streams keep enough cache-line misses in flight; one stream does not), and each block of up to
// R = 4 input rows keeps its 4 x 6 vector partial sums in registers while the group streams by;
// further row blocks reread the group from L2.
//
// Every output row goes through the same instruction sequence whatever the number of rows (rows
// never share accumulators), so a token's logits are bitwise the same in a one-token step and in
// a tree of any size.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t VL = 16;  // floats per vector and columns per sub-panel
constexpr int64_t S = 6;    // sub-panels streamed together
constexpr int64_t R = 4;    // input rows per register block

typedef float vf __attribute__((vector_size(VL * sizeof(float))));

inline vf load(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof(vf));
  return v;
}

// a scalar broadcast straight from memory (a load-port operation, not a shuffle)
inline vf splat(const float* p) {
#if defined(__AVX512F__)
  return (vf)_mm512_set1_ps(*p);
#else
  return vf{} + *p;
#endif
}

// rows x[0..RR) against sub-panels w[0..SS) (each [K][16]); columns beyond `cols` are dropped
template <int64_t SS, int64_t RR>
void block(const float* x, int64_t ldx, const float* w, int64_t K, const float* bias, float* y,
           int64_t ldy, int64_t cols) {
  vf acc[RR][SS];
  for (int64_t r = 0; r < RR; ++r)
    for (int64_t s = 0; s < SS; ++s) acc[r][s] = vf{};
  for (int64_t k = 0; k < K; ++k) {
    vf xv[RR];
    for (int64_t r = 0; r < RR; ++r) xv[r] = splat(x + r * ldx + k);
    for (int64_t s = 0; s < SS; ++s) {
      const vf wv = load(w + (s * K + k) * VL);
      for (int64_t r = 0; r < RR; ++r) acc[r][s] += xv[r] * wv;
    }
  }
  for (int64_t r = 0; r < RR; ++r) {
    float out[SS * VL];
    std::memcpy(out, acc[r], sizeof(out));
    float* dst = y + r * ldy;
    const int64_t n = std::min<int64_t>(cols, SS * VL);
    if (bias) {
      for (int64_t j = 0; j < n; ++j) dst[j] = out[j] + bias[j];
    } else {
      std::memcpy(dst, out, n * sizeof(float));
    }
  }
}

template <int64_t SS>
void group(const float* x, int64_t M, const float* w, int64_t K, const float* bias, float* y, int64_t N,
           int64_t cols) {
  int64_t m = 0;
  for (; m + R <= M; m += R) block<SS, R>(x + m * K, K, w, K, bias, y + m * N, N, cols);
  switch (M - m) {
    case 3: block<SS, 3>(x + m * K, K, w, K, bias, y + m * N, N, cols); break;
    case 2: block<SS, 2>(x + m * K, K, w, K, bias, y + m * N, N, cols); break;
    case 1: block<SS, 1>(x + m * K, K, w, K, bias, y + m * N, N, cols); break;
    default: break;
  }
}

at::Tensor pack(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat, "pack: a 2-D float32 weight");
  auto w = weight.contiguous();
  const int64_t N = w.size(0), K = w.size(1), P = (N + VL - 1) / VL;
  auto out = at::zeros({P, K, VL}, w.options());
  const float* src = w.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p)
      for (int64_t j = 0; j < VL && p * VL + j < N; ++j)
        for (int64_t k = 0; k < K; ++k) dst[(p * K + k) * VL + j] = src[(p * VL + j) * K + k];
  });
  return out;
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& packed, int64_t N, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "linear: x must be [rows, in] float32");
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == VL && packed.size(1) == x.size(1),
              "linear: the packed weight does not match x");
  auto xc = x.contiguous();
  const int64_t M = xc.size(0), K = xc.size(1), P = packed.size(0);
  TORCH_CHECK(N > 0 && N <= P * VL && N > (P - 1) * VL, "linear: N does not match the packed weight");
  auto y = at::empty({M, N}, xc.options());
  const float* b = nullptr;
  at::Tensor bc;
  if (bias.has_value() && bias->defined()) {
    bc = bias->contiguous();
    TORCH_CHECK(bc.numel() == N, "linear: bias size");
    b = bc.data_ptr<float>();
  }
  if (M == 0) return y;
  const float* xp = xc.data_ptr<float>();
  const float* wp = packed.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t G = (P + S - 1) / S;
  at::parallel_for(0, G, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t p = g * S, ss = std::min(S, P - p), col = p * VL, cols = N - col;
      const float* w = wp + p * K * VL;
      const float* bg = b ? b + col : nullptr;
      switch (ss) {
        case 6: group<6>(xp, M, w, K, bg, yp + col, N, cols); break;
        case 5: group<5>(xp, M, w, K, bg, yp + col, N, cols); break;
        case 4: group<4>(xp, M, w, K, bg, yp + col, N, cols); break;
        case 3: group<3>(xp, M, w, K, bg, yp + col, N, cols); break;
        case 2: group<2>(xp, M, w, K, bg, yp + col, N, cols); break;
        default: group<1>(xp, M, w, K, bg, yp + col, N, cols); break;
      }
    }
  });
  return y;
}

}  // namespace

TORCH_LIBRARY(jakiro_smallgemm, m) {
  m.def("pack(Tensor weight) -> Tensor", pack);
  m.def("linear(Tensor x, Tensor packed, int n, Tensor? bias) -> Tensor", linear);
}
