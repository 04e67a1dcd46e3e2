"""Run summaries, the run directory and the comparison table, on hand-computed records."""

from __future__ import annotations

import csv
import json
import math

import numpy as np
import pytest

from fluidserve.bench.client import RequestRecord
from fluidserve.bench.fluidity import fluid_token_rate, fluidity_index
from fluidserve.bench.report import (
    CSV_COLUMNS,
    ROWS,
    compare_table,
    constant_deadline,
    fluidity_slo_met,
    load_run,
    run_names,
    score_fluidity,
    summarize_run,
    write_run,
)

LONG_ERROR = "HTTP 500: " + "x" * 200


def records() -> list[RequestRecord]:
    """Three completed requests (the one-token one finishes last) and two failed with the
    same long error, one after part of its stream; times exact in binary."""
    return [
        RequestRecord(0, 10, 3, 0.0, sent=0.25, gaps=[0.5, 0.25, 0.25], num_output_tokens=3,
                      scheduling_delay=0.125),
        RequestRecord(1, 20, 2, 1.0, sent=1.0, gaps=[1.0, 0.5], num_output_tokens=2),
        RequestRecord(2, 5, 1, 2.0, sent=2.0, gaps=[0.75], num_output_tokens=1,
                      scheduling_delay=0.0),
        RequestRecord(3, 7, 4, 0.5, sent=0.5, gaps=[0.25, 1.5], num_output_tokens=2,
                      error=LONG_ERROR),
        RequestRecord(4, 9, 4, 3.0, sent=3.0, error=LONG_ERROR),
    ]


def test_score_fluidity_uses_each_requests_deadline():
    recs = records()
    score_fluidity(recs, lambda prompt_len: prompt_len / 20, 0.25)  # D_p grows with the prompt
    assert [r.ttft_deadline for r in recs] == [0.5, 1.0, 0.25, None, None]
    assert recs[0].fluidity_index == 1.0
    # Request 1: TTFT on time, then a 0.5 s gap at D_d = 0.25 s: 2 missed of 3 deadlines.
    assert recs[1].fluidity_index == pytest.approx(1 / 3)
    assert recs[1].fluidity_index == fluidity_index([1.0, 0.5], 1.0, 0.25)
    assert recs[3].fluidity_index is None  # failed: not scored
    assert constant_deadline(0.7)(12345) == 0.7


def test_summarize_run_on_known_records():
    recs = records()
    score_fluidity(recs, constant_deadline(0.5), 0.25)
    s = summarize_run(recs, 0.25)
    assert (s["num_requests"], s["num_completed"], s["num_failed"]) == (5, 3, 2)
    assert s["errors"] == {LONG_ERROR[:120]: 2}
    # From the first send (0.25) to the last token (request 2 at 2.0 + 0.75).
    assert s["duration_s"] == 2.5
    assert s["request_throughput"] == 3 / 2.5 and s["output_token_throughput"] == 6 / 2.5
    assert s["total_output_tokens"] == 6 and s["total_prompt_tokens"] == 35
    # Failed requests count in no per-request latency, but the gaps of the part of a stream
    # that arrived before its failure are gaps a user waited through: they count in TBT.
    assert s["ttft_s"]["count"] == 3 and s["ttft_s"]["mean"] == 0.75
    assert s["ttft_s"]["max"] == 1.0 and s["ttft_s"]["p99"] == pytest.approx(0.995)
    assert s["tbt_s"]["count"] == 4 and s["tbt_s"]["p50"] == 0.375 and s["tbt_s"]["max"] == 1.5
    assert s["tpot_s"]["count"] == 2 and s["tpot_s"]["mean"] == 0.375  # (0.25 + 0.5) / 2
    assert s["e2e_latency_s"]["mean"] == pytest.approx(3.25 / 3)
    assert s["normalized_latency_s"]["mean"] == pytest.approx((1 / 3 + 0.75 + 0.75) / 3)
    assert s["scheduling_delay_s"]["count"] == 2 and s["scheduling_delay_s"]["max"] == 0.125
    # Fluidity at D_p = 0.5, D_d = 0.25: request 1 misses 3 deadlines on its first token and
    # 2 on its second, request 2 misses 2 on its only token; request 0 is fluid.
    assert s["fluidity_index"]["count"] == 3
    assert s["fluidity_index"]["mean"] == pytest.approx(1 / 3)
    # Of five requests one is fluid: a failed request is not.
    assert s["fraction_fluid_requests"] == pytest.approx(1 / 5)
    assert s["tbt_deadline_s"] == 0.25
    # Two of five failed: no deadline makes 99% of the requests fluid.
    assert (s["fluid_token_generation_rate"], s["fluid_tbt_deadline_s"]) == (0.0, math.inf)
    rate, d = fluid_token_rate([r.gaps for r in recs[:3]])
    assert summarize_run(recs[:3], 0.25)["fluid_token_generation_rate"] == rate > 0
    assert s["tpot_based_token_rate"] == 1 / 0.375
    assert s["p99_tbt_based_token_rate"] == pytest.approx(
        1 / np.quantile([0.25, 0.25, 0.5, 1.5], 0.99))


