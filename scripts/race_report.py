"""Tables and plots of a `race_vllm_cpu.py` run (race.json)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def _ratio(a, b) -> str:
    return f"{a / b:.2f}x" if a and b else "n/a"


def _row(name: str, unit: str, v, f, target: str, better: str) -> str:
    fmt = (lambda x: f"{x:.1f}") if max(abs(v or 0), abs(f or 0)) >= 10 else (lambda x: f"{x:.3f}")
    vs = fmt(v) if v is not None else "n/a"
    fs = fmt(f) if f is not None else "n/a"
    return f"| {name} | {unit} | {vs} | {fs} | {_ratio(f, v)} | {target} | {better} |"


def weight_bytes(model_dir: str) -> int:
    """bf16 bytes a decode step reads: every weight but the embedding table, of which it
    reads one row (a tied table is read whole, as the LM head)."""
    from fluidserve.model.arch import read_arch

    a = read_arch(model_dir)
    untied_embedding = 0 if a.tie_word_embeddings else a.vocab_size * a.hidden_size
    return (a.num_params - untied_embedding) * 2


def model_words(model_dir: str) -> str:
    """'213M parameters, GQA 16/4, 16 layers' for the model directory."""
    from fluidserve.model.arch import read_arch

    a = read_arch(model_dir)
    n = a.num_params
    size = f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.0f}M"
    return f"{size} parameters, GQA {a.num_heads}/{a.num_kv_heads}, {a.num_layers} layers"


def _fluidserve_flags(result: dict) -> str:
    """The fluidserve flags of the workloads, as prose: one set, or the set of each."""
    per = result.get("fluidserve_workload_args") or {}
    if len(set(per.values())) <= 1:
        return f"`{result['fluidserve_args']}`"
    return ", ".join(f"`{flags}` for {w}" for w, flags in per.items())


def report(result: dict, out: Path, commands: list[str]) -> str:
    e, m = result["engines"], result["machine"]
    v, f = e.get("vllm", {}), e.get("fluidserve", {})
    floor_ms = weight_bytes(result["model"]) / (m["read_bandwidth_gb_s"] * 1e9) * 1e3
    g = lambda d, w, k: (d.get(w) or {}).get(k)  # noqa: E731
    sat, poi = _sizes(result, "saturated"), _sizes(result, "poisson")
    rows = [
        "| metric | unit | vllm-cpu | fluidserve | fluidserve / vllm | target | better |",
        "|---|---|---|---|---|---|---|",
        _row("decode, batch 1: median ITL", "ms", g(v, "decode-bs1", "median_itl_ms"),
             g(f, "decode-bs1", "median_itl_ms"), "<= 0.8x", "lower"),
        _row(f"saturated ({sat['label']} at once): total throughput", "tok/s",
             g(v, "saturated", "total_token_throughput"),
             g(f, "saturated", "total_token_throughput"), ">= 1.2x", "higher"),
        _row("saturated: median ITL", "ms", g(v, "saturated", "median_itl_ms"),
             g(f, "saturated", "median_itl_ms"), "", "lower"),
        _row(f"Poisson {poi['rate']} req/s ({poi['label']}): P99 ITL", "ms",
             g(v, "poisson", "p99_itl_ms"),
             g(f, "poisson", "p99_itl_ms"), "<= 0.5x", "lower"),
        _row("Poisson: P50 TTFT", "ms", g(v, "poisson", "median_ttft_ms"),
             g(f, "poisson", "median_ttft_ms"), "<= 1.2x", "lower"),
        _row(f"Poisson: output throughput (offered: {poi['offered']:.3g} tok/s)", "tok/s",
             g(v, "poisson", "output_throughput"), g(f, "poisson", "output_throughput"),
             "keeps up", "higher"),
    ]
    if "long-prompt" in v or "long-prompt" in f:  # (races before 2026-12-07 ran none)
        rows.append(_row(f"long prompt ({_sizes(result, 'long-prompt')['label']}, one at a"
                         " time): median TTFT", "ms", g(v, "long-prompt", "median_ttft_ms"),
                         g(f, "long-prompt", "median_ttft_ms"), "", "lower"))
    fb = lambda d, k: (d.get("poisson_fluidserve_bench") or {}).get(k)  # noqa: E731
    rate = "fluid_token_generation_rate"
    rows.append(_row("Poisson (fluidserve bench): fluid token rate", "tok/s", fb(v, rate),
                     fb(f, rate), "", "higher"))
    rows.append(_row("Poisson (fluidserve bench): fraction of fluid requests", "",
                     fb(v, "fraction_fluid_requests"), fb(f, "fraction_fluid_requests"), "",
                     "higher"))
    caps = result.get("capacity") or {}
    cap_rows = []
    # The ratio row needs both engines' searches (a run may hold one side's only: the table
    # below lists what it has).
    both = all(any(k.startswith(e) for k in caps) for e in ("vllm", "fluidserve"))
    if both:
        best_v = max((c["capacity_qps"] or 0, k) for k, c in caps.items() if k.startswith("vllm"))
        best_f = max((c["capacity_qps"] or 0, k) for k, c in caps.items()
                     if k.startswith("fluidserve"))
        bound = _upper_bound(caps, "vllm")
        # Races before --delay-metric ttft held fluidserve to its reported scheduling delay
        # and vllm-cpu (which reports none) to its TTFT.
        metrics = {((c.get("variants") or {}).get("endpoint") or {}).get("delay_metric")
                   for c in caps.values()}
        delay = "median TTFT" if metrics == {"ttft"} else \
            "median sched. delay (vllm-cpu: its TTFT)"
        name = (f"capacity (P99 TBT <= 0.2 s, {delay} <= 2 s), best"
                f" configuration of each ({'every budget' if bound else best_v[1]},"
                f" {best_f[1]})")
        if best_v[0] == 0 and bound:  # every vllm probe missed: its capacity is below them
            rows.append(f"| {name} | req/s | < {bound:.3g} (every probe missed) |"
                        f" {best_f[0]:.3g} | > {best_f[0] / bound:.1f}x | >= 1.5x | higher |")
        elif best_v[0] and not _search(caps[best_v[1]]).get("upper_bound_qps"):
            # vllm-cpu met every rate its search probed: its capacity is at least that, the
            # ratio at most this
            rows.append(f"| {name} | req/s | >= {best_v[0]:.3g} (met every probe) |"
                        f" {best_f[0]:.3g} | <= {best_f[0] / best_v[0]:.2f}x | >= 1.5x |"
                        " higher |")
        else:
            rows.append(_row(name, "req/s", best_v[0], best_f[0], ">= 1.5x", "higher"))
        # (fluidserve's search is a lower bound the same way where it met every probe: the
        # table below says which searches converged)
        # Beside it, what each engine served where a probe saturated it: the SLO's capacity
        # turns on where a latency percentile lands on its bound, this throughput does not.
        sat = {e: [m for k, c in caps.items() if k.startswith(e)
                   for m, saturated in [_served(k, c, out)] if m is not None and saturated]
               for e in ("vllm", "fluidserve")}
        if sat["vllm"] and sat["fluidserve"]:
            rows.append(_row("capacity probes: most requests served where a probe saturated"
                             " the server (any configuration; not a target)", "req/s",
                             max(sat["vllm"]), max(sat["fluidserve"]), "", "higher"))
    if caps:
        def flags(k: str, c: dict) -> str:
            if c.get("args"):
                return c["args"]
            if k.startswith("vllm"):
                return "--max-num-batched-tokens " + k.split("-")[1]
            return result["fluidserve_args"]

        def converged(c: dict) -> bool | None:
            return c.get("converged", (c.get("variants") or {}).get("endpoint", {})
                         .get("converged"))

        def served(k: str, c: dict) -> str:
            most, saturated = _served(k, c, out)
            return "n/a" if most is None else f"{most:.3g}" + (" (saturated)" if saturated else "")

        cap_rows = ["| server | flags | capacity (req/s) | most served (req/s) | converged |",
                    "|---|---|---|---|---|"] + [
            f"| {k} | `{flags(k, c)}` | {_capacity_cell(c)} | {served(k, c)} | {converged(c)} |"
            for k, c in caps.items()]
    lines = [
        "## Head to head with vLLM's CPU build",
        "",
        f"Measured {result['started']} on {m['cpu']} ({m['cores']} cores), torch {m['torch']}:",
        "both engines serve the same locally built model",
        f"(`{Path(result['model']).name}`: a bf16 Llama, {model_words(result['model'])}),",
        f"one at a time, with a {2048}-token context and a 1 GiB KV cache; prefix caching off on",
        "vLLM (vllm-cpu 0.32.0, default budget 2048, `VLLM_CPU_OMP_THREADS_BIND=0-1`). fluidserve",
        f"runs {_fluidserve_flags(result)}. Client: vLLM's own `vllm bench serve` (random",
        "prompts of exact length, `--ignore-eos --temperature 0`, 2 warm-up requests), and",
        "`fluidserve bench` for the Etalon metrics. "
        + ("Command:" if len(commands) == 1 else "Commands:"),
        "",
        *(f"    {c}" for c in commands),
        "",
        *rows,
        "",
        f"Memory-bandwidth floor of one decode step: {weight_bytes(result['model']) / 1e6:.0f} MB"
        f" of weights / {m['read_bandwidth_gb_s']:.1f} GB/s measured read bandwidth"
        f" = **{floor_ms:.1f} ms**.",
        "",
        *_repeats_line(v, f),
        *(["### Capacity", "", *cap_rows, ""] if cap_rows else []),
        *(["![ITL distribution under Poisson load](img/race-itl-cdf.png)", ""]
          if _has_poisson(result) else []),
    ]
    return "\n".join(lines)


def _search(c: dict) -> dict:
    """The search of a capacity result (`fluidserve capacity` nests it under its variant)."""
    return (c.get("variants") or {}).get("endpoint", c)


def _served(key: str, c: dict, out: Path) -> tuple[float | None, bool | None]:
    """(the most requests per second a probe of this search served, whether some probe
    saturated the server): from the search, or for races older than those figures from the
    probes in the run directory's capacity.json."""
    s = _search(c)
    if "most_served_qps" not in s:
        from fluidserve.bench.capacity import served_stats

        path = out / f"{key}-capacity" / "capacity.json"
        if not path.is_file():
            return None, None
        probes = json.loads(path.read_text()).get("probes") or {}
        s = served_stats(probes.get("endpoint") or [])
    return s["most_served_qps"], s["saturated"]


