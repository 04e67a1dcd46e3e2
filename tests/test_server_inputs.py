"""What the server does with what clients send: hostile bodies, sizes, long prompts, the
published schema, and where text work runs."""

from __future__ import annotations

import json
import threading
import unicodedata

import httpx
import pytest
import torch

from fluidserve.serve.inputs import chars_per_token

from .server_utils import InProcessServer, metric_values

PROMPT = "The river rose slowly in the spring, and the people of the valley"
LIMIT = 256 * 1024


@pytest.fixture(scope="module")
def srv(tiny_model_dir):
    with InProcessServer(tiny_model_dir, max_request_bytes=LIMIT) as s:
        yield s


@pytest.fixture(scope="module")
def schema(srv) -> dict:
    return httpx.get(srv.url + "/openapi.json").json()


def post(srv, path: str, body, **kw) -> httpx.Response:
    if isinstance(body, (str, bytes)):
        kw["content"] = body
    else:
        kw["json"] = body
    return httpx.post(srv.url + path, timeout=60, **kw)


def assert_error(r: httpx.Response, status: int, schema: dict | None = None) -> dict:
    """An OpenAI-style JSON error with this status (and documented, given the schema)."""
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"] and err["type"]
    if schema is not None:
        path = r.request.url.path
        documented = schema["paths"][path][r.request.method.lower()]["responses"]
        assert str(status) in documented, f"{status} is not documented for {path}"
    return err


HOSTILE = [
    ("lone surrogate in prompt", "/v1/completions", '{"prompt":"hi\\ud800x","max_tokens":2}'),
    ("lone surrogate in chat", "/v1/chat/completions",
     '{"messages":[{"role":"user","content":"a\\udc00"}]}'),
    ("lone surrogate in stop", "/v1/completions", '{"prompt":"hi","stop":"\\ud800"}'),
    ("content part text is a number", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}),
    ("content part text is null", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": [{"type": "text", "text": None}]}]}),
    ("content part without text", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": [{"type": "text"}]}]}),
    ("image content part", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}),
    ("content part not an object", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": ["hi"]}]}),
    ("NaN temperature", "/v1/completions", '{"prompt":"hi","temperature":NaN}'),
    ("invalid UTF-8", "/v1/completions", b'{"prompt":"\xff\xfe"}'),
    ("string for a number", "/v1/completions", {"prompt": "hi", "max_tokens": "5"}),
    ("huge seed", "/v1/completions", {"prompt": "hi", "seed": 2**70}),
    ("huge top_k", "/v1/completions", {"prompt": "hi", "top_k": 2**40}),
    ("empty prompt", "/v1/completions", {"prompt": ""}),
    ("1025 prompts", "/v1/completions", {"prompt": ["a"] * 1025}),
    ("129 samples", "/v1/completions", {"prompt": "hi", "n": 129}),
    ("stream_options without stream", "/v1/completions",
     {"prompt": "hi", "stream_options": {"include_usage": True}}),
    # Parameters this server does not implement: refused unless neutral, never ignored.
    ("JSON mode", "/v1/completions", {"prompt": "hi", "response_format": {"type": "json_object"}}),
    ("JSON schema in chat", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "hi"}],
      "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}}),
    ("tools", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                       "tools": [{"type": "function", "function": {"name": "f"}}]}),
    ("forced tool call", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "hi"}],
      "tool_choice": {"type": "function", "function": {"name": "f"}}}),
    ("repetition penalty of 0", "/v1/completions", {"prompt": "hi", "repetition_penalty": 0}),
    ("repetition penalty that parses to infinity", "/v1/completions",
     '{"prompt": "hi", "repetition_penalty": 1e400}'),
    ("min_p above 1", "/v1/completions", {"prompt": "hi", "min_p": 1.5}),
    ("presence penalty above 2", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "hi"}], "presence_penalty": 2.5}),
    ("frequency penalty below -2", "/v1/completions", {"prompt": "hi", "frequency_penalty": -3}),
    ("logit bias of a token past the vocabulary", "/v1/completions",
     {"prompt": "hi", "logit_bias": {"1334": 5}}),
    ("logit bias past 100", "/v1/completions", {"prompt": "hi", "logit_bias": {"7": 101}}),
    ("logit bias of 301 tokens", "/v1/completions",
     {"prompt": "hi", "logit_bias": {str(i): 1 for i in range(301)}}),
    ("beam search", "/v1/completions", {"prompt": "hi", "use_beam_search": True}),
    ("guided json", "/v1/completions", {"prompt": "hi", "guided_json": {"type": "object"}}),
    ("guided choice", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "hi"}], "guided_choice": ["a", "b"]}),
    ("no allowed token", "/v1/completions", {"prompt": "hi", "allowed_token_ids": []}),
    ("an allowed token past the vocabulary", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "hi"}], "allowed_token_ids": [5, 1334]}),
    ("template kwargs that set the rendering", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "hi"}],
      "chat_template_kwargs": {"return_tensors": "pt"}}),
    ("a final message continued and a new turn opened", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "hi"}], "continue_final_message": True}),
    ("a bad word of spaces", "/v1/completions", {"prompt": "hi", "bad_words": ["ok", " \t"]}),
    ("257 bad words", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                               "bad_words": ["w"] * 257}),
    ("logits processors", "/v1/completions", {"prompt": "hi", "logits_processors": ["m.f"]}),
    ("prompt embeddings", "/v1/completions", {"prompt": "hi", "prompt_embeds": "AAAA"}),
    ("audio out", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                           "modalities": ["text", "audio"]}),
    ("logit bias of junk", "/v1/completions",
     {"prompt": "hi", "logit_bias": {str(i): "x" for i in range(20_000)}}),
]


@pytest.mark.parametrize("name,path,body", HOSTILE, ids=[h[0] for h in HOSTILE])
def test_hostile_input_gets_a_documented_400(srv, schema, name, path, body):
    assert_error(post(srv, path, body), 400, schema)
    assert httpx.get(srv.url + "/health").status_code == 200


def test_neutral_values_of_unimplemented_parameters_change_nothing(srv):
    """A client (or vLLM's benchmark, which sends repetition_penalty=1.0) that passes an
    unimplemented parameter at its neutral value gets what it would get without it."""
    base = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0}
    neutral = {"repetition_penalty": 1.0, "min_p": 0, "use_beam_search": False,
               "skip_special_tokens": True, "include_stop_str_in_output": False,
               "response_format": {"type": "text"}, "guided_json": None, "bad_words": [],
               "add_special_tokens": True, "return_tokens_as_token_ids": False}
    plain = post(srv, "/v1/completions", base)
    same = post(srv, "/v1/completions", base | neutral)
    assert plain.status_code == same.status_code == 200, same.text
    assert same.json()["choices"][0]["text"] == plain.json()["choices"][0]["text"]
    chat = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 6, "temperature": 0}
    plain = post(srv, "/v1/chat/completions", chat)
    same = post(srv, "/v1/chat/completions", chat | {
        "tools": [], "tool_choice": "none", "echo": False, "add_generation_prompt": True,
        "continue_final_message": False, "chat_template": None, "add_special_tokens": False,
        "modalities": ["text"]})
    assert plain.status_code == same.status_code == 200, same.text
    assert (same.json()["choices"][0]["message"]["content"]
            == plain.json()["choices"][0]["message"]["content"])


