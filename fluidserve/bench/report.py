"""Summaries of a run: per-request metrics, aggregates, the run directory, and comparisons."""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from fluidserve.bench.fluidity import (
    TARGET_FLUIDITY,
    TARGET_QUANTILE,
    fluid_token_rate,
    fluidity_index,
)
from fluidserve.bench.records import RequestRecord
from fluidserve.metrics import summarize, to_json

Deadline = Callable[[int], float]  # prompt length -> TTFT deadline D_p


def constant_deadline(d: float) -> Deadline:
    return lambda _prompt_len: d


def score_fluidity(records: Sequence[RequestRecord], ttft_deadline: Deadline, tbt_deadline: float
                   ) -> None:
    for r in records:
        if r.ok:
            r.ttft_deadline = ttft_deadline(r.prompt_len)
            r.fluidity_index = fluidity_index(r.gaps, r.ttft_deadline, tbt_deadline)


def summarize_run(records: Sequence[RequestRecord], tbt_deadline: float, duration: float | None
                  = None) -> dict:
    """Aggregate metrics of a run. Failed requests are counted, never silently dropped: they
    count as not fluid in ``fraction_fluid_requests`` and the fluid token generation rate,
    the gaps of the part of their stream that arrived count in ``tbt_s``, and a run that
    completed none served 0 requests/s; the other latencies are those of completed requests."""
    ok = [r for r in records if r.ok and r.gaps]
    ttft = [r.gaps[0] for r in ok]
    tbt = [g for r in records for g in r.gaps[1:]]
    e2e = [sum(r.gaps) for r in ok]
    tpot = [sum(r.gaps[1:]) / (len(r.gaps) - 1) for r in ok if len(r.gaps) > 1]
    norm = [sum(r.gaps) / len(r.gaps) for r in ok]
    delays = [r.scheduling_delay for r in ok if r.scheduling_delay is not None]
    fi = [r.fluidity_index for r in ok if r.fluidity_index is not None]
    if duration is None:
        ends = [t for r in ok for t in r.token_times()[-1:]]
        starts = [r.sent for r in records if r.sent is not None]
        duration = (max(ends) - min(starts)) if ends and starts else 0.0
    out_tokens = sum(r.num_output_tokens for r in ok)
    fluid_rate, fluid_d = fluid_token_rate([r.gaps for r in ok], len(records) - len(ok))
    mean_tpot = float(np.mean(tpot)) if tpot else math.nan
    p99_tbt = float(np.quantile(tbt, 0.99)) if tbt else math.nan
    errors: dict[str, int] = {}
    for r in records:
        if not r.ok:
            errors[r.error[:120]] = errors.get(r.error[:120], 0) + 1
    return {
        "num_requests": len(records),
        "num_completed": len(ok),
        "num_failed": len(records) - len(ok),
        "errors": errors,
        "duration_s": duration,
        "request_throughput": len(ok) / duration if duration else 0.0 if not ok else math.nan,
        "output_token_throughput": out_tokens / duration if duration
        else 0.0 if not ok else math.nan,
        "total_output_tokens": out_tokens,
        "total_prompt_tokens": sum(r.prompt_len for r in ok),
        "ttft_s": summarize(ttft),
        "tbt_s": summarize(tbt),
        "tpot_s": summarize(tpot),
        "normalized_latency_s": summarize(norm),
        "e2e_latency_s": summarize(e2e),
        "scheduling_delay_s": summarize(delays) if delays else None,
        "fluidity_index": summarize(fi),
        "tbt_deadline_s": tbt_deadline,
        "fraction_fluid_requests": (sum(f >= TARGET_FLUIDITY for f in fi) / len(records))
        if records else math.nan,
        "fluid_token_generation_rate": fluid_rate,
        "fluid_tbt_deadline_s": fluid_d,
        "tpot_based_token_rate": _rate(mean_tpot),
        "p99_tbt_based_token_rate": _rate(p99_tbt),
    }


def _rate(interval: float) -> float:
    """Tokens per second at one token every ``interval`` seconds: unbounded (inf) when tokens
    came bundled (a zero interval), NaN when there was no interval to measure."""
    if math.isnan(interval):
        return math.nan
    return 1.0 / interval if interval > 0 else math.inf


def fluidity_slo_met(summary: dict) -> bool:
    """Etalon's fluidity SLO: 99% of requests keep fluidity-index >= 0.9."""
    return summary["num_failed"] == 0 and summary["fraction_fluid_requests"] >= TARGET_QUANTILE


CSV_COLUMNS = ("index", "prompt_len", "output_len", "num_output_tokens", "scheduled", "sent",
               "ttft", "tpot", "e2e", "max_tbt", "scheduling_delay", "fluidity_index", "error")


