"""Tensor and pipeline parallelism across processes: same tokens as one process, no hangs.

Each worker process runs one torch thread; executors are shared across schedulers (the
scheduler lives in the engine core, the executor only runs batches) to keep the test fast.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import httpx
import pytest
import torch

from fluidserve.config import SCHEDULERS, EngineConfig
from fluidserve.engine.engine import LLMEngine
from fluidserve.engine.llm import LLM
from fluidserve.model.linear import packed_linear_supported
from fluidserve.model.step_delta import StepEncoder
from fluidserve.model.tokenizer import Tokenizer
from fluidserve.sampling_params import SamplingParams

from .server_utils import InProcessServer

PROMPTS = [
    "The river rose slowly in the spring, and the people of the valley moved their goats.",
    "Hi",
    "A good teacher explains a hard idea twice: once in words and once with a picture.",
    "Why is the sky blue?",
]
MAX_TOKENS = [10, 14, 6, 9]
PARALLEL = [(1, 2), (2, 1), (2, 2)]  # (tensor, pipeline)


def greedy(i: int) -> SamplingParams:
    return SamplingParams(max_tokens=MAX_TOKENS[i], temperature=0.0, ignore_eos=True)


def knobs(model_dir, **kw) -> dict:
    return dict(model=str(model_dir), num_threads=1, block_size=16, num_kv_blocks=64,
                token_budget=24) | kw


def generate(engine: LLMEngine) -> list[list[int]]:
    reqs = [engine.add_request(f"r{i}", p, greedy(i)) for i, p in enumerate(PROMPTS)]
    while engine.has_unfinished():
        engine.step()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    return [r.output_token_ids for r in reqs]


@pytest.fixture(scope="module")
def reference_outputs(tiny_model_dir):
    with LLM(**knobs(tiny_model_dir)) as llm:
        return llm.generate(PROMPTS, [greedy(i) for i in range(4)])


@pytest.fixture(scope="module")
def reference(reference_outputs):
    return [o.token_ids for o in reference_outputs]


@pytest.mark.parametrize("tp,pp", PARALLEL, ids=lambda v: str(v))
def test_greedy_outputs_equal_one_process_for_every_scheduler(tiny_model_dir, reference,
                                                               tp, pp):
    first = LLMEngine(EngineConfig.create(**knobs(tiny_model_dir, tensor_parallel_size=tp,
                                                  pipeline_parallel_size=pp)))
    assert first.executor.depth == pp
    # The ranks run prepacked linears on padded rows, and say so (`auto` prices those rows).
    assert first.executor.pads_rows is packed_linear_supported(torch.float32,
                                                               torch.device("cpu"))
    tok = Tokenizer(tiny_model_dir)
    try:
        for policy in SCHEDULERS:
            cfg = EngineConfig.create(**knobs(tiny_model_dir, scheduler=policy,
                                              tensor_parallel_size=tp, pipeline_parallel_size=pp))
            engine = LLMEngine(cfg, executor=first.executor, tokenizer=tok)
            assert generate(engine) == reference, policy
        stats = first.executor.stats()
        assert len(stats) == tp * pp and all(s["busy_s"] > 0 for s in stats)
        # Ranks of a tensor-parallel group on one host all-reduce through shared memory
        assert {s["all_reduce"] for s in stats} == {"shared memory" if tp > 1 else None}
    finally:
        first.shutdown()


def test_tensor_parallel_ranks_through_gloo_give_the_same_tokens(tiny_model_dir, reference):
    """--disable-custom-all-reduce: the all-reduce over loopback TCP, the fallback."""
    with LLM(**knobs(tiny_model_dir, tensor_parallel_size=2,
                     disable_custom_all_reduce=True)) as llm:
        outs = llm.generate(PROMPTS, [greedy(i) for i in range(4)])
        assert {s["all_reduce"] for s in llm.engine.executor.stats()} == {"gloo"}
    assert [o.token_ids for o in outs] == reference


def test_pipeline_keeps_micro_batches_in_flight(tiny_model_dir):
    cfg = EngineConfig.create(**knobs(tiny_model_dir, pipeline_parallel_size=2,
                                      token_budget=8))
    engine = LLMEngine(cfg)
    try:
        for i, p in enumerate(PROMPTS):
            engine.add_request(f"r{i}", p, greedy(i))
        depths = []
        while engine.has_unfinished():
            engine.core.fill()
            depths.append(len(engine.core.in_flight))
            engine.step()
        assert max(depths) == 2  # two micro-batches, never one request in both
    finally:
        engine.shutdown()


def test_ranks_follow_preemptions_and_penalties_to_one_process_tokens(tiny_model_dir):
    """More requests than the KV cache holds: the scheduler preempts and re-admits them with
    new block tables, which the ranks' mirrors must follow, as they follow the penalized
    requests' counted tokens (greedy with a repetition penalty: one process's tokens)."""
    prompts = [p + " " + q for p in PROMPTS for q in PROMPTS[:2]]
    params = [SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True,
                             repetition_penalty=1.3 if i % 2 else 1.0,
                             presence_penalty=0.4 if i % 3 else 0.0)
              for i in range(len(prompts))]
    outs = {}
    for tp, pp in [(1, 1), (2, 2)]:
        engine = LLMEngine(EngineConfig.create(**knobs(
            tiny_model_dir, tensor_parallel_size=tp, pipeline_parallel_size=pp,
            token_budget=64)))
        try:
            reqs = [engine.add_request(f"r{i}", p, q)
                    for i, (p, q) in enumerate(zip(prompts, params, strict=True))]
            while engine.has_unfinished():
                engine.step()
            outs[tp, pp] = [r.output_token_ids for r in reqs]
            assert engine.core.scheduler.num_preemptions > 0
        finally:
            engine.shutdown()
    assert outs[2, 2] == outs[1, 1]


def test_ray_backend_on_a_local_instance(tiny_model_dir, reference):
    pytest.importorskip("ray")
    with LLM(**knobs(tiny_model_dir, tensor_parallel_size=2,
                     distributed_executor_backend="ray")) as llm:
        outs = llm.generate(PROMPTS, [greedy(i) for i in range(4)])
    assert [o.token_ids for o in outs] == reference


def test_ray_start_up_that_times_out_leaves_nothing_behind(tiny_model_dir):
    """A placement group or rank that is not ready in time: a clear error, and the placement
    group, the actors and the Ray instance started for them are gone."""
    ray = pytest.importorskip("ray")
    from fluidserve.engine.ray_executor import RayExecutor
    from fluidserve.model.worker import plan_workers

    cfg = EngineConfig.create(**knobs(tiny_model_dir, tensor_parallel_size=2,
                                      distributed_executor_backend="ray"))
    _, spec = plan_workers(str(tiny_model_dir), cfg)
    with pytest.raises(RuntimeError, match="Ray worker ranks failed to start.*Timeout"):
        RayExecutor(spec, cfg.parallel, 1, startup_timeout=1e-3)
    assert not ray.is_initialized(), "the Ray instance started for the ranks was left running"


def bad_plan():
    """A batch every rank fails on: a token id far outside the vocabulary."""
    from fluidserve.core.scheduler.output import ScheduledChunk, SchedulerOutput

    return SchedulerOutput(0, [ScheduledChunk("x", 0, (10**9,), (0,), True,
                                              SamplingParams(max_tokens=1), 0, 0)])


def test_a_ray_rank_that_raises_fails_its_batch_with_the_cause(tiny_model_dir):
    # The sampling rank's failure reached the batch's callback after the batch had left the
    # pending list, so nothing failed it (and killing the ranks from Ray's callback thread
    # blocked that thread): the engine waited for ever.
    pytest.importorskip("ray")
    from fluidserve.engine.core import ExecutorDead

    engine = LLMEngine(EngineConfig.create(**knobs(tiny_model_dir, tensor_parallel_size=2,
                                                   distributed_executor_backend="ray")))
    try:
        fut = engine.executor.submit(bad_plan())
        with pytest.raises(ExecutorDead, match="rank failed: IndexError: index out of range"):
            fut.result(timeout=60)
        with pytest.raises(ExecutorDead):
            engine.executor.submit(bad_plan()).result(timeout=60)
    finally:
        engine.shutdown()


def test_ranks_outlive_the_thread_that_started_them_and_a_dying_sampler_says_how(
        tiny_model_dir, reference):
    import threading

    from fluidserve.engine.core import ExecutorDead

    built = []  # a short-lived thread builds the engine (a server started from a pool)
    t = threading.Thread(target=lambda: built.append(LLMEngine(EngineConfig.create(
        **knobs(tiny_model_dir, pipeline_parallel_size=2)))))
    t.start()
    t.join()
    engine = built[0]
    try:
        assert generate(engine) == reference
        ex = engine.executor
        os.kill(ex.procs[ex.sampler_rank].pid, signal.SIGKILL)
        engine.add_request("late", PROMPTS[0], greedy(0))
        with pytest.raises(ExecutorDead, match=r"worker rank 1 died \(exit code -9\)"):
            while engine.has_unfinished():
                engine.step()
    finally:
        engine.shutdown()


def test_a_batch_submitted_as_a_rank_dies_fails_instead_of_waiting_for_ever():
    # The reader declared the executor dead between submit's check and its queueing the
    # batch: the batch landed in a queue nobody would fail again.
    import threading
    from collections import deque

    from fluidserve.engine import distributed
    from fluidserve.engine.core import ExecutorDead

    ex = distributed.MultiprocExecutor.__new__(distributed.MultiprocExecutor)
    ex.dead, ex._closing, ex._lock, ex._pending = None, False, threading.Lock(), deque()
    ex.block_size, ex.inboxes = 16, []
    ex._kill = lambda: None

    class DiesMeanwhile(StepEncoder):
        def encode(self, plan):
            ex._die("worker rank 1 died (exit code -9)")
            return super().encode(plan)

    ex._encoder = DiesMeanwhile()
    plan = bad_plan()
    with pytest.raises(ExecutorDead, match="rank 1 died"):
        ex.submit(plan)
    assert not ex._pending


def test_an_interrupted_send_leaves_the_executor_dead_not_out_of_step():
    # Ctrl-C while a step's bytes go to the ranks: some may have it and others not, and the
    # next step would wait for ever on a rank that never got the last one.
    import threading
    from collections import deque

    from fluidserve.engine import distributed
    from fluidserve.engine.core import ExecutorDead

    class Pipe:
        def __init__(self, fails: bool) -> None:
            self.fails = fails

        def send_bytes(self, data) -> None:
            if self.fails:
                raise KeyboardInterrupt

    ex = distributed.MultiprocExecutor.__new__(distributed.MultiprocExecutor)
    ex.dead, ex._closing, ex._lock, ex._pending = None, False, threading.Lock(), deque()
    ex.block_size, ex.inboxes = 16, [Pipe(False), Pipe(True)]
    ex._kill = lambda: None
    ex._encoder = StepEncoder()
    with pytest.raises(KeyboardInterrupt):
        ex.submit(bad_plan())
    assert "interrupted" in ex.dead and not ex._pending
    with pytest.raises(ExecutorDead, match="interrupted"):
        ex.submit(bad_plan())


def test_a_reply_racing_a_failure_settles_its_future_once():
    # A rank's reply on Ray's callback thread and _die (or a shutdown) on another: the loser
    # raised InvalidStateError on its thread.
    from concurrent.futures import Future

    from fluidserve.engine.core import ExecutorDead
    from fluidserve.engine.distributed import settle

    fut = Future()
    settle(fut, error=ExecutorDead("worker rank 1 died"))
    settle(fut, "a late reply")
    assert isinstance(fut.exception(), ExecutorDead)


def test_cuda_ranks_need_a_device_each(monkeypatch):
    import torch

    from fluidserve.engine.distributed import check_cuda_ranks

    check_cuda_ranks("cpu", 4)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="sees no CUDA device"):  # was a ZeroDivisionError
        check_cuda_ranks("cuda", 2)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    check_cuda_ranks("cuda", 2)
    with pytest.raises(ValueError, match="needs 4 CUDA devices"):
        check_cuda_ranks("cuda", 4)
    from fluidserve.model.worker import Worker, WorkerSpec

    with pytest.raises(ValueError, match="'cuda:2' requested but torch sees 2 CUDA device"):
        Worker(WorkerSpec("/not/loaded", device="cuda:2"))  # refused before any loading


def test_a_closed_or_dropped_engine_fails_its_batches_and_leaves_no_rank(tiny_model_dir):
    """close() from another thread fails the generate under way, a generate after close()
    fails at once (both used to wait for ever), and an LLM dropped without close() stops its
    ranks when it is collected."""
    import gc
    import threading

    from fluidserve.engine.core import ExecutorDead
    from fluidserve.engine.core_proc import wait_exit

    llm = LLM(**knobs(tiny_model_dir, pipeline_parallel_size=2))
    ex = llm.engine.executor
    procs, submit, submitted = list(ex.procs), ex.submit, []

    def close_at_the_fifth_batch(plan):  # mid-generate, whatever the machine's speed
        submitted.append(plan)
        if len(submitted) == 5:
            threading.Thread(target=llm.close).start()
        return submit(plan)

    ex.submit = close_at_the_fifth_batch
    params = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
    t0 = time.monotonic()
    with pytest.raises(ExecutorDead, match="shut down"):
        llm.generate([PROMPTS[0]] * 4, params)
    assert time.monotonic() - t0 < 30
    with pytest.raises(ExecutorDead, match="shut down"):
        llm.generate([PROMPTS[0]], greedy(0))
    assert all(wait_exit(p, 15) is not None for p in procs)

    dropped = LLM(**knobs(tiny_model_dir, pipeline_parallel_size=2))
    procs = list(dropped.engine.executor.procs)
    del dropped
    gc.collect()
    assert all(wait_exit(p, 15) is not None for p in procs)


def test_a_rank_error_is_one_line_naming_its_cause():
    from fluidserve.engine.ray_executor import describe

    class RayTaskError(Exception):  # the shape of ray.exceptions.RayTaskError
        def __init__(self, cause):
            super().__init__("\x1b[36mray::_Rank.step()\x1b[39m (pid=1, ip=127.0.0.1)\n"
                             "  File ...\nValueError: bad shape")
            self.cause = cause

    assert describe(RayTaskError(ValueError("bad shape\nmore"))) == "ValueError: bad shape"
    assert describe(RuntimeError("\x1b[31mThe actor died\x1b[0m\nbecause")) == \
        "RuntimeError: The actor died"


def test_a_script_without_a_main_guard_is_told_what_to_do(tiny_model_dir, tmp_path):
    """Each rank imports the script again (spawn): without the guard it starts ranks of its
    own, which multiprocessing refuses, and the rank dies before it can report anything."""
    import subprocess
    import sys

    script = tmp_path / "unguarded.py"
    script.write_text("from fluidserve import LLM\n"
                      f"LLM({str(tiny_model_dir)!r}, pipeline_parallel_size=2, num_threads=1)\n")
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode != 0
    assert "while starting, before it could report an error" in r.stderr, r.stderr[-2000:]
    assert "if __name__ == '__main__':" in r.stderr.splitlines()[-1]


def test_bad_split_is_a_clear_error(tiny_model_dir):
    with pytest.raises(ValueError, match="must divide"):
        LLM(**knobs(tiny_model_dir, tensor_parallel_size=3))
    with pytest.raises(ValueError, match="exceeds"):
        LLM(**knobs(tiny_model_dir, pipeline_parallel_size=9))


def children(pid: int) -> list[int]:
    kids = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        text = (task / "children").read_text().split()
        kids += [int(k) for k in text]
    return kids


def test_server_greedy_matches_and_a_dead_rank_fails_requests_visibly(tiny_model_dir,
                                                                      reference_outputs):
    eng = knobs(tiny_model_dir, tensor_parallel_size=2, pipeline_parallel_size=2)
    eng.pop("model")
    with InProcessServer(tiny_model_dir, engine_kw=eng) as s:
        for i, prompt in enumerate(PROMPTS):
            r = httpx.post(s.url + "/v1/completions", timeout=120, json={
                "prompt": prompt, "max_tokens": MAX_TOKENS[i], "temperature": 0,
                "ignore_eos": True})
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] == MAX_TOKENS[i]
            assert r.json()["choices"][0]["text"] == reference_outputs[i].text
        ranks = children(s.engine.client.proc.pid)
        assert len(ranks) == 4
        with httpx.stream("POST", s.url + "/v1/completions", timeout=60, json={
                "prompt": PROMPTS[0], "max_tokens": 300, "ignore_eos": True,
                "stream": True}) as r:
            lines = r.iter_lines()
            next(x for x in lines if x.startswith("data: "))
            os.kill(ranks[-1], signal.SIGKILL)
            events = [x for x in lines if x.startswith("data: ")]
        assert events[-1] == "data: [DONE]" and '"error"' in events[-2]
        assert "rank" in events[-2] and "died" in events[-2]
        deadline = time.monotonic() + 30
        while httpx.get(s.url + "/health").status_code != 503:
            assert time.monotonic() < deadline, "the server still says it is healthy"
            time.sleep(0.1)
        r = httpx.post(s.url + "/v1/completions", json={"prompt": "x"}, timeout=10)
        assert r.status_code == 503


def test_a_rank_that_dies_while_the_server_is_idle_makes_it_unhealthy_at_once(tiny_model_dir):
    # Found only by the next request's submit before: /health said ok meanwhile.
    eng = knobs(tiny_model_dir, pipeline_parallel_size=2)
    eng.pop("model")
    with InProcessServer(tiny_model_dir, engine_kw=eng) as s:
        ranks = children(s.engine.client.proc.pid)
        assert len(ranks) == 2 and httpx.get(s.url + "/health").status_code == 200
        os.kill(ranks[-1], signal.SIGKILL)
        deadline = time.monotonic() + 30
        while httpx.get(s.url + "/health").status_code != 503:
            assert time.monotonic() < deadline, "the server still says it is healthy"
            time.sleep(0.1)


def listening(pid: int) -> list[str]:
    """The local addresses (hex, as /proc/net prints them) of the TCP sockets ``pid``
    listens on."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    out = []
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            f = line.split()
            if f[3] == "0A" and f[9] in inodes:  # LISTEN
                out.append(f[1].rsplit(":", 1)[0])
    return out


