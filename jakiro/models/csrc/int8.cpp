// y = x @ W^T for GGUF-block weights (Q8_0, Q4_1) with int8 inputs, on AVX-512 VNNI CPUs without
// AMX tiles (Zen 4 and later, Ice Lake and later): the integer counterpart of the tile kernel's
// one-byte inputs (``input_bytes`` 1, amx.cpp), for drafts, whose proposals need not be exact
// (verification decides what is accepted), and for targets run with int8 activations (then the
// target is this computation, for plain decoding and every method alike).
//
// Each input row is written, per block of 32 values, as X = round(x * 2^(7 - E)) clamped to
// [-127, 127] with |x| < 2^E (the tile kernel's one-byte rule, so a draft proposes the same
// on both kinds of CPU). The weights are in the tile kernel's layout (``amx_pack``): per 16
// output columns and block, the 16 scales d (Q4_1: and the 16 offsets m), then 8 rows of 64
// bytes (Q4_1: 4 rows whose low nibbles are rows 0-3 and high nibbles rows 4-7), row i holding
// inputs 4i..4i+3 of each column side by side, which is what vpdpbusd takes: one instruction
// adds 4 products of an unsigned and a signed byte into each of the 16 columns' int32 sums.
// Q8_0's q are signed, so the inputs go as the unsigned bytes X + 128 and a block's sum is
// sum(q (X + 128)) - 128 sum(q) (the second term once per block, shared by all rows); Q4_1's q
// are in [0, 15], the unsigned operand against the signed X, and the block adds m * sum(x) (the
// float32 sum of the block's inputs, as the tile kernel). The integer sum is scaled by d 2^(E - 7)
// into a float32 accumulator per row and column.
//
// Against the float32 kernel (two 16-lane multiply-adds per row, column and block of 32), a row
// costs 8 integer dot instructions and 3-4 vector operations per 16 columns and block: a step
// over many rows is about three times cheaper, one row about as cheap (it streams the same
// bytes). A row's outputs do not depend on the other rows.
//
// Three bytes per input (``input_bytes`` 3, a target's float32-accurate inputs) follow the tile
// kernel's rule too: X = round(x * 2^(22 - E)) in three balanced signed bytes a1 2^16 + a2 2^8
// + a3, each byte row's integer sums taken exactly (Q8_0: as a1 + 128 etc., less 128 sum(q)) and
// recombined as amx.cpp does (Q4_1 in int32, Q8_0 in float32), so the outputs are bitwise the tile
// kernel's: the same text on both kinds of CPU. 24 dot instructions a row per 16 columns and block
// instead of the float32 kernel's 32 multiply-adds and the dequantization: one row streams at the
// one-byte kernel's pace, a tree's rows cost about two thirds of the float32 kernel's.
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