def _upper_bound(caps: dict, prefix: str) -> float | None:
    """The largest rate any search of ``prefix`` missed at, where none met the SLO."""
    bounds = [_search(c).get("upper_bound_qps") for k, c in caps.items() if k.startswith(prefix)]
    return max(bounds) if bounds and all(bounds) else None


def _capacity_cell(c: dict) -> str:
    s = _search(c)
    if not c["capacity_qps"] and s.get("upper_bound_qps"):
        missed = [p["value"] for p in s.get("curve", []) if not p["ok"]]
        tbt = f", P99 TBT {missed[0]:.2f} s there" if missed else ""
        return f"< {s['upper_bound_qps']:.3g} (misses at {s['upper_bound_qps']:.3g}{tbt})"
    return f"{c['capacity_qps']:.3g}"


# The workload sizes of runs that did not record theirs (the defaults of that time).
DEFAULT_SIZES = {"saturated": dict(num_prompts=40, input_len=256, output_len=64, rate="inf"),
                 "poisson": dict(num_prompts=50, input_len=512, output_len=64, rate="1")}


def _sizes(result: dict, workload: str) -> dict:
    w = (result.get("workloads") or DEFAULT_SIZES)[workload]
    label = f"{w['num_prompts']} x {w['input_len']}/{w['output_len']}"
    rate = w.get("rate", "inf")
    offered = float(rate) * w["output_len"] if rate != "inf" else float("inf")
    return {"label": label, "rate": rate, "offered": offered}