def _csv_row(r: RequestRecord) -> list:
    g = r.gaps
    tpot = sum(g[1:]) / (len(g) - 1) if len(g) > 1 else None
    return [r.index, r.prompt_len, r.output_len, r.num_output_tokens, r.scheduled, r.sent,
            g[0] if g else None, tpot, sum(g) if g else None, max(g[1:], default=None),
            r.scheduling_delay, r.fluidity_index, r.error or ""]


def write_run(out_dir: Path, records: Sequence[RequestRecord], summary: dict) -> None:
    """requests.jsonl (every field, raw gaps included), requests.csv, summary.json."""
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / "requests.jsonl", "w") as f:
        for r in records:
            f.write(to_json(r.to_dict()) + "\n")
    with open(out_dir / "requests.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(CSV_COLUMNS)
        w.writerows(_csv_row(r) for r in records)
    (out_dir / "summary.json").write_text(to_json(summary, indent=1))


def load_run(run_dir: str | Path) -> tuple[list[RequestRecord], dict]:
    run_dir = Path(run_dir)
    if not (run_dir / "summary.json").is_file():
        raise ValueError(f"{run_dir} is not a run directory (no summary.json)")
    records = []
    path = run_dir / "requests.jsonl"
    try:
        if path.is_file():
            with open(path) as f:
                records = [RequestRecord(**json.loads(line)) for line in f if line.strip()]
        path = run_dir / "summary.json"
        summary = json.loads(path.read_text())
    except (json.JSONDecodeError, TypeError) as e:  # (a line that is not a record)
        raise ValueError(f"{path}: not a `fluidserve bench` result ({e})") from None
    if not isinstance(summary, dict):
        raise ValueError(f"{path}: not a `fluidserve bench` result")
    return records, summary


ROWS = [
    ("completed / failed", lambda s: f"{s['num_completed']} / {s['num_failed']}"),
    ("request throughput (req/s)", lambda s: _f(s["request_throughput"])),
    ("output tokens/s", lambda s: _f(s["output_token_throughput"])),
    ("TTFT p50 / p99 (s)", lambda s: f"{_f(s['ttft_s']['p50'])} / {_f(s['ttft_s']['p99'])}"),
    ("TBT p50 / p99 (s)", lambda s: f"{_f(s['tbt_s']['p50'])} / {_f(s['tbt_s']['p99'])}"),
    ("TPOT mean (s)", lambda s: _f(s["tpot_s"]["mean"])),
    ("normalized latency p50 (s)", lambda s: _f(s["normalized_latency_s"]["p50"])),
    ("scheduling delay p50 (s)", lambda s: _f((s.get("scheduling_delay_s") or {}).get("p50"))),
    ("fluidity-index mean", lambda s: _f(s["fluidity_index"]["mean"])),
    ("requests with fluidity >= 0.9", lambda s: _f(s["fraction_fluid_requests"])),
    ("fluid token rate (tok/s)", lambda s: _f(s["fluid_token_generation_rate"])),
    ("TPOT-based rate (tok/s)", lambda s: _f(s["tpot_based_token_rate"])),
    ("P99-TBT-based rate (tok/s)", lambda s: _f(s["p99_tbt_based_token_rate"])),
    ("capacity (req/s)", lambda s: _f(s.get("capacity_qps"))),
]


def _f(x) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return f"{x:.4g}"


def run_names(run_dirs: Sequence[str | Path]) -> list[str]:
    """A column name per run: its directory's name, or its path where two names are alike
    (``runs/a/vllm`` and ``runs/b/vllm``)."""
    names = [Path(d).name for d in run_dirs]
    return names if len(set(names)) == len(names) else [str(Path(d)) for d in run_dirs]


def compare_table(run_dirs: Sequence[str | Path]) -> str:
    summaries = [(name, load_run(d)[1]) for name, d in zip(run_names(run_dirs), run_dirs,
                                                            strict=True)]
    rows = []
    for name, fn in ROWS:
        cells = []
        for _, s in summaries:
            try:
                cells.append(fn(s))
            except (KeyError, TypeError):
                cells.append("-")
        rows.append((name, cells))
    width = max(len(name) for name, _ in ROWS) + 2
    cols = [max(len(n), *(len(r[1][i]) for r in rows)) + 3 for i, (n, _) in enumerate(summaries)]
    lines = ["metric".ljust(width) + "".join(n.rjust(c) for (n, _), c in zip(summaries, cols,
                                                                              strict=True))]
    for name, cells in rows:
        lines.append(name.ljust(width) + "".join(x.rjust(c) for x, c in zip(cells, cols,
                                                                            strict=True)))
    return "\n".join(lines)
