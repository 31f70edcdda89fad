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
#include <c10/util/Half.h>
#include <torch/library.h>
#if defined(__AVX512F__) || defined(__F16C__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstring>
#include <tuple>
#include <type_traits>
#include <vector>

#include "kernels.h"

namespace {

using jakiro::hsum;
using jakiro::load;
using jakiro::store;
using jakiro::vf;
using jakiro::VL;
using jakiro::vi;

// e^x to about one ulp (Cephes' expf: x = n ln2 + r, a degree-6 polynomial in r, 2^n through the
// exponent bits); inputs below -87.3 give ~1e-38 instead of 0, which no softmax or SiLU notices.
// Written for any vector width: every lane computes the same whatever the width.
template <typename F, typename I>
inline F vexp_lanes(F x) {
  const F lo = F{} - 87.3f, hi = F{} + 88.3f;
  x = x < lo ? lo : x;
  x = x > hi ? hi : x;
  const F t = x * 1.44269504088896341f;
  const I n = __builtin_convertvector(t + (t >= 0.f ? F{} + 0.5f : F{} - 0.5f), I);
  const F nf = __builtin_convertvector(n, F);
  const F r = x - nf * 0.693359375f + nf * 2.12194440e-4f;
  F p = F{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  const I bits = (n + 127) << 23;
  F scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

inline vf vexp(vf x) {
#if defined(__AVX512F__)
  return vexp_lanes<vf, vi>(x);
#else
  // in halves the machine has registers for (16-lane conversions between floats and integers
  // went through memory one lane at a time with AVX2)
  typedef int32_t vi8 __attribute__((vector_size(8 * sizeof(int32_t))));
  using jakiro::vf8;
  const vf8 a = vexp_lanes<vf8, vi8>(__builtin_shufflevector(x, x, 0, 1, 2, 3, 4, 5, 6, 7));
  const vf8 b = vexp_lanes<vf8, vi8>(__builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15));
  return __builtin_shufflevector(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
#endif
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

// The keys a new row attends, in the order it visits them: cache positions 0..prefix-1, then
// `extra` (ascending). A tree token and the same token decoded after its ancestors were committed
// visit the same keys in the same order.
struct Visible {
  int64_t prefix;
  std::vector<int64_t> extra;
};

// mask [n, n] over the new tokens (the prefix all visible), or [n, past + n] over the whole
// cache (a draft's scratch slots); none: causal over the new tokens
std::vector<Visible> visibility(const c10::optional<at::Tensor>& mask, int64_t n, int64_t past, bool whole) {
  std::vector<Visible> vis(n);
  if (!mask.has_value() || !mask->defined()) {
    for (int64_t r = 0; r < n; ++r) {
      vis[r].prefix = past;
      for (int64_t c = 0; c <= r; ++c) vis[r].extra.push_back(past + c);
    }
    return vis;
  }
  const auto m = mask->to(at::kBool).contiguous();
  const int64_t cols = whole ? past + n : n, offset = whole ? 0 : past;
  TORCH_CHECK(m.dim() == 2 && m.size(0) == n && m.size(1) == cols, "attention mask must be [", n, ", ", cols, "]");
  const bool* mp = m.data_ptr<bool>();
  for (int64_t r = 0; r < n; ++r) {
    const bool* row = mp + r * cols;
    int64_t c = 0;
    if (whole)
      while (c < cols && row[c]) ++c;
    vis[r].prefix = whole ? c : past;
    for (; c < cols; ++c)
      if (row[c]) vis[r].extra.push_back(offset + c);
  }
  return vis;
}

// four lanes' sums of four vectors at once: [hsum(a), hsum(b), hsum(c), hsum(d)], each in a
// fixed order (halving, as hsum), with no dependency between the four
inline jakiro::vf4 hsum4(vf a, vf b, vf c, vf d) {
  using jakiro::vf8;
  auto half = [](vf v) {
    return vf8(__builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7)) +
           vf8(__builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15));
  };
  const vf8 a8 = half(a), b8 = half(b), c8 = half(c), d8 = half(d);
  const vf8 ab = __builtin_shufflevector(a8, b8, 0, 1, 2, 3, 8, 9, 10, 11) +
                 __builtin_shufflevector(a8, b8, 4, 5, 6, 7, 12, 13, 14, 15);
  const vf8 cd = __builtin_shufflevector(c8, d8, 0, 1, 2, 3, 8, 9, 10, 11) +
                 __builtin_shufflevector(c8, d8, 4, 5, 6, 7, 12, 13, 14, 15);
  const vf8 abcd = __builtin_shufflevector(ab, cd, 0, 1, 4, 5, 8, 9, 12, 13) +
                   __builtin_shufflevector(ab, cd, 2, 3, 6, 7, 10, 11, 14, 15);
  return __builtin_shufflevector(abcd, abcd, 0, 2, 4, 6) + __builtin_shufflevector(abcd, abcd, 1, 3, 5, 7);
}

// Attention runs on the widest vectors the machine has registers for: 16 lanes (AVX-512, 32
// registers) or 8 (AVX2, 16 registers; GCC spills 16-lane accumulators there and builds every
// scalar broadcast through memory). Per pass, NK keys are scored at once and CH chunks of values
// accumulated at once for the G heads sharing a KV head, so their partial sums stay in
// registers. Every row goes through the same instructions, so a head's sums do not depend on
// the other rows (nor on G).
#if defined(__AVX512F__)
using av = vf;
constexpr int AL = 16;
constexpr int SCORE_KEYS = 4;
template <int C, int G>
constexpr int value_chunks() { return C; }
inline float ahsum(av v) { return hsum(v); }
inline av aexp(av v) { return vexp_lanes<vf, vi>(v); }
#else
using av = jakiro::vf8;
constexpr int AL = 8;
constexpr int SCORE_KEYS = 2;
template <int C, int G>
constexpr int value_chunks() { return G >= 3 ? 2 : 4 < C ? 4 : C; }
inline float ahsum(av v) {
  const jakiro::vf4 b = __builtin_shufflevector(v, v, 0, 1, 2, 3) + __builtin_shufflevector(v, v, 4, 5, 6, 7);
  const jakiro::vf4 c = b + __builtin_shufflevector(b, b, 2, 3, 0, 1);
  return c[0] + c[1];
}
typedef int32_t vi8 __attribute__((vector_size(8 * sizeof(int32_t))));
inline av aexp(av v) { return vexp_lanes<av, vi8>(v); }
#endif

inline av aload(const float* p) {
  av v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline void astore(float* p, av v) { std::memcpy(p, &v, sizeof(v)); }

// Cached keys and values are float32, or float16 (``half``: half the memory a sequence holds and
// half the bytes each new row reads from a long context); either way the attention's products and
// sums are float32, and every row reads the same values whatever the rows beside it.
using half = c10::Half;
inline av kload(const float* p) { return aload(p); }
inline av kload(const half* p) {
#if defined(__AVX512F__)
  return (av)_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
#elif defined(__F16C__)
  return (av)_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else
  av v;
  for (int i = 0; i < AL; ++i) v[i] = static_cast<float>(p[i]);
  return v;
#endif
}
inline float kvalue(float x) { return x; }
inline float kvalue(half x) { return static_cast<float>(x); }
// a new row's keys or values into the cache (float16: rounded to nearest, ties to even)
inline void kstore(float* to, const float* from, int64_t D) { std::memcpy(to, from, D * sizeof(float)); }
inline void kstore(half* to, const float* from, int64_t D) {
  for (int64_t i = 0; i < D; ++i) to[i] = half(from[i]);
}

// Scores of G query heads q [G][C vectors] against keys k[0..NK): NK chains side by side per
// head, each key vector loaded once for all G heads; out[h][j] for key j
template <int C, int G, int NK, class KT>
inline void dot_heads(const float* q, int64_t D, const KT* const* k, float (*out)[4]) {
  av acc[G][NK];
  for (int h = 0; h < G; ++h)
    for (int j = 0; j < NK; ++j) acc[h][j] = av{};
  for (int i = 0; i < C; ++i) {
    av kv[NK];
    for (int j = 0; j < NK; ++j) kv[j] = kload(k[j] + i * AL);
    for (int h = 0; h < G; ++h) {
      const av qv = aload(q + h * D + i * AL);
      for (int j = 0; j < NK; ++j) acc[h][j] += qv * kv[j];
    }
  }
  for (int h = 0; h < G; ++h) {
#if defined(__AVX512F__)
    if constexpr (NK == 4) {
      const jakiro::vf4 s = hsum4(acc[h][0], acc[h][1], acc[h][2], acc[h][3]);
      for (int j = 0; j < 4; ++j) out[h][j] = s[j];
      continue;
    }
#endif
    for (int j = 0; j < NK; ++j) out[h][j] = ahsum(acc[h][j]);
  }
}

// dot_heads for R rows' query heads (q[r]) against the same keys, each key vector loaded once for
// all rows; each row's sums in dot_heads' order (a key's sum is its own: hsum4 sums each lane
// group as hsum does, so how many keys a pass takes does not change it)
template <int C, int G, int NK, int R, class KT>
inline void dot_heads_rows(const float* const* q, int64_t D, const KT* const* k, float (*out)[G][4]) {
  av acc[R][G][NK];
  for (int r = 0; r < R; ++r)
    for (int h = 0; h < G; ++h)
      for (int j = 0; j < NK; ++j) acc[r][h][j] = av{};
  for (int i = 0; i < C; ++i) {
    av kv[NK];
    for (int j = 0; j < NK; ++j) kv[j] = kload(k[j] + i * AL);
    for (int r = 0; r < R; ++r)
      for (int h = 0; h < G; ++h) {
        const av x = aload(q[r] + h * D + i * AL);
        for (int j = 0; j < NK; ++j) acc[r][h][j] += x * kv[j];
      }
  }
  for (int r = 0; r < R; ++r)
    for (int h = 0; h < G; ++h) {
#if defined(__AVX512F__)
      if constexpr (NK == 4) {
        const jakiro::vf4 t = hsum4(acc[r][h][0], acc[r][h][1], acc[r][h][2], acc[r][h][3]);
        for (int j = 0; j < 4; ++j) out[r][h][j] = t[j];
        continue;
      }
#endif
      for (int j = 0; j < NK; ++j) out[r][h][j] = ahsum(acc[r][h][j]);
    }
}

// softmax of each head's scores in place (s [g][L]); returns 1 / sum per head in inv
inline void softmax_rows(float* scores, int64_t g, int64_t L, float* inv) {
  for (int64_t h = 0; h < g; ++h) {
    float* s = scores + h * L;
    float m = s[0];
    for (int64_t j = 1; j < L; ++j) m = std::max(m, s[j]);
    const av mv = av{} + m;
    av acc = av{};
    int64_t j = 0;
    for (; j + AL <= L; j += AL) {
      const av e = aexp(aload(s + j) - mv);
      astore(s + j, e);
      acc += e;
    }
    float sum = ahsum(acc);
    for (; j < L; ++j) {
      s[j] = sexp(s[j] - m);
      sum += s[j];
    }
    inv[h] = 1.f / sum;
  }
}

// Cached keys and values are read one row after another, a single stream per head, which one
// core reads at a fraction of the rate several streams reach; asking for the rows AHEAD
// positions on keeps more of them in flight
constexpr int64_t AHEAD = 8;
template <class KT>
inline void prefetch_row(const KT* p, int vectors) {
  for (int c = 0; c < vectors * AL; c += 64 / static_cast<int>(sizeof(KT))) __builtin_prefetch(p + c, 0, 3);
}

// Scores of the G query heads q [G][D] sharing one KV head against the keys `vis` from key
// index i0 (a multiple of the keys per pass) on: scores [G][L], scaled.
template <int C, int G, class KT>
void score_keys(const float* q, const KT* K, int64_t ld, const Visible& vis, int64_t D, float scale, float* scores,
                int64_t i0) {
  constexpr int NK = SCORE_KEYS;
  const int64_t P = vis.prefix, L = P + static_cast<int64_t>(vis.extra.size());
  auto key = [&](int64_t i) { return i < P ? i : vis.extra[i - P]; };
  int64_t i = i0;
  float sc[G][4];
  for (; i + NK <= L; i += NK) {
    const KT* k[NK];
    for (int j = 0; j < NK; ++j) k[j] = K + key(i + j) * ld;
    if (i + AHEAD + NK <= P)
      for (int j = 0; j < NK; ++j) prefetch_row(K + (i + AHEAD + j) * ld, C);
    dot_heads<C, G, NK>(q, D, k, sc);
    for (int h = 0; h < G; ++h)
      for (int j = 0; j < NK; ++j) scores[h * L + i + j] = sc[h][j] * scale;
  }
  for (; i < L; ++i) {
    const KT* k = K + key(i) * ld;
    dot_heads<C, G, 1>(q, D, &k, sc);
    for (int h = 0; h < G; ++h) scores[h * L + i] = sc[h][0] * scale;
  }
}

// acc [G][CH] += the G heads' softmax weights (scores [G][L]) times value chunks c0..c0+CH-1 of
// the keys `vis` from key index t0 on, one key after another
template <int G, int CH, class KT>
inline void add_values(const KT* V, int64_t ld, const Visible& vis, const float* scores, int64_t c0, int64_t t0,
                       av (*acc)[CH]) {
  const int64_t P = vis.prefix, L = P + static_cast<int64_t>(vis.extra.size());
  for (int64_t t = t0; t < L; ++t) {
    const int64_t key = t < P ? t : vis.extra[t - P];
    const KT* v = V + key * ld + c0 * AL;
    if (t + AHEAD < P) prefetch_row(V + (t + AHEAD) * ld + c0 * AL, CH);
    av vv[CH];
    for (int c = 0; c < CH; ++c) vv[c] = kload(v + c * AL);
    for (int h = 0; h < G; ++h) {
      const av p = av{} + scores[h * L + t];
      for (int c = 0; c < CH; ++c) acc[h][c] += p * vv[c];
    }
  }
}

// The G query heads q [G][D] sharing one KV head attend the keys `vis`: out [G][D], D = AL C.
// Keys and values are read once per pass for all G heads (attend_any runs other group sizes one
// head at a time). scores: scratch of G * (number of keys) floats.
template <int C, int G, class KT>
void attend_heads(const float* q, const KT* K, const KT* V, int64_t ld, const Visible& vis, int64_t D,
                  float scale, float* out, float* scores) {
  constexpr int CH = value_chunks<C, G>();
  static_assert(C % CH == 0, "value chunks must divide the head");
  const int64_t L = vis.prefix + static_cast<int64_t>(vis.extra.size());
  score_keys<C, G>(q, K, ld, vis, D, scale, scores, 0);
  float inv[G];
  softmax_rows(scores, G, L, inv);
  for (int c0 = 0; c0 < C; c0 += CH) {
    av acc[G][CH];
    for (int h = 0; h < G; ++h)
      for (int c = 0; c < CH; ++c) acc[h][c] = av{};
    add_values<G, CH>(V, ld, vis, scores, c0, 0, acc);
    for (int h = 0; h < G; ++h)
      for (int c = 0; c < CH; ++c) astore(out + h * D + (c0 + c) * AL, acc[h][c] * inv[h]);
  }
}

// Registers for R rows' G heads: keys scored per pass and value chunks summed per pass such that
// the sums (R G of them per key or chunk), the keys or chunks and a query fit in the 32 (AVX-512)
// or 16 (AVX2) vector registers
template <int C, int G, int R>
constexpr int rows_keys() { return R * G * SCORE_KEYS + SCORE_KEYS + 1 <= 2 * AL ? SCORE_KEYS : SCORE_KEYS / 2; }
template <int C, int G, int R>
constexpr int rows_chunks() {
  int ch = value_chunks<C, G>();
  while (ch > 1 && (C % ch || R * G * ch + ch + 1 > 2 * AL)) --ch;
  return ch;
}

// R rows' G query heads (q[r] [G][D]) attend their keys vis[r] in the same cache, as attend_heads
// does each: the keys they all visit first (the shortest prefix) are read once for all rows, in
// the same passes, so a verification tree's rows read a long context's keys and values once per
// R rows. Every row's sums take the same operations in the same order as attend_heads gives it
// alone (each score lane group and each lane of a value chunk sums over its keys in order, however
// many keys or chunks a pass takes), so the results are bitwise the same.
template <int C, int G, int R, class KT>
void attend_rows(const float* const* q, const KT* K, const KT* V, int64_t ld, const Visible* const* vis,
                 int64_t D, float scale, float* const* out, float* const* sc) {
  constexpr int NK = rows_keys<C, G, R>(), CH = rows_chunks<C, G, R>();
  static_assert(NK >= 1 && CH >= 1, "registers");
  int64_t P = vis[0]->prefix, L[R];
  for (int r = 0; r < R; ++r) {
    P = std::min(P, vis[r]->prefix);
    L[r] = vis[r]->prefix + static_cast<int64_t>(vis[r]->extra.size());
  }
  // scores of the shared keys in whole passes, then each row's rest as attend_heads scores them
  const int64_t shared = P / SCORE_KEYS * SCORE_KEYS;
  for (int64_t i = 0; i + NK <= shared; i += NK) {
    const KT* k[NK];
    for (int j = 0; j < NK; ++j) k[j] = K + (i + j) * ld;
    if (i + AHEAD + NK <= P)
      for (int j = 0; j < NK; ++j) prefetch_row(K + (i + AHEAD + j) * ld, C);
    float part[R][G][4];
    dot_heads_rows<C, G, NK, R>(q, D, k, part);
    for (int r = 0; r < R; ++r)
      for (int h = 0; h < G; ++h)
        for (int j = 0; j < NK; ++j) sc[r][h * L[r] + i + j] = part[r][h][j] * scale;
  }
  float inv[R][G];
  for (int r = 0; r < R; ++r) {
    score_keys<C, G>(q[r], K, ld, *vis[r], D, scale, sc[r], shared);
    softmax_rows(sc[r], G, L[r], inv[r]);
  }
  for (int c0 = 0; c0 < C; c0 += CH) {
    av acc[R][G][CH];
    for (int r = 0; r < R; ++r)
      for (int h = 0; h < G; ++h)
        for (int c = 0; c < CH; ++c) acc[r][h][c] = av{};
    for (int64_t t = 0; t < P; ++t) {
      const KT* v = V + t * ld + c0 * AL;
      if (t + AHEAD < P) prefetch_row(V + (t + AHEAD) * ld + c0 * AL, CH);
      av vv[CH];
      for (int c = 0; c < CH; ++c) vv[c] = kload(v + c * AL);
      for (int r = 0; r < R; ++r)
        for (int h = 0; h < G; ++h) {
          const av p = av{} + sc[r][h * L[r] + t];
          for (int c = 0; c < CH; ++c) acc[r][h][c] += p * vv[c];
        }
    }
    for (int r = 0; r < R; ++r) {
      add_values<G, CH>(V, ld, *vis[r], sc[r], c0, P, acc[r]);
      for (int h = 0; h < G; ++h)
        for (int c = 0; c < CH; ++c) astore(out[r] + h * D + (c0 + c) * AL, acc[r][h][c] * inv[r][h]);
    }
  }
}

// One query head q [D] attends the keys `vis`, for a head size that is not a multiple of the lanes
template <class KT>
void attend_scalar(const float* q, const KT* K, const KT* V, int64_t ld, const Visible& vis, int64_t D,
                   float scale, float* out, float* scores) {
  const int64_t P = vis.prefix, L = P + static_cast<int64_t>(vis.extra.size());
  auto key = [&](int64_t i) { return i < P ? i : vis.extra[i - P]; };
  for (int64_t i = 0; i < L; ++i) {
    const KT* k = K + key(i) * ld;
    float s = 0.f;
    if constexpr (std::is_same_v<KT, float>) {
      s = dot(q, k, D);
    } else {
      for (int64_t c = 0; c < D; ++c) s += q[c] * kvalue(k[c]);
    }
    scores[i] = s * scale;
  }
  float inv;
  softmax_rows(scores, 1, L, &inv);
  std::fill(out, out + D, 0.f);
  for (int64_t t = 0; t < L; ++t) {
    const KT* v = V + key(t) * ld;
    const float p = scores[t];
    for (int64_t c = 0; c < D; ++c) out[c] += p * kvalue(v[c]);
  }
  for (int64_t c = 0; c < D; ++c) out[c] *= inv;
}

// the g query heads of a KV head one at a time (scores [g][keys] as for attend_heads)
template <int C, class KT>
void attend_each(const float* q, int64_t g, const KT* K, const KT* V, int64_t ld, const Visible& vis,
                 int64_t D, float scale, float* out, float* scores) {
  const int64_t L = vis.prefix + static_cast<int64_t>(vis.extra.size());
  for (int64_t h = 0; h < g; ++h) {
    if constexpr (C > 0)
      attend_heads<C, 1>(q + h * D, K, V, ld, vis, D, scale, out + h * D, scores + h * L);
    else
      attend_scalar(q + h * D, K, V, ld, vis, D, scale, out + h * D, scores + h * L);
  }
}

template <class KT>
void attend_any(const float* q, int64_t g, const KT* K, const KT* V, int64_t ld, const Visible& vis, int64_t D,
                float scale, float* out, float* scores) {
  if (D == 64 && g == 3) return attend_heads<64 / AL, 3>(q, K, V, ld, vis, D, scale, out, scores);
  if (D == 64 && g == 4) return attend_heads<64 / AL, 4>(q, K, V, ld, vis, D, scale, out, scores);
  if (D == 128 && g == 2) return attend_heads<128 / AL, 2>(q, K, V, ld, vis, D, scale, out, scores);
  switch (D) {
    case 64: attend_each<64 / AL>(q, g, K, V, ld, vis, D, scale, out, scores); break;
    case 128: attend_each<128 / AL>(q, g, K, V, ld, vis, D, scale, out, scores); break;
    case 32: attend_each<32 / AL>(q, g, K, V, ld, vis, D, scale, out, scores); break;
    default: attend_each<0>(q, g, K, V, ld, vis, D, scale, out, scores); break;
  }
}

// R (1 to ROW_GROUP) rows' query heads of one KV head (see attend_rows) where the kernels take
// them at once; false for other head layouts (the caller runs attend_any on each row)
constexpr int64_t ROW_GROUP = 4;
template <int R, class KT>
bool attend_group_of(const float* const* q, int64_t g, const KT* K, const KT* V, int64_t ld,
                     const Visible* const* vis, int64_t D, float scale, float* const* out, float* const* sc) {
  if (D == 64 && g == 3) return attend_rows<64 / AL, 3, R>(q, K, V, ld, vis, D, scale, out, sc), true;
  if (D == 64 && g == 2) return attend_rows<64 / AL, 2, R>(q, K, V, ld, vis, D, scale, out, sc), true;
  if (D == 128 && g == 2) return attend_rows<128 / AL, 2, R>(q, K, V, ld, vis, D, scale, out, sc), true;
  return false;
}

template <class KT>
bool attend_group(int64_t rows, const float* const* q, int64_t g, const KT* K, const KT* V, int64_t ld,
                  const Visible* const* vis, int64_t D, float scale, float* const* out, float* const* sc) {
  switch (rows) {
    case 2: return attend_group_of<2>(q, g, K, V, ld, vis, D, scale, out, sc);
    case 3: return attend_group_of<3>(q, g, K, V, ld, vis, D, scale, out, sc);
    case 4: return attend_group_of<4>(q, g, K, V, ld, vis, D, scale, out, sc);
    default: return false;
  }
}

inline vf silu_times(vf g, vf u) { return g / (1.f + vexp(-g)) * u; }

struct Shape {
  int64_t n, d, H, Hkv, D, inter;
  float eps, scale;
  int64_t qkv() const { return (H + 2 * Hkv) * D; }
};

// a layer's q/k/v or gate/up projection: one weight over all its outputs, or (where a file holds
// them in different block types) two or three weights whose outputs follow one another
struct Stacked {
  const at::Tensor* part[3] = {nullptr, nullptr, nullptr};
  int64_t rows[3] = {0, 0, 0};
  int count = 0;
};

Stacked single(const at::Tensor* w, int64_t rows) {
  Stacked s;
  s.part[0] = w;
  s.rows[0] = rows;
  s.count = 1;
  return s;
}

// y [M, N] = x @ W^T (+ bias) for a stacked weight (each part's rows into its columns of y)
void apply_stacked(const Stacked& w, int64_t N, const float* bias, const float* x, int64_t M, int64_t K, float* y,
                   int64_t input_bytes) {
  if (w.count == 1) return jakiro::apply_linear(*w.part[0], N, bias, x, M, K, y, input_bytes);
  std::vector<float> part;
  int64_t col = 0;
  for (int p = 0; p < w.count; ++p) {
    const int64_t rows = w.rows[p];
    part.resize(M * rows);
    jakiro::apply_linear(*w.part[p], rows, nullptr, x, M, K, part.data(), input_bytes);
    for (int64_t r = 0; r < M; ++r) std::memcpy(y + r * N + col, part.data() + r * rows, rows * sizeof(float));
    col += rows;
  }
  if (bias)
    for (int64_t r = 0; r < M; ++r)
      for (int64_t j = 0; j < N; ++j) y[r * N + j] += bias[j];
}

struct AttentionWeights {
  const float* norm;
  Stacked qkv;
  const float* qkv_bias;
  const at::Tensor* o;
  const float* q_norm;  // per-head norms of Qwen3, else null
  const float* k_norm;
};

// one layer's keys and values: [Hkv][max_len][D] each, float32 or float16 (`half`), heads
// `head_stride` entries apart
struct LayerCache {
  void* k;
  void* v;
  bool half;
  int64_t head_stride, row_stride;
  // independent sequences (batched decoding): row r has its own cache, batch_stride entries after
  // row r - 1's, and its new entry goes at position at[r]; else all rows share one cache and
  // row r goes at past + r
  int64_t batch_stride = 0;
  const int64_t* at = nullptr;
  // with several rows per sequence (verifying a batch of trees), row r's sequence is seq[r]
  const int64_t* seq = nullptr;
  template <class KT>
  KT* k_of(int64_t r) const { return static_cast<KT*>(k) + (seq ? seq[r] : r) * batch_stride; }
  template <class KT>
  KT* v_of(int64_t r) const { return static_cast<KT*>(v) + (seq ? seq[r] : r) * batch_stride; }
  int64_t position(int64_t r, int64_t past) const { return at ? at[r] : past + r; }
  // whether rows a and b read the same keys and values (one shared cache, or one sequence's)
  bool same_sequence(int64_t a, int64_t b) const { return batch_stride == 0 || (seq ? seq[a] == seq[b] : a == b); }
};

struct Scratch {
  float *h, *qkv, *o, *y, *scores;
  int64_t keys;  // the most keys a row attends
};

// attention stays on the calling thread below this many multiply-adds (measured on the
// development CPU at a 256-token context: raised to 2^20, forwards over 2 to 6 tokens ran
// 0.7-2.3 ms slower, one token no faster)
constexpr int64_t PARALLEL_WORK = int64_t(1) << 16;

// the rows' new keys and values (rotated, in s.qkv) into the cache, then each row's attention
// over what vis[r] names into s.o
template <class KT>
void store_and_attend(const Shape& S, const LayerCache& c, int64_t past, const std::vector<Visible>& vis,
                      const Scratch& s) {
  const int64_t n = S.n, H = S.H, Hkv = S.Hkv, D = S.D, NQKV = S.qkv(), g = H / Hkv;
  for (int64_t r = 0; r < n; ++r) {
    const float* row = s.qkv + r * NQKV;
    const int64_t p = c.position(r, past);
    for (int64_t j = 0; j < Hkv; ++j) {
      kstore(c.k_of<KT>(r) + j * c.head_stride + p * c.row_stride, row + (H + j) * D, D);
      kstore(c.v_of<KT>(r) + j * c.head_stride + p * c.row_stride, row + (H + Hkv + j) * D, D);
    }
  }
  // one task per (group of up to ROW_GROUP consecutive rows of one sequence, KV head), each row's g
  // query heads consecutive in q: rows that share a cache read the keys and values they all visit
  // once (attend_group), a batch's trees each theirs, not once per row
  std::vector<int64_t> starts;
  for (int64_t r = 0; r < n; ++r)
    if (starts.empty() || r - starts.back() == ROW_GROUP || !c.same_sequence(r, starts.back())) starts.push_back(r);
  starts.push_back(n);
  const int64_t groups = static_cast<int64_t>(starts.size()) - 1;
  const int64_t work = n * H * s.keys * D, ld = g * s.keys;
  auto attend_row = [&](int64_t r, int64_t j) {
    attend_any(s.qkv + r * NQKV + j * g * D, g, c.k_of<KT>(r) + j * c.head_stride, c.v_of<KT>(r) + j * c.head_stride,
               c.row_stride, vis[r], D, S.scale, s.o + r * H * D + j * g * D, s.scores + (r * Hkv + j) * ld);
  };
  at::parallel_for(0, groups * Hkv, work >= PARALLEL_WORK ? 1 : groups * Hkv, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t r0 = starts[t / Hkv], j = t % Hkv, rows = starts[t / Hkv + 1] - r0;
      const float* q[ROW_GROUP];
      const Visible* v[ROW_GROUP];
      float *o[ROW_GROUP], *sc[ROW_GROUP];
      for (int64_t r = 0; r < rows; ++r) {
        q[r] = s.qkv + (r0 + r) * NQKV + j * g * D;
        v[r] = &vis[r0 + r];
        o[r] = s.o + (r0 + r) * H * D + j * g * D;
        sc[r] = s.scores + ((r0 + r) * Hkv + j) * ld;
      }
      if (rows == 1 || !attend_group(rows, q, g, c.k_of<KT>(r0) + j * c.head_stride, c.v_of<KT>(r0) + j * c.head_stride,
                                     c.row_stride, v, D, S.scale, o, sc))
        for (int64_t r = 0; r < rows; ++r) attend_row(r0 + r, j);
    }
  });
}

// x [n, d] += o(attention(rmsnorm(x))), writing the new keys and values at past..past+n-1
void attention_block(float* x, const Shape& S, const AttentionWeights& w, const LayerCache& c, int64_t past,
                     const float* cos, const float* sin, const std::vector<Visible>& vis, const Scratch& s,
                     int64_t input_bytes = 3) {
  const int64_t n = S.n, d = S.d, H = S.H, Hkv = S.Hkv, D = S.D, NQKV = S.qkv();
  for (int64_t r = 0; r < n; ++r) rmsnorm(x + r * d, w.norm, s.h + r * d, d, S.eps);
  apply_stacked(w.qkv, NQKV, w.qkv_bias, s.h, n, d, s.qkv, input_bytes);
  for (int64_t r = 0; r < n; ++r) {
    float* row = s.qkv + r * NQKV;
    for (int64_t a = 0; a < H + Hkv; ++a) {
      float* v = row + a * D;
      const float* nw = a < H ? w.q_norm : w.k_norm;
      if (nw) {
        float tmp[1024];
        rmsnorm(v, nw, tmp, D, S.eps);
        std::memcpy(v, tmp, D * sizeof(float));
      }
      rope(v, cos + r * D, sin + r * D, D);
    }
  }
  if (c.half)
    store_and_attend<half>(S, c, past, vis, s);
  else
    store_and_attend<float>(S, c, past, vis, s);
  jakiro::apply_linear(*w.o, d, nullptr, s.o, n, H * D, s.y, input_bytes);
  for (int64_t i = 0; i < n * d; ++i) x[i] += s.y[i];
}

// x [n, d] += down(silu(gate) * up) of rmsnorm(x); gu [n, 2 inter], act [n, inter] scratch
void mlp_block(float* x, const Shape& S, const float* norm, const Stacked& gate_up, const at::Tensor& down,
               float* y, float* gu, float* act, int64_t input_bytes = 3) {
  const int64_t n = S.n, d = S.d, I = S.inter;
  for (int64_t r = 0; r < n; ++r) rmsnorm(x + r * d, norm, y + r * d, d, S.eps);
  apply_stacked(gate_up, 2 * I, nullptr, y, n, d, gu, input_bytes);
  for (int64_t r = 0; r < n; ++r) {
    const float* gate = gu + r * 2 * I;
    const float* up = gate + I;
    float* a = act + r * I;
    int64_t i = 0;
    for (; i + VL <= I; i += VL) store(a + i, silu_times(load(gate + i), load(up + i)));
    for (; i < I; ++i) a[i] = gate[i] / (1.f + sexp(-gate[i])) * up[i];
  }
  jakiro::apply_linear(down, d, nullptr, act, n, I, y, input_bytes);
  for (int64_t i = 0; i < n * d; ++i) x[i] += y[i];
}

// weights per layer in decoder_layers' list: input norm, post-attention norm, q/k/v (or q), its
// bias, o, gate/up (or gate), down, q norm, k norm, then k, v and up where stored apart
constexpr int64_t SLOTS = 12;

const float* optional_data(const c10::optional<at::Tensor>& t) {
  return t.has_value() && t->defined() ? t->data_ptr<float>() : nullptr;
}

bool cache_dtype(const at::Tensor& kv) { return kv.scalar_type() == at::kFloat || kv.scalar_type() == at::kHalf; }

void check_cache(const at::Tensor& kv, int64_t layers, int64_t Hkv, int64_t past, int64_t n) {
  TORCH_CHECK(kv.dim() == 6 && cache_dtype(kv) && kv.size(0) == layers && kv.size(2) == 1 &&
                  kv.size(3) == Hkv && kv.stride(5) == 1 && kv.stride(4) == kv.size(5) && kv.size(5) % 2 == 0 &&
                  kv.size(5) <= 1024,
              "the KV cache does not match the model");
  TORCH_CHECK(past >= 0 && past + n <= kv.size(4), "KV cache overflow");
}

void check_rope(const at::Tensor& cos, const at::Tensor& sin, int64_t n, int64_t D) {
  TORCH_CHECK(cos.dim() == 2 && cos.size(0) == n && cos.size(1) == D && cos.is_contiguous() &&
                  sin.sizes() == cos.sizes() && sin.is_contiguous() && cos.scalar_type() == at::kFloat &&
                  sin.scalar_type() == at::kFloat,
              "cos/sin must be [n, head_dim] float32");
}

LayerCache layer_cache(const at::Tensor& kv, int64_t layer) {
  const int64_t size = kv.element_size();
  char* k = static_cast<char*>(kv.data_ptr()) + layer * kv.stride(0) * size;
  return {k, k + kv.stride(1) * size, kv.scalar_type() == at::kHalf, kv.stride(3), kv.stride(4)};
}

// The layers' weights as decoder_layers takes them (nine per layer), checked against the shapes;
// fills S.inter
bool present(const c10::optional<at::Tensor>& t) { return t.has_value() && t->defined(); }

// a projection from slot `first` and those of `rest` that are present (stored apart: k and v,
// or up; each `rest_rows` rows, the first part the rest of N), checked against the kernels
Stacked stacked(const c10::optional<at::Tensor>* w, int64_t first, std::initializer_list<int64_t> rest, int64_t N,
                int64_t rest_rows, int64_t K, int64_t layer) {
  Stacked s;
  s.part[0] = &*w[first];
  s.rows[0] = N;
  s.count = 1;
  for (int64_t slot : rest) {
    if (!present(w[slot])) continue;
    s.part[s.count] = &*w[slot];
    s.rows[s.count++] = rest_rows;
    s.rows[0] -= rest_rows;
  }
  for (int p = 0; p < s.count; ++p)
    TORCH_CHECK(s.rows[p] > 0 && jakiro::valid_linear(*s.part[p], s.rows[p], K), "decoder_layers: layer ", layer,
                " has a weight the kernels cannot take");
  return s;
}

// The layers' weights as decoder_layers takes them (SLOTS per layer), checked against the shapes;
// fills S.inter, and each layer's gate/up into `gate_up`
std::vector<AttentionWeights> layer_weights(const std::vector<c10::optional<at::Tensor>>& weights,
                                            at::IntArrayRef out_features, Shape& S, std::vector<Stacked>& gate_up) {
  const int64_t layers = static_cast<int64_t>(weights.size()) / SLOTS, d = S.d;
  TORCH_CHECK(layers * SLOTS == static_cast<int64_t>(weights.size()) &&
                  static_cast<int64_t>(out_features.size()) == 4 * layers,
              "decoder_layers: 12 weights and 4 output sizes per layer");
  std::vector<AttentionWeights> attn(layers);
  gate_up.resize(layers);
  for (int64_t l = 0; l < layers; ++l) {
    const auto* w = &weights[l * SLOTS];
    for (int64_t s : {0, 1, 2, 4, 5, 6})
      TORCH_CHECK(present(w[s]), "decoder_layers: layer ", l, " lacks weight ", s);
    const int64_t* N = &out_features[l * 4];
    TORCH_CHECK(N[0] == S.qkv() && N[1] == d && N[3] == d && N[2] % 2 == 0 && (l == 0 || N[2] / 2 == S.inter),
                "decoder_layers: layer ", l, " shapes");
    S.inter = N[2] / 2;
    TORCH_CHECK(jakiro::valid_linear(*w[4], N[1], S.H * S.D) && jakiro::valid_linear(*w[6], N[3], S.inter),
                "decoder_layers: layer ", l, " has a weight the kernels cannot take");
    attn[l] = {w[0]->data_ptr<float>(), stacked(w, 2, {9, 10}, N[0], S.Hkv * S.D, d, l), optional_data(w[3]), &*w[4],
               optional_data(w[7]), optional_data(w[8])};
    gate_up[l] = stacked(w, 5, {11}, N[2], S.inter, d, l);
  }
  return attn;
}

// x [n, d] through every layer; row r attends what vis[r] names in cache(l, r)
// The layers over x [n, d]; with ``keep_after`` (increasing layer counts), [n, 1 + A, d]: the last
// residual stream, then the stream after each of those layers.
at::Tensor run_layers(at::Tensor x, const std::vector<c10::optional<at::Tensor>>& weights, Shape S,
                      const std::vector<AttentionWeights>& attn, const std::vector<Stacked>& gate_up, const std::vector<LayerCache>& caches, int64_t past,
                      const at::Tensor& cos, const at::Tensor& sin, const std::vector<Visible>& vis, int64_t keys,
                      at::IntArrayRef keep_after, int64_t input_bytes) {
  const int64_t n = S.n, d = S.d, H = S.H, Hkv = S.Hkv, A = static_cast<int64_t>(keep_after.size());
  for (int64_t j = 0; j < A; ++j)
    TORCH_CHECK(keep_after[j] >= 1 && keep_after[j] < static_cast<int64_t>(attn.size()) &&
                    (j == 0 || keep_after[j] > keep_after[j - 1]),
                "decoder_layers: keep_after must be increasing layer counts below the number of layers");
  at::Tensor streams = A ? at::empty({n, 1 + A, d}, x.options()) : at::Tensor();
  auto opts = x.options();
  auto h = at::empty({n, d}, opts), ob = at::empty({n, H * S.D}, opts), qkv = at::empty({n, S.qkv()}, opts);
  auto y = at::empty({n, d}, opts), gu = at::empty({n, 2 * S.inter}, opts), act = at::empty({n, S.inter}, opts);
  auto scores = at::empty({n * Hkv, (H / Hkv) * keys}, opts);
  const Scratch scratch{h.data_ptr<float>(), qkv.data_ptr<float>(), ob.data_ptr<float>(), y.data_ptr<float>(),
                        scores.data_ptr<float>(), keys};
  float* xp = x.data_ptr<float>();
  for (size_t l = 0; l < attn.size(); ++l) {
    const auto* w = &weights[l * SLOTS];
    attention_block(xp, S, attn[l], caches[l], past, cos.data_ptr<float>(), sin.data_ptr<float>(), vis, scratch,
                    input_bytes);
    mlp_block(xp, S, w[1]->data_ptr<float>(), gate_up[l], *w[6], scratch.y, gu.data_ptr<float>(), act.data_ptr<float>(),
              input_bytes);
    for (int64_t j = 0; j < A; ++j)
      if (keep_after[j] == static_cast<int64_t>(l) + 1) streams.select(1, 1 + j).copy_(x);
  }
  if (!A) return x;
  streams.select(1, 0).copy_(x);
  return streams;
}

at::Tensor decoder_layers(const at::Tensor& x_in, const std::vector<c10::optional<at::Tensor>>& weights,
                          at::IntArrayRef out_features, const at::Tensor& kv, int64_t past, const at::Tensor& cos,
                          const at::Tensor& sin, const c10::optional<at::Tensor>& tree_mask, int64_t H, int64_t Hkv,
                          double eps, double scale, at::IntArrayRef keep_after, int64_t input_bytes) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kFloat, "decoder_layers: x must be [n, d] float32");
  auto x = x_in.contiguous().clone();
  const int64_t n = x.size(0), d = x.size(1), layers = static_cast<int64_t>(weights.size()) / SLOTS;
  TORCH_CHECK(Hkv > 0 && H % Hkv == 0, "decoder_layers: head layout");
  check_cache(kv, layers, Hkv, past, n);
  Shape S{n, d, H, Hkv, kv.size(5), 0, static_cast<float>(eps), static_cast<float>(scale)};
  check_rope(cos, sin, n, S.D);
  std::vector<Stacked> gate_up;
  const auto attn = layer_weights(weights, out_features, S, gate_up);
  std::vector<LayerCache> caches;
  for (int64_t l = 0; l < layers; ++l) caches.push_back(layer_cache(kv, l));
  return run_layers(x, weights, S, attn, gate_up, caches, past, cos, sin, visibility(tree_mask, n, past, false), past + n,
                    keep_after, input_bytes);
}

