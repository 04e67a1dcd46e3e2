from __future__ import annotations

import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import uvicorn

from fluidserve import net
from fluidserve.config import EngineConfig, ServerConfig
from fluidserve.net import free_port  # noqa: F401 - the tests import it from here
from fluidserve.serve.server import DrainingServer, build_app, start_engine


def wait_healthy(url: str, timeout: float = 120.0, proc=None) -> None:
    net.wait_healthy(url, timeout, proc, poll=0.1)


class InProcessServer:
    """The real app on a real localhost port (its engine core in a process of its own), served
    by the same ``DrainingServer`` as `fluidserve serve`; ``dead`` is set when the engine is."""

    def __init__(
        self, model_dir, *, name: str | tuple[str, ...] = "tiny", engine_kw: dict | None = None,
        **server_kw
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        kw = dict(model=str(model_dir), max_model_len=512, token_budget=64, block_size=8,
                  num_threads=1)
        config = ServerConfig(port=self.port, served_model_name=name, **server_kw)
        self.dead = threading.Event()
        self.engine, served = start_engine(EngineConfig.create(**kw | (engine_kw or {})),
                                           config, on_dead=lambda _: self.dead.set())
        self.app = build_app(self.engine, config, served)
        self.server = DrainingServer(
            uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning"),
            self.app.state.fluidserve,
        )
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> InProcessServer:
        self.thread.start()
        wait_healthy(self.url)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.engine.stop()  # in case the app's own shutdown did not run

    def signal(self) -> None:
        """What SIGTERM does to `fluidserve serve` (a first one drains, a second stops)."""
        self.server.handle_exit(signal.SIGTERM, None)

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


def start_servers(model_dir, specs: dict[str, dict]) -> dict[str, InProcessServer]:
    """Several servers at once, their engine cores loading in parallel; keyword arguments of
    ``InProcessServer`` per name. Close them with ``stop_servers``."""

    def start(kw: dict) -> InProcessServer:
        return InProcessServer(model_dir, **kw).__enter__()

    from transformers import AutoTokenizer  # noqa: F401 - its lazy import is not thread-safe

    with ThreadPoolExecutor(len(specs)) as pool:
        futures = {name: pool.submit(start, kw) for name, kw in specs.items()}
    started = {name: f.result() for name, f in futures.items() if f.exception() is None}
    failed = [f.exception() for f in futures.values() if f.exception() is not None]
    if failed:
        stop_servers(started)
        raise failed[0]
    return started


def stop_servers(servers: dict[str, InProcessServer]) -> None:
    for s in servers.values():
        s.__exit__(None, None, None)


def metric_samples(url: str) -> dict[tuple[str, tuple], float]:
    """Every sample of /metrics, keyed by (sample name, sorted label items)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url + "/metrics", timeout=10).text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }
