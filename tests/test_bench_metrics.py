"""Etalon metrics on hand-computed timelines, the capacity search, workloads, and the client."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math

import httpx
import numpy as np
import pytest

from fluidserve.bench.capacity import curve_point, delay_stats, search_capacity, slo_check
from fluidserve.bench.client import Client, ClientConfig, RequestRecord, arrival_gaps
from fluidserve.bench.fluidity import (
    deadline_counts,
    fluid_token_rate,
    fluidity_index,
    min_tbt_deadline,
)
from fluidserve.bench.report import summarize_run
from fluidserve.bench.workload import (
    TETRI_DECODE_THRESHOLD,
    TETRI_PROMPT_THRESHOLD,
    WorkloadRequest,
    WorkloadSpec,
    build_workload,
)
from fluidserve.config import CapacityConfig, ConfigError
from fluidserve.metrics import percentile, request_latency

# Deadlines chosen so every number below is exact in binary floating point.
DP, DD = 1.0, 0.25


def test_on_time_stream_is_fully_fluid():
    assert deadline_counts([0.5, 0.25, 0.125, 0.25], DP, DD) == (0, 4)
    assert fluidity_index([0.5, 0.25, 0.125, 0.25], DP, DD) == 1.0


def test_slack_from_early_tokens_absorbs_a_later_delay():
    # The first token is 0.5 s early, so a 0.75 s gap (3 x D_d) still meets its deadline.
    assert deadline_counts([0.5, 0.75], DP, DD) == (0, 2)
    assert deadline_counts([1.0, 0.75], DP, DD) == (3, 4)  # no slack: 3 deadlines elapsed


def test_a_stall_costs_the_same_early_or_late():
    early = [0.5, 1.5, 0.25, 0.25, 0.25, 0.25]
    late = [0.5, 0.25, 0.25, 0.25, 0.25, 1.5]
    # 1.5 s gap with 0.5 s of banked slack: 1.0 s late = 4 elapsed D_d, charged once each.
    assert deadline_counts(early, DP, DD) == (4, 9)
    assert deadline_counts(late, DP, DD) == (4, 9)
    assert fluidity_index(early, DP, DD) == pytest.approx(5 / 9)


def test_a_miss_rebases_later_deadlines_on_the_late_token():
    # After the stall, tokens on a D_d cadence from the late token are on time again.
    assert deadline_counts([1.0, 1.0, 0.25, 0.25], DP, DD) == (4, 7)
    # Without re-basing, the two tokens after it would also have been late.


def test_missed_first_token_is_charged_per_elapsed_tbt_deadline():
    assert deadline_counts([1.5], DP, DD) == (3, 3)  # 1 + floor(0.5 / 0.25)
    assert fluidity_index([1.5], DP, DD) == 0.0


def test_bundled_tokens_count_each_token():
    # A chunk carrying three tokens after 0.75 s: gaps 0.75, 0, 0.
    assert deadline_counts([0.5, 0.75, 0.0, 0.0], DP, DD) == (0, 4)
    assert deadline_counts([1.0, 0.75, 0.0, 0.0], DP, DD) == (3, 6)


def test_zero_length_outputs():
    assert fluidity_index([], DP, DD) == 1.0
    assert min_tbt_deadline([0.3]) == 0.0
    lat = request_latency(0.0, [])
    assert lat.ttft is None and lat.tbt == [] and lat.tpot is None
    assert math.isnan(percentile([], 50))
    rate, d = fluid_token_rate([[0.3]])
    assert math.isnan(rate) and math.isnan(d)
    s = summarize_run([RequestRecord(0, 10, 5, 0.0, 0.0, error="boom")], 0.2, 1.0)
    assert s["num_failed"] == 1 and s["num_completed"] == 0 and s["errors"] == {"boom": 1}
    s = summarize_run([RequestRecord(0, 10, 5, 0.0, 0.0, error="boom")], 0.2)
    assert s["request_throughput"] == s["output_token_throughput"] == 0.0  # served nothing


def test_min_tbt_deadline_is_the_smallest_fluid_deadline():
    gaps = [0.2] + [0.05] * 30 + [0.8] + [0.05] * 30
    d = min_tbt_deadline(gaps)
    assert fluidity_index([0.0] + gaps[1:], 0.0, d) >= 0.9
    assert deadline_counts([0.0] + gaps[1:], 0.0, d * 0.999, ignore_first=True)[0] > 0.1 * 61
    # Steady 50 ms tokens: fluid at 50 ms, so the rate is 20 tokens/s.
    rate, d2 = fluid_token_rate([[0.1] + [0.05] * 20] * 5)
    assert d2 == pytest.approx(0.05, rel=1e-3) and rate == pytest.approx(20, rel=1e-3)


def test_the_fluid_rate_is_the_deadline_at_which_99_percent_of_requests_are_fluid():
    smooth, slow = [0.1] + [0.05] * 20, [0.1] + [0.2] * 20
    # Ten requests: 99% of them is all ten, so the slow one sets the deadline (an
    # interpolated quantile gave 0.1865 s, at which only nine were fluid).
    assert fluid_token_rate([smooth] * 9 + [slow]) == pytest.approx((5.0, 0.2), rel=1e-3)
    # 100 requests: one may miss.
    assert fluid_token_rate([smooth] * 99 + [slow])[1] == pytest.approx(0.05, rel=1e-3)
    # A failed request is fluid at no deadline: one in 100 is allowed, two are not.
    assert fluid_token_rate([smooth] * 99, num_failed=1)[1] == pytest.approx(0.05, rel=1e-3)
    assert fluid_token_rate([smooth] * 98, num_failed=2) == (0.0, math.inf)
    records = [RequestRecord(i, 10, 20, 0.0, 0.0) for i in range(98)]
    for r in records:
        r.gaps = list(smooth)
    records += [RequestRecord(98 + i, 10, 20, 0.0, 0.0, error="timed out") for i in range(2)]
    s = summarize_run(records, 0.2, 10.0)
    assert s["num_failed"] == 2 and s["fluid_token_generation_rate"] == 0.0
    # Every token bundled into the first chunk: fluid at any deadline, found at once.
    assert min_tbt_deadline([0.3] + [0.0] * 1000) == 0.0


def test_capacity_search_on_a_monotone_oracle():
    calls = []

    def oracle(rate):
        calls.append(rate)
        return rate <= 7.3, {}

    res = search_capacity(oracle, start=1.0)
    assert res["converged"] and res["capacity_qps"] <= 7.3 <= res["upper_bound_qps"]
    assert (res["upper_bound_qps"] - res["capacity_qps"]) / res["capacity_qps"] <= 0.025
    assert len(calls) <= 20 and calls[:4] == [1.0, 2.0, 4.0, 8.0]
    down = search_capacity(lambda r: (r <= 0.3, {}), start=4.0)
    assert down["capacity_qps"] <= 0.3 <= down["upper_bound_qps"]
    never = search_capacity(lambda r: (False, {}), start=1.0, max_probes=6)
    assert never["capacity_qps"] == 0.0 and never["num_probes"] == 6 and not never["converged"]
    capped = search_capacity(lambda r: (r <= 1000, {}), start=1.0, max_probes=5)
    assert capped["capacity_qps"] == 16.0 and capped["upper_bound_qps"] is None


def test_capacity_reports_what_the_probes_served():
    """A server that completes at most 1.6 req/s: below that it serves the offered rate, above
    it saturates. The search reports the most it served and that it saturated, whatever its
    latency SLO says (here one that holds to 2.5 req/s); a search that never pushed it to its
    limit says so; probes without a throughput (an oracle) report none."""
    def server(rate):
        return rate <= 2.5, {"request_throughput": min(rate, 1.6)}

    res = search_capacity(server, start=1.0, max_probes=4)
    assert [p["rate"] for p in res["probes"]] == [1.0, 2.0, 4.0, 3.0]
    assert res["capacity_qps"] == 2.0 and res["most_served_qps"] == 1.6 and res["saturated"]
    light = search_capacity(server, start=0.25, max_probes=2)
    assert light["most_served_qps"] == 0.5 and light["saturated"] is False
    # A probe where every request failed served nothing (its throughput NaN in old runs).
    failed = search_capacity(lambda r: (r < 8, {"request_throughput": math.nan if r >= 8
                                                else min(r, 3.3)}), start=8.0, max_probes=3)
    assert failed["most_served_qps"] == 3.3 and failed["saturated"]
    blind = search_capacity(lambda r: (r <= 2, {}), start=1.0, max_probes=3)
    assert blind["most_served_qps"] is None and blind["saturated"] is None
    assert curve_point(2.0, True, 0.15, {"request_throughput": 1.6}) == \
        {"rate": 2.0, "value": 0.15, "ok": True, "served_qps": 1.6}


def test_the_downward_search_stops_at_the_lowest_rate():
    # Every probe sends the whole workload, so halving forever would run for days: the
    # served search stops at --min-rate (start / 16 by default) and says so.
    calls = []
    res = search_capacity(lambda r: (calls.append(r), (False, {}))[1], start=1.0,
                          min_rate=CapacityConfig().lowest_rate)
    assert calls == [1.0, 0.5, 0.25, 0.125, 0.0625]
    assert res["capacity_qps"] == 0.0 and res["below_min_rate"] and not res["converged"]
    calls.clear()
    uneven = search_capacity(lambda r: (calls.append(r), (False, {}))[1], start=1.0,
                             min_rate=0.1)
    assert calls == [1.0, 0.5, 0.25, 0.125, 0.1] and uneven["upper_bound_qps"] == 0.1
    # A capacity above the floor is found as before, and the floor is not reported.
    found = search_capacity(lambda r: (r <= 0.2, {}), start=1.0, min_rate=0.0625)
    assert 0.19 < found["capacity_qps"] <= 0.2 and not found["below_min_rate"]
    assert CapacityConfig(start_rate=2.0).lowest_rate == 0.125
    with pytest.raises(ConfigError, match="min_rate"):
        CapacityConfig(start_rate=1.0, min_rate=2.0)


def test_slo_checks():
    s = {"num_completed": 10, "num_failed": 0, "tbt_s": {"p99": 0.09},
         "scheduling_delay_s": {"p50": 1.0}, "ttft_s": {"p50": 3.0, "p99": 4.0},
         "tpot_s": {"p99": 0.05}, "fraction_fluid_requests": 0.995}
    assert slo_check(CapacityConfig(slo="tbt", tbt_slo=0.1))(s)[0]
    assert not slo_check(CapacityConfig(slo="tbt", tbt_slo=0.08))(s)[0]
    assert not slo_check(CapacityConfig(slo="tbt", max_scheduling_delay=0.5))(s)[0]
    assert slo_check(CapacityConfig(slo="fluidity"))(s)[0]
    assert not slo_check(CapacityConfig(slo="ttft", ttft_slo=3.5))(s)[0]
    assert slo_check(CapacityConfig(slo="tpot", tpot_slo=0.06))(s)[0]
    assert not slo_check(CapacityConfig(slo="tpot", tpot_slo=0.06))(s | {"num_failed": 1})[0]


def test_the_delay_bound_says_what_it_bounds():
    s = {"num_completed": 10, "num_failed": 0, "tbt_s": {"p99": 0.09},
         "scheduling_delay_s": {"p50": 1.0}, "ttft_s": {"p50": 3.0, "p99": 4.0}}
    # fluidserve reports its scheduling delay (1 s); another engine only its TTFT (3 s).
    assert delay_stats(CapacityConfig(), s) == ("scheduling", {"p50": 1.0})
    assert slo_check(CapacityConfig())(s)[0]
    other = s | {"scheduling_delay_s": None}
    assert delay_stats(CapacityConfig(), other)[0] == "ttft"
    assert not slo_check(CapacityConfig())(other)[0]
    # Judging both engines alike: the TTFT for both.
    assert not slo_check(CapacityConfig(delay_metric="ttft"))(s)[0]
    assert slo_check(CapacityConfig(delay_metric="ttft", max_scheduling_delay=3.0))(other)[0]
    with pytest.raises(ValueError, match="--delay-metric ttft"):
        slo_check(CapacityConfig(delay_metric="scheduling"))(other)


def test_one_token_outputs_bound_no_gap():
    # No request has a second token: there is no TBT or TPOT to bound, so those SLOs hold
    # (they used to compare NaN and fail at every rate); a run with nothing completed fails.
    nan = {"p50": math.nan, "p90": math.nan, "p99": math.nan}
    s = {"num_completed": 20, "num_failed": 0, "tbt_s": nan, "tpot_s": nan,
         "scheduling_delay_s": {"p50": 0.1}, "ttft_s": {"p50": 0.2, "p99": 0.3}}
    assert slo_check(CapacityConfig(slo="tbt"))(s)[0]
    assert slo_check(CapacityConfig(slo="tpot"))(s)[0]
    assert not slo_check(CapacityConfig(slo="tbt"))(s | {"num_failed": 1})[0]
    assert not slo_check(CapacityConfig(slo="tbt"))(s | {"num_completed": 0})[0]
    # The same summary read back from a probe cache, where JSON holds NaN as null.
    null = json.loads(json.dumps({k: None for k in nan}))
    assert slo_check(CapacityConfig(slo="tbt"))(s | {"tbt_s": null, "tpot_s": null})[0]
    assert slo_check(CapacityConfig(slo="tpot"))(s | {"tbt_s": null, "tpot_s": null})[0]


def test_the_slo_percentile_is_one_a_summary_carries():
    assert CapacityConfig(slo_percentile=90).slo_percentile == 90
    with pytest.raises(ConfigError, match="50.0, 90.0, 99.0"):
        CapacityConfig(slo_percentile=95)


def test_workloads_are_seeded_and_shaped():
    a, src = build_workload(WorkloadSpec(num_prompts=300, request_rate=4.0, seed=5))
    b, _ = build_workload(WorkloadSpec(num_prompts=300, request_rate=4.0, seed=5))
    c, _ = build_workload(WorkloadSpec(num_prompts=300, request_rate=4.0, seed=6))
    assert a == b and a != c
    gaps = np.diff([r.arrival for r in a])
    assert np.mean(gaps) == pytest.approx(0.25, rel=0.15)  # Poisson at 4 req/s
    bursty, _ = build_workload(WorkloadSpec(num_prompts=4000, request_rate=4.0, burstiness=0.25))
    g = np.diff([r.arrival for r in bursty])
    assert np.std(g) / np.mean(g) == pytest.approx(2.0, rel=0.15)  # CV = 1/sqrt(0.25)
    flat, _ = build_workload(WorkloadSpec(num_prompts=10))
    assert all(r.arrival == 0 for r in flat)
    fixed, _ = build_workload(WorkloadSpec(dataset="fixed", num_prompts=5, input_len=77,
                                           output_len=9))
    assert {(r.prompt_len, r.output_len) for r in fixed} == {(77, 9)}
    clipped, _ = build_workload(WorkloadSpec(dataset="arxiv", num_prompts=200,
                                             max_prompt_len=1000, max_output_len=50))
    assert max(r.prompt_len for r in clipped) <= 1000 and max(r.output_len for r in clipped) <= 50


@pytest.mark.parametrize("cls", ["LPLD", "LPHD", "HPLD", "HPHD"])
def test_tetri_classes(cls):
    reqs, _ = build_workload(WorkloadSpec(dataset=cls, num_prompts=50, max_prompt_len=8192,
                                          max_output_len=8192))
    heavy_p = all(r.prompt_len >= TETRI_PROMPT_THRESHOLD for r in reqs)
    light_p = all(r.prompt_len < TETRI_PROMPT_THRESHOLD for r in reqs)
    heavy_d = all(r.output_len >= TETRI_DECODE_THRESHOLD for r in reqs)
    light_d = all(r.output_len < TETRI_DECODE_THRESHOLD for r in reqs)
    assert (heavy_p if cls[0] == "H" else light_p) and (heavy_d if cls[2] == "H" else light_d)


def test_a_dataset_path_is_the_trace_or_the_pool_of_the_classes(tmp_path):
    path = tmp_path / "lengths.csv"
    rows = [(100, 20), (2000, 300), (150, 400), (3000, 50)] * 5
    path.write_text("num_prefill_tokens,num_decode_tokens\n" +
                    "".join(f"{p},{o}\n" for p, o in rows))
    trace, src = build_workload(WorkloadSpec(dataset="sharegpt", dataset_path=str(path),
                                             num_prompts=20, max_prompt_len=8192))
    assert src == str(path) and sorted((r.prompt_len, r.output_len) for r in trace) == \
        sorted(rows)
    lpld, src = build_workload(WorkloadSpec(dataset="LPLD", dataset_path=str(path),
                                            num_prompts=10, max_prompt_len=8192))
    assert {(r.prompt_len, r.output_len) for r in lpld} == {(100, 20)} and str(path) in src
    with pytest.raises(ValueError, match="--dataset-path gives the lengths of a trace"):
        WorkloadSpec(dataset="fixed", dataset_path=str(path))


def test_a_dataset_path_that_is_missing_or_a_directory_says_which(tmp_path):
    for path, why in ((tmp_path / "none.csv", "does not exist"),
                      (tmp_path, "is a directory, not a CSV file")):
        with pytest.raises(ValueError, match=why):
            build_workload(WorkloadSpec(dataset="sharegpt", dataset_path=str(path),
                                        num_prompts=2))


def test_a_trace_with_rows_out_of_time_order_is_replayed_in_time_order(tmp_path):
    path = tmp_path / "trace.csv"
    rows = [(30.0, 300, 3), (10.0, 100, 1), (40.0, 400, 4), (20.0, 200, 2)]
    path.write_text("arrived_at,num_prefill_tokens,num_decode_tokens\n" +
                    "".join(f"{t},{p},{o}\n" for t, p, o in rows))
    reqs, _ = build_workload(WorkloadSpec(dataset="sharegpt", dataset_path=str(path),
                                          num_prompts=4, arrivals="trace"))
    assert [(r.arrival, r.prompt_len, r.output_len) for r in reqs] == [
        (0.0, 100, 1), (10.0, 200, 2), (20.0, 300, 3), (30.0, 400, 4)]


def test_trace_arrivals_replay_a_contiguous_slice_of_the_trace(tmp_path):
    """A burst stays a burst: rows k..k+n-1 with their own gaps (a random sample of rows
    thinned bursts towards Poisson arrivals); past the trace's end it plays again."""
    path = tmp_path / "trace.csv"
    times = [0, 1, 1.1, 1.2, 1.3, 9, 20, 20.05, 20.1, 40]
    path.write_text("arrived_at,num_prefill_tokens,num_decode_tokens\n" +
                    "".join(f"{t},{100 + i},{i + 1}\n" for i, t in enumerate(times)))
    starts = set()
    for seed in range(12):
        reqs, _ = build_workload(WorkloadSpec(dataset="sharegpt", dataset_path=str(path),
                                              num_prompts=4, arrivals="trace", seed=seed))
        k = reqs[0].prompt_len - 100
        assert [r.prompt_len for r in reqs] == [100 + k + i for i in range(4)]
        assert [r.arrival for r in reqs] == pytest.approx([t - times[k] for t in
                                                           times[k:k + 4]])
        starts.add(k)
    assert len(starts) > 3  # the seed picks where the slice starts
    reqs, _ = build_workload(WorkloadSpec(dataset="sharegpt", dataset_path=str(path),
                                          num_prompts=12, arrivals="trace"))
    assert [r.output_len for r in reqs] == [*range(1, 11), 1, 2]
    assert [r.arrival for r in reqs[9:]] == pytest.approx([40, 40 + 40 / 9, 41 + 40 / 9])


