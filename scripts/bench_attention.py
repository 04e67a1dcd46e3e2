"""The compiled paged-attention kernel alone: a decode batch and a prefill batch, per thread count.

The race model's attention shape (16 query heads, 4 kv heads, head_dim 64; ``--heads`` for
another), bf16, blocks of 16, sixteen layers each with its own cache so that a step reads its
KV from memory as the engine's does (one cache reused would sit in the CPU's caches and
flatter the kernel):

  decode   N requests of one query token over C tokens of context, on block tables of
           ``--tables``: ``random`` (every block anywhere, the default), ``contiguous``
           (each request's blocks one after the other, as a fresh engine hands out a
           prompt's), or ``churned`` (the tables the engine's own BlockManager leaves after
           3000 decode steps of requests arriving and finishing: at 40 x 290, 29% of the
           blocks follow the one before them in memory)
  prefill  S runs of P tokens (``SxP``), each attending causally to itself, or the last P
           tokens of S prompts of C + P tokens over the C cached before them (``SxP@C``:
           a prompt's later chunk); the prefill kernel's path where the CPU has one
  mixed    with ``--mixed SxP@C+NxC2``: a hybrid batch, the prefill runs of ``SxP@C`` and the
           decodes of ``NxC2`` in one call, as a chunked-prefill iteration holds them
           (``1x448@512+30x300``: a mixed iteration of the capacity probe)

For each: the median time of the sixteen layers and, for decode, the KV bytes read per
second. ``--against FILE`` builds a second variant of the kernels (the main file of an edited
copy of ``fluidserve/kernels/csrc``, or one self-contained source) and times both in the same
rounds, interleaved, with the largest difference of their outputs (``--against`` repeated:
each file its own variant, labelled by its directory's or file's name): how a kernel change
is judged on a machine whose speed drifts by more than the change. ``--march`` builds them
all for another instruction set (``x86-64-v3``: the AVX2 paths). ``--min-long-run`` times the
kernel at several thresholds of the prefill path the same way (default: the engine's for bf16
here).
Prints JSON lines.

    python scripts/bench_attention.py
    python scripts/bench_attention.py --against /tmp/variant/cpu_kernels.cpp --threads 2
    python scripts/bench_attention.py --march x86-64-v3 --against /tmp/a/cpu_kernels.cpp \
        --against /tmp/b/cpu_kernels.cpp
    python scripts/bench_attention.py --prefill 4x8@512 --min-long-run 2 1000000000
    python scripts/bench_attention.py --tables churned --against /tmp/a/cpu_kernels.cpp
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import torch

from fluidserve.core.block_manager import BlockManager
from fluidserve.kernels import build_error, cpu_ops, variant_label, variant_ops
from fluidserve.model.attention import min_long_run, new_kv_cache

H, HKV, D, BS, LAYERS = 16, 4, 64, 16, 16


def kv_caches(blocks: int, gen: torch.Generator) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each layer's random key and value caches of ``blocks`` blocks, allocated as the
    engine's are (``new_kv_cache``: on huge pages where the OS grants them). On 4 KB pages
    (``FLUIDSERVE_NO_HUGE_PAGES=1``) a decode's scattered blocks miss the TLB: 40 decodes of
    290 tokens on two cores of an AMX Xeon VM took 13.0 ms on random tables against 11.2 on
    huge pages (contiguous tables: 12.3-12.5 against 9.8-10.9)."""
    caches = []
    for _ in range(LAYERS):
        k, v = new_kv_cache(blocks, BS, HKV, D, torch.bfloat16, torch.device("cpu"))
        k.copy_(torch.randn(k.shape, generator=gen))
        v.copy_(torch.randn(v.shape, generator=gen))
        caches.append((k, v))
    return caches


