"""`fluidserve bench`: one seeded workload against one OpenAI-compatible endpoint."""

from __future__ import annotations

import asyncio
import dataclasses
import math
import os
import sys
import time
from pathlib import Path

import httpx
import numpy as np
from tqdm import tqdm

from fluidserve.bench.client import Client, ClientConfig, RequestRecord
from fluidserve.bench.prompts import PromptBuilder, load_corpus
from fluidserve.bench.report import (
    Deadline,
    constant_deadline,
    score_fluidity,
    summarize_run,
    write_run,
)
from fluidserve.bench.workload import WorkloadRequest, WorkloadSpec, build_workload
from fluidserve.config import BenchConfig
from fluidserve.metrics import to_json

PREFILL_PROFILE_POINTS = 8
PROMPT_TOKENS_TOLERANCE = 0.02  # server/built prompt-token ratio beyond which the run warns


def workload_spec(cfg: BenchConfig, **override) -> WorkloadSpec:
    # vllm bench serve's "random": uniform lengths, by default all the same (range ratio 0).
    random = cfg.dataset_name == "random"
    dataset = "uniform" if random else cfg.dataset_name
    ratio = cfg.range_ratio if cfg.range_ratio is not None else 0.0 if random else 0.5
    # --input-len / --output-len set uniform's means, and otherwise fix every length.
    fixed = dataset != "uniform" and (cfg.input_len is not None or cfg.output_len is not None)
    spec = WorkloadSpec(
        dataset="fixed" if fixed else dataset, dataset_path=cfg.dataset_path,
        num_prompts=cfg.num_prompts, input_len=cfg.input_len or 512,
        output_len=cfg.output_len or 128, range_ratio=ratio,
        prompt_scale=cfg.prompt_scale, output_scale=cfg.output_scale,
        max_prompt_len=cfg.max_prompt_len, max_output_len=cfg.max_output_len,
        request_rate=cfg.request_rate, burstiness=cfg.burstiness, arrivals=cfg.arrivals,
        seed=cfg.seed,
    )
    return dataclasses.replace(spec, **override)


def load_tokenizer(cfg: BenchConfig, server_root: str | None = None) -> tuple[object, str]:
    """(tokenizer, where from) that prompts are built with: ``--tokenizer``, else the one in
    the directory the server reports as its model's ``root`` (a server on this machine), else
    the embedded model's, which only counts right for a server of the embedded model."""
    from fluidserve.model.builder import default_model_dir
    from fluidserve.model.tokenizer import Tokenizer

    if cfg.tokenizer:
        return Tokenizer(cfg.tokenizer), cfg.tokenizer
    if server_root and any((Path(server_root) / f).is_file()
                           for f in ("tokenizer.json", "tokenizer.model")):
        return Tokenizer(server_root), server_root
    why = f"; the server's model directory {server_root} has no tokenizer on this machine," \
        " pass --tokenizer" if server_root else ""
    return Tokenizer(default_model_dir()), f"{default_model_dir()} (embedded model{why})"


def server_model(cfg: BenchConfig) -> tuple[str, str | None, int | None]:
    """(the model name to send, the server's model directory and context window if it
    reports them: vLLM and fluidserve list ``root`` and ``max_model_len``)."""
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    try:
        r = httpx.get(cfg.base_url.rstrip("/") + "/v1/models", headers=headers, timeout=30)
    except httpx.HTTPError as e:
        raise ValueError(f"cannot reach {cfg.base_url}: {e}") from None
    if r.status_code != 200:
        raise ValueError(f"{cfg.base_url}/v1/models answered HTTP {r.status_code}: {r.text[:200]}")
    data = r.json().get("data") or []
    card = next((m for m in data if m.get("id") == cfg.model), None) if cfg.model else \
        (data[0] if data else None)
    if cfg.model:
        return cfg.model, (card or {}).get("root"), (card or {}).get("max_model_len")
    if card is None:
        raise ValueError(f"{cfg.base_url} lists no models; pass --model")
    return card["id"], card.get("root"), card.get("max_model_len")


WINDOW_MARGIN = 32  # tokens left free in the window: a chat template's, a prompt built long


def fit_window(work: list[WorkloadRequest], window: int | None) -> tuple[list, int]:
    """The requests with prompt + output cut to the server's context window (the output
    first, down to one token, then the prompt), and how many were cut."""
    if not window:
        return work, 0
    room, out, cut = max(window - WINDOW_MARGIN, 2), [], 0
    for w in work:
        prompt = min(w.prompt_len, room - 1)
        output = min(w.output_len, room - prompt)
        cut += (prompt, output) != (w.prompt_len, w.output_len)
        out.append(dataclasses.replace(w, prompt_len=prompt, output_len=output))
    return out, cut


