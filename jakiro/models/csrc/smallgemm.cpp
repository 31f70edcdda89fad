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

#include "kernels.h"
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

using jakiro::hsum;
using jakiro::load;
using jakiro::vf;
using jakiro::VL;  // floats per vector and columns per sub-panel
#if defined(__AVX512F__)
constexpr int64_t S = 6;    // sub-panels streamed together
constexpr int64_t R = 4;    // input rows per register block
#else  // 16 registers of 8 floats: the partial sums of 3 x 2 vectors
constexpr int64_t S = 3;
constexpr int64_t R = 2;
#endif

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
#if defined(__AVX2__) && !defined(__AVX512F__)
  // a sub-panel's 16 columns as two 8-lane halves, each column's sum taken in the same order
  __m256 half[RR][SS][2];
  for (int64_t r = 0; r < RR; ++r)
    for (int64_t s = 0; s < SS; ++s) half[r][s][0] = half[r][s][1] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    __m256 xv[RR];
    for (int64_t r = 0; r < RR; ++r) xv[r] = _mm256_broadcast_ss(x + r * ldx + k);
    for (int64_t s = 0; s < SS; ++s)
      for (int64_t h = 0; h < 2; ++h) {
        const __m256 wv = _mm256_loadu_ps(w + (s * K + k) * VL + 8 * h);
        for (int64_t r = 0; r < RR; ++r) half[r][s][h] = _mm256_fmadd_ps(xv[r], wv, half[r][s][h]);
      }
  }
  for (int64_t r = 0; r < RR; ++r)
    for (int64_t s = 0; s < SS; ++s) std::memcpy(&acc[r][s], half[r][s], sizeof(vf));
#else
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
#endif
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
  auto out = jakiro::weight_empty({P, K, VL}, w.options()).zero_();
  const float* src = w.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p)
      for (int64_t j = 0; j < VL && p * VL + j < N; ++j)
        for (int64_t k = 0; k < K; ++k) dst[(p * K + k) * VL + j] = src[(p * VL + j) * K + k];
  });
  return out;
}

}  // namespace

namespace jakiro {

void linear_rows(const float* xp, int64_t M, int64_t K, const float* wp, int64_t N, const float* b, float* yp) {
  const int64_t P = (N + VL - 1) / VL, G = (P + S - 1) / S;
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
}

}  // namespace jakiro

namespace {

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
  jakiro::linear_rows(xc.data_ptr<float>(), M, K, packed.data_ptr<float>(), N, b, y.data_ptr<float>());
  return y;
}

// ---------------------------------------------------------------------------------------------
// Block-quantized weights as GGUF stores them: each row of W is blocks of QB = 32 values
// w = d * q + m, with Q4_1's q in 0..15 (two per byte: the low nibbles are the block's first 16
// values, the high nibbles the next 16) or Q8_0's q in -128..127 (m = 0). A block is packed as
// [d, m as float32][q bytes], rows one after another, and dequantized in registers: d * q has at
// most 15 (Q4_1) or 19 (Q8_0) significant bits, so d * q + m rounds once whether or not the
// compiler fuses it, and the weights are bitwise those of the float32 model. A fifth or less of
// the float32 bytes streams per forward; the rows' products are accumulated as in ``linear``
// (per row and output, the same order whatever the number of rows).

using jakiro::QB;  // values per block
// output rows streamed together, each from its own span of the matrix (measured on the
// development CPU, all the default target's Q4_1 matrices, one row: 14.3 ms on one thread with
// two neighbouring rows, 7.4 ms with six spans), for up to four input rows (see qlinear_rows)
constexpr int64_t NQ = 6;

typedef uint8_t v16b __attribute__((vector_size(16)));
typedef int8_t v16s __attribute__((vector_size(16)));
using jakiro::vi;

template <bool Q4>
constexpr int64_t block_bytes() { return jakiro::gguf_block_bytes(Q4); }

template <bool Q4>
inline void dequant(const uint8_t* blk, vf& lo, vf& hi) {
  float d, m;
  std::memcpy(&d, blk, 4);
  std::memcpy(&m, blk + 4, 4);
#if defined(__AVX512F__)
  // the generic form (#else) compiles to a much slower byte widening here
  const __m512 dv = _mm512_set1_ps(d);
  if (Q4) {
    // the block's 16 possible weights d * q + m (q = 0..15) in one register, then each nibble
    // picks its weight (a permute reads only the low four bits of each index): the same values
    // as converting every nibble and multiplying, in fewer instructions
    const __m512 table = _mm512_fmadd_ps(_mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), dv,
                                         _mm512_set1_ps(m));
    const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 8)));
    lo = (vf)_mm512_permutexvar_ps(q, table);
    hi = (vf)_mm512_permutexvar_ps(_mm512_srli_epi32(q, 4), table);
  } else {
    lo = (vf)_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
             _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 8)))), dv);
    hi = (vf)_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
             _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 24)))), dv);
  }
