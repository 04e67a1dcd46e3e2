"""Compile every Triton kernel of ``fluidserve.kernels.triton_ops`` for a CUDA target, with no
GPU: Triton lowers each to PTX and its bundled ``ptxas`` assembles a cubin. The interpreter
tests run the kernels' arithmetic; this catches what only the GPU compiler sees (types it
rejects, inline assembly such as the PDL waits, layouts it cannot lower).

Each line also tells what the machine code does with memory: how many 2-byte global loads it
issues, its registers and its stack (spills), read with the ``cuobjdump`` that ships beside
``ptxas``. The attention kernel and the one-row projections are compiled as the JIT compiles
them for a Llama-3-8B decode (every pointer and integer argument a multiple of 16, one row
specialized to a constant), at the warps and stages their launchers pick.

Run without ``TRITON_INTERPRET`` (which turns the kernels into Python): prints one JSON line
per compiled variant. Usage: ``python tests/triton_compile_check.py [capability]`` (90).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from fluidserve.kernels import triton_ops as T

BF16 = "*bf16"
I32P = "*i32"
F32P = "*fp32"
FLOATS = {"eps", "scale"}  # the scalar float arguments; every other scalar is an int32


def signature(fn, consts: dict, pointers: dict) -> dict:
    sig = {}
    for p in fn.params:
        if p.name in consts:
            sig[p.name] = "constexpr"
        elif p.name.endswith("_ptr"):
            sig[p.name] = pointers.get(p.name, BF16)
        else:
            sig[p.name] = "fp32" if p.name in FLOATS else "i32"
    return sig


def variants():
    """(kernel, constexprs, pointer dtypes other than bf16, launch options); an option
    ``hints`` marks every pointer and integer argument a multiple of 16."""
    pdl = {"launch_pdl": True}
    yield T._rms_norm_kernel, dict(ADD=True, BLOCK=4096), {}, {}
    yield T._rms_norm_kernel, dict(ADD=False, BLOCK=1024), {}, {}
    rope_int = {"pos_ptr": I32P, "slot_ptr": I32P}
    for write, gdc in ((False, False), (True, False), (True, True)):
        yield (T._rope_kernel, dict(HALF=64, WRITE=write, BS=16, GDC=gdc), rope_int,
               pdl if gdc else {})
    yield T._silu_and_mul_kernel, dict(BLOCK=2048), {}, {}
    yield (T._write_kv_kernel, dict(BS=16, D=128), {"slot_ptr": I32P}, {})
    yield (T._argmax_kernel, dict(BLOCK=4096, NB_POW2=32),
           {"x_ptr": BF16, "out_ptr": "*i64", "pm_ptr": F32P, "pi_ptr": I32P,
            "count_ptr": I32P}, {})
    skinny = dict(BIAS=False, EVEN_K=True, PRECISION="tf32", NORM_BLOCK=4096)
    for norm, silu, add in ((True, False, False), (False, False, True), (False, True, True)):
        # One row (M specialized to 1, as the JIT does), the tiling measured on an H100.
        yield (T._skinny_linear_kernel, skinny | dict(
            NORM=norm, SILU=silu, ADD=add, DOT=False, BLOCK_M=1, BLOCK_N=8, BLOCK_K=1024,
            GDC=True, M=1), {}, pdl | {"hints": True, "num_stages": 3})
    yield (T._skinny_linear_kernel, skinny | dict(
        NORM=True, SILU=False, ADD=False, DOT=True, BLOCK_M=16, BLOCK_N=64, BLOCK_K=128,
        GDC=False, EVEN_K=False, BIAS=True, NORM_BLOCK=256), {}, {})
    attn = {"cu_q_ptr": I32P, "ctx_ptr": I32P, "bt_ptr": I32P, "tile_run_ptr": I32P,
            "tile_tok_ptr": I32P, "count_ptr": I32P, "part_ptr": F32P, "ml_ptr": F32P}
    for splits, block_m, gdc in ((16, 16, True), (1, 16, False), (1, 64, False)):
        yield (T._attention_kernel, dict(G=4, BLOCK_M=block_m, BLOCK_N=64, D=128, BS=16,
                                         SPLITS=splits, PRECISION="tf32", GDC=gdc, KV_RUN=16),
               attn, (pdl if gdc else {}) | {"hints": True, "num_warps": 4 if block_m <= 16
                                             else 8, "num_stages": 2})


def machine_code(cubin: bytes) -> dict:
    """2- and 16-byte global loads, registers and stack bytes of a cubin (cuobjdump)."""
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        sass = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True,
                              check=True).stdout
        usage = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True,
                               text=True, check=True).stdout
    regs = re.search(r"REG:(\d+)", usage)
    stack = re.search(r"STACK:(\d+)", usage)
    loads = re.findall(r"\bLDG\.E(?:\.[A-Z]+)*\.(U16|S16|128)\b", sass)
    return {"loads_2_bytes": sum(w != "128" for w in loads),
            "loads_16_bytes": loads.count("128"),
            "registers": int(regs.group(1)), "stack_bytes": int(stack.group(1))}


def main(capability: int = 90) -> None:
    target = GPUTarget("cuda", capability, 32)
    for fn, consts, pointers, options in variants():
        sig = signature(fn, consts, pointers)
        hints = options.pop("hints", False)
        attrs = {(i,): [["tt.divisibility", 16]] for i, p in enumerate(fn.params)
                 if hints and sig[p.name] not in ("constexpr", "fp32")}
        compiled = triton.compile(ASTSource(fn, sig, consts, attrs), target=target,
                                  options={"num_warps": 4, **options})
        ptx = compiled.asm["ptx"]
        print(json.dumps({"kernel": fn.__name__, "constexprs": consts, "hints": hints,
                          "cubin_bytes": len(compiled.asm["cubin"]),
                          "gdc_wait": "griddepcontrol.wait" in ptx,
                          "gdc_launch_dependents": "griddepcontrol.launch_dependents" in ptx,
                          **machine_code(compiled.asm["cubin"])}), flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 90)
