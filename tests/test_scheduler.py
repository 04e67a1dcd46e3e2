"""Pure-Python scheduler and block-manager tests: no torch, fake runner outputs."""

from __future__ import annotations

import subprocess
import sys
from collections import deque

import pytest

from fluidserve.core.block_manager import BlockManager
from fluidserve.core.queue_policy import WaitingQueue
from fluidserve.core.scheduler import (
    SCHEDULER_REGISTRY,
    RequestRejected,
    RunnerOutput,
    SchedulerLimits,
    make_scheduler,
)
from fluidserve.request import Request, RequestStatus
from fluidserve.sampling_params import SamplingParams


def make(
    name="sarathi",
    budget=32,
    blocks=256,
    block_size=4,
    max_seqs=64,
    tile=1,
    max_len=4096,
    watermark=0.0,
    policy="fcfs",
):
    bm = BlockManager(blocks, block_size, watermark)
    lim = SchedulerLimits(budget, max_seqs, max_len, tile, policy)
    return make_scheduler(name, lim, bm)


def req(rid, prompt_len, max_tokens=4, arrival=0.0):
    return Request(
        str(rid), list(range(1, prompt_len + 1)), SamplingParams(max_tokens=max_tokens), arrival
    )


def run(sched, max_iters=10_000, on_step=None):
    """Drive the scheduler with a fake executor; returns the list of iteration plans."""
    plans, now = [], 0.0
    while sched.has_unfinished() and len(plans) < max_iters:
        plan = sched.schedule(now)
        sampled = {c.request_id: 7 for c in plan.chunks if c.samples}
        now += 1.0
        sched.update(plan, RunnerOutput(sampled, 1.0), now)
        computed = {r.request_id: r.num_computed_tokens for r in sched.running}
        sched.bm.check_invariants(computed)
        plans.append(plan)
        if on_step:
            on_step(plan)
    assert not sched.has_unfinished(), "scheduler stopped making progress"
    return plans


