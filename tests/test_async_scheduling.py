"""Asynchronous scheduling: batch N+1 is scheduled and launched while batch N is in flight.

Its decodes read their input token, still in flight, on the device; ``update`` writes the
tokens in. Whatever the policy, budget, memory pressure or stop condition, the outputs must be
the synchronous engine's, token for token, and nothing may leak (blocks, placeholders).
"""

from __future__ import annotations

import pytest
import torch

from fluidserve.config import SCHEDULERS, ConfigError, EngineConfig
from fluidserve.core.block_manager import BlockManager
from fluidserve.core.scheduler import RunnerOutput, SchedulerLimits, make_scheduler
from fluidserve.core.scheduler.base import PLACEHOLDER
from fluidserve.engine.llm import LLM
from fluidserve.request import Request
from fluidserve.sampling_params import SamplingParams
from tests.test_engine import PROMPTS, greedy

GREEDY = [greedy(i) for i in range(len(PROMPTS))]
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    llm = LLM(model=str(tiny_model_dir), scheduler="sarathi", token_budget=4096)
    return [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]


def async_llm(model_dir, **kw) -> LLM:
    llm = LLM(model=str(model_dir), async_scheduling=True, **kw)
    assert llm.engine.core.depth == 2 and llm.engine.scheduler.async_scheduling
    return llm


def assert_clean(llm: LLM) -> None:
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    assert not llm.engine.scheduler.requests and not llm.engine.core.in_flight


class Recording:
    """Wraps an executor's submit: records each plan and how many were in flight at once."""

    def __init__(self, llm: LLM) -> None:
        self.core, ex = llm.engine.core, llm.engine.executor
        self.plans, self.in_flight, self._submit = [], [], ex.submit
        ex.submit = self

    def __call__(self, plan):
        self.plans.append(plan)
        self.in_flight.append(len(self.core.in_flight))
        return self._submit(plan)


@pytest.mark.parametrize("scheduler", SCHEDULERS)
@pytest.mark.parametrize("budget", [8, 512])
def test_greedy_outputs_match_the_synchronous_engine(tiny_model_dir, reference, scheduler,
                                                     budget):
    llm = async_llm(tiny_model_dir, scheduler=scheduler, token_budget=budget, block_size=8)
    rec = Recording(llm)
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == reference
    assert all(PLACEHOLDER not in o.token_ids and o.finish_reason == "length" for o in outs)
    assert_clean(llm)
    # The point of it: batches launched while another is in flight, decodes of tokens in
    # flight among them.
    assert max(rec.in_flight) == 1
    assert any(c.token_ids == (PLACEHOLDER,) for p in rec.plans for c in p.chunks)


@pytest.mark.parametrize("scheduler", ["sarathi", "sarathi_slack"])
def test_the_adaptive_budget_plans_batches_in_flight(tiny_model_dir, reference, scheduler):
    llm = async_llm(tiny_model_dir, scheduler=scheduler, token_budget="auto", tbt_slo=0.05)
    rec = Recording(llm)
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == reference
    assert_clean(llm)
    assert max(rec.in_flight) == 1
    # Its iteration-time model learned from iterations timed from when each began (the
    # one before it ended), not from when it was scheduled.
    iters = list(llm.engine.telemetry.iterations)
    assert all(b.start >= a.start + a.duration - 1e-9
               for a, b in zip(iters[:-1], iters[1:], strict=True))


def test_a_prompt_chunked_over_batches_in_flight_continues_at_once(tiny_model_dir, reference):
    # One long prompt alone, budget 8: its chunks run in consecutive batches, each scheduled
    # while the one before is in flight, and never overlap.
    llm = async_llm(tiny_model_dir, token_budget=8, block_size=8)
    rec = Recording(llm)
    out = llm.generate(PROMPTS[3], GREEDY[3])[0]
    assert out.token_ids == reference[3]
    assert all(len(p.chunks) == 1 for p in rec.plans)
    starts = [p.chunks[0].start for p in rec.plans]
    assert starts == list(range(0, len(out.prompt_token_ids), 8)) + list(
        range(len(out.prompt_token_ids), len(out.prompt_token_ids) + len(out.token_ids) - 1))
    assert rec.in_flight[0] == 0 and set(rec.in_flight[1:]) == {1}


