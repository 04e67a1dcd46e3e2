"""Attention test cases shared by the CPU and Triton kernel tests: a flattened hybrid batch of
decodes and prefill chunks over a scattered paged cache, and the float32 SDPA reference."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fluidserve.model import attention as A

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


def batch(h, hkv, d, bs, dtype, seed=0, lengths=RUNS, num_blocks=200):
    """q, k, v of a flattened batch of runs (query tokens, context) over a scattered cache."""
    g = torch.Generator().manual_seed(seed)
    nb = num_blocks
    k_cache, v_cache = A.new_kv_cache(nb, bs, hkv, d, dtype, torch.device("cpu"))
    k_cache.copy_(torch.randn(k_cache.shape, generator=g))
    v_cache.copy_(torch.randn(v_cache.shape, generator=g))
    perm = torch.randperm(nb, generator=g).tolist()
    runs, tables, slots, q0 = [], [], [], 0
    for n, ctx in lengths:
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


def check_elementwise_ops(ops, dtype, exact_norm: bool, device: str = "cpu") -> None:
    """RMSNorm (plain and fused with the residual add), RoPE and SiLU-and-mul of a kernel
    module against the eager layers. ``exact_norm``: bf16 norms must be bit-equal (a kernel
    that sums in the reference's order); else within 1% (about one bf16 step)."""
    from fluidserve.model.arch import parse_arch
    from fluidserve.model.llama import RMSNorm, Rotary, apply_rope

    g = torch.Generator().manual_seed(5)
    # 200 = three 64-wide steps, one 16-wide step and a scalar tail; 37 rows span threads.
    x = torch.randn(37, 200, generator=g).to(dtype)
    res = torch.randn(37, 200, generator=g).to(dtype)
    norm = RMSNorm(200, 1e-5)
    norm.weight.data = (torch.rand(200, generator=g) + 0.5).to(dtype)
    if dtype == torch.float32:
        tol = dict(atol=1e-6, rtol=1e-6)
    else:
        tol = dict(atol=0, rtol=0) if exact_norm else dict(atol=1e-2, rtol=1e-2)
    x, res, norm = x.to(device), res.to(device), norm.to(device)
    with torch.no_grad():
        torch.testing.assert_close(norm.native(x, ops), norm(x), **tol)
        h, r = norm.add_native(x.clone(), res.clone(), ops)
        torch.testing.assert_close(r, res + x, atol=0, rtol=0)
        torch.testing.assert_close(h, norm(res + x), **tol)
        # RoPE in place on views of a fused QKV row (H=6, Hkv=2, D=32), positions out of order.
        cfg = parse_arch({"architectures": ["LlamaForCausalLM"], "vocab_size": 10,
                          "hidden_size": 192, "intermediate_size": 10, "num_hidden_layers": 1,
                          "num_attention_heads": 6, "num_key_value_heads": 2})
        rot = Rotary(cfg, 64).to(device)
        qkv = torch.randn(5, (6 + 2 + 2) * 32, generator=g).to(dtype).to(device)
        pos = torch.tensor([3, 0, 63, 17, 5], device=device)
        q, k = qkv[:, :192].view(5, 6, 32), qkv[:, 192:256].view(5, 2, 32)
        cos, sin = rot(pos)
        want_q, want_k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        ops.rope(q, k, pos, rot.cos, rot.sin)
        close = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-2,
                                                                               rtol=1e-2)
        torch.testing.assert_close(q, want_q, **close)
        torch.testing.assert_close(k, want_k, **close)
        gu = torch.randn(6, 2 * 40, generator=g).to(dtype) * 3
        gu[0, :4] = torch.tensor([-120.0, -90.0, 90.0, 120.0])  # exp under- and overflow
        gu = gu.to(device)
        out = gu.new_empty(6, 40)
        ops.silu_and_mul(out, gu)
        gate, up = gu.chunk(2, dim=-1)
        torch.testing.assert_close(out, F.silu(gate) * up, **close)


def record_results(monkeypatch, cls, name: str) -> list[bool]:
    """Wrap method ``name`` of ``cls``; the list records, call by call, whether it returned
    something other than None."""
    calls: list[bool] = []
    real = getattr(cls, name)

    def spy(self, *args):
        out = real(self, *args)
        calls.append(out is not None)
        return out

    monkeypatch.setattr(cls, name, spy)
    return calls


def check_last_layer_on_sampled_rows(make_executor, monkeypatch, atol: float, rtol: float
                                     ) -> None:
    """Steps whose last decoder layer computes past its keys and values only for the rows
    they sample (``llama.SAMPLED_ROWS_ONLY``) give the logits of steps that compute every row,
    now and in the steps after (which read the keys and values that layer wrote): batches that
    sample none of their rows, some, all (left whole), and a padded one of 100+ rows."""
    from fluidserve.core.scheduler.output import ScheduledChunk, SchedulerOutput
    from fluidserve.model import llama
    from fluidserve.sampling_params import SamplingParams

    pruned, full = make_executor(), make_executor()
    vocab = full.arch.vocab_size
    g = torch.Generator().manual_seed(0)
    ids = {r: torch.randint(3, vocab, (120,), generator=g).tolist() for r in "abcd"}
    tables = {"a": (3, 9, 4, 11, 12), "b": (13, 1, 7, 20), "c": (21, 30, 25),
              "d": (40, 41, 50, 43, 44, 60, 46, 47)}

    def chunk(r: str, start: int, n: int, samples: bool = True) -> ScheduledChunk:
        return ScheduledChunk(r, start, tuple(ids[r][start:start + n]), tables[r], samples,
                              SamplingParams(temperature=0.0), 0, 0,
                              is_decode=n == 1 and start > 0)

    plans = [([chunk("a", 0, 40, samples=False)], True),  # nothing sampled: keys, values only
             ([chunk("a", 40, 30), chunk("b", 0, 20, samples=False)], True),
             ([chunk("a", 70, 1), chunk("b", 20, 40), chunk("c", 0, 5)], True),
             ([chunk("a", 71, 1), chunk("b", 60, 1), chunk("c", 5, 1)], False),  # all sampled
             ([chunk("d", 0, 100), chunk("a", 72, 1), chunk("c", 6, 1)], True),  # 102 rows
             ([chunk("a", 73, 1), chunk("b", 61, 1), chunk("c", 7, 1), chunk("d", 100, 1)],
              False)]
    took = record_results(monkeypatch, llama.LlamaForCausalLM, "_sampled_rows")
    with torch.inference_mode():
        for i, (plan, _) in enumerate(plans):
            monkeypatch.setattr(llama, "SAMPLED_ROWS_ONLY", False)
            want = full.logits(SchedulerOutput(i, plan))
            monkeypatch.setattr(llama, "SAMPLED_ROWS_ONLY", True)
            got = pruned.logits(SchedulerOutput(i, plan))
            assert got.shape == want.shape == (sum(c.samples for c in plan), vocab)
            torch.testing.assert_close(got, want, atol=atol, rtol=rtol, msg=f"step {i}")
            assert torch.equal(got.argmax(-1), want.argmax(-1)), f"step {i}"
    assert took == [x for _, p in plans for x in (False, p)]
