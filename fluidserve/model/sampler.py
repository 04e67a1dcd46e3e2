"""Token sampling for the whole batch at once: greedy, temperature, top-k, top-p, min-p,
seeded, after logit biases and penalties.

Every row is sampled by inverse transform: the token whose cumulative probability first
exceeds a uniform number ``u``. ``u`` is a hash of the request's seed and the token's index in
its output, so the n-th output token of a request depends only on its logits and its seed,
never on which other requests shared the batch (a request preempted and recomputed draws
the same ``u``; its bf16 logits may differ in their last bits); and there is no
per-request generator, only a handful of tensor operations for the batch and
one copy of the sampled ids to the host.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from fluidserve.model.host_memory import to_device
from fluidserve.model.inputs import Penalties, PromptRows, SamplingMetadata

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
    divided by temperature; top_k <= 0 and top_p >= 1 disable a filter). As in vLLM, top-p
    takes the mass of the distribution top-k left, renormalized. Ties with the threshold are
    kept."""
    sorted_logits = torch.sort(logits, dim=-1, descending=True).values
    v = logits.shape[-1]
    k = torch.where(top_k > 0, top_k.clamp(max=v), torch.full_like(top_k, v))
    ranks = torch.arange(v, device=logits.device)
    probs = sorted_logits.masked_fill(ranks[None, :] >= k[:, None], float("-inf")).softmax(-1)
    # A token is kept while the mass before it is below top_p (the first is always kept).
    # top_p >= 1 keeps every token outright: a float32 running sum reaches 1 before the end
    # of a large vocabulary, which would drop its tail (and make a row's draw depend on
    # whether another row in the batch asked for a filter).
    before = probs.cumsum(-1) - probs
    kept_p = torch.where(top_p >= 1, v, (before < top_p[:, None]).sum(-1))
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


@dataclass
class DeviceSample:
    """A batch's sampled tokens (and requested logprobs) as tensors, before they reach the
    host: ``sample_on_device`` makes it without waiting for the device, ``to_host`` reads it.
    ``rows``/``ks``: the rows that asked for logprobs, and how many top entries each."""

    tokens: torch.Tensor  # [R] int64
    rows: list[int]
    ks: list[int]
    chosen: torch.Tensor | None = None  # [len(rows)] logprob of each sampled token
    top_v: torch.Tensor | None = None  # [len(rows), max(ks)]
    top_i: torch.Tensor | None = None
    prompt: DevicePromptLogprobs | None = None

    def copy_to_host(self) -> DeviceSample:
        """Its tensors copied into pinned host memory, asynchronously: read them after the
        device's work up to here is done (an event recorded after this call)."""
        def host(t):
            if t is None:
                return None
            h = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            return h.copy_(t, non_blocking=True)

        p = self.prompt
        return DeviceSample(host(self.tokens), self.rows, self.ks, host(self.chosen),
                            host(self.top_v), host(self.top_i), p and DevicePromptLogprobs(
                                p.rows, host(p.chosen), host(p.top_v), host(p.top_i),
                                host(p.rank)))


@dataclass
class DevicePromptLogprobs:
    """A step's prompt logprobs (``SamplingMetadata.prompt``) as tensors: of each row's
    target token, and each row's top entries."""

    rows: PromptRows
    chosen: torch.Tensor  # [E]
    top_v: torch.Tensor  # [E, max(ks)]
    top_i: torch.Tensor
    rank: torch.Tensor  # [E] int64: 1 + the tokens more likely than the target, as vLLM's

    ROWS_AT_ONCE = 256  # float32 log-softmax rows held at once (a prompt chunk has many)

    @classmethod
    def compute(cls, logits: torch.Tensor, rows: PromptRows) -> DevicePromptLogprobs:
        """From the step's logits rows after the sampled ones, queued on their device."""
        targets = to_device(rows.targets, logits.device, torch.int64)
        k = max(rows.ks)
        chosen, top_v, top_i, rank = [], [], [], []
        for a in range(0, len(targets), cls.ROWS_AT_ONCE):
            lp = torch.log_softmax(logits[a:a + cls.ROWS_AT_ONCE].float(), dim=-1)
            c = lp.gather(1, targets[a:a + cls.ROWS_AT_ONCE, None])
            chosen.append(c.squeeze(1))
            rank.append((lp > c).sum(-1) + 1)
            v, i = torch.topk(lp, k) if k else (lp[:, :0], lp[:, :0].long())
            top_v.append(v)
            top_i.append(i)
        return cls(rows, torch.cat(chosen), torch.cat(top_v), torch.cat(top_i),
                   torch.cat(rank))

    def to_host(self) -> dict[str, list[PromptLogprobs]]:
        """Request id -> the (logprob, top, rank) of its chunk's targets, in order."""
        chosen, top_v, top_i = self.chosen.tolist(), self.top_v.tolist(), self.top_i.tolist()
        rank = self.rank.tolist()
        out, at = {}, 0
        for rid, n, k in zip(self.rows.request_ids, self.rows.counts, self.rows.ks,
                             strict=True):
            out[rid] = [(chosen[j], list(zip(top_i[j][:k], top_v[j][:k], strict=True)),
                         rank[j]) for j in range(at, at + n)]
            at += n
        return out


