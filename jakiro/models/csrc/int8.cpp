// y = x @ W^T for a draft's Q8_0 weights with int8 inputs, on AVX-512 VNNI CPUs without AMX
// tiles (Zen 4 and later, Ice Lake and later): the integer counterpart of the tile kernel's
// one-byte inputs (``input_bytes`` 1, amx.cpp), for drafts only, whose proposals need not be
// exact (verification decides what is accepted).
//
// Each input row is written, per block of 32 values, as X = round(x * 2^(7 - E)) clamped to
// [-127, 127] with |x| < 2^E (the tile kernel's one-byte rule, so a draft proposes the same
// on both kinds of CPU), stored as the unsigned bytes X + 128. The weights are in the tile
// kernel's layout (``amx_pack``): per 16 output columns and block, the 16 scales d, then 8 rows
// of 64 bytes, row i holding inputs 4i..4i+3 of each column side by side, which is what
// vpdpbusd takes: one instruction adds 4 products into each of the 16 columns' int32 sums. A
// block's sum is then sum(q (X + 128)) - 128 sum(q) (the second term once per block, shared by
// all rows), scaled by d 2^(E - 7) into a float32 accumulator per row and column.
//
// Against the float32 kernel (two 16-lane multiply-adds per row, column and block of 32), a row
// costs 8 integer dot instructions and 3 vector operations per 16 columns and block: a draft
// step over many rows is about three times cheaper, one row about as cheap (it streams the same
// bytes). A row's outputs do not depend on the other rows.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "kernels.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define JAKIRO_VNNI 1
#include <immintrin.h>
#endif

namespace {

using jakiro::QB;
constexpr int64_t G = 16;                      // output columns per group (vector lanes)
constexpr int64_t Q8_TILE_BYTES = jakiro::amx_pack_bytes(false);  // amx_pack's Q8_0 layout per group and block

#if defined(JAKIRO_VNNI)

// x [M, K] -> u [M, K] (X + 128 as bytes) and scale [M, K / 32] (2^(E - 7), 0 for a block of
// zeros, NaN for a non-finite block, which makes its outputs NaN as float32 arithmetic would)
void prepare(const float* x, int64_t M, int64_t K, uint8_t* u, float* scale) {
  const int64_t nb = K / QB;
  for (int64_t m = 0; m < M; ++m)
    for (int64_t b = 0; b < nb; ++b) {
      const float* xb = x + m * K + b * QB;
      const __m512 lo = _mm512_loadu_ps(xb), hi = _mm512_loadu_ps(xb + 16);
      const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
      const float sum = _mm512_reduce_add_ps(_mm512_add_ps(lo, hi));
      uint8_t* ub = u + m * K + b * QB;
      if (!(amax > 0) || !std::isfinite(amax) || !std::isfinite(sum)) {
        std::memset(ub, 128, QB);
        scale[m * nb + b] = std::isfinite(sum) && !(amax > 0) ? 0.0f : NAN;
        continue;
      }
      const int e = std::ilogb(amax) + 1;  // amax < 2^e
      const __m512 up = _mm512_set1_ps(std::ldexp(1.0f, 7 - e));
      scale[m * nb + b] = std::ldexp(1.0f, e - 7);
      for (int h = 0; h < 2; ++h) {
        __m512i X = _mm512_cvtps_epi32(_mm512_mul_ps(h ? hi : lo, up));
        X = _mm512_max_epi32(_mm512_min_epi32(X, _mm512_set1_epi32(127)), _mm512_set1_epi32(-127));
        X = _mm512_add_epi32(X, _mm512_set1_epi32(128));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(ub + 16 * h), _mm512_cvtepi32_epi8(X));
      }
    }
}

