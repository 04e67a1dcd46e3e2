"""Token sampling: greedy, temperature, top-k, top-p, seeded per token.

The n-th output token of a request is drawn from a generator seeded by (seed, n), so a
request's output depends only on its logits and its seed, never on which other requests
shared the batch or whether it was preempted and recomputed.
"""

from __future__ import annotations

import torch

from fluidserve.core.scheduler.output import ScheduledChunk

_MASK64 = (1 << 63) - 1


def token_seed(seed: int, index: int) -> int:
    return (seed * 0x9E3779B97F4A7C15 + (index + 1) * 0xBF58476D1CE4E5B9) & _MASK64


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """logits: [V] float32, already divided by temperature. Returns a masked copy."""
    if 0 < top_k < logits.numel():
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        # drop a token when the mass before it already reaches top_p (the first always stays)
        drop_sorted = (cum - sorted_logits.softmax(-1)) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def sample(
    logits: torch.Tensor, chunks: list[ScheduledChunk]
) -> tuple[list[int], list[tuple[float, list[tuple[int, float]]] | None]]:
    """logits: [S, V] float32, one row per sampling chunk. Returns token ids and logprobs."""
    tokens = logits.argmax(dim=-1).tolist()
    for i, c in enumerate(chunks):
        p = c.params
        if p.greedy:
            continue
        row = filter_logits(logits[i] / p.temperature, p.top_k, p.top_p)
        gen = torch.Generator(device=logits.device).manual_seed(token_seed(c.seed, c.output_index))
        tokens[i] = int(torch.multinomial(row.softmax(-1), 1, generator=gen))
    logprobs: list = [None] * len(chunks)
    want = [i for i, c in enumerate(chunks) if c.params.logprobs is not None]
    if want:
        lp = torch.log_softmax(logits[want], dim=-1)
        for row, i in enumerate(want):
            k = chunks[i].params.logprobs
            top = torch.topk(lp[row], k) if k else None
            top_list = (
                list(zip(top.indices.tolist(), top.values.tolist(), strict=True)) if top else []
            )
            logprobs[i] = (float(lp[row, tokens[i]]), top_list)
    return tokens, logprobs
