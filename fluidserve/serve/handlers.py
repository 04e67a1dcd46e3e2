"""Serving one request: refuse early what cannot run, then stream or collect its outputs.

Cheap checks come first (model name, shutdown, overload, prompt length in characters), so a
request that will be refused is never tokenized.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from contextlib import contextmanager
from dataclasses import dataclass, replace

import jinja2
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from fluidserve.config import ServerConfig
from fluidserve.core.admission import admissible_blocks, admission_error, cache_room
from fluidserve.model.tokenizer import TemplateKwargsError
from fluidserve.sampling_params import SamplingParams
from fluidserve.serve import responses as R
from fluidserve.serve.async_engine import AsyncEngine, Handle
from fluidserve.serve.inputs import PromptTokenizer, too_long
from fluidserve.serve.metrics import ServerMetrics
from fluidserve.serve.protocol import (
    CONTEXT_LENGTH_EXCEEDED,
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    context_length_error,
    cross_field_error,
    error_body,
)

log = logging.getLogger("fluidserve.server")


@dataclass
class ServerState:
    engine: AsyncEngine
    metrics: ServerMetrics
    config: ServerConfig
    model_name: str
    prompts: PromptTokenizer
    draining: bool = False  # refuse new requests (a drain has begun)
    closed: bool = False  # refuse even those already past the first checks (shutting down)
    admitting: int = 0  # requests past the first checks, not yet handed to the engine
    # Names a request may also use, not listed: without --served-model-name, the model path
    # as given and resolved (vLLM's name for it, which its clients send)
    aliases: tuple[str, ...] = ()

    @property
    def max_model_len(self) -> int:
        return self.engine.info.max_model_len

    @property
    def model_names(self) -> tuple[str, ...]:
        """Every name a request may use (``model_name``, the first, is in the responses)."""
        return self.config.served_model_name or (self.model_name,)


def precheck(state: ServerState, body: CompletionRequest | ChatCompletionRequest) -> None:
    """Refusals that need no tokenizing, in the order a client can act on them."""
    _check_model(state, body.model)
    if (fault := cross_field_error(body)) is not None:
        raise ApiError(400, fault[1], param=fault[0])
    if state.draining:
        raise ApiError(503, "the server is shutting down", "service_unavailable")
    if state.engine.dead is not None:
        raise ApiError(503, f"the engine is down: {state.engine.dead}", "service_unavailable")
    limit, choices = state.config.max_waiting_requests, num_choices(body)
    if choices > limit:
        raise ApiError(400, f"{choices} choices (prompts × n) in one request; at most"
                       f" {limit} can wait to run at once (--max-waiting-requests)", param="n")
    waiting = state.engine.num_waiting + state.admitting  # admitting: being tokenized
    if waiting + choices > limit:
        asked = f" and {choices} asked" if choices > 1 else ""
        raise ApiError(503, f"server overloaded: {waiting} requests waiting{asked} (limit"
                       f" {limit}); retry later", "overloaded")


async def completion_ids(state: ServerState, body: CompletionRequest) -> list[list[int]]:
    """Each prompt's ids, in order."""
    prompts = body.prompts
    for i, prompt in enumerate(prompts):
        if isinstance(prompt, str):
            with _which(i, len(prompts)):
                if state.prompts.tokenizer is None:
                    raise ApiError(400, "this model has no tokenizer: send token ids",
                                   param="prompt")
                _check_chars(state, len(prompt), "prompt")

    texts = [p for p in prompts if isinstance(p, str)]
    special = body.add_special_tokens is not False
    if len(texts) == 1:
        encoded = iter([await state.prompts.encode(texts[0], special)])
    else:
        encoded = iter(await state.prompts.encode_many(texts, special) if texts else [])
    # (token ids: the schema bounds them and their number)
    return [next(encoded) if isinstance(p, str) else list(p) for p in prompts]


