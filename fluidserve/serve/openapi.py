"""The published schema (``/openapi.json``): request models with this model's bounds, every
status each route can return with its body, and the API key where one is required."""

from __future__ import annotations

from typing import Literal

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from fluidserve.config import ServerConfig


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | int | None


class ErrorResponse(BaseModel):
    error: ErrorDetail


class PromptTokensDetails(BaseModel):
    cached_tokens: int


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    # With --enable-prefix-caching: the prompt tokens found cached (as vLLM reports them).
    prompt_tokens_details: PromptTokensDetails | None = None


class ServerMetricsOut(BaseModel):
    scheduling_delay: float | None


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    # (null: an echoed prompt's first token, which nothing predicts)
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class PromptLogprob(BaseModel):
    logprob: float
    rank: int
    decoded_token: str


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: Literal["stop", "length"] | None
    # vLLM's: the stop string, or the one of stop_token_ids, that ended it (else null)
    stop_reason: int | str | None = None
    # only with return_token_ids (vLLM's): its token ids, and its prompt's
    token_ids: list[int] | None = None
    prompt_token_ids: list[int] | None = None
    # only with prompt_logprobs (vLLM's): null for the first prompt token
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage
    metrics: ServerMetricsOut | None = None  # only with return_metrics=true


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: Literal["stop", "length"] | None
    # vLLM's: the stop string, or the one of stop_token_ids, that ended it (else null)
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None  # only with return_token_ids (vLLM's)


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    metrics: ServerMetricsOut | None = None
    # only with prompt_logprobs (vLLM's): null for the rendered prompt's first token
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None
    prompt_token_ids: list[int] | None = None  # only with return_token_ids (vLLM's)


class CompletionStreamChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: Literal["stop", "length"] | None
    # vLLM's: the stop string, or the one of stop_token_ids, that ended it (else null)
    stop_reason: int | str | None = None
    # only with return_token_ids (vLLM's): the chunk's new token ids, and in each choice's
    # first chunk its prompt's
    token_ids: list[int] | None = None
    prompt_token_ids: list[int] | None = None
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None  # (first chunk)


class CompletionChunk(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionStreamChoice]  # empty in the final usage chunk
    usage: Usage | None = None
    metrics: ServerMetricsOut | None = None


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatStreamChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None
    finish_reason: Literal["stop", "length"] | None
    # vLLM's: the stop string, or the one of stop_token_ids, that ended it (else null)
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None  # only with return_token_ids: the chunk's new ones


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: Usage | None = None
    metrics: ServerMetricsOut | None = None
    # only with return_token_ids (vLLM's), in each choice's first chunk: the prompt's
    prompt_token_ids: list[int] | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int
    root: str | None = None


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class Health(BaseModel):
    status: Literal["ok", "draining", "dead"]
    error: str | None = None


class Version(BaseModel):
    version: str


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(BaseModel):
    prompt: str


def _error(description: str) -> dict:
    return {"model": ErrorResponse, "description": description}


def stream(chunk: type[BaseModel]) -> dict:
    """One server-sent event: a JSON chunk per token, an error if the request fails, [DONE]."""
    payload = {"anyOf": [{"$ref": f"#/components/schemas/{chunk.__name__}"},
                         {"$ref": "#/components/schemas/ErrorResponse"}]}
    event = {"type": "object", "required": ["data"], "properties": {
        "event": {"type": "string"},
        "data": {"anyOf": [{"const": "[DONE]"}, {
            "type": "string", "contentMediaType": "application/json", "contentSchema": payload}]},
    }}
    return {"text/event-stream": {"schema": event}}


EVERY_ROUTE = {
    413: _error("The request body exceeds --max-request-bytes (checked before it is read)."),
    500: _error("An internal error."),
}
AUTH = {401: _error("Missing or invalid API key (checked before anything else).")}


TOKENIZER_ERRORS = {
    400: _error("Invalid request: malformed JSON, a value outside the schema, neither or both"
                " of prompt and messages, or a model without a tokenizer."),
    404: _error("The model named is not this server's."),
}