// The stack over rows of independent sequences: row r belongs to sequence seq[r] (or r),
// whose keys and values are kv[:, :, seq[r]] ([layers, 2, B, Hkv, max_len, D]); its entry goes
// at position at[r] and it attends what vis[r] names there.
at::Tensor run_sequences(const at::Tensor& x_in, const std::vector<c10::optional<at::Tensor>>& weights,
                         at::IntArrayRef out_features, const at::Tensor& kv, const int64_t* seq, const int64_t* at_pos,
                         const std::vector<Visible>& vis, const at::Tensor& cos, const at::Tensor& sin, int64_t H,
                         int64_t Hkv, double eps, double scale, at::IntArrayRef keep_after, int64_t input_bytes,
                         const char* op) {
  auto x = x_in.contiguous().clone();
  const int64_t n = x.size(0), d = x.size(1), layers = static_cast<int64_t>(weights.size()) / SLOTS;
  TORCH_CHECK(Hkv > 0 && H % Hkv == 0, op, ": head layout");
  TORCH_CHECK(kv.dim() == 6 && cache_dtype(kv) && kv.size(0) == layers && kv.size(3) == Hkv &&
                  kv.stride(5) == 1 && kv.stride(4) == kv.size(5) && kv.size(5) % 2 == 0 && kv.size(5) <= 1024,
              op, ": the KV cache does not match the model");
  int64_t keys = 1;
  for (int64_t r = 0; r < n; ++r) {
    TORCH_CHECK(at_pos[r] >= 0 && at_pos[r] < kv.size(4), "KV cache overflow: a sequence is full");
    TORCH_CHECK(!seq || (seq[r] >= 0 && seq[r] < kv.size(2)), op, ": a row names a sequence the cache lacks");
    keys = std::max(keys, vis[r].prefix + static_cast<int64_t>(vis[r].extra.size()));
  }
  Shape S{n, d, H, Hkv, kv.size(5), 0, static_cast<float>(eps), static_cast<float>(scale)};
  check_rope(cos, sin, n, S.D);
  std::vector<Stacked> gate_up;
  const auto attn = layer_weights(weights, out_features, S, gate_up);
  std::vector<LayerCache> caches;
  for (int64_t l = 0; l < layers; ++l) {
    LayerCache c = layer_cache(kv, l);
    c.batch_stride = kv.stride(2);
    c.at = at_pos;
    c.seq = seq;
    caches.push_back(c);
  }
  return run_layers(x, weights, S, attn, gate_up, caches, 0, cos, sin, vis, keys, keep_after, input_bytes);
}