@contextmanager
def _which(index: int, num_prompts: int):
    """An error about one prompt of several names it (as the schema's errors do)."""
    try:
        yield
    except ApiError as e:
        if num_prompts > 1:
            e.message = f"prompt.{index}: {e.message}"
            e.param = f"prompt.{index}" if e.param in ("prompt", None) else e.param
        raise


async def chat_ids(state: ServerState, body: ChatCompletionRequest) -> list[int]:
    _need_tokenizer(state, ", so chat is unavailable")
    messages = [{"role": m.role, "content": m.text()} for m in body.messages]
    # Each message takes a token at least (its role, as the template renders it), so that
    # many fewer tokens are left for the text.
    _check_chars(state, sum(len(m["content"]) for m in messages), "messages", len(messages))
    return await _render(state, messages, body.template_options())


async def _render(state: ServerState, messages: list[dict], options: dict) -> list[int]:
    """A conversation's ids, as the chat template renders it with ``options``."""
    try:
        return await state.prompts.chat(messages, **options)
    except TemplateKwargsError as e:
        raise ApiError(400, str(e), param="chat_template_kwargs") from None
    except (ValueError, TypeError, jinja2.TemplateError) as e:
        raise ApiError(400, f"cannot apply the chat template: {e}", param="messages") from None


def _check_model(state: ServerState, name: str | None) -> None:
    if name is not None and name not in state.model_names and name not in state.aliases:
        served = ", ".join(repr(n) for n in state.model_names)
        raise ApiError(404, f"model {name!r} does not exist; this server serves {served}",
                       "not_found_error", "model")


def _need_tokenizer(state: ServerState, why: str = "") -> None:
    if state.prompts.tokenizer is None:
        raise ApiError(400, f"this model has no tokenizer{why}")


async def tokenize(state: ServerState, body: TokenizeRequest) -> dict:
    """vLLM's /tokenize: a prompt's ids, or a conversation's as the chat endpoint renders it."""
    _check_model(state, body.model)
    if (body.prompt is None) == (body.messages is None):
        raise ApiError(400, "give either prompt or messages", param="prompt")
    _need_tokenizer(state)
    if (fault := cross_field_error(body)) is not None:
        raise ApiError(400, fault[1], param=fault[0])
    if body.prompt is not None:
        ids = await state.prompts.encode(body.prompt, body.add_special_tokens is not False)
    else:
        ids = await _render(state, [{"role": m.role, "content": m.text()} for m in body.messages],
                            body.template_options())
    strs = state.prompts.tokenizer.hf.convert_ids_to_tokens(ids) if body.return_token_strs \
        else None
    return {"count": len(ids), "max_model_len": state.max_model_len, "tokens": ids,
            "token_strs": strs}


async def detokenize(state: ServerState, body: DetokenizeRequest) -> dict:
    """vLLM's /detokenize: the text of token ids (special tokens included)."""
    _check_model(state, body.model)
    _need_tokenizer(state)
    return {"prompt": await state.prompts.decode(list(body.tokens))}


def _check_chars(state: ServerState, num_chars: int, param: str, num_messages: int = 0) -> None:
    """Text that cannot leave the window a token to generate (max_tokens beyond it is cut)."""
    max_len = state.max_model_len
    room = max_len - 1
    limit = state.prompts.max_chars(max(room - num_messages, 0))
    if limit is not None and num_chars > limit:
        raise too_long(num_chars, room, max_len, param, num_messages)


