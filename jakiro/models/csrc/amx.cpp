// y = x @ W^T for GGUF-block weights (Q4_1, Q8_0) on the AMX tile unit (Sapphire Rapids and
// later): one tile multiply takes 16 output columns x 32 inputs (one block) for up to 16
// rows, so the weights are read, unpacked and multiplied once for all the rows of a tree; what
// grows with the rows is only the rescaling of each block's sums (a few vector operations per
// row and block).
//
// The tile unit multiplies bytes, so each input row is written, per block of 32 values, as an
// integer X = round(x * 2^(22 - E)) with |x| < 2^E (E from the block's largest value), split
// into three signed bytes X = a1 * 2^16 + a2 * 2^8 + a3. The three byte rows go through the
// same tile multiply, exactly (integer sums), and are recombined in float32. The only rounding
// beyond float32 arithmetic is that of X: at most 2^-22 of the block's largest value per input
// (four float32 roundings of that value; values far smaller than their block's largest keep
// fewer significant bits than in float32). Weights are the GGUF blocks as they are
// (4-bit or 8-bit q, per-block scale d and offset m): each block adds d * sum(q x) + m * sum(x).
//
// For 4-bit weights the same X goes through two tile multiplies instead of three: X = D1 * 2^12
// + D0 with 12-bit digits, each written as D = 16 h + l (h a signed byte, l in [0, 15]) in one
// 64-byte row [h of the 32 inputs][l of the 32 inputs] against the block's weights as [16 q][q]
// (16 q <= 240 still fits an unsigned byte); a tile multiply then sums q (16 h + l) = q D over
// the block. The integer sums are the same (D1 * 2^12 + D0 = X), so the outputs are bitwise
// those of three byte rows, for two thirds of the tile stores and conversions per row.
//
// Drafts may ask for one byte per input instead (``input_bytes`` 1: X = round(x * 2^(7 - E))
// clamped to [-127, 127], int8 per block of 32 as llama.cpp's Q8 activations): one byte row per
// row, so a third of the tile stores and rescaling that grow with the rows, for a rounding of
// up to 2^-6 of the block's largest value that changes a draft's proposals slightly, never what
// verification accepts.
//
// Each output is computed by the same instructions whatever the number of rows (a row's
// integer sums do not depend on the other rows of the tile), so a token's logits are bitwise the
// same alone and in a tree.
//
// Layout (``pack``): per 16 output columns and block, [d: 16 float32][m: 16 float32 (Q4_1)]
// then the q bytes in the tile's row format, 4 consecutive inputs of a column side by side:
// Q8_0 512 bytes, loaded straight into the tile; Q4_1 256 bytes whose low nibbles are the tile's
// rows 0-3 and high nibbles rows 4-7 (the GGUF nibble order needs no reshuffle).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <utility>
#include <vector>

#include "kernels.h"

#if defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__AVX512F__)
#define JAKIRO_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace {

using jakiro::QB;  // inputs per block
constexpr int64_t G = 16;    // output columns per tile
constexpr int MAX_ROWS = 16;  // rows per pass (3 x 16 byte rows fill three tiles)

// input pieces per row and bytes per piece row: P = 2 are the two 12-bit digits of 4-bit
// weights' three-byte inputs (above), 64 bytes each
constexpr int64_t piece_bytes(int P) { return P == 2 ? 2 * QB : QB; }

constexpr int64_t amx_bytes(bool q4) { return jakiro::amx_pack_bytes(q4); }

#if defined(JAKIRO_AMX)

struct TileConfig {
  uint8_t palette_id = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
} __attribute__((packed));

// Tiles: TA tiles of x's byte rows (16 rows each), KG weight tiles (column groups in flight:
// a tile multiply's result takes tens of cycles, so independent ones are interleaved; they come
// from KG spans of the thread's columns, KG read streams, which measured 30 % faster for one
// row than KG neighbouring groups), KG x TA sums
template <int TA, int KG>
constexpr int a_tile(int t) { return t; }
template <int TA, int KG>
constexpr int b_tile(int j) { return TA + j; }
template <int TA, int KG>
constexpr int c_tile(int j, int t) { return TA + KG + j * TA + t; }