def generate_responses(response_model: type[BaseModel], chunk: type[BaseModel],
                       protected: bool) -> dict:
    return {
        200: {"model": response_model, "content": stream(chunk),
              "description": "The completion (JSON), or its stream (server-sent events)."},
        400: _error("Invalid request: malformed JSON, a value outside the schema, a prompt"
                    " that does not fit the context window (code context_length_exceeded),"
                    " min_tokens above the max_tokens in force (param min_tokens), or more"
                    " choices (prompts × n) than the server lets wait (param n)."),
        **(AUTH if protected else {}),
        404: _error("The model named is not the one this server serves."),
        **EVERY_ROUTE,
        499: {"description": "The client closed the connection before the response was ready"
                             " (logged; nobody receives it)."},
        503: _error("Overloaded (too many requests waiting), shutting down, or the engine is"
                    " down."),
    }


def other_responses(response_model: type[BaseModel] | None, protected: bool,
                    extra: dict | None = None) -> dict:
    ok = {"model": response_model} if response_model else {
        "content": {"text/plain": {"schema": {"type": "string"}}}}
    return {200: ok | {"description": "OK"}, **(AUTH if protected else {}), **EVERY_ROUTE,
            **(extra or {})}


def request_body(name: str) -> dict:
    ref = {"$ref": f"#/components/schemas/{name}"}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": ref}}}}


# Constraints between fields, stated the way JSON Schema can (the server enforces the same).
CROSS_FIELD = {  # field: (the field it needs, at this value, the values of it that need it)
    "stream_options": ("stream", True, {"type": "object", "anyOf": [  # (unknown keys ask
        {"required": ["include_usage"]}, {"required": ["continuous_usage_stats"]}]}),  # none)
    "top_logprobs": ("logprobs", True, {"type": "integer", "minimum": 1}),
    "continue_final_message": ("add_generation_prompt", False, {"const": True}),
    "max_tokens": ("echo", True, {"const": 0}),
}


# A model's own: (field, the values of it that forbid the other, the other, its value then
# forbidden)
FORBIDS = {"ChatCompletionRequest": [
    ("prompt_logprobs", {"type": "integer", "minimum": 1}, "stream", True)]}


def _cross_field(schema: dict, name: str) -> None:
    rules = []
    for field, (needs, value, values) in CROSS_FIELD.items():
        if field in schema["properties"] and needs in schema["properties"]:
            present = {"properties": {field: values}, "required": [field]}
            rules.append({"if": present, "then": {"properties": {needs: {"const": value}},
                                                  "required": [needs]}})
    for field, values, other, value in FORBIDS.get(name, ()):
        present = {"properties": {field: values}, "required": [field]}
        rules.append({"if": present, "then": {"properties": {other: {"not": {
            "const": value}}}}})
    if rules:
        schema["allOf"] = rules


def install_openapi(app: FastAPI, request_models: list[type[BaseModel]],
                    config: ServerConfig) -> None:
    """Serve a schema that includes the request models (parsed by the routes themselves)."""

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            models = [(m, "validation") for m in request_models]
            models += [(m, "serialization") for m in (CompletionChunk, ChatCompletionChunk,
                                                      ErrorResponse)]
            _, defs = models_json_schema(models, ref_template="#/components/schemas/{model}")
            comps = schema.setdefault("components", {}).setdefault("schemas", {})
            comps.update(defs["$defs"])
            for m in request_models:
                _cross_field(comps[m.__name__], m.__name__)
            if config.api_key is not None:
                _require_key(schema, config.protect_metrics)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi


def _require_key(schema: dict, protect_metrics: bool) -> None:
    schema["components"]["securitySchemes"] = {"apiKey": {"type": "http", "scheme": "bearer"}}
    for path, ops in schema["paths"].items():
        if path.startswith("/v1/") or (protect_metrics and path == "/metrics"):
            for op in ops.values():
                op["security"] = [{"apiKey": []}]