def test_an_error_speaks_of_the_form_the_value_has(srv):
    """Where a field takes several forms, the error is the one of the form the client used."""
    err = assert_error(post(srv, "/v1/completions", {"prompt": "hi", "stop": ["a"] * 17}), 400)
    assert err["param"] == "stop" and "at most 16 items" in err["message"]
    err = assert_error(post(srv, "/v1/completions", {"prompt": "hi", "stop": 5}), 400)
    assert "valid string" in err["message"]


@pytest.mark.parametrize("body, param, says", [
    # Too many prompts in one request: said as such, not as a prompt too long for the window
    # (the code clients answer by cutting the prompt).
    ({"prompt": ["Hello"] * 1025}, "prompt", "a list of 1025 prompts; at most 1024 per"),
    ({"prompt": [[1, 2]] * 1025}, "prompt", "a list of 1025 prompts"),
    # Ids that are not integers: the id at fault.
    ({"prompt": [1.5, 2, 3]}, "prompt.0", "valid integer"),
    ({"prompt": [1, None]}, "prompt.1", "valid integer"),
    ({"prompt": [True, 2]}, "prompt.0", "valid integer"),
    # The bound nearest the value, of a field's alternatives.
    ({"prompt": "x", "top_k": 3_000_000_000}, "top_k", "less than or equal to 2147483647"),
    ({"prompt": "x", "top_k": -5}, "top_k", "greater than or equal to -1"),
])
def test_a_malformed_prompt_or_bound_is_told_as_what_it_is(srv, body, param, says):
    err = assert_error(post(srv, "/v1/completions", body), 400)
    assert err["param"] == param and says in err["message"], err
    assert err["code"] != "context_length_exceeded"


def test_a_field_that_must_be_empty_says_it_is_not_supported(srv):
    history = [{"role": "assistant", "content": "x", "tool_calls": [{"id": "1"}]},
               {"role": "user", "content": "hi"}]
    err = assert_error(post(srv, "/v1/chat/completions", {"messages": history}), 400)
    assert err["param"] == "messages.0.tool_calls" and "not supported" in err["message"], err
    assert err["code"] != "context_length_exceeded"


def test_a_parts_type_is_what_its_error_names(srv):
    err = assert_error(post(srv, "/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "a"}, {"type": "image_url", "image_url": {"url": "x"}}]}]}), 400)
    assert err["param"] == "messages.0.content.1.type" and "'text'" in err["message"]


def test_a_list_of_junk_is_one_error_not_one_per_item(monkeypatch):
    # The report of two million item errors held the event loop for ten seconds.
    from fluidserve.serve import inputs
    from fluidserve.serve.protocol import Limits, request_models

    completion, chat = request_models(Limits(512, 1000, 512 * 14))
    seen = []
    real = inputs.validation_error
    monkeypatch.setattr(inputs, "validation_error", lambda errors, *a: seen.append(errors) or
                        real(errors, *a))
    cases = [(chat, {"messages": [1] * 400}), (completion, {"prompt": [None] * 400}),
             (chat, {"messages": [{"role": "user", "content": [1] * 400}]}),
             (completion, {"prompt": [-1] * 400})]
    for model, body in cases:
        with pytest.raises(inputs.ApiError):
            inputs.parse_body(json.dumps(body).encode(), model)
        assert len(seen.pop()) <= 4, body  # one per alternative of a union, not per item
    with pytest.raises(inputs.ApiError, match=r"messages \(600 messages\) cannot fit in the"
                       " context window: each takes a token at least \\(at most 511\\)"):
        inputs.parse_body(json.dumps({"messages": [{"role": "user"}] * 600}).encode(), chat)


def test_a_rule_between_fields_names_the_field_at_fault(srv, schema):
    for path, body, param in (
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                      "top_logprobs": 2}, "top_logprobs"),
            ("/v1/completions", {"prompt": "hi", "stream_options": {"include_usage": True}},
             "stream_options")):
        err = assert_error(post(srv, path, body), 400, schema)
        assert err["param"] == param, err
    # What asks for nothing is accepted, as vLLM accepts it (clients that send each field
    # at its default send these), and the schema's rules say so.
    for path, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                 "top_logprobs": 0, "max_tokens": 2}),
                       ("/v1/completions", {"prompt": "hi", "stream_options": {},
                                            "max_tokens": 2})):
        assert post(srv, path, body).status_code == 200
    rules = [r["if"]["properties"] for r in
             schema["components"]["schemas"]["ChatCompletionRequest"]["allOf"]]
    assert {"top_logprobs": {"type": "integer", "minimum": 1}} in rules
    assert {"stream_options": {"type": "object", "anyOf": [
        {"required": ["include_usage"]}, {"required": ["continuous_usage_stats"]}]}} in rules


@pytest.mark.parametrize("field,value,says", [
    ("best_of", 3, "best_of: only 1 is supported"),
    ("use_beam_search", True, "use_beam_search: only false is supported"),
    ("response_format", {"type": "json_object"}, 'response_format.type: only "text" is'),
])
def test_a_parameter_at_a_value_this_server_does_not_implement_says_so(field, value, says):
    """Not a range ('less than or equal to 0' for 0.5, 'greater than or equal to 0' for
    -0.5): the one value that is supported."""
    from fluidserve.serve import inputs
    from fluidserve.serve.protocol import Limits, request_models

    completion, _ = request_models(Limits(512, 1000, 512 * 14))
    with pytest.raises(inputs.ApiError, match=says):
        inputs.parse_body(json.dumps({"prompt": "a", field: value}).encode(), completion)
    neutral = {"best_of": 1.0, "use_beam_search": False,
               "response_format": {"type": "text"}}[field]
    inputs.parse_body(json.dumps({"prompt": "a", field: neutral}).encode(), completion)


def test_logit_bias_and_penalties_change_what_is_served(srv):
    """A +100 bias makes a token every greedy pick; penalties and min_p are served on both
    routes, for every sample of n (the engine's tests check their arithmetic)."""
    body = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    forced = post(srv, "/v1/completions", body | {"logit_bias": {"500": 100}})
    assert forced.status_code == 200, forced.text
    text = httpx.post(srv.url + "/detokenize", json={"tokens": [500] * 6}).json()["prompt"]
    assert forced.json()["choices"][0]["text"] == text
    plain = post(srv, "/v1/completions", body | {"max_tokens": 16}).json()
    repeats = post(srv, "/v1/completions", body | {"max_tokens": 16, "frequency_penalty": 2,
                                                   "presence_penalty": 2}).json()
    assert repeats["choices"][0]["text"] != plain["choices"][0]["text"]
    chat = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 8, "n": 2,
            "seed": 1, "repetition_penalty": 1.3, "min_p": 0.1, "presence_penalty": -0.5,
            "logit_bias": {"7": -100}}
    r = post(srv, "/v1/chat/completions", chat)
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 2 and r.json()["usage"]["completion_tokens"] > 0