template <int TA, int KG, int64_t KB>
void configure(int64_t byte_rows) {
  static_assert(TA + KG + TA * KG <= 8, "eight tiles");
  TileConfig c;
  for (int t = 0; t < TA; ++t) {
    const int64_t r = std::min<int64_t>(16, byte_rows - t * 16);
    c.rows[a_tile<TA, KG>(t)] = r;
    c.colsb[a_tile<TA, KG>(t)] = KB;
    for (int j = 0; j < KG; ++j) {
      c.rows[c_tile<TA, KG>(j, t)] = r;
      c.colsb[c_tile<TA, KG>(j, t)] = 64;
    }
  }
  for (int j = 0; j < KG; ++j) {
    c.rows[b_tile<TA, KG>(j)] = KB / 4;
    c.colsb[b_tile<TA, KG>(j)] = 64;
  }
  // not _tile_loadconfig: GCC 12's names only 8 bytes of the configuration as read, so the
  // compiler may drop the stores to the rest
  asm volatile("ldtilecfg %0" ::"m"(c));
}

// x [M, K] -> per block: piece rows [P * M][piece_bytes(P)] (piece-major), scale 2^(E - S) and
// sum(x). P = 3: X = round(x * 2^(22 - E)) in three balanced bytes (exact to float32 rounding,
// above); P = 2: the same X in two 12-bit digits of 64 bytes each (4-bit weights only);
// P = 1: one byte, X = round(x * 2^(7 - E)) clamped to [-127, 127] (int8 inputs per block of 32,
// as llama.cpp's Q8 activations: for a draft, whose proposals need not be exact)
template <int P>
void prepare(const float* x, int64_t M, int64_t K, int8_t* bytes, float* scale, float* sums) {
  static_assert(P >= 1 && P <= 3, "one byte, two digits or three bytes per input");
  constexpr int S = P == 1 ? 7 : 22;
  constexpr int64_t KB = piece_bytes(P);
  const int64_t nb = K / QB, R = P * M;
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t b = 0; b < nb; ++b) {
      const __m512 lo = _mm512_loadu_ps(x + m * K + b * QB), hi = _mm512_loadu_ps(x + m * K + b * QB + 16);
      const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
      const float sum = jakiro::hsum((jakiro::vf)lo) + jakiro::hsum((jakiro::vf)hi);
      sums[m * nb + b] = sum;
      int8_t* row = bytes + b * R * KB;
      if (!(amax > 0) || !std::isfinite(amax) || !std::isfinite(sum)) {
        // zeros; or a non-finite input (the maximum may skip a NaN, the sum does not), which
        // makes the block's outputs NaN as in float32 arithmetic
        for (int64_t p = 0; p < P; ++p) std::memset(row + (p * M + m) * KB, 0, KB);
        scale[m * nb + b] = std::isfinite(sum) && !(amax > 0) ? 0.0f : NAN;
        continue;
      }
      const int e = std::ilogb(amax) + 1;  // amax < 2^e
      const __m512 up = _mm512_set1_ps(std::ldexp(1.0f, S - e));
      scale[m * nb + b] = std::ldexp(1.0f, e - S);
      for (int64_t h = 0; h < 2; ++h) {
        const __m512i X = _mm512_cvtps_epi32(_mm512_mul_ps(h ? hi : lo, up));  // |X| <= 2^S
        if constexpr (P == 1) {
          const __m512i c = _mm512_max_epi32(_mm512_min_epi32(X, _mm512_set1_epi32(127)), _mm512_set1_epi32(-127));
          _mm_storeu_si128(reinterpret_cast<__m128i*>(row + m * QB + 16 * h), _mm512_cvtepi32_epi8(c));
          continue;
        }
        if constexpr (P == 2) {
          // X = D1 * 2^12 + D0, D0 in [-2048, 2047], D1 in [-1024, 1024]; D = 16 (D >> 4) + (D & 15)
          const __m512i d1 = _mm512_srai_epi32(_mm512_add_epi32(X, _mm512_set1_epi32(2048)), 12);
          const __m512i d0 = _mm512_sub_epi32(X, _mm512_slli_epi32(d1, 12));
          const __m512i fifteen = _mm512_set1_epi32(15);
          int8_t* r1 = row + m * KB + 16 * h;
          int8_t* r0 = row + (M + m) * KB + 16 * h;
          _mm_storeu_si128(reinterpret_cast<__m128i*>(r1), _mm512_cvtepi32_epi8(_mm512_srai_epi32(d1, 4)));
          _mm_storeu_si128(reinterpret_cast<__m128i*>(r1 + QB), _mm512_cvtepi32_epi8(_mm512_and_si512(d1, fifteen)));
          _mm_storeu_si128(reinterpret_cast<__m128i*>(r0), _mm512_cvtepi32_epi8(_mm512_srai_epi32(d0, 4)));
          _mm_storeu_si128(reinterpret_cast<__m128i*>(r0 + QB), _mm512_cvtepi32_epi8(_mm512_and_si512(d0, fifteen)));
          continue;
        }
        // balanced digits: a2 * 2^8 + a3 spans [-32896, 32639], so a1 = floor((X + 32896) / 2^16)
        const __m512i a1 = _mm512_srai_epi32(_mm512_add_epi32(X, _mm512_set1_epi32(32896)), 16);
        const __m512i r1 = _mm512_sub_epi32(X, _mm512_slli_epi32(a1, 16));
        const __m512i a2 = _mm512_srai_epi32(_mm512_add_epi32(r1, _mm512_set1_epi32(1 << 7)), 8);
        const __m512i a3 = _mm512_sub_epi32(r1, _mm512_slli_epi32(a2, 8));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(row + (0 * M + m) * QB + 16 * h), _mm512_cvtepi32_epi8(a1));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(row + (1 * M + m) * QB + 16 * h), _mm512_cvtepi32_epi8(a2));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(row + (2 * M + m) * QB + 16 * h), _mm512_cvtepi32_epi8(a3));
      }
    }
  }
}

