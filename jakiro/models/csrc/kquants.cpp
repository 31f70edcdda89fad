// GGUF's other block types (Q4_0, Q5_0, Q5_1 and the K-quants Q2_K..Q6_K) streamed from their
// own bits: what a Q4_K_M file, the format most GGUF models are downloaded in, holds.
//
// Every type is one form, per sub-block of 16 or 32 values of a weight row:
//   min types (Q5_1, Q2_K, Q4_K, Q5_K):    w = D q + M       (q unsigned, M an offset)
//   symmetric types (Q4_0, Q5_0, Q3_K, Q6_K): w = D (q - o)   (o = 8, 16, 4, 32)
// with D the block's fp16 scale times the sub-block's integer scale and M its fp16 min times the
// sub-block's integer min (negated), each a float32 product that is exact, so D q + M rounds once
// and the weights are bitwise those of GGUF's reference dequantization (``gguf.quants``).
//
// Layout (``kq_pack``, once at load): per 16 output columns and super-block (32 values for Q4_0,
// Q5_0, Q5_1; 256 for the K-quants), the 16 columns' fp16 scales (and mins), their sub-block
// integer scales as bytes, then the codes of each block of 32 inputs as the int8 kernel's
// registers take them: eight 64-byte rows, row i holding inputs 4i..4i+3 of each column side by
// side. The low four bits of rows 0-3 and 4-7 share 256 bytes as nibbles (as GGUF's own Q4
// bytes), a fifth bit is one 64-byte row (bit i of a byte for row i), two more bits two rows.
// The layout holds the file's bits (Q6_K: the same 6.5625 bits a weight; Q4_K 4.625 for 4.5:
// its 6-bit sub-block scales and mins as bytes), so a forward reads about the file's bytes.
//
// Two kernels read it:
// - the int8 kernel (AVX-512 VNNI, as int8.cpp): each input row goes in as one byte per value
//   (int8 activations) or three (float32 accuracy) per block of 32, scaled by a power of two;
//   integer sums of codes times input bytes per sub-block are exact, then scaled by D (and the
//   block's M times the float32 sum of its inputs added). Symmetric types take the codes minus
//   o as signed bytes against the inputs plus 128, as int8.cpp does for Q8_0, so no offset term
//   has to cancel in float32.
// - a portable float32 kernel (any CPU, vector extensions): the codes of 16 columns widened
//   lane by lane, w = D q + M as the reference computes it, multiplied and added in float32.
// Either computes each row with the same instructions whatever the other rows, so a token's
// logits are bitwise the same alone and inside a tree.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#include "kernels.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define JAKIRO_KQ_VNNI 1
#endif
#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

using jakiro::QB;
constexpr int64_t G = 16;  // output columns per group

