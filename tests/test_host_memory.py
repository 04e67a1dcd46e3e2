"""The engine keeps glibc from unmapping large activations between iterations, and puts the
tensors a decode step streams through on transparent huge pages."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fluidserve.model.attention import new_kv_cache
from fluidserve.model.host_memory import HUGE_PAGE, huge_page_empty, on_huge_pages

CODE = """
import resource, statistics, torch
from fluidserve.model.host_memory import keep_freed_memory

def faults_per_use(n):
    # Median over n uses: now and then a small allocation lands in the freed block and the
    # next large one extends the heap once more (fresh pages), as any allocator would.
    counts = []
    for _ in range(n):
        f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        x = torch.empty(48 << 20, dtype=torch.uint8)  # 48 MiB: above glibc's mmap threshold
        x.fill_(1)
        del x
        counts.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
    return statistics.median(counts)

before = faults_per_use(3)
ok = keep_freed_memory()
faults_per_use(2)  # the first allocations after the change still map their pages
print(before, ok, faults_per_use(7))
"""


def test_large_activations_are_not_faulted_in_again_at_every_iteration():
    out = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True,
                         check=True).stdout.split()
    before, ok, after = float(out[0]), out[1] == "True", float(out[2])
    assert ok
    assert before > 10_000  # 48 MiB of 4 KiB pages, mapped afresh on every use by default
    assert after < 500  # the freed block is reused as it is


def _mapping_fields(ptr: int, smaps: str | None = None) -> dict[str, str]:
    """The smaps fields of the mapping holding address ``ptr``: of this process, or of the
    ``smaps`` text another one printed."""
    fields, inside = {}, False
    for line in (smaps or open("/proc/self/smaps").read()).splitlines():
        head = line.split()[0] if line.split() else ""
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= ptr < hi
        elif inside and ":" in line:
            key, _, value = line.partition(":")
            fields[key] = value.strip()
    return fields


THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")
needs_thp = pytest.mark.skipif(not THP.is_file() or "[never]" in THP.read_text(),
                               reason="transparent huge pages are off on this kernel")


@needs_thp
def test_the_kv_cache_and_tile_copies_sit_on_huge_pages():
    """A KV cache of whole huge pages starts on one, zeroed, in a mapping the kernel may back
    with them (THPeligible: the advice took); a tile copy is the packed weight's bytes on
    such a mapping, and outlives every other reference to the mapping."""
    k, v = new_kv_cache(512, 16, 4, 64, torch.bfloat16, torch.device("cpu"))
    assert k.shape == (512, 4, 64, 16) and v.shape == (512, 4, 16, 64)
    for t in (k, v):
        assert t.data_ptr() % HUGE_PAGE == 0 and not t.any()
        assert _mapping_fields(t.data_ptr())["THPeligible"] == "1"
    w = torch.randn(3 << 20, generator=torch.Generator().manual_seed(0)).bfloat16()
    copy = on_huge_pages(w)
    assert copy.data_ptr() != w.data_ptr() and torch.equal(copy, w)
    view = copy[1:]
    del copy
    gc.collect()
    assert torch.equal(view, w[1:]) and _mapping_fields(view.data_ptr())["THPeligible"] == "1"


def test_small_tensors_and_the_opt_out_keep_the_allocators_pages(monkeypatch):
    small = torch.ones(1000)
    assert on_huge_pages(small) is small
    assert huge_page_empty((1000,), torch.float32).shape == (1000,)
    monkeypatch.setenv("FLUIDSERVE_NO_HUGE_PAGES", "1")
    big = torch.ones(4 << 20, dtype=torch.uint8)
    assert on_huge_pages(big) is big
    assert huge_page_empty((4 << 20,), torch.uint8).untyped_storage().nbytes() == 4 << 20


RELEASE = """
import torch
from fluidserve.model.host_memory import keep_freed_memory, release_freed_memory

def rss_mb():
    return int(next(l for l in open("/proc/self/status") if l.startswith("VmRSS")).split()[1]) >> 10

