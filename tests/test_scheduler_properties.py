"""Scheduler and block-manager invariants under random traffic, for every registered policy.

Hypothesis draws a configuration (token budget, max running requests, KV blocks, block size,
watermark, tile, queue policy, context window, iterations in flight as with pipeline stages)
and a program of operations: add requests, abort a waiting / running / in-flight request,
run iterations. The fake executor samples
from a per-request token pattern that includes EOS and a stop token, so requests end by
EOS, stop token, length, or abort. After every step the whole state is checked; at the end
the engine is drained and every block must be back.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fluidserve.core.block_manager import make_block_manager
from fluidserve.core.scheduler import (
    SCHEDULER_REGISTRY,
    RequestRejected,
    RunnerOutput,
    SchedulerLimits,
    SchedulerOutput,
    make_scheduler,
)
from fluidserve.request import Request, RequestStatus
from fluidserve.sampling_params import SamplingParams

EOS, STOP = 2, 9
TOKENS = (5, 6, 7, 8, EOS, STOP)

# How each policy bounds the tokens of an iteration (read from the policies' code):
# chunked policies never exceed the budget with prefill work; whole-prompt policies under a
# budget may exceed it only with the first prefill of an iteration, granted whole so that a
# prompt longer than the budget cannot starve; the others have no budget at all. Decodes are
# bounded by max_num_seqs only.
# sarathi_slack without an iteration-time predictor (a bare scheduler) is stall-free batching;
# its slack rule has its own property test (test_slack.py).
CHUNKED = {"sarathi", "sarathi_slack", "decode_maximal", "chunked_only"}
WHOLE_FIRST_PREFILL = {"vllm", "hybrid_only"}
NO_BUDGET = {"orca", "faster_transformer"}
NEVER_MIXED = {"vllm", "chunked_only"}  # an iteration is prefill-only or decode-only
DECODES_NEVER_WAIT = {"sarathi", "sarathi_slack", "orca", "hybrid_only", "decode_maximal",
                      "faster_transformer"}
QUEUE_KEYS = {
    "fcfs": lambda r: r.arrival_time,
    "sjf": lambda r: r.num_prompt_tokens,
    "ljf": lambda r: -r.num_prompt_tokens,
}


@dataclass(frozen=True)
class Spec:
    """A request to add: its shape and the tokens the fake executor samples for it."""

    prompt_len: int
    max_tokens: int
    min_tokens: int
    ignore_eos: bool
    stop_on: bool  # STOP is a stop token for this request
    pattern: tuple[int, ...]

    def token(self, index: int) -> int:
        return self.pattern[index % len(self.pattern)]

    def expected_end(self) -> tuple[int, RequestStatus]:
        """(output length, status) when nothing aborts it: the reference stop rule (a stop
        token past min_tokens stops it, the last allowed one too, as vLLM checks them)."""
        for n in range(1, self.max_tokens + 1):
            tok = self.token(n - 1)
            stops = (self.stop_on and tok == STOP) or (not self.ignore_eos and tok == EOS)
            if n > self.min_tokens and stops:
                return n, RequestStatus.FINISHED_STOPPED
            if n == self.max_tokens:
                return n, RequestStatus.FINISHED_LENGTH
        raise AssertionError("unreachable")


@st.composite
def specs(draw) -> Spec:
    max_tokens = draw(st.integers(1, 24))
    return Spec(
        prompt_len=draw(st.integers(1, 30)),
        max_tokens=max_tokens,
        min_tokens=draw(st.integers(0, max_tokens)),
        ignore_eos=draw(st.booleans()),
        stop_on=draw(st.booleans()),
        pattern=tuple(draw(st.lists(st.sampled_from(TOKENS), min_size=1, max_size=8))),
    )


OPS = ["add"] * 4 + ["step"] * 3 + ["abort_waiting", "abort_running", "abort_in_flight"]


@st.composite
def operation(draw) -> tuple:
    op = draw(st.sampled_from(OPS))
    if op == "add":  # a burst of arrivals
        return op, draw(st.lists(specs(), min_size=1, max_size=4))
    return op, draw(st.integers(1, 4) if op == "step" else st.integers(0, 99))


@st.composite
def scenarios(draw) -> tuple[dict, list]:
    """A configuration and a program of operations."""
    program = draw(st.lists(operation(), min_size=4, max_size=60))
    sizes = [s.prompt_len + s.max_tokens for op, arg in program if op == "add" for s in arg]
    # The KV cache holds from the largest request alone to all of them at once, so most
    # programs run short of blocks: admission, preemption and recompute get exercised.
    capacity = draw(st.integers(max(sizes, default=1), max(sum(sizes), 1)))
    block_size = draw(st.sampled_from([1, 2, 4, 8]))
    # Small budgets keep requests part-way through their prefills for many iterations.
    budget = draw(st.one_of(st.integers(1, 12), st.integers(13, 48)))
    cfg = dict(
        budget=budget,
        max_num_seqs=draw(st.integers(1, 8)),
        num_blocks=-(-capacity // block_size),
        block_size=block_size,
        watermark=draw(st.sampled_from([0.0, 0.0, 0.05, 0.1, 0.25])),
        tile=draw(st.integers(1, min(4, budget))),
        policy=draw(st.sampled_from(["fcfs", "sjf", "ljf"])),
        max_model_len=draw(st.sampled_from([48, 4096, 4096])),
        depth=draw(st.sampled_from([1, 1, 2, 3])),  # iterations in flight (pipeline stages)
        # Every prompt is the same token repeated: with prefix caching most requests start
        # with blocks another computed, or their own from before a preemption.
        prefix_caching=draw(st.booleans()),
    )
    return cfg, program


class Harness:
    """Drives one scheduler with a fake executor and checks every invariant after each step."""

    def __init__(self, name: str, cfg: dict) -> None:
        self.name, self.cfg = name, cfg
        self.bm = make_block_manager(cfg["num_blocks"], cfg["block_size"], cfg["watermark"],
                                     cfg["prefix_caching"])
        limits = SchedulerLimits(cfg["budget"], cfg["max_num_seqs"], cfg["max_model_len"],
                                 cfg["tile"], cfg["policy"])
        self.s = make_scheduler(name, limits, self.bm)
        self.specs: dict[str, Spec] = {}
        self.reqs: dict[str, Request] = {}
        self.aborted: set[str] = set()
        self.ended: dict[str, tuple] = {}  # request id -> its final state, frozen
        self.flight: deque[SchedulerOutput] = deque()  # scheduled, not yet updated
        self.first_scheduled: dict[str, float] = {}
        self.iterations = 0
        self.preempted: dict[str, int] = {}  # request id -> times preempted
        self.now = 0.0

    # ---------------------------------------------------------------- operations
    def add(self, spec: Spec) -> None:
        rid = f"r{len(self.specs)}"
        params = SamplingParams(max_tokens=spec.max_tokens, min_tokens=spec.min_tokens,
                                ignore_eos=spec.ignore_eos,
                                stop_token_ids=(STOP,) if spec.stop_on else ())
        req = Request(rid, [3] * spec.prompt_len, params, self.now, eos_token_ids=(EOS,))
        total = spec.prompt_len + spec.max_tokens
        reserve = int(self.cfg["watermark"] * self.cfg["num_blocks"])
        # (KV for all but the last output token: it is sampled, never fed back)
        fits = (total <= self.cfg["max_model_len"] and math.ceil(
            (total - 1) / self.cfg["block_size"]) <= self.cfg["num_blocks"] - reserve)
        try:
            self.s.add_request(req)
        except RequestRejected:
            assert not fits, "a request that fits was rejected"
            assert rid not in self.s.requests and rid not in self.s.waiting
            return
        assert fits, "a request that can never run was accepted"
        self.specs[rid], self.reqs[rid] = spec, req

    def abort(self, kind: str, pick: int) -> None:
        if kind == "abort_waiting":
            pool = [r.request_id for r in self.s.waiting.ordered()]
        elif kind == "abort_running":
            pool = [r.request_id for r in self.s.running]
        else:  # the client goes away while an iteration holding its request runs
            pool = sorted({c.request_id for p in self.flight for c in p.chunks} - self.aborted)
        if not pool:
            return
        rid = pool[pick % len(pool)]
        self.now += 0.25
        assert self.s.abort(rid, self.now) is self.reqs[rid]
        self.aborted.add(rid)
        assert self.reqs[rid].status is RequestStatus.FINISHED_ABORTED
        assert self.reqs[rid].finish_time == self.now
        assert self.s.abort(rid, self.now) is None, "an ended request was aborted again"
        self.check_state()

    def step(self, abort_pick: int | None = None) -> None:
        """Schedule an iteration; complete the oldest in flight once the pipeline is full."""
        busy = frozenset(c.request_id for p in self.flight for c in p.chunks)
        before = {rid: r.status for rid, r in self.s.requests.items()}
        queue = [r.request_id for r in self.s.waiting.ordered()]
        running = [r for r in self.s.running if r.request_id not in busy]
        waits = {r.request_id for r in running if not (r.is_decode and self.name in NEVER_MIXED)}
        plan = self.s.schedule(self.now, busy)
        self.iterations += 1
        assert plan.iteration == self.iterations
        self.check_plan(plan, before, busy)
        admitted = [rid for rid in queue if self.reqs[rid].status is RequestStatus.RUNNING]
        assert admitted == queue[: len(admitted)], "admitted out of queue order"
        if admitted:  # only when every running request got its share: memory is not short
            assert waits <= {c.request_id for c in plan.chunks}, "admitted while one waited"
        self.check_state()
        if plan.chunks:
            self.flight.append(plan)
        if abort_pick is not None:
            self.abort("abort_in_flight", abort_pick)
        if self.flight and (len(self.flight) >= self.cfg["depth"] or not plan.chunks):
            self.complete(self.flight.popleft())

    def complete(self, plan: SchedulerOutput) -> None:
        sampled = {c.request_id: self.specs[c.request_id].token(c.output_index)
                   for c in plan.chunks if c.samples}
        self.now += 1.0
        touched = self.s.update(plan, RunnerOutput(sampled, 1.0), self.now)
        assert {r.request_id for r in touched} <= set(sampled) - self.aborted
        for c in plan.chunks:  # every chunk of a live request advanced it
            req = self.reqs[c.request_id]
            if c.request_id in self.aborted:
                continue
            assert req.num_computed_tokens == c.context_len, "a chunk's work was dropped"
            if c.samples:
                assert req in touched and len(req.output_token_ids) == c.output_index + 1
                assert req.token_times[-1] == self.now
            if req.status.finished:
                assert req.finish_time == self.now
        self.check_state()

    def drain(self) -> None:
        for _ in range(5000):
            if not (self.s.has_unfinished() or self.flight):
                break
            self.step()
        assert not self.s.has_unfinished(), "the scheduler stopped making progress"
        assert self.bm.num_free_blocks == self.bm.num_blocks, "KV blocks leaked"
        self.bm.check_invariants()
        for rid, req in self.reqs.items():
            assert req.status.finished, f"{rid} never ended"
            if rid not in self.aborted:
                n, status = self.specs[rid].expected_end()
                assert (len(req.output_token_ids), req.status) == (n, status), rid
                assert len(req.token_times) == n

    # ---------------------------------------------------------------- invariants
    def check_plan(self, plan: SchedulerOutput, before: dict, busy: frozenset[str]) -> None:
        s, cfg = self.s, self.cfg
        ids = [c.request_id for c in plan.chunks]
        assert len(ids) == len(set(ids)), "a request is twice in one plan"
        assert not set(plan.preempted) & set(ids), "a plan holds a request it preempted"
        assert not (set(ids) | set(plan.preempted)) & busy, "an in-flight request was touched"
        if s.has_unfinished() and not busy:
            assert plan.chunks, "work is waiting but the iteration is empty"
        assert not set(ids) & (self.aborted | set(self.ended)), "a plan holds an ended request"
        for rid in plan.preempted:
            req = self.reqs[rid]
            assert req.status is RequestStatus.WAITING and req.num_computed_tokens == 0
            assert rid in s.waiting and self.bm.table(rid) == ()
            self.preempted[rid] = self.preempted.get(rid, 0) + 1
        for rid, req in self.reqs.items():
            assert req.num_preemptions == self.preempted.get(rid, 0)
        assert s.num_preemptions == sum(self.preempted.values())
        # The blocks a chunk writes are its own (others may share the full blocks before).
        bs = self.bm.block_size
        tables = [set(c.block_table[c.start // bs:]) for c in plan.chunks]
        assert sum(map(len, tables)) == len(set().union(*tables)), "block tables overlap"
        if self.bm.prefix_caching:
            for c in plan.chunks:
                written = c.block_table[c.start // bs:]
                assert all(self.bm._refs[b] == 1 for b in written), "a shared block is written"
                assert not set(written) & set(self.bm._key), "a cached block is written"
        for c in plan.chunks:
            req = self.reqs[c.request_id]
            assert req.status is RequestStatus.RUNNING and req in s.running
            assert c.start == req.num_computed_tokens and c.num_tokens >= 1
            assert c.token_ids == tuple(req.token_slice(c.start, c.context_len))
            assert c.samples == (c.context_len == req.num_tokens)
            # (A preempted request readmitted with all but its last token cached computes it
            # in a prefill chunk, its first.)
            assert c.is_decode == (req.is_decode and c.num_tokens == 1) or (
                not c.is_decode and before[c.request_id] is RequestStatus.WAITING
                and c.start > 0 and self.bm.prefix_caching)
            assert c.output_index == len(req.output_token_ids)
            assert c.params is req.params and c.seed == req.seed
            # Exactly the blocks its tokens need: no block is handed out early.
            assert len(c.block_table) == self.bm.blocks_for(c.context_len)
            assert c.block_table == self.bm.table(c.request_id)
            first = self.first_scheduled.setdefault(c.request_id, self.now)
            assert req.first_scheduled_time == first, "first scheduled time lost or moved"
        assert len(s.running) <= cfg["max_num_seqs"] and len(ids) <= cfg["max_num_seqs"]
        self.check_budget(plan)
        if not busy and (self.name in DECODES_NEVER_WAIT or not plan.num_prefill_tokens):
            # Stall-free and request-level batching run every running decode each iteration
            # (prefill-first ones in every iteration without prefills).
            decodes = {r.request_id for r in s.running if r.is_decode}
            # (or just admitted with all but its last token cached: a prefill chunk samples it)
            served = {c.request_id for c in plan.chunks if c.is_decode or c.samples}
            assert decodes <= served, "a decode stalled"
        running = RequestStatus.RUNNING
        admitted = [rid for rid, status in before.items()
                    if status is RequestStatus.WAITING and self.reqs[rid].status is running]
        if admitted:  # admission keeps the watermark free
            assert self.bm.num_free_blocks >= self.bm.watermark_blocks, "watermark ignored"
        if admitted and self.name == "faster_transformer":  # a batch runs to completion
            assert running not in before.values(), "admitted while a batch was running"

    def check_budget(self, plan: SchedulerOutput) -> None:
        budget, decodes = self.cfg["budget"], plan.num_decode_tokens
        prefills = [c for c in plan.chunks if not c.is_decode]
        assert decodes <= self.cfg["max_num_seqs"]
        if self.name in NEVER_MIXED:
            assert not (decodes and prefills), "a prefill-first iteration mixed in decodes"
        if self.name == "decode_maximal":
            assert len(prefills) <= 1
        if self.name in NO_BUDGET:
            return
        room = max(0, budget - decodes)
        if self.name in CHUNKED:
            # A chunk that stops short of the request's end was cut by the budget: it took
            # all the budget left, rounded down to the tile (less than a tile: all of it).
            for c in prefills:
                if not c.samples:
                    assert c.num_tokens % self.cfg["tile"] == 0 or \
                        c.num_tokens < self.cfg["tile"], "a chunk ignored the tile"
                    assert budget - plan.num_tokens < self.cfg["tile"], "budget left unused"
        if self.name in CHUNKED or plan.num_prefill_tokens <= room:
            assert plan.num_prefill_tokens <= room, "prefill work exceeds the token budget"
            return
        # Over budget: only a lone first prefill, granted whole, with budget left for it.
        assert len(prefills) == 1 and prefills[0].samples and decodes < budget

    def check_state(self) -> None:
        s, bm = self.s, self.bm
        queue = s.waiting.ordered()
        # Preempted requests first (recompute never starves), then the queue policy's order.
        fresh = [r for r in queue if not r.num_preemptions]
        assert queue[len(queue) - len(fresh):] == fresh, "a preempted request queues behind"
        keys = [QUEUE_KEYS[self.cfg["policy"]](r) for r in fresh]
        assert keys == sorted(keys), f"waiting queue not in {self.cfg['policy']} order"
        waiting = {r.request_id for r in queue}
        running = [r.request_id for r in s.running]
        assert len(running) == len(set(running)) and not waiting & set(running)
        assert waiting | set(running) == set(s.requests), "a live request is lost or ended twice"
        computed = {}
        for rid, req in self.reqs.items():
            spec = self.specs[rid]
            out = req.output_token_ids
            assert out == [spec.token(i) for i in range(len(out))], "tokens lost or reordered"
            if rid in waiting:
                assert req.status is RequestStatus.WAITING and bm.table(rid) == ()
            elif rid in s.requests:
                assert req.status is RequestStatus.RUNNING
                computed[rid] = req.num_computed_tokens
                assert req.num_computed_tokens <= req.num_tokens
            else:
                assert req.status.finished and bm.table(rid) == ()
                final = (req.status, req.finish_time, tuple(out), req.num_computed_tokens)
                assert self.ended.setdefault(rid, final) == final, f"{rid} ended twice"
            assert len(out) <= spec.expected_end()[0], f"{rid} ran past its stop"
            if rid not in self.aborted and not req.status.finished:
                assert len(out) < spec.expected_end()[0], f"{rid} missed its stop"
        bm.check_invariants(computed)
        owned = {b for rid in running for b in bm.table(rid)}
        assert len(owned) == bm.num_blocks - bm.num_free_blocks
        if bm.prefix_caching:  # a cached block holds the tokens its key says, KV computed
            for rid in running:
                req, table = self.reqs[rid], bm.table(rid)
                for i, b in enumerate(table[:req.num_computed_tokens // bm.block_size]):
                    if b in bm._key:
                        assert bm._key[b][1] == tuple(req.token_slice(
                            i * bm.block_size, (i + 1) * bm.block_size)), "a block's key lies"


@pytest.mark.parametrize("name", sorted(SCHEDULER_REGISTRY))
@given(scenario=scenarios())
def test_scheduler_invariants_under_random_traffic(name, scenario):
    cfg, program = scenario
    h = Harness(name, cfg)
    for op, arg in program:
        if op == "add":
            for spec in arg:
                h.add(spec)
        elif op == "step":
            for _ in range(arg):
                h.step()
        elif op == "abort_in_flight":
            h.step(abort_pick=arg)
        else:
            h.abort(op, arg)
    h.drain()


def test_every_registered_policy_has_a_budget_rule():
    assert set(SCHEDULER_REGISTRY) == CHUNKED | WHOLE_FIRST_PREFILL | NO_BUDGET
