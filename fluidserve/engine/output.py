"""Front-end output processing: token deltas from the engine core become text deltas.

Detokenization and stop strings run here, in the front end, so the engine core never waits on
text work. A stop string ends the request here at once (its text cut before the stop string)
and the caller tells the core to stop computing it; tokens the core produced meanwhile are
dropped. A stop string completed by the very last allowed token still applies.

As in vLLM: a stop string only matches once more than ``min_tokens`` tokens were produced,
and only where it takes in text the newest tokens added (text already emitted, or held back
before then, never ends a request later); and the text of the token that stopped a request
in the core (one of ``stop_token_ids``, or EOS) is not part of the output, though the token
counts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from fluidserve.engine.messages import RequestDelta
from fluidserve.model.tokenizer import IncrementalDetokenizer, Tokenizer
from fluidserve.sampling_params import SamplingParams


@dataclass(slots=True)
class RequestOutput:
    """What one step produced for one request: new tokens and text, and whether it ended."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None = None
    error: str | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    new_logprobs: list = field(default_factory=list)
    # Set when finished: first scheduled - arrival, and, with prefix caching, the prompt's
    # tokens found cached.
    scheduling_delay: float | None = None
    num_cached_tokens: int | None = None
    # The error is the server's state (shutting down, the engine core down), not the
    # request's: the API answers 503 and the client may retry elsewhere.
    unavailable: bool = False
    prompt_logprobs: list | None = None  # with the first token, if asked
    # vLLM's: what stopped it, the stop string matched or the stop token (one of
    # ``stop_token_ids``; None: EOS, the length, or not finished)
    stop_reason: int | str | None = None


@dataclass(slots=True)
class _State:
    params: SamplingParams
    detok: IncrementalDetokenizer | None
    num_output_tokens: int = 0
    sent: int = 0  # characters of text already emitted
    scheduling_delay: float | None = None  # (the core's latest)
    num_cached_tokens: int | None = None


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer | None) -> None:
        self.tokenizer = tokenizer
        self._states: dict[str, _State] = {}

    def add(self, request_id: str, params: SamplingParams, prompt_ids: Sequence[int] = ()
            ) -> None:
        detok = IncrementalDetokenizer(self.tokenizer, prompt_ids, params.skip_special_tokens) \
            if self.tokenizer is not None else None
        self._states[request_id] = _State(params, detok)

    def forget(self, request_id: str) -> None:
        self._states.pop(request_id, None)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._states

    def __len__(self) -> int:
        return len(self._states)

    def process(self, delta: RequestDelta) -> tuple[RequestOutput | None, bool]:
        """The client-facing output for ``delta`` (None if the request already ended here), and
        whether a stop string ended it (the core must then be told to stop it)."""
        st = self._states.get(delta.request_id)
        if st is None:
            return None, False
        st.num_output_tokens += len(delta.new_token_ids)
        if delta.scheduling_delay is not None:
            st.scheduling_delay = delta.scheduling_delay
        if delta.num_cached_tokens is not None:
            st.num_cached_tokens = delta.num_cached_tokens
        reason = delta.finish_reason
        text = ""
        ids = delta.new_token_ids
        if reason == "stop" and not st.params.include_stop_str_in_output:
            ids = ids[:-1]  # the last token is the stop token: its text is not output
        match = None
        if st.detok is not None and (ids or delta.finished):
            text, match = self._advance_text(st, ids, delta.finished)
        stopped = match is not None
        if stopped and reason != "error":
            reason = "stop"
        done = reason is not None  # (the core's end, or a stop string's)
        out = RequestOutput(delta.request_id, delta.new_token_ids, text, done, reason,
                            delta.error, delta.num_prompt_tokens, st.num_output_tokens,
                            delta.new_logprobs, st.scheduling_delay if done else None,
                            st.num_cached_tokens if done else None, delta.unavailable)
        out.prompt_logprobs = delta.prompt_logprobs
        if reason == "stop":
            out.stop_reason = match if stopped else delta.stop_token
        if out.finished:
            del self._states[delta.request_id]
        return out, stopped and not delta.finished

    def _advance_text(self, st: _State, token_ids: list[int], finished: bool
                      ) -> tuple[str, str | None]:
        """Detokenize, apply stop strings, and return the text delta safe to emit now, and
        the stop string that ended the text, if one did."""
        det = st.detok
        before = len(det.text)
        det.push(token_ids)
        text, stops = det.text, st.params.stop
        match = None
        if stops and st.num_output_tokens > st.params.min_tokens and len(text) > before:
            # A match must end in the new text: one found in older text was either there
            # before min_tokens allowed it, or is already past (the hold-back below keeps
            # the start of any match that can still complete from being emitted).
            hits = [(i, i + len(s), s) for i, s in ((text.find(s, max(0, before - len(s) + 1)),
                                                     s) for s in stops) if i >= 0]
            if hits:  # (the first match ends the text, before it or, if asked, after it)
                start, end, match = min(hits)
                det.text = text = text[: end if st.params.include_stop_str_in_output
                                       else start]
        # While a stop string could still complete, hold back a possible partial match.
        hold = 0 if finished or match is not None or not stops else max(len(s) for s in stops) - 1
        upto = max(st.sent, len(text) - hold)
        out = text[st.sent : upto]
        st.sent = upto
        return out, match
