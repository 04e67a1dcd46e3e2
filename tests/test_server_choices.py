"""Several choices in one response: a list of prompts, n samples of each (as vLLM serves them)."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from fluidserve.engine.llm import LLM
from fluidserve.sampling_params import SamplingParams

from .server_utils import InProcessServer, metric_values

PROMPTS = ["The river rose slowly in the spring", "Why is the sky blue?", "A"]


@pytest.fixture(scope="module")
def srv(tiny_model_dir):
    with InProcessServer(tiny_model_dir, max_waiting_requests=64) as s:
        yield s


def post(srv, path: str, body: dict) -> httpx.Response:
    return httpx.post(srv.url + path, json=body, timeout=60)


def events(srv, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", srv.url + path, json=body | {"stream": True}, timeout=60) as r:
        assert r.status_code == 200, r.read()
        lines = [x[6:] for x in r.iter_lines() if x.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(x) for x in lines[:-1]]


def test_a_list_of_prompts_gives_each_its_n_choices_in_order(srv, tiny_model_dir):
    """Choice i × n + j is prompt i's sample j; greedy samples are the offline greedy
    completion; the usage counts each prompt once and every choice's tokens."""
    llm = LLM(model=str(tiny_model_dir), max_model_len=512)
    want = [o.text for o in llm.generate(
        PROMPTS, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))]
    ids = llm.tokenizer.encode(PROMPTS[1])
    r = post(srv, "/v1/completions", {"prompt": [PROMPTS[0], PROMPTS[1], PROMPTS[2]], "n": 2,
                                      "max_tokens": 6, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert [c["index"] for c in body["choices"]] == list(range(6))
    assert [c["text"] for c in body["choices"]] == [w for w in want for _ in range(2)]
    prompt_tokens = sum(len(llm.tokenizer.encode(p)) for p in PROMPTS)
    assert body["usage"] == {"prompt_tokens": prompt_tokens, "completion_tokens": 36,
                             "total_tokens": prompt_tokens + 36}
    # Token ids, several lists of them, are prompts as well.
    r = post(srv, "/v1/completions", {"prompt": [ids, ids], "max_tokens": 6, "temperature": 0,
                                      "ignore_eos": True})
    assert [c["text"] for c in r.json()["choices"]] == [want[1]] * 2
    assert srv.kv_idle()


def test_seeded_samples_are_the_seeds_of_vllms_children(srv):
    """With a seed, sample j is what a request of its own with seed + j gives (as vLLM
    seeds the samples of n): reproducible, and not n copies of one."""
    common = {"prompt": PROMPTS[0], "max_tokens": 8, "temperature": 1.0, "ignore_eos": True}
    got = [c["text"] for c in post(srv, "/v1/completions",
                                   common | {"n": 3, "seed": 41}).json()["choices"]]
    alone = [post(srv, "/v1/completions", common | {"seed": 41 + j}).json()["choices"][0]["text"]
             for j in range(3)]
    assert got == alone and len(set(got)) == 3
    # Near the top of int64, the seeds wrap rather than overflow.
    top = post(srv, "/v1/completions", common | {"n": 2, "seed": 2**63 - 1})
    wrapped = post(srv, "/v1/completions", common | {"seed": -(2**63)})
    assert top.json()["choices"][1]["text"] == wrapped.json()["choices"][0]["text"]


def test_a_chat_stream_of_n_choices_carries_each_as_its_index(srv):
    body = {"messages": [{"role": "user", "content": "Tell me a story"}], "n": 3, "seed": 7,
            "max_tokens": 5, "ignore_eos": True, "stream_options": {"include_usage": True}}
    chunks = events(srv, "/v1/chat/completions", body)
    whole = post(srv, "/v1/chat/completions", body | {"stream_options": None}).json()
    texts, roles, reasons = {}, [], {}
    for c in chunks[:-1]:
        (choice,) = c["choices"]
        assert c["id"] == chunks[0]["id"]
        if "role" in choice["delta"]:
            roles.append(choice["index"])
        texts[choice["index"]] = texts.get(choice["index"], "") + choice["delta"].get(
            "content", "")
        if choice["finish_reason"]:
            reasons[choice["index"]] = choice["finish_reason"]
    assert roles == [0, 1, 2] and reasons == {0: "length", 1: "length", 2: "length"}
    assert [texts[i] for i in range(3)] == [c["message"]["content"] for c in whole["choices"]]
    usage = chunks[-1]["usage"]
    assert not chunks[-1]["choices"] and usage["completion_tokens"] == 15
    assert usage == whole["usage"]  # the prompt once, though three samples were drawn from it
    assert srv.kv_idle()


def test_the_openai_client_reads_several_choices(srv):
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
    r = client.completions.create(model="tiny", prompt=PROMPTS[:2], n=2, max_tokens=3,
                                  best_of=1, extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert all(c.finish_reason == "length" for c in r.choices)
    assert r.usage.completion_tokens == 12


def test_one_bad_prompt_refuses_the_whole_request_and_runs_none(srv):
    before = metric_values(httpx.get(srv.url + "/metrics").text)
    r = post(srv, "/v1/completions", {"prompt": [[1, 2], [3] * 600], "max_tokens": 2})
    err = r.json()["error"]
    assert r.status_code == 400 and err["code"] == "context_length_exceeded"
    assert err["param"] == "prompt.1", err
    r = post(srv, "/v1/completions", {"prompt": ["fine", "word " * 600], "max_tokens": 2})
    err = r.json()["error"]
    assert r.status_code == 400 and err["code"] == "context_length_exceeded"
    assert err["param"] == "prompt.1" and err["message"].startswith(
        "prompt.1: This model's maximum context length is 512 tokens. The prompt has")
    r = post(srv, "/v1/completions", {"prompt": ["fine", "also"], "max_tokens": 2,
                                      "min_tokens": 3})
    assert r.status_code == 400 and r.json()["error"]["param"] == "min_tokens"
    after = metric_values(httpx.get(srv.url + "/metrics").text)
    ran = [k for k in after if k.startswith("fluidserve_requests_total")
           and after[k] != before.get(k, 0)]
    assert ran == [], ran


def test_more_choices_than_may_wait_is_a_400_naming_the_limit(srv):
    r = post(srv, "/v1/completions", {"prompt": ["a"] * 33, "n": 2, "max_tokens": 1})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "n"
    assert "66 choices" in err["message"] and "--max-waiting-requests" in err["message"]
    assert post(srv, "/v1/completions", {"prompt": ["a"] * 32, "n": 2,
                                         "max_tokens": 1}).status_code == 200


def test_a_client_leaving_aborts_every_choice(srv):
    body = {"prompt": PROMPTS[0], "n": 4, "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        seen = set()
        while len(seen) < 4:  # every choice has begun
            line = next(lines)
            if line.startswith("data: "):
                seen.add(json.loads(line[6:])["choices"][0]["index"])
    assert srv.kv_idle(), "KV blocks of the aborted choices came back"


def test_a_choice_that_fails_ends_the_response_and_its_siblings(srv):
    srv.engine.inject_fault("output")
    r = post(srv, "/v1/completions", {"prompt": PROMPTS[0], "n": 3, "max_tokens": 50,
                                      "ignore_eos": True})
    assert r.status_code == 500 and "injected output fault" in r.json()["error"]["message"]
    assert srv.kv_idle()  # (the siblings' last outputs, processed, may not trip the next fault)
    srv.engine.inject_fault("output")
    chunks = events(srv, "/v1/completions", {"prompt": PROMPTS[0], "n": 3, "max_tokens": 50,
                                             "ignore_eos": True})
    assert "injected output fault" in chunks[-1]["error"]["message"]
    assert srv.kv_idle()


def test_a_large_response_is_built_off_the_event_loop_and_reads_the_same(srv, monkeypatch):
    """Past LARGE_RESPONSE entries a non-streamed response is built and encoded on a worker
    thread (so streams are not held up by it): the same JSON either way."""
    import threading

    from fluidserve.serve import handlers

    body = {"prompt": PROMPTS, "n": 2, "max_tokens": 5, "temperature": 0, "logprobs": 2,
            "echo": True, "ignore_eos": True, "return_metrics": True}
    threads = []
    real = handlers.R.full_response

    def spy(choices):
        threads.append(threading.current_thread())
        return real(choices)

    monkeypatch.setattr(handlers.R, "full_response", spy)
    answers = []
    for bound in (10**9, 0):
        monkeypatch.setattr(handlers, "LARGE_RESPONSE", bound)
        r = post(srv, "/v1/completions", body)
        assert r.status_code == 200 and r.headers["content-type"] == "application/json"
        answers.append(r.json())
    assert [a["choices"] for a in answers] == [answers[0]["choices"]] * 2
    assert answers[0]["usage"] == answers[1]["usage"] and "metrics" in answers[1]
    on_loop, off_loop = threads
    assert off_loop is not on_loop  # (the event loop's thread, then a worker's)