def test_preemption_under_tiny_kv_cache_loses_nothing(tiny_model_dir, reference):
    llm = async_llm(tiny_model_dir, token_budget=32, block_size=8, num_kv_blocks=10)
    outs = llm.generate(PROMPTS, GREEDY)
    assert llm.engine.scheduler.num_preemptions > 0
    assert [o.token_ids for o in outs] == reference
    assert_clean(llm)


@pytest.mark.parametrize("device", DEVICES)
def test_seeded_sampling_and_logprobs_match_the_synchronous_engine(tiny_model_dir, device):
    # On CUDA: decodes replay CUDA graphs, tokens come back through pinned copies and a
    # waiting thread, greedy and sampled rows in the same batches.
    params = [SamplingParams(max_tokens=11, temperature=0.9 if i % 3 else 0.0, top_p=0.9,
                             top_k=50, seed=10 + i, ignore_eos=True,
                             logprobs=2 if i % 2 else None)
              for i in range(len(PROMPTS))]
    sync = LLM(model=str(tiny_model_dir), token_budget=16, device=device,
               async_scheduling=False).generate(PROMPTS, params)
    llm = async_llm(tiny_model_dir, token_budget=16, device=device)
    got = llm.generate(PROMPTS, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in sync]
    for a, b in zip(got, sync, strict=True):
        assert len(a.logprobs) == len(b.logprobs)
        for x, y in zip(a.logprobs, b.logprobs, strict=True):
            assert x[0] == pytest.approx(y[0], abs=1e-5)
            assert [t for t, _ in x[1]] == [t for t, _ in y[1]]
    assert_clean(llm)
    llm.engine.shutdown()


def test_a_token_sampled_after_its_request_stopped_is_dropped(tiny_model_dir, reference):
    # EOS at output 3 (and 6): the decode after it was launched before the EOS was known.
    llm = async_llm(tiny_model_dir)
    eos = llm.tokenizer.eos_token_id
    llm.engine.core.force_eos_at = frozenset({3, 6})
    base = dict(max_tokens=10, temperature=0.0)
    stop, ignored, min5 = llm.generate(
        [PROMPTS[2]] * 3, [SamplingParams(**base), SamplingParams(**base, ignore_eos=True),
                           SamplingParams(**base, min_tokens=5)])
    assert stop.finish_reason == "stop" and stop.token_ids == reference[2][:3] + [eos]
    assert ignored.finish_reason == "length" and len(ignored.token_ids) == 10
    assert min5.finish_reason == "stop" and len(min5.token_ids) == 7
    tok = reference[1][3]
    by_id = llm.generate(PROMPTS[1], SamplingParams(max_tokens=20, temperature=0.0,
                                                    stop_token_ids=(tok,)))[0]
    assert by_id.token_ids == reference[1][: reference[1].index(tok) + 1]
    # A stop string ends the request from the front end, with a batch of it still in flight.
    full = llm.generate(PROMPTS[1], greedy(1))[0]
    word = full.text.strip().split()[1] if len(full.text.split()) > 1 else full.text[2:5]
    cut = llm.generate(PROMPTS[1], SamplingParams(max_tokens=20, temperature=0.0,
                                                  ignore_eos=True, stop=(word,)))[0]
    assert cut.finish_reason == "stop" and cut.text == full.text[: full.text.find(word)]
    assert_clean(llm)
    tokens = [e for e in llm.engine.telemetry.tokens if e.request_id == stop.request_id]
    assert [e.token_index for e in tokens] == [0, 1, 2, 3]


def test_a_failed_batch_fails_its_requests_and_the_engine_goes_on(tiny_model_dir, reference):
    llm = async_llm(tiny_model_dir)
    worker, calls = llm.engine.executor.worker, []
    real = worker.launch

    def flaky(inputs):
        calls.append(inputs)
        if len(calls) == 3:
            raise RuntimeError("boom")
        return real(inputs)

    worker.launch = flaky
    bad = llm.generate(PROMPTS[0], greedy(0))[0]
    assert bad.finish_reason == "error" and "boom" in bad.error
    # The batch launched after the failed one read its placeholder as token 0, and was dropped.
    assert calls[3].token_ids.tolist() == [0]
    worker.launch = real
    assert llm.generate(PROMPTS[:2], GREEDY[:2])[1].token_ids == reference[1]
    assert_clean(llm)


