"""The batched sampler: right distribution, filters, seeds, independence from the batch."""

from __future__ import annotations

import math

import pytest
import torch

from fluidserve.model.inputs import SamplingMetadata
from fluidserve.model.sampler import filter_threshold, uniform
from fluidserve.model.sampler import sample as sample_meta
from fluidserve.sampling_params import SamplingParams


def chunk(params: SamplingParams, seed: int, index: int = 0) -> tuple:
    return params, seed, index


def sample(logits, rows):
    """Sample with one (params, seed, output index) per row."""
    p = [r[0] for r in rows]
    meta = SamplingMetadata([f"r{i}" for i in range(len(rows))], [x.temperature for x in p],
                            [x.top_k for x in p], [x.top_p for x in p], [r[1] for r in rows],
                            [r[2] for r in rows], [x.logprobs for x in p])
    return sample_meta(logits, meta)


def test_frequencies_follow_softmax_of_logits_over_temperature():
    logits = torch.tensor([2.0, 1.0, 0.5, -1.0, 0.0])
    p = SamplingParams(temperature=0.7)
    n = 20000
    tokens, _ = sample(logits.repeat(n, 1), [chunk(p, seed) for seed in range(n)])
    counts = torch.bincount(torch.tensor(tokens), minlength=5).double()
    expected = torch.softmax(logits / 0.7, -1).double() * n
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 20.5  # 4 degrees of freedom: p = 0.0004


def reference_kept(logits: torch.Tensor, top_k: int, top_p: float) -> int:
    """How many of the best tokens top-k / top-p keep (vLLM's rule): top-k keeps the k best;
    of those, tokens are taken in order of probability, renormalized over the k, while the
    mass already taken is below top_p."""
    best = torch.sort(logits.double(), descending=True).values
    if top_k > 0:
        best = best[:top_k]
    if top_p >= 1:
        return len(best)
    probs = best.softmax(-1)
    keep = 1
    while keep < len(probs) and float(probs[:keep].sum()) < top_p:
        keep += 1
    return keep


def test_top_k_and_top_p_keep_exactly_the_reference_sets():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 50, generator=g) * 3
    top_k = torch.randint(0, 12, (64,), generator=g)  # 0: no top-k
    top_p = torch.rand(64, generator=g).clamp(min=0.05)
    threshold = filter_threshold(logits, top_k, top_p)
    for row in range(64):
        order = torch.sort(logits[row], descending=True).values
        keep = reference_kept(logits[row], int(top_k[row]), float(top_p[row]))
        assert float(threshold[row]) == float(order[keep - 1]), row


def test_filters_off_keep_every_token_of_a_large_vocabulary():
    """top_p = 1 and top_k = -1 keep all 128k tokens (a float32 running sum reaches 1 long
    before the end: the tail was dropped, so a row's draw changed when another row of its
    batch asked for a filter and the filter ran for every row)."""
    logits = torch.randn(2, 128256, generator=torch.Generator().manual_seed(0)) * 3
    threshold = filter_threshold(logits, torch.tensor([-1, 5]), torch.tensor([1.0, 1.0]))
    assert float(threshold[0]) == float(logits[0].min())
    assert float(threshold[1]) == float(torch.sort(logits[1], descending=True).values[4])


def test_top_p_takes_the_mass_top_k_left():
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.1]]))
    # top-k 2 leaves 0.4 / 0.3, renormalized 0.57 / 0.43: top-p 0.5 keeps one token (over
    # the whole distribution 0.4 < 0.5 would have kept two).
    threshold = filter_threshold(logits, torch.tensor([2]), torch.tensor([0.5]))
    assert float(threshold[0]) == float(logits[0, 0])


def test_sampled_tokens_respect_the_filters():
    logits = torch.linspace(0, 3, 40).repeat(500, 1)
    chunks = [chunk(SamplingParams(temperature=1.5, top_k=3), s) for s in range(250)]
    chunks += [chunk(SamplingParams(temperature=1.5, top_p=0.2), s) for s in range(250)]
    tokens, _ = sample(logits, chunks)
    assert set(tokens[:250]) == {37, 38, 39}
    kept = reference_kept(logits[0] / 1.5, -1, 0.2)
    assert set(tokens[250:]) == set(range(40 - kept, 40))


def test_a_rows_token_does_not_depend_on_its_batch():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(9, 300, generator=g)
    params = [SamplingParams(temperature=t, top_p=tp, top_k=k)
              for t, tp, k in [(0.5, 1.0, -1), (1.0, 0.9, -1), (2.0, 1.0, 20), (0.0, 1.0, -1)] * 2
              + [(1.0, 0.5, 5)]]
    chunks = [chunk(p, seed=100 + i, index=i) for i, p in enumerate(params)]
    together, _ = sample(logits, chunks)
    alone = [sample(logits[i : i + 1], [c])[0][0] for i, c in enumerate(chunks)]
    assert together == alone
    reversed_, _ = sample(logits.flip(0), chunks[::-1])
    assert reversed_[::-1] == together