#else
  if (Q4) {
    v16b raw;
    std::memcpy(&raw, blk + 8, 16);
    const vi q = __builtin_convertvector(raw, vi);
    lo = __builtin_convertvector(q & 15, vf) * d + m;
    hi = __builtin_convertvector(q >> 4, vf) * d + m;
  } else {
    v16s a, b;
    std::memcpy(&a, blk + 8, 16);
    std::memcpy(&b, blk + 24, 16);
    lo = __builtin_convertvector(__builtin_convertvector(a, vi), vf) * d;
    hi = __builtin_convertvector(__builtin_convertvector(b, vi), vf) * d;
  }
#endif
}

// rows x[0..RR) against weight rows w[0..NN) (each nb blocks); y[r][j] for j < NN. Each block
// is dequantized once for all RR rows; x is read from L1 as it is used (registers hold the
// RR x NN partial sums and the dequantized block).
template <bool Q4, int64_t NN, int64_t RR>
void qblock(const float* x, int64_t K, const uint8_t* w, int64_t wstride, float* y, int64_t ldy, int64_t ystride) {
  constexpr int64_t BB = block_bytes<Q4>();
  const int64_t nb = K / QB;
  vf acc[RR][NN];
  for (int64_t r = 0; r < RR; ++r)
    for (int64_t j = 0; j < NN; ++j) acc[r][j] = vf{};
  for (int64_t b = 0; b < nb; ++b) {
    if constexpr (RR <= 2) {  // memory-bound: each block's multiply-adds right after its read
      for (int64_t j = 0; j < NN; ++j) {
        vf lo, hi;
        dequant<Q4>(w + j * wstride + b * BB, lo, hi);
        for (int64_t r = 0; r < RR; ++r) {  // x comes from L1; two fused multiply-adds
          acc[r][j] += lo * load(x + r * K + b * QB);
          acc[r][j] += hi * load(x + r * K + b * QB + VL);
        }
      }
    } else {
      // multiply-add-bound: the NN blocks dequantized first, then each x piece read once from L1
      // for all NN outputs (reading it per output kept the load port as busy as the FMA units:
      // eight rows of the default target's matrices took 19.4 ms on a Zen 4 EPYC, 2 threads,
      // and 16.7-18.8 ms in this order, docs/experiments/kernel_rows.py; one or two rows were
      // slower in it)
      vf lo[NN], hi[NN];
      for (int64_t j = 0; j < NN; ++j) dequant<Q4>(w + j * wstride + b * BB, lo[j], hi[j]);
      for (int64_t r = 0; r < RR; ++r) {
        const vf xl = load(x + r * K + b * QB), xh = load(x + r * K + b * QB + VL);
        for (int64_t j = 0; j < NN; ++j) {
          acc[r][j] += lo[j] * xl;
          acc[r][j] += hi[j] * xh;
        }
      }
    }
  }
  for (int64_t r = 0; r < RR; ++r)
    for (int64_t j = 0; j < NN; ++j) y[r * ldy + j * ystride] = hsum(acc[r][j]);
}

constexpr int64_t QR = 8;  // rows per register block of the quantized kernel

// NN x RB partial sums stay in registers (with the dequantized block and x: at most 32)
template <bool Q4, int64_t NN, int64_t RB>
void qgroup(const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t wstride, float* y, int64_t N,
            int64_t ystride) {
  int64_t m = 0;
  for (; m + RB <= M; m += RB) qblock<Q4, NN, RB>(x + m * K, K, w, wstride, y + m * N, N, ystride);
  const float* xm = x + m * K;
  float* ym = y + m * N;
  switch (M - m) {
    case 7: qblock<Q4, NN, 7>(xm, K, w, wstride, ym, N, ystride); break;
    case 6: qblock<Q4, NN, 6>(xm, K, w, wstride, ym, N, ystride); break;
    case 5: qblock<Q4, NN, 5>(xm, K, w, wstride, ym, N, ystride); break;
    case 4: qblock<Q4, NN, 4>(xm, K, w, wstride, ym, N, ystride); break;
    case 3: qblock<Q4, NN, 3>(xm, K, w, wstride, ym, N, ystride); break;
    case 2: qblock<Q4, NN, 2>(xm, K, w, wstride, ym, N, ystride); break;
    case 1: qblock<Q4, NN, 1>(xm, K, w, wstride, ym, N, ystride); break;
    default: break;
  }
}

