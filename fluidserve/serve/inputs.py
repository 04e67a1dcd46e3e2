"""Request bodies and prompts, turned into token ids without stalling anyone else.

- Bodies are parsed by a strict JSON parser (no lone UTF-16 surrogates, no NaN), then validated
  against the request models: every failure is an HTTP 400 with an OpenAI-style body. A large
  body is parsed in a process of its own (``BodyParser``).
- A prompt that cannot fit the context window is refused before it is tokenized. One token
  stands for at most ``chars_per_token`` characters of text (the longest token in the vocabulary,
  times what the normalizer may shrink text by), so a prompt of more than
  ``room * chars_per_token`` characters cannot fit in ``room`` tokens.
- Tokenizing runs on a small pool of worker threads, never on the event loop (the tokenizer
  releases the GIL while it works).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import multiprocessing
import os
import re
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from functools import cache, partial

import pydantic_core
from pydantic import BaseModel, ValidationError

from fluidserve.model.tokenizer import Tokenizer
from fluidserve.net import die_with_parent, ignore_group_signals
from fluidserve.serve.protocol import (
    CONTEXT_LENGTH_EXCEEDED,
    ApiError,
    Limits,
    context_length_error,
    request_models,
    tokenizer_models,
)

log = logging.getLogger(__name__)

TOKENIZE_THREADS = 2


LARGE_BODY = 64 << 10  # bytes: bodies above this are parsed in another process
MAX_PARSER_DEATHS = 3


class BodyParser:
    """``parse_body`` for the request models of these limits: in this process for a small
    body; in a process of its own for a large one, so that the streams of others keep
    flowing meanwhile. The JSON parser holds the interpreter for the whole of a body, and
    building its values costs far more than its bytes say (4 MB of small objects in an
    ignored field: ~0.2 s, in which no token of any stream is delivered, on a worker thread
    as much as on the event loop; scripts/body_parse_lag.py). The other process sends back
    only the validated fields, which are validated again here (a prompt's worth of data, not
    the junk)."""

    def __init__(self, limits: Limits) -> None:
        self.limits = limits
        self.models = _models(limits)
        self._pool: ProcessPoolExecutor | None = None
        self._deaths = 0  # parser processes lost; at MAX_PARSER_DEATHS, no more are started

    async def read(self, raw: bytes, kind: str) -> BaseModel:
        model = self.models[kind]
        if len(raw) <= LARGE_BODY:
            return parse_body(raw, model, self.limits.max_model_len)
        if self._deaths >= MAX_PARSER_DEATHS:
            return await asyncio.to_thread(parse_body, raw, model, self.limits.max_model_len)
        if self._pool is None:  # (started at the first large body: most servers see none)
            self._pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"),
                                             initializer=_parser_started,
                                             initargs=(os.getpid(),))
        pool = self._pool
        try:
            fields = await asyncio.get_running_loop().run_in_executor(
                pool, _parse_fields, raw, self.limits, kind)
        except BrokenProcessPool:  # the parser died (killed, out of memory, cannot start)
            if pool is self._pool:  # (every body in flight hears of one death)
                self._pool, self._deaths = None, self._deaths + 1
                log.warning("the body parser process died (%d of %d); parsing here%s",
                            self._deaths, MAX_PARSER_DEATHS,
                            "" if self._deaths < MAX_PARSER_DEATHS else " from now on")
            return await asyncio.to_thread(parse_body, raw, model, self.limits.max_model_len)
        if isinstance(fields, tuple):  # an ApiError's arguments
            raise ApiError(*fields)
        return model.model_validate(fields)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)


def _parser_started(server: int) -> None:
    """The parser process dies with the server, however it dies (it holds both ends of its
    own work queue, so it would never see the server gone, and kept the server's output
    open), and leaves the process group's signals to it."""
    die_with_parent(server)
    ignore_group_signals()


def _parse_fields(raw: bytes, limits: Limits, kind: str) -> dict | tuple:
    """In the parser process: the body's fields as set, or the arguments of its ApiError."""
    model = _models(limits)[kind]
    try:
        return parse_body(raw, model, limits.max_model_len).model_dump(mode="json",
                                                                       exclude_unset=True)
    except ApiError as e:
        return e.status, e.message, e.type, e.param, e.code


@cache
def _models(limits: Limits) -> dict[str, type[BaseModel]]:
    """The request models of each route, by kind."""
    return dict(zip(("completion", "chat", "tokenize", "detokenize"),
                    (*request_models(limits), *tokenizer_models(limits)), strict=True))


def parse_body(raw: bytes, model: type[BaseModel], max_model_len: int | None = None
               ) -> BaseModel:
    """The validated request, or ApiError(400) saying what is wrong with it (of a prompt
    beyond the window: ``max_model_len``, the window's, in it)."""
    try:
        data = pydantic_core.from_json(raw, allow_inf_nan=False)
    except ValueError as e:
        raise ApiError(400, f"the body is not valid JSON (UTF-8, no lone surrogates): {e}"
                       ) from None
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise validation_error(e.errors(), max_model_len) from None


