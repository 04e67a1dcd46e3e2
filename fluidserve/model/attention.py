"""Paged attention over one flattened hybrid batch.

The batch is a concatenation of per-request query runs: prefill chunks (many tokens, each
attending causally to the request's earlier tokens, some already in the cache from earlier
chunks) and decodes (one token attending to the whole cache). Keys and values of the batch are
written into the paged cache first; every query then reads its context through its block
table, so a chunked prefill computes exactly what an unchunked one would.

KV cache layout per layer (token ``i`` of a request lives in block ``table[i // block_size]``
at offset ``i % block_size``):

- keys   ``[num_blocks, num_kv_heads, head_dim, block_size]``: transposed within a block, so the
  compiled kernel scores a query against a whole block with block-wide vector multiply-adds;
- values ``[num_blocks, num_kv_heads, block_size, head_dim]``.

Three implementations share this layout, picked by ``AttentionMetadata.backend``: ``native``,
the compiled CPU kernel (``fluidserve.kernels``: one call per layer for the whole batch, no
padding, no per-request Python); ``triton``, the same contract in Triton for GPUs
(``fluidserve.kernels.triton_ops``); and ``eager``, the PyTorch code below, which is the
reference and the fallback where neither can run.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from types import ModuleType

import numpy as np
import torch
import torch.nn.functional as F

from fluidserve.model.host_memory import huge_page_empty

# Runs of at least this many query tokens take the compiled kernel's prefill path (bf16 on
# AMX tiles or the panels where the CPU has them, else ATen's flash attention): faster than
# the per-token work items once a run has many queries (measured at 16 queries and up).
MIN_LONG_RUN = 16
# The panels' prefill kernel takes 16 query tokens at a time on AVX2 and 32 on AVX-512, and
# the per-token items are slower or faster beside it. On an AVX2 CPU the items of bf16 runs
# keep their 16-lane vectors on the stack, and the kernel is faster from two query tokens up
# (sixteen layers, four runs of 2 / 4 / 8 tokens: 0.80x / 0.43x / 0.25x the items' time;
# 2-core EPYC, Zen 3). With AVX-512 the items run in registers and a run shorter than a
# 32-token tile pays for the whole tile: four runs of 16 / 24 / 32 / 64 tokens after 512
# cached took 32.7 / 38.2 / 34.3 / 57.6 ms on the kernel and 22.5 / 38.1 / 44.2 / 92.4 ms on
# the items (2-core Emerald Rapids class Xeon; ``scripts/bench_attention.py --prefill 4x32@512
# --min-long-run 2 1000000000``).
MIN_LONG_RUN_PANELS = {"avx2": 2, "avx512": 32}


def min_long_run(ops: ModuleType, dtype: torch.dtype) -> int:
    """The shortest run (in query tokens) that the compiled CPU kernel ``ops`` gives to its
    prefill path for a ``dtype`` model (asked each step: the kernel can be switched off)."""
    kernel = ops.prefill_kernel() if hasattr(ops, "prefill_kernel") else ""
    if dtype != torch.bfloat16:
        return MIN_LONG_RUN
    return MIN_LONG_RUN_PANELS.get(kernel, MIN_LONG_RUN)


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64: flat cache slot (block * block_size + offset)
    cu_q: torch.Tensor  # [S + 1] int32: run s holds batch tokens cu_q[s] .. cu_q[s+1]-1
    ctx_lens: torch.Tensor  # [S] int32: the run's last position + 1
    block_tables: torch.Tensor  # [S, max_blocks] int32, padded with block 0
    block_size: int
    runs: list[tuple[int, int, int]]  # (q_start, q_len, ctx_len) per run, on the host
    backend: str = "native"  # native (compiled CPU kernels) | triton | eager
    tiles: object = None  # triton: the launch grid (triton_ops.AttentionTiles)
    # Whether every row whose logits the step needs ends its run (the sampled rows), so the
    # last layer may compute those rows alone (``sampled_rows_metadata``); not with rows of
    # prompt logprobs.
    last_rows_only: bool = True

    @property
    def compiled(self) -> bool:
        """True when the layers run on kernels (``ops``), False on the eager reference."""
        return self.backend != "eager"

    @property
    def ops(self) -> ModuleType:
        """The kernel module of this backend (same call signatures on every device)."""
        return kernel_ops(self.backend)


def sampled_rows_metadata(meta: AttentionMetadata, rows: torch.Tensor, group: int,
                          num_kv_heads: int) -> AttentionMetadata:
    """The metadata of attention for ``rows`` alone, each the last row of its run (the rows
    a step samples): one query per run, at the run's last position, over the same context.
    ``slot_mapping`` stays the whole batch's: every row's keys and values are still written.
    For the compiled backends (native, triton); ``group`` and ``num_kv_heads`` shape
    triton's launch grid."""
    if meta.backend not in ("native", "triton"):
        raise ValueError(f"sampled_rows_metadata: backend {meta.backend!r} has none")
    n = len(rows)
    runs = torch.searchsorted(meta.cu_q[1:], rows.to(meta.cu_q.dtype), right=True)
    sub = AttentionMetadata(
        slot_mapping=meta.slot_mapping,
        cu_q=torch.arange(n + 1, dtype=torch.int32, device=meta.cu_q.device),
        ctx_lens=meta.ctx_lens[runs], block_tables=meta.block_tables[runs],
        block_size=meta.block_size, runs=[], backend=meta.backend)
    if meta.backend == "triton":
        sub.tiles = meta.ops.attention_tiles(np.arange(n + 1, dtype=np.int32), group,
                                             num_kv_heads, meta.cu_q.device)
    return sub