inline float half_to_float(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

// ---------------------------------------------------------------------------------------------
// The block types: ggml's type id, values and bytes per GGUF block, and bytes per 16 columns and
// block in the packed layout.
struct TypeInfo {
  int64_t id, qk, raw, layout;
  bool is_min;  // w = D q + M (else D (q - o))
  int offset;   // o of the symmetric types
  int sub;      // values per sub-block scale
};

constexpr TypeInfo TYPES[] = {
    {2, 32, 18, 288, false, 8, 32},         // Q4_0
    {3, 32, 20, 0, true, 0, 32},            // Q4_1 (raw rows only: int8.cpp streams it)
    {6, 32, 22, 352, false, 16, 32},        // Q5_0
    {7, 32, 24, 384, true, 0, 32},          // Q5_1
    {8, 32, 34, 0, false, 128, 32},         // Q8_0 (raw rows only)
    {10, 256, 84, 1344, true, 0, 16},       // Q2_K
    {11, 256, 110, 1824, false, 4, 16},     // Q3_K
    {12, 256, 144, 2368, true, 0, 32},      // Q4_K
    {13, 256, 176, 2880, true, 0, 32},      // Q5_K
    {14, 256, 210, 3360, false, 32, 16},    // Q6_K
};

constexpr TypeInfo type_info(int64_t id) {
  for (const auto& t : TYPES)
    if (t.id == id) return t;
  return TYPES[0];
}

const TypeInfo* type_by_raw(int64_t raw) {
  for (const auto& t : TYPES)
    if (t.raw == raw) return &t;
  return nullptr;
}

const TypeInfo* type_by_layout(int64_t layout) {
  for (const auto& t : TYPES)
    if (t.layout && t.layout == layout) return &t;
  return nullptr;
}

// One GGUF block decoded: value i = D[i / sub] * q[i] + M[i / sub] (min types) or
// D[i / sub] * (q[i] - offset); the fp16 scale (and min) bits and the sub-block codes, for packing.
struct Block {
  uint8_t q[256];
  float D[16], M[16];
  uint8_t d[2], dmin[2];  // fp16 bits (Q4_1 / Q5_1: dmin holds m)
  uint8_t sc[16], mn[16];  // sub-block scale / min codes (Q3_K, Q6_K: signed scale bits)
};

void decode(const TypeInfo& t, const uint8_t* b, Block& o) {
  std::memset(&o, 0, sizeof(o));
  auto halves = [&](const uint8_t* qs, int n) {  // GGUF's 32-value nibble bytes: value i low, 16 + i high
    for (int i = 0; i < n; ++i) {
      o.q[i] = qs[i] & 15;
      o.q[16 + i] = qs[i] >> 4;
    }
  };
  switch (t.id) {
    case 2: {  // Q4_0: d, 16 nibble bytes
      std::memcpy(o.d, b, 2);
      halves(b + 2, 16);
      o.D[0] = half_to_float(b);
      break;
    }
    case 3:  // Q4_1: d, m, 16 nibble bytes
    case 7: {  // Q5_1: d, m, 32 high bits, 16 nibble bytes
      std::memcpy(o.d, b, 2);
      std::memcpy(o.dmin, b + 2, 2);
      const bool five = t.id == 7;
      halves(b + (five ? 8 : 4), 16);
      if (five) {
        uint32_t qh;
        std::memcpy(&qh, b + 4, 4);
        for (int i = 0; i < 32; ++i) o.q[i] |= ((qh >> i) & 1) << 4;
      }
      o.D[0] = half_to_float(b);
      o.M[0] = half_to_float(b + 2);
      break;
    }
    case 6: {  // Q5_0: d, 32 high bits, 16 nibble bytes
      std::memcpy(o.d, b, 2);
      uint32_t qh;
      std::memcpy(&qh, b + 2, 4);
      halves(b + 6, 16);
      for (int i = 0; i < 32; ++i) o.q[i] |= ((qh >> i) & 1) << 4;
      o.D[0] = half_to_float(b);
      break;
    }
    case 8: {  // Q8_0: d, 32 signed bytes (codes q + 128)
      std::memcpy(o.d, b, 2);
      for (int i = 0; i < 32; ++i) o.q[i] = static_cast<uint8_t>(static_cast<int8_t>(b[2 + i]) + 128);
      o.D[0] = half_to_float(b);
      break;
    }
    case 10: {  // Q2_K: 16 scale bytes (scale | min << 4), 64 bytes of 2-bit codes, d, dmin
      const uint8_t* qs = b + 16;
      for (int h = 0; h < 2; ++h)
        for (int s = 0; s < 4; ++s)
          for (int i = 0; i < 32; ++i) o.q[128 * h + 32 * s + i] = (qs[32 * h + i] >> (2 * s)) & 3;
      std::memcpy(o.d, b + 80, 2);
      std::memcpy(o.dmin, b + 82, 2);
      const float d = half_to_float(b + 80), dmin = half_to_float(b + 82);
      for (int s = 0; s < 16; ++s) {
        o.sc[s] = b[s];
        o.D[s] = d * static_cast<float>(b[s] & 15);
        o.M[s] = -(dmin * static_cast<float>(b[s] >> 4));
      }
      break;
    }
    case 11: {  // Q3_K: 32 bytes of high bits, 64 bytes of 2-bit codes, 12 bytes of 6-bit scales, d
      const uint8_t *hm = b, *qs = b + 32, *sc = b + 96;
      for (int h = 0; h < 2; ++h)
        for (int s = 0; s < 4; ++s)
          for (int i = 0; i < 32; ++i) o.q[128 * h + 32 * s + i] = (qs[32 * h + i] >> (2 * s)) & 3;
      for (int s = 0; s < 8; ++s)
        for (int i = 0; i < 32; ++i) o.q[32 * s + i] |= ((hm[i] >> s) & 1) << 2;
      std::memcpy(o.d, b + 108, 2);
      const float d = half_to_float(b + 108);
      for (int k = 0; k < 16; ++k) {
        const int low = k < 8 ? sc[k] & 15 : sc[k - 8] >> 4, high = (sc[8 + k % 4] >> (2 * (k / 4))) & 3;
        const int8_t s = static_cast<int8_t>((low | (high << 4)) - 32);
        o.sc[k] = static_cast<uint8_t>(s);
        o.D[k] = d * static_cast<float>(s);
      }
      break;
    }
    case 12:  // Q4_K: d, dmin, 12 bytes of 6-bit scales and mins, 128 nibble bytes
    case 13: {  // Q5_K: the same, then 32 bytes of fifth bits before the nibbles
      std::memcpy(o.d, b, 2);
      std::memcpy(o.dmin, b + 2, 2);
      const uint8_t* sc = b + 4;
      const bool five = t.id == 13;
      const uint8_t* qs = b + (five ? 48 : 16);
      for (int c = 0; c < 4; ++c)
        for (int i = 0; i < 32; ++i) {
          o.q[64 * c + i] = qs[32 * c + i] & 15;
          o.q[64 * c + 32 + i] = qs[32 * c + i] >> 4;
        }
      if (five)
        for (int j = 0; j < 8; ++j)
          for (int i = 0; i < 32; ++i) o.q[32 * j + i] |= ((b[16 + i] >> j) & 1) << 4;
      const float d = half_to_float(b), dmin = half_to_float(b + 2);
      for (int j = 0; j < 8; ++j) {
        uint8_t s, m;
        if (j < 4) {
          s = sc[j] & 63;
          m = sc[j + 4] & 63;
        } else {
          s = (sc[j + 4] & 15) | ((sc[j - 4] >> 6) << 4);
          m = (sc[j + 4] >> 4) | ((sc[j] >> 6) << 4);
        }
        o.sc[j] = s;
        o.mn[j] = m;
        o.D[j] = d * static_cast<float>(s);
        o.M[j] = -(dmin * static_cast<float>(m));
      }
      break;
    }
    case 14: {  // Q6_K: 128 nibble bytes, 64 bytes of 2 high bits, 16 signed scales, d
      const uint8_t *ql = b, *qh = b + 128;
      for (int h = 0; h < 2; ++h)
        for (int s = 0; s < 4; ++s)
          for (int i = 0; i < 32; ++i)
            o.q[128 * h + 32 * s + i] = ((ql[64 * h + 32 * (s % 2) + i] >> (4 * (s / 2))) & 15) |
                                        (((qh[32 * h + i] >> (2 * s)) & 3) << 4);
      std::memcpy(o.d, b + 208, 2);
      const float d = half_to_float(b + 208);
      for (int k = 0; k < 16; ++k) {
        o.sc[k] = b[192 + k];
        o.D[k] = d * static_cast<float>(static_cast<int8_t>(b[192 + k]));
      }
      break;
    }
    default:
      TORCH_CHECK(false, "unknown block type");
  }
}

inline float value(const TypeInfo& t, const Block& o, int i) {
  const int s = i / t.sub;
  return t.is_min ? o.D[s] * static_cast<float>(o.q[i]) + o.M[s]
                  : o.D[s] * static_cast<float>(static_cast<int>(o.q[i]) - t.offset);
}

// one row of a GGUF tensor in float32: raw blocks, or float32 / float16 / bfloat16 values
void row_values(const at::Tensor& src, int64_t r, float* out) {
  if (src.scalar_type() == at::kFloat) {
    std::memcpy(out, src.data_ptr<float>() + r * src.size(1), src.size(1) * sizeof(float));
    return;
  }
  if (src.scalar_type() == at::kHalf || src.scalar_type() == at::kBFloat16) {
    const int64_t d = src.size(1);
    for (int64_t i = 0; i < d; ++i)
      out[i] = src.scalar_type() == at::kHalf ? static_cast<float>(src.data_ptr<at::Half>()[r * d + i])
                                              : static_cast<float>(src.data_ptr<at::BFloat16>()[r * d + i]);
    return;
  }
  const TypeInfo& t = *type_by_raw(src.size(2));
  const int64_t nb = src.size(1);
  const uint8_t* row = src.data_ptr<uint8_t>() + r * nb * t.raw;
  Block o;
  for (int64_t b = 0; b < nb; ++b) {
    decode(t, row + b * t.raw, o);
    for (int i = 0; i < t.qk; ++i) out[b * t.qk + i] = value(t, o, i);
  }
}

// ---------------------------------------------------------------------------------------------
// Packing: per group of 16 columns and super-block, at these offsets (bytes)
struct Offsets {
  int64_t d, dmin, sc, mn, nib, hi, two;  // -1: absent. nib: 256 bytes per 32 inputs; hi: the
  // fifth bit (64 bytes per 32 inputs) or, Q6_K, bits 4-5 (128); two: Q2_K / Q3_K 2-bit codes (128)
};

constexpr Offsets offsets(int64_t id) {
  switch (id) {
    case 2: return {0, -1, -1, -1, 32, -1, -1};
    case 6: return {0, -1, -1, -1, 96, 32, -1};
    case 7: return {0, 32, -1, -1, 128, 64, -1};
    case 10: return {0, 32, 64, -1, -1, -1, 320};
    case 11: return {0, -1, 32, -1, -1, 1312, 288};
    case 12: return {0, 32, 64, 192, 320, -1, -1};
    case 13: return {0, 32, 64, 192, 320, 2368, -1};
    case 14: return {0, -1, 32, -1, 288, 2336, -1};
    default: return {-1, -1, -1, -1, -1, -1, -1};
  }
}

// the byte of code row i (inputs 4i..4i+3 of a block of 32) for column c and input 4i + p
inline int64_t row_byte(int i, int c, int p) { return 64 * i + 4 * c + p; }

void pack_column(const TypeInfo& t, const Block& blk, int c, uint8_t* o) {
  const Offsets f = offsets(t.id);
  std::memcpy(o + f.d + 2 * c, blk.d, 2);
  if (f.dmin >= 0) std::memcpy(o + f.dmin + 2 * c, blk.dmin, 2);
  const int subs = t.qk / t.sub;
  if (f.sc >= 0 && t.qk == 256)
    for (int s = 0; s < subs; ++s) o[f.sc + 16 * s + c] = blk.sc[s];
  if (f.mn >= 0)
    for (int s = 0; s < subs; ++s) o[f.mn + 16 * s + c] = blk.mn[s];
  // each byte of the code rows written once: a code's bits spread over the nibble bytes and the
  // rows of two or one more bits
  for (int j = 0; j < t.qk / 32; ++j) {
    const uint8_t* q = blk.q + 32 * j;
    for (int p = 0; p < 4; ++p) {
      if (f.nib >= 0)
        for (int i = 0; i < 4; ++i)
          o[f.nib + 256 * j + row_byte(i, c, p)] = (q[4 * i + p] & 15) | ((q[16 + 4 * i + p] & 15) << 4);
      for (int half = 0; half < 2; ++half) {
        uint8_t two = 0, high = 0;
        for (int i = 0; i < 4; ++i) {
          const uint8_t v = q[4 * (4 * half + i) + p];
          two |= (v & 3) << (2 * i);
          high |= ((v >> 4) & 3) << (2 * i);
        }
        if (f.two >= 0) o[f.two + 128 * j + 64 * half + 4 * c + p] = two;
        if (f.hi >= 0 && t.id == 14) o[f.hi + 128 * j + 64 * half + 4 * c + p] = high;
      }
      if (f.hi >= 0 && t.id != 14) {
        const int bit = t.id == 11 ? 2 : 4;
        uint8_t b = 0;
        for (int i = 0; i < 8; ++i) b |= ((q[4 * i + p] >> bit) & 1) << i;
        o[f.hi + 64 * j + 4 * c + p] = b;
      }
    }
  }
}

// raw GGUF blocks [N, nb, raw bytes] -> [ceil(N / 16), nb, layout bytes] (int8: the dtype tells
// this layout from the others); rows past N are zero (their outputs are dropped)
at::Tensor kq_pack(const at::Tensor& raw) {
  TORCH_CHECK(raw.dim() == 3 && raw.scalar_type() == at::kByte && raw.is_contiguous(),
              "kq_pack: expected GGUF blocks [rows, blocks, bytes] as uint8");
  const TypeInfo* t = type_by_raw(raw.size(2));
  TORCH_CHECK(t && t->layout, "kq_pack: no packed layout for blocks of ", raw.size(2), " bytes");
  const int64_t N = raw.size(0), nb = raw.size(1), groups = (N + G - 1) / G;
  auto out = jakiro::weight_empty({groups, nb, t->layout}, raw.options().dtype(at::kChar)).zero_();
  const uint8_t* src = raw.data_ptr<uint8_t>();
  uint8_t* dst = reinterpret_cast<uint8_t*>(out.data_ptr<int8_t>());
  at::parallel_for(0, groups, 16, [&](int64_t g0, int64_t g1) {
    Block blk;
    for (int64_t g = g0; g < g1; ++g)
      for (int64_t b = 0; b < nb; ++b)
        for (int c = 0; c < G && g * G + c < N; ++c) {
          decode(*t, src + ((g * G + c) * nb + b) * t->raw, blk);
          pack_column(*t, blk, c, dst + (g * nb + b) * t->layout);
        }
  });
  return out;
}

// calls f(std::integral_constant<int, id>) for the block types of the packed layout: one switch for
// every kernel whose code is a template per type
template <class F>
void by_type(int64_t id, F&& f) {
  switch (id) {
    case 2: return f(std::integral_constant<int, 2>{});
    case 6: return f(std::integral_constant<int, 6>{});
    case 7: return f(std::integral_constant<int, 7>{});
    case 10: return f(std::integral_constant<int, 10>{});
    case 11: return f(std::integral_constant<int, 11>{});
    case 12: return f(std::integral_constant<int, 12>{});
    case 13: return f(std::integral_constant<int, 13>{});
    case 14: return f(std::integral_constant<int, 14>{});
    default: TORCH_CHECK(false, "integer kernel: unknown block type ", id);
  }
}

// ---------------------------------------------------------------------------------------------
// Reading the layout: per type, the super-block's scales and each block of 32 inputs' codes.
// Codes come as eight 64-byte rows (row i: inputs 4i..4i+3 of 16 columns), unsigned for min
// types, code - o as signed bytes for symmetric ones; D[h], M[h] scale inputs 16h..16h+15.

#if defined(JAKIRO_KQ_VNNI)
namespace vnni {

inline __m512 halves16(const uint8_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline __m512 u8f(const uint8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline __m512 s8f(const uint8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline __m512i ld(const uint8_t* p) { return _mm512_loadu_si512(p); }

// the low four bits of the eight rows from 256 nibble bytes
inline void nibbles(const uint8_t* p, __m512i q[8]) {
  const __m512i m = _mm512_set1_epi8(0x0F);
  for (int i = 0; i < 4; ++i) {
    const __m512i raw = ld(p + 64 * i);
    q[i] = _mm512_and_si512(raw, m);
    q[i + 4] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), m);
  }
}
// bit i of each byte of h, moved to bit `to` and or-ed into row i (shifts within 16-bit lanes
// move no bit across a byte boundary before the mask)
template <int TO>
inline void or_bit(const __m512i h, __m512i q[8]) {
  const __m512i m = _mm512_set1_epi8(1 << TO);
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i) {
    const __m512i s = i <= TO ? _mm512_slli_epi16(h, TO - i) : _mm512_srli_epi16(h, i - TO);
    q[i] = _mm512_ternarylogic_epi32(q[i], s, m, 0xF8);  // q | (s & m)
  }
}
// two bits (2i, 2i + 1 of a byte of rows a, b for rows i, i + 4) moved to bits `to`, to + 1
template <int TO>
inline void or_two(const uint8_t* p, __m512i q[8]) {
  const __m512i m = _mm512_set1_epi8(3 << TO), a = ld(p), b = ld(p + 64);
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i) {
    const int sh = TO - 2 * i;
    const __m512i sa = sh >= 0 ? _mm512_slli_epi16(a, sh) : _mm512_srli_epi16(a, -sh);
    const __m512i sb = sh >= 0 ? _mm512_slli_epi16(b, sh) : _mm512_srli_epi16(b, -sh);
    q[i] = _mm512_ternarylogic_epi32(q[i], sa, m, 0xF8);
    q[i + 4] = _mm512_ternarylogic_epi32(q[i + 4], sb, m, 0xF8);
  }
}
inline void minus(int o, __m512i q[8]) {
  const __m512i v = _mm512_set1_epi8(static_cast<char>(o));
  for (int i = 0; i < 8; ++i) q[i] = _mm512_sub_epi8(q[i], v);
}

struct Sup {
  __m512 d, neg_dmin;
};

template <int ID>
struct Kind;

template <>
struct Kind<2> {  // Q4_0
  static constexpr int QK = 32;
  static constexpr int64_t LB = 288;
  static constexpr bool MIN = false, SUB16 = false;
  static Sup sup(const uint8_t* o) { return {halves16(o), _mm512_setzero_ps()}; }
  static void codes(const uint8_t* o, int, __m512i q[8]) {
    nibbles(o + 32, q);
    minus(8, q);
  }
  static void scales(const uint8_t*, const Sup& s, int, __m512 D[2], __m512*) { D[0] = s.d; }
};
template <>
struct Kind<6> {  // Q5_0
  static constexpr int QK = 32;
  static constexpr int64_t LB = 352;
  static constexpr bool MIN = false, SUB16 = false;
  static Sup sup(const uint8_t* o) { return {halves16(o), _mm512_setzero_ps()}; }
  static void codes(const uint8_t* o, int, __m512i q[8]) {
    nibbles(o + 96, q);
    or_bit<4>(ld(o + 32), q);
    minus(16, q);
  }
  static void scales(const uint8_t*, const Sup& s, int, __m512 D[2], __m512*) { D[0] = s.d; }
};
template <>
struct Kind<7> {  // Q5_1
  static constexpr int QK = 32;
  static constexpr int64_t LB = 384;
  static constexpr bool MIN = true, SUB16 = false;
  static Sup sup(const uint8_t* o) { return {halves16(o), halves16(o + 32)}; }  // neg_dmin holds +m
  static void codes(const uint8_t* o, int, __m512i q[8]) {
    nibbles(o + 128, q);
    or_bit<4>(ld(o + 64), q);
  }
  static void scales(const uint8_t*, const Sup& s, int, __m512 D[2], __m512 M[2]) {
    D[0] = s.d;
    M[0] = s.neg_dmin;
  }
};
template <>
struct Kind<10> {  // Q2_K
  static constexpr int QK = 256;
  static constexpr int64_t LB = 1344;
  static constexpr bool MIN = true, SUB16 = true;
  static Sup sup(const uint8_t* o) {
    return {halves16(o), _mm512_sub_ps(_mm512_setzero_ps(), halves16(o + 32))};
  }
  static void codes(const uint8_t* o, int j, __m512i q[8]) {
    const __m512i m = _mm512_set1_epi8(3), a = ld(o + 320 + 128 * j), b = ld(o + 320 + 128 * j + 64);
    for (int i = 0; i < 4; ++i) {
      q[i] = _mm512_and_si512(_mm512_srli_epi16(a, 2 * i), m);
      q[i + 4] = _mm512_and_si512(_mm512_srli_epi16(b, 2 * i), m);
    }
  }
  static void scales(const uint8_t* o, const Sup& s, int j, __m512 D[2], __m512 M[2]) {
    for (int h = 0; h < 2; ++h) {
      const __m512i sc = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(o + 64 + 16 * (2 * j + h))));
      D[h] = _mm512_mul_ps(s.d, _mm512_cvtepi32_ps(_mm512_and_si512(sc, _mm512_set1_epi32(15))));
      M[h] = _mm512_mul_ps(s.neg_dmin, _mm512_cvtepi32_ps(_mm512_srli_epi32(sc, 4)));
    }
  }
};
template <>
struct Kind<11> {  // Q3_K
  static constexpr int QK = 256;
  static constexpr int64_t LB = 1824;
  static constexpr bool MIN = false, SUB16 = true;
  static Sup sup(const uint8_t* o) { return {halves16(o), _mm512_setzero_ps()}; }
  static void codes(const uint8_t* o, int j, __m512i q[8]) {
    Kind<10>::codes(o - 32, j, q);  // the 2-bit codes sit 32 bytes earlier than Q2_K's (no dmin)
    or_bit<2>(ld(o + 1312 + 64 * j), q);
    minus(4, q);
  }
  static void scales(const uint8_t* o, const Sup& s, int j, __m512 D[2], __m512*) {
    D[0] = _mm512_mul_ps(s.d, s8f(o + 32 + 16 * (2 * j)));
    D[1] = _mm512_mul_ps(s.d, s8f(o + 32 + 16 * (2 * j + 1)));
  }
};
template <>
struct Kind<12> {  // Q4_K
  static constexpr int QK = 256;
  static constexpr int64_t LB = 2368;
  static constexpr bool MIN = true, SUB16 = false;
  static Sup sup(const uint8_t* o) {
    return {halves16(o), _mm512_sub_ps(_mm512_setzero_ps(), halves16(o + 32))};
  }
  static void codes(const uint8_t* o, int j, __m512i q[8]) { nibbles(o + 320 + 256 * j, q); }
  static void scales(const uint8_t* o, const Sup& s, int j, __m512 D[2], __m512 M[2]) {
    D[0] = _mm512_mul_ps(s.d, u8f(o + 64 + 16 * j));
    M[0] = _mm512_mul_ps(s.neg_dmin, u8f(o + 192 + 16 * j));
  }
};
template <>
struct Kind<13> {  // Q5_K
  static constexpr int QK = 256;
  static constexpr int64_t LB = 2880;
  static constexpr bool MIN = true, SUB16 = false;
  static Sup sup(const uint8_t* o) { return Kind<12>::sup(o); }
  static void codes(const uint8_t* o, int j, __m512i q[8]) {
    nibbles(o + 320 + 256 * j, q);
    or_bit<4>(ld(o + 2368 + 64 * j), q);
  }
  static void scales(const uint8_t* o, const Sup& s, int j, __m512 D[2], __m512 M[2]) {
    Kind<12>::scales(o, s, j, D, M);
  }
};
template <>
struct Kind<14> {  // Q6_K
  static constexpr int QK = 256;
  static constexpr int64_t LB = 3360;
  static constexpr bool MIN = false, SUB16 = true;
  static Sup sup(const uint8_t* o) { return {halves16(o), _mm512_setzero_ps()}; }
  static void codes(const uint8_t* o, int j, __m512i q[8]) {
    nibbles(o + 288 + 256 * j, q);
    or_two<4>(o + 2336 + 128 * j, q);
    minus(32, q);
  }
  static void scales(const uint8_t* o, const Sup& s, int j, __m512 D[2], __m512*) {
    D[0] = _mm512_mul_ps(s.d, s8f(o + 32 + 16 * (2 * j)));
    D[1] = _mm512_mul_ps(s.d, s8f(o + 32 + 16 * (2 * j + 1)));
  }
};

