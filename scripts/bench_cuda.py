"""The CUDA fast path on a GPU: decode-step time against the memory-bandwidth floor.

A benchmark program, not a test (it needs a CUDA GPU; nothing else depends on it):

    python scripts/bench_cuda.py --out runs/cuda                  # builds a Llama-3-8B shape
    python scripts/bench_cuda.py --model DIR --batch-sizes 1,16

1. Builds the model with ``build-model --device cuda`` (random bf16 weights) unless --model.
2. Measures the card: device-to-device copy bandwidth (bytes read + written) and a bf16 matmul.
3. Decode steps at each batch size and context, three ways side by side in interleaved rounds
   on one loaded model: the eager reference (PyTorch attention over a padded gather, every
   operator launched from Python), the Triton kernels launched from Python, and the Triton
   kernels replayed from CUDA graphs (the default). For each: the executor step, what the engine
   waits for (input preparation, transfers, forward pass, sampling, the sync), and the forward
   pass alone on CUDA events.
4. A per-kernel profile of one Triton decode step at batch 1 (torch.profiler): where GPU time goes.

Writes ``bench_cuda.json`` to --out and prints it as the last line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import time
from pathlib import Path

import torch

from fluidserve.core.scheduler.output import ScheduledChunk, SchedulerOutput
from fluidserve.model.inputs import prepare_inputs
from fluidserve.model.runner import ModelExecutor
from fluidserve.profiler.run import measure_peaks
from fluidserve.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0)
H100_SXM_HBM_BYTES_PER_S = 3.35e12  # datasheet
MODES = ("eager", "triton", "triton+graphs")


def chunk(rid: str, start: int, n: int, table: tuple[int, ...]) -> ScheduledChunk:
    ids = tuple(100 + (start + i) % 1000 for i in range(n))
    return ScheduledChunk(rid, start, ids, table, True, GREEDY, 0, 0, is_decode=n == 1)


def set_mode(ex: ModelExecutor, mode: str, graphs) -> None:
    ex.worker.attention = "eager" if mode == "eager" else "triton"
    ex.worker.graphs = graphs if mode == "triton+graphs" else None


def fill(ex: ModelExecutor, batch: int, ctx: int, steps: int) -> list[tuple[int, ...]]:
    """Prefill ``batch`` requests of ``ctx`` tokens; their block tables."""
    bs = ex.block_size
    per = -(-(ctx + steps + 1) // bs)
    tables = [tuple(range(i * per, (i + 1) * per)) for i in range(batch)]
    set_mode(ex, "triton", None)
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
    return {"step_ms": statistics.median(step_ms), "forward_ms": statistics.median(fwd_ms)}


def kernel_profile(ex: ModelExecutor, tables, ctx: int) -> list[dict]:
    from torch.profiler import ProfilerActivity, profile

    set_mode(ex, "triton", None)
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
    args = ap.parse_args()
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
                       max_model_len=4096, attention_backend="triton",
                       cuda_graph_max_batch=max(batches))
    graphs = ex.worker.graphs
    print(f"loaded and captured in {time.perf_counter() - t0:.0f} s", flush=True)
    arch = ex.arch
    peaks = measure_peaks("cuda", torch.bfloat16)
    weight_bytes = arch.num_params * 2
    embed_bytes = arch.vocab_size * arch.hidden_size * 2  # a decode reads one row of it
    results = []
    for batch, ctx in cases:
        tables = fill(ex, batch, ctx, args.steps)
        runs = {m: [] for m in MODES}
        for _ in range(args.rounds):
            for mode in MODES:
                set_mode(ex, mode, graphs)
                runs[mode].append(time_decodes(ex, tables, ctx, args.steps))
        kv_read = batch * (ctx + args.steps / 2) * arch.kv_bytes_per_token(2)
        row = {"batch": batch, "context": ctx,
               "bytes_read_per_step": weight_bytes - embed_bytes + kv_read}
        for mode, rs in runs.items():
            row[mode] = {k: statistics.median(r[k] for r in rs) for k in rs[0]}
        results.append(row)
        print(json.dumps(row), flush=True)
    try:  # optional: the step times above stand without it
        profile_rows = kernel_profile(ex, fill(ex, 1, 512, 2), 512)
    except Exception as e:  # noqa: BLE001 - a profiler that cannot run here
        profile_rows = [{"kernel": f"profiler failed: {e!r}"[:200], "calls": 0,
                         "ms_per_step": 0.0}]
    gpu = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,clocks.max.sm,"
                          "clocks.max.mem", "--format=csv,noheader"], capture_output=True,
                         text=True).stdout.strip()
    floor_datasheet = weight_bytes / H100_SXM_HBM_BYTES_PER_S
    floor_measured = weight_bytes / peaks["memory_bandwidth_bytes_per_s"]
    summary = {
        "gpu": gpu, "torch": torch.__version__, "model": model,
        "num_params": arch.num_params, "weight_bytes": weight_bytes, "peaks": peaks,
        "hbm_floor_ms": {"weights_over_datasheet_3.35TBps": floor_datasheet * 1e3,
                         "weights_over_measured_copy": floor_measured * 1e3},
        "decode": results, "kernel_profile_bs1_ctx512": profile_rows,
    }
    (out / "bench_cuda.json").write_text(json.dumps(summary, indent=1))
    print(f"{'batch':>5} {'ctx':>5} | " + " | ".join(f"{m:>22}" for m in MODES))
    for r in results:
        cells = [f"{r[m]['step_ms']:7.2f} ({r[m]['forward_ms']:6.2f})" for m in MODES]
        print(f"{r['batch']:>5} {r['context']:>5} | " + " | ".join(f"{c:>22}" for c in cells))
    print(f"floor: {floor_datasheet * 1e3:.2f} ms (datasheet), {floor_measured * 1e3:.2f} ms"
          f" (measured copy {peaks['memory_bandwidth_bytes_per_s'] / 1e12:.2f} TB/s)")
    for p in profile_rows:
        print(f"{p['ms_per_step']:8.3f} ms {p['calls']:5d}x  {p['kernel']}")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
