"""The driver-to-rank step messages: each rank rebuilds the scheduler's plan exactly, and a
step carries what changed, not every request's table and counted tokens (pure Python)."""

from __future__ import annotations

import pickle
import random
import threading
from concurrent.futures import Future
from dataclasses import fields, replace

import numpy as np
import pytest

from fluidserve.config import EngineConfig
from fluidserve.core.block_manager import BlockManager
from fluidserve.core.scheduler import RunnerOutput, SchedulerLimits, make_scheduler
from fluidserve.engine.core import EngineCore, VirtualClock
from fluidserve.engine.messages import AddRequest
from fluidserve.engine.telemetry import Telemetry
from fluidserve.model.inputs import prepare_inputs
from fluidserve.model.step_delta import StepDecoder, StepEncoder
from fluidserve.request import Request
from fluidserve.sampling_params import SamplingParams

BLOCK = 4

PARAMS = [
    SamplingParams(max_tokens=9, ignore_eos=True),
    SamplingParams(max_tokens=12, repetition_penalty=1.3, presence_penalty=0.5,
                   ignore_eos=True, seed=3),
    SamplingParams(max_tokens=7, frequency_penalty=0.4, min_tokens=4, logprobs=2,
                   stop_token_ids=[5]),
    SamplingParams(max_tokens=6, prompt_logprobs=1, ignore_eos=True, temperature=0.7),
    SamplingParams(max_tokens=8, bad_words_token_ids=((7, 7), (9,)), ignore_eos=True,
                   logit_bias={3: -2.0}, allowed_token_ids=list(range(40))),
]


def same(a, b, path="inputs") -> None:
    """Field by field: the rank's inputs are the driver's."""
    if hasattr(a, "__dataclass_fields__"):
        assert type(a) is type(b), path
        for f in fields(a):
            same(getattr(a, f.name), getattr(b, f.name), f"{path}.{f.name}")
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and np.array_equal(a, b), path
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            same(x, y, f"{path}[{i}]")
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


def drive(sched, add, steps: int, aborts: bool = True):
    """Run ``sched`` with a fake sampler, ``add(step)`` adding requests, and through one
    encoder and one decoder (each plan pickled as the ranks get it); yields each plan with
    the inputs the driver and the rank prepare and the pickled delta's size."""
    rng = random.Random(0)
    enc, dec = StepEncoder(), StepDecoder()
    for step in range(steps):
        add(step)
        plan = sched.schedule(float(step))
        payload = pickle.dumps(enc.encode(plan))
        mine = prepare_inputs(plan, BLOCK)
        theirs = prepare_inputs(dec.decode(pickle.loads(payload)), BLOCK)
        yield plan, mine, theirs, len(payload)
        sampled = {c.request_id: rng.randrange(1, 40) for c in plan.chunks if c.samples}
        if aborts and step % 7 == 3 and sched.running:  # an abort now and then
            sched.abort(sched.running[0].request_id, float(step))
        sched.update(plan, RunnerOutput(sampled, 0.01), step + 1.0)
        if not sched.has_unfinished() and step > 40:
            break
    # Whatever the ranks still hold, the driver knows it holds (and nothing it forgot).
    assert set(dec.held) == set(enc.sent)


@pytest.mark.parametrize("policy", ["sarathi", "vllm"])
def test_every_rank_prepares_the_drivers_inputs_through_preemption_aborts_and_reused_ids(
        policy):
    # Few blocks: requests are preempted (and re-admitted with new tables) all along.
    sched = make_scheduler(policy, SchedulerLimits(24, 8, 256, 1, "fcfs"),
                           BlockManager(30, BLOCK, 0.0))
    rng = random.Random(1)

    def add(step: int) -> None:
        if step < 40 and step % 3 == 0:
            for _ in range(2):
                i = rng.randrange(len(PARAMS))
                # ids come back: a finished request's id is reused by a new one
                rid = f"r{rng.randrange(6)}"
                if sched.find(rid) is None:
                    sched.add_request(Request(rid, [rng.randrange(1, 40) for _ in range(
                        rng.randrange(3, 30))], PARAMS[i], float(step)))

    plans = 0
    for _, mine, theirs, _ in drive(sched, add, 400):
        same(mine, theirs)
        plans += 1
    assert plans > 40 and sched.num_preemptions > 0, (plans, sched.num_preemptions)


def test_a_decode_step_sends_its_tokens_not_the_contexts():
    """32 penalized decodes of ~1000 tokens of context: the step's message holds a token, a
    start and a count each, and a block now and then; the full plan's inputs hold their
    tables and every counted token."""
    n, prompt = 32, 1000
    sched = make_scheduler("sarathi", SchedulerLimits(4096, n, 4096, 1, "fcfs"),
                           BlockManager(n * 300, BLOCK, 0.0))
    params = SamplingParams(max_tokens=40, repetition_penalty=1.2, presence_penalty=0.3,
                            ignore_eos=True)

    def add(step: int) -> None:
        if step == 0:
            for i in range(n):
                sched.add_request(Request(f"req-{i}", list(range(i, i + prompt)), params, 0.0))

    sizes, full = [], []
    for plan, mine, theirs, size in drive(sched, add, 30, aborts=False):
        same(mine, theirs)
        if plan.num_decode_tokens == n:
            sizes.append(size)
            full.append(len(pickle.dumps(mine)))
    assert len(sizes) > 15
    # ~60 bytes a decode (its id, token, start, count, output index and counted token)
    assert max(sizes) < 100 * n, sizes
    assert min(full) > 8 * n * prompt  # the prompts' counted tokens, at 8 bytes each


