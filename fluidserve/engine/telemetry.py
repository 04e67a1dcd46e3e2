"""Per-iteration and per-token records, exportable as JSON lines."""

from __future__ import annotations

import json
from collections import deque
from dataclasses import asdict, dataclass
from pathlib import Path

from fluidserve.core.scheduler.output import SchedulerOutput
from fluidserve.metrics import request_latency
from fluidserve.request import Request


@dataclass(frozen=True)
class IterationRecord:
    iteration: int
    start: float
    duration: float
    num_prefill_tokens: int
    num_decode_tokens: int
    num_requests: int
    num_prefill_requests: int
    num_preempted: int
    # Attention work, for fitting cost models: sums over multi-token chunks of chunk length x
    # tokens already cached and of chunk length squared, and the one-token runs' count,
    # longest context and sum of contexts.
    prefix_work: int = 0
    num_single: int = 0
    single_ctx_max: int = 0
    sq_work: int = 0
    token_budget: int | None = None
    single_ctx_sum: int = 0


@dataclass(frozen=True)
class TokenEvent:
    request_id: str
    token_index: int
    time: float


def finished_row(req: Request) -> dict:
    """A finished request's record: lengths, outcome and latency metrics."""
    lat = request_latency(req.arrival_time, req.token_times, req.first_scheduled_time)
    return {
        "request_id": req.request_id,
        "arrival_time": req.arrival_time,
        "num_prompt_tokens": req.num_prompt_tokens,
        "num_output_tokens": len(req.output_token_ids),
        "finish_reason": req.finish_reason,
        "num_preemptions": req.num_preemptions,
        "error": req.error,
        **lat.to_dict(),
    }


MAX_RECORDS = 100_000  # of each kind, by default: an engine that runs for days stays bounded


class Telemetry:
    """Keeps the most recent ``max_records`` iterations and token events (None: all)."""

    def __init__(self, max_records: int | None = MAX_RECORDS) -> None:
        self.iterations: deque[IterationRecord] = deque(maxlen=max_records)
        self.tokens: deque[TokenEvent] = deque(maxlen=max_records)
        self.finished: deque[dict] = deque(maxlen=max_records)

    def record_iteration(self, plan: SchedulerOutput, start: float, duration: float) -> None:
        if self.iterations.maxlen == 0:
            return
        w = plan.attention_work
        prefill_reqs = len(plan.chunks) - plan.num_decode_tokens
        rec = IterationRecord(
            plan.iteration, start, duration, plan.num_prefill_tokens, plan.num_decode_tokens,
            len(plan.chunks), prefill_reqs, len(plan.preempted), w.prefix, w.num_single,
            w.single_ctx_max, w.sq, plan.token_budget, w.single_ctx_sum,
        )  # fmt: skip
        self.iterations.append(rec)

    def record_token(self, req: Request) -> None:
        if self.tokens.maxlen == 0:
            return
        idx = len(req.token_times) - 1  # (its outputs may end in a token still in flight)
        self.tokens.append(TokenEvent(req.request_id, idx, req.token_times[idx]))

    def record_finished(self, req: Request, row: dict | None = None) -> None:
        if self.finished.maxlen != 0:
            self.finished.append(row if row is not None else finished_row(req))

    def export_jsonl(self, path: str | Path) -> None:
        with open(path, "w") as f:
            for kind, rows in (
                ("iteration", self.iterations),
                ("token", self.tokens),
                ("request", self.finished),
            ):
                for row in rows:
                    f.write(
                        json.dumps(
                            {"type": kind, **(row if isinstance(row, dict) else asdict(row))}
                        )
                        + "\n"
                    )
