"""OpenAI API request models (pydantic), error bodies and the helpers responses share.

The models are the published schema (``/openapi.json``) and the server's validation at once:
every constraint the server enforces on a request's shape is a JSON-schema constraint here, so a
request that matches the schema is accepted unless it fails a check no schema can express (its
prompt, once tokenized, does not fit the context window: HTTP 400 with code
``context_length_exceeded``). Bounds that depend on the model (context window, vocabulary) are
filled in by ``request_models`` when the server starts.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    WithJsonSchema,
    create_model,
)

from fluidserve.sampling_params import (
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    MAX_REPETITION_PENALTY,
    MIN_REPETITION_PENALTY,
    SamplingParams,
)

MAX_STOP = 16
MAX_STOP_TOKEN_IDS = 1024
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
INT32_MAX = 2**31 - 1
CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
MAX_N = 128  # samples per prompt (OpenAI's bound)
MAX_PROMPTS = 1024  # prompts in one completion request

def _integral(value):
    """JSON Schema's integers include 3.0: take it as 3 (strict mode still refuses 3.5, "3"
    and true)."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


def Int(**bounds) -> Any:  # noqa: N802 - a type
    return Annotated[int, Field(**bounds), BeforeValidator(_integral)]


Int64 = Int(ge=INT64_MIN, le=INT64_MAX)
StopString = Annotated[str, Field(min_length=1)]
MAX_BAD_WORDS = 256
# More than spaces: a character other than Python's whitespace (str.isspace), spelled out,
# since the \s of ECMA-262 (a client checking the schema) and of the server's regex differ.
BadWord = Annotated[str, Field(max_length=1024, pattern=(
    r"[^\t-\r\x1c-\x20\x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000]"))]


def _only(value, allowed):
    if value != allowed:
        raise ValueError(f"only {json.dumps(allowed)} is supported")
    return value


def Only(kind: type, allowed: Any, json_type: str) -> Any:  # noqa: N802 - a type
    """A parameter of the OpenAI or vLLM API that this server accepts at its neutral value
    only (the one that leaves the output as it would be without it); any other value is a
    400, never silently ignored."""
    return Annotated[kind, AfterValidator(lambda v: _only(v, allowed)),
                     WithJsonSchema({"type": json_type, "const": allowed})]


def _null(value):
    if value is not None:
        raise ValueError("not supported by this server (only null)")
    return value


OnlyFalse = Only(bool, False, "boolean")
OnlyTrue = Only(bool, True, "boolean")
# Literal[1] would take true and Literal[False] would take 0 (they compare equal in Python).
One = Annotated[Only(int, 1, "integer"), BeforeValidator(_integral)]
# A parameter this server does not implement, whose presence would change the output
# (structured output, tool calls, other sampling rules): null or absent, else a 400.
Unsupported = Annotated[Any, AfterValidator(_null), WithJsonSchema({"type": "null"})]
NOT_SUPPORTED = "Not supported: must be null or absent."
NoItems = Annotated[list[Any], Field(max_length=0)]


Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]
ALLOWED_TOKEN_IDS = ("Only these token ids may be sampled, greedy too (vLLM's; applied before"
                     " logit_bias and the penalties).")
MAX_LOGIT_BIAS_TOKENS = 300  # (OpenAI's bound)


def id_pattern(top: int | None) -> str:
    """A regular expression for the decimal integers 0..top (any if None), no leading zeros:
    a token id as a JSON object's key, which JSON Schema can bound only by its pattern."""
    if top is None:
        return "^(0|[1-9][0-9]*)$"
    def any_digits(n: int) -> str:
        return "" if n == 0 else "[0-9]" if n == 1 else f"[0-9]{{{n}}}"

    digits = str(top)
    alts = ["0"] if top > 0 else []  # (the top itself is the last alternative)
    alts += ["[1-9]" + any_digits(n - 1) for n in range(1, len(digits))]  # fewer digits
    for i, d in enumerate(map(int, digits)):  # top's first i digits, then a smaller one
        low = 1 if i == 0 else 0
        if d > low:
            alts.append(digits[:i] + (f"[{low}-{d - 1}]" if d - 1 > low else str(low))
                        + any_digits(len(digits) - i - 1))
    alts.append(digits)
    return f"^({'|'.join(alts)})$"


def _few_biases(value):
    # Before its entries are checked: a 300k-entry map is one error, not 300k.
    if isinstance(value, dict) and len(value) > MAX_LOGIT_BIAS_TOKENS:
        raise ValueError(f"at most {MAX_LOGIT_BIAS_TOKENS} tokens, got {len(value)}")
    return value


