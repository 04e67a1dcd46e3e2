"""A request's token state and timestamps. Torch-free: the scheduler core reads it.

The one rule every scheduler follows: a request's ``num_computed_tokens`` catches up with its
``num_tokens``. A prefill chunk and a decode differ only in how many tokens they grant.
"""

from __future__ import annotations

import enum
from array import array
from dataclasses import dataclass, field

from fluidserve.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    # Prefilled on a prefill instance; its KV blocks wait there to move to a decode instance.
    MIGRATING = "migrating"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"

    def __init__(self, value: str) -> None:
        # An attribute, not a property: read for every token in the engine's hot loops.
        self.finished = value not in ("waiting", "running", "migrating")


# Output tokens still in flight at once at most (asynchronous scheduling: the batch in flight
# and the one being scheduled); only these may change after they were appended.
IN_FLIGHT = 2


@dataclass(eq=False, slots=True)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    eos_token_ids: tuple[int, ...] = ()  # the tokenizer's EOS and those the model declares
    seed: int = 0  # sampling seed: params.seed, or one drawn by the engine
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    # Timestamps (engine clock). token_times[i] is when output token i became available.
    first_scheduled_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    finish_time: float | None = None
    num_preemptions: int = 0
    num_cached_tokens: int | None = None  # found in the prefix cache when first admitted
    # (None: prefix caching is off, or it has not been admitted)
    error: str | None = None
    # The prompt as a machine array, made when a repetition penalty first needs it: its
    # sampler reads the whole prompt every step, which then costs a copy, not a conversion
    # of every token (nor, to another process, a pickled list).
    prompt_array: array | None = None
    # The output as a machine array, brought up to date when a penalty reads it
    # (``output_array``): converted a few tokens a step, not all of them (2-core Zen 4 EPYC,
    # 128 penalized decodes of 2000 output tokens: schedule + prepare_inputs 13.2 ms a step
    # converting every token, 1.2 ms with this; plain decodes 0.6 ms).
    output_cache: array | None = None
    # With params.prompt_logprobs: entry i is prompt token i + 1's (logprob, [(id, logprob)],
    # rank)
    prompt_logprobs: list | None = None

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Whether its prefill computes its prompt's logprobs: asked for, and not returned
        yet (they go with the first output token)."""
        return self.params.prompt_logprobs is not None and not self.output_token_ids

    def output_array(self) -> array:
        """A copy of ``output_token_ids`` as int64 (placeholders included). The output only
        ever changes at its end: a token appended, a placeholder written in or dropped, at
        most ``IN_FLIGHT`` from the end (asynchronous scheduling runs one batch ahead), so
        the cache converts those again, and what was appended since."""
        out, cache = self.output_token_ids, self.output_cache
        if cache is None:
            cache = self.output_cache = array("q")
        del cache[max(0, min(len(cache), len(out)) - IN_FLIGHT):]
        cache.extend(out[len(cache):])
        return cache[:]

    def shift_times(self, dt: float) -> None:
        """Move every timestamp by ``dt`` (onto another process's clock)."""
        if not dt:
            return
        self.arrival_time += dt
        if self.first_scheduled_time is not None:
            self.first_scheduled_time += dt
        if self.finish_time is not None:
            self.finish_time += dt
        self.token_times = [t + dt for t in self.token_times]

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        """Every token that would stop this request: ``min_tokens`` bans them."""
        p = self.params
        return p.stop_token_ids if p.ignore_eos else p.stop_token_ids + self.eos_token_ids

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_remaining(self) -> int:
        """Tokens whose KV is not computed yet (1 for a decode)."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_decode(self) -> bool:
        out = self.output_token_ids
        return bool(out) and self.num_computed_tokens == len(self.prompt_token_ids) + len(out) - 1

    @property
    def is_prefill(self) -> bool:
        return not self.is_decode

    @property
    def max_total_tokens(self) -> int:
        return self.num_prompt_tokens + self.params.max_tokens

    def token_slice(self, start: int, end: int) -> list[int]:
        p = len(self.prompt_token_ids)
        if end <= p:
            return self.prompt_token_ids[start:end]
        if start >= p:
            return self.output_token_ids[start - p : end - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - p]

    @property
    def finish_reason(self) -> str | None:
        return self.status.value if self.status.finished else None
