"""TetriInfer: prefill/decode instance schedulers, predictor, dispatcher, the cluster loop
(simulated and on a real model), instance flip."""

from __future__ import annotations

import collections
import dataclasses
import json

import pytest

from fluidserve.bench.workload import WorkloadRequest
from fluidserve.config import ConfigError, EngineConfig, SimConfig
from fluidserve.core.block_manager import BlockManager
from fluidserve.core.queue_policy import WaitingQueue
from fluidserve.core.scheduler.base import SchedulerLimits
from fluidserve.core.scheduler.disagg import DecodeOnlyScheduler, PrefillOnlyScheduler
from fluidserve.core.scheduler.output import RunnerOutput
from fluidserve.disagg.dispatch import DecodeLoad, Dispatcher
from fluidserve.disagg.predictor import NoisyPredictor, make_predictor, predict_length
from fluidserve.request import Request, RequestStatus
from fluidserve.sampling_params import SamplingParams


def req(rid: str, prompt: int, max_tokens: int = 8, arrival: float = 0.0) -> Request:
    return Request(rid, [3] * prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                   arrival)


def prefilled(rid: str, prompt: int, max_tokens: int = 64) -> Request:
    """A request as a prefill instance hands it over: prompt computed, first token sampled."""
    r = req(rid, prompt, max_tokens)
    r.num_computed_tokens = prompt
    r.output_token_ids = [7]
    r.status = RequestStatus.MIGRATING
    return r


# ---------------------------------------------------------------- queue window
def test_sorting_window_bounds_how_long_a_long_prompt_waits():
    lengths = [50, 10, 40, 5]
    for window, want in ((0, [5, 10, 40, 50]), (2, [10, 50, 5, 40])):
        q = WaitingQueue("sjf", window)
        for i, n in enumerate(lengths):
            q.push(req(str(i), n, arrival=float(i)))
        assert [r.num_prompt_tokens for r in q.ordered()] == want
    with pytest.raises(ValueError):
        WaitingQueue("sjf", -1)


# ---------------------------------------------------------------- prefill instance
def prefill_instance(*prompt_lens: int):
    """A prefill-only scheduler (chunks of 16, 64 blocks of 4) with requests a, b, ... queued."""
    bm = BlockManager(64, 4)
    s = PrefillOnlyScheduler(SchedulerLimits(16, 8, 1024), bm)
    reqs = [req(chr(ord("a") + i), n) for i, n in enumerate(prompt_lens)]
    for r in reqs:
        s.add_request(r)
    return s, bm, reqs


def test_prefill_instance_runs_fixed_chunks_then_holds_kv_until_released():
    s, bm, (a, b) = prefill_instance(10, 20)
    sizes = []
    while s.has_work():
        plan = s.schedule(0.0)
        sizes.append([(c.request_id, c.num_tokens) for c in plan.chunks])
        assert plan.num_decode_tokens == 0
        s.update(plan, RunnerOutput({c.request_id: 9 for c in plan.chunks if c.samples}, 0.1),
                 1.0)
    # 30 prompt tokens in 16-token iterations, requests packed into one chunk budget.
    assert sizes == [[("a", 10), ("b", 6)], [("b", 14)]]
    assert set(s.handoff) == {"a", "b"}
    assert a.status is RequestStatus.MIGRATING and a.output_token_ids == [9]
    assert len(bm.table("b")) == 5  # 20 tokens in blocks of 4, still held
    s.release("a")
    s.release("b")
    assert bm.num_free_blocks == 64 and not s.requests


def test_prefill_instance_finishes_one_token_requests_itself():
    bm = BlockManager(16, 4)
    s = PrefillOnlyScheduler(SchedulerLimits(64, 8, 1024), bm)
    s.add_request(req("a", 5, max_tokens=1))
    plan = s.schedule(0.0)
    s.update(plan, RunnerOutput({"a": 4}, 0.1), 1.0)
    assert not s.handoff and not s.requests and bm.num_free_blocks == 16


# ---------------------------------------------------------------- decode instance
@pytest.mark.parametrize("policy, admitted", [
    # 40 free blocks of 4 tokens; each request: 20 prompt tokens (5 blocks now), predicted to
    # end at 20 + 100 tokens (30 blocks).
    ("greedy", 8),           # while its current 5 blocks fit: 8 x 5 = 40
    ("reserve_static", 3),   # while its predicted 30 blocks fit in what is free: 40, 35, 30
    ("reserve_dynamic", 1),  # ... after the running ones' predicted growth (25 blocks each)
])
def test_decode_admission_policies(policy, admitted):
    bm = BlockManager(40, 4)
    s = DecodeOnlyScheduler(SchedulerLimits(64, 64, 4096), bm, policy)
    for i in range(10):
        s.offer(prefilled(str(i), 20, max_tokens=200), predicted_len=100)
    n = 0
    while s.admit_next() is not None:
        n += 1
    assert n == admitted
    assert len(s.incoming) == 10 - admitted


def test_decode_instance_decodes_received_requests_and_recomputes_when_preempted():
    bm = BlockManager(12, 4)
    s = DecodeOnlyScheduler(SchedulerLimits(64, 8, 4096), bm, "greedy")
    received = [prefilled(str(i), 14, max_tokens=16) for i in range(2)]
    for r in received:
        s.offer(r, predicted_len=16)
    while (r := s.admit_next()) is not None:
        s.activate(r.request_id)
    assert len(s.running) == 2
    steps = 0
    while s.has_work():
        plan = s.schedule(float(steps))
        s.update(plan, RunnerOutput({c.request_id: 5 for c in plan.chunks if c.samples}, 0.1),
                 float(steps))
        bm.check_invariants({r.request_id: r.num_computed_tokens for r in s.running})
        steps += 1
        assert steps < 200
    # 2 x (14 + 16) tokens need 16 blocks > 12: one was preempted and recomputed here.
    assert s.num_preemptions > 0
    assert bm.num_free_blocks == 12 and not s.requests
    assert [len(r.output_token_ids) for r in received] == [16, 16]


