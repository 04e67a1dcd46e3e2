"""Moving a request's KV blocks between two instances' paged caches.

Token ``i`` of a request sits at offset ``i % block_size`` of its ``i // block_size``-th
block on both sides, so a transfer copies whole blocks, layer by layer, from the source's
block table to the destination's (the tail of the last block is copied too and never read).
On the wire, a request's KV is one or more pieces (``piece_blocks``: the whole request, or
a prefill chunk's worth of blocks each, sent as each chunk is computed), each a contiguous
tensor of shape ``(layers, 2, blocks, elements per block)`` (``gather_blocks`` /
``scatter_blocks``): the sender copies its blocks out, so the source blocks may be freed or
reused while the bytes travel.

Transports between the processes of a served deployment (``--kv-transport``):

- ``gloo``: ``torch.distributed`` point-to-point (``isend``/``irecv`` with one tag per
  piece) in a process group of all instances, which meet at a ``TCPStore`` the front end
  hosts (so the instances may be anywhere it can reach); NCCL would take its place on GPUs;
- ``shm``: same host, shared memory: the receiver creates a segment named after the
  transfer's tag, the sender copies the bytes in and then sets the segment's last byte; the
  receiver polls that byte (x86's store order makes the data visible before the flag).

Both are polled from the instance's loop (``Transfer.done``): nothing blocks an iteration.
``LocalKVMover`` copies between two executors in one process (the offline cluster and the
tests).
"""

from __future__ import annotations

import datetime
import sys
import threading
import time
from multiprocessing.shared_memory import SharedMemory

import torch

from fluidserve.config import KV_TRANSPORTS
from fluidserve.net import loopback_collectives

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]
_NO_TRACK = {"track": False} if sys.version_info >= (3, 13) else {}


def staged_shape(kv_caches: KVCaches, num_blocks: int) -> tuple[int, ...]:
    return (len(kv_caches), 2, num_blocks, kv_caches[0][0][0].numel())


def gather_blocks(kv_caches: KVCaches, blocks: tuple[int, ...] | list[int]) -> torch.Tensor:
    """These blocks of every layer's K and V cache, copied into one contiguous tensor."""
    idx = torch.tensor(list(blocks), dtype=torch.long)
    n = len(blocks)
    out = torch.empty(staged_shape(kv_caches, n), dtype=kv_caches[0][0].dtype)
    with torch.inference_mode():
        for layer, (k, v) in enumerate(kv_caches):
            out[layer, 0] = k.index_select(0, idx).reshape(n, -1)
            out[layer, 1] = v.index_select(0, idx).reshape(n, -1)
    return out


def scatter_blocks(kv_caches: KVCaches, blocks: tuple[int, ...] | list[int],
                   staged: torch.Tensor) -> None:
    """Write a ``gather_blocks`` tensor into these blocks of every layer's caches."""
    n = len(blocks)
    if staged.shape != staged_shape(kv_caches, n):
        raise ValueError(f"KV of shape {tuple(staged.shape)} does not fit {n} blocks of"
                         f" {staged_shape(kv_caches, n)}")
    idx = torch.tensor(list(blocks), dtype=torch.long)
    with torch.inference_mode():
        for layer, (k, v) in enumerate(kv_caches):
            k.index_copy_(0, idx, staged[layer, 0].reshape(n, *k.shape[1:]))
            v.index_copy_(0, idx, staged[layer, 1].reshape(n, *v.shape[1:]))


