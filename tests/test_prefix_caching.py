"""Prefix caching: full KV blocks outlive their requests and start the next request whose
tokens begin alike. Outputs must be the uncached engine's, token for token, whatever the
policy, budget, preemption or asynchronous scheduling; nothing may leak."""

from __future__ import annotations

import json

import httpx
import pytest

from fluidserve.config import SCHEDULERS, ConfigError, EngineConfig
from fluidserve.core.block_manager import PrefixCachingBlockManager
from fluidserve.core.scheduler import RunnerOutput, SchedulerLimits, make_scheduler
from fluidserve.engine.llm import LLM
from fluidserve.request import Request
from fluidserve.sampling_params import SamplingParams
from tests.test_engine import PROMPTS, greedy

from .server_utils import InProcessServer, metric_values

SYSTEM = ("You are a careful assistant. Answer in plain words, check every number twice, and"
          " say so when you do not know. Keep answers short.\n")
SHARED = [SYSTEM + p for p in PROMPTS]
GREEDY = [greedy(i) for i in range(len(PROMPTS))]


def test_a_prefix_is_found_by_its_tokens_and_every_block_before():
    bm = PrefixCachingBlockManager(num_blocks=8, block_size=2)
    a = [1, 2, 3, 4, 5]
    assert bm.match(a) == [] and bm.can_admit("a", len(a), [])
    bm.adopt("a", [], len(a))
    bm.allocate("a", 5)
    bm.commit("a", 5, lambda s, e: a[s:e])  # blocks [1, 2] and [3, 4]: full, registered
    first = bm.table("a")
    assert bm.match([1, 2, 3, 4, 9]) == list(first[:2])
    assert bm.match([1, 2, 3, 9, 9]) == [first[0]]
    assert bm.match([7, 7, 3, 4, 9]) == []  # [3, 4] after another block is another prefix
    assert bm.match([1, 2, 3, 4]) == [first[0]]  # the last token is always computed
    bm.free("a")
    assert bm.num_free_blocks == 8 and bm.usage == 0.0
    bm.check_invariants()
    # A new request starts with the cached blocks; reviving them takes from the free count.
    prefix = bm.match([1, 2, 3, 4, 6, 6])
    bm.adopt("b", prefix, 6)
    assert bm.allocate("b", 6) and bm.table("b")[:2] == first[:2]
    assert bm.num_free_blocks == 5 and (bm.queries, bm.hits) == (11, 4)
    bm.check_invariants({"b": 4})


def test_cached_blocks_are_reused_last_when_memory_runs_out_tail_first():
    bm = PrefixCachingBlockManager(num_blocks=4, block_size=1)
    tokens = [1, 2, 3]
    bm.allocate("a", 3)
    bm.commit("a", 3, lambda s, e: tokens[s:e])
    head, mid, tail = bm.table("a")
    bm.free("a")
    assert bm.allocate("x", 1) and bm.table("x") not in ((head,), (mid,), (tail,))  # a free one
    assert bm.allocate("y", 1) and bm.table("y") == (tail,)  # the prefix's tail goes first
    assert bm.match([1, 2, 3, 0]) == [head, mid]
    bm.check_invariants()
    # Two blocks holding the same tokens: the first registered stays the one found.
    bm.free("x")
    bm.free("y")
    bm.allocate("c", 2)
    bm.commit("c", 2, lambda s, e: [1, 2][s:e])
    assert bm.match([1, 2, 3]) == [head, mid]
    bm.check_invariants()