def validation_error(errors: list, max_model_len: int | None = None) -> ApiError:
    # Too many prompts is what is wrong with a list of prompts over the bound (not their ids).
    for e in errors:
        if _prompt_list_bound(e):
            return ApiError(400, f"prompt: a list of {len(e['input'])} prompts; at most"
                            f" {e['ctx']['max_length']} per request", param="prompt")
    # A part's wrong "type" tag says what is wrong ("image_url": only text parts), whatever
    # else that part lacks. Else, of a union's alternatives, the one whose type the value has
    # says best (17 stop strings: "at most 16 items", not "should be a valid string"), then
    # the one that got furthest into the value, then the bound nearest the value (top_k
    # 3e9: "at most 2147483647", not "at most 0").
    first = max(errors, key=lambda e: (_type_tag(e), not _wrong_type(e),
                                       len(e.get("loc", ())), -_bound_distance(e)), default={})
    loc = [str(x) for x in first.get("loc", ()) if not _union_tag(x)]
    msg = str(first.get("msg", "invalid request")).removeprefix("Value error, ")
    where = ".".join(loc)
    if loc[:1] == ["logit_bias"] and first["loc"][-1] == "[key]":  # (a key may look like a tag)
        top = re.search(r"\|(\d+)\)\$", str(first.get("ctx", {}).get("pattern", "")))
        return ApiError(400, f"logit_bias: {first['loc'][-2]!r} is not a token id of this model"
                        f" (a decimal integer from 0 to"
                        f" {top.group(1) if top else 'its vocabulary size - 1'}, no leading zeros)",
                        param="logit_bias")
    if first.get("type") == "too_long" and first.get("ctx", {}).get("max_length") == 0 \
            and loc not in (["prompt"], ["messages"]):  # (those: a one-token window's)
        return ApiError(400, f"{where}: not supported (absent or empty only)", param=where)
    if loc[:1] in (["prompt"], ["messages"]) and first.get("type") in ("string_too_long",
                                                                      "too_long"):
        return _window_error(first, where, max_model_len)
    return ApiError(400, f"{where}: {msg}" if where else msg, param=where or None)


def _prompt_list_bound(error: dict) -> bool:
    """Whether the error is a list of prompts' bound on their number (a list of ids over its
    bound is a prompt too long for the window)."""
    value = error.get("input")
    return error.get("type") == "too_long" and error.get("loc", ())[:1] == ("prompt",) \
        and isinstance(value, list) and bool(value) \
        and all(isinstance(x, str | list) for x in value)


def _bound_distance(error: dict) -> float:
    """How far the value is from the bound it failed (0 where there is none)."""
    value, ctx = error.get("input"), error.get("ctx") or {}
    bound = next((ctx[k] for k in ("le", "ge", "lt", "gt") if k in ctx), None)
    if isinstance(value, int | float) and isinstance(bound, int | float):
        return abs(value - bound)
    return 0.0


def _window_error(error: dict, where: str, max_model_len: int | None) -> ApiError:
    """A prompt or messages longer than the schema's bound, which is the context window's:
    said as such, with the code clients look for (the bound itself means nothing to them)."""
    bound, value = error.get("ctx", {}).get("max_length"), error.get("input")
    size = len(value) if isinstance(value, str | list) else None
    if error["type"] == "string_too_long":
        what = f"{size} characters" if size is not None else "text"
        why = f"no text of more than {bound} characters fits in it"
    elif where == "messages":
        what, why = f"{size} messages", f"each takes a token at least (at most {bound})"
    else:
        what, why = f"{size} token ids", f"at most {bound} fit with a token to generate"
    if max_model_len is None:
        return ApiError(400, f"{where} ({what}) cannot fit in the context window: {why}",
                        param=where, code=CONTEXT_LENGTH_EXCEEDED)
    return context_length_error(max_model_len, f"{where} ({what}) cannot fit in it: {why}",
                                where)


def _wrong_type(error: dict) -> bool:
    """Whether the error says the value is not of the alternative's type at all."""
    kind = str(error.get("type", ""))
    return kind.endswith("_type") or kind in ("none_required", "literal_error",
                                              "is_instance_of", "model_attributes_type")


def _type_tag(error: dict) -> bool:
    loc = error.get("loc", ())
    return error.get("type") == "literal_error" and bool(loc) and loc[-1] == "type"


def _union_tag(part) -> bool:
    """Whether a location part names a union alternative (a type), not a field or index."""
    return isinstance(part, str) and (any(c in part for c in "[-") or part[:1].isupper()
                                      or part in ("str", "int", "float", "bool", "none"))


