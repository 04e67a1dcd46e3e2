"""`fluidserve profile`: characterize the engine on this machine (Sarathi-Serve Figs. 1, 3, 6, 14).

Measures, on a real model through the real executor:
  (a) iteration time vs tokens in the batch, and where the knee is;
  (b) decode throughput vs batch size, prefill throughput vs prompt length;
  (c) chunked-prefill overhead vs chunk size, and iterations of several short prompts beside
      one prompt of as many tokens (what attention adds to a long one);
  (d) a generation-stall timeline: ongoing decodes while a long prompt arrives, vllm vs sarathi;
  (e) engine overhead: the share of a step that is not the forward pass, with many running
      requests;
plus achieved weight bandwidth and FLOP/s against this machine's measured peaks.
Writes PNG plots and ``profile.json`` to the output directory; the JSON is also the last line.
"""

from __future__ import annotations

import json
import logging
import random
import statistics
import time
from pathlib import Path

import torch
from tqdm import tqdm

from fluidserve.config import ConfigError, EngineConfig, ProfileConfig
from fluidserve.core.scheduler.output import ScheduledChunk, SchedulerOutput
from fluidserve.model.arch import read_arch
from fluidserve.model.runner import ModelExecutor
from fluidserve.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=1)
FULL = {
    "tokens": [1, 8, 16, 32, 64, 128, 256, 384, 512, 768, 1024, 1536, 2048],
    "batch_sizes": [1, 2, 4, 8, 16, 32, 64],
    "decode_context": 512,
    "chunk_prompt": 2048,
    "chunk_sizes": [128, 256, 512, 1024, 2048],
    "batched_prompts": [(4, 128), (8, 128), (16, 128), (8, 256), (4, 512)],  # (k, tokens)
    "stall_prompt": 2048,
    "stall_budget": 256,
    "stall_decodes": 4,
    "overhead_running": [32, 128],
    "overhead_context": 256,
}
QUICK = {
    "tokens": [1, 16, 64, 128],
    "batch_sizes": [1, 4],
    "decode_context": 32,
    "chunk_prompt": 128,
    "chunk_sizes": [32, 128],
    "batched_prompts": [(4, 16), (2, 64)],
    "stall_prompt": 96,
    "stall_budget": 32,
    "stall_decodes": 2,
    "overhead_running": [4],
    "overhead_context": 16,
}