// One new token for each of B independent sequences (batched decoding): x [B, d]; sequence r's
// token goes at position lengths[r] and attends positions 0..lengths[r], in order, as
// ``decoder_layers`` would decode it alone.
at::Tensor decoder_layers_batch(const at::Tensor& x_in, const std::vector<c10::optional<at::Tensor>>& weights,
                                at::IntArrayRef out_features, const at::Tensor& kv, const at::Tensor& lengths,
                                const at::Tensor& cos, const at::Tensor& sin, int64_t H, int64_t Hkv, double eps,
                                double scale, at::IntArrayRef keep_after, int64_t input_bytes) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kFloat, "decoder_layers_batch: x must be [B, d] float32");
  const int64_t n = x_in.size(0);
  TORCH_CHECK(kv.dim() == 6 && kv.size(2) == n, "decoder_layers_batch: the KV cache does not match the batch");
  TORCH_CHECK(lengths.dim() == 1 && lengths.size(0) == n && lengths.scalar_type() == at::kLong &&
                  lengths.is_contiguous(),
              "decoder_layers_batch: lengths must be [B] int64");
  const int64_t* at_pos = lengths.data_ptr<int64_t>();
  std::vector<Visible> vis(n);
  for (int64_t r = 0; r < n; ++r) vis[r].prefix = at_pos[r] + 1;
  return run_sequences(x_in, weights, out_features, kv, nullptr, at_pos, vis, cos, sin, H, Hkv, eps, scale, keep_after,
                       input_bytes, "decoder_layers_batch");
}