def test_the_waiting_thread_path_matches(tiny_model_dir, reference):
    # On CUDA a thread waits for each batch's tokens; the same path, on the CPU.
    from concurrent.futures import ThreadPoolExecutor

    llm = async_llm(tiny_model_dir, token_budget=16)
    llm.engine.executor._waiter = ThreadPoolExecutor(1)
    try:
        assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == reference
    finally:
        llm.engine.shutdown()
    assert_clean(llm)


def test_scheduler_advances_at_schedule_and_writes_tokens_in():
    bm = BlockManager(16, 4)
    s = make_scheduler("sarathi", SchedulerLimits(8, 4, 64), bm)
    s.async_scheduling = True
    req = Request("a", [5, 6, 7], SamplingParams(max_tokens=3, temperature=0.0), 0.0)
    s.add_request(req)
    p1 = s.schedule(0.0)
    assert req.num_computed_tokens == 3 and req.output_token_ids == [PLACEHOLDER]
    p2 = s.schedule(0.0, frozenset({"a"}))  # while p1 is in flight
    (c,) = p2.chunks
    assert (c.start, c.token_ids, c.output_index) == (3, (PLACEHOLDER,), 1)
    p3 = s.schedule(0.0, frozenset({"a"}))  # the last token (max_tokens 3) is in flight
    (c,) = p3.chunks
    assert (c.start, c.token_ids, c.output_index) == (4, (PLACEHOLDER,), 2)
    assert s.schedule(0.0, frozenset({"a"})).is_empty  # max_tokens: nothing more to sample
    s.update(p1, RunnerOutput({"a": 40}, 0.0), 1.0)
    assert req.output_token_ids == [40, PLACEHOLDER, PLACEHOLDER]
    s.update(p2, RunnerOutput({"a": 41}, 0.0), 2.0)
    s.update(p3, RunnerOutput({"a": 42}, 0.0), 3.0)
    assert req.output_token_ids == [40, 41, 42] and req.finish_reason == "length"
    assert bm.num_free_blocks == 16


def test_a_stop_drops_the_placeholders_after_it():
    bm = BlockManager(16, 4)
    s = make_scheduler("sarathi", SchedulerLimits(8, 4, 64), bm)
    s.async_scheduling = True
    req = Request("a", [5, 6, 7], SamplingParams(max_tokens=9, stop_token_ids=(40,)), 0.0)
    s.add_request(req)
    p1 = s.schedule(0.0)
    s.schedule(0.0, frozenset({"a"}))
    assert s.update(p1, RunnerOutput({"a": 40}, 0.0), 1.0) == [req]
    assert req.output_token_ids == [40] and req.finish_reason == "stop"
    assert bm.num_free_blocks == 16


def test_a_newer_request_in_flight_is_preempted_for_an_older_decode():
    """The oldest decode needs a block and every newer request is in flight: the newest is
    preempted at once, as in the synchronous engine (it used to wait, keeping its blocks, while
    the newer ones decoded on: 16 iterations here), and the token it samples in flight is
    dropped; recomputed, it ends with the tokens it would have had."""
    bm = BlockManager(6, 16)
    s = make_scheduler("sarathi", SchedulerLimits(128, 8, 4096), bm)
    s.async_scheduling = True
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    a, b, c = (Request(rid, [5] * n, params, 0.0) for rid, n in (("a", 32), ("b", 17),
                                                                 ("c", 17)))
    for r in (a, b, c):
        s.add_request(r)
    in_flight, t = s.schedule(0.0), 0.0  # all three prompts (6 blocks: the cache is full)
    while not c.num_preemptions:  # "a" decodes next and needs a 7th block
        nxt = s.schedule(t, frozenset(x.request_id for x in in_flight.chunks))
        assert "a" in {x.request_id for x in nxt.chunks}, "the oldest decode waited"
        t += 1.0
        s.update(in_flight, RunnerOutput({x.request_id: 7 for x in in_flight.chunks}, 0.0), t)
        in_flight = nxt
    assert PLACEHOLDER not in c.output_token_ids and c.num_computed_tokens == 0
    assert c.output_token_ids == [] and c.status.name == "WAITING"  # its first, in flight
    while s.has_unfinished():
        nxt = s.schedule(t, frozenset(x.request_id for x in in_flight.chunks))
        t += 1.0
        s.update(in_flight, RunnerOutput({x.request_id: 7 for x in in_flight.chunks}, 0.0), t)
        in_flight = nxt
    assert all(r.output_token_ids == [7] * 40 for r in (a, b, c))
    assert bm.num_free_blocks == 6