def test_a_request_at_exactly_the_target_fluidity_counts_as_fluid():
    # Ten deadlines, one missed by less than one D_d: fluidity-index exactly 0.9.
    r = RequestRecord(0, 4, 10, 0.0, sent=0.0, gaps=[0.5] + [0.25] * 8 + [0.375],
                      num_output_tokens=10)
    score_fluidity([r], constant_deadline(0.5), 0.25)
    assert r.fluidity_index == 0.9
    assert summarize_run([r], 0.25)["fraction_fluid_requests"] == 1.0


def test_summarize_run_with_a_given_duration_and_with_nothing_completed():
    s = summarize_run(records(), 0.25, duration=10.0)
    assert s["duration_s"] == 10.0 and s["request_throughput"] == 0.3
    failed = summarize_run([RequestRecord(0, 5, 5, 0.0, sent=0.0, error="boom")], 0.1)
    assert failed["duration_s"] == 0.0 and failed["errors"] == {"boom": 1}
    assert failed["fraction_fluid_requests"] == 0.0  # none of the requests was fluid
    for key in ("tpot_based_token_rate", "p99_tbt_based_token_rate"):
        assert math.isnan(failed[key]), key  # no interval to measure
    # It served nothing, and no deadline made its requests fluid.
    for key in ("request_throughput", "output_token_throughput", "fluid_token_generation_rate"):
        assert failed[key] == 0.0, key
    assert failed["scheduling_delay_s"] is None and failed["ttft_s"]["count"] == 0


@pytest.mark.parametrize(
    "fraction,failed,met", [(1.0, 0, True), (0.99, 0, True), (0.989, 0, False), (1.0, 1, False)]
)
def test_fluidity_slo(fraction, failed, met):
    assert fluidity_slo_met({"num_failed": failed, "fraction_fluid_requests": fraction}) is met


def test_run_directory_round_trip(tmp_path):
    recs = records()
    score_fluidity(recs, constant_deadline(0.5), 0.25)
    summary = summarize_run(recs, 0.25) | {"numpy_value": np.float64(0.5),
                                             "numpy_count": np.int64(3)}
    run = tmp_path / "runs" / "a"  # parents are created; writing again overwrites
    write_run(run, recs[:1], {})
    write_run(run, recs, summary)
    loaded, loaded_summary = load_run(run)
    assert loaded == recs
    assert loaded_summary["numpy_value"] == 0.5 and loaded_summary["numpy_count"] == 3
    assert loaded_summary["ttft_s"] == summary["ttft_s"]
    text = (run / "summary.json").read_text()
    assert json.loads(text) == loaded_summary
    assert text.splitlines()[1].startswith(' "num_requests"')  # indented for reading
    with open(run / "requests.csv", newline="") as f:
        rows = list(csv.reader(f))
    assert tuple(rows[0]) == CSV_COLUMNS and len(rows) == 6
    by_col = [dict(zip(CSV_COLUMNS, r, strict=True)) for r in rows[1:]]
    assert by_col[0] == {
        "index": "0", "prompt_len": "10", "output_len": "3", "num_output_tokens": "3",
        "scheduled": "0.0", "sent": "0.25", "ttft": "0.5", "tpot": "0.25", "e2e": "1.0",
        "max_tbt": "0.25", "scheduling_delay": "0.125", "fluidity_index": "1.0", "error": "",
    }
    assert (by_col[1]["tpot"], by_col[1]["max_tbt"], by_col[1]["e2e"]) == ("0.5", "0.5", "1.5")
    # One token: no TPOT and no TBT; a failure: its error, no latencies without tokens.
    assert (by_col[2]["tpot"], by_col[2]["max_tbt"], by_col[2]["e2e"]) == ("", "", "0.75")
    assert by_col[4]["ttft"] == by_col[4]["e2e"] == "" and by_col[4]["error"] == LONG_ERROR


