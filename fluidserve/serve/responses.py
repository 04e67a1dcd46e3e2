"""OpenAI response and stream-chunk bodies for completions and chat completions."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from fluidserve.engine.output import RequestOutput
from fluidserve.serve.protocol import new_id, now, usage

__all__ = ["Context", "chat_chunk", "full_response", "model_list", "new_id", "now",
           "stream_chunk", "usage", "usage_chunk"]


@dataclass
class Context:
    """Everything one response needs, accumulated from the request's outputs."""

    id: str
    model: str
    created: int
    prompt_tokens: int
    chat: bool
    texts: dict[int, str] | None  # token id -> text, decoded off the event loop (None: no
    # tokenizer, a token is shown as its id)
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    logprobs: list = field(default_factory=list)  # (token id, logprob, [(id, lp)...])
    _new_logprobs: list = field(default_factory=list)
    # text_offset of the first new entry: the earlier entries' token texts, as the full
    # response counts them (not the text streamed so far, which lags while a possible stop
    # string holds it back)
    _offset: int = 0
    _chars: int = 0
    scheduling_delay: float | None = None

    def add(self, out: RequestOutput) -> None:
        self.text += out.new_text
        self.token_ids += out.new_token_ids
        self._new_logprobs = [
            (t, lp, top) for t, (lp, top) in zip(out.new_token_ids, out.new_logprobs, strict=False)
        ]
        self.logprobs += self._new_logprobs
        self._offset = self._chars
        self._chars += sum(len(self.token_text(t)) for t, _, _ in self._new_logprobs)
        if out.finished:
            self.finish_reason = out.finish_reason
            self.scheduling_delay = out.scheduling_delay

    def token_text(self, token_id: int) -> str:
        return str(token_id) if self.texts is None else self.texts.get(token_id, "")


def _lp(value: float) -> float:
    """A logprob JSON can carry: -inf (and anything below) as -9999.0, as OpenAI does."""
    return value if math.isfinite(value) and value > -9999.0 else -9999.0


def _completion_logprobs(ctx: Context, entries: list, offset: int) -> dict | None:
    if not entries:
        return None
    tokens = [ctx.token_text(t) for t, _, _ in entries]
    offsets, pos = [], offset
    for tok in tokens:
        offsets.append(pos)
        pos += len(tok)
    return {
        "tokens": tokens,
        "token_logprobs": [_lp(lp) for _, lp, _ in entries],
        # As OpenAI and vLLM: the sampled token too, first, so up to logprobs + 1 entries.
        "top_logprobs": [{ctx.token_text(t): _lp(lp)} | {ctx.token_text(i): _lp(v) for i, v in top}
                         for t, lp, top in entries],
        "text_offset": offsets,
    }


def _chat_logprobs(ctx: Context, entries: list) -> dict | None:
    if not entries:
        return None

    def item(tid: int, lp: float) -> dict:
        text = ctx.token_text(tid)
        return {"token": text, "logprob": _lp(lp), "bytes": list(text.encode())}

    return {
        "content": [
            item(t, lp) | {"top_logprobs": [item(i, v) for i, v in top]} for t, lp, top in entries
        ]
    }


def _envelope(ctx: Context, obj: str, choices: list, usage_: dict | None = None) -> dict:
    body = {
        "id": ctx.id,
        "object": obj,
        "created": ctx.created,
        "model": ctx.model,
        "choices": choices,
    }
    if usage_ is not None or obj in ("text_completion", "chat.completion"):
        body["usage"] = usage_
    return body


def stream_chunk(ctx: Context, out: RequestOutput) -> dict:
    reason = out.finish_reason if out.finished else None
    if ctx.chat:
        delta = {"content": out.new_text} if out.new_text else {}
        return chat_chunk(ctx, delta, reason, _chat_logprobs(ctx, ctx._new_logprobs))
    lp = _completion_logprobs(ctx, ctx._new_logprobs, ctx._offset)
    choice = {"index": 0, "text": out.new_text, "logprobs": lp, "finish_reason": reason}
    return _envelope(ctx, "text_completion", [choice], None)


def chat_chunk(ctx: Context, delta: dict, reason: str | None, logprobs: dict | None = None):
    choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": reason}
    return _envelope(ctx, "chat.completion.chunk", [choice])


def usage_chunk(ctx: Context) -> dict:
    obj = "chat.completion.chunk" if ctx.chat else "text_completion"
    return _envelope(ctx, obj, [], usage(ctx.prompt_tokens, len(ctx.token_ids)))


def full_response(ctx: Context) -> dict:
    u = usage(ctx.prompt_tokens, len(ctx.token_ids))
    if ctx.chat:
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": ctx.text},
            "logprobs": _chat_logprobs(ctx, ctx.logprobs),
            "finish_reason": ctx.finish_reason,
        }
        return _envelope(ctx, "chat.completion", [choice], u)
    choice = {
        "index": 0,
        "text": ctx.text,
        "logprobs": _completion_logprobs(ctx, ctx.logprobs, 0),
        "finish_reason": ctx.finish_reason,
    }
    return _envelope(ctx, "text_completion", [choice], u)


def model_list(names: tuple[str, ...], max_model_len: int, root: str | None = None) -> dict:
    """The served model under each of its names; ``root`` is its directory (as vLLM reports
    it), which lets a client on the same machine find the tokenizer the server counts tokens
    with."""
    created = now()
    return {
        "object": "list",
        "data": [
            {
                "id": name,
                "object": "model",
                "created": created,
                "owned_by": "fluidserve",
                "max_model_len": max_model_len,
                "root": root,
            }
            for name in names
        ],
    }