async def generate(state: ServerState, body, request: Request, chat: bool) -> Response:
    precheck(state, body)
    choices = num_choices(body)
    state.admitting += choices  # a drain waits for these too
    try:
        prompts = [await chat_ids(state, body)] if chat else await completion_ids(state, body)
        bad = await _bad_words(state, body.bad_words) if body.bad_words else ()
        shown = not chat and (body.echo or body.prompt_logprobs is not None)
        if shown:  # (the prompt in the response: its text and its tokens')
            echoes = await _echoes(state, body, prompts)
        if chat and body.prompt_k is not None:  # (the first choice's: the response's)
            prompt_texts = await asyncio.to_thread(state.prompts.token_texts, set(prompts[0]))
        handle, ctxs = admit(state, body, prompts, chat, bad)
        if shown:
            for ctx, (text, ids, texts) in zip(ctxs.values(), (
                    e for e in echoes for _ in range(body.num_samples)), strict=True):
                ctx.prompt_ids, ctx.prompt_k = ids, body.prompt_logprobs
                if body.echo:
                    ctx.echo, ctx.echo_k = text, body.logprobs
                    ctx.score_only = body.max_tokens == 0
                handle.token_texts.update(texts)
        elif chat:
            first = next(iter(ctxs.values()))
            if body.prompt_k is not None:
                first.prompt_ids, first.prompt_k = prompts[0], body.prompt_k
                handle.token_texts.update(prompt_texts)
            for ctx in ctxs.values():
                ctx.echo = body.echo_text()
    finally:
        state.admitting -= choices
    if body.streaming:
        return StreamingResponse(_sse(handle, ctxs, body), media_type="text/event-stream")
    return await _complete(handle, ctxs, request, body)


async def _echoes(state: ServerState, body: CompletionRequest, prompts: list[list[int]]
                  ) -> list[tuple[str, list[int], dict[int, str]]]:
    """For ``echo`` and ``prompt_logprobs``: each prompt's text (a prompt of ids decoded),
    ids, and its tokens' texts (decoded off the event loop)."""
    tok = state.prompts.tokenizer
    if tok is None:
        return [(p if isinstance(p, str) else "", ids, {}) for p, ids in zip(
            body.prompts, prompts, strict=True)]

    def decode() -> list:
        return [(p if isinstance(p, str) else tok.decode(ids, skip_special_tokens=False), ids,
                 state.prompts.token_texts(set(ids)))
                for p, ids in zip(body.prompts, prompts, strict=True)]

    return await asyncio.to_thread(decode)


def num_choices(body: CompletionRequest | ChatCompletionRequest) -> int:
    """The requests the engine is to run for it: each prompt's samples."""
    return body.num_samples * (len(body.prompts) if isinstance(body, CompletionRequest) else 1)


async def _bad_words(state: ServerState, words: list[str]) -> tuple[tuple[int, ...], ...]:
    """``bad_words`` as token sequences (``Tokenizer.bad_words_ids``)."""
    _need_tokenizer(state, ", so bad_words cannot be tokenized")
    ids = await state.prompts.bad_words(words)
    vocab = state.engine.info.vocab_size
    if vocab and any(max(w) >= vocab for w in ids):
        raise ApiError(400, f"bad_words tokenize to ids outside the model's vocabulary of"
                       f" {vocab}: the server's tokenizer does not match its model",
                       param="bad_words")
    return ids


def admit(state: ServerState, body, prompts: list[list[int]], chat: bool,
          bad_words: tuple[tuple[int, ...], ...] = ()) -> tuple[Handle, dict[str, R.Context]]:
    """Hand the request to the engine, each prompt's samples as requests of their own: its
    output stream, and each engine request's choice. Every prompt is checked before any is
    handed over. ``bad_words``: the request's, tokenized."""
    params: list[SamplingParams] = []
    for i, ids in enumerate(prompts):
        with _which(i, len(prompts)):
            # (the first prompt's, with another max_tokens: what its long token lists derive
            # is made once for the request, not once per prompt)
            params.append(sampling_params(state, body, ids, chat, params[0] if params else
                                          None, bad_words))
    rid = R.new_id("chatcmpl" if chat else "cmpl")
    n = body.num_samples
    children = []  # (engine request id, prompt ids, parameters), in the order of the choices
    for ids, p in zip(prompts, params, strict=True):
        for j in range(n):
            child = rid if len(prompts) * n == 1 else f"{rid}-{len(children)}"
            q = p.sample(j) if j else p
            if j and chat:  # (a chat response has one prompt_logprobs: the first sample's)
                q = replace(q, prompt_logprobs=None)
            children.append((child, ids, q))
    if state.closed:
        raise ApiError(503, "the server is shutting down", "service_unavailable")
    try:
        handle = state.engine.add_all(children)
    except RuntimeError as e:  # the engine core died meanwhile
        raise ApiError(503, f"the engine is down: {e}", "service_unavailable") from None
    texts = handle.token_texts if state.prompts.tokenizer is not None else None
    created = R.now()
    as_ids, ret = bool(body.return_tokens_as_token_ids), bool(body.return_token_ids)
    return handle, {child: R.Context(rid, state.model_name, created, len(ids), chat, texts,
                                     index=k, sample=k % n, ids_as_text=as_ids,
                                     prompt_ids=ids, return_ids=ret)
                    for k, (child, ids, _) in enumerate(children)}


