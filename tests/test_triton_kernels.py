"""The Triton kernels (the CUDA fast path) against the eager reference they replace.

On a GPU they run compiled; elsewhere through Triton's interpreter on the CPU (conftest sets
``TRITON_INTERPRET=1``), where bfloat16 loads are not supported, so the CPU checks use float32
and float16 and the GPU adds bfloat16.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fluidserve.model import attention as A

from .attention_cases import (
    RUNS,
    batch,
    check_elementwise_ops,
    check_last_layer_on_sampled_rows,
    reference,
)

triton_ops = pytest.importorskip("fluidserve.kernels.triton_ops")
CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if CUDA else [])
DECODES = [(1, c) for c in (1, 2, 15, 16, 17, 64, 65, 200, 333)]


def run_triton(q, k, v, k_cache, v_cache, meta, splits: int | None = None):
    dev = torch.device(DEVICE)
    q, k, v, k_cache, v_cache = (t.to(dev) for t in (q, k, v, k_cache, v_cache))
    hkv = k_cache.shape[1]
    tiles = triton_ops.attention_tiles(meta.cu_q.numpy(), q.shape[1] // hkv, hkv, dev)
    if splits is not None:
        tiles.splits = splits
    out = torch.full_like(q, float("nan"))  # every row must be written
    triton_ops.paged_attention(out, q, k, v, k_cache, v_cache, meta.slot_mapping.to(dev),
                               meta.cu_q.to(dev), meta.ctx_lens.to(dev),
                               meta.block_tables.to(dev), q.shape[2] ** -0.5, tiles)
    return out.cpu(), k_cache.cpu(), v_cache.cpu(), tiles


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(16, 4, 64, 16), (4, 2, 16, 16), (8, 8, 32, 32),
                                   (32, 1, 64, 16), (6, 2, 32, 16), (8, 2, 128, 16)],
                         ids=lambda s: "h{}-kv{}-d{}-bs{}".format(*s))
def test_attention_over_a_hybrid_batch_matches_reference(dtype, shape):
    """Decodes and prefill chunks (from the start and after a cached prefix) in one launch;
    grouped-query heads packed into tiles, including a group (3) that leaves rows unused."""
    h, hkv, d, bs = shape
    q, k, v, k_cache, v_cache, meta, tables = batch(h, hkv, d, bs, dtype)
    out, kc, vc, tiles = run_triton(q, k, v, k_cache.clone(), v_cache.clone(), meta)
    assert tiles.splits == 1 and tiles.block_m >= 64
    A.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    assert torch.equal(kc, k_cache) and torch.equal(vc, v_cache)
    ref = reference(q, k_cache, v_cache, meta.runs, tables, d**-0.5)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert (out.float() - ref.float()).abs().max() <= tol


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("splits", [None, 1, 2, 16], ids=lambda s: f"splits-{s or 'auto'}")
def test_decode_batches_split_the_context_and_merge_exactly(dtype, splits):
    """Decode-only batches use small tiles and split each context into key ranges
    (flash-decoding), including ranges that are empty for short contexts."""
    q, k, v, k_cache, v_cache, meta, tables = batch(8, 2, 64, 16, dtype, lengths=DECODES)
    out, *_, tiles = run_triton(q, k, v, k_cache.clone(), v_cache.clone(), meta, splits)
    assert tiles.block_m == 16 and tiles.num_tiles == len(DECODES)
    if splits is None:
        assert tiles.splits == 16  # 9 runs x 2 KV heads: far fewer programs than a GPU has
    A.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    ref = reference(q, k_cache, v_cache, meta.runs, tables, 64**-0.5)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert (out.float() - ref.float()).abs().max() <= tol


@pytest.mark.parametrize("lengths, bs", [(DECODES, 16), (RUNS, 16), (RUNS, 32)],
                         ids=["decodes-bs16", "hybrid-bs16", "hybrid-bs32"])
def test_cache_slots_outside_every_context_never_reach_the_output(lengths, bs):
    """A key step loads whole cache blocks (vector loads, not masked per key), so it reads
    slots past a run's context and, past its block table, block 0: with NaN in every slot
    that holds no context key, the outputs are still exact."""
    q, k, v, k_cache, v_cache, meta, tables = batch(8, 2, 64, bs, torch.float32,
                                                    lengths=lengths)
    valid = torch.zeros(k_cache.shape[0], bs, dtype=torch.bool)
    for (_, _, ctx), table in zip(meta.runs, tables, strict=True):
        for p in range(ctx):
            valid[table[p // bs], p % bs] = True
    k_cache.masked_fill_(~valid[:, None, None, :], float("nan"))  # [block, head, D, BS]
    v_cache.masked_fill_(~valid[:, None, :, None], float("nan"))  # [block, head, BS, D]
    assert not valid[0].all()  # block 0, read past the tables, holds NaN too
    out, *_ = run_triton(q, k, v, k_cache.clone(), v_cache.clone(), meta)
    A.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    ref = reference(q, k_cache, v_cache, meta.runs, tables, 64**-0.5)
    assert not out.isnan().any()
    assert (out - ref).abs().max() <= 1e-5


def test_a_split_count_that_is_not_a_power_of_two_is_refused():
    q, k, v, k_cache, v_cache, meta, _ = batch(4, 2, 16, 16, torch.float32, lengths=[(1, 5)])
    with pytest.raises(ValueError, match="3 key splits, not a power of two"):
        run_triton(q, k, v, k_cache, v_cache, meta, splits=3)


def test_padding_rows_write_nothing_and_attend_to_nothing():
    """A padded decode row (slot -1, context 0), as CUDA graphs replay them."""
    q, k, v, k_cache, v_cache, meta, _ = batch(4, 2, 16, 16, torch.float32, lengths=[(1, 5)] * 3)
    meta.slot_mapping[1] = -1
    meta.ctx_lens[1] = 0
    out, kc, vc, _ = run_triton(q, k, v, k_cache.clone(), v_cache.clone(), meta, splits=4)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    keep = [0, 2]
    A.write_kv(k[keep], v[keep], k_cache, v_cache, meta.slot_mapping[keep])
    assert torch.equal(kc, k_cache) and torch.equal(vc, v_cache)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fused_elementwise_kernels_match_the_eager_layers(dtype):
    check_elementwise_ops(triton_ops, dtype, exact_norm=False, device=DEVICE)


def test_tiles_cover_every_query_token_once():
    cu_q = np.cumsum([0] + [n for n, _ in RUNS]).astype(np.int32)
    for group in (1, 3, 4, 8, 32):
        tiles = triton_ops.attention_tiles(cu_q, group, 2, torch.device("cpu"))
        per_tile = tiles.block_m // group
        covered = sorted((int(r), int(t) + i) for r, t in zip(tiles.run, tiles.tok, strict=True)
                         for i in range(per_tile)
                         if int(t) + i < cu_q[int(r) + 1] - cu_q[int(r)])
        assert covered == [(r, i) for r, (n, _) in enumerate(RUNS) for i in range(n)]


def _skinny_reference(x, w, b, nw, eps, silu, res):
    """The operators skinny_linear folds together, one after another as the layers run them
    (the product in float64)."""
    dt = x.dtype
    if nw is not None:
        xf = x.float()
        y = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(dt)
        x = (nw.float() * y.float()).to(dt)
    if silu:
        gate, up = x.chunk(2, -1)
        x = (torch.nn.functional.silu(gate.float()).to(dt).float() * up.float()).to(dt)
    y = torch.nn.functional.linear(x.double(), w.double(), None if b is None else b.double())
    y = y.to(dt)
    return y if res is None else (res.float() + y.float()).to(dt)


SKINNY_CONFIGS = [triton_ops.SkinnyConfig(16, 64), triton_ops.SkinnyConfig(32, 128, dot=False)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mode", ["plain", "bias", "norm", "silu", "residual"])
@pytest.mark.parametrize("rows", [1, 3, 16])
def test_skinny_linear_folds_its_operators_like_the_layers(dtype, mode, rows):
    """A product of a few rows with the norm before it, the SiLU-and-mul before it or the
    residual add after it folded in; N and K not multiples of the tiles; both tilings (the
    matrix-unit one over padded rows, the multiply-add one for a single row)."""
    g = torch.Generator().manual_seed(rows)
    dev = torch.device(DEVICE)

    def on(t):
        return None if t is None else t.to(dev)

    for n, k in ((40, 96), (33, 200), (24, 256)):  # K uneven, and whole steps
        w = (torch.randn(n, k, generator=g) / k**0.5).to(dtype)
        x = torch.randn(rows, 2 * k if mode == "silu" else k, generator=g).to(dtype)
        b = torch.randn(n, generator=g).to(dtype) if mode == "bias" else None
        nw = (torch.rand(k, generator=g) + 0.5).to(dtype) if mode == "norm" else None
        res = torch.randn(rows, n, generator=g).to(dtype) if mode == "residual" else None
        want = _skinny_reference(x, w, b, nw, 1e-5, mode == "silu", res)
        for cfg in SKINNY_CONFIGS:
            r = on(res.clone()) if res is not None else None
            got = triton_ops.skinny_linear(on(x), on(w), on(b), norm_weight=on(nw), eps=1e-5,
                                           silu=mode == "silu", residual=r, config=cfg)
            if r is not None:
                assert got is r  # in place on the residual stream
            tol = 1e-4 if dtype == torch.float32 else 2e-2
            torch.testing.assert_close(got.cpu().float(), want.float(), atol=tol, rtol=tol)


def test_skinny_linear_rejects_a_mismatched_input():
    w = torch.randn(8, 32)
    with pytest.raises(ValueError, match="does not fit"):
        triton_ops.skinny_linear(torch.randn(2, 31), w)
    with pytest.raises(ValueError, match="with silu"):
        triton_ops.skinny_linear(torch.randn(2, 32), w, silu=True)


def test_skinny_config_keeps_every_multiprocessor_busy():
    """The rule's tiles for Llama-3-8B's projections: at least 256 programs each, 4-32 KB of
    weight per step, multiply-adds for one row; a measured choice overrides the rule."""
    for n, k in ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096)):
        for rows in (1, 16):
            cfg = triton_ops.skinny_config(rows, n, k)
            assert -(-n // cfg.block_n) >= 256 and k % cfg.block_k == 0
            assert 4096 <= cfg.block_n * cfg.block_k * 2 <= 32768
            assert cfg.dot == (rows > 1)
    tuned = triton_ops.SkinnyConfig(64, 128, num_warps=8)
    key = (16, 4096, 4096)
    triton_ops.SKINNY_TUNED[key] = tuned
    try:
        assert triton_ops.skinny_config(5, 4096, 4096) is tuned
        assert triton_ops.skinny_config(1, 4096, 4096) is not tuned
    finally:
        del triton_ops.SKINNY_TUNED[key]


def test_the_last_layer_on_the_sampled_rows_gives_the_full_batchs_logits(hf_models,
                                                                         monkeypatch):
    """On the Triton kernels too, the last layer past its keys and values for the sampled rows
    only gives the whole batch's logits, now and in the steps that read its cache."""
    from fluidserve.model.runner import ModelExecutor

    check_last_layer_on_sampled_rows(
        lambda: ModelExecutor(hf_models["llama"], dtype="float32", device=DEVICE,
                              num_blocks=64, block_size=16, max_model_len=256,
                              attention_backend="triton", linear_backend="eager"),
        monkeypatch, atol=1e-4, rtol=1e-4)