def piece_blocks(granularity: str, chunk_size: int, block_size: int, num_blocks: int) -> int:
    """Blocks per piece of a request's KV on the wire: all of them at ``request``
    granularity; at ``chunk`` granularity, a prefill chunk's worth (at least one block), so
    that a piece is ready as soon as the chunk that computes its last token has run."""
    if granularity == "request":
        return max(num_blocks, 1)
    return max(1, chunk_size // block_size)


def piece_range(k: int, piece_blocks: int, num_blocks: int) -> range:
    """The blocks (indices into the request's block table) of piece ``k``."""
    return range(k * piece_blocks, min((k + 1) * piece_blocks, num_blocks))


def num_pieces(num_blocks: int, piece_blocks: int) -> int:
    return max(1, -(-num_blocks // piece_blocks))


class LocalKVMover:
    """Both instances' executors in this process: one indexed copy per layer and cache."""

    def move(self, src, dst, src_blocks: tuple[int, ...], dst_blocks: tuple[int, ...],
             num_tokens: int) -> None:
        n = -(-num_tokens // src.block_size)
        if src.block_size != dst.block_size or len(src_blocks) < n or len(dst_blocks) < n:
            raise ValueError(f"cannot move {num_tokens} tokens: {len(src_blocks)} source and"
                             f" {len(dst_blocks)} destination blocks of"
                             f" {src.block_size}/{dst.block_size} tokens")
        staged = gather_blocks(src.kv_caches, src_blocks[:n]).to(dst.kv_caches[0][0].device)
        scatter_blocks(dst.kv_caches, dst_blocks[:n], staged)


# ---------------------------------------------------------------- between processes


class Transfer:
    """One send or receive in progress. ``done()`` is True once it has landed and raises if
    it failed; a receive's bytes are then in ``tensor``."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor
        self.started = time.monotonic()

    def done(self) -> bool:
        return True

    def close(self) -> None:
        """Give up on it (a receive whose request ended): release what it holds."""


class _GlooTransfer(Transfer):
    """A gloo send/receive completes only inside ``Work.wait()`` (``is_completed`` stays
    False until then), so a thread of its own waits on it (releasing the GIL) and the
    instance's loop polls the result."""

    def __init__(self, tensor: torch.Tensor, work) -> None:
        super().__init__(tensor)
        self._landed = threading.Event()
        self._error: BaseException | None = None
        threading.Thread(target=self._wait, args=(work,), name="fluidserve-kv-transfer",
                         daemon=True).start()

    def _wait(self, work) -> None:
        try:
            work.wait()
        except BaseException as e:  # e.g. the peer died or the group timed out
            self._error = e
        self._landed.set()

    def done(self) -> bool:
        if not self._landed.is_set():
            return False
        if self._error is not None:
            raise self._error
        return True


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


class GlooTransport:
    """torch.distributed point-to-point in a gloo group of every instance of the deployment."""

    name = "gloo"

    def __init__(self, rank: int, world_size: int, store: str, timeout: float = 600.0) -> None:
        """``store``: ``host:port`` of the rendezvous store the front end hosts."""
        import torch.distributed as dist

        self.dist = dist
        host, port = store.rsplit(":", 1)
        if host == "127.0.0.1":  # every instance on this host: gloo's sockets on loopback
            loopback_collectives()
        wait = datetime.timedelta(seconds=timeout)
        dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=wait,
                                store=dist.TCPStore(host, int(port), world_size,
                                                   is_master=False, timeout=wait))

    def send(self, tensor: torch.Tensor, dst: int, tag: int) -> Transfer:
        return _GlooTransfer(tensor, self.dist.isend(_bytes(tensor), dst, tag=tag))

    def recv(self, shape: tuple[int, ...], dtype: torch.dtype, src: int, tag: int) -> Transfer:
        t = torch.empty(shape, dtype=dtype)
        return _GlooTransfer(t, self.dist.irecv(_bytes(t), src, tag=tag))

    def close(self) -> None:
        if self.dist.is_initialized():
            self.dist.destroy_process_group()


class _ShmRecv(Transfer):
    def __init__(self, shm: SharedMemory, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        nbytes = len(shm.buf) - 1
        super().__init__(torch.frombuffer(shm.buf, dtype=torch.uint8, count=nbytes)
                         .view(dtype).view(shape))
        self.shm = shm

    def done(self) -> bool:
        return self.shm.buf[-1] == 1

    def close(self) -> None:
        if self.shm is not None:
            self.tensor = None  # the view must go before the mapping can be closed
            self.shm.close()
            self.shm.unlink()
            self.shm = None


class ShmTransport:
    """Same host: one shared-memory segment per transfer, created and removed by the
    receiver."""

    name = "shm"

    def __init__(self, session: str) -> None:
        self.session = session

    def _name(self, tag: int) -> str:
        return f"fluidserve-{self.session}-{tag}"

    def send(self, tensor: torch.Tensor, dst: int, tag: int) -> Transfer:
        # The receiver owns the segment (it creates and removes it). Before Python 3.13,
        # attaching registers it with the resource tracker, which the instances share with
        # the front end: a second registration of the same name is a no-op there.
        shm = SharedMemory(self._name(tag), **_NO_TRACK)
        try:
            data = _bytes(tensor)
            if len(shm.buf) != data.numel() + 1:
                raise ValueError(f"the receiver expects {len(shm.buf) - 1} bytes of KV, not"
                                 f" {data.numel()}")
            torch.frombuffer(shm.buf, dtype=torch.uint8, count=data.numel()).copy_(data)
            shm.buf[-1] = 1
        finally:
            shm.close()
        return Transfer(tensor)

    def recv(self, shape: tuple[int, ...], dtype: torch.dtype, src: int, tag: int) -> Transfer:
        nbytes = torch.Size(shape).numel() * torch.empty(0, dtype=dtype).element_size()
        shm = SharedMemory(self._name(tag), create=True, size=nbytes + 1)
        shm.buf[-1] = 0
        return _ShmRecv(shm, shape, dtype)

    def close(self) -> None:
        pass


def make_transport(kind: str, rank: int, world_size: int, store: str, session: str):
    if kind == "gloo":
        return GlooTransport(rank, world_size, store)
    if kind == "shm":
        return ShmTransport(session)
    raise ValueError(f"unknown KV transport {kind!r}; choose from {', '.join(KV_TRANSPORTS)}")