// the exact integer sums of one input byte row (u: 32 bytes) against code rows [i0, i0 + n):
// min types take the codes unsigned against signed input bytes, symmetric ones the input bytes
// + 128 against signed codes
template <bool MIN, int I0, int N>
inline __m512i dot(const uint8_t* u, const __m512i* q) {
  const int32_t* up = reinterpret_cast<const int32_t*>(u);
  __m512i a = _mm512_setzero_si512(), c = _mm512_setzero_si512();
#pragma GCC unroll 8
  for (int i = I0; i < I0 + N; i += 2) {
    if constexpr (MIN) {
      a = _mm512_dpbusd_epi32(a, q[i], _mm512_set1_epi32(up[i]));
      c = _mm512_dpbusd_epi32(c, q[i + 1], _mm512_set1_epi32(up[i + 1]));
    } else {
      a = _mm512_dpbusd_epi32(a, _mm512_set1_epi32(up[i]), q[i]);
      c = _mm512_dpbusd_epi32(c, _mm512_set1_epi32(up[i + 1]), q[i + 1]);
    }
  }
  return _mm512_add_epi32(a, c);
}

// sum(code x) over code rows [i0, i0 + n) in float32, before the block's input scale: P byte
// rows (1: the byte; 3: a1 2^16 + a2 2^8 + a3), less 128 sum(code) for symmetric types
template <bool MIN, int P, int I0, int N>
inline __m512 sums(const uint8_t* u, int64_t K, const __m512i* q, __m512i offset) {
  __m512i s[P];
#pragma GCC unroll 3
  for (int p = 0; p < P; ++p) {
    s[p] = dot<MIN, I0, N>(u + p * K, q);
    if constexpr (!MIN) s[p] = _mm512_sub_epi32(s[p], offset);
  }
  if constexpr (P == 1) return _mm512_cvtepi32_ps(s[0]);
  return _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[0]), _mm512_set1_ps(65536.0f),
                         _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[1]), _mm512_set1_ps(256.0f), _mm512_cvtepi32_ps(s[2])));
}