# ---------------------------------------------------------------- predictor, dispatcher
def test_noisy_predictor_has_the_set_accuracy_and_misses_by_one_bucket():
    p = NoisyPredictor(200, 0.749, seed=3)
    hits = 0
    for i in range(4000):
        true = (i * 37) % 1000
        b = p.bucket(f"r{i}", [], true)
        assert b == p.bucket(f"r{i}", [], true)  # deterministic per request
        assert abs(b - true // 200) <= 1
        hits += b == true // 200
    assert abs(hits / 4000 - 0.749) < 0.03
    assert make_predictor("oracle", 100).predict("x", [], 250) == 300  # bucket 2's upper end
    # Served, max_tokens bounds a prediction; where it is the true length, it may not.
    r = req("y", 10, max_tokens=250)
    assert predict_length(make_predictor("oracle", 100), r, 250) == 250
    assert predict_length(make_predictor("oracle", 100), r, 250, cap=False) == 300
    with pytest.raises(ValueError):
        make_predictor("psychic")


def test_power_of_two_prefers_fewer_heavy_decodes_among_instances_with_room():
    d = Dispatcher("power_of_two", seed=0)
    d.broadcast([DecodeLoad(0, 100, heavy=5, light=1), DecodeLoad(1, 100, heavy=1, light=5),
                 DecodeLoad(2, 3, heavy=0, light=0)])
    # Instance 2 lacks room for 10 blocks; of 0 and 1 (both sampled), 1 has the lower ratio.
    assert d.pick(10, 2, heavy=True) == 1
    # Until the next broadcast the view says what that one will: the offer's 2 blocks held.
    assert d.view[1].free_blocks == 98 and d.view[1].heavy == 2
    assert d.pick(500, 2, heavy=False) == 0  # nobody has 500: the roomiest that holds 2 now
    assert d.view[0].free_blocks == 98  # (not 100 - 500: the next small one still fits)
    assert d.pick(10, 2, heavy=False) in (0, 1)
    assert d.pick(500, 200, heavy=False) is None


@pytest.mark.parametrize("policy", ["random", "round_robin", "least_loaded"])
def test_alternative_dispatchers_spread_work(policy):
    d = Dispatcher(policy, seed=1)
    d.broadcast([DecodeLoad(i, 1000, 0, 0) for i in range(3)])
    picks = collections.Counter(d.pick(10, 1, heavy=False) for _ in range(30))
    assert set(picks) == {0, 1, 2}
    if policy != "random":
        assert set(picks.values()) == {10}


def test_disagg_config_rejects_bad_values():
    with pytest.raises(ConfigError):
        EngineConfig.create(dispatcher="nearest")
    with pytest.raises(ConfigError):
        EngineConfig.create(num_decode_instances=0)
    with pytest.raises(ConfigError):
        EngineConfig.create(predictor_accuracy=1.5)
    # The colocated engine's scheduler knobs have no say over the instances: refused, not
    # silently ignored.
    for knob in ({"scheduler": "vllm"}, {"token_budget": "auto", "tbt_slo": 0.2}):
        with pytest.raises(ConfigError, match="would be ignored"):
            EngineConfig.create(disaggregate=True, **knob)
    EngineConfig.create(disaggregate=True, token_budget=1024, prefill_policy="sjf",
                        queue_policy="sjf")  # (decode instances order their waiting queue)


# ---------------------------------------------------------------- the cluster, simulated
def workload(n: int, rate: float, prompt: int, out: int, seed: int = 0):
    import random

    rng = random.Random(seed)
    t, work = 0.0, []
    for i in range(n):
        t += rng.expovariate(rate)
        work.append(WorkloadRequest(i, t, rng.randint(prompt // 2, prompt),
                                    rng.randint(max(1, out // 2), out)))
    return work


def simulate(work, **knobs):
    from fluidserve.disagg.sim import simulate_disaggregated

    eng = EngineConfig.create(disaggregate=True, **knobs)
    return simulate_disaggregated(work, eng, SimConfig(model_shape="mistral-7b", device="a100"))


@pytest.mark.parametrize("granularity", ["request", "chunk"])
@pytest.mark.parametrize("admission", ["greedy", "reserve_static", "reserve_dynamic"])
def test_simulated_cluster_completes_every_request_and_frees_every_block(granularity, admission):
    # Every seventh request ends with its first token, on the prefill instance: handed off
    # at its first chunk, a decode instance may already hold an offer or blocks for it.
    work = [dataclasses.replace(w, output_len=1) if w.index % 7 == 3 else w
            for w in workload(60, 6.0, 1500, 300)]
    records, res = simulate(work, num_prefill_instances=1, num_decode_instances=2,
                            decode_admission=admission, kv_transfer_granularity=granularity)
    assert [r.num_output_tokens for r in records] == [w.output_len for w in work]
    assert all(r.error is None for r in records)
    assert res.transfers == sum(w.output_len > 1 for w in work)
    for inst in res.instances:
        assert inst.core.block_manager.num_free_blocks == inst.core.block_manager.num_blocks
        assert not inst.sched.requests
    # The first token comes from the prefill instance, the rest after the transfer.
    assert all(r.gaps[0] > 0 for r in records)


def test_chunk_level_transfer_takes_less_time_on_the_critical_path():
    work = workload(30, 2.0, 3000, 50)
    kw = dict(kv_transfer_bandwidth_gbps=5.0, prefill_chunk_size=512)
    _, whole = simulate(work, kv_transfer_granularity="request", **kw)
    _, chunks = simulate(work, kv_transfer_granularity="chunk", **kw)
    assert chunks.transfer_seconds < 0.5 * whole.transfer_seconds


def test_instance_flip_moves_an_idle_decode_instance_to_prefill_and_loses_nothing():
    # Heavy prefill, light decode: three decode instances idle while one prefill instance
    # drowns; with flips on, decode instances become prefill instances.
    work = workload(120, 40.0, 4000, 8)
    kw = dict(num_prefill_instances=1, num_decode_instances=3, flip_window=0.3)
    base_records, base = simulate(work, **kw)
    records, res = simulate(work, instance_flip=True, **kw)
    assert res.flips and all(f.to == "prefill" for f in res.flips)
    assert [i.role for i in res.instances].count("prefill") > 1
    assert [r.num_output_tokens for r in records] == [w.output_len for w in work]
    ttft = sum(r.gaps[0] for r in records) / len(records)
    assert ttft < sum(r.gaps[0] for r in base_records) / len(base_records)


def test_an_offer_waiting_at_an_idle_decode_instance_is_admitted_when_blocks_free():
    # The first request ends with its first token on its prefill instance after its first
    # chunk reserved blocks at the decode instance; the second, offered meanwhile, waits for
    # them. The decode instance runs nothing then: only the end of the first may admit it
    # (the simulated cluster stalled here, where a served decode instance admits every loop).
    work = [WorkloadRequest(0, 0.0, 2500, 1), WorkloadRequest(1, 0.1, 200, 500)]
    for granularity in ("chunk", "request"):
        records, _ = simulate(work, num_prefill_instances=2, num_decode_instances=1,
                              num_kv_blocks=200, decode_admission="reserve_dynamic",
                              kv_transfer_granularity=granularity, length_predictor="oracle")
        assert [r.num_output_tokens for r in records] == [1, 500], granularity


class FakeInstance:
    """What the control plane sends an instance."""

    def __init__(self) -> None:
        self.sent: list = []

    def send(self, msg) -> None:
        self.sent.append(msg)

    add = send

    def abort(self, ids, reason: str = "abort") -> None:
        self.sent.append(("abort", list(ids)))


def control_plane(*roles: str, flip: bool = True):
    from fluidserve.disagg.control import ControlPlane

    config = EngineConfig.create(disaggregate=True, instance_flip=flip)
    outputs: list = []
    cp = ControlPlane(config, list(roles), outputs.append, lambda why: outputs.append(why))
    cp.instances = [FakeInstance() for _ in roles]
    cp._blocks = [100] * len(roles)
    cp._loads = {i: DecodeLoad(i, 100, 0, 0) for i, r in enumerate(roles) if r == "decode"}
    return cp, outputs


def handoff(rid: str, dst: int):
    from fluidserve.disagg.messages import Handoff

    return Handoff(req(rid, 10), dst, 8, True)


def test_a_hand_off_to_a_decode_instance_that_died_is_dispatched_again():
    from fluidserve.disagg.messages import Migrate, Redispatch

    cp, outputs = control_plane("prefill", "decode", "decode", flip=False)
    cp._where["r"] = {0}
    cp._on_instance_dead(2, "killed")
    cp._relay(0, handoff("r", 2))  # chosen before the dispatcher heard of the death
    assert cp.instances[0].sent[-1] == Redispatch("r") and not outputs
    cp._relay(0, handoff("r", 1))
    assert isinstance(cp.instances[1].sent[-1], Migrate) and cp._where["r"] == {0, 1}


def test_a_decode_instance_that_dies_sends_back_what_it_had_not_received():
    """Requests whose KV had not all arrived (waiting to be admitted, or mid-transfer) are
    still whole at their prefill instance: they go back to it. One whose KV had arrived
    (the prefill instance freed it) is lost with the instance: it fails."""
    from fluidserve.disagg.messages import KVReceived, ReadyToReceive, Redispatch, SendKV
    from fluidserve.engine.messages import EngineCoreOutputs

    cp, outputs = control_plane("prefill", "decode", "decode", flip=False)
    for rid in ("waiting", "moving", "decoding"):
        cp._where[rid] = {0}
        cp._relay(0, handoff(rid, 2))
    cp._on_instance_outputs(2, EngineCoreOutputs([], events=[
        ReadyToReceive("moving", 0, 2, (2050,), 2, 2),
        ReadyToReceive("decoding", 0, 2, (3074,), 2, 2), KVReceived("decoding", 0)]))
    assert isinstance(cp.instances[0].sent[-2], SendKV)
    cp._on_instance_dead(2, "killed")
    back = [m for m in cp.instances[0].sent if isinstance(m, Redispatch)]
    assert back == [Redispatch("waiting"), Redispatch("moving")] and cp.redispatched == 2
    assert cp._where == {"waiting": {0}, "moving": {0}} and not cp._transfers
    failed = [d for o in outputs for d in o.outputs]
    assert [(d.request_id, d.unavailable) for d in failed] == [("decoding", True)]
    # A receive the dead instance posted, read after its death, moves nothing.
    cp._relay(2, ReadyToReceive("moving", 0, 2, (4098,), 2, 2))
    assert not cp._transfers and not isinstance(cp.instances[0].sent[-1], SendKV)


def test_a_request_sent_back_mid_transfer_stops_its_kv_stream_to_the_dead_instance():
    from types import SimpleNamespace

    from fluidserve.disagg.messages import Redispatch
    from fluidserve.disagg.prefill_role import PrefillRole, _Stream

    r = prefilled("r", 40)
    core = SimpleNamespace(scheduler=SimpleNamespace(requests={"r": r}))
    role = PrefillRole(core, 0, None, EngineConfig.create(disaggregate=True))
    role.streams["r"] = _Stream(2, (2050, 3074), 5, 3, next=1)  # one piece of two sent
    assert role.handle(Redispatch("r"))
    assert not role.streams and "r" in role.undispatched and role.in_flight() == 0


def test_a_request_from_another_hosts_clock_is_moved_onto_the_decode_instances():
    """Monotonic clocks of two hosts count from different boots: a request's times cross
    over with the sender's clock and land on the receiver's, so its next token's gap is the
    hand-off's, not the hosts' difference in uptime."""
    import time
    from types import SimpleNamespace

    from fluidserve.core.block_manager import BlockManager
    from fluidserve.core.scheduler.base import SchedulerLimits
    from fluidserve.core.scheduler.disagg import role_scheduler_factory
    from fluidserve.disagg.decode_role import DecodeRole
    from fluidserve.disagg.messages import Migrate, Prefilled, clock_stamp

    config = EngineConfig.create(disaggregate=True)
    limits, bm = SchedulerLimits(512, 8, 256), BlockManager(64, 16)
    core = SimpleNamespace(scheduler=role_scheduler_factory(config, "decode")(limits, bm),
                           block_manager=bm, notify=lambda: None)
    role = DecodeRole(core, 1, None, config)
    ahead = 86_400.0  # the sender booted a day earlier
    there = time.monotonic() + ahead

    def sent(rid: str) -> Request:
        r = prefilled(rid, 40)
        r.arrival_time, r.first_scheduled_time, r.token_times = there - 0.3, there - 0.2, \
            [there - 0.1]
        return r

    far = sent("far")
    role.handle(Migrate(far, 8, 0, True, ("another boot", there)))
    assert far.token_times[0] == pytest.approx(time.monotonic() - 0.1, abs=0.05)
    assert far.token_times[0] - far.arrival_time == pytest.approx(0.2)
    early = sent("early")
    role.handle(Migrate(early, 8, 0, False, ("another boot", there)))
    done = sent("early")
    role.handle(Prefilled(done, ("another boot", there)))
    assert done.arrival_time == pytest.approx(time.monotonic() - 0.3, abs=0.05)
    near = sent("near")  # on this host: one clock, nothing moves
    role.handle(Migrate(near, 8, 0, True, clock_stamp()))
    assert near.token_times == [there - 0.1]


def test_prompts_are_routed_by_the_tokens_each_prefill_instance_has_left():
    """As in the simulated cluster: a half-prefilled long prompt counts what is left of it, as
    its instance reports; a prompt routed there and not yet read counts whole until it is."""
    from fluidserve.disagg.messages import PrefillLoad
    from fluidserve.engine.messages import AddRequest, EngineCoreOutputs

    cp, _ = control_plane("prefill", "prefill", "decode", flip=False)

    def add(rid: str, n: int) -> int:
        cp.add(AddRequest(rid, [1] * n, SamplingParams(max_tokens=4)))
        return next(i for i, x in enumerate(cp.instances) if rid in
                    [m.request_id for m in x.sent if isinstance(m, AddRequest)])

    def report(i: int, queued: int, read: int) -> None:
        cp._on_instance_outputs(i, EngineCoreOutputs([], adds_seen=read,
                                                     load=PrefillLoad(0, queued)))

    assert add("long", 1000) == 0 and add("mid", 500) == 1
    assert cp._outstanding(0) == 1000  # not read yet: counted whole
    report(0, 200, read=1)  # 800 of its 1000 tokens computed
    assert add("next", 50) == 0  # 200 left there against 500 at the other
    assert cp._outstanding(0) == 250
    report(0, 150, read=1)  # "next" still unread: it counts whole beside the report
    assert cp._outstanding(0) == 200
    report(0, 200, read=2)
    assert cp._outstanding(0) == 200 and cp._outstanding(1) == 500
    report(0, 0, read=2)
    report(1, 0, read=1)
    assert cp._outstanding(0) == cp._outstanding(1) == 0


def test_a_load_reported_before_a_flip_does_not_outlive_it():
    from fluidserve.disagg.messages import DecodeLoads
    from fluidserve.engine.messages import EngineCoreOutputs

    cp, _ = control_plane("prefill", "decode", "decode")
    cp._draining.add(2)
    cp._balance(0.0)  # nothing held there: it flips
    assert cp.roles[2] == "prefill" and 2 not in cp._loads
    cp._on_instance_outputs(2, EngineCoreOutputs([], load=DecodeLoad(2, 100, 0, 0)))  # late
    cp._broadcast()
    assert [x.instance for x in cp.instances[0].sent[-1].loads] == [1]
    assert isinstance(cp.instances[0].sent[-1], DecodeLoads)


def test_no_instance_flips_while_kv_of_a_request_that_ended_is_still_under_way():
    """A request aborted after its decode instance posted receives: the prefill instance still
    fills them (with zeros), and only their confirmation frees both ends to flip; a flip
    before would drop the receives (their shared-memory segments, in the decode role)."""
    from fluidserve.disagg.messages import KVReceived, ReadyToReceive, SendKV, SetRole
    from fluidserve.engine.messages import EngineCoreOutputs

    cp, _ = control_plane("prefill", "prefill", "decode", "decode")
    cp._where["r"] = {0}
    cp._relay(0, handoff("r", 2))
    cp._on_instance_outputs(2, EngineCoreOutputs([], events=[
        ReadyToReceive("r", 0, 2, (1026, 2050), 2, 1)]))
    assert isinstance(cp.instances[0].sent[-1], SendKV)
    cp.abort(["r"])
    cp._draining.update({0, 2})
    cp._balance(1.0)
    assert cp.roles == ["prefill", "prefill", "decode", "decode"]
    assert not any(isinstance(m, SetRole) for x in cp.instances for m in x.sent)
    cp._on_instance_outputs(2, EngineCoreOutputs([], events=[KVReceived("r", 0)]))
    cp._balance(2.0)
    assert cp.roles == ["decode", "prefill", "prefill", "decode"]
    assert cp.instances[2].sent[-1] == SetRole("prefill")


def test_a_decode_role_after_two_flips_does_not_reuse_a_transfer_tag():
    """Tags name shared-memory segments: a new role continues its instance's counter."""
    from types import SimpleNamespace

    from fluidserve.core.block_manager import BlockManager
    from fluidserve.core.scheduler.base import SchedulerLimits
    from fluidserve.core.scheduler.disagg import role_scheduler_factory
    from fluidserve.disagg.instance import Instance, InstanceSpec
    from fluidserve.disagg.messages import SetRole

    config = EngineConfig.create(disaggregate=True)
    limits, bm = SchedulerLimits(512, 8, 256), BlockManager(64, 16)
    core = SimpleNamespace(scheduler=role_scheduler_factory(config, "decode")(limits, bm),
                           block_manager=bm, notify=lambda: None)
    inst = Instance(core, InstanceSpec(2, "decode", 3, "", "s"), None, config, limits)
    first = {inst.role._tag() for _ in range(3)}
    assert inst.handle(SetRole("prefill")) and inst.handle(SetRole("decode"))
    assert type(inst.role).__name__ == "DecodeRole" and inst.role._tag() not in first


def test_a_dying_instance_neither_blocks_later_flips_nor_takes_a_roles_last_one():
    from fluidserve.disagg.messages import SetRole

    # Decode instance 3 drains, then dies: the next drain may start and flip.
    cp, _ = control_plane("prefill", "prefill", "decode", "decode")
    cp._draining.add(3)
    cp._on_instance_dead(3, "killed")
    assert not cp._draining
    # Decode instance 1 drains to become a prefill instance, and the other decode instance
    # dies: 1 is the last decode instance now, so it stays one (and is offered work again).
    cp, _ = control_plane("prefill", "decode", "decode")
    cp._where["q"] = {1}
    cp._draining.add(1)
    cp._on_instance_dead(2, "killed")
    assert not cp._draining and cp.roles == ["prefill", "decode", "decode"]
    del cp._where["q"]
    cp._balance(1.0)
    assert cp.roles[1] == "decode" and not any(isinstance(m, SetRole)
                                               for m in cp.instances[1].sent)
    cp._broadcast()
    assert [x.accepting for x in cp.instances[0].sent[-1].loads] == [True]


def test_what_the_control_plane_says_itself_carries_the_requests_instances_have_read():
    # The front end's watchdog and waiting count go by it: a failure made here with a count
    # of 0 would read as the instances having lost every request sent.
    from fluidserve.engine.messages import EngineCoreOutputs

    cp, outputs = control_plane("prefill", "decode", "decode", flip=False)
    cp._on_instance_outputs(0, EngineCoreOutputs([], adds_seen=3))
    assert outputs[-1].adds_seen == 3
    cp._where["r"] = {2}  # its KV there only: it fails with the instance
    cp._on_instance_dead(2, "killed")
    assert outputs[-1].outputs[0].request_id == "r" and outputs[-1].adds_seen == 3


def test_a_request_ended_at_two_instances_is_reported_once():
    """An abort ends a request at its prefill and its decode instance: each reports it, the
    front end (its metrics) hears of it once."""
    from fluidserve.engine.messages import EngineCoreOutputs

    cp, outputs = control_plane("prefill", "decode", flip=False)
    row = {"request_id": "r", "finish_reason": "abort"}
    cp._on_instance_outputs(0, EngineCoreOutputs([], finished=[row]))
    cp._on_instance_outputs(1, EngineCoreOutputs([], finished=[dict(row), {
        "request_id": "s", "finish_reason": "stop"}]))
    assert [r["request_id"] for o in outputs for r in o.finished] == ["r", "s"]


# ---------------------------------------------------------------- the cluster, real model
PROMPTS = [
    "The river rose slowly in the spring, and the people of the valley moved their goats.",
    "Hi",
    "A good teacher explains a hard idea twice: once in words and once with a picture.",
    "Computers follow instructions one after another, very quickly. A program is a list of"
    " such instructions, written so that people can read it and machines can run it.",
    "Why is the sky blue?",
]
MAX_TOKENS = [12, 20, 7, 16, 1]


@pytest.fixture(scope="module")
def colocated(tiny_model_dir):
    from fluidserve.engine.llm import LLM

    llm = LLM(model=str(tiny_model_dir), token_budget=4096)
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in MAX_TOKENS]
    outs = llm.generate(PROMPTS, params)
    ids = [llm.tokenizer.encode(p) for p in PROMPTS]
    return ids, [o.token_ids for o in outs]


@pytest.mark.parametrize("chunk, decodes, granularity", [
    (8, 1, "request"), (37, 2, "chunk"), (512, 2, "request")])
def test_disaggregated_greedy_outputs_equal_the_colocated_engine(
        tiny_model_dir, colocated, chunk, decodes, granularity):
    from fluidserve.disagg.cluster import Cluster
    from fluidserve.disagg.transfer import LocalKVMover
    from fluidserve.engine.messages import AddRequest
    from fluidserve.model.runner import ModelExecutor

    ids, want = colocated
    eng = EngineConfig.create(model=str(tiny_model_dir), disaggregate=True, block_size=8,
                              num_decode_instances=decodes, prefill_chunk_size=chunk,
                              kv_transfer_granularity=granularity)
    cluster = Cluster(eng, lambda clock: ModelExecutor(tiny_model_dir, block_size=8,
                                                       num_blocks=64),
                      kv_bytes_per_token=1024, bandwidth_gbps=10.0, mover=LocalKVMover())
    arrivals = [(0.001 * i, AddRequest(str(i), p, SamplingParams(
        max_tokens=m, temperature=0.0, ignore_eos=True)), m)
        for i, (p, m) in enumerate(zip(ids, MAX_TOKENS, strict=True))]
    res = cluster.run(arrivals)
    got = [res.requests[str(i)].output_token_ids for i in range(len(PROMPTS))]
    assert got == want
    assert res.transfers == sum(m > 1 for m in MAX_TOKENS)
    for inst in res.instances:
        assert inst.core.block_manager.num_free_blocks == 64


def test_tetriinfer_mixed_workload_is_the_same_in_every_process():
    # Regression: the classes were drawn in set order, which varies with PYTHONHASHSEED.
    import os
    import subprocess
    import sys

    code = ("from fluidserve.bench.workload import build_workload, WorkloadSpec;"
            "w, _ = build_workload(WorkloadSpec(dataset='mixed', num_prompts=40, seed=3,"
            " request_rate=2.0));"
            "print([(r.prompt_len, r.output_len) for r in w])")
    outs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           check=True, env=os.environ | {"PYTHONHASHSEED": str(h)}).stdout
            for h in (1, 2, 3, 4)}
    assert len(outs) == 1


def test_reserve_dynamic_counts_only_the_growth_still_to_come():
    # 100 blocks of 4; each request holds 5 blocks now (20 tokens) and is predicted to end
    # at 60 tokens (15 blocks): 10 more each. Admit while 15 + 10 per admitted <= free.
    bm = BlockManager(100, 4)
    s = DecodeOnlyScheduler(SchedulerLimits(64, 64, 4096), bm, "reserve_dynamic")
    for i in range(10):
        s.offer(prefilled(str(i), 20, max_tokens=200), predicted_len=40)
    n = 0
    while s.admit_next() is not None:
        n += 1
    assert n == 6  # counting the whole final size instead of the growth would give 5


def test_decode_instance_admits_nothing_new_while_a_preempted_request_waits():
    bm = BlockManager(40, 4)
    s = DecodeOnlyScheduler(SchedulerLimits(64, 8, 4096), bm, "greedy")
    s.offer(prefilled("a", 20), predicted_len=64)
    s.activate(s.admit_next().request_id)
    s._preempted = []
    s._preempt(s.running[0])  # as a full cache would, inside schedule()
    s.offer(prefilled("b", 20), predicted_len=64)
    assert s.admit_next() is None and s.num_waiting == 1


def test_a_request_aborted_in_transit_is_not_resurrected_and_frees_its_blocks():
    from fluidserve.disagg.cluster import Cluster
    from fluidserve.engine.messages import AddRequest
    from fluidserve.sim.run import make_cost_model, make_executor

    sim = SimConfig(model_shape="mistral-7b", device="a100")
    eng = EngineConfig.create(disaggregate=True, kv_transfer_bandwidth_gbps=0.01)

    def executor(clock):
        ex = make_executor(sim, eng, make_cost_model(sim, eng.parallel))
        ex.clock = clock
        return ex

    cluster = Cluster(eng, executor, 131072, bandwidth_gbps=0.01)
    aborted = {}
    on_prefilled = cluster._on_prefilled

    def prefilled_then_abort(t, src, req):  # the client leaves as the KV starts moving
        on_prefilled(t, src, req)
        if req.request_id == "0":
            cluster.abort("0", t)
            aborted["t"] = t

    cluster._on_prefilled = prefilled_then_abort
    arrivals = [(0.01 * i, AddRequest(str(i), [1] * 1000, SamplingParams(
        max_tokens=20, ignore_eos=True)), 20) for i in range(3)]
    res = cluster.run(arrivals)
    assert aborted and res.requests["0"].status is RequestStatus.FINISHED_ABORTED
    assert len(res.requests["0"].output_token_ids) == 1  # only the prefill's token
    assert [len(res.requests[str(i)].output_token_ids) for i in (1, 2)] == [20, 20]
    for inst in res.instances:
        assert inst.core.block_manager.num_free_blocks == inst.core.block_manager.num_blocks


def test_a_monitor_interval_over_a_minute_is_slow_but_not_a_stall():
    # A request no decode instance can take yet waits for the next broadcast: a minute of
    # nothing happening is a stall only once a broadcast has come and changed nothing.
    work = [WorkloadRequest(i, 0.01 * i, 1500, 300) for i in range(4)]
    records, res = simulate(work, num_kv_blocks=300, monitor_interval=100.0,
                            length_predictor="oracle")
    assert [r.num_output_tokens for r in records] == [300] * 4 and res.makespan > 100


@pytest.mark.parametrize("flip", ["decode_instance_first", "source_flips_in_transit"])
def test_a_request_aborted_in_transit_around_a_flip_frees_its_blocks_everywhere(flip):
    """The instances share one Request: a decode instance listed before the prefill instance
    (after a flip) ends it first, and the prefill side must still free its blocks; a source
    that flips once the abort has emptied it must not be asked to release the request."""
    from fluidserve.disagg.cluster import Cluster
    from fluidserve.engine.messages import AddRequest
    from fluidserve.sim.run import make_cost_model, make_executor

    sim = SimConfig(model_shape="mistral-7b", device="a100")
    eng = EngineConfig.create(disaggregate=True, num_prefill_instances=2, instance_flip=True,
                              dispatcher="round_robin", kv_transfer_bandwidth_gbps=0.01)

    def executor(clock):
        ex = make_executor(sim, eng, make_cost_model(sim, eng.parallel))
        ex.clock = clock
        return ex

    cluster = Cluster(eng, executor, 131072, bandwidth_gbps=0.01)  # ~13 s per 1000 tokens
    if flip == "decode_instance_first":
        cluster.instances[0].draining = True  # idle: a decode instance at the first tick
    transfer, aborted = cluster._transfer, []

    def transfer_then_abort(rid, t):
        transfer(rid, t)
        if rid == "0":
            if flip == "source_flips_in_transit":
                cluster.owner[rid].draining = True
            cluster.abort(rid, t)
            aborted.append(t)

    cluster._transfer = transfer_then_abort
    arrivals = [(0.5 + 0.1 * i, AddRequest(str(i), [1] * 1000, SamplingParams(
        max_tokens=20, ignore_eos=True)), 20) for i in range(2)]
    res = cluster.run(arrivals)
    assert aborted and res.flips
    assert len(res.requests["1"].output_token_ids) == 20
    for inst in res.instances:
        assert inst.core.block_manager.num_free_blocks == inst.core.block_manager.num_blocks
        assert not inst.sched.requests


@pytest.mark.parametrize("admission", ["greedy", "reserve_static", "reserve_dynamic"])
def test_a_small_kv_cache_slows_the_cluster_down_but_never_stalls_it(admission):
    # Prefill instances fill their cache with finished prefills waiting for the decode side,
    # which can hold only a few: instances must wait for the events that free blocks.
    import signal

    def stalled(*_):
        raise TimeoutError("the cluster loop did not finish")

    signal.signal(signal.SIGALRM, stalled)
    signal.alarm(60)
    try:
        work = [WorkloadRequest(i, 0.01 * i, 500, 2000) for i in range(20)]
        records, res = simulate(work, num_kv_blocks=200, decode_admission=admission)
    finally:
        signal.alarm(0)
    assert [r.num_output_tokens for r in records] == [2000] * 20
    _, roomy = simulate(work, decode_admission=admission)
    assert res.makespan > 1.5 * roomy.makespan  # the decode side holds a few at a time
    for inst in res.instances:
        assert inst.core.block_manager.num_free_blocks == inst.core.block_manager.num_blocks


def test_a_prediction_beyond_the_cache_does_not_block_a_request_that_fits():
    # Oracle bucket upper end 3200 tokens > 200 blocks of 16 (the simulator does not cap
    # predictions by max_tokens, its true lengths): an empty decode instance admits what
    # fits now, however large its prediction.
    for admission in ("reserve_static", "reserve_dynamic"):
        records, _ = simulate([WorkloadRequest(0, 0.0, 100, 3000)], num_kv_blocks=200,
                              decode_admission=admission, length_predictor="oracle")
        assert records[0].num_output_tokens == 3000


def test_the_transfer_time_delays_the_second_token():
    work = [WorkloadRequest(0, 0.0, 2000, 4)]
    kw = dict(kv_transfer_latency=0.0)
    _, slow = simulate(work, kv_transfer_bandwidth_gbps=0.5, **kw)
    _, fast = simulate(work, kv_transfer_bandwidth_gbps=500.0, **kw)
    gap = {k: r.requests["0"].token_times[1] - r.requests["0"].token_times[0]
           for k, r in (("slow", slow), ("fast", fast))}
    bytes_ = 2000 * 131072  # Mistral-7B: 128 KiB of KV per token
    assert gap["slow"] - gap["fast"] == pytest.approx(bytes_ / 0.5e9 - bytes_ / 500e9, rel=1e-6)


def test_a_decode_core_ends_an_offer_it_has_not_admitted():
    """An abort (its client left, a stop string, the request ended on its prefill instance)
    or a failure reaching a decode instance while the request waits there for admission
    ends it there: it used to stay queued, be admitted later and decode on zeroed KV."""
    from fluidserve.core.scheduler.disagg import role_scheduler_factory
    from fluidserve.engine.core import EngineCore
    from fluidserve.engine.messages import AbortRequests

    class Idle:
        depth, num_blocks, block_size, max_model_len = 1, 8, 16, 1024

    cfg = EngineConfig.create(disaggregate=True)
    core = EngineCore(cfg, Idle(), scheduler_factory=role_scheduler_factory(cfg, "decode"))
    sched = core.scheduler
    big, a, b = (prefilled(rid, n) for rid, n in (("big", 120), ("a", 8), ("b", 8)))
    sched.offer(big, 8)  # takes all 8 blocks
    assert sched.admit_next() is big
    sched.offer(a, 8)
    sched.offer(b, 8)
    assert sched.admit_next() is None and sched.held() == ["big", "a", "b"]
    core.abort(AbortRequests(["a"]))
    deltas = core.fail(["b"], "its prefill instance is gone")
    assert [(d.request_id, d.finish_reason) for d in deltas] == [("b", "error")]
    assert not sched.incoming and a.status.finished and b.status.finished
    core.abort(AbortRequests(["big"]))
    assert sched.admit_next() is None and not sched.held()
    assert core.block_manager.num_free_blocks == 8


def test_step_with_wait_starts_a_micro_batch_while_the_oldest_is_in_flight():
    from concurrent.futures import Future

    from fluidserve.engine.core import EngineCore
    from fluidserve.engine.messages import AddRequest

    class Slow:  # two batches in flight; completes only when told
        depth, num_blocks, block_size, max_model_len = 2, 64, 16, 1024

        def __init__(self):
            self.futures = []

        def submit(self, plan):
            f = Future()
            self.futures.append((plan, f))
            return f

        def shutdown(self):
            pass

    ex = Slow()
    core = EngineCore(EngineConfig.create(token_budget=64), ex)
    p = SamplingParams(max_tokens=4, ignore_eos=True)
    core.add(AddRequest("a", [1] * 8, p))
    out = core.step(wait=0.01)  # the oldest is not done: back empty-handed
    assert not out.outputs and len(core.in_flight) == 1
    core.add(AddRequest("b", [1] * 8, p))
    # Room in the pipeline: "b" starts the second micro-batch at once; the pipeline is then
    # full, and step blocks until the oldest completes (here 0.05 s later, another thread).
    import threading

    threading.Timer(0.05, lambda: ex.futures[0][1].set_result(
        RunnerOutput({"a": 5}, 0.01))).start()
    out = core.step(wait=0.01)
    assert [d.request_id for d in out.outputs] == ["a"]
    assert [plan.chunks[0].request_id for plan, _, _ in core.in_flight] == ["b"]
    ex.futures[1][1].set_result(RunnerOutput({"b": 5}, 0.01))
    out = core.step(wait=0.01)  # the oldest is done: applied before anything else
    assert [d.request_id for d in out.outputs] == ["b"]


def synthetic_log(path, n: int, seed: int = 0) -> None:
    """Requests whose generated length depends on their prompt: long prompts (summaries) get
    short answers, prompts with token 7 get long ones; some aborted (not lengths)."""
    import json
    import random

    rng = random.Random(seed)
    with open(path, "w") as f:
        for i in range(n):
            long_prompt = rng.random() < 0.5
            ids = [rng.randrange(5, 50) for _ in range(rng.randrange(800, 1000)
                                                        if long_prompt else rng.randrange(10, 60))]
            talkative = rng.random() < 0.5
            if talkative:
                ids[:3] = [7, 7, 7]
            generated = rng.randrange(10, 190) if long_prompt else \
                rng.randrange(610, 790) if talkative else rng.randrange(210, 390)
            reason = "abort" if i % 10 == 9 else rng.choice(("stop", "length"))
            f.write(json.dumps({"prompt_token_ids": ids[:1024], "num_prompt_tokens": len(ids),
                                "max_tokens": 1000, "generated": generated,
                                "finish_reason": reason}) + "\n")


def test_learned_predictor_learns_lengths_from_the_request_log(tmp_path):
    from fluidserve.disagg.learned import read_request_log, train

    synthetic_log(tmp_path / "log.jsonl", 400)
    records = read_request_log([tmp_path / "log.jsonl"])
    assert len(records) == 360  # aborted requests say nothing about lengths
    model, report = train(records, granularity=200, holdout=0.25)
    assert report.heldout == 90 and report.num_buckets == 4
    # Half the requests are summaries: their bucket is right about half the time.
    assert report.majority_accuracy < 0.65
    assert report.accuracy > 0.95, report.text()
    path = tmp_path / "pred.json"
    path.write_text(__import__("json").dumps(model))
    pred = make_predictor("learned", path=str(path))
    assert pred.granularity == 200
    # New prompts of each kind: a summary, a talkative chat, a plain chat.
    import random

    rng = random.Random(99)
    words = [rng.randrange(8, 50) for _ in range(900)]
    assert pred.predict("a", words, 0) == 200
    assert pred.predict("b", [7, 7, 7] + words[:30], 0) == 800
    assert pred.predict("c", words[:33], 0) == 400


def test_learned_predictor_errors_are_clear(tmp_path):
    from fluidserve.disagg.learned import read_request_log, train

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt_token_ids": [1], "finish_reason": "stop"}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1: not a request-log line"):
        read_request_log([bad])
    with pytest.raises(ValueError, match="need at least 10"):
        train([], granularity=200)
    with pytest.raises(ValueError, match="not a fluidserve length predictor"):
        make_predictor("learned", path=str(bad))
    from fluidserve.disagg.learned import FORMAT

    for damaged, why in (([1, 2], "not a fluidserve length predictor"),
                         ({"format": FORMAT}, "damaged length predictor .KeyError"),
                         ({"format": FORMAT, "granularity": 200, "hash_dims": 4, "mean": [0, 0],
                           "std": [1, 1], "weights": [[1, 2]], "bias": [0, 0]},
                          "do not fit together")):
        bad.write_text(json.dumps(damaged))  # (a traceback from deep inside, before)
        with pytest.raises(ValueError, match=why):
            make_predictor("learned", path=str(bad))
    with pytest.raises(ConfigError, match="needs --length-predictor-path"):
        EngineConfig.create(length_predictor="learned")


def test_train_predictor_command_writes_a_predictor_the_server_can_load(tmp_path):
    import subprocess
    import sys

    synthetic_log(tmp_path / "log.jsonl", 200)
    out = tmp_path / "p.json"
    r = subprocess.run([sys.executable, "-m", "fluidserve.cli", "train-predictor",
                        "--request-log", str(tmp_path / "log.jsonl"), "--out", str(out)],
                       capture_output=True, text=True, check=True)
    assert "held-out accuracy" in r.stdout and "74.9%" in r.stdout
    cfg = EngineConfig.create(disaggregate=True, length_predictor="learned",
                              length_predictor_path=str(out))
    assert make_predictor(cfg.disagg.length_predictor,
                          path=cfg.disagg.length_predictor_path).name == "learned"


# ---------------------------------------------------------------- decode instance, in detail
def decode_instance(blocks: int = 40, admission: str = "greedy", **kw) -> DecodeOnlyScheduler:
    return DecodeOnlyScheduler(SchedulerLimits(64, kw.pop("max_seqs", 64), 4096),
                               BlockManager(blocks, 4, kw.pop("watermark", 0.0)), admission,
                               **kw)


def admit_and_activate(s: DecodeOnlyScheduler, r: Request, predicted: int) -> None:
    s.offer(r, predicted)
    assert s.admit_next() is r
    assert s.activate(r.request_id)


def test_decode_instance_defaults_and_a_clear_error_for_an_unknown_policy():
    s = DecodeOnlyScheduler(SchedulerLimits(64, 8, 4096), BlockManager(40, 4))
    assert s.admission == "greedy" and s.heavy_threshold == 128
    with pytest.raises(ValueError, match="unknown decode admission 'fifo'; choose from"
                       " greedy, reserve_static, reserve_dynamic"):
        decode_instance(admission="fifo")


def test_heavy_and_light_decodes_count_admitted_and_offered_requests():
    s = decode_instance(heavy_threshold=100)
    admit_and_activate(s, prefilled("a", 8), 100)  # at the threshold: light
    admit_and_activate(s, prefilled("b", 8), 101)  # above: heavy
    s.offer(prefilled("c", 8), 150)  # offered, not admitted: heavy
    s.offer(prefilled("d", 8), 100)
    s.offer(prefilled("e", 8), 300)
    assert not s.is_heavy("a") and s.is_heavy("b") and not s.is_heavy("unknown")
    assert s.heavy_light() == (3, 2)
    # A request with no prediction counts as light, whatever its length.
    assert not decode_instance(heavy_threshold=0).is_heavy("x")


def test_predicted_growth_is_what_admitted_requests_still_need():
    s = decode_instance()  # blocks of 4 tokens
    a = prefilled("a", 8)  # 8 tokens: 2 blocks; predicted to end at 8 + 10 = 18: 5 blocks
    admit_and_activate(s, a, 10)
    assert s.predicted_growth() == 3
    b = prefilled("b", 8)  # predicted 0 (or beyond already): at least its next token
    admit_and_activate(s, b, 0)
    assert s.predicted_growth() == 3 + 1  # 8 + max(0, 1 + 1) = 10 tokens: 3 blocks
    # Past its prediction, a request is expected to need its next token only.
    b.output_token_ids += [1] * 6  # 8 + (7 + 1) = 16 tokens: 4 blocks, it holds 2
    assert s.predicted_growth() == 3 + 2
    # A request whose blocks already hold its predicted end adds nothing.
    admit_and_activate(s, prefilled("c", 5), 0)  # 5 + (1 + 1) = 7 tokens: its 2 blocks
    assert s.predicted_growth() == 3 + 2


def test_the_broadcast_free_blocks_are_what_admission_would_grant():
    """What a decode instance broadcasts as free is what its admission policy would let a new
    request use: under reserve_dynamic, the blocks its admitted requests are predicted to
    still take are not free. (Broadcasting the raw free blocks let the dispatcher send a
    request where admission then refused it, to wait there while another instance had room:
    11% longer mean JCT under memory pressure with power-of-two, docs/disaggregation.md.)"""
    for admission, growth in (("greedy", 0), ("reserve_static", 0), ("reserve_dynamic", 3)):
        s = decode_instance(admission=admission)
        admit_and_activate(s, prefilled("a", 8), 10)  # holds 2 blocks, predicted 5
        s.offer(prefilled("q", 8), 4)  # queued: its 2 blocks now
        assert s.free_blocks == 40 - 2 - 2 - growth, admission


def test_admission_boundaries_max_seqs_watermark_and_exact_fits():
    s = decode_instance(max_seqs=1)
    admit_and_activate(s, prefilled("a", 4), 4)
    s.offer(prefilled("b", 4), 4)
    assert s.admit_next() is None  # max_num_seqs reached
    # The watermark is kept free: 10 blocks, 1 kept (0.1), a 9-block request fits, 10 not.
    s = decode_instance(blocks=10, watermark=0.1)
    assert s.admissible(prefilled("x", 36), 1) and not s.admissible(prefilled("y", 37), 1)
    # reserve_dynamic: need + growth == free blocks admits; one more block does not.
    s = decode_instance(blocks=20, admission="reserve_dynamic")
    admit_and_activate(s, prefilled("a", 8), 12)  # holds 2, grows by 3 (20 tokens)
    assert s.bm.num_free_blocks == 18
    assert s.admissible(prefilled("b", 8), 52)  # 60 tokens: 15 blocks; 15 + 3 == 18
    assert not s.admissible(prefilled("c", 8), 53)
    # reserve_static: the predicted final length against what is free.
    s = decode_instance(blocks=20, admission="reserve_static")
    admit_and_activate(s, prefilled("a", 8), 12)
    assert s.admissible(prefilled("b", 8), 64) and not s.admissible(prefilled("c", 8), 65)
    # A prediction of no tokens still plans for the next one: 71 + 1 tokens fill 18 blocks.
    assert s.admissible(prefilled("d", 71), 0) and not s.admissible(prefilled("e", 72), 0)


def test_activate_and_finish_in_every_state_free_exactly_what_is_held():
    s = decode_instance()
    a = prefilled("a", 8)
    s.offer(a, 8)
    assert s.admit_next() is a and "a" in s.receiving and s.bm.num_free_blocks == 38
    assert s.activate("a") and a.status is RequestStatus.RUNNING and s.running == [a]
    assert not s.activate("a")  # not in transit any more
    # Aborted while its KV was in transit: activation frees its blocks and says so.
    b = prefilled("b", 8)
    s.offer(b, 8)
    s.admit_next()
    b.status = RequestStatus.FINISHED_ABORTED
    assert not s.activate("b")
    # Aborted here while in transit: nothing may write its blocks any more.
    b2 = prefilled("b2", 8)
    s.offer(b2, 8)
    s.admit_next()
    s.finish(b2, RequestStatus.FINISHED_ABORTED, 1.0)
    assert "b2" not in s.receiving and "b2" not in s.requests and not s.activate("b2")
    assert "b" not in s.requests and s.bm.num_free_blocks == 38 and b not in s.running
    # Finished while offered: withdrawn, nothing held.
    c = prefilled("c", 8)
    s.offer(c, 8)
    s.finish(c, RequestStatus.FINISHED_ABORTED, 1.0)
    assert not s.incoming and s.bm.num_free_blocks == 38
    # Running: finished with its time; its blocks and prediction go.
    s.finish(a, RequestStatus.FINISHED_STOPPED, 2.0)
    assert a.finish_time == 2.0 and a.status is RequestStatus.FINISHED_STOPPED
    assert not s.requests and not s.running and not s.predicted and s.bm.num_free_blocks == 40
    # Ended elsewhere while running here (aborted at the front end): freed, not re-finished.
    d = prefilled("d", 8)
    admit_and_activate(s, d, 8)
    d.status = RequestStatus.FINISHED_ABORTED
    d.finish_time = 5.0
    s.finish(d, RequestStatus.FINISHED_ABORTED, 6.0)
    assert d.finish_time == 5.0 and not s.requests and not s.running
    assert s.bm.num_free_blocks == 40
    # Ended elsewhere while offered here: withdrawn, nothing to free.
    g = prefilled("g", 8)
    s.offer(g, 8)
    g.status = RequestStatus.FINISHED_ABORTED
    s.finish(g, RequestStatus.FINISHED_ABORTED, 7.0)
    assert not s.incoming and s.bm.num_free_blocks == 40
    # withdraw only touches offered requests.
    e, f = prefilled("e", 8), prefilled("f", 8)
    s.offer(e, 8)
    s.offer(f, 8)
    assert s.withdraw("f") is f and [i.req for i in s.incoming] == [e]
    assert s.withdraw("zzz") is None


def test_a_decode_instance_recomputes_a_preempted_request_in_chunks():
    bm = BlockManager(12, 4)
    s = DecodeOnlyScheduler(SchedulerLimits(8, 8, 4096), bm)
    received = [prefilled(str(i), 14, max_tokens=16) for i in range(2)]
    for r in received:
        admit_and_activate(s, r, 16)
    sizes, steps = [], 0
    while s.has_work():
        plan = s.schedule(float(steps))
        sizes.append(plan.num_tokens)
        s.update(plan, RunnerOutput({c.request_id: 5 for c in plan.chunks if c.samples}, 0.1),
                 float(steps))
        steps += 1
        assert steps < 200
    assert s.num_preemptions > 0 and max(sizes) == 8  # recomputed in chunks of the budget
    assert [len(r.output_token_ids) for r in received] == [16, 16]


def test_prefill_instance_release_and_finish_forget_the_request():
    s, bm, (a, b) = prefill_instance(10, 10)
    plan = s.schedule(2.5)
    assert a.first_scheduled_time == 2.5
    s.update(plan, RunnerOutput({c.request_id: 9 for c in plan.chunks if c.samples}, 0.1), 3.0)
    assert set(s.handoff) == {"a"}
    assert s.release("a") is a and "a" not in s.requests and s.release("a") is None
    s.finish(b, RequestStatus.FINISHED_ABORTED, 4.0)  # mid-prefill
    assert b.finish_time == 4.0 and not s.requests and bm.num_free_blocks == 64
    c = req("c", 4)
    s.add_request(c)
    plan = s.schedule(5.0)
    s.update(plan, RunnerOutput({"c": 9}, 0.1), 5.5)
    s.finish(c, RequestStatus.FINISHED_ABORTED, 6.0)  # waiting for its hand-off
    assert not s.handoff and not s.requests and c.finish_time == 6.0
