"""The compiled CPU kernels against the eager PyTorch reference they replace."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from fluidserve.kernels import build_error, cpu_ops
from fluidserve.model import attention as A

ops = cpu_ops()
pytestmark = pytest.mark.skipif(ops is None, reason=f"no compiled kernels: {build_error()}")

# (query tokens, context after the run) per run: decodes, chunks that start at 0 and chunks
# that continue a cached prefix, short (kernel) and long (flash attention inside the op).
RUNS = [(1, 37), (1, 1), (5, 5), (13, 40), (1, 100), (64, 64), (7, 200), (3, 16), (1, 17),
        (40, 90), (16, 16), (17, 300)]


def reference(q, k_cache, v_cache, runs, tables, scale):
    """SDPA on each run's context gathered into a contiguous [Hkv, ctx, D], in float32."""
    out = torch.empty_like(q)
    for (q0, n, ctx), table in zip(runs, tables, strict=True):
        kh, vh = A.gather_kv(k_cache, v_cache, torch.tensor(table), ctx)
        mask = torch.arange(ctx)[None, :] <= torch.arange(ctx - n, ctx)[:, None]
        o = F.scaled_dot_product_attention(q[q0:q0 + n].transpose(0, 1).float()[None],
                                           kh.float()[None], vh.float()[None], attn_mask=mask,
                                           scale=scale, enable_gqa=True)
        out[q0:q0 + n] = o[0].transpose(0, 1).to(q.dtype)
    return out


