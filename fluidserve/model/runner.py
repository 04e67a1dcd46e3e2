"""The single-process executor: the whole model in this process, one batch at a time."""

from __future__ import annotations

import time
from concurrent.futures import Future
from pathlib import Path

from fluidserve.core.scheduler.output import RunnerOutput, SchedulerOutput
from fluidserve.model.arch import read_arch
from fluidserve.model.inputs import prepare_inputs
from fluidserve.model.loader import resolve_dtype
from fluidserve.model.worker import (
    Worker,
    WorkerSpec,
    choose_attention,  # noqa: F401 - re-exported for tests
    kv_cache_blocks,
    resolve_max_model_len,
)


def runner_output(request_ids: list[str], tokens: list[int], logprobs: list, seconds: float
                  ) -> RunnerOutput:
    sampled = dict(zip(request_ids, tokens, strict=True))
    lps = {r: lp for r, lp in zip(request_ids, logprobs, strict=True) if lp is not None}
    return RunnerOutput(sampled, seconds, lps)


class ModelExecutor:
    """Runs the real model in this process. The engine calls ``submit``; tests and the
    profiler may call ``execute`` / ``logits`` directly."""

    depth = 1  # batches in flight

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
        cuda_graph_max_batch: int = 0,
        max_num_seqs: int | None = None,
        watermark: float = 0.0,
    ) -> None:
        """``max_num_seqs`` (and the admission ``watermark``): size a memory-sized cache to
        no more than that many sequences of the context window can use."""
        arch = read_arch(model_dir)
        dtype = resolve_dtype(dtype, arch, device)
        max_len = resolve_max_model_len(arch, max_model_len)
        blocks = num_blocks or kv_cache_blocks(arch, dtype, block_size, kv_cache_memory_gb,
                                               max_seqs=max_num_seqs, max_len=max_len,
                                               watermark=watermark)
        spec = WorkerSpec(str(model_dir), dtype, device, block_size, blocks, max_len,
                          attention_backend, linear_backend, cuda_graph_max_batch)
        self.worker = Worker(spec)
        self.arch, self.model = self.worker.arch, self.worker.model
        self.kv_caches, self.device = self.worker.kv_caches, self.worker.device
        self.attention = self.worker.attention
        self.pads_rows = spec.pads_rows()
        self.num_blocks, self.block_size = blocks, block_size
        self.max_model_len = spec.max_model_len

    def submit(self, plan: SchedulerOutput) -> Future:
        fut: Future = Future()
        try:
            fut.set_result(self.execute(plan))
        except Exception as e:
            fut.set_exception(e)
        return fut

    def execute(self, plan: SchedulerOutput) -> RunnerOutput:
        t0 = time.perf_counter()
        if plan.is_empty:
            return RunnerOutput({}, 0.0)
        inputs = prepare_inputs(plan, self.block_size)
        tokens, logprobs = self.worker.execute(inputs)
        return runner_output(inputs.sampling.request_ids, tokens, logprobs,
                             time.perf_counter() - t0)

    def forward(self, plan: SchedulerOutput):
        """Run the batch (writing its KV); [S, vocab] logits of the sampling chunks."""
        import torch

        with torch.inference_mode():
            return self.worker.forward(prepare_inputs(plan, self.block_size))

    def logits(self, plan: SchedulerOutput):
        """``forward`` as float32."""
        return self.forward(plan).float()

    def shutdown(self) -> None:
        pass
