"""The machine's ceiling for the int8 kernels: int8 multiply-adds per second that AVX-512 VNNI's
dot-product instruction (vpdpbusd, 64 per instruction) reaches on this CPU with 1 and N threads,
with nothing else in the loop (12 independent accumulators, no memory traffic). The int8 kernels
need 8 of these instructions per row, block of 32 inputs and 16 output columns, so a forward over
many rows (a prompt's pieces, a large batch) cannot run faster than its multiply-adds divided by
this rate. Builds a tiny extension with torch's inline loader (a C++ compiler is needed).

    python docs/experiments/vnni_peak.py --threads 2
"""

from __future__ import annotations

import argparse
import json
import time

SOURCE = r"""
#include <ATen/Parallel.h>
#include <torch/extension.h>
#include <immintrin.h>

// seconds of `iters` rounds of 12 independent vpdpbusd on each of `threads` threads
int64_t spin(int64_t iters, int64_t threads) {
  std::vector<int64_t> sink(threads);
  at::parallel_for(0, threads, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      __m512i a[12];
      for (int i = 0; i < 12; ++i) a[i] = _mm512_set1_epi32(i + t);
      const __m512i b = _mm512_set1_epi8(1), c = _mm512_set1_epi8(2);
      for (int64_t it = 0; it < iters; ++it) {
#pragma GCC unroll 12
        for (int i = 0; i < 12; ++i) a[i] = _mm512_dpbusd_epi32(a[i], b, c);
        asm volatile("" ::: "memory");
      }
      int64_t s = 0;
      for (int i = 0; i < 12; ++i) s += _mm512_reduce_add_epi32(a[i]);
      sink[t] = s;
    }
  });
  int64_t s = 0;
  for (auto v : sink) s += v;
  return s;
}
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--iters", type=int, default=100_000_000, help="rounds of 12 instructions per thread")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    import torch
    from torch.utils.cpp_extension import load_inline

    from jakiro.models import smallgemm
    if not smallgemm.int8_activations_usable():
        raise SystemExit("this CPU has no AVX-512 VNNI (nor AMX)")
    ext = load_inline("jakiro_vnni_peak", cpp_sources=SOURCE, functions=["spin"],
                      extra_cflags=["-O2", "-march=native", "-fopenmp"], extra_ldflags=["-fopenmp"])
    out = {"threads": {}}
    for threads in sorted({1, args.threads}):
        torch.set_num_threads(threads)
        best = float("inf")
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            ext.spin(args.iters, threads)
            best = min(best, time.perf_counter() - t0)
        out["threads"][threads] = {"gmac_per_s": round(args.iters * 12 * 64 * threads / best / 1e9, 1),
                                   "seconds": round(best, 3)}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
