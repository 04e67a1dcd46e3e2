"""The CUDA fast path on a GPU: decode-step time against the memory-bandwidth floor.

A benchmark program, not a test (it needs a CUDA GPU; nothing else depends on it):

    python scripts/bench_cuda.py --out runs/cuda                  # builds a Llama-3-8B shape
    python scripts/bench_cuda.py --model DIR --batch-sizes 1,16

1. Builds the model with ``build-model --device cuda`` (random bf16 weights) unless --model.
2. Measures the card: device-to-device copy bandwidth (bytes read + written) and a bf16 matmul.
3. The projections of a one-row decode step alone (skip with ``--no-linears``): for each of
   the model's five weight shapes, cuBLAS (F.linear) against ``skinny_linear`` at each
   candidate tiling (with programmatic dependent launch where the card has it, and the rule's
   tiling without), over all 32 layers' weights (nothing comes from L2), replayed from a CUDA
   graph; GB/s of weight read. The best tiling per shape goes into SKINNY_TUNED.
4. Decode steps at each batch size and context, the ``--modes`` side by side in interleaved
   rounds on one loaded model: ``eager`` (the PyTorch reference: attention over a padded
   gather, every operator launched from Python), ``triton`` (the Triton kernels layer by
   layer, launched from Python), ``graphs`` (the same replayed from CUDA graphs), ``skinny``
   (graphs in which a one-row batch takes the few-rows path: one skinny_linear per projection
   with the norms, SiLU and residual adds folded in, RoPE writing the KV cache; the rule's
   tilings; every kernel of a layer launched with PDL where the card has it),
   ``skinny-nopdl`` (the same launched without PDL), ``skinny-proj-pdl`` (PDL for the
   projections only, RoPE and attention launched plainly) and ``skinny-tuned`` (at the
   tilings step 3 chose). For each: the executor step, the forward pass alone on CUDA events,
   and the host's parts of a step (building the inputs, launching the forward pass, sampling
   with the sync), which tell where the step's time beyond the forward pass goes.
5. A per-kernel profile of one decode step at batch 1 (torch.profiler, Python launches) on the
   layer-by-layer and the few-rows paths: where GPU time goes.
6. Requests decoding through the engine core (``--engine-batches``; skip with
   ``--engine-tokens 0``), in the ``--engine-mode`` graphs: the median gap between a request's
   tokens, synchronous (the host applies a step's tokens, schedules and builds the next step
   while the GPU idles) and with asynchronous scheduling (the next step is launched first),
   side by side in interleaved rounds: the decode step a client sees, less HTTP.

Writes ``bench_cuda.json`` to --out and prints a table of the step times last.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import time
import traceback
from pathlib import Path

import torch
from engine_gaps import engine_gaps

from fluidserve.core.scheduler.output import ScheduledChunk, SchedulerOutput
from fluidserve.kernels import triton_ops
from fluidserve.model.cuda_graphs import DecodeGraphs
from fluidserve.model.inputs import prepare_inputs
from fluidserve.model.runner import ModelExecutor
from fluidserve.model.sampler import sample
from fluidserve.profiler.run import measure_peaks
from fluidserve.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0)
HBM_BYTES_PER_S = {"H100": 3.35e12, "H200": 4.8e12}  # datasheets (SXM)


def datasheet_bandwidth() -> float:
    name = torch.cuda.get_device_name()
    return next((bw for key, bw in HBM_BYTES_PER_S.items() if key in name), 3.35e12)


MODES = ("eager", "triton", "graphs", "skinny", "skinny-nopdl", "skinny-proj-pdl",
         "skinny-tuned")
# Tilings tried for one row: (block_n, block_k, warps, stages, dot).
CANDIDATES = [(8, 1024, 8, 3, False), (8, 1024, 4, 3, False), (8, 512, 4, 3, False),
              (8, 256, 2, 3, False), (4, 1024, 4, 3, False), (16, 512, 8, 3, False),
              (16, 256, 4, 4, True)]


def chunk(rid: str, start: int, n: int, table: tuple[int, ...]) -> ScheduledChunk:
    ids = tuple(100 + (start + i) % 1000 for i in range(n))
    return ScheduledChunk(rid, start, ids, table, True, GREEDY, 0, 0, is_decode=n == 1)


def set_mode(ex: ModelExecutor, mode: str, graphs: dict) -> None:
    """Route decode steps through ``mode``: its attention backend, its captured graphs (if
    any), whether a single row takes the skinny path and whether it launches with PDL."""
    ex.worker.attention = "eager" if mode == "eager" else "triton"
    ex.worker.graphs = graphs.get(mode)
    triton_ops.SKINNY_MAX_ROWS = 1 if mode.startswith("skinny") else 0
    triton_ops.SKINNY_PDL = False if mode == "skinny-nopdl" else None
    triton_ops.ATTENTION_PDL = mode != "skinny-proj-pdl"


def capture(ex: ModelExecutor, mode: str, max_batch: int) -> DecodeGraphs:
    set_mode(ex, mode, {})
    return DecodeGraphs(ex.worker, max_batch)


def fill(ex: ModelExecutor, batch: int, ctx: int, steps: int) -> list[tuple[int, ...]]:
    """Prefill ``batch`` requests of ``ctx`` tokens; their block tables."""
    bs = ex.block_size
    per = -(-(ctx + steps + 1) // bs)
    tables = [tuple(range(i * per, (i + 1) * per)) for i in range(batch)]
    set_mode(ex, "triton", {})
    for i, table in enumerate(tables):
        for s in range(0, ctx, 2048):
            ex.execute(SchedulerOutput(0, [chunk(f"r{i}", s, min(2048, ctx - s), table)]))
    return tables


def time_decodes(ex: ModelExecutor, tables, ctx: int, steps: int) -> dict:
    """Median executor step and forward pass (ms) over ``steps`` decodes at positions ctx..."""
    plans = [SchedulerOutput(s, [chunk(f"r{i}", ctx + s, 1, t) for i, t in enumerate(tables)])
             for s in range(steps)]
    for p in plans[:3]:  # warm-up
        ex.execute(p)
    step_ms, fwd_ms = [], []
    for p in plans:
        t0 = time.perf_counter()
        ex.execute(p)
        step_ms.append((time.perf_counter() - t0) * 1e3)
    inputs = [prepare_inputs(p, ex.block_size) for p in plans]
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.inference_mode():
        for x in inputs:
            start.record()
            ex.worker.forward(x)
            end.record()
            end.synchronize()
            fwd_ms.append(start.elapsed_time(end))
    return {"step_ms": statistics.median(step_ms), "forward_ms": statistics.median(fwd_ms),
            **host_breakdown(ex, plans)}


def host_breakdown(ex: ModelExecutor, plans) -> dict:
    """Median host time (µs) of a step's parts, the executor's own calls in order: building
    the inputs, launching the forward pass (the call returns once its work is queued), and
    sampling with the sync (which waits for the GPU). Between two steps the GPU idles for
    about the first two and the sync's return: what separates the step from the forward."""
    sync = torch.cuda.synchronize if ex.device.type == "cuda" else (lambda: None)
    parts: dict[str, list[float]] = {"prepare_us": [], "launch_us": [], "sample_sync_us": []}
    with torch.inference_mode():
        for p in plans:
            t0 = time.perf_counter()
            x = prepare_inputs(p, ex.block_size)
            t1 = time.perf_counter()
            out = ex.worker.forward(x)
            t2 = time.perf_counter()
            sample(out, x.sampling)
            sync()
            t3 = time.perf_counter()
            for key, dt in zip(parts, (t1 - t0, t2 - t1, t3 - t2), strict=True):
                parts[key].append(dt * 1e6)
    return {k: statistics.median(v) for k, v in parts.items()}


