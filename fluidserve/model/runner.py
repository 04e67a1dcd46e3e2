"""The model executor: turns a SchedulerOutput into one forward pass over a paged KV cache."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import torch

from fluidserve.core.scheduler.output import RunnerOutput, SchedulerOutput
from fluidserve.model.arch import ArchConfig
from fluidserve.model.attention import AttentionMetadata, native_supported, new_kv_cache
from fluidserve.model.linear import pack_linear_layers, packed_linear_supported
from fluidserve.model.loader import DTYPES, load_model
from fluidserve.model.sampler import sample


def kv_cache_blocks(arch: ArchConfig, dtype: str, block_size: int, memory_gb: float) -> int:
    per_block = arch.kv_bytes_per_token(DTYPES[dtype].itemsize) * block_size
    return max(1, int(memory_gb * (1 << 30) // per_block))


class ModelExecutor:
    """Runs the real model. ``execute`` is the only entry point the engine uses."""

    def __init__(
        self,
        model_dir: str | Path,
        *,
        dtype: str = "float32",
        device: str = "cpu",
        block_size: int = 16,
        num_blocks: int | None = None,
        kv_cache_memory_gb: float = 1.0,
        max_model_len: int | None = None,
        attention_backend: str = "auto",
        linear_backend: str = "auto",
    ) -> None:
        self.device = torch.device(device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("device 'cuda' requested but torch sees no CUDA device")
        self.arch, self.model = load_model(model_dir, dtype, device, max_model_len)
        self.packed_linear = _choose_linear(linear_backend, DTYPES[dtype], self.device)
        if self.packed_linear:
            pack_linear_layers(self.model)
        self.max_model_len = max_model_len or self.arch.max_position_embeddings
        if self.arch.sliding_window and self.arch.sliding_window < self.max_model_len:
            # Sliding-window attention is not implemented; within the window it is exact.
            self.max_model_len = self.arch.sliding_window
        self.block_size = block_size
        self.num_blocks = num_blocks or kv_cache_blocks(
            self.arch, dtype, block_size, kv_cache_memory_gb
        )
        # One (key, value) pair of caches per layer (layouts in model/attention.py).
        self.kv_caches = [
            new_kv_cache(self.num_blocks, block_size, self.arch.num_kv_heads, self.arch.head_dim,
                         DTYPES[dtype], self.device)
            for _ in range(self.arch.num_layers)
        ]
        self.native_attention = _choose_attention(attention_backend, block_size,
                                                  self.arch.head_dim, self.device)

    def execute(self, plan: SchedulerOutput) -> RunnerOutput:
        t0 = time.perf_counter()
        if plan.is_empty:
            return RunnerOutput({}, 0.0)
        with torch.inference_mode():
            logits = self.forward(plan)
            chunks = [c for c in plan.chunks if c.samples]
            tokens, logprobs = sample(logits, chunks)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        sampled = {c.request_id: t for c, t in zip(chunks, tokens, strict=True)}
        lps = {c.request_id: lp for c, lp in zip(chunks, logprobs, strict=True) if lp is not None}
        return RunnerOutput(sampled, time.perf_counter() - t0, lps)

    def forward(self, plan: SchedulerOutput) -> torch.Tensor:
        """Run the batch (writing its KV); [S, vocab] logits of the sampling chunks."""
        ids, pos, meta, logits_idx = self._prepare(plan)
        return self.model(ids, pos, meta, self.kv_caches, logits_idx)

    def logits(self, plan: SchedulerOutput) -> torch.Tensor:
        """``forward`` as float32."""
        return self.forward(plan).float()

    def _prepare(self, plan: SchedulerOutput):
        """Flatten the plan into the model's inputs: token ids, positions, attention metadata
        and the batch positions whose logits are sampled."""
        bs, dev = self.block_size, self.device
        ids: list[int] = []
        pos: list[int] = []
        runs: list[tuple[int, int, int]] = []
        logits_idx: list[int] = []
        tables: list[tuple[int, ...]] = []
        for c in plan.chunks:
            q0, n = len(ids), len(c.token_ids)
            ids.extend(c.token_ids)
            ctx = c.start + n
            pos.extend(range(c.start, ctx))
            runs.append((q0, n, ctx))
            tables.append(c.block_table[: -(-ctx // bs)])
            if c.samples:
                logits_idx.append(q0 + n - 1)
        width = max(len(t) for t in tables)
        table_arr = np.zeros((len(tables), width), dtype=np.int32)
        for i, t in enumerate(tables):
            table_arr[i, : len(t)] = t
        pos_arr = np.asarray(pos, dtype=np.int64)
        run_of_token = np.repeat(np.arange(len(runs)), [n for _, n, _ in runs])
        slots = table_arr[run_of_token, pos_arr // bs].astype(np.int64) * bs + pos_arr % bs
        cu_q = np.zeros(len(runs) + 1, dtype=np.int32)
        cu_q[1:] = np.cumsum([n for _, n, _ in runs])
        meta = AttentionMetadata(
            slot_mapping=torch.from_numpy(slots).to(dev),
            cu_q=torch.from_numpy(cu_q).to(dev),
            ctx_lens=torch.tensor([c for _, _, c in runs], dtype=torch.int32, device=dev),
            block_tables=torch.from_numpy(table_arr).to(dev),
            block_size=bs,
            runs=runs,
            native=self.native_attention,
        )
        as_long = lambda xs: torch.tensor(xs, dtype=torch.long, device=dev)  # noqa: E731
        return as_long(ids), torch.from_numpy(pos_arr).to(dev), meta, as_long(logits_idx)


def _choose_attention(backend: str, block_size: int, head_dim: int, device: torch.device
                      ) -> bool:
    """True for the compiled kernel, False for eager PyTorch; 'native' fails loudly."""
    if backend == "eager":
        return False
    from fluidserve.kernels import build_error, cpu_ops

    supported = native_supported(block_size, head_dim, device)
    if supported and cpu_ops() is not None:
        return True
    if backend == "native":
        why = build_error() if supported else (
            f"block size {block_size} / head_dim {head_dim} / device {device.type} not supported"
            " (needs cpu, block size 16 or 32, head_dim a multiple of 16)")
        raise ValueError(f"attention backend 'native' unavailable: {why}")
    return False


def _choose_linear(backend: str, dtype: torch.dtype, device: torch.device) -> bool:
    if backend == "eager":
        return False
    supported = packed_linear_supported(dtype, device)
    if backend == "packed" and not supported:
        raise ValueError(f"linear backend 'packed' unavailable for {dtype} on {device.type}"
                         " (needs a CPU with oneDNN support for the dtype)")
    return supported
