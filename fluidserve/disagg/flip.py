"""When an instance should change role (TetriInfer's instance flip, section 3.5).

The cluster monitor calls ``FlipPolicy.decide`` every interval with what it sees: the prefill
backlog (prompt tokens queued per accepting prefill instance, in chunks) and whether prefilled
requests wait for a decode instance. Prefill is short of instances when the backlog stays
above ``flip_prefill_backlog`` chunks with no decode shortage; decode is short when prefilled
requests wait while the prefill backlog is under a chunk. After ``flip_window`` seconds of one
shortage, the instance of the other role holding the fewest requests drains (takes no new
work) and flips once it is empty; a role keeps at least one instance, and one instance drains
at a time. The simulated cluster and the served control plane share this policy.
"""

from __future__ import annotations

from fluidserve.config import DisaggConfig


class FlipPolicy:
    def __init__(self, d: DisaggConfig) -> None:
        self.d = d
        self._short: dict[str, float | None] = {"prefill": None, "decode": None}

    def decide(self, t: float, backlog_chunks: float, decode_short: bool,
               accepting: dict[str, list[tuple[int, int]]], draining: bool) -> int | None:
        """The instance to drain now, or None. ``accepting[role]``: (instance, requests it
        holds) for that role's instances that take new work; ``draining``: one already is."""
        d = self.d
        prefill_short = backlog_chunks > d.flip_prefill_backlog and not decode_short
        self._short["prefill"] = _since(self._short["prefill"], prefill_short, t)
        self._short["decode"] = _since(self._short["decode"],
                                       decode_short and backlog_chunks < 1, t)
        for short, spare in (("prefill", "decode"), ("decode", "prefill")):
            since = self._short[short]
            candidates = accepting.get(spare, [])
            if since is not None and t - since >= d.flip_window and len(candidates) > 1 \
                    and not draining:
                self._short[short] = None
                return min(candidates, key=lambda c: (c[1], c[0]))[0]
        return None


def _since(since: float | None, cond: bool, t: float) -> float | None:
    return (since if since is not None else t) if cond else None
