"""GPU kernels in Triton, with the call signatures of the compiled CPU kernels.

``rms_norm``, ``fused_add_rms_norm``, ``rope``, ``silu_and_mul`` and ``paged_attention`` take the
same arguments as their C++ counterparts (``csrc/cpu_kernels.cpp``), so the model's
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
  handful of tiles a GPU would otherwise run a few programs for the whole context. The last
  of a tile's splits to finish (an atomic count per tile) merges their partial results, so a
  split launch is still one kernel.

The tile table is built on the host from the plan (``attention_tiles``), so no launch needs a
device-to-host sync and a decode batch of fixed size has a fixed grid (CUDA graphs capture it).

Tests run these kernels on the CPU through Triton's interpreter (``TRITON_INTERPRET=1``, which
must be set before this module is first imported) against the eager reference.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch
import triton
import triton.language as tl

from fluidserve.model.host_memory import to_device

_DOT_PRECISION = {torch.float32: "ieee", torch.bfloat16: "tf32", torch.float16: "tf32"}


def _pow2(n: int, least: int = 1) -> int:
    return max(least, triton.next_power_of_2(n))


# ----------------------------------------------------------------------------- norms, RoPE, MLP


@triton.jit
def _scale_norm(x, inv, w):
    """weight * bf16(x * inv) in the dtype of x, rounded as the eager RMSNorm rounds
    (inv: the row's inverse RMS; w: the norm weight in float32)."""
    y = (x.to(tl.float32) * inv).to(x.dtype).to(tl.float32)
    return (y * w).to(x.dtype)


@triton.jit
def _silu_mul(g, u):
    """silu(g) * u in the dtype of g, rounded as the eager MLP rounds."""
    gf = g.to(tl.float32)
    act = (gf / (1.0 + tl.exp(-gf))).to(g.dtype).to(tl.float32)
    return (act * u.to(tl.float32)).to(g.dtype)


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
    w = tl.load(w_ptr + cols, mask=m, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, _scale_norm(x, inv, w), mask=m)


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
                 num_q_heads, half, v_ptr, kc_ptr, vc_ptr, slot_ptr, sv_t, sv_h, skc_b, skc_h,
                 skc_d, svc_b, svc_h, svc_s, HALF: tl.constexpr, WRITE: tl.constexpr,
                 BS: tl.constexpr, GDC: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    # The batch's inputs and the tables first: none of them is written by the kernel before.
    p = tl.load(pos_ptr + t).to(tl.int64)
    i = tl.arange(0, HALF)
    m = i < half
    c1 = tl.load(cos_ptr + p * s_cs + i, mask=m, other=0.0)
    c2 = tl.load(cos_ptr + p * s_cs + half + i, mask=m, other=0.0)
    s1 = tl.load(sin_ptr + p * s_cs + i, mask=m, other=0.0)
    s2 = tl.load(sin_ptr + p * s_cs + half + i, mask=m, other=0.0)
    slot = tl.load(slot_ptr + t).to(tl.int64) if WRITE else -1  # < 0: a padding token
    if GDC:  # launched early: wait for the projection that wrote q, k and v
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    if h < num_q_heads:
        base = q_ptr + t * sq_t + h * sq_h
    else:
        base = k_ptr + t * sk_t + (h - num_q_heads) * sk_h
    x1 = tl.load(base + i, mask=m, other=0.0)
    x2 = tl.load(base + half + i, mask=m, other=0.0)
    a, b = x1.to(tl.float32), x2.to(tl.float32)
    # rotate-half: [x1, x2] * cos + [-x2, x1] * sin
    y1 = (a * c1 - b * s1).to(x1.dtype)
    y2 = (b * c2 + a * s2).to(x1.dtype)
    tl.store(base + i, y1, mask=m)
    tl.store(base + half + i, y2, mask=m)
    if WRITE:  # a key head: also store it, and its value head, at the token's cache slot
        if (h >= num_q_heads) & (slot >= 0):
            j = h - num_q_heads
            blk = slot // BS
            off = slot % BS
            kc = kc_ptr + blk * skc_b + j * skc_h + off
            tl.store(kc + i * skc_d, y1, mask=m)
            tl.store(kc + (half + i) * skc_d, y2, mask=m)
            vsrc = v_ptr + t * sv_t + j * sv_h
            vdst = vc_ptr + blk * svc_b + j * svc_h + off * svc_s
            tl.store(vdst + i, tl.load(vsrc + i, mask=m), mask=m)
            tl.store(vdst + half + i, tl.load(vsrc + half + i, mask=m), mask=m)


def rope(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
         sin: torch.Tensor) -> None:
    """In place on q: [T, H, D] and k: [T, Hkv, D] (row-strided views of the QKV output)."""
    _rope(q, k, positions, cos, sin, None, False)


def rope_and_write_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                      cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, slots: torch.Tensor, pdl: bool = False) -> None:
    """``rope``, and the rotated keys and the values stored at their cache slots in the same
    launch (what ``write_kv`` does; pass ``kv_written=True`` to ``paged_attention`` after).
    ``pdl``: launch with programmatic dependent launch (``pdl_launch``)."""
    _rope(q, k, positions, cos, sin, (v, k_cache, v_cache, slots), pdl)