def test_a_single_row_takes_one_launch_per_projection(hf_models, monkeypatch,
                                                      few_key_splits):
    """A batch of SKINNY_MAX_ROWS rows (one decode) runs each projection as one skinny_linear
    (norms, SiLU and residual adds folded in): the same logits as the layer-by-layer Triton
    path, within float32 rounding; larger batches keep the layer-by-layer path."""
    from fluidserve.core.scheduler.output import ScheduledChunk, SchedulerOutput
    from fluidserve.model.runner import ModelExecutor
    from fluidserve.sampling_params import SamplingParams

    assert triton_ops.SKINNY_MAX_ROWS == 1
    greedy = SamplingParams(temperature=0.0)
    ex = ModelExecutor(hf_models["llama"], dtype="float32", device=DEVICE, num_blocks=64,
                       block_size=16, max_model_len=256, attention_backend="triton",
                       linear_backend="eager")
    layers = ex.arch.num_layers

    def plan(step, rows, n):
        return SchedulerOutput(step, [
            ScheduledChunk(f"r{i}", 0 if n > 1 else 9, tuple(range(3 + i, 3 + i + n)),
                           (i,), True, greedy, 0, 0, is_decode=n == 1) for i in range(rows)])

    calls = []
    real = triton_ops.skinny_linear
    monkeypatch.setattr(triton_ops, "skinny_linear",
                        lambda *a, **kw: calls.append(1) or real(*a, **kw))
    with torch.inference_mode():
        ex.logits(plan(0, 3, 9))  # prefill chunks: 27 rows, layer by layer
        ex.logits(plan(1, 3, 1))  # three decodes: layer by layer
        assert calls == []
        got = ex.logits(plan(2, 1, 1))
        assert len(calls) == 4 * layers + 1
        monkeypatch.setattr(triton_ops, "SKINNY_MAX_ROWS", 0)
        want = ex.logits(plan(3, 1, 1))  # the same decode again (same slot and context)
    assert len(calls) == 4 * layers + 1
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rope_and_write_kv_equals_rope_then_write_kv(dtype):
    """The fused launch rotates q and k in place and stores the rotated keys and the values
    at their slots, exactly as rope followed by write_kv; a padding token (slot -1) writes
    nothing."""
    g = torch.Generator().manual_seed(3)
    t, h, hkv, d, bs, blocks = 5, 6, 2, 32, 16, 4
    dev = torch.device(DEVICE)
    qkv = torch.randn(t, (h + 2 * hkv) * d, generator=g).to(dtype).to(dev)
    cos, sin = torch.randn(64, d, generator=g).to(dev), torch.randn(64, d, generator=g).to(dev)
    pos = torch.tensor([3, 0, 63, 17, 5], device=dev)
    slots = torch.tensor([5, 17, -1, 40, 63], device=dev)
    kc = torch.randn(blocks, hkv, d, bs, generator=g).to(dtype).to(dev)
    vc = torch.randn(blocks, hkv, bs, d, generator=g).to(dtype).to(dev)

    def views(x):
        return (x[:, : h * d].view(t, h, d), x[:, h * d : (h + hkv) * d].view(t, hkv, d),
                x[:, (h + hkv) * d :].view(t, hkv, d))

    a, kc_a, vc_a = qkv.clone(), kc.clone(), vc.clone()
    q, k, v = views(a)
    triton_ops.rope(q, k, pos, cos, sin)
    triton_ops.write_kv(k, v, kc_a, vc_a, slots)
    b, kc_b, vc_b = qkv.clone(), kc.clone(), vc.clone()
    q, k, v = views(b)
    triton_ops.rope_and_write_kv(q, k, v, pos, cos, sin, kc_b, vc_b, slots)
    assert torch.equal(a, b) and torch.equal(kc_a, kc_b) and torch.equal(vc_a, vc_b)
    assert not torch.equal(kc_a, kc)  # something was written


def test_argmax_rows_takes_the_lowest_id_of_the_maximum():
    """Rows longer than one block and shorter, ties inside a block and across blocks, a
    maximum in the ragged last block; what torch.argmax gives (the lowest id of a tie)."""
    g = torch.Generator().manual_seed(11)
    x = torch.randn(5, 300, generator=g)
    x[1, 7] = x[1, 250] = 9.0  # tie across blocks of 64
    x[2, 70] = x[2, 71] = 9.0  # tie inside a block
    x[3, 299] = 9.0  # in the last, ragged block
    x[4] = 0.5  # all equal
    got = triton_ops.argmax_rows(x.to(DEVICE), block=64)
    assert got.dtype == torch.int64
    assert got.cpu().tolist() == [int(x[0].argmax()), 7, 70, 299, 0]
    # Again: the counters were left at zero for the next launch.
    assert triton_ops.argmax_rows(x.to(DEVICE), block=64).cpu().tolist() == got.cpu().tolist()
    assert triton_ops.argmax_rows(x[:1].to(DEVICE)).cpu().tolist() == [int(x[0].argmax())]
