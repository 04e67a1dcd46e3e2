"""How fast this CPU issues its bf16 dot product against its float32 FMA, on one core.

Twelve independent accumulator chains of each instruction in a tight loop (a C++ program,
compiled here with ``g++ -O2 -march=native``): ``VFMADD231PS`` (16 float32 multiply-adds per
zmm instruction) and ``VDPBF16PS`` (32 bf16 products summed in pairs into 16 float32 lanes).
Where the second issues at a quarter of the first's rate, as on the AVX-512 Emerald Rapids
class VM (docs/performance.md), bf16 weights are faster widened to float32 and multiplied on
the FMA units (the panel kernels) than through the bf16 instruction (oneDNN's bf16 kernels).
Needs AVX-512 BF16 (``avx512_bf16`` in /proc/cpuinfo). Prints one JSON line.

    python scripts/probe_bf16_dot.py
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

SOURCE = r"""
#include <immintrin.h>
#include <chrono>
#include <cstdio>
template <class F> double rate(long n, F step) {
  auto t0 = std::chrono::steady_clock::now();
  for (long i = 0; i < n / 12; ++i) step();
  return n / std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}
int main() {
  const long n = 200000000;
  __m512 a[12], b[12];
  for (int j = 0; j < 12; ++j) a[j] = b[j] = _mm512_setzero_ps();
  const __m512 x = _mm512_set1_ps(1.0001f), y = _mm512_set1_ps(0.9999f);
  const __m512bh u = (__m512bh)_mm512_set1_epi16(0x3f80);
  double fma = rate(n, [&] {
#pragma GCC unroll 12
    for (int j = 0; j < 12; ++j) a[j] = _mm512_fmadd_ps(x, y, a[j]);
    asm volatile("" ::"v"(a[0]), "v"(a[3]), "v"(a[6]), "v"(a[9]));
  });
  double dp = rate(n, [&] {
#pragma GCC unroll 12
    for (int j = 0; j < 12; ++j) b[j] = _mm512_dpbf16_ps(b[j], u, u);
    asm volatile("" ::"v"(b[0]), "v"(b[3]), "v"(b[6]), "v"(b[9]));
  });
  float sink = 0;
  for (int j = 0; j < 12; ++j) sink += _mm512_reduce_add_ps(a[j]) + _mm512_reduce_add_ps(b[j]);
  std::printf("%.6e %.6e %g\n", fma, dp, sink);
}
"""


def main() -> int:
    flags = Path("/proc/cpuinfo").read_text().split()
    if "avx512_bf16" not in flags:
        print(json.dumps({"error": "this CPU has no AVX-512 BF16"}))
        return 1
    with tempfile.TemporaryDirectory() as tmp:
        src, exe = Path(tmp) / "probe.cpp", Path(tmp) / "probe"
        src.write_text(SOURCE)
        subprocess.run(["g++", "-O2", "-march=native", str(src), "-o", str(exe)], check=True)
        fma, dp, _ = subprocess.run([str(exe)], check=True, capture_output=True,
                                    text=True).stdout.split()
    fma, dp = float(fma), float(dp)
    print(json.dumps({"vfmadd231ps_per_s": fma, "fma_gflops": fma * 32 / 1e9,
                      "vdpbf16ps_per_s": dp, "dpbf16_gflops": dp * 64 / 1e9,
                      "instruction_rate_ratio": dp / fma}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