def capture_async(ex: ModelExecutor, mode: str, max_batch: int, last: torch.Tensor
                  ) -> DecodeGraphs:
    """``mode``'s graphs with the placeholder read of asynchronous scheduling captured in."""
    ex.worker.last_tokens = last
    try:
        return capture(ex, mode, max_batch)
    finally:
        ex.worker.last_tokens = None


def kernel_profile(ex: ModelExecutor, tables, ctx: int, mode: str) -> list[dict]:
    from torch.profiler import ProfilerActivity, profile

    set_mode(ex, mode, {})
    plan = SchedulerOutput(0, [chunk(f"r{i}", ctx, 1, t) for i, t in enumerate(tables[:1])])
    ex.execute(plan)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            ex.execute(plan)
    rows = []
    for e in prof.key_averages():
        total = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if total > 0:
            rows.append({"kernel": e.key[:90], "calls": e.count // 5,
                         "ms_per_step": total / 5 / 1e3})
    rows.sort(key=lambda r: -r["ms_per_step"])
    return rows[:15]


def replay_us(calls, reps: int = 10) -> float:
    """Median time (us) of one replay of ``calls`` captured in a CUDA graph."""
    for c in calls:  # warm-up: compiles outside the capture
        c()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for c in calls:
            c()
    g.replay()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        g.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def bench_linears(model) -> list[dict]:
    """Each projection shape of one row over every layer's weight: cuBLAS against the skinny
    tilings (launched with PDL where the card has it, and the rule's without)."""
    shapes = {
        "qkv": [layer.self_attn.qkv_proj.weight for layer in model.layers],
        "o": [layer.self_attn.o_proj.weight for layer in model.layers],
        "gate_up": [layer.mlp.gate_up_proj.weight for layer in model.layers],
        "down": [layer.mlp.down_proj.weight for layer in model.layers],
        "lm_head": [model.lm_head.weight] * 8,
    }
    out = []
    for name, weights in shapes.items():
        n, k = weights[0].shape
        x = torch.randn(1, k, device=weights[0].device, dtype=weights[0].dtype)
        nbytes = sum(w.numel() * w.element_size() for w in weights) / len(weights)
        ref = torch.nn.functional.linear(x, weights[0]).float()
        row = {"shape": name, "n": n, "k": k,
               "cublas_us": replay_us([lambda w=w, x=x: torch.nn.functional.linear(x, w)
                                       for w in weights]) / len(weights)}
        rule = triton_ops.skinny_config(1, n, k)
        tried = {}
        for pdl, cands in ((None, CANDIDATES), (False, [tuple(rule.__dict__.values())])):
            triton_ops.SKINNY_PDL = pdl
            for cand in cands:
                cfg = triton_ops.SkinnyConfig(*cand)
                key = str(cand) + ("" if pdl is None else " no-pdl")
                try:
                    got = triton_ops.skinny_linear(x, weights[0], config=cfg).float()
                    err = float((got - ref).norm() / ref.norm())
                    calls = [lambda w=w, c=cfg, x=x: triton_ops.skinny_linear(x, w, config=c)
                             for w in weights]
                    tried[key] = {"us": replay_us(calls) / len(weights), "rel_err": err}
                except Exception as e:  # noqa: BLE001 - a tiling this card cannot run
                    tried[key] = {"error": repr(e)[:200]}
        triton_ops.SKINNY_PDL = None
        ok = {key: v for key, v in tried.items() if "us" in v and "no-pdl" not in key}
        best = min(ok, key=lambda key: ok[key]["us"]) if ok else None
        rule_key = str(tuple(rule.__dict__.values()))
        row.update(candidates=tried, best=best, rule=rule_key,
                   rule_us=tried.get(rule_key, {}).get("us"),
                   rule_nopdl_us=tried.get(rule_key + " no-pdl", {}).get("us"),
                   cublas_gbps=nbytes / (row["cublas_us"] * 1e-6) / 1e9)
        if best is not None:
            row["best_us"] = ok[best]["us"]
            row["best_gbps"] = nbytes / (ok[best]["us"] * 1e-6) / 1e9
            cand = eval(best)  # noqa: S307 - our own tuple repr
            triton_ops.SKINNY_TUNED[(1, n, k)] = triton_ops.SkinnyConfig(*cand)
        out.append(row)
        print(f"{name:>8}: cuBLAS {row['cublas_us']:7.1f} us ({row['cublas_gbps']:5.0f} GB/s),"
              f" rule {row['rule_us'] or 0:7.1f} (no PDL {row['rule_nopdl_us'] or 0:7.1f}),"
              f" best {best} {row.get('best_us', 0):7.1f} us ({row.get('best_gbps', 0):5.0f}"
              f" GB/s)", flush=True)
        for key, v in tried.items():
            print(f"          {key:40} {v.get('us', 0):8.1f} us  err {v.get('rel_err', v)}")
    return out