def LogitBias(top_id: int | None) -> Any:  # noqa: N802 - a type
    """``logit_bias``: token ids up to ``top_id`` to biases."""
    pattern = id_pattern(top_id)
    bias = Annotated[float, Field(ge=-MAX_LOGIT_BIAS, le=MAX_LOGIT_BIAS)]
    return Annotated[dict[Annotated[str, Field(pattern=pattern)], bias],
                     BeforeValidator(_few_biases),
                     WithJsonSchema({"type": "object", "maxProperties": MAX_LOGIT_BIAS_TOKENS,
                                     "propertyNames": {"pattern": pattern},
                                     "additionalProperties": {
                                         "type": "number", "minimum": -MAX_LOGIT_BIAS,
                                         "maximum": MAX_LOGIT_BIAS}})]


class ApiError(Exception):
    """An error the client sees as an OpenAI-style body with this status."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | int | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param = status, message, type_, param
        self.code = status if code is None else code

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False  # vLLM extension: usage in every chunk


class TextFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    type: Only(str, "text", "string")


class _Common(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    model: str | None = None
    max_tokens: Int(ge=1) | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Int(ge=-1, le=0) | Int(ge=1, le=INT32_MAX) | None = Field(
        None, description="-1 or 0 (as in vLLM): every token.")
    min_tokens: Int(ge=0, le=INT64_MAX) = Field(
        0, description="The first min_tokens output tokens cannot stop the request: neither"
        " EOS nor stop_token_ids are sampled there, and no stop string ends in their text. At"
        " most the max_tokens in force: the one given, else the default (16 for completions;"
        " for chat, what the context window leaves after the prompt). Above it, 400 with"
        " param min_tokens.")
    seed: Int64 | None = None
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP)] | None = None
    stop_token_ids: Annotated[list[Int64], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = Field(
        None, description="Tokens that end the request: each counts in the usage, its text is"
        " not part of the output.")
    n: Int(ge=1, le=MAX_N) | None = Field(
        None, description="Samples per prompt, each a choice of its own. With a seed, sample i"
        " is drawn with seed + i (as vLLM draws them). Prompts × n may not exceed the"
        " requests the server lets wait (--max-waiting-requests): above it, 400 with param n.")
    stream: bool | None = False
    stream_options: StreamOptions | None = Field(
        None, description="Only with stream=true.")
    ignore_eos: bool = False
    user: str | None = None
    presence_penalty: Penalty | None = Field(
        None, description="Subtracted from the logit of every token already in the output"
        " (0: off).")
    frequency_penalty: Penalty | None = Field(
        None, description="Times a token's count in the output so far, subtracted from its"
        " logit (0: off).")
    repetition_penalty: Annotated[float, Field(ge=MIN_REPETITION_PENALTY,
                                               le=MAX_REPETITION_PENALTY)] | None = Field(
        None, description="vLLM's (CTRL's): the logit of every token in the prompt or the"
        " output is divided by it if positive, else multiplied by it (1: off).")
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = Field(
        None, description="After the temperature, tokens less likely than min_p times the most"
        " likely one are not sampled (0: off).")
    allowed_token_ids: Annotated[list[Int(ge=0)], Field(min_length=1, fail_fast=True)] \
        | None = Field(None, description=ALLOWED_TOKEN_IDS)
    include_stop_str_in_output: bool | None = Field(
        None, description="The stop string (or stop token's text) that ended the output, at"
        " its end (default: left out).")
    skip_special_tokens: bool | None = Field(
        None, description="Leave special tokens' text (EOS, a chat template's markers) out of"
        " the output (default: true).")
    logit_bias: LogitBias(None) | None = Field(
        None, description=f"Token id (a string) -> a number in [-{MAX_LOGIT_BIAS:g},"
        f" {MAX_LOGIT_BIAS:g}] added to its logit before any penalty, greedy too; at most"
        f" {MAX_LOGIT_BIAS_TOKENS} tokens.")
    return_metrics: bool = False  # fluidserve extension: server-side timings in the response
    # Parameters of the OpenAI API and vLLM's extensions that this server does not implement:
    # only their neutral values are accepted, so a client never gets output made under other
    # rules than it asked for.
    response_format: TextFormat | None = Field(
        None, description='Only {"type": "text"}: no JSON mode or JSON schema.')
    use_beam_search: OnlyFalse | None = Field(None, description="Only false is supported.")
    prompt_logprobs: Unsupported = Field(None, description=NOT_SUPPORTED)
    guided_json: Unsupported = Field(None, description=NOT_SUPPORTED)
    guided_regex: Unsupported = Field(None, description=NOT_SUPPORTED)
    guided_choice: Unsupported = Field(None, description=NOT_SUPPORTED)
    guided_grammar: Unsupported = Field(None, description=NOT_SUPPORTED)
    structured_outputs: Unsupported = Field(None, description=NOT_SUPPORTED)
    bad_words: Annotated[list[BadWord], Field(max_length=MAX_BAD_WORDS)] | None = Field(
        None, description="Words the output may not contain (vLLM's): each word, its leading"
        " spaces dropped, is tokenized as it is and after a space, and the last token of each"
        " sequence is never sampled right after the others (a one-token word never), unless"
        " it is the last of allowed_token_ids left. Matched against the output only.")
    truncate_prompt_tokens: Unsupported = Field(None, description=NOT_SUPPORTED)
    return_tokens_as_token_ids: bool | None = Field(
        None, description="Logprobs' tokens as 'token_id:{id}' strings, not their text.")
    return_token_ids: bool | None = Field(
        None, description="vLLM's: each choice's token_ids, and the prompt's"
        " prompt_token_ids (completions: in each choice; chat: in the response). Streamed:"
        " each chunk's new token ids, and the prompt's in each choice's first chunk.")
    logits_processors: Unsupported = Field(None, description=NOT_SUPPORTED)
    prompt_embeds: Unsupported = Field(None, description=NOT_SUPPORTED)

    @property
    def prompt_k(self) -> int | None:
        """Top entries of each prompt token's logprobs to compute (None: none computed)."""
        return None

    def sampling_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=-1 if self.top_k is None or self.top_k <= 0 else self.top_k,
            seed=self.seed,
            stop=tuple(self.stop_strings),
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            min_tokens=self.min_tokens,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None
            else self.repetition_penalty,
            min_p=self.min_p or 0.0,
            logit_bias={int(t): b for t, b in (self.logit_bias or {}).items()},
            prompt_logprobs=self.prompt_k,
            allowed_token_ids=None if self.allowed_token_ids is None
            else tuple(self.allowed_token_ids),
            skip_special_tokens=self.skip_special_tokens is not False,
            include_stop_str_in_output=bool(self.include_stop_str_in_output),
        )

    @property
    def num_samples(self) -> int:
        return self.n or 1

    @property
    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else (self.stop or [])

    @property
    def streaming(self) -> bool:
        return bool(self.stream)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """Usage in every chunk: only along with the final usage chunk, as in vLLM."""
        return self.include_usage and bool(self.stream_options.continuous_usage_stats)