// Output rows are taken NN at a time from NN equal spans of the matrix: NN sequential read
// streams per thread (one stream alone leaves the memory system idle between its misses). Up to
// two input rows, six streams; from three rows, where the multiply-adds rather than the reads
// set the pace, three streams of eight rows, so that each block is dequantized once for up to
// eight rows. (Six streams of three or four rows, 18-24 partial sums beside the dequantized
// block, ran at 1.6-1.8x the time of three streams: measured on Zen 5 and Sapphire Rapids.)
template <bool Q4, int64_t NN, int64_t RB>
void qlinear_spans(const float* xp, int64_t M, int64_t K, const uint8_t* wp, int64_t N, float* yp) {
  constexpr int64_t BB = block_bytes<Q4>();
  const int64_t row_bytes = (K / QB) * BB, span = (N + NN - 1) / NN;
  at::parallel_for(0, span, 8, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      if (g + (NN - 1) * span < N) {
        qgroup<Q4, NN, RB>(xp, M, K, wp + g * row_bytes, span * row_bytes, yp + g, N, span);
      } else {
        for (int64_t n = g; n < N; n += span) qgroup<Q4, 1, QR>(xp, M, K, wp + n * row_bytes, 0, yp + n, N, 0);
      }
    }
  });
}

#if defined(__AVX2__) && !defined(__AVX512F__)
// ---------------------------------------------------------------------------------------------
// AVX2 (16 vector registers of 8 floats; the 16-float form above spills its accumulators there,
// and the generic dequantization widens bytes one lane at a time: a Q4_1 matrix streamed about
// 50x slower than its bytes allow). Each output (row r, column n) is one 8-lane accumulator that
// takes the block's four 8-value pieces in order with fused multiply-adds, then a fixed-order
// lane sum: the same instructions whatever the number of rows. Registers hold the accumulators
// of NN output rows x RB input rows and one dequantized block; fewer input rows stream more
// output rows side by side (one row: six; from four rows: two, each block dequantized once per
// four input rows, where the multiply-adds set the pace; measured on a Zen 3 EPYC, one
// dequantized panel in L1 for all rows or eight rows per block were no faster; nor was a layout
// of 8-column groups with lanes as output columns, each block summed as d * sum(x q) + m * sum(x)
// as llama.cpp does: faster in a standalone loop, 0.77-0.91x of this kernel's speed in the
// decoder's forwards at 1-32 rows).
namespace avx2 {

template <bool Q4>
inline void dequant8(const uint8_t* blk, __m256 out[4]) {
  const __m256 dv = _mm256_broadcast_ss(reinterpret_cast<const float*>(blk));
  // eight bytes widened straight from memory (one instruction each: the widening of a register
  // that first had to be shuffled into place cost a third more here)
  auto bytes = [blk](int64_t at) { return _mm_loadl_epi64(reinterpret_cast<const __m128i*>(blk + at)); };
  if (Q4) {
    // low nibbles are the block's values 0-15, high nibbles 16-31; d * q + m is exact before
    // rounding (q < 16), so the fused form gives the float32 model's weight
    const __m256 mv = _mm256_broadcast_ss(reinterpret_cast<const float*>(blk + 4));
    const __m256i a = _mm256_cvtepu8_epi32(bytes(8)), b = _mm256_cvtepu8_epi32(bytes(16));
    const __m256i nib = _mm256_set1_epi32(15);
    out[0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(a, nib)), dv, mv);
    out[1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(b, nib)), dv, mv);
    out[2] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(a, 4)), dv, mv);
    out[3] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4)), dv, mv);
  } else {
    for (int c = 0; c < 4; ++c) out[c] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes(8 + 8 * c))), dv);
  }
}

// the sum of 8 lanes by halving (a fixed order)
inline float hsum8(__m256 v) {
  __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  a = _mm_add_ps(a, _mm_movehl_ps(a, a));
  a = _mm_add_ss(a, _mm_movehdup_ps(a));
  return _mm_cvtss_f32(a);
}