def test_greedy_takes_the_lowest_id_among_ties_and_bf16_logits_work():
    logits = torch.tensor([[0.0, 3.0, 3.0, 1.0], [5.0, 5.0, 5.0, 5.0]], dtype=torch.bfloat16)
    tokens, _ = sample(logits, [chunk(SamplingParams(temperature=0.0), 0)] * 2)
    assert tokens == [1, 0]


def test_seed_and_index_change_the_uniform():
    us = {uniform(s, i) for s in range(50) for i in range(50)}
    assert len(us) == 2500 and all(0 < u < 1 for u in us)
    assert uniform(1, 2) == uniform(1, 2)


@pytest.mark.parametrize("k", [0, 3])
def test_logprobs_are_normalized_and_include_the_chosen_token(k):
    logits = torch.tensor([[1.0, 2.0, 0.5, -3.0]])
    p = SamplingParams(temperature=0.0, logprobs=k)
    tokens, lps = sample(logits, [chunk(p, 0)])
    chosen, top = lps[0]
    ref = torch.log_softmax(logits[0], -1)
    assert tokens == [1] and math.isclose(chosen, float(ref[1]), rel_tol=1e-6)
    assert [t for t, _ in top] == [1, 0, 2][:k]
    assert all(math.isclose(v, float(ref[t]), rel_tol=1e-6) for t, v in top)


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
def test_sampling_on_the_device_waits_for_nothing_and_reads_back_as_sample(device):
    """A mixed batch (greedy, temperature, top-k, top-p, logprobs) queued by
    sample_on_device reads back as sample() returns it; on CUDA, torch's sync debug mode
    checks that queueing it (and the copy to pinned memory) never waits for the device: with
    asynchronous scheduling the next step is launched behind it."""
    from fluidserve.model.sampler import sample_on_device, to_host

    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0)).to(device)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8),
              SamplingParams(temperature=1.0, top_k=5), SamplingParams(top_p=0.5),
              SamplingParams(temperature=0.0, logprobs=3),
              SamplingParams(temperature=1.0, logprobs=2)]
    meta = SamplingMetadata([f"r{i}" for i in range(6)], [p.temperature for p in params],
                            [p.top_k for p in params], [p.top_p for p in params],
                            list(range(6)), [4] * 6, [p.logprobs for p in params])
    want_tokens, want_lps = sample_meta(logits, meta)
    cuda = device == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
    try:
        queued = sample_on_device(logits, meta)
        queued = queued.copy_to_host() if cuda else queued
    finally:
        if cuda:
            torch.cuda.set_sync_debug_mode(0)
            torch.cuda.synchronize()
    tokens, lps = to_host(queued)
    assert tokens == want_tokens
    assert [lp is None for lp in lps] == [k is None for k in meta.logprobs]
    for got, want in zip(lps, want_lps, strict=True):
        if want is not None:
            assert got[0] == pytest.approx(want[0]) and got[1] == want[1]


@pytest.mark.parametrize("kernels", [True, False], ids=["native-argmax", "eager-argmax"])
def test_banned_tokens_are_never_sampled_and_leave_logprobs_alone(kernels, monkeypatch):
    if not kernels:  # the eager fallback of the greedy pick
        monkeypatch.setattr("fluidserve.kernels.cpu_ops", lambda *a, **k: None)
    # Row 0 greedy, row 1 sampled, both with the best token (3) banned; row 2 bans nothing.
    logits = torch.tensor([[0.0, 1.0, 2.0, 9.0, -1.0]]).repeat(3, 1)
    greedy = SamplingParams(temperature=0.0, logprobs=1)
    hot = SamplingParams(temperature=5.0)
    meta = SamplingMetadata(["a", "b", "c"], [0.0, 5.0, 0.0], [-1] * 3, [1.0] * 3, [0, 1, 2],
                            [0] * 3, [greedy.logprobs, hot.logprobs, None],
                            [(3, 99999, -1), (3, 2), ()])  # ids outside the vocab ban nothing
    tokens, lps = sample_meta(logits.clone(), meta)
    assert tokens[0] == 2 and tokens[2] == 3
    chosen, top = lps[0]
    # The logprobs are the model's: the banned token is still its most likely.
    assert top[0][0] == 3 and chosen == pytest.approx(float(logits[0].log_softmax(-1)[2]))
    draws = [sample_meta(logits.clone(), SamplingMetadata(
        ["b"], [5.0], [-1], [1.0], [seed], [0], [None], [(3, 2)]))[0][0] for seed in range(300)]
    assert set(draws) == {0, 1, 4}


def test_a_temperature_too_small_for_float32_is_greedy():
    # 1e-39 rounds to 0 in float32: dividing by it gave infinities and a meaningless token.
    assert SamplingParams(temperature=1e-39).temperature == 0.0
    assert SamplingParams(temperature=1e-5).temperature == 1e-5
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0]])
    p = SamplingParams(temperature=1e-39)
    assert sample(logits, [chunk(p, s) for s in range(1)])[0] == [1]
