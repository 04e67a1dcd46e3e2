"""``fluidserve serve --request-log FILE``: one JSON line per finished request.

Each line holds what a length predictor may learn from and what it must predict: the prompt's
token ids (the first ``MAX_LOGGED_TOKENS``), its length, ``max_tokens``, the number of tokens
generated and how the request ended. ``fluidserve train-predictor`` reads it.
"""

from __future__ import annotations

import json
import threading

from fluidserve.disagg.learned import MAX_LOGGED_TOKENS


class RequestLog:
    def __init__(self, path: str) -> None:
        self._file = open(path, "a", buffering=1)  # noqa: SIM115 - open for the server's life
        self._lock = threading.Lock()
        self._prompts: dict[str, tuple[list[int], int, int]] = {}

    def add(self, request_id: str, prompt_ids: list[int], max_tokens: int) -> None:
        with self._lock:
            self._prompts[request_id] = (prompt_ids[:MAX_LOGGED_TOKENS], len(prompt_ids),
                                         max_tokens)

    def finished(self, rows: list[dict], rejected: list[str]) -> None:
        """The engine's finished-request rows (``telemetry.finished_row``) and the ids of the
        requests it rejected."""
        with self._lock:
            for rid in rejected:
                self._prompts.pop(rid, None)
            for row in rows:
                prompt = self._prompts.pop(row["request_id"], None)
                if prompt is None:
                    continue
                ids, n, max_tokens = prompt
                self._file.write(json.dumps({
                    "prompt_token_ids": ids, "num_prompt_tokens": n, "max_tokens": max_tokens,
                    "generated": row["num_output_tokens"],
                    "finish_reason": row["finish_reason"]}) + "\n")

    def forget_all(self) -> None:
        with self._lock:
            self._prompts.clear()

    def close(self) -> None:
        with self._lock:
            self._file.close()
