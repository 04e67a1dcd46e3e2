"""A scheduler plan flattened into model inputs.

``StepInputs`` holds numpy arrays and plain values only, which the worker turns into tensors
without copying. The single-process executor builds it from the scheduler's plan; each rank of a
tensor- or pipeline-parallel executor from the plan it rebuilds from what changed
(``step_delta``).
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field

import numpy as np

from fluidserve.core.scheduler.output import SchedulerOutput
from fluidserve.sampling_params import SamplingParams

# Pads the token arrays of ``Penalties``: no vocabulary is this large, so it counts nowhere.
NO_TOKEN = np.iinfo(np.int64).max


@dataclass
class Penalties:
    """The penalized rows of a step and the tokens each counts, as padded arrays: rows with
    their penalties, the prompt tokens (repetition penalty; no columns when no row has one)
    and the output tokens before the sampled one. An output token still in flight is
    ``-(row + 1)``, the row of the batch that samples it, as in the inputs' token ids."""

    rows: list[int]
    presence: list[float]
    frequency: list[float]
    repetition: list[float]
    prompt: np.ndarray  # [P, prompt width] int64, NO_TOKEN-padded
    output: np.ndarray  # [P, output width] int64, NO_TOKEN-padded

    @classmethod
    def build(cls, chunks: list, rows: dict[str, int] | None) -> Penalties:
        """From the sampled chunks (``rows``: as ``prepare_inputs`` takes it)."""
        at = [i for i, c in enumerate(chunks) if c.penalized is not None]
        hist = [chunks[i].penalized for i in at]
        params = [chunks[i].params for i in at]

        def padded(seqs) -> np.ndarray:
            arr = np.full((len(seqs), max(map(len, seqs))), NO_TOKEN, dtype=np.int64)
            for i, t in enumerate(seqs):
                if len(t):  # (a prompt is a machine array: copied, not converted)
                    arr[i, : len(t)] = np.frombuffer(t, np.int64) if isinstance(t, array) \
                        else t
            return arr

        output = padded([h[1] for h in hist])
        if rows is not None:  # a PLACEHOLDER (-1): the token in flight, row r of the last step
            for j, i in enumerate(at):
                output[j][output[j] == -1] = -1 - rows.get(chunks[i].request_id, -1)
        return cls(at, [p.presence_penalty for p in params],
                   [p.frequency_penalty for p in params], [p.repetition_penalty for p in params],
                   padded([h[0] for h in hist]), output)


@dataclass
class PromptRows:
    """The logits rows of a step after its sampled ones: positions of prefill chunks whose
    request asked for its prompt's logprobs, chunk by chunk; each predicts a prompt token."""

    request_ids: list[str]
    counts: list[int]  # rows of each request's chunk
    ks: list[int]  # top entries each request asked for
    targets: np.ndarray  # [rows] int64: the prompt token each row predicts


@dataclass
class SamplingMetadata:
    """One entry per sampled row (a chunk that ends a request's known tokens)."""

    request_ids: list[str]
    temperature: list[float]
    top_k: list[int]
    top_p: list[float]
    seeds: list[int]
    output_index: list[int]  # index of the token being sampled in its request's output
    logprobs: list[int | None]
    banned: list[tuple[int, ...]] = field(default_factory=list)  # per row; [] if none bans
    min_p: list[float] = field(default_factory=list)  # per row; [] if none filters by it
    # per row (each [] if no row has one): its logit_bias as (token ids, biases), machine
    # arrays (SamplingParams' bias_arrays), and the SamplingParams of a row with
    # allowed_token_ids (its ``allowed_mask``)
    logit_bias: list[tuple[array, array] | None] = field(default_factory=list)
    allowed: list[SamplingParams | None] = field(default_factory=list)
    penalties: Penalties | None = None  # None if no row asks for a penalty
    # [K, 4] int64 (row, token, row of the last step, token): bans that hold if that row of
    # the last step sampled that token (bad words ending in a token in flight); None if none
    banned_if: np.ndarray | None = None
    prompt: PromptRows | None = None  # None if no chunk computes prompt logprobs

    @property
    def all_greedy(self) -> bool:
        return all(t == 0.0 for t in self.temperature)


@dataclass
class StepInputs:
    token_ids: np.ndarray  # [T] int64
    positions: np.ndarray  # [T] int64
    slot_mapping: np.ndarray  # [T] int64: flat KV-cache slot of every token
    cu_q: np.ndarray  # [S + 1] int32: run s holds tokens cu_q[s] .. cu_q[s+1]-1
    ctx_lens: np.ndarray  # [S] int32: the run's last position + 1
    block_tables: np.ndarray  # [S, max_blocks] int32, padded with block 0
    # [R (+ E)] int64: batch positions whose next-token logits are sampled (then those of
    # ``sampling.prompt``'s rows)
    logits_idx: np.ndarray
    sampling: SamplingMetadata

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def runs(self) -> list[tuple[int, int, int]]:
        """(q_start, q_len, ctx_len) per run."""
        cu, ctx = self.cu_q.tolist(), self.ctx_lens.tolist()
        return [(cu[i], cu[i + 1] - cu[i], ctx[i]) for i in range(len(ctx))]