// rows x[0..RR) against weight rows w[0..NN) (each K / 32 blocks, `wstride` bytes apart)
template <bool Q4, int NN, int RR>
void regs(const float* x, int64_t K, const uint8_t* w, int64_t wstride, float* y, int64_t ldy, int64_t ystride) {
  constexpr int64_t BB = block_bytes<Q4>();
  __m256 acc[RR][NN];
  for (int r = 0; r < RR; ++r)
    for (int j = 0; j < NN; ++j) acc[r][j] = _mm256_setzero_ps();
  for (int64_t b = 0, nb = K / QB; b < nb; ++b) {
    for (int j = 0; j < NN; ++j) {
      __m256 wv[4];
      dequant8<Q4>(w + j * wstride + b * BB, wv);
      for (int r = 0; r < RR; ++r)
        for (int c = 0; c < 4; ++c) acc[r][j] = _mm256_fmadd_ps(wv[c], _mm256_loadu_ps(x + r * K + b * QB + c * 8), acc[r][j]);
    }
  }
  for (int r = 0; r < RR; ++r)
    for (int j = 0; j < NN; ++j) y[r * ldy + j * ystride] = hsum8(acc[r][j]);
}

// the last M < RB rows: one register block of M rows
template <bool Q4, int NN, int RB>
void regs_tail(const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t wstride, float* y, int64_t N,
               int64_t ystride) {
  if constexpr (RB > 1) {
    if (M == RB - 1) return regs<Q4, NN, RB - 1>(x, K, w, wstride, y, N, ystride);
    regs_tail<Q4, NN, RB - 1>(x, M, K, w, wstride, y, N, ystride);
  }
}

// accumulators and the dequantized block in registers: NN x RB + 4 of the 16
template <int NN>
constexpr int row_block() { return NN == 2 ? 4 : NN == 3 ? 3 : 1; }

template <bool Q4, int NN>
void regs_rows(const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t wstride, float* y, int64_t N,
               int64_t ystride) {
  constexpr int RB = row_block<NN>();
  int64_t m = 0;
  for (; m + RB <= M; m += RB) regs<Q4, NN, RB>(x + m * K, K, w, wstride, y + m * N, N, ystride);
  if (m < M) regs_tail<Q4, NN, RB>(x + m * K, M - m, K, w, wstride, y + m * N, N, ystride);
}

// NN output rows from NN equal spans of the matrix per task (NN read streams per thread)
template <bool Q4, int NN>
void spans(const float* xp, int64_t M, int64_t K, const uint8_t* wp, int64_t N, float* yp) {
  const int64_t row_bytes = (K / QB) * block_bytes<Q4>(), span = (N + NN - 1) / NN;
  at::parallel_for(0, span, 8, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      if (g + (NN - 1) * span < N) {
        regs_rows<Q4, NN>(xp, M, K, wp + g * row_bytes, span * row_bytes, yp + g, N, span);
      } else {
        for (int64_t n = g; n < N; n += span) regs_rows<Q4, 1>(xp, M, K, wp + n * row_bytes, 0, yp + n, N, 0);
      }
    }
  });
}

}  // namespace avx2

// the rows decide how many output rows stream side by side (more streams keep more reads in
// flight; more input rows per block share each dequantized block)
template <bool Q4>
void qlinear_rows(const float* xp, int64_t M, int64_t K, const uint8_t* wp, int64_t N, float* yp) {
  if (M == 1)
    avx2::spans<Q4, 6>(xp, M, K, wp, N, yp);
  else if (M <= 3)
    avx2::spans<Q4, 3>(xp, M, K, wp, N, yp);
  else
    avx2::spans<Q4, 2>(xp, M, K, wp, N, yp);
}
#else
template <bool Q4>
void qlinear_rows(const float* xp, int64_t M, int64_t K, const uint8_t* wp, int64_t N, float* yp) {
  if (M <= 2)
    qlinear_spans<Q4, NQ, 4>(xp, M, K, wp, N, yp);
  else
    qlinear_spans<Q4, 3, 8>(xp, M, K, wp, N, yp);
}
#endif

}  // namespace

