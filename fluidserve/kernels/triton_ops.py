"""GPU kernels in Triton, with the call signatures of the compiled CPU kernels.

``rms_norm``, ``fused_add_rms_norm``, ``rope``, ``silu_and_mul`` and ``paged_attention`` take the
same arguments as their C++ counterparts (``csrc/paged_attention_cpu.cpp``), so the model's
compiled path (``DecoderLayer.forward_native``) runs unchanged on either device. Each rounds
where the eager reference rounds (model dtype after every operator, float32 inside).

Paged attention covers the whole flattened hybrid batch in one launch and reads keys and values
straight from the paged cache (no gather, no padding to the longest context):

- a *tile* is ``BLOCK_M`` query rows of one run and one KV head: ``BLOCK_M // G`` tokens times
  the ``G`` query heads that share the KV head (grouped-query attention packs a decode's heads
  into one tile, so each key block is read once for all of them);
- each program walks its run's keys up to its last row's position, ``BLOCK_N`` keys at a time,
  gathering them from their blocks through the block table, with an online softmax;
- small decode batches split every tile's keys into ``SPLITS`` ranges (flash-decoding): with a
  handful of tiles a GPU would otherwise run a few programs for the whole context. A second
  kernel merges the partial results.

The tile table is built on the host from the plan (``attention_tiles``), so no launch needs a
device-to-host sync and a decode batch of fixed size has a fixed grid (CUDA graphs capture it).

Tests run these kernels on the CPU through Triton's interpreter (``TRITON_INTERPRET=1``, which
must be set before this module is first imported) against the eager reference.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import triton
import triton.language as tl

_DOT_PRECISION = {torch.float32: "ieee", torch.bfloat16: "tf32", torch.float16: "tf32"}


def _pow2(n: int, least: int = 1) -> int:
    return max(least, triton.next_power_of_2(n))


# ----------------------------------------------------------------------------- norms, RoPE, MLP


@triton.jit
def _rms_norm_kernel(out_ptr, x_ptr, res_ptr, w_ptr, stride_o, stride_x, stride_r, n, eps,
                     ADD: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    m = cols < n
    x = tl.load(x_ptr + row * stride_x + cols, mask=m, other=0.0)
    if ADD:  # residual += x, rounded to the model dtype as the eager add is
        r = tl.load(res_ptr + row * stride_r + cols, mask=m, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(r.dtype)
        tl.store(res_ptr + row * stride_r + cols, x, mask=m)
    xf = x.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / n + eps)
    y = (xf * inv).to(x.dtype).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=m, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (y * w).to(x.dtype), mask=m)


def rms_norm(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    """out = weight * norm(x); x, out: [T, hidden]."""
    t, n = x.shape
    if t:
        _rms_norm_kernel[(t,)](out, x, x, weight, out.stride(0), x.stride(0), x.stride(0), n,
                               eps, ADD=False, BLOCK=_pow2(n), num_warps=_warps(n))


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> None:
    """In place: residual += x, then x = weight * norm(residual)."""
    t, n = x.shape
    if t:
        _rms_norm_kernel[(t,)](x, x, residual, weight, x.stride(0), x.stride(0),
                               residual.stride(0), n, eps, ADD=True, BLOCK=_pow2(n),
                               num_warps=_warps(n))


def _warps(n: int) -> int:
    return 4 if n <= 4096 else 8 if n <= 16384 else 16


@triton.jit
def _rope_kernel(q_ptr, k_ptr, pos_ptr, cos_ptr, sin_ptr, sq_t, sq_h, sk_t, sk_h, s_cs,
                 num_q_heads, half, HALF: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    if h < num_q_heads:
        base = q_ptr + t * sq_t + h * sq_h
    else:
        base = k_ptr + t * sk_t + (h - num_q_heads) * sk_h
    p = tl.load(pos_ptr + t).to(tl.int64)
    i = tl.arange(0, HALF)
    m = i < half
    x1 = tl.load(base + i, mask=m, other=0.0)
    x2 = tl.load(base + half + i, mask=m, other=0.0)
    c1 = tl.load(cos_ptr + p * s_cs + i, mask=m, other=0.0)
    c2 = tl.load(cos_ptr + p * s_cs + half + i, mask=m, other=0.0)
    s1 = tl.load(sin_ptr + p * s_cs + i, mask=m, other=0.0)
    s2 = tl.load(sin_ptr + p * s_cs + half + i, mask=m, other=0.0)
    a, b = x1.to(tl.float32), x2.to(tl.float32)
    # rotate-half: [x1, x2] * cos + [-x2, x1] * sin
    tl.store(base + i, (a * c1 - b * s1).to(x1.dtype), mask=m)
    tl.store(base + half + i, (b * c2 + a * s2).to(x1.dtype), mask=m)


def rope(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
         sin: torch.Tensor) -> None:
    """In place on q: [T, H, D] and k: [T, Hkv, D] (row-strided views of the QKV output)."""
    t, h, d = q.shape
    if t:
        _rope_kernel[(t, h + k.shape[1])](q, k, positions, cos, sin, q.stride(0), q.stride(1),
                                          k.stride(0), k.stride(1), cos.stride(0), h, d // 2,
                                          HALF=_pow2(d // 2))


@triton.jit
def _silu_and_mul_kernel(out_ptr, gu_ptr, stride_o, stride_gu, n, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = cols < n
    g = tl.load(gu_ptr + row * stride_gu + cols, mask=m, other=0.0)
    u = tl.load(gu_ptr + row * stride_gu + n + cols, mask=m, other=0.0)
    gf = g.to(tl.float32)
    act = (gf / (1.0 + tl.exp(-gf))).to(g.dtype).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (act * u.to(tl.float32)).to(g.dtype), mask=m)


def silu_and_mul(out: torch.Tensor, gu: torch.Tensor) -> None:
    """out = silu(gate) * up for gu = [gate | up]: [T, 2F]; out: [T, F]."""
    t, n = out.shape
    if t:
        block = min(_pow2(n), 2048)
        _silu_and_mul_kernel[(t, triton.cdiv(n, block))](out, gu, out.stride(0), gu.stride(0),
                                                         n, BLOCK=block)


# ------------------------------------------------------------------------------ paged attention


@dataclass
class AttentionTiles:
    """The launch grid of one batch's attention (host-built; tensors on the batch's device)."""

    run: torch.Tensor  # [num_tiles] int32: the run (request) of each tile
    tok: torch.Tensor  # [num_tiles] int32: index of the tile's first token within its run
    block_m: int  # query rows per tile
    splits: int  # key ranges per tile (1: no split)

    @property
    def num_tiles(self) -> int:
        return self.run.shape[0]


def tile_shape(q_lens: np.ndarray, group: int, num_kv_heads: int) -> tuple[int, int]:
    """(rows per tile, key splits) for a batch whose runs have ``q_lens`` query tokens."""
    decode_only = bool(len(q_lens)) and int(q_lens.max()) == 1
    block_m = _pow2(group, 16) if decode_only else _pow2(group, 64)
    if not decode_only:
        return block_m, 1
    # Enough programs to cover a GPU's ~100+ multiprocessors twice over.
    programs = len(q_lens) * num_kv_heads
    return block_m, int(min(16, _pow2(max(1, 256 // programs))))


def attention_tiles(cu_q: np.ndarray, group: int, num_kv_heads: int,
                    device: torch.device) -> AttentionTiles:
    q_lens = np.diff(cu_q)
    block_m, splits = tile_shape(q_lens, group, num_kv_heads)
    per_tile = max(1, block_m // group)
    counts = -(-q_lens // per_tile)
    run = np.repeat(np.arange(len(q_lens), dtype=np.int32), counts)
    first = np.repeat(np.cumsum(counts) - counts, counts)
    tok = ((np.arange(len(run)) - first) * per_tile).astype(np.int32)
    return AttentionTiles(torch.from_numpy(run).to(device), torch.from_numpy(tok).to(device),
                          block_m, splits)


@triton.jit
def _write_kv_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr, sk_t, sk_h, sv_t, sv_h,
                     skc_b, skc_h, skc_d, svc_b, svc_h, svc_s, d, BS: tl.constexpr,
                     D: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    slot = tl.load(slot_ptr + t).to(tl.int64)  # < 0: a padding token, nothing to write
    blk = slot // BS
    off = slot % BS
    i = tl.arange(0, D)
    m = (i < d) & (slot >= 0)
    kv = tl.load(k_ptr + t * sk_t + h * sk_h + i, mask=m)
    tl.store(kc_ptr + blk * skc_b + h * skc_h + i * skc_d + off, kv, mask=m)
    vv = tl.load(v_ptr + t * sv_t + h * sv_h + i, mask=m)
    tl.store(vc_ptr + blk * svc_b + h * svc_h + off * svc_s + i, vv, mask=m)


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slots: torch.Tensor) -> None:
    """Store this batch's keys and values at their cache slots (layouts: model/attention.py)."""
    t, hkv, d = k.shape
    if t:
        _write_kv_kernel[(t, hkv)](k, v, k_cache, v_cache, slots, k.stride(0), k.stride(1),
                                   v.stride(0), v.stride(1), k_cache.stride(0),
                                   k_cache.stride(1), k_cache.stride(2), v_cache.stride(0),
                                   v_cache.stride(1), v_cache.stride(2), d,
                                   BS=k_cache.shape[3], D=_pow2(d))