def test_bad_words_keep_their_tokens_out_of_what_is_served(srv, tiny_model_dir):
    """Each word's token sequences (as it is and after a space) never appear in any
    sample's tokens, on both routes; the output changes where the plain one had them."""
    from fluidserve.model.tokenizer import Tokenizer

    tok = Tokenizer(tiny_model_dir)
    body = {"prompt": PROMPT, "max_tokens": 12, "temperature": 0, "ignore_eos": True,
            "logprobs": 0, "return_tokens_as_token_ids": True}

    def ids(choice) -> list[int]:
        return [int(t.removeprefix("token_id:")) for t in choice["logprobs"]["tokens"]]

    plain = ids(post(srv, "/v1/completions", body).json()["choices"][0])
    words = [tok.decode(plain[:2]), tok.decode(plain[5:6]) + "x"]
    seqs = tok.bad_words_ids(words)
    r = post(srv, "/v1/completions", body | {"bad_words": words, "n": 2, "temperature": 1})
    assert r.status_code == 200, r.text
    got = [ids(c) for c in r.json()["choices"]]
    g = post(srv, "/v1/completions", body | {"bad_words": words}).json()["choices"][0]
    assert ids(g) != plain
    chat = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 12, "seed": 3,
            "bad_words": words, "logprobs": True, "return_tokens_as_token_ids": True}
    c = post(srv, "/v1/chat/completions", chat)
    assert c.status_code == 200, c.text
    got += [ids(g), [int(t["token"].removeprefix("token_id:"))
                     for t in c.json()["choices"][0]["logprobs"]["content"]]]
    for out in got:
        for w in seqs:
            assert all(tuple(out[i:i + len(w)]) != w for i in range(len(out))), (w, out)


def test_echo_returns_the_prompt_and_its_logprobs_as_lm_eval_reads_them(srv, tiny_model_dir):
    """lm-evaluation-harness's loglikelihood: token-id prompts, echo, logprobs 1, one token:
    token_logprobs[ctxlen:-1] are the continuation's, top_logprobs say whether it was greedy.
    Streamed, the prompt comes in each choice's first chunk."""
    import transformers as tf

    prompts = [[1, 50, 60, 70, 80, 90], [1, 300, 301]]
    body = {"prompt": prompts, "max_tokens": 2, "temperature": 0, "logprobs": 2, "echo": True,
            "ignore_eos": True}
    r = post(srv, "/v1/completions", body)
    assert r.status_code == 200, r.text
    echoed = r.json()["choices"]
    model = tf.AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    for choice, ids in zip(r.json()["choices"], prompts, strict=True):
        lp = choice["logprobs"]
        assert len(lp["tokens"]) == len(ids) + 2 and lp["token_logprobs"][0] is None
        assert lp["top_logprobs"][0] is None and lp["text_offset"][0] == 0
        with torch.no_grad():
            want = model(torch.tensor([ids])).logits[0].log_softmax(-1)
        for i in range(1, len(ids)):
            assert lp["token_logprobs"][i] == pytest.approx(float(want[i - 1, ids[i]]),
                                                            abs=1e-3)
            assert len(lp["top_logprobs"][i]) in (2, 3)  # the token itself, and the top 2
        prompt_text = httpx.post(srv.url + "/detokenize", json={"tokens": ids}).json()["prompt"]
        assert choice["text"].startswith(prompt_text)
        plain = post(srv, "/v1/completions", body | {"prompt": ids, "echo": False}).json()
        assert choice["text"] == prompt_text + plain["choices"][0]["text"]
        assert lp["token_logprobs"][len(ids):] == plain["choices"][0]["logprobs"][
            "token_logprobs"]
    # streamed: the same text and logprobs, the prompt's first
    with httpx.stream("POST", srv.url + "/v1/completions", json=body | {"stream": True},
                      timeout=60) as s:
        chunks = [json.loads(x[6:]) for x in s.iter_lines() if x.startswith("data: {")]
    for k, choice in enumerate(r.json()["choices"]):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == k]
        assert "".join(c["text"] for c in mine) == choice["text"]
        assert sum((c["logprobs"]["token_logprobs"] for c in mine), []) \
            == choice["logprobs"]["token_logprobs"]
        assert len(mine[0]["logprobs"]["tokens"]) == len(prompts[k]) + 1
    # echo without logprobs: the text alone
    r = post(srv, "/v1/completions", {"prompt": PROMPT, "max_tokens": 3, "echo": True})
    assert r.json()["choices"][0]["text"].startswith(PROMPT)
    assert r.json()["choices"][0]["logprobs"] is None
    # max_tokens 0 (only with echo): the prompt scored, nothing generated, streamed or not
    scored = body | {"max_tokens": 0}
    whole = post(srv, "/v1/completions", scored).json()
    for choice, full, ids in zip(whole["choices"], echoed, prompts, strict=True):
        assert choice["finish_reason"] == "length"
        assert choice["logprobs"]["token_logprobs"] == full["logprobs"]["token_logprobs"][
            :len(ids)]
        assert full["text"].startswith(choice["text"]) and len(choice["text"]) < len(
            full["text"])
    assert whole["usage"]["completion_tokens"] == 0
    with httpx.stream("POST", srv.url + "/v1/completions", timeout=60,
                      json=scored | {"stream": True}) as s:
        chunks = [json.loads(x[6:]) for x in s.iter_lines() if x.startswith("data: {")]
    for k, choice in enumerate(whole["choices"]):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == k]
        assert "".join(c["text"] for c in mine) == choice["text"]
        assert mine[-1]["finish_reason"] == "length"
    err = assert_error(post(srv, "/v1/completions", {"prompt": PROMPT, "max_tokens": 0}), 400)
    assert err["param"] == "max_tokens"