LOOPBACK = {"0100007F", "00000000000000000000000001000000", "0000000000000000FFFF00000100007F"}


def test_ranks_listen_on_loopback_and_die_with_their_driver(tiny_model_dir, tmp_path):
    """The rendezvous store and the ranks' collective sockets are on 127.0.0.1 only (torch's
    own store listens on every interface), and a driver killed outright takes its ranks with
    it (a rank stuck in a collective never reads the pipe that would tell it)."""
    import subprocess
    import sys

    script = tmp_path / "driver.py"
    config = knobs(tiny_model_dir, pipeline_parallel_size=2)
    script.write_text(
        "import time\n"
        "from fluidserve.config import EngineConfig\n"
        "from fluidserve.engine.engine import LLMEngine\n"
        "if __name__ == '__main__':  # (the ranks, spawned, import this file)\n"
        f"    e = LLMEngine(EngineConfig.create(**{config!r}))\n"
        "    print(' '.join(str(p.pid) for p in e.executor.procs), flush=True)\n"
        "    time.sleep(600)\n")
    driver = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True,
                              cwd=Path(__file__).parent.parent)
    try:
        ranks = [int(p) for p in driver.stdout.readline().split()]
        assert len(ranks) == 2
        addresses = [a for pid in (driver.pid, *ranks) for a in listening(pid)]
        assert addresses and set(addresses) <= LOOPBACK, addresses
        driver.kill()
        driver.wait(10)
        deadline = time.monotonic() + 20
        while any(Path(f"/proc/{r}").exists() and "Z" not in
                  Path(f"/proc/{r}/stat").read_text().split()[2] for r in ranks):
            assert time.monotonic() < deadline, "a rank outlived its driver"
            time.sleep(0.1)
    finally:
        if driver.poll() is None:
            driver.kill()


