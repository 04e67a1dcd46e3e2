"""Prompt logprobs (``SamplingParams.prompt_logprobs``, the completions API's ``echo`` with
``logprobs``): every prompt token's logprob given the ones before it, against transformers."""

from __future__ import annotations

import pytest
import torch

from fluidserve.engine.llm import LLM
from fluidserve.sampling_params import SamplingParams

PROMPTS = [[1, 5, 9, 9, 30, 41, 7, 7, 7, 12, 60, 33, 9, 2, 18, 18, 5, 90, 4, 11, 3, 9],
           [1, 8], [1], [1, 77, 3, 77, 3, 77, 3, 77, 100, 200, 300, 5]]
K = 3


def params(k: int | None = K, max_tokens: int = 3) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                          prompt_logprobs=k)


def transformers_prompt_logprobs(model_dir, prompts) -> list[torch.Tensor]:
    import transformers as tf

    model = tf.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return [model(torch.tensor([p])).logits[0].float().log_softmax(-1) for p in prompts]


def assert_prompt_logprobs(got: list, prompt: list[int], want: torch.Tensor, k: int = K):
    assert len(got) == len(prompt) - 1
    for i, (chosen, top, rank) in enumerate(got):
        row = want[i]
        assert chosen == pytest.approx(float(row[prompt[i + 1]]), abs=2e-4), i
        target = row[prompt[i + 1]]  # (the rank: 1 + the tokens more likely, near-ties aside)
        assert int((row > target + 1e-4).sum()) < rank <= int((row > target - 1e-4).sum()) + 1
        assert [t for t, _ in top] == row.topk(k).indices.tolist(), i
        assert [v for _, v in top] == pytest.approx(row.topk(k).values.tolist(), abs=2e-4)


@pytest.fixture(scope="module")
def want(hf_models):
    return transformers_prompt_logprobs(hf_models["llama"], PROMPTS)


@pytest.mark.parametrize("setup", ["chunked", "whole", "eager", "prefix-cached", "preempted"])
def test_prompt_logprobs_match_transformers(hf_models, want, setup):
    """Chunks of 5 tokens (a chunk's last position predicts the next chunk's first token),
    whole prompts, the eager reference, a prefix cache that holds the prompts already (the
    logprobs are computed anyway) and a cache so small that requests are preempted."""
    kw = {"chunked": dict(token_budget=5), "whole": dict(token_budget=512),
          "eager": dict(token_budget=7, attention_backend="eager", linear_backend="eager"),
          "prefix-cached": dict(token_budget=5, block_size=8, enable_prefix_caching=True),
          "preempted": dict(token_budget=6, block_size=8, num_kv_blocks=6)}[setup]
    llm = LLM(model=str(hf_models["llama"]), **kw)
    n = 12 if setup == "preempted" else 3  # (decodes that outgrow the cache)
    plain = llm.generate(PROMPTS, params(None, n))
    if setup == "prefix-cached":  # (the cache now holds every prompt's full blocks)
        assert llm.generate(PROMPTS, params(None, 1))[0].num_cached_tokens > 0
    preempted = llm.engine.scheduler.num_preemptions
    outs = llm.generate(PROMPTS, params(K, n))
    for out, ref, prompt, w in zip(outs, plain, PROMPTS, want, strict=True):
        assert out.token_ids == ref.token_ids  # sampling is what it was
        assert_prompt_logprobs(out.prompt_logprobs, prompt, w)
        assert ref.prompt_logprobs is None
    if setup == "preempted":
        assert llm.engine.scheduler.num_preemptions > preempted
    if setup == "prefix-cached":
        assert all(o.num_cached_tokens == 0 for o in outs)


@pytest.mark.parametrize("setup", ["async", "pipeline"])
def test_prompt_logprobs_across_async_scheduling_and_pipeline_stages(hf_models, want, setup):
    kw = {"async": dict(token_budget=7, async_scheduling=True),
          "pipeline": dict(token_budget=9, pipeline_parallel_size=2, num_threads=1)}[setup]
    with LLM(model=str(hf_models["llama"]), **kw) as llm:
        outs = llm.generate(PROMPTS, [params(k) for k in (K, K, K, 0)])
    for out, prompt, w in zip(outs[:3], PROMPTS[:3], want[:3], strict=True):
        assert_prompt_logprobs(out.prompt_logprobs, prompt, w)
    assert_prompt_logprobs(outs[3].prompt_logprobs, PROMPTS[3], want[3], k=0)


def test_prompt_logprobs_leave_the_other_requests_of_a_batch_alone(hf_models):
    """Rows of prompt logprobs beside sampled rows: every request's tokens, and the sampled
    rows' own logprobs, are what they are without them."""
    llm = LLM(model=str(hf_models["llama"]), token_budget=16)
    mixed = [params(), SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True,
                                      logprobs=2), params(1), SamplingParams(max_tokens=4)]
    alone = [SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True),
             SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=2),
             SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True),
             SamplingParams(max_tokens=4)]
    seeded = [p if p.temperature == 0 else SamplingParams(max_tokens=4, seed=7)
              for p in mixed]
    together = llm.generate(PROMPTS, seeded)
    apart = [llm.generate([p], [a if a.temperature == 0 else SamplingParams(max_tokens=4,
                                                                            seed=7)])[0]
             for p, a in zip(PROMPTS, alone, strict=True)]
    for t, a in zip(together, apart, strict=True):
        assert t.token_ids == a.token_ids
    for x, y in zip(together[1].logprobs, apart[1].logprobs, strict=True):
        assert x[0] == pytest.approx(y[0], abs=1e-5)
        assert [t for t, _ in x[1]] == [t for t, _ in y[1]]
    assert len(together[0].prompt_logprobs) == len(PROMPTS[0]) - 1
    assert together[1].prompt_logprobs is None


def test_out_of_range_prompt_logprobs_are_refused():
    with pytest.raises(ValueError, match="prompt_logprobs must be in"):
        SamplingParams(prompt_logprobs=21)
