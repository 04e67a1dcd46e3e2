"""PNG plots of a run: latency/fluidity CDFs, token timeline, miss rate vs TBT, capacity curve."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from fluidserve.bench.fluidity import miss_rate_curve  # noqa: E402
from fluidserve.bench.records import RequestRecord  # noqa: E402


def _save(fig, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


CDF_POINTS = 2000  # a CDF line is drawn through this many quantiles at most
MISS_CURVE_STREAMS = 500  # the miss-rate curve is computed on this many requests at most


def _cdf(ax, values: Sequence[float], label: str | None = None) -> None:
    xs = np.sort(np.asarray(values, float))
    if len(xs) > CDF_POINTS:  # millions of TBT samples: the quantiles draw the same line
        q = np.linspace(0, 1, CDF_POINTS)
        ax.plot(np.quantile(xs, q), q, label=label)
    elif len(xs):
        ax.plot(xs, np.arange(1, len(xs) + 1) / len(xs), label=label)


def plot_run(records: Sequence[RequestRecord], summary: dict, out: Path, title: str = "") -> None:
    ok = [r for r in records if r.ok and r.gaps]
    if not ok:
        return
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    _cdf(axes[0], [r.gaps[0] for r in ok])
    axes[0].set(xlabel="TTFT (s)", ylabel="CDF", title="Time to first token")
    _cdf(axes[1], [g for r in ok for g in r.gaps[1:]])
    axes[1].set(xlabel="TBT (s)", title="Time between tokens", xscale="log")
    _cdf(axes[2], [r.fluidity_index for r in ok if r.fluidity_index is not None])
    axes[2].set(xlabel="fluidity-index", title=f"Fluidity (D_d = {summary['tbt_deadline_s']} s)")
    fig.suptitle(title)
    _save(fig, out / "cdfs.png")

    fig, ax = plt.subplots(figsize=(10, 4.5))
    shown = sorted(ok, key=lambda r: r.scheduled)[:40]
    for i, r in enumerate(shown):
        ts = r.token_times()
        ax.plot([r.sent, ts[0]], [i, i], c="lightgray", lw=1)
        ax.plot(ts, [i] * len(ts), "|", ms=4, c=f"C{i % 10}")
    ax.set(xlabel="time since start (s)", ylabel="request", title="Token timeline (gray: waiting "
           "for the first token; gaps in a row are stalls)")
    _save(fig, out / "token_timeline.png")

    gaps = [r.gaps for r in ok if len(r.gaps) > 1]
    if len(gaps) > MISS_CURVE_STREAMS:  # an evenly spaced subset (the plot says so)
        step = len(gaps) / MISS_CURVE_STREAMS
        gaps = [gaps[int(i * step)] for i in range(MISS_CURVE_STREAMS)]
    if gaps:
        tbt = [g for r in gaps for g in r[1:]]
        hi = max(np.quantile(tbt, 0.999) * 2, 1e-3)
        ds = np.geomspace(max(min(tbt + [hi]) / 2, hi / 1000), hi, 40)
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.plot(ds, miss_rate_curve(gaps, ds))
        ax.set(xscale="log", xlabel="target TBT deadline D_d (s)",
               ylabel="P99 deadline-miss rate",
               title=f"Deadline misses vs target TBT ({len(gaps)} requests)")
        ax.axhline(0.1, ls=":", c="gray")
        _save(fig, out / "miss_rate_vs_tbt.png")


def plot_capacity(curves: dict[str, list[dict]], metric: str, out: Path, slo: float | None
                  ) -> None:
    """curves: variant -> probes [{"rate", "value", "ok"}]; one load-latency line each, a dot
    for a probe that met the SLO and a cross for one that did not (the metric plotted may be
    within its bound while another part of the SLO failed: the delay bound, failed requests)."""
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for name, probes in curves.items():
        pts = sorted(probes, key=lambda p: p["rate"])
        line, = ax.plot([p["rate"] for p in pts], [p["value"] for p in pts], "-", label=name)
        for ok, marker in ((True, "o"), (False, "x")):
            sel = [p for p in pts if bool(p["ok"]) == ok]
            ax.plot([p["rate"] for p in sel], [p["value"] for p in sel], marker, ls="",
                    c=line.get_color())
    if any(not p["ok"] for probes in curves.values() for p in probes):
        ax.plot([], [], "kx", ls="", label="SLO missed")
    if slo is not None:
        ax.axhline(slo, ls="--", c="red", label="SLO")
    ax.set(xlabel="request rate (req/s)", ylabel=metric, title="Load vs latency (capacity search)")
    ax.legend()
    _save(fig, out / "capacity_curve.png")


def plot_compare(runs: dict[str, Sequence[RequestRecord]], out: Path) -> None:
    """TTFT, TBT and fluidity-index CDFs of several runs overlaid."""
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for name, records in runs.items():
        ok = [r for r in records if r.ok and r.gaps]
        _cdf(axes[0], [r.gaps[0] for r in ok], name)
        _cdf(axes[1], [g for r in ok for g in r.gaps[1:]], name)
        _cdf(axes[2], [r.fluidity_index for r in ok if r.fluidity_index is not None], name)
    axes[0].set(xlabel="TTFT (s)", ylabel="CDF", title="Time to first token")
    axes[1].set(xlabel="TBT (s)", title="Time between tokens", xscale="log")
    axes[2].set(xlabel="fluidity-index", title="Fluidity-index")
    axes[0].legend()
    out.mkdir(parents=True, exist_ok=True)
    _save(fig, out / "compare_cdfs.png")