class CompletionRequest(_Common):
    prompt: str | list[int] | list[str] | list[list[int]] = Field(
        description="Text, or token ids, or a list of texts or of lists of token ids: one"
        f" prompt each (at most {MAX_PROMPTS}, and at most the requests the server lets"
        " wait), whose n choices come in the order of the"
        " prompts (choice index = prompt index × n + sample index). Each must fit the context"
        " window once tokenized (else 400 context_length_exceeded).")
    logprobs: Annotated[Int(ge=0, le=MAX_LOGPROBS) | bool | None, AfterValidator(
        lambda v: (1 if v else None) if isinstance(v, bool) else v)] = Field(
        None, description="Top entries per token (with each token's own logprob); true, as"
        " chat clients send it, is 1 (as vLLM takes it), false none.")
    max_tokens: Int(ge=0) | None = Field(
        None, description="0 only with echo: the prompt (and its logprobs) alone, nothing"
        " generated (as vLLM's).")
    prompt_logprobs: Int(ge=0, le=MAX_LOGPROBS) | None = Field(
        None, description="vLLM's: each choice's prompt_logprobs, null for the first prompt"
        " token, then for each the logprob, rank (1 + the tokens more likely) and text of"
        " the prompt token and of the prompt_logprobs most likely ones; streamed, in each"
        " choice's first chunk.")
    echo: bool | None = Field(
        False, description="The prompt before the completion, in the text and, with"
        " logprobs, in the logprobs too: each prompt token's logprob given the tokens before"
        " it (the first has none: null), as OpenAI returns them. Computed by the prefill, so"
        " never from a cached prefix.")
    best_of: One | None = Field(
        None, description="Only 1, whatever n (as vLLM: no sample is generated but those"
        " returned; some clients send best_of 1 beside n).")
    suffix: Annotated[str, Field(max_length=0)] | None = Field(
        None, description="Not supported: must be empty.")
    add_special_tokens: bool | None = Field(
        None, description="A text prompt gets the tokenizer's special tokens (BOS): true by"
        " default.")

    @property
    def prompt_k(self) -> int | None:
        asked = [k for k in (self.logprobs if self.echo else None, self.prompt_logprobs)
                 if k is not None]
        return max(asked) if asked else None

    @property
    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        return p if isinstance(p, list) and p and isinstance(p[0], (str, list)) else [p]


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    # Any name the chat template may know, as vLLM passes it on (Llama 3.1's "ipython",
    # the legacy "function"): a template that does not know it fails, a 400 that says so.
    role: Annotated[str, Field(pattern=r"^[A-Za-z_][A-Za-z0-9_-]{0,63}$", description=(
        "system, user, assistant, developer, tool, or any other role the model's chat"
        " template renders (a name of letters, digits, _ and -, at most 64)."))]
    content: str | list[TextPart] | None = None
    # The template sees role and text only: an earlier turn's tool calls would vanish from
    # the prompt, so a history that holds any is refused rather than rendered without them.
    tool_calls: NoItems | None = Field(None, description="Not supported: must be empty.")
    function_call: Unsupported = Field(None, description=NOT_SUPPORTED)

    def text(self) -> str:
        if isinstance(self.content, list):  # parts on lines of their own, as vLLM joins them
            return "\n".join(p.text for p in self.content)
        return self.content or ""