def test_trace_standins_work_without_data_files(monkeypatch, tmp_path):
    monkeypatch.setenv("FLUIDSERVE_DATA_DIR", str(tmp_path))
    reqs, src = build_workload(WorkloadSpec(dataset="sharegpt", num_prompts=3000,
                                            max_prompt_len=100000, max_output_len=100000))
    assert "stand-in" in src
    # The stand-in reproduces the trace's medians (sharegpt: 1730 prompt, 415 output).
    assert np.median([r.prompt_len for r in reqs]) == pytest.approx(1730, rel=0.08)
    assert np.median([r.output_len for r in reqs]) == pytest.approx(415, rel=0.08)
    with pytest.raises(ValueError, match="no arrival timestamps"):
        build_workload(WorkloadSpec(dataset="splitwise_conv", num_prompts=5, arrivals="trace"))


def sse(*objs) -> bytes:
    return b"".join(b"data: " + json.dumps(o).encode() + b"\n\n" for o in objs) + \
        b"data: [DONE]\n\n"


def test_client_counts_bundled_chunks_and_records_errors():
    def chunk(text, done=None, usage=None):
        return {"choices": [{"index": 0, "text": text, "finish_reason": done}], "usage": usage}

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        if body["prompt"] == "bad":
            return httpx.Response(400, json={"error": {"message": "nope", "type": "x"}})
        if body["prompt"] == "plain":  # no usage per chunk: final usage reconciles
            return httpx.Response(200, content=sse(chunk("a"), chunk("b c", "length"),
                                                   {"choices": [], "usage": {
                                                       "prompt_tokens": 3,
                                                       "completion_tokens": 4}}))
        return httpx.Response(200, content=sse(
            chunk("x", usage={"completion_tokens": 1}),
            chunk("yyy", usage={"completion_tokens": 4}),
            chunk("", "length", usage={"completion_tokens": 4})))

    client = Client(ClientConfig("http://test"), transport=httpx.MockTransport(handler))
    work = [WorkloadRequest(i, 0.0, 3, 4) for i in range(3)]
    recs = asyncio.run(client.run(work, ["bundled", "plain", "bad"]))
    assert recs[0].num_output_tokens == 4 and recs[0].gaps[2:] == [0.0, 0.0]
    assert recs[1].num_output_tokens == 4 and len(recs[1].gaps) == 4
    assert recs[2].error == "HTTP 400: nope" and recs[2].gaps == []


