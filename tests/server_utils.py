from __future__ import annotations

import socket
import threading
import time

import httpx
import uvicorn

from fluidserve.config import EngineConfig, ServerConfig
from fluidserve.engine.engine import LLMEngine
from fluidserve.serve.server import build_app


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, timeout: float = 120.0, proc=None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"{url} did not become healthy")


class InProcessServer:
    """The real app on a real localhost port, with the engine reachable for inspection."""

    def __init__(
        self, model_dir, *, name: str = "tiny", engine_kw: dict | None = None, **server_kw
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        kw = dict(model=str(model_dir), max_model_len=512, token_budget=64, block_size=8)
        self.engine = LLMEngine(EngineConfig(**kw | (engine_kw or {})))
        self.app = build_app(self.engine, ServerConfig(port=self.port, **server_kw), name)
        self.server = uvicorn.Server(
            uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning")
        )
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> InProcessServer:
        self.thread.start()
        wait_healthy(self.url)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(10)

    def kv_idle(self, timeout: float = 10.0) -> bool:
        bm = self.engine.block_manager
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if bm.num_free_blocks == bm.num_blocks and not self.engine.scheduler.requests:
                return True
            time.sleep(0.05)
        return False


class ForcedEos:
    """Wraps an executor: the output tokens at indices ``at`` are EOS, for every request or
    (a dict) per request id."""

    def __init__(self, inner, eos: int, at: set[int] | dict[str, set[int]]) -> None:
        self.inner, self.eos, self.at = inner, eos, at

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def execute(self, plan):
        result = self.inner.execute(plan)
        for c in plan.chunks:
            at = self.at.get(c.request_id, ()) if isinstance(self.at, dict) else self.at
            if c.samples and c.output_index in at:
                result.sampled[c.request_id] = self.eos
        return result


def metric_values(url: str) -> dict[tuple[str, tuple], float]:
    """Every sample of /metrics, keyed by (sample name, sorted label items)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url + "/metrics", timeout=10).text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }
