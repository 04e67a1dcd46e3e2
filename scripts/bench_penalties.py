"""What the logit rules (penalties, allowed tokens, biases) cost, side by side in one process.

First the penalties alone (``sampler.apply_penalties``) on 128 rows of the race model's
vocabulary, each with 700 output tokens (and, with a repetition penalty, 500 prompt tokens):
the compiled CPU kernel against the eager code (the fallback, and the path on CUDA). Then
whole sampling steps of 128 rows that allow every other token (``allowed_token_ids``) or
bias 300, against plain ones. Then the saturated burst offline on the race model
(``LLM.generate`` of 40 prompts of 256 random tokens, 64 outputs each, budget 2048), greedy,
every request penalized (repetition 1.1, frequency 0.5, presence 0.3) against none. Rounds
alternate (ABBA); one JSON line per case: both medians and their ratio.

    python scripts/bench_penalties.py
    python scripts/bench_penalties.py --rounds 8 --skip-burst
"""

from __future__ import annotations

import random
import time
from array import array

import engine_ab
import torch
from engine_ab import ENGINE_ARGS, abba, report, time_burst

import fluidserve.kernels as kernels
from fluidserve.core.scheduler.output import ScheduledChunk
from fluidserve.engine.llm import LLM
from fluidserve.model.arch import read_arch
from fluidserve.model.inputs import Penalties, sampling_metadata
from fluidserve.model.sampler import apply_penalties, sample
from fluidserve.sampling_params import SamplingParams

ROWS, OUTPUT, PROMPT = 128, 700, 500
PENALIZED = dict(repetition_penalty=1.1, frequency_penalty=0.5, presence_penalty=0.3)


def penalties(vocab: int, repetition: float) -> Penalties:
    rng = random.Random(0)
    params = SamplingParams(frequency_penalty=0.5, presence_penalty=0.3,
                            repetition_penalty=repetition)
    prompt = (lambda: array("q", (rng.randrange(vocab) for _ in range(PROMPT)))) \
        if repetition != 1.0 else (lambda: ())
    return Penalties.build([ScheduledChunk(
        f"r{i}", 0, (1,), (), True, params, 0, OUTPUT, True,
        penalized=(prompt(), tuple(rng.randrange(vocab) for _ in range(OUTPUT))))
        for i in range(ROWS)], None)


def steps(model: str, rounds: int) -> None:
    vocab = read_arch(model).vocab_size
    compiled = kernels.cpu_ops
    if compiled() is None:
        raise SystemExit("the compiled CPU kernels are not built here: nothing to compare")
    sides = ("compiled", "eager")
    logits = torch.randn(ROWS, vocab, generator=torch.Generator().manual_seed(0))
    for repetition in (1.0, 1.1):
        pen = penalties(vocab, repetition)
        times = {s: [] for s in sides}
        for side in abba(rounds, sides):
            kernels.cpu_ops = compiled if side == "compiled" else (lambda *a, **k: None)
            best = float("inf")
            for _ in range(5):
                x = logits.clone()
                t = time.perf_counter()
                apply_penalties(x, pen)
                best = min(best, time.perf_counter() - t)
            times[side].append(best * 1e3)
        kernels.cpu_ops = compiled
        what = "frequency and presence" + (", repetition (prompts too)" if repetition != 1
                                           else "")
        report(f"apply_penalties: {ROWS} rows x {OUTPUT} tokens, V={vocab}, {what}", "ms",
               times)
    masks(vocab, rounds)


def masks(vocab: int, rounds: int) -> None:
    """A whole sampling step (its metadata and the sampler) of 128 greedy rows, each allowing
    every other token of the vocabulary, or biasing 300, against plain rows."""
    logits = torch.randn(ROWS, vocab, generator=torch.Generator().manual_seed(1))
    cases = {"allowed_token_ids: every other token": SamplingParams(
                 temperature=0.0, allowed_token_ids=range(0, vocab, 2)),
             "logit_bias: 300 tokens": SamplingParams(
                 temperature=0.0, logit_bias={t: 1.0 for t in range(300)})}
    plain = SamplingParams(temperature=0.0)
    for case, params in cases.items():
        times = {"asked": [], "plain": []}
        for side in abba(rounds, tuple(times)):
            p = params if side == "asked" else plain
            chunks = [ScheduledChunk(f"r{i}", 0, (1,), (), True, p, 0, 5, True)
                      for i in range(ROWS)]
            best = float("inf")
            for _ in range(5):
                t = time.perf_counter()
                sample(logits, sampling_metadata(chunks))
                best = min(best, time.perf_counter() - t)
            times[side].append(best * 1e3)
        report(f"a sampling step of {ROWS} rows, V={vocab}, {case}", "ms", times)


def burst(model: str, rounds: int) -> None:
    llm = LLM(model, **ENGINE_ARGS, scheduler="sarathi", token_budget=2048)

    def generate(side, prompts, params):
        if side == "penalized":
            params = SamplingParams(temperature=0.0, max_tokens=params.max_tokens,
                                    ignore_eos=True, **PENALIZED)
        llm.generate(prompts, params)

    time_burst(rounds, ("penalized", "plain"), generate)
    llm.close()


if __name__ == "__main__":
    engine_ab.main(__doc__, steps, burst)