def batch(h, hkv, d, bs, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    nb = 200
    k_cache, v_cache = A.new_kv_cache(nb, bs, hkv, d, dtype, torch.device("cpu"))
    k_cache.copy_(torch.randn(k_cache.shape, generator=g))
    v_cache.copy_(torch.randn(v_cache.shape, generator=g))
    perm = torch.randperm(nb, generator=g).tolist()
    runs, tables, slots, q0 = [], [], [], 0
    for n, ctx in RUNS:
        table, perm = perm[: -(-ctx // bs)], perm[-(-ctx // bs):]
        runs.append((q0, n, ctx))
        tables.append(table)
        slots += [table[p // bs] * bs + p % bs for p in range(ctx - n, ctx)]
        q0 += n
    width = max(map(len, tables))
    meta = A.AttentionMetadata(
        slot_mapping=torch.tensor(slots),
        cu_q=torch.tensor([0] + [r[0] + r[1] for r in runs], dtype=torch.int32),
        ctx_lens=torch.tensor([r[2] for r in runs], dtype=torch.int32),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables],
                                  dtype=torch.int32),
        block_size=bs, runs=runs)
    q = torch.randn(q0, h, d, generator=g).to(dtype)
    k = torch.randn(q0, hkv, d, generator=g).to(dtype)
    v = torch.randn(q0, hkv, d, generator=g).to(dtype)
    return q, k, v, k_cache, v_cache, meta, tables


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(16, 4, 64, 16), (4, 2, 16, 16), (8, 8, 32, 32),
                                   (32, 1, 64, 16), (8, 2, 128, 16)],
                         ids=lambda s: "h{}-kv{}-d{}-bs{}".format(*s))
@pytest.mark.parametrize("min_long_run", [1, A.MIN_LONG_RUN, 10**9],
                         ids=["all-flash", "default", "all-kernel"])
@pytest.mark.parametrize("amx", [True, False], ids=["amx", "aten"])
def test_native_attention_matches_reference(dtype, shape, min_long_run, amx):
    """Long runs take the AMX kernel (bf16, head_dim a multiple of 32, where the CPU has
    AMX) or ATen's flash attention; short ones and decodes this file's other kernel."""
    h, hkv, d, bs = shape
    q, k, v, k_cache, v_cache, meta, tables = batch(h, hkv, d, bs, dtype)
    kc, vc = k_cache.clone(), v_cache.clone()
    out = torch.empty_like(q)
    before = ops.use_amx(amx)
    try:
        ops.paged_attention(out, q, k, v, kc, vc, meta.slot_mapping, meta.cu_q, meta.ctx_lens,
                            meta.block_tables, d**-0.5, min_long_run)
    finally:
        ops.use_amx(before)
    # The kernel wrote the new keys and values where the eager writer puts them.
    A.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    assert torch.equal(kc, k_cache) and torch.equal(vc, v_cache)
    ref = reference(q, k_cache, v_cache, meta.runs, tables, d**-0.5)
    # The flash path computes in the cache dtype; the kernel accumulates in float32.
    tol = 1e-5 if dtype == torch.float32 else (4e-3 if min_long_run > 10**8 else 3e-2)
    assert (out.float() - ref.float()).abs().max() <= tol


def test_long_runs_take_the_amx_kernel_where_the_cpu_has_it():
    q, k, v, k_cache, v_cache, meta, tables = batch(16, 4, 64, 16, torch.bfloat16, seed=2)
    outs = []
    for amx in (True, False):
        out = torch.empty_like(q)
        before = ops.use_amx(amx)
        try:
            ops.paged_attention(out, q, k, v, k_cache.clone(), v_cache.clone(),
                                meta.slot_mapping, meta.cu_q, meta.ctx_lens, meta.block_tables,
                                0.125, A.MIN_LONG_RUN)
        finally:
            ops.use_amx(before)
        outs.append(out)
    flags = open("/proc/cpuinfo").read() if os.path.exists("/proc/cpuinfo") else ""
    has_amx = " amx_bf16" in flags and " amx_tile" in flags
    # Kernels are built with -march=native: where the CPU has AMX, so does the build.
    assert ops.amx_available() == has_amx
    # The two paths round differently (P in bf16 on the tiles), so the outputs differ
    # exactly when the AMX kernel ran.
    assert torch.equal(outs[0], outs[1]) != has_amx


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_eager_attention_matches_reference(dtype):
    q, k, v, k_cache, v_cache, meta, tables = batch(16, 4, 64, 16, dtype, seed=1)
    meta.native = False
    out = A.paged_attention(q, k, v, k_cache, v_cache, meta, 0.125)
    ref = reference(q, k_cache, v_cache, meta.runs, tables, 0.125)
    assert (out.float() - ref.float()).abs().max() <= (1e-5 if dtype == torch.float32 else 3e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [1, 15, 16, 17, 1001, 32000])
def test_argmax_rows_matches_torch_and_prefers_the_lowest_tie(dtype, vocab):
    x = torch.randn(9, vocab, generator=torch.Generator().manual_seed(vocab)).to(dtype)
    assert torch.equal(ops.argmax_rows(x), x.float().argmax(-1))
    ties = torch.tensor([[0.0, 3, 3, 1], [5, 5, 5, 5], [1, 2, 2, 2]], dtype=dtype).repeat(1, 9)
    assert ops.argmax_rows(ties).tolist() == [1, 0, 1]


def test_kernels_can_be_disabled_and_the_engine_falls_back():
    code = ("from fluidserve.kernels import cpu_ops, build_error; import torch;"
            "from fluidserve.model.worker import choose_attention as c;"
            "print(cpu_ops() is None, build_error(), c('auto', 16, 64, torch.device('cpu')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=os.environ | {"FLUIDSERVE_NO_KERNELS": "1"}, check=True)
    assert out.stdout.split() == ["True", "disabled", "by", "FLUIDSERVE_NO_KERNELS", "False"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_elementwise_kernels_match_the_eager_layers(dtype):
    from fluidserve.model.arch import parse_arch
    from fluidserve.model.llama import RMSNorm, Rotary, apply_rope

    g = torch.Generator().manual_seed(5)
    # 200 = three 64-wide steps, one 16-wide step and a scalar tail; 37 rows span threads.
    x = torch.randn(37, 200, generator=g).to(dtype)
    res = torch.randn(37, 200, generator=g).to(dtype)
    norm = RMSNorm(200, 1e-5)
    norm.weight.data = (torch.rand(200, generator=g) + 0.5).to(dtype)
    tol = dict(atol=0, rtol=0) if dtype == torch.bfloat16 else dict(atol=1e-6, rtol=1e-6)
    with torch.no_grad():
        torch.testing.assert_close(norm.native(x), norm(x), **tol)
        h, r = norm.add_native(x.clone(), res.clone())
        torch.testing.assert_close(r, res + x, atol=0, rtol=0)
        torch.testing.assert_close(h, norm(res + x), **tol)
        # RoPE in place on views of a fused QKV row (H=3, Hkv=2, D=32), positions out of order.
        cfg = parse_arch({"architectures": ["LlamaForCausalLM"], "vocab_size": 10,
                          "hidden_size": 96, "intermediate_size": 10, "num_hidden_layers": 1,
                          "num_attention_heads": 3, "num_key_value_heads": 2})
        rot = Rotary(cfg, 64)
        qkv = torch.randn(5, (3 + 2 + 2) * 32, generator=g).to(dtype)
        pos = torch.tensor([3, 0, 63, 17, 5])
        q, k = qkv[:, :96].view(5, 3, 32), qkv[:, 96:160].view(5, 2, 32)
        cos, sin = rot(pos)
        want_q, want_k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        ops.rope(q, k, pos, rot.cos, rot.sin)
        close = dict(atol=1e-2, rtol=1e-2) if dtype == torch.bfloat16 else dict(atol=1e-5,
                                                                                rtol=1e-5)
        torch.testing.assert_close(q, want_q, **close)
        torch.testing.assert_close(k, want_k, **close)
        gu = torch.randn(6, 2 * 40, generator=g).to(dtype) * 3
        gu[0, :4] = torch.tensor([-120.0, -90.0, 90.0, 120.0])  # exp under- and overflow
        out = gu.new_empty(6, 40)
        ops.silu_and_mul(out, gu)
        gate, up = gu.chunk(2, dim=-1)
        torch.testing.assert_close(out, F.silu(gate) * up, **close)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_decoder_layers_in_one_call_equal_the_per_layer_path(tiny_model_dir, monkeypatch, dtype):
    """Batches run the whole stack of decoder layers in one compiled call: the same kernels in
    the same order as the per-layer path, so the logits are identical, whether the batch is a
    few decodes, pads its linears' rows (17+ tokens) or holds a run long enough for the flash
    attention path."""
    from fluidserve.core.scheduler.output import ScheduledChunk, SchedulerOutput
    from fluidserve.model import llama
    from fluidserve.model.runner import ModelExecutor
    from fluidserve.sampling_params import SamplingParams

    ex = ModelExecutor(str(tiny_model_dir), dtype=dtype, num_blocks=64, block_size=16)
    assert ex.native_attention
    g = torch.Generator().manual_seed(0)
    ids = {r: torch.randint(3, ex.arch.vocab_size, (100,), generator=g).tolist() for r in "abcd"}
    tables = {"a": (3, 9, 4), "b": (12, 1, 7), "c": (20, 30, 25), "d": (40, 41, 50, 43, 44, 60, 46)}

    def chunk(r: str, start: int, n: int) -> ScheduledChunk:
        return ScheduledChunk(r, start, tuple(ids[r][start:start + n]), tables[r], True,
                              SamplingParams(temperature=0.0), 0, 0,
                              is_decode=n == 1 and start > 0)

    plans = [[chunk("a", 0, 14)], [chunk("b", 0, 9), chunk("a", 14, 1)],
             [chunk("a", 15, 1), chunk("b", 9, 1), chunk("c", 0, 3)],
             [chunk("c", 3, 13), chunk("a", 16, 1), chunk("b", 10, 1)],
             [chunk("d", 0, 70), chunk("a", 17, 1), chunk("c", 16, 20)],  # 91 rows, padded
             [chunk("d", 70, 30), chunk("a", 18, 1)]]
    used = []
    real = llama.LlamaForCausalLM._fused_layers

    def spy(self, *args):
        out = real(self, *args)
        used.append(out is not None)
        return out

    monkeypatch.setattr(llama.LlamaForCausalLM, "_fused_layers", spy)
    with torch.inference_mode():
        for i, plan in enumerate(plans):
            # The same plan twice rewrites the same cache slots with the same values.
            monkeypatch.setattr(llama, "FUSED_MAX_ROWS", None)
            fused = ex.logits(SchedulerOutput(i, plan))
            monkeypatch.setattr(llama, "FUSED_MAX_ROWS", 0)
            layered = ex.logits(SchedulerOutput(i, plan))
            assert torch.equal(fused, layered), f"iteration {i}"
    assert used == [True, False] * len(plans)  # the one-call path ran, then the layered one