def slow_sse(*objs, delay: float = 0.05, done: bool = True):
    """The chunks of ``sse`` one at a time, ``delay`` apart."""
    async def gen():
        for o in objs:
            await asyncio.sleep(delay)
            yield b"data: " + json.dumps(o).encode() + b"\n\n"
        if done:
            yield b"data: [DONE]\n\n"
    return gen()


def chat_chunk(delta: dict, reason=None) -> dict:
    return {"choices": [{"index": 0, "delta": delta, "finish_reason": reason}]}


def test_a_reasoning_stream_is_timed_token_by_token():
    # A reasoning model streams delta.reasoning_content; only the final usage counts tokens.
    async def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=slow_sse(
            chat_chunk({"role": "assistant", "content": ""}),
            *[chat_chunk({"reasoning_content": "t"}) for _ in range(3)],
            {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 3}}))

    client = Client(ClientConfig("http://test", endpoint="/v1/chat/completions"),
                    transport=httpx.MockTransport(handler))
    rec = asyncio.run(client.run([WorkloadRequest(0, 0.0, 3, 3)], ["p"]))[0]
    assert rec.ok and rec.num_output_tokens == 3
    assert rec.gaps[0] >= 0.09 and min(rec.gaps[1:]) >= 0.04  # not bundled at time zero


