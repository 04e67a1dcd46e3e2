"""sarathi_slack: no decode misses a deadline that plain stall-free batching would have met,
while decodes with banked slack lend their turn to the prefill."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from fluidserve.core.block_manager import BlockManager
from fluidserve.core.scheduler import RunnerOutput, SchedulerLimits, make_scheduler
from fluidserve.engine.budget import AdaptiveBudget
from fluidserve.request import Request
from fluidserve.sampling_params import SamplingParams


def predictor(base: float, per_decode: float, per_token: float, per_ctx: float):
    def predict(ctxs: list[int], chunk: int, prefix: int) -> float:
        return (base + per_decode * len(ctxs) + per_ctx * sum(ctxs) + per_token * chunk
                + per_ctx * chunk * prefix / 64)
    return predict


def setup(policy: str, contexts: list[int], prompt: int, slo: float, predict,
          max_seqs: int = 256):
    """A scheduler with one running decode per context and one waiting prompt."""
    sched = make_scheduler(policy, SchedulerLimits(8192, max_seqs, 1 << 16, 1, "fcfs"),
                           BlockManager(4096, 16))
    for i, ctx in enumerate(contexts):
        req = Request(f"d{i}", [3] * ctx, SamplingParams(max_tokens=50), 0.0)
        sched.add_request(req)
    # Prefill every decode in one go (chunk cap off), sampling their first token.
    plan = sched.schedule(0.0)
    sched.update(plan, RunnerOutput({c.request_id: 5 for c in plan.chunks if c.samples}, 0.0),
                 0.0)
    assert all(r.is_decode for r in sched.running)
    sched.budget_policy = AdaptiveBudget(predict, slo, 0.1)
    sched.add_request(Request("p", [4] * prompt, SamplingParams(max_tokens=5), 0.0))
    return sched


@settings(max_examples=150)
@given(
    contexts=st.lists(st.integers(1, 400), min_size=0, max_size=12),
    offsets=st.lists(st.floats(-0.05, 0.6), min_size=12, max_size=12),
    prompt=st.integers(1, 3000),
    slo=st.floats(0.02, 0.3),
    coef=st.tuples(st.floats(0.001, 0.01), st.floats(0.0, 0.002), st.floats(1e-5, 2e-4),
                   st.floats(0.0, 1e-6)),
)
def test_no_decode_misses_a_deadline_plain_stall_free_would_meet(contexts, offsets, prompt,
                                                                  slo, coef):
    predict = predictor(*coef)
    now = 1.0
    plain = setup("sarathi", contexts, prompt, slo, predict)
    slack = setup("sarathi_slack", contexts, prompt, slo, predict)
    slack.deadline = {f"d{i}": now + offsets[i] for i in range(len(contexts))}
    p_plan, s_plan = plain.schedule(now), slack.schedule(now)

    def time_of(plan):
        ctxs = [c.start + 1 for c in plan.chunks if c.is_decode]
        pre = [c for c in plan.chunks if not c.is_decode]
        chunk, prefix = (len(pre[0].token_ids), pre[0].start) if pre else (0, 0)
        return predict(ctxs, chunk, prefix)

    t_plain, t_slack = time_of(p_plan), time_of(s_plan)
    in_slack = {c.request_id for c in s_plan.chunks}
    target = slack.budget_policy.target
    for rid, deadline in slack.deadline.items():
        if now + t_plain > deadline:
            continue  # plain stall-free misses it too
        if rid in in_slack:
            assert now + t_slack <= deadline + 1e-12, rid
        else:  # skipped: its token comes by the end of the next iteration, at most target
            assert now + t_slack + target <= deadline + 1e-12, rid
    # It never gives the prefill less than plain stall-free does.
    pre = lambda plan: sum(len(c.token_ids) for c in plan.chunks if not c.is_decode)  # noqa: E731
    assert pre(s_plan) >= pre(p_plan)


def test_slack_lends_decode_turns_to_the_prefill():
    predict = predictor(0.005, 0.001, 1e-4, 0.0)
    sched = setup("sarathi_slack", [50] * 10, 3000, 0.1, predict)
    plain = setup("sarathi", [50] * 10, 3000, 0.1, predict)
    sched.deadline = {f"d{i}": 1.0 + 0.5 for i in range(10)}  # far away: banked slack
    s_plan, p_plan = sched.schedule(1.0), plain.schedule(1.0)
    assert not any(c.is_decode for c in s_plan.chunks) and sched.num_skipped == 10
    assert s_plan.num_prefill_tokens > p_plan.num_prefill_tokens


def test_no_turn_is_lent_when_the_prefill_cannot_start():
    # max_num_seqs is reached: the waiting prompt cannot be admitted, so skipping the decodes
    # would leave an empty iteration (and stall an engine with nothing in flight).
    predict = predictor(0.005, 0.001, 1e-4, 0.0)
    sched = setup("sarathi_slack", [50] * 4, 3000, 0.1, predict, max_seqs=4)
    sched.deadline = {f"d{i}": 1.5 for i in range(4)}
    plan = sched.schedule(1.0)
    assert sorted(c.request_id for c in plan.chunks) == [f"d{i}" for i in range(4)]
    assert all(c.is_decode and c.num_tokens == 1 for c in plan.chunks)
    assert sched.num_skipped == 0
    # The budget it reports (telemetry, the /metrics gauge) is the plain iteration's, not
    # the one sized for the prefill that could not start.
    plain = setup("sarathi", [50] * 4, 3000, 0.1, predict, max_seqs=4).schedule(1.0)
    assert plan.token_budget == sched.budget_policy.last == plain.token_budget


def run(sched, now: float, end: float):
    """Schedule at ``now``, finish the iteration at ``end`` (every sampled token is 5)."""
    plan = sched.schedule(now)
    sched.update(plan, RunnerOutput({c.request_id: 5 for c in plan.chunks if c.samples}, 0.0),
                 end)
    return plan


def test_deadlines_follow_etalon_met_carries_slack_missed_rebases_finished_forgets():
    predict = predictor(0.005, 0.001, 1e-4, 0.0)
    sched = setup("sarathi_slack", [50, 60], 20, 0.1, predict)
    # "e" ends at its first token; its update comes before d0's and d1's in the same plan.
    sched.add_request(Request("e", [4] * 3, SamplingParams(max_tokens=1), 0.0))
    run(sched, 1.0, 1.02)  # first tokens (d0, d1 decode; p and e get their first token)
    first = 1.02 + 0.1
    assert sched.deadline == {"d0": first, "d1": first, "p": first}
    run(sched, 1.02, first)  # exactly on the deadline: met, the slack carries forward
    assert sched.deadline == {"d0": first + 0.1, "d1": first + 0.1, "p": first + 0.1}
    run(sched, first, 1.30)  # late: re-based on the token
    late = 1.30 + 0.1
    assert sched.deadline == {"d0": late, "d1": late, "p": late}
    run(sched, 1.30, 1.33)  # early: the slack carries forward
    assert sched.deadline == {"d0": late + 0.1, "d1": late + 0.1, "p": late + 0.1}
    # d0 ends at its next token, before d1 in the same plan (p ends too, at its fifth):
    # their deadlines go, d1's still moves.
    d0 = sched.requests["d0"]
    d0.params = SamplingParams(max_tokens=len(d0.output_token_ids) + 1)
    run(sched, 1.33, 1.36)
    assert sched.deadline == {"d1": late + 0.1 + 0.1}


def test_the_skip_rule_two_target_iterations_away_and_the_plan_it_makes():
    predict = predictor(0.005, 0.001, 1e-4, 0.0)
    sched = setup("sarathi_slack", [50] * 4, 3000, 0.1, predict)
    now = 1.0
    target = sched.budget_policy.target
    sched.deadline = {"d0": now + 2 * target,  # exactly two iterations away: lends its turn
                      "d1": now + 2 * target - 1e-9,  # just inside: kept
                      "d3": now + 1.0}  # far: lends its turn; d2 has no deadline yet: kept
    plan = sched.schedule(now)
    decodes = [c for c in plan.chunks if c.is_decode]
    assert sorted(c.request_id for c in decodes) == ["d1", "d2"]
    assert all(len(c.token_ids) == 1 for c in decodes)
    prefill = [c for c in plan.chunks if not c.is_decode]
    assert [c.request_id for c in prefill] == ["p"]
    assert sched.num_skipped == 2
    pol = sched.budget_policy
    assert plan.num_tokens == pol.last == 2 + len(prefill[0].token_ids)
    # The chunk is the largest that fits the kept decodes' deadlines and the target.
    kept = [51, 51]
    chunk = len(prefill[0].token_ids)
    assert predict(kept, chunk, 0) <= target < predict(kept, chunk + 1, 0)
    assert sched.requests["p"].first_scheduled_time == now
    # Lent turns add up over iterations.
    sched.update(plan, RunnerOutput({c.request_id: 5 for c in plan.chunks if c.samples}, 0.0),
                 now + 0.05)
    sched.deadline.update(d0=now + 1.0, d1=now + 0.06, d2=now + 0.06, d3=now + 1.0)
    sched.schedule(now + 0.05)
    assert sched.num_skipped == 4


def test_a_kept_decode_bounds_the_chunk_when_plain_batching_meets_its_deadline():
    """A short prompt leaves the plain iteration well under the target; a kept decode whose
    deadline lies between the plain iteration's end and the target caps the slack chunk."""
    predict = predictor(0.005, 0.001, 1e-4, 0.0)
    now = 1.0
    sched = setup("sarathi_slack", [50] * 6, 3000, 0.1, predict)
    plain = setup("sarathi", [50] * 6, 3000, 0.1, predict)
    # Plain stall-free: 6 decodes and a chunk up to the target.
    p_plan = plain.schedule(now)
    t_plain = predict([51] * 6, p_plan.num_prefill_tokens, 0)
    deadline = now + t_plain + 0.002  # plain meets it, barely
    sched.deadline = {"d0": deadline} | {f"d{i}": now + 1.0 for i in range(1, 6)}
    s_plan = sched.schedule(now)
    assert [c.request_id for c in s_plan.chunks if c.is_decode] == ["d0"]
    t_slack = predict([51], s_plan.num_prefill_tokens, 0)
    assert now + t_slack <= deadline
    assert s_plan.num_prefill_tokens > p_plan.num_prefill_tokens