// tile instructions on tile registers named by template arguments (the compiler's intrinsics
// take only literal numbers)
template <int T>
inline void tile_load(const void* p, int64_t stride) {
  asm volatile("tileloadd (%0,%1,1), %%tmm%c2" ::"r"(p), "r"(stride), "i"(T) : "memory");
}
template <int T>
inline void tile_store(void* p, int64_t stride) {
  asm volatile("tilestored %%tmm%c2, (%0,%1,1)" ::"r"(p), "r"(stride), "i"(T) : "memory");
}
template <int T>
inline void tile_zero() {
  asm volatile("tilezero %%tmm%c0" ::"i"(T));
}
// C += A (signed bytes) . B (unsigned bytes for Q4_1, signed for Q8_0)
template <bool Q4, int C, int A, int B>
inline void tile_dot() {
  if constexpr (Q4)
    asm volatile("tdpbsud %%tmm%c2, %%tmm%c1, %%tmm%c0" ::"i"(C), "i"(A), "i"(B));
  else
    asm volatile("tdpbssd %%tmm%c2, %%tmm%c1, %%tmm%c0" ::"i"(C), "i"(A), "i"(B));
}

// compile-time loops (tile numbers must be constants)
template <int N, typename F, int... I>
inline void unroll(F&& f, std::integer_sequence<int, I...>) {
  (f(std::integral_constant<int, I>{}), ...);
}
template <int N, typename F>
inline void unroll(F&& f) {
  unroll<N>(f, std::make_integer_sequence<int, N>{});
}

// a row's integer sums of one block (one per piece of x) as one float32 value: for 4-bit
// weights exactly in int32 first (|sum| < 2^31: |D1| <= 1024, 32 * 15 * 1024 * 2^12 + 32 * 15 *
// 2048 < 2^31, likewise for three bytes), for 8-bit ones in float32
inline __m512 combine(__m512i c1, __m512i c0) {
  return _mm512_cvtepi32_ps(_mm512_add_epi32(_mm512_slli_epi32(c1, 12), c0));
}
template <bool Q4>
inline __m512 combine(__m512i c1, __m512i c2, __m512i c3) {
  if constexpr (Q4)
    return _mm512_cvtepi32_ps(
        _mm512_add_epi32(_mm512_add_epi32(_mm512_slli_epi32(c1, 16), _mm512_slli_epi32(c2, 8)), c3));
  else
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(c1), _mm512_set1_ps(65536.0f),
                           _mm512_fmadd_ps(_mm512_cvtepi32_ps(c2), _mm512_set1_ps(256.0f), _mm512_cvtepi32_ps(c3)));
}

