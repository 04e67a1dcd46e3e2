"""Decode steps replayed from CUDA graphs.

A decode step of a small batch is a few hundred short kernels (about ten per layer); launched
one by one from Python, the launches take longer than the GPU needs to run them. For each of a
few batch sizes the model's forward pass over a decode-only batch is captured once, at start-up;
a batch of B decodes then replays the graph of the smallest captured size >= B, its extra rows
padded so that they change nothing: slot -1 (no KV write), context 0 (attention over nothing).
Batches with a prefill chunk, and decode batches above the largest size, run eagerly.

Every input a graph reads lives at a fixed address in one device buffer; a step fills a pinned
host twin and sends it with one asynchronous copy, ordered before the replay on the same stream.
There are two twins, used in turn: with asynchronous scheduling the next step fills one while
the copy from the other may still wait behind the step in flight. With it, too, the graph reads
placeholder token ids from the previous step's sampled tokens (``sampler.resolve_placeholders``).
The capture itself is a parameter so that the bookkeeping (layout, padding, which graph runs)
is tested on the CPU, where ``capture=lambda step: step`` replays eagerly.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from fluidserve.model.attention import AttentionMetadata
from fluidserve.model.inputs import StepInputs

CAPTURE_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)

Step = Callable[[], torch.Tensor]


class CudaGraphCapture:
    """Captures steps into CUDA graphs that share one memory pool.

    A graph reads, at replay, the memory of every tensor its step used at capture: whoever
    replays it must keep the step (and what it closes over) alive; see DecodeGraphs.
    """

    def __init__(self) -> None:
        self.pool = None
        self.graphs: list[torch.cuda.CUDAGraph] = []

    def __call__(self, step: Step) -> Step:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=self.pool):
            out = step()
        self.pool = g.pool()
        self.graphs.append(g)

        def replay() -> torch.Tensor:
            g.replay()
            return out

        return replay


def capture_sizes(max_batch: int) -> list[int]:
    sizes = [s for s in CAPTURE_SIZES if s < max_batch]
    return sizes + [max_batch] if max_batch > 0 else []


class DecodeGraphs:
    """One captured decode step per batch size, for one worker (whole model, one device)."""

    # The inputs a graph reads: name -> value of a padding row (slot -1: no KV write; context
    # 0: attends to nothing). Each is a view of one device buffer, laid out as these vectors
    # (``top`` entries each, every one starting on 64 bytes as a tensor of its own would) and
    # then the block tables (``top`` rows of ``width``): the vectors and the tables' first
    # rows are one prefix of it, sent by one copy from a pinned twin.
    PAD = {"tokens": 0, "positions": 0, "slots": -1, "ctx": 0}

    def __init__(self, worker, max_batch: int, capture: Callable[[Step], Step] | None = None
                 ) -> None:
        from fluidserve.kernels.triton_ops import AttentionTiles, tile_shape

        self.worker = worker
        self.sizes = capture_sizes(max_batch)
        dev, top = worker.device, self.sizes[-1]
        self.width = -(-worker.spec.max_model_len // worker.spec.block_size)  # table columns
        pin = dev.type == "cuda"
        self.stride = -(-top // 16) * 16  # int32 entries per vector: 64-byte aligned starts
        size = len(self.PAD) * self.stride + top * self.width
        self.host_bufs = [torch.zeros(size, dtype=torch.int32, pin_memory=pin) for _ in "ab"]
        self.host_views = [self._views(b.numpy(), top) for b in self.host_bufs]
        # When each twin's last copy has been made (None: never used, or on the CPU).
        self.sent: list = [None, None]
        self.turn = 0
        self.dev_buf = torch.zeros(size, dtype=torch.int32, device=dev)
        self.dev = self._views(self.dev_buf, top)
        self.cu_q = torch.arange(top + 1, dtype=torch.int32, device=dev)  # one token per run
        self.logits_idx = torch.arange(top, device=dev)
        attn = worker.model.layers[0].self_attn if worker.model.layers else None
        hkv = attn.hkv if attn else 1
        group = attn.h // hkv if attn else 1
        self.steps: dict[int, Step] = {}
        # A graph reads, at replay, the tensors its step used at capture (the tile table of
        # its batch size among them): the steps live as long as the graphs do. (Held only by
        # a capture object that went away with this constructor, they were freed, their memory
        # went to the next eager step, and replays read garbage.)
        self.captured: list[Step] = []
        self.capture = capture = capture or CudaGraphCapture()
        with torch.inference_mode():
            for b in reversed(self.sizes):  # largest first: the smaller reuse its memory
                block_m, splits = tile_shape(np.ones(b, dtype=np.int32), group, hkv)
                tiles = AttentionTiles(torch.arange(b, dtype=torch.int32, device=dev),
                                       torch.zeros(b, dtype=torch.int32, device=dev),
                                       block_m, splits)
                step = self._step(b, tiles)
                self._send(0, top)  # all padding: the warm-up writes nothing
                step()  # warm-up: compiles the kernels for this shape outside the capture
                self.steps[b] = capture(step)
                self.captured.append(step)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    def _views(self, buf, top: int) -> dict:
        """name -> the input's view of ``buf`` (numpy array or tensor)."""
        at = self.stride
        views = {name: buf[i * at:i * at + top] for i, name in enumerate(self.PAD)}
        views["tables"] = buf[len(self.PAD) * at:].reshape(top, self.width)
        return views

    def _step(self, b: int, tiles) -> Step:
        w, d = self.worker, self.dev
        meta = AttentionMetadata(slot_mapping=d["slots"][:b], cu_q=self.cu_q[: b + 1],
                                 ctx_lens=d["ctx"][:b], block_tables=d["tables"][:b],
                                 block_size=w.spec.block_size, runs=[], backend="triton",
                                 tiles=tiles)
        tokens, positions, idx = d["tokens"][:b], d["positions"][:b], self.logits_idx[:b]
        if w.last_tokens is not None:
            from fluidserve.model.sampler import resolve_placeholders

            last = w.last_tokens
            return lambda: w.model(resolve_placeholders(tokens, last), positions, meta,
                                   w.kv_caches, idx)
        return lambda: w.model(tokens, positions, meta, w.kv_caches, idx)

    def size_for(self, inputs: StepInputs) -> int | None:
        """The captured size that runs this batch, or None (not decode-only, or too large).
        A graph's logits are those of every run, in order, which the sampler reads as its
        rows: a batch with a run that samples nothing (a one-token chunk inside a prompt) or
        with rows of prompt logprobs is not one."""
        n = len(inputs.ctx_lens)
        if inputs.num_tokens != n or n > self.sizes[-1] or len(inputs.logits_idx) != n \
                or inputs.sampling.prompt is not None:
            return None
        return next(s for s in self.sizes if s >= n)

    def _host(self) -> dict:
        """The views of the next host twin, once the copy last made from it is done (two
        steps ago: long done, unless the host ran far ahead of the device)."""
        self.turn ^= 1
        if self.sent[self.turn] is not None:
            self.sent[self.turn].synchronize()
        return self.host_views[self.turn]

    def _send(self, n: int, size: int, views: dict | None = None) -> None:
        """Pad rows n..size of the twin ``views`` (by default the next one), then copy to the
        device the vectors and rows 0..size of the tables (what a graph of ``size`` rows
        reads, in one copy)."""
        views = views if views is not None else self._host()
        if n < size:
            for name, value in self.PAD.items():
                views[name][n:size] = value
        end = len(self.PAD) * self.stride + size * self.width
        self.dev_buf[:end].copy_(self.host_bufs[self.turn][:end], non_blocking=True)
        if self.dev_buf.device.type == "cuda":
            event = self.sent[self.turn] or torch.cuda.Event()
            event.record()
            self.sent[self.turn] = event

    def run(self, inputs: StepInputs, size: int) -> torch.Tensor:
        """[n, vocab] logits of a decode-only batch of n <= size rows."""
        n = len(inputs.ctx_lens)
        h = self._host()
        h["tokens"][:n] = inputs.token_ids
        h["positions"][:n] = inputs.positions
        h["slots"][:n] = inputs.slot_mapping
        h["ctx"][:n] = inputs.ctx_lens
        h["tables"][:n, : inputs.block_tables.shape[1]] = inputs.block_tables
        self._send(n, size, h)
        return self.steps[size]()[:n]
