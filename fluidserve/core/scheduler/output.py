"""The tensor-free contract between a scheduler and an executor."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import NamedTuple

from fluidserve.sampling_params import SamplingParams


@dataclass(slots=True)
class ScheduledChunk:
    """One request's share of an iteration: ``token_ids`` at positions ``start..start+n``.

    A decode is a chunk of one token. ``samples`` is true when the chunk reaches the end of
    the request's known tokens, so the executor must sample the next token from its logits.
    Not modified once scheduled (not frozen either: a frozen dataclass took 1 us more to
    build, per decode token, a fifth of the simulator's time).
    """

    request_id: str
    start: int
    token_ids: tuple[int, ...]
    block_table: tuple[int, ...]
    samples: bool
    params: SamplingParams
    seed: int
    output_index: int  # index of the token this chunk samples, if it samples
    is_decode: bool = False
    banned: tuple[int, ...] = ()  # tokens it may not sample (stop tokens, within min_tokens)
    # the request's preemptions when it was scheduled: a chunk of an earlier admission, still
    # in flight when an asynchronous schedule preempted and re-admitted it, is not applied
    epoch: int = 0
    # A sampling chunk of a request with a penalty: the tokens its sampler counts, (prompt,
    # output before the token it samples), each a machine array of int64 (a copy of the
    # output's, an int sequence too); the prompt is () without a repetition penalty
    penalized: tuple[Sequence[int], Sequence[int]] | None = None
    # A prefill chunk of a request that wants its prompt's logprobs: the prompt tokens its
    # first positions predict (the token after each), one per position up to the prompt's
    # next-to-last
    prompt_targets: tuple[int, ...] = ()
    # Bad words ending in a token the chunk's request has in flight (asynchronous
    # scheduling): (token, token in flight) pairs, the first banned if the second is sampled
    banned_if: tuple[tuple[int, int], ...] = ()

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def context_len(self) -> int:
        return self.start + len(self.token_ids)


class AttentionWork(NamedTuple):
    """A batch's attention work, as cost models and telemetry price it: each multi-token
    chunk against itself (sum q^2) and its cached prefix (sum q x cached), and the one-token
    runs' reads of their own contexts (summed, and the longest)."""

    sq: int = 0
    prefix: int = 0
    single_ctx_sum: int = 0
    single_ctx_max: int = 0
    num_single: int = 0


@dataclass
class SchedulerOutput:
    """One hybrid batch: prefill chunks and decodes travel together, decodes first."""

    iteration: int
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    token_budget: int | None = None  # the budget this iteration was built under
    # Requests whose blocks the scheduler gave up for good since its last plan that reached
    # the executor (finished, aborted, handed to another instance; ``not_submitted``): an
    # executor that mirrors requests in other processes forgets them (``preempted`` ones
    # too) before it runs this plan's chunks.
    released: list[str] = field(default_factory=list)

    # Computed once: a plan is not modified after the scheduler returns it.
    @cached_property
    def num_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.chunks)

    @cached_property
    def num_decode_tokens(self) -> int:
        return sum(1 for c in self.chunks if c.is_decode)

    @cached_property
    def attention_work(self) -> AttentionWork:
        sq = prefix = ctx_sum = ctx_max = singles = 0
        for c in self.chunks:
            n = len(c.token_ids)
            if n == 1:
                singles += 1
                ctx_sum += c.start + 1
                ctx_max = max(ctx_max, c.start + 1)
            else:
                sq += n * n
                prefix += n * c.start
        return AttentionWork(sq, prefix, ctx_sum, ctx_max, singles)

    @property
    def sampled_request_ids(self) -> list[str]:
        """The requests whose chunks sample, in the plan's order (the sampled rows')."""
        return [c.request_id for c in self.chunks if c.samples]

    @property
    def num_prefill_tokens(self) -> int:
        return self.num_tokens - self.num_decode_tokens

    @property
    def is_empty(self) -> bool:
        return not self.chunks

    def composition(self) -> tuple[tuple[str, int], ...]:
        return tuple((c.request_id, c.num_tokens) for c in self.chunks)


@dataclass
class RunnerOutput:
    """What an executor returns: one sampled token per sampling chunk, and how long it took."""

    sampled: dict[str, int]
    execution_time: float
    logprobs: dict[str, tuple[float, list[tuple[int, float]]]] = field(default_factory=dict)
    # request id -> the (logprob, top) of each of its chunk's prompt_targets
    prompt_logprobs: dict[str, list] = field(default_factory=dict)
    finish_time: float | None = None  # on a virtual clock: when the batch completes