def test_a_chunk_from_before_a_preemption_is_not_applied_to_the_request_admitted_again():
    """Q preempts itself while its first two batches are in flight; an abort frees blocks and
    the next schedule admits Q again before those batches are applied. Their tokens belong to
    the admission before: applied, they duplicated a streamed token or (the recompute not
    sampling yet) wrote past the end of the outputs and took the engine core down."""
    bm = BlockManager(3, 4)
    s = make_scheduler("sarathi", SchedulerLimits(64, 8, 64), bm)
    s.async_scheduling = True
    S = Request("S", [5] * 7, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True),
                0.0)
    Q = Request("Q", [5] * 3, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True),
                0.0)
    s.add_request(S)
    s.add_request(Q)

    def busy(*plans) -> frozenset[str]:
        return frozenset(c.request_id for p in plans for c in p.chunks)

    def tokens(plan, base: int) -> RunnerOutput:
        return RunnerOutput({c.request_id: base + c.output_index for c in plan.chunks
                             if c.samples}, 0.0)

    p1 = s.schedule(0.0)  # both prompts: the cache is full
    p2 = s.schedule(0.0, busy(p1))  # both decode
    assert s.schedule(0.0, busy(p1, p2)).is_empty and Q.num_preemptions == 1
    s.abort("S", 0.0)
    p4 = s.schedule(0.0, busy(p1, p2))
    assert [(c.request_id, c.start) for c in p4.chunks] == [("Q", 0)]  # admitted again
    assert s.update(p1, tokens(p1, 10), 1.0) == []
    assert s.update(p2, tokens(p2, 10), 2.0) == []
    flight, t = [p4], 2.0
    while s.has_unfinished():
        nxt = s.schedule(t, busy(*flight))
        if not nxt.is_empty:
            flight.append(nxt)
        t += 1.0
        p = flight.pop(0)
        s.update(p, tokens(p, 20), t)
    assert Q.output_token_ids == [20, 21, 22, 23] and Q.token_times == [3.0, 4.0, 5.0, 6.0]
    assert bm.num_free_blocks == 3


def test_async_scheduling_needs_one_model_process():
    with pytest.raises(ConfigError, match="one process"):
        EngineConfig.create(async_scheduling=True, pipeline_parallel_size=2)
    with pytest.raises(ConfigError, match="one process"):
        EngineConfig.create(async_scheduling=True, disaggregate=True)


def test_on_by_default_for_one_model_process_on_cuda_only():
    """As vLLM: a GPU's idle time between steps is what it removes (measured on an H200:
    token gap 3.95 against 4.21-4.43 ms); on the CPU it only delays each token."""
    assert EngineConfig.create(device="cuda").uses_async_scheduling()
    assert EngineConfig.create(device="cuda:1").uses_async_scheduling()
    assert not EngineConfig.create().uses_async_scheduling()  # the CPU
    assert not EngineConfig.create(device="cuda", async_scheduling=False).uses_async_scheduling()
    assert EngineConfig.create(async_scheduling=True).uses_async_scheduling()
    for multi in ({"pipeline_parallel_size": 2}, {"tensor_parallel_size": 2},
                  {"disaggregate": True}):
        assert not EngineConfig.create(device="cuda", **multi).uses_async_scheduling()


def test_the_default_stays_off_where_the_executor_cannot_resolve_tokens():
    """The simulator's executor (or a pipeline's) cannot read tokens in flight: by default the
    core runs synchronously there; asked for explicitly, it is a clear error."""
    from fluidserve.engine.core import EngineCore, VirtualClock
    from tests.test_adaptive_budget import FakeExecutor

    core = EngineCore(EngineConfig.create(device="cuda"), FakeExecutor(per_token=1e-4),
                      VirtualClock())
    assert core.depth == 1 and not core.scheduler.async_scheduling
    with pytest.raises(ConfigError, match="single-process model executor"):
        EngineCore(EngineConfig.create(async_scheduling=True), FakeExecutor(per_token=1e-4),
                   VirtualClock())


