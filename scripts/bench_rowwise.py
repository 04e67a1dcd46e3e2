"""The compiled row-wise kernels alone: SiLU-and-mul, RMSNorm, residual add + RMSNorm, RoPE.

The race model's shapes (hidden 1024, intermediate 2816, 16 query and 4 kv heads of 64, bf16),
sixteen layers each with its own tensors, as a step of the engine touches them (one set reused
would sit in the CPU's caches and flatter the kernel), at each of ``--rows`` (default 40: a
batch of decodes; 2048: a prefill iteration at the saturated burst's budget).

For each kernel, rows and thread count, one JSON line: the median time of the sixteen layers
and the nanoseconds per element per thread. ``--against FILE`` builds a variant of the kernels
(the main file of an edited copy of ``fluidserve/kernels/csrc``, or one self-contained source;
repeat for several) and times it beside them, interleaved, with ``identical`` (every output bit
equal, on the benchmark's inputs and on a set of special values: zeros, signed zeros,
infinities, NaN, denormals and the exponential's under- and overflow) and, where not,
``max_abs_diff``. ``--march x86-64-v3`` builds them all for AVX2.

    python scripts/bench_rowwise.py
    python scripts/bench_rowwise.py --rows 40 2048 --against /tmp/variant/cpu_kernels.cpp
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from bench_attention import add_variant_arguments, kernel_variants

HIDDEN, INTER, H, HKV, D, LAYERS, CTX = 1024, 2816, 16, 4, 64, 16, 4096
KERNELS = ("silu_and_mul", "rms_norm", "fused_add_rms_norm", "rope")


def rope_tables(ctx: int = CTX, base: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 cos / sin tables of rotate-half RoPE, [ctx, D], as the model's Rotary keeps."""
    inv = 1.0 / base ** (torch.arange(0, D, 2, dtype=torch.float32) / D)
    ang = torch.outer(torch.arange(ctx, dtype=torch.float32), inv)
    ang = torch.cat([ang, ang], dim=-1)
    return ang.cos().contiguous(), ang.sin().contiguous()


def special_values(n: int, gen: torch.Generator) -> torch.Tensor:
    """n bf16 values: random ones with the special ones of float arithmetic spread among them."""
    x = torch.randn(n, generator=gen) * 4
    special = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), 1e-39, -1e-39,
                            -87.5, -88.5, 88.5, 89.0, -120.0, 120.0, 3e38, -3e38, 1e-30])
    idx = torch.randperm(n, generator=gen)[:special.numel() * 8]
    x[idx] = special.repeat(8)[:idx.numel()]
    return x.to(torch.bfloat16)


def inputs(kernel: str, rows: int, gen: torch.Generator, special: bool = False) -> list[tuple]:
    """Per layer, the inputs of ``kernel`` for ``rows`` tokens."""
    def t(*shape: int) -> torch.Tensor:
        n = 1
        for s in shape:
            n *= s
        x = special_values(n, gen) if special else torch.randn(n, generator=gen).bfloat16()
        return x.view(*shape)

    layers = []
    for _ in range(LAYERS):
        if kernel == "silu_and_mul":
            layers.append((t(rows, 2 * INTER),))
        elif kernel in ("rms_norm", "fused_add_rms_norm"):
            w = (1 + 0.1 * torch.randn(HIDDEN, generator=gen)).bfloat16()
            layers.append((t(rows, HIDDEN), t(rows, HIDDEN), w))
        else:
            pos = torch.randint(0, CTX, (rows,), generator=gen)
            layers.append((t(rows, (H + 2 * HKV) * D), pos))
    return layers


