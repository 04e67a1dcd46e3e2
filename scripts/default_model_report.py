"""What the embedded default model writes, and how long its answers run when nothing stops
them but the model itself.

For each bench workload (prompt lengths from the trace, scaled as the races scale them and at
most 496 tokens; prompt text cut from the prompt corpus by ``fluidserve bench``'s own
builder), the prompts are sent as chat messages and as plain completions with ``max_tokens``
512 and no ``ignore_eos``; the natural output lengths are summarized. A few sampled
completions are printed. JSON out:

    python scripts/default_model_report.py --out docs/default-model.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from fluidserve import LLM, SamplingParams
from fluidserve.bench.prompts import PromptBuilder, load_corpus
from fluidserve.bench.workload import WorkloadSpec, build_workload
from fluidserve.model.builder import default_model_dir

MAX_TOKENS = 512
SAMPLE_PROMPTS = [
    "What news from the court?",
    "Good morrow, friend. Whither goest thou so early?",
    "Tell me, is the king dead?",
    "I love thee not, and yet I cannot leave thee.",
]


def lengths(llm: LLM, prompts: list, params: SamplingParams) -> dict:
    outs = llm.generate(prompts, params)
    n = np.array([len(o.token_ids) for o in outs])
    stopped = np.array([o.finish_reason == "stop" for o in outs])
    return {"requests": len(outs), "ended_by_eos": round(float(stopped.mean()), 3),
            "p10": int(np.percentile(n, 10)), "p50": int(np.percentile(n, 50)),
            "p90": int(np.percentile(n, 90)), "mean": round(float(n.mean()), 1),
            "max": int(n.max())}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="runs/default-model.json")
    ap.add_argument("--num-prompts", type=int, default=200)
    args = ap.parse_args()
    llm = LLM()
    tok = llm.tokenizer
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    report: dict = {"model": str(default_model_dir()), "max_tokens": MAX_TOKENS,
                    "training": json.loads((default_model_dir() / "training.json").read_text())
                    | {"loss_log": "..."}}
    samples = []
    for text in SAMPLE_PROMPTS:
        for params, how in ((greedy, "greedy"),
                            (SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, top_p=0.95,
                                            seed=1), "temperature 0.8, top-p 0.95, seed 1")):
            out = llm.generate([tok.chat([{"role": "user", "content": text}])], params)[0]
            samples.append({"prompt": text, "sampling": how, "completion": out.text,
                            "tokens": len(out.token_ids), "finish_reason": out.finish_reason})
            print(f"--- {text!r} ({how}; {len(out.token_ids)} tokens, {out.finish_reason})\n"
                  f"{out.text}", flush=True)
    report["samples"] = samples
    text, _ = load_corpus()
    report["workloads"] = {}
    for dataset in ("sharegpt", "arxiv"):
        # Prompts scaled as the races scale them, at most half the 1024-token context so
        # that an answer of MAX_TOKENS always fits.
        spec = WorkloadSpec(dataset=dataset, num_prompts=args.num_prompts, prompt_scale=0.25,
                            max_prompt_len=1024 - MAX_TOKENS - 16, seed=0)
        work, _ = build_workload(spec)
        builder = PromptBuilder(tok, text, seed=0)
        plain = [builder.build(w.prompt_len) for w in work]
        chat = [tok.chat([{"role": "user", "content": p}]) for p in plain]
        report["workloads"][dataset] = {
            "prompt_tokens_p50": int(np.median([w.prompt_len for w in work])),
            "chat": lengths(llm, chat, greedy),
            "completion": lengths(llm, plain, greedy),
        }
        print(dataset, json.dumps(report["workloads"][dataset]), flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
