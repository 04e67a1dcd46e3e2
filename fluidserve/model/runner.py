"""The single-process executor: the whole model in this process, one batch at a time."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from fluidserve.core.scheduler.output import RunnerOutput, SchedulerOutput
from fluidserve.model.arch import read_arch
from fluidserve.model.inputs import prepare_inputs
from fluidserve.model.loader import resolve_dtype
from fluidserve.model.worker import (
    StepResult,
    Worker,
    WorkerSpec,
    choose_attention,  # noqa: F401 - re-exported for tests
    kv_cache_blocks,
    resolve_max_model_len,
)

log = logging.getLogger(__name__)


def runner_output(request_ids: list[str], result: StepResult, seconds: float) -> RunnerOutput:
    sampled = dict(zip(request_ids, result.tokens, strict=True))
    lps = {r: lp for r, lp in zip(request_ids, result.logprobs, strict=True) if lp is not None}
    return RunnerOutput(sampled, seconds, lps, prompt_logprobs=result.prompt_logprobs)


class ModelExecutor:
    """Runs the real model in this process. The engine calls ``submit``; tests and the
    profiler may call ``execute`` / ``logits`` directly.

    With ``async_scheduling`` a batch's decodes may take their input token from the batch
    submitted before it, still in flight (``PLACEHOLDER``): ``submit`` queues the batch on the
    device and returns, and a thread waits for its tokens to reach the host; on the CPU, where
    the forward pass runs in ``submit``, the future is done when it returns."""

    depth = 1  # batches in flight (the engine keeps two with asynchronous scheduling)

    def __init__(
        self,
        model_dir: str | Path,
        *,
        dtype: str = "auto",
        device: str = "cpu",
        block_size: int = 16,
        num_blocks: int | None = None,
        kv_cache_memory_gb: float = 1.0,
        max_model_len: int | None = None,
        attention_backend: str = "auto",
        linear_backend: str = "auto",
        panel_product: str = "auto",
        cuda_graph_max_batch: int = 0,
        max_num_seqs: int | None = None,
        watermark: float = 0.0,
        async_scheduling: bool = False,
        warmup_rows: tuple[int, int] = (0, 0),
    ) -> None:
        """``max_num_seqs`` (and the admission ``watermark``): size a memory-sized cache to
        no more than that many sequences of the context window can use. ``warmup_rows``:
        (tokens of a batch, the LM head's rows) up to which the oneDNN linears are warmed up
        at load (``worker.warmup_rows``; (0, 0), the default here: not at all)."""
        arch = read_arch(model_dir)
        dtype = resolve_dtype(dtype, arch, device)
        max_len = resolve_max_model_len(arch, max_model_len)
        blocks = num_blocks or kv_cache_blocks(arch, dtype, block_size, kv_cache_memory_gb,
                                               max_seqs=max_num_seqs, max_len=max_len,
                                               watermark=watermark)
        spec = WorkerSpec(str(model_dir), dtype, device, block_size, blocks, max_len,
                          attention_backend, linear_backend, panel_product, cuda_graph_max_batch,
                          async_scheduling, max_num_seqs or WorkerSpec.max_num_seqs,
                          *warmup_rows)
        self.worker = Worker(spec)
        self.resolves_placeholders = async_scheduling
        self._rows: dict[str, int] = {}  # request id -> its row in the last batch's tokens
        self._waiter = None
        if async_scheduling and self.worker.device.type == "cuda":
            import torch

            # (on the model's device: a fresh thread would wait on device 0's context)
            index = self.worker.device.index
            self._waiter = ThreadPoolExecutor(
                1, thread_name_prefix="fluidserve-tokens", initializer=torch.cuda.set_device,
                initargs=(torch.cuda.current_device() if index is None else index,))
        if async_scheduling and self._waiter is None:
            log.warning("--async-scheduling on the CPU: a batch runs when it is submitted, so"
                        " each token reaches its stream one iteration later, and the host's"
                        " work between iterations overlaps nothing (it is meant for CUDA)")
        self.arch, self.model = self.worker.arch, self.worker.model
        self.kv_caches, self.device = self.worker.kv_caches, self.worker.device
        self.attention = self.worker.attention
        self.pads_rows = spec.pads_rows()
        self.num_blocks, self.block_size = blocks, block_size
        self.max_model_len = spec.max_model_len

    def submit(self, plan: SchedulerOutput) -> Future:
        fut: Future = Future()
        try:
            if self._waiter is not None and not plan.is_empty:  # CUDA, asynchronous
                return self._waiter.submit(self._launch(plan))
            fut.set_result(self.execute(plan))
        except Exception as e:
            fut.set_exception(e)
        return fut

    def execute(self, plan: SchedulerOutput) -> RunnerOutput:
        """Run the batch and wait for its tokens."""
        if plan.is_empty:
            return RunnerOutput({}, 0.0)
        return self._launch(plan)()

    def _launch(self, plan: SchedulerOutput) -> Callable[[], RunnerOutput]:
        """Queue the batch; returns the call that waits for its RunnerOutput. With
        asynchronous scheduling its placeholders read the rows of the batch launched before
        it, and its own rows are kept for the next one."""
        t0 = time.perf_counter()
        rows = self._rows if self.resolves_placeholders else None
        try:
            inputs = prepare_inputs(plan, self.block_size, rows)
            collect = self.worker.launch(inputs)
        except Exception:
            self._rows = {}  # (the placeholders of the next batch belong to failed requests)
            raise
        ids = inputs.sampling.request_ids
        if self.resolves_placeholders:
            self._rows = {rid: i for i, rid in enumerate(ids)}
        return lambda: runner_output(ids, collect(), time.perf_counter() - t0)

    def forward(self, plan: SchedulerOutput):
        """Run the batch (writing its KV); [S, vocab] logits of the sampling chunks."""
        import torch

        with torch.inference_mode():
            return self.worker.forward(prepare_inputs(plan, self.block_size))

    def logits(self, plan: SchedulerOutput):
        """``forward`` as float32."""
        return self.forward(plan).float()

    def shutdown(self) -> None:
        if self._waiter is not None:
            self._waiter.shutdown(wait=True)