def fresh(kernel: str, layers: list[tuple]) -> list[tuple]:
    """The arguments of one pass, made before the clock starts: the outputs allocated (and
    touched, so that no page is first faulted in while timed), the in-place kernels' inputs
    copied."""
    if kernel == "silu_and_mul":
        return [(gu, gu.new_zeros(gu.size(0), gu.size(1) // 2)) for (gu,) in layers]
    if kernel == "rms_norm":
        return [(x, torch.zeros_like(x), w) for x, _, w in layers]
    if kernel == "fused_add_rms_norm":
        return [(x.clone(), res.clone(), w) for x, res, w in layers]
    return [(qkv.clone(), pos) for qkv, pos in layers]


def run(mod, kernel: str, layers: list[tuple], tables) -> list[torch.Tensor]:
    """Run ``kernel`` of module ``mod`` over every layer's arguments (from ``fresh``); its
    outputs."""
    outs = []
    for args in layers:
        if kernel == "silu_and_mul":
            gu, out = args
            mod.silu_and_mul(out, gu)
            outs.append(out)
        elif kernel == "rms_norm":
            x, out, w = args
            mod.rms_norm(out, x, w, 1e-5)
            outs.append(out)
        elif kernel == "fused_add_rms_norm":
            x, res, w = args
            mod.fused_add_rms_norm(x, res, w, 1e-5)
            outs += [x, res]
        else:
            qkv, pos = args
            n = qkv.size(0)
            q = qkv[:, :H * D].view(n, H, D)
            k = qkv[:, H * D:(H + HKV) * D].view(n, HKV, D)
            mod.rope(q, k, pos, *tables)
            outs.append(qkv)
    return outs


def elements(kernel: str, rows: int) -> int:
    """Output elements of one layer: what the per-element time divides by."""
    return rows * {"silu_and_mul": INTER, "rms_norm": HIDDEN, "fused_add_rms_norm": HIDDEN,
                   "rope": (H + HKV) * D}[kernel]


def same_bits(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x.view(torch.int16), y.view(torch.int16))
               for x, y in zip(a, b, strict=True))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kernels", nargs="*", choices=KERNELS, default=list(KERNELS))
    ap.add_argument("--rows", type=int, nargs="*", default=[40, 2048],
                    help="tokens of a step (default 40 2048)")
    ap.add_argument("--threads", type=int, nargs="*", default=[2, 1])
    ap.add_argument("--rounds", type=int, default=9)
    add_variant_arguments(ap)
    args = ap.parse_args()
    if min(args.rows, default=1) < 1 or args.rounds < 1:
        raise SystemExit("--rows and --rounds must be positive")
    kernels = kernel_variants(args)
    ops = kernels["kernel"]
    tables = rope_tables()
    gen = torch.Generator().manual_seed(0)
    for kernel in args.kernels:
        for rows in args.rows:
            layers = inputs(kernel, rows, gen)
            special = inputs(kernel, rows, gen, special=True)[:1]
            for threads in args.threads:
                torch.set_num_threads(threads)
                times = {label: [] for label in kernels}
                outs = {}
                for _ in range(args.rounds + 1):  # the first round warms up
                    for label, mod in kernels.items():
                        todo = fresh(kernel, layers)
                        t0 = time.perf_counter()
                        outs[label] = run(mod, kernel, todo, tables)
                        times[label].append(time.perf_counter() - t0)
                row = {"kernel": kernel, "rows": rows, "threads": threads, "layers": LAYERS}
                for label, ts in times.items():
                    t = statistics.median(ts[1:])
                    row[f"{label}_ms"] = round(t * 1e3, 3)
                    row[f"{label}_ns_per_element"] = round(
                        t * 1e9 * threads / (LAYERS * elements(kernel, rows)), 3)
                if len(kernels) > 1:
                    first, *others = outs.values()
                    firsts = run(ops, kernel, fresh(kernel, special), tables)
                    row["identical"] = all(
                        same_bits(first, o)
                        and same_bits(firsts, run(m, kernel, fresh(kernel, special), tables))
                        for o, m in zip(others, list(kernels.values())[1:], strict=True))
                    if not row["identical"]:
                        row["max_abs_diff"] = max(
                            (a.float() - b.float()).nan_to_num().abs().max().item()
                            for o in others for a, b in zip(first, o, strict=True))
                print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