// acc + d * scale * v (+ m * sum(x) for Q4_1), for the 16 columns of the block group at grp
template <bool Q4>
inline __m512 accumulate(__m512 acc, __m512 v, const uint8_t* grp, float scale, float sum) {
  const float* dm = reinterpret_cast<const float*>(grp);
  acc = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_loadu_ps(dm), _mm512_set1_ps(scale)), v, acc);
  if constexpr (Q4) acc = _mm512_fmadd_ps(_mm512_loadu_ps(dm + G), _mm512_set1_ps(sum), acc);
  return acc;
}

// output column groups [g0, g1), KG at a time, for M rows (P M piece rows in TA tiles; M is a
// constant so that the rows' sums stay in registers)
template <bool Q4, int P, int M, int TA, int KG>
void columns(const int8_t* bytes, const float* scale, const float* sums, int64_t nb, const uint8_t* w, int64_t g0,
             int64_t g1, float* y, int64_t N) {
  static_assert(P != 2 || Q4, "two digits per input need 4-bit weights");
  constexpr int64_t BB = amx_bytes(Q4), KB = piece_bytes(P);
  const int64_t sp = (g1 - g0) / KG;  // the KG groups in flight come from KG equal spans
  const int64_t R = P * M;
  // Q4_1: the weight tiles' bytes, unpacked one block ahead (a tile load waits for the stores
  // that wrote its bytes to retire; unpacking the next block while this one multiplies hides it)
  alignas(64) uint8_t wtile[2][KG][KB / 4 * 64];
  alignas(64) int32_t sums32[KG][P * M * G];
  const auto unpack = [&](int64_t g, int64_t b) {
    const __m512i low = _mm512_set1_epi8(0x0F);
    for (int j = 0; j < KG; ++j) {
      const uint8_t* q = w + ((g + j * sp) * nb + b) * BB + 2 * G * 4;
      uint8_t* out = wtile[b & 1][j];
      for (int64_t i = 0; i < 4; ++i) {
        const __m512i v = _mm512_loadu_si512(q + 64 * i);
        if constexpr (P == 2) {  // rows 0-7: 16 q against the digits' h, rows 8-15: q against their l
          const __m512i high = _mm512_set1_epi8(static_cast<char>(0xF0));
          _mm512_store_si512(out + 64 * i, _mm512_and_si512(_mm512_slli_epi16(v, 4), high));
          _mm512_store_si512(out + 64 * (i + 4), _mm512_and_si512(v, high));
          _mm512_store_si512(out + 64 * (i + 8), _mm512_and_si512(v, low));
          _mm512_store_si512(out + 64 * (i + 12), _mm512_and_si512(_mm512_srli_epi16(v, 4), low));
        } else {
          _mm512_store_si512(out + 64 * i, _mm512_and_si512(v, low));
          _mm512_store_si512(out + 64 * (i + 4), _mm512_and_si512(_mm512_srli_epi16(v, 4), low));
        }
      }
    }
  };
  __m512 acc[KG][M];
  const auto rescale = [&](int64_t g, int64_t b) {  // the sums of block b into the outputs
    unroll<KG>([&](auto j) {
      const uint8_t* grp = w + ((g + j * sp) * nb + b) * BB;
      const int32_t* s32 = sums32[j];
      for (int m = 0; m < M; ++m) {
        __m512 v;
        if constexpr (P == 1)
          v = _mm512_cvtepi32_ps(_mm512_load_si512(s32 + m * G));
        else if constexpr (P == 2)
          v = combine(_mm512_load_si512(s32 + m * G), _mm512_load_si512(s32 + (M + m) * G));
        else
          v = combine<Q4>(_mm512_load_si512(s32 + m * G), _mm512_load_si512(s32 + (M + m) * G),
                          _mm512_load_si512(s32 + (2 * M + m) * G));
        acc[j][m] = accumulate<Q4>(acc[j][m], v, grp, scale[m * nb + b], sums[m * nb + b]);
      }
    });
  };
  configure<TA, KG, KB>(R);
  for (int64_t g = g0; g < g0 + sp; ++g) {
    for (int j = 0; j < KG; ++j)
      for (int m = 0; m < M; ++m) acc[j][m] = _mm512_setzero_ps();
    if constexpr (Q4) unpack(g, 0);
    for (int64_t b = 0; b < nb; ++b) {
      const int8_t* a = bytes + b * R * KB;
      unroll<TA>([&](auto t) { tile_load<a_tile<TA, KG>(decltype(t)::value)>(a + 16 * t * KB, KB); });
      unroll<KG>([&](auto j) {
        if constexpr (Q4)
          tile_load<b_tile<TA, KG>(decltype(j)::value)>(wtile[b & 1][j], 64);
        else
          tile_load<b_tile<TA, KG>(decltype(j)::value)>(w + ((g + j * sp) * nb + b) * BB + G * 4, 64);
        unroll<TA>([&](auto t) {
          constexpr int c = c_tile<TA, KG>(decltype(j)::value, decltype(t)::value);
          tile_zero<c>();
          tile_dot<Q4, c, a_tile<TA, KG>(decltype(t)::value), b_tile<TA, KG>(decltype(j)::value)>();
        });
      });
      if constexpr (Q4)
        if (b + 1 < nb) unpack(g, b + 1);
      unroll<KG>([&](auto j) {
        unroll<TA>([&](auto t) {
          tile_store<c_tile<TA, KG>(decltype(j)::value, decltype(t)::value)>(sums32[j] + 16 * t * G, 64);
        });
      });
      rescale(g, b);
    }
    for (int j = 0; j < KG; ++j)
      for (int m = 0; m < M; ++m) _mm512_storeu_ps(y + m * N + (g + j * sp) * G, acc[j][m]);
  }
}

