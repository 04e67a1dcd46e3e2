"""`fluidserve bench` and `fluidserve capacity` against a real fluidserve server on localhost."""

from __future__ import annotations

import json

import numpy as np
import pytest

from fluidserve.cli import main

from .server_utils import InProcessServer

FILES = ("requests.jsonl", "requests.csv", "summary.json", "cdfs.png", "token_timeline.png",
         "miss_rate_vs_tbt.png")


@pytest.fixture(scope="module")
def srv(tiny_model_dir):
    with InProcessServer(tiny_model_dir, name="tiny") as s:
        s.tokenizer = str(tiny_model_dir)  # the bench must count tokens as the server does
        yield s


def last_json(capsys) -> dict:
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
def test_bench_writes_every_output(srv, tmp_path, capsys, endpoint):
    out = tmp_path / "run"
    rc = main(["bench", "--base-url", srv.url, "--tokenizer", srv.tokenizer,
               "--endpoint", endpoint, "--num-prompts", "12",
               "--dataset-name", "fixed", "--input-len", "40", "--output-len", "9",
               "--request-rate", "30", "--seed", "3", "--output-dir", str(out),
               "--tbt-deadline", "0.5"])
    assert rc == 0
    summary = last_json(capsys)
    for f in FILES:
        assert (out / f).stat().st_size > 0, f
    assert summary["num_completed"] == 12 and summary["num_failed"] == 0
    assert summary["model"] == "tiny" and summary["total_output_tokens"] == 12 * 9
    records = [json.loads(x) for x in (out / "requests.jsonl").read_text().splitlines()]
    for r in records:
        # Every token's arrival is recorded: TTFT, then one gap per further token.
        assert len(r["gaps"]) == r["num_output_tokens"] == 9
        assert r["fluidity_index"] is not None and r["error"] is None
        assert r["scheduling_delay"] is not None and r["scheduling_delay"] >= 0
    if endpoint == "/v1/completions":
        # Prompts have the exact requested token length (the server counts them too).
        assert all(r["server_prompt_tokens"] == r["prompt_len"] == 40 for r in records)
    assert summary["scheduling_delay_s"]["count"] == 12
    for key in ("fluid_token_generation_rate", "tpot_based_token_rate",
                "p99_tbt_based_token_rate"):
        assert summary[key] > 0


def test_bench_profile_prefill_and_compare(srv, tmp_path, capsys):
    common = ["bench", "--base-url", srv.url, "--tokenizer", srv.tokenizer,
              "--num-prompts", "6", "--dataset-name", "uniform", "--input-len", "100",
              "--range-ratio", "0.8", "--output-len", "5", "--no-plots"]
    assert main([*common, "--output-dir", str(tmp_path / "a"), "--profile-prefill",
                 "--ttft-slack", "0.25", "--max-prompt-len", "200"]) == 0
    a = last_json(capsys)
    fit = a["prefill_fit"]
    assert len(fit["coeffs"]) == 3 and a["ttft_deadline_s"] is None and a["ttft_slack_s"] == 0.25
    # Etalon's D_p: each prompt's own fitted prefill time plus the slack.
    records = [json.loads(x) for x in (tmp_path / "a" / "requests.jsonl").read_text()
               .splitlines()]
    assert len({r["prompt_len"] for r in records}) > 1
    for r in records:
        prefill = max(float(np.polyval(fit["coeffs"], r["prompt_len"])), fit["floor_s"])
        assert r["ttft_deadline"] == pytest.approx(prefill + 0.25)
    assert main([*common, "--output-dir", str(tmp_path / "b"), "--request-rate", "5"]) == 0
    capsys.readouterr()
    assert main(["bench", "--compare", str(tmp_path / "a"), str(tmp_path / "b")]) == 0
    table = capsys.readouterr().out
    assert "fluid token rate" in table and " a " in table.splitlines()[0] + " "


def test_bench_records_errors_instead_of_hiding_them(srv, tmp_path, capsys):
    # A model the server does not serve: every request gets a 404, and the run fails.
    assert main(["bench", "--base-url", srv.url, "--tokenizer", srv.tokenizer,
                 "--model", "not-served", "--num-prompts", "3", "--input-len", "20",
                 "--output-len", "5", "--no-plots", "--warmup-requests", "0",
                 "--output-dir", str(tmp_path)]) == 1
    summary = last_json(capsys)
    assert summary["num_failed"] == 3 and "not-served" in next(iter(summary["errors"]))
    # With warm-up requests (the default): one error line before the run.
    assert main(["bench", "--base-url", srv.url, "--tokenizer", srv.tokenizer, "--model",
                 "not-served", "--num-prompts", "3", "--no-plots",
                 "--output-dir", str(tmp_path / "b")]) == 2
    assert "warm-up requests" in capsys.readouterr().err and not (tmp_path / "b").exists()


def test_bench_cuts_requests_to_the_servers_window(srv, tmp_path, capsys):
    # Prompts longer than the server's 512-token window: cut (with a warning), not refused.
    assert main(["bench", "--base-url", srv.url, "--tokenizer", srv.tokenizer,
                 "--num-prompts", "3", "--input-len", "600",
                 "--output-len", "5", "--max-prompt-len", "600", "--no-plots",
                 "--warmup-requests", "0", "--output-dir", str(tmp_path)]) == 0
    summary = last_json(capsys)
    assert summary["num_completed"] == 3 and summary["requests_cut_to_window"] == 3
    assert summary["server_max_model_len"] == 512


