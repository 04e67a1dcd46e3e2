"""The in-process engine: a front end (tokenizer, output processor) around an engine core.

The offline API (``LLM``) and the profiler drive the engine core in their own process through
this class (the simulator drives ``EngineCore`` directly, on a virtual clock); the HTTP server
runs the same core in a process of its own (``fluidserve.engine.core_proc``). Both exchange
the same typed messages with the core.
"""

from __future__ import annotations

from dataclasses import replace

from fluidserve.config import EngineConfig
from fluidserve.core.scheduler import RequestRejected, RunnerOutput, SchedulerOutput
from fluidserve.engine.core import EngineCore, Executor, VirtualClock, WallClock
from fluidserve.engine.messages import AbortRequests, AddRequest, EngineCoreOutputs
from fluidserve.engine.output import OutputProcessor, RequestOutput
from fluidserve.engine.telemetry import Telemetry
from fluidserve.model.tokenizer import Tokenizer
from fluidserve.request import Request
from fluidserve.sampling_params import SamplingParams

__all__ = ["LLMEngine", "RequestOutput", "VirtualClock", "WallClock", "build_model_executor"]


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
        if config.disagg.disaggregate:
            from fluidserve.config import ConfigError

            raise ConfigError("the in-process engine runs one colocated instance: serve a"
                              " disaggregated deployment with `fluidserve serve --disaggregate`"
                              " (or drive fluidserve.disagg.cluster.Cluster in process)")
        self.config = config
        self.model_dir = config.model.model
        if executor is None:
            executor, self.model_dir = build_model_executor(config)
            try:
                tokenizer = tokenizer or Tokenizer(config.model.tokenizer or self.model_dir)
            except BaseException:
                executor.shutdown()  # (worker ranks would outlive the error)
                raise
        vocab = getattr(getattr(executor, "arch", None), "vocab_size", None)
        try:
            self.core = EngineCore(config, executor, clock, telemetry, emit_outputs, vocab)
        except BaseException:
            executor.shutdown()
            raise
        self.tokenizer = tokenizer
        self.outputs = OutputProcessor(tokenizer)

    # The core's parts, for in-process callers (tests, the profiler, the simulator).
    @property
    def scheduler(self):
        return self.core.scheduler

    @property
    def block_manager(self):
        return self.core.block_manager

    @property
    def executor(self):
        return self.core.executor

    @property
    def telemetry(self) -> Telemetry:
        return self.core.telemetry

    @property
    def clock(self):
        return self.core.clock

    @property
    def max_model_len(self) -> int:
        return self.core.max_model_len

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
        if params.bad_words:
            if self.tokenizer is None:
                raise RequestRejected("this engine has no tokenizer: give bad words as"
                                      " bad_words_token_ids")
            params = replace(params, bad_words=(), bad_words_token_ids=(
                *params.bad_words_token_ids, *self.tokenizer.bad_words_ids(params.bad_words)))
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestRejected("this engine has no tokenizer: pass token ids")
            ids = self.tokenizer.encode(prompt)
        else:
            ids = list(prompt)
        eos = self.tokenizer.eos_token_id if self.tokenizer else None
        req = self.core.add(AddRequest(request_id, ids, params, eos, arrival_time))
        if self.core.emit_outputs:
            self.outputs.add(request_id, params, ids)
        return req

    def abort(self, request_id: str) -> bool:
        known = request_id in self.core.scheduler.requests
        self.core.abort(AbortRequests([request_id]))
        self.outputs.forget(request_id)
        return known

    def has_unfinished(self) -> bool:
        return self.core.has_unfinished()

    def shutdown(self) -> None:
        """Stop the executor's worker processes, if it has any."""
        self.core.executor.shutdown()

    # ------------------------------------------------------------------ the loop
    def step(self) -> list[RequestOutput]:
        return self._process(self.core.step())

    def complete(self, plan: SchedulerOutput, result: RunnerOutput, start: float, end: float
                 ) -> list[RequestOutput]:
        """Apply a finished iteration (``step`` does this; a pipelined loop calls it directly)."""
        return self._process(self.core.complete(plan, result, start, end))

    def fail(self, request_ids: list[str], message: str) -> list[RequestOutput]:
        """End these requests with an error the client sees; their KV blocks are freed."""
        return self._process(EngineCoreOutputs(self.core.fail(request_ids, message)))

    def _process(self, outs: EngineCoreOutputs) -> list[RequestOutput]:
        results, stopped = [], []
        for delta in outs.outputs:
            out, stop = self.outputs.process(delta)
            if out is not None:
                results.append(out)
            if stop:
                stopped.append(delta.request_id)
        if stopped:  # stop strings: the core stops computing these now
            self.core.abort(AbortRequests(stopped, reason="stop"))
        return results


def build_model_executor(config: EngineConfig):
    """The real-model executor for ``config`` (the embedded default model if none is given): the
    model in this process, or tp x pp worker processes (local, or Ray actors)."""
    import torch

    from fluidserve.model.builder import default_model_dir
    from fluidserve.model.runner import ModelExecutor
    from fluidserve.model.worker import cuda_graph_batch, warmup_rows

    m, c, par = config.model, config.cache, config.parallel
    model_dir = str(m.model or default_model_dir())
    if par.world_size > 1:
        from fluidserve.model.worker import plan_workers

        arch, spec = plan_workers(model_dir, config)
        if par.distributed_executor_backend == "ray":
            from fluidserve.engine.ray_executor import RayExecutor

            executor = RayExecutor(spec, par, m.num_threads)
        else:
            from fluidserve.engine.distributed import MultiprocExecutor

            executor = MultiprocExecutor(spec, par, m.num_threads)
        executor.arch = arch
        return executor, model_dir
    if m.num_threads:
        torch.set_num_threads(m.num_threads)
    executor = ModelExecutor(
        model_dir,
        dtype=m.dtype,
        device=m.device,
        block_size=c.block_size,
        num_blocks=c.num_kv_blocks,
        kv_cache_memory_gb=c.kv_cache_memory_gb,
        max_model_len=m.max_model_len,
        attention_backend=m.attention_backend,
        linear_backend=m.linear_backend,
        panel_product=m.panel_product,
        cuda_graph_max_batch=cuda_graph_batch(config),
        max_num_seqs=config.scheduler.max_num_seqs,
        watermark=c.watermark,
        async_scheduling=config.uses_async_scheduling(),
        warmup_rows=warmup_rows(config),
    )
    return executor, model_dir