def sampling_params(state: ServerState, body, ids: list[int], chat: bool,
                    like: SamplingParams | None = None,
                    bad_words: tuple[tuple[int, ...], ...] = ()) -> SamplingParams:
    """A prompt's sampling parameters, or the error that refuses it: ``like``'s (another
    prompt's of the same request) with this prompt's max_tokens, else made from the body,
    with ``bad_words``."""
    max_len = state.max_model_len
    if not ids:
        raise ApiError(400, "the prompt is empty", param="prompt")
    info = state.engine.info
    if info.vocab_size and (top := max(ids)) >= info.vocab_size:  # (token ids: the schema's)
        raise ApiError(400, f"the prompt tokenizes to id {top}, outside the model's"
                       f" vocabulary of {info.vocab_size}: the server's tokenizer does not match"
                       " its model", param="messages" if chat else "prompt")
    room = max_len - len(ids)
    if room < 1:
        raise context_length_error(max_len, f"the prompt has {len(ids)} tokens, and the window"
                                   " holds prompt and completion together",
                                   "messages" if chat else "prompt")
    admissible = admissible_blocks(info.num_kv_blocks, state.engine.config.cache.watermark)
    requested = body.max_new_tokens if chat else body.max_tokens
    if requested == 0:  # (echo: score the prompt; one token is computed, none returned)
        if body.min_tokens:
            raise ApiError(400, f"min_tokens must be at most max_tokens, which is 0; got"
                           f" min_tokens={body.min_tokens}", param="min_tokens")
        requested = 1
    if requested is not None:
        max_tokens = requested
    elif chat:  # the rest of the window, or as much of it as the KV cache can ever hold
        max_tokens = max(1, min(room, cache_room(len(ids), info.block_size, admissible)))
    else:
        max_tokens = min(16, room)
    # As vLLM does: a completion that the window ends early ends there, on "length".
    max_tokens = min(max_tokens, room)
    if body.min_tokens > max_tokens:
        default = " (the default: no max_tokens was given)" if requested is None else \
            f" (what the {max_len}-token window leaves)" if max_tokens < requested else ""
        raise ApiError(400, f"min_tokens must be at most max_tokens, which is {max_tokens}"
                       f"{default}; got min_tokens={body.min_tokens}", param="min_tokens")
    why = admission_error(len(ids), max_tokens, max_len, info.block_size, admissible)
    if why is not None:  # (the KV cache's: max_tokens was cut to what the window leaves)
        raise ApiError(400, why, code=CONTEXT_LENGTH_EXCEEDED)
    if state.engine.config.disagg.disaggregate and body.prompt_k is not None:
        raise ApiError(400, "the prompt's logprobs (prompt_logprobs, or echo with logprobs)"
                       " are not computed by disaggregated instances (--disaggregate)",
                       param="prompt_logprobs" if body.prompt_logprobs is not None else "echo")
    if like is not None:
        return replace(like, max_tokens=max_tokens)
    try:
        p = body.sampling_params(max_tokens, body.num_logprobs if chat else body.logprobs)
        return replace(p, bad_words_token_ids=bad_words) if bad_words else p
    except ValueError as e:  # (a rule the schema missed: the client's error, not the server's)
        raise ApiError(400, str(e)) from None