def kernel_ops(backend: str) -> ModuleType:
    if backend == "triton":
        from fluidserve.kernels import triton_ops

        return triton_ops
    from fluidserve.kernels import cpu_ops

    return cpu_ops()


def new_kv_cache(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    k_shape = (num_blocks, num_kv_heads, head_dim, block_size)
    v_shape = (num_blocks, num_kv_heads, block_size, head_dim)
    if device.type == "cpu":  # (a decode reads scattered blocks: huge pages spare the TLB)
        k, v = huge_page_empty(k_shape, dtype), huge_page_empty(v_shape, dtype)
    else:
        k = torch.empty(k_shape, dtype=dtype, device=device)
        v = torch.empty(v_shape, dtype=dtype, device=device)
    # Written, not just allocated: zeroed-on-demand pages would otherwise fault in one by one
    # on the serving path the first time each block is used (measured: 4% of an engine's
    # time under load went to page faults).
    k.fill_(0)
    v.fill_(0)
    return k, v


def native_supported(block_size: int, head_dim: int, device: torch.device) -> bool:
    return device.type == "cpu" and block_size in (16, 32) and head_dim % 16 == 0 \
        and head_dim <= 256


def triton_unsupported(head_dim: int, device: torch.device) -> str | None:
    """Why the Triton kernels cannot run here, or None. On the CPU they run only under
    Triton's interpreter (``TRITON_INTERPRET=1``), which the tests use."""
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        return "needs a CUDA device (or TRITON_INTERPRET=1 on the CPU, for testing)"
    if device.type not in ("cpu", "cuda"):
        return f"device {device.type} not supported"
    if head_dim > 256:
        return f"head_dim {head_dim} > 256"
    try:
        import triton  # noqa: F401
    except ImportError as e:
        return f"triton is not installed ({e})"
    return None


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """q: [T, H, D]; k, v: [T, Hkv, D] (this batch's new tokens; views into the fused QKV
    output will do: the kernels read them through their strides). Returns [T, H, D]."""
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if meta.backend == "native":
        meta.ops.paged_attention(out, q, k, v, k_cache, v_cache, meta.slot_mapping, meta.cu_q,
                                 meta.ctx_lens, meta.block_tables, scale,
                                 min_long_run(meta.ops, q.dtype))
        return out
    if meta.backend == "triton":
        meta.ops.paged_attention(out, q, k, v, k_cache, v_cache, meta.slot_mapping, meta.cu_q,
                                 meta.ctx_lens, meta.block_tables, scale, meta.tiles)
        return out
    write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    singles = []
    for s, (q0, n, ctx) in enumerate(meta.runs):
        if n == 1:
            singles.append(s)
            continue
        sl = slice(q0, q0 + n)
        out[sl] = _run_attention(q[sl], k[sl], v[sl], k_cache, v_cache,
                                 meta.block_tables[s], ctx, scale)
    if singles:
        idx = torch.tensor([meta.runs[s][0] for s in singles], device=q.device)
        out[idx] = _single_token_attention(q[idx], k_cache, v_cache, meta, singles, scale)
    return out


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slots: torch.Tensor) -> None:
    bs = k_cache.shape[3]
    blk, off = slots // bs, slots % bs
    k_cache[blk, :, :, off] = k  # indexed dims first: [T, Hkv, D]
    v_cache[blk, :, off, :] = v


