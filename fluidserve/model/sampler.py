"""Token sampling for the whole batch at once: greedy, temperature, top-k, top-p, seeded.

Every row is sampled by inverse transform: the token whose cumulative probability first
exceeds a uniform number ``u``. ``u`` is a hash of the request's seed and the token's index in
its output, so the n-th output token of a request depends only on its logits and its seed,
never on which other requests shared the batch or whether it was preempted and recomputed;
and there is no per-request generator, only a handful of tensor operations for the batch and
one copy of the sampled ids to the host.
"""

from __future__ import annotations

import torch

from fluidserve.model.inputs import SamplingMetadata

_MASK64 = (1 << 64) - 1


def token_seed(seed: int, index: int) -> int:
    """splitmix64 of (seed, index): a well-mixed 64-bit value per request and token index."""
    x = (seed * 0x9E3779B97F4A7C15 + (index + 1) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def uniform(seed: int, index: int) -> float:
    """A number in (0, 1) from 53 bits of ``token_seed``."""
    return ((token_seed(seed, index) >> 11) + 0.5) / (1 << 53)


def filter_threshold(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
                     ) -> torch.Tensor:
    """Per row, the smallest logit that top-k and top-p keep (logits: [R, V] float32, already
    divided by temperature; top_k <= 0 and top_p >= 1 disable a filter). Ties with the
    threshold are kept."""
    sorted_logits = torch.sort(logits, dim=-1, descending=True).values
    v = logits.shape[-1]
    k = torch.where(top_k > 0, top_k.clamp(max=v), torch.full_like(top_k, v))
    probs = sorted_logits.softmax(-1)
    # A token is kept while the mass before it is below top_p (the first is always kept).
    before = probs.cumsum(-1) - probs
    kept_p = (before < top_p[:, None]).sum(-1)
    keep = torch.minimum(k, kept_p.clamp(min=1))
    return sorted_logits.gather(1, (keep - 1)[:, None]).squeeze(1)


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """Per-row argmax; ties go to the lowest id."""
    if logits.device.type == "cpu":
        from fluidserve.kernels import cpu_ops

        ops = cpu_ops()
        if ops is not None:
            return ops.argmax_rows(logits.contiguous())
    if logits.device.type == "cuda" and logits.stride(-1) == 1:
        from fluidserve.kernels.triton_ops import argmax_rows

        return argmax_rows(logits)
    return logits.max(dim=-1).indices


def sample(
    logits: torch.Tensor, meta: SamplingMetadata
) -> tuple[list[int], list[tuple[float, list[tuple[int, float]]] | None]]:
    """logits: [S, V], one row per sampled request. Returns token ids and logprobs."""
    tokens = greedy_tokens(logits)
    rows = [i for i, t in enumerate(meta.temperature) if t != 0.0]
    if rows:
        tokens[rows] = _sample_rows(logits[rows].float(), meta, rows)
    token_list = tokens.tolist()
    logprobs: list = [None] * len(token_list)
    want = [i for i, k in enumerate(meta.logprobs) if k is not None]
    if want:
        _logprobs(logits[want].float(), [token_list[i] for i in want],
                  [meta.logprobs[i] for i in want], want, logprobs)
    return token_list, logprobs


def _sample_rows(logits: torch.Tensor, meta: SamplingMetadata, rows: list[int]) -> torch.Tensor:
    dev = logits.device
    temp = torch.tensor([meta.temperature[i] for i in rows], device=dev)
    logits = logits / temp[:, None]
    top_k = torch.tensor([meta.top_k[i] for i in rows], device=dev)
    top_p = torch.tensor([meta.top_p[i] for i in rows], device=dev)
    if bool((top_k > 0).any() or (top_p < 1).any()):
        threshold = filter_threshold(logits, top_k, top_p)
        logits = logits.masked_fill(logits < threshold[:, None], float("-inf"))
    cdf = logits.softmax(-1).cumsum(-1)
    u = torch.tensor([uniform(meta.seeds[i], meta.output_index[i]) for i in rows], device=dev,
                     dtype=cdf.dtype)
    target = (u * cdf[:, -1])[:, None]
    picked = torch.searchsorted(cdf, target, right=True).squeeze(1)
    # Rounding can put the target at the very top: take the last token with mass.
    last = (logits > float("-inf")).long().cumsum(-1).argmax(-1)
    return torch.minimum(picked, last)


def _logprobs(logits: torch.Tensor, tokens: list[int], ks: list[int], rows: list[int],
              out: list) -> None:
    lp = torch.log_softmax(logits, dim=-1)
    chosen = lp.gather(1, torch.tensor(tokens, device=lp.device)[:, None]).squeeze(1).tolist()
    kmax = max(ks)
    top_v, top_i = (torch.topk(lp, kmax) if kmax else (lp[:, :0], lp[:, :0].long()))
    top_v, top_i = top_v.tolist(), top_i.tolist()
    for j, row in enumerate(rows):
        k = ks[j]
        out[row] = (chosen[j], list(zip(top_i[j][:k], top_v[j][:k], strict=True)))
