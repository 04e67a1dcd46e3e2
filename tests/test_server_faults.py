"""No silent death, no request waiting forever: faults injected in each place the engine core
and the front end can fail, the watchdog, and what shutdown does to unfinished requests."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from .server_utils import free_port, start_servers, stop_servers, wait_healthy

LONG = {"prompt": "The river rose slowly", "max_tokens": 480, "ignore_eos": True}


def data_events(lines) -> list[str]:
    return [x for x in lines if x.startswith("data: ")]


def assert_failed_stream(events: list[str]) -> str:
    """The stream ended with an error event, then [DONE]; returns the error message."""
    assert events[-1] == "data: [DONE]", events[-3:]
    err = json.loads(events[-2][6:])["error"]
    assert err["type"] and err["message"]
    return err["message"]


# The core dies at: its loop, applying a command, sending outputs; it wedges (the watchdog
# must notice); or the front end cannot hand outputs to streams. Each must end every request.
DEATHS = ["loop", "command", "send", "wedge", "deliver"]
SMALL = {"num_kv_blocks": 1024}


@pytest.fixture(scope="module")
def fleet(tiny_model_dir, tmp_path_factory):
    """Every server this module needs, started at once (each test ends its own): one per
    fault, two for shutdown, and a `fluidserve serve` process."""
    logs, clis = [], {}
    for name, flags in (("cli", ["--watchdog-timeout", "2", "--token-budget", "auto",
                                 "--tbt-slo", "0.5"]),
                        ("cli_int", [])):
        port = free_port()
        log_path = tmp_path_factory.mktemp(name) / "server.log"
        logs.append(open(log_path, "w"))
        proc = subprocess.Popen(
            [sys.executable, "-m", "fluidserve.cli", "serve", "--port", str(port), "--model",
             str(tiny_model_dir), "--num-threads", "1", "--num-kv-blocks", "1024", *flags],
            stdout=logs[-1], stderr=subprocess.STDOUT,
            env=os.environ | {"PYTHONUNBUFFERED": "1"})
        clis[name] = (proc, f"http://127.0.0.1:{port}", log_path)
    specs = {point: dict(engine_kw=SMALL, watchdog_timeout=1.0) for point in DEATHS}
    specs["drain"] = dict(engine_kw=SMALL | {"max_num_seqs": 1}, drain_timeout=60)
    specs["stop"] = dict(engine_kw=SMALL | {"max_model_len": 2048}, drain_timeout=60)
    try:
        servers = start_servers(tiny_model_dir, specs)
    except BaseException:
        for proc, _, _ in clis.values():
            proc.kill()
        raise
    yield servers | clis
    stop_servers(servers)
    for proc, _, _ in clis.values():
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    for log in logs:
        log.close()


@pytest.mark.parametrize("point", DEATHS)
def test_a_fault_anywhere_fails_every_request_and_turns_unhealthy(fleet, point):
    s = fleet[point]
    with httpx.stream("POST", s.url + "/v1/completions", json=LONG | {"stream": True},
                      timeout=30) as r:
        lines = r.iter_lines()
        first = next(x for x in lines if x.startswith("data: "))
        s.engine.inject_fault(point)
        # A later request (also the command that trips the "command" fault).
        later = httpx.post(s.url + "/v1/completions", json={"prompt": "hi"}, timeout=30)
        events = [first, *data_events(lines)]
    message = assert_failed_stream(events)
    assert ("injected" in message or "no progress" in message), message
    # The core going down is the server's state, not the request's: 503, which a client or
    # load balancer may retry elsewhere; a fault in the front end's own code is a 500.
    code = json.loads(events[-2][6:])["error"]["code"]
    assert code == (500 if point == "deliver" else 503), code
    # Accepted and then failed in flight (the "command" fault), or refused once the core was
    # known down: either way a 503.
    assert later.status_code == 503 and later.json()["error"]["message"]
    assert s.dead.wait(10), "on_dead was not called (the server would not exit)"
    health = httpx.get(s.url + "/health")
    assert health.status_code == 503 and health.json()["status"] == "dead"
    refused = httpx.post(s.url + "/v1/completions", json={"prompt": "hi"}, timeout=30)
    assert refused.status_code == 503
    # The client's reader thread reaps the killed core too; two threads waiting on one
    # child race (the loser's waitpid fails and multiprocessing reports the child alive
    # until the winner has stored its exit code), so wait for an exit code, not is_alive.
    deadline = time.monotonic() + 10
    while s.engine.client.proc.exitcode is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert s.engine.client.proc.exitcode is not None, "the dead core was left running"


def test_drain_waits_for_queued_and_admitting_requests(fleet, monkeypatch):
    """SIGTERM's drain waits for every accepted request: running, queued in the core, and
    still being tokenized; requests arriving during the drain get 503."""
    s = fleet["drain"]
    prompts = s.app.state.fluidserve.prompts
    release, entered = threading.Event(), threading.Event()
    real = prompts.encode

    async def slow_encode(text: str, *args) -> list[int]:
        if text == "admitting":
            entered.set()
            await asyncio.to_thread(release.wait, 30)
        return await real(text, *args)

    monkeypatch.setattr(prompts, "encode", slow_encode)

    async def main():
        async with httpx.AsyncClient(base_url=s.url, timeout=60) as c:
            async def one(prompt: str) -> list[str]:
                body = {"prompt": prompt, "max_tokens": 30, "ignore_eos": True,
                        "stream": True, "stream_options": {"include_usage": True}}
                async with c.stream("POST", "/v1/completions", json=body) as r:
                    return [x async for x in r.aiter_lines() if x.startswith("data: ")]

            running = [asyncio.create_task(one(f"request {i}")) for i in range(3)]
            admitting = asyncio.create_task(one("admitting"))
            await asyncio.to_thread(entered.wait, 30)
            while s.engine.num_unfinished < 3:
                await asyncio.sleep(0.01)
            s.signal()
            refused = await c.post("/v1/completions", json={"prompt": "late"})
            done = await asyncio.gather(*running)
            await asyncio.sleep(0.5)
            still_up = s.thread.is_alive()
            release.set()
            return refused, done + [await admitting], still_up

    refused, results, still_up = asyncio.run(main())
    assert refused.status_code == 503
    assert still_up, "the drain ended while a request was still being tokenized"
    for events in results:
        assert events[-1] == "data: [DONE]"
        assert json.loads(events[-2][6:])["usage"]["completion_tokens"] == 30
    s.thread.join(15)
    assert not s.thread.is_alive()


def test_a_second_signal_ends_unfinished_streams_with_an_error(fleet):
    s = fleet["stop"]
    body = {"prompt": "hi", "max_tokens": 2000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", s.url + "/v1/completions", json=body, timeout=30) as r:
        lines = r.iter_lines()
        first = next(x for x in lines if x.startswith("data: "))
        s.signal()  # drain: the request may run on...
        s.signal()  # ...until a second signal stops the server now
        events = [first, *data_events(lines)]
    assert "shutting down" in assert_failed_stream(events)
    assert len(events) < 1000, "the request ran to its end"
    s.thread.join(15)
    assert not s.thread.is_alive()


def _core_pid(server_pid: int, timeout: float = 30.0) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        kids = Path(f"/proc/{server_pid}/task/{server_pid}/children").read_text().split()
        for kid in kids:
            cmd = Path(f"/proc/{kid}/cmdline").read_bytes()
            if b"spawn_main" in cmd and b"resource_tracker" not in cmd:
                return int(kid)
        time.sleep(0.1)
    raise TimeoutError("no engine-core process")


def test_cli_serve_exits_nonzero_when_its_engine_core_wedges(fleet):
    """A core that stops (SIGSTOP: no crash, no exit) is found by the watchdog: the stream gets
    an error, and `fluidserve serve` exits 1 so that a supervisor restarts it."""
    proc, url, log_path = fleet["cli"]
    wait_healthy(url, proc=proc)
    core = _core_pid(proc.pid)
    try:
        with httpx.stream("POST", url + "/v1/completions", json=LONG | {"stream": True},
                          timeout=30) as r:
            lines = r.iter_lines()
            first = next(x for x in lines if x.startswith("data: "))
            os.kill(core, signal.SIGSTOP)
            events = [first, *data_events(lines)]
        assert "no progress" in assert_failed_stream(events)
        assert proc.wait(30) == 1
        log = log_path.read_text()  # (the server runs `--token-budget auto`)
        assert "(token budget auto)" in log and "Logging error" not in log
    finally:
        if Path(f"/proc/{core}").exists():
            os.kill(core, signal.SIGKILL)


def test_ctrl_c_twice_fails_the_streams_and_exits(fleet):
    """Two SIGINTs (Ctrl-C twice): the first drains, the second ends the streams with an error,
    and the process exits 0 with its engine core stopped. (The second used to be uvicorn's
    forced exit, which skipped the app's shutdown: the core was never stopped and the process
    waited on it for ever, deaf to further signals.)"""
    proc, url, log_path = fleet["cli_int"]
    wait_healthy(url, proc=proc)
    core = _core_pid(proc.pid)
    with httpx.stream("POST", url + "/v1/completions", json=LONG | {"stream": True},
                      timeout=30) as r:
        lines = r.iter_lines()
        first = next(x for x in lines if x.startswith("data: "))
        proc.send_signal(signal.SIGINT)
        time.sleep(0.3)
        proc.send_signal(signal.SIGINT)
        events = [first, *data_events(lines)]
    assert "shutting down" in assert_failed_stream(events)
    try:
        assert proc.wait(30) == 0, log_path.read_text()[-2000:]
    finally:
        if Path(f"/proc/{core}").exists() and proc.poll() is None:
            os.kill(core, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while Path(f"/proc/{core}").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not Path(f"/proc/{core}").exists(), "the engine core outlived the server"
    assert "CancelledError" not in log_path.read_text()


def _exit_at_once() -> None:
    os._exit(3)


def test_core_exit_seen_by_every_thread_that_waits() -> None:
    """The client's reader, its watchdog and shutdown may wait for the core's exit at once.
    ``Process.join``/``exitcode`` from several threads race in waitpid, and the loser reads a
    dead process as running (then kills a reaped PID); ``wait_exit`` gives each the code."""
    import multiprocessing as mp

    from fluidserve.engine.core_proc import kill_unless_exited, wait_exit

    ctx = mp.get_context("fork")
    # Join/exitcode from three threads misread 10-20% of such trials on this 2-core machine;
    # 25 trials (a fork of the large test process is ~0.2 s) catch that nearly always.
    for _ in range(25):
        proc = ctx.Process(target=_exit_at_once)
        proc.start()
        start, codes = threading.Barrier(3), []

        def waiter(proc=proc, start=start, codes=codes) -> None:
            start.wait()
            codes.append(wait_exit(proc, 10))
        threads = [threading.Thread(target=waiter) for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert codes == [3, 3, 3]

    class Exited:  # its sentinel is readable: it has exited, whatever else it says
        exitcode = 3

        def __init__(self) -> None:
            self.sentinel, w = os.pipe()
            os.close(w)

        def kill(self) -> None:
            raise AssertionError("signalled a process that had exited")
    exited = Exited()
    kill_unless_exited(exited)
    os.close(exited.sentinel)

    running = ctx.Process(target=time.sleep, args=(60,))
    running.start()
    assert wait_exit(running, 0.05) is None
    kill_unless_exited(running)
    assert wait_exit(running, 10) == -signal.SIGKILL


def test_stop_process_terminates_then_kills() -> None:
    """What the launchers and benchmarks use to stop a server they started."""
    from fluidserve.net import stop_process

    polite = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    assert stop_process(polite, 10) == -signal.SIGTERM
    deaf = subprocess.Popen([sys.executable, "-c", "import signal, sys, time;"
                             " signal.signal(signal.SIGTERM, signal.SIG_IGN);"
                             " sys.stdout.write('ready\\n'); sys.stdout.flush(); time.sleep(60)"],
                            stdout=subprocess.PIPE, text=True)
    assert deaf.stdout.readline() == "ready\n"  # SIGTERM is ignored from here on
    assert stop_process(deaf, 0.5) is None and deaf.returncode == -signal.SIGKILL
    assert stop_process(deaf) == -signal.SIGKILL  # already ended: just its code
    deaf.stdout.close()


class SilentCore:
    """An engine-core client whose core reads nothing and says nothing until told to."""

    dead = None

    def __init__(self, config, on_outputs, on_dead, telemetry_file=None) -> None:
        self.on_outputs, self.sent = on_outputs, []

    def add(self, msg) -> None:
        self.sent.append(msg)

    def add_many(self, msgs) -> None:
        self.sent += msgs

    def abort(self, ids, reason: str = "abort") -> None:
        pass

    def declare_dead(self, message: str) -> None:
        self.dead = message

    def wait_ready(self, timeout: float):
        return None

    def shutdown(self, timeout: float) -> int:
        return 0


def silent_engine(monkeypatch, watchdog: float = 60.0):
    from fluidserve.config import EngineConfig
    from fluidserve.serve import async_engine
    from fluidserve.serve.metrics import ServerMetrics

    monkeypatch.setattr(async_engine, "EngineCoreClient", SilentCore)
    engine = async_engine.AsyncEngine(EngineConfig.create(), None, ServerMetrics(),
                                      watchdog_timeout=watchdog)
    engine.start()
    return engine


def test_requests_sent_during_a_reported_iteration_still_count_as_waiting(monkeypatch):
    from fluidserve.engine.messages import EngineCoreOutputs, SchedulerStats
    from fluidserve.sampling_params import SamplingParams

    engine = silent_engine(monkeypatch)

    async def main() -> None:
        for i in range(5):
            engine.add(f"r{i}", [1, 2, 3], SamplingParams(max_tokens=4))
        assert engine.num_waiting == 5
        # The core reports on an iteration it started before it read any of them: none
        # waiting, as far as it knew; all five still are.
        engine._on_outputs(EngineCoreOutputs([], stats=SchedulerStats(0, 0, 0.0, 0, 0),
                                             adds_seen=0))
        assert engine.num_waiting == 5
        engine._on_outputs(EngineCoreOutputs([], stats=SchedulerStats(0, 3, 0.0, 0, 3),
                                             adds_seen=5))  # it read them; 2 run already
        assert engine.num_waiting == 3

    asyncio.run(main())
    engine._stopping.set()


def test_the_watchdog_fires_on_a_wedged_core_whose_clients_give_up_first(monkeypatch):
    from fluidserve.sampling_params import SamplingParams

    engine = silent_engine(monkeypatch, watchdog=0.4)

    async def main() -> None:
        for i in range(12):  # each client leaves after 0.1 s, before the watchdog's 0.4 s
            engine.add(f"r{i}", [1, 2, 3], SamplingParams(max_tokens=4))
            await asyncio.sleep(0.1)
            engine.abort(f"r{i}")
            if engine.client.dead:
                return

    asyncio.run(main())
    assert engine.client.dead and "no progress" in engine.client.dead
    engine._stopping.set()


def test_stopping_ends_every_stream_the_cores_last_message_left_open(monkeypatch):
    from fluidserve.sampling_params import SamplingParams

    engine = silent_engine(monkeypatch)

    async def main() -> list:
        handle = engine.add("r", [1, 2, 3], SamplingParams(max_tokens=4))
        engine.stop()

        async def read() -> list:
            return [out async for out in handle]
        return await asyncio.wait_for(read(), 10)  # (it waited for ever)

    outs = asyncio.run(main())
    assert [(o.finish_reason, o.error, o.unavailable) for o in outs] == [
        ("error", "the server is shutting down", True)]
    assert engine.num_unfinished == 0


def test_a_shutdown_keeps_what_the_same_pass_had_gathered():
    """Rejections and failures read just before the Shutdown reach the front end with its
    last message (a stream whose request was refused there waited for ever)."""
    import multiprocessing as mp

    from fluidserve.core.scheduler import RequestRejected
    from fluidserve.engine.core_proc import _busy_loop
    from fluidserve.engine.messages import (
        AddRequest,
        EngineCoreOutputs,
        FailAll,
        RequestDelta,
        Shutdown,
    )
    from fluidserve.sampling_params import SamplingParams

    class Core:  # refuses every request; a drain fails the one it holds
        faults: dict = {}
        in_flight: list = []

        def trip(self, point: str) -> None:
            pass

        def has_unfinished(self) -> bool:
            return False

        def add(self, msg) -> None:
            raise RequestRejected("too long")

        def fail_all(self, message: str) -> list:
            return [RequestDelta("held", [], "error", message)] if "drain" in message else []

        def make_outputs(self, deltas: list) -> EngineCoreOutputs:
            return EngineCoreOutputs(deltas)

    inbox, to_core = mp.Pipe(duplex=False)
    from_core, outbox = mp.Pipe(duplex=False)
    for msg in (AddRequest("bad", [1], SamplingParams()), FailAll("drain timeout"), Shutdown()):
        to_core.send(msg)
    _busy_loop(Core(), inbox, outbox)
    last = from_core.recv()
    assert not from_core.poll(0.1)
    assert last.rejected == {"bad": "too long"} and last.adds_seen == 1
    assert [(d.request_id, d.finish_reason) for d in last.outputs] == [("held", "error")]