class Bench:
    """A prepared workload that can be run at any request rate.

    Each run after the first sends prompts of the same lengths with other text: a server with
    prefix caching (vLLM's default) would otherwise find every later probe of a capacity
    search in its cache and answer its prefills for free."""

    def __init__(self, cfg: BenchConfig, tokenizer=None, quiet: bool = False) -> None:
        if cfg.api_key is None and os.environ.get("OPENAI_API_KEY"):
            cfg = dataclasses.replace(cfg, api_key=os.environ["OPENAI_API_KEY"])
        self.cfg = cfg
        self.quiet = quiet
        self.model, root, self.window = server_model(cfg)
        if tokenizer is None:
            tokenizer, self.tokenizer_source = load_tokenizer(cfg, root)
        else:
            self.tokenizer_source = "given"
        self.tokenizer = tokenizer
        self.text, self.corpus_source = load_corpus()
        self.builder = self._builder(cfg.seed)
        self.spec = workload_spec(cfg)
        work, self.length_source = build_workload(self.spec)
        self.work, cut = fit_window(work, self.window)
        if cut:
            self.log(f"warning: {cut} of {len(work)} requests cut to fit the server's context"
                     f" window of {self.window} tokens (prompt + output, {WINDOW_MARGIN} spare):"
                     " lower --max-prompt-len/--max-output-len to measure the lengths you"
                     " asked for")
        self.window_cut = cut
        self.prompts = [self.builder.build(w.prompt_len) for w in self.work]
        self.runs = 0
        self.client = Client(ClientConfig(cfg.base_url, cfg.endpoint, self.model, cfg.api_key,
                                          cfg.ignore_eos, cfg.timeout, cfg.max_concurrency,
                                          cfg.temperature), self.tokenizer)
        self.ttft_deadline: Deadline = constant_deadline(cfg.ttft_deadline)
        self.prefill_fit: list[float] | None = None

    def _builder(self, seed: int) -> PromptBuilder:
        return PromptBuilder(self.tokenizer, self.text, seed,
                             add_special_tokens="chat" not in self.cfg.endpoint,
                             prefix_len=self.cfg.shared_prefix_len)

    def log(self, msg: str) -> None:
        if not self.quiet:
            print(msg, file=sys.stderr)

    def _run(self, work: list[WorkloadRequest], prompts: list, desc: str) -> list[RequestRecord]:
        bar = tqdm(total=len(work), desc=desc, unit="req", disable=self.quiet, file=sys.stderr)
        try:
            return asyncio.run(self.client.run(work, prompts, bar))
        finally:
            bar.close()

    def warmup(self) -> None:
        n = self.cfg.warmup_requests
        if n:
            work = [WorkloadRequest(i, 0.0, 16, 4) for i in range(n)]
            records = self._run(work, [self.builder.build(16) for _ in work], "warm-up")
            if not any(r.ok for r in records):  # as vLLM's test request: fail before the run
                raise ValueError(f"the warm-up requests to {self.cfg.base_url}"
                                 f"{self.cfg.endpoint} failed: {records[0].error}")

    def profile_prefill(self) -> None:
        """Fit TTFT(prompt length) with a quadratic from isolated max_tokens=1 requests."""
        top = max(w.prompt_len for w in self.work)
        lengths = np.unique(np.geomspace(16, max(top, 32), PREFILL_PROFILE_POINTS).astype(int))
        work = [WorkloadRequest(i, 0.0, int(n), 1) for i, n in enumerate(lengths)]
        ttfts = []
        for w in tqdm(work, desc="prefill profile", disable=self.quiet, file=sys.stderr):
            rec = asyncio.run(self.client.run([w], [self.builder.build(w.prompt_len)]))[0]
            if not rec.ok:
                raise ValueError(f"prefill profile request failed: {rec.error}")
            ttfts.append(rec.gaps[0])
        coeffs = np.polyfit(lengths, ttfts, 2 if len(lengths) > 2 else 1)
        self.use_prefill_fit({"coeffs": [float(c) for c in coeffs], "floor_s": min(ttfts)})

    def use_prefill_fit(self, fit: dict) -> None:
        """D_p(p) = prefill(p) + slack (Etalon), prefill(p) the fitted polynomial, never
        below the fastest TTFT measured (a quadratic can dip under it at short prompts)."""
        self.prefill_fit = fit
        coeffs, floor, slack = fit["coeffs"], fit["floor_s"], self.cfg.ttft_slack
        self.ttft_deadline = lambda p: max(float(np.polyval(coeffs, p)), floor) + slack
        self.log(f"prefill profile: TTFT(p) ~ {np.poly1d(coeffs)} (>= {floor:.3g} s);"
                 f" D_p = that + {slack:g} s")

    def run(self, request_rate: float | None = None) -> tuple[list[RequestRecord], dict]:
        work = self.work
        if request_rate is not None and request_rate != self.spec.request_rate:
            spec = dataclasses.replace(self.spec, request_rate=request_rate)
            work = fit_window(build_workload(spec)[0], self.window)[0]
        rate = request_rate if request_rate is not None else self.spec.request_rate
        prompts = self.prompts
        if self.runs:  # same lengths, other text (see the class)
            builder = self._builder(self.cfg.seed + 1_000_003 * self.runs)
            prompts = [builder.build(w.prompt_len) for w in work]
        self.runs += 1
        t0 = time.perf_counter()
        records = self._run(work, prompts, f"bench @ {rate:g} req/s")
        wall = time.perf_counter() - t0
        score_fluidity(records, self.ttft_deadline, self.cfg.tbt_deadline)
        summary = summarize_run(records, self.cfg.tbt_deadline)
        summary |= {
            "label": self.cfg.label, "base_url": self.cfg.base_url, "endpoint": self.cfg.endpoint,
            "model": self.model, "request_rate": rate, "wall_time_s": wall,
            "lengths": self.length_source, "corpus": self.corpus_source,
            "server_max_model_len": self.window, "requests_cut_to_window": self.window_cut,
            "prompts_inexact_length": self.builder.inexact,
            "shared_prefix_len": self.cfg.shared_prefix_len,
            "tokenizer": self.tokenizer_source,
            "server_prompt_tokens_ratio": prompt_token_ratio(records,
                                                             "chat" in self.cfg.endpoint),
            "ttft_deadline_s": self.cfg.ttft_deadline if self.prefill_fit is None else None,
            "prefill_fit": self.prefill_fit,
            "ttft_slack_s": None if self.prefill_fit is None else self.cfg.ttft_slack,
            "config": {k: (None if isinstance(v, float) and math.isinf(v) else v)
                       for k, v in dataclasses.asdict(self.cfg).items() if k != "api_key"},
        }
        ratio = summary["server_prompt_tokens_ratio"]
        if ratio is not None and abs(ratio - 1) > PROMPT_TOKENS_TOLERANCE:
            self.log(f"warning: the server counts {ratio:.2f}x the prompt tokens built with"
                     f" {self.tokenizer_source}: the lengths in this report are not the"
                     " lengths served; pass the server's tokenizer with --tokenizer")
        return records, summary


