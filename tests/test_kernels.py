"""The compiled CPU kernels against the eager PyTorch reference they replace."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from fluidserve.kernels import build_error, cpu_flags, cpu_ops
from fluidserve.model import attention as A

from .attention_cases import (
    batch,
    check_elementwise_ops,
    check_last_layer_on_sampled_rows,
    record_results,
    reference,
)

ops = cpu_ops()
pytestmark = pytest.mark.skipif(ops is None, reason=f"no compiled kernels: {build_error()}")


def kind_built_here() -> str:
    """The kernels' kind that this CPU's flags imply (they are built with -march=native: what
    the CPU has, the build has): "amx", "avx512" (panels of 32 columns), "avx2" or ""."""
    flags = set(cpu_flags().split())
    if {"amx_bf16", "amx_tile", "avx512bw"} <= flags:
        return "amx"
    if {"avx512f", "avx512bw"} <= flags:
        return "avx512"
    return "avx2" if {"avx2", "fma"} <= flags else ""


AVX2_MARCH = "x86-64-v3"  # AVX2, FMA, F16C, BMI1/2, LZCNT, MOVBE


@pytest.fixture(scope="module", params=["native", "avx2"])
def kernels(request):
    """The kernels as built for this CPU, and as built for AVX2 and FMA alone (the EPYC's
    paths: decode loops on eight-lane registers, panels of 16 columns), so that those paths
    are tested on every CPU that can run them; where AVX2 is what this CPU has, the two are
    one build."""
    if request.param == "native":
        return ops
    if not {"avx2", "fma", "f16c", "bmi1", "bmi2", "movbe", "abm"} <= set(cpu_flags().split()):
        pytest.skip(f"the CPU cannot run a -march={AVX2_MARCH} build")
    if kind_built_here() == "avx2":
        return ops
    built = cpu_ops(AVX2_MARCH)
    assert built is not None, build_error(AVX2_MARCH)  # a compiler built the native ones
    assert built.tile_kind() == "avx2" and built.prefill_kernel() == "avx2"
    return built


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(16, 4, 64, 16), (4, 2, 16, 16), (8, 8, 32, 32),
                                   (32, 1, 64, 16), (8, 2, 128, 16), (12, 2, 64, 16)],
                         ids=lambda s: "h{}-kv{}-d{}-bs{}".format(*s))
@pytest.mark.parametrize("min_long_run", [1, A.MIN_LONG_RUN, 10**9],
                         ids=["all-flash", "default", "all-kernel"])
@pytest.mark.parametrize("prefill", ["fma", "dot", "aten"],
                         ids=["prefill-kernel", "prefill-kernel-dot", "aten"])
def test_native_attention_matches_reference(kernels, dtype, shape, min_long_run, prefill):
    """Long runs take the prefill kernel (bf16; AMX tiles with head_dim a multiple of 32, or
    the AVX2 or AVX-512 panels, where the CPU has them, on float32 FMAs or, with AVX-512 BF16,
    the bf16 dot product) or ATen's flash attention; short ones and decodes this file's other
    kernel (groups of six query heads a kv head: a partial group of rows in the decode loops).
    Where a build has no dot product, asking for it is an error."""
    h, hkv, d, bs = shape
    q, k, v, k_cache, v_cache, meta, tables = batch(h, hkv, d, bs, dtype)
    kc, vc = k_cache.clone(), v_cache.clone()
    out = torch.empty_like(q)
    if prefill == "dot" and not kernels.dot_panels_built():
        with pytest.raises(RuntimeError, match="AVX-512 BF16|no panel prefill kernel"):
            kernels.use_prefill_dot(True)
        return
    before = kernels.use_prefill_kernel(prefill != "aten")
    dot_before = kernels.use_prefill_dot(prefill == "dot")
    try:
        kernels.paged_attention(out, q, k, v, kc, vc, meta.slot_mapping, meta.cu_q,
                                meta.ctx_lens, meta.block_tables, d**-0.5, min_long_run)
    finally:
        kernels.use_prefill_kernel(before)
        kernels.use_prefill_dot(dot_before)
    # The kernel wrote the new keys and values where the eager writer puts them.
    A.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    assert torch.equal(kc, k_cache) and torch.equal(vc, v_cache)
    ref = reference(q, k_cache, v_cache, meta.runs, tables, d**-0.5)
    # The flash path computes in the cache dtype; the kernel accumulates in float32.
    tol = 1e-5 if dtype == torch.float32 else (4e-3 if min_long_run > 10**8 else 3e-2)
    assert (out.float() - ref.float()).abs().max() <= tol


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("min_long_run", [1, A.MIN_LONG_RUN, 10**9],
                         ids=["all-flash", "default", "all-kernel"])
@pytest.mark.parametrize("prefill", [True, False], ids=["prefill-kernel", "aten"])
def test_attention_reads_queries_keys_and_values_through_their_strides(dtype, min_long_run,
                                                                       prefill):
    """The model hands the kernel views into its fused QKV output (no copies): every path
    (decodes, short runs, the prefill kernel's or ATen's long runs, the cache write) gives
    exactly what it gives on dense tensors."""
    h, hkv, d, bs = 16, 4, 64, 16
    q, k, v, k_cache, v_cache, meta, _ = batch(h, hkv, d, bs, dtype, seed=3)
    qkv = torch.cat([q.flatten(1), k.flatten(1), v.flatten(1)], dim=1)
    t = q.shape[0]
    views = (qkv[:, : h * d].view(t, h, d), qkv[:, h * d: (h + hkv) * d].view(t, hkv, d),
             qkv[:, (h + hkv) * d:].view(t, hkv, d))
    assert not any(x.is_contiguous() for x in views)
    results = []
    for q_, k_, v_ in ((q, k, v), views):
        out, kc, vc = torch.empty_like(q), k_cache.clone(), v_cache.clone()
        before = ops.use_prefill_kernel(prefill)
        try:
            ops.paged_attention(out, q_, k_, v_, kc, vc, meta.slot_mapping, meta.cu_q,
                                meta.ctx_lens, meta.block_tables, d**-0.5, min_long_run)
        finally:
            ops.use_prefill_kernel(before)
        results.append((out, kc, vc))
    assert all(torch.equal(a, b) for a, b in zip(*results, strict=True))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_lone_decode_split_over_threads_matches_reference(kernels, dtype):
    """A batch of fewer decodes than threads splits each decode's heads over the threads
    (whole kv-head groups): the output is the one of a single item, exactly."""
    q, k, v, k_cache, v_cache, meta, tables = batch(16, 4, 64, 16, dtype, seed=4,
                                                    lengths=[(1, 300)])
    outs = []
    before = torch.get_num_threads()
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            out = torch.empty_like(q)
            kernels.paged_attention(out, q, k, v, k_cache.clone(), v_cache.clone(),
                                    meta.slot_mapping, meta.cu_q, meta.ctx_lens,
                                    meta.block_tables, 0.125, A.MIN_LONG_RUN)
            outs.append(out)
    finally:
        torch.set_num_threads(before)
    A.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    ref = reference(q, k_cache, v_cache, meta.runs, tables, 0.125)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
    assert (outs[0].float() - ref.float()).abs().max() <= (1e-5 if dtype == torch.float32
                                                            else 4e-3)


def test_long_runs_take_the_prefill_kernel_the_cpu_has():
    q, k, v, k_cache, v_cache, meta, tables = batch(16, 4, 64, 16, torch.bfloat16, seed=2)
    outs = []
    for prefill in (True, False):
        out = torch.empty_like(q)
        before = ops.use_prefill_kernel(prefill)
        try:
            ops.paged_attention(out, q, k, v, k_cache.clone(), v_cache.clone(),
                                meta.slot_mapping, meta.cu_q, meta.ctx_lens, meta.block_tables,
                                0.125, A.MIN_LONG_RUN)
        finally:
            ops.use_prefill_kernel(before)
        outs.append(out)
    expected = kind_built_here()
    assert ops.prefill_kernel() == expected
    before = ops.use_prefill_kernel(False)
    try:  # switched off, it is ATen's, and the engine gives it no short runs
        assert ops.prefill_kernel() == ""
        assert A.min_long_run(ops, torch.bfloat16) == A.MIN_LONG_RUN
    finally:
        ops.use_prefill_kernel(before)
    assert A.min_long_run(ops, torch.bfloat16) == A.MIN_LONG_RUN_PANELS.get(expected,
                                                                            A.MIN_LONG_RUN)
    assert A.min_long_run(ops, torch.float32) == A.MIN_LONG_RUN
    # The two paths round differently (P in bf16 in the kernels), so the outputs differ
    # exactly when a prefill kernel ran; both are checked against the reference above.
    assert torch.equal(outs[0], outs[1]) != bool(expected)


@pytest.mark.parametrize("d", [32, 64, 128])
def test_the_prefill_kernel_follows_scores_that_keep_rising(d):
    """Scores that rise along the context, by a few units a 32-key chunk or by many: the AMX
    kernel raises its running max only when a chunk passes it by more than 2^8 (and keeps its
    output in tile registers up to head_dim 64), so both the stale max and the rescale must
    give the reference's softmax; so must the panel kernels where the CPU has those."""
    if ops.prefill_kernel() == "":
        pytest.skip("no prefill kernel on this CPU")
    h, hkv, bs = 8, 2, 16
    lengths = [(64, 64), (200, 300), (33, 97)]
    q, k, v, k_cache, v_cache, meta, tables = batch(h, hkv, d, bs, torch.bfloat16, seed=4,
                                                    lengths=lengths)
    g = torch.Generator().manual_seed(9)
    u = F.normalize(torch.randn(hkv, d, generator=g), dim=-1)  # each kv head's direction
    # per query head: the score gained per key (natural units), 0.02 to 0.4 (13 a chunk)
    rise = torch.linspace(0.02, 0.4, h)
    keys, values, slots = [], [], []
    for (q0, n, ctx), table in zip(meta.runs, tables, strict=True):
        pos = torch.arange(ctx, dtype=torch.float32)
        noise = 0.05 * torch.randn(ctx, hkv, d, generator=g)
        keys.append(pos[:, None, None] * u[None] + noise)
        values.append(torch.randn(ctx, hkv, d, generator=g))
        slots += [table[p // bs] * bs + p % bs for p in range(ctx)]
        # q . k / sqrt(d) = rise x position for the group's direction
        q[q0:q0 + n] = (rise[:, None] * d**0.5 * u.repeat_interleave(h // hkv, 0))[None].to(
            q.dtype)
    keys, values = torch.cat(keys).to(q.dtype), torch.cat(values).to(q.dtype)
    A.write_kv(keys, values, k_cache, v_cache, torch.tensor(slots))
    # the new tokens' keys and values: each run's last n positions
    new = torch.cat([torch.arange(sum(r[2] for r in meta.runs[:i]) + ctx - n,
                                  sum(r[2] for r in meta.runs[:i]) + ctx)
                     for i, (_, n, ctx) in enumerate(meta.runs)])
    out = torch.empty_like(q)
    before = ops.use_prefill_kernel(True)
    try:
        ops.paged_attention(out, q, keys[new], values[new], k_cache, v_cache,
                            meta.slot_mapping, meta.cu_q, meta.ctx_lens, meta.block_tables,
                            d**-0.5, 1)
    finally:
        ops.use_prefill_kernel(before)
    ref = reference(q, k_cache, v_cache, meta.runs, tables, d**-0.5)
    assert (out.float() - ref.float()).abs().max() <= 3e-2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_eager_attention_matches_reference(dtype):
    q, k, v, k_cache, v_cache, meta, tables = batch(16, 4, 64, 16, dtype, seed=1)
    meta.backend = "eager"
    out = A.paged_attention(q, k, v, k_cache, v_cache, meta, 0.125)
    ref = reference(q, k_cache, v_cache, meta.runs, tables, 0.125)
    assert (out.float() - ref.float()).abs().max() <= (1e-5 if dtype == torch.float32 else 3e-2)


@pytest.mark.parametrize("backend", ["eager", "native"])
def test_stale_cache_slots_past_a_context_never_reach_the_output(backend):
    """NaN in slots no run's context covers (its last block's tail, block 0 padding shorter
    block tables): one request's overflow must not poison the others' attention."""
    if backend == "native" and cpu_ops() is None:
        pytest.skip(f"native kernels unavailable: {build_error()}")
    for seed in range(50):  # a batch where block 0 pads the first table and holds no context
        q, k, v, k_cache, v_cache, meta, tables = batch(8, 2, 64, 16, torch.float32, seed=seed,
                                                        lengths=[(1, 20), (1, 70)], num_blocks=40)
        if all(0 not in t for t in tables):
            break
    want = A.paged_attention(q, k, v, k_cache.clone(), v_cache.clone(),
                             dataclasses.replace(meta, backend=backend), 0.125)
    k_cache[tables[0][-1], :, :, 5:], v_cache[tables[0][-1], :, 5:, :] = float("nan"), float("nan")
    k_cache[0], v_cache[0] = float("nan"), float("nan")
    got = A.paged_attention(q, k, v, k_cache, v_cache, dataclasses.replace(meta, backend=backend),
                            0.125)
    assert torch.equal(got, want)


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
    assert out.stdout.split() == ["True", "disabled", "by", "FLUIDSERVE_NO_KERNELS", "eager"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_elementwise_kernels_match_the_eager_layers(kernels, dtype):
    """The row-wise kernels of this CPU's build and of the AVX2 build against the eager
    layers."""
    check_elementwise_ops(kernels, dtype, exact_norm=True)


def test_row_wise_kernels_give_the_same_bits_in_the_avx512_and_the_avx2_build():
    """The AVX-512 build loads, rounds, stores and exponentiates with AVX-512's own instructions
    (VPMOVZXWD, VPMOVDW, VRNDSCALEPS, VSCALEFPS) where the AVX2 build runs the portable vector
    code or its eight-lane loops: the same arithmetic, so every output bit must agree, on
    random values and on those where the paths could part (zeros of both signs, infinities,
    NaN, denormals, the exponential's clamps at -87 and 88 and beyond, the largest floats)."""
    if kind_built_here() not in ("avx512", "amx"):
        pytest.skip("this CPU's build has no AVX-512 paths")
    avx2 = cpu_ops(AVX2_MARCH)
    assert avx2 is not None, build_error(AVX2_MARCH)
    g = torch.Generator().manual_seed(11)
    special = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), 1e-39, -1e-39,
                            -86.9, -87.0, -87.5, -88.5, 87.9, 88.0, 88.5, -120.0, 120.0, 3e38,
                            -3e38, 1e-30, 0.5, -0.5])

    def values(rows: int, cols: int) -> torch.Tensor:
        x = torch.randn(rows * cols, generator=g) * 4
        idx = torch.randperm(rows * cols, generator=g)[:special.numel() * 6]
        x[idx] = special.repeat(6)
        return x.view(rows, cols).bfloat16()

    def same(a: torch.Tensor, b: torch.Tensor) -> bool:
        return torch.equal(a.view(torch.int16), b.view(torch.int16))

    # 208 = 6 x 32 + 16: the two-vector loop and a single vector. (A scalar tail, which the
    # builds cut at 16 and 8 lanes, takes libm's exp: no clamp at 88.)
    gu = values(37, 2 * 208)
    outs = [gu.new_empty(37, 208) for _ in range(2)]
    for mod, out in zip((ops, avx2), outs, strict=True):
        mod.silu_and_mul(out, gu)
    assert same(*outs)
    x, res = values(37, 200), values(37, 200)
    w = (torch.rand(200, generator=g) + 0.5).bfloat16()
    normed = [torch.empty_like(x) for _ in range(2)]
    added = [(x.clone(), res.clone()) for _ in range(2)]
    for mod, out, (h, r) in zip((ops, avx2), normed, added, strict=True):
        mod.rms_norm(out, x, w, 1e-5)
        mod.fused_add_rms_norm(h, r, w, 1e-5)
    assert same(*normed)
    assert same(added[0][0], added[1][0]) and same(added[0][1], added[1][1])
    qkv = values(9, (6 + 2 + 2) * 32)
    cos, sin = torch.randn(64, 32, generator=g), torch.randn(64, 32, generator=g)
    pos = torch.tensor([3, 0, 63, 17, 5, 5, 40, 1, 2])
    rotated = [qkv.clone() for _ in range(2)]
    for mod, t in zip((ops, avx2), rotated, strict=True):
        mod.rope(t[:, :192].view(9, 6, 32), t[:, 192:256].view(9, 2, 32), pos, cos, sin)
    assert same(*rotated)


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
    assert ex.attention == "native"
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
    used = record_results(monkeypatch, llama.LlamaForCausalLM, "_fused_layers")
    with torch.inference_mode():
        for i, plan in enumerate(plans):
            # The same plan twice rewrites the same cache slots with the same values.
            monkeypatch.setattr(llama, "FUSED_MAX_ROWS", None)
            fused = ex.logits(SchedulerOutput(i, plan))
            monkeypatch.setattr(llama, "FUSED_MAX_ROWS", 0)
            layered = ex.logits(SchedulerOutput(i, plan))
            assert torch.equal(fused, layered), f"iteration {i}"
    assert used == [True, False] * len(plans)  # the one-call path ran, then the layered one


@pytest.mark.parametrize("linear", ["auto", "packed"])
@pytest.mark.parametrize("fused", [True, False], ids=["one-call", "per-layer"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_last_layer_on_the_sampled_rows_gives_the_full_batchs_logits(
        tiny_model_dir, monkeypatch, dtype, fused, linear):
    """The last layer runs past its keys and values for the sampled rows only, in the one-call
    stack and in the per-layer path, on this CPU's linears and on oneDNN's (whose batches
    the stack pads, the kept rows to a count of their own): the logits of every step equal
    those of the whole batch within rounding (a sampled row's attention then runs as a single
    query, not in its prefill run's tiles), and so do the next steps', which read the keys and
    values it wrote."""
    from fluidserve.model import llama
    from fluidserve.model.runner import ModelExecutor

    monkeypatch.setattr(llama, "FUSED_MAX_ROWS", None if fused else 0)
    tol = 1e-4 if dtype == "float32" else 2e-2
    check_last_layer_on_sampled_rows(
        lambda: ModelExecutor(str(tiny_model_dir), dtype=dtype, num_blocks=64, block_size=16,
                              linear_backend=linear),
        monkeypatch, atol=tol, rtol=tol)


def test_row_wise_benchmark_reports_each_kernel_per_row_count():
    """scripts/bench_rowwise.py at toy sizes: one JSON line per kernel, row count and thread
    count, with its time per element (the numbers themselves are not checked: a benchmark)."""
    script = os.path.join(os.path.dirname(__file__), "..", "scripts", "bench_rowwise.py")
    out = subprocess.run([sys.executable, script, "--rows", "3", "5", "--threads", "1",
                          "--rounds", "1"], capture_output=True, text=True, check=True,
                         timeout=300)
    rows = [json.loads(line) for line in out.stdout.splitlines()]
    assert [(r["kernel"], r["rows"]) for r in rows] == [
        (k, n) for k in ("silu_and_mul", "rms_norm", "fused_add_rms_norm", "rope") for n in (3, 5)]
    assert all(r["kernel_ms"] > 0 and r["kernel_ns_per_element"] > 0 for r in rows)
    assert not any("identical" in r or "variant_ms" in r for r in rows)
    bad = subprocess.run([sys.executable, script, "--rows", "0"], capture_output=True,
                         text=True, timeout=300)
    assert bad.returncode != 0 and "--rows and --rounds must be positive" in bad.stderr


def test_attention_benchmark_reports_both_cases_per_thread_count():
    """scripts/bench_attention.py at toy sizes: one JSON line per case and thread count, with
    the decode case's KV read rate (the numbers themselves are not checked: a benchmark), and a
    hybrid batch on request."""
    script = os.path.join(os.path.dirname(__file__), "..", "scripts", "bench_attention.py")
    out = subprocess.run([sys.executable, script, "--decode", "3x40", "--prefill", "2x33",
                          "--mixed", "1x20@17+3x40", "--threads", "1", "--rounds", "1"],
                         capture_output=True, text=True, check=True, timeout=300)
    rows = [json.loads(line) for line in out.stdout.splitlines()]
    assert [(r["case"], r["shape"], r["threads"]) for r in rows] == [
        ("decode", "3x40", 1), ("prefill", "2x33", 1), ("mixed", "1x20@17+3x40", 1)]
    bad = subprocess.run([sys.executable, script, "--mixed", "1x20"], capture_output=True,
                         text=True, timeout=300)
    assert bad.returncode != 0 and "--mixed: SxP[@C]+NxC" in bad.stderr
    assert rows[0]["kernel_kv_gb_s"] > 0 and all(r["kernel_ms"] > 0 for r in rows)
    assert "variant_ms" not in rows[0]
    # A later chunk of a prompt (5 tokens after 20 cached), at two thresholds side by side.
    out = subprocess.run([sys.executable, script, "--decode", "1x16", "--prefill", "2x5@20",
                          "--min-long-run", "2", "16", "--threads", "1", "--rounds", "1"],
                         capture_output=True, text=True, check=True, timeout=300)
    row = json.loads(out.stdout.splitlines()[-1])
    assert row["shape"] == "2x5@20" and row["kernel@2_ms"] > 0 and row["kernel@16_ms"] > 0
    assert row["max_abs_diff"] < 0.05  # the prefill path against the per-token items


TILE_KIND = ops.tile_kind() if ops is not None else ""
AMX = TILE_KIND == "amx"
needs_amx = pytest.mark.skipif(not AMX, reason="the CPU has no AMX tiles")


@needs_amx
@pytest.mark.parametrize("n,k,bias", [(96, 64, False), (100, 96, True), (1536, 1024, False),
                                      (1024, 2816, True), (40, 32, True)])
def test_tile_linear_matches_onednn_and_is_the_same_for_every_batch_size(n, k, bias):
    """The small-batch linear on tile-packed weights: as close to the float32 product as
    oneDNN on the same bf16 operands (bit-equal up to 16 rows, where both sum in the same
    order), and each row's result independent of the rows beside it, whatever their number
    (whole and partial row tiles, one to four of them)."""
    g = torch.Generator().manual_seed(n + k)
    w = (torch.randn(n, k, generator=g) * 0.05).bfloat16()
    b = torch.randn(n, generator=g).bfloat16() if bias else None
    tiles, packed = ops.tile_pack(w), torch.ops.mkldnn._reorder_linear_weight(w, None)
    x = torch.randn(64, k, generator=g).bfloat16()
    full = ops.tile_linear(x, tiles, n, b)
    for m in (1, 5, 16, 17, 32, 40, 48, 49, 64):
        y = ops.tile_linear(x[:m], tiles, n, b)
        assert y.shape == (m, n) and torch.equal(y, full[:m]), m
        ref = x[:m].float() @ w.float().T + (b.float() if bias else 0)
        onednn = torch.ops.mkldnn._linear_pointwise(x[:m], packed, b, "none", [], "")
        assert (y.float() - ref).abs().max() <= (onednn.float() - ref).abs().max() * 1.01 + 1e-6
        if m <= 16:
            assert torch.equal(y, onednn), m


@needs_amx
def test_tile_linear_rejects_what_it_cannot_multiply():
    w = torch.randn(64, 48).bfloat16()
    with pytest.raises(RuntimeError, match="multiple of 32"):
        ops.tile_pack(w)
    tiles = ops.tile_pack(torch.randn(64, 64).bfloat16())
    with pytest.raises(RuntimeError, match="at most 64 rows"):
        ops.tile_linear(torch.randn(65, 64).bfloat16(), tiles, 64, None)
    with pytest.raises(RuntimeError, match="does not match"):
        ops.tile_linear(torch.randn(4, 96).bfloat16(), tiles, 64, None)
    with pytest.raises(RuntimeError, match="does not match"):  # a spare pair of tiles
        ops.tile_linear(torch.randn(4, 64).bfloat16(), tiles, 32, None)
    with pytest.raises(RuntimeError, match="bf16"):
        ops.tile_linear(torch.randn(4, 64), tiles, 64, None)


def test_linear_backend_tiles_is_chosen_where_it_can_run(tiny_model_dir, monkeypatch):
    """``auto`` copies bf16 weights into tiles on an AMX CPU while the copy fits a quarter of
    the available memory, into AVX-512 panels on an AVX-512 CPU without AMX, and into AVX2
    panels where oneDNN has no bf16 kernels (they take
    every batch and replace oneDNN's copy, so memory does not matter); ``tiles`` insists,
    and says why it cannot where it cannot."""
    from fluidserve.model import worker as W
    from fluidserve.model.linear import ANY_ROWS, panels_by_default, widened
    from fluidserve.model.runner import ModelExecutor

    panels = panels_by_default()
    ex = ModelExecutor(str(tiny_model_dir), dtype="bfloat16", num_blocks=16)
    assert ex.worker.tile_linear == (AMX or panels)
    assert ex.pads_rows == (not panels)
    layer = ex.model.layers[0].mlp.down_proj
    assert (layer.tiles is not None) == (AMX or panels)
    assert layer.tile_rows == (64 if AMX else ANY_ROWS if panels else 0)
    assert (layer.packed is None) == panels  # panels replace oneDNN's copy
    packed = ModelExecutor(str(tiny_model_dir), dtype="bfloat16", num_blocks=16,
                           linear_backend="packed")
    assert not packed.worker.tile_linear and packed.pads_rows
    assert packed.model.layers[0].mlp.down_proj.wide == widened(torch.bfloat16)
    with pytest.raises(ValueError, match="'tiles' unavailable: needs bfloat16"):
        ModelExecutor(str(tiny_model_dir), dtype="float32", num_blocks=16,
                      linear_backend="tiles")
    monkeypatch.setattr(W, "available_memory", lambda: 1 << 20)  # 1 MB free: no extra copy
    assert ModelExecutor(str(tiny_model_dir), dtype="bfloat16",
                         num_blocks=16).worker.tile_linear == panels
    if TILE_KIND:  # asked for explicitly, the copy is made whatever the memory
        assert ModelExecutor(str(tiny_model_dir), dtype="bfloat16", num_blocks=16,
                             linear_backend="tiles").worker.tile_linear


def test_the_panels_product_is_the_dot_product_where_it_issues_fast_enough(tiny_model_dir,
                                                                           monkeypatch):
    """``--panel-product auto`` takes the bf16 dot product where the build has it (AVX-512
    BF16 without AMX) and the CPU issues it at least DOT_RATE_SHARE as fast as its FMA;
    ``dot`` insists, and says why it cannot where it cannot; ``fma`` never; the worker packs
    its panels for the product it chose."""
    from fluidserve.model import linear as L
    from fluidserve.model.runner import ModelExecutor

    built = ops is not None and ops.dot_panels_built()
    assert built == ({"avx512f", "avx512bw", "avx512_bf16"} <= set(cpu_flags().split())
                     and TILE_KIND == "avx512")
    fma_rate, dot_rate = ops.bf16_dot_rates() if ops is not None else (0.0, 0.0)
    assert (fma_rate > 1e8 and dot_rate > 1e8) == ("avx512_bf16" in cpu_flags().split()
                                                   and ops is not None)
    L.dot_panels_by_default.cache_clear()
    assert L.dot_panels_by_default() == (built and dot_rate >= L.DOT_RATE_SHARE * fma_rate)
    assert not L.dot_panels("fma")
    with pytest.raises(ValueError, match="one of auto, fma, dot"):
        L.dot_panels("bf16")
    if not built:
        with pytest.raises(ValueError, match="'dot' unavailable"):
            L.dot_panels("dot")
        return
    for fast in (True, False):  # a CPU whose dot product issues fast, and one where it is slow
        monkeypatch.setattr(L, "dot_panels_by_default", lambda fast=fast: fast)
        ex = ModelExecutor(str(tiny_model_dir), dtype="bfloat16", num_blocks=16)
        assert ex.worker.dot_panels == fast
        assert ex.model.layers[0].mlp.down_proj.tiles.shape[2] == (64 if fast else 32)
        assert ("bf16 dot products" if fast else "float32 FMAs") in ex.worker.linear_kernel()
        # The prefill attention kernel takes the same product.
        assert ex.worker.prefill_dot == fast
    ex = ModelExecutor(str(tiny_model_dir), dtype="bfloat16", num_blocks=16,
                       panel_product="dot")
    assert ex.worker.dot_panels and ex.worker.prefill_dot
    ex = ModelExecutor(str(tiny_model_dir), dtype="bfloat16", num_blocks=16,
                       panel_product="fma")
    assert not ex.worker.dot_panels and not ex.worker.prefill_dot
    # A float32 model's attention has no prefill kernel: nothing to choose.
    assert not ModelExecutor(str(tiny_model_dir), dtype="float32", num_blocks=16
                             ).worker.prefill_dot
    with pytest.raises(ValueError, match="'dot' needs the panel linears"):
        ModelExecutor(str(tiny_model_dir), dtype="bfloat16", num_blocks=16,
                      linear_backend="packed", panel_product="dot")


@pytest.mark.skipif(ops is None or not os.path.exists("/proc/cpuinfo"),
                    reason="needs the compiled kernels and /proc/cpuinfo")
def test_the_linear_kernel_built_is_the_widest_the_cpu_has():
    """Kernels are built with -march=native: AMX tiles where the CPU has AMX, else panels on
    512-bit registers where it has AVX-512 (which ``auto`` then always uses: with float32
    FMAs where oneDNN's bf16 kernels run at about half their rate, with the bf16 dot product
    where it issues as fast, matching oneDNN from 256 rows and beating it below), else on
    AVX2."""
    from fluidserve.model.linear import panels_by_default

    expected = kind_built_here()
    assert TILE_KIND == expected
    if expected == "avx512":
        assert panels_by_default()


@pytest.mark.parametrize("product", ["fma", "dot"])
@pytest.mark.parametrize("n,k,bias", [(96, 64, False), (100, 96, True), (1536, 1024, False),
                                      (1024, 2816, True), (40, 33, True)])
def test_panel_linear_rounds_the_float32_product_and_is_the_same_for_every_batch(kernels, n,
                                                                                  k, bias,
                                                                                  product):
    """The AVX2 or AVX-512 kernel on bf16 panels (16 or 32 columns), with float32 FMAs or
    (AVX-512 BF16) the bf16 dot product: the float32 product of the bf16 operands, rounded
    once to bf16 (within a unit in the last place of the exact product's rounding, where
    float32 sums in another order tip it), and each row's result independent of the rows
    beside it, whatever their number (groups of six rows on AVX2, twelve on AVX-512, partial
    groups, row blocks of 48), and a partial last panel. The dot product takes an even K
    only (the FMA panels any)."""
    if kernels.tile_kind() not in ("avx2", "avx512"):
        pytest.skip("this build's linears are AMX tiles (tested above), not panels")
    dot = product == "dot"
    g = torch.Generator().manual_seed(n + k)
    w = (torch.randn(n, k, generator=g) * 0.05).bfloat16()
    b = torch.randn(n, generator=g).bfloat16() if bias else None
    if dot and not kernels.dot_panels_built():  # AVX2, or AVX-512 without BF16
        with pytest.raises(RuntimeError, match="AVX-512 BF16"):
            kernels.tile_pack(w, dot=True)
        return
    if dot and k % 2:
        with pytest.raises(RuntimeError, match="even K"):
            kernels.tile_pack(w, dot=True)
        return
    panels = kernels.tile_pack(w, dot=dot)
    if dot:  # [panels][pairs of k][32 columns x 2]
        assert panels.shape == ((n + 31) // 32, k // 2, 64)
    else:
        assert panels.shape[2] == (32 if kernels.tile_kind() == "avx512" else 16)
    x = torch.randn(100, k, generator=g).bfloat16()
    full = kernels.tile_linear(x, panels, n, b)
    ref = x.double() @ w.double().T + (b.double() if bias else 0)
    ulp = torch.finfo(torch.bfloat16).eps * ref.abs()  # one unit in the last place, ~
    assert ((full.double() - ref).abs() <= ulp + 1e-6).all()
    assert (full == ref.bfloat16()).float().mean() > 0.98
    for m in (1, 2, 5, 6, 7, 11, 12, 13, 17, 40, 48, 49, 97):
        y = kernels.tile_linear(x[:m], panels, n, b)
        assert y.shape == (m, n) and torch.equal(y, full[:m]), m
    with pytest.raises(RuntimeError, match="does not match"):
        kernels.tile_linear(torch.randn(4, k + 1).bfloat16(), panels, n, None)
    with pytest.raises(RuntimeError, match="bf16"):
        kernels.tile_linear(x.float(), panels, n, None)
    if n > 64:  # whole panels past ``n``: the kernel ran them, writing past the output's rows
        with pytest.raises(RuntimeError, match="does not match"):
            kernels.tile_linear(x[:2], panels, n - 64, None)


@pytest.mark.parametrize("product", ["fma", "dot"])
@pytest.mark.parametrize("k,i,bias", [(1024, 2816, False), (64, 64, True), (130, 96, True)])
def test_fused_gate_up_and_silu_give_the_bits_of_the_two_calls(kernels, k, i, bias, product):
    """tile_linear_silu (the decoder stack's gate/up layer on the AVX-512 panels) gives exactly
    tile_linear followed by silu_and_mul, for every row count; where it cannot fuse (AVX2
    panels, out features not a multiple of 64) it says so."""
    if kernels.tile_kind() not in ("avx2", "avx512"):
        pytest.skip("this build's linears are AMX tiles, not panels")
    g = torch.Generator().manual_seed(k + i)
    w = (torch.randn(2 * i, k, generator=g) * 0.05).bfloat16()
    b = torch.randn(2 * i, generator=g).bfloat16() if bias else None
    if product == "dot" and not kernels.dot_panels_built():  # no such panels to fuse
        with pytest.raises(RuntimeError, match="AVX-512 BF16"):
            kernels.tile_pack(w, dot=True)
        return
    panels = kernels.tile_pack(w, dot=product == "dot")
    x = torch.randn(97, k, generator=g).bfloat16()
    if kernels.tile_kind() == "avx2":
        with pytest.raises(RuntimeError, match="not fused here"):
            kernels.tile_linear_silu(x, panels, 2 * i, b)
        return
    for m in (1, 5, 12, 13, 40, 49, 97):
        gate_up = kernels.tile_linear(x[:m], panels, 2 * i, b)
        ref = torch.empty(m, i, dtype=torch.bfloat16)
        kernels.silu_and_mul(ref, gate_up)
        assert torch.equal(kernels.tile_linear_silu(x[:m], panels, 2 * i, b), ref), m
    odd = kernels.tile_pack(w[:80], dot=product == "dot")
    with pytest.raises(RuntimeError, match="not fused here"):
        kernels.tile_linear_silu(x, odd, 80, None)