# The names a template variable may not have (``tokenizer.chat_template_parameters`` finds
# them in the installed transformers; a test holds this list to it).
RESERVED_TEMPLATE_NAMES = frozenset({
    "add_generation_prompt", "chat_template", "continue_final_message", "conversation",
    "conversations", "documents", "max_length", "messages", "padding",
    "return_assistant_tokens_mask", "return_dict", "return_tensors", "sanitize_control_tokens",
    "self", "tokenize", "tokenizer_kwargs", "tools", "truncation"})


def _template_variable(name: str) -> str:
    if name in RESERVED_TEMPLATE_NAMES:
        raise ValueError(f"{name!r} would set a parameter of the template's rendering, not a"
                         " variable of the template")
    return name


class _TemplateFields(BaseModel):
    """How messages are rendered: as the chat endpoint renders them, or refused."""

    model_config = ConfigDict(extra="ignore", strict=True)

    add_generation_prompt: bool | None = Field(
        None, description="Open the assistant's turn after the messages (default: true).")
    continue_final_message: bool | None = Field(
        None, description="Leave the last message's turn open, for the reply to go on with it"
                          " (needs add_generation_prompt false, as in vLLM).")
    chat_template: Unsupported = Field(
        None, description="Not supported: the model's own template is used.")
    chat_template_kwargs: Annotated[
        dict[Annotated[str, AfterValidator(_template_variable)], Any], Field(max_length=64),
        WithJsonSchema({"type": "object", "maxProperties": 64, "propertyNames": {
            "not": {"enum": sorted(RESERVED_TEMPLATE_NAMES)}}})] | None = Field(
        None, description="More variables for the chat template (enable_thinking, ...); not"
                          " the names of apply_chat_template's own parameters.")

    def template_options(self) -> dict:
        """``Tokenizer.chat``'s rendering options."""
        return {"add_generation_prompt": self.add_generation_prompt is not False,
                "continue_final_message": bool(self.continue_final_message),
                "template_kwargs": self.chat_template_kwargs,
                "add_special_tokens": getattr(self, "add_special_tokens", None) is True}