def test_streams_cut_short_or_aborted_are_failures_and_bad_chunks_fail_one_request():
    def chunk(text, reason=None, n=None):
        usage = None if n is None else {"completion_tokens": n}
        return {"choices": [{"index": 0, "text": text, "finish_reason": reason}], "usage": usage}

    def handler(request: httpx.Request) -> httpx.Response:
        prompt = json.loads(request.content)["prompt"]
        if prompt == "cut":  # the connection closes after 2 of 10 tokens, no [DONE]
            return httpx.Response(200, content=slow_sse(chunk("a", n=1), chunk("b", n=2),
                                                         delay=0, done=False))
        if prompt == "abort":
            return httpx.Response(200, content=sse(chunk("a", "abort", 1)))
        if prompt == "array":  # valid JSON, not an object
            return httpx.Response(200, content=b"data: [1, 2]\n\n")
        if prompt == "event":  # an SSE error event whose data names no "error"
            return httpx.Response(200, content=b'data: {"choices": [{"text": "a"}]}\n\n'
                                  b'event: error\ndata: {"message": "overloaded"}\n\n'
                                  b"data: [DONE]\n\n")
        return httpx.Response(200, content=sse(chunk("a", n=1) | {"metrics": None,
                                                                   "error": None},
                                               chunk("b", "length", 2)))

    client = Client(ClientConfig("http://test"), transport=httpx.MockTransport(handler))
    work = [WorkloadRequest(i, 0.0, 3, 10) for i in range(5)]
    cut, abort, array, ok, event = asyncio.run(client.run(work, ["cut", "abort", "array", "ok",
                                                                 "event"]))
    assert event.error is not None and "overloaded" in event.error
    assert cut.error == "the stream ended before its [DONE] after 2 tokens"
    assert len(cut.gaps) == 2  # what arrived still counts in the TBT statistics
    assert abort.error == "the server ended the stream with finish_reason 'abort'"
    assert array.error.startswith("ValueError: a stream chunk is not a JSON object")
    assert ok.ok and ok.num_output_tokens == 2