def prompt_token_ratio(records: list[RequestRecord], chat: bool = False) -> float | None:
    """Median of (prompt tokens the server reported) / (tokens the prompt was built with), over
    the requests whose usage reported them; None when none did. On the chat endpoint the
    server also counts its template's tokens, a constant: there, the slope of one against the
    other (None with fewer than two prompt lengths)."""
    pairs = [(r.prompt_len, r.server_prompt_tokens) for r in records
             if r.server_prompt_tokens and r.prompt_len]
    if not chat:
        return float(np.median([s / b for b, s in pairs])) if pairs else None
    if len({b for b, _ in pairs}) < 2:
        return None
    built, served = np.array(pairs, dtype=float).T
    return float(np.polyfit(built, served, 1)[0])


def run_bench(cfg: BenchConfig) -> int:
    out = Path(cfg.output_dir or f"runs/bench-{time.strftime('%Y%m%d-%H%M%S')}")
    bench = Bench(cfg)
    bench.log(f"{len(bench.work)} requests ({bench.length_source}) against {cfg.base_url}"
              f"{cfg.endpoint}, model {bench.model}, prompts built with the tokenizer of"
              f" {bench.tokenizer_source}")
    bench.warmup()
    if cfg.profile_prefill:
        bench.profile_prefill()
    records, summary = bench.run()
    write_run(out, records, summary)
    if cfg.plots:
        from fluidserve.bench.plots import plot_run

        plot_run(records, summary, out, cfg.label or str(out.name))
    if summary["num_failed"]:
        bench.log(f"{summary['num_failed']} requests failed: {summary['errors']}")
    bench.log(f"wrote {out}")
    print(to_json(summary))
    if not summary["num_completed"]:
        bench.log("error: no request completed")
        return 1
    return 0