def test_nothing_is_lent_without_a_prefill_to_lend_to():
    predict = predictor(0.005, 0.001, 1e-4, 0.0)
    sched = setup("sarathi_slack", [50] * 3, 10, 0.1, predict)
    run(sched, 1.0, 1.01)  # the short prompt is prefilled whole: only decodes are left
    sched.deadline = {rid: 2.0 for rid in sched.deadline}
    plan = sched.schedule(1.01)
    assert sorted(c.request_id for c in plan.chunks) == ["d0", "d1", "d2", "p"]
    assert sched.num_skipped == 0


def test_auto_budget_is_asked_with_the_decodes_contexts_and_the_next_prefill_prefix():
    """--token-budget auto prices the iteration it will build: each decode reads its context
    plus the new token, and the chunk continues the first part-done prefill."""
    calls = []

    def policy(ctxs: list[int], prefix: int) -> int:
        calls.append((sorted(ctxs), prefix))
        return len(ctxs) + 16

    sched = make_scheduler("sarathi", SchedulerLimits(8192, 64, 1 << 16, 1, "fcfs"),
                           BlockManager(4096, 16))
    sched.add_request(Request("d", [3] * 20, SamplingParams(max_tokens=50), 0.0))
    run(sched, 0.0, 0.1)  # d decodes from now on, at 21 tokens of context
    sched.budget_policy = policy
    sched.add_request(Request("p", [4] * 100, SamplingParams(max_tokens=5), 0.0))
    assert calls == [] and run(sched, 0.1, 0.2).num_prefill_tokens == 16
    assert calls == [([21], 0)]  # p has nothing cached yet
    plan = run(sched, 0.2, 0.3)
    assert calls[-1] == ([22], 16) and plan.num_tokens == 17  # d's context grew by one
    # A decode in flight in another micro-batch is not the prefill the chunk continues.
    calls.clear()
    sched.schedule(0.3, frozenset({"d"}))
    assert calls == [([], sched.requests["p"].num_computed_tokens)]
    # Without a part-done prefill the prefix is 0.
    while sched.requests["p"].is_prefill:
        run(sched, 0.3, 0.4)
    assert all(r.is_decode for r in sched.running)
    want = sorted(r.num_computed_tokens + 1 for r in sched.running)
    calls.clear()
    run(sched, 0.4, 0.5)
    assert calls == [(want, 0)]