async def _sse(handle: Handle, choices: dict[str, R.Context], body) -> AsyncIterator[str]:
    def emit(ctx: R.Context, chunk: dict, out=None) -> str:
        if body.continuous_usage:
            chunk["usage"] = R.usage(ctx.prompt_tokens, len(ctx.token_ids))
        if out is not None and out.finished and body.return_metrics:
            chunk["metrics"] = {"scheduling_delay": out.scheduling_delay}
        return _data(chunk)

    try:  # a client gone at any yield (even before the first output) leaves nothing running
        for ctx in choices.values():
            if ctx.chat:
                yield emit(ctx, R.chat_role_chunk(ctx))
        for ctx in choices.values():  # (as vLLM: after every choice's role)
            if ctx.chat and ctx.echo:
                yield emit(ctx, R.chat_chunk(ctx, {"content": ctx.echo}, None))
        try:
            async for out in handle:
                if out.error is not None:  # the stream ends: the other choices too
                    handle.abort()
                    yield _data(_failure_body(out))
                    break
                ctx = choices[out.request_id]
                ctx.add(out)
                # One chunk per token, even when its text is held back (a partial character or
                # a possible stop string), so clients can time every token.
                yield emit(ctx, R.stream_chunk(ctx, out), out)
        except Exception as e:  # never leave a client with a silently truncated stream
            log.exception("stream %s failed", next(iter(choices.values())).id)
            handle.abort()
            yield _data(error_body(f"internal error: {e}", "internal_error", code=500))
        ended = all(c.finish_reason is not None for c in choices.values())
        if body.include_usage and handle.finished and ended:
            yield _data(R.usage_chunk(list(choices.values())))
        yield "data: [DONE]\n\n"
    finally:
        handle.abort()


# A response of more tokens than this (a logprob entry weighing 8) is built and encoded on a
# worker thread: 1024 choices of 16 tokens with 2 top logprobs took 70 ms to build and
# encode on the 2-core Zen 4 EPYC (32 + 37 ms; 3 ms without logprobs), which every
# stream of the server waited for (the thread lets the event loop in every few ms).
LARGE_RESPONSE = 4096


async def _complete(handle: Handle, choices: dict[str, R.Context], request: Request,
                    body) -> Response:
    async def consume():
        async for out in handle:
            if out.error is not None:  # the response fails: the other choices too
                handle.abort()
                return out
            choices[out.request_id].add(out)
        return None

    task = asyncio.ensure_future(consume())
    while not task.done():  # watch for the client going away while we generate
        await asyncio.wait({task}, timeout=0.5)
        if not task.done() and await request.is_disconnected():
            task.cancel()
            handle.abort()
            return Response(status_code=499)
    failed = task.result()
    if failed is not None:
        body = _failure_body(failed)
        return JSONResponse(body, status_code=body["error"]["code"])

    def render() -> bytes:
        resp = R.full_response(list(choices.values()))
        if body.return_metrics:  # (of several choices: the one that waited longest)
            resp["metrics"] = {"scheduling_delay": max(
                (c.scheduling_delay for c in choices.values() if c.scheduling_delay is not None),
                default=None)}
        return json.dumps(resp, ensure_ascii=False, allow_nan=False, indent=None,
                          separators=(",", ":")).encode()  # (as JSONResponse renders it)

    entries = sum(len(c.token_ids) + (len(c.logprobs) + len(c.prompt_entries)
                                      + len(c.vllm_prompt_logprobs or ())) * 8
                  for c in choices.values())
    if entries > LARGE_RESPONSE:  # off the event loop: every stream would wait for it
        content = await asyncio.to_thread(render)
    else:
        content = render()
    return Response(content, media_type="application/json")


def _failure_body(out) -> dict:
    """A request the server failed: 503 when the server is going away or its engine is down
    (the client may retry elsewhere), 500 for an error in the request's own processing."""
    if out.unavailable:
        return error_body(out.error, "service_unavailable", code=503)
    return error_body(out.error, "internal_error", code=500)


def _data(obj: dict) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"
