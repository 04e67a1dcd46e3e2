"""OpenAI-compatible HTTP server: a thin adapter from pydantic requests to the engine stream.

Every request first passes the ``Gate`` (API key, then body size); routes parse and validate
their bodies themselves (``serve.inputs``), so the schema they publish (``serve.openapi``) is
exactly what they accept. Every error, expected or not, is an OpenAI-style JSON body.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import threading
import time
from contextlib import asynccontextmanager
from pathlib import Path

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from fluidserve import __version__
from fluidserve.config import ConfigError, EngineConfig, ServerConfig
from fluidserve.core.admission import admissible_blocks
from fluidserve.engine.core_proc import freeze_startup_heap
from fluidserve.model.builder import default_model_dir
from fluidserve.model.tokenizer import Tokenizer, check_tokenizer_files
from fluidserve.serve import handlers
from fluidserve.serve import openapi as api
from fluidserve.serve import responses as R
from fluidserve.serve.async_engine import AsyncEngine
from fluidserve.serve.gate import Gate
from fluidserve.serve.handlers import ServerState, generate
from fluidserve.serve.inputs import BodyParser, PromptTokenizer
from fluidserve.serve.metrics import ServerMetrics
from fluidserve.serve.protocol import ApiError, Limits, error_body

__all__ = ["ApiError", "DrainingServer", "ServerState", "build_app", "run_server",
           "start_engine"]

log = logging.getLogger("fluidserve.server")


def build_app(engine: AsyncEngine, config: ServerConfig, model_name: str) -> FastAPI:
    """The HTTP app around a started ``AsyncEngine`` (whose core process is ready)."""
    prompts = PromptTokenizer(engine.tokenizer)
    state = ServerState(engine, engine.metrics, config, model_name, prompts)
    info = engine.info
    model_root = str(Path(engine.config.model.model).resolve())
    if not config.served_model_name:
        state.aliases = (engine.config.model.model, model_root)
    room = info.max_model_len - 1
    bodies = BodyParser(Limits(info.max_model_len, info.vocab_size, prompts.max_chars(room),
                               config.max_waiting_requests))
    completion_model, chat_model = bodies.models["completion"], bodies.models["chat"]

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        state.closed = True
        if engine.num_unfinished:  # a stop without a drain: their clients get an error
            engine.fail_all("the server is shutting down")
        # The core reads its Shutdown between iterations: wait as long as one may take (the
        # watchdog's bound), or a healthy core is killed mid-step and the exit reads as a crash.
        engine.stop(max(10.0, engine.watchdog_timeout))
        prompts.close()
        bodies.close()

    app = FastAPI(title="fluidserve", version=__version__, lifespan=lifespan)
    app.state.fluidserve = state
    _install_error_handlers(app)
    protected = config.api_key is not None

    @app.get("/health", responses=api.other_responses(api.Health, False, {503: {
        "model": api.Health, "description": "Draining, or the engine is down."}}))
    async def health() -> Response:
        if engine.dead is not None:
            return JSONResponse({"status": "dead", "error": engine.dead}, status_code=503)
        if state.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/version", responses=api.other_responses(api.Version, False))
    async def version() -> Response:  # as vLLM's: which server, which release
        return JSONResponse({"version": __version__})

    @app.get("/metrics", response_class=Response,
             responses=api.other_responses(None, protected and config.protect_metrics))
    async def prometheus() -> Response:
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models", responses=api.other_responses(api.ModelList, protected))
    async def models() -> Response:
        return JSONResponse(R.model_list(state.model_names, state.max_model_len, model_root))

    @app.post("/v1/completions", openapi_extra=api.request_body("CompletionRequest"),
              responses=api.generate_responses(api.CompletionResponse,
                                                  api.CompletionChunk, protected))
    async def completions(request: Request) -> Response:
        body = await bodies.read(await request.body(), "completion")
        return await generate(state, body, request, chat=False)

    @app.post("/v1/chat/completions", openapi_extra=api.request_body("ChatCompletionRequest"),
              responses=api.generate_responses(api.ChatCompletionResponse,
                                                  api.ChatCompletionChunk, protected))
    async def chat(request: Request) -> Response:
        body = await bodies.read(await request.body(), "chat")
        return await generate(state, body, request, chat=True)

    @app.post("/tokenize", openapi_extra=api.request_body("TokenizeRequest"),
              responses=api.other_responses(api.TokenizeResponse, False, api.TOKENIZER_ERRORS))
    async def tokenize(request: Request) -> Response:  # as vLLM's (`vllm bench serve` asks)
        body = await bodies.read(await request.body(), "tokenize")
        return JSONResponse(await handlers.tokenize(state, body))

    @app.post("/detokenize", openapi_extra=api.request_body("DetokenizeRequest"),
              responses=api.other_responses(api.DetokenizeResponse, False, api.TOKENIZER_ERRORS))
    async def detokenize(request: Request) -> Response:
        body = await bodies.read(await request.body(), "detokenize")
        return JSONResponse(await handlers.detokenize(state, body))

    api.install_openapi(app, [completion_model, chat_model, bodies.models["tokenize"],
                              bodies.models["detokenize"]], config)
    app.add_middleware(Gate, api_key=config.api_key, protect_metrics=config.protect_metrics,
                       max_body=config.max_request_bytes)
    return app


# An ApiError's type -> the reason label of fluidserve_requests_rejected_total.
REFUSALS = {"overloaded": "overloaded", "service_unavailable": "unavailable"}


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def api_error(request: Request, e: ApiError) -> JSONResponse:
        # Every refusal is counted here, whatever refused it (the schema, a precheck, the
        # tokenized length); the gate's 401 and 413 come before the app.
        reason = REFUSALS.get(e.type, "invalid") if e.status < 500 or e.status == 503 else None
        if reason is not None:
            request.app.state.fluidserve.metrics.rejected.labels(reason).inc()
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
        # 405 answers keep their Allow header (RFC 9110).
        return JSONResponse(error_body(str(e.detail), code=e.status_code),
                            status_code=e.status_code, headers=getattr(e, "headers", None))

    @app.exception_handler(Exception)
    async def internal(_: Request, e: Exception) -> JSONResponse:
        log.error("unhandled %s: %s", type(e).__name__, e, exc_info=e)
        return JSONResponse(error_body(f"internal error: {type(e).__name__}", "internal_error",
                                       code=500), status_code=500)


# ---------------------------------------------------------------------- process entry point
class DrainingServer(uvicorn.Server):
    """A uvicorn server whose first SIGTERM/SIGINT drains in-flight requests, then exits.

    While draining, new requests get 503 and /health reports "draining"; requests still
    unfinished after ``drain_timeout`` (running, waiting, or still on their way to the engine
    core) are failed with an error their clients see. A second signal stops at once, failing
    what is unfinished the same way.
    """

    def __init__(self, config: uvicorn.Config, state: ServerState) -> None:
        super().__init__(config)
        self.state = state

    def handle_exit(self, sig, frame) -> None:
        # Never uvicorn's own handler: a second SIGINT there is a forced exit, which skips
        # the app's shutdown, so the engine core was never stopped and the process waited on
        # it for ever. A later signal ends the drain; the shutdown fails what is unfinished.
        if self.state.draining:
            if self.should_exit:  # a third: stop waiting for connections too
                self.force_exit = True
            self.should_exit = True
            return
        self.state.draining = True
        log.info(
            "signal %s: draining %d in-flight requests (up to %.0fs)",
            sig,
            self.state.engine.num_unfinished,
            self.state.config.drain_timeout,
        )
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self) -> None:
        st = self.state
        deadline = time.monotonic() + st.config.drain_timeout
        while (st.engine.num_unfinished or st.admitting) and time.monotonic() < deadline \
                and not self.should_exit:
            time.sleep(0.05)
        self.should_exit = True

    async def shutdown(self, sockets=None) -> None:
        # Before uvicorn waits for open connections: end every unfinished request with an
        # error event, so that its stream closes instead of being cut when the wait runs out.
        eng = self.state.engine
        self.state.closed = True
        if eng.num_unfinished:
            log.info("failing %d unfinished requests", eng.num_unfinished)
            eng.fail_all("the server is shutting down")
            await asyncio.sleep(0.2)  # let the streams write their error events
        await super().shutdown(sockets)


def start_engine(engine_config: EngineConfig, config: ServerConfig,
                 on_dead=None) -> tuple[AsyncEngine, str]:
    """Resolve the model, start the engine-core process and load the tokenizer here while
    the core loads the model."""
    given = engine_config.model.model
    default_name = Path(given).name if given else "fluidserve-shakespeare"
    name = config.served_model_name[0] if config.served_model_name else default_name
    model_dir = given or str(default_model_dir())
    engine_config = engine_config.replace(model=model_dir)
    tokenizer_dir = engine_config.model.tokenizer or model_dir
    check_tokenizer_files(tokenizer_dir)  # before starting anything
    engine = AsyncEngine(engine_config, lambda: Tokenizer(tokenizer_dir), ServerMetrics(name),
                         config.telemetry_file, on_dead, config.watchdog_timeout,
                         config.request_log)
    engine.start()
    return engine, name


def listen_socket(host: str, port: int) -> socket.socket:
    """The server's socket, bound: a port in use is an error before anything loads. A TCP
    socket by protocol too: asyncio turns Nagle's algorithm off (TCP_NODELAY) only on
    connections whose socket says so, and with it on, each small SSE write waited for the
    client's delayed ACK (~40 ms to the first event of a stream, later tokens in bursts)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET,
                         socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise ConfigError(f"cannot listen on {host}:{port}: {e.strerror}") from None
    return sock