// rows [0, RR) of the prepared inputs against one group of 16 columns; y[r][0..cols)
template <int ID, int RR, int P>
void rows_block(const uint8_t* u, const float* scale, const float* sums32, const float* sums16, int64_t K,
                const uint8_t* w, float* y, int64_t ldy, int64_t cols) {
  using T = Kind<ID>;
  constexpr int QK = T::QK;
  constexpr int64_t LB = T::LB;
  const int64_t nb = K / QB;
  __m512 acc[RR];
#pragma GCC unroll 8
  for (int r = 0; r < RR; ++r) acc[r] = _mm512_setzero_ps();
  const __m512i ones = _mm512_set1_epi8(1);
  for (int64_t sb = 0; sb < K / QK; ++sb) {
    const uint8_t* o = w + sb * LB;
    const Sup s = T::sup(o);
#pragma GCC unroll 8
    for (int j = 0; j < QK / QB; ++j) {
      const int64_t b = sb * (QK / QB) + j;
      // the weights ahead (kernels.h), a share per block of 32 inputs: one read stream per thread
      // otherwise leaves the memory system idle between its misses
      jakiro::prefetch_weights(o + j * (LB / (QK / QB)), LB / (QK / QB));
      __m512i q[8];
      T::codes(o, j, q);
      __m512 D[2], M[2];
      T::scales(o, s, j, D, M);
      __m512i off[2] = {_mm512_setzero_si512(), _mm512_setzero_si512()};
      if constexpr (!T::MIN) {  // 128 sum(code) per half (SUB16) or block
        __m512i h0 = _mm512_setzero_si512(), h1 = _mm512_setzero_si512();
        for (int i = 0; i < 4; ++i) {
          h0 = _mm512_dpbusd_epi32(h0, ones, q[i]);
          h1 = _mm512_dpbusd_epi32(h1, ones, q[i + 4]);
        }
        if constexpr (T::SUB16) {
          off[0] = _mm512_slli_epi32(h0, 7);
          off[1] = _mm512_slli_epi32(h1, 7);
        } else {
          off[0] = _mm512_slli_epi32(_mm512_add_epi32(h0, h1), 7);
        }
      }
#pragma GCC unroll 8
      for (int r = 0; r < RR; ++r) {
        const uint8_t* ur = u + P * r * K + b * QB;
        const __m512 sx = _mm512_set1_ps(scale[r * nb + b]);
        if constexpr (T::SUB16) {
          const __m512 v0 = sums<T::MIN, P, 0, 4>(ur, K, q, off[0]), v1 = sums<T::MIN, P, 4, 4>(ur, K, q, off[1]);
          acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(D[0], sx), v0, acc[r]);
          if constexpr (T::MIN) acc[r] = _mm512_fmadd_ps(M[0], _mm512_set1_ps(sums16[r * 2 * nb + 2 * b]), acc[r]);
          acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(D[1], sx), v1, acc[r]);
          if constexpr (T::MIN) acc[r] = _mm512_fmadd_ps(M[1], _mm512_set1_ps(sums16[r * 2 * nb + 2 * b + 1]), acc[r]);
        } else {
          const __m512 v = sums<T::MIN, P, 0, 8>(ur, K, q, off[0]);
          acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(D[0], sx), v, acc[r]);
          if constexpr (T::MIN) acc[r] = _mm512_fmadd_ps(M[0], _mm512_set1_ps(sums32[r * nb + b]), acc[r]);
        }
      }
    }
  }
  jakiro::store_columns<RR>(acc, y, ldy, cols);
}