def test_admission_counts_the_cached_blocks_it_revives():
    bm = PrefixCachingBlockManager(num_blocks=4, block_size=2)
    bm.allocate("a", 4)
    bm.commit("a", 4, lambda s, e: [1, 2, 3, 4][s:e])
    bm.free("a")
    prefix = bm.match([1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert len(prefix) == 2
    # 5 blocks for 9 tokens, 2 cached: 3 more, out of 4 free of which 2 are the prefix's own.
    assert not bm.can_admit("b", 9, prefix)
    assert bm.can_admit("b", 7, prefix)  # 4 blocks: 2 cached + 2 free


def test_a_whole_prompt_policy_grants_a_cached_prompt_what_it_has_left_to_compute():
    """vllm admits a prompt whole or not at all after an iteration's first prefill: counted
    as its uncached rest, a mostly cached prompt joins the iteration."""
    bm = PrefixCachingBlockManager(num_blocks=64, block_size=8)
    s = make_scheduler("vllm", SchedulerLimits(32, 8, 512), bm)
    once = SamplingParams(max_tokens=1)
    s.add_request(Request("a", list(range(1, 41)), once, 0.0))
    plan = s.schedule(0.0)
    s.update(plan, RunnerOutput({"a": 7}, 0.1), 0.1)  # a's 40 tokens computed, a ends
    s.add_request(Request("b", [99] * 10, once, 1.0))
    s.add_request(Request("c", list(range(1, 41)) + [5, 6, 7, 8], once, 1.0))
    plan = s.schedule(1.0)
    assert [(c.request_id, c.start, len(c.token_ids)) for c in plan.chunks] == [
        ("b", 0, 10), ("c", 40, 4)]


def test_the_adaptive_budget_prices_the_next_prompt_after_its_cached_prefix():
    """--token-budget auto plans the iteration with the next prefill's cached prefix (its
    chunk's attention reads it): for a request about to be admitted, what the cache holds."""
    bm = PrefixCachingBlockManager(num_blocks=64, block_size=8)
    s = make_scheduler("sarathi", SchedulerLimits(64, 8, 512), bm)
    seen = []
    s.budget_policy = lambda ctxs, prefix: seen.append(prefix) or 64
    s.add_request(Request("a", list(range(1, 41)), SamplingParams(max_tokens=1), 0.0))
    s.update(s.schedule(0.0), RunnerOutput({"a": 7}, 0.1), 0.1)
    s.add_request(Request("c", list(range(1, 41)) + [5, 6], SamplingParams(max_tokens=1), 1.0))
    s.schedule(1.0)
    assert seen == [0, 40]


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    llm = LLM(model=str(tiny_model_dir), scheduler="sarathi", token_budget=4096)
    return [o.token_ids for o in llm.generate(SHARED, GREEDY)]


def expected_hits(llm: LLM, first: list[int], block: int) -> int:
    """Tokens each shared prompt finds cached after the first one ran alone: its common
    prefix with the first, in whole blocks, all but its last token."""
    hits = 0
    for p in SHARED:
        ids = llm.tokenizer.encode(p)
        common = next((i for i, (x, y) in enumerate(zip(ids, first, strict=False)) if x != y),
                      min(len(ids), len(first)))
        hits += min(common, len(ids) - 1) // block * block
    return hits


@pytest.mark.parametrize("scheduler", SCHEDULERS)
def test_greedy_outputs_with_prefix_caching_are_the_uncached_ones(
        tiny_model_dir, reference, scheduler):
    llm = LLM(model=str(tiny_model_dir), scheduler=scheduler, token_budget=37, block_size=8,
              enable_prefix_caching=True)
    assert [o.token_ids for o in llm.generate(SHARED[:1], GREEDY[:1])] == reference[:1]
    bm = llm.engine.block_manager
    assert bm.hits == 0
    first = llm.tokenizer.encode(SHARED[0]) + list(reference[0])
    outs = llm.generate(SHARED, GREEDY)
    assert [o.token_ids for o in outs] == reference
    assert bm.hits == sum(o.num_cached_tokens for o in outs)
    assert bm.hits >= expected_hits(llm, first, 8) > 8 * len(SHARED)
    assert bm.num_free_blocks == bm.num_blocks
    bm.check_invariants()


@pytest.mark.parametrize("scheduler", ["sarathi", "vllm"])
def test_requests_arriving_together_wait_for_the_first_to_compute_their_prefix(
        tiny_model_dir, scheduler):
    """The samples of n arrive together: all but one wait for the first to register the
    blocks they share, then start from them; what they sample is unchanged."""
    prompt = SHARED[3]
    seeded = [SamplingParams(max_tokens=8, temperature=1.0, seed=s, ignore_eos=True)
              for s in range(4)]
    ref = LLM(model=str(tiny_model_dir), token_budget=32).generate([prompt] * 4, seeded)
    llm = LLM(model=str(tiny_model_dir), scheduler=scheduler, token_budget=32, block_size=8,
              enable_prefix_caching=True)
    outs = llm.generate([prompt] * 4, seeded)
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
    full = (len(outs[0].prompt_token_ids) - 1) // 8 * 8
    assert [o.num_cached_tokens for o in outs] == [0, full, full, full]
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks


def test_request_level_batches_do_not_wait_for_a_prefix_within_the_batch(tiny_model_dir):
    """faster_transformer admits only between batches: a request waiting for its batch's
    first to compute their prefix would wait for the whole batch to end."""
    llm = LLM(model=str(tiny_model_dir), scheduler="faster_transformer", block_size=8,
              enable_prefix_caching=True)
    outs = llm.generate([SHARED[3]] * 3, greedy(0))
    assert [o.num_cached_tokens for o in outs] == [0, 0, 0]
    first = [o.metrics.ttft for o in outs]
    assert max(first) < 2 * min(first), first  # (one batch: their first tokens together)


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("backend,block_size,blocks", [("eager", 8, 10), ("native", 16, 8)])
def test_preempted_requests_start_again_from_their_own_cached_blocks(
        tiny_model_dir, async_scheduling, backend, block_size, blocks):
    """On the compiled CPU kernels and on the eager fallback: a chunk over cached blocks is
    the attention of a later chunk."""
    ref = [o.token_ids for o in LLM(model=str(tiny_model_dir), token_budget=4096).generate(
        PROMPTS, GREEDY)]
    llm = LLM(model=str(tiny_model_dir), token_budget=32, block_size=block_size,
              num_kv_blocks=blocks, enable_prefix_caching=True,
              async_scheduling=async_scheduling, attention_backend=backend)
    assert llm.engine.core.executor.attention == backend
    outs = llm.generate(PROMPTS, GREEDY)
    assert llm.engine.scheduler.num_preemptions > 0
    assert [o.token_ids for o in outs] == ref
    bm = llm.engine.block_manager
    assert bm.hits > 0 and bm.num_free_blocks == bm.num_blocks
    bm.check_invariants()


def test_a_served_conversation_finds_its_earlier_turn_cached(tiny_model_dir):
    history = [{"role": "system", "content": SYSTEM * 3},
               {"role": "user", "content": "Why is the sky blue?"}]
    body = {"messages": history, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    with InProcessServer(tiny_model_dir, engine_kw={"enable_prefix_caching": True}) as srv:
        cold = httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=60).json()
        m = metric_values(httpx.get(srv.url + "/metrics").text)
        assert m["fluidserve_prefix_cache_hits_total"] == 0
        queried = m["fluidserve_prefix_cache_queries_total"]
        assert queried == cold["usage"]["prompt_tokens"]
        warm = httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=60).json()
        assert warm["choices"][0]["message"] == cold["choices"][0]["message"]
        m = metric_values(httpx.get(srv.url + "/metrics").text)
        block = 8  # (the test server's)
        found = (queried - 1) // block * block
        assert m["fluidserve_prefix_cache_hits_total"] == found
        # As vLLM reports them: the prompt's tokens found cached, in the usage.
        assert cold["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
        assert warm["usage"]["prompt_tokens_details"] == {"cached_tokens": found}
        chunks = [line for line in httpx.post(
            srv.url + "/v1/chat/completions", timeout=60, json=body | {
                "stream": True, "stream_options": {"include_usage": True}}).text.splitlines()
            if line.startswith("data: {")]
        assert json.loads(chunks[-1][6:])["usage"] == warm["usage"]
        # A request that a stop string ends (in the front end, before the engine ends it)
        # says so too, and its scheduling delay.
        prompt = SYSTEM + "The river rose slowly in the spring, and the people of the valley"
        plain = {"prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
        first = httpx.post(srv.url + "/v1/completions", json=plain, timeout=60).json()
        text = first["choices"][0]["text"]
        assert len(text) >= 3, text
        stopped = httpx.post(srv.url + "/v1/completions", timeout=60, json=plain | {
            "stop": [text[1:3]], "return_metrics": True}).json()
        assert stopped["choices"][0]["finish_reason"] == "stop"
        length = first["usage"]["prompt_tokens"]
        assert stopped["usage"]["prompt_tokens_details"] == {
            "cached_tokens": (length - 1) // block * block}
        assert stopped["metrics"]["scheduling_delay"] is not None
        assert srv.kv_idle()


def test_prefix_caching_is_refused_where_it_cannot_hold():
    with pytest.raises(ConfigError, match="--disaggregate"):
        EngineConfig.create(enable_prefix_caching=True, disaggregate=True)


def test_the_simulator_finds_a_shared_prefix_and_what_it_saves(tmp_path, capsys):
    """A workload of lengths: every prompt's tokens its own but for the shared prefix, so the
    same scheduler code finds that prefix and nothing else."""
    from fluidserve.cli import main

    base = ["simulate", "--model-shape", "mistral-7b", "--device", "a100", "--dataset-name",
            "fixed", "--input-len", "2048", "--output-len", "32", "--num-prompts", "60",
            "--request-rate", "4", "--no-plots", "--output-dir"]
    runs = {}
    for name, extra in (("off", []), ("unshared", ["--enable-prefix-caching"]),
                        ("on", ["--enable-prefix-caching", "--shared-prefix-len", "1536"])):
        assert main([*base, str(tmp_path / name), *extra]) == 0
        runs[name] = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert runs["off"]["prefix_cache_hit_rate"] is None
    assert runs["unshared"]["prefix_cache_hit_rate"] == 0.0
    # The 59 requests after the first find the 1536 tokens (whole blocks of 16) at most.
    assert 0.5 < runs["on"]["prefix_cache_hit_rate"] <= 59 * 1536 / (60 * 2048)
    assert runs["on"]["ttft_s"]["mean"] < 0.6 * runs["off"]["ttft_s"]["mean"]
    assert runs["unshared"]["ttft_s"] == runs["off"]["ttft_s"]


def test_bench_prompts_can_share_a_prefix_that_a_caching_server_finds(tiny_model_dir, tmp_path,
                                                                      capsys):
    from fluidserve.bench.prompts import PromptBuilder, load_corpus
    from fluidserve.cli import main
    from fluidserve.model.tokenizer import Tokenizer

    tok = Tokenizer(tiny_model_dir)
    text = load_corpus()[0]
    plain = PromptBuilder(tok, text, seed=5)
    shared = PromptBuilder(tok, text, seed=5, prefix_len=40)
    a, b, short = shared.build(70), shared.build(90), shared.build(20)
    ids = [tok.encode(p) for p in (a, b, short)]
    assert [len(x) for x in ids] == [70, 90, 20]
    assert ids[0][:38] == ids[1][:38] and ids[0][:18] == ids[2][:18]  # (the junction may merge)
    assert plain.build(70) != a and tok.encode(plain.build(90))[:38] != ids[1][:38]
    with InProcessServer(tiny_model_dir, engine_kw={"enable_prefix_caching": True}) as srv:
        assert main(["bench", "--base-url", srv.url, "--tokenizer", str(tiny_model_dir),
                     "--num-prompts", "8", "--dataset-name", "fixed", "--input-len", "96",
                     "--output-len", "4", "--max-concurrency", "1", "--shared-prefix-len",
                     "64", "--warmup-requests", "0", "--output-dir", str(tmp_path / "run"),
                     "--no-plots"]) == 0
        summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert summary["shared_prefix_len"] == 64 and summary["num_completed"] == 8
        m = metric_values(httpx.get(srv.url + "/metrics").text)
    # The 7 prompts after the first find its first 56 tokens at least (7 blocks of 8).
    assert m["fluidserve_prefix_cache_hits_total"] >= 7 * 56