// Several sequences' draft trees verified in one pass: x [N, d], row r of sequence seq[r] written
// at position at[r], attending its sequence's first prefix[r] positions and then the positions
// at[c] of the rows c with mask[r, c] (rows of one sequence in increasing at; mask [N, N] only
// within a sequence), in that order: as ``decoder_layers`` verifies each tree alone.
at::Tensor decoder_layers_ragged(const at::Tensor& x_in, const std::vector<c10::optional<at::Tensor>>& weights,
                                 at::IntArrayRef out_features, const at::Tensor& kv, const at::Tensor& seq,
                                 const at::Tensor& at_pos, const at::Tensor& prefix, const at::Tensor& mask,
                                 const at::Tensor& cos, const at::Tensor& sin, int64_t H, int64_t Hkv, double eps,
                                 double scale, at::IntArrayRef keep_after, int64_t input_bytes) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kFloat, "decoder_layers_ragged: x must be [N, d] float32");
  const int64_t n = x_in.size(0);
  for (const at::Tensor* t : {&seq, &at_pos, &prefix})
    TORCH_CHECK(t->dim() == 1 && t->size(0) == n && t->scalar_type() == at::kLong && t->is_contiguous(),
                "decoder_layers_ragged: seq, at and prefix must be [N] int64");
  const auto m = mask.to(at::kBool).contiguous();
  TORCH_CHECK(m.dim() == 2 && m.size(0) == n && m.size(1) == n, "decoder_layers_ragged: mask must be [N, N]");
  const int64_t *sq = seq.data_ptr<int64_t>(), *ap = at_pos.data_ptr<int64_t>(), *pf = prefix.data_ptr<int64_t>();
  const bool* mp = m.data_ptr<bool>();
  std::vector<Visible> vis(n);
  for (int64_t r = 0; r < n; ++r) {
    TORCH_CHECK(pf[r] >= 0 && pf[r] <= ap[r] && mp[r * n + r], "decoder_layers_ragged: row ", r,
                " must see itself, after its prefix");
    vis[r].prefix = pf[r];
    int64_t last = pf[r] - 1;
    for (int64_t c = 0; c < n; ++c) {
      if (!mp[r * n + c]) continue;
      TORCH_CHECK(sq[c] == sq[r] && ap[c] > last, "decoder_layers_ragged: row ", r,
                  " may see only rows of its own sequence after its prefix, in increasing position");
      vis[r].extra.push_back(ap[c]);
      last = ap[c];
    }
  }
  return run_sequences(x_in, weights, out_features, kv, sq, ap, vis, cos, sin, H, Hkv, eps, scale, keep_after,
                       input_bytes, "decoder_layers_ragged");
}

