"""How fast this CPU issues its bf16 dot product against its float32 FMA, on one core.

Twelve independent accumulator chains of each instruction in a tight loop (the compiled
kernels' ``bf16_dot_rates``, which ``--panel-product auto`` reads at start-up):
``VFMADD231PS`` (16 float32 multiply-adds per zmm instruction) and ``VDPBF16PS`` (32 bf16
products summed in pairs into 16 float32 lanes). Where the second issues at a quarter of the
first's rate, as on the AVX-512 Emerald Rapids class VM (docs/performance.md), bf16 weights
are faster widened to float32 and multiplied on the FMA units (the FMA panels); where it
issues about as fast, as on AMD Zen 4, the dot-product panels do twice the work a cycle.
Needs AVX-512 BF16 (``avx512_bf16`` in /proc/cpuinfo). Prints one JSON line.

    python scripts/probe_bf16_dot.py
"""

from __future__ import annotations

import json
import sys

from fluidserve.kernels import build_error, cpu_ops
from fluidserve.model.linear import DOT_RATE_SHARE


def main() -> int:
    ops = cpu_ops()
    if ops is None:
        print(json.dumps({"error": f"no compiled kernels: {build_error()}"}))
        return 1
    fma, dp = ops.bf16_dot_rates()
    if not fma:
        print(json.dumps({"error": "this CPU (or build) has no AVX-512 BF16"}))
        return 1
    print(json.dumps({"vfmadd231ps_per_s": fma, "fma_gflops": fma * 32 / 1e9,
                      "vdpbf16ps_per_s": dp, "dpbf16_gflops": dp * 64 / 1e9,
                      "instruction_rate_ratio": dp / fma,
                      "dot_panels_by_default": dp >= DOT_RATE_SHARE * fma}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
