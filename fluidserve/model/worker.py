"""One worker's part of an iteration: its shard of the model, its KV cache, one forward pass.

With one worker (no parallelism) it holds the whole model. With tensor parallelism each worker
of a stage holds a slice of every layer and the layers all-reduce their outputs; with pipeline
parallelism stage ``s`` receives the hidden states of stage ``s - 1`` and sends its own to stage
``s + 1`` (``torch.distributed`` point-to-point: gloo on CPU, NCCL on CUDA). Only the last
stage's first tensor-parallel rank samples.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch

from fluidserve.config import ConfigError
from fluidserve.core.admission import cache_blocks
from fluidserve.model.arch import ArchConfig, read_arch
from fluidserve.model.attention import (
    AttentionMetadata,
    native_supported,
    new_kv_cache,
    triton_unsupported,
)
from fluidserve.model.host_memory import keep_freed_memory, release_freed_memory, to_device
from fluidserve.model.inputs import StepInputs
from fluidserve.model.linear import (
    PANEL_KINDS,
    dot_panels,
    linear_weight_bytes,
    pack_linear_layers,
    packed_linear_supported,
    panels_by_default,
    tile_kind,
    tiles_cover_every_batch,
    tiles_supported,
    warm_up_linears,
    widened,
)
from fluidserve.model.llama import Shard, TensorParallel
from fluidserve.model.loader import DTYPES, load_model, resolve_dtype
from fluidserve.model.sampler import (
    prompt_logprobs_to_host,
    resolve_placeholders,
    sample_on_device,
    to_host,
)

log = logging.getLogger(__name__)


class StepResult(NamedTuple):
    """A step's results on the host, as the sampling worker returns them: one token (and
    logprobs, or None) per sampled row, and the prompt logprobs of the step's chunks."""

    tokens: list[int]
    logprobs: list
    prompt_logprobs: dict[str, list]


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a worker needs to build its part (plain values: it crosses processes)."""

    model_dir: str
    dtype: str = "float32"
    device: str = "cpu"
    block_size: int = 16
    num_blocks: int = 0
    max_model_len: int = 0
    attention_backend: str = "auto"
    linear_backend: str = "auto"
    panel_product: str = "auto"
    cuda_graph_max_batch: int = 0  # decode batches up to this size replay CUDA graphs (0: off)
    # Asynchronous scheduling: a step's token ids may name a row of the previous step's
    # sampled tokens (``inputs.prepare_inputs``), of which there are at most max_num_seqs.
    async_scheduling: bool = False
    max_num_seqs: int = 256
    # oneDNN linears: batches of up to ``warmup_rows`` tokens (the LM head's sampled rows: up
    # to ``warmup_head_rows``) have their kernels built at load (linear.warm_up_linears).
    warmup_rows: int = 0
    warmup_head_rows: int = 0

    def packed_linear(self) -> bool:
        """Whether the workers run their linears prepacked (and pad a batch's rows as
        ``linear.padded_rows`` does), as ``Worker`` decides it."""
        return choose_linear(self.linear_backend, DTYPES[self.dtype], torch.device(self.device))

    def pads_rows(self) -> bool:
        """Whether the workers pad a batch's rows as ``linear.padded_rows`` does: they run
        prepacked oneDNN linears, unless tile copies take every batch (``choose_tiles``
        always makes those: they replace oneDNN's copy)."""
        if not self.packed_linear():
            return False
        panels = self.linear_backend == "tiles" or (
            self.linear_backend == "auto" and panels_by_default())  # as choose_tiles
        return not (panels and self.dtype == "bfloat16" and self.device == "cpu"
                    and tiles_cover_every_batch())


def resolve_max_model_len(arch: ArchConfig, requested: int | None) -> int:
    if requested is not None and requested > arch.max_position_embeddings:
        raise ConfigError(f"--max-model-len {requested} is longer than the model's context"
                          f" window (max_position_embeddings {arch.max_position_embeddings})")
    n = requested or arch.max_position_embeddings
    if arch.sliding_window and arch.sliding_window < n:
        # Sliding-window attention is not implemented; within the window it is exact.
        log.warning("context window capped at the model's sliding window, %d tokens (sliding"
                    " window attention is not implemented)", arch.sliding_window)
        n = arch.sliding_window
    return n


def kv_cache_blocks(arch: ArchConfig, dtype: str, block_size: int, memory_gb: float,
                    tp: int = 1, pp: int = 1, max_seqs: int | None = None,
                    max_len: int | None = None, watermark: float = 0.0) -> int:
    """Blocks that fit ``memory_gb`` on each worker (the stage with the most layers), capped
    as ``cache_blocks`` caps them (a small model's 1 GiB default cache is mostly blocks no
    sequence could use: the embedded model's 21,845 blocks against the 8,192 that 128
    sequences of 1,024 tokens can use)."""
    return cache_blocks(arch.kv_bytes_per_token(DTYPES[dtype].itemsize, tp, pp), block_size,
                        memory_gb, max_seqs, max_len, watermark)


def plan_workers(model_dir: str | Path, config) -> tuple[ArchConfig, WorkerSpec]:
    """The architecture and the worker spec of an EngineConfig (KV size, context window)."""
    m, c, p = config.model, config.cache, config.parallel
    arch = read_arch(model_dir)
    Shard(0, p.tensor_parallel_size, 0, p.pipeline_parallel_size).check(arch)
    dtype = resolve_dtype(m.dtype, arch, m.device)
    max_len = resolve_max_model_len(arch, m.max_model_len)
    blocks = c.num_kv_blocks or kv_cache_blocks(
        arch, dtype, c.block_size, c.kv_cache_memory_gb, p.tensor_parallel_size,
        p.pipeline_parallel_size, config.scheduler.max_num_seqs, max_len, c.watermark)
    spec = WorkerSpec(str(model_dir), dtype, m.device, c.block_size, blocks, max_len,
                      m.attention_backend, m.linear_backend, m.panel_product,
                      cuda_graph_batch(config), *warmup_rows(config))
    return arch, spec


def warmup_rows(config) -> tuple[int, int]:
    """The batch sizes an EngineConfig's workers warm their oneDNN linears up to: (tokens of
    an iteration, the LM head's sampled rows), each at most --warmup-max-rows; (0, 0) off."""
    limit = config.model.warmup_max_rows
    sc = config.scheduler
    if not limit or not config.model.device.startswith("cpu"):
        return 0, 0
    from fluidserve.engine.budget import max_iteration_tokens

    tokens = min(limit, max_iteration_tokens(sc))
    return tokens, min(tokens, sc.max_num_seqs)


def cuda_graph_batch(config) -> int:
    """The largest decode batch captured in a CUDA graph for an EngineConfig (0: none)."""
    m = config.model
    if m.enforce_eager or not m.device.startswith("cuda") or config.parallel.world_size > 1:
        return 0
    return min(m.max_cudagraph_capture_size, config.scheduler.max_num_seqs)


class Worker:
    def __init__(self, spec: WorkerSpec, shard: Shard | None = None, tp_group=None,
                 host_all_reduce=None) -> None:
        shard = shard or Shard()
        self.spec, self.shard = spec, shard
        self.device = torch.device(spec.device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("device 'cuda' requested but torch sees no CUDA device")
        if self.device.type == "cuda" and (self.device.index or 0) >= torch.cuda.device_count():
            raise ValueError(f"device {spec.device!r} requested but torch sees"
                             f" {torch.cuda.device_count()} CUDA device(s)")
        if self.device.type == "cpu":
            keep_freed_memory()  # no page faults on every iteration's activations
        tp = TensorParallel(shard.tp_size, tp_group, host_all_reduce)
        self.arch, self.model = load_model(spec.model_dir, spec.dtype, spec.device,
                                           spec.max_model_len, shard, tp)
        dtype = DTYPES[spec.dtype]
        self.packed_linear = spec.packed_linear()
        self.tile_linear = self.packed_linear and choose_tiles(
            spec.linear_backend, self.model, self.device)
        panels = self.tile_linear and tile_kind() in PANEL_KINDS
        if spec.panel_product == "dot" and not panels:
            raise ValueError("panel product 'dot' needs the panel linears (bfloat16 on a CPU"
                             " with AVX-512 and without AMX, --linear-backend auto or tiles)")
        self.dot_panels = panels and dot_panels(spec.panel_product)
        if self.packed_linear:
            pack_linear_layers(self.model, tiles=self.tile_linear, dot=self.dot_panels)
        log.info("linear layers: %s", self.linear_kernel())
        if self.packed_linear and spec.warmup_rows:
            start = time.perf_counter()
            runs = warm_up_linears(self.model, spec.warmup_rows, spec.warmup_head_rows)
            if runs:
                log.info("oneDNN linears warmed up for batches of up to %d tokens: %d products"
                         " in %.2f s", spec.warmup_rows, runs, time.perf_counter() - start)
        hkv = self.arch.num_kv_heads // shard.tp_size
        # One (key, value) pair of caches per layer of this stage (layouts: model/attention.py).
        self.kv_caches = [new_kv_cache(spec.num_blocks, spec.block_size, hkv, self.arch.head_dim,
                                       dtype, self.device) for _ in self.model.layers]
        if self.device.type == "cpu":
            release_freed_memory()  # what loading and packing left behind
        self.attention = choose_attention(spec.attention_backend, spec.block_size,
                                          self.arch.head_dim, self.device)
        self.prefill_dot = self._choose_prefill_product(dtype)
        self.tp_size, self.pp_size = shard.tp_size, shard.pp_size
        # The last step's sampled tokens, where the next step's placeholders read them.
        self.last_tokens = torch.zeros(max(spec.max_num_seqs, spec.cuda_graph_max_batch, 1),
                                       dtype=torch.int32, device=self.device) \
            if spec.async_scheduling else None
        self.graphs = None
        if spec.cuda_graph_max_batch and self.attention == "triton" \
                and self.device.type == "cuda" and shard.tp_size == shard.pp_size == 1:
            from fluidserve.model.cuda_graphs import DecodeGraphs

            self.graphs = DecodeGraphs(self, spec.cuda_graph_max_batch)

    def _choose_prefill_product(self, dtype: torch.dtype) -> bool:
        """The prefill attention kernel's panels take the linears' product (``--panel-product``:
        the bf16 dot product where it is chosen and built); the kernel's switch is per process.
        Returns whether long runs multiply on the dot product."""
        if self.attention != "native" or dtype != torch.bfloat16:
            return False
        from fluidserve.kernels import cpu_ops

        ops = cpu_ops()
        if not ops.dot_panels_built():
            return False
        dot = dot_panels(self.spec.panel_product)
        ops.use_prefill_dot(dot)
        if ops.prefill_kernel():
            log.info("prefill attention: %s panels, %s", ops.prefill_kernel(),
                     "bf16 dot products" if dot else "float32 FMAs")
        return dot

    def linear_kernel(self) -> str:
        """What the linear layers run on, in words (logged at start-up)."""
        if not self.packed_linear:
            return "F.linear"
        kind = tile_kind()
        if self.tile_linear and kind in PANEL_KINDS:
            product = "bf16 dot products" if self.dot_panels else "float32 FMAs"
            return f"{kind} panels of the compiled kernels, {product}"
        onednn = "oneDNN, prepacked" + (" (widened to float32)" if widened(
            DTYPES[self.spec.dtype]) else "")
        return f"AMX tiles up to 64 rows, else {onednn}" if self.tile_linear else onednn

    def _rank(self, pp_rank: int) -> int:
        return pp_rank * self.tp_size + self.shard.tp_rank

    def forward(self, inputs: StepInputs) -> torch.Tensor:
        """This stage's forward pass: logits on the last stage, hidden states elsewhere."""
        dev, sh = self.device, self.shard
        size = self.graphs.size_for(inputs) if self.graphs else None
        if size is not None:
            self.comm_wait = 0.0
            return self.graphs.run(inputs, size)
        meta = AttentionMetadata(
            slot_mapping=to_device(inputs.slot_mapping, dev),
            cu_q=to_device(inputs.cu_q, dev),
            ctx_lens=to_device(inputs.ctx_lens, dev),
            block_tables=to_device(inputs.block_tables, dev),
            block_size=self.spec.block_size,
            runs=inputs.runs() if self.attention == "eager" else [],
            backend=self.attention,
            last_rows_only=inputs.sampling.prompt is None,
        )
        if self.attention == "triton":
            from fluidserve.kernels.triton_ops import attention_tiles

            attn = self.model.layers[0].self_attn if self.model.layers else None
            if attn is not None:
                meta.tiles = attention_tiles(inputs.cu_q, attn.h // attn.hkv, attn.hkv, dev)
        self.comm_wait = 0.0  # seconds blocked on the neighbouring stages this step
        if sh.first:
            x = to_device(inputs.token_ids, dev)
            if self.last_tokens is not None:
                x = resolve_placeholders(x, self.last_tokens)
        else:
            x = torch.empty(inputs.num_tokens, self.arch.hidden_size, device=dev,
                            dtype=DTYPES[self.spec.dtype])
            t = time.perf_counter()
            torch.distributed.recv(x, src=self._rank(sh.pp_rank - 1))
            self.comm_wait += time.perf_counter() - t
        out = self.model(x, to_device(inputs.positions, dev), meta, self.kv_caches,
                         to_device(inputs.logits_idx, dev))
        if not sh.last:
            t = time.perf_counter()
            torch.distributed.send(out, dst=self._rank(sh.pp_rank + 1))
            self.comm_wait += time.perf_counter() - t
        return out

    def execute(self, inputs: StepInputs) -> StepResult | None:
        """Run the step; the sampled tokens and logprobs on the sampling worker, else None."""
        collect = self.launch(inputs)
        return collect() if collect is not None else None

    def launch(self, inputs: StepInputs) -> Callable[[], StepResult] | None:
        """Queue the step (forward pass, sampling, the copy of its tokens to the host) and
        return, on the sampling worker, the call that waits for its tokens and logprobs; on
        a CPU the step has run by then. With asynchronous scheduling the sampled tokens also
        stay on the device, where the next step's placeholders read them."""
        with torch.inference_mode():
            out = self.forward(inputs)
            if not self.shard.last or self.shard.tp_rank != 0:
                return None
            sampled = sample_on_device(out, inputs.sampling, self.last_tokens)
            if self.last_tokens is not None:
                n = len(sampled.tokens)
                if n > len(self.last_tokens):
                    raise ValueError(f"{n} sampled rows in one step: more than the"
                                     f" {len(self.last_tokens)} of max_num_seqs")
                self.last_tokens[:n].copy_(sampled.tokens)
        if self.device.type != "cuda":
            return lambda: StepResult(*to_host(sampled), prompt_logprobs_to_host(sampled))
        host = sampled.copy_to_host()
        done = torch.cuda.Event()
        done.record()

        def collect() -> StepResult:
            done.synchronize()
            return StepResult(*to_host(host), prompt_logprobs_to_host(host))

        return collect


def choose_attention(backend: str, block_size: int, head_dim: int, device: torch.device) -> str:
    """The attention (and fused-operator) backend that runs: native (compiled CPU kernels),
    triton (GPU) or eager. auto picks native on the CPU and triton on CUDA, falling back to
    eager; asking for native or triton where it cannot run fails loudly."""
    if backend == "eager":
        return "eager"
    if backend == "triton" or (backend == "auto" and device.type == "cuda"):
        why = triton_unsupported(head_dim, device)
        if why is None:
            return "triton"
        if backend == "triton":
            raise ValueError(f"attention backend 'triton' unavailable: {why}")
        return "eager"
    from fluidserve.kernels import build_error, cpu_ops

    supported = native_supported(block_size, head_dim, device)
    if supported and cpu_ops() is not None:
        return "native"
    if backend == "native":
        why = build_error() if supported else (
            f"block size {block_size} / head_dim {head_dim} / device {device.type} not supported"
            " (needs cpu, block size 16 or 32, head_dim a multiple of 16)")
        raise ValueError(f"attention backend 'native' unavailable: {why}")
    return "eager"


# ``auto`` keeps a tile copy of the linear weights only while it takes at most this share of
# the memory available when the model loads.
TILE_COPY_MEMORY_SHARE = 0.25


def choose_tiles(backend: str, model: torch.nn.Module, device: torch.device) -> bool:
    """Whether bf16 linears get a tile copy (``linear.PackedLinear``): with ``tiles`` wherever
    it can run (else an error saying why); with ``auto`` on an AMX CPU while the copy fits a
    quarter of the available memory, and on an AVX2 CPU whose oneDNN has no bf16 kernels
    (there the copy takes every batch and replaces oneDNN's, so it costs no memory)."""
    if backend not in ("auto", "tiles"):
        return False
    weights = [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)]
    why = None
    if device.type != "cpu" or not weights or weights[0].dtype != torch.bfloat16:
        why = "needs bfloat16 weights on the CPU"
    elif not any(tiles_supported(w) for w in weights):
        why = "needs the compiled kernels on a CPU with AMX, AVX-512 or AVX2"
    if why is None and backend == "auto":
        if tile_kind() in PANEL_KINDS:
            return panels_by_default()  # else oneDNN's own bf16 kernels
        extra, available = linear_weight_bytes(model), available_memory()
        if available is not None and extra > TILE_COPY_MEMORY_SHARE * available:
            log.info("linear weights not copied into tiles: %.1f GB would exceed %d%% of the"
                     " %.1f GB available", extra / 1e9, TILE_COPY_MEMORY_SHARE * 100,
                     available / 1e9)
            return False
    if why is not None and backend == "tiles":
        raise ValueError(f"linear backend 'tiles' unavailable: {why}")
    return why is None


def available_memory() -> int | None:
    """MemAvailable from /proc/meminfo in bytes (None where there is none)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def choose_linear(backend: str, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the linears run prepacked for oneDNN (``tiles`` implies it)."""
    if backend == "eager":
        return False
    supported = packed_linear_supported(dtype, device)
    if backend in ("packed", "tiles") and not supported:
        raise ValueError(f"linear backend '{backend}' unavailable for {dtype} on {device.type}"
                         " (needs a CPU with oneDNN support for the dtype)")
    return supported
