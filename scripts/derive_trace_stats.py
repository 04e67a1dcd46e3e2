"""Derive the quantile tables in fluidserve/bench/trace_stats.json from ../shared/data/traces.

The tables let the built-in trace stand-ins sample realistic lengths when the CSV files are
absent: 101 prompt-length quantiles, and 21 output-length quantiles within each prompt decile
(which keeps the prompt/output correlation). Run: python scripts/derive_trace_stats.py
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from fluidserve.bench.workload import TRACE_FILES, read_trace
from fluidserve.data import data_dir


def stats(prompt: np.ndarray, output: np.ndarray, arrivals: np.ndarray | None) -> dict:
    deciles = np.quantile(prompt, np.linspace(0, 1, 11))
    bins = np.clip(np.searchsorted(deciles, prompt, side="right") - 1, 0, 9)
    cond = [np.quantile(output[bins == b], np.linspace(0, 1, 21)).round(1).tolist()
            for b in range(10)]
    out = {
        "rows": int(len(prompt)),
        "prompt_quantiles": np.quantile(prompt, np.linspace(0, 1, 101)).round(1).tolist(),
        "prompt_deciles": deciles.round(1).tolist(),
        "output_quantiles_by_prompt_decile": cond,
        "median_prompt": float(np.median(prompt)),
        "median_output": float(np.median(output)),
    }
    if arrivals is not None and len(arrivals) > 1:
        out["mean_request_rate"] = float((len(arrivals) - 1) / (arrivals[-1] - arrivals[0]))
    return out


def main() -> None:
    root = data_dir()
    if root is None:
        raise SystemExit("../shared/data not found (set FLUIDSERVE_DATA_DIR)")
    table = {"source": "statistics of the public traces in shared/data/traces (etalon and vidur"
                       " processed_traces, Azure/splitwise conv+code); Llama-2 tokenizer counts"}
    for name, fname in TRACE_FILES.items():
        t = read_trace(root / "traces" / fname)
        table[name] = stats(t.prompt, t.output, t.arrivals)
        print(name, table[name]["rows"], table[name]["median_prompt"],
              table[name]["median_output"])
    out = Path(__file__).resolve().parents[1] / "fluidserve" / "bench" / "trace_stats.json"
    out.write_text(json.dumps(table, separators=(",", ":")) + "\n")
    print("wrote", out)


if __name__ == "__main__":
    main()
