"""Scheduler base: request bookkeeping shared by every batching policy.

A policy only implements ``schedule()``: which requests compute how many tokens this
iteration. Admission, KV reservation with preemption-by-recompute, and the state changes
after an iteration (``update()``) are the same for all of them and live here.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

from fluidserve.core.admission import admission_error
from fluidserve.core.block_manager import BlockManager
from fluidserve.core.queue_policy import WaitingQueue
from fluidserve.core.scheduler.output import RunnerOutput, ScheduledChunk, SchedulerOutput
from fluidserve.request import Request, RequestStatus
from fluidserve.sampling_params import SamplingParams

#: With asynchronous scheduling, an output token that a batch still in flight is sampling: the
#: executor reads it from that batch's sampled tokens on the device, and ``update`` writes it in.
PLACEHOLDER = -1


class RequestRejected(ValueError):
    """The request can never run (too long for the context window or the KV cache)."""


@dataclass(frozen=True)
class SchedulerLimits:
    token_budget: int
    max_num_seqs: int
    max_model_len: int
    tile_size: int = 1
    queue_policy: str = "fcfs"
    queue_window: int = 0  # arrivals per sorting window of the queue (0: one window)


class Batch:
    """An iteration under construction: (request, tokens) entries plus the budget left."""

    def __init__(self, budget: float, busy: frozenset[str] = frozenset()) -> None:
        self.budget = budget
        self.left = budget
        self.entries: list[tuple[Request, int, bool]] = []  # (request, tokens, is decode)
        # Requests that may not join: those in this batch and those still in flight in an
        # earlier pipeline micro-batch.
        self.ids: set[str] = set(busy)
        self.num_prefills = 0

    def add(self, req: Request, n: int, is_decode: bool = False) -> None:
        self.entries.append((req, n, is_decode))
        self.ids.add(req.request_id)
        self.left -= n
        self.num_prefills += not is_decode

    def chunk(self, req: Request, n: int, is_decode: bool, table: tuple[int, ...]
              ) -> ScheduledChunk:
        # Members of a batch are never preempted later in the same schedule() (victims
        # exclude them), so their state is still what it was when they were added.
        start = req.num_computed_tokens
        out = req.output_token_ids
        # Within min_tokens no stop token may be sampled (a prefill that does not sample
        # carries the ban harmlessly: the sampler only reads the rows it samples).
        params = req.params
        banned = req.stop_token_ids if len(out) < params.min_tokens else ()
        samples = is_decode or start + n == req.num_tokens
        banned_if = ()
        if params.bans_words and samples:
            words, banned_if = word_bans(params, out)
            banned = (*banned, *words)
        # A penalty counts the tokens before the one sampled: the output as it is now (with
        # asynchronous scheduling its last token may be a PLACEHOLDER, the sampler reads it on
        # the device), and for a repetition penalty the prompt, never modified.
        penalized = None
        if params.penalizes and samples:
            prompt = ()
            if params.repetition_penalty != 1.0:
                if req.prompt_array is None:
                    req.prompt_array = array("q", req.prompt_token_ids)
                prompt = req.prompt_array
            penalized = (prompt, req.output_array())
        if is_decode:
            return ScheduledChunk(req.request_id, start, (out[-1],), table, True, params,
                                  req.seed, len(out), True, banned, req.num_preemptions,
                                  penalized, (), banned_if)
        targets = ()
        if params.prompt_logprobs is not None and req.needs_prompt_logprobs:
            targets = tuple(req.token_slice(start + 1, min(start + n + 1,
                                                            req.num_prompt_tokens)))
        return ScheduledChunk(req.request_id, start, tuple(req.token_slice(start, start + n)),
                              table, samples, params, req.seed, len(out), False, banned,
                              req.num_preemptions, penalized, targets, banned_if)


def word_bans(params: SamplingParams, out: list[int]
              ) -> tuple[list[int], tuple[tuple[int, int], ...]]:
    """The tokens ``params``' bad words forbid after the output ``out``: those banned now,
    and (with asynchronous scheduling, when the last output token is still in flight) the
    (token, token in flight) pairs banned if the token in flight turns out to be the one
    given, which the sampler reads on the device."""
    bans = list(params.bad_single)
    if not out or not params.bad_after:
        return bans, ()

    def follows(earlier: tuple[int, ...]) -> bool:  # the tokens before out[-1] end so
        k = len(earlier)
        return not k or (len(out) > k and tuple(out[-1 - k:-1]) == earlier)

    last = out[-1]
    if last != PLACEHOLDER:
        bans += [ban for earlier, ban in params.bad_after.get(last, ()) if follows(earlier)]
        return bans, ()
    return bans, tuple((ban, key) for key, words in params.bad_after.items()
                       for earlier, ban in words if follows(earlier))


class Scheduler(ABC):
    """Decides what runs each iteration. Contract:

    - ``schedule(now)`` returns a SchedulerOutput; it may admit, and preempt by recompute,
      but it never advances a request's computed tokens.
    - ``update(output, result, now)`` is the only place request state advances: computed
      tokens, sampled tokens, stop conditions, finishing and freeing KV blocks.

    With ``async_scheduling`` (set by the engine) a request may run in the next batch while
    its last one is still in flight, so that the executor launches batch N+1 before N's
    tokens reach the host: ``schedule`` then advances the computed tokens of what it schedules
    and appends a ``PLACEHOLDER`` for each token it samples, and ``update`` only writes the
    sampled tokens in. A decode of a token still in flight reads it on the device; a token
    sampled after its request stopped is dropped.
    """

    #: Registry name; set by subclasses.
    name = "base"
    #: With prefix caching, whether a request waits for a running one to compute the blocks
    #: they share (``_prefix_coming``): not where admission waits for a whole batch to end.
    waits_for_coming_prefix = True

    def __init__(self, limits: SchedulerLimits, block_manager: BlockManager) -> None:
        self.limits = limits
        self.bm = block_manager
        self.waiting = WaitingQueue(limits.queue_policy, limits.queue_window)
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.iteration = 0
        self.num_preemptions = 0
        self._busy: frozenset[str] = frozenset()
        self.async_scheduling = False
        self._released: list[str] = []  # since the last plan: its ``released``

    # ------------------------------------------------------------------ requests in/out
    def add_request(self, req: Request) -> None:
        if req.request_id in self.requests:
            raise RequestRejected(f"duplicate request id {req.request_id!r}")
        why = admission_error(req.num_prompt_tokens, req.params.max_tokens,
                              self.limits.max_model_len, self.bm.block_size,
                              self.bm.num_blocks - self.bm.watermark_blocks)
        if why is not None:
            raise RequestRejected(why)
        self.requests[req.request_id] = req
        self.waiting.push(req)

    def finish(self, req: Request, status: RequestStatus, now: float | None = None) -> None:
        """End ``req`` and release whatever this scheduler holds of it. A request that has
        already ended keeps its status: in the simulated cluster the instances share one
        ``Request``, and the first to end it is not always the last to hold it."""
        if not req.status.finished:
            _drop_in_flight(req)  # sampled in flight after it stopped
            req.status = status
            req.finish_time = now
        self.waiting.remove(req.request_id)
        if req in self.running:
            self.running.remove(req)
        self.bm.free(req.request_id)
        self.requests.pop(req.request_id, None)
        self._released.append(req.request_id)

    def find(self, request_id: str) -> Request | None:
        """The request, wherever this scheduler holds it (``finish`` ends it there)."""
        return self.requests.get(request_id)

    def held(self) -> list[str]:
        """Every request ``find`` finds."""
        return list(self.requests)

    def abort(self, request_id: str, now: float | None = None) -> Request | None:
        req = self.find(request_id)
        if req is not None:
            self.finish(req, RequestStatus.FINISHED_ABORTED, now)
        return req

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    # ------------------------------------------------------------------ the iteration
    @abstractmethod
    def _build(self, now: float) -> Batch:
        """Choose the chunks of this iteration (policy-specific)."""

    def schedule(self, now: float, busy: frozenset[str] = frozenset()) -> SchedulerOutput:
        """Build the next batch. ``busy``: requests in micro-batches still in the pipeline."""
        self._preempted: list[str] = []
        self._short = False  # a request went without the blocks it needs, none preempted
        # Asynchronous scheduling may preempt a request in flight (``_reserve``).
        self._busy = frozenset() if self.async_scheduling else busy
        batch = self._build(now)
        self.iteration += 1
        table = self.bm.table
        chunks = [batch.chunk(r, n, d, table(r.request_id)) for r, n, d in batch.entries]
        if self.async_scheduling:
            for (req, n, _), c in zip(batch.entries, chunks, strict=True):
                req.num_computed_tokens += n
                if c.samples:
                    req.output_token_ids.append(PLACEHOLDER)
        budget = batch.budget if math.isfinite(batch.budget) else None
        released, self._released = self._released, []
        return SchedulerOutput(self.iteration, chunks, self._preempted, budget, released)

    def not_submitted(self, plan: SchedulerOutput) -> None:
        """``plan`` never reached the executor (it was empty, or failed on the way): the
        next plan releases what it released and preempted, so that an executor mirroring
        requests forgets them all the same."""
        self._released[:0] = [*plan.released, *plan.preempted]

    def update(self, output: SchedulerOutput, result: RunnerOutput, now: float) -> list[Request]:
        """Advance state after an iteration; returns requests that got a token or finished."""
        touched = []
        requests, running, sampled = self.requests, RequestStatus.RUNNING, result.sampled
        advance = not self.async_scheduling  # (else ``schedule`` advanced them)
        commit = self.bm.commit if self.bm.prefix_caching else None
        bs = self.bm.block_size
        for chunk in output.chunks:
            req = requests.get(chunk.request_id)
            if req is None or req.status is not running or chunk.epoch != req.num_preemptions:
                continue  # aborted (or preempted, and admitted again) while the iteration ran
            if advance:
                req.num_computed_tokens += len(chunk.token_ids)
            if commit is not None:
                n = len(chunk.token_ids)
                end = chunk.start + n
                if end % bs < n:  # it filled a block: that block's KV is written, cache it
                    # (its tokens are known: each was written in before it was computed)
                    commit(chunk.request_id, end, req.token_slice)
            if not chunk.samples:
                continue
            token = sampled[chunk.request_id]
            out = req.output_token_ids
            if advance:
                out.append(token)
            else:
                out[chunk.output_index] = token
            req.token_times.append(now)
            touched.append(req)
            stop = self._stop_status(req, token, chunk.output_index + 1)
            if stop is not None:
                self.finish(req, stop, now)
        return touched

    def _stop_status(self, req: Request, token: int, n: int) -> RequestStatus | None:
        """How ``req`` stops, if its ``n``-th output token ``token`` stops it: a stop token
        (EOS, ``stop_token_ids``) past ``min_tokens`` stops it, the last allowed token too
        (as vLLM checks them: before the length)."""
        p = req.params
        if n > p.min_tokens and (token in p.stop_token_set
                                 or not p.ignore_eos and token in req.eos_token_ids):
            return RequestStatus.FINISHED_STOPPED
        if n >= p.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        return None

    # ------------------------------------------------------------------ helpers for policies
    def _chunk_size(self, req: Request, left: float, chunked: bool, batch: Batch,
                    cached: int = 0) -> int:
        """Tokens to grant a prefill: min(remaining, budget left), never negative; a chunk
        the budget cuts is rounded down to whole tiles where at least one is left.
        ``cached``: tokens a request about to be admitted finds in the prefix cache.

        Unchunked policies grant the whole remainder or nothing, except that the first
        prefill of an iteration is always granted whole so an over-long prompt cannot starve.
        """
        remaining = req.num_remaining - cached
        if not chunked:
            if remaining <= left or (batch.num_prefills == 0 and left > 0):
                return remaining
            return 0
        n = int(min(remaining, max(left, 0)))
        tile = self.limits.tile_size
        if n < remaining and n >= tile > 1:  # (less than a tile left: all of it, or a prompt
            n -= n % tile  # would wait for as long as decodes leave less than a tile)
        return n

    def _admit(self, req: Request, n: int, batch: Batch, now: float,
               prefix: Sequence[int] | None = None) -> bool:
        """Move the head of the waiting queue to running with a first chunk of ``n`` tokens.

        Only if its whole prompt fits in the free blocks (as Sarathi-Serve's and vLLM's block
        managers admit), though its blocks are taken chunk by chunk: a prompt admitted on its
        first chunk alone would, where running decodes hold the memory, preempt itself once
        the blocks ran out and be admitted again at once, recomputing its chunks for as long
        as those decodes ran.

        With prefix caching, its tokens' longest cached prefix (``prefix``, from
        ``_cached_prefix``: looked up here if not given) is not computed again, and ``n``
        shrinks to what is left."""
        if len(self.running) >= self.limits.max_num_seqs:
            return False
        bm = self.bm
        if prefix is None:
            prefix = self._cached_prefix(req)
        if not bm.can_admit(req.request_id, req.num_tokens, prefix):
            return False
        if bm.prefix_caching and self.waits_for_coming_prefix \
                and not req.needs_prompt_logprobs and self._prefix_coming(req, len(prefix)):
            return False
        if bm.prefix_caching:
            bm.adopt(req.request_id, prefix, req.num_tokens)
            req.num_computed_tokens = len(prefix) * bm.block_size
            if req.num_cached_tokens is None:  # (as vLLM reports it: at first admission)
                req.num_cached_tokens = req.num_computed_tokens
            n = min(n, req.num_remaining)
        bm.allocate(req.request_id, req.num_computed_tokens + n)
        self.waiting.remove(req.request_id)
        self.running.append(req)
        req.status = RequestStatus.RUNNING
        if req.first_scheduled_time is None:
            req.first_scheduled_time = now
        batch.add(req, n)
        return True

    def _cached_prefix(self, req: Request) -> Sequence[int]:
        """The blocks of ``req``'s longest cached prefix (none without prefix caching, or
        where even the longest could not make it fit)."""
        bm = self.bm
        if not bm.prefix_caching or not bm.can_admit(req.request_id, req.num_tokens, None) \
                or req.needs_prompt_logprobs:  # (its prefill computes every position)
            return ()
        return bm.match(req.token_slice(0, req.num_tokens))

    def _prefix_coming(self, req: Request, cached_blocks: int) -> bool:
        """Whether a running request is computing the block of ``req``'s tokens after its
        cached prefix (its prompt begins as ``req``'s tokens do, up to that block, and has not
        registered it yet): ``req`` then waits for it, to start from it rather than compute it
        too, as the samples of n, or requests that share a system prompt and arrive
        together, would."""
        bs = self.bm.block_size
        end = (cached_blocks + 1) * bs
        if end > req.num_tokens - 1:  # (the last token is always computed)
            return False
        mine = None
        for other in self.running:
            if other.num_prompt_tokens >= end \
                    and self.bm.num_committed(other.request_id) <= cached_blocks:
                mine = mine or req.token_slice(0, end)
                if other.prompt_token_ids[:end] == mine:
                    return True
        return False

    def _reserve(self, req: Request, n: int, batch: Batch) -> bool:
        """Make room for ``n`` more tokens of running ``req``, preempting from the tail.

        Victims are the most recently admitted running requests not already in this batch,
        down to ``req`` itself: when ``req`` is the latest of them, it is preempted and False
        is returned. A request never evicts one admitted before it, or two requests that do
        not fit together could evict each other's recompute forever. While requests are in
        a pipeline's stages (``busy``), they are never victims, and ``req`` is not preempted
        but waits, keeping its blocks: it may only lack blocks that those requests hold, and
        evicting itself each time could let two requests take turns throwing their progress
        away forever. With asynchronous scheduling a request in flight may be preempted (or
        every older decode would wait until all newer ones had run out of blocks too): the
        batch in flight writes its blocks before any later batch can reuse them (batches run
        in order), and the token it samples there is dropped.
        """
        total = req.num_computed_tokens + n
        while not self.bm.allocate(req.request_id, total):
            victim = self._victim(req, batch)
            if victim is req and self._busy:
                self._short = True
                return False
            self._preempt(victim)
            if victim is req:
                return False
        return True

    def _victim(self, req: Request, batch: Batch) -> Request:
        """The latest admitted running request that is neither in ``batch`` nor in flight,
        if it was admitted after ``req``; else ``req`` itself."""
        busy = self._busy
        for r in reversed(self.running):
            if r is req or (r.request_id not in batch.ids and r.request_id not in busy):
                return r
        return req

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.bm.free(req.request_id)
        _drop_in_flight(req)  # (``update`` skips it: it is no longer running)
        req.num_computed_tokens = 0
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.push(req)
        self._preempted.append(req.request_id)

    def _new_batch(self, budget: float) -> Batch:
        # Requests in flight may join the next batch only with asynchronous scheduling.
        return Batch(budget, self._busy)

    def _schedule_decodes(self, batch: Batch) -> None:
        # The hot loop of every iteration (and of the simulator): kept free of extra calls.
        running, taken, allocate = RequestStatus.RUNNING, batch.ids, self.bm.allocate
        in_flight = self.async_scheduling
        for req in list(self.running):
            out = req.output_token_ids
            if req.status is not running or req.request_id in taken or not out or \
                    req.num_computed_tokens != len(req.prompt_token_ids) + len(out) - 1 or \
                    in_flight and len(out) >= req.params.max_tokens:
                continue  # not a decode (or already scheduled / in flight / its last token is)
            if allocate(req.request_id, req.num_computed_tokens + 1) or \
                    self._reserve(req, 1, batch):
                batch.add(req, 1, is_decode=True)

    def _schedule_prefills(
        self, batch: Batch, now: float, *, chunked: bool, max_prefills: float = math.inf
    ) -> None:
        """Ongoing prefills first, then new requests in queue order, while budget lasts."""
        for req in list(self.running):
            if batch.num_prefills >= max_prefills or batch.left <= 0:
                return
            if (
                req.request_id in batch.ids  # (most running requests: the batch's decodes)
                or req.status is not RequestStatus.RUNNING
                or req.is_decode
            ):
                continue
            n = self._chunk_size(req, batch.left, chunked, batch)
            if n == 0:
                return
            if self._reserve(req, n, batch):
                batch.add(req, n)
        if self._preempted or self._short:
            return  # memory is short: admitting now would only preempt again
        for req in self.waiting.in_order():
            if batch.num_prefills >= max_prefills or batch.left <= 0:
                return
            prefix = self._cached_prefix(req)
            n = self._chunk_size(req, batch.left, chunked, batch,
                                 len(prefix) * self.bm.block_size)
            if n == 0 or not self._admit(req, n, batch, now, prefix):
                return


def _drop_in_flight(req: Request) -> None:
    """Forget the tokens ``req`` samples in the batch in flight (their places are held by
    ``PLACEHOLDER``s): it stopped, or was preempted and will sample them again."""
    out = req.output_token_ids
    while out and out[-1] == PLACEHOLDER:
        out.pop()