def test_prompt_logprobs_in_vllms_form(srv):
    """vLLM's prompt_logprobs: per position the prompt token's logprob (the echo's), rank (1
    + the tokens more likely, wherever it is) and text, and the top ones ranked 1..k; null
    first; streamed in the choice's first chunk."""
    ids = [1, 50, 60, 70, 80, 90]
    body = {"prompt": ids, "max_tokens": 2, "temperature": 0, "ignore_eos": True}
    echo = post(srv, "/v1/completions", body | {"echo": True, "logprobs": 2}).json()
    r = post(srv, "/v1/completions", body | {"prompt_logprobs": 2})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["text"] == post(srv, "/v1/completions", body).json()["choices"][0]["text"]
    plp = choice["prompt_logprobs"]
    assert len(plp) == len(ids) and plp[0] is None
    lp = echo["choices"][0]["logprobs"]
    outranked = [0, 0]
    for i in range(1, len(ids)):
        entry = plp[i]
        mine = entry[str(ids[i])]
        assert mine["logprob"] == pytest.approx(lp["token_logprobs"][i], abs=1e-6)
        top = sorted((v["rank"], v["logprob"]) for t, v in entry.items()
                     if t != str(ids[i]) or len(entry) == 2)  # (the token is in the top 2)
        assert [rank for rank, _ in top] == [1, 2] and top[0][1] >= top[1][1]
        if len(entry) == 3:  # not among them: ranked below them
            assert mine["rank"] > 2 and top[1][1] >= mine["logprob"] - 1e-6
        outranked[mine["rank"] > 2] += 1
        assert all(v["decoded_token"] for v in entry.values())
    assert outranked[1]  # (a prompt of random ids: some are far from the top)
    with httpx.stream("POST", srv.url + "/v1/completions", timeout=60,
                      json=body | {"prompt_logprobs": 2, "stream": True}) as s:
        chunks = [json.loads(x[6:]) for x in s.iter_lines() if x.startswith("data: {")]
    assert chunks[0]["choices"][0]["prompt_logprobs"] == plp
    assert all("prompt_logprobs" not in c["choices"][0] for c in chunks[1:])
    plain = post(srv, "/v1/completions", body).json()["choices"][0]
    assert "prompt_logprobs" not in plain


def test_stop_reason_names_the_stop_string_or_token_that_ended_a_choice(srv):
    """vLLM's stop_reason: the stop string, the stop token's id, else null (the length);
    streamed, null until the last chunk. A chat stream's deltas always carry content, ""
    where text is held back (a possible stop string) and at the end, as vLLM's do."""
    body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
            "logprobs": 0, "return_tokens_as_token_ids": True}
    plain = post(srv, "/v1/completions", body).json()["choices"][0]
    ids = [int(t.removeprefix("token_id:")) for t in plain["logprobs"]["tokens"]]
    assert plain["stop_reason"] is None and plain["finish_reason"] == "length"
    word = plain["text"][3:6]
    r = post(srv, "/v1/completions", body | {"stop": ["never there", word]}).json()
    assert r["choices"][0]["stop_reason"] == word
    r = post(srv, "/v1/completions", body | {"stop_token_ids": [ids[2]], "max_tokens": 3})
    assert (r.json()["choices"][0]["finish_reason"], r.json()["choices"][0]["stop_reason"]) \
        == ("stop", ids[2])  # (the last allowed token: still a stop, as vLLM's)
    chat = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 8,
            "temperature": 0, "ignore_eos": True}
    text = post(srv, "/v1/chat/completions", chat).json()["choices"][0]["message"]["content"]
    stop = text[4:7]
    c = post(srv, "/v1/chat/completions", chat | {"stop": [stop]}).json()["choices"][0]
    assert c["stop_reason"] == stop and c["message"]["content"] == text[:text.find(stop)]
    with httpx.stream("POST", srv.url + "/v1/chat/completions", timeout=60,
                      json=chat | {"stop": [stop, text[:3] + "~~~~"], "stream": True}) as s:
        chunks = [json.loads(x[6:]) for x in s.iter_lines() if x.startswith("data: {")]
    choices = [ch["choices"][0] for ch in chunks]
    assert all(isinstance(c["delta"]["content"], str) for c in choices)
    assert "" in [c["delta"]["content"] for c in choices[1:-1]]  # (held back)
    assert [c["stop_reason"] for c in choices] == [None] * (len(choices) - 1) + [stop]
    assert "".join(c["delta"]["content"] for c in choices) == text[:text.find(stop)]


def test_chat_prompt_logprobs_are_the_rendered_prompts_once_per_response(srv, schema):
    """Chat's prompt_logprobs (vLLM's): at the response's top, of the prompt as the template
    rendered it, the same as a completion of those ids gets; with n = 2 still one list; echo
    with top_logprobs asks for them too; streamed, only 0 is taken."""
    messages = [{"role": "user", "content": PROMPT}]
    ids = httpx.post(srv.url + "/tokenize", json={"messages": messages}).json()["tokens"]
    body = {"messages": messages, "max_tokens": 3, "temperature": 0, "ignore_eos": True}
    r = post(srv, "/v1/chat/completions", body | {"prompt_logprobs": 2, "n": 2})
    assert r.status_code == 200, r.text
    plp = r.json()["prompt_logprobs"]
    assert len(r.json()["choices"]) == 2 and len(plp) == len(ids) == r.json()["usage"][
        "prompt_tokens"]
    want = post(srv, "/v1/completions", {"prompt": ids, "max_tokens": 1, "prompt_logprobs": 2})
    assert plp == pytest.approx(want.json()["choices"][0]["prompt_logprobs"])
    assert plp[0] is None and all(str(t) in e for t, e in zip(ids[1:], plp[1:], strict=True))
    echoed = post(srv, "/v1/chat/completions", body | {"echo": True, "logprobs": True,
                                                        "top_logprobs": 2})
    assert echoed.json()["prompt_logprobs"] == plp
    assert "prompt_logprobs" not in post(srv, "/v1/chat/completions", body).json()
    assert_error(post(srv, "/v1/chat/completions", body | {"prompt_logprobs": 1,
                                                           "stream": True}), 400, schema)
    with httpx.stream("POST", srv.url + "/v1/chat/completions", timeout=60,
                      json=body | {"prompt_logprobs": 0, "stream": True}) as s:
        assert s.status_code == 200
        assert all("prompt_logprobs" not in x for x in s.iter_lines())


