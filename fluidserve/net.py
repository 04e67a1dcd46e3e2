"""Localhost helpers shared by the launchers, benchmarks and tests: a free port, waiting
until a server process answers ``/health``, and stopping it."""

from __future__ import annotations

import socket
import subprocess
import time


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, timeout: float, proc: subprocess.Popen | None = None,
                 what: str = "server", poll: float = 0.2) -> float:
    """Poll ``url/health`` until it answers 200; returns the seconds it took. Raises
    RuntimeError if ``proc`` exits first, TimeoutError after ``timeout`` seconds (having
    killed ``proc``, so no half-started server outlives its launcher)."""
    import httpx

    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return time.monotonic() - t0
        except httpx.HTTPError:
            pass
        time.sleep(poll)
    if proc is not None:
        proc.kill()
    raise TimeoutError(f"{what} did not answer {url}/health within {timeout:g} s")


def stop_process(proc: subprocess.Popen, timeout: float = 30.0) -> int | None:
    """SIGTERM ``proc`` (a server drains), SIGKILL it after ``timeout`` s; its exit code, or
    None when it had to be killed."""
    if proc.poll() is not None:
        return proc.returncode
    proc.terminate()
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        return None