template <bool Q4, int P, int M>
void column_range(const int8_t* bytes, const float* scale, const float* sums, int64_t nb, const uint8_t* w, int64_t g0,
                  int64_t g1, float* y, int64_t N) {
  constexpr int TA = (P * M + 15) / 16, KG = TA == 1 ? 3 : TA == 2 ? 2 : 1;
  const int64_t full = g0 + (g1 - g0) / KG * KG;
  columns<Q4, P, M, TA, KG>(bytes, scale, sums, nb, w, g0, full, y, N);
  if (full < g1) columns<Q4, P, M, TA, 1>(bytes, scale, sums, nb, w, full, g1, y, N);
}

template <bool Q4, int P, int... I>
void column_dispatch(std::integer_sequence<int, I...>, const int8_t* bytes, const float* scale, const float* sums,
                     int64_t M, int64_t nb, const uint8_t* w, int64_t g0, int64_t g1, float* y, int64_t N) {
  ((M == I + 1 ? (column_range<Q4, P, I + 1>(bytes, scale, sums, nb, w, g0, g1, y, N), true) : false) || ...);
}

constexpr int64_t TWO_DIGIT_ROWS = 6;  // measured on the layers of SmolLM2-135M: slower at 1-4 rows, 5-10 % faster from 6 on

// M rows in passes of MAX_ROWS, each prepared as pieces PP of x and multiplied by every column
template <bool Q4, int PP>
void tile_passes(const float* x, int64_t M, int64_t K, const uint8_t* wp, int64_t N, float* y) {
  const int64_t nb = K / QB;
  for (int64_t m0 = 0; m0 < M; m0 += MAX_ROWS) {
    const int64_t rows = std::min<int64_t>(MAX_ROWS, M - m0);
    std::vector<int8_t> bytes(nb * PP * rows * piece_bytes(PP));
    std::vector<float> scale(rows * nb), sums(rows * nb);
    prepare<PP>(x + m0 * K, rows, K, bytes.data(), scale.data(), sums.data());
    at::parallel_for(0, N / G, 4, [&](int64_t g0, int64_t g1) {
      column_dispatch<Q4, PP>(std::make_integer_sequence<int, MAX_ROWS>{}, bytes.data(), scale.data(), sums.data(),
                              rows, nb, wp, g0, g1, y + m0 * N, N);
    });
  }
}