def test_return_token_ids_gives_each_choices_and_the_prompts_ids(srv):
    """vLLM's return_token_ids (RL trainers read it, not the text): each choice's token ids
    (the stop token's too), the prompt's; streamed, each chunk's new ids and the prompt's in
    each choice's first chunk."""
    messages = [{"role": "user", "content": PROMPT}]
    chat_ids = httpx.post(srv.url + "/tokenize", json={"messages": messages}).json()["tokens"]
    ids = httpx.post(srv.url + "/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    body = {"prompt": PROMPT, "max_tokens": 5, "temperature": 0, "ignore_eos": True,
            "logprobs": 0, "return_tokens_as_token_ids": True, "return_token_ids": True}

    def logged(choice) -> list[int]:
        return [int(t.removeprefix("token_id:")) for t in choice["logprobs"]["tokens"]]

    r = post(srv, "/v1/completions", body | {"n": 2, "seed": 3, "temperature": 1}).json()
    for c in r["choices"]:
        assert c["token_ids"] == logged(c) and c["prompt_token_ids"] == ids
    stop = logged(r["choices"][0])[2]
    one = post(srv, "/v1/completions", body | {"stop_token_ids": [stop], "n": 1, "seed": 3,
                                               "temperature": 1}).json()["choices"][0]
    assert one["token_ids"][-1] == stop and one["stop_reason"] == stop
    with httpx.stream("POST", srv.url + "/v1/completions", timeout=60,
                      json=body | {"stream": True}) as s:
        chunks = [json.loads(x[6:])["choices"][0] for x in s.iter_lines()
                  if x.startswith("data: {")]
    assert chunks[0]["prompt_token_ids"] == ids
    assert all("prompt_token_ids" not in c for c in chunks[1:])
    streamed = [t for c in chunks for t in c["token_ids"]]
    assert streamed == post(srv, "/v1/completions", body).json()["choices"][0]["token_ids"]
    chat = {"messages": messages, "max_tokens": 4, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, "n": 2}
    c = post(srv, "/v1/chat/completions", chat).json()
    assert c["prompt_token_ids"] == chat_ids and all(len(x["token_ids"]) == 4
                                                     for x in c["choices"])
    with httpx.stream("POST", srv.url + "/v1/chat/completions", timeout=60,
                      json=chat | {"stream": True}) as s:
        chunks = [json.loads(x[6:]) for x in s.iter_lines() if x.startswith("data: {")]
    firsts = [ch for ch in chunks if "role" in ch["choices"][0]["delta"]]
    assert len(firsts) == 2 and all(ch["prompt_token_ids"] == chat_ids for ch in firsts)
    for i in (0, 1):
        got = [t for ch in chunks if ch["choices"][0]["index"] == i
               for t in ch["choices"][0].get("token_ids", [])]
        assert got == c["choices"][i]["token_ids"]
    plain = post(srv, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2}).json()
    assert "token_ids" not in plain["choices"][0]


def test_completion_logprobs_true_is_one_and_false_none(srv):
    """A client that sends chat's boolean logprobs to completions too (vLLM takes it)."""
    body = {"prompt": PROMPT, "max_tokens": 3, "temperature": 0}
    one = post(srv, "/v1/completions", body | {"logprobs": True}).json()["choices"][0]
    assert one == post(srv, "/v1/completions", body | {"logprobs": 1}).json()["choices"][0]
    assert len(one["logprobs"]["tokens"]) == 3
    off = post(srv, "/v1/completions", body | {"logprobs": False}).json()["choices"][0]
    assert off["logprobs"] is None and off["text"] == one["text"]


def test_roles_beyond_openais_reach_the_chat_template(srv, tiny_model_dir):
    """As vLLM: a role the template renders (Llama 3.1's ipython, the legacy function) is
    passed on as it is, not refused."""
    from fluidserve.model.tokenizer import Tokenizer

    messages = [{"role": "user", "content": "what is 6 x 7?"},
                {"role": "ipython", "content": "42"}, {"role": "function", "content": "ok"}]
    ids = httpx.post(srv.url + "/tokenize", json={"messages": messages}).json()["tokens"]
    assert ids == Tokenizer(tiny_model_dir).chat(messages)
    r = post(srv, "/v1/chat/completions", {"messages": messages, "max_tokens": 2})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == len(ids)


def test_chat_echo_puts_the_last_message_of_the_replys_role_first(srv):
    """As vLLM's: a continued assistant message comes back whole, before the reply; streamed,
    in a chunk of its own after the role's; a user's last message is not the reply's role."""
    start = "Once upon a time"
    cont = {"messages": [{"role": "user", "content": PROMPT},
                         {"role": "assistant", "content": start}],
            "add_generation_prompt": False, "continue_final_message": True,
            "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    plain = post(srv, "/v1/chat/completions", cont).json()["choices"][0]["message"]["content"]
    r = post(srv, "/v1/chat/completions", cont | {"echo": True, "n": 2, "seed": 1})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == start + plain
    assert all(c["message"]["content"].startswith(start) for c in r.json()["choices"])
    with httpx.stream("POST", srv.url + "/v1/chat/completions", timeout=60,
                      json=cont | {"echo": True, "stream": True}) as s:
        chunks = [json.loads(x[6:]) for x in s.iter_lines() if x.startswith("data: {")]
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert deltas[0]["role"] == "assistant" and deltas[1] == {"content": start}
    assert "".join(d.get("content") or "" for d in deltas) == start + plain
    user = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 4,
            "temperature": 0, "ignore_eos": True}
    assert post(srv, "/v1/chat/completions", user | {"echo": True}).json()["choices"][0][
        "message"] == post(srv, "/v1/chat/completions", user).json()["choices"][0]["message"]


def test_allowed_tokens_special_tokens_and_the_stop_string_in_the_output(srv):
    """allowed_token_ids holds greedy picks to its ids; forced to the end-of-sequence token,
    a request stops at once, and its text is that token's only when special tokens are kept
    and the stop is included; a stop string is kept at the end of the text when asked."""
    body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    r = post(srv, "/v1/completions", body | {"allowed_token_ids": [500, 501], "logprobs": 0})
    assert r.status_code == 200, r.text
    tokens = r.json()["choices"][0]["logprobs"]["tokens"]
    texts = {httpx.post(srv.url + "/detokenize", json={"tokens": [t]}).json()["prompt"]
             for t in (500, 501)}
    assert set(tokens) <= texts and len(tokens) == 8
    eos = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "allowed_token_ids": [2]}
    eos_text = httpx.post(srv.url + "/detokenize", json={"tokens": [2]}).json()["prompt"]
    assert eos_text  # (the tiny model's end of sequence, "</s>")
    for extra, text in (({}, ""), ({"skip_special_tokens": False}, ""),
                        ({"skip_special_tokens": False, "include_stop_str_in_output": True},
                         eos_text),
                        # min_tokens bans EOS, the one token allowed: allowed wins, and
                        # min_tokens still holds the stop off for its two tokens
                        ({"min_tokens": 2}, "")):
        r = post(srv, "/v1/completions", eos | extra).json()
        choice = r["choices"][0]
        assert (choice["text"], choice["finish_reason"]) == (text, "stop"), extra
        assert r["usage"]["completion_tokens"] == 1 + extra.get("min_tokens", 0), extra
        ids = post(srv, "/v1/completions", eos | extra | {
            "logprobs": 0, "return_tokens_as_token_ids": True}).json()["choices"][0]
        assert set(ids["logprobs"]["tokens"]) == {"token_id:2"}, extra
    plain = post(srv, "/v1/completions", body | {"max_tokens": 12}).json()["choices"][0]["text"]
    stop = plain[4:7]
    cut = post(srv, "/v1/completions", body | {"max_tokens": 12, "stop": stop}).json()
    kept = post(srv, "/v1/completions", body | {"max_tokens": 12, "stop": stop,
                                                "include_stop_str_in_output": True}).json()
    assert kept["choices"][0]["text"] == cut["choices"][0]["text"] + stop
    assert plain.startswith(kept["choices"][0]["text"])