// A draft's fusion layer and attention block (EAGLE's fc over [embedding, feature], then a
// decoder layer's attention half) for the rows of one draft step: r [n, d]. ``mask`` [n, past + n]
// says which cache entries each row sees (the committed context and its tree ancestors).
at::Tensor draft_attend(const at::Tensor& features, const at::Tensor& tokens, const at::Tensor& embed,
                        const at::Tensor& fc, const c10::optional<at::Tensor>& fc_bias, const at::Tensor& norm,
                        const at::Tensor& qkv, const at::Tensor& o, const at::Tensor& kv, int64_t past,
                        const at::Tensor& cos_table, const at::Tensor& sin_table, const at::Tensor& positions,
                        const c10::optional<at::Tensor>& mask, int64_t H, int64_t Hkv, double eps, double scale,
                        int64_t input_bytes) {
  const int64_t d = norm.numel();
  TORCH_CHECK(features.dim() == 2 && features.size(1) == d && features.scalar_type() == at::kFloat,
              "draft_attend: features must be [n, d] float32");
  const int64_t n = features.size(0);
  TORCH_CHECK(tokens.dim() == 1 && tokens.size(0) == n && tokens.scalar_type() == at::kLong &&
                  positions.dim() == 1 && positions.size(0) == n && positions.scalar_type() == at::kLong,
              "draft_attend: tokens and positions must be [n] int64");
  TORCH_CHECK(jakiro::valid_rows(embed) && jakiro::row_width(embed) == d,
              "draft_attend: embed must be [V, d] float rows or GGUF blocks of rows of d values");
  TORCH_CHECK(Hkv > 0 && H % Hkv == 0, "draft_attend: head layout");
  check_cache(kv, 1, Hkv, past, n);
  Shape S{n, d, H, Hkv, kv.size(5), 0, static_cast<float>(eps), static_cast<float>(scale)};
  TORCH_CHECK(cos_table.dim() == 2 && cos_table.size(1) == S.D && cos_table.is_contiguous() &&
                  sin_table.sizes() == cos_table.sizes() && sin_table.is_contiguous() &&
                  cos_table.scalar_type() == at::kFloat && sin_table.scalar_type() == at::kFloat,
              "draft_attend: cos/sin tables must be [positions, head_dim] float32");
  const float* bias = optional_data(fc_bias);
  TORCH_CHECK(jakiro::valid_linear(fc, d, 2 * d) && jakiro::valid_linear(qkv, S.qkv(), d) &&
                  jakiro::valid_linear(o, d, H * S.D) && (!bias || fc_bias->numel() == d),
              "draft_attend: a weight the kernels cannot take");
  // the fusion layer's input: [embedding of the next token, feature] per row, and each row's
  // rotary angles, gathered here rather than by three tensor operations of the caller
  auto opts = features.options();
  auto xin = at::empty({n, 2 * d}, opts), cos = at::empty({n, S.D}, opts), sin = at::empty({n, S.D}, opts);
  const auto fin = features.contiguous();
  const auto tok = tokens.contiguous(), pos = positions.contiguous();
  for (int64_t r = 0; r < n; ++r) {
    const int64_t t = tok.data_ptr<int64_t>()[r], p = pos.data_ptr<int64_t>()[r];
    TORCH_CHECK(t >= 0 && t < embed.size(0), "draft_attend: token id ", t, " outside the embedding");
    TORCH_CHECK(p >= 0 && p < cos_table.size(0), "draft_attend: position ", p, " beyond the rotary tables");
    jakiro::embedding_row(embed, t, xin.data_ptr<float>() + r * 2 * d);
    std::memcpy(xin.data_ptr<float>() + r * 2 * d + d, fin.data_ptr<float>() + r * d, d * sizeof(float));
    std::memcpy(cos.data_ptr<float>() + r * S.D, cos_table.data_ptr<float>() + p * S.D, S.D * sizeof(float));
    std::memcpy(sin.data_ptr<float>() + r * S.D, sin_table.data_ptr<float>() + p * S.D, S.D * sizeof(float));
  }
  auto x = at::empty({n, d}, opts);
  jakiro::apply_linear(fc, d, bias, xin.data_ptr<float>(), n, 2 * d, x.data_ptr<float>(), input_bytes);
  const auto vis = visibility(mask, n, past, true);
  auto h = at::empty({n, d}, opts), ob = at::empty({n, H * S.D}, opts), qb = at::empty({n, S.qkv()}, opts);
  auto y = at::empty({n, d}, opts), scores = at::empty({n * Hkv, (H / Hkv) * (past + n)}, opts);
  const Scratch scratch{h.data_ptr<float>(), qb.data_ptr<float>(), ob.data_ptr<float>(), y.data_ptr<float>(),
                        scores.data_ptr<float>(), past + n};
  const AttentionWeights w{norm.data_ptr<float>(), single(&qkv, S.qkv()), nullptr, &o, nullptr, nullptr};
  attention_block(x.data_ptr<float>(), S, w, layer_cache(kv, 0), past, cos.data_ptr<float>(), sin.data_ptr<float>(),
                  vis, scratch, input_bytes);
  return x;
}