assert keep_freed_memory()
x = torch.empty(200 << 20, dtype=torch.uint8)
x.fill_(1)
del x  # kept by the allocator for the next iteration
kept = rss_mb()
release_freed_memory()
print(kept, rss_mb())
"""


def test_what_loading_left_behind_is_handed_back_once():
    """Freed memory stays with the allocator (for the next iteration's activations) until the
    engine, its model in place, hands it back."""
    kept, released = (int(x) for x in subprocess.run(
        [sys.executable, "-c", RELEASE], capture_output=True, text=True, check=True).stdout.split())
    assert kept - released > 150


def _built(opt_out: bool, monkeypatch, build):
    """``build()`` with huge pages, or with the opt-out set (the 4 KB-page fallback)."""
    with monkeypatch.context() as m:
        if opt_out:
            m.setenv("FLUIDSERVE_NO_HUGE_PAGES", "1")
        else:
            m.delenv("FLUIDSERVE_NO_HUGE_PAGES", raising=False)
        return build()


@needs_thp
def test_the_huge_page_path_computes_what_the_fallback_does(monkeypatch, tiny_model_dir):
    """The same engine step (prefill, then decodes reading the cache) gives the same logits,
    bit for bit, with the KV cache on huge pages and on the allocator's pages; so does a
    linear's tile copy on either."""
    from fluidserve.core.scheduler.output import SchedulerOutput
    from fluidserve.model.runner import ModelExecutor
    from fluidserve.profiler.run import _chunk

    def logits(ex) -> list[torch.Tensor]:
        out = [ex.logits(SchedulerOutput(0, [_chunk("a", 0, 40, 16, 0),
                                             _chunk("b", 0, 7, 16, 8)]))]
        for step in range(3):
            out.append(ex.logits(SchedulerOutput(0, [_chunk("a", 40 + step, 1, 16, 0),
                                                     _chunk("b", 7 + step, 1, 16, 8)])))
        return out

    runs = {}
    for opt_out in (False, True):
        ex = _built(opt_out, monkeypatch,
                    lambda: ModelExecutor(tiny_model_dir, num_blocks=2048, max_model_len=512))
        on_huge = ex.kv_caches[0][0].data_ptr() % HUGE_PAGE == 0 and \
            _mapping_fields(ex.kv_caches[0][0].data_ptr()).get("THPeligible") == "1"
        assert on_huge != opt_out
        runs[opt_out] = logits(ex)
        ex.shutdown()
    for a, b in zip(runs[False], runs[True], strict=True):
        assert torch.equal(a, b)

    from fluidserve.model.linear import PackedLinear, tiles_supported

    torch.manual_seed(0)
    linear = torch.nn.Linear(1024, 2048, bias=False).to(torch.bfloat16)
    if not tiles_supported(linear.weight):
        return  # (no tile kernel on this CPU: the KV cache above is the whole change here)
    x = torch.randn(5, 1024).bfloat16()
    packed = {o: _built(o, monkeypatch, lambda: PackedLinear(linear, tiles=True))
              for o in (False, True)}
    assert packed[False].tiles.data_ptr() % HUGE_PAGE == 0
    assert torch.equal(packed[False](x), packed[True](x))


def test_worker_processes_start_with_malloc_on_huge_pages(monkeypatch):
    """The variable that has glibc's malloc advise its memory for huge pages is added to what
    GLIBC_TUNABLES already says, never overrides a setting of its own, and is left out with
    the opt-out; around a spawn it is set, and afterwards the environment is as it was."""
    from fluidserve.model.host_env import (
        MALLOC_ON_HUGE_PAGES,
        huge_page_malloc_env,
        huge_pages_advisable,
        spawning_with_huge_page_malloc,
    )

    monkeypatch.delenv("FLUIDSERVE_NO_HUGE_PAGES", raising=False)
    if not huge_pages_advisable():
        assert huge_page_malloc_env({}) == {}
        return
    assert huge_page_malloc_env({}) == {"GLIBC_TUNABLES": MALLOC_ON_HUGE_PAGES}
    assert huge_page_malloc_env({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}) == {
        "GLIBC_TUNABLES": f"glibc.malloc.arena_max=2:{MALLOC_ON_HUGE_PAGES}"}
    assert huge_page_malloc_env({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}) == {}
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.arena_max=2")
    with spawning_with_huge_page_malloc():
        assert os.environ["GLIBC_TUNABLES"].endswith(MALLOC_ON_HUGE_PAGES)
    assert os.environ["GLIBC_TUNABLES"] == "glibc.malloc.arena_max=2"
    monkeypatch.setenv("FLUIDSERVE_NO_HUGE_PAGES", "1")
    assert huge_page_malloc_env({}) == {}


MALLOC_CHILD = """
import sys, torch
from fluidserve.model.host_memory import keep_freed_memory
if sys.argv[1] == "heap":
    keep_freed_memory()  # (large blocks from the heap, as in a worker; else mmap'd)
x = torch.empty(64 << 20, dtype=torch.uint8)
x.fill_(1)
print(x.data_ptr())
print(open("/proc/self/smaps").read())
"""


@needs_thp
@pytest.mark.parametrize("where", ["heap", "mmap"])
def test_a_process_started_so_mallocs_on_huge_pages(where, monkeypatch):
    """A process started with ``huge_page_malloc_env`` gets a large block from malloc in a
    mapping the kernel may back with huge pages, from the heap and from mmap alike; without
    it (THP in madvise mode) it does not."""
    from fluidserve.model.host_env import huge_page_malloc_env

    monkeypatch.delenv("FLUIDSERVE_NO_HUGE_PAGES", raising=False)
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)

    def eligible(extra: dict[str, str]) -> str:
        ptr, _, smaps = subprocess.run(
            [sys.executable, "-c", MALLOC_CHILD, where], capture_output=True, text=True,
            check=True, env=os.environ | extra).stdout.partition("\n")
        return _mapping_fields(int(ptr), smaps)["THPeligible"]

    assert eligible(huge_page_malloc_env()) == "1"
    if "[madvise]" in THP.read_text():
        assert eligible({}) == "0"