def sampling_metadata(sampled: list, rows: dict[str, int] | None = None) -> SamplingMetadata:
    """The sampling chunks' metadata, one row each (``rows``: as ``prepare_inputs`` takes
    it)."""
    p = [c.params for c in sampled]
    sampling = SamplingMetadata(
        [c.request_id for c in sampled], [x.temperature for x in p], [x.top_k for x in p],
        [x.top_p for x in p], [c.seed for c in sampled], [c.output_index for c in sampled],
        [x.logprobs for x in p],
        [c.banned for c in sampled] if any(c.banned for c in sampled) else [])
    if any(x.adjusts_logits for x in p):  # (one test per row when none does)
        if any(c.banned_if for c in sampled):  # (a token in flight: with ``rows``; row 0
            # where the last batch did not sample it, as in the inputs' ids: that batch
            # failed, and so does the request)
            last_row = rows or {}
            sampling.banned_if = np.array(
                [(i, token, last_row.get(c.request_id, 0), last)
                 for i, c in enumerate(sampled) for token, last in c.banned_if],
                dtype=np.int64).reshape(-1, 4)
        if any(x.min_p for x in p):
            sampling.min_p = [x.min_p for x in p]
        if any(x.logit_bias for x in p):
            sampling.logit_bias = [x.bias_arrays for x in p]
        if any(x.allowed_token_ids is not None for x in p):
            sampling.allowed = [x if x.allowed_token_ids is not None else None for x in p]
        if any(c.penalized is not None for c in sampled):
            sampling.penalties = Penalties.build(sampled, rows)
    return sampling


def prepare_inputs(plan: SchedulerOutput, block_size: int, rows: dict[str, int] | None = None
                   ) -> StepInputs:
    """The plan's model inputs. ``rows`` (asynchronous scheduling): for each request sampled
    by the batch submitted before this one, its row in that batch's sampled tokens; a decode
    of a token still in flight (``PLACEHOLDER``) gets token id ``-(row + 1)``, which the
    worker reads from that row on the device (0 for a request that batch did not sample:
    its own batch failed, and so does the request)."""
    bs = block_size
    ids: list[int] = []
    pos: list[int] = []
    lens: list[int] = []
    ctxs: list[int] = []
    logits_idx: list[int] = []
    tables: list[tuple[int, ...]] = []
    sampled = []
    prompt_rows: list[int] = []  # (after the sampled rows)
    prompt_chunks = []
    for c in plan.chunks:
        q0, n = len(ids), len(c.token_ids)
        if rows is not None and c.token_ids[0] < 0:  # (only a decode's can be)
            ids.append(-1 - rows.get(c.request_id, -1))
        else:
            ids.extend(c.token_ids)
        ctx = c.start + n
        pos.extend(range(c.start, ctx))
        lens.append(n)
        ctxs.append(ctx)
        tables.append(c.block_table[: -(-ctx // bs)])
        if c.samples:
            logits_idx.append(q0 + n - 1)
            sampled.append(c)
        if c.prompt_targets:
            prompt_rows.extend(range(q0, q0 + len(c.prompt_targets)))
            prompt_chunks.append(c)
    width = max(map(len, tables))
    table_arr = np.zeros((len(tables), width), dtype=np.int32)
    for i, t in enumerate(tables):
        table_arr[i, : len(t)] = t
    pos_arr = np.asarray(pos, dtype=np.int64)
    run_of_token = np.repeat(np.arange(len(lens)), lens)
    slots = table_arr[run_of_token, pos_arr // bs].astype(np.int64) * bs + pos_arr % bs
    cu_q = np.zeros(len(lens) + 1, dtype=np.int32)
    np.cumsum(lens, out=cu_q[1:])
    sampling = sampling_metadata(sampled, rows)
    if prompt_chunks:
        sampling.prompt = PromptRows(
            [c.request_id for c in prompt_chunks], [len(c.prompt_targets) for c in prompt_chunks],
            [c.params.prompt_logprobs for c in prompt_chunks],
            np.fromiter((t for c in prompt_chunks for t in c.prompt_targets), np.int64,
                        len(prompt_rows)))
        logits_idx += prompt_rows
    return StepInputs(np.asarray(ids, dtype=np.int64), pos_arr, slots, cu_q,
                      np.asarray(ctxs, dtype=np.int32), table_arr,
                      np.asarray(logits_idx, dtype=np.int64), sampling)