// x [M, K] -> P byte rows per input row, u [M][P][K], scale [M, K / 32] and the blocks' sums
// [M, K / 32] (for Q4_1's offsets m: m * sum(x), as the tile kernel takes them; where
// ``half_sums`` is given, also the sums of each block's two halves of 16, [M, K / 16], whose sum
// is the block's). P = 1: X =
// round(x * 2^(7 - E)) clamped to [-127, 127]; P = 3: X = round(x * 2^(22 - E)) as the tile
// kernel's balanced bytes a1, a2, a3. The bytes are signed for Q4_1's unsigned weights and + 128
// (unsigned) for Q8_0's signed ones; the scale is 2^(E - 7) or 2^(E - 22), 0 for a block of zeros,
// NaN for a non-finite block (which makes its outputs NaN as float32 arithmetic would).
template <int P>
void prepare(const float* x, int64_t M, int64_t K, uint8_t* u, float* scale, float* sums, float* half_sums,
             bool offset) {
  static_assert(P == 1 || P == 3, "one or three bytes per input");
  constexpr int S = P == 1 ? 7 : 22;
  const int64_t nb = K / QB;
  const __m512i bias = _mm512_set1_epi32(offset ? 128 : 0);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t b = 0; b < nb; ++b) {
      const float* xb = x + m * K + b * QB;
      const __m512 lo = _mm512_loadu_ps(xb), hi = _mm512_loadu_ps(xb + 16);
      const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
      const float lo_sum = jakiro::hsum((jakiro::vf)lo), hi_sum = jakiro::hsum((jakiro::vf)hi);
      const float sum = lo_sum + hi_sum;
      sums[m * nb + b] = sum;
      if (half_sums) {
        half_sums[2 * (m * nb + b)] = lo_sum;
        half_sums[2 * (m * nb + b) + 1] = hi_sum;
      }
      uint8_t* ub = u + P * m * K + b * QB;
      if (!(amax > 0) || !std::isfinite(amax) || !std::isfinite(sum)) {
        for (int p = 0; p < P; ++p) std::memset(ub + p * K, offset ? 128 : 0, QB);
        scale[m * nb + b] = std::isfinite(sum) && !(amax > 0) ? 0.0f : NAN;
        continue;
      }
      const int e = std::ilogb(amax) + 1;  // amax < 2^e
      const __m512 up = _mm512_set1_ps(std::ldexp(1.0f, S - e));
      scale[m * nb + b] = std::ldexp(1.0f, e - S);
      for (int h = 0; h < 2; ++h) {
        const __m512i X = _mm512_cvtps_epi32(_mm512_mul_ps(h ? hi : lo, up));  // |X| <= 2^S
        __m512i digits[P];
        if constexpr (P == 1) {
          digits[0] = _mm512_max_epi32(_mm512_min_epi32(X, _mm512_set1_epi32(127)), _mm512_set1_epi32(-127));
        } else {
          // balanced digits: a2 * 2^8 + a3 spans [-32896, 32639], so a1 = floor((X + 32896) / 2^16)
          digits[0] = _mm512_srai_epi32(_mm512_add_epi32(X, _mm512_set1_epi32(32896)), 16);
          const __m512i r1 = _mm512_sub_epi32(X, _mm512_slli_epi32(digits[0], 16));
          digits[1] = _mm512_srai_epi32(_mm512_add_epi32(r1, _mm512_set1_epi32(1 << 7)), 8);
          digits[2] = _mm512_sub_epi32(r1, _mm512_slli_epi32(digits[1], 8));
        }
        for (int p = 0; p < P; ++p)
          _mm_storeu_si128(reinterpret_cast<__m128i*>(ub + p * K + 16 * h),
                           _mm512_cvtepi32_epi8(_mm512_add_epi32(digits[p], bias)));
      }
    }
}

// a row's three byte rows against a block's 8 weight rows: the exact integer sums of each (two
// chains each: integer sums do not depend on the order, and one chain of 8 waits on its latency)
template <bool Q4>
inline void three_sums(const uint8_t* ur, int64_t K, const __m512i* q, __m512i* s) {
  for (int p = 0; p < 3; ++p) {
    const int32_t* up = reinterpret_cast<const int32_t*>(ur + p * K);
    __m512i a = _mm512_setzero_si512(), c = _mm512_setzero_si512();
    for (int i = 0; i < 4; ++i) {
      if constexpr (Q4) {  // q in [0, 15] unsigned, the input bytes signed
        a = _mm512_dpbusd_epi32(a, q[i], _mm512_set1_epi32(up[i]));
        c = _mm512_dpbusd_epi32(c, q[i + 4], _mm512_set1_epi32(up[i + 4]));
      } else {  // the input bytes + 128 unsigned, q signed
        a = _mm512_dpbusd_epi32(a, _mm512_set1_epi32(up[i]), q[i]);
        c = _mm512_dpbusd_epi32(c, _mm512_set1_epi32(up[i + 4]), q[i + 4]);
      }
    }
    s[p] = _mm512_add_epi32(a, c);
  }
}

