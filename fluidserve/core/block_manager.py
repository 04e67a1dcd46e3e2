"""Paged KV-cache bookkeeping: which physical blocks hold which request's tokens.

Token ``i`` of a request lives in block ``table[i // block_size]`` at offset
``i % block_size``. Blocks are handed out from a free list; a request's table only grows
until the request finishes or is preempted, when all its blocks return at once.
"""

from __future__ import annotations

from collections import deque

from fluidserve.core.admission import admissible_blocks


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, watermark: float = 0.0) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        # Admission keeps this many blocks free so running requests can still grow.
        self.watermark_blocks = num_blocks - admissible_blocks(num_blocks, watermark)
        self._free: deque[int] = deque(range(num_blocks))
        # Tables are tuples, replaced when they grow (once per block_size tokens), so the
        # scheduler hands them to every iteration's batch without copying.
        self._tables: dict[str, tuple[int, ...]] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        return 1.0 - len(self._free) / self.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def table(self, request_id: str) -> tuple[int, ...]:
        return self._tables.get(request_id, ())

    def num_new_blocks(self, request_id: str, num_tokens: int) -> int:
        """Blocks to add so that ``request_id`` can hold ``num_tokens`` tokens in total."""
        return max(0, self.blocks_for(num_tokens) - len(self.table(request_id)))

    def can_allocate(self, request_id: str, num_tokens: int, *, admit: bool = False) -> bool:
        reserve = self.watermark_blocks if admit else 0
        return self.num_new_blocks(request_id, num_tokens) <= len(self._free) - reserve

    def allocate(self, request_id: str, num_tokens: int) -> bool:
        """Grow ``request_id``'s table to hold ``num_tokens``; False (and no change) if full."""
        table = self._tables.get(request_id)
        need = -(-num_tokens // self.block_size) - (len(table) if table else 0)
        if need <= 0:
            return True
        if need > len(self._free):
            return False
        popleft = self._free.popleft
        self._tables[request_id] = (table or ()) + tuple(popleft() for _ in range(need))
        return True

    def free(self, request_id: str) -> int:
        blocks = self._tables.pop(request_id, ())
        self._free.extend(blocks)
        return len(blocks)

    def check_invariants(self, num_computed: dict[str, int] | None = None) -> None:
        """Raise AssertionError if the bookkeeping is inconsistent.

        Every block is either free or owned by exactly one request; with ``num_computed``
        (request id -> computed tokens) every table is also large enough for its tokens.
        """
        owned = [b for t in self._tables.values() for b in t]
        free = list(self._free)
        assert len(set(owned)) == len(owned), "a block is owned twice"
        assert len(set(free)) == len(free), "a block is free twice"
        assert not set(owned) & set(free), "a block is both owned and free"
        assert len(owned) + len(free) == self.num_blocks, "a block leaked"
        assert all(0 <= b < self.num_blocks for b in owned + free), "block id out of range"
        for rid, n in (num_computed or {}).items():
            assert len(self.table(rid)) >= self.blocks_for(n), f"{rid}: table too small"
