"""Host memory: the C allocator kept from handing large activations back to the kernel between
iterations, the long-lived tensors a decode step streams through (the KV cache, the weights'
tile copies) on transparent huge pages, the worker processes' C heaps (oneDNN's packed weights
among them) on them too, and pinned staging for the small copies of each step's inputs to a
GPU.

glibc's malloc serves large blocks with a fresh ``mmap`` and returns them with ``munmap`` when
freed (and trims the top of its heap once enough is free there). A forward pass allocates and
frees the same large activations every iteration, so each iteration faults every page of them
back in. Measured on the 213M race model (2-core Sapphire Rapids VM): a 2048-token prefill took
187,000 minor page faults (730 MB of 4 KB pages) and 620-840 ms per iteration; with the
thresholds below it takes none and 445-455 ms; 1024 tokens 252 -> 237 ms. This is what
``LD_PRELOAD``-ing tcmalloc or jemalloc buys CPU inference servers, done in-process: the engine's
steady state reuses the same sizes, so holding freed memory costs nothing the engine would not
need again at the next iteration.
"""

from __future__ import annotations

import logging
import math
import mmap
import os

import numpy as np
import torch

from fluidserve.model.host_env import glibc, huge_pages_advisable

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
_done = False


def keep_freed_memory(mmap_threshold: int = 1 << 30, trim_threshold: int = (1 << 31) - 1) -> bool:
    """Raise glibc's mmap and trim thresholds for this process (once). Returns whether they
    are in effect: False off glibc, or with ``FLUIDSERVE_NO_MALLOPT`` set."""
    global _done
    if _done:
        return True
    if os.environ.get("FLUIDSERVE_NO_MALLOPT"):
        return False
    mallopt = glibc("mallopt")
    if mallopt is None:
        return False  # not glibc (musl, macOS): nothing to tune
    ok = mallopt(M_MMAP_THRESHOLD, mmap_threshold) == 1 and mallopt(
        M_TRIM_THRESHOLD, trim_threshold) == 1
    if not ok:
        log.debug("mallopt refused the allocator thresholds; large activations stay on mmap")
    _done = ok
    return ok


HUGE_PAGE = 2 << 20


def huge_page_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A CPU tensor on its own 2 MB-aligned anonymous mapping advised for transparent huge
    pages (``MADV_HUGEPAGE``), zero until written; a plain ``torch.empty`` where that cannot
    be had (``huge_pages_advisable``) or the tensor is smaller than one huge page.

    Where THP is in ``madvise`` mode (the common default) nothing else in the process gets
    huge pages, and a decode step streams every weight and its requests' KV blocks through
    4 KB pages: one TLB miss per 4 KB, and the scattered KV blocks' misses unhidden. On a
    2-core Zen 4 EPYC: the race model's decode attention at 40 x 290 tokens 13.4 -> 11.6 ms
    for 16 layers, its 64 tile linears at one row 11.0 -> 10.5 ms; its whole decode step
    0-4% faster (scripts/bench_huge_pages.py). The mapping lives as long as the tensor (or
    any view of it) does."""
    raw = _huge_mapping(math.prod(shape) * dtype.itemsize)
    return torch.empty(shape, dtype=dtype) if raw is None else raw.view(dtype).view(shape)


def on_huge_pages(t: torch.Tensor) -> torch.Tensor:
    """A copy of CPU tensor ``t`` on huge pages (``huge_page_empty``), or ``t`` itself where
    none can be had."""
    raw = _huge_mapping(t.numel() * t.element_size()) if t.device.type == "cpu" else None
    if raw is None:
        return t
    return raw.view(t.dtype).view(t.shape).copy_(t)


def _huge_mapping(n: int) -> torch.Tensor | None:
    """``n`` bytes (uint8) at the start of a huge page of a mapping advised for them, or
    None (too small to fill one, or not to be had here)."""
    if n < HUGE_PAGE or not huge_pages_advisable():
        return None
    try:
        m = mmap.mmap(-1, n + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        m.madvise(mmap.MADV_HUGEPAGE)
    except OSError as e:  # (a kernel built without THP refuses the advice)
        log.debug("no huge pages for %d bytes: %s", n, e)
        return None
    raw = torch.frombuffer(m, dtype=torch.uint8)  # (the tensor holds the mapping)
    start = -raw.data_ptr() % HUGE_PAGE
    return raw[start:start + n]


def release_freed_memory() -> None:
    """Hand the memory the C allocator holds free back to the kernel (glibc's ``malloc_trim``;
    elsewhere nothing). ``keep_freed_memory`` keeps freed blocks for the next iteration's
    activations, and so also what loading a model leaves behind: its weights as read, the
    packed copies replaced by their huge-page ones (the race model: ~470 MB of 2.9 GB
    resident, 37 ms to return). Called once the model is in place."""
    malloc_trim = glibc("malloc_trim")
    if malloc_trim is not None:  # (not glibc: nothing held to hand back this way)
        malloc_trim(0)


def to_device(values: np.ndarray | list, device: torch.device, dtype: torch.dtype | None = None
              ) -> torch.Tensor:
    """A small host array (or list) as a tensor on ``device``. On CUDA it goes through pinned
    memory, so the copy is queued behind the work already on the stream without waiting for
    it: a copy from pageable memory waits, and would keep the host from preparing the next
    step while the device runs this one. On the CPU a numpy array is shared, not copied."""
    t = torch.from_numpy(values) if isinstance(values, np.ndarray) else torch.tensor(values)
    if dtype is not None:
        t = t.to(dtype)
    if device.type != "cuda":
        return t
    return t.pin_memory().to(device, non_blocking=True)
