"""The engine core: schedule -> execute -> update, over token ids only.

The core owns the scheduler, the block manager, the executor and the clock. It knows nothing
of text: tokenizing, detokenizing and stop strings belong to the front end
(``fluidserve.engine.output``), so they never sit on the critical path of an iteration. The
core is driven through the typed messages of ``fluidserve.engine.messages``, in this process
(the offline API, the simulator) or in a process of its own (the HTTP server).
"""

from __future__ import annotations

import logging
import random
import time
from collections import deque
from concurrent.futures import Future
from concurrent.futures import wait as futures_wait
from typing import Protocol

from fluidserve.config import ConfigError, EngineConfig
from fluidserve.core.block_manager import make_block_manager
from fluidserve.core.scheduler import (
    RequestRejected,
    RunnerOutput,
    SchedulerLimits,
    SchedulerOutput,
    make_scheduler,
)
from fluidserve.engine.budget import learned_budget, max_iteration_tokens
from fluidserve.engine.messages import (
    AbortRequests,
    AddRequest,
    EngineCoreOutputs,
    RequestDelta,
    SchedulerStats,
)
from fluidserve.engine.telemetry import Telemetry, finished_row
from fluidserve.request import Request, RequestStatus

log = logging.getLogger(__name__)

# A hybrid iteration this long (s) made the streams beside its prefill wait as long for a
# token: under a fixed token budget the engine says once how to bound it, at the second such
# iteration (a first one may be a one-off: a kernel compiled on first use).
STALL_HINT_S = 1.0


class Executor(Protocol):
    """Runs batches. ``submit`` returns at once with a future of the batch's RunnerOutput; up
    to ``depth`` batches may be in flight (the pipeline-parallel stages), and results come back
    in submission order. A future that raises ``ExecutorDead`` means the executor is gone.
    An executor whose linears pad a batch's rows (``model.linear.padded_rows``) says so with
    a true ``pads_rows``; `auto`'s iteration-time model then prices batches on those rows."""

    num_blocks: int
    block_size: int
    max_model_len: int
    depth: int

    def submit(self, plan: SchedulerOutput) -> Future: ...

    def shutdown(self) -> None: ...


def stop_token(req: Request) -> int | None:
    """The one of ``stop_token_ids`` that stopped ``req`` (None: EOS did, or something else)."""
    p, last = req.params, req.output_token_ids[-1]
    if last not in p.stop_token_set or not p.ignore_eos and last in req.eos_token_ids:
        return None
    return last


class ExecutorDead(RuntimeError):
    """A worker of the executor died: no batch can run any more."""


class WallClock:
    def now(self) -> float:
        return time.monotonic()

    def completed(self, result: RunnerOutput) -> float:
        return time.monotonic()


class VirtualClock:
    """Time that moves only by the execution times the executor reports."""

    def __init__(self, start: float = 0.0) -> None:
        self.t = start

    def now(self) -> float:
        return self.t

    def completed(self, result: RunnerOutput) -> float:
        end = result.finish_time if result.finish_time is not None \
            else self.t + result.execution_time
        self.t = max(self.t, end)
        return self.t


