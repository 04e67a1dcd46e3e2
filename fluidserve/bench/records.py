"""One request as a client saw it: the record every metric is computed from.

Kept apart from the HTTP client so that the simulator, which produces the same records on a
virtual clock, does not import an HTTP library.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RequestRecord:
    index: int
    prompt_len: int
    output_len: int  # requested
    scheduled: float  # seconds after the run start when it was due
    sent: float | None = None  # seconds after the run start when it was sent
    gaps: list[float] = field(default_factory=list)  # TTFT, then every inter-token gap
    num_output_tokens: int = 0
    server_prompt_tokens: int | None = None
    scheduling_delay: float | None = None  # as reported by the server, if it does
    error: str | None = None
    fluidity_index: float | None = None
    ttft_deadline: float | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    def token_times(self) -> list[float]:
        """Absolute token arrival times (seconds after the run start)."""
        out, t = [], self.sent or 0.0
        for g in self.gaps:
            t += g
            out.append(t)
        return out

    def to_dict(self) -> dict:
        return {f: getattr(self, f) for f in self.__dataclass_fields__}  # no deep copy
