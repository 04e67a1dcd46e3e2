"""OpenAI-compatible HTTP server: a thin adapter from pydantic requests to the engine stream."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import signal
import threading
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from fluidserve.config import EngineConfig, ServerConfig
from fluidserve.core.admission import admissible_blocks, admission_error
from fluidserve.model.builder import DEFAULT_SHAPE, cached_model_dir
from fluidserve.model.tokenizer import Tokenizer
from fluidserve.serve import responses as R
from fluidserve.serve.async_engine import AsyncEngine
from fluidserve.serve.gate import Gate
from fluidserve.serve.metrics import ServerMetrics
from fluidserve.serve.protocol import ChatCompletionRequest, CompletionRequest, error_body

log = logging.getLogger("fluidserve.server")


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        param: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param = status, message, type_, param


@dataclass
class ServerState:
    engine: AsyncEngine
    metrics: ServerMetrics
    config: ServerConfig
    model_name: str
    draining: bool = False

    @property
    def max_model_len(self) -> int:
        return self.engine.info.max_model_len


def build_app(engine: AsyncEngine, config: ServerConfig, model_name: str) -> FastAPI:
    """The HTTP app around a started ``AsyncEngine`` (whose core process is ready)."""
    metrics = engine.metrics
    state = ServerState(engine, metrics, config, model_name)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        engine.stop()

    app = FastAPI(title="fluidserve", lifespan=lifespan)
    app.state.fluidserve = state
    _install_error_handlers(app)

    @app.get("/health")
    async def health() -> Response:
        if engine.dead is not None:
            return JSONResponse({"status": "dead", "error": engine.dead}, status_code=503)
        if state.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models() -> dict:
        return R.model_list(model_name, state.max_model_len)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        ids = await _prompt_ids(state, body.prompt)
        return await _serve(state, body, ids, request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request) -> Response:
        if engine.tokenizer is None:
            raise ApiError(400, "this model has no tokenizer, so chat is unavailable")
        try:
            messages = [{"role": m.role, "content": m.text()} for m in body.messages]
            ids = await asyncio.to_thread(engine.tokenizer.chat, messages)
        except ValueError as e:
            raise ApiError(400, str(e), param="messages") from None
        return await _serve(state, body, ids, request, chat=True)

    app.add_middleware(Gate, api_key=config.api_key, protect_metrics=config.protect_metrics,
                       max_body=config.max_request_bytes)
    return app


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def api_error(_: Request, e: ApiError) -> JSONResponse:
        return JSONResponse(error_body(e.message, e.type, e.param, e.status), status_code=e.status)

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, e: RequestValidationError) -> JSONResponse:
        errs = e.errors()
        first = errs[0] if errs else {}
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        msg = first.get("msg", "invalid request").removeprefix("Value error, ")
        where = ".".join(loc)
        text = f"{where}: {msg}" if where else msg
        return JSONResponse(error_body(text, param=where or None, code=400), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(
            error_body(str(e.detail), code=e.status_code), status_code=e.status_code
        )


async def _prompt_ids(state: ServerState, prompt: str | list[int]) -> list[int]:
    tok = state.engine.tokenizer
    if isinstance(prompt, str):
        if tok is None:
            raise ApiError(400, "this model has no tokenizer: send token ids", param="prompt")
        return await asyncio.to_thread(tok.encode, prompt)  # never on the event loop
    vocab = state.engine.info.vocab_size
    if vocab is not None and any(not 0 <= t < vocab for t in prompt):
        raise ApiError(400, f"prompt token ids must be in [0, {vocab})", param="prompt")
    return list(prompt)


async def _serve(state: ServerState, body, ids: list[int], request: Request, chat: bool):
    if body.model is not None and body.model != state.model_name:
        raise ApiError(
            404,
            f"model {body.model!r} does not exist; this server serves {state.model_name!r}",
            "not_found_error",
            "model",
        )
    if state.draining:
        raise ApiError(503, "the server is shutting down", "service_unavailable")
    if state.engine.dead is not None:
        raise ApiError(503, f"the engine is down: {state.engine.dead}", "service_unavailable")
    waiting = state.engine.num_waiting
    if waiting >= state.config.max_waiting_requests:
        state.metrics.rejected.labels("overloaded").inc()
        raise ApiError(
            503,
            f"server overloaded: {waiting} requests waiting (limit"
            f" {state.config.max_waiting_requests}); retry later",
            "overloaded",
        )
    max_len = state.max_model_len
    if not ids:
        raise ApiError(400, "the prompt is empty", param="prompt")
    room = max_len - len(ids)
    max_tokens = (
        body.max_tokens if body.max_tokens is not None else (min(16, room) if not chat else room)
    )
    if room < 1 or len(ids) + max_tokens > max_len:
        raise ApiError(
            400,
            f"this model's context window is {max_len} tokens; the prompt has"
            f" {len(ids)} and max_tokens is {max_tokens}",
            param="max_tokens",
        )
    info = state.engine.info
    why = admission_error(len(ids), max_tokens, max_len, info.block_size,
                          admissible_blocks(info.num_kv_blocks, state.engine.config.watermark))
    if why is not None:
        state.metrics.rejected.labels("invalid").inc()
        raise ApiError(400, why)
    logprobs = body.num_logprobs if chat else body.logprobs
    try:
        params = body.sampling_params(max_tokens, logprobs)
    except ValueError as e:
        raise ApiError(400, str(e)) from None
    rid = R.new_id("chatcmpl" if chat else "cmpl")
    try:
        handle = state.engine.add(rid, ids, params)
    except RuntimeError as e:  # the engine core died meanwhile
        raise ApiError(503, f"the engine is down: {e}", "service_unavailable") from None
    ctx = R.Context(rid, state.model_name, R.now(), len(ids), chat, state.engine.tokenizer)
    if body.stream:
        return StreamingResponse(
            _sse(handle, ctx, body), media_type="text/event-stream"
        )
    return await _complete(handle, ctx, request, body)


async def _sse(handle, ctx: R.Context, body) -> AsyncIterator[str]:
    def emit(chunk: dict, out=None) -> str:
        if body.continuous_usage:
            chunk["usage"] = R.usage(ctx.prompt_tokens, len(ctx.token_ids))
        if out is not None and out.finished and body.return_metrics:
            chunk["metrics"] = {"scheduling_delay": out.scheduling_delay}
        return _data(chunk)

    if ctx.chat:
        yield emit(R.chat_chunk(ctx, {"role": "assistant", "content": ""}, None))
    try:
        async for out in handle:
            if out.error is not None:
                yield _data(error_body(out.error, "internal_error", code=500))
                break
            ctx.add(out)
            # One chunk per token, even when its text is held back (a partial character or
            # a possible stop string), so clients can time every token.
            yield emit(R.stream_chunk(ctx, out), out)
    except Exception as e:  # never leave a client with a silently truncated stream
        log.exception("stream %s failed", ctx.id)
        handle.abort()
        yield _data(error_body(f"internal error: {e}", "internal_error", code=500))
    if body.include_usage and handle.finished and ctx.finish_reason is not None:
        yield _data(R.usage_chunk(ctx))
    yield "data: [DONE]\n\n"


async def _complete(handle, ctx: R.Context, request: Request, body) -> Response:
    async def consume():
        async for out in handle:
            if out.error is not None:
                return out
            ctx.add(out)
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
        return JSONResponse(error_body(failed.error, "internal_error", code=500), status_code=500)
    resp = R.full_response(ctx)
    if body.return_metrics:
        resp["metrics"] = {"scheduling_delay": ctx.scheduling_delay}
    return JSONResponse(resp)


def _data(obj: dict) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


# ---------------------------------------------------------------------- process entry point
class DrainingServer(uvicorn.Server):
    """A uvicorn server whose first SIGTERM/SIGINT drains in-flight requests, then exits.

    While draining, new requests get 503 and /health reports "draining"; requests still
    running after ``drain_timeout`` are failed with an error their clients see.
    """

    def __init__(self, config: uvicorn.Config, state: ServerState) -> None:
        super().__init__(config)
        self.state = state

    def handle_exit(self, sig, frame) -> None:
        if self.state.draining:  # a second signal: stop now
            return super().handle_exit(sig, frame)
        self.state.draining = True
        log.info(
            "signal %s: draining %d in-flight requests (up to %.0fs)",
            sig,
            self.state.engine.num_unfinished,
            self.state.config.drain_timeout,
        )
        threading.Thread(target=self._drain, args=(sig, frame), daemon=True).start()

    def _drain(self, sig, frame) -> None:
        eng = self.state.engine
        deadline = time.monotonic() + self.state.config.drain_timeout
        while eng.num_unfinished and time.monotonic() < deadline:
            time.sleep(0.05)
        if eng.num_unfinished:
            eng.fail_all("the server is shutting down")
            time.sleep(0.5)  # let the failed streams deliver their error events
        super().handle_exit(sig, frame)


def start_engine(engine_config: EngineConfig, config: ServerConfig,
                 on_dead=None) -> tuple[AsyncEngine, str]:
    """Resolve the model, load its tokenizer here and start the engine-core process."""
    given = engine_config.model
    default_name = Path(given).name if given else f"fluidserve-{DEFAULT_SHAPE}"
    name = config.served_model_name or default_name
    model_dir = given or str(cached_model_dir())
    engine_config = dataclasses.replace(engine_config, model=model_dir)
    tokenizer = Tokenizer(engine_config.tokenizer or model_dir)
    engine = AsyncEngine(engine_config, tokenizer, ServerMetrics(), config.telemetry_file,
                         on_dead, config.watchdog_timeout)
    engine.start()
    return engine, name


def run_server(engine_config: EngineConfig, config: ServerConfig) -> int:
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    t0 = time.perf_counter()
    holder: dict = {}

    def on_dead(message: str) -> None:  # the engine core died: stop, and exit non-zero
        holder["failed"] = message
        if "server" in holder:
            holder["server"].should_exit = True

    try:
        engine, name = start_engine(engine_config, config, on_dead)
    except RuntimeError as e:
        log.error("%s", e)
        return 1
    app = build_app(engine, config, name)
    info = engine.info
    log.info(
        "model %s ready in %.1fs (engine core: %.1fs): %d KV blocks of %d tokens,"
        " max_model_len %d, scheduler %s (token budget %d)",
        name,
        time.perf_counter() - t0,
        info.load_seconds,
        info.num_kv_blocks,
        info.block_size,
        info.max_model_len,
        engine_config.scheduler,
        engine_config.token_budget,
    )
    uv = uvicorn.Config(
        app,
        host=config.host,
        port=config.port,
        log_level="info",
        access_log=config.log_requests,
        timeout_graceful_shutdown=int(config.drain_timeout) + 5,
    )
    # uvicorn re-raises the signal it caught once it has shut down; after a drain that is
    # a clean exit, so the re-raised signal must not kill the process.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    server = DrainingServer(uv, app.state.fluidserve)
    holder["server"] = server
    server.run()
    if "failed" in holder:
        log.error("exiting: %s", holder["failed"])
        return 1
    return 0