// rows [0, RR) of u against one group of 16 columns (all blocks); y[r][0..16)
template <int RR>
void rows_block(const uint8_t* u, const float* scale, int64_t K, const uint8_t* w, float* y, int64_t ldy,
                int64_t cols) {
  const int64_t nb = K / QB;
  __m512 acc[RR];
  for (int r = 0; r < RR; ++r) acc[r] = _mm512_setzero_ps();
  const __m512i ones = _mm512_set1_epi8(1);
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = w + b * Q8_TILE_BYTES;
    const __m512 d = _mm512_loadu_ps(reinterpret_cast<const float*>(blk));
    __m512i q[8];
    __m512i qsum = _mm512_setzero_si512();
    for (int i = 0; i < 8; ++i) {
      q[i] = _mm512_loadu_si512(blk + G * 4 + 64 * i);
      qsum = _mm512_dpbusd_epi32(qsum, ones, q[i]);
    }
    const __m512i offset = _mm512_slli_epi32(qsum, 7);  // 128 sum(q)
    for (int r = 0; r < RR; ++r) {
      const int32_t* ur = reinterpret_cast<const int32_t*>(u + r * K + b * QB);
      __m512i s = _mm512_setzero_si512();
      for (int i = 0; i < 8; ++i) s = _mm512_dpbusd_epi32(s, _mm512_set1_epi32(ur[i]), q[i]);
      const __m512 v = _mm512_cvtepi32_ps(_mm512_sub_epi32(s, offset));
      acc[r] = _mm512_fmadd_ps(v, _mm512_mul_ps(d, _mm512_set1_ps(scale[r * nb + b])), acc[r]);
    }
  }
  for (int r = 0; r < RR; ++r) {
    if (cols >= G) {
      _mm512_storeu_ps(y + r * ldy, acc[r]);
    } else {
      float out[G];
      _mm512_storeu_ps(out, acc[r]);
      std::memcpy(y + r * ldy, out, cols * sizeof(float));
    }
  }
}

constexpr int RB = 8;  // rows per register block: 8 accumulators beside the block's 8 weight rows

void group_rows(const uint8_t* u, const float* scale, int64_t M, int64_t K, const uint8_t* w, float* y,
                int64_t N, int64_t cols) {
  const int64_t nb = K / QB;
  int64_t m = 0;
  for (; m + RB <= M; m += RB) rows_block<RB>(u + m * K, scale + m * nb, K, w, y + m * N, N, cols);
  const uint8_t* um = u + m * K;
  const float* sm = scale + m * nb;
  float* ym = y + m * N;
  switch (M - m) {
    case 7: rows_block<7>(um, sm, K, w, ym, N, cols); break;
    case 6: rows_block<6>(um, sm, K, w, ym, N, cols); break;
    case 5: rows_block<5>(um, sm, K, w, ym, N, cols); break;
    case 4: rows_block<4>(um, sm, K, w, ym, N, cols); break;
    case 3: rows_block<3>(um, sm, K, w, ym, N, cols); break;
    case 2: rows_block<2>(um, sm, K, w, ym, N, cols); break;
    case 1: rows_block<1>(um, sm, K, w, ym, N, cols); break;
    default: break;
  }
}

#endif  // JAKIRO_VNNI

}  // namespace

namespace jakiro {

bool int8_usable() {
#if defined(JAKIRO_VNNI)
  return true;
#else
  return false;
#endif
}

void int8_linear_rows(const float* x, int64_t M, int64_t K, const at::Tensor& w, int64_t N, float* y) {
  TORCH_CHECK(w.dim() == 3 && w.size(2) == Q8_TILE_BYTES && w.size(0) * G == N && w.size(1) * QB == K,
              "int8 kernel: expected Q8_0 blocks in the tile layout for this matrix");
#if defined(JAKIRO_VNNI)
  const int64_t nb = K / QB;
  std::vector<uint8_t> u(M * K);
  std::vector<float> scale(M * nb);
  prepare(x, M, K, u.data(), scale.data());
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const int64_t groups = N / G;
  at::parallel_for(0, groups, 4, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g)
      group_rows(u.data(), scale.data(), M, K, wp + g * nb * Q8_TILE_BYTES, y + g * G, N, G);
  });
#else
  (void)x, (void)M, (void)y;
  TORCH_CHECK(false, "this build has no int8 (AVX-512 VNNI) kernel");
#endif
}

}  // namespace jakiro