def test_the_engine_core_process_starts_with_malloc_on_huge_pages(tiny_model_dir, monkeypatch):
    """The engine-core process (which holds oneDNN's packed weights) starts with the tunable
    where huge pages are to be had; the front end's own environment is left alone."""
    from fluidserve.config import EngineConfig
    from fluidserve.engine.core_proc import EngineCoreClient
    from fluidserve.model.host_env import huge_page_malloc_env

    monkeypatch.delenv("FLUIDSERVE_NO_HUGE_PAGES", raising=False)
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    client = EngineCoreClient(EngineConfig.create(model=str(tiny_model_dir), num_threads=1),
                              lambda out: None, lambda msg: None)
    try:
        client.wait_ready(120)
        environ = Path(f"/proc/{client.proc.pid}/environ").read_bytes().split(b"\0")
    finally:
        client.shutdown()
    expected = [f"GLIBC_TUNABLES={v}".encode() for v in huge_page_malloc_env().values()]
    assert [e for e in environ if e.startswith(b"GLIBC_TUNABLES=")] == expected
    assert "GLIBC_TUNABLES" not in os.environ


def test_engines_started_from_several_threads_leave_the_environment_as_it_was(monkeypatch):
    """Servers started together enter the spawn context from several threads, in any order:
    the first sets the variable, the last to leave restores the environment (before, one
    thread restored what another had set, and every later child of the process inherited
    it)."""
    import threading

    from fluidserve.model.host_env import huge_page_malloc_env, spawning_with_huge_page_malloc

    monkeypatch.delenv("FLUIDSERVE_NO_HUGE_PAGES", raising=False)
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    first_in, second_in, first_out = threading.Event(), threading.Event(), threading.Event()
    seen = []

    def first():
        with spawning_with_huge_page_malloc():
            first_in.set()
            second_in.wait(5)
        first_out.set()

    def second():
        first_in.wait(5)
        with spawning_with_huge_page_malloc():
            second_in.set()
            first_out.wait(5)
            seen.append(os.environ.get("GLIBC_TUNABLES"))

    threads = [threading.Thread(target=f) for f in (first, second)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert seen == [huge_page_malloc_env({}).get("GLIBC_TUNABLES")]
    assert "GLIBC_TUNABLES" not in os.environ
