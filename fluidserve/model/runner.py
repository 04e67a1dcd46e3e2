"""The model executor: turns a SchedulerOutput into one forward pass over a paged KV cache."""

from __future__ import annotations

import time
from pathlib import Path

import torch

from fluidserve.core.scheduler.output import RunnerOutput, SchedulerOutput
from fluidserve.model.arch import ArchConfig
from fluidserve.model.attention import AttentionMetadata, PrefillRun
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
    ) -> None:
        self.device = torch.device(device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("device 'cuda' requested but torch sees no CUDA device")
        self.arch, self.model = load_model(model_dir, dtype, device, max_model_len)
        self.max_model_len = max_model_len or self.arch.max_position_embeddings
        if self.arch.sliding_window and self.arch.sliding_window < self.max_model_len:
            # Sliding-window attention is not implemented; within the window it is exact.
            self.max_model_len = self.arch.sliding_window
        self.block_size = block_size
        self.num_blocks = num_blocks or kv_cache_blocks(
            self.arch, dtype, block_size, kv_cache_memory_gb
        )
        shape = (self.num_blocks, block_size, self.arch.num_kv_heads, self.arch.head_dim)
        # One (key, value) pair of caches per layer, each [num_blocks, block_size, Hkv, D].
        self.kv_caches = [
            (
                torch.zeros(shape, dtype=DTYPES[dtype], device=self.device),
                torch.zeros(shape, dtype=DTYPES[dtype], device=self.device),
            )
            for _ in range(self.arch.num_layers)
        ]

    def execute(self, plan: SchedulerOutput) -> RunnerOutput:
        t0 = time.perf_counter()
        if plan.is_empty:
            return RunnerOutput({}, 0.0)
        with torch.inference_mode():
            logits = self.logits(plan)
            chunks = [c for c in plan.chunks if c.samples]
            tokens, logprobs = sample(logits, chunks)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        sampled = {c.request_id: t for c, t in zip(chunks, tokens, strict=True)}
        lps = {c.request_id: lp for c, lp in zip(chunks, logprobs, strict=True) if lp is not None}
        return RunnerOutput(sampled, time.perf_counter() - t0, lps)

    def logits(self, plan: SchedulerOutput) -> torch.Tensor:
        """Run the batch (writing its KV); [S, vocab] float32 logits of the sampling chunks."""
        ids, pos, meta, logits_idx = self._prepare(plan)
        return self.model(ids, pos, meta, self.kv_caches, logits_idx)

    def _prepare(self, plan: SchedulerOutput):
        bs = self.block_size
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        logits_idx: list[int] = []
        prefills: list[PrefillRun] = []
        singles: list[tuple[int, int, tuple[int, ...]]] = []
        for c in plan.chunks:
            q0 = len(ids)
            ids.extend(c.token_ids)
            positions = range(c.start, c.context_len)
            pos.extend(positions)
            slots.extend(c.block_table[p // bs] * bs + p % bs for p in positions)
            if c.num_tokens == 1:
                singles.append((q0, c.context_len, c.block_table))
            else:
                table = torch.tensor(c.block_table[: -(-c.context_len // bs)], device=self.device)
                prefills.append(PrefillRun(q0, c.num_tokens, c.start, table))
            if c.samples:
                logits_idx.append(q0 + c.num_tokens - 1)
        dev = self.device
        max_blocks = max((-(-ctx // bs) for _, ctx, _ in singles), default=0)
        tables = [
            list(t[:max_blocks]) + [0] * (max_blocks - len(t[:max_blocks])) for *_, t in singles
        ]
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            prefills=prefills,
            single_idx=torch.tensor([q for q, _, _ in singles], dtype=torch.long, device=dev),
            single_tables=torch.tensor(tables, dtype=torch.long, device=dev).view(
                len(singles), max_blocks
            ),
            single_ctx_lens=torch.tensor([c for _, c, _ in singles], dtype=torch.long, device=dev),
            block_size=bs,
        )
        as_long = lambda xs: torch.tensor(xs, dtype=torch.long, device=dev)  # noqa: E731
        return as_long(ids), as_long(pos), meta, as_long(logits_idx)