constexpr int RB = 8;

template <int ID, int P>
void group_rows(const uint8_t* u, const float* scale, const float* s32, const float* s16, int64_t M, int64_t K,
                const uint8_t* w, float* y, int64_t N, int64_t cols) {
  const int64_t nb = K / QB;
  int64_t m = 0;
  for (; m + RB <= M; m += RB)
    rows_block<ID, RB, P>(u + P * m * K, scale + m * nb, s32 + m * nb, s16 + 2 * m * nb, K, w, y + m * N, N, cols);
  const uint8_t* um = u + P * m * K;
  const float *sm = scale + m * nb, *am = s32 + m * nb, *hm = s16 + 2 * m * nb;
  float* ym = y + m * N;
  switch (M - m) {
    case 7: rows_block<ID, 7, P>(um, sm, am, hm, K, w, ym, N, cols); break;
    case 6: rows_block<ID, 6, P>(um, sm, am, hm, K, w, ym, N, cols); break;
    case 5: rows_block<ID, 5, P>(um, sm, am, hm, K, w, ym, N, cols); break;
    case 4: rows_block<ID, 4, P>(um, sm, am, hm, K, w, ym, N, cols); break;
    case 3: rows_block<ID, 3, P>(um, sm, am, hm, K, w, ym, N, cols); break;
    case 2: rows_block<ID, 2, P>(um, sm, am, hm, K, w, ym, N, cols); break;
    case 1: rows_block<ID, 1, P>(um, sm, am, hm, K, w, ym, N, cols); break;
    default: break;
  }
}

template <int ID, int P>
void linear(const float* x, int64_t M, int64_t K, const uint8_t* w, const TypeInfo& t, int64_t N, float* y) {
  const int64_t nb = K / QB, groups = (N + G - 1) / G, per_group = (K / t.qk) * t.layout;
  std::vector<uint8_t> u(P * M * K);
  std::vector<float> scale(M * nb), s32(M * nb), s16(2 * M * nb);
  jakiro::prepare_inputs(P, x, M, K, u.data(), scale.data(), s32.data(), s16.data(), !Kind<ID>::MIN);
  at::parallel_for(0, groups, 4, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g)
      group_rows<ID, P>(u.data(), scale.data(), s32.data(), s16.data(), M, K, w + g * per_group, y + g * G, N,
                        std::min<int64_t>(G, N - g * G));
  });
}

template <int P>
void dispatch(const float* x, int64_t M, int64_t K, const uint8_t* w, const TypeInfo& t, int64_t N, float* y) {
  by_type(t.id, [&](auto id) { linear<decltype(id)::value, P>(x, M, K, w, t, N, y); });
}

}  // namespace vnni
#endif  // JAKIRO_KQ_VNNI


