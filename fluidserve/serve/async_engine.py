"""The HTTP front end's engine: an engine-core process and one output stream per request.

The event loop never blocks on the core: requests are handed to the core client's writer
thread; the client's reader thread receives one ``EngineCoreOutputs`` per iteration,
detokenizes and applies stop strings (``OutputProcessor``), updates the metrics, and hands each
request its ``RequestOutput`` through the event loop (one callback per iteration, not per
token). A slow consumer only grows its own queue.

No request waits forever: if the core dies, fails, or makes no progress for
``watchdog_timeout`` seconds while requests are in flight (a watchdog thread checks), or if the
front end's own processing of the core's outputs breaks, every stream ends with an error and
``on_dead`` is called (the server turns unhealthy and exits non-zero).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable

from fluidserve.config import EngineConfig
from fluidserve.engine.core_proc import EngineCoreClient
from fluidserve.engine.messages import AddRequest, CoreReady, EngineCoreOutputs, RequestDelta
from fluidserve.engine.output import OutputProcessor, RequestOutput
from fluidserve.model.tokenizer import Tokenizer
from fluidserve.sampling_params import SamplingParams
from fluidserve.serve.metrics import ServerMetrics
from fluidserve.serve.request_log import RequestLog

log = logging.getLogger(__name__)

FRONT_END_FAULTS = ("output", "metrics", "deliver")


class Handle:
    """The output streams of one or more requests (the choices of one API request), merged in
    the order their outputs arrive. Iterate it; leaving early aborts those not finished.

    ``token_texts`` maps the token ids of its outputs (and of their top logprobs, when asked
    for) to their text, decoded off the event loop."""

    def __init__(self, engine: AsyncEngine, request_ids: list[str], queue: asyncio.Queue) -> None:
        self.engine, self._queue = engine, queue
        self._open = dict.fromkeys(request_ids)  # not finished, in the order given
        self.token_texts: dict[int, str] = {}

    @property
    def finished(self) -> bool:
        return not self._open

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        try:
            while self._open:
                out, texts = await self._queue.get()
                if out.finished:
                    self._open.pop(out.request_id, None)
                if texts:
                    self.token_texts.update(texts)
                yield out
        finally:
            self.abort()

    def abort(self) -> None:
        if self._open:
            self.engine.abort(*self._open)
            self._open.clear()


class AsyncEngine:
    def __init__(self, config: EngineConfig,
                 tokenizer: Tokenizer | Callable[[], Tokenizer] | None,
                 metrics: ServerMetrics, telemetry_file: str | None = None,
                 on_dead: Callable[[str], None] | None = None,
                 watchdog_timeout: float = 60.0, request_log: str | None = None) -> None:
        """``tokenizer``: a tokenizer, or a function that loads one: it is called once the
        engine-core process has been started, so that the two load side by side (loading a
        tokenizer imports transformers: seconds). If it raises, the core is stopped."""
        self.config = config
        self.metrics = metrics
        self._on_dead_cb = on_dead
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue, bool]] = {}
        self._lock = threading.Lock()  # streams and output states: event loop vs reader thread
        self._waiting_reported = 0
        self._adds_sent = 0  # AddRequests sent to the core
        self._adds_reported = 0  # of which the core had read as many when it last reported
        self._adds_acked = 0  # of which the core has said it read as many (any message)
        self._faults: dict[str, int] = {}
        self.watchdog_timeout = watchdog_timeout
        self.request_log = RequestLog(request_log) if request_log else None
        self._last_progress = time.monotonic()
        self._stopping = threading.Event()
        if config.disagg.disaggregate:  # prefill and decode instances (TetriInfer)
            from fluidserve.disagg.client import DisaggClient

            self.client = DisaggClient(config, self._on_outputs, self._on_dead, telemetry_file)
        else:
            self.client = EngineCoreClient(config, self._on_outputs, self._on_dead,
                                           telemetry_file)
        self.info: CoreReady | None = None
        if callable(tokenizer):
            try:
                tokenizer = tokenizer()
            except BaseException:
                self.client.abandon()
                if self.request_log is not None:
                    self.request_log.close()
                raise
        self.tokenizer = tokenizer
        self.eos_token_id = tokenizer.eos_token_id if tokenizer is not None else None
        self._outputs = OutputProcessor(tokenizer)

    def start(self, timeout: float = 600.0) -> CoreReady:
        """Wait for the engine core to load its model, then start watching it."""
        try:
            self.info = self.client.wait_ready(timeout)
        except BaseException:  # the core could not start: reap it, close what was opened
            self.client.abandon()
            if self.request_log is not None:
                self.request_log.close()
            raise
        threading.Thread(target=self._watch, name="fluidserve-watchdog", daemon=True).start()
        return self.info

    def stop(self, timeout: float = 10.0) -> int | None:
        self._stopping.set()
        code = self.client.shutdown(timeout)
        # Whatever the core's last message did not end ends here.
        self._deliver(self._end_streams("the server is shutting down"))
        if self.request_log is not None:
            self.request_log.close()
        return code

    @property
    def stopped(self) -> bool:
        return self._stopping.is_set()

    @property
    def dead(self) -> str | None:
        return self.client.dead

    @property
    def num_unfinished(self) -> int:
        """Requests accepted and not yet ended (queued to the core, waiting or running)."""
        return len(self._streams)

    @property
    def num_waiting(self) -> int:
        """Requests accepted but not yet running: as of the core's last report, and those sent
        since it read its inbox for that report (not since the report arrived: requests added
        during the iteration it reported on are in neither)."""
        return self._waiting_reported + self._adds_sent - self._adds_reported

    def inject_fault(self, point: str, times: int = 1) -> None:
        """Testing: see ``messages.InjectFault`` (front-end points are handled here)."""
        if point in FRONT_END_FAULTS:
            self._faults[point] = times
        else:
            self.client.inject_fault(point, times)

    def _trip(self, point: str) -> None:
        if self._faults.get(point, 0) > 0:
            self._faults[point] -= 1
            raise RuntimeError(f"injected {point} fault")

    # ------------------------------------------------------------------ event-loop side
    def add(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> Handle:
        return self.add_all([(request_id, prompt_ids, params)])

    def add_all(self, requests: list[tuple[str, list[int], SamplingParams]]) -> Handle:
        """Add requests (id, prompt ids, parameters) whose outputs come through one stream:
        all of them, or none if the core is dead."""
        queue: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()
        with self._lock:
            if self.dead is not None:
                raise RuntimeError(self.dead)
            # An idle core that has read every request sent: the watchdog measures progress
            # from here. (Not when it has not: requests whose clients gave up before a wedged
            # core read them would otherwise restart the clock for ever.)
            if not self._streams and self._adds_acked == self._adds_sent:
                self._last_progress = time.monotonic()
            for request_id, prompt_ids, params in requests:
                texts = (params.logprobs is not None or params.prompt_logprobs is not None) \
                    and self.tokenizer is not None
                self._streams[request_id] = (loop, queue, texts)
                self._outputs.add(request_id, params, prompt_ids)
            self._adds_sent += len(requests)
        for request_id, prompt_ids, params in requests:
            if self.request_log is not None:
                self.request_log.add(request_id, prompt_ids, params.max_tokens)
        # (in one message: what the samples' parameters share is sent once)
        self.client.add_many([AddRequest(request_id, prompt_ids, params, self.eos_token_id)
                              for request_id, prompt_ids, params in requests])
        return Handle(self, [rid for rid, _, _ in requests], queue)

    def abort(self, *request_ids: str) -> None:
        with self._lock:
            known = [rid for rid in request_ids if self._streams.pop(rid, None) is not None]
            for rid in request_ids:
                self._outputs.forget(rid)
        if known:
            self.client.abort(known)

    def fail_all(self, message: str) -> None:
        """End every unfinished request with this error now, whatever state the core is in."""
        ready = self._end_streams(message)
        self.client.fail_all(message)  # the core frees what they held
        self._deliver(ready)

    def _end_streams(self, message: str) -> list:
        """Forget every open stream; the error output each is to get (``_deliver``)."""
        with self._lock:
            ready = [(loop, q, _error_output(rid, message, unavailable=True), None)
                     for rid, (loop, q, _) in self._streams.items()]
            for rid in self._streams:
                self._outputs.forget(rid)
            self._streams.clear()
        return ready

    # ------------------------------------------------------------------ reader thread
    def _on_outputs(self, msg: EngineCoreOutputs) -> None:
        self._observe(msg)
        if self.request_log is not None and (msg.finished or msg.rejected):
            try:  # a full disk costs log lines, never the outputs of this message
                self.request_log.finished(msg.finished, list(msg.rejected))
            except Exception:
                log.exception("writing the request log failed")
        ready, stopped, failed = [], [], []
        with self._lock:
            self._adds_acked = msg.adds_seen
            if msg.stats is not None:
                self._waiting_reported = msg.stats.num_waiting
                self._adds_reported = msg.adds_seen
            deltas = msg.outputs + [RequestDelta(rid, [], "error", why)
                                    for rid, why in msg.rejected.items()]
            for delta in deltas:
                target = self._streams.get(delta.request_id)
                out, texts, stop = self._process(delta, target is not None and target[2])
                if stop:
                    (failed if out is not None and out.error else stopped).append(
                        delta.request_id)
                if target is None or out is None:
                    continue
                if out.finished:
                    del self._streams[delta.request_id]
                ready.append((target[0], target[1], out, texts))
            self._last_progress = time.monotonic()
        if stopped:
            self.client.abort(stopped, reason="stop")
        if failed:
            self.client.abort(failed)
        try:
            self._trip("deliver")
            self._deliver(ready)
        except Exception as e:  # these streams are no longer listed: end them here, then die
            message = f"internal error in the front end: {type(e).__name__}: {e}"
            self._deliver([(loop, q, _error_output(out.request_id, message), None)
                           for loop, q, out, _ in ready])
            raise

    def _process(self, delta: RequestDelta, want_texts: bool
                 ) -> tuple[RequestOutput | None, dict | None, bool]:
        """(output, token texts, whether the core must stop computing the request)."""
        try:
            self._trip("output")
            out, stop = self._outputs.process(delta)
            texts = self._texts(out) if want_texts and out is not None else None
            return out, texts, stop
        except Exception as e:  # a bad delta fails its own request, nobody else's
            log.exception("output processing failed for %s", delta.request_id)
            self._outputs.forget(delta.request_id)
            out = _error_output(delta.request_id, f"internal error: {e}")
            return out, None, not delta.finished

    def _observe(self, msg: EngineCoreOutputs) -> None:
        try:
            self._trip("metrics")
            self.metrics.observe(msg)
        except Exception:  # metrics are not worth a request: log, count, go on
            log.exception("updating metrics failed")
            self.metrics.internal_errors.labels("metrics").inc()

    def _texts(self, out: RequestOutput) -> dict[int, str]:
        ids = set(out.new_token_ids)
        for entry in out.new_logprobs + (out.prompt_logprobs or []):  # (lp, top[, rank])
            ids.update(i for i, _ in entry[1])
        return {i: self.tokenizer.decode([i], skip_special_tokens=False) for i in ids}

    def _on_dead(self, message: str) -> None:
        if self.request_log is not None:
            self.request_log.forget_all()
        with self._lock:
            ready = [(loop, q, _error_output(rid, message, unavailable=True), None)
                     for rid, (loop, q, _) in self._streams.items()]
            self._streams.clear()
        self._deliver(ready)
        if self._on_dead_cb is not None:
            self._on_dead_cb(message)

    @staticmethod
    def _deliver(ready: list) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for loop, q, out, texts in ready:
            by_loop.setdefault(loop, []).append((q, (out, texts)))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # the event loop is closed: nobody is listening any more
                pass

    # ------------------------------------------------------------------ watchdog thread
    def _watch(self) -> None:
        period = min(1.0, self.watchdog_timeout / 4)
        while not self._stopping.wait(period):
            if self.dead is not None:
                return
            stalled = time.monotonic() - self._last_progress
            if self._streams and stalled > self.watchdog_timeout:
                self.client.declare_dead(
                    f"the engine core made no progress for {stalled:.0f}s with"
                    f" {len(self._streams)} requests in flight")
                return


def _error_output(request_id: str, message: str, unavailable: bool = False) -> RequestOutput:
    return RequestOutput(request_id, [], "", True, "error", message, unavailable=unavailable)


def _put_all(items: list[tuple[asyncio.Queue, tuple]]) -> None:
    for q, item in items:
        q.put_nowait(item)