// rows [0, RR) of u against one group of 16 columns (all blocks); y[r][0..16). The loops over rows
// are unrolled so that the RR accumulators stay in registers: left to the compiler, for RR = 8 it
// kept them on the stack and unrolled the blocks instead (on two Zen 4 cores a tree forward of 8
// tokens took 11.7-13.9 ms that way, 9.4-10.8 ms unrolled; the Q8_0 head over 8 rows 3.3 -> 0.9-2.1 ms)
template <bool Q4, int RR, int P>
void rows_block(const uint8_t* u, const float* scale, const float* sums, int64_t K, const uint8_t* w, float* y,
                int64_t ldy, int64_t cols) {
  static_assert(P == 1 || P == 3, "one or three bytes per input");
  constexpr int64_t BB = jakiro::amx_pack_bytes(Q4);
  const int64_t nb = K / QB;
  __m512 acc[RR];
#pragma GCC unroll 8
  for (int r = 0; r < RR; ++r) acc[r] = _mm512_setzero_ps();
  const __m512i ones = _mm512_set1_epi8(1);
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = w + b * BB;
    jakiro::prefetch_weights(blk, BB);  // the weights ahead (kernels.h)
    const __m512 d = _mm512_loadu_ps(reinterpret_cast<const float*>(blk));
    __m512i q[8];
    if constexpr (Q4) {
      // tile rows 0-3 (inputs 0-15) in the low nibbles, rows 4-7 (inputs 16-31) in the high ones
      for (int i = 0; i < 4; ++i) {
        const __m512i raw = _mm512_loadu_si512(blk + 2 * G * 4 + 64 * i);
        q[i] = _mm512_and_si512(raw, nibble);
        q[i + 4] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), nibble);
      }
      if constexpr (P == 3) {
        // as the tile kernel: the three sums recombined exactly in int32, then acc + d 2^(E - 22) v + m sum(x)
#pragma GCC unroll 8
        for (int r = 0; r < RR; ++r) {
          __m512i c[3];
          three_sums<true>(u + 3 * r * K + b * QB, K, q, c);
          const __m512 v = _mm512_cvtepi32_ps(
              _mm512_add_epi32(_mm512_add_epi32(_mm512_slli_epi32(c[0], 16), _mm512_slli_epi32(c[1], 8)), c[2]));
          acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(d, _mm512_set1_ps(scale[r * nb + b])), v, acc[r]);
          acc[r] = _mm512_fmadd_ps(_mm512_loadu_ps(reinterpret_cast<const float*>(blk) + G),
                                   _mm512_set1_ps(sums[r * nb + b]), acc[r]);
        }
        continue;
      }
      // q in [0, 15] is the unsigned operand, the signed input bytes X the other: sum(q X) at once
#pragma GCC unroll 8
      for (int r = 0; r < RR; ++r) {
        const int32_t* ur = reinterpret_cast<const int32_t*>(u + r * K + b * QB);
        __m512i s = _mm512_setzero_si512();
        for (int i = 0; i < 8; ++i) s = _mm512_dpbusd_epi32(s, q[i], _mm512_set1_epi32(ur[i]));
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(d, _mm512_set1_ps(scale[r * nb + b])), acc[r]);
        acc[r] = _mm512_fmadd_ps(_mm512_loadu_ps(reinterpret_cast<const float*>(blk) + G),
                                 _mm512_set1_ps(sums[r * nb + b]), acc[r]);
      }
      continue;
    }
    // Q8_0: signed q, so the inputs go as the unsigned bytes X + 128 and sum(q X) =
    // sum(q (X + 128)) - 128 sum(q)
    for (int i = 0; i < 8; ++i) q[i] = _mm512_loadu_si512(blk + G * 4 + 64 * i);
    __m512i qsum = _mm512_setzero_si512();
    for (int i = 0; i < 8; ++i) qsum = _mm512_dpbusd_epi32(qsum, ones, q[i]);
    const __m512i offset = _mm512_slli_epi32(qsum, 7);  // 128 sum(q)
    if constexpr (P == 3) {  // as the tile kernel: the three sums recombined in float32
#pragma GCC unroll 8
      for (int r = 0; r < RR; ++r) {
        __m512i c[3];
        three_sums<false>(u + 3 * r * K + b * QB, K, q, c);
        const __m512 v = _mm512_fmadd_ps(
            _mm512_cvtepi32_ps(_mm512_sub_epi32(c[0], offset)), _mm512_set1_ps(65536.0f),
            _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(c[1], offset)), _mm512_set1_ps(256.0f),
                            _mm512_cvtepi32_ps(_mm512_sub_epi32(c[2], offset))));
        acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(d, _mm512_set1_ps(scale[r * nb + b])), v, acc[r]);
      }
      continue;
    }
#pragma GCC unroll 8
    for (int r = 0; r < RR; ++r) {
      const int32_t* ur = reinterpret_cast<const int32_t*>(u + r * K + b * QB);
      __m512i s = _mm512_setzero_si512();
      for (int i = 0; i < 8; ++i) s = _mm512_dpbusd_epi32(s, _mm512_set1_epi32(ur[i]), q[i]);
      const __m512 v = _mm512_cvtepi32_ps(_mm512_sub_epi32(s, offset));
      acc[r] = _mm512_fmadd_ps(v, _mm512_mul_ps(d, _mm512_set1_ps(scale[r * nb + b])), acc[r]);
    }
  }
  jakiro::store_columns<RR>(acc, y, ldy, cols);
}

