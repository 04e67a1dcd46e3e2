"""The engine loop: schedule -> execute -> update, then emit per-token events.

The same loop drives the offline API, the HTTP server and (with a cost-model executor and a
virtual clock) the simulator. Only ``Scheduler.update`` changes request state.
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass, field
from typing import Protocol

from fluidserve.config import EngineConfig
from fluidserve.core.block_manager import BlockManager
from fluidserve.core.scheduler import (
    RequestRejected,
    RunnerOutput,
    SchedulerLimits,
    SchedulerOutput,
    make_scheduler,
)
from fluidserve.engine.telemetry import Telemetry
from fluidserve.model.tokenizer import IncrementalDetokenizer, Tokenizer
from fluidserve.request import Request, RequestStatus
from fluidserve.sampling_params import SamplingParams

log = logging.getLogger(__name__)


class Executor(Protocol):
    num_blocks: int
    block_size: int
    max_model_len: int

    def execute(self, plan: SchedulerOutput) -> RunnerOutput: ...


class WallClock:
    def now(self) -> float:
        return time.perf_counter()

    def after(self, elapsed: float) -> float:
        return time.perf_counter()


class VirtualClock:
    """Time that moves only by the execution times the executor reports."""

    def __init__(self, start: float = 0.0) -> None:
        self.t = start

    def now(self) -> float:
        return self.t

    def after(self, elapsed: float) -> float:
        self.t += elapsed
        return self.t


@dataclass(slots=True)
class RequestOutput:
    """What one step produced for one request: new tokens and text, and whether it ended."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None = None
    error: str | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    new_logprobs: list = field(default_factory=list)
    scheduling_delay: float | None = None  # set when finished: first scheduled - arrival