@triton.jit
def _tile_rows(cu_q_ptr, tile_run_ptr, tile_tok_ptr, tile, h, G: tl.constexpr,
               BLOCK_M: tl.constexpr):
    """A tile's rows (its tokens' query heads of kv head h, G per token): the run, its first
    token and the run's span in the batch, and per row its token, query head and validity."""
    run = tl.load(tile_run_ptr + tile)
    tok0 = tl.load(tile_tok_ptr + tile)
    q0 = tl.load(cu_q_ptr + run)
    n = tl.load(cu_q_ptr + run + 1) - q0
    rows = tl.arange(0, BLOCK_M)
    tok = tok0 + rows // G
    head = h * G + rows % G
    row_ok = (tok < n) & (rows < (BLOCK_M // G) * G)
    return run, tok0, q0, n, rows, tok, head, row_ok


@triton.jit
def _attention_kernel(out_ptr, q_ptr, kc_ptr, vc_ptr, cu_q_ptr, ctx_ptr, bt_ptr, tile_run_ptr,
                      tile_tok_ptr, part_ptr, ml_ptr,
                      sq_t, sq_h, so_t, so_h, skc_b, skc_h, skc_d, svc_b, svc_h, svc_s, s_bt,
                      scale, d, G: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      D: tl.constexpr, BS: tl.constexpr, SPLITS: tl.constexpr,
                      PRECISION: tl.constexpr):
    tile = tl.program_id(0)
    h = tl.program_id(1)
    split = tl.program_id(2)
    run, tok0, q0, n, rows, tok, head, row_ok = _tile_rows(cu_q_ptr, tile_run_ptr, tile_tok_ptr,
                                                           tile, h, G, BLOCK_M)
    ctx = tl.load(ctx_ptr + run)
    qpos = ctx - n + tok  # position of each row's token in its sequence
    di = tl.arange(0, D)
    dm = di < d
    q = tl.load(q_ptr + (q0 + tok).to(tl.int64)[:, None] * sq_t + head[:, None] * sq_h
                + di[None, :], mask=row_ok[:, None] & dm[None, :], other=0.0)

    # Keys this tile can see: up to its last token's position; this split's share of them.
    last_tok = tl.minimum(n, tok0 + BLOCK_M // G)
    kv_end = ctx - n + last_tok
    per_split = tl.cdiv(tl.cdiv(kv_end, SPLITS), BLOCK_N) * BLOCK_N
    k_lo = split * per_split
    k_hi = tl.minimum(kv_end, k_lo + per_split)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    table = bt_ptr + run.to(tl.int64) * s_bt
    for start in range(k_lo, k_hi, BLOCK_N):
        keys = start + tl.arange(0, BLOCK_N)
        kmask = keys < k_hi
        blk = tl.load(table + keys // BS, mask=kmask, other=0).to(tl.int64)
        off = keys % BS
        # keys: [D, BLOCK_N] from the [block, head, D, BS] layout
        kt = tl.load(kc_ptr + blk[None, :] * skc_b + h * skc_h + di[:, None] * skc_d
                     + off[None, :], mask=kmask[None, :] & dm[:, None], other=0.0)
        s = tl.dot(q, kt, input_precision=PRECISION) * scale
        visible = (keys[None, :] <= qpos[:, None]) & kmask[None, :]
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        vt = tl.load(vc_ptr + blk[:, None] * svc_b + h * svc_h + off[:, None] * svc_s
                     + di[None, :], mask=kmask[:, None] & dm[None, :], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt, input_precision=PRECISION)
        m_i = m_new

    if SPLITS == 1:
        o = acc / tl.maximum(l_i, 1e-30)[:, None]
        tl.store(out_ptr + (q0 + tok).to(tl.int64)[:, None] * so_t + head[:, None] * so_h
                 + di[None, :], o.to(out_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & dm[None, :])
    else:  # partial results: [tile, head, split, row, D] and (max, sum) per row
        slot = ((tile * tl.num_programs(1) + h) * SPLITS + split).to(tl.int64)
        tl.store(part_ptr + slot * BLOCK_M * D + rows[:, None] * D + di[None, :], acc)
        tl.store(ml_ptr + slot * 2 * BLOCK_M + rows, m_i)
        tl.store(ml_ptr + slot * 2 * BLOCK_M + BLOCK_M + rows, l_i)


@triton.jit
def _merge_splits_kernel(out_ptr, part_ptr, ml_ptr, cu_q_ptr, tile_run_ptr, tile_tok_ptr,
                         so_t, so_h, d, G: tl.constexpr, BLOCK_M: tl.constexpr, D: tl.constexpr,
                         SPLITS: tl.constexpr):
    tile = tl.program_id(0)
    h = tl.program_id(1)
    _, _, q0, _, rows, tok, head, row_ok = _tile_rows(cu_q_ptr, tile_run_ptr, tile_tok_ptr, tile,
                                                      h, G, BLOCK_M)
    di = tl.arange(0, D)
    base = ((tile * tl.num_programs(1) + h) * SPLITS).to(tl.int64)
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    for s in range(SPLITS):
        m = tl.maximum(m, tl.load(ml_ptr + (base + s) * 2 * BLOCK_M + rows))
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    l_tot = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    for s in range(SPLITS):
        w = tl.exp(tl.load(ml_ptr + (base + s) * 2 * BLOCK_M + rows) - m_safe)
        l_tot += w * tl.load(ml_ptr + (base + s) * 2 * BLOCK_M + BLOCK_M + rows)
        acc += w[:, None] * tl.load(part_ptr + (base + s) * BLOCK_M * D + rows[:, None] * D
                                    + di[None, :])
    o = acc / tl.maximum(l_tot, 1e-30)[:, None]
    tl.store(out_ptr + (q0 + tok).to(tl.int64)[:, None] * so_t + head[:, None] * so_h
             + di[None, :], o.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & (di < d)[None, :])


def paged_attention(out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                    cu_q: torch.Tensor, ctx_lens: torch.Tensor, block_tables: torch.Tensor,
                    scale: float, tiles: AttentionTiles) -> None:
    """Write k, v into the cache, then out = attention of every query row over its run's
    context (causal within the run). q, out: [T, H, D]; k, v: [T, Hkv, D]."""
    write_kv(k, v, k_cache, v_cache, slot_mapping)
    if not tiles.num_tiles:
        return
    hkv, d, bs = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    g = q.shape[1] // hkv
    dd = _pow2(d, 16)
    bm, splits = tiles.block_m, tiles.splits
    block_n = 64 if dd <= 128 else 32
    if splits > 1:
        part = torch.empty(tiles.num_tiles * hkv * splits * bm * dd, dtype=torch.float32,
                           device=q.device)
        ml = torch.empty(tiles.num_tiles * hkv * splits * 2 * bm, dtype=torch.float32,
                         device=q.device)
    else:
        part = ml = out  # unused
    _attention_kernel[(tiles.num_tiles, hkv, splits)](
        out, q, k_cache, v_cache, cu_q, ctx_lens, block_tables, tiles.run, tiles.tok, part, ml,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), k_cache.stride(0),
        k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1),
        v_cache.stride(2), block_tables.stride(0), scale, d, G=g, BLOCK_M=bm, BLOCK_N=block_n,
        D=dd, BS=bs, SPLITS=splits, PRECISION=_DOT_PRECISION[q.dtype],
        num_warps=4 if bm <= 16 else 8 if dd > 64 else 4, num_stages=2)
    if splits > 1:
        _merge_splits_kernel[(tiles.num_tiles, hkv)](
            out, part, ml, cu_q, tiles.run, tiles.tok, out.stride(0), out.stride(1), d, G=g,
            BLOCK_M=bm, D=dd, SPLITS=splits)