def test_the_chat_template_options_render_as_transformers_renders_them(srv, tiny_model_dir):
    """add_generation_prompt false, continue_final_message (the reply goes on with the last
    message) and template variables: /tokenize and the served prompt both render them as
    transformers' apply_chat_template does."""
    import transformers as tf

    hf = tf.AutoTokenizer.from_pretrained(tiny_model_dir)
    messages = [{"role": "user", "content": "Tell me a story"},
                {"role": "assistant", "content": "Once upon a"}]
    for options, kw in (({}, {"add_generation_prompt": True}),
                        ({"add_generation_prompt": False}, {"add_generation_prompt": False}),
                        ({"add_generation_prompt": False, "continue_final_message": True},
                         {"continue_final_message": True}),
                        ({"chat_template_kwargs": {"enable_thinking": False}},
                         {"add_generation_prompt": True, "enable_thinking": False})):
        text = hf.apply_chat_template(messages, tokenize=False, **kw)
        want = hf.encode(text, add_special_tokens=False)
        got = post(srv, "/tokenize", {"messages": messages} | options).json()
        assert got["tokens"] == want, options
        served = post(srv, "/v1/chat/completions", {"messages": messages, "max_tokens": 1}
                      | options).json()
        assert served["usage"]["prompt_tokens"] == len(want), options
    ends = [post(srv, "/tokenize", {"messages": messages} | o).json()["tokens"] for o in (
        {"add_generation_prompt": False},
        {"add_generation_prompt": False, "continue_final_message": True})]
    assert len(ends[1]) < len(ends[0])  # (the last turn left open: no end-of-turn after it)


def test_special_tokens_added_or_not_and_tokens_shown_as_ids(srv):
    """add_special_tokens: a completion's text prompt without BOS, a conversation with it
    (as /tokenize counts them); return_tokens_as_token_ids: logprobs name tokens by id."""
    def prompt_tokens(path, body) -> int:
        r = post(srv, path, body | {"max_tokens": 1})
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens"]

    plain = prompt_tokens("/v1/completions", {"prompt": PROMPT})
    assert prompt_tokens("/v1/completions", {"prompt": [PROMPT, PROMPT],
                                             "add_special_tokens": False}) == 2 * (plain - 1)
    tokenized = post(srv, "/tokenize", {"prompt": PROMPT, "add_special_tokens": False}).json()
    assert tokenized["count"] == plain - 1
    messages = [{"role": "user", "content": PROMPT}]
    chat = prompt_tokens("/v1/chat/completions", {"messages": messages})
    assert prompt_tokens("/v1/chat/completions", {"messages": messages,
                                                  "add_special_tokens": True}) == chat + 1
    assert post(srv, "/tokenize", {"messages": messages, "add_special_tokens": True}
                ).json()["count"] == chat + 1
    r = post(srv, "/v1/completions", {"prompt": PROMPT, "max_tokens": 3, "temperature": 0,
                                      "logprobs": 1, "return_tokens_as_token_ids": True})
    lp = r.json()["choices"][0]["logprobs"]
    assert all(t.startswith("token_id:") for t in lp["tokens"])
    assert all(k.startswith("token_id:") for top in lp["top_logprobs"] for k in top)
    r = post(srv, "/v1/chat/completions", {"messages": messages, "max_tokens": 2,
                                           "logprobs": True, "top_logprobs": 1,
                                           "return_tokens_as_token_ids": True})
    content = r.json()["choices"][0]["logprobs"]["content"]
    assert all(c["token"].startswith("token_id:") for c in content)


def test_continuous_usage_comes_with_the_final_usage_only(srv):
    def usages(options: dict) -> list:
        body = {"prompt": PROMPT, "max_tokens": 3, "ignore_eos": True, "stream": True,
                "stream_options": options}
        with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=60) as s:
            chunks = [json.loads(x[6:]) for x in s.iter_lines() if x.startswith("data: {")]
        return [(len(c["choices"]), (c.get("usage") or {}).get("completion_tokens"))
                for c in chunks]

    both = usages({"include_usage": True, "continuous_usage_stats": True})
    assert both == [(1, 1), (1, 2), (1, 3), (0, 3)]
    assert usages({"include_usage": True}) == [(1, None)] * 3 + [(0, 3)]
    assert usages({"continuous_usage_stats": True}) == [(1, None)] * 3  # as vLLM: needs both


def test_top_k_zero_is_every_token_as_in_vllm(srv):
    body = {"prompt": PROMPT, "max_tokens": 6, "temperature": 1.0, "seed": 3}
    texts = [post(srv, "/v1/completions", body | extra).json()["choices"][0]["text"]
             for extra in ({}, {"top_k": 0}, {"top_k": -1})]
    assert texts[0] == texts[1] == texts[2]
    assert_error(post(srv, "/v1/completions", body | {"top_k": -2}), 400)


def test_published_schema_states_what_is_rejected(schema):
    """A body the schema accepts is served; one the server refuses, the schema refuses too."""
    req = schema["components"]["schemas"]["CompletionRequest"]
    texts = [a for a in req["properties"]["prompt"]["anyOf"] if a.get("type") == "string"]
    assert texts[0]["minLength"] == 1  # so {"prompt": ""} is not schema-valid
    assert texts[0]["maxLength"] > 0  # longer text can never fit the context window
    ids = [a for a in req["properties"]["prompt"]["anyOf"]
           if a.get("type") == "array" and a["items"].get("type") == "integer"][0]
    assert ids["items"]["maximum"] == 1333 and ids["minItems"] == 1  # the tiny model's vocab
    chat = schema["components"]["schemas"]["ChatCompletionRequest"]
    assert chat["properties"]["messages"]["minItems"] == 1
    # What is not implemented is stated: its one accepted value, or null only.
    consts = [a for a in req["properties"]["use_beam_search"]["anyOf"] if "const" in a]
    assert consts == [{"type": "boolean", "const": False}]
    bias = req["properties"]["logit_bias"]["anyOf"][0]  # token ids of the vocabulary only
    assert bias["propertyNames"]["pattern"].endswith("|1333)$")
    assert bias["maxProperties"] == 300
    assert req["properties"]["guided_json"]["type"] == "null"
    assert chat["properties"]["tools"]["anyOf"][0]["maxItems"] == 0
    for path in ("/v1/completions", "/v1/chat/completions"):
        responses = schema["paths"][path]["post"]["responses"]
        for status in ("200", "400", "404", "413", "500", "503"):
            assert status in responses, (path, status)
        assert "text/event-stream" in responses["200"]["content"]
        err = responses["400"]["content"]["application/json"]["schema"]["$ref"]
        assert err.endswith("/ErrorResponse")


def test_unexpected_exception_is_a_json_500(srv, schema, monkeypatch):
    def broken(text, *args):
        raise KeyError("bug")

    monkeypatch.setattr(srv.app.state.fluidserve.prompts, "encode", broken)
    err = assert_error(post(srv, "/v1/completions", {"prompt": "hi"}), 500, schema)
    assert err["type"] == "internal_error"


