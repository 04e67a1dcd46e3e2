"""The tensor-parallel all-reduce of ranks on one host, through shared memory.

gloo's all-reduce between two processes on one host goes through loopback TCP: 0.41 ms for a
single row of the race model's hidden size, 1.76 ms for 512 rows (bf16, a 2-core Xeon), and a
tensor-parallel step makes two per layer. Ranks that share a host can instead exchange their
partial sums through a shared mapping: each writes its tensor into its own slot, publishes a
sequence number, waits for every other rank's, and adds the slots up in rank order (so every
rank gets the same bits). The group is still a ``torch.distributed`` group: it agrees on the
mapping through it, and tensors larger than a slot (or not on the CPU) take gloo.

Layout of the mapping (``/dev/shm``, unlinked once every rank has it open): one 64-byte line
per rank holding its sequence number, then for each rank two slots of ``slot_bytes`` (double
buffering: a rank writes a slot again two calls later, by when every rank has read it, since
each waited for all the others to reach the call in between).
"""

from __future__ import annotations

import logging
import mmap
import os
import platform
import socket
import tempfile
import time

import numpy as np
import torch
import torch.distributed as dist

from fluidserve.net import boot_id

log = logging.getLogger(__name__)

LINE = 64  # bytes per rank's sequence number (its own cache line)
SLOT_BYTES = 8 << 20  # per rank and buffer: 2048 rows of a 1024-wide float32 activation
TIMEOUT_S = 600.0  # a rank that never arrives (it died: the executor stops the others)
# A rank publishes its slot by storing its sequence number after the slot's bytes, with no
# fence: others see them in that order only where the CPU keeps stores in order (x86's TSO;
# an Arm CPU may not), so elsewhere the group keeps gloo.
STORES_IN_ORDER = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")


class HostAllReduce:
    def __init__(self, mapping: mmap.mmap, index: int, world: int, slot_bytes: int,
                 group) -> None:
        self.mapping, self.index, self.world = mapping, index, world
        self.slot_bytes, self.group = slot_bytes, group
        raw = torch.frombuffer(mapping, dtype=torch.uint8)
        # [world]: each rank's sequence number (numpy: a scalar read or write is ~0.1 us)
        self.seqs = np.frombuffer(mapping, dtype=np.int64, count=LINE * world // 8)[:: LINE // 8]
        base = LINE * world
        self.slots = [[raw[base + (2 * r + b) * slot_bytes: base + (2 * r + b + 1) * slot_bytes]
                       for b in range(2)] for r in range(world)]
        self.others = [r for r in range(world) if r != index]
        self._views: dict = {}  # (buffer, shape, dtype) -> every rank's slot, as such a tensor
        self.seq = 0

    @classmethod
    def create(cls, group, slot_bytes: int = SLOT_BYTES) -> HostAllReduce | None:
        """For the calling rank of ``group`` (every rank of it calls this together): the
        shared mapping, or None where the ranks are not all on this host or the mapping
        cannot be had (gloo then)."""
        world, index = dist.get_world_size(group), dist.get_rank(group)
        hosts: list = [None] * world
        dist.all_gather_object(hosts, host_identity(), group=group)
        if len(set(hosts)) != 1 or not STORES_IN_ORDER:
            return None
        size = LINE * world + 2 * world * slot_bytes
        path = [_new_mapping_file(size) if index == 0 else None]
        src = dist.get_global_rank(group, 0)
        dist.broadcast_object_list(path, src=src, group=group)
        mapping = None
        if path[0] is not None:
            try:
                with open(path[0], "r+b") as f:
                    mapping = mmap.mmap(f.fileno(), size)
            except OSError as e:
                log.warning("shared-memory all-reduce unavailable (%s): gloo instead", e)
        ok: list = [None] * world
        dist.all_gather_object(ok, mapping is not None, group=group)
        if index == 0 and path[0] is not None:
            os.unlink(path[0])  # (every rank has it open, or none uses it)
        if not all(ok):
            return None
        return cls(mapping, index, world, slot_bytes, group)

    def fits(self, x: torch.Tensor) -> bool:
        return x.device.type == "cpu" and x.is_contiguous() and \
            x.numel() * x.element_size() <= self.slot_bytes

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the group in place (gloo where it does not fit a slot)."""
        if not self.fits(x):
            dist.all_reduce(x, group=self.group)
            return x
        self.seq += 1
        seq, buf = self.seq, self.seq & 1
        key = (buf, x.shape, x.dtype)
        parts = self._views.get(key)
        if parts is None:
            if len(self._views) >= 1024:  # (a step's shape is its token count: bounded)
                self._views.clear()
            n = x.numel() * x.element_size()
            parts = self._views[key] = [s[buf][:n].view(x.dtype).view(x.shape)
                                        for s in self.slots]
        parts[self.index].copy_(x)
        self.seqs[self.index] = seq  # (x86 stores are seen in order: the slot, then this)
        self._wait(seq)
        torch.add(parts[0], parts[1], out=x)
        for p in parts[2:]:
            x.add_(p)
        return x

    def _wait(self, seq: int) -> None:
        seqs, deadline = self.seqs, None
        for r in self.others:
            while seqs[r] < seq:
                os.sched_yield()  # (more ranks than cores: let the one waited for run)
                if deadline is None:
                    deadline = time.monotonic() + TIMEOUT_S
                elif time.monotonic() > deadline:
                    raise RuntimeError(f"shared-memory all-reduce: rank {r} of the group did"
                                       f" not arrive in {TIMEOUT_S:.0f} s")


def host_identity() -> tuple[str, str]:
    """This host, as ranks on it see it: its name and this boot's id (containers on one
    machine share the boot and may share a name without sharing /dev/shm: those find the
    mapping missing)."""
    return socket.gethostname(), boot_id()


def _new_mapping_file(size: int) -> str | None:
    """A file of ``size`` bytes in /dev/shm with its pages reserved (a tmpfs too small to hold
    it fails here, not with SIGBUS at the first touch), or None."""
    try:
        fd, path = tempfile.mkstemp(prefix="fluidserve-allreduce-", dir="/dev/shm")
    except OSError as e:
        log.warning("shared-memory all-reduce unavailable (%s): gloo instead", e)
        return None
    try:
        os.posix_fallocate(fd, 0, size)
        return path
    except OSError as e:
        os.unlink(path)
        log.warning("shared-memory all-reduce unavailable (%s): gloo instead", e)
        return None
    finally:
        os.close(fd)
