"""Asynchronous streaming client for any OpenAI-compatible endpoint.

Records the arrival time of every streamed token. A chunk that carries k tokens counts as
k tokens arriving together (the first gap is the wait, the other k-1 gaps are zero); k comes
from per-chunk usage (``continuous_usage_stats``) when the server sends it, else from the
chunk's logprobs, else from re-tokenizing the chunk text (a reasoning model's
``reasoning_content`` counts), and the total is reconciled with the final ``usage`` when the
server reports it. A request succeeded only if its stream ended with ``[DONE]`` and not with
``finish_reason`` ``abort`` or ``error``; whatever else goes wrong with one request (a status,
a malformed chunk, a timeout) is that request's error, never the run's.
"""

from __future__ import annotations

import asyncio
import heapq
import json
import time
from dataclasses import dataclass, field

import httpx

from fluidserve.bench.records import RequestRecord
from fluidserve.bench.workload import WorkloadRequest

__all__ = ["Client", "ClientConfig", "RequestRecord"]


@dataclass
class ClientConfig:
    base_url: str
    endpoint: str = "/v1/completions"
    model: str | None = None
    api_key: str | None = None
    ignore_eos: bool = True
    timeout: float = 600.0
    max_concurrency: int | None = None
    temperature: float = 0.0


class Client:
    def __init__(self, cfg: ClientConfig, tokenizer=None, transport=None) -> None:
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.transport = transport  # an httpx transport (tests inject a mock server)
        self.chat = "chat" in cfg.endpoint

    def body(self, prompt: str | list[int], max_tokens: int) -> dict:
        body = {"max_tokens": max_tokens, "stream": True, "temperature": self.cfg.temperature,
                "ignore_eos": self.cfg.ignore_eos, "return_metrics": True,
                "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
        if self.cfg.model:
            body["model"] = self.cfg.model
        if self.chat:
            body["messages"] = [{"role": "user", "content": prompt}]
        else:
            body["prompt"] = prompt
        return body

    async def run(self, work: list[WorkloadRequest], prompts: list, progress=None
                  ) -> list[RequestRecord]:
        """Open loop: each request is sent at its arrival time, whatever the others do;
        ``max_concurrency`` (if set) caps requests in flight, making it closed-loop."""
        limit = self.cfg.max_concurrency
        sem = asyncio.Semaphore(limit) if limit else None
        conns = max(100, limit or len(work))
        headers = {"Authorization": f"Bearer {self.cfg.api_key}"} if self.cfg.api_key else {}
        async with httpx.AsyncClient(base_url=self.cfg.base_url, headers=headers,
                                     timeout=httpx.Timeout(self.cfg.timeout, connect=30.0),
                                     limits=httpx.Limits(max_connections=conns,
                                                         max_keepalive_connections=conns),
                                     transport=self.transport) as http:
            start = time.perf_counter()

            async def one(w: WorkloadRequest, prompt) -> RequestRecord:
                rec = RequestRecord(w.index, w.prompt_len, w.output_len, w.arrival)
                await asyncio.sleep(max(0.0, start + w.arrival - time.perf_counter()))
                if sem is not None:
                    async with sem:
                        await self._send(http, rec, prompt, start)
                else:
                    await self._send(http, rec, prompt, start)
                if progress is not None:
                    progress.update(1)
                return rec

            return await asyncio.gather(*(one(w, p) for w, p in zip(work, prompts, strict=True)))

    async def _send(self, http: httpx.AsyncClient, rec: RequestRecord, prompt, start: float):
        rec.sent = time.perf_counter() - start
        t0, seen = time.perf_counter(), _Arrivals()
        try:
            async with asyncio.timeout(self.cfg.timeout):
                await self._stream(http, rec, prompt, seen)
        except TimeoutError:
            rec.error = f"timed out after {self.cfg.timeout:g} s (--timeout)"
        except Exception as e:  # anything a server sends ends this request, not the run
            rec.error = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
        # What arrived, however the stream ended (a cut one's gaps count in TBT).
        rec.gaps = arrival_gaps(seen.chunks, t0, seen.final)
        rec.num_output_tokens = len(rec.gaps)
        if rec.error is not None and rec.error.startswith("timed out"):
            rec.error += f" with {len(rec.gaps)} tokens"
        if rec.error is None and rec.num_output_tokens == 0:
            rec.error = "the stream ended without any token"

    async def _stream(self, http, rec: RequestRecord, prompt, seen: _Arrivals) -> None:
        async with http.stream("POST", self.cfg.endpoint, json=self.body(prompt, rec.output_len)
                               ) as r:
            if r.status_code != 200:
                body = (await r.aread()).decode(errors="replace")
                rec.error = f"HTTP {r.status_code}: {_error_message(body)}"
                return
            chunks = seen.chunks
            counted, done, reason, event = 0, False, None, None
            async for line in r.aiter_lines():
                if line.startswith("event:"):  # an SSE event's name (an "error" one too)
                    event = line[6:].strip()
                    continue
                if not line.startswith("data:"):
                    if not line:
                        event = None  # a blank line ends the event
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    done = True
                    break
                obj = json.loads(data)
                if not isinstance(obj, dict):
                    raise ValueError(f"a stream chunk is not a JSON object: {data[:100]}")
                if obj.get("error") is not None or event == "error":
                    rec.error = f"stream error: {_error_message(json.dumps(obj))}"
                    return
                now = time.perf_counter()
                usage = obj.get("usage") or {}
                if usage.get("prompt_tokens") is not None:
                    rec.server_prompt_tokens = usage["prompt_tokens"]
                metrics = obj.get("metrics")
                if isinstance(metrics, dict) and metrics.get("scheduling_delay") is not None:
                    rec.scheduling_delay = metrics["scheduling_delay"]
                if not obj.get("choices"):
                    seen.final = usage.get("completion_tokens", seen.final)
                    if seen.final and not chunks:  # every token came in this one chunk
                        chunks.append((now, 0))
                    continue
                reason = obj["choices"][0].get("finish_reason") or reason
                k = max(self._tokens_in(obj, usage, counted), 0)
                chunks.append((now, k))
                counted += k
            if not done:
                n = seen.final if seen.final is not None else counted
                rec.error = f"the stream ended before its [DONE] after {n} tokens"
            elif reason in ("abort", "error"):
                rec.error = f"the server ended the stream with finish_reason {reason!r}"

    def _tokens_in(self, obj: dict, usage: dict, counted: int) -> int:
        if usage.get("completion_tokens") is not None:
            return usage["completion_tokens"] - counted
        choice = obj["choices"][0]
        lp = choice.get("logprobs") or {}
        if lp.get("tokens") or lp.get("content"):
            return len(lp.get("tokens") or lp.get("content"))
        if self.chat:
            delta = choice.get("delta") or {}
            text = "".join(delta.get(f) or "" for f in ("content", "reasoning_content",
                                                         "reasoning"))
        else:
            text = choice.get("text")
        if not text:  # e.g. the chat role chunk; the final usage reconciles the count
            return 0
        if self.tokenizer is None:
            return 1
        return max(1, len(self.tokenizer.encode(text, add_special_tokens=False)))


@dataclass
class _Arrivals:
    """What a stream brought, kept through a timeout that cuts it."""

    chunks: list[tuple[float, int]] = field(default_factory=list)  # (arrival, tokens in it)
    final: int | None = None  # the server's own count (final usage), if it sent one


def arrival_gaps(chunks: list[tuple[float, int]], t0: float, final: int | None
                 ) -> list[float]:
    """TTFT then every inter-token gap, from each chunk's arrival time and the tokens counted
    in it; a chunk of k tokens is k tokens arriving together.

    Counts that were estimated (from re-tokenized text) are reconciled with the server's own
    total (``final``) keeping every arrival time: an estimate short of it is scaled up (when
    nothing was counted, every token came with the last chunk); tokens it over-counted come
    off the most bundled chunks first, then two chunks that followed each other most closely
    become one (the likeliest to be one token split in two; the first token's time and the
    last one's are kept)."""
    counts = [k for _, k in chunks]
    if final is not None and chunks:
        extra = final - sum(counts)
        if extra > 0 and sum(counts):  # spread in proportion to the estimates
            total = sum(counts)
            scaled = [k * final / total for k in counts]
            counts = [int(x) for x in scaled]
            for i in sorted(range(len(counts)), key=lambda j: int(scaled[j]) - scaled[j]
                            )[:final - sum(counts)]:
                counts[i] += 1
        elif extra > 0:  # nothing was counted: they came with the last chunk
            counts[-1] = extra
        # (In O(n log n): this runs on the client's event loop as the stream ends.)
        bundles = [(-k, i) for i, k in enumerate(counts) if k > 1]
        heapq.heapify(bundles)
        while extra < 0 and bundles:
            _, i = heapq.heappop(bundles)
            counts[i] -= 1
            extra += 1
            if counts[i] > 1:
                heapq.heappush(bundles, (-counts[i], i))
        if extra < 0:  # a token a chunk: those closest to the next become part of it
            kept = [j for j, k in enumerate(counts) if k]
            after = {a: b for a, b in zip(kept, kept[1:], strict=False)}
            inner = sorted(kept[1:-1], key=lambda j: chunks[after[j]][0] - chunks[j][0])
            for j in (inner + kept[-1:])[:-extra]:  # (then the last: final is tiny)
                counts[j] = 0
    gaps, last_t = [], t0
    for (t, _), k in zip(chunks, counts, strict=True):
        if k > 0:
            gaps += [t - last_t] + [0.0] * (k - 1)
            last_t = t
    return gaps


def _error_message(body: str) -> str:
    try:
        obj = json.loads(body)
        return str(obj["error"]["message"]) if isinstance(obj.get("error"), dict) else body[:300]
    except (json.JSONDecodeError, AttributeError, KeyError, TypeError):
        return body[:300]
