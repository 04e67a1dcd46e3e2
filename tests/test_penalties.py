"""Logit bias, repetition / frequency / presence penalties and min-p: the batched sampler
against a per-token reference, and the engine against a step-by-step transformers loop."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch

from fluidserve.core.scheduler.output import ScheduledChunk
from fluidserve.model.inputs import NO_TOKEN, Penalties, SamplingMetadata, sampling_metadata
from fluidserve.model.sampler import adjust_logits, sample, sample_on_device, to_host
from fluidserve.sampling_params import SamplingParams

V = 40


def reference_adjust(logits: torch.Tensor, p: SamplingParams, prompt, output) -> torch.Tensor:
    """One row, token by token, in float64: allowed tokens, bias, then repetition,
    frequency, presence."""
    x = logits.double().clone()
    if p.allowed_token_ids is not None:
        x[[t for t in range(len(x)) if t not in p.allowed_token_ids]] = float("-inf")
    for t, b in p.logit_bias:
        x[t] += b
    if p.repetition_penalty != 1.0:
        for t in set(prompt) | set(output):
            x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    for t, n in Counter(output).items():
        x[t] -= p.frequency_penalty * n + p.presence_penalty
    return x


def metadata(params: list[SamplingParams], histories: list, seeds=None, index=None,
             rows: dict | None = None) -> SamplingMetadata:
    """As ``prepare_inputs`` builds it from sampling chunks with these (prompt, output)."""
    n = len(params)
    seeds, index = seeds or [0] * n, index or [0] * n
    return sampling_metadata([
        ScheduledChunk(f"r{i}", 0, (1,), (), True, p, seeds[i], index[i], True,
                       penalized=(h[0] if p.repetition_penalty != 1 else (), tuple(h[1]))
                       if p.penalizes else None)
        for i, (p, h) in enumerate(zip(params, histories, strict=True))], rows)


CASES = [
    SamplingParams(temperature=0.0),  # nothing: its row is left alone
    SamplingParams(repetition_penalty=1.7),
    SamplingParams(repetition_penalty=0.6),  # < 1 favours what was seen
    SamplingParams(frequency_penalty=0.9),
    SamplingParams(presence_penalty=-1.5),
    SamplingParams(frequency_penalty=-0.4, presence_penalty=1.1, repetition_penalty=1.3),
    SamplingParams(logit_bias={3: 100.0, 7: -100.0, 39: 2.5}),
    SamplingParams(logit_bias={5: -3.0}, repetition_penalty=2.0, frequency_penalty=2.0,
                   presence_penalty=2.0),
    SamplingParams(allowed_token_ids=[3, 9, 11, 12, 30, 39], logit_bias={9: 3.0, 4: 50.0},
                   frequency_penalty=1.0, repetition_penalty=1.5),  # (4 is not allowed)
]


def histories(seed: int) -> list:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(len(CASES)):
        prompt = torch.randint(0, V, (int(torch.randint(1, 30, (1,), generator=g)),),
                               generator=g).tolist()
        output = torch.randint(0, V, (i * 3,), generator=g).tolist()  # (row 0: no output yet)
        out.append((prompt, output))
    return out


def no_kernels(monkeypatch) -> None:
    """The eager fallback: as where the compiled CPU kernels cannot be built."""
    monkeypatch.setattr("fluidserve.kernels.cpu_ops", lambda *a, **k: None)


@pytest.mark.parametrize("path", ["native", "eager", "dense"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_adjusted_logits_match_the_per_token_reference(seed, path, monkeypatch):
    if path != "native":
        no_kernels(monkeypatch)
    if path == "dense":  # (CUDA's, here on the CPU)
        import fluidserve.model.sampler as sampler

        apply = sampler.apply_penalties
        monkeypatch.setattr(sampler, "apply_penalties",
                            lambda *a, **k: apply(*a, **k, dense=True))
    logits = torch.randn(len(CASES), V, generator=torch.Generator().manual_seed(seed)) * 4
    hist = histories(seed)
    got = adjust_logits(logits, metadata(CASES, hist))
    assert got.dtype == torch.float32 and got.data_ptr() != logits.data_ptr()
    for i, (p, (prompt, output)) in enumerate(zip(CASES, hist, strict=True)):
        want = reference_adjust(logits[i], p, prompt, output)
        torch.testing.assert_close(got[i].double(), want, rtol=1e-6, atol=1e-5)
    assert got[-1].isfinite().sum() == 6  # (only the allowed tokens)
    # bf16 logits come back adjusted in float32, from the same values
    low = adjust_logits(logits.bfloat16(), metadata(CASES, hist))
    for i, (p, (prompt, output)) in enumerate(zip(CASES, hist, strict=True)):
        want = reference_adjust(logits[i].bfloat16().float(), p, prompt, output)
        torch.testing.assert_close(low[i].double(), want, rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("kernels", [True, False], ids=["native-argmax", "eager-argmax"])
def test_a_penalized_pick_is_the_plain_pick_from_the_adjusted_logits(kernels, monkeypatch):
    """Greedy and seeded draws alike: penalties change the logits a row picks from, nothing
    else (the same uniform number, the same filters); the logprobs stay the model's."""
    if not kernels:
        no_kernels(monkeypatch)
    logits = torch.randn(len(CASES), V, generator=torch.Generator().manual_seed(5)) * 3
    hist = histories(5)
    for temperature, top_k in ((0.0, -1), (0.8, -1), (1.3, 12)):
        params = [SamplingParams(temperature=temperature, top_k=top_k, logprobs=2,
                                 presence_penalty=c.presence_penalty,
                                 frequency_penalty=c.frequency_penalty,
                                 repetition_penalty=c.repetition_penalty,
                                 logit_bias=c.logit_bias,
                                 allowed_token_ids=c.allowed_token_ids) for c in CASES]
        seeds, index = list(range(100, 100 + len(CASES))), [len(h[1]) for h in hist]
        got, lps = sample(logits, metadata(params, hist, seeds, index))
        adjusted = torch.stack([reference_adjust(logits[i], p, *hist[i]).float()
                                for i, p in enumerate(params)])
        plain = [SamplingParams(temperature=temperature, top_k=top_k, logprobs=2)] * len(CASES)
        want, raw = sample(adjusted, metadata(plain, hist, seeds, index))
        assert got == want
        model, _ = sample(logits, metadata(plain, hist, seeds, index))
        for (chosen, top), t, row in zip(lps, got, logits.log_softmax(-1), strict=True):
            assert chosen == pytest.approx(float(row[t]), abs=1e-5)
            assert [i for i, _ in top] == row.topk(2).indices.tolist()
    assert got != model  # (the penalties changed some pick)