def dyadic(base: int, per_decode: int, per_token: int):
    """Times in units of 2**-13 s: sums and differences are exact in floating point."""
    return predictor(base / 8192, per_decode / 8192, per_token / 8192, 0.0)


def test_kept_deadlines_met_by_plain_batching_bound_the_chunk_exactly():
    """A kept decode due exactly when the plain iteration ends caps the slack iteration
    there (a decode is worth 8.75 prefill tokens, so the cap and the target differ by one
    token); one that plain batching misses anyway does not cap it."""
    predict = dyadic(32, 8.75, 1)
    now = 0.5
    plain = setup("sarathi", [50] * 6, 3000, 0.1, predict)
    p_plan = plain.schedule(now)
    t_plain = predict([51] * 6, p_plan.num_prefill_tokens, 0)
    target = plain.budget_policy.target
    for deadline, limit in ((now + t_plain, t_plain), (now + t_plain - 0.01, target)):
        sched = setup("sarathi_slack", [50] * 6, 3000, 0.1, predict)
        sched.deadline = {"d0": deadline} | {f"d{i}": now + 1.0 for i in range(1, 6)}
        s_plan = sched.schedule(now)
        assert [c.request_id for c in s_plan.chunks if c.is_decode] == ["d0"]
        chunk = s_plan.num_prefill_tokens
        assert predict([51], chunk, 0) <= limit < predict([51], chunk + 1, 0)
    assert predict([51], chunk, 0) > t_plain  # the two cases do differ