def _repeats_line(v: dict, f: dict) -> list[str]:
    """The spread of a repeated workload (saturated), when it was repeated."""
    rv, rf = (v.get("saturated") or {}).get("repeats"), (f.get("saturated") or {}).get("repeats")
    if not rv or not rf:
        return []
    def span(r: list[float]) -> str:
        return f"{min(r):.0f}–{max(r):.0f}"

    line = (f"Saturated: the run of median throughput of {len(rv)} (prompt seeds 0–{len(rv) - 1});"
            f" total tok/s over the runs: vllm-cpu {span(rv)}, fluidserve {span(rf)}.")
    pairs = (f.get("saturated") or {}).get("pair_ratios")
    if pairs:
        line += (" The runs alternated between the two servers, seed by seed; fluidserve /"
                 " vllm-cpu per seed: " + ", ".join(f"{r:.2f}x" for r in pairs) +
                 f" (median **{f['saturated']['median_pair_ratio']:.2f}x**).")
    return [line, ""]


BEGIN = "<!-- race results: generated by scripts/race_vllm_cpu.py -->"
END = "<!-- end of race results -->"


def write_doc(doc: Path, text: str, out: Path, begin: str = BEGIN, end: str = END) -> None:
    """Put the generated report between the markers of ``doc`` (the hand-written analysis
    around them is kept), or, without them, start the file (append to it when it exists and
    the markers are not the race's); copy the race plot beside it if there is one."""
    import shutil

    block = f"{begin}\n{text}\n{end}"
    old = doc.read_text() if doc.exists() else ""
    if begin in old and end in old:
        head, rest = old.split(begin, 1)
        block = head + block + rest.split(end, 1)[1]
    elif old and begin != BEGIN:
        block = old.rstrip("\n") + "\n\n" + block
    doc.write_text(block if block.endswith("\n") else block + "\n")
    img = doc.parent / "img"
    img.mkdir(exist_ok=True)
    if (out / "race-itl-cdf.png").exists():
        shutil.copy(out / "race-itl-cdf.png", img / "race-itl-cdf.png")