def test_the_compiled_penalties_are_the_eager_ones_bit_for_bit(monkeypatch):
    """Many rows of a large vocabulary, long histories full of repeats, ids outside the
    vocabulary and tokens in flight: the same float32 numbers on both paths."""
    from fluidserve.kernels import cpu_ops
    from fluidserve.model.sampler import apply_penalties

    if cpu_ops() is None:
        pytest.skip("the compiled CPU kernels are not built on this machine")
    g = torch.Generator().manual_seed(11)
    vocab, rows = 5000, 24
    params = [SamplingParams(repetition_penalty=[1.0, 1.3, 0.7][i % 3],
                             frequency_penalty=[0.0, 0.6, -1.2, 2.0][i % 4],
                             presence_penalty=[0.4, 0.0, -2.0][i % 3] if i % 5 else 0.0)
              for i in range(rows)]
    hist = []
    for i in range(rows):
        prompt = torch.randint(0, 60 if i % 2 else vocab, (200 + i,), generator=g).tolist()
        output = torch.randint(0, 50, (3 * i,), generator=g).tolist()
        if i % 4 == 1:
            output[-1:] = [-1]  # in flight
        if i % 6 == 2:
            output += [vocab + 7, NO_TOKEN]  # outside the vocabulary: counts nowhere
        hist.append((prompt, output))
    pen = metadata([p if p.penalizes else SamplingParams(frequency_penalty=0.1)
                    for p in params], hist, rows={f"r{i}": i for i in range(rows)}).penalties
    logits = torch.randn(rows + 3, vocab, generator=g) * 5
    last = torch.randint(0, vocab, (rows,), generator=g)
    native = logits.clone()
    apply_penalties(native, pen, last)
    assert not torch.equal(native, logits)
    no_kernels(monkeypatch)
    for dense in (False, True):  # (the eager CPU path, CUDA's)
        eager = logits.clone()
        apply_penalties(eager, pen, last, dense=dense)
        assert torch.equal(native, eager), dense