def test_reconciling_with_the_servers_count_keeps_every_arrival_time():
    chunks = [(0.1 * i, 1) for i in range(1, 7)]  # six chunks, 0.1 s apart, one token each
    # The server counted 12: each chunk carried two.
    assert arrival_gaps(chunks, 0.0, 12) == pytest.approx([0.1, 0] * 6)
    # The server counted 3: three pairs of chunks were one token each; the first and the last
    # arrival times stay, so TTFT and the end-to-end latency do too.
    gaps = arrival_gaps([(0.1, 1), (0.2, 2), (0.25, 1), (0.4, 1), (0.6, 1)], 0.0, 3)
    assert len(gaps) == 3 and gaps[0] == pytest.approx(0.1) and sum(gaps) == pytest.approx(0.6)
    # Nothing was counted (text the client could not see): the tokens came with the last chunk.
    assert arrival_gaps([(0.2, 0), (0.5, 0)], 0.0, 2) == pytest.approx([0.5, 0.0])
    assert arrival_gaps(chunks, 0.0, None) == pytest.approx([0.1] * 6)


def test_each_run_after_the_first_sends_other_text_of_the_same_lengths(monkeypatch):
    # Else a server with prefix caching answers every later capacity probe from its cache.
    from fluidserve.bench import run as bench_run
    from fluidserve.config import BenchConfig

    monkeypatch.setattr(bench_run, "server_model", lambda cfg: ("m", None, None))
    bench = bench_run.Bench(BenchConfig(base_url="http://test", num_prompts=4, input_len=40,
                                        output_len=2, warmup_requests=0), quiet=True)
    seen: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(json.loads(request.content)["prompt"])
        return httpx.Response(200, content=sse({"choices": [{"index": 0, "text": "a b"}],
                                                "usage": {"completion_tokens": 2}}))

    bench.client.transport = httpx.MockTransport(handler)
    assert bench.run()[1]["num_completed"] == 4
    first = sorted(seen)
    seen.clear()
    assert bench.run(8.0)[1]["num_completed"] == 4
    assert first == sorted(bench.prompts) and not set(first) & set(seen)
    count = bench.builder.count
    assert sorted(map(count, first)) == sorted(map(count, seen)) == [40] * 4