def test_core_does_not_import_torch():
    """Every module of ``fluidserve.core`` (found by walking the package, so a new one is
    covered too), the request and the metrics: pure Python."""
    code = (
        "import importlib, pkgutil, sys, fluidserve.core, fluidserve.request, fluidserve.metrics\n"
        "core = fluidserve.core\n"
        "names = [m.name for m in pkgutil.walk_packages(core.__path__, 'fluidserve.core.')]\n"
        "for n in names: importlib.import_module(n)\n"
        "print(len(names), 'torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    count, torch_loaded = out.stdout.split()
    assert int(count) >= 12 and torch_loaded == "False", out.stdout


def test_block_manager_allocate_free_and_invariants():
    bm = BlockManager(10, 4, watermark=0.2)
    assert bm.allocate("a", 9) and bm.table("a") == (0, 1, 2)
    assert bm.allocate("a", 12) and len(bm.table("a")) == 3  # still fits in 3 blocks
    assert bm.allocate("a", 13) and len(bm.table("a")) == 4
    assert not bm.can_allocate("b", 20, admit=True)  # 5 blocks > 6 free - 2 watermark
    assert bm.can_allocate("b", 16, admit=True)
    assert not bm.allocate("b", 40) and bm.table("b") == ()  # failure changes nothing
    bm.check_invariants({"a": 13})
    assert bm.free("a") == 4 and bm.num_free_blocks == 10
    bm.check_invariants()


def test_block_manager_defaults_and_arguments():
    bm = BlockManager(10, 4)
    assert bm.watermark_blocks == 0 and bm.usage == 0.0
    assert BlockManager(10, 4, watermark=0.25).watermark_blocks == 2  # int(2.5)
    for blocks, size in ((0, 4), (4, 0)):
        with pytest.raises(ValueError, match="^num_blocks and block_size must be >= 1$"):
            BlockManager(blocks, size)


def test_block_manager_new_blocks_and_admission_check():
    bm = BlockManager(6, 4, watermark=0.4)  # 2 blocks reserved at admission
    bm.allocate("a", 9)  # 3 blocks
    assert bm.num_new_blocks("a", 12) == 0 and bm.num_new_blocks("a", 13) == 1
    assert bm.num_new_blocks("b", 5) == 2
    assert bm.can_allocate("a", 20) and not bm.can_allocate("a", 20, admit=True)
    assert bm.can_allocate("b", 12) and not bm.can_allocate("b", 13)
    bm.allocate("b", 12)  # the cache is full now
    assert bm.can_allocate("a", 12) and not bm.can_allocate("a", 13) and bm.usage == 1.0


def corrupt(how):
    bm = BlockManager(4, 4)
    bm.allocate("a", 8)  # blocks 0 and 1; 2 and 3 free
    how(bm)
    return bm


@pytest.mark.parametrize("how,message", [
    (lambda bm: bm._free.append(bm.table("a")[0]), "a block is both owned and free"),
    (lambda bm: bm._tables.update(b=(bm._free.popleft(),) * 2), "a block is owned twice"),
    (lambda bm: bm._free.append(bm._free[0]), "a block is free twice"),
    (lambda bm: bm._free.pop(), "a block leaked"),
    (lambda bm: bm._free.__setitem__(0, 4), "block id out of range"),
    (lambda bm: (bm._tables.update(a=(0,)), bm._free.append(1)), "a: table too small"),
])
def test_block_manager_invariant_check_catches_corruption(how, message):
    bm = corrupt(how)
    with pytest.raises(AssertionError, match=f"^{message}$"):
        bm.check_invariants({"a": 8})


def test_waiting_queue():
    q = WaitingQueue()  # fcfs
    a, b = req("a", 5, arrival=1.0), req("b", 5, arrival=0.5)
    q.push(a)
    q.push(b)
    assert len(q) == 2 and "a" in q and [r.request_id for r in q.ordered()] == ["b", "a"]
    assert q.remove("a") is a and q.remove("a") is None and "a" not in q
    with pytest.raises(ValueError, match="unknown queue policy 'lifo'"):
        WaitingQueue("lifo")


@pytest.mark.parametrize("name", sorted(SCHEDULER_REGISTRY))
def test_every_policy_finishes_everything_with_full_outputs(name):
    s = make(name, budget=16)
    reqs = [req(i, p, m) for i, (p, m) in enumerate([(40, 5), (3, 9), (17, 2), (64, 1), (9, 12)])]
    for r in reqs:
        s.add_request(r)
    run(s)
    for r in reqs:
        assert r.status is RequestStatus.FINISHED_LENGTH
        assert r.output_token_ids == [7] * r.params.max_tokens
    assert s.bm.num_free_blocks == s.bm.num_blocks


def test_sarathi_respects_budget_and_puts_decodes_first():
    s = make("sarathi", budget=16)
    for i, p in enumerate([40, 30, 5, 50]):
        s.add_request(req(i, p, max_tokens=6))

    def check(plan):
        assert plan.num_tokens <= 16
        kinds = [c.is_decode for c in plan.chunks]
        assert kinds == sorted(kinds, reverse=True), "decodes must come before prefill chunks"

    plans = run(s, on_step=check)
    # A hybrid batch exists: decodes ride along with a prefill chunk (no generation stall).
    assert any(p.num_decode_tokens and p.num_prefill_tokens for p in plans)


def test_sarathi_chunk_is_min_of_remaining_and_budget_left():
    s = make("sarathi", budget=10)
    s.add_request(req("a", 25, max_tokens=3))
    p1 = s.schedule(0.0)
    assert p1.composition() == (("a", 10),)
    s.update(p1, RunnerOutput({}, 0.1), 1.0)
    p2 = s.schedule(1.0)
    assert p2.composition() == (("a", 10),)
    s.update(p2, RunnerOutput({}, 0.1), 2.0)
    s.add_request(req("b", 8))
    p3 = s.schedule(2.0)  # a's last 5 tokens, then b gets the 5 left in the budget
    assert p3.composition() == (("a", 5), ("b", 5))
    assert [c.samples for c in p3.chunks] == [True, False]


def test_tile_rounding_only_rounds_budget_limited_chunks():
    s = make("sarathi", budget=30, tile=8)
    s.add_request(req("a", 50))
    assert s.schedule(0.0).composition() == (("a", 24),)
    s2 = make("sarathi", budget=30, tile=8)
    s2.add_request(req("a", 13))
    assert s2.schedule(0.0).composition() == (("a", 13),)  # the final chunk is whole


def test_a_prefill_progresses_when_decodes_leave_less_than_a_tile():
    """With the tile as large as the budget (allowed), one running decode left budget - 1,
    which rounded down to nothing: no prompt ran until every decode had ended."""
    s = make("sarathi", budget=64, tile=64)
    s.add_request(req("long_decode", 4, max_tokens=200))
    first = s.schedule(0.0)
    s.update(first, RunnerOutput({"long_decode": 7}, 1.0), 1.0)
    s.add_request(req("new", 100))
    assert s.schedule(1.0).composition() == (("long_decode", 1), ("new", 63))


def test_vllm_iterations_are_prefill_only_or_decode_only_and_stall_decodes():
    s = make("vllm", budget=64)
    s.add_request(req("a", 10, max_tokens=20))
    arrivals = {5: req("b", 60, 3), 9: req("c", 30, 3)}
    plans, now = [], 0.0
    while s.has_unfinished():
        if len(plans) in arrivals:
            s.add_request(arrivals.pop(len(plans)))
        plan = s.schedule(now)
        s.update(plan, RunnerOutput({c.request_id: 7 for c in plan.chunks if c.samples}, 1), now)
        plans.append(plan)
        now += 1
    for p in plans:
        assert not (p.num_decode_tokens and p.num_prefill_tokens)
    # Prompts are admitted whole, and a's decode skipped that iteration (the stall).
    assert ("b", 60) in plans[5].composition() and "a" not in dict(plans[5].composition())


def test_vllm_admits_an_overlong_prompt_alone():
    s = make("vllm", budget=16)
    s.add_request(req("a", 40))
    s.add_request(req("b", 4))
    assert s.schedule(0.0).composition() == (("a", 40),)


def test_orca_mixes_decodes_with_whole_prompts():
    s = make("orca", budget=8)
    s.add_request(req("a", 5, max_tokens=10))
    s.update(s.schedule(0.0), RunnerOutput({"a": 7}, 1), 1.0)
    s.add_request(req("b", 30))
    s.add_request(req("c", 20))
    assert s.schedule(1.0).composition() == (("a", 1), ("b", 30), ("c", 20))


def test_hybrid_only_keeps_whole_prompts_under_the_budget():
    s = make("hybrid_only", budget=40)
    for rid, n in (("a", 30), ("b", 20), ("c", 5)):
        s.add_request(req(rid, n))
    # a fits whole; b (20) does not fit in the 10 left and is not chunked; FCFS stops there.
    assert s.schedule(0.0).composition() == (("a", 30),)
    exact = make("hybrid_only", budget=50)
    for rid, n in (("a", 30), ("b", 20)):
        exact.add_request(req(rid, n))
    assert exact.schedule(0.0).composition() == (("a", 30), ("b", 20))  # b fits exactly


def test_decode_maximal_has_at_most_one_prefill_per_batch():
    s = make("decode_maximal", budget=32)
    for i in range(6):
        s.add_request(req(i, 20, max_tokens=5))
    run(
        s,
        on_step=lambda p: assert_(
            sum(1 for c in p.chunks if not c.is_decode) <= 1 and p.num_tokens <= 32
        ),
    )


def assert_(cond):
    assert cond


def test_chunked_only_chunks_but_never_mixes():
    s = make("chunked_only", budget=16)
    s.add_request(req("a", 10, max_tokens=8))
    s.add_request(req("b", 50, max_tokens=2))
    plans = run(
        s,
        on_step=lambda p: assert_(
            p.num_tokens <= 16 and not (p.num_decode_tokens and p.num_prefill_tokens)
        ),
    )
    assert max(p.num_prefill_tokens for p in plans) == 16


def test_faster_transformer_admits_nothing_until_the_batch_finishes():
    s = make("faster_transformer", max_seqs=2)
    s.add_request(req("a", 8, max_tokens=3))
    s.add_request(req("b", 8, max_tokens=6))
    s.add_request(req("c", 8, max_tokens=2))
    plans = run(s)
    first_c = next(i for i, p in enumerate(plans) if "c" in dict(p.composition()))
    last_b = max(i for i, p in enumerate(plans) if "b" in dict(p.composition()))
    assert first_c > last_b
    assert plans[0].composition() == (("a", 8), ("b", 8))


def test_max_num_seqs_caps_running_requests():
    s = make("sarathi", budget=1000, max_seqs=3)
    for i in range(8):
        s.add_request(req(i, 4, max_tokens=5))
    run(s, on_step=lambda p: assert_(len(s.running) <= 3 and len(p.chunks) <= 3))


@pytest.mark.parametrize("name", sorted(SCHEDULER_REGISTRY))
def test_preemption_under_a_tiny_cache_recomputes_and_loses_nothing(name):
    # 12 blocks of 4 tokens = 48 slots for requests that need up to 30 each.
    s = make(name, budget=24, blocks=12, block_size=4)
    reqs = [req(i, p, m) for i, (p, m) in enumerate([(10, 20), (12, 15), (8, 22), (6, 18)])]
    for r in reqs:
        s.add_request(r)
    run(s)
    assert s.num_preemptions > 0 or name == "faster_transformer"
    for r in reqs:
        assert r.output_token_ids == [7] * r.params.max_tokens
        assert len(r.token_times) == r.params.max_tokens


def test_preempted_request_recomputes_prompt_and_outputs():
    s = make("sarathi", budget=64, blocks=6, block_size=4)
    s.add_request(req("a", 8, max_tokens=12))
    s.add_request(req("b", 8, max_tokens=12))
    seen = []
    run(s, on_step=lambda p: seen.extend(c for c in p.chunks if c.start == 0 and c.num_tokens > 8))
    assert seen, "a preempted request is recomputed over prompt + generated tokens"
    assert all(c.token_ids[:8] == tuple(range(1, 9)) for c in seen)


def test_a_later_request_never_preempts_an_earlier_one():
    # Prefill-first with chunks: b's prefill fills the cache while a waits to decode, and its
    # own decode outgrows it. Evicting a (admitted first) let a's recompute evict b in turn,
    # forever.
    s = make("chunked_only", budget=1, blocks=16, block_size=1)
    s.add_request(req("a", 4, max_tokens=2))
    s.add_request(req("b", 12, max_tokens=2))
    plans = run(s, max_iters=500)
    assert {rid for p in plans for rid in p.preempted} == {"b"}


def run_pipelined(sched, depth: int = 2, max_iters: int = 1000) -> list:
    """Like run(), with ``depth`` iterations in flight (pipeline stages), each scheduled
    without the requests still in flight."""
    flight, plans, now = deque(), [], 0.0
    while (sched.has_unfinished() or flight) and len(plans) < max_iters:
        plan = sched.schedule(now, frozenset(c.request_id for p in flight for c in p.chunks))
        plans.append(plan)
        if plan.chunks:
            flight.append(plan)
        if flight and (len(flight) == depth or not plan.chunks):
            done = flight.popleft()
            now += 1.0
            sched.update(done, RunnerOutput({c.request_id: 7 for c in done.chunks if c.samples},
                                            1.0), now)
    assert not sched.has_unfinished(), "scheduler stopped making progress"
    return plans


def test_a_request_short_of_blocks_waits_for_requests_in_flight():
    # Two requests that do not fit together, two iterations in flight: each found the other
    # in flight when it needed blocks, evicted itself, and was re-admitted while the other
    # ran, which then evicted itself in turn, forever.
    s = make("chunked_only", budget=7, blocks=9, block_size=4)
    reqs = [req("a", 25, max_tokens=8), req("b", 25, max_tokens=8)]
    for r in reqs:
        s.add_request(r)
    run_pipelined(s)
    assert all(r.output_token_ids == [7] * 8 for r in reqs)
    assert s.num_preemptions <= 4


def test_a_request_never_preempts_one_already_in_the_batch():
    # With tile rounding, d (admitted after p) finished its prefill in the budget p left
    # and decodes first; p's next chunk lacks a block, and d, scheduled already, must stay.
    s = make("sarathi", budget=10, tile=4, blocks=7, block_size=2)
    s.add_request(req("p", 12, max_tokens=1))
    s.add_request(req("d", 2, max_tokens=5))
    first = s.schedule(0.0)
    assert first.composition() == (("p", 8), ("d", 2))
    s.update(first, RunnerOutput({"d": 7}, 1.0), 1.0)
    second = s.schedule(1.0)
    assert second.composition() == (("d", 1),) and second.preempted == ["p"]


def test_decode_maximal_runs_one_prefill_even_when_two_are_part_done():
    # With iterations in flight, a and b both got a first chunk (each while the other was
    # in flight); with neither in flight, only the first continues.
    s = make("decode_maximal", budget=8)
    s.add_request(req("a", 12))
    s.add_request(req("b", 20))
    first = s.schedule(0.0)
    second = s.schedule(0.0, busy=frozenset({"a"}))
    assert first.composition() == (("a", 8),) and second.composition() == (("b", 8),)
    for plan in (first, second):
        s.update(plan, RunnerOutput({}, 1.0), 1.0)
    assert s.schedule(1.0).composition() == (("a", 4),)


def test_make_scheduler_by_name():
    limits = SchedulerLimits(32, 4, 512)
    for name in SCHEDULER_REGISTRY:
        assert make_scheduler(name, limits, BlockManager(8, 4)).name == name
    names = ", ".join(SCHEDULER_REGISTRY)
    with pytest.raises(ValueError, match=f"^unknown scheduler 'fifo'; choose from {names}$"):
        make_scheduler("fifo", limits, BlockManager(8, 4))


def test_rejects_requests_that_cannot_fit():
    s = make("sarathi", max_len=64, blocks=8, block_size=4)
    with pytest.raises(RequestRejected, match="context window"):
        s.add_request(req("a", 60, max_tokens=10))
    with pytest.raises(RequestRejected, match="KV blocks"):
        s.add_request(req("b", 30, max_tokens=10))
    with pytest.raises(RequestRejected, match="^the prompt is empty$"):
        s.add_request(req("c", 0))
    s.add_request(req("d", 4))
    with pytest.raises(RequestRejected, match="duplicate"):
        s.add_request(req("d", 4))


def test_abort_frees_blocks_mid_flight():
    s = make("sarathi", budget=8)
    s.add_request(req("a", 30, max_tokens=5))
    plan = s.schedule(0.0)
    assert s.bm.num_free_blocks < s.bm.num_blocks
    s.abort("a")
    s.update(plan, RunnerOutput({}, 1.0), 1.0)  # the in-flight iteration completes harmlessly
    assert s.bm.num_free_blocks == s.bm.num_blocks and not s.has_unfinished()


EOS, STOP = 2, 9


def run_stream(sched, reqs: list[Request], tokens: dict[str, list[int]]) -> list:
    """Drive ``sched`` with an executor that samples ``tokens[rid][i]`` as output token i."""
    for r in reqs:
        sched.add_request(r)
    plans, now = [], 0.0
    while sched.has_unfinished() and len(plans) < 1000:
        plan = sched.schedule(now)
        sampled = {c.request_id: tokens[c.request_id][c.output_index]
                   for c in plan.chunks if c.samples}
        now += 1.0
        sched.update(plan, RunnerOutput(sampled, 1.0), now)
        plans.append(plan)
    assert not sched.has_unfinished()
    return plans


def stream_req(rid, max_tokens=10, **params):
    return Request(rid, [1, 2, 3], SamplingParams(max_tokens=max_tokens, **params), 0.0,
                   eos_token_ids=(EOS,))


def test_stop_conditions():
    s = make("sarathi")
    a = stream_req("a", stop_token_ids=(STOP,))
    b = stream_req("b")  # EOS ends it
    c = stream_req("c", max_tokens=3)  # EOS as the last allowed token: still a stop (vLLM)
    d = stream_req("d", max_tokens=2, stop_token_ids=(STOP,))
    e = stream_req("e", max_tokens=2)
    run_stream(s, [a, b, c, d, e], {"a": [4, STOP, 4], "b": [4, 4, EOS, 4], "c": [4, 4, EOS],
                                    "d": [4, STOP], "e": [4, 4]})
    assert a.status is RequestStatus.FINISHED_STOPPED and a.output_token_ids == [4, STOP]
    assert b.status is RequestStatus.FINISHED_STOPPED and b.output_token_ids == [4, 4, EOS]
    assert c.status is RequestStatus.FINISHED_STOPPED and c.output_token_ids == [4, 4, EOS]
    assert d.status is RequestStatus.FINISHED_STOPPED and e.status is RequestStatus.FINISHED_LENGTH
    assert s.bm.num_free_blocks == s.bm.num_blocks


def test_ignore_eos_generates_through_eos_but_not_through_stop_tokens():
    s = make("sarathi")
    a = stream_req("a", max_tokens=5, ignore_eos=True)
    b = stream_req("b", max_tokens=5, ignore_eos=True, stop_token_ids=(EOS,))
    run_stream(s, [a, b], {"a": [EOS, 4, EOS, 4, 4], "b": [4, EOS, 4, 4, 4]})
    assert a.status is RequestStatus.FINISHED_LENGTH and a.output_token_ids == [EOS, 4, EOS, 4, 4]
    # An explicit stop token stays a stop token.
    assert b.status is RequestStatus.FINISHED_STOPPED and b.output_token_ids == [4, EOS]


@pytest.mark.parametrize(
    "min_tokens,length,status",
    [(0, 1, "stop"), (1, 3, "stop"), (2, 3, "stop"), (3, 5, "stop"), (4, 5, "stop"),
     (5, 8, "length"), (6, 8, "length"), (8, 8, "length")],
)
def test_min_tokens_defers_eos_and_stop_tokens(min_tokens, length, status):
    # As in vLLM, the first min_tokens tokens cannot stop a request (the sampler bans stop
    # tokens there; these tokens are forced, not sampled): the earliest stop is token
    # min_tokens + 1.
    tokens = [EOS, 4, STOP, 4, EOS, 4, 4, 4]
    s = make("sarathi")
    r = stream_req("r", max_tokens=8, min_tokens=min_tokens, stop_token_ids=(STOP,))
    run_stream(s, [r], {"r": tokens})
    assert r.output_token_ids == tokens[:length] and r.finish_reason == status


def test_watermark_holds_admission_but_running_requests_grow_into_it():
    # 10 blocks of 4 tokens; a watermark of 0.3 keeps 3 blocks free at admission.
    s = make("sarathi", budget=64, blocks=10, block_size=4, watermark=0.3)
    s.add_request(req("a", 16, max_tokens=8))  # 4 blocks when admitted, 6 at the end
    s.add_request(req("b", 4, max_tokens=8))  # 1 block when admitted, 3 at the end
    s.add_request(req("c", 12, max_tokens=1))  # 3 more blocks would leave only 2 free
    used = []
    plans = run(s, on_step=lambda p: used.append(s.bm.num_blocks - s.bm.num_free_blocks))
    has_c = [i for i, p in enumerate(plans) if "c" in dict(p.composition())]
    assert plans[0].composition() == (("a", 16), ("b", 4))
    assert has_c == [8], "c is admitted only once a and b (8 iterations) have finished"
    assert max(used) == 9 and s.num_preemptions == 0  # a and b grew into the reserve


def test_watermark_never_blocks_a_request_on_an_empty_cache():
    s = make("vllm", budget=64, blocks=10, block_size=4, watermark=0.3)
    s.add_request(req("a", 26, max_tokens=2))  # 7 blocks: all the cache minus the watermark
    assert s.schedule(0.0).composition() == (("a", 26),)
    with pytest.raises(RequestRejected, match="7 admissible blocks"):
        s.add_request(req("b", 28, max_tokens=2))


def test_abort_a_waiting_request():
    s = make("sarathi", budget=8, max_seqs=1)
    s.add_request(req("a", 4, max_tokens=3))
    s.add_request(req("b", 4, max_tokens=3))
    s.update(s.schedule(0.0), RunnerOutput({"a": 7}, 1.0), 1.0)
    assert s.num_waiting == 1
    b = s.abort("b", 1.5)
    assert b.status is RequestStatus.FINISHED_ABORTED and b.finish_time == 1.5
    assert s.num_waiting == 0 and s.abort("b") is None
    plans = run(s)
    assert all("b" not in dict(p.composition()) for p in plans)
    assert b.output_token_ids == [] and s.bm.table("b") == ()
    assert s.bm.num_free_blocks == s.bm.num_blocks


def test_a_request_preempted_in_this_iteration_is_not_in_its_plan():
    # Two decodes outgrow a 6-block cache; the one preempted is first in the waiting queue,
    # and the budget would let it back in at once.
    s = make("sarathi", budget=5, blocks=6, block_size=4)
    s.add_request(req("a", 8, max_tokens=12))
    s.add_request(req("b", 8, max_tokens=12))
    plans = run(s)
    assert any(p.preempted for p in plans)
    for p in plans:
        assert not set(p.preempted) & {c.request_id for c in p.chunks}


@pytest.mark.parametrize("policy,first", [("sjf", "short"), ("ljf", "long"), ("fcfs", "long")])
def test_queue_policies(policy, first):
    s = make("sarathi", budget=100, max_seqs=1, policy=policy)
    s.add_request(req("long", 50, arrival=0.0))
    s.add_request(req("short", 5, arrival=1.0))
    assert s.schedule(0.0).chunks[0].request_id == first


def test_a_request_that_fits_exactly_is_admitted_and_runs_in_its_blocks():
    """4 + 5 tokens in two blocks of 4: the 9th, sampled last, is never fed back."""
    s = make("sarathi", budget=64, blocks=2, block_size=4)
    a = req("a", 4, max_tokens=5)
    s.add_request(a)
    run(s)
    assert a.output_token_ids == [7] * 5 and a.finish_reason == "length"
    assert s.bm.num_free_blocks == 2


def test_admission_error_says_why_a_request_can_never_run():
    from fluidserve.core.admission import admission_error

    assert admission_error(0, 4, 64, 2, 10) == "the prompt is empty"
    assert admission_error(60, 5, 64, 2, 40) == (
        "prompt (60 tokens) + max_tokens (5) = 65 exceeds the context window of 64 tokens")
    assert admission_error(5, 2, 64, 2, 2) == (
        "request needs 3 KV blocks for 6 tokens (its prompt and all but its last output"
        " token) but the cache has 2 admissible blocks")
    assert admission_error(5, 2, 64, 2, 3) is None  # the 7th token's KV is never computed
    assert admission_error(60, 4, 64, 2, 32) is None


def test_plans_carry_the_budget_they_were_built_under():
    for policy, budget in (("sarathi", 64), ("vllm", 64)):
        s = make_scheduler(policy, SchedulerLimits(budget, 8, 1024), BlockManager(64, 16))
        s.add_request(Request("a", [1] * 10, SamplingParams(max_tokens=4), 0.0))
        assert s.schedule(0.0).token_budget == budget
    s = make_scheduler("orca", SchedulerLimits(64, 8, 1024), BlockManager(64, 16))
    s.add_request(Request("a", [1] * 10, SamplingParams(max_tokens=4), 0.0))
    assert s.schedule(0.0).token_budget is None  # no token budget: whole prompts


def test_queue_windows_group_consecutive_arrivals():
    with pytest.raises(ValueError, match="^queue window must be >= 0$"):
        WaitingQueue("sjf", -1)
    q = WaitingQueue("sjf", 3)
    for i, n in enumerate([30, 20, 10, 25, 5, 15, 1]):
        q.push(Request(str(i), [1] * n, SamplingParams(), float(i)))
    # Windows of three arrivals, each sorted shortest first, in arrival order of windows.
    assert [r.num_prompt_tokens for r in q.ordered()] == [10, 20, 30, 5, 15, 25, 1]


def test_a_scheduler_sorts_its_queue_within_the_configured_windows():
    s = make_scheduler("sarathi", SchedulerLimits(8, 8, 1024, 1, "sjf", queue_window=3),
                       BlockManager(256, 16))
    for i, n in enumerate([30, 20, 10, 25, 5, 15]):
        s.add_request(Request(str(i), [1] * n, SamplingParams(max_tokens=2), float(i)))
    first = s.schedule(0.0)
    assert [c.request_id for c in first.chunks] == ["2"]  # the shortest of the first window


@pytest.mark.parametrize("policy,window", [("fcfs", 0), ("sjf", 0), ("ljf", 7)])
def test_waiting_queue_stays_in_order_through_removals_requeues_and_compaction(policy, window):
    import random

    from fluidserve.core.queue_policy import QUEUE_POLICIES

    rng = random.Random(7)
    q = WaitingQueue(policy, window)
    live: dict[str, tuple] = {}  # id -> (request, arrival seq when queued)
    seq = 0

    def expected():
        def key(item):
            r, s = item
            group = (s - 1) // window if window else 0
            return (r.num_preemptions == 0, group) + QUEUE_POLICIES[policy](r, s)
        return [r.request_id for r, _ in sorted(live.values(), key=key)]

    for i in range(3000):  # well past the compaction threshold
        op = rng.random()
        if op < 0.5 or not live:
            r = req(f"r{i}", rng.randint(1, 50), arrival=float(rng.randint(0, 100)))
            seq += 1
            live[r.request_id] = (r, seq)
            q.push(r)
        elif op < 0.8:  # admit from the head while iterating, as a scheduler does
            for r in q.in_order():
                assert q.remove(r.request_id) is r
                del live[r.request_id]
                if rng.random() < 0.5:
                    break
        elif op < 0.9:  # remove from anywhere (an abort)
            rid = rng.choice(list(live))
            assert q.remove(rid) is live.pop(rid)[0]
        else:  # a preempted request queues again, ahead of every arrival
            rid = rng.choice(list(live))
            r = live[rid][0]
            q.remove(rid)
            r.num_preemptions += 1
            live[rid] = (r, seq)
            q.push(r)
        assert len(q) == len(live)
        if i % 97 == 0:
            assert [r.request_id for r in q.ordered()] == expected()
    assert [r.request_id for r in q.ordered()] == expected()
    assert len(q._sorted) - q._head < 2 * len(live) + 300  # dead entries do not pile up
