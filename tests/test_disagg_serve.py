"""A served disaggregated deployment (`fluidserve serve --disaggregate`): prefill and decode
instances in processes of their own, KV moved between them over torch.distributed (gloo) or
shared memory, one OpenAI-compatible front end. Greedy outputs equal the colocated engine's;
aborts, failed transfers and dying instances end requests with errors and free every block."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import httpx
import pytest
import torch

from fluidserve.config import ConfigError, EngineConfig
from fluidserve.disagg.client import check_served
from fluidserve.disagg.transfer import ShmTransport, gather_blocks, scatter_blocks

from .server_utils import start_servers, stop_servers

BASE = dict(max_model_len=512, block_size=8, num_threads=1)
PROMPTS = ["The quick brown fox", "Once upon a time " * 6, "a b c d e f g " * 20,
           "Hello", "To be or not to be, that is the question " * 3, "1 2 3 4 5 6 7 8 9 10"]
MAX_TOKENS = [12, 20, 8, 24, 16, 10]


@pytest.fixture(scope="module")
def deployments(tiny_model_dir, tmp_path_factory):
    """1 prefill + 2 decode instances over gloo (chunks of 16, KV sent chunk by chunk), the
    same with instance flips (KV sent per request), and 1 + 1 over shared memory (chunks of
    64, KV sent chunk by chunk, 48 KV blocks an instance) writing a request log."""
    log = tmp_path_factory.mktemp("log") / "requests.jsonl"
    specs = {
        "flip": dict(engine_kw=BASE | dict(
            disaggregate=True, num_decode_instances=2, prefill_chunk_size=16,
            instance_flip=True, flip_window=0.3, flip_prefill_backlog=2.0,
            monitor_interval=0.05)),
        "gloo": dict(engine_kw=BASE | dict(disaggregate=True, num_decode_instances=2,
                                           prefill_chunk_size=16, kv_transfer_timeout=20,
                                           kv_transfer_granularity="chunk")),
        "shm": dict(engine_kw=BASE | dict(disaggregate=True, kv_transport="shm",
                                          prefill_chunk_size=64, num_kv_blocks=48,
                                          kv_transfer_granularity="chunk"),
                    request_log=str(log)),
    }
    servers = start_servers(tiny_model_dir, specs)
    yield servers
    stop_servers(servers)


@pytest.fixture(scope="module")
def reference(tiny_model_dir) -> list[str]:
    """The colocated engine's greedy outputs."""
    from fluidserve.engine.llm import LLM
    from fluidserve.sampling_params import SamplingParams

    llm = LLM(config=EngineConfig.create(model=str(tiny_model_dir), token_budget=64, **BASE))
    return [llm.generate([p], SamplingParams(max_tokens=n, ignore_eos=True,
                                             temperature=0.0))[0].text
            for p, n in zip(PROMPTS, MAX_TOKENS, strict=True)]


def body(i: int, **kw) -> dict:
    return {"model": "tiny", "prompt": PROMPTS[i], "max_tokens": MAX_TOKENS[i],
            "temperature": 0.0, "ignore_eos": True} | kw


async def complete_all(url: str) -> list[str]:
    """Every prompt at once, half of them streamed."""
    async with httpx.AsyncClient(base_url=url, timeout=60) as c:
        async def one(i: int) -> str:
            if i % 2:
                r = await c.post("/v1/completions", json=body(i))
                assert r.status_code == 200, r.text
                return r.json()["choices"][0]["text"]
            text = ""
            async with c.stream("POST", "/v1/completions", json=body(i, stream=True)) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        text += json.loads(line[6:])["choices"][0]["text"]
            return text

        return list(await asyncio.gather(*(one(i) for i in range(len(PROMPTS)))))