def too_long(num_chars: int, room: int, max_model_len: int, param: str,
             num_messages: int = 0) -> ApiError:
    plural = "s" if num_messages != 1 else ""
    what = f"{num_messages} message{plural} of {num_chars} characters (a token each at least," \
        " besides their text)" if num_messages else f"the prompt ({num_chars} characters)"
    return context_length_error(max_model_len, f"{what} cannot fit in the {room} tokens it"
                                " leaves for it", param)


class PromptTokenizer:
    def __init__(self, tokenizer: Tokenizer | None) -> None:
        self.tokenizer = tokenizer
        self.chars_per_token = chars_per_token(tokenizer) if tokenizer is not None else None
        self._pool = ThreadPoolExecutor(TOKENIZE_THREADS, thread_name_prefix="fluidserve-tok")

    def max_chars(self, room: int) -> int | None:
        """No text longer than this tokenizes to ``room`` tokens or fewer (None: unknown)."""
        return None if self.chars_per_token is None else room * self.chars_per_token

    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return await self._run(self.tokenizer.encode, text, add_special_tokens)

    async def encode_many(self, texts: list[str], add_special_tokens: bool = True
                          ) -> list[list[int]]:
        """Several texts in one job: a request of many prompts holds one tokenizing thread,
        not the queue of every other request's."""
        return await self._run(self.tokenizer.encode_many, texts, add_special_tokens)

    async def bad_words(self, words: list[str]) -> tuple[tuple[int, ...], ...]:
        """``Tokenizer.bad_words_ids``."""
        return await self._run(self.tokenizer.bad_words_ids, words)

    async def decode(self, ids: list[int]) -> str:
        return await self._run(self.tokenizer.decode, ids, False)

    async def chat(self, messages: list[dict], **options) -> list[int]:
        """``Tokenizer.chat`` (``options``: its rendering options)."""
        return await self._run(partial(self.tokenizer.chat, messages, **options))

    def token_texts(self, ids: set[int]) -> dict[int, str]:
        return {i: self.tokenizer.decode([i], skip_special_tokens=False) for i in ids}

    async def _run(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def chars_per_token(tokenizer: Tokenizer) -> int | None:
    """The most characters of input text one token can stand for, or None if there is no bound
    (a normalizer or pre-tokenizer that deletes text, unknown-token fusing, a slow tokenizer)."""
    backend = getattr(tokenizer.hf, "backend_tokenizer", None)
    if backend is None:
        return None
    spec = json.loads(backend.to_str())
    shrink = _normalizer_shrink(spec.get("normalizer"))
    model = spec.get("model") or {}
    if shrink is None or not _keeps_text(spec.get("pre_tokenizer")) or not _model_bounded(model):
        return None
    if any(t.get("lstrip") or t.get("rstrip") for t in spec.get("added_tokens", [])):
        return None  # such tokens swallow any run of whitespace beside them
    longest = max((len(t) for t in tokenizer.hf.get_vocab()), default=1)
    longest = max(longest, model.get("max_input_chars_per_word") or 0)  # WordPiece's [UNK]
    return max(1, longest) * shrink


def _normalizer_shrink(spec: dict | None) -> int | None:
    """By how much a normalizer may shorten text (None: it may delete text, no bound)."""
    if spec is None:
        return 1
    kind = spec.get("type")
    if kind == "Sequence":
        total = 1
        for sub in spec.get("normalizers", []):
            factor = _normalizer_shrink(sub)
            if factor is None:
                return None
            total *= factor
        return total
    if kind in ("NFD", "NFKD", "Lowercase", "Prepend"):
        return 1
    if kind in ("NFC", "NFKC"):
        # Composition: at most four code points into one (U+1F82 is four decomposed; no
        # decomposition, compatibility or canonical, makes text shorter).
        return 4
    if kind == "Replace":
        pattern, content = spec.get("pattern", {}).get("String"), spec.get("content", "")
        if pattern is None or not content:
            return None
        return max(1, math.ceil(len(pattern) / len(content)))
    return None


def _keeps_text(spec: dict | None) -> bool:
    """Whether a pre-tokenizer keeps every character (whitespace splitters drop them)."""
    if spec is None:
        return True
    kind = spec.get("type")
    if kind == "Sequence":
        return all(_keeps_text(s) for s in spec.get("pretokenizers", []))
    if kind in ("Split", "Punctuation"):
        return spec.get("behavior", "Isolated") != "Removed"
    return kind in ("ByteLevel", "Metaspace", "Digits", "UnicodeScripts")


def _model_bounded(model: dict) -> bool:
    kind = model.get("type")
    if kind == "BPE":
        return not model.get("fuse_unk") or bool(model.get("byte_fallback"))
    if kind == "Unigram":
        return bool(model.get("byte_fallback"))
    return kind == "WordPiece"