def _rope(q, k, positions, cos, sin, write, pdl) -> None:
    t, h, d = q.shape
    if not t:
        return
    v, kc, vc, slots = write if write is not None else (k, k, k, positions)
    kcs = kc.stride() if write is not None else (0, 0, 0)
    vcs = vc.stride() if write is not None else (0, 0, 0)
    _rope_kernel[(t, h + k.shape[1])](
        q, k, positions, cos, sin, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        cos.stride(0), h, d // 2, v, kc, vc, slots, v.stride(0), v.stride(1), kcs[0], kcs[1],
        kcs[2], vcs[0], vcs[1], vcs[2], HALF=_pow2(d // 2), WRITE=write is not None,
        BS=kc.shape[3] if write is not None else 1, GDC=pdl, **_pdl_option(pdl))


@triton.jit
def _silu_and_mul_kernel(out_ptr, gu_ptr, stride_o, stride_gu, n, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = cols < n
    g = tl.load(gu_ptr + row * stride_gu + cols, mask=m, other=0.0)
    u = tl.load(gu_ptr + row * stride_gu + n + cols, mask=m, other=0.0)
    tl.store(out_ptr + row * stride_o + cols, _silu_mul(g, u), mask=m)


def silu_and_mul(out: torch.Tensor, gu: torch.Tensor) -> None:
    """out = silu(gate) * up for gu = [gate | up]: [T, 2F]; out: [T, F]."""
    t, n = out.shape
    if t:
        block = min(_pow2(n), 2048)
        _silu_and_mul_kernel[(t, triton.cdiv(n, block))](out, gu, out.stride(0), gu.stride(0),
                                                         n, BLOCK=block)


# ------------------------------------------------------------------- linears of a few rows

# Batches of up to this many rows (the decode steps of single requests) take
# ``skinny_linear`` for their projections, with the norms, the SiLU and the residual adds
# folded into them (``LlamaForCausalLM._few_rows_forward``). Each program of the kernel
# recomputes the folded prologue for all rows of x: at one row that is a few KB from L2, at
# 8 or 16 rows it doubled the bytes the down projection moves (Llama-3-8B on an H100: 12.3 ms
# a decode step at batch 8, against 7.1 layer by layer), so one row.
SKINNY_MAX_ROWS = 1


@dataclass(frozen=True)
class SkinnyConfig:
    """How ``skinny_linear`` tiles a product: ``block_n`` weight rows per program (the grid),
    ``block_k`` columns per step; ``dot``: the rows padded to 16 for the matrix units, else
    (one row only) multiply-adds into a [block_n, block_k] accumulator."""

    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 4
    dot: bool = True


# Measured choices per (rows bucket, N, K), where one beat the rule of ``skinny_config``
# (scripts/bench_cuda.py); the rows bucket is 1 or the rows padded to a power of two >= 16.
SKINNY_TUNED: dict[tuple[int, int, int], SkinnyConfig] = {}


def skinny_bucket(m: int) -> int:
    return 1 if m == 1 else _pow2(m, 16)


def skinny_config(m: int, n: int, k: int, elem_size: int = 2) -> SkinnyConfig:
    """The tiling of an [m, k] x [k, n] product: a measured one, or the rule. One row: 8
    weight rows per program, 1024 columns a step, 4 warps, multiply-adds: on an H100, within
    1% of the fastest of seven tilings for each of Llama-3-8B's five projections and 1.11-1.34x
    faster than cuBLAS (scripts/bench_cuda.py, docs/performance.md). More rows: the matrix
    units, enough programs to keep every multiprocessor streaming (at least 384 where N
    allows), ~16 KB of weight per step."""
    tuned = SKINNY_TUNED.get((skinny_bucket(m), n, k))
    if tuned is not None:
        return tuned
    if m == 1:
        return SkinnyConfig(8, 1024, num_warps=4, num_stages=3, dot=False)
    block_n = next((b for b in (128, 64, 32) if -(-n // b) >= 384), 16)
    block_k = max(64, min(512, 16384 // (block_n * elem_size)))
    return SkinnyConfig(block_n, block_k, num_warps=4, num_stages=4 if block_n <= 32 else 3)


@functools.cache
def skinny_pdl(device: torch.device) -> bool:
    """Whether skinny_linear launches with programmatic dependent launch here (Hopper and
    later, and a Triton that has it): each launch may start while the kernel before it
    finishes, its programs waiting (``gdc_wait``) before they read what that kernel wrote."""
    if device.type != "cuda" or torch.cuda.get_device_capability(device)[0] < 9:
        return False
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
        from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait  # noqa: F401
    except ImportError:
        return False
    return "launch_pdl" in CUDAOptions.__dataclass_fields__


# None: skinny_pdl decides; False turns it off (benchmarks compare).
SKINNY_PDL: bool | None = None
# Whether the one-row path's RoPE and attention launch with PDL where its projections do
# (False: only the projections; benchmarks compare).
ATTENTION_PDL = True


def pdl_launch(device: torch.device) -> bool:
    """Whether the one-row path's kernels launch with PDL: ``SKINNY_PDL``, else
    ``skinny_pdl``. A kernel launched so must wait (``gdc_wait``) before it reads anything
    the kernel before it writes, and before it lets the next one in."""
    return SKINNY_PDL if SKINNY_PDL is not None else skinny_pdl(device)


def _pdl_option(pdl: bool) -> dict:
    return {"launch_pdl": True} if pdl else {}


@triton.jit
def _skinny_masks(m_ok, n_ok, kk, K, EVEN_K: tl.constexpr):
    """Masks of a step's x [M, BK] and W [BN, BK] loads. Where the step is whole (EVEN_K)
    they are constant along K, so the loads stay 16 bytes wide."""
    if EVEN_K:
        xm = m_ok[:, None]
        wm = n_ok[:, None]
    else:
        k_ok = (kk < K)[None, :]
        xm = m_ok[:, None] & k_ok
        wm = n_ok[:, None] & k_ok
    return xm, wm


@triton.jit
def _skinny_step(acc, wv, x_rows, xm, kk, K, inv, nw_ptr, NORM: tl.constexpr,
                 SILU: tl.constexpr, DOT: tl.constexpr, EVEN_K: tl.constexpr,
                 PRECISION: tl.constexpr):
    """acc += f(x[:, kk]) . W[:, kk] for one step's weight tile wv [BN, BK] (acc: [M, BN]
    with DOT, else a [BN, BK] accumulator of products)."""
    xv = tl.load(x_rows + kk[None, :], mask=xm, other=0.0)
    if NORM:  # rounded as the norm kernel rounds
        if EVEN_K:
            g = tl.load(nw_ptr + kk[None, :])
        else:
            g = tl.load(nw_ptr + kk[None, :], mask=(kk < K)[None, :], other=0.0)
        xv = _scale_norm(xv, inv[:, None], g.to(tl.float32))
    if SILU:  # x = [gate | up], rounded as silu_and_mul rounds
        xv = _silu_mul(xv, tl.load(x_rows + K + kk[None, :], mask=xm, other=0.0))
    if DOT:
        acc += tl.dot(xv, tl.trans(wv), input_precision=PRECISION)
    else:
        acc += wv.to(tl.float32) * xv.to(tl.float32)
    return acc


@triton.jit
def _skinny_linear_kernel(out_ptr, x_ptr, w_ptr, b_ptr, nw_ptr, M, N, K, s_out, s_x, s_w, eps,
                          NORM: tl.constexpr, SILU: tl.constexpr, ADD: tl.constexpr,
                          BIAS: tl.constexpr, DOT: tl.constexpr, EVEN_K: tl.constexpr,
                          PRECISION: tl.constexpr, BLOCK_M: tl.constexpr,
                          BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                          NORM_BLOCK: tl.constexpr, GDC: tl.constexpr):
    rm = tl.arange(0, BLOCK_M)
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_ok = rm < M
    n_ok = rn < N
    x_rows = x_ptr + rm.to(tl.int64)[:, None] * s_x
    w_rows = w_ptr + rn.to(tl.int64)[:, None] * s_w
    # The first weight tile does not depend on the kernel before: load it, then (launched
    # early, with PDL) wait for that kernel before reading x, which it wrote.
    xm, wm = _skinny_masks(m_ok, n_ok, rk, K, EVEN_K)
    w0 = tl.load(w_rows + rk[None, :], mask=wm, other=0.0, eviction_policy="evict_first")
    if GDC:
        tl.extra.cuda.gdc_wait()
    inv = tl.zeros([BLOCK_M], tl.float32)
    if NORM:  # a first pass over the (few, cached) rows: their inverse RMS, in wide steps
        nk = tl.arange(0, NORM_BLOCK)
        ss = tl.zeros([BLOCK_M], tl.float32)
        for k0 in range(0, K, NORM_BLOCK):
            nm = m_ok[:, None] & ((k0 + nk) < K)[None, :]
            xf = tl.load(x_rows + (k0 + nk)[None, :], mask=nm, other=0.0).to(tl.float32)
            ss += tl.sum(xf * xf, 1)
        inv = 1.0 / tl.sqrt(ss / K + eps)
    if DOT:
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    else:
        acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    acc = _skinny_step(acc, w0, x_rows, xm, rk, K, inv, nw_ptr, NORM, SILU, DOT, EVEN_K,
                       PRECISION)
    for k0 in range(BLOCK_K, K, BLOCK_K):
        kk = k0 + rk
        xm, wm = _skinny_masks(m_ok, n_ok, kk, K, EVEN_K)
        wv = tl.load(w_rows + kk[None, :], mask=wm, other=0.0, eviction_policy="evict_first")
        acc = _skinny_step(acc, wv, x_rows, xm, kk, K, inv, nw_ptr, NORM, SILU, DOT, EVEN_K,
                           PRECISION)
    if GDC:  # the weights are read: the next kernel may start loading its own
        tl.extra.cuda.gdc_launch_dependents()
    if not DOT:
        acc = tl.sum(acc, 1)[None, :]
    if BIAS:
        acc += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    o_ptrs = out_ptr + rm.to(tl.int64)[:, None] * s_out + rn[None, :]
    o_ok = m_ok[:, None] & n_ok[None, :]
    y = acc.to(out_ptr.dtype.element_ty)
    if ADD:  # the residual stream, in place: rounded as the eager add is
        r = tl.load(o_ptrs, mask=o_ok, other=0.0)
        y = (r.to(tl.float32) + y.to(tl.float32)).to(out_ptr.dtype.element_ty)
    tl.store(o_ptrs, y, mask=o_ok)


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                  norm_weight: torch.Tensor | None = None, eps: float = 0.0,
                  silu: bool = False, residual: torch.Tensor | None = None,
                  config: SkinnyConfig | None = None) -> torch.Tensor:
    """``f(x) W^T + bias`` for a few rows of x, reading W once, in one launch.

    f is the identity, or with ``norm_weight`` the RMS norm ``norm_weight * norm(x)``, or with
    ``silu`` ``silu(gate) * up`` of x = [gate | up] ([M, 2K]); each rounds as the kernels it
    replaces round (``rms_norm``, ``silu_and_mul``). With ``residual`` ([M, N]) the product is
    added to it in place (one rounding, as ``residual + y`` rounds) and it is returned; else a
    new [M, N] tensor. A batch of decodes is bound by reading the weights: folding the
    operators around the product into it saves their launches and round trips, and the
    tiling keeps every multiprocessor streaming the weight (``skinny_config``)."""
    m = x.shape[0]
    n, k = weight.shape
    if x.shape[1] != (2 * k if silu else k) or x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError(f"skinny_linear: x {tuple(x.shape)} (stride {x.stride()}) does not"
                         f" fit weight {tuple(weight.shape)}{' with silu' if silu else ''}")
    out = residual if residual is not None else x.new_empty(m, n)
    if m == 0:
        return out
    cfg = config or skinny_config(m, n, k, x.element_size())
    dot = cfg.dot or m > 1
    block_m = _pow2(m, 16) if dot else 1
    pdl = pdl_launch(x.device)
    _skinny_linear_kernel[(triton.cdiv(n, cfg.block_n),)](
        out, x, weight, bias if bias is not None else weight,
        norm_weight if norm_weight is not None else weight, m, n, k, out.stride(0),
        x.stride(0), weight.stride(0), eps, NORM=norm_weight is not None, SILU=silu,
        ADD=residual is not None, BIAS=bias is not None, DOT=dot, EVEN_K=k % cfg.block_k == 0,
        PRECISION=_DOT_PRECISION[x.dtype], BLOCK_M=block_m, BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k, NORM_BLOCK=min(_pow2(k), max(cfg.block_k, 4096 // block_m)),
        GDC=pdl, num_warps=cfg.num_warps, num_stages=cfg.num_stages, **_pdl_option(pdl))
    return out


# -------------------------------------------------------------------------------- greedy tokens


@triton.jit
def _last_to_arrive(count_ptr, parts):
    """Whether this program is the last of ``parts`` to reach here for its counter: every
    program's stores so far are done (barrier) before it counts itself in (release), and
    the last one's count acquires all of them. That program must reset the counter to 0
    (``tl.atomic_xchg``) once it has read the others' results, for the next launch."""
    tl.debug_barrier()
    return tl.atomic_add(count_ptr, 1, sem="acq_rel", scope="gpu") == parts - 1


@triton.jit
def _argmax_kernel(x_ptr, out_ptr, pm_ptr, pi_ptr, count_ptr, n, stride, NB,
                   BLOCK: tl.constexpr, NB_POW2: tl.constexpr):
    row = tl.program_id(0)
    b = tl.program_id(1)
    i = b * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + row.to(tl.int64) * stride + i, mask=i < n, other=float("-inf"))
    x = x.to(tl.float32)
    m = tl.max(x, 0)
    tl.store(pm_ptr + row * NB + b, m)
    tl.store(pi_ptr + row * NB + b, tl.min(tl.where(x == m, i, n), 0))
    if _last_to_arrive(count_ptr + row, NB):  # it reduces the blocks' maxima
        j = tl.arange(0, NB_POW2)
        pm = tl.load(pm_ptr + row * NB + j, mask=j < NB, other=float("-inf"),
                     cache_modifier=".cg")
        pi = tl.load(pi_ptr + row * NB + j, mask=j < NB, other=n, cache_modifier=".cg")
        tl.store(out_ptr + row, tl.min(tl.where(pm == tl.max(pm, 0), pi, n), 0).to(tl.int64))
        tl.atomic_xchg(count_ptr + row, 0, sem="relaxed", scope="gpu")


def argmax_rows(logits: torch.Tensor, block: int = 4096) -> torch.Tensor:
    """Per-row argmax of [R, V] logits (ties: the lowest id), int64, in one launch of R x
    V/block programs: a decode step samples one row of 128K logits, which ATen's reduction
    walks with a handful of programs (32-42 us on an H100 and an H200)."""
    r, v = logits.shape
    out = torch.empty(r, dtype=torch.int64, device=logits.device)
    if r == 0:
        return out
    nb = triton.cdiv(v, block)
    pm = torch.empty(r * nb, dtype=torch.float32, device=logits.device)
    pi = torch.empty(r * nb, dtype=torch.int32, device=logits.device)
    _argmax_kernel[(r, nb)](logits, out, pm, pi, split_counters(r, logits.device), v,
                            logits.stride(0), nb, BLOCK=block, NB_POW2=_pow2(nb),
                            num_warps=8)
    return out


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
    return AttentionTiles(to_device(run, device), to_device(tok, device), block_m, splits)


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
def _key_blocks(table, keys, k_hi, BS: tl.constexpr, KV_RUN: tl.constexpr):
    """The cache block of each key, from the run's block table: every key of a block that
    holds keys below k_hi gets that block, the rest block 0, so a block number is the same
    for KV_RUN keys in a row, which the kernel states (it makes the key loads vectors; a
    loop-carried value keeps the hint only where each definition has it)."""
    blk = tl.load(table + keys // BS, mask=keys // BS * BS < k_hi, other=0).to(tl.int64)
    return tl.max_constancy(blk, KV_RUN)


@triton.jit
def _attention_kernel(out_ptr, q_ptr, kc_ptr, vc_ptr, cu_q_ptr, ctx_ptr, bt_ptr, tile_run_ptr,
                      tile_tok_ptr, part_ptr, ml_ptr, count_ptr,
                      sq_t, sq_h, so_t, so_h, skc_b, skc_h, skc_d, svc_b, svc_h, svc_s, s_bt,
                      scale, d, G: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      D: tl.constexpr, BS: tl.constexpr, SPLITS: tl.constexpr,
                      PRECISION: tl.constexpr, GDC: tl.constexpr, KV_RUN: tl.constexpr):
    tile = tl.program_id(0)
    h = tl.program_id(1)
    split = tl.program_id(2)
    # The tile table and the batch's inputs first: the kernel before writes none of them.
    run, tok0, q0, n, rows, tok, head, row_ok = _tile_rows(cu_q_ptr, tile_run_ptr, tile_tok_ptr,
                                                           tile, h, G, BLOCK_M)
    ctx = tl.load(ctx_ptr + run)
    qpos = ctx - n + tok  # position of each row's token in its sequence
    di = tl.arange(0, D)
    dm = di < d
    # Keys this tile can see: up to its last token's position; this split's share of them.
    last_tok = tl.minimum(n, tok0 + BLOCK_M // G)
    kv_end = ctx - n + last_tok
    per_split = tl.cdiv(tl.cdiv(kv_end, SPLITS), BLOCK_N) * BLOCK_N
    k_lo = split * per_split
    k_hi = tl.minimum(kv_end, k_lo + per_split)
    # The cache blocks of each step's keys are read one step ahead, the first step's before
    # the wait (the block table is an input): the key loads need not wait for them.
    table = bt_ptr + run.to(tl.int64) * s_bt
    blk = _key_blocks(table, k_lo + tl.arange(0, BLOCK_N), k_hi, BS, KV_RUN)
    if GDC:  # launched early: wait for the kernel that wrote q and the new keys and values
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    q = tl.load(q_ptr + (q0 + tok).to(tl.int64)[:, None] * sq_t + head[:, None] * sq_h
                + di[None, :], mask=row_ok[:, None] & dm[None, :], other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    for start in range(k_lo, k_hi, BLOCK_N):
        keys = start + tl.arange(0, BLOCK_N)
        kmask = keys < k_hi
        off = keys % BS
        blk_next = _key_blocks(table, keys + BLOCK_N, k_hi, BS, KV_RUN)
        # keys: [D, BLOCK_N] from the [block, head, D, BS] layout, in runs of KV_RUN keys of
        # one block (steps start at multiples of BLOCK_N): contiguous, so vector loads (one
        # 2-byte load per key and thread without these hints, 255 registers, on sm_90). Not
        # masked by key either (a mask per key would split them): past the range they read
        # whatever the cache holds there, whose scores `visible` replaces; the values, which
        # multiply, stay masked.
        koff = tl.max_contiguous(tl.multiple_of(off, KV_RUN), KV_RUN)
        kt = tl.load(kc_ptr + blk[None, :] * skc_b + h * skc_h + di[:, None] * skc_d
                     + koff[None, :], mask=dm[:, None], other=0.0)
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
        blk = blk_next

    if SPLITS == 1:
        o = acc / tl.maximum(l_i, 1e-30)[:, None]
        tl.store(out_ptr + (q0 + tok).to(tl.int64)[:, None] * so_t + head[:, None] * so_h
                 + di[None, :], o.to(out_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & dm[None, :])
    else:  # partial results: [tile, head, split, row, D] and (max, sum) per row
        pair = tile * tl.num_programs(1) + h
        slot = (pair * SPLITS + split).to(tl.int64)
        # Only the first splits have keys (a short context leaves the rest empty): those
        # store partial results, and the merge reads only theirs.
        parts = tl.cdiv(kv_end, tl.maximum(per_split, 1))  # (per_split is 0 only if kv_end is)
        if split < parts:
            tl.store(part_ptr + slot * BLOCK_M * D + rows[:, None] * D + di[None, :], acc)
            tl.store(ml_ptr + slot * 2 * BLOCK_M + rows, m_i)
            tl.store(ml_ptr + slot * 2 * BLOCK_M + BLOCK_M + rows, l_i)
        if _last_to_arrive(count_ptr + pair, SPLITS):  # it merges this (tile, head)
            _merge_splits(out_ptr, part_ptr, ml_ptr, (pair * SPLITS).to(tl.int64), parts, q0,
                          tok, head, row_ok, rows, di, so_t, so_h, d, BLOCK_M, D, SPLITS)
            tl.atomic_xchg(count_ptr + pair, 0, sem="relaxed", scope="gpu")


@triton.jit
def _merge_splits(out_ptr, part_ptr, ml_ptr, base, parts, q0, tok, head, row_ok, rows, di,
                  so_t, so_h, d, BLOCK_M: tl.constexpr, D: tl.constexpr, SPLITS: tl.constexpr):
    """out = the softmax-weighted merge of a tile's first ``parts`` partial results, those of
    the splits with keys (read past L1: other multiprocessors wrote them; a split without
    keys would add exp(-inf) * 0, so the result is the same to the bit).

    Latency is all it costs: the maxima come in one load; the loop is unrolled over every
    split with its loads masked to those with keys, and each split's weight is computed
    twice, in the layout of the sum and in that of the output rows, so that no layout
    conversion (a shared-memory round trip and two barriers a split, in the sm_90 code) sits
    between them: the compiler issues the splits' loads together instead of one round trip
    after another."""
    sp = tl.arange(0, SPLITS)
    m_all = tl.load(ml_ptr + (base + sp)[:, None] * 2 * BLOCK_M + rows[None, :],
                    mask=(sp < parts)[:, None], other=float("-inf"), cache_modifier=".cg")
    m = tl.max(m_all, 0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    l_tot = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    for s in tl.static_range(SPLITS):
        live = s < parts
        part = tl.load(part_ptr + (base + s) * BLOCK_M * D + rows[:, None] * D + di[None, :],
                       mask=live, other=0.0, cache_modifier=".cg")
        w = tl.exp(tl.load(ml_ptr + (base + s) * 2 * BLOCK_M + rows, mask=live,
                           other=float("-inf"), cache_modifier=".cg") - m_safe)
        l_tot += w * tl.load(ml_ptr + (base + s) * 2 * BLOCK_M + BLOCK_M + rows, mask=live,
                             other=0.0, cache_modifier=".cg")
        w2 = tl.exp(tl.load(ml_ptr + (base + s) * 2 * BLOCK_M + rows[:, None], mask=live,
                            other=float("-inf"), cache_modifier=".cg") - m_safe[:, None])
        acc += w2 * part
    o = acc / tl.maximum(l_tot, 1e-30)[:, None]
    tl.store(out_ptr + (q0 + tok).to(tl.int64)[:, None] * so_t + head[:, None] * so_h
             + di[None, :], o.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & (di < d)[None, :])


_SPLIT_COUNTERS: dict[torch.device, torch.Tensor] = {}


def split_counters(n: int, device: torch.device) -> torch.Tensor:
    """Zeroed int32 counters for ``_last_to_arrive`` (one per (tile, kv head) of a split
    attention launch, one per row of ``argmax_rows``), kept across launches (each leaves them
    at zero), so a captured graph replays with no reset."""
    buf = _SPLIT_COUNTERS.get(device)
    if buf is None or buf.numel() < n:
        buf = _SPLIT_COUNTERS[device] = torch.zeros(max(n, 4096), dtype=torch.int32,
                                                    device=device)
    return buf


def paged_attention(out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                    cu_q: torch.Tensor, ctx_lens: torch.Tensor, block_tables: torch.Tensor,
                    scale: float, tiles: AttentionTiles, kv_written: bool = False,
                    pdl: bool = False) -> None:
    """Write k, v into the cache (unless ``kv_written``), then out = attention of every query
    row over its run's context (causal within the run). q, out: [T, H, D]; k, v: [T, Hkv, D].
    ``pdl``: launch with programmatic dependent launch (``pdl_launch``).
    """
    if not kv_written:
        write_kv(k, v, k_cache, v_cache, slot_mapping)
    if not tiles.num_tiles:
        return
    hkv, d, bs = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    g = q.shape[1] // hkv
    dd = _pow2(d, 16)
    bm, splits = tiles.block_m, tiles.splits
    if splits & (splits - 1):
        raise ValueError(f"paged_attention: {splits} key splits, not a power of two")
    block_n = 64 if dd <= 128 else 32
    kv_run = min(bs, block_n) if bs & (bs - 1) == 0 else 1  # keys of one block per run
    if splits > 1:
        part = torch.empty(tiles.num_tiles * hkv * splits * bm * dd, dtype=torch.float32,
                           device=q.device)
        ml = torch.empty(tiles.num_tiles * hkv * splits * 2 * bm, dtype=torch.float32,
                         device=q.device)
        count = split_counters(tiles.num_tiles * hkv, q.device)
    else:
        part = ml = count = out  # unused
    _attention_kernel[(tiles.num_tiles, hkv, splits)](
        out, q, k_cache, v_cache, cu_q, ctx_lens, block_tables, tiles.run, tiles.tok, part, ml,
        count, q.stride(0), q.stride(1), out.stride(0), out.stride(1), k_cache.stride(0),
        k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1),
        v_cache.stride(2), block_tables.stride(0), scale, d, G=g, BLOCK_M=bm, BLOCK_N=block_n,
        D=dd, BS=bs, SPLITS=splits, PRECISION=_DOT_PRECISION[q.dtype], GDC=pdl, KV_RUN=kv_run,
        num_warps=4 if bm <= 16 else 8 if dd > 64 else 4, num_stages=2, **_pdl_option(pdl))