// The inputs as the integer kernels take them, in plain C++ (int8.cpp's ``prepare_inputs`` does
// the same with AVX-512): per block of 32, P bytes per value (+ 128 for symmetric types), the
// block's power-of-two scale and the float32 sums of its halves of 16.
[[maybe_unused]] void prepare_scalar(int P, const float* x, int64_t M, int64_t K, uint8_t* u, float* scale,
                                     float* half_sums, bool offset) {
  const int S = P == 1 ? 7 : 22, bias = offset ? 128 : 0;
  const int64_t nb = K / QB;
  for (int64_t m = 0; m < M; ++m)
    for (int64_t b = 0; b < nb; ++b) {
      const float* xb = x + m * K + b * QB;
      float amax = 0.0f, sums[2] = {0.0f, 0.0f};
      bool finite = true;
      for (int i = 0; i < QB; ++i) {
        amax = std::max(amax, std::fabs(xb[i]));
        sums[i / 16] += xb[i];
        finite &= std::isfinite(xb[i]);
      }
      half_sums[2 * (m * nb + b)] = sums[0];
      half_sums[2 * (m * nb + b) + 1] = sums[1];
      uint8_t* ub = u + P * m * K + b * QB;
      if (!(amax > 0) || !finite) {
        for (int p = 0; p < P; ++p) std::memset(ub + p * K, bias, QB);
        scale[m * nb + b] = finite ? 0.0f : NAN;
        continue;
      }
      const int e = std::ilogb(amax) + 1;
      const float up = std::ldexp(1.0f, S - e);
      scale[m * nb + b] = std::ldexp(1.0f, e - S);
      for (int i = 0; i < QB; ++i) {
        const int32_t X = static_cast<int32_t>(std::nearbyint(xb[i] * up));
        if (P == 1) {
          ub[i] = static_cast<uint8_t>(std::max(-127, std::min(127, X)) + bias);
        } else {
          const int32_t a1 = (X + 32896) >> 16, r1 = X - (a1 << 16), a2 = (r1 + 128) >> 8, a3 = r1 - (a2 << 8);
          ub[i] = static_cast<uint8_t>(a1 + bias);
          ub[K + i] = static_cast<uint8_t>(a2 + bias);
          ub[2 * K + i] = static_cast<uint8_t>(a3 + bias);
        }
      }
    }
}

// ---------------------------------------------------------------------------------------------
// The integer kernel on AVX2 (no AVX-512 VNNI: Zen 2-3, Haswell and later): the same sums as the
// VNNI kernel, each 64-byte row of the layout read as two 32-byte halves of 8 columns, and four
// products of a byte pair summed by maddubs (unsigned times signed bytes into 16-bit pairs, which
// these codes cannot saturate: at most 255 x 32 x 2 or 63 x 128 x 2) then madd into 32-bit lanes.
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && !defined(JAKIRO_KQ_VNNI)
#define JAKIRO_KQ_AVX2 1
namespace avx2 {

inline __m256i ld(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline __m256 halves8(const uint8_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline __m256 u8f(const uint8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline __m256 s8f(const uint8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline __m256i shr(__m256i x, int n) { return _mm256_srl_epi16(x, _mm_cvtsi32_si128(n)); }
inline __m256i shl(__m256i x, int n) { return _mm256_sll_epi16(x, _mm_cvtsi32_si128(n)); }

// the codes of block j for columns 8h..8h+7: eight rows of 8 lanes x 4 inputs (signed: code - o)
template <int ID>
inline void codes(const uint8_t* o, int j, int h, __m256i q[8]) {
  constexpr Offsets f = offsets(ID);
  constexpr TypeInfo t = type_info(ID);
  const __m256i m4 = _mm256_set1_epi8(0x0F), m2 = _mm256_set1_epi8(3);
  if constexpr (f.nib >= 0)
    for (int i = 0; i < 4; ++i) {
      const __m256i raw = ld(o + f.nib + 256 * j + 64 * i + 32 * h);
      q[i] = _mm256_and_si256(raw, m4);
      q[i + 4] = _mm256_and_si256(shr(raw, 4), m4);
    }
  if constexpr (f.two >= 0)
    for (int i = 0; i < 8; ++i) q[i] = _mm256_and_si256(shr(ld(o + f.two + 128 * j + 64 * (i / 4) + 32 * h), 2 * (i % 4)), m2);
  if constexpr (ID == 14) {
    for (int i = 0; i < 8; ++i) {
      const __m256i x = _mm256_and_si256(shr(ld(o + f.hi + 128 * j + 64 * (i / 4) + 32 * h), 2 * (i % 4)), m2);
      q[i] = _mm256_or_si256(q[i], shl(x, 4));
    }
  } else if constexpr (f.hi >= 0) {
    constexpr int bit = ID == 11 ? 2 : 4;
    const __m256i H = ld(o + f.hi + 64 * j + 32 * h), one = _mm256_set1_epi8(1);
    for (int i = 0; i < 8; ++i) q[i] = _mm256_or_si256(q[i], shl(_mm256_and_si256(shr(H, i), one), bit));
  }
  if constexpr (!t.is_min) {
    const __m256i off = _mm256_set1_epi8(static_cast<char>(t.offset));
    for (int i = 0; i < 8; ++i) q[i] = _mm256_sub_epi8(q[i], off);
  }
}

// D and M for inputs 16hh..16hh+15 of block j, columns 8h..8h+7
template <int ID>
inline void scales(const uint8_t* o, int j, int h, __m256 D[2], __m256 M[2]) {
  constexpr Offsets f = offsets(ID);
  const __m256 d = halves8(o + f.d + 16 * h);
  if constexpr (ID == 2 || ID == 6) {
    D[0] = D[1] = d;
  } else if constexpr (ID == 7) {
    D[0] = D[1] = d;
    M[0] = M[1] = halves8(o + f.dmin + 16 * h);
  } else if constexpr (ID == 10) {
    const __m256 nd = _mm256_sub_ps(_mm256_setzero_ps(), halves8(o + f.dmin + 16 * h));
    for (int hh = 0; hh < 2; ++hh) {
      const __m256i sc = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(o + f.sc + 16 * (2 * j + hh) + 8 * h)));
      D[hh] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_and_si256(sc, _mm256_set1_epi32(15))));
      M[hh] = _mm256_mul_ps(nd, _mm256_cvtepi32_ps(_mm256_srli_epi32(sc, 4)));
    }
  } else if constexpr (ID == 12 || ID == 13) {
    const __m256 nd = _mm256_sub_ps(_mm256_setzero_ps(), halves8(o + f.dmin + 16 * h));
    D[0] = D[1] = _mm256_mul_ps(d, u8f(o + f.sc + 16 * j + 8 * h));
    M[0] = M[1] = _mm256_mul_ps(nd, u8f(o + f.mn + 16 * j + 8 * h));
  } else {  // Q3_K, Q6_K: signed scales per 16 inputs
    for (int hh = 0; hh < 2; ++hh) D[hh] = _mm256_mul_ps(d, s8f(o + f.sc + 16 * (2 * j + hh) + 8 * h));
  }
}

// sum over code rows [I0, I0 + 4) of (unsigned a) x (signed b) per lane, exactly
template <bool MIN, int I0>
inline __m256i dot4(const uint8_t* u, const __m256i* q) {
  const int32_t* up = reinterpret_cast<const int32_t*>(u);
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i s = _mm256_setzero_si256();
  for (int i = I0; i < I0 + 4; ++i) {
    const __m256i x = _mm256_set1_epi32(up[i]);
    const __m256i pairs = MIN ? _mm256_maddubs_epi16(q[i], x) : _mm256_maddubs_epi16(x, q[i]);
    s = _mm256_add_epi32(s, _mm256_madd_epi16(pairs, ones));
  }
  return s;
}

template <bool MIN, int P, int I0>
inline __m256 half_sum(const uint8_t* u, int64_t K, const __m256i* q, __m256i offset) {
  __m256i s[P];
  for (int p = 0; p < P; ++p) {
    s[p] = dot4<MIN, I0>(u + p * K, q);
    if constexpr (!MIN) s[p] = _mm256_sub_epi32(s[p], offset);
  }
  if constexpr (P == 1) return _mm256_cvtepi32_ps(s[0]);
  return _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[0]), _mm256_set1_ps(65536.0f),
                         _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[1]), _mm256_set1_ps(256.0f), _mm256_cvtepi32_ps(s[2])));
}

