from __future__ import annotations

import socket
import threading
import time

import httpx
import uvicorn

from fluidserve.config import EngineConfig, ServerConfig
from fluidserve.serve.server import build_app, start_engine


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
    """The real app on a real localhost port (its engine core in a process of its own)."""

    def __init__(
        self, model_dir, name: str = "tiny", engine_kw: dict | None = None, **server_kw
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        kw = dict(model=str(model_dir), max_model_len=512, token_budget=64, block_size=8,
                  num_threads=1)
        config = ServerConfig(port=self.port, served_model_name=name, **server_kw)
        self.engine, _ = start_engine(EngineConfig.create(**kw | (engine_kw or {})), config)
        self.app = build_app(self.engine, config, name)
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
        """Whether the engine core reports no requests and no KV blocks in use, in time."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            m = metric_values(httpx.get(self.url + "/metrics").text)
            busy = m["fluidserve_kv_cache_usage"] or m["fluidserve_num_requests_running"] \
                or m["fluidserve_num_requests_waiting"] or self.engine.num_unfinished
            if not busy:
                return True
            time.sleep(0.05)
        return False


def metric_values(text: str) -> dict[str, float]:
    """Prometheus text format -> {name{labels}: value} (samples only)."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out