class EngineCore:
    def __init__(
        self,
        config: EngineConfig,
        executor: Executor,
        clock: WallClock | VirtualClock | None = None,
        telemetry: Telemetry | None = None,
        emit_outputs: bool = True,
        vocab_size: int | None = None,
        budget_policy=None,
        scheduler_factory=None,
    ) -> None:
        """``budget_policy``: for ``--token-budget auto``, the per-iteration budget (default:
        learned online from this engine's iterations, engine/budget.py).
        ``scheduler_factory(limits, block_manager)``: a scheduler other than the configured
        policy (the prefill and decode roles of a disaggregated deployment)."""
        self.config = config
        self.executor = executor
        self.clock = clock or WallClock()
        self.telemetry = telemetry or Telemetry()
        self.emit_outputs = emit_outputs
        self.vocab_size = vocab_size
        # Besides the tokenizer's EOS (which each request carries), every id the model
        # declares an end of sequence (config.json, generation_config.json) ends a request.
        self.model_eos_ids = tuple(getattr(getattr(executor, "arch", None), "eos_token_ids", ()))
        self.max_model_len = min(config.model.max_model_len or executor.max_model_len,
                                 executor.max_model_len)
        sc = config.scheduler
        auto = sc.token_budget == "auto"
        limits = SchedulerLimits(max_iteration_tokens(sc), sc.max_num_seqs,
                                 self.max_model_len, sc.tile_size, sc.queue_policy,
                                 sc.queue_window)
        self.block_manager = make_block_manager(executor.num_blocks, executor.block_size,
                                                config.cache.watermark,
                                                config.cache.enable_prefix_caching)
        self.scheduler = (scheduler_factory or (lambda lim, bm: make_scheduler(sc.policy, lim, bm))
                          )(limits, self.block_manager)
        self.budget, self._budget_model = None, None
        if auto:
            if budget_policy is None:
                budget_policy, self._budget_model = learned_budget(
                    sc.tbt_slo, sc.budget_margin, sc.tile_size,
                    config.parallel.pipeline_parallel_size,
                    pads_rows=getattr(executor, "pads_rows", False))
            self.budget = budget_policy
            self.scheduler.budget_policy = budget_policy
        # Batches in flight at once: the pipeline's stages; with asynchronous scheduling at
        # least two, the next one launched while the host applies the last one's tokens.
        self.depth = executor.depth
        if config.uses_async_scheduling():
            if getattr(executor, "resolves_placeholders", False):
                self.scheduler.async_scheduling = True
                self.depth = max(self.depth, 2)
            elif sc.async_scheduling:  # asked for (by default it stays off here)
                raise ConfigError("--async-scheduling needs the single-process model executor"
                                  f" (not {type(executor).__name__})")
        # Batches submitted and not yet applied: (plan, future of its RunnerOutput, start).
        self.in_flight: deque[tuple[SchedulerOutput, Future, float]] = deque()
        self._changed = True  # requests added, ended or advanced since the last empty plan
        self._rng = random.Random(config.model.seed)
        # Gathered for the front end's metrics between two outputs messages.
        self._finished_rows: list[dict] = []
        self._iteration_tokens: list[int] = []
        self.collect_stats = False
        self.faults: dict[str, int] = {}  # fault point -> passes left that raise (testing)
        # Testing (messages.ForceEos): output indices made EOS, for all requests or by id.
        self.force_eos_at: frozenset[int] | dict[str, set[int]] = frozenset()
        self._slow_hybrids = 0  # hybrid iterations over STALL_HINT_S under a fixed budget
        self._last_end = float("-inf")  # when the last batch completed

    def notify(self) -> None:
        """Something changed the scheduler's state from outside (a disaggregated cluster's
        hand-off): schedule again even with batches in flight."""
        self._changed = True

    def trip(self, point: str) -> None:
        """Raise if a fault was injected at ``point`` (see messages.InjectFault)."""
        if self.faults.get(point, 0) > 0:
            self.faults[point] -= 1
            raise RuntimeError(f"injected {point} fault")

    # ------------------------------------------------------------------ requests
    def add(self, msg: AddRequest) -> Request:
        """Queue a request; raises RequestRejected (a ValueError) if it can never run."""
        ids = msg.prompt_token_ids
        if self.vocab_size is not None and any(not 0 <= t < self.vocab_size for t in ids):
            raise RequestRejected(f"prompt token ids must be in [0, {self.vocab_size})")
        p = msg.params
        if self.vocab_size is not None and p.logit_bias and p.logit_bias[-1][0] >= self.vocab_size:
            raise RequestRejected(f"logit_bias token ids must be in [0, {self.vocab_size})")
        if self.vocab_size is not None and p.allowed_token_ids \
                and p.allowed_token_ids[-1] >= self.vocab_size:
            raise RequestRejected(f"allowed_token_ids must be in [0, {self.vocab_size})")
        if p.n != 1:
            raise RequestRejected(f"n = {p.n}: a request of the core is one sample (LLM.generate"
                                  " and the server make one request per sample)")
        if p.bad_words:
            raise RequestRejected("bad_words are text: the front end with the tokenizer turns"
                                  " them into bad_words_token_ids before the request comes")
        if self.vocab_size is not None and any(max(w) >= self.vocab_size
                                               for w in p.bad_words_token_ids):
            raise RequestRejected(f"bad_words_token_ids must be in [0, {self.vocab_size})")
        if p.prompt_logprobs is not None and self.config.disagg.disaggregate:
            raise RequestRejected("prompt logprobs are not computed by disaggregated instances"
                                  " (the prefill instance would have to send them on)")
        if any(c.request_id == msg.request_id for plan, _, _ in self.in_flight
               for c in plan.chunks):
            raise RequestRejected(f"request id {msg.request_id!r} is still in a batch in"
                                  " flight (it ended only just now): use a new id")
        seed = p.seed if p.seed is not None else self._rng.getrandbits(63)
        now = self.clock.now() if msg.arrival_time is None else msg.arrival_time
        eos = self.model_eos_ids if msg.eos_token_id is None else tuple(
            dict.fromkeys((msg.eos_token_id, *self.model_eos_ids)))
        req = Request(msg.request_id, ids, p, now, eos_token_ids=eos, seed=seed)
        self.scheduler.add_request(req)
        self._changed = True
        return req

    def abort(self, msg: AbortRequests) -> None:
        self._changed = True
        status = RequestStatus.FINISHED_STOPPED if msg.reason == "stop" \
            else RequestStatus.FINISHED_ABORTED
        for rid in msg.request_ids:
            req = self.scheduler.find(rid)  # (a decode instance's offers too)
            if req is not None:
                self.scheduler.finish(req, status, self.clock.now())
                self._record_finished(req)

    def fail(self, request_ids: list[str], message: str) -> list[RequestDelta]:
        """End these requests with an error the client sees; their KV blocks are freed."""
        self._changed = True
        deltas = []
        for rid in request_ids:
            req = self.scheduler.find(rid)
            if req is None:
                continue
            req.error = message
            self.scheduler.finish(req, RequestStatus.FINISHED_ERROR, self.clock.now())
            self._record_finished(req)
            deltas.append(RequestDelta(rid, [], "error", message,
                                       num_prompt_tokens=req.num_prompt_tokens))
        return deltas

    def fail_all(self, message: str) -> list[RequestDelta]:
        return self.fail(self.scheduler.held(), message)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self.in_flight)

    # ------------------------------------------------------------------ the loop
    def step(self, wait: float | None = None) -> EngineCoreOutputs:
        """Fill the pipeline, then complete the oldest batch in flight.

        With ``wait`` (seconds) and room left in the pipeline, return empty-handed if the
        oldest batch is not done within ``wait``, so that the caller can take in new requests
        and start another micro-batch meanwhile, as the simulator does; with the pipeline
        full, or without ``wait``, block until the oldest batch completes."""
        if wait is not None and self.in_flight and self.in_flight[0][1].done():
            return self.finish_oldest()  # apply it first: its requests may go on at once
        self.fill()
        if not self.in_flight:
            return self.make_outputs([])
        if wait is not None and not self.pipeline_full:
            done, _ = futures_wait([self.in_flight[0][1]], timeout=wait)
            if not done:
                return self.make_outputs([])
        return self.finish_oldest()

    @property
    def pipeline_full(self) -> bool:
        return len(self.in_flight) >= self.depth

    def fill(self) -> None:
        """Schedule and submit batches until ``depth`` are in flight or nothing is left; each
        is scheduled without the requests still in flight in earlier ones. With batches in
        flight and nothing changed since the last empty schedule, there is nothing to do."""
        if not self._changed and self.in_flight:
            return
        while not self.pipeline_full:
            start = self.clock.now()
            busy = frozenset(c.request_id for p, _, _ in self.in_flight for c in p.chunks) \
                if self.in_flight else frozenset()
            plan = self.scheduler.schedule(start, busy)
            if plan.is_empty:
                self.scheduler.not_submitted(plan)
                self._changed = False
                return
            try:
                self.trip("execute")
                fut = self.executor.submit(plan)
            except ExecutorDead:
                raise
            except Exception as e:
                self.scheduler.not_submitted(plan)
                fut = Future()
                fut.set_exception(e)
            self.in_flight.append((plan, fut, start))
            if self.budget is not None and self.budget.learns_gaps:
                self.budget.submitted(plan)

    def finish_oldest(self) -> EngineCoreOutputs:
        """Wait for the oldest batch in flight and apply it."""
        plan, fut, start = self.in_flight.popleft()
        try:
            result = fut.result()
        except ExecutorDead:
            raise
        except Exception as e:  # one bad batch must not take the engine down
            self._last_end = self.clock.now()
            log.error("batch of iteration %d failed: %s", plan.iteration, e)
            message = f"internal error while executing the batch: {e}"
            return self.make_outputs(self.fail([c.request_id for c in plan.chunks], message))
        end = self.clock.completed(result)
        if self.scheduler.async_scheduling:
            # It was scheduled while the one before ran: its iteration began when that ended.
            start, self._last_end = max(start, self._last_end), end
        return self.complete(plan, result, start, end)

    def complete(self, plan: SchedulerOutput, result: RunnerOutput, start: float, end: float
                 ) -> EngineCoreOutputs:
        """Apply a finished iteration (``step`` does this; a pipelined loop calls it directly)."""
        if self.force_eos_at:
            self._force_eos(plan, result)
        self._changed = True
        if self.budget is not None and self.budget.learns_gaps:
            self.budget.observe_gaps(plan, self._token_gaps(plan, end))
        if result.prompt_logprobs:
            self._keep_prompt_logprobs(plan, result)
        touched = self.scheduler.update(plan, result, end)
        self.telemetry.record_iteration(plan, start, end - start)
        if end - start > STALL_HINT_S and self.emit_outputs:
            self._hint_stall(plan, end - start)
        if self._budget_model is not None:
            self._budget_model.observe(plan, end - start)
        if self.collect_stats:
            self._iteration_tokens.append(plan.num_tokens)
        if not self.emit_outputs:  # the simulator reads request state, not deltas
            for req in touched:
                if req.status.finished:
                    self._record_finished(req)
            return EngineCoreOutputs([])
        deltas = []
        logprobs = result.logprobs
        for req in touched:
            self.telemetry.record_token(req)
            lp = logprobs.get(req.request_id)
            d = RequestDelta(req.request_id, [result.sampled[req.request_id]], req.finish_reason,
                             new_logprobs=[lp] if lp is not None else [],
                             num_prompt_tokens=req.num_prompt_tokens)
            times = req.token_times
            # (with its first token too: the front end may end it on a stop string, before
            # the core does)
            first = len(times) == 1
            if first:
                d.ttft = times[0] - req.arrival_time
            elif times:
                d.tbt = times[-1] - times[-2]
            if first or req.status.finished:
                d.scheduling_delay = req.first_scheduled_time - req.arrival_time
                d.num_cached_tokens = req.num_cached_tokens
            if first and req.params.prompt_logprobs is not None:
                d.prompt_logprobs, req.prompt_logprobs = req.prompt_logprobs or [], None
            if req.status.finished:
                self._record_finished(req)
                if req.status is RequestStatus.FINISHED_STOPPED:
                    d.stop_token = stop_token(req)
            deltas.append(d)
        return self.make_outputs(deltas)

    def _keep_prompt_logprobs(self, plan: SchedulerOutput, result: RunnerOutput) -> None:
        """Write each chunk's prompt logprobs into its request, at the chunk's positions (a
        chunk recomputed after a preemption writes the same entries again; one of an
        earlier admission still in flight is dropped, as its tokens are)."""
        chunks = {c.request_id: c for c in plan.chunks if c.prompt_targets}
        for rid, entries in result.prompt_logprobs.items():
            req, c = self.scheduler.requests.get(rid), chunks.get(rid)
            if req is None or c is None or c.epoch != req.num_preemptions:
                continue
            if req.prompt_logprobs is None:
                req.prompt_logprobs = []
            if c.start <= len(req.prompt_logprobs):
                req.prompt_logprobs[c.start:c.start + len(entries)] = entries

    def _hint_stall(self, plan: SchedulerOutput, seconds: float) -> None:
        """Say once that a fixed budget's prefill work stalled running streams, and what
        bounds it (the adaptive budget already plans every iteration for its SLO)."""
        if self._slow_hybrids >= 2 or self.budget is not None or not plan.num_decode_tokens \
                or not plan.num_prefill_tokens:
            return  # said already, or the adaptive budget, or no stream waited on a prefill
        self._slow_hybrids += 1
        if self._slow_hybrids < 2:
            return
        log.warning(
            "an iteration of %d tokens (%d of them prefill) took %.1f s: the %d stream(s)"
            " decoding beside it waited that long for a token. --scheduler sarathi"
            " --token-budget auto --tbt-slo SECONDS sizes each iteration's prefill chunk to"
            " a time-between-tokens bound (or lower --token-budget, now %s).", plan.num_tokens,
            plan.num_prefill_tokens, seconds, plan.num_decode_tokens,
            self.scheduler.limits.token_budget)

    def _token_gaps(self, plan: SchedulerOutput, end: float) -> list[float]:
        """For each decode of this completed batch, the time since its request's previous
        token (decodes that lent a turn to a prefill, by ``sarathi_slack``, excepted)."""
        lent = getattr(self.scheduler, "lent", ())
        gaps = []
        for c in plan.chunks:
            req = self.scheduler.requests.get(c.request_id)
            if c.is_decode and req is not None and req.token_times and c.request_id not in lent:
                gaps.append(end - req.token_times[-1])
        return gaps

    def _force_eos(self, plan: SchedulerOutput, result: RunnerOutput) -> None:
        at = self.force_eos_at
        for c in plan.chunks:
            req = self.scheduler.requests.get(c.request_id)
            where = at.get(c.request_id, ()) if isinstance(at, dict) else at
            if c.samples and c.output_index in where and req is not None \
                    and req.eos_token_ids:
                result.sampled[c.request_id] = req.eos_token_ids[0]

    def stats(self) -> SchedulerStats:
        s = self.scheduler
        b = self.budget
        bm = self.block_manager
        return SchedulerStats(len(s.running), s.num_waiting, bm.usage,
                              s.num_preemptions, len(s.requests),
                              b.last if b is not None else s.limits.token_budget,
                              b.unreachable if b is not None else 0,
                              bm.queries, bm.hits)

    def make_outputs(self, deltas: list[RequestDelta]) -> EngineCoreOutputs:
        """An outputs message: these deltas, plus statistics when ``collect_stats`` is on."""
        out = EngineCoreOutputs(deltas)
        if self.collect_stats:
            out.stats = self.stats()
            out.finished, self._finished_rows = self._finished_rows, []
            out.iteration_tokens, self._iteration_tokens = self._iteration_tokens, []
        return out

    def _record_finished(self, req: Request) -> None:
        if not self.collect_stats:
            self.telemetry.record_finished(req)
            return
        row = finished_row(req)
        self._finished_rows.append(row)
        self.telemetry.record_finished(req, row)