template <int ID, int RR, int P>
void rows_block(const uint8_t* u, const float* scale, const float* sums16, int64_t K, const uint8_t* w, int h,
                float* y, int64_t ldy, int64_t cols) {
  constexpr TypeInfo t = type_info(ID);
  constexpr bool MIN = t.is_min;
  const int64_t nb = K / QB;
  __m256 acc[RR];
  for (int r = 0; r < RR; ++r) acc[r] = _mm256_setzero_ps();
  const __m256i ones8 = _mm256_set1_epi8(1), ones16 = _mm256_set1_epi16(1);
  for (int64_t sb = 0; sb < K / t.qk; ++sb) {
    const uint8_t* o = w + sb * t.layout;
    for (int j = 0; j < t.qk / QB; ++j) {
      const int64_t b = sb * (t.qk / QB) + j;
      __m256i q[8];
      codes<ID>(o, j, h, q);
      __m256 D[2], M[2];
      scales<ID>(o, j, h, D, M);
      __m256i off[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
      if constexpr (!MIN)
        for (int hh = 0; hh < 2; ++hh) {
          __m256i c = _mm256_setzero_si256();
          for (int i = 4 * hh; i < 4 * hh + 4; ++i)
            c = _mm256_add_epi32(c, _mm256_madd_epi16(_mm256_maddubs_epi16(ones8, q[i]), ones16));
          off[hh] = _mm256_slli_epi32(c, 7);
        }
      for (int r = 0; r < RR; ++r) {
        const uint8_t* ur = u + P * r * K + b * QB;
        const __m256 sx = _mm256_set1_ps(scale[r * nb + b]);
        const __m256 v0 = half_sum<MIN, P, 0>(ur, K, q, off[0]), v1 = half_sum<MIN, P, 4>(ur, K, q, off[1]);
        acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(D[0], sx), v0, acc[r]);
        if constexpr (MIN) acc[r] = _mm256_fmadd_ps(M[0], _mm256_set1_ps(sums16[r * 2 * nb + 2 * b]), acc[r]);
        acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(D[1], sx), v1, acc[r]);
        if constexpr (MIN) acc[r] = _mm256_fmadd_ps(M[1], _mm256_set1_ps(sums16[r * 2 * nb + 2 * b + 1]), acc[r]);
      }
    }
  }
  for (int r = 0; r < RR; ++r) {
    float out[8];
    _mm256_storeu_ps(out, acc[r]);
    const int64_t n = std::max<int64_t>(0, std::min<int64_t>(8, cols - 8 * h));
    std::memcpy(y + r * ldy + 8 * h, out, n * sizeof(float));
  }
}

constexpr int RB = 4;  // rows per register block (16 registers)

template <int ID, int P>
void linear(const float* x, int64_t M, int64_t K, const uint8_t* w, const TypeInfo& t, int64_t N, float* y) {
  const int64_t nb = K / QB, groups = (N + G - 1) / G, per_group = (K / t.qk) * t.layout;
  std::vector<uint8_t> u(P * M * K);
  std::vector<float> scale(M * nb), s16(2 * M * nb);
  prepare_scalar(P, x, M, K, u.data(), scale.data(), s16.data(), !t.is_min);
  at::parallel_for(0, 2 * groups, 8, [&](int64_t g0, int64_t g1) {
    for (int64_t gh = g0; gh < g1; ++gh) {
      const int64_t g = gh / 2, cols = std::min<int64_t>(G, N - g * G);
      const int h = static_cast<int>(gh % 2);
      if (8 * h >= cols) continue;
      int64_t m = 0;
      for (; m + RB <= M; m += RB)
        rows_block<ID, RB, P>(u.data() + P * m * K, scale.data() + m * nb, s16.data() + 2 * m * nb, K,
                              w + g * per_group, h, y + m * N + g * G, N, cols);
      const uint8_t* um = u.data() + P * m * K;
      const float *sm = scale.data() + m * nb, *hm = s16.data() + 2 * m * nb;
      float* ym = y + m * N + g * G;
      switch (M - m) {
        case 3: rows_block<ID, 3, P>(um, sm, hm, K, w + g * per_group, h, ym, N, cols); break;
        case 2: rows_block<ID, 2, P>(um, sm, hm, K, w + g * per_group, h, ym, N, cols); break;
        case 1: rows_block<ID, 1, P>(um, sm, hm, K, w + g * per_group, h, ym, N, cols); break;
        default: break;
      }
    }
  });
}

template <int P>
void dispatch(const float* x, int64_t M, int64_t K, const uint8_t* w, const TypeInfo& t, int64_t N, float* y) {
  by_type(t.id, [&](auto id) { linear<decltype(id)::value, P>(x, M, K, w, t, N, y); });
}

}  // namespace avx2
#endif  // AVX2

