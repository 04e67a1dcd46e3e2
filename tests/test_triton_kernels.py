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

from .attention_cases import RUNS, batch, check_elementwise_ops, reference

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
