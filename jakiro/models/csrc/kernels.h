// Kernels shared by the extension's translation units (smallgemm.cpp defines them).
#pragma once

#include <ATen/ATen.h>

#include <cstring>
#if defined(__linux__)
#include <sys/mman.h>
#endif
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace jakiro {

constexpr int64_t VL = 16;  // floats per vector
typedef float vf __attribute__((vector_size(VL * sizeof(float))));
typedef float vf8 __attribute__((vector_size(8 * sizeof(float))));
typedef float vf4 __attribute__((vector_size(4 * sizeof(float))));
typedef int32_t vi __attribute__((vector_size(VL * sizeof(int32_t))));

// GGUF blocks as the kernels take them: QB values per block, packed as [d, m as float32][q bytes]
// (Q4_1: 16 bytes of nibbles; Q8_0: 32 bytes, m = 0)
constexpr int64_t QB = 32;
constexpr int64_t gguf_block_bytes(bool q4) { return 8 + (q4 ? QB / 2 : QB); }
// bytes per 16 output columns and block in the AMX kernel's layout (``amx_pack``): the 16
// scales d (Q4_1: and offsets m) as float32, then the q bytes
constexpr int64_t amx_pack_bytes(bool q4) { return q4 ? 2 * 16 * 4 + 16 * QB / 2 : 16 * 4 + 16 * QB; }

// Memory for a weight the kernels stream (or a buffer timed against them): on 2 MiB pages where
// the kernel allows it, asked for before the first touch. A forward reads every weight once; on
// 4 KiB pages the hardware prefetchers stop at each page's end and every page costs a TLB walk
// (a 1.5B model's one-token forward: 48.4 against 53.8 ms, its weights read once 39.2 against
// 41.5 ms, 2 threads).
inline at::Tensor weight_empty(at::IntArrayRef sizes, at::TensorOptions options) {
  at::Tensor t = at::empty(sizes, options);
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  constexpr uintptr_t huge = uintptr_t(2) << 20;
  const uintptr_t p = reinterpret_cast<uintptr_t>(t.data_ptr()), e = p + t.nbytes();
  const uintptr_t a = (p + huge - 1) & ~(huge - 1), b = e & ~(huge - 1);
  if (b > a) madvise(reinterpret_cast<void*>(a), b - a, MADV_HUGEPAGE);  // advice only: ignore failure
#endif
  return t;
}

// Software prefetch of a weight stream, issued for each piece of ``bytes`` the integer kernels
// are about to read: the lines ``prefetch_l1`` bytes ahead into L1 (0: the lines themselves,
// about to be read anyway) and those ``prefetch_l2`` bytes ahead into L2 (0: none). Without the far stream a forward over a few rows (a tree, a
// batch, a prompt's piece) took about the time to read its weights plus the time to compute on
// them, one after the other. Two Zen 4 cores, int8 inputs, medians of 8 rounds alternating the
// settings in one process (docs/experiments/prefetch_ab.py): Qwen2.5-Coder-1.5B Q4_K_M's forward
// over 1 / 8 / 32 rows 27.0 / 42.4 / 119.9 ms with the near stream alone, 24.2 / 37.9 / 122.3 ms
// with both (every matrix alone, in another run: 31.0 / 60.1 / 169.7 against 22.5 / 40.4 / 148.0
// ms; 8-24 KiB ahead within 5 % of each other); SmolLM2-135M's Q4_1 and Q8_0 blocks, 1 / 4 / 8
// rows, 3.7 / 5.3 / 7.5 ms with no prefetch, 3.1 / 4.2 / 5.3 with the near stream alone, 3.3 /
// 3.8 / 4.8 with both. The near distance, on Emerald Rapids (the 1.5B's one-token forward against
// reading its weights once): 2048 bytes 1.29x that floor, 1024 1.34x, 3072 1.37x, 4096 1.54x
// (a line one 4 KiB page ahead lands in the L1 set being read).
extern int64_t prefetch_l1, prefetch_l2;  // bytes ahead (smallgemm.cpp; ``set_prefetch``)

inline void prefetch_weights(const uint8_t* p, int64_t bytes) {
  for (int64_t line = 0; line < bytes; line += 64) __builtin_prefetch(p + prefetch_l1 + line, 0, 3);  // prefetcht0
  if (prefetch_l2)
    for (int64_t line = 0; line < bytes; line += 64) __builtin_prefetch(p + prefetch_l2 + line, 0, 1);  // prefetcht2
}

inline vf load(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof(vf));
  return v;
}

inline void store(float* p, vf v) { std::memcpy(p, &v, sizeof(vf)); }