// ---------------------------------------------------------------------------------------------
// The portable float32 kernel: per block of 32 inputs, the 16 columns' codes widened lane by lane
// from the same rows (lanes are columns), each weight D q + M (or D (q - o)) in float32.
namespace portable {

using jakiro::vf;
using jakiro::vi;

inline vi row(const uint8_t* p) {
  vi v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline vf halves16(const uint8_t* p) {
  vf v;
  for (int c = 0; c < G; ++c) v[c] = half_to_float(p + 2 * c);
  return v;
}
inline vf bytes16(const uint8_t* p, bool is_signed) {
  vf v;
  for (int c = 0; c < G; ++c) v[c] = is_signed ? static_cast<float>(static_cast<int8_t>(p[c])) : static_cast<float>(p[c]);
  return v;
}

// the codes of one block of 32 inputs as eight rows of 16 int32 lanes (4 codes a lane, one byte each)
void codes(const TypeInfo& t, const uint8_t* o, int j, vi q[8]) {
  const Offsets f = offsets(t.id);
  const vi low4 = vi{} + 0x0F0F0F0F;
  for (int i = 0; i < 8; ++i) q[i] = vi{};
  if (f.nib >= 0)
    for (int i = 0; i < 4; ++i) {
      const vi raw = row(o + f.nib + 256 * j + 64 * i);
      q[i] = raw & low4;
      q[i + 4] = (raw >> 4) & low4;
    }
  if (f.two >= 0)
    for (int i = 0; i < 8; ++i) q[i] = (row(o + f.two + 128 * j + 64 * (i / 4)) >> (2 * (i % 4))) & (vi{} + 0x03030303);
  if (f.hi >= 0 && t.id == 14) {
    for (int i = 0; i < 8; ++i)
      q[i] |= ((row(o + f.hi + 128 * j + 64 * (i / 4)) >> (2 * (i % 4))) & (vi{} + 0x03030303)) << 4;
  } else if (f.hi >= 0) {
    const int to = t.id == 11 ? 2 : 4;
    for (int i = 0; i < 8; ++i) q[i] |= ((row(o + f.hi + 64 * j) >> i) & (vi{} + 0x01010101)) << to;
  }
}

// D and M of the sub-blocks covering inputs 16h..16h+15 of block j, as the reference computes them
void scales(const TypeInfo& t, const uint8_t* o, int j, vf D[2], vf M[2]) {
  const Offsets f = offsets(t.id);
  const vf d = halves16(o + f.d);
  const vf dmin = f.dmin >= 0 ? halves16(o + f.dmin) : vf{};
  for (int h = 0; h < 2; ++h) {
    if (t.qk == 32) {
      D[h] = d;
      M[h] = dmin;  // Q5_1's m (zero for the symmetric types)
      continue;
    }
    const int s = t.sub == 16 ? 2 * j + h : j;
    if (t.id == 10) {
      vf sc, mn;
      for (int c = 0; c < G; ++c) {
        sc[c] = static_cast<float>(o[f.sc + 16 * s + c] & 15);
        mn[c] = static_cast<float>(o[f.sc + 16 * s + c] >> 4);
      }
      D[h] = d * sc;
      M[h] = -(dmin * mn);
    } else if (t.is_min) {
      D[h] = d * bytes16(o + f.sc + 16 * s, false);
      M[h] = -(dmin * bytes16(o + f.mn + 16 * s, false));
    } else {
      D[h] = d * bytes16(o + f.sc + 16 * s, true);
      M[h] = vf{};
    }
  }
}

template <int RR>
void rows_block(const TypeInfo& t, const float* x, int64_t K, const uint8_t* w, float* y, int64_t ldy, int64_t cols) {
  vf acc[RR];
  for (int r = 0; r < RR; ++r) acc[r] = vf{};
  const vi byte = vi{} + 0xFF;
  const vf off = vf{} + static_cast<float>(t.offset);
  for (int64_t sb = 0; sb < K / t.qk; ++sb) {
    const uint8_t* o = w + sb * t.layout;
    for (int j = 0; j < t.qk / QB; ++j) {
      vi q[8];
      codes(t, o, j, q);
      vf D[2], M[2];
      scales(t, o, j, D, M);
      const float* xb = x + sb * t.qk + j * QB;
      for (int k = 0; k < QB; ++k) {
        const int h = k / 16;
        const vf c = __builtin_convertvector((q[k / 4] >> (8 * (k % 4))) & byte, vf);
        const vf wk = t.is_min ? D[h] * c + M[h] : D[h] * (c - off);
        for (int r = 0; r < RR; ++r) acc[r] += wk * xb[r * K + k];
      }
    }
  }
  for (int r = 0; r < RR; ++r) {
    float out[G];
    std::memcpy(out, &acc[r], sizeof(out));
    std::memcpy(y + r * ldy, out, cols * sizeof(float));
  }
}

void linear(const float* x, int64_t M, int64_t K, const uint8_t* w, const TypeInfo& t, int64_t N, float* y) {
  const int64_t groups = (N + G - 1) / G, per_group = (K / t.qk) * t.layout;
  constexpr int R = 4;
  at::parallel_for(0, groups, 4, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      const uint8_t* wg = w + g * per_group;
      const int64_t cols = std::min<int64_t>(G, N - g * G);
      int64_t m = 0;
      for (; m + R <= M; m += R) rows_block<R>(t, x + m * K, K, wg, y + m * N + g * G, N, cols);
      switch (M - m) {
        case 3: rows_block<3>(t, x + m * K, K, wg, y + m * N + g * G, N, cols); break;
        case 2: rows_block<2>(t, x + m * K, K, wg, y + m * N + g * G, N, cols); break;
        case 1: rows_block<1>(t, x + m * K, K, wg, y + m * N + g * G, N, cols); break;
        default: break;
      }
    }
  });
}

}  // namespace portable

bool integer_on = true;  // the integer kernel where built (``set_kq_int8``: off to measure the portable one)

// float32 rows [n, d] of a GGUF tensor (raw blocks or float values) for token ids
at::Tensor gguf_rows(const at::Tensor& src, const at::Tensor& ids) {
  TORCH_CHECK(jakiro::valid_rows(src), "gguf_rows: expected raw GGUF blocks [V, blocks, bytes] or float rows [V, d]");
  TORCH_CHECK(ids.dim() == 1 && ids.scalar_type() == at::kLong, "gguf_rows: ids must be [n] int64");
  const auto idc = ids.contiguous();
  const int64_t n = idc.size(0), V = src.size(0), d = jakiro::row_width(src);
  auto out = at::empty({n, d}, src.options().dtype(at::kFloat));
  for (int64_t r = 0; r < n; ++r) {
    const int64_t t = idc.data_ptr<int64_t>()[r];
    TORCH_CHECK(t >= 0 && t < V, "token id ", t, " outside the embedding (", V, " rows)");
  }
  at::parallel_for(0, n, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) row_values(src, idc.data_ptr<int64_t>()[r], out.data_ptr<float>() + r * d);
  });
  return out;
}

void set_kq_int8(bool on) { integer_on = on; }

}  // namespace

namespace jakiro {

bool kq_weight(const at::Tensor& w) {
  return w.dim() == 3 && w.scalar_type() == at::kChar && type_by_layout(w.size(2)) != nullptr;
}

int64_t kq_block_values(const at::Tensor& w) { return type_by_layout(w.size(2))->qk; }

void kq_linear_rows(const float* x, int64_t M, int64_t K, const at::Tensor& w, int64_t N, float* y,
                    int64_t input_bytes) {
  const TypeInfo& t = *type_by_layout(w.size(2));
  const uint8_t* wp = reinterpret_cast<const uint8_t*>(w.data_ptr<int8_t>());
#if defined(JAKIRO_KQ_VNNI)
  if (integer_on) {
    if (input_bytes == 1)
      vnni::dispatch<1>(x, M, K, wp, t, N, y);
    else
      vnni::dispatch<3>(x, M, K, wp, t, N, y);
    return;
  }
#elif defined(JAKIRO_KQ_AVX2)
  if (integer_on) {
    if (input_bytes == 1)
      avx2::dispatch<1>(x, M, K, wp, t, N, y);
    else
      avx2::dispatch<3>(x, M, K, wp, t, N, y);
    return;
  }
#endif
  (void)input_bytes;
  portable::linear(x, M, K, wp, t, N, y);
}

bool valid_rows(const at::Tensor& src) {
  if (!src.is_contiguous()) return false;
  if (src.dim() == 2)
    return src.scalar_type() == at::kFloat || src.scalar_type() == at::kHalf || src.scalar_type() == at::kBFloat16;
  return src.dim() == 3 && src.scalar_type() == at::kByte && type_by_raw(src.size(2)) != nullptr;
}

int64_t row_width(const at::Tensor& src) {
  return src.dim() == 2 ? src.size(1) : src.size(1) * type_by_raw(src.size(2))->qk;
}

void embedding_row(const at::Tensor& src, int64_t r, float* out) { row_values(src, r, out); }

}  // namespace jakiro

TORCH_LIBRARY_FRAGMENT(jakiro_smallgemm, m) {
  m.def("kq_pack(Tensor raw) -> Tensor", kq_pack);
  m.def("gguf_rows(Tensor src, Tensor ids) -> Tensor", gguf_rows);
  m.def("set_kq_int8(bool on) -> ()", set_kq_int8);
}
