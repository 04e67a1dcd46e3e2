"""The OpenAI-compatible server over real HTTP on localhost."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import httpx
import openai
import pytest

from fluidserve.engine.llm import LLM
from fluidserve.sampling_params import SamplingParams

from .server_utils import InProcessServer, free_port, metric_values, wait_healthy

PROMPT = "The river rose slowly in the spring, and the people of the valley"


@pytest.fixture(scope="module")
def srv(default_model_dir):
    with InProcessServer(default_model_dir, max_waiting_requests=1000) as s:
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
    c = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "x"}],
        max_tokens=2,
        logprobs=True,
        top_logprobs=3,
    )
    assert len(c.choices[0].logprobs.content) == 2
    assert len(c.choices[0].logprobs.content[0].top_logprobs) == 3


def test_greedy_over_http_equals_offline_generate(srv, default_model_dir):
    llm = LLM(model=str(default_model_dir), max_model_len=512)
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
    ("context overflow", "/v1/completions", {"prompt": "word " * 400, "max_tokens": 200}, 400),
    ("empty prompt", "/v1/completions", {"prompt": ""}, 400),
    ("empty token list", "/v1/completions", {"prompt": []}, 400),
    ("token id out of vocab", "/v1/completions", {"prompt": [1, 99999999]}, 400),
    ("missing prompt", "/v1/completions", {"max_tokens": 3}, 400),
    ("temperature too high", "/v1/completions", {"prompt": "x", "temperature": 7}, 400),
    ("top_p zero", "/v1/completions", {"prompt": "x", "top_p": 0}, 400),
    ("n > 1", "/v1/completions", {"prompt": "x", "n": 3}, 400),
    ("logprobs too many", "/v1/completions", {"prompt": "x", "logprobs": 99}, 400),
    ("empty stop string", "/v1/completions", {"prompt": "x", "stop": [""]}, 400),
    ("unknown model", "/v1/completions", {"prompt": "x", "model": "gpt-9"}, 404),
    ("no messages", "/v1/chat/completions", {"messages": []}, 400),
    ("bad role", "/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400),
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


def test_gate_checks_the_key_first_then_the_body_size(default_model_dir):
    with InProcessServer(default_model_dir, api_key="sekret", protect_metrics=True,
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


def test_metrics_stay_open_without_protect_metrics(srv):
    assert httpx.get(srv.url + "/metrics").status_code == 200


def test_overload_gets_503_and_nothing_is_lost(default_model_dir):
    with InProcessServer(default_model_dir, engine_kw={"max_num_seqs": 2},
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


def test_cli_serve_drains_on_sigterm(default_model_dir, tmp_path):
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
            str(default_model_dir),
            "--served-model-name",
            "m",
            "--scheduler",
            "vllm",
            "--drain-timeout",
            "60",
            "--num-threads",
            "1",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=os.environ | {"PYTHONUNBUFFERED": "1"},
    )
    try:
        wait_healthy(url, proc=proc)
        with httpx.stream(
            "POST",
            url + "/v1/completions",
            timeout=60,
            json={
                "model": "m",
                "prompt": PROMPT,
                "max_tokens": 1500,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True},
            },
        ) as r:
            lines = r.iter_lines()
            first = next(x for x in lines if x.startswith("data: "))
            proc.send_signal(signal.SIGTERM)
            time.sleep(0.3)
            refused = httpx.post(url + "/v1/completions", json={"prompt": "x"}, timeout=10)
            assert refused.status_code == 503
            rest = [first] + [x for x in lines if x.startswith("data: ")]
        assert rest[-1] == "data: [DONE]"
        usage = json.loads(rest[-2][6:])["usage"]
        assert usage["completion_tokens"] == 1500, "the in-flight request finished in full"
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        log.close()