def test_wrong_method_gets_405_with_allow(srv):
    r = httpx.get(srv.url + "/v1/completions")
    assert_error(r, 405)
    assert r.headers["allow"] == "POST"
    r = httpx.delete(srv.url + "/v1/models")
    assert r.status_code == 405 and "GET" in r.headers["allow"]


@pytest.fixture
def text_work(srv, monkeypatch):
    """Which threads the tokenizer ran on (encode, chat, decode), by function."""
    tok = srv.engine.tokenizer
    seen: dict[str, list[str]] = {"encode": [], "chat": [], "decode": []}
    for name in seen:
        real = getattr(tok, name)

        def spy(*a, _real=real, _name=name, **kw):
            seen[_name].append(threading.current_thread().name)
            return _real(*a, **kw)

        monkeypatch.setattr(tok, name, spy)
    return seen


def test_a_prompt_that_cannot_fit_is_refused_without_tokenizing(srv, schema, text_work):
    n = srv.app.state.fluidserve.prompts.chars_per_token
    assert n == 14  # the tiny model's longest token
    too_long = "word " * (512 * n // 5 + 1)  # > max_model_len * N characters
    for path, body in (("/v1/completions", {"prompt": too_long}),
                       ("/v1/chat/completions", {"messages": [
                           {"role": "user", "content": too_long[: len(too_long) // 2]},
                           {"role": "user", "content": too_long[: len(too_long) // 2]}]}),
                       # (max_tokens counts for nothing here: beyond the window it is cut)
                       ("/v1/completions", {"prompt": "x" * (511 * n + 1), "max_tokens": 1})):
        err = assert_error(post(srv, path, body), 400, schema)
        # (not the schema's character bound; in OpenAI's words, which clients match)
        assert err["message"].startswith("This model's maximum context length is 512 tokens."), err
        assert err["code"] == "context_length_exceeded", err
    assert text_work["encode"] == [] and text_work["chat"] == []
    # Every message takes a token besides its text: 400 messages leave 111 of the 511 tokens
    # for their 4000 characters, which 14 characters a token cannot fit.
    many = {"messages": [{"role": "user", "content": "0123456789"}] * 400}
    err = assert_error(post(srv, "/v1/chat/completions", many), 400, schema)
    assert err["message"].startswith("This model's maximum context length is 512 tokens. 400"
                                     " messages of 4000 characters")
    assert text_work["chat"] == []
    # Short enough in characters but not in tokens: tokenized, then refused the same way.
    err = assert_error(post(srv, "/v1/completions", {"prompt": "word " * 600}), 400, schema)
    assert err["code"] == "context_length_exceeded" and len(text_work["encode"]) == 1


def test_text_work_never_runs_on_the_event_loop(srv, text_work):
    body = {"prompt": PROMPT, "max_tokens": 4, "logprobs": 2, "ignore_eos": True}
    r = post(srv, "/v1/completions", body)
    assert len(r.json()["choices"][0]["logprobs"]["tokens"]) == 4
    with httpx.stream("POST", srv.url + "/v1/completions", json=body | {"stream": True}) as s:
        events = [x for x in s.iter_lines() if x.startswith("data: {")]
    assert len(events) == 4
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "logprobs": True,
            "top_logprobs": 2}
    assert post(srv, "/v1/chat/completions", chat).status_code == 200
    assert text_work["encode"] and text_work["chat"] and text_work["decode"]
    loop_thread = srv.thread.name
    for name, threads in text_work.items():
        assert loop_thread not in threads, f"{name} ran on the event loop"


def test_a_huge_prompt_does_not_disturb_a_running_stream(srv, text_work):
    """A smaller, untimed version of scripts/stall_bench.py: while a body at the size limit is
    sent and refused, another stream goes on to the end; the big prompt is never tokenized."""
    got: list[str] = []

    def stream():
        body = {"prompt": PROMPT, "max_tokens": 200, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=60) as s:
            got.extend(x for x in s.iter_lines() if x.startswith("data: {"))

    t = threading.Thread(target=stream)
    t.start()
    big = json.dumps({"prompt": "x" * (LIMIT - 100)})
    for _ in range(3):
        assert post(srv, "/v1/completions", big).status_code == 400
    t.join(60)
    assert len(got) == 200
    assert len(text_work["encode"]) == 1  # only the stream's own prompt


def test_a_large_body_is_parsed_in_another_process_to_the_same_request():
    """Above 64 KiB a body is parsed in a process of its own (its JSON parse holds the
    interpreter: 4 MB of small objects in an ignored field stalled every stream for up to a
    second); what comes back is the request the in-process parse makes, or its error."""
    import asyncio
    import os

    from fluidserve.serve.inputs import BodyParser, parse_body
    from fluidserve.serve.protocol import Limits

    parser = BodyParser(Limits(512, 1000, 512 * 14))
    junk = [{"a": 1}] * 40_000  # an ignored field, well over 64 KiB
    cases = [
        ("completion", {"prompt": list(range(5, 400)), "max_tokens": 3, "stop": ["x", "y"],
                        "stream": True, "stream_options": {}, "junk": junk}),
        ("chat", {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
                  "top_logprobs": 0, "temperature": 1, "junk": junk}),
    ]

    async def read_all():
        out = []
        for kind, body in cases:
            raw = json.dumps(body).encode()
            out.append((await parser.read(raw, kind), parse_body(raw, parser.models[kind])))
        errors = []
        for raw in (json.dumps({"prompt": ["a"] * 1025, "junk": junk}).encode(),
                    b'{"prompt": NaN, "junk": "' + b"x" * 70_000 + b'"}'):
            for read in (parser.read(raw, "completion"),
                         asyncio.to_thread(parse_body, raw, parser.models["completion"])):
                try:
                    await read
                except Exception as e:  # noqa: BLE001 - compared below
                    errors.append((type(e).__name__, e.status, e.message, e.param, e.code))
        return out, errors

    try:
        out, errors = asyncio.run(read_all())
        pids = [p.pid for p in parser._pool._processes.values()]
    finally:
        parser.close()
    for there, here in out:
        assert there == here and there.model_fields_set == here.model_fields_set
        assert type(there) is type(here)
    assert errors[0] == errors[1] and errors[2] == errors[3] and len(errors) == 4
    assert errors[0][0] == "ApiError" and "1025 prompts" in errors[0][2]
    assert pids and os.getpid() not in pids


def test_a_body_parser_that_dies_loses_no_body_and_counts_once():
    import asyncio
    import os
    import signal

    from fluidserve.serve.inputs import BodyParser
    from fluidserve.serve.protocol import Limits

    parser = BodyParser(Limits(512, 1000, 512 * 14))
    raw = json.dumps({"prompt": "hi", "junk": [{"a": 1}] * 300_000}).encode()  # ~0.1 s each

    async def run():
        await parser.read(raw, "completion")  # the parser process starts
        pid = next(iter(parser._pool._processes))
        reads = [asyncio.create_task(parser.read(raw, "completion")) for _ in range(3)]
        await asyncio.sleep(0)
        os.kill(pid, signal.SIGKILL)  # one death, three bodies in flight
        done = await asyncio.gather(*reads)
        deaths = parser._deaths
        await parser.read(raw, "completion")
        return done, deaths, parser._pool is not None

    try:
        done, deaths, restarted = asyncio.run(run())
    finally:
        parser.close()
    assert [r.prompt for r in done] == ["hi"] * 3  # parsed here instead
    assert deaths == 1 and restarted


def test_stop_string_completed_by_the_last_token_applies(srv):
    base = {"prompt": "The river rose slowly", "max_tokens": 8, "temperature": 1.0, "seed": 0,
            "ignore_eos": True}
    r = post(srv, "/v1/completions", base | {"logprobs": 0}).json()["choices"][0]
    text, last = r["text"], r["logprobs"]["tokens"][-1]
    stop = last.strip()
    assert stop and text.find(stop) == len(text) - len(stop), "the stop must first appear last"
    r = post(srv, "/v1/completions", base | {"stop": [stop]}).json()
    assert r["choices"][0]["finish_reason"] == "stop"
    assert r["choices"][0]["text"] == text[: -len(stop)]
    assert r["usage"]["completion_tokens"] == 8
    with httpx.stream("POST", srv.url + "/v1/completions",
                      json=base | {"stop": [stop], "stream": True}) as s:
        chunks = [json.loads(x[6:]) for x in s.iter_lines()
                  if x.startswith("data: {")]
    assert "".join(c["choices"][0]["text"] for c in chunks) == text[: -len(stop)]
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_metrics_forget_a_non_streaming_request_whose_client_left(srv):
    def aborted() -> float:
        m = metric_values(httpx.get(srv.url + "/metrics").text)
        return m.get('fluidserve_requests_total{outcome="abort"}', 0.0)

    before = aborted()
    with pytest.raises(httpx.ReadTimeout):  # ~490 tokens take well over 0.5 s
        httpx.post(srv.url + "/v1/completions", timeout=0.5,
                   json={"prompt": "hi", "max_tokens": 490, "ignore_eos": True})
    # No later request runs: the abort alone must bring the gauges back to idle.
    assert srv.kv_idle(), "the aborted request is still reported running or holding KV blocks"
    assert aborted() == before + 1


def test_chars_per_token_bounds_only_where_text_cannot_vanish(srv):
    tok = srv.engine.tokenizer
    n = chars_per_token(tok)
    for text in (PROMPT, "ééé 漢字 🙂" * 20, "x" * 500, " " * 300):
        assert len(text) <= n * len(tok.encode(text, add_special_tokens=False))

    class Stub:  # a BERT-style tokenizer drops whitespace: no bound can be claimed
        def __init__(self, spec):
            self.hf = type("HF", (), {"backend_tokenizer": type(
                "B", (), {"to_str": lambda self: json.dumps(spec)})(),
                "get_vocab": lambda self: {"abc": 0}})()

    bpe = {"type": "BPE", "fuse_unk": False}
    assert chars_per_token(Stub({"normalizer": None, "pre_tokenizer": {"type": "ByteLevel"},
                                 "model": bpe})) == 3
    # NFC composes up to four code points into one (here U+1F8B).
    assert len(unicodedata.normalize("NFC", "\u0391\u0314\u0300\u0345")) == 1
    assert chars_per_token(Stub({"normalizer": {"type": "NFC"}, "pre_tokenizer": None,
                                 "model": bpe})) == 12
    assert chars_per_token(Stub({"normalizer": None, "pre_tokenizer": {
        "type": "Whitespace"}, "model": bpe})) is None
    assert chars_per_token(Stub({"normalizer": {"type": "Strip"}, "pre_tokenizer": None,
                                 "model": bpe})) is None
    assert chars_per_token(Stub({"normalizer": None, "pre_tokenizer": None,
                                 "model": {"type": "BPE", "fuse_unk": True}})) is None


def test_text_parts_of_a_message_are_lines_of_its_content():
    """vLLM joins a message's text parts with newlines; the same request must make the same
    prompt here."""
    from fluidserve.serve.protocol import ChatCompletionRequest

    body = ChatCompletionRequest.model_validate_json(json.dumps({"messages": [{
        "role": "user", "content": [{"type": "text", "text": "Hello"},
                                    {"type": "text", "text": "world"}]}]}))
    assert body.messages[0].text() == "Hello\nworld"


def test_tokenize_and_detokenize_answer_as_vllms_do(srv, schema):
    """`vllm bench serve` asks /tokenize how the server counts its prompts' tokens (and
    re-cuts them where that differs): the ids the completion endpoint would run, the ids a
    conversation renders to at the chat endpoint, and text back from ids."""
    tok = srv.engine.tokenizer
    text = "The river rose slowly in the spring"
    r = post(srv, "/tokenize", {"model": "tiny", "prompt": text})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body == {"count": len(tok.encode(text)), "max_model_len": 512,
                    "tokens": tok.encode(text), "token_strs": None}
    plain = post(srv, "/tokenize", {"prompt": text, "add_special_tokens": False}).json()
    assert plain["tokens"] == tok.encode(text, add_special_tokens=False)
    completion = post(srv, "/v1/completions", {"prompt": text, "max_tokens": 1}).json()
    assert completion["usage"]["prompt_tokens"] == body["count"]
    messages = [{"role": "user", "content": "What news from the court?"}]
    chat = post(srv, "/tokenize", {"messages": messages}).json()
    served = post(srv, "/v1/chat/completions", {"messages": messages, "max_tokens": 1}).json()
    assert chat["count"] == served["usage"]["prompt_tokens"]
    strs = post(srv, "/tokenize", {"prompt": text, "return_token_strs": True}).json()
    assert strs["token_strs"] == tok.hf.convert_ids_to_tokens(body["tokens"])
    back = post(srv, "/detokenize", {"tokens": plain["tokens"]})
    assert back.status_code == 200 and back.json() == {"prompt": text}
    for path, bad, status, param in (
            ("/tokenize", {"prompt": text, "messages": messages}, 400, "prompt"),
            ("/tokenize", {}, 400, "prompt"),
            ("/tokenize", {"prompt": text, "model": "gpt-9"}, 404, "model"),
            ("/detokenize", {"tokens": [1, 10**6]}, 400, "tokens.1"),
            ("/detokenize", {"tokens": "abc"}, 400, "tokens"),
            # What would change the result and is not done: refused, never ignored.
            ("/tokenize", {"messages": messages, "continue_final_message": True}, 400,
             "continue_final_message"),
            ("/tokenize", {"messages": messages, "chat_template_kwargs": {"tokenize": True}},
             400, "chat_template_kwargs.tokenize"),
            ("/tokenize", {"prompt": text, "continue_final_message": True}, 400,
             "continue_final_message"),
            ("/tokenize", {"messages": messages, "chat_template": "{{ x }}"}, 400,
             "chat_template")):
        err = assert_error(post(srv, path, bad), status, schema)
        assert err["param"] == param, err