def test_served_with_its_engine_core_in_a_process_of_its_own(tiny_model_dir):
    """Over HTTP: the engine-core process polls for new requests between batches in flight."""
    import asyncio

    import httpx

    from tests.server_utils import InProcessServer

    offline = LLM(model=str(tiny_model_dir), max_model_len=512)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    want = [o.text for o in offline.generate(PROMPTS, [params] * len(PROMPTS))]

    async def one(c: httpx.AsyncClient, i: int) -> tuple[str, int]:
        r = await c.post("/v1/completions", json={
            "prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": 12, "temperature": 0,
            "ignore_eos": True})
        body = r.json()
        return body["choices"][0]["text"], body["usage"]["completion_tokens"]

    async def main(url: str):
        async with httpx.AsyncClient(base_url=url, timeout=120) as c:
            return await asyncio.gather(*(one(c, i) for i in range(16)))

    with InProcessServer(tiny_model_dir, engine_kw={"async_scheduling": True}) as srv:
        got = asyncio.run(main(srv.url))
        assert [text for text, _ in got] == [want[i % len(PROMPTS)] for i in range(16)]
        assert all(n == 12 for _, n in got)
        assert srv.kv_idle()


def run_in_flight(num_blocks: int, prompts: list[int], max_tokens: int = 12):
    """A scheduler driven as the asynchronous engine drives it (two batches in flight, fake
    tokens); returns the preempted ids in order and the number of batches."""
    from collections import deque

    bm = BlockManager(num_blocks, 4)
    s = make_scheduler("sarathi", SchedulerLimits(16, 8, 256), bm)
    s.async_scheduling = True
    for i, n in enumerate(prompts):
        s.add_request(Request(f"r{i}", [3] * n, SamplingParams(max_tokens=max_tokens,
                                                               ignore_eos=True), float(i)))
    in_flight, preempted, batches = deque(), [], 0
    while s.requests or in_flight:
        assert batches < 2000, "no progress"
        while len(in_flight) < 2:
            plan = s.schedule(0.0, frozenset(c.request_id for p in in_flight for c in p.chunks))
            preempted += plan.preempted
            if plan.is_empty:
                break
            in_flight.append(plan)
            batches += 1
        plan = in_flight.popleft()
        s.update(plan, RunnerOutput({c.request_id: 7 for c in plan.chunks if c.samples}, 0.0),
                 0.0)
    assert bm.num_free_blocks == num_blocks
    return preempted, batches


@pytest.mark.parametrize("num_blocks, prompts", [(5, [3, 5]), (8, [5, 6, 7, 8])])
def test_a_request_in_flight_never_evicts_one_admitted_before_it(num_blocks, prompts):
    # Too few blocks for all: the latest admitted make room, never the first (which, not in
    # flight after it went short of a block, would be the first candidate a newer request in
    # flight met past itself).
    preempted, _ = run_in_flight(num_blocks, prompts)
    assert preempted and "r0" not in preempted


def test_a_request_id_still_in_flight_cannot_be_reused(tiny_model_dir):
    from fluidserve.core.scheduler import RequestRejected

    llm = async_llm(tiny_model_dir)
    eng = llm.engine
    eng.core.force_eos_at = {"x": {2}}  # it stops at its third token...
    eng.add_request("x", PROMPTS[1], SamplingParams(max_tokens=10, temperature=0.0))
    while not any(o.finished for o in eng.step()):
        pass
    assert eng.core.in_flight  # ...with the decode of a fourth launched
    with pytest.raises(RequestRejected, match="still in a batch in flight"):
        eng.add_request("x", PROMPTS[1], greedy(1))
    while eng.has_unfinished():
        eng.step()
    eng.add_request("x", PROMPTS[1], greedy(1))  # once that batch is applied, it is free
    while eng.has_unfinished():
        eng.step()
    assert_clean(llm)
