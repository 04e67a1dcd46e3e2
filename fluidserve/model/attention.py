"""Paged attention over one flattened hybrid batch.

The batch is a concatenation of per-request token runs: prefill chunks (many tokens, each
attending causally to the request's earlier tokens, some already in the cache from earlier
chunks) and decodes (one token attending to the whole cache). Keys and values are written
into the paged cache first; every query then reads its context through its block table, so
a chunked prefill computes exactly what an unchunked one would.

KV cache layout per layer: ``[num_blocks, block_size, num_kv_heads, head_dim]``; token ``i``
of a request sits at ``cache[table[i // block_size], i % block_size]``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class PrefillRun:
    q_start: int  # offset of the chunk's first token in the flattened batch
    q_len: int
    start: int  # position of the chunk's first token in its request
    block_table: torch.Tensor  # [num_blocks_of_request] long

    @property
    def ctx_len(self) -> int:
        return self.start + self.q_len


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] long: flat cache slot of every batch token
    prefills: list[PrefillRun]  # runs with q_len > 1
    single_idx: torch.Tensor  # [S] long: batch positions of one-token runs (decodes)
    single_tables: torch.Tensor  # [S, max_blocks] long, padded with block 0 (masked)
    single_ctx_lens: torch.Tensor  # [S] long
    block_size: int


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
) -> None:
    # k, v: [T, Hkv, D]; caches viewed as [num_blocks * block_size, Hkv, D]
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slots, k)
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slots, v)


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """q: [T, H, D]; k, v: [T, Hkv, D] (this batch's new tokens). Returns [T, H, D]."""
    write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    out = torch.empty_like(q)
    for run in meta.prefills:
        sl = slice(run.q_start, run.q_start + run.q_len)
        out[sl] = _prefill_attention(q[sl], k[sl], v[sl], k_cache, v_cache, run, scale)
    if meta.single_idx.numel():
        out[meta.single_idx] = _single_token_attention(
            q[meta.single_idx], k_cache, v_cache, meta, scale
        )
    return out


def _prefill_attention(q, k, v, k_cache, v_cache, run: PrefillRun, scale: float) -> torch.Tensor:
    qh = q.transpose(0, 1).unsqueeze(0)  # [1, H, L, D]
    if run.start == 0:  # first chunk: its own keys are the whole context
        kh, vh = k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)
        o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale, enable_gqa=True)
        return o.squeeze(0).transpose(0, 1)
    ctx = run.ctx_len
    kh = _gather(k_cache, run.block_table)[:ctx].transpose(0, 1).unsqueeze(0)  # [1,Hkv,ctx,D]
    vh = _gather(v_cache, run.block_table)[:ctx].transpose(0, 1).unsqueeze(0)
    q_pos = torch.arange(run.start, ctx, device=q.device)
    mask = torch.arange(ctx, device=q.device)[None, :] <= q_pos[:, None]  # [L, ctx]
    o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale, enable_gqa=True)
    return o.squeeze(0).transpose(0, 1)


def _single_token_attention(q, k_cache, v_cache, meta: AttentionMetadata, scale: float):
    s, max_blocks = meta.single_tables.shape
    kv_shape = (s, max_blocks * meta.block_size, *k_cache.shape[2:])
    kh = k_cache[meta.single_tables].view(kv_shape).transpose(1, 2)  # [S, Hkv, ctx, D]
    vh = v_cache[meta.single_tables].view(kv_shape).transpose(1, 2)
    pos = torch.arange(kv_shape[1], device=q.device)
    mask = (pos[None, :] < meta.single_ctx_lens[:, None])[:, None, None, :]  # [S,1,1,ctx]
    o = F.scaled_dot_product_attention(
        q.unsqueeze(2), kh, vh, attn_mask=mask, scale=scale, enable_gqa=True
    )
    return o.squeeze(2)  # [S, H, D]


def _gather(cache: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    # [n, block_size, Hkv, D] -> [n * block_size, Hkv, D]
    return cache[table].flatten(0, 1)
