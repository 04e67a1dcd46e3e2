"""Paged KV-cache bookkeeping: which physical blocks hold which request's tokens.

Token ``i`` of a request lives in block ``table[i // block_size]`` at offset
``i % block_size``. Blocks are handed out from a free list; a request's table only grows
until the request finishes or is preempted, when all its blocks return at once.

With prefix caching (``PrefixCachingBlockManager``) a full block outlives its request: it is
known by its tokens and those of every block before it, a later request whose tokens begin
the same way starts with it instead of computing it again, and it is only reused for other
tokens when no free block is left (least recently freed first).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Sequence

from fluidserve.core.admission import admissible_blocks


class BlockManager:
    prefix_caching = False
    queries = hits = 0  # (prefix caching's: tokens looked up, tokens found)

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
        return self.num_new_blocks(request_id, num_tokens) <= self.num_free_blocks - reserve

    def can_admit(self, request_id: str, num_tokens: int,
                  prefix: Sequence[int] | None = ()) -> bool:
        """Whether a new request of ``num_tokens`` fits whole, the watermark kept."""
        return self.can_allocate(request_id, num_tokens, admit=True)

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


class PrefixCachingBlockManager(BlockManager):
    """Blocks shared by the requests whose tokens begin alike (vLLM's automatic prefix
    caching).

    A block is registered once it is full and its KV written (``commit``), under its key:
    the node of the block before it (0 for the first) and its own tokens. Keys hold the
    tokens themselves, not a hash of them, so two prefixes never share a block by collision.
    ``match`` finds the longest registered prefix of a request's tokens, ``adopt`` starts
    its table with those blocks. Only full blocks are shared, and a request only writes past
    its computed tokens, so a shared block is never written again. A block whose last holder
    ends stays registered among the free (``num_free_blocks`` counts it) until a request
    needs a block and none is free otherwise."""

    prefix_caching = True

    def __init__(self, num_blocks: int, block_size: int, watermark: float = 0.0) -> None:
        super().__init__(num_blocks, block_size, watermark)
        self._refs = [0] * num_blocks  # tables holding each block
        self._cached: OrderedDict[int, None] = OrderedDict()  # free registered blocks, least
        # recently freed first
        self._block_of: dict[tuple[int, tuple[int, ...]], int] = {}  # key -> block
        self._key: dict[int, tuple[int, tuple[int, ...]]] = {}  # registered block -> key
        self._node: dict[int, int] = {}  # registered block -> its node (its successors' key)
        self._next_node = 1
        self._committed: dict[str, tuple[int, int]] = {}  # request -> (its first blocks that
        # are registered or hold registered tokens, the node of the last of them)
        self.queries = 0  # tokens of admitted requests looked up
        self.hits = 0  # of which found in the cache

    @property
    def num_free_blocks(self) -> int:
        return len(self._free) + len(self._cached)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def match(self, tokens: Sequence[int]) -> list[int]:
        """The blocks holding the longest registered prefix of ``tokens``, in whole blocks,
        leaving at least the last token to compute (it gives the next token's logits)."""
        bs, block_of, node = self.block_size, self._block_of, self._node
        blocks, parent = [], 0
        for i in range((len(tokens) - 1) // bs):
            block = block_of.get((parent, tuple(tokens[i * bs:(i + 1) * bs])))
            if block is None:
                break
            blocks.append(block)
            parent = node[block]
        return blocks

    def can_admit(self, request_id: str, num_tokens: int,
                  prefix: Sequence[int] | None = ()) -> bool:
        """Whether a new request of ``num_tokens`` whose first blocks are ``prefix`` (from
        ``match``) fits whole, the watermark kept; ``None``: whether it could with the
        longest prefix there can be, held by other requests."""
        if prefix is None:
            need = self.blocks_for(num_tokens) - (num_tokens - 1) // self.block_size
            return need <= self.num_free_blocks - self.watermark_blocks
        reviving = sum(1 for b in prefix if self._refs[b] == 0)  # (free now, not once held)
        need = self.blocks_for(num_tokens) - len(prefix)
        return need <= self.num_free_blocks - reviving - self.watermark_blocks

    def adopt(self, request_id: str, prefix: Sequence[int], num_tokens: int) -> None:
        """Start ``request_id``'s (empty) table with ``prefix``; ``num_tokens``: its tokens,
        counted in ``queries``."""
        for b in prefix:
            if self._refs[b] == 0:
                del self._cached[b]
            self._refs[b] += 1
        self._tables[request_id] = tuple(prefix)
        self._committed[request_id] = (len(prefix), self._node[prefix[-1]] if prefix else 0)
        self.queries += num_tokens
        self.hits += len(prefix) * self.block_size

    def allocate(self, request_id: str, num_tokens: int) -> bool:
        table = self._tables.get(request_id)
        need = -(-num_tokens // self.block_size) - (len(table) if table else 0)
        if need <= 0:
            return True
        if need > len(self._free) + len(self._cached):
            return False
        new = []
        for _ in range(need):
            if self._free:
                block = self._free.popleft()
            else:  # the least recently freed registered block: its tokens are forgotten
                block, _ = self._cached.popitem(last=False)
                del self._block_of[self._key.pop(block)], self._node[block]
            self._refs[block] = 1
            new.append(block)
        self._tables[request_id] = (table or ()) + tuple(new)
        return True

    def free(self, request_id: str) -> int:
        blocks = self._tables.pop(request_id, ())
        self._committed.pop(request_id, None)
        refs = self._refs
        for b in reversed(blocks):  # a prefix's tail is forgotten before its head
            refs[b] -= 1
            if refs[b] == 0:
                if b in self._key:
                    self._cached[b] = None
                else:
                    self._free.append(b)
        return len(blocks)

    def num_committed(self, request_id: str) -> int:
        """``request_id``'s first blocks that are registered (or hold registered tokens)."""
        return self._committed.get(request_id, (0, 0))[0]

    def commit(self, request_id: str, num_tokens: int,
               token_slice: Callable[[int, int], Sequence[int]]) -> None:
        """Register the full blocks among ``request_id``'s first ``num_tokens`` tokens, whose
        KV is written; ``token_slice(start, end)``: its tokens there (none unknown yet)."""
        bs = self.block_size
        done, parent = self._committed.get(request_id, (0, 0))
        full = num_tokens // bs
        if full <= done:
            return
        table, tokens = self._tables[request_id], token_slice(done * bs, full * bs)
        for i in range(done, full):
            key = (parent, tuple(tokens[(i - done) * bs:(i - done + 1) * bs]))
            held = self._block_of.get(key)
            if held is None:  # (else another request computed these tokens too: its block
                block = table[i]  # stays the one found, this one is freed unregistered)
                self._block_of[key], self._key[block] = block, key
                self._node[block], parent = self._next_node, self._next_node
                self._next_node += 1
            else:
                parent = self._node[held]
        self._committed[request_id] = (full, parent)

    def check_invariants(self, num_computed: dict[str, int] | None = None) -> None:
        """As ``BlockManager``'s, with shared blocks: each block is free, free and
        registered, or held by as many tables as its count says."""
        held: dict[int, int] = {}
        for t in self._tables.values():
            assert len(set(t)) == len(t), "a table holds a block twice"
            for b in t:
                held[b] = held.get(b, 0) + 1
        free, cached = list(self._free), list(self._cached)
        assert len(set(free)) == len(free), "a block is free twice"
        assert not set(free) & set(cached), "a block is free twice"
        assert not (set(free) | set(cached)) & set(held), "a block is both held and free"
        assert len(held) + len(free) + len(cached) == self.num_blocks, "a block leaked"
        assert all(self._refs[b] == n for b, n in held.items()), "a reference count is wrong"
        assert all(b in self._key for b in cached), "a cached block is not registered"
        assert not set(free) & set(self._key), "a free block is registered"
        assert all(self._block_of[k] == b for b, k in self._key.items()), "a key is stale"
        for rid, n in (num_computed or {}).items():
            assert len(self.table(rid)) >= self.blocks_for(n), f"{rid}: table too small"


def make_block_manager(num_blocks: int, block_size: int, watermark: float = 0.0,
                       prefix_caching: bool = False) -> BlockManager:
    cls = PrefixCachingBlockManager if prefix_caching else BlockManager
    return cls(num_blocks, block_size, watermark)