constexpr int RB = 8;  // rows per register block: 8 accumulators beside the block's 8 weight rows

template <bool Q4, int P>
void group_rows(const uint8_t* u, const float* scale, const float* sums, int64_t M, int64_t K, const uint8_t* w,
                float* y, int64_t N, int64_t cols) {
  const int64_t nb = K / QB;
  int64_t m = 0;
  for (; m + RB <= M; m += RB)
    rows_block<Q4, RB, P>(u + P * m * K, scale + m * nb, sums + m * nb, K, w, y + m * N, N, cols);
  const uint8_t* um = u + P * m * K;
  const float* sm = scale + m * nb;
  const float* xm = sums + m * nb;
  float* ym = y + m * N;
  switch (M - m) {
    case 7: rows_block<Q4, 7, P>(um, sm, xm, K, w, ym, N, cols); break;
    case 6: rows_block<Q4, 6, P>(um, sm, xm, K, w, ym, N, cols); break;
    case 5: rows_block<Q4, 5, P>(um, sm, xm, K, w, ym, N, cols); break;
    case 4: rows_block<Q4, 4, P>(um, sm, xm, K, w, ym, N, cols); break;
    case 3: rows_block<Q4, 3, P>(um, sm, xm, K, w, ym, N, cols); break;
    case 2: rows_block<Q4, 2, P>(um, sm, xm, K, w, ym, N, cols); break;
    case 1: rows_block<Q4, 1, P>(um, sm, xm, K, w, ym, N, cols); break;
    default: break;
  }
}

template <int P>
void linear_bytes(const float* x, int64_t M, int64_t K, const uint8_t* wp, bool q4, int64_t N, float* y) {
  const int64_t nb = K / QB, BB = jakiro::amx_pack_bytes(q4);
  std::vector<uint8_t> u(P * M * K);
  std::vector<float> scale(M * nb), sums(M * nb);
  prepare<P>(x, M, K, u.data(), scale.data(), sums.data(), nullptr, !q4);
  at::parallel_for(0, N / G, 4, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g)
      if (q4)
        group_rows<true, P>(u.data(), scale.data(), sums.data(), M, K, wp + g * nb * BB, y + g * G, N, G);
      else
        group_rows<false, P>(u.data(), scale.data(), sums.data(), M, K, wp + g * nb * BB, y + g * G, N, G);
  });
}

#endif  // JAKIRO_VNNI

}  // namespace

namespace jakiro {

#if defined(JAKIRO_VNNI)
void prepare_inputs(int P, const float* x, int64_t M, int64_t K, uint8_t* u, float* scale, float* sums,
                    float* half_sums, bool offset) {
  if (P == 1)
    prepare<1>(x, M, K, u, scale, sums, half_sums, offset);
  else
    prepare<3>(x, M, K, u, scale, sums, half_sums, offset);
}
#endif

bool int8_usable() {
#if defined(JAKIRO_VNNI)
  return true;
#else
  return false;
#endif
}

void int8_linear_rows(const float* x, int64_t M, int64_t K, const at::Tensor& w, int64_t N, float* y,
                      int64_t input_bytes) {
  const bool q4 = w.dim() == 3 && w.size(2) == jakiro::amx_pack_bytes(true);
  TORCH_CHECK(w.dim() == 3 && (q4 || w.size(2) == Q8_TILE_BYTES) && w.size(0) * G == N && w.size(1) * QB == K,
              "int8 kernel: expected Q8_0 or Q4_1 blocks in the tile layout for this matrix");
  TORCH_CHECK(input_bytes == 1 || input_bytes == 3, "the int8 kernel takes inputs as 1 or 3 bytes");
#if defined(JAKIRO_VNNI)
  if (input_bytes == 1)
    linear_bytes<1>(x, M, K, w.data_ptr<uint8_t>(), q4, N, y);
  else
    linear_bytes<3>(x, M, K, w.data_ptr<uint8_t>(), q4, N, y);
#else
  (void)x, (void)M, (void)y;
  TORCH_CHECK(false, "this build has no int8 (AVX-512 VNNI) kernel");
#endif
}

}  // namespace jakiro