def test_min_p_keeps_the_tokens_at_least_min_p_times_as_likely_as_the_best():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0, -1.0]])
    probs = (logits / 0.7).softmax(-1)[0]
    for min_p in (0.05, 0.2, 0.5, 1.0):
        keep = {i for i in range(6) if probs[i] >= min_p * probs.max()}
        p = SamplingParams(temperature=0.7, min_p=min_p)
        drawn = {sample(logits, metadata([p], [((), ())], [s]))[0][0] for s in range(400)}
        assert drawn == keep, min_p
    # min_p 0 filters nothing; a greedy row ignores it
    p = SamplingParams(temperature=4.0, min_p=0.0)
    assert {sample(logits, metadata([p], [((), ())], [s]))[0][0] for s in range(400)} \
        == set(range(6))
    assert sample(logits, metadata([SamplingParams(temperature=0.0, min_p=0.9)],
                                   [((), ())]))[0] == [0]


def test_a_token_still_in_flight_is_counted_from_the_last_step():
    """With asynchronous scheduling a request's last output token may be a placeholder: it is
    read on the device from the previous step's sampled tokens, as the inputs' are."""
    p = SamplingParams(temperature=0.0, frequency_penalty=2.0)
    logits = torch.zeros(2, V)
    logits[:, 9] = 3.0  # 9 wins unless penalized twice
    logits[:, 4] = 0.5
    hist = [((), [9, 9]), ((), [9, -1])]  # row 1: its second 9 is in flight
    # (row 1 of the request in the last step: its token is row 1 of last_tokens)
    meta = metadata([p, p], hist, rows={"r1": 1})
    assert meta.penalties.output[1].tolist() == [9, -2]
    last = torch.tensor([0, 9, 0])
    tokens, _ = to_host(sample_on_device(logits, meta, last))
    assert tokens == [4, 4]
    last = torch.tensor([0, 5, 0])  # the token in flight was 5, not 9: 9 is penalized once
    tokens, _ = to_host(sample_on_device(logits, metadata([p, p], hist, rows={"r1": 1}), last))
    assert tokens == [4, 9]


def test_penalty_arrays_pad_outside_every_vocabulary():
    chunks = [ScheduledChunk("a", 0, (1,), (), True, SamplingParams(frequency_penalty=1),
                             0, 2, True, penalized=((), (3, 4))),
              ScheduledChunk("b", 0, (1,), (), True, SamplingParams(), 0, 0, True),
              ScheduledChunk("c", 0, (1,), (), True, SamplingParams(repetition_penalty=2),
                             0, 0, True, penalized=([5, 6, 7], ()))]
    pen = Penalties.build(chunks, None)
    assert pen.rows == [0, 2]
    assert pen.output.tolist() == [[3, 4], [NO_TOKEN, NO_TOKEN]]
    assert pen.prompt.tolist() == [[NO_TOKEN] * 3, [5, 6, 7]]
    assert pen.output.dtype == np.int64 and pen.repetition == [1.0, 2.0]