def _chunk(rid: str, start: int, n: int, bs: int, base_block: int) -> ScheduledChunk:
    blocks = tuple(range(base_block, base_block + -(-(start + n) // bs)))
    return ScheduledChunk(
        rid, start, tuple([5] * n), blocks, True, GREEDY, 0, 0, is_decode=n == 1 and start > 0
    )


class Timer:
    """Times points, each a list of steps (plans) whose times add up, in interleaved rounds.

    A warm-up round runs every point once untimed; each of ``repeats`` timed rounds then
    visits every point once, in an order shuffled per round, and a point reports the median
    of its rounds. On a shared machine whose speed drifts by tens of percent over minutes, a
    slow spell so touches one sample of every point instead of all samples of the points
    measured during it, and the points stay comparable with each other (what a cost model
    fitted to them needs)."""

    def __init__(self, ex: ModelExecutor, repeats: int, seed: int = 0) -> None:
        self.ex, self.repeats, self.seed = ex, repeats, seed

    def run(self, chunks: list[ScheduledChunk]) -> float:
        return self.ex.execute(SchedulerOutput(0, chunks)).execution_time

    def rounds(self, points: list[list[list[ScheduledChunk]]], desc: str) -> list[list[float]]:
        """Per point, its total time in each timed round (in round order)."""
        samples: list[list[float]] = [[] for _ in points]
        order = list(range(len(points)))
        rng = random.Random(self.seed)
        bar = tqdm(total=(self.repeats + 1) * len(points), desc=desc, leave=False)
        for r in range(self.repeats + 1):
            rng.shuffle(order)
            for i in order:
                total = sum(self.run(plan) for plan in points[i])
                if r:  # round 0 is the warm-up
                    samples[i].append(total)
                bar.update()
        bar.close()
        return samples


def _point(samples: list[float]) -> dict:
    """A point's median time and its rounds' spread (max / min), from the samples."""
    return {"time_s": statistics.median(samples), "spread": max(samples) / min(samples),
            "samples_s": samples}


def measure_peaks(device: str, dtype: torch.dtype) -> dict:
    """The machine's matmul and copy peaks. On CPU the matmul peak is the faster of the model
    dtype and float32: where the CPU has no bf16/fp16 instructions ATen multiplies them in
    scalar code, and an engine widens them to float32 instead (as fluidserve's panels do)."""
    cuda = torch.device(device).type == "cuda"
    sync = (lambda: torch.cuda.synchronize(device)) if cuda else (lambda: None)
    n = 8192 if cuda else 2048
    reps = 20 if cuda else 5
    rates = {}
    for dt in dict.fromkeys([dtype] if cuda else [dtype, torch.float32]):
        a = torch.randn(n, n, device=device).to(dt)
        b = torch.randn(n, n, device=device).to(dt)
        torch.matmul(a, b)
        sync()
        t0 = time.perf_counter()
        for _ in range(reps):
            torch.matmul(a, b)
        sync()
        rates[str(dt).removeprefix("torch.")] = 2 * n**3 * reps / (time.perf_counter() - t0)
    matmul_dtype, flops = max(rates.items(), key=lambda kv: kv[1])
    x = torch.empty((2048 if cuda else 256) << 20, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    y.copy_(x)
    sync()
    t0 = time.perf_counter()
    for _ in range(reps):
        y.copy_(x)
    sync()
    bw = 2 * x.numel() * reps / (time.perf_counter() - t0)  # read + write
    return {"matmul_flops": flops, "matmul_dtype": matmul_dtype, "matmul_flops_by_dtype": rates,
            "memory_bandwidth_bytes_per_s": bw}


def sweeps(t: Timer, tokens: list[int], batch_sizes: list[int], ctx: int, prompt: int,
           chunk_sizes: list[int], batched: list[tuple[int, int]] = ()
           ) -> tuple[list[dict], list[dict], list[dict], list[dict]]:
    """(a) iteration time vs tokens, (b) decode steps vs batch size at one context, (c) a
    prompt prefilled in chunks of each size and iterations of k fresh prompts of n tokens
    each (``batched``: (k, n) pairs), all timed in the same interleaved rounds. Beside (a)'s
    single prompts of k * n tokens, (c)'s batches separate attention's quadratic work from
    the linears' (a single prompt's grow together)."""
    bs = t.ex.block_size
    per_req = -(-(ctx + 1) // bs)
    # Request "a" (prefills, chunks) owns blocks from 0; decode request i from base + i * per_req;
    # batched prompt i from i * its blocks.
    base = -(-max(max(tokens), prompt) // bs)
    if any(k * -(-n // bs) > base for k, n in batched):
        raise ValueError("batched prompts need more blocks than the longest single prompt")
    for i in range(max(batch_sizes)):  # fill each decode request's context once
        t.run([_chunk(f"r{i}", 0, ctx, bs, base + i * per_req)])
    points = [[[_chunk("a", 0, n, bs, 0)]] for n in tokens]
    points += [[[_chunk(f"r{i}", ctx, 1, bs, base + i * per_req) for i in range(b)]]
               for b in batch_sizes]
    points += [[[_chunk("a", s, min(c, prompt - s), bs, 0)] for s in range(0, prompt, c)]
               for c in chunk_sizes]
    points += [[[_chunk(f"b{i}", 0, n, bs, i * -(-n // bs)) for i in range(k)]]
               for k, n in batched]
    samples = t.rounds(points, "(a-c) iterations, decodes, chunked and batched prefills")
    it = iter(samples)
    iters = [{"tokens": n} | _point(next(it)) for n in tokens]
    for p in iters:
        p["prefill_tokens_per_s"] = p["tokens"] / p["time_s"]
    decodes = [{"batch_size": b, "context": ctx} | _point(next(it)) for b in batch_sizes]
    for p in decodes:
        p["decode_tokens_per_s"] = p["batch_size"] / p["time_s"]
    chunks = [{"chunk_size": c, "prompt": prompt} | _point(next(it)) for c in chunk_sizes]
    whole = next((p["time_s"] for p in chunks if p["chunk_size"] >= prompt), chunks[-1]["time_s"])
    for p in chunks:
        p["overhead"] = p["time_s"] / whole - 1.0
    single = {p["tokens"]: p["time_s"] for p in iters}
    batches = [{"prompts": k, "prompt_tokens": n, "tokens": k * n} | _point(next(it))
               for k, n in batched]
    for p in batches:  # against one prompt of as many tokens, where (a) timed one
        if p["tokens"] in single:
            p["vs_one_prompt"] = p["time_s"] / single[p["tokens"]]
    return iters, decodes, chunks, batches


def knee(points: list[dict]) -> int | None:
    """Smallest batch size (tokens) whose iteration takes twice as long as a 1-token one."""
    base = points[0]["time_s"]
    return next((p["tokens"] for p in points if p["time_s"] >= 2 * base), None)


def stall_timeline(model_dir: str, args: ProfileConfig, q: dict, scheduler: str) -> dict:
    from fluidserve.engine.engine import LLMEngine

    cfg = EngineConfig.create(
        model=model_dir,
        dtype=args.dtype,
        device=args.device,
        scheduler=scheduler,
        token_budget=q["stall_budget"] if scheduler == "sarathi" else 4096,
        num_kv_blocks=256 + q["stall_prompt"] // 16 + 16,
    )
    eng = LLMEngine(cfg)
    # A fresh engine pays first-use costs (allocations, kernel set-up for new shapes) in its
    # first steps: run the timeline's shapes once, untimed, so that neither scheduler's
    # timeline (vllm's ran first) carries them.
    eng.add_request("warm", [7] * q["stall_prompt"], SamplingParams(max_tokens=4,
                                                                     ignore_eos=True))
    while eng.has_unfinished():
        eng.step()
    decode = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    for i in range(q["stall_decodes"]):
        eng.add_request(f"d{i}", [5 + i] * 32, decode)
    steps, arrival = 0, 0.0
    while eng.has_unfinished():
        if steps == 10:
            eng.add_request(
                "long", [7] * q["stall_prompt"], SamplingParams(max_tokens=4, ignore_eos=True)
            )
            arrival = eng.clock.now()
        eng.step()
        steps += 1
    times: dict[str, list[float]] = {}
    for ev in eng.telemetry.tokens:
        if ev.request_id != "warm":
            times.setdefault(ev.request_id, []).append(ev.time)
    t0 = min(ts[0] for ts in times.values())
    gaps = [
        b - a
        for rid, ts in times.items()
        if rid != "long"
        for a, b in zip(ts, ts[1:], strict=False)
    ]
    return {
        "scheduler": scheduler,
        "token_budget": cfg.scheduler.token_budget,
        "decode_max_tbt_s": max(gaps),
        "decode_median_tbt_s": statistics.median(gaps),
        "long_prompt_ttft_s": times["long"][0] - arrival,
        "token_times": {rid: [x - t0 for x in ts] for rid, ts in times.items()},
        "long_arrival_s": arrival - t0,
    }


def engine_overhead(model_dir: str, args: ProfileConfig, running: int, context: int,
                    steps: int = 10) -> dict:
    """Step time of the engine with ``running`` decodes vs the time of its forward passes:
    the rest (scheduling, input preparation, sampling, state updates) is engine overhead."""
    from fluidserve.engine.engine import LLMEngine

    bs, budget = 16, max(running, 2048)
    # Decodes go first while the others prefill, so the first admitted decode for as many
    # steps as the prefills take: outputs long enough that all ``running`` stay to the end.
    max_tokens = -(-running * context // budget) + steps + 8
    cfg = EngineConfig.create(model=model_dir, dtype=args.dtype, device=args.device,
                              max_num_seqs=running, token_budget=budget,
                              num_kv_blocks=running * -(-(context + max_tokens) // bs) + 16)
    eng = LLMEngine(cfg)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for i in range(running):
        eng.add_request(f"r{i}", [5 + i % 50] * context, params)
    # Prefilling them all under a large budget stalls the first ones' decodes on purpose:
    # the engine's hint about such stalls (engine/core.py) is not for this setup.
    core_log = logging.getLogger("fluidserve.engine.core")
    level = core_log.level
    core_log.setLevel(logging.ERROR)
    try:
        while any(not r.is_decode for r in eng.scheduler.running) or eng.scheduler.num_waiting:
            eng.step()
        eng.step()  # the first decode-only step of this batch size, untimed (first-use costs)
    finally:
        core_log.setLevel(level)
    ex = eng.executor.worker
    forward, spent = ex.forward, [0.0]
    # CUDA runs the forward pass asynchronously: wait for it, or it looks free.
    sync = torch.cuda.synchronize if ex.device.type == "cuda" else (lambda: None)

    def timed(plan):
        sync()
        t = time.perf_counter()
        out = forward(plan)
        sync()
        spent[0] += time.perf_counter() - t
        return out

    ex.forward = timed
    def decoding() -> int:
        return sum(r.is_decode for r in eng.scheduler.running)

    if decoding() != running:
        raise RuntimeError(f"engine overhead: {decoding()} of {running} requests decoding")
    t0 = time.perf_counter()
    for _ in range(steps):
        eng.step()
    total = time.perf_counter() - t0
    ex.forward = forward
    batches = [it.num_decode_tokens for it in list(eng.telemetry.iterations)[-steps:]]
    if batches != [running] * steps:  # every timed step held all of them
        raise RuntimeError(f"engine overhead: decode batches of {batches}, not {running}")
    return {"running": running, "context": context, "decode_batches": batches,
            "step_s": total / steps,
            "forward_s": spent[0] / steps, "overhead_fraction": 1 - spent[0] / total}


def run_profile(args: ProfileConfig) -> int:
    from fluidserve.model.builder import cached_model_dir

    q = QUICK if args.quick else FULL
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    model_dir = args.model or str(cached_model_dir(args.shape, args.dtype))
    out_dir = Path(args.output_dir or f"runs/profile-{time.strftime('%Y%m%d-%H%M%S')}")
    out_dir.mkdir(parents=True, exist_ok=True)
    need_tokens = max(q["tokens"] + [q["chunk_prompt"]])
    blocks = -(-need_tokens // 16) + max(q["batch_sizes"]) * -(-(q["decode_context"] + 1) // 16)
    context = max(need_tokens, q["stall_prompt"] + 64)
    window = read_arch(model_dir).max_position_embeddings
    if window < context:
        raise ConfigError(f"{model_dir}: a context window of {window} tokens, but the"
                          f" {'quick' if args.quick else 'full'} profile runs prompts of up to"
                          f" {context} (take a longer model, e.g. --shape 250m, or --quick)")
    ex = ModelExecutor(
        model_dir,
        dtype=args.dtype,
        device=args.device,
        num_blocks=blocks + 1,
        max_model_len=context,
        # CUDA: decode batches replay graphs, as in the engine (cuda_graph_batch)
        cuda_graph_max_batch=max(q["batch_sizes"]) if args.device.startswith("cuda") else 0,
    )
    t = Timer(ex, args.repeats)
    arch = ex.arch
    # Linear weights may be prepacked (not parameters any more): count from the shape.
    weight_bytes = arch.num_params * ex.kv_caches[0][0].element_size()
    print(
        f"model {model_dir}: {arch.num_params / 1e6:.1f}M params, {args.dtype},"
        f" {torch.get_num_threads()} threads"
    )
    peaks = measure_peaks(args.device, ex.kv_caches[0][0].dtype)
    iters, decodes, chunks, batches = sweeps(t, q["tokens"], q["batch_sizes"],
                                             q["decode_context"], q["chunk_prompt"],
                                             q["chunk_sizes"], q["batched_prompts"])
    del ex, t
    stalls = [stall_timeline(model_dir, args, q, s) for s in ("vllm", "sarathi")]
    overhead = [engine_overhead(model_dir, args, n, q["overhead_context"])
                for n in tqdm(q["overhead_running"], desc="(e) engine overhead", leave=False)]
    decode1 = decodes[0]["time_s"]
    best_prefill = max(iters, key=lambda p: p["prefill_tokens_per_s"])
    prefill_flops = 2 * arch.prefill_matmul_params * best_prefill["prefill_tokens_per_s"]
    achieved = {
        "decode_bs1_weight_bandwidth_bytes_per_s": weight_bytes / decode1,
        "decode_bs1_fraction_of_peak_bandwidth": weight_bytes
        / decode1
        / peaks["memory_bandwidth_bytes_per_s"],
        # The linears' FLOPs (attention adds ~3% at 384 tokens on the 250m model).
        "prefill_flops": prefill_flops,
        "prefill_fraction_of_peak_flops": prefill_flops / peaks["matmul_flops"],
    }
    result = {
        "model": str(model_dir),
        "num_params": arch.num_params,
        "dtype": args.dtype,
        "threads": torch.get_num_threads(),
        "repeats": args.repeats,
        "peaks": peaks,
        "achieved": achieved,
        "iteration_time": iters,
        "knee_tokens": knee(iters),
        "decode": decodes,
        "chunked_prefill": chunks,
        "batched_prefill": batches,
        "stall": [{k: v for k, v in s.items() if k != "token_times"} for s in stalls],
        "engine_overhead": overhead,
    }
    (out_dir / "profile.json").write_text(
        json.dumps(result | {"stall_timelines": stalls}, indent=1)
    )
    if args.plots:
        from fluidserve.profiler.plots import plot_profile

        plot_profile(result, stalls, out_dir)
    print(summary(result))
    print(f"wrote {out_dir}")
    print(json.dumps(result))
    return 0


def summary(r: dict) -> str:
    """The profile in a few lines, for a person (the JSON follows for programs)."""
    it, dec, ch = r["iteration_time"], r["decode"], r["chunked_prefill"]
    whole = ch[-1]["time_s"]
    pk, ach = r["peaks"], r["achieved"]
    lines = [
        f"peaks: matmul {pk['matmul_flops'] / 1e9:.0f} GFLOP/s ({pk['matmul_dtype']}),"
        f" copy {pk['memory_bandwidth_bytes_per_s'] / 1e9:.1f} GB/s",
        "iteration time: " + ", ".join(f"{p['tokens']} tok {p['time_s'] * 1e3:.0f} ms"
                                        for p in it)
        + f" (doubles at {r['knee_tokens'] or '-'} tokens)",
        "decode: " + ", ".join(f"batch {p['batch_size']} {p['decode_tokens_per_s']:.0f} tok/s"
                               for p in dec) + f" (context {dec[0]['context']})",
        f"achieved: decode batch 1 reads weights at"
        f" {ach['decode_bs1_weight_bandwidth_bytes_per_s'] / 1e9:.1f} GB/s"
        f" ({ach['decode_bs1_fraction_of_peak_bandwidth']:.0%} of copy bandwidth); prefill"
        f" {ach['prefill_flops'] / 1e9:.0f} GFLOP/s ({ach['prefill_fraction_of_peak_flops']:.0%}"
        " of the matmul peak)",
        f"chunked prefill of {ch[0]['prompt']} tokens vs one chunk of"
        f" {ch[-1]['chunk_size']}: "
        + ", ".join(f"chunk {p['chunk_size']} {p['time_s'] / whole - 1:+.0%}" for p in ch[:-1]),
        "prompts batched vs one prompt of as many tokens: " + ", ".join(
            f"{p['prompts']} x {p['prompt_tokens']} {p['vs_one_prompt'] - 1:+.0%}"
            for p in r.get("batched_prefill", []) if "vs_one_prompt" in p),
        "stall test, max decode TBT: " + ", ".join(
            f"{s['scheduler']} (budget {s['token_budget']}) {s['decode_max_tbt_s'] * 1e3:.0f} ms"
            for s in r["stall"]),
        "engine overhead: " + ", ".join(
            f"{o['overhead_fraction']:.1%} of the step at {o['running']} running"
            for o in r["engine_overhead"]),
    ]
    spread = max(p["spread"] for p in (*it, *dec, *ch, *r.get("batched_prefill", [])))
    if r["repeats"] > 1:
        lines.append(f"the {r['repeats']} rounds of one point differed by up to {spread:.2f}x"
                     " (the machine's noise; each point reports its median)")
    return "\n".join(lines)