// The rest of an EAGLE-2 draft step for its rows r [n, d] (the residual after ``draft_attend``):
// out = r + down(silu(gate) * up) of rmsnorm(r), then the head's logits over its ``V`` rows and,
// per row, the ``k`` best entries with their log-probabilities (largest first, the lower index
// first among equal logits). One call instead of a dozen framework operations per step.
// whether any lane is set (true: -1, as vector comparisons give)
inline bool any_lane(vi m) {
  typedef int32_t vi8 __attribute__((vector_size(8 * sizeof(int32_t))));
  typedef int32_t vi4 __attribute__((vector_size(4 * sizeof(int32_t))));
  const vi8 a = __builtin_shufflevector(m, m, 0, 1, 2, 3, 4, 5, 6, 7) | __builtin_shufflevector(m, m, 8, 9, 10, 11, 12, 13, 14, 15);
  vi4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) | __builtin_shufflevector(a, a, 4, 5, 6, 7);
  b |= __builtin_shufflevector(b, b, 2, 3, 0, 1);
  b |= __builtin_shufflevector(b, b, 1, 0, 3, 2);
  return b[0] != 0;
}

// x [n, d] += the gated MLP of rmsnorm(x) for a draft step's rows, with scratch of its own
void mlp_rows(float* x, int64_t n, int64_t d, int64_t inter, double eps, const float* norm, const at::Tensor& gate_up,
              const at::Tensor& down, int64_t input_bytes, const at::TensorOptions& opts) {
  const Shape S{n, d, 0, 0, 0, inter, static_cast<float>(eps), 0.f};
  auto y = at::empty({n, d}, opts), gu = at::empty({n, 2 * inter}, opts), act = at::empty({n, inter}, opts);
  mlp_block(x, S, norm, single(&gate_up, 2 * inter), down, y.data_ptr<float>(), gu.data_ptr<float>(), act.data_ptr<float>(), input_bytes);
}