// P bytes per input; from TWO_DIGIT_ROWS rows on, three bytes go to 4-bit weights as two
// 12-bit digits (the same sums, bitwise the same outputs): fewer tile stores and conversions per
// row, for twice the weight bytes unpacked per block, which only pays once there are a few rows
template <int P>
void tile_rows(const float* x, int64_t M, int64_t K, const at::Tensor& w, int64_t N, float* y) {
  const uint8_t* wp = w.data_ptr<uint8_t>();
  if (w.size(2) != amx_bytes(true))
    tile_passes<false, P>(x, M, K, wp, N, y);
  else if (P == 3 && M >= TWO_DIGIT_ROWS)
    tile_passes<true, 2>(x, M, K, wp, N, y);
  else
    tile_passes<true, P>(x, M, K, wp, N, y);
}

bool request_tiles() {
  constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
  return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
}

#endif  // JAKIRO_AMX

}  // namespace

namespace jakiro {

bool amx_usable() {
#if defined(JAKIRO_AMX)
  static const bool ok = request_tiles();
  return ok;
#else
  return false;
#endif
}

bool amx_weight(const at::Tensor& w) {
  return w.dim() == 3 && w.scalar_type() == at::kByte &&
         (w.size(2) == amx_bytes(true) || w.size(2) == amx_bytes(false));
}

at::Tensor amx_pack(const at::Tensor& blocks) {
  TORCH_CHECK(blocks.dim() == 3 && blocks.scalar_type() == at::kByte && blocks.is_contiguous() &&
                  (blocks.size(2) == gguf_block_bytes(true) || blocks.size(2) == gguf_block_bytes(false)),
              "amx_pack: expected GGUF blocks [rows, in / 32, bytes] (Q4_1 or Q8_0)");
  TORCH_CHECK(blocks.size(0) % G == 0, "amx_pack: the number of rows must be a multiple of 16");
  const bool q4 = blocks.size(2) == gguf_block_bytes(true);
  const int64_t N = blocks.size(0), nb = blocks.size(1), in = gguf_block_bytes(q4), out = amx_bytes(q4);
  auto packed = jakiro::weight_empty({N / G, nb, out}, blocks.options());
  const uint8_t* src = blocks.data_ptr<uint8_t>();
  uint8_t* dst = packed.data_ptr<uint8_t>();
  for (int64_t g = 0; g < N / G; ++g)
    for (int64_t b = 0; b < nb; ++b) {
      uint8_t* o = dst + (g * nb + b) * out;
      for (int64_t n = 0; n < G; ++n) {
        const uint8_t* blk = src + ((g * G + n) * nb + b) * in;
        std::memcpy(o + 4 * n, blk, 4);  // d
        if (q4) std::memcpy(o + 4 * (G + n), blk + 4, 4);  // m
        uint8_t* q = o + (q4 ? 8 : 4) * G;
        // byte (i, n, j) of the tile rows holds input 4i + j of column n (Q4_1: and 16 + 4i + j)
        for (int64_t i = 0; i < (q4 ? 4 : 8); ++i)
          for (int64_t j = 0; j < 4; ++j) q[i * 64 + n * 4 + j] = blk[8 + 4 * i + j];
      }
    }
  return packed;
}

void amx_linear_rows(const float* x, int64_t M, int64_t K, const at::Tensor& w, int64_t N, float* y,
                     int64_t input_bytes) {
  TORCH_CHECK(input_bytes == 1 || input_bytes == 3, "the AMX kernel takes inputs as 1 or 3 bytes");
#if defined(JAKIRO_AMX)
  if (input_bytes == 1)
    tile_rows<1>(x, M, K, w, N, y);
  else
    tile_rows<3>(x, M, K, w, N, y);
#else
  TORCH_CHECK(false, "this build has no AMX kernel");
#endif
}

}  // namespace jakiro