def test_vllms_random_dataset_and_flags():
    """--dataset-name random --random-input-len/--random-output-len/--random-range-ratio, as
    `vllm bench serve` takes them: uniform lengths, all the same unless given a range."""
    from fluidserve.bench.run import workload_spec
    from fluidserve.bench.workload import build_workload
    from fluidserve.cli import build_parser
    from fluidserve.cli_args import dataclass_from_args
    from fluidserve.config import BenchConfig

    def lengths(*flags):
        cfg = dataclass_from_args(BenchConfig, build_parser().parse_args(
            ["bench", "--num-prompts", "50", *flags]))
        work = build_workload(workload_spec(cfg))[0]
        return {w.prompt_len for w in work}, {w.output_len for w in work}

    assert lengths("--dataset-name", "random", "--random-input-len", "100",
                   "--random-output-len", "20") == ({100}, {20})
    prompts, outputs = lengths("--dataset-name", "random", "--random-input-len", "100",
                               "--random-output-len", "20", "--random-range-ratio", "0.5")
    assert len(prompts) > 10 and 50 <= min(prompts) and max(prompts) <= 150
    prompts, _ = lengths("--dataset-name", "uniform", "--input-len", "100")
    assert len(prompts) > 10 and 50 <= min(prompts) and max(prompts) <= 150  # 0.5 by default