def test_a_rank_out_of_step_says_so():
    enc, dec = StepEncoder(), StepDecoder()
    sched = make_scheduler("sarathi", SchedulerLimits(64, 4, 256, 1, "fcfs"),
                           BlockManager(64, BLOCK, 0.0))
    sched.add_request(Request("a", [1, 2, 3], SamplingParams(max_tokens=4), 0.0))
    plan = sched.schedule(0.0)
    enc.encode(plan)  # this step never reaches the rank
    sched.update(plan, RunnerOutput({"a": 5}, 0.01), 1.0)
    with pytest.raises(RuntimeError, match="holds no request 'a'.*out of step"):
        dec.decode(enc.encode(sched.schedule(1.0)))


def test_engines_sharing_the_ranks_one_after_the_other_reuse_ids_safely():
    """A second scheduler's requests may take the first one's ids, parameters object and
    blocks (the first's last requests were never released to the ranks)."""
    params = SamplingParams(max_tokens=3, presence_penalty=0.5, ignore_eos=True)
    enc, dec = StepEncoder(), StepDecoder()
    for prompt in (6, 30):
        sched = make_scheduler("sarathi", SchedulerLimits(64, 4, 256, 1, "fcfs"),
                               BlockManager(64, BLOCK, 0.0))
        sched.add_request(Request("a", list(range(1, prompt + 1)), params, 0.0))
        step = 0
        while sched.has_unfinished():
            plan = sched.schedule(float(step))
            same(prepare_inputs(plan, BLOCK),
                 prepare_inputs(dec.decode(pickle.loads(pickle.dumps(enc.encode(plan)))),
                                BLOCK))
            sched.update(plan, RunnerOutput({"a": 9 + step}, 0.01), step + 1.0)
            step += 1


class Ranks:
    """An executor of ``depth`` stages whose one rank checks every step it gets: its inputs
    are the driver's."""

    num_blocks, block_size, max_model_len = 64, BLOCK, 4096

    def __init__(self, depth: int) -> None:
        self.depth = depth
        self.enc, self.dec = StepEncoder(), StepDecoder()

    def submit(self, plan):
        theirs = self.dec.decode(pickle.loads(self.enc.payload(plan)))
        same(prepare_inputs(plan, BLOCK), prepare_inputs(theirs, BLOCK))
        done = Future()
        done.set_result(RunnerOutput({c.request_id: 7 for c in plan.chunks if c.samples}, 0.01))
        return done

    def shutdown(self) -> None:
        pass


def test_what_plans_never_submitted_release_is_forgotten_all_the_same():
    """Two micro-batches in flight: the first's request ends while the second runs, and the
    plan scheduled then is empty (the second's request is busy) and never submitted; its
    release reaches the ranks with the next. Request ids come back, with one parameters
    object and seed (penalized: the ranks count their outputs)."""
    ranks = Ranks(depth=2)
    core = EngineCore(EngineConfig.create(scheduler="sarathi", token_budget=256), ranks,
                      VirtualClock(), Telemetry(max_records=0))
    short = SamplingParams(max_tokens=2, ignore_eos=True, presence_penalty=0.5, seed=1)
    long = SamplingParams(max_tokens=4, ignore_eos=True)
    for i in range(30):
        core.add(AddRequest(f"a{i % 3}", [5] * (8 + i % 5 * 8), short))  # (ids come back)
        core.fill()
        core.add(AddRequest(f"b{i}", [5] * 8, long))
        while core.has_unfinished():
            core.step()
    # At most the last round's requests: their release waits for a plan
    assert set(ranks.dec.held) <= {"a2", "b29"} and set(ranks.enc.sent) == set(ranks.dec.held)


def test_a_step_that_fails_to_encode_starts_the_mirrors_afresh():
    ranks = Ranks(depth=1)
    sched = make_scheduler("sarathi", SchedulerLimits(64, 4, 256, 1, "fcfs"),
                           BlockManager(64, BLOCK, 0.0))
    sched.add_request(Request("a", [1, 2, 3], SamplingParams(max_tokens=6), 0.0))
    for step in range(5):
        plan = sched.schedule(float(step))
        if step == 2:  # (it gains a block) a ban that cannot be pickled: the step never
            # reaches a rank, after the driver took note of the new block
            unpicklable = [replace(c, banned=(threading.Lock(),)) for c in plan.chunks]
            with pytest.raises(TypeError, match="pickle"):
                ranks.enc.payload(replace(plan, chunks=unpicklable))
        else:
            ranks.submit(plan)
        sched.update(plan, RunnerOutput({"a": 9}, 0.01), step + 1.0)
