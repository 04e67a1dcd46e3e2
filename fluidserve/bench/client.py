"""Asynchronous streaming client for any OpenAI-compatible endpoint.

Records the arrival time of every streamed token. A chunk that carries k tokens counts as
k tokens arriving together (the first gap is the wait, the other k-1 gaps are zero); k comes
from per-chunk usage (``continuous_usage_stats``) when the server sends it, else from the
chunk's logprobs, else from re-tokenizing the chunk text, and the total is reconciled with
the final ``usage`` when the server reports it.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass

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
        try:
            async with asyncio.timeout(self.cfg.timeout):
                await self._stream(http, rec, prompt, time.perf_counter())
        except TimeoutError:
            rec.error = (f"timed out after {self.cfg.timeout:g} s (--timeout) with"
                         f" {len(rec.gaps)} tokens")
        except (httpx.HTTPError, OSError, ValueError) as e:
            rec.error = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
        if rec.error is None and rec.num_output_tokens == 0:
            rec.error = "the stream ended without any token"

    async def _stream(self, http, rec: RequestRecord, prompt, t0: float) -> None:
        async with http.stream("POST", self.cfg.endpoint, json=self.body(prompt, rec.output_len)
                               ) as r:
            if r.status_code != 200:
                body = (await r.aread()).decode(errors="replace")
                rec.error = f"HTTP {r.status_code}: {_error_message(body)}"
                return
            last, counted, final = t0, 0, None
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                obj = json.loads(data)
                if "error" in obj:
                    rec.error = f"stream error: {_error_message(json.dumps(obj))}"
                    return
                now = time.perf_counter()
                usage = obj.get("usage") or {}
                if usage.get("prompt_tokens") is not None:
                    rec.server_prompt_tokens = usage["prompt_tokens"]
                if "metrics" in obj and obj["metrics"].get("scheduling_delay") is not None:
                    rec.scheduling_delay = obj["metrics"]["scheduling_delay"]
                if not obj.get("choices"):
                    final = usage.get("completion_tokens", final)
                    continue
                k = self._tokens_in(obj, usage, counted)
                if k > 0:
                    rec.gaps += [now - last] + [0.0] * (k - 1)
                    counted += k
                    last = now
            if final is not None and final != counted:  # reconcile with the server's count
                if final > counted:
                    rec.gaps += [0.0] * (final - counted)
                else:
                    del rec.gaps[final:]
                counted = final
            rec.num_output_tokens = counted

    def _tokens_in(self, obj: dict, usage: dict, counted: int) -> int:
        if usage.get("completion_tokens") is not None:
            return usage["completion_tokens"] - counted
        choice = obj["choices"][0]
        lp = choice.get("logprobs") or {}
        if lp.get("tokens") or lp.get("content"):
            return len(lp.get("tokens") or lp.get("content"))
        text = (choice.get("delta") or {}).get("content") if self.chat else choice.get("text")
        if not text:  # e.g. the chat role chunk; the final usage reconciles the count
            return 0
        if self.tokenizer is None:
            return 1
        return max(1, len(self.tokenizer.encode(text, add_special_tokens=False)))


def _error_message(body: str) -> str:
    try:
        obj = json.loads(body)
        return str(obj["error"]["message"]) if isinstance(obj.get("error"), dict) else body[:300]
    except (json.JSONDecodeError, AttributeError, KeyError, TypeError):
        return body[:300]