def test_the_api_key_defaults_to_openai_api_key(monkeypatch):
    from fluidserve.bench import run as bench_run
    from fluidserve.config import BenchConfig

    seen = []
    monkeypatch.setattr(bench_run, "server_model",
                        lambda cfg: seen.append(cfg.api_key) or ("m", None, None))
    monkeypatch.setenv("OPENAI_API_KEY", "from-env")
    cfg = BenchConfig(base_url="http://test", num_prompts=1, warmup_requests=0)
    assert bench_run.Bench(cfg, quiet=True).client.cfg.api_key == "from-env"
    bench_run.Bench(dataclasses.replace(cfg, api_key="given"), quiet=True)
    assert seen == ["from-env", "given"]


def test_requests_are_cut_to_the_servers_window_output_first():
    from fluidserve.bench.run import WINDOW_MARGIN, fit_window
    from fluidserve.bench.workload import WorkloadRequest

    room = 100 - WINDOW_MARGIN
    work = [WorkloadRequest(0, 0.0, 20, 10), WorkloadRequest(1, 0.0, 50, 40),
            WorkloadRequest(2, 0.0, 500, 40)]
    cut, n = fit_window(work, 100)
    assert [(w.prompt_len, w.output_len) for w in cut] == [(20, 10), (50, room - 50),
                                                            (room - 1, 1)]
    assert n == 2 and fit_window(work, None) == (work, 0)