namespace jakiro {

void apply_linear(const at::Tensor& w, int64_t N, const float* bias, const float* x, int64_t M, int64_t K, float* y,
                  int64_t input_bytes) {
  TORCH_CHECK(input_bytes == 1 || input_bytes == 3, "inputs go to the tile kernel as 1 or 3 bytes");
  if (w.scalar_type() == at::kFloat) {
    linear_rows(x, M, K, w.data_ptr<float>(), N, bias, y);
    return;
  }
  if (kq_weight(w))
    kq_linear_rows(x, M, K, w, N, y, input_bytes);
  else if (amx_weight(w) && !amx_usable())  // tile layout without tiles: the int8 (AVX-512 VNNI) kernel
    int8_linear_rows(x, M, K, w, N, y, input_bytes);
  else if (amx_weight(w))
    amx_linear_rows(x, M, K, w, N, y, input_bytes);
  else if (w.size(2) == block_bytes<true>())
    qlinear_rows<true>(x, M, K, w.data_ptr<uint8_t>(), N, y);
  else
    qlinear_rows<false>(x, M, K, w.data_ptr<uint8_t>(), N, y);
  if (bias)
    for (int64_t r = 0; r < M; ++r)
      for (int64_t j = 0; j < N; ++j) y[r * N + j] += bias[j];
}

bool valid_linear(const at::Tensor& w, int64_t N, int64_t K) {
  if (!w.is_contiguous() || w.dim() != 3) return false;
  if (w.scalar_type() == at::kFloat) return w.size(2) == VL && w.size(1) == K && N <= w.size(0) * VL && N > (w.size(0) - 1) * VL;
  if (kq_weight(w)) return (w.size(0) - 1) * 16 < N && N <= w.size(0) * 16 && w.size(1) * kq_block_values(w) == K;
  if (amx_weight(w))
    return w.size(0) * 16 == N && w.size(1) * QB == K &&
           (amx_usable() || int8_usable());
  return w.scalar_type() == at::kByte && w.size(0) == N && w.size(1) * QB == K &&
         (w.size(2) == block_bytes<true>() || w.size(2) == block_bytes<false>());
}

}  // namespace jakiro

namespace {

// y [M, N] = x [M, K] @ W^T for W in GGUF blocks, in the layout of the portable kernel
// ([N][K/32][bytes]) or of the AMX kernel (``amx_pack``, which takes x as ``input_bytes`` bytes)
at::Tensor quantized_linear(const at::Tensor& x, const at::Tensor& w, int64_t N, int64_t input_bytes) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "quantized linear: x must be [rows, in] float32");
  TORCH_CHECK((w.scalar_type() == at::kByte || w.scalar_type() == at::kChar) && jakiro::valid_linear(w, N, x.size(1)),
              "quantized linear: the packed blocks do not match x");
  auto xc = x.contiguous();
  const int64_t M = xc.size(0), K = xc.size(1);
  auto y = at::empty({M, N}, xc.options());
  if (M > 0) jakiro::apply_linear(w, N, nullptr, xc.data_ptr<float>(), M, K, y.data_ptr<float>(), input_bytes);
  return y;
}

// n float32 zeros on the pages weights get (``weight_empty``): what a timing of reading the
// weights once streams, so that floor and forward read memory the same way
at::Tensor weight_buffer(int64_t n) { return jakiro::weight_empty({n}, at::TensorOptions().dtype(at::kFloat)).zero_(); }

bool amx_usable() { return jakiro::amx_usable(); }
bool int8_usable() { return jakiro::int8_usable(); }

// the integer kernels' prefetch distances (kernels.h), set for side-by-side measurements in one
// process; returns the previous ones
std::vector<int64_t> set_prefetch(int64_t l1, int64_t l2) {
  TORCH_CHECK(l1 >= 0 && l2 >= 0 && l1 % 64 == 0 && l2 % 64 == 0, "prefetch distances are multiples of 64 bytes");
  std::vector<int64_t> previous = {jakiro::prefetch_l1, jakiro::prefetch_l2};
  jakiro::prefetch_l1 = l1;
  jakiro::prefetch_l2 = l2;
  return previous;
}

}  // namespace

namespace jakiro {
int64_t prefetch_l1 = 2048, prefetch_l2 = 16384;
}  // namespace jakiro

TORCH_LIBRARY(jakiro_smallgemm, m) {
  m.def("pack(Tensor weight) -> Tensor", pack);
  m.def("linear(Tensor x, Tensor packed, int n, Tensor? bias) -> Tensor", linear);
  m.def("quantized_linear(Tensor x, Tensor blocks, int n, int input_bytes=3) -> Tensor", quantized_linear);
  m.def("weight_buffer(int n) -> Tensor", weight_buffer);
  m.def("set_prefetch(int l1, int l2) -> int[]", set_prefetch);
  m.def("amx_usable() -> bool", amx_usable);
  m.def("int8_usable() -> bool", int8_usable);
  m.def("amx_pack(Tensor blocks) -> Tensor", jakiro::amx_pack);
}
