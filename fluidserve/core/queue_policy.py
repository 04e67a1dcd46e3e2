"""Order of the waiting queue. Preempted requests always go first, so recompute never starves.

With a ``window`` of N (TetriInfer's PrefillSchedBatch), arrivals are grouped N at a time in
arrival order; the policy orders requests within a group and groups run in order, so a long
prompt under SJF waits for at most its own group, never forever."""

from __future__ import annotations

from collections.abc import Callable

from fluidserve.request import Request

QUEUE_POLICIES: dict[str, Callable[[Request, int], tuple]] = {
    "fcfs": lambda r, seq: (r.arrival_time, seq),
    "sjf": lambda r, seq: (r.num_prompt_tokens, r.arrival_time, seq),
    "ljf": lambda r, seq: (-r.num_prompt_tokens, r.arrival_time, seq),
}


class WaitingQueue:
    def __init__(self, policy: str = "fcfs", window: int = 0) -> None:
        if policy not in QUEUE_POLICIES:
            raise ValueError(f"unknown queue policy {policy!r}; choose from {list(QUEUE_POLICIES)}")
        if window < 0:
            raise ValueError("queue window must be >= 0")
        self._key = QUEUE_POLICIES[policy]
        self._window = window
        self._items: dict[str, tuple[Request, int]] = {}
        self._seq = 0
        self._ordered: list[Request] | None = []

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._items

    def push(self, req: Request) -> None:
        # A preempted request sorts first anyway: only arrivals take a place in the windows.
        if req.num_preemptions == 0:
            self._seq += 1
        self._items[req.request_id] = (req, self._seq)
        self._ordered = None

    def remove(self, request_id: str) -> Request | None:
        item = self._items.pop(request_id, None)
        if item is not None:
            self._ordered = None
        return item[0] if item else None

    def __iter__(self):
        """The queued requests in no particular order (``ordered`` sorts)."""
        return (req for req, _ in self._items.values())

    def ordered(self) -> list[Request]:
        if self._ordered is None:
            items = self._items.values()
            self._ordered = [
                r
                for r, _ in sorted(
                    items, key=lambda x: (x[0].num_preemptions == 0, self._group(x[1]))
                    + self._key(*x)
                )
            ]
        return list(self._ordered)

    def _group(self, seq: int) -> int:
        return (seq - 1) // self._window if self._window else 0
