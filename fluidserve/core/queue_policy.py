"""Order of the waiting queue. Preempted requests always go first, so recompute never starves.

With a ``window`` of N (TetriInfer's PrefillSchedBatch), arrivals are grouped N at a time in
arrival order; the policy orders requests within a group and groups run in order, so a long
prompt under SJF waits for at most its own group, never forever."""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterator

from fluidserve.request import Request

QUEUE_POLICIES: dict[str, Callable[[Request, int], tuple]] = {
    "fcfs": lambda r, seq: (r.arrival_time, seq),
    "sjf": lambda r, seq: (r.num_prompt_tokens, r.arrival_time, seq),
    "ljf": lambda r, seq: (-r.num_prompt_tokens, r.arrival_time, seq),
}


class WaitingQueue:
    """The waiting requests, kept sorted as they come and go: a sorted list of entries with
    lazy deletion (an entry is live while it is its request's latest), so that an iteration
    that admits the head of a queue of thousands pays for the few entries it looks at, not
    for a sort of the whole queue."""

    def __init__(self, policy: str = "fcfs", window: int = 0) -> None:
        if policy not in QUEUE_POLICIES:
            raise ValueError(f"unknown queue policy {policy!r}; choose from {list(QUEUE_POLICIES)}")
        if window < 0:
            raise ValueError("queue window must be >= 0")
        self._key = QUEUE_POLICIES[policy]
        self._window = window
        self._items: dict[str, tuple[Request, int]] = {}  # request id -> (request, entry)
        self._sorted: list[tuple[tuple, int, Request]] = []  # (sort key, entry, request)
        self._head = 0  # every entry before it is dead
        self._dead = 0
        self._seq = 0
        self._entries = 0

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._items

    def push(self, req: Request) -> None:
        """Queue ``req`` (again, after a preemption: preempted requests sort first)."""
        # A preempted request sorts first anyway: only arrivals take a place in the windows.
        if req.num_preemptions == 0:
            self._seq += 1
        self._entries += 1
        if self._items.get(req.request_id) is not None:
            self._dead += 1
        self._items[req.request_id] = (req, self._entries)
        key = (req.num_preemptions == 0, self._group(self._seq)) + self._key(req, self._seq)
        bisect.insort(self._sorted, (key, self._entries, req), lo=self._head)

    def remove(self, request_id: str) -> Request | None:
        item = self._items.pop(request_id, None)
        if item is None:
            return None
        self._dead += 1
        return item[0]

    def __iter__(self):
        """The queued requests in no particular order (``in_order`` sorts)."""
        return (req for req, _ in self._items.values())

    def in_order(self) -> Iterator[Request]:
        """The queued requests in queue order, lazily. Requests may be removed while this
        runs (admitting the head); none may be pushed."""
        if self._dead > 256 and self._dead > len(self._items):
            self._compact()
        s, items = self._sorted, self._items
        i = self._head
        while i < len(s):
            _, entry, req = s[i]
            item = items.get(req.request_id)
            if item is not None and item[1] == entry:
                yield req
            elif i == self._head:
                self._head += 1
            i += 1

    def ordered(self) -> list[Request]:
        return list(self.in_order())

    def _compact(self) -> None:
        items = self._items
        self._sorted = [e for e in self._sorted[self._head:]
                        if (item := items.get(e[2].request_id)) is not None and item[1] == e[1]]
        self._head = self._dead = 0

    def _group(self, seq: int) -> int:
        return (seq - 1) // self._window if self._window else 0