def test_generate_with_pipeline_parallelism_exits(tiny_model_dir):
    """The ranks ignore SIGTERM and multiprocessing joins them at exit: `generate` used to
    print its output and then wait for them for ever."""
    import json
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "fluidserve.cli", "generate", "--model", str(tiny_model_dir),
           "--prompt", PROMPTS[3], "--max-tokens", "4", "--temperature", "0", "--json",
           "--num-threads", "1", "-pp", "2"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert len(json.loads(done.stdout.splitlines()[0])["token_ids"]) == 4
    bad = subprocess.run([*cmd, "--tokenizer", "/nonexistent"], capture_output=True,
                         text=True, timeout=120)
    assert bad.returncode != 0 and "nonexistent" in bad.stderr


def test_stats_of_a_dead_rank_is_an_error_not_a_hang(tiny_model_dir):
    engine = LLMEngine(EngineConfig.create(**knobs(tiny_model_dir, pipeline_parallel_size=2)))
    try:
        ex = engine.executor
        assert [s["rank"] for s in ex.stats()] == [0, 1]
        # A call that gives up leaves its replies to come: the next call skips them. (With no
        # time to wait, a call gives up unless both ranks answered within microseconds, which
        # a fast machine sometimes does: the first of a few that gives up is the case.)
        for _ in range(20):
            try:
                ex.stats(timeout=0)
            except RuntimeError as e:
                assert "no statistics" in str(e)
                break
        else:
            pytest.fail("20 calls with no time to wait all had their replies")
        time.sleep(0.2)
        a = ex.stats()
        time.sleep(0.5)
        b = ex.stats()
        assert all(y["wall_s"] - x["wall_s"] >= 0.5 for x, y in zip(a, b, strict=True))
        os.kill(ex.procs[0].pid, signal.SIGKILL)  # not the sampling rank
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match="rank 0"):
            ex.stats(timeout=5)
        assert time.monotonic() - t0 < 10
    finally:
        engine.shutdown()