@pytest.mark.parametrize("kw,says", [
    ({"presence_penalty": 2.5}, "presence_penalty must be in"),
    ({"frequency_penalty": float("nan")}, "frequency_penalty must be in"),
    ({"repetition_penalty": 0.0}, "repetition_penalty must be in"),
    ({"repetition_penalty": 1e-40}, "repetition_penalty must be in"),  # (0 in float32)
    ({"repetition_penalty": float("inf")}, "repetition_penalty must be in"),
    ({"min_p": 1.01}, "min_p must be in"),
    ({"logit_bias": {3: 100.5}}, "logit_bias must map"),
    ({"logit_bias": {-1: 1.0}}, "logit_bias must map"),
])
def test_out_of_range_values_are_refused(kw, says):
    with pytest.raises(ValueError, match=says):
        SamplingParams(**kw)


def test_equal_biases_compare_equal_and_neutral_values_penalize_nothing():
    assert SamplingParams(logit_bias={7: 1, 3: 2}) == SamplingParams(logit_bias=[(3, 2.0),
                                                                                (7, 1.0)])
    neutral = SamplingParams(presence_penalty=0, frequency_penalty=0.0, repetition_penalty=1,
                             min_p=0)
    assert not neutral.penalizes and not neutral.adjusts_logits
    assert SamplingParams(min_p=0.1).adjusts_logits and not SamplingParams(min_p=0.1).penalizes


# ---------------------------------------------------------------------------- the engine
ENGINE_CASES = [
    SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True),
    SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True, repetition_penalty=1.8),
    SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True, frequency_penalty=1.5,
                   presence_penalty=0.7),
    SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True, frequency_penalty=-2.0),
    SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True, repetition_penalty=0.5,
                   presence_penalty=-1.0, logit_bias={17: 4.0, 23: 6.0, 9: -100.0}),
]
ENGINE_PROMPTS = [[1, 5, 9, 9, 30, 41, 7, 7, 7, 12, 60, 33, 9, 2, 18, 18, 5, 90, 4, 11, 3, 9],
                  [1, 40, 41, 42, 40, 41, 42, 9], [1, 8], [1, 77, 3, 77, 3, 77, 3, 77],
                  [1, 9, 17, 23, 100, 17, 5, 6, 7, 8, 9, 10, 11, 12]]


def transformers_reference(model_dir, prompts, params) -> list[list[int]]:
    """Greedy, one token at a time over the whole sequence, the logits adjusted by
    ``reference_adjust``."""
    import transformers as tf

    model = tf.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    outs = []
    for prompt, p in zip(prompts, params, strict=True):
        out: list[int] = []
        with torch.no_grad():
            for _ in range(p.max_tokens):
                logits = model(torch.tensor([prompt + out])).logits[0, -1]
                out.append(int(reference_adjust(logits, p, prompt, out).argmax()))
        outs.append(out)
    return outs


def test_penalized_greedy_outputs_match_transformers_step_by_step(hf_models):
    """Chunked prefills (a 6-token budget), decodes and plain requests in the same batches;
    each penalized request counts its own prompt and output only."""
    from fluidserve.engine.llm import LLM

    model = hf_models["llama"]
    plain = SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True)
    # A prompt of what the model says next: only the prompt's share of a repetition penalty
    # keeps it from saying it again.
    echo = [1, 8] + transformers_reference(model, [[1, 8]], [plain])[0][:8]
    prompts = ENGINE_PROMPTS + [echo]
    cases = ENGINE_CASES + [ENGINE_CASES[1]]
    want = transformers_reference(model, prompts, cases)
    assert len({tuple(w) for w in want}) == len(want)
    llm = LLM(model=str(model), token_budget=6, block_size=16)
    got = [o.token_ids for o in llm.generate(prompts, cases)]
    assert got == want
    unpenalized = [o.token_ids for o in llm.generate(prompts, [plain] * len(want))]
    assert unpenalized[0] == got[0] and all(u != g for u, g in zip(unpenalized[1:], got[1:],
                                                                    strict=True))