def test_load_run_needs_a_summary_and_tolerates_missing_records(tmp_path):
    with pytest.raises(ValueError, match="not a run directory"):
        load_run(tmp_path)
    (tmp_path / "summary.json").write_text('{"num_completed": 0}')
    assert load_run(tmp_path) == ([], {"num_completed": 0})
    with pytest.raises(TypeError, match="set"):
        write_run(tmp_path / "bad", [], {"not json": {1, 2}})


def test_compare_table(tmp_path):
    recs = records()
    score_fluidity(recs, constant_deadline(0.5), 0.25)
    a = summarize_run(recs, 0.25) | {"capacity_qps": 1.23456}
    b = {"num_completed": 7, "num_failed": 0, "request_throughput": math.nan}  # a partial one
    write_run(tmp_path / "sarathi", recs, a)
    write_run(tmp_path / "vllm-baseline", [], b)
    lines = compare_table([tmp_path / "sarathi", tmp_path / "vllm-baseline"]).splitlines()
    width = max(len(name) for name, _ in ROWS) + 2  # the metric column
    assert len(lines) == len(ROWS) + 1
    assert lines[0].split() == ["metric", "sarathi", "vllm-baseline"]
    cells = {line[:width].rstrip(): line[width:].split() for line in lines[1:]}
    assert list(cells) == [name for name, _ in ROWS]
    assert cells["completed / failed"] == ["3", "/", "2", "7", "/", "0"]
    assert cells["request throughput (req/s)"] == ["1.2", "-"]  # NaN prints as "-"
    assert cells["TTFT p50 / p99 (s)"] == ["0.75", "/", "0.995", "-"]
    assert cells["capacity (req/s)"] == ["1.235", "-"]
    assert cells["fluid token rate (tok/s)"][1] == "-"
    # Columns are right-aligned: every line is as wide as the header, and each run's column
    # is 3 wider than its widest cell or its name.
    assert {len(line) for line in lines} == {len(lines[0])}
    assert cells["TBT p50 / p99 (s)"] == ["0.375", "/", "1.47", "-"]  # the widest cell
    cols = 3 + len("0.375 / 1.47"), 3 + len("vllm-baseline")
    assert lines[0] == "metric".ljust(width) + "sarathi".rjust(cols[0]) + \
        "vllm-baseline".rjust(cols[1])
    assert lines[2] == "request throughput (req/s)".ljust(width) + "1.2".rjust(cols[0]) + \
        "-".rjust(cols[1])


def strict_json(text: str):
    """json.loads refusing NaN and Infinity, as jq, browsers and JSON.parse do."""
    def refuse(name):
        raise ValueError(f"not JSON: {name}")
    return json.loads(text, parse_constant=refuse)


def test_summaries_are_standard_json_even_without_bounds(tmp_path):
    # Every output arrived in one chunk (no inter-token time) and requests were sent all at
    # once (an infinite rate): rates without bounds become null, and nothing raises.
    bundled = [RequestRecord(i, 5, 4, 0.0, sent=0.0, gaps=[0.5, 0.0, 0.0, 0.0],
                             num_output_tokens=4) for i in range(3)]
    s = summarize_run(bundled, 0.25) | {"request_rate": math.inf}
    assert s["tpot_based_token_rate"] == s["p99_tbt_based_token_rate"] == math.inf
    one_token = summarize_run([RequestRecord(0, 5, 1, 0.0, sent=0.0, gaps=[0.5],
                                             num_output_tokens=1)], 0.25)
    assert math.isnan(one_token["tpot_based_token_rate"])  # no interval to measure
    write_run(tmp_path / "a", bundled, s)
    loaded = strict_json((tmp_path / "a" / "summary.json").read_text())
    assert loaded["request_rate"] is None and loaded["tpot_based_token_rate"] is None
    assert loaded["ttft_s"]["p50"] == 0.5
    write_run(tmp_path / "b", [], one_token)
    assert strict_json((tmp_path / "b" / "summary.json").read_text())["tbt_s"]["p99"] is None
    assert compare_table([tmp_path / "a", tmp_path / "b"])  # null reads as "-"


def test_runs_of_the_same_name_are_told_apart(tmp_path):
    for d in ("x/vllm", "y/vllm", "y/fluidserve"):
        write_run(tmp_path / d, [], {"num_completed": 0, "num_failed": 0})
    assert run_names([tmp_path / "y/vllm", tmp_path / "y/fluidserve"]) == ["vllm", "fluidserve"]
    names = run_names([tmp_path / "x/vllm", tmp_path / "y/vllm"])
    assert names == [str(tmp_path / "x/vllm"), str(tmp_path / "y/vllm")]
    assert compare_table([tmp_path / "x/vllm", tmp_path / "y/vllm"]).splitlines()[0].split()[1:] \
        == names
