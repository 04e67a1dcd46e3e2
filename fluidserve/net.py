"""Localhost helpers shared by the launchers, benchmarks and tests: a free port, a
rendezvous store and collective sockets that stay on the loopback interface, waiting until a
server process answers ``/health``, and stopping it; this boot of the host's kernel."""

from __future__ import annotations

import os
import socket
import subprocess
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from functools import cache


@cache
def boot_id() -> str:
    """This boot of the kernel: processes that share it share the host's clock and memory.
    Not Linux: an id of this process's own (nothing is taken to be shared)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return uuid.uuid4().hex


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def local_store(world_size: int | None = None):
    """A torch.distributed ``TCPStore`` server that listens on 127.0.0.1 only (one that torch
    binds itself listens on every interface, with no authentication): the socket is bound
    here and handed to it."""
    from torch.distributed import TCPStore

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    port = sock.getsockname()[1]
    return TCPStore("127.0.0.1", port, world_size, True, wait_for_workers=False,
                    master_listen_fd=sock.detach(), use_libuv=True)


def loopback_collectives() -> None:
    """Gloo's and NCCL's sockets on the loopback interface (every process on this host),
    unless the user chose an interface; else they bind the address the host name resolves
    to, which on most machines is routable."""
    names = [name for _, name in socket.if_nameindex()]
    lo = "lo" if "lo" in names else next((n for n in names if n.startswith("lo")), "lo")
    for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        os.environ.setdefault(var, lo)


def die_with_parent(parent: int) -> None:
    """Linux: this process gets SIGKILL when ``parent``, the process that started it, dies,
    however it dies (a process stuck in a collective never reads the pipe that would tell
    it). The signal follows the thread that started this process, so start it from one that
    lives as long as its process."""
    import ctypes
    import signal
    import sys

    if not sys.platform.startswith("linux"):
        return
    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
    if os.getppid() != parent:  # it died before the request took effect
        os._exit(1)


def ignore_group_signals() -> None:
    """In a child process of the server: leave SIGINT and SIGTERM to the front end.

    Ctrl-C in a terminal, `timeout`, or `kill -- -PGID` signal the whole process group; the
    front end then drains its requests, which needs the engine core (and its workers) alive.
    A child ends when the front end tells it to, or when its pipe from the front end closes
    (the front end is gone)."""
    import signal

    if threading.current_thread() is not threading.main_thread():
        return  # a Ray actor's task thread: Ray owns the signals of its worker processes
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


_OWNER: ThreadPoolExecutor | None = None
_OWNER_LOCK = threading.Lock()


def process_owner() -> ThreadPoolExecutor:
    """A thread that lives as long as this process, to start children from: a child that
    asks ``die_with_parent`` dies with the *thread* that started it, and the caller may be
    short-lived (an engine built in a worker thread, a server started from a thread pool)."""
    global _OWNER
    with _OWNER_LOCK:
        if _OWNER is None:
            _OWNER = ThreadPoolExecutor(1, thread_name_prefix="fluidserve-process-owner")
        return _OWNER


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