class ChatCompletionRequest(_Common, _TemplateFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    logprobs: bool | None = False
    top_logprobs: Int(ge=0, le=MAX_LOGPROBS) | None = Field(
        None, description="Only with logprobs=true.")
    max_completion_tokens: Int(ge=1) | None = None
    tools: NoItems | None = Field(None, description="Not supported: must be empty.")
    tool_choice: Literal["none", "auto"] | None = Field(
        None, description='With no tools: "none" or "auto" (no tool is ever called).')
    functions: NoItems | None = Field(None, description="Not supported: must be empty.")
    function_call: Literal["none", "auto"] | None = Field(
        None, description='With no functions: "none" or "auto".')
    echo: bool | None = Field(
        False, description="vLLM's: the last message's text before each choice's content"
        " when that message has the reply's role (the assistant's, or with"
        " add_generation_prompt false its own, as with continue_final_message); streamed, in"
        " a chunk of its own after the role's. With top_logprobs and no prompt_logprobs, as"
        " vLLM: prompt_logprobs of top_logprobs entries.")
    prompt_logprobs: Int(ge=0, le=MAX_LOGPROBS) | None = Field(
        None, description="vLLM's: the response's prompt_logprobs, null for the rendered"
        " prompt's first token, then for each the logprob, rank (1 + the tokens more likely)"
        " and text of the prompt token and of the prompt_logprobs most likely ones. Not with"
        " stream (as vLLM), unless 0.")
    add_special_tokens: bool | None = Field(
        None, description="The tokenizer's special tokens (BOS) before the rendered"
        " conversation too (default: false, the chat template places them; a model without"
        " a template of its own gets them either way).")
    modalities: Annotated[list[Literal["text"]], Field(max_length=1)] | None = Field(
        None, description='Only ["text"].')
    audio: Unsupported = Field(None, description=NOT_SUPPORTED)

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def prompt_k(self) -> int | None:
        """As vLLM's: echo with top_logprobs asks for them too; a stream shows none."""
        if self.stream:
            return None
        if self.prompt_logprobs is not None:
            return self.prompt_logprobs
        return self.top_logprobs if self.echo else None

    def echo_text(self) -> str | None:
        """With ``echo``: the text to put before the reply (None: none), the last message's
        if it has the reply's role."""
        if not self.echo:
            return None
        last = self.messages[-1]
        role = "assistant" if self.add_generation_prompt is not False else last.role
        return last.text() if last.role == role else None

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None \
            else self.max_tokens


class TokenizeRequest(_TemplateFields):
    """vLLM's ``/tokenize``: a prompt's token ids (``prompt``), or a conversation's as the
    chat endpoint renders it (``messages``)."""

    model_config = ConfigDict(extra="ignore", strict=True, json_schema_extra={"oneOf": [
        {"required": ["prompt"], "properties": {"prompt": {"type": "string"},
                                                "messages": {"type": "null"}}},
        {"required": ["messages"], "properties": {"messages": {"type": "array"},
                                                  "prompt": {"type": "null"}}},
    ]})

    model: str | None = None
    prompt: str | None = None  # (exactly one of prompt and messages)
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    add_special_tokens: bool | None = Field(
        None, description="The tokenizer's special tokens (BOS): with prompt true by default,"
        " with messages false (the chat template places them), as the endpoints do.")
    return_token_strs: bool | None = Field(False, description="Each id's token as text too.")
    tools: NoItems | None = Field(None, description="Not supported: must be empty.")


class DetokenizeRequest(BaseModel):
    """vLLM's ``/detokenize``: the text of token ids."""

    model_config = ConfigDict(extra="ignore", strict=True)

    model: str | None = None
    tokens: list[Int(ge=0)]


@dataclass(frozen=True)
class Limits:
    """The model's and the server's bounds that the published schema states."""

    max_model_len: int
    vocab_size: int | None
    max_prompt_chars: int | None  # no text longer than this can fit (None: no bound known)
    max_choices: int | None = None  # choices (prompts × n) that may wait at once, if fewer
    # than MAX_PROMPTS and MAX_N allow


def request_models(limits: Limits) -> tuple[type[CompletionRequest], type[ChatCompletionRequest]]:
    """The request models with this model's bounds (the schema and the validation)."""
    # Lists stop at their first bad item (fail_fast): a 4 MB list of junk is one error, not
    # two million (whose report alone held the event loop for ten seconds).
    room = limits.max_model_len - 1  # a prompt has at least one token
    most = limits.max_choices or MAX_PROMPTS
    num_prompts, samples = min(MAX_PROMPTS, most), Int(ge=1, le=min(MAX_N, most)) | None
    vocab = limits.vocab_size
    token = Int(ge=0, le=vocab - 1) if vocab else Int(ge=0)
    ids = Annotated[list[token], Field(min_length=1, max_length=room, fail_fast=True)]
    text = Annotated[str, Field(min_length=1, max_length=limits.max_prompt_chars)]
    content = Annotated[str, Field(max_length=limits.max_prompt_chars)]
    part = create_model("TextPart", __base__=TextPart, text=(content, ...))
    # Parts are joined with newlines, so n parts are at least n - 1 characters.
    max_parts = None if limits.max_prompt_chars is None else limits.max_prompt_chars + 1
    parts = Annotated[list[part], Field(max_length=max_parts, fail_fast=True)]
    message = create_model("ChatMessage", __base__=ChatMessage,
                           content=(content | parts | None, None))
    new_tokens = Int(ge=1, le=limits.max_model_len) | None  # (cut to what the prompt leaves)
    prompt_field = CompletionRequest.model_fields["prompt"]
    stop_ids_field = CompletionRequest.model_fields["stop_token_ids"]
    stop_ids = (Annotated[list[token], Field(max_length=MAX_STOP_TOKEN_IDS)] | None,
                Field(None, description=stop_ids_field.description))
    bias = (LogitBias(vocab - 1 if vocab else None) | None,
            Field(None, description=CompletionRequest.model_fields["logit_bias"].description))
    allowed = (Annotated[list[token], Field(min_length=1, max_length=vocab, fail_fast=True)]
               | None, Field(None, description=ALLOWED_TOKEN_IDS))
    completion = create_model(
        "CompletionRequest", __base__=CompletionRequest, logit_bias=bias,
        allowed_token_ids=allowed,
        prompt=(text | ids
                | Annotated[list[text], Field(min_length=1, max_length=num_prompts,
                                              fail_fast=True)]
                | Annotated[list[ids], Field(min_length=1, max_length=num_prompts,
                                             fail_fast=True)],
                Field(description=prompt_field.description)),
        max_tokens=(Int(ge=0, le=limits.max_model_len) | None, Field(
            None, description=CompletionRequest.model_fields["max_tokens"].description)),
        stop_token_ids=stop_ids,
        n=(samples, Field(None, description=CompletionRequest.model_fields["n"].description)))
    chat = create_model(
        "ChatCompletionRequest", __base__=ChatCompletionRequest, logit_bias=bias,
        allowed_token_ids=allowed,
        # Every message takes at least one token of the prompt (its role, as the template
        # renders it).
        messages=(Annotated[list[message], Field(min_length=1, max_length=room,
                                                 fail_fast=True)], ...),
        max_tokens=(new_tokens, None), max_completion_tokens=(new_tokens, None),
        stop_token_ids=stop_ids,
        n=(samples, Field(None, description=ChatCompletionRequest.model_fields["n"].description)))
    return completion, chat


def tokenizer_models(limits: Limits) -> tuple[type[TokenizeRequest], type[DetokenizeRequest]]:
    """The /tokenize and /detokenize request models, with this model's vocabulary."""
    vocab = limits.vocab_size
    token = Int(ge=0, le=vocab - 1) if vocab else Int(ge=0)
    detokenize = create_model("DetokenizeRequest", __base__=DetokenizeRequest,
                              tokens=(Annotated[list[token], Field(fail_fast=True)], ...))
    return TokenizeRequest, detokenize


def context_length_error(max_model_len: int, detail: str, param: str | None) -> ApiError:
    """A request the context window cannot hold, in the words OpenAI's (and vLLM's) errors
    begin with, which clients match (``context_length_exceeded`` is their code)."""
    return ApiError(400, f"This model's maximum context length is {max_model_len} tokens."
                    f" {detail[:1].upper()}{detail[1:]}", param=param,
                    code=CONTEXT_LENGTH_EXCEEDED)


def cross_field_error(body: Any) -> tuple[str, str] | None:
    """Constraints between fields (the schema states them with ``dependentSchemas``): the
    field at fault and what is wrong."""
    # As vLLM has them: an empty stream_options, or top_logprobs 0, asks for nothing, and
    # clients that send every field at its default send them.
    options = getattr(body, "stream_options", None)
    if options is not None and options.model_fields_set and not body.stream:
        return "stream_options", "stream_options is only allowed when stream is true"
    if getattr(body, "continue_final_message", None) \
            and getattr(body, "add_generation_prompt", None) is not False:
        return "continue_final_message", ("continue_final_message needs add_generation_prompt"
                                          " false: the last turn goes on, no new one opens")
    if getattr(body, "max_tokens", None) == 0 and not getattr(body, "echo", False):
        return "max_tokens", "max_tokens 0 generates nothing: only with echo (to score a prompt)"
    if isinstance(body, ChatCompletionRequest) and body.prompt_logprobs and body.stream:
        return "prompt_logprobs", "prompt_logprobs above 0 are not streamed: only with stream" \
            " false (as vLLM)"
    if getattr(body, "top_logprobs", None) and not body.logprobs:
        return "top_logprobs", "top_logprobs above 0 requires logprobs=true"
    return None


def error_body(
    message: str,
    type_: str = "invalid_request_error",
    param: str | None = None,
    code: str | int | None = None,
) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