def test_capacity_against_a_running_endpoint(srv, tmp_path, capsys):
    args = ["capacity", "--base-url", srv.url, "--tokenizer", srv.tokenizer,
            "--num-prompts", "8", "--input-len", "20",
            "--output-len", "4", "--slo", "ttft", "--ttft-slo", "30", "--start-rate", "2",
            "--max-probes", "2", "--output-dir", str(tmp_path), "--warmup-requests", "0"]
    assert main(args) == 0
    res = last_json(capsys)
    assert res["capacity_qps"] == 4.0 and res["variants"]["endpoint"]["num_probes"] == 2
    # What each probe served (8 Poisson arrivals: about the rate, by chance more or less).
    endpoint = res["variants"]["endpoint"]
    served = [p["served_qps"] for p in endpoint["curve"]]
    assert min(served) > 0 and endpoint["most_served_qps"] == max(served)
    assert (tmp_path / "capacity_curve.png").stat().st_size > 0
    cache = json.loads((tmp_path / "probe_cache.json").read_text())
    assert len(cache) == 2
    # A rerun answers from the probe cache (no new run directories are needed).
    assert main(args) == 0
    assert last_json(capsys)["capacity_qps"] == 4.0


def test_capacity_that_no_rate_meets(srv, tmp_path, capsys):
    # A 1 us TTFT bound fails at every rate: the search halves down to --min-rate and stops
    # there; and each probe scored fluidity with the endpoint's prefill profile.
    assert main(["capacity", "--base-url", srv.url, "--tokenizer", srv.tokenizer,
                 "--num-prompts", "3", "--input-len", "20", "--output-len", "3",
                 "--slo", "ttft", "--ttft-slo", "0.000001", "--profile-prefill",
                 "--start-rate", "4", "--min-rate", "2", "--no-plots", "--output-dir",
                 str(tmp_path), "--warmup-requests", "0"]) == 0
    res = last_json(capsys)["variants"]["endpoint"]
    assert res["capacity_qps"] == 0.0 and res["below_min_rate"] and res["num_probes"] == 2
    for rate in ("4", "2"):
        summary = json.loads((tmp_path / "endpoint" / f"rate-{rate}" / "summary.json")
                             .read_text())
        assert summary["prefill_fit"] is not None and summary["ttft_slack_s"] == 0.3
        assert summary["ttft_deadline_s"] is None


def test_bench_counts_prompts_with_the_served_models_tokenizer(srv, tmp_path, capsys):
    """Without --tokenizer the bench builds prompts with the tokenizer in the directory the
    server reports as its model's root, so the lengths it reports are the lengths served; with
    a different tokenizer the mismatch is measured and warned about, not hidden."""
    common = ["bench", "--base-url", srv.url, "--num-prompts", "4", "--input-len", "60",
              "--output-len", "2", "--request-rate", "inf", "--no-plots"]
    assert main([*common, "--output-dir", str(tmp_path / "auto")]) == 0
    summary = last_json(capsys)
    assert summary["tokenizer"] == str(srv.engine.config.model.model)
    assert summary["server_prompt_tokens_ratio"] == 1.0
    records = [json.loads(x) for x in (tmp_path / "auto" / "requests.jsonl").read_text()
               .splitlines()]
    assert all(r["server_prompt_tokens"] == r["prompt_len"] == 60 for r in records)

    from fluidserve.model.builder import default_model_dir

    assert main([*common, "--tokenizer", str(default_model_dir()),
                 "--output-dir", str(tmp_path / "other")]) == 0
    out = capsys.readouterr()
    summary = json.loads(out.out.strip().splitlines()[-1])
    assert summary["tokenizer"] == str(default_model_dir())
    assert abs(summary["server_prompt_tokens_ratio"] - 1) > 0.02
    assert "pass the server's tokenizer with --tokenizer" in out.err
    # The chat endpoint counts its template's tokens too: a constant, not a mismatch.
    assert main([*common, "--endpoint", "/v1/chat/completions", "--dataset-name", "uniform",
                 "--output-dir", str(tmp_path / "chat")]) == 0
    out = capsys.readouterr()
    summary = json.loads(out.out.strip().splitlines()[-1])
    assert summary["server_prompt_tokens_ratio"] == pytest.approx(1.0, abs=0.02)
    assert "--tokenizer" not in out.err


def test_bench_names_a_server_model_directory_it_cannot_read(tmp_path):
    """A remote server's model directory is not on this machine: the bench falls back to the
    embedded model's tokenizer and says so where it names the tokenizer (the run's first line
    and the summary), instead of silently building prompts of other lengths."""
    from fluidserve.bench.run import load_tokenizer
    from fluidserve.config import BenchConfig
    from fluidserve.model.builder import default_model_dir

    remote = str(tmp_path / "elsewhere" / "llama")
    _, source = load_tokenizer(BenchConfig(), remote)
    assert source.startswith(str(default_model_dir()))
    assert remote in source and "--tokenizer" in source
    _, source = load_tokenizer(BenchConfig(), None)
    assert source == f"{default_model_dir()} (embedded model)"