def test_the_timeout_bounds_the_whole_request():
    # A stream that never stalls for long but never ends: no read times out, the request must.
    async def trickle():
        for i in range(1000):
            yield b"data: " + json.dumps({"choices": [{"index": 0, "text": "x"}],
                                          "usage": {"completion_tokens": i + 1}}).encode()
            yield b"\n\n"
            await asyncio.sleep(0.02)

    async def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=trickle())

    client = Client(ClientConfig("http://test", timeout=0.3),
                    transport=httpx.MockTransport(handler))
    rec = asyncio.run(client.run([WorkloadRequest(0, 0.0, 3, 10000)], ["p"]))[0]
    assert not rec.ok and rec.error.startswith("timed out after 0.3 s (--timeout)")
    assert 3 <= len(rec.gaps) < 100


def test_input_len_sets_uniforms_mean_and_fixes_the_others():
    from fluidserve.bench.run import workload_spec
    from fluidserve.config import BenchConfig

    uni = workload_spec(BenchConfig(dataset_name="uniform", input_len=100, output_len=10,
                                    range_ratio=0.5))
    assert (uni.dataset, uni.input_len, uni.output_len) == ("uniform", 100, 10)
    lengths = [w.prompt_len for w in build_workload(uni)[0]]
    assert min(lengths) >= 50 and max(lengths) <= 150 and len(set(lengths)) > 10
    fixed = workload_spec(BenchConfig(input_len=100))  # the default trace: fixed lengths
    assert (fixed.dataset, fixed.input_len, fixed.output_len) == ("fixed", 100, 128)
