"""The C library and the kernel's huge pages as a process finds them, and the environment it
starts worker processes with so that their C heaps sit on huge pages. No torch here: the HTTP
front end starts the engine core with it (``host_memory`` holds the tensors' side).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

THP_ENABLED = "/sys/kernel/mm/transparent_hugepage/enabled"


def huge_pages_advisable() -> bool:
    """Whether this process may ask for transparent huge pages: Linux with THP in ``madvise``
    or ``always`` mode (``never``: the advice changes nothing), and no
    ``FLUIDSERVE_NO_HUGE_PAGES`` in the environment."""
    if os.environ.get("FLUIDSERVE_NO_HUGE_PAGES") or not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    try:
        with open(THP_ENABLED) as f:
            mode = f.read()
    except OSError:
        return False
    return "[never]" not in mode


# glibc's tunable (2.35 and later, read when a process starts) with which malloc advises the
# memory it takes from the kernel, its heap and its mmap'd blocks, for transparent huge pages.
MALLOC_ON_HUGE_PAGES = "glibc.malloc.hugetlb=1"


def huge_page_malloc_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The variables to start a worker process with (beside ``env``, default this process's
    environment) so that its C allocator puts what it serves on transparent huge pages:
    ``GLIBC_TUNABLES`` with ``MALLOC_ON_HUGE_PAGES`` added. Empty where huge pages are not
    advisable (``huge_pages_advisable``), the C library is not glibc, or ``env`` already sets
    the tunable.

    oneDNN allocates its packed weights, the copy every product of more than a decode
    batch's rows reads, with malloc, on 4 KB pages; a prefill walks the page tables of all of
    them, and after decode steps, which stream the tile copies instead, those tables may be
    out of the caches. Measured offline on a 2-core AMX Xeon VM (``LLM.generate``, each
    prefill after a 64-token decode, processes with and without the tunable alternated), in a
    half hour when prefills after decodes ran 10-30% slower than after short requests: a
    128-token prefill of a 1.1B model (2.1 GB of packed weights) 193-201 against 211-226 ms,
    a 448-token one of the 213M race model 99-104 against 105-107 ms; in the next half hour,
    when the slowdown after decodes had gone, no difference (1.1B: 199-203 against
    196-203 ms)."""
    env = os.environ if env is None else env
    current = env.get("GLIBC_TUNABLES", "")
    if "glibc.malloc.hugetlb" in current or not huge_pages_advisable() \
            or glibc("gnu_get_libc_version") is None:
        return {}
    return {"GLIBC_TUNABLES": f"{current}:{MALLOC_ON_HUGE_PAGES}" if current
            else MALLOC_ON_HUGE_PAGES}


# Engines may start their processes from several threads at once (servers started
# together): the variables are set by the first to enter and restored by the last to leave.
_spawning = threading.Lock()
_spawners = 0
_saved: dict[str, str | None] = {}


@contextmanager
def spawning_with_huge_page_malloc() -> Iterator[None]:
    """Around starting worker processes by ``multiprocessing``'s spawn (a fresh interpreter
    that takes this process's environment): they start with ``huge_page_malloc_env``, and
    this process's environment is as it was once no thread is starting any."""
    global _spawners, _saved
    with _spawning:
        if _spawners == 0:
            extra = huge_page_malloc_env()
            _saved = {key: os.environ.get(key) for key in extra}
            os.environ.update(extra)
        _spawners += 1
    try:
        yield
    finally:
        with _spawning:
            _spawners -= 1
            if _spawners == 0:
                for key, value in _saved.items():
                    if value is None:
                        os.environ.pop(key, None)
                    else:
                        os.environ[key] = value


def ray_actor_env() -> dict:
    """Ray actor options that start the actor's worker process with ``huge_page_malloc_env``
    (a ``runtime_env`` of those variables; none where there are none)."""
    env = huge_page_malloc_env()
    return {"runtime_env": {"env_vars": env}} if env else {}


def glibc(function: str):
    """The C library's ``function``, or None where the C library has none (not glibc)."""
    try:
        return getattr(ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6"), function)
    except (OSError, AttributeError):
        return None