def gather_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, table: torch.Tensor, ctx: int
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """A request's context as contiguous [Hkv, ctx, D] keys and values."""
    hkv, d, bs = k_cache.shape[1:]
    nb = -(-ctx // bs)
    blocks = table[:nb].long()
    kh = k_cache[blocks].permute(1, 0, 3, 2).reshape(hkv, nb * bs, d)[:, :ctx]
    vh = v_cache[blocks].permute(1, 0, 2, 3).reshape(hkv, nb * bs, d)[:, :ctx]
    return kh, vh


def _run_attention(q, k, v, k_cache, v_cache, table, ctx: int, scale: float) -> torch.Tensor:
    n = q.shape[0]
    qh = q.transpose(0, 1).unsqueeze(0)  # [1, H, L, D]
    if ctx == n:  # a first chunk: its own keys are the whole context
        kh, vh = k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)
        o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale, enable_gqa=True)
        return o.squeeze(0).transpose(0, 1)
    kh, vh = gather_kv(k_cache, v_cache, table, ctx)
    q_pos = torch.arange(ctx - n, ctx, device=q.device)
    mask = torch.arange(ctx, device=q.device)[None, :] <= q_pos[:, None]  # [L, ctx]
    o = F.scaled_dot_product_attention(qh, kh[None], vh[None], attn_mask=mask, scale=scale,
                                       enable_gqa=True)
    return o.squeeze(0).transpose(0, 1)


def _single_token_attention(q, k_cache, v_cache, meta: AttentionMetadata, runs: list[int],
                            scale: float) -> torch.Tensor:
    # One query per run: gather every run's blocks into a padded [S, Hkv, ctx_max, D] batch.
    bs = meta.block_size
    ctx = meta.ctx_lens[runs].long()
    nb = -(-int(ctx.max()) // bs)
    tables = meta.block_tables[runs, :nb].long()  # [S, nb]
    s, hkv, d = len(runs), k_cache.shape[1], k_cache.shape[2]
    kh = k_cache[tables].permute(0, 2, 1, 4, 3).reshape(s, hkv, nb * bs, d)
    vh = v_cache[tables].permute(0, 2, 1, 3, 4).reshape(s, hkv, nb * bs, d)
    pos = torch.arange(nb * bs, device=q.device)
    valid = pos[None, :] < ctx[:, None]  # [S, ctx_max]
    # Slots past a run's context (a block's unused tail, the block 0 that pads short tables)
    # hold whatever another request left there: zero them, since a masked NaN still turns
    # a score, and a zero-weighted NaN value an output, into NaN.
    hidden = ~valid[:, None, :, None]
    kh, vh = kh.masked_fill(hidden, 0), vh.masked_fill(hidden, 0)
    o = F.scaled_dot_product_attention(
        q.unsqueeze(2), kh, vh, attn_mask=valid[:, None, None, :], scale=scale,
        enable_gqa=True
    )
    return o.squeeze(2)  # [S, H, D]