def _poisson_itls(engine: dict) -> list[float]:
    """Every inter-token latency of an engine's Poisson runs (none: it did not run one)."""
    return [x for per in (engine.get("poisson") or {}).get("itls") or [] for x in per]


def _has_poisson(result: dict) -> bool:
    return any(_poisson_itls(r) for r in result["engines"].values())


def plot(result: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    curves = {tag: itls for tag, r in result["engines"].items() if (itls := _poisson_itls(r))}
    if not curves:  # a race without the Poisson workload (--workloads) has nothing to draw
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    for tag, itls in curves.items():
        xs = np.sort(np.asarray(itls) * 1e3)
        ax.plot(xs, np.arange(1, len(xs) + 1) / len(xs), label=tag)
    ax.set_xscale("log")
    ax.set_xlabel("inter-token latency (ms)")
    ax.set_ylabel("CDF")
    poi = _sizes(result, "poisson")
    ax.set_title(f"Poisson {poi['rate']} req/s, {poi['label']} (vllm bench serve)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "race-itl-cdf.png", dpi=120)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description="Re-render a race's tables and plots from its"
                                 " run directory (race.json), optionally into a document.")
    ap.add_argument("run", type=Path, help="the race's --out directory")
    ap.add_argument("doc", type=Path, nargs="?", help="write the report here too")
    args = ap.parse_args()
    path = args.run / "race.json"
    if not path.is_file():
        ap.error(f"{path}: no such file (is {args.run} a race_vllm_cpu.py --out directory?)")
    res = json.loads(path.read_text())
    plot(res, args.run)
    text = report(res, args.run, res.get("commands", ["python scripts/race_vllm_cpu.py ..."]))
    if args.doc:
        write_doc(args.doc, text, args.run)
    print(text)


if __name__ == "__main__":
    main()