@pytest.mark.parametrize("name", ["gloo", "shm"])
def test_served_disaggregation_equals_the_colocated_engine(deployments, reference, name):
    s = deployments[name]
    assert asyncio.run(complete_all(s.url)) == reference
    assert s.kv_idle(), "KV blocks or requests left on an instance"
    client = s.engine.client
    assert not client._where and not client._decoder
    assert not any(client._outstanding(i) for i in range(len(client.roles)))
    # Prompts longer than a chunk went to their decode instance while still prefilling.
    assert client.early_handoffs >= 1
    if s.engine.request_log is not None:  # what `fluidserve train-predictor` learns from
        lines = [json.loads(x) for x in open(s.engine.request_log._file.name)]
        assert sorted(x["generated"] for x in lines) == sorted(MAX_TOKENS)
        assert {x["finish_reason"] for x in lines} == {"length"}
        assert all(x["num_prompt_tokens"] == len(x["prompt_token_ids"]) > 0 for x in lines)


def test_a_request_no_single_instance_can_hold_is_refused_up_front(deployments):
    """A request lives on one instance at a time: the instances' caches together (96 blocks
    here) are not what it can use, one instance's (48) is."""
    s = deployments["shm"]
    big = body(3, max_tokens=400)  # 4 + 400 tokens: 51 blocks of 8
    r = httpx.post(s.url + "/v1/completions", json=big, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "context_length_exceeded"
    assert "48 admissible blocks" in r.json()["error"]["message"]
    ok = httpx.post(s.url + "/v1/completions", json=body(3, max_tokens=300), timeout=60)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 300
    # Prompt logprobs are not computed by the instances: a 400 that says so, not a failure.
    scored = httpx.post(s.url + "/v1/completions", timeout=30,
                        json=body(3, max_tokens=2) | {"echo": True, "logprobs": 1})
    assert scored.status_code == 400 and scored.json()["error"]["param"] == "echo"
    assert s.kv_idle()


def test_a_client_leaving_mid_stream_frees_its_blocks_everywhere(deployments):
    s = deployments["gloo"]
    long = {"model": "tiny", "prompt": PROMPTS[2], "max_tokens": 400, "ignore_eos": True,
            "stream": True}
    with httpx.stream("POST", s.url + "/v1/completions", json=long, timeout=30) as r:
        events = 0
        for line in r.iter_lines():
            events += line.startswith("data: ")
            if events == 5:  # decoding on a decode instance by now
                break
    assert s.kv_idle(), "the aborted request still holds KV blocks"


@pytest.mark.parametrize("point", ["kv_send", "kv_recv"])
def test_a_failed_transfer_fails_its_request_and_nothing_else(deployments, point):
    s = deployments["gloo"]
    s.engine.inject_fault(point)
    r = httpx.post(s.url + "/v1/completions", json=body(0), timeout=30)
    assert r.status_code >= 500 and "KV transfer" in r.json()["error"]["message"], r.text
    s.engine.inject_fault(point, times=0)  # disarm it on the instances that did not trip
    ok = httpx.post(s.url + "/v1/completions", json=body(1), timeout=30)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == MAX_TOKENS[1]
    assert s.kv_idle()


def kill_decoder_mid_stream(s) -> tuple[int, str]:
    """Stream a long request, SIGKILL the decode instance holding it after 5 events; the
    victim and the error that ended the stream."""
    client = s.engine.client
    long = {"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 400, "ignore_eos": True,
            "stream": True}
    with httpx.stream("POST", s.url + "/v1/completions", json=long, timeout=30) as r:
        lines = r.iter_lines()
        for _ in range(5):
            next(x for x in lines if x.startswith("data: "))
        holders = {i for where in client._where.values() for i in where
                   if client.roles[i] == "decode"}
        assert len(holders) == 1
        victim = holders.pop()
        os.kill(client.instances[victim].proc.pid, signal.SIGKILL)
        events = [x for x in lines if x.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    error = json.loads(events[-2][6:])["error"]
    assert error["code"] == 503, error  # the server's state, not the request's: retry
    return victim, error["message"]


def test_a_dying_decode_instance_fails_its_requests_and_the_rest_go_on(deployments):
    s = deployments["gloo"]
    client = s.engine.client
    victim, error = kill_decoder_mid_stream(s)
    assert f"decode instance {victim}" in error, error
    # The other decode instance takes the next requests; the server stays healthy.
    for i in (1, 3):
        r = httpx.post(s.url + "/v1/completions", json=body(i), timeout=30)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == MAX_TOKENS[i]
    assert httpx.get(s.url + "/health").status_code == 200
    assert not s.dead.is_set()
    # Without a prefill instance nothing can run: the deployment is dead, and says so.
    os.kill(client.instances[0].proc.pid, signal.SIGKILL)
    assert s.dead.wait(10)
    assert httpx.get(s.url + "/health").status_code == 503
    for c in client.instances:
        assert gone(c.proc.pid), f"{c.proc.name} was left running"


def test_a_request_whose_decode_instance_dies_before_its_kv_arrives_finishes_elsewhere(
        tiny_model_dir, reference):
    """Its prefill instance still holds its KV: it dispatches it again, and the client gets
    the full output, the colocated engine's, as if nothing had happened."""
    from concurrent.futures import ThreadPoolExecutor

    spec = dict(engine_kw=BASE | dict(disaggregate=True, num_decode_instances=2,
                                      prefill_chunk_size=16))
    servers = start_servers(tiny_model_dir, {"redispatch": spec})
    try:
        s = servers["redispatch"]
        client = s.engine.client
        victim = client.roles.index("decode")
        pid = client.instances[victim].proc.pid
        os.kill(pid, signal.SIGSTOP)  # it takes requests in, and posts no receive

        def held() -> bool:
            return any(victim in where for where in list(client._where.values()))

        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            sent = []
            for i in range(len(PROMPTS)):  # one at a time, until one is dispatched there
                sent.append(pool.submit(httpx.post, s.url + "/v1/completions", json=body(i),
                                        timeout=60))
                while not sent[-1].done() and not held():
                    time.sleep(0.01)
                if held():
                    break
            assert held(), "no request was dispatched to the stopped decode instance"
            os.kill(pid, signal.SIGKILL)
            replies = [f.result() for f in sent]
        for i, r in enumerate(replies):
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] == reference[i]
        assert client.redispatched == 1
        assert s.kv_idle() and not client._where
        assert httpx.get(s.url + "/health").status_code == 200
    finally:
        stop_servers(servers)


def gone(pid: int, timeout: float = 10.0) -> bool:
    """Whether the process has ended (exited or a zombie) within ``timeout`` (whichever thread
    of this process reaps it)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] in "ZX":
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.05)
    return False


def test_instances_placed_by_ray_serve_the_colocated_outputs_and_leave_nothing(
        tiny_model_dir, reference):
    pytest.importorskip("ray")
    spec = dict(engine_kw=BASE | dict(disaggregate=True, distributed_executor_backend="ray",
                                      prefill_chunk_size=32, kv_transfer_granularity="chunk"))
    servers = start_servers(tiny_model_dir, {"ray": spec})
    try:
        s = servers["ray"]
        assert asyncio.run(complete_all(s.url)) == reference
        assert s.kv_idle()
        client = s.engine.client
        pids = [c.proc.pid for c in client.instances]
        # Ray's worker processes, not children of the front end.
        assert len(set(pids)) == 2 and not set(pids) & set(children(os.getpid()))
        # A placed instance that dies is noticed as a local one is: its stream ends with an
        # error naming it, and without a decode instance the deployment is dead.
        victim, error = kill_decoder_mid_stream(s)
        assert victim == 1 and "decode instance 1" in error, error
        assert s.dead.wait(10)
    finally:
        stop_servers(servers)
    for pid in pids:
        assert gone(pid), f"instance process {pid} was left running"


def children(pid: int) -> list[int]:
    kids = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            kids += [int(k) for k in f.read().split()]
    return kids


def test_what_a_served_deployment_does_not_support_is_a_clear_error():
    with pytest.raises(ConfigError, match="one process"):
        check_served(EngineConfig.create(disaggregate=True, tensor_parallel_size=2))
    with pytest.raises(ConfigError, match="runs on the CPU"):
        check_served(EngineConfig.create(disaggregate=True, device="cuda"))


def test_the_offline_engine_refuses_a_disaggregated_config_instead_of_ignoring_it():
    from fluidserve.engine.llm import LLM

    with pytest.raises(ConfigError, match="fluidserve serve --disaggregate"):
        LLM(config=EngineConfig.create(disaggregate=True))


def kv_caches(blocks: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(blocks, 2, 4, 8, generator=g).bfloat16(),
             torch.randn(blocks, 2, 8, 4, generator=g).bfloat16()) for _ in range(3)]


def test_blocks_gathered_on_one_side_land_in_other_blocks_on_the_other():
    src, dst = kv_caches(10, 0), kv_caches(10, 1)
    before = [(k.clone(), v.clone()) for k, v in dst]
    staged = gather_blocks(src, (7, 2, 5))
    scatter_blocks(dst, (0, 9, 4), staged)
    for (sk, sv), (dk, dv), (bk, bv) in zip(src, dst, before, strict=True):
        for a, b in ((7, 0), (2, 9), (5, 4)):
            assert torch.equal(dk[b], sk[a]) and torch.equal(dv[b], sv[a])
        untouched = [b for b in range(10) if b not in (0, 9, 4)]
        assert torch.equal(dk[untouched], bk[untouched])
        assert torch.equal(dv[untouched], bv[untouched])
    with pytest.raises(ValueError, match="does not fit"):
        scatter_blocks(dst, (0, 1), staged)


def test_shared_memory_transport_delivers_the_bytes_and_cleans_up():
    t = ShmTransport(f"test-{os.getpid()}")
    data = torch.randn(3, 2, 4, 64).bfloat16()
    recv = t.recv(tuple(data.shape), data.dtype, src=0, tag=7)
    assert not recv.done()
    assert t.send(data, dst=1, tag=7).done()
    assert recv.done() and torch.equal(recv.tensor, data)
    name = recv.shm.name
    recv.close()
    assert not os.path.exists(f"/dev/shm/{name.lstrip('/')}")
    recv = t.recv((2,), torch.bfloat16, src=0, tag=8)
    with pytest.raises(ValueError, match="expects 4 bytes"):
        t.send(data, dst=1, tag=8)
    recv.close()


FLIP_PROMPTS = [f"item {i} " * 50 for i in range(16)]
FLIP_TOKENS = [4 + 3 * i for i in range(16)]


@pytest.fixture(scope="module")
def flip_reference(tiny_model_dir) -> list[str]:
    from fluidserve.engine.llm import LLM
    from fluidserve.sampling_params import SamplingParams

    llm = LLM(config=EngineConfig.create(model=str(tiny_model_dir), token_budget=64, **BASE))
    return [o.text for o in llm.generate(
        FLIP_PROMPTS, [SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.0)
                       for n in FLIP_TOKENS])]


def test_a_decode_instance_flips_to_prefill_under_a_prompt_backlog_and_loses_nothing(
        deployments, flip_reference):
    """Long prompts swamp the one prefill instance: after the flip window a decode instance
    drains (finishing what it decodes) and becomes a prefill instance; requests sent before,
    during and after the flip all end with exactly their greedy outputs."""
    s = deployments["flip"]
    client = s.engine.client

    async def main() -> list[tuple[str, int]]:
        async with httpx.AsyncClient(base_url=s.url, timeout=120) as c:
            async def one(i: int) -> tuple[str, int]:
                r = await c.post("/v1/completions", json={
                    "model": "tiny", "prompt": FLIP_PROMPTS[i], "max_tokens": FLIP_TOKENS[i],
                    "temperature": 0.0, "ignore_eos": True})
                assert r.status_code == 200, r.text
                j = r.json()
                return j["choices"][0]["text"], j["usage"]["completion_tokens"]

            first = [asyncio.create_task(one(i)) for i in range(8)]
            for _ in range(1000):  # the flip, done while the first requests run
                if client.flips:
                    break
                await asyncio.sleep(0.01)
            second = [asyncio.create_task(one(i)) for i in range(8, 16)]
            return list(await asyncio.gather(*first, *second))

    results = asyncio.run(main())
    assert [t for t, _ in results] == flip_reference
    assert [n for _, n in results] == FLIP_TOKENS
    assert client.flips and client.flips[0][2] == "prefill", client.flips
    flipped = client.flips[0][1]
    assert client.roles[flipped] == "prefill" and client.roles.count("decode") == 1
    assert client.routed[flipped] > 0, "the new prefill instance took no prompts"
    assert s.kv_idle()
