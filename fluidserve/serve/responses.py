"""OpenAI response and stream-chunk bodies for completions and chat completions."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from fluidserve.engine.output import RequestOutput
from fluidserve.serve.protocol import new_id, now, usage

__all__ = ["Context", "chat_chunk", "chat_role_chunk", "full_response", "model_list", "new_id",
           "now", "stream_chunk", "total_usage", "usage", "usage_chunk"]


@dataclass
class Context:
    """Everything one choice of a response needs, accumulated from its request's outputs."""

    id: str  # the response's (every choice's)
    model: str
    created: int
    prompt_tokens: int
    chat: bool
    texts: dict[int, str] | None  # token id -> text, decoded off the event loop (None: no
    # tokenizer, a token is shown as its id)
    index: int = 0  # the choice's
    sample: int = 0  # of its prompt's samples (the first counts the prompt in the usage)
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
    num_cached_tokens: int | None = None  # (with prefix caching)
    stop_reason: int | str | None = None  # vLLM's: the stop string or token that ended it
    # A completion's ``echo``: its prompt's text and, with logprobs (``echo_k`` top
    # entries), its prompt's entries (the first token's logprob and top are None); a chat's:
    # the last message's text. With vLLM's ``prompt_logprobs`` (``prompt_k``), the prompt's
    # entries in vLLM's form (of a chat: its first choice's, the response's)
    echo: str | None = None
    prompt_ids: list[int] = field(default_factory=list)
    echo_k: int | None = None
    prompt_k: int | None = None
    prompt_entries: list = field(default_factory=list)
    vllm_prompt_logprobs: list | None = None
    _echoed: bool = False  # (streamed: the prompt goes in the choice's first chunk)
    ids_as_text: bool = False  # return_tokens_as_token_ids: a token is "token_id:{id}"
    # vLLM's return_token_ids: each choice's token ids, and its prompt's (``prompt_ids``)
    return_ids: bool = False
    score_only: bool = False  # echo with max_tokens 0: the token computed is not returned

    def add(self, out: RequestOutput) -> None:
        if out.prompt_logprobs is not None:
            ids = self.prompt_ids
            if self.echo is not None and self.echo_k is not None:
                self.prompt_entries = [(ids[0], None, None)] + [
                    (t, lp, top[:self.echo_k])
                    for t, (lp, top, _) in zip(ids[1:], out.prompt_logprobs, strict=True)]
                self._chars = sum(len(self.token_text(t)) for t in ids)
            if self.prompt_k is not None:
                self.vllm_prompt_logprobs = [None] + [
                    self._vllm_entry(t, lp, top[:self.prompt_k], rank)
                    for t, (lp, top, rank) in zip(ids[1:], out.prompt_logprobs, strict=True)]
        if self.score_only:
            self._new_logprobs = []
            if out.finished:
                self.finish_reason = "length"  # (as vLLM answers a prompt scored alone)
                self.scheduling_delay = out.scheduling_delay
                self.num_cached_tokens = out.num_cached_tokens
            return
        self.text += out.new_text
        self.token_ids += out.new_token_ids
        self._new_logprobs = [
            (t, lp, top) for t, (lp, top) in zip(out.new_token_ids, out.new_logprobs, strict=False)
        ]
        self.logprobs += self._new_logprobs
        self._offset = self._chars
        self._chars += sum(len(self.token_text(t)) for t, _, _ in self._new_logprobs)
        if out.finished:
            self.finish_reason, self.stop_reason = out.finish_reason, out.stop_reason
            self.scheduling_delay = out.scheduling_delay
            self.num_cached_tokens = out.num_cached_tokens

    def _vllm_entry(self, token: int, lp: float, top: list, rank: int) -> dict:
        """A prompt position as vLLM's prompt_logprobs has it: the prompt token, with its
        rank (1 + the tokens more likely), and the top ones, by id, ranked by position (the
        prompt token among them too, as vLLM's dict keeps the later entry)."""
        def item(t: int, v: float, r: int) -> dict:
            return {"logprob": _lp(v), "rank": r, "decoded_token": self.token_text(t)}

        return {str(token): item(token, lp, rank)} | {
            str(t): item(t, v, r) for r, (t, v) in enumerate(top, 1)}

    def token_text(self, token_id: int) -> str:
        if self.ids_as_text:
            return f"token_id:{token_id}"
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
        # (None: an echoed prompt's first token, which nothing predicts)
        "token_logprobs": [None if lp is None else _lp(lp) for _, lp, _ in entries],
        # As OpenAI and vLLM: the sampled token too, first, so up to logprobs + 1 entries.
        "top_logprobs": [None if lp is None else {ctx.token_text(t): _lp(lp)}
                         | {ctx.token_text(i): _lp(v) for i, v in top}
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
    reason = (ctx.finish_reason if ctx.score_only else out.finish_reason) if out.finished \
        else None
    stop = out.stop_reason if out.finished and not ctx.score_only else None
    if ctx.chat:  # (content "" too, as vLLM: while text is held back, and at the end)
        chunk = chat_chunk(ctx, {"content": out.new_text}, reason,
                           _chat_logprobs(ctx, ctx._new_logprobs), stop)
        if ctx.return_ids:
            chunk["choices"][0]["token_ids"] = out.new_token_ids
        return chunk
    text, entries, offset = ("" if ctx.score_only else out.new_text), ctx._new_logprobs, \
        ctx._offset
    first = not ctx._echoed
    ctx._echoed = True
    if ctx.echo is not None and first:
        text, entries, offset = ctx.echo + text, ctx.prompt_entries + entries, 0
    lp = _completion_logprobs(ctx, entries, offset)
    choice = {"index": ctx.index, "text": text, "logprobs": lp, "finish_reason": reason,
              "stop_reason": stop}
    if ctx.prompt_k is not None and first:
        choice["prompt_logprobs"] = ctx.vllm_prompt_logprobs
    if ctx.return_ids:  # (as vLLM's: the prompt's in each choice's first chunk)
        choice["token_ids"] = [] if ctx.score_only else out.new_token_ids
        if first:
            choice["prompt_token_ids"] = ctx.prompt_ids
    return _envelope(ctx, "text_completion", [choice], None)


def chat_chunk(ctx: Context, delta: dict, reason: str | None, logprobs: dict | None = None,
               stop_reason: int | str | None = None):
    choice = {"index": ctx.index, "delta": delta, "logprobs": logprobs, "finish_reason": reason,
              "stop_reason": stop_reason}
    return _envelope(ctx, "chat.completion.chunk", [choice])


def chat_role_chunk(ctx: Context) -> dict:
    """A chat choice's first chunk: its role (with return_token_ids, as vLLM's, the prompt's
    token ids beside it)."""
    chunk = chat_chunk(ctx, {"role": "assistant", "content": ""}, None)
    if ctx.return_ids:
        chunk["prompt_token_ids"] = ctx.prompt_ids
    return chunk


def total_usage(choices: list[Context]) -> dict:
    """Each prompt's tokens once (however many samples it has), every choice's output; with
    prefix caching, as vLLM's ``prompt_tokens_details``, those of its prompt found cached
    (its first sample's)."""
    firsts = [c for c in choices if c.sample == 0]
    body = usage(sum(c.prompt_tokens for c in firsts), sum(len(c.token_ids) for c in choices))
    cached = [c.num_cached_tokens for c in firsts]
    if cached and None not in cached:
        body["prompt_tokens_details"] = {"cached_tokens": sum(cached)}
    return body


def usage_chunk(choices: list[Context]) -> dict:
    first = choices[0]
    obj = "chat.completion.chunk" if first.chat else "text_completion"
    return _envelope(first, obj, [], total_usage(choices))


def full_response(choices: list[Context]) -> dict:
    first = choices[0]
    if first.chat:
        items = [{
            "index": c.index,
            "message": {"role": "assistant", "content": (c.echo or "") + c.text},
            "logprobs": _chat_logprobs(c, c.logprobs),
            "finish_reason": c.finish_reason,
            "stop_reason": c.stop_reason,
        } | ({"token_ids": c.token_ids} if c.return_ids else {}) for c in choices]
        body = _envelope(first, "chat.completion", items, total_usage(choices))
        if first.prompt_k is not None:
            body["prompt_logprobs"] = first.vllm_prompt_logprobs
        if first.return_ids:
            body["prompt_token_ids"] = first.prompt_ids
        return body
    items = [{
        "index": c.index,
        "text": (c.echo or "") + c.text,
        "logprobs": _completion_logprobs(c, c.prompt_entries + c.logprobs, 0),
        "finish_reason": c.finish_reason,
        "stop_reason": c.stop_reason,
    } | ({"prompt_logprobs": c.vllm_prompt_logprobs} if c.prompt_k is not None else {})
      | ({"token_ids": [] if c.score_only else c.token_ids, "prompt_token_ids": c.prompt_ids}
         if c.return_ids else {})
        for c in choices]
    return _envelope(first, "text_completion", items, total_usage(choices))


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
