"""The OpenAI-compatible server over real HTTP on localhost."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import openai
import pytest

from fluidserve.engine.llm import LLM
from fluidserve.sampling_params import SamplingParams

from .server_utils import InProcessServer, free_port, metric_samples, metric_values, wait_healthy

PROMPT = "The river rose slowly in the spring, and the people of the valley"


@pytest.fixture(scope="module")
def srv(tiny_model_dir):
    with InProcessServer(tiny_model_dir, max_waiting_requests=1000) as s:
        yield s


@pytest.fixture(scope="module")
def client(srv):
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)


def test_openai_client_completions(client, srv):
    r = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=7, temperature=0, extra_body={"ignore_eos": True}
    )
    assert r.object == "text_completion" and r.model == "tiny" and r.id.startswith("cmpl-")
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 7 and r.usage.prompt_tokens > 5
    assert r.usage.total_tokens == r.usage.prompt_tokens + 7
    chunks = list(
        client.completions.create(
            model="tiny",
            prompt=PROMPT,
            max_tokens=7,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == r.choices[0].text
    assert chunks[-1].usage.completion_tokens == 7 and not chunks[-1].choices
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert srv.kv_idle()


def test_openai_client_chat(client):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello!"}]
    r = client.chat.completions.create(
        model="tiny", messages=msgs, max_tokens=6, temperature=0, extra_body={"ignore_eos": True}
    )
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    assert r.usage.completion_tokens == 6
    stream = client.chat.completions.create(
        model="tiny",
        messages=msgs,
        max_tokens=6,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == r.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length"


def test_models_and_metrics(client, srv):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    body = httpx.get(srv.url + "/metrics").text
    for name in (
        "fluidserve_requests_total",
        "fluidserve_num_requests_running",
        "fluidserve_num_requests_waiting",
        "fluidserve_kv_cache_usage",
        "fluidserve_iteration_tokens_bucket",
        "fluidserve_time_to_first_token_seconds",
        "fluidserve_time_between_tokens_seconds",
        "fluidserve_e2e_request_latency",
        "fluidserve_preemptions_total",
    ):
        assert name in body, name
    assert 'fluidserve_requests_total{outcome="length"}' in body


def test_without_a_served_name_requests_may_name_the_model_path_as_vllms_clients_do(
        tiny_model_dir):
    with InProcessServer(tiny_model_dir, name=()) as s:
        listed = httpx.get(s.url + "/v1/models").json()["data"]
        assert [m["id"] for m in listed] == [tiny_model_dir.name]
        for name in (tiny_model_dir.name, str(tiny_model_dir)):
            r = httpx.post(s.url + "/v1/completions", timeout=60,
                           json={"model": name, "prompt": "hi", "max_tokens": 1})
            assert r.status_code == 200 and r.json()["model"] == tiny_model_dir.name, r.text
        r = httpx.post(s.url + "/v1/completions", json={"model": "other", "prompt": "hi"})
        assert r.status_code == 404


def test_metrics_under_vllms_names_match_their_fluidserve_twins(srv):
    """Dashboards and autoscalers written for vLLM read the same values: vLLM's names,
    labelled by the served model's name, beside fluidserve's."""
    from .server_utils import metric_values

    def values() -> dict[str, float]:
        return metric_values(httpx.get(srv.url + "/metrics").text)

    before = values()
    r = httpx.post(srv.url + "/v1/completions", timeout=60, json={
        "prompt": [5, 6, 7, 8, 9], "max_tokens": 3, "ignore_eos": True})
    assert r.status_code == 200, r.text
    m = values()
    lab = '{engine="0",model_name="tiny"}'
    for ours, theirs in [("fluidserve_generation_tokens_total", "vllm:generation_tokens_total"),
                         ("fluidserve_num_requests_running", "vllm:num_requests_running"),
                         ("fluidserve_kv_cache_usage", "vllm:kv_cache_usage_perc"),
                         ("fluidserve_preemptions_total", "vllm:num_preemptions_total"),
                         ("fluidserve_time_to_first_token_seconds_count",
                          "vllm:time_to_first_token_seconds_count"),
                         ("fluidserve_time_between_tokens_seconds_count",
                          "vllm:inter_token_latency_seconds_count")]:
        assert m[ours] == m[theirs + lab], theirs
    key = 'vllm:request_success_total{engine="0",finished_reason="length",model_name="tiny"}'
    assert m[key] == before.get(key, 0) + 1
    grew = {k: m[k + lab] - before.get(k + lab, 0) for k in (
        "vllm:prompt_tokens_total", "vllm:request_prompt_tokens_sum",
        "vllm:request_generation_tokens_sum", "vllm:request_queue_time_seconds_count")}
    assert grew == {"vllm:prompt_tokens_total": 5, "vllm:request_prompt_tokens_sum": 5,
                    "vllm:request_generation_tokens_sum": 3,
                    "vllm:request_queue_time_seconds_count": 1}


def test_logprobs(client):
    r = client.completions.create(
        model="tiny",
        prompt=PROMPT,
        max_tokens=3,
        temperature=0,
        logprobs=2,
        extra_body={"ignore_eos": True},
    )
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == 3 and len(lp.top_logprobs[0]) == 2
    # Greedy: the sampled token is the most likely one.
    assert lp.token_logprobs[0] == pytest.approx(max(lp.top_logprobs[0].values()))
    # As OpenAI and vLLM: the sampled token is always among top_logprobs (logprobs + 1 at
    # most), so logprobs=0 gives it alone.
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=3, temperature=2.0,
                                  seed=1, logprobs=0, extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert lp.top_logprobs == [{t: v} for t, v in zip(lp.tokens, lp.token_logprobs,
                                                      strict=True)]
    c = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "x"}],
        max_tokens=2,
        logprobs=True,
        top_logprobs=3,
    )
    assert len(c.choices[0].logprobs.content) == 2
    assert len(c.choices[0].logprobs.content[0].top_logprobs) == 3


def test_streamed_text_offsets_are_the_full_responses_even_while_text_is_held(srv):
    # A stop string that might still complete holds text back; the offsets go by the tokens.
    body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
            "logprobs": 1, "stop": ["NEVER MATCHES"]}
    whole = httpx.post(srv.url + "/v1/completions", json=body, timeout=60).json()
    lp = whole["choices"][0]["logprobs"]
    assert lp["text_offset"] == [sum(map(len, lp["tokens"][:i])) for i in range(8)]
    streamed = []
    with httpx.stream("POST", srv.url + "/v1/completions", json=body | {"stream": True},
                      timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])["choices"][0]
                streamed += (chunk["logprobs"] or {}).get("text_offset", [])
    assert streamed == lp["text_offset"]


def test_greedy_over_http_equals_offline_generate(srv, tiny_model_dir):
    llm = LLM(model=str(tiny_model_dir), max_model_len=512)
    prompts = [PROMPT, "Why is the sky blue?", "A"]
    offline = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    for p, ref in zip(prompts, offline, strict=True):
        r = httpx.post(
            srv.url + "/v1/completions",
            json={
                "model": "tiny",
                "prompt": p,
                "max_tokens": 12,
                "temperature": 0,
                "ignore_eos": True,
            },
            timeout=60,
        ).json()
        assert r["choices"][0]["text"] == ref.text
    # The same prompt as token ids gives the same completion.
    ids = llm.tokenizer.encode(prompts[0])
    r = httpx.post(
        srv.url + "/v1/completions",
        json={"prompt": ids, "max_tokens": 12, "temperature": 0, "ignore_eos": True},
        timeout=60,
    ).json()
    assert r["choices"][0]["text"] == offline[0].text


def test_32_concurrent_streams_complete_with_requested_counts(srv):
    async def one(client: httpx.AsyncClient, i: int) -> tuple[int, int, int]:
        want = 4 + i % 9
        n_chunks = 0
        usage = None
        async with client.stream(
            "POST",
            "/v1/completions",
            json={
                "prompt": f"Request number {i}: " + "word " * (i % 7) * 5,
                "max_tokens": want,
                "ignore_eos": True,
                "stream": True,
                "temperature": 0.7,
                "seed": i,
                "stream_options": {"include_usage": True},
            },
        ) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                obj = json.loads(line[6:])
                if obj["choices"]:
                    n_chunks += 1
                if obj.get("usage"):
                    usage = obj["usage"]["completion_tokens"]
        return want, usage, n_chunks

    async def main():
        async with httpx.AsyncClient(base_url=srv.url, timeout=120) as c:
            return await asyncio.gather(*(one(c, i) for i in range(32)))

    results = asyncio.run(main())
    for want, got, n_chunks in results:
        assert got == want
        assert n_chunks <= want  # one chunk per token, minus tokens whose text was held back
    assert srv.kv_idle()


def test_client_disconnect_aborts_and_frees_kv(srv):
    with httpx.Client(base_url=srv.url, timeout=30) as c:
        with c.stream(
            "POST",
            "/v1/completions",
            json={"prompt": PROMPT, "max_tokens": 400, "ignore_eos": True, "stream": True},
        ) as r:
            lines = r.iter_lines()
            got = [next(lines) for _ in range(6)]
            assert any(x.startswith("data: ") for x in got)
            assert metric_values(httpx.get(srv.url + "/metrics").text)[
                "fluidserve_kv_cache_usage"] > 0
    assert srv.kv_idle(), "KV blocks of the aborted request came back"
    aborted = metric_values(httpx.get(srv.url + "/metrics").text)
    assert aborted['fluidserve_requests_total{outcome="abort"}'] >= 1


BAD = [
    ("malformed json", "/v1/completions", b'{"prompt": "x", ', 400),
    ("prompt wrong type", "/v1/completions", {"prompt": 12}, 400),
    ("max_tokens wrong type", "/v1/completions", {"prompt": "x", "max_tokens": "many"}, 400),
    ("negative max_tokens", "/v1/completions", {"prompt": "x", "max_tokens": -3}, 400),
    ("absurd max_tokens", "/v1/completions", {"prompt": "x", "max_tokens": 10**9}, 400),
    ("context overflow", "/v1/completions", {"prompt": "word " * 600, "max_tokens": 1}, 400),
    ("empty prompt", "/v1/completions", {"prompt": ""}, 400),
    ("empty token list", "/v1/completions", {"prompt": []}, 400),
    ("token id out of vocab", "/v1/completions", {"prompt": [1, 99999999]}, 400),
    ("missing prompt", "/v1/completions", {"max_tokens": 3}, 400),
    ("temperature too high", "/v1/completions", {"prompt": "x", "temperature": 7}, 400),
    ("top_p zero", "/v1/completions", {"prompt": "x", "top_p": 0}, 400),
    ("n over 128", "/v1/completions", {"prompt": "x", "n": 129}, 400),
    ("logprobs too many", "/v1/completions", {"prompt": "x", "logprobs": 99}, 400),
    ("min_tokens over max_tokens", "/v1/completions",
     {"prompt": "x", "max_tokens": 3, "min_tokens": 4}, 400),
    ("min_tokens over the default max_tokens", "/v1/completions",
     {"prompt": "x", "min_tokens": 17}, 400),
    ("empty stop string", "/v1/completions", {"prompt": "x", "stop": [""]}, 400),
    # Looked up for every token the request samples: bounded, and ids the model has.
    ("stop token id out of vocab", "/v1/completions",
     {"prompt": "x", "stop_token_ids": [99999999]}, 400),
    ("too many stop token ids", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "x"}], "stop_token_ids": [1] * 1025}, 400),
    ("unknown model", "/v1/completions", {"prompt": "x", "model": "gpt-9"}, 404),
    ("no messages", "/v1/chat/completions", {"messages": []}, 400),
    ("bad role", "/v1/chat/completions", {"messages": [{"role": "a b", "content": "x"}]}, 400),
    ("empty role", "/v1/chat/completions", {"messages": [{"role": "", "content": "x"}]}, 400),
    ("tool calls in the history", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [
         {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
         {"role": "tool", "tool_call_id": "c1", "content": "4"}]}, 400),
    ("body not an object", "/v1/chat/completions", [1, 2], 400),
    ("unknown route", "/v1/engines", {}, 404),
]


@pytest.mark.parametrize("name,path,body,status", BAD, ids=[b[0] for b in BAD])
def test_bad_input_gets_clear_error(srv, name, path, body, status):
    kw = (
        {"content": body, "headers": {"content-type": "application/json"}}
        if isinstance(body, bytes)
        else {"json": body}
    )
    r = httpx.post(srv.url + path, timeout=30, **kw)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and err["type"]
    assert httpx.get(srv.url + "/health").status_code == 200


def test_max_tokens_past_the_window_ends_the_completion_at_the_window(srv):
    """As vLLM serves it: the completion is cut to what the window leaves after the prompt,
    and ends on "length" there (it was a 400, and `vllm bench serve` runs whose lengths
    overflow the window failed against fluidserve alone)."""
    ids = list(range(10, 410))  # 400 tokens of a 512-token window
    r = httpx.post(srv.url + "/v1/completions", timeout=60, json={
        "prompt": ids, "max_tokens": 200, "ignore_eos": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["usage"] == {"prompt_tokens": 400, "completion_tokens": 112,
                             "total_tokens": 512}
    assert body["choices"][0]["finish_reason"] == "length"
    r = httpx.post(srv.url + "/v1/completions", timeout=60, json={
        "prompt": ids, "max_tokens": 200, "min_tokens": 150})
    assert r.status_code == 400 and r.json()["error"]["param"] == "min_tokens"
    assert "which is 112 (what the 512-token window leaves)" in r.json()["error"]["message"]
    # Text too, and the bound on its characters counts no max_tokens: 500 characters could
    # not fit beside 500 tokens, and are not refused for it.
    for path, field in (("/v1/completions", {"prompt": "word " * 100}),
                        ("/v1/chat/completions",
                         {"messages": [{"role": "user", "content": "word " * 100}]})):
        r = httpx.post(srv.url + path, timeout=60, json=field | {"max_tokens": 500,
                                                                 "ignore_eos": True})
        assert r.status_code == 200, r.text
        usage = r.json()["usage"]
        assert usage["prompt_tokens"] + usage["completion_tokens"] == 512, usage


def test_engine_exception_fails_requests_visibly_and_server_keeps_serving(srv):
    srv.engine.client.inject_fault("execute")
    r = httpx.post(
        srv.url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 5}, timeout=30
    )
    assert r.status_code == 500 and "injected execute fault" in r.json()["error"]["message"]
    srv.engine.client.inject_fault("execute")
    with httpx.stream(
        "POST",
        srv.url + "/v1/completions",
        timeout=30,
        json={"prompt": PROMPT, "max_tokens": 5, "stream": True},
    ) as s:
        events = [x for x in s.iter_lines() if x.startswith("data: ")]
    assert "injected execute fault" in events[-2] and events[-1] == "data: [DONE]"
    ok = httpx.post(
        srv.url + "/v1/completions",
        json={"prompt": PROMPT, "max_tokens": 3, "ignore_eos": True},
        timeout=30,
    )
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3
    assert srv.kv_idle()


def test_output_processing_fault_fails_only_its_request(srv):
    srv.engine.inject_fault("output")
    r = httpx.post(srv.url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 5},
                   timeout=30)
    assert r.status_code == 500 and "injected output fault" in r.json()["error"]["message"]
    ok = httpx.post(srv.url + "/v1/completions", timeout=30,
                    json={"prompt": PROMPT, "max_tokens": 3, "ignore_eos": True})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3
    assert httpx.get(srv.url + "/health").status_code == 200
    assert srv.kv_idle()


def test_metrics_fault_is_counted_and_fails_nobody(srv):
    def errors() -> float:
        m = metric_values(httpx.get(srv.url + "/metrics").text)
        return m.get('fluidserve_internal_errors_total{where="metrics"}', 0.0)

    before = errors()
    srv.engine.inject_fault("metrics")
    r = httpx.post(srv.url + "/v1/completions", timeout=30,
                   json={"prompt": PROMPT, "max_tokens": 4, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    assert errors() == before + 1
    assert httpx.get(srv.url + "/health").status_code == 200


def test_several_served_model_names_as_vllm(tiny_model_dir):
    """--served-model-name a b: requests may name either; responses carry the first; both
    are listed; another name is a 404 that lists them."""
    from fluidserve.cli import build_parser

    args = build_parser().parse_args(["serve", "--served-model-name", "a", "b"])
    assert args.served_model_name == ["a", "b"]
    with InProcessServer(tiny_model_dir, name=("first", "second")) as s:
        ids = [m["id"] for m in httpx.get(s.url + "/v1/models").json()["data"]]
        assert ids == ["first", "second"]
        body = {"model": "second", "prompt": "x", "max_tokens": 1}
        r = httpx.post(s.url + "/v1/completions", json=body, timeout=30)
        assert r.status_code == 200 and r.json()["model"] == "first"
        r = httpx.post(s.url + "/v1/completions", json=body | {"model": "third"}, timeout=30)
        assert r.status_code == 404
        assert "serves 'first', 'second'" in r.json()["error"]["message"]


def test_gate_checks_the_key_first_then_the_body_size(tiny_model_dir):
    with InProcessServer(tiny_model_dir, api_key="sekret", protect_metrics=True,
                         max_request_bytes=64 * 1024) as s:
        body = {"prompt": "x", "max_tokens": 1}
        key = {"Authorization": "Bearer sekret"}
        assert httpx.post(s.url + "/v1/completions", json=body).status_code == 401
        bad = httpx.post(
            s.url + "/v1/completions", json=body, headers={"Authorization": "Bearer nope"}
        )
        assert bad.status_code == 401 and bad.json()["error"]["type"] == "authentication_error"
        assert bad.headers["www-authenticate"] == "Bearer"
        # Without a key, neither the body, nor its size, nor the route matters: 401.
        for path, content in (("/v1/completions", b'{"prompt": '),
                              ("/v1/chat/completions", b'{"messages": []}'),
                              ("/v1/completions", b"x" * (1024 * 1024)),
                              ("/v1/no-such-route", b"{}")):
            r = httpx.post(s.url + path, content=content, timeout=30)
            assert r.status_code == 401, (path, r.status_code, r.text[:200])
            assert r.json()["error"]["type"] == "authentication_error"
        assert httpx.get(s.url + "/v1/models").status_code == 401
        assert httpx.get(s.url + "/metrics").status_code == 401  # --protect-metrics
        assert httpx.get(s.url + "/metrics", headers=key).status_code == 200
        assert httpx.get(s.url + "/health").status_code == 200  # health needs no key
        # With the key: the body-size limit, whether the size is announced or not.
        big = json.dumps({"prompt": "x" * 64 * 1024}).encode()

        def chunks():
            for i in range(0, len(big), 4096):
                yield big[i : i + 4096]

        for content in (big, chunks()):
            r = httpx.post(s.url + "/v1/completions", content=content, headers=key, timeout=30)
            assert r.status_code == 413 and r.json()["error"]["type"] == "request_too_large"
        # Then the usual answers.
        r = httpx.post(s.url + "/v1/completions", content=b'{"prompt": ', headers=key)
        assert r.status_code == 400
        good = httpx.post(s.url + "/v1/completions", json=body, timeout=30, headers=key)
        assert good.status_code == 200
        schema = httpx.get(s.url + "/openapi.json").json()
        ops = schema["paths"]["/v1/completions"]["post"]
        assert ops["security"] and "401" in ops["responses"]
        assert schema["paths"]["/metrics"]["get"]["security"]


def test_version_as_vllm(srv):
    import fluidserve

    r = httpx.get(srv.url + "/version")
    assert r.status_code == 200 and r.json() == {"version": fluidserve.__version__}
    schema = httpx.get(srv.url + "/openapi.json").json()
    assert schema["info"]["version"] == fluidserve.__version__
    assert "Version" in str(schema["paths"]["/version"]["get"]["responses"]["200"])


def test_metrics_stay_open_without_protect_metrics(srv):
    assert httpx.get(srv.url + "/metrics").status_code == 200


def test_overload_gets_503_and_nothing_is_lost(tiny_model_dir):
    with InProcessServer(tiny_model_dir, engine_kw={"max_num_seqs": 2},
                         max_waiting_requests=3) as s:

        async def one(c: httpx.AsyncClient, i: int):
            r = await c.post(
                "/v1/completions",
                json={"prompt": "word " * 100, "max_tokens": 8, "ignore_eos": True},
            )
            return r.status_code, r.json()

        async def main():
            async with httpx.AsyncClient(base_url=s.url, timeout=120) as c:
                return await asyncio.gather(*(one(c, i) for i in range(40)))

        results = asyncio.run(main())
        codes = [code for code, _ in results]
        assert set(codes) <= {200, 503} and 503 in codes and 200 in codes
        for code, body in results:
            if code == 200:
                assert body["usage"]["completion_tokens"] == 8
            else:
                assert "overloaded" in body["error"]["message"]
        assert s.kv_idle()
        m = metric_values(httpx.get(s.url + "/metrics").text)
        refused = 'fluidserve_requests_rejected_total{reason="%s"}'
        assert m[refused % "overloaded"] == codes.count(503)
        # Every refusal counts, whatever refused it: the schema, the model name, the length.
        for body in ({"prompt": 7}, {"prompt": "x", "model": "other"},
                     {"prompt": "word " * 600}):
            assert httpx.post(s.url + "/v1/completions", json=body).status_code in (400, 404)
        m = metric_values(httpx.get(s.url + "/metrics").text)
        assert m[refused % "invalid"] == 3


@pytest.mark.parametrize("extra, group", [
    (["--scheduler", "vllm"], False),
    # Ctrl-C, `timeout` and `kill -- -PGID` signal every process of the group: the engine's
    # processes must leave the shutdown to the front end, or the drain has nothing to drain.
    (["--disaggregate"], True)])
def test_cli_serve_drains_on_sigterm(tiny_model_dir, tmp_path, extra, group):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = open(tmp_path / "server.log", "w")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "fluidserve.cli",
            "serve",
            "--port",
            str(port),
            "--model",
            str(tiny_model_dir),
            "--served-model-name",
            "m",
            "--drain-timeout",
            "60",
            "--num-threads",
            "1",
            *extra,
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=os.environ | {"PYTHONUNBUFFERED": "1"},
        start_new_session=True,
    )
    try:
        wait_healthy(url, proc=proc)
        # 600 tokens: ~2 s of decoding on one thread, running through the signal and the drain.
        with httpx.stream(
            "POST",
            url + "/v1/completions",
            timeout=60,
            json={
                "model": "m",
                "prompt": PROMPT,
                "max_tokens": 600,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True},
            },
        ) as r:
            lines = r.iter_lines()
            first = next(x for x in lines if x.startswith("data: "))
            if group:
                os.killpg(proc.pid, signal.SIGTERM)
            else:
                proc.send_signal(signal.SIGTERM)
            time.sleep(0.3)
            refused = httpx.post(url + "/v1/completions", json={"prompt": "x"}, timeout=10)
            assert refused.status_code == 503
            rest = [first] + [x for x in lines if x.startswith("data: ")]
        assert rest[-1] == "data: [DONE]"
        usage = json.loads(rest[-2][6:])["usage"]
        assert usage["completion_tokens"] == 600, "the in-flight request finished in full"
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()


def test_model_eos_over_http_honours_ignore_eos_and_min_tokens(srv):
    srv.engine.client.force_eos({3, 6})  # the model "says" EOS twice

    def complete(**kw) -> tuple[str, int]:
        body = {"prompt": PROMPT, "max_tokens": 10, "temperature": 0} | kw
        r = httpx.post(srv.url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["finish_reason"], r.json()["usage"]["completion_tokens"]

    try:
        assert complete() == ("stop", 4)
        assert complete(ignore_eos=True) == ("length", 10)
        assert complete(min_tokens=3) == ("stop", 4)
        assert complete(min_tokens=4) == ("stop", 7)  # the first 4 tokens cannot stop it
        assert complete(min_tokens=5, ignore_eos=True) == ("length", 10)
    finally:
        srv.engine.client.force_eos(set())
    assert srv.kv_idle()


def sse_events(response) -> list[dict | str]:
    return [line[6:] if line == "data: [DONE]" else json.loads(line[6:])
            for line in response.iter_lines() if line.startswith("data: ")]


def test_stop_strings_in_streams(srv, tiny_model_dir):
    """A stop string that spans two tokens: the stream never shows any of it, one chunk
    arrives per token (text held back while it could still be a stop string), and the
    stream and the full response agree."""
    llm = LLM(model=str(tiny_model_dir), max_model_len=512)
    sampling = {"max_tokens": 40, "temperature": 1.0, "seed": 1, "ignore_eos": True}
    ids = llm.generate(PROMPT, SamplingParams(**sampling))[0].token_ids
    decode = llm.tokenizer.decode
    full = decode(ids)
    # The first two adjacent plain-text tokens whose joint text first appears there.
    for k in range(2, len(ids) - 1):
        a, b = decode([ids[k]]), decode([ids[k + 1]])
        stop = a[-2:] + b[:2]
        if (a + b).isascii() and min(len(a), len(b)) >= 3 and \
                full.find(stop) == len(decode(ids[: k + 1])) - 2:
            break
    else:
        pytest.fail("no stop string candidate in the sampled text")
    want_text, want_tokens = full[: full.find(stop)], k + 2
    body = {"prompt": PROMPT, "stop": ["no such text", stop], **sampling}
    with httpx.stream("POST", srv.url + "/v1/completions", timeout=60,
                      json=body | {"stream": True, "stream_options": {"include_usage": True}}
                      ) as r:
        events = sse_events(r)
    chunks = [e for e in events[:-1] if e["choices"]]
    assert events[-1] == "[DONE]" and events[-2]["usage"]["completion_tokens"] == want_tokens
    assert "".join(c["choices"][0]["text"] for c in chunks) == want_text
    assert len(chunks) == want_tokens
    assert [c["choices"][0]["finish_reason"] for c in chunks][-2:] == [None, "stop"]
    whole = httpx.post(srv.url + "/v1/completions", json=body, timeout=60).json()
    assert whole["choices"][0]["text"] == want_text
    assert whole["choices"][0]["finish_reason"] == "stop"
    assert whole["usage"]["completion_tokens"] == want_tokens
    assert srv.kv_idle()


def test_non_streaming_client_disconnect_aborts_and_frees_kv(srv):
    def aborted() -> float:
        return metric(metric_samples(srv.url), "fluidserve_requests_total", outcome="abort")

    def generated() -> float:
        return metric(metric_samples(srv.url), "fluidserve_generation_tokens_total")

    before, tokens_before = aborted(), generated()
    body = json.dumps({"prompt": PROMPT, "max_tokens": 480, "ignore_eos": True}).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json"
            f"\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    with socket.create_connection(("127.0.0.1", srv.port)) as sock:
        sock.sendall(head + body)
        deadline = time.monotonic() + 30
        while generated() == tokens_before:
            assert time.monotonic() < deadline, "the request never started generating"
            time.sleep(0.01)
    assert srv.kv_idle(), "the KV blocks of the abandoned request came back"
    assert aborted() == before + 1 and 0 < generated() - tokens_before < 480


def metric(values: dict, name: str, **labels) -> float:
    return values.get((name, tuple(sorted(labels.items()))), 0.0)


def test_metrics_values_after_known_traffic(tiny_model_dir):
    # 12 blocks of 8 tokens: four 40-token prompts generating 20 tokens each must preempt.
    kw = {"num_kv_blocks": 12, "token_budget": 16, "max_num_seqs": 4}
    with InProcessServer(tiny_model_dir, engine_kw=kw) as s:
        def complete(n_prompt: int, n_out: int) -> httpx.Response:
            body = {"prompt": list(range(5, 5 + n_prompt)), "max_tokens": n_out,
                    "ignore_eos": True, "temperature": 0}
            return httpx.post(s.url + "/v1/completions", json=body, timeout=120)

        # A stream the client abandons after a few tokens. Latencies are observed as tokens
        # come (before they reach the stream), not when the request ends.
        with httpx.stream("POST", s.url + "/v1/completions", timeout=60,
                          json={"prompt": [5] * 10, "max_tokens": 60, "ignore_eos": True,
                                "stream": True}) as r:
            events = (x for x in r.iter_lines() if x.startswith("data: "))
            next(events)
            next(events)
            live = metric_samples(s.url)
            assert metric(live, "fluidserve_time_to_first_token_seconds_count") == 1
            assert metric(live, "fluidserve_time_between_tokens_seconds_count") >= 1
            assert metric(live, "fluidserve_requests_total", outcome="abort") == 0
        assert s.kv_idle()
        m0 = metric_samples(s.url)
        aborted_tokens = metric(m0, "fluidserve_generation_tokens_total")
        assert metric(m0, "fluidserve_requests_total", outcome="abort") == 1
        assert 0 < aborted_tokens < 60

        def delta(m: dict, name: str, **labels) -> float:
            return metric(m, name, **labels) - metric(m0, name, **labels)

        # Two requests, one after the other: 20+5 and 30+7 tokens, in budget-16 iterations.
        assert complete(20, 5).status_code == complete(30, 7).status_code == 200
        m = metric_samples(s.url)
        assert delta(m, "fluidserve_requests_total", outcome="length") == 2
        assert delta(m, "fluidserve_generation_tokens_total") == 12
        assert delta(m, "fluidserve_time_to_first_token_seconds_count") == 2
        assert delta(m, "fluidserve_e2e_request_latency_seconds_count") == 2
        assert delta(m, "fluidserve_time_between_tokens_seconds_count") == 4 + 6
        # Iterations: 16+4 prompt tokens then 4 decodes; 16+14 then 6 decodes.
        new = "fluidserve_iteration_tokens_count", "fluidserve_iteration_tokens_sum"
        assert delta(m, new[0]) == 14
        assert delta(m, new[1]) == 20 + 4 + 30 + 6
        assert delta(m, "fluidserve_iteration_tokens_bucket", le="1.0") == 10
        assert metric(m, "fluidserve_iteration_tokens_bucket", le="16.0") == metric(m, new[0])
        ttft = delta(m, "fluidserve_time_to_first_token_seconds_sum")
        e2e = delta(m, "fluidserve_e2e_request_latency_seconds_sum")
        assert 0 < ttft < e2e
        assert metric(m, "fluidserve_preemptions_total") == 0
        assert metric(m, "fluidserve_token_budget") == 16

        async def burst():
            async with httpx.AsyncClient(base_url=s.url, timeout=120) as c:
                body = {"max_tokens": 20, "ignore_eos": True, "temperature": 0}
                return await asyncio.gather(*(
                    c.post("/v1/completions", json=body | {"prompt": [7 + i] * 40})
                    for i in range(4)))

        assert {r.status_code for r in asyncio.run(burst())} == {200}
        too_long = complete(100, 1)  # more KV blocks than the cache has: never admissible
        assert too_long.status_code == 400 and "KV blocks" in too_long.json()["error"]["message"]
        m = metric_samples(s.url)
        assert metric(m, "fluidserve_preemptions_total") > 0
        assert metric(m, "fluidserve_requests_total", outcome="length") == 6
        assert metric(m, "fluidserve_generation_tokens_total") == 12 + 80 + aborted_tokens
        assert metric(m, "fluidserve_requests_rejected_total", reason="invalid") == 1
        assert metric(m, "fluidserve_num_requests_running") == 0
        assert metric(m, "fluidserve_num_requests_waiting") == 0
        assert metric(m, "fluidserve_kv_cache_usage") == 0

        # A chat request without max_tokens gets the rest of the 2048-token window only as
        # far as the 96-token cache can hold it (as vLLM's does; it refuses so small a cache).
        chat = httpx.post(s.url + "/v1/chat/completions", timeout=120, json={
            "messages": [{"role": "user", "content": "Hi"}], "ignore_eos": True})
        assert chat.status_code == 200, chat.text
        usage = chat.json()["usage"]
        assert usage["prompt_tokens"] + usage["completion_tokens"] - 1 == 12 * 8
        assert chat.json()["choices"][0]["finish_reason"] == "length"


def test_a_tokenizer_past_the_models_vocabulary_is_a_400_not_a_500(tiny_model_dir):
    # The embedded model's 4096-token tokenizer before the tiny model's 1334-token vocabulary:
    # the engine core refused such prompts, and the client saw an internal error.
    from fluidserve.model.builder import default_model_dir

    with InProcessServer(tiny_model_dir, engine_kw={"tokenizer": str(default_model_dir())}) as s:
        r = httpx.post(s.url + "/v1/completions", timeout=60, json={
            "prompt": "Wherefore art thou, gentle Romeo? The king hath sent for thee.",
            "max_tokens": 2})
        assert r.status_code == 400, r.text
        assert "outside the model's vocabulary of 1334" in r.json()["error"]["message"]
        ok = httpx.post(s.url + "/v1/completions", timeout=60,
                        json={"prompt": [5, 6, 7], "max_tokens": 2})
        assert ok.status_code == 200, ok.text


def test_drain_timeout_fails_what_is_still_running(tiny_model_dir, tmp_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = open(tmp_path / "server.log", "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "fluidserve.cli", "serve", "--port", str(port), "--model",
         str(tiny_model_dir), "--drain-timeout", "1"],
        stdout=log, stderr=subprocess.STDOUT, env=os.environ | {"PYTHONUNBUFFERED": "1"},
    )
    try:
        wait_healthy(url, proc=proc)
        body = {"prompt": PROMPT, "max_tokens": 1500, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", timeout=60, json=body) as r:
            lines = (x for x in r.iter_lines() if x.startswith("data: "))
            next(lines)
            t0 = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            events = [(time.monotonic() - t0, x[6:]) for x in lines]
        assert events[-1][1] == "[DONE]"
        failed_at, last = events[-2]
        err = json.loads(last)["error"]
        assert "shutting down" in err["message"] and err["code"] == 503, err
        tokens = [t for t, e in events[:-2]]
        assert len(tokens) < 1500, "the request was failed before it could finish"
        assert failed_at >= 0.9, "it was failed only after the drain timeout"
        assert any(0.3 < t < 0.9 for t in tokens), "it kept generating while draining"
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        log.close()


def test_a_sigterm_while_the_server_starts_drains_it_once_it_has(tiny_model_dir, tmp_path):
    """Between the start-up signal handlers and uvicorn's, a SIGTERM was ignored: the server
    then served on for good. It is kept and drains the server as soon as it runs."""
    # The signal comes as the server object is made: after the handlers, before the server
    # they could hand it to exists.
    code = ("import os, signal, sys\n"
            "import fluidserve.serve.server as s\n"
            "init = s.DrainingServer.__init__\n"
            "def term_then_init(self, *args):\n"
            "    os.kill(os.getpid(), signal.SIGTERM)\n"
            "    init(self, *args)\n"
            "s.DrainingServer.__init__ = term_then_init\n"
            "from fluidserve.cli import main\n"
            "sys.exit(main(sys.argv[1:]))\n")
    with open(tmp_path / "serve.log", "w") as log:
        proc = subprocess.Popen([sys.executable, "-c", code, "serve", "--port",
                                 str(free_port()), "--model", str(tiny_model_dir)],
                                stdout=log, stderr=subprocess.STDOUT)
        try:
            assert proc.wait(120) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
    out = (tmp_path / "serve.log").read_text()
    assert "draining 0 in-flight requests" in out, out[-3000:]


def test_a_broken_tokenizer_stops_the_engine_core_it_loaded_beside(tiny_model_dir, tmp_path):
    """The server starts its engine core first and loads the tokenizer while the core loads
    the model; a tokenizer that cannot be loaded is a clear error and leaves no core behind.
    Without tokenizer files nothing is started at all."""
    import multiprocessing as mp
    import shutil

    from fluidserve.config import EngineConfig, ServerConfig
    from fluidserve.model.arch import ModelLoadError
    from fluidserve.serve.server import start_engine

    def cores() -> list:
        return [p for p in mp.active_children() if p.name == "fluidserve-engine-core"]

    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    (model / "tokenizer.json").write_text("{not json")
    config = EngineConfig.create(model=str(model), max_model_len=256, num_threads=1)
    before = set(cores())  # cores of other tests' servers may end meanwhile: only new ones count
    with pytest.raises(ModelLoadError, match="cannot load tokenizer"):
        start_engine(config, ServerConfig(port=free_port()))
    assert not set(cores()) - before, "the engine core was left running"
    (model / "tokenizer.json").unlink()
    with pytest.raises(ModelLoadError, match="no tokenizer files"):
        start_engine(config, ServerConfig(port=free_port()))
    assert not set(cores()) - before


def test_connections_to_the_servers_socket_send_small_writes_at_once():
    """`fluidserve serve` hands uvicorn the socket it bound: asyncio turns Nagle's algorithm off
    on the connections it accepts only when that socket is a TCP one by protocol. With it on,
    a stream's first event reached the client ~40 ms late and tokens came in bursts."""
    from fluidserve.serve.server import listen_socket

    async def nodelay() -> int:
        sock = listen_socket("127.0.0.1", free_port())
        accepted = asyncio.get_running_loop().create_future()

        class Probe(asyncio.Protocol):
            def connection_made(self, transport) -> None:
                s = transport.get_extra_info("socket")
                accepted.set_result(s.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))

        server = await asyncio.get_running_loop().create_server(Probe, sock=sock)
        try:
            _, writer = await asyncio.open_connection(*sock.getsockname()[:2])
            value = await asyncio.wait_for(accepted, 10)
            writer.close()
            return value
        finally:
            server.close()

    assert asyncio.run(nodelay()) != 0


def test_a_killed_server_leaves_no_body_parser_behind(tiny_model_dir):
    """The process that parses large bodies held both ends of its own work queue: a server
    killed with SIGKILL left it running, and with it the server's output open (a reader of
    that output, `fluidserve serve | tee` or a supervisor, waited for ever)."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "fluidserve.cli", "serve", "--port", str(port), "--model",
         str(tiny_model_dir), "--num-threads", "1"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:  # (reading no output: it is read at the end)
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        raw = json.dumps({"prompt": "hi", "junk": [{"a": 1}] * 20_000}).encode()  # > 64 KiB
        r = httpx.post(url + "/tokenize", content=raw, timeout=60,
                       headers={"content-type": "application/json"})
        assert r.status_code == 200, r.text
        os.kill(proc.pid, signal.SIGKILL)
        proc.communicate(timeout=30)  # every holder of its output has ended
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