def test_decodes_that_cost_nothing_are_not_skipped_and_small_gains_are_taken():
    # Free decodes: skipping them buys no prefill token, so nobody lends a turn.
    sched = setup("sarathi_slack", [50] * 4, 3000, 0.1, dyadic(32, 0, 1))
    sched.deadline = {f"d{i}": 2.0 for i in range(4)}
    plan = sched.schedule(1.0)
    assert sum(c.is_decode for c in plan.chunks) == 4 and sched.num_skipped == 0
    # Decodes worth one prefill token each: lending two turns buys two tokens, taken.
    sched = setup("sarathi_slack", [50] * 4, 3000, 0.1, dyadic(32, 1, 1))
    plain = setup("sarathi", [50] * 4, 3000, 0.1, dyadic(32, 1, 1))
    sched.deadline = {"d0": 2.0, "d1": 2.0}
    plan, p_plan = sched.schedule(1.0), plain.schedule(1.0)
    assert sched.num_skipped == 2
    assert plan.num_prefill_tokens == p_plan.num_prefill_tokens + 2


def test_contexts_priced_are_the_decodes_next_tokens_with_and_without_lending():
    # Attention grows with context: being off by one token of context moves the chunk.
    predict = predictor(0.005, 0.001, 1e-4, 5e-5)
    for far in (0, 2):  # nobody lends / d2 and d3 lend their turns
        sched = setup("sarathi_slack", [50, 60, 70, 80], 3000, 0.1, predict)
        sched.deadline = {f"d{i}": 1.0 + (1.0 if i >= 4 - far else 0.05) for i in range(4)}
        plan = sched.schedule(1.0)
        ctxs = sorted(c.start + 1 for c in plan.chunks if c.is_decode)
        assert ctxs == [51, 61, 71, 81][:4 - far]
        chunk, target = plan.num_prefill_tokens, sched.budget_policy.target
        assert predict(ctxs, chunk, 0) <= target < predict(ctxs, chunk + 1, 0)


