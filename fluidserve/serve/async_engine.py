"""Runs the engine loop in its own thread and streams each request's outputs to asyncio.

The event loop never touches the engine directly: it sends commands (add, abort, fail-all)
that the engine thread applies between iterations, and receives RequestOutputs through a
per-request asyncio.Queue. A slow consumer only grows its own queue.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from fluidserve.engine.engine import LLMEngine, RequestOutput
from fluidserve.sampling_params import SamplingParams

log = logging.getLogger(__name__)


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue


class Handle:
    """One request's output stream. Iterate it; leaving early aborts the request."""

    def __init__(self, engine: AsyncEngine, request_id: str, stream: _Stream) -> None:
        self.engine, self.request_id, self._stream = engine, request_id, stream
        self.finished = False

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        try:
            while not self.finished:
                out: RequestOutput = await self._stream.queue.get()
                self.finished = out.finished
                yield out
        finally:
            self.abort()

    def abort(self) -> None:
        if not self.finished:
            self.finished = True
            self.engine._submit(("abort", self.request_id))


class AsyncEngine:
    def __init__(self, engine: LLMEngine, on_step: Callable[[LLMEngine, list], None] | None = None):
        self.engine = engine
        self.on_step = on_step
        self._cmds: deque[tuple] = deque()
        self._wake = threading.Event()
        self._streams: dict[str, _Stream] = {}
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="fluidserve-engine", daemon=True)
        self.num_unfinished = 0  # written by the engine thread only
        self._pending_adds = 0  # submitted but not yet applied by the engine thread
        self._lock = threading.Lock()

    @property
    def num_waiting(self) -> int:
        """Requests accepted but not yet running (queued for the engine or in its queue)."""
        return self._pending_adds + self.engine.scheduler.num_waiting

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stopped = True
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    # ------------------------------------------------------------------ event-loop side
    async def add(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> Handle:
        """Queue a request; raises the engine's rejection (a ValueError) if it cannot run."""
        loop = asyncio.get_running_loop()
        added: asyncio.Future = loop.create_future()
        stream = _Stream(loop, asyncio.Queue())
        with self._lock:
            self._pending_adds += 1
        self._submit(("add", request_id, prompt_ids, params, stream, added))
        try:
            await added
        except asyncio.CancelledError:
            self._submit(("abort", request_id))
            raise
        return Handle(self, request_id, stream)

    def fail_all(self, message: str) -> None:
        self._submit(("fail_all", message))

    def _submit(self, cmd: tuple) -> None:
        self._cmds.append(cmd)
        self._wake.set()

    # ------------------------------------------------------------------ engine thread
    def _run(self) -> None:
        while not self._stopped:
            self._apply_commands()
            if not self.engine.has_unfinished():
                self._wake.wait(0.5)
                self._wake.clear()
                continue
            try:
                outs = self.engine.step()
            except Exception as e:  # a scheduler bug must not kill the server
                log.exception("engine step failed")
                outs = self._fail_everything(f"internal engine error: {e}")
            for out in outs:
                self._deliver(out)
            self.num_unfinished = len(self.engine.scheduler.requests)
            if self.on_step is not None:
                self.on_step(self.engine, outs)
        self._fail_everything("the server is shutting down")

    def _apply_commands(self) -> None:
        while self._cmds:
            cmd = self._cmds.popleft()
            if cmd[0] == "add":
                self._add(*cmd[1:])
            elif cmd[0] == "abort":
                if self.engine.abort(cmd[1]):
                    self._streams.pop(cmd[1], None)
            elif cmd[0] == "fail_all":
                for out in self._fail_everything(cmd[1]):
                    self._deliver(out)
        self.num_unfinished = len(self.engine.scheduler.requests)

    def _add(self, rid, prompt_ids, params, stream: _Stream, added: asyncio.Future) -> None:
        with self._lock:
            self._pending_adds -= 1
        try:
            self.engine.add_request(rid, prompt_ids, params)
        except Exception as e:  # rejection: hand the error to the waiting handler
            stream.loop.call_soon_threadsafe(_set_exception, added, e)
            return
        self._streams[rid] = stream
        stream.loop.call_soon_threadsafe(_set_result, added, None)

    def _deliver(self, out: RequestOutput) -> None:
        stream = self._streams.get(out.request_id)
        if stream is None:
            return
        if out.finished:
            del self._streams[out.request_id]
        stream.loop.call_soon_threadsafe(stream.queue.put_nowait, out)

    def _fail_everything(self, message: str) -> list[RequestOutput]:
        return self.engine.fail(list(self.engine.scheduler.requests), message)


def _set_result(fut: asyncio.Future, value) -> None:
    if not fut.done():
        fut.set_result(value)


def _set_exception(fut: asyncio.Future, exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)
