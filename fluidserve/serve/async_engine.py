"""The HTTP front end's engine: an engine-core process and one output stream per request.

The event loop never blocks on the core: requests are handed to the core client's writer
thread; the client's reader thread receives one ``EngineCoreOutputs`` per iteration,
detokenizes and applies stop strings (``OutputProcessor``), updates the metrics, and hands each
request its ``RequestOutput`` through the event loop (one callback per iteration, not per
token). A slow consumer only grows its own queue.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator, Callable

from fluidserve.config import EngineConfig
from fluidserve.engine.core_proc import EngineCoreClient
from fluidserve.engine.messages import AddRequest, CoreReady, EngineCoreOutputs, RequestDelta
from fluidserve.engine.output import OutputProcessor, RequestOutput
from fluidserve.model.tokenizer import Tokenizer
from fluidserve.sampling_params import SamplingParams
from fluidserve.serve.metrics import ServerMetrics

log = logging.getLogger(__name__)


class Handle:
    """One request's output stream. Iterate it; leaving early aborts the request."""

    def __init__(self, engine: AsyncEngine, request_id: str, queue: asyncio.Queue) -> None:
        self.engine, self.request_id, self._queue = engine, request_id, queue
        self.finished = False

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        try:
            while not self.finished:
                out: RequestOutput = await self._queue.get()
                self.finished = out.finished
                yield out
        finally:
            self.abort()

    def abort(self) -> None:
        if not self.finished:
            self.finished = True
            self.engine.abort(self.request_id)


class AsyncEngine:
    def __init__(self, config: EngineConfig, tokenizer: Tokenizer | None, metrics: ServerMetrics,
                 telemetry_file: str | None = None,
                 on_dead: Callable[[str], None] | None = None) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.metrics = metrics
        self._on_dead_cb = on_dead
        self.eos_token_id = tokenizer.eos_token_id if tokenizer is not None else None
        self._outputs = OutputProcessor(tokenizer)
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._lock = threading.Lock()  # streams and output states: event loop vs reader thread
        self._waiting_reported = 0
        self._added_since_stats = 0
        self.client = EngineCoreClient(config, self._on_outputs, self._on_dead, telemetry_file)
        self.info: CoreReady | None = None

    def start(self, timeout: float = 600.0) -> CoreReady:
        """Wait for the engine core to load its model."""
        self.info = self.client.wait_ready(timeout)
        return self.info

    def stop(self, timeout: float = 10.0) -> int | None:
        return self.client.shutdown(timeout)

    @property
    def dead(self) -> str | None:
        return self.client.dead

    @property
    def num_unfinished(self) -> int:
        """Requests accepted and not yet ended (queued to the core, waiting or running)."""
        return len(self._streams)

    @property
    def num_waiting(self) -> int:
        """Requests accepted but not yet running, as of the core's last report."""
        return self._waiting_reported + self._added_since_stats

    # ------------------------------------------------------------------ event-loop side
    def add(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> Handle:
        queue: asyncio.Queue = asyncio.Queue()
        with self._lock:
            if self.dead is not None:
                raise RuntimeError(self.dead)
            self._streams[request_id] = (asyncio.get_running_loop(), queue)
            self._outputs.add(request_id, params)
            self._added_since_stats += 1
        self.client.add(AddRequest(request_id, prompt_ids, params, self.eos_token_id))
        return Handle(self, request_id, queue)

    def abort(self, request_id: str) -> None:
        with self._lock:
            known = self._streams.pop(request_id, None) is not None
            self._outputs.forget(request_id)
        if known:
            self.client.abort([request_id])

    def fail_all(self, message: str) -> None:
        self.client.fail_all(message)

    # ------------------------------------------------------------------ reader thread
    def _on_outputs(self, msg: EngineCoreOutputs) -> None:
        self.metrics.observe(msg)
        ready: list[tuple[asyncio.AbstractEventLoop, asyncio.Queue, RequestOutput]] = []
        stopped = []
        with self._lock:
            if msg.stats is not None:
                self._waiting_reported = msg.stats.num_waiting
                self._added_since_stats = 0
            deltas = msg.outputs + [RequestDelta(rid, [], "error", why)
                                    for rid, why in msg.rejected.items()]
            for delta in deltas:
                try:
                    out, stop = self._outputs.process(delta)
                except Exception as e:  # a bad delta fails its own request, nobody else's
                    log.exception("output processing failed for %s", delta.request_id)
                    self._outputs.forget(delta.request_id)
                    out, stop = RequestOutput(delta.request_id, [], "", True, "error",
                                              f"internal error: {e}"), True
                if stop:
                    stopped.append(delta.request_id)
                if out is None:
                    continue
                target = self._streams.get(delta.request_id)
                if target is None:
                    continue
                if out.finished:
                    del self._streams[delta.request_id]
                ready.append((*target, out))
        if stopped:
            self.client.abort(stopped, reason="stop")
        self._deliver(ready)

    def _on_dead(self, message: str) -> None:
        with self._lock:
            ready = [(loop, q, RequestOutput(rid, [], "", True, "error", message))
                     for rid, (loop, q) in self._streams.items()]
            self._streams.clear()
        self._deliver(ready)
        if self._on_dead_cb is not None:
            self._on_dead_cb(message)

    @staticmethod
    def _deliver(ready: list) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for loop, q, out in ready:
            by_loop.setdefault(loop, []).append((q, out))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # the event loop is closed: nobody is listening any more
                pass


def _put_all(items: list[tuple[asyncio.Queue, RequestOutput]]) -> None:
    for q, out in items:
        q.put_nowait(out)