def sample_on_device(logits: torch.Tensor, meta: SamplingMetadata,
                     last_tokens: torch.Tensor | None = None) -> DeviceSample:
    """logits: [S, V], one row per sampled request. Queues the sampling on the logits' device
    and returns without waiting for it (every choice that depends on the batch's parameters
    is made on the host). ``last_tokens`` (asynchronous scheduling): the step before's
    sampled tokens, where the penalties read the ones still in flight. Rows after the
    sampled ones are ``meta.prompt``'s: their prompt logprobs are computed too."""
    if meta.prompt is None:
        return _sample_on_device(logits, meta, last_tokens)
    n = len(meta.request_ids)
    s = _sample_on_device(logits[:n], meta, last_tokens)
    s.prompt = DevicePromptLogprobs.compute(logits[n:], meta.prompt)
    return s


def _sample_on_device(logits: torch.Tensor, meta: SamplingMetadata,
                      last_tokens: torch.Tensor | None) -> DeviceSample:
    dev = logits.device
    raw = logits  # logprobs are the model's, bans, biases and penalties or not
    if meta.logit_bias or meta.allowed or meta.penalties is not None:
        logits = adjust_logits(logits, meta, last_tokens)
    if meta.banned or meta.banned_if is not None:
        banned = ban_tokens(logits, meta.banned)
        if meta.banned_if is not None:
            banned = ban_if(banned, meta.banned_if, last_tokens, banned is logits)
        if meta.allowed:  # a ban never takes a row's last allowed token: allowed wins
            left = (banned > float("-inf")).any(-1, keepdim=True)
            banned = torch.where(left, banned, logits)
        logits = banned
    tokens = greedy_tokens(logits)
    rows = [i for i, t in enumerate(meta.temperature) if t != 0.0]
    if rows:  # (indexing by a list would copy it to the device and wait)
        idx = to_device(rows, dev, torch.int64)
        tokens.index_copy_(0, idx, _sample_rows(logits.index_select(0, idx).float(), meta,
                                                rows))
    want = [i for i, k in enumerate(meta.logprobs) if k is not None]
    if not want:
        return DeviceSample(tokens, [], [])
    ks = [meta.logprobs[i] for i in want]
    idx = to_device(want, dev, torch.int64)
    lp = torch.log_softmax(raw.index_select(0, idx).float(), dim=-1)
    picked = tokens.index_select(0, idx)
    chosen = lp.gather(1, picked[:, None]).squeeze(1)
    top_v, top_i = torch.topk(lp, max(ks)) if max(ks) else (lp[:, :0], lp[:, :0].long())
    return DeviceSample(tokens, want, ks, chosen, top_v, top_i)