def test_nothing_is_lent_when_the_slo_is_out_of_reach():
    # Four decodes alone take 0.105 s > the 0.09 s target (a prefill alone would fit): every
    # decode keeps its turn.
    sched = setup("sarathi_slack", [50] * 4, 3000, 0.1, predictor(0.005, 0.025, 1e-4, 0.0))
    sched.deadline = {f"d{i}": 5.0 for i in range(4)}
    plan = sched.schedule(1.0)
    assert not sched.budget_policy.reachable
    assert sum(c.is_decode for c in plan.chunks) == 4 and sched.num_skipped == 0


def test_a_request_that_ends_outside_an_update_leaves_no_deadline_or_lent_turn_behind():
    predict = predictor(0.005, 0.001, 1e-4, 0.0)
    sched = setup("sarathi_slack", [50] * 3, 3000, 0.1, predict)
    run(sched, 1.0, 1.02)
    assert set(sched.deadline) == {"d0", "d1", "d2"}
    sched.deadline.update({f"d{i}": 5.0 for i in range(3)})  # banked slack: all lend a turn
    plan = sched.schedule(1.02)
    assert sched.lent == {"d0", "d1", "d2"} and not any(c.is_decode for c in plan.chunks)
    sched.abort("d1", 1.03)  # a client went away while its request had lent its turn
    assert "d1" not in sched.deadline and "d1" not in sched.lent
    sched.update(plan, RunnerOutput({c.request_id: 5 for c in plan.chunks if c.samples}, 0.0),
                 1.1)
    sched.deadline.update({"d0": 1.15, "d2": 1.15})  # now due: no turn to lend
    plan = sched.schedule(1.1)
    assert {"d0", "d2"} <= {c.request_id for c in plan.chunks if c.is_decode}
    sched.update(plan, RunnerOutput({c.request_id: 5 for c in plan.chunks if c.samples}, 0.0),
                 1.2)
    assert sched.lent == set()  # their tokens came: the turns are repaid


def test_a_decode_lending_its_turn_is_never_evicted_for_the_prefill():
    """K (due soon) decodes, S (banked slack) lends its turn, and R, an earlier prefill, needs
    blocks the cache does not have. Plain stall-free batching would evict nothing that
    decodes; a lent turn must not make S the victim (it was preempted and then put back into
    the plan as a decode, with an empty block table, writing into another request's KV)."""
    bm = BlockManager(12, 4)  # R's 30 tokens fit when it is admitted, not beside the decodes
    sched = make_scheduler("sarathi_slack", SchedulerLimits(20, 8, 4096, 8, "fcfs"), bm)
    reqs = [Request("K", [3] * 8, SamplingParams(max_tokens=5), 0.0),
            Request("R", [3] * 30, SamplingParams(max_tokens=1), 0.0),
            Request("S", [3] * 4, SamplingParams(max_tokens=5), 0.0)]
    for r in reqs:
        sched.add_request(r)
    plan = sched.schedule(0.0)  # K and S prefill whole, R its first chunk
    sched.update(plan, RunnerOutput({c.request_id: 5 for c in plan.chunks if c.samples}, 0.0),
                 1.0)
    sched.budget_policy = AdaptiveBudget(predictor(0.005, 0.001, 1e-4, 0.0), 0.1, 0.1)
    sched.deadline = {"K": 1.01, "S": 1.5}
    plan = sched.schedule(1.0)
    assert "S" not in plan.preempted and reqs[2] in sched.running
    for c in plan.chunks:
        req = sched.requests[c.request_id]
        assert req in sched.running and c.start == req.num_computed_tokens
        assert len(c.block_table) * 4 >= c.start + len(c.token_ids), c
    sched.bm.check_invariants()
