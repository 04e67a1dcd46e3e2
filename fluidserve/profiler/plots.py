"""PNG plots for `fluidserve profile`."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def _save(fig, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_profile(result: dict, stalls: list[dict], out: Path) -> None:
    it = result["iteration_time"]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([p["tokens"] for p in it], [p["time_s"] * 1e3 for p in it], "o-", label="one prompt")
    batched = result.get("batched_prefill", [])  # several short prompts: less attention work
    if batched:
        ax.plot([p["tokens"] for p in batched], [p["time_s"] * 1e3 for p in batched], "s",
                c="C2", ms=5, label="several short prompts (" + ", ".join(
                    f"{p['prompts']}x{p['prompt_tokens']}" for p in batched) + ")")
    if result.get("knee_tokens"):
        ax.axvline(
            result["knee_tokens"],
            ls="--",
            c="gray",
            label=f"2x of 1-token time ({result['knee_tokens']} tokens)",
        )
    ax.legend(loc="upper left", fontsize=8)
    ax.set(
        xlabel="tokens in the batch",
        ylabel="iteration time (ms)",
        title="Iteration time vs batch tokens (cf. Sarathi-Serve Fig. 6)",
    )
    _save(fig, out / "iteration_time.png")

    dec = result["decode"]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
    a1.plot([p["batch_size"] for p in dec], [p["decode_tokens_per_s"] for p in dec], "o-")
    a1.set(xlabel="decode batch size", ylabel="tokens/s", title="Decode throughput")
    a2.plot([p["tokens"] for p in it], [p["prefill_tokens_per_s"] for p in it], "o-", c="C1")
    a2.set(xlabel="prompt length", ylabel="tokens/s", title="Prefill throughput")
    fig.suptitle("Throughput (cf. Sarathi-Serve Fig. 3)")
    _save(fig, out / "throughput.png")

    ch = result["chunked_prefill"]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.bar([str(p["chunk_size"]) for p in ch], [100 * p["overhead"] for p in ch])
    ax.set(
        xlabel="chunk size",
        ylabel="overhead vs unchunked (%)",
        title=f"Chunked prefill of a {ch[0]['prompt']}-token prompt (cf. Fig. 14)",
    )
    _save(fig, out / "chunked_prefill_overhead.png")

    fig, axes = plt.subplots(len(stalls), 1, figsize=(8, 2.4 * len(stalls)), sharex=True)
    for ax, s in zip(axes, stalls, strict=True):
        for i, (rid, ts) in enumerate(sorted(s["token_times"].items())):
            ax.plot(ts, [i] * len(ts), "|", ms=12, label=rid)
        ax.axvline(s["long_arrival_s"], c="red", ls=":", label="long prompt arrives")
        ax.set(
            title=f"{s['scheduler']} (budget {s['token_budget']}): max decode TBT "
            f"{s['decode_max_tbt_s'] * 1e3:.0f} ms",
            yticks=[],
        )
    axes[-1].set_xlabel("time (s)")
    axes[0].legend(loc="upper right", fontsize=7, ncol=3)
    fig.suptitle("Generation stalls: token timeline (cf. Sarathi-Serve Fig. 1a)")
    _save(fig, out / "stall_timeline.png")