// the sum of a vector's lanes by halving (a fixed order, four dependent steps)
inline float hsum(vf v) {
  const vf8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  vf4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  b += __builtin_shufflevector(b, b, 2, 3, 0, 1);
  b += __builtin_shufflevector(b, b, 1, 0, 3, 2);
  return b[0];
}

// y [M, N] = x [M, K] @ W^T (+ bias) for a weight packed by ``pack`` ([N/16][K][16] float32)
void linear_rows(const float* x, int64_t M, int64_t K, const float* packed, int64_t N, const float* bias, float* y);

// the same for a weight held as packed float32 or as GGUF blocks ([N][K/32][block], uint8);
// input_bytes: how the AMX kernel takes x (3: exact to float32 rounding; 1: one byte per input
// and block of 32, for drafts and int8 activations, also for the int8 kernel), ignored by the others
void apply_linear(const at::Tensor& w, int64_t N, const float* bias, const float* x, int64_t M, int64_t K, float* y,
                  int64_t input_bytes = 3);

// whether ``w`` is a weight ``apply_linear`` takes for N outputs and K inputs
bool valid_linear(const at::Tensor& w, int64_t N, int64_t K);

// The AMX kernel (amx.cpp): whether this CPU and build can run it (asks the kernel for the tile
// state once), GGUF blocks [N][K/32][bytes] -> its layout [N/16][K/32][bytes'], whether a
// weight is in that layout, and y [M, N] = x [M, K] @ W^T for such a weight.
bool amx_usable();
at::Tensor amx_pack(const at::Tensor& blocks);
bool amx_weight(const at::Tensor& w);
void amx_linear_rows(const float* x, int64_t M, int64_t K, const at::Tensor& w, int64_t N, float* y,
                     int64_t input_bytes);

// The int8 kernel (int8.cpp; on CPUs with AVX-512 VNNI and without tiles): whether this build has
// it, and y [M, N] = x [M, K] @ W^T for Q8_0 or Q4_1 blocks in the AMX kernel's layout, x taken
// as 1 byte per input (drafts, targets with int8 activations) or 3 (float32 accuracy), bitwise
// as the AMX kernel's ``input_bytes``.
bool int8_usable();
void int8_linear_rows(const float* x, int64_t M, int64_t K, const at::Tensor& w, int64_t N, float* y,
                      int64_t input_bytes);

// The int8 kernel's input rows (int8.cpp, with AVX-512 VNNI): per block of 32 values P = 1 or 3
// bytes each (``offset``: + 128, for signed weights), the block's power-of-two scale and the
// float32 sum of its values (and, with ``half_sums``, of its two halves of 16).
void prepare_inputs(int P, const float* x, int64_t M, int64_t K, uint8_t* u, float* scale, float* sums,
                    float* half_sums, bool offset);

// GGUF's other block types (kquants.cpp: Q4_0, Q5_0, Q5_1, Q2_K..Q6_K) in their packed layout
// (``kq_pack``: int8 [N/16, K/QK, bytes]): whether ``w`` is such a weight, its values per block,
// and y [M, N] = x [M, K] @ W^T (the int8 kernel with AVX-512 VNNI, taking x as ``input_bytes``
// bytes, else the portable float32 kernel).
bool kq_weight(const at::Tensor& w);
int64_t kq_block_values(const at::Tensor& w);
void kq_linear_rows(const float* x, int64_t M, int64_t K, const at::Tensor& w, int64_t N, float* y,
                    int64_t input_bytes);

// Rows of an embedding as GGUF holds it: raw blocks [V, blocks, bytes] (any type above, Q4_1,
// Q8_0) or float32 / float16 / bfloat16 [V, d]: whether ``src`` is one, its row width d, and
// row r in float32 (as GGUF's reference dequantization gives it).
bool valid_rows(const at::Tensor& src);
int64_t row_width(const at::Tensor& src);
void embedding_row(const at::Tensor& src, int64_t r, float* out);

#if defined(__AVX512F__)
// RR rows of 16 output columns' accumulators into y (row r at y + r ldy), the first `cols` of them
template <int RR>
inline void store_columns(const __m512* acc, float* y, int64_t ldy, int64_t cols) {
#pragma GCC unroll 8
  for (int r = 0; r < RR; ++r) {
    if (cols >= 16) {
      _mm512_storeu_ps(y + r * ldy, acc[r]);
    } else {
      float out[16];
      _mm512_storeu_ps(out, acc[r]);
      std::memcpy(y + r * ldy, out, cols * sizeof(float));
    }
  }
}
#endif

}  // namespace jakiro