def churned_tables(n: int, ctx: int, num_blocks: int, steps: int = 3000,
                   seed: int = 0) -> torch.Tensor:
    """[n, ctx / BS] block tables as a server's BlockManager leaves them: n requests
    running, each growing a token a step, each replaced when done by one of max(200, ctx)
    to max(520, ctx + 1) prompt tokens and 16-127 outputs; then each table's first ctx / BS
    blocks (every prompt has at least ctx tokens)."""
    per = -(-ctx // BS)
    rng = random.Random(seed)
    bm, goal, count = BlockManager(num_blocks, BS), {}, 0

    def admit() -> None:
        nonlocal count
        rid, prompt = f"r{count}", rng.randrange(max(200, ctx), max(520, ctx + 1))
        count += 1
        assert bm.allocate(rid, prompt), "the cache is too small for the churn"
        goal[rid] = [prompt, prompt + rng.randrange(16, 128)]

    for _ in range(n):
        admit()
    for _ in range(steps):
        for rid in list(goal):
            goal[rid][0] += 1
            assert bm.allocate(rid, goal[rid][0]), "the cache is too small for the churn"
            if goal[rid][0] >= goal[rid][1]:
                bm.free(rid)
                del goal[rid]
                admit()
    return torch.tensor([bm.table(rid)[:per] for rid in sorted(goal)], dtype=torch.int32)


def decode_case(n: int, ctx: int, gen: torch.Generator, layout: str = "random") -> tuple:
    per = -(-ctx // BS)
    # (churned: a pool four times what n of the longest requests can hold, room to churn in)
    blocks = n * per + 1 if layout != "churned" else 4 * n * -(-(max(520, ctx) + 128) // BS)
    caches = kv_caches(blocks, gen)
    if layout == "churned":
        tables = churned_tables(n, ctx, blocks)
    elif layout == "contiguous":
        tables = (torch.arange(n * per, dtype=torch.int32) + 1).view(n, per)
    else:
        tables = (torch.randperm(blocks - 1, generator=gen)[: n * per].int() + 1).view(n, per)
    slots = (tables[:, (ctx - 1) // BS].long() * BS + (ctx - 1) % BS).contiguous()
    meta = (slots, torch.arange(n + 1, dtype=torch.int32), torch.full((n,), ctx, dtype=torch.int32),
            tables.contiguous())
    qkv = [torch.randn(n, h, D, generator=gen).bfloat16() for h in (H, HKV, HKV)]
    return caches, meta, qkv, n * ctx * HKV * D * 2 * 2 * LAYERS


def runs_case(runs: list[tuple[int, int]], gen: torch.Generator) -> tuple:
    """One batch of runs, each (context, query tokens): its last query tokens attend to its
    whole context, on blocks scattered at random over a pool that holds them all."""
    ctxs = [c for c, _ in runs]
    pers = [-(-c // BS) for c in ctxs]
    blocks = sum(pers) + 1
    caches = kv_caches(blocks, gen)
    order = (torch.randperm(blocks - 1, generator=gen) + 1).int()
    tables = torch.zeros(len(runs), max(pers), dtype=torch.int32)
    slots, used = [], 0
    for r, ((c, q_len), per) in enumerate(zip(runs, pers, strict=True)):
        tables[r, :per] = order[used:used + per]
        used += per
        pos = torch.arange(c - q_len, c)
        slots.append(tables[r, pos // BS].long() * BS + pos % BS)
    q_lens = torch.tensor([q for _, q in runs])
    cu_q = torch.cat([torch.zeros(1, dtype=torch.int32), q_lens.cumsum(0).int()])
    meta = (torch.cat(slots).contiguous(), cu_q, torch.tensor(ctxs, dtype=torch.int32), tables)
    t = int(cu_q[-1])
    qkv = [torch.randn(t, h, D, generator=gen).bfloat16() for h in (H, HKV, HKV)]
    return caches, meta, qkv, 0


def prefill_case(s: int, p: int, gen: torch.Generator, cached: int = 0) -> tuple:
    return runs_case([(cached + p, p)] * s, gen)


def mixed_case(spec: str, gen: torch.Generator) -> tuple:
    """The prefill runs and the decodes of ``SxP@C+NxC2`` in one batch, runs first."""
    prefill, _, decode = spec.partition("+")
    runs, _, cached = prefill.partition("@")
    (s, p), (n, ctx_d) = ((int(x) for x in part.split("x")) for part in (runs, decode))
    return runs_case([(int(cached or 0) + p, p)] * s + [(ctx_d, 1)] * n, gen)


def add_variant_arguments(ap: argparse.ArgumentParser) -> None:
    """The kernel benchmarks' ``--against FILE`` (repeatable) and ``--march``."""
    ap.add_argument("--against", type=Path, action="append", default=[], metavar="FILE",
                    help="a variant of the kernel source to time beside it; repeat for several")
    ap.add_argument("--march", default="native",
                    help="build the kernels and their variants for this -march (x86-64-v3: the"
                    " AVX2 paths on a CPU that has wider ones)")


def kernel_variants(args: argparse.Namespace) -> dict:
    """The package's kernels built for ``args.march`` ("kernel"), then each ``--against``
    source built beside them ("variant", or each one's ``variant_label`` where several)."""
    ops = cpu_ops(args.march)
    if ops is None:
        raise SystemExit(f"no compiled kernels: {build_error(args.march)}")
    kernels = {"kernel": ops}
    for i, path in enumerate(args.against):
        label = "variant" if len(args.against) == 1 else variant_label(path)
        if label in kernels:
            raise SystemExit(f"--against: two variants named {label!r}")
        kernels[label] = variant_ops(path, i, args.march)
    return kernels


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--decode", default="40x290", help="requests x context (default 40x290)")
    ap.add_argument("--prefill", default="8x256",
                    help="runs x tokens[@cached context] (default 8x256)")
    ap.add_argument("--mixed", help="a hybrid batch too: prefill runs + decodes,"
                    " SxP[@C]+NxC (1x448@512+30x300: a mixed iteration of the capacity probe)")
    ap.add_argument("--tables", choices=("random", "contiguous", "churned"), default="random",
                    help="the decode batch's block tables (default random)")
    ap.add_argument("--threads", type=int, nargs="*", default=[2, 1])
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--heads", default="16,4,64",
                    help="query heads, kv heads, head_dim (default 16,4,64: the race model's;"
                    " 32,8,128: Llama-3-8B's)")
    add_variant_arguments(ap)
    ap.add_argument("--min-long-run", type=int, nargs="*",
                    help="thresholds (query tokens) of the prefill path to time side by side")
    args = ap.parse_args()
    global H, HKV, D
    try:
        H, HKV, D = (int(x) for x in args.heads.split(","))
    except ValueError:
        ap.error(f"--heads: three integers H,HKV,D, got {args.heads!r}")
    if H % HKV or D % 16:
        ap.error(f"--heads {args.heads}: H a multiple of HKV, D of 16")
    kernels = kernel_variants(args)
    ops = kernels["kernel"]
    gen = torch.Generator().manual_seed(0)
    dn, dc = (int(x) for x in args.decode.split("x"))
    runs, _, cached = args.prefill.partition("@")
    pn, pp = (int(x) for x in runs.split("x"))
    cases = {"decode": decode_case(dn, dc, gen, args.tables),
             "prefill": prefill_case(pn, pp, gen, int(cached or 0))}
    if args.mixed:
        try:
            cases["mixed"] = mixed_case(args.mixed, gen)
        except ValueError:
            ap.error(f"--mixed: SxP[@C]+NxC, got {args.mixed!r}")
    thresholds = args.min_long_run or [min_long_run(ops, torch.bfloat16)]
    variants = {(f"{label}@{t}" if len(thresholds) > 1 else label): (mod, t)
                for label, mod in kernels.items() for t in thresholds}
    for name, (caches, (slots, cu_q, ctx, tables), (q, k, v), kv_bytes) in cases.items():
        for threads in args.threads:
            torch.set_num_threads(threads)
            times = {label: [] for label in variants}
            outs = {}
            for _ in range(args.rounds + 1):  # the first round warms up
                for label, (mod, threshold) in variants.items():
                    out = torch.empty_like(q)
                    t0 = time.perf_counter()
                    for kc, vc in caches:
                        mod.paged_attention(out, q, k, v, kc, vc, slots, cu_q, ctx, tables,
                                            D**-0.5, threshold)
                    times[label].append(time.perf_counter() - t0)
                    outs[label] = out
            row = {"case": name,
                   "shape": {"decode": args.decode, "prefill": args.prefill}.get(name, args.mixed),
                   "heads": args.heads,
                   **({"tables": args.tables} if name == "decode" else {}),
                   "threads": threads, "layers": LAYERS}
            for label, ts in times.items():
                t = statistics.median(ts[1:])
                row[f"{label}_ms"] = round(t * 1e3, 2)
                if kv_bytes:
                    row[f"{label}_kv_gb_s"] = round(kv_bytes / t / 1e9, 1)
            if len(outs) > 1:
                first, *others = outs.values()
                row["max_abs_diff"] = max((first.float() - o.float()).abs().max().item()
                                          for o in others)
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