def mixed_params() -> list[SamplingParams]:
    """Penalized greedy and seeded rows (min-p and top-k among them), and a plain one."""
    base = dict(max_tokens=12, ignore_eos=True)
    return [SamplingParams(**base, temperature=0.0, repetition_penalty=1.5, logit_bias={5: 3}),
            SamplingParams(**base, temperature=0.9, seed=3, frequency_penalty=1.0, min_p=0.05),
            SamplingParams(**base, temperature=0.0),
            SamplingParams(**base, temperature=1.1, seed=4, top_k=40, presence_penalty=1.5,
                           repetition_penalty=1.2),
            SamplingParams(**base, temperature=0.0, frequency_penalty=-1.0, presence_penalty=2)]


@pytest.fixture(scope="module")
def mixed_reference(tiny_model_dir):
    from fluidserve.engine.llm import LLM

    llm = LLM(model=str(tiny_model_dir), token_budget=4096)
    return [o.token_ids for o in llm.generate(ENGINE_PROMPTS, mixed_params())]


@pytest.mark.parametrize("setup", ["chunked", "preempted", "async", "pipeline"])
def test_penalties_hold_across_chunking_preemption_async_scheduling_and_pipelines(
        tiny_model_dir, mixed_reference, setup):
    """A penalty counts the tokens of the request as they are, whatever happened to it: its
    prompt chunked, its blocks dropped and recomputed, its last token still in flight on the
    device (asynchronous scheduling), its batch on another process (the last pipeline stage
    samples it)."""
    from fluidserve.engine.llm import LLM

    kw = {"chunked": dict(token_budget=5, block_size=8),
          "preempted": dict(token_budget=32, block_size=8, num_kv_blocks=7),
          "async": dict(token_budget=7, async_scheduling=True),
          "pipeline": dict(token_budget=9, pipeline_parallel_size=2, num_threads=1)}[setup]
    with LLM(model=str(tiny_model_dir), **kw) as llm:
        got = [o.token_ids for o in llm.generate(ENGINE_PROMPTS, mixed_params())]
        if setup == "preempted":
            assert llm.engine.scheduler.num_preemptions > 0
    assert got == mixed_reference


def test_allowed_tokens_hold_for_every_row_of_a_batch_and_for_some():
    """Each row's mask is made once (per vocabulary size) and reused; a batch whose rows
    all allow tokens masks in place, one with some rows copies those."""
    logits = torch.arange(12.0).repeat(3, 1)  # 11 is every row's best
    a, b = SamplingParams(temperature=0.0, allowed_token_ids=[2, 5]), \
        SamplingParams(temperature=0.0, allowed_token_ids=[7, 30])  # (30: past the vocab)
    for rows in ([a, b, a], [a, SamplingParams(temperature=0.0), b]):
        tokens, _ = sample(logits, metadata(rows, [((), ())] * 3))
        want = {id(a): 5, id(b): 7}
        assert tokens == [want.get(id(p), 11) for p in rows]
    assert a.allowed_mask(12) is a.allowed_mask(12) and a.allowed_mask(12).sum() == 2


def test_the_output_array_follows_every_change_at_the_end_of_the_output():
    """A penalty reads the output as a machine array, converted a few tokens a step: what
    asynchronous scheduling does to the output's end (placeholders appended, written in,
    dropped) is followed."""
    from fluidserve.core.scheduler.base import PLACEHOLDER
    from fluidserve.request import Request

    req = Request("r", [1, 2], SamplingParams(), 0.0)
    out = req.output_token_ids
    steps = [lambda: out.append(5), lambda: out.append(PLACEHOLDER),
             lambda: out.append(PLACEHOLDER), lambda: out.__setitem__(-2, 7),
             lambda: out.append(PLACEHOLDER), lambda: out.__setitem__(-2, 9),
             lambda: (out.pop(), out.pop()), lambda: out.extend([3, 4, 4])]
    for step in steps:
        step()
        got = req.output_array()
        assert list(got) == out and got is not req.output_array()  # (each read a copy)