def run_server(engine_config: EngineConfig, config: ServerConfig) -> int:
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    t0 = time.perf_counter()
    holder: dict = {}
    sock = listen_socket(config.host, config.port)  # before the model loads, not after

    def on_dead(message: str) -> None:  # the engine core died: stop, and exit non-zero
        holder["failed"] = message
        if "server" in holder:
            holder["server"].should_exit = True

    try:
        engine, name = start_engine(engine_config, config, on_dead)
    except RuntimeError as e:
        log.error("%s", e)
        return 1
    try:  # whatever fails from here on, the engine core stops with it
        app = build_app(engine, config, name)
        info = engine.info
        log.info(
            "model %s ready in %.1fs (engine core: %.1fs): %d KV blocks of %d tokens%s,"
            " max_model_len %d, scheduler %s (token budget %s)%s",
            name,
            time.perf_counter() - t0,
            info.load_seconds,
            info.num_kv_blocks,
            info.block_size,
            " per instance" if engine_config.disagg.disaggregate else "",
            info.max_model_len,
            engine_config.scheduler.policy,
            engine_config.scheduler.token_budget,
            ", asynchronous scheduling" if engine_config.uses_async_scheduling() else "",
        )
        tok = engine.tokenizer
        if tok is not None and info.vocab_size and len(tok) > info.vocab_size:
            log.warning("the tokenizer has %d tokens, the model a vocabulary of %d: prompts"
                        " whose text tokenizes past it are refused (400)", len(tok),
                        info.vocab_size)
        if tok is not None and not tok.has_chat_template:
            log.warning("the tokenizer has no chat template: /v1/chat/completions renders"
                        " conversations as plain 'role: content' lines, which the model may"
                        " not have been trained on")
        held = info.block_size * admissible_blocks(info.num_kv_blocks,
                                                   engine_config.cache.watermark)
        if held < info.max_model_len:
            log.warning("the KV cache holds %d tokens of one request, less than the %d-token"
                        " context window: longer requests are refused (400), and a chat request"
                        " without max_tokens gets at most what the cache holds", held,
                        info.max_model_len)
        uv = uvicorn.Config(
            app,
            host=config.host,
            port=config.port,
            log_level="info",
            access_log=config.log_requests,
            timeout_graceful_shutdown=int(config.drain_timeout) + 5,
        )
        # Outside uvicorn's run a signal goes to the same drain: one before it (while the
        # server starts) is kept for it, one after (while the engine core stops) must not cut
        # that short.
        def on_signal(sig, frame) -> None:
            if "server" in holder:
                holder["server"].handle_exit(sig, frame)
            else:
                holder.setdefault("signals", []).append(sig)

        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, on_signal)
        host = f"[{config.host}]" if ":" in config.host else config.host
        log.info("serving on http://%s:%d (Ctrl-C drains, twice stops)", host, config.port)
        server = DrainingServer(uv, app.state.fluidserve)
        holder["server"] = server
        for sig in holder.pop("signals", []):
            server.handle_exit(sig, None)
        freeze_startup_heap()  # the front end's full collections would pause every stream
        server.run(sockets=[sock])
    finally:
        if not engine.stopped:  # a forced exit skips the app's shutdown, which stops it
            engine.stop(5.0)
    if "failed" in holder:
        log.error("exiting: %s", holder["failed"])
        return 1
    return 0