class LLMEngine:
    def __init__(
        self,
        config: EngineConfig,
        executor: Executor | None = None,
        tokenizer: Tokenizer | None = None,
        clock: WallClock | VirtualClock | None = None,
        telemetry: Telemetry | None = None,
        emit_outputs: bool = True,
    ) -> None:
        self.config = config
        self.emit_outputs = emit_outputs
        self.model_dir = config.model
        if executor is None:
            executor, self.model_dir = build_model_executor(config)
            tokenizer = tokenizer or Tokenizer(config.tokenizer or self.model_dir)
        self.executor = executor
        self.tokenizer = tokenizer
        self.clock = clock or WallClock()
        self.telemetry = telemetry or Telemetry()
        max_len = min(config.max_model_len or executor.max_model_len, executor.max_model_len)
        self.max_model_len = max_len
        limits = SchedulerLimits(
            config.token_budget, config.max_num_seqs, max_len, config.tile_size, config.queue_policy
        )
        self.block_manager = BlockManager(
            executor.num_blocks, executor.block_size, config.watermark
        )
        self.scheduler = make_scheduler(config.scheduler, limits, self.block_manager)
        self._rng = random.Random(config.seed)
        self._detok: dict[str, IncrementalDetokenizer] = {}
        self._sent: dict[str, int] = {}  # characters of text already emitted per request

    # ------------------------------------------------------------------ requests
    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
    ) -> Request:
        """Queue a request; raises RequestRejected (a ValueError) if it can never run."""
        params = params or SamplingParams()
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestRejected("this engine has no tokenizer: pass token ids")
            ids = self.tokenizer.encode(prompt)
        else:
            ids = list(prompt)
        vocab = getattr(getattr(self.executor, "arch", None), "vocab_size", None)
        if vocab is not None and any(not 0 <= t < vocab for t in ids):
            raise RequestRejected(f"prompt token ids must be in [0, {vocab})")
        eos = self.tokenizer.eos_token_id if self.tokenizer else None
        seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
        now = self.clock.now() if arrival_time is None else arrival_time
        req = Request(request_id, ids, params, now, eos_token_id=eos, seed=seed)
        self.scheduler.add_request(req)
        if self.tokenizer is not None:
            self._detok[request_id] = IncrementalDetokenizer(self.tokenizer)
            self._sent[request_id] = 0
        return req

    def abort(self, request_id: str) -> bool:
        req = self.scheduler.abort(request_id, self.clock.now())
        if req is not None:
            self._forget(req)
        return req is not None

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # ------------------------------------------------------------------ the loop
    def step(self) -> list[RequestOutput]:
        start = self.clock.now()
        plan = self.scheduler.schedule(start)
        if plan.is_empty:
            return []
        try:
            result = self.executor.execute(plan)
        except Exception as e:  # one bad batch must not take the engine down
            log.exception("executor failed on iteration %d", plan.iteration)
            return self._fail_batch(plan, f"internal error while executing the batch: {e}")
        end = self.clock.after(result.execution_time)
        return self.complete(plan, result, start, end)

    def complete(self, plan: SchedulerOutput, result: RunnerOutput, start: float, end: float
                 ) -> list[RequestOutput]:
        """Apply a finished iteration (``step`` does this; a pipelined loop calls it directly)."""
        touched = self.scheduler.update(plan, result, end)
        self.telemetry.record_iteration(plan, start, end - start)
        if not self.emit_outputs:  # the simulator reads request state, not output objects
            for req in touched:
                if req.status.finished:
                    self._forget(req)
            return []
        return [self._output(req, result) for req in touched]

    def _output(self, req: Request, result: RunnerOutput) -> RequestOutput:
        self.telemetry.record_token(req)
        token = req.output_token_ids[-1]
        lp = result.logprobs.get(req.request_id)
        out = RequestOutput(req.request_id, [token], self._advance_text(req, token),
                            finished=req.status.finished, finish_reason=req.finish_reason,
                            num_prompt_tokens=req.num_prompt_tokens,
                            num_output_tokens=len(req.output_token_ids),
                            new_logprobs=[lp] if lp is not None else [])
        if out.finished:
            self._forget(req)
            out.scheduling_delay = req.first_scheduled_time - req.arrival_time
        return out

    def _advance_text(self, req: Request, token: int) -> str:
        """Detokenize, apply stop strings, and return the text delta safe to emit now."""
        det = self._detok.get(req.request_id)
        if det is None:
            return ""
        det.push([token])
        text, stops = det.text, req.params.stop
        if stops and not req.status.finished:
            # Only text after what was already emitted can complete a stop string now.
            first = max(0, self._sent[req.request_id] - max(len(s) for s in stops))
            hits = [i for i in (text.find(s, first) for s in stops) if i >= 0]
            if hits:
                det.text = text = text[: min(hits)]
                self.scheduler.finish(req, RequestStatus.FINISHED_STOPPED, self.clock.now())
        # While a stop string could still complete, hold back a possible partial match.
        hold = 0 if req.status.finished or not stops else max(len(s) for s in stops) - 1
        upto = max(self._sent[req.request_id], len(text) - hold)
        delta = text[self._sent[req.request_id] : upto]
        self._sent[req.request_id] = upto
        return delta

    def _fail_batch(self, plan: SchedulerOutput, message: str) -> list[RequestOutput]:
        return self.fail([c.request_id for c in plan.chunks], message)

    def fail(self, request_ids: list[str], message: str) -> list[RequestOutput]:
        """End these requests with an error the client sees; their KV blocks are freed."""
        outs = []
        for rid in request_ids:
            req = self.scheduler.requests.get(rid)
            if req is None:
                continue
            req.error = message
            self.scheduler.finish(req, RequestStatus.FINISHED_ERROR, self.clock.now())
            self._forget(req)
            outs.append(RequestOutput(req.request_id, [], "", finished=True,
                                      finish_reason="error", error=message,
                                      num_prompt_tokens=req.num_prompt_tokens,
                                      num_output_tokens=len(req.output_token_ids)))
        return outs

    def _forget(self, req: Request) -> None:
        self.telemetry.record_finished(req)
        self._detok.pop(req.request_id, None)
        self._sent.pop(req.request_id, None)


def build_model_executor(config: EngineConfig):
    """The real-model executor for ``config`` (building the embedded model if needed)."""
    import torch

    from fluidserve.model.builder import cached_model_dir
    from fluidserve.model.runner import ModelExecutor

    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    model_dir = str(config.model or cached_model_dir())
    executor = ModelExecutor(
        model_dir,
        dtype=config.dtype,
        device=config.device,
        block_size=config.block_size,
        num_blocks=config.num_kv_blocks,
        kv_cache_memory_gb=config.kv_cache_memory_gb,
        max_model_len=config.max_model_len,
        attention_backend=config.attention_backend,
        linear_backend=config.linear_backend,
    )
    return executor, model_dir