def read_bandwidth() -> float:
    """Bytes/s of a sum over 4 GB (reads only): what a weight stream can hope for."""
    x = torch.ones(2 << 30, dtype=torch.bfloat16, device="cuda")
    x.sum()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(10):
        x.sum()
    torch.cuda.synchronize()
    bw = 10 * x.numel() * 2 / (time.perf_counter() - t0)
    del x
    return bw


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="Model directory (default: build --shape).")
    ap.add_argument("--shape", default="llama3-8b")
    ap.add_argument("--out", default="runs/cuda")
    ap.add_argument("--batch-sizes", default="1,8,32,64")
    ap.add_argument("--contexts", default="128,1024", help="Contexts (tokens) at batch 1.")
    ap.add_argument("--context", type=int, default=512, help="Context at the larger batches.")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--modes", default=",".join(MODES), help=f"Of {', '.join(MODES)}.")
    ap.add_argument("--no-linears", action="store_true",
                    help="Skip timing the projections alone.")
    ap.add_argument("--engine-mode", default="skinny", choices=MODES[2:],
                    help="Graphs the engine-core runs replay.")
    ap.add_argument("--engine-batches", default="1,8",
                    help="Requests decoding together in the engine-core runs.")
    ap.add_argument("--engine-tokens", type=int, default=64,
                    help="Tokens each request decodes in the engine-core runs (0: skip).")
    args = ap.parse_args()
    modes = args.modes.split(",")
    if unknown := set(modes) - set(MODES):
        ap.error(f"unknown modes {sorted(unknown)}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = args.model
    if model is None:
        from fluidserve.model.builder import build_model_dir

        model = str(out.parent / f"model-{args.shape}")
        if not (Path(model) / "config.json").exists():
            t0 = time.perf_counter()
            build_model_dir(model, args.shape, dtype="bfloat16", device="cuda")
            print(f"built {model} in {time.perf_counter() - t0:.0f} s", flush=True)
    batches = [int(b) for b in args.batch_sizes.split(",")]
    cases = [(1, int(c)) for c in args.contexts.split(",")]
    cases += [(b, args.context) for b in batches if b > 1]
    t0 = time.perf_counter()
    ex = ModelExecutor(model, dtype="bfloat16", device="cuda", kv_cache_memory_gb=8,
                       max_model_len=4096, attention_backend="triton", cuda_graph_max_batch=0)
    top = max(batches)
    graphs = {m: capture(ex, m, top) for m in modes  # skinny-tuned: after the tuning
              if m not in ("eager", "triton", "skinny-tuned")}
    print(f"loaded and captured in {time.perf_counter() - t0:.0f} s", flush=True)
    arch = ex.arch
    peaks = measure_peaks("cuda", torch.bfloat16)
    peaks["read_bandwidth_bytes_per_s"] = read_bandwidth()
    linears = []
    if not args.no_linears:
        try:  # the step times below stand without it
            linears = bench_linears(ex.worker.model)
        except Exception:  # noqa: BLE001
            traceback.print_exc()
    if "skinny-tuned" in modes:
        graphs["skinny-tuned"] = capture(ex, "skinny-tuned", top)
    weight_bytes = arch.num_params * 2
    embed_bytes = arch.vocab_size * arch.hidden_size * 2  # a decode reads one row of it
    results = []
    for batch, ctx in cases:
        tables = fill(ex, batch, ctx, args.steps)
        runs = {m: [] for m in modes}
        for _ in range(args.rounds):
            for mode in modes:
                set_mode(ex, mode, graphs)
                runs[mode].append(time_decodes(ex, tables, ctx, args.steps))
        kv_read = batch * (ctx + args.steps / 2) * arch.kv_bytes_per_token(2)
        row = {"batch": batch, "context": ctx,
               "bytes_read_per_step": weight_bytes - embed_bytes + kv_read}
        for mode, rs in runs.items():
            row[mode] = {k: statistics.median(r[k] for r in rs) for k in rs[0]}
        results.append(row)
        print(json.dumps(row), flush=True)
    profiles = {}
    for mode in ("triton", "skinny"):  # optional: the step times above stand without it
        try:
            profiles[mode] = kernel_profile(ex, fill(ex, 1, 512, 2), 512, mode)
        except Exception as e:  # noqa: BLE001 - a profiler that cannot run here
            profiles[mode] = [{"kernel": f"profiler failed: {e!r}"[:200], "calls": 0,
                               "ms_per_step": 0.0}]
    engine = []
    if args.engine_tokens:  # optional: the step times above stand without it
        try:
            mode = args.engine_mode
            set_mode(ex, mode, graphs)
            last = torch.zeros(256, dtype=torch.int32, device=ex.device)
            both = {"sync": graphs.get(mode) or capture(ex, mode, top),
                    "async": capture_async(ex, mode, top, last)}
            set_mode(ex, mode, graphs)
            for b in (int(x) for x in args.engine_batches.split(",")):
                engine.append({"mode": mode, **engine_gaps(ex, model, both, last, b, 128,
                                                           args.engine_tokens, 2)})
                print(json.dumps(engine[-1]), flush=True)
        except Exception:  # noqa: BLE001
            traceback.print_exc()
    gpu = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,clocks.max.sm,"
                          "clocks.max.mem", "--format=csv,noheader"], capture_output=True,
                         text=True).stdout.strip()
    floor_datasheet = weight_bytes / datasheet_bandwidth()
    floor_measured = weight_bytes / peaks["memory_bandwidth_bytes_per_s"]
    summary = {
        "gpu": gpu, "torch": torch.__version__, "model": model,
        "num_params": arch.num_params, "weight_bytes": weight_bytes, "peaks": peaks,
        "hbm_floor_ms": {"weights_over_datasheet": floor_datasheet * 1e3,
                         "datasheet_bytes_per_s": datasheet_bandwidth(),
                         "weights_over_measured_copy": floor_measured * 1e3},
        "linears": linears,
        "skinny_tuned": {str(k): v.__dict__ for k, v in triton_ops.SKINNY_TUNED.items()},
        "decode": results, "kernel_profile_bs1_ctx512": profiles, "engine": engine,
    }
    (out / "bench_cuda.json").write_text(json.dumps(summary, indent=1))
    print(f"{'batch':>5} {'ctx':>5} | " + " | ".join(f"{m:>22}" for m in modes))
    for r in results:
        cells = [f"{r[m]['step_ms']:7.2f} ({r[m]['forward_ms']:6.2f})" for m in modes]
        print(f"{r['batch']:>5} {r['context']:>5} | " + " | ".join(f"{c:>22}" for c in cells))
    for r in results:
        for m in modes:
            print(f"{r['batch']:>5} {r['context']:>5} {m:>16}: host µs: build inputs"
                  f" {r[m]['prepare_us']:.0f}, launch {r[m]['launch_us']:.0f}, sample and"
                  f" sync {r[m]['sample_sync_us']:.0f}")
    print(f"floor: {floor_datasheet * 1e3:.2f} ms (datasheet), {floor_measured * 1e3:.2f} ms"
          f" (measured copy {peaks['memory_bandwidth_bytes_per_s'] / 1e12:.2f} TB/s; reads"
          f" {peaks['read_bandwidth_bytes_per_s'] / 1e12:.2f} TB/s)")
    for e in engine:
        print(f"engine core, {e['mode']}, batch {e['batch']}: token gap {e['sync_gap_ms']:.2f}"
              f" ms synchronous, {e['async_gap_ms']:.2f} ms asynchronous"
              f" ({e['async_over_sync']:.3f}x)")
    for mode, rows in profiles.items():
        print(f"-- {mode}")
        for p in rows:
            print(f"{p['ms_per_step']:8.3f} ms {p['calls']:5d}x  {p['kernel']}")


if __name__ == "__main__":
    main()