def resolve_placeholders(tokens: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
    """Token ids with each ``-(r + 1)`` replaced by row r of ``last``, the previous step's
    sampled tokens (a decode scheduled while the step that samples its input was in flight).
    Runs on the device, inside a captured graph too: no host round trip."""
    rows = (-1 - tokens).clamp(0, len(last) - 1)
    return torch.where(tokens < 0, last[rows].to(tokens.dtype), tokens)


def adjust_logits(logits: torch.Tensor, meta: SamplingMetadata,
                  last_tokens: torch.Tensor | None = None) -> torch.Tensor:
    """A float32 copy of ``logits``: only each row's ``allowed_token_ids`` left above -inf,
    its ``logit_bias`` added, and then its penalties applied (repetition, frequency, presence:
    ``SamplingParams`` says how)."""
    out = logits.float()
    if out is logits:
        out = logits.clone()
    dev, v = out.device, out.shape[-1]
    if meta.allowed:
        asked = [r for r, p in enumerate(meta.allowed) if p is not None]
        keep = to_device(np.stack([meta.allowed[r].allowed_mask(v) for r in asked]), dev)
        if len(asked) == len(out):
            out.masked_fill_(~keep, float("-inf"))
        else:
            idx = to_device(asked, dev, torch.int64)
            out.index_copy_(0, idx, out.index_select(0, idx).masked_fill_(~keep,
                                                                          float("-inf")))
    if meta.logit_bias:
        rows, ids = _rows_and_ids([b and b[0] for b in meta.logit_bias])
        add = np.concatenate([np.frombuffer(b[1], np.float32) for b in meta.logit_bias if b])
        inside = ids < v
        out.index_put_((to_device(rows[inside], dev), to_device(ids[inside], dev)),
                       to_device(add[inside], dev), accumulate=True)
    if meta.penalties is not None:
        apply_penalties(out, meta.penalties, last_tokens)
    return out


def _rows_and_ids(per_row: list) -> tuple[np.ndarray, np.ndarray]:
    """int64 arrays of (row, token id) for every id of every row's machine array of ids
    (None: a row without): copies of bytes, no Python int per id."""
    arrays = [np.frombuffer(a, np.int64) if a else np.empty(0, np.int64) for a in per_row]
    return np.repeat(np.arange(len(arrays)), [len(a) for a in arrays]), np.concatenate(arrays)


def apply_penalties(logits: torch.Tensor, pen: Penalties,
                    last_tokens: torch.Tensor | None = None, *, dense: bool | None = None
                    ) -> None:
    """Penalize ``pen.rows`` of ``logits`` (float32 [S, V], in place), all rows at once.

    On the CPU the compiled kernel visits each token a row counts once; without it, the
    eager code finds those tokens by sorting (row, token) keys. On CUDA (``dense``) the
    tokens are counted into [rows, V] tables instead: more arithmetic, but no host round
    trip, so the step behind it is still queued at once. The three give the same numbers.
    ``python scripts/bench_penalties.py`` times them."""
    dev, v = logits.device, logits.shape[-1]
    rows = to_device(pen.rows, dev, torch.int64)
    output = to_device(pen.output, dev)
    if last_tokens is not None:
        output = resolve_placeholders(output, last_tokens)
    repeats = any(r != 1.0 for r in pen.repetition)
    prompt = to_device(pen.prompt, dev) if repeats and pen.prompt.shape[1] else None
    counted = any(pen.presence) or any(pen.frequency)
    rep, freq, pres = (to_device(x, dev, torch.float32)
                       for x in (pen.repetition, pen.frequency, pen.presence))
    if dense is None and dev.type == "cpu":
        from fluidserve.kernels import cpu_ops

        ops = cpu_ops()
        if ops is not None:
            ops.apply_penalties(logits, rows, output, to_device(pen.prompt, dev), pres,
                                freq, rep)
            return
    if dense if dense is not None else dev.type != "cpu":
        sub = logits.index_select(0, rows)
        counts = token_counts(output, v)
        if repeats:
            seen = counts > 0 if prompt is None else (counts + token_counts(prompt, v)) > 0
            r = rep[:, None].expand_as(sub)
            sub = torch.where(seen, torch.where(sub > 0, sub / r, sub * r), sub)
        if counted:
            sub -= torch.where(counts > 0, freq[:, None] * counts + pres[:, None], 0.0)
        logits.index_copy_(0, rows, sub)
        return
    flat = logits.view(-1)

    def keys(tokens: torch.Tensor) -> torch.Tensor:  # (row, token) as row * V + token
        return (rows[:, None] * v + tokens)[(tokens >= 0) & (tokens < v)]

    seen = keys(output)  # (a key's penalties: those of its row's rank in the ascending rows)
    if repeats:
        at = torch.unique(seen if prompt is None else torch.cat([seen, keys(prompt)]))
        x, r = flat[at], rep[torch.searchsorted(rows, at // v)]
        flat[at] = torch.where(x > 0, x / r, x * r)
    if counted:
        at, counts = torch.unique(seen, return_counts=True)
        row = torch.searchsorted(rows, at // v)
        flat[at] -= freq[row] * counts + pres[row]


def token_counts(tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    """[R, vocab] float32: how many times each token is in each row of ``tokens`` (int64
    [R, L]; ids outside the vocabulary count nowhere: they add 0 to token 0)."""
    inside = (tokens >= 0) & (tokens < vocab)
    counts = torch.zeros(tokens.shape[0], vocab, dtype=torch.float32, device=tokens.device)
    return counts.scatter_add_(1, torch.where(inside, tokens, 0), inside.float())


def ban_tokens(logits: torch.Tensor, banned: list[tuple[int, ...]]) -> torch.Tensor:
    """A copy of ``logits`` with each row's banned tokens at -inf (ids outside the
    vocabulary ban nothing)."""
    v = logits.shape[-1]
    pairs = [(r, t) for r, ts in enumerate(banned) for t in ts if 0 <= t < v]
    if not pairs:
        return logits
    where = to_device(pairs, logits.device, torch.int64)
    out = logits.clone()
    out[where[:, 0], where[:, 1]] = float("-inf")
    return out


def ban_if(logits: torch.Tensor, bans: np.ndarray, last_tokens: torch.Tensor | None,
           copy: bool) -> torch.Tensor:
    """``logits`` (a copy if ``copy``) with each (row, token, last row, token) of ``bans``
    at -inf where row ``last row`` of ``last_tokens`` (the previous step's sampled tokens,
    on the device) is that token: no host round trip."""
    if last_tokens is None:
        raise ValueError("conditional bans need the previous step's sampled tokens")
    bans = bans[(bans[:, 1] >= 0) & (bans[:, 1] < logits.shape[-1])]
    if not len(bans):
        return logits
    b = to_device(bans, logits.device, torch.int64)
    src = b[:, 2].clamp(0, len(last_tokens) - 1)
    hit = last_tokens[src].to(torch.int64) == b[:, 3]
    out = logits.clone() if copy else logits
    # accumulated: a (row, token) named twice gets -inf if either holds, never a race
    add = torch.where(hit, float("-inf"), 0.0).to(out.dtype)
    return out.index_put_((b[:, 0], b[:, 1]), add, accumulate=True)


Logprobs = tuple[float, list[tuple[int, float]]]
# A prompt token's: its logprob, the top ones, and its rank (1 + the tokens more likely)
PromptLogprobs = tuple[float, list[tuple[int, float]], int]


def prompt_logprobs_to_host(s: DeviceSample) -> dict[str, list[PromptLogprobs]]:
    """Request id -> its prompt logprobs of this step (empty if none asked)."""
    return s.prompt.to_host() if s.prompt is not None else {}


def to_host(s: DeviceSample) -> tuple[list[int], list[Logprobs | None]]:
    """Token ids and logprobs (None for rows that did not ask) as Python values."""
    token_list = s.tokens.tolist()
    logprobs: list = [None] * len(token_list)
    if s.rows:
        chosen, top_v, top_i = s.chosen.tolist(), s.top_v.tolist(), s.top_i.tolist()
        for j, (row, k) in enumerate(zip(s.rows, s.ks, strict=True)):
            logprobs[row] = (chosen[j], list(zip(top_i[j][:k], top_v[j][:k], strict=True)))
    return token_list, logprobs


def sample(logits: torch.Tensor, meta: SamplingMetadata
           ) -> tuple[list[int], list[Logprobs | None]]:
    """logits: [S, V], one row per sampled request. Returns token ids and logprobs."""
    return to_host(sample_on_device(logits, meta))


def _sample_rows(logits: torch.Tensor, meta: SamplingMetadata, rows: list[int]) -> torch.Tensor:
    dev = logits.device
    temp = to_device([meta.temperature[i] for i in rows], dev, torch.float32)
    logits = logits / temp[:, None]
    if meta.min_p and any(meta.min_p[i] > 0 for i in rows):
        # p < min_p * p_max, as logits: below the row's best by more than -log(min_p)
        floor = to_device([meta.min_p[i] for i in rows], dev, torch.float32).log()
        logits = logits.masked_fill(logits < logits.max(-1, keepdim=True).values
                                    + floor[:, None], float("-inf"))
    if any(meta.top_k[i] > 0 or meta.top_p[i] < 1 for i in rows):
        top_k = to_device([meta.top_k[i] for i in rows], dev, torch.int64)
        top_p = to_device([meta.top_p[i] for i in rows], dev, torch.float32)
        threshold = filter_threshold(logits, top_k, top_p)
        logits = logits.masked_fill(logits < threshold[:, None], float("-inf"))
    cdf = logits.softmax(-1).cumsum(-1)
    u = to_device([uniform(meta.seeds[i], meta.output_index[i]) for i in rows], dev,
                  cdf.dtype)
    target = (u * cdf[:, -1])[:, None]
    picked = torch.searchsorted(cdf, target, right=True).squeeze(1)
    # Rounding can put the target at the very top: take the last token with mass.
    last = (logits > float("-inf")).long().cumsum(-1).argmax(-1)
    return torch.minimum(picked, last)