// the k largest of z[0..V) (ties: the lower index first; NaN never taken) as indices and their
// log-probabilities under softmax(z). Insertion into a sorted list of k, with 64 entries at a time
// skipped while none beats the k-th best (after the first few hundred almost every block): the
// same choice, in the same order, as one scalar pass.
void top_k_logp(const float* z, int64_t V, int64_t k, int64_t* best, int64_t* ids, float* logp) {
  int64_t have = 0;
  auto offer = [&](int64_t i) {
    if (have == k && !(z[i] > z[best[k - 1]])) return;
    int64_t j = have < k ? have++ : k - 1;
    while (j > 0 && z[i] > z[best[j - 1]]) {
      best[j] = best[j - 1];
      --j;
    }
    best[j] = i;
  };
  constexpr int64_t BLOCK = 4 * VL;
  int64_t i = 0;
  for (; i < V && (have < k || i % BLOCK); ++i) offer(i);
  for (; i + BLOCK <= V; i += BLOCK) {
    const vf t = vf{} + z[best[k - 1]];  // a lane offer would take beats this (a NaN lane never does)
    if (!any_lane((load(z + i) > t) | (load(z + i + VL) > t) | (load(z + i + 2 * VL) > t) | (load(z + i + 3 * VL) > t)))
      continue;
    for (int64_t j = i; j < i + BLOCK; ++j) offer(j);
  }
  for (; i < V; ++i) offer(i);
  if (have == 0) {  // every logit NaN: nothing to rank
    for (int64_t j = 0; j < k; ++j) ids[j] = 0, logp[j] = -INFINITY;
    return;
  }
  for (int64_t j = have; j < k; ++j) best[j] = best[have - 1];  // fewer than k non-NaN logits
  const float top = z[best[0]];
  vf acc = vf{};
  i = 0;
  for (; i + VL <= V; i += VL) acc += vexp(load(z + i) - top);
  float sum = hsum(acc);
  for (; i < V; ++i) sum += sexp(z[i] - top);
  const float lse = top + std::log(sum);
  for (int64_t j = 0; j < k; ++j) {
    ids[j] = best[j];
    logp[j] = z[best[j]] - lse;
  }
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> draft_mlp_head(const at::Tensor& r_in, const at::Tensor& norm,
                                                              const at::Tensor& gate_up, const at::Tensor& down,
                                                              int64_t inter, const at::Tensor& head, int64_t V,
                                                              int64_t k, double eps, int64_t input_bytes) {
  TORCH_CHECK(r_in.dim() == 2 && r_in.scalar_type() == at::kFloat, "draft_mlp_head: r must be [n, d] float32");
  auto out = r_in.contiguous().clone();
  const int64_t n = out.size(0), d = out.size(1);
  TORCH_CHECK(norm.numel() == d && norm.scalar_type() == at::kFloat && norm.is_contiguous(),
              "draft_mlp_head: norm must be [d] float32");
  TORCH_CHECK(k >= 1 && k <= V, "draft_mlp_head: need 1 <= k <= head rows");
  TORCH_CHECK(jakiro::valid_linear(gate_up, 2 * inter, d) && jakiro::valid_linear(down, d, inter) &&
                  jakiro::valid_linear(head, V, d),
              "draft_mlp_head: a weight the kernels cannot take");
  auto opts = out.options();
  mlp_rows(out.data_ptr<float>(), n, d, inter, eps, norm.data_ptr<float>(), gate_up, down, input_bytes, opts);
  auto logits = at::empty({n, V}, opts);
  jakiro::apply_linear(head, V, nullptr, out.data_ptr<float>(), n, d, logits.data_ptr<float>(), input_bytes);
  auto ids = at::empty({n, k}, opts.dtype(at::kLong));
  auto logp = at::empty({n, k}, opts);
  const float* z0 = logits.data_ptr<float>();
  int64_t* ids0 = ids.data_ptr<int64_t>();
  float* logp0 = logp.data_ptr<float>();
  // rows in parallel: each is a top-k and a log-sum-exp over the head's V logits (a fifth of the
  // step with the rows one after another)
  at::parallel_for(0, n, 1, [&](int64_t r0, int64_t r1) {
    std::vector<int64_t> best(k);
    for (int64_t row = r0; row < r1; ++row) top_k_logp(z0 + row * V, V, k, best.data(), ids0 + row * k, logp0 + row * k);
  });
  return {out, ids, logp};
}

// The experts of a row r [d] in router order: the router's logits over rmsnorm(r) (``m``, written),
// largest first, ties to the lower index
void rank_experts(const float* r, const float* norm, const float* router, int64_t N, int64_t d, float eps, float* m,
                  int64_t* order) {
  rmsnorm(r, norm, m, d, eps);
  std::vector<float> z(N);
  for (int64_t e = 0; e < N; ++e) {
    z[e] = dot(router + e * d, m, d);
    order[e] = e;
  }
  std::stable_sort(order, order + N, [&](int64_t a, int64_t b) { return z[a] > z[b]; });
}

// A decoupled Jakiro draft step's children for residual rows r [n, d]: each row's activated
// experts in router order (the A largest of router [N, d] times rmsnorm(r) with ``norm``, ties to
// the lower index; computed here, where the same few operations in torch cost about 0.1 ms a
// step), the one of rank a proposing
// ``quotas[a]`` children: the top tokens of the head over r + that expert's MLP output, skipping
// those the ranks before it proposed. Every expert that some row activates runs over all rows
// (they are few), the head over the n x A expert features in one call. Returns (features r +
// expert output [n, A, d], head row ids [n, k], their log-probabilities under each feature's
// own softmax [n, k]), children ordered by rank, then by score.
std::tuple<at::Tensor, at::Tensor, at::Tensor> draft_experts_topk(
    const at::Tensor& r_in, const at::Tensor& norm, const std::vector<at::Tensor>& gate_ups,
    const std::vector<at::Tensor>& downs, int64_t inter, const at::Tensor& head, int64_t V, const at::Tensor& router,
    at::IntArrayRef quotas, double eps, int64_t input_bytes) {
  TORCH_CHECK(r_in.dim() == 2 && r_in.scalar_type() == at::kFloat, "draft_experts_topk: r must be [n, d] float32");
  const auto r = r_in.contiguous();
  const int64_t n = r.size(0), d = r.size(1), N = static_cast<int64_t>(gate_ups.size());
  const int64_t A = static_cast<int64_t>(quotas.size());
  TORCH_CHECK(N >= 1 && static_cast<int64_t>(downs.size()) == N, "draft_experts_topk: one gate/up and down per expert");
  TORCH_CHECK(norm.numel() == d && norm.scalar_type() == at::kFloat && norm.is_contiguous(),
              "draft_experts_topk: norm must be [d] float32");
  TORCH_CHECK(router.dim() == 2 && router.size(0) == N && router.size(1) == d && router.scalar_type() == at::kFloat,
              "draft_experts_topk: router must be [experts, d] float32");
  TORCH_CHECK(A >= 1 && A <= N, "draft_experts_topk: between one rank and one per expert");
  int64_t k = 0;
  for (int64_t a = 0; a < A; ++a) {
    TORCH_CHECK(quotas[a] >= 1, "draft_experts_topk: every rank proposes at least one child");
    k += quotas[a];
  }
  TORCH_CHECK(k <= V, "draft_experts_topk: more children than head rows");
  TORCH_CHECK(jakiro::valid_linear(head, V, d), "draft_experts_topk: a head the kernels cannot take");
  for (int64_t e = 0; e < N; ++e)
    TORCH_CHECK(jakiro::valid_linear(gate_ups[e], 2 * inter, d) && jakiro::valid_linear(downs[e], d, inter),
                "draft_experts_topk: an expert the kernels cannot take");
  // each row's experts by router logit, the largest first
  const auto rw = router.contiguous();
  std::vector<int64_t> rank_of(n * A);
  std::vector<char> used(N, 0);
  {
    std::vector<float> m(d);
    std::vector<int64_t> idx(N);
    for (int64_t i = 0; i < n; ++i) {
      rank_experts(r.data_ptr<float>() + i * d, norm.data_ptr<float>(), rw.data_ptr<float>(), N, d,
                   static_cast<float>(eps), m.data(), idx.data());
      for (int64_t a = 0; a < A; ++a) used[rank_of[i * A + a] = idx[a]] = 1;
    }
  }
  auto opts = r.options();
  // each used expert's r + MLP(r) over all rows
  auto outs = at::empty({N, n, d}, opts);
  for (int64_t e = 0; e < N; ++e) {
    if (!used[e]) continue;
    float* o = outs.data_ptr<float>() + e * n * d;
    std::memcpy(o, r.data_ptr<float>(), n * d * sizeof(float));
    mlp_rows(o, n, d, inter, eps, norm.data_ptr<float>(), gate_ups[e], downs[e], input_bytes, opts);
  }
  auto feats = at::empty({n, A, d}, opts);
  for (int64_t i = 0; i < n; ++i)
    for (int64_t a = 0; a < A; ++a)
      std::memcpy(feats.data_ptr<float>() + (i * A + a) * d, outs.data_ptr<float>() + (rank_of[i * A + a] * n + i) * d,
                  d * sizeof(float));
  auto logits = at::empty({n * A, V}, opts);
  jakiro::apply_linear(head, V, nullptr, feats.data_ptr<float>(), n * A, d, logits.data_ptr<float>(), input_bytes);
  auto ids = at::empty({n, k}, opts.dtype(at::kLong));
  auto logp = at::empty({n, k}, opts);
  const float* z0 = logits.data_ptr<float>();
  int64_t* ids0 = ids.data_ptr<int64_t>();
  float* logp0 = logp.data_ptr<float>();
  at::parallel_for(0, n, 1, [&](int64_t r0, int64_t r1) {
    std::vector<int64_t> best(k), cand(k);
    std::vector<float> cand_lp(k);
    for (int64_t row = r0; row < r1; ++row) {
      int64_t have = 0;  // children of this row so far (the ranks before a)
      for (int64_t a = 0; a < A; ++a) {
        // the top quota + have, then the first quota of them the ranks before did not propose
        const int64_t want = std::min<int64_t>(quotas[a] + have, V);
        top_k_logp(z0 + (row * A + a) * V, V, want, best.data(), cand.data(), cand_lp.data());
        int64_t got = 0;
        for (int64_t j = 0; j < want && got < quotas[a]; ++j) {
          const int64_t* taken = ids0 + row * k;
          if (std::find(taken, taken + have + got, cand[j]) != taken + have + got) continue;
          ids0[row * k + have + got] = cand[j];
          logp0[row * k + have + got] = cand_lp[j];
          ++got;
        }
        have += got;
      }
      for (int64_t j = have; j < k; ++j) ids0[row * k + j] = 0, logp0[row * k + j] = -INFINITY;  // NaN logits only
    }
  });
  return {feats, ids, logp};
}

// A draft's whole chain proposal (top-k 1: each step keeps only its best child) in one call. First
// the catch-up: the fusion and attention of the rows committed since the last proposal
// (``features`` [m, d], the draft's input features, and ``tokens`` [m], the tokens after them) at
// positions ``past`` .. ``past`` + m - 1, their keys and values written to the cache (the caller
// commits them). Then, from the newest row's residual, ``steps`` times the MLP (EAGLE-2; no
// ``router``) or the expert the router ranks first (decoupled Jakiro), the best of the head's V
// rows (``head_ids``: their target token ids), and, but after the last step, the fusion and
// attention of the next step for that token and feature at the next position, whose keys and
// values go to the cache after the catch-up's (the caller leaves them uncommitted). With
// ``con_router`` the last step also runs the expert ranked second and adds the contrastive
// branch's best row, r + c_A E_A - c_B E_B (c: the softmax of con_router over rmsnorm(r) at those
// two experts), as one more token. Returns (head rows [steps (+ 1)], their log-probabilities):
// what ``draft_attend``, then ``draft_mlp_head`` or ``draft_experts_topk`` with k = 1 and
// ``draft_attend`` step by step give, without a return to the caller between them.
// With ``draws`` (float64 uniforms in [0, 1), one per step) each step's token is drawn instead:
// q = softmax(logits / temperature) over the head's rows goes to row s of the third result
// [steps, V], and the token is the first row whose float64 running sum of q exceeds draws[s]
// times the total (``sampling.sample_rows``); the log-probability returned is the best row's under
// q (the draft's confidence), and a contrastive last token stays the branch's best row.
std::tuple<at::Tensor, at::Tensor, at::Tensor> draft_chain(
    const at::Tensor& features, const at::Tensor& tokens, int64_t steps, const at::Tensor& embed, const at::Tensor& fc,
    const c10::optional<at::Tensor>& fc_bias, const at::Tensor& in_norm, const at::Tensor& qkv, const at::Tensor& o,
    const at::Tensor& kv, int64_t past, const at::Tensor& cos_table, const at::Tensor& sin_table, int64_t H,
    int64_t Hkv, double scale, const at::Tensor& post_norm, const std::vector<at::Tensor>& gate_ups,
    const std::vector<at::Tensor>& downs, int64_t inter, const c10::optional<at::Tensor>& router,
    const c10::optional<at::Tensor>& con_router, const at::Tensor& head, const at::Tensor& head_ids, double eps,
    int64_t input_bytes, const c10::optional<at::Tensor>& draws, double temperature) {
  const int64_t d = post_norm.numel(), N = static_cast<int64_t>(gate_ups.size());
  TORCH_CHECK(features.dim() == 2 && features.size(0) >= 1, "draft_chain: features must be [m, d], m >= 1");
  TORCH_CHECK(steps >= 1, "draft_chain: at least one step");
  TORCH_CHECK(!draws || (draws->dim() == 1 && draws->size(0) == steps && draws->scalar_type() == at::kDouble &&
                         draws->is_contiguous() && temperature > 0),
              "draft_chain: draws must be [steps] float64 uniforms, with a temperature > 0");
  TORCH_CHECK(post_norm.scalar_type() == at::kFloat && post_norm.is_contiguous(), "draft_chain: norm must be [d] float32");
  TORCH_CHECK(head_ids.dim() == 1 && head_ids.scalar_type() == at::kLong && head_ids.is_contiguous(),
              "draft_chain: head_ids must be [V] int64");
  const int64_t V = head_ids.size(0);
  TORCH_CHECK(N >= 1 && static_cast<int64_t>(downs.size()) == N, "draft_chain: one gate/up and down per expert");
  TORCH_CHECK(jakiro::valid_linear(head, V, d), "draft_chain: a head the kernels cannot take");
  for (int64_t e = 0; e < N; ++e)
    TORCH_CHECK(jakiro::valid_linear(gate_ups[e], 2 * inter, d) && jakiro::valid_linear(downs[e], d, inter),
                "draft_chain: an expert the kernels cannot take");
  const bool con = con_router.has_value();
  auto checked_router = [&](const c10::optional<at::Tensor>& t) -> const float* {
    if (!t) return nullptr;
    TORCH_CHECK(t->dim() == 2 && t->size(0) == N && t->size(1) == d && t->scalar_type() == at::kFloat &&
                    t->is_contiguous(),
                "draft_chain: a router must be [experts, d] float32");
    return t->data_ptr<float>();
  };
  const float* rw = checked_router(router);
  const float* cw = checked_router(con_router);
  TORCH_CHECK(!con || (rw && N >= 2), "draft_chain: the contrastive branch needs a router and two experts");
  auto opts = features.options();
  const int64_t m_rows = features.size(0);
  check_cache(kv, 1, Hkv, past, m_rows + steps - 1);
  at::Tensor r = draft_attend(features, tokens, embed, fc, fc_bias, in_norm, qkv, o, kv, past, cos_table, sin_table,
                              at::arange(past, past + m_rows, opts.dtype(at::kLong)), c10::nullopt, H, Hkv, eps,
                              scale, input_bytes)
                     .slice(0, m_rows - 1, m_rows);
  past += m_rows;
  auto ids = at::empty({steps + con}, opts.dtype(at::kLong));
  auto logp = at::empty({steps + con}, opts);
  auto probs = at::empty({draws ? steps : 0, V}, opts);
  int64_t* id = ids.data_ptr<int64_t>();
  float* lp = logp.data_ptr<float>();
  auto out = at::empty({1, d}, opts), logits = at::empty({1, V}, opts);
  std::vector<float> m(d);
  std::vector<int64_t> order(N, 0), best(1);
  auto tok = at::empty({1}, opts.dtype(at::kLong)), pos = at::empty({1}, opts.dtype(at::kLong));
  auto best_row = [&](const float* x, int64_t j) {
    jakiro::apply_linear(head, V, nullptr, x, 1, d, logits.data_ptr<float>(), input_bytes);
    top_k_logp(logits.data_ptr<float>(), V, 1, best.data(), id + j, lp + j);
  };
  auto draw_row = [&](int64_t j) {  // after best_row(.., j): q into probs row j, the drawn row into id[j]
    const float* z = logits.data_ptr<float>();
    float* q = probs.data_ptr<float>() + j * V;
    const float inv_t = static_cast<float>(1.0 / temperature), top = z[id[j]];
    float sum = 0.f;
    for (int64_t v = 0; v < V; ++v) sum += (q[v] = std::exp((z[v] - top) * inv_t));
    const float inv = 1.f / sum;
    double total = 0.0;
    for (int64_t v = 0; v < V; ++v) total += (q[v] *= inv);
    lp[j] = std::log(q[id[j]]);  // the best row's probability under q: the draft's confidence
    const double u = draws->data_ptr<double>()[j] * total;
    double run = 0.0;
    int64_t pick = -1, last = id[j];
    for (int64_t v = 0; v < V; ++v) {
      if (q[v] > 0) last = v;
      run += q[v];
      if (run > u) { pick = v; break; }
    }
    id[j] = pick >= 0 ? pick : last;  // a draw that rounds up to the total: the last row of weight > 0
  };
  for (int64_t s = 0; s < steps; ++s) {
    const float* rp = r.data_ptr<float>();
    if (rw) rank_experts(rp, post_norm.data_ptr<float>(), rw, N, d, static_cast<float>(eps), m.data(), order.data());
    float* op = out.data_ptr<float>();
    std::memcpy(op, rp, d * sizeof(float));
    mlp_rows(op, 1, d, inter, eps, post_norm.data_ptr<float>(), gate_ups[order[0]], downs[order[0]], input_bytes, opts);
    best_row(op, s);
    if (draws) draw_row(s);
    if (s + 1 < steps) {
      tok.data_ptr<int64_t>()[0] = head_ids.data_ptr<int64_t>()[id[s]];
      pos.data_ptr<int64_t>()[0] = past + s;
      r = draft_attend(out, tok, embed, fc, fc_bias, in_norm, qkv, o, kv, past + s, cos_table, sin_table, pos,
                       c10::nullopt, H, Hkv, eps, scale, input_bytes);
    } else if (con) {
      auto second = r.clone();
      float* sp = second.data_ptr<float>();
      mlp_rows(sp, 1, d, inter, eps, post_norm.data_ptr<float>(), gate_ups[order[1]], downs[order[1]], input_bytes,
               opts);
      std::vector<float> z(N);
      float top = -INFINITY, sum = 0.f;
      for (int64_t e = 0; e < N; ++e) top = std::max(top, z[e] = dot(cw + e * d, m.data(), d));
      for (int64_t e = 0; e < N; ++e) sum += std::exp(z[e] - top);
      const float ca = std::exp(z[order[0]] - top) / sum, cb = std::exp(z[order[1]] - top) / sum;
      std::vector<float> c(d);
      for (int64_t i = 0; i < d; ++i) c[i] = rp[i] + ca * (op[i] - rp[i]) - cb * (sp[i] - rp[i]);
      best_row(c.data(), steps);
    }
  }
  return {ids, logp, probs};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(jakiro_smallgemm, m) {
  m.def("decoder_layers(Tensor x, Tensor?[] weights, int[] out_features, Tensor kv, int past, Tensor cos, "
        "Tensor sin, Tensor? tree_mask, int num_heads, int num_kv_heads, float eps, float scale, "
        "int[] keep_after=[], int input_bytes=3) -> Tensor",
        decoder_layers);
  m.def("decoder_layers_batch(Tensor x, Tensor?[] weights, int[] out_features, Tensor kv, Tensor lengths, "
        "Tensor cos, Tensor sin, int num_heads, int num_kv_heads, float eps, float scale, int[] keep_after=[], "
        "int input_bytes=3) "
        "-> Tensor",
        decoder_layers_batch);
  m.def("decoder_layers_ragged(Tensor x, Tensor?[] weights, int[] out_features, Tensor kv, Tensor seq, Tensor at, "
        "Tensor prefix, Tensor mask, Tensor cos, Tensor sin, int num_heads, int num_kv_heads, float eps, float scale, "
        "int[] keep_after=[], int input_bytes=3) -> Tensor",
        decoder_layers_ragged);
  m.def("draft_attend(Tensor features, Tensor tokens, Tensor embed, Tensor fc, Tensor? fc_bias, Tensor norm, "
        "Tensor qkv, Tensor o, Tensor kv, int past, Tensor cos_table, Tensor sin_table, Tensor positions, "
        "Tensor? mask, int num_heads, int num_kv_heads, float eps, float scale, int input_bytes=3) -> Tensor",
        draft_attend);
  m.def("draft_mlp_head(Tensor r, Tensor norm, Tensor gate_up, Tensor down, int inter, Tensor head, int V, int k, "
        "float eps, int input_bytes=3) -> (Tensor, Tensor, Tensor)",
        draft_mlp_head);
  m.def("draft_chain(Tensor features, Tensor tokens, int steps, Tensor embed, Tensor fc, Tensor? fc_bias, Tensor in_norm, Tensor qkv, "
        "Tensor o, Tensor kv, int past, Tensor cos_table, Tensor sin_table, int num_heads, int num_kv_heads, "
        "float scale, Tensor post_norm, Tensor[] gate_ups, Tensor[] downs, int inter, Tensor? router, "
        "Tensor? con_router, Tensor head, Tensor head_ids, float eps, int input_bytes=3, Tensor? draws=None, "
        "float temperature=1.0) -> (Tensor, Tensor, Tensor)",
        draft_chain);
  m.def("draft_experts_topk(Tensor r, Tensor norm, Tensor[] gate_ups, Tensor[] downs, int inter, Tensor head, int V, "
        "Tensor router, int[] quotas, float eps, int input_bytes=3) -> (Tensor, Tensor, Tensor)",
        draft_experts_topk);
}
