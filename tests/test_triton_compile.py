"""The Triton kernels compile for a Hopper GPU on any machine (tests/triton_compile_check.py):
what the interpreter cannot check, the PTX and cubin the GPU would run, in a subprocess
without ``TRITON_INTERPRET``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")


def test_every_kernel_compiles_for_sm90_and_the_pdl_variants_wait(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env |= {"TRITON_CACHE_DIR": str(tmp_path), "CUDA_VISIBLE_DEVICES": ""}
    script = Path(__file__).with_name("triton_compile_check.py")
    done = subprocess.run([sys.executable, str(script), "90"], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    rows = [json.loads(line) for line in done.stdout.splitlines()]
    names = {r["kernel"] for r in rows}
    assert names == {"_rms_norm_kernel", "_rope_kernel", "_silu_and_mul_kernel",
                     "_write_kv_kernel", "_argmax_kernel", "_skinny_linear_kernel",
                     "_attention_kernel"}
    for r in rows:
        assert r["cubin_bytes"] > 0, r
        gdc = r["constexprs"].get("GDC", False)
        # A kernel launched with PDL waits for the one before and lets the next one in; one
        # launched plainly carries neither instruction.
        assert r["gdc_wait"] == r["gdc_launch_dependents"] == gdc, r
    assert sum(r["constexprs"].get("GDC", False) for r in rows) == 5  # rope, 3 skinny, attention
    attention = [r for r in rows if r["kernel"] == "_attention_kernel"]
    assert len(attention) == 3 and all(r["hints"] for r in attention)
    for r in attention:
        # Keys load as vectors (one 2-byte load per key and thread without the kernel's
        # hints: 64 a step, 255 registers), and nothing spills.
        assert r["loads_2_bytes"] == 0 and r["stack_bytes"] == 0, r
        assert r["registers"] <= 200, r
    one_row = [r for r in rows if r["kernel"] == "_skinny_linear_kernel" and r["hints"]]
    assert len(one_row) == 3
    for r in one_row:
        # The weight streams in 16-byte loads (the one 2-byte load is the residual's element
        # where the product is added to it), and nothing spills.
        assert r["loads_16_bytes"] >= 8 and r["loads_2_bytes"] <= 1, r
        assert r["stack_bytes"] == 0, r
