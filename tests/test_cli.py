"""The command line: generate --json, build-model, profile --quick, config errors."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from fluidserve.engine.llm import LLM
from fluidserve.sampling_params import SamplingParams


def cli(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "fluidserve.cli", *args],
        capture_output=True,
        text=True,
        check=check,
        timeout=300,
    )


def test_generate_json_matches_offline_api(tiny_model_dir):
    out = cli(
        "generate",
        "--model",
        str(tiny_model_dir),
        "--prompt",
        "The river rose",
        "--prompt",
        "Hi",
        "--max-tokens",
        "6",
        "--ignore-eos",
        "--json",
        "--token-budget",
        "8",
    )
    rows = [json.loads(line) for line in out.stdout.splitlines()]
    ref = LLM(model=str(tiny_model_dir)).generate(
        ["The river rose", "Hi"], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    )
    assert [r["token_ids"] for r in rows] == [o.token_ids for o in ref]
    assert all(r["finish_reason"] == "length" and r["ttft_s"] > 0 for r in rows)


def test_generate_n_prints_each_sample_as_the_offline_api_draws_it(tiny_model_dir):
    out = cli("generate", "--model", str(tiny_model_dir), "--prompt", "Hi", "--n", "3",
              "--temperature", "1", "--sampling-seed", "5", "--max-tokens", "5", "--ignore-eos",
              "--bad-words", "the", "--json")
    rows = [json.loads(line) for line in out.stdout.splitlines()]
    ref = LLM(model=str(tiny_model_dir)).generate("Hi", SamplingParams(
        n=3, seed=5, max_tokens=5, temperature=1.0, ignore_eos=True, bad_words=("the",)))
    assert [(r["sample"], r["token_ids"]) for r in rows] == [
        (o.index, o.token_ids) for o in ref[0].outputs]
    assert "1 prompt x 3 samples, 15 tokens" in out.stderr


def test_help_lists_every_engine_knob():
    import dataclasses

    from fluidserve.config import SECTIONS, ServerConfig
    from fluidserve.sim.run import SIM_SECTIONS

    def flags(classes):
        return [f.metadata.get("flag", "--" + f.name.replace("_", "-"))
                for cls in classes for f in dataclasses.fields(cls)]

    text = cli("serve", "--help").stdout
    for flag in flags((*SECTIONS.values(), ServerConfig)):
        assert flag in text, flag
    for alias in ("--max-num-batched-tokens", "-tp", "-pp", "--distributed-executor-backend"):
        assert alias in text
    sim_text = cli("simulate", "--help").stdout
    for flag in flags(SECTIONS[name] for name in SIM_SECTIONS):
        assert flag in sim_text, flag


def test_generate_and_build_model_knobs_are_config_fields(tmp_path, capsys):
    """generate's and build-model's flags come from their config dataclasses (every field a
    flag); repeatable flags collect in order; build-model writes a loadable model."""
    import dataclasses

    from fluidserve.cli import build_parser, main
    from fluidserve.cli_args import dataclass_from_args
    from fluidserve.config import BuildModelConfig, GenerateConfig
    from fluidserve.model.arch import read_arch

    parser = build_parser()
    for command, cls in (("generate", GenerateConfig), ("build-model", BuildModelConfig)):
        args = parser.parse_args([command])
        assert {f.name for f in dataclasses.fields(cls)} <= set(vars(args)), command
    g = dataclass_from_args(GenerateConfig, parser.parse_args(
        ["generate", "--prompt", "a", "--stop", "x", "--prompt", "b", "--stop", "y", "--json"]))
    assert (g.prompt, g.stop, g.json, g.ignore_eos) == (("a", "b"), ("x", "y"), True, False)
    g = dataclass_from_args(GenerateConfig, parser.parse_args(["generate"]))
    assert (g.prompt, g.stop, g.max_tokens) == ((), (), 32)
    assert main(["build-model", "--shape", "tiny"]) == 2
    assert "--out DIR" in capsys.readouterr().err
    out = tmp_path / "m"
    assert main(["build-model", "--out", str(out), "--shape", "tiny", "--dtype", "float32",
                 "--seed", "5"]) == 0
    assert read_arch(out).hidden_size == 256 and "wrote" in capsys.readouterr().out
    weights = (out / "model.safetensors").read_bytes()
    assert main(["build-model", "--out", str(out), "--shape", "tiny", "--seed", "6"]) == 2
    assert "exists and is not an empty directory" in capsys.readouterr().err
    assert (out / "model.safetensors").read_bytes() == weights  # never overwritten


def test_serve_takes_vllms_spellings_and_checks_its_port_first(capsys):
    """`serve MODEL` as `vllm serve MODEL`; --dtype half/float as vLLM's; a port in use is an
    error before the model loads (it came after, from uvicorn, with exit code 3)."""
    import socket

    from fluidserve.cli import build_parser, main

    parser = build_parser()
    assert parser.parse_args(["serve", "/m", "--port", "9"]).model_tag == "/m"
    assert parser.parse_args(["generate", "--dtype", "half"]).dtype == "float16"
    assert parser.parse_args(["serve", "--dtype", "float"]).dtype == "float32"
    assert main(["serve", "/a", "--model", "/b"]) == 2
    assert "two models: /a and --model /b" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:  # a flag vLLM has and this server not: serve's usage
        main(["serve", "--port", "9", "--gpu-memory-utilization", "0.9"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("usage: fluidserve serve")
    assert "fluidserve serve: error: unrecognized arguments: --gpu-memory-utilization" in err
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["serve", "--port", str(port), "--model", "/does/not/matter"]) == 2
    assert f"cannot listen on 127.0.0.1:{port}" in capsys.readouterr().err


@pytest.mark.parametrize("args, why", [
    (("serve", "--drain-timeout", "nan"), "--drain-timeout: must be a finite number"),
    (("serve", "--drain-timeout", "inf"), "--drain-timeout: must be a finite number"),
    (("simulate", "--disaggregate", "--kv-transfer-latency", "inf"),
     "--kv-transfer-latency: must be a finite number"),
    (("capacity", "--tbt-slo", "nan"), "--tbt-slo: must be a finite number"),
    (("bench", "--prompt-scale", "nan"), "--prompt-scale: must be a finite number"),
])
def test_a_float_knob_refuses_nan_and_inf_where_they_mean_nothing(capsys, args, why):
    from fluidserve.cli import main

    with pytest.raises(SystemExit) as e:
        main(list(args))
    assert e.value.code == 2 and why in capsys.readouterr().err
    from fluidserve.cli import build_parser

    assert build_parser().parse_args(["bench", "--request-rate", "inf"]).request_rate == math.inf


@pytest.mark.parametrize("args, why", [
    (("bench", "--input-len", "0"), "input_len must be >= 1"),  # was silently 512
    (("bench", "--warmup-requests", "-1"), "warmup_requests must be >= 0"),  # an IndexError
    (("bench", "--prompt-scale", "0"), "prompt_scale must be > 0"),
    (("capacity", "--tbt-slo", "-1"), "tbt_slo must be > 0"),  # 20 probes for nothing
    (("generate", "--prompt", "hi", "--num-threads", "1000000"),
     "num_threads must be at most 1024"),  # a SIGSEGV in torch
    (("profile", "--num-threads", "5000"), "num_threads must be at most 1024"),
    (("simulate", "--find-token-budget", "--cost-model", "cpu", "--budget-context", "5000"),
     "budget_context 5000 is not below the 4096-token window"),  # priced past the model
])
def test_workload_and_slo_values_that_cannot_work_are_refused(capsys, args, why):
    from fluidserve.cli import main

    assert main(list(args)) == 2
    assert why in capsys.readouterr().err


def test_capacity_and_compare_say_what_is_wrong_in_one_line(tmp_path):
    r = cli("capacity", "--launch", "a=--nosuch-flag", "--output-dir", str(tmp_path / "c"),
            check=False)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert "refused to start: fluidserve serve: error: unrecognized arguments: --nosuch-flag" \
        in r.stderr
    (tmp_path / "summary.json").write_text("{not json")
    r = cli("bench", "--compare", str(tmp_path), check=False)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert "summary.json: not a `fluidserve bench` result" in r.stderr


def test_a_telemetry_file_that_cannot_be_written_is_refused_before_the_model_loads(capsys):
    # It is written at shutdown: found out then, the whole run's telemetry was lost.
    from fluidserve.cli import main

    assert main(["serve", "--telemetry-file", "/nonexistent/dir/t.jsonl"]) == 2
    assert "telemetry_file: cannot write in /nonexistent/dir" in capsys.readouterr().err


def test_bad_config_is_a_clear_error(tiny_model_dir, tmp_path):
    r = cli("generate", "--prompt", "x", "--token-budget", "0", check=False)
    assert r.returncode == 2 and "token_budget must be >= 1" in r.stderr
    r = cli("generate", "--prompt", "x", "--model", str(tmp_path), check=False)
    assert r.returncode == 2 and "no config.json" in r.stderr
    # A prompt the engine refuses: one line, not a traceback.
    r = cli("generate", "--prompt", "x", "--max-tokens", "5000", check=False)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "fluidserve: error: prompt (2 tokens) + max_tokens (5000)" in r.stderr


def test_profile_quick_writes_json_and_plots(tiny_model_dir, tmp_path):
    out = cli(
        "profile",
        "--model",
        str(tiny_model_dir),
        "--dtype",
        "float32",
        "--quick",
        "--repeats",
        "1",
        "--output-dir",
        str(tmp_path),
    )
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert {s["scheduler"] for s in result["stall"]} == {"vllm", "sarathi"}
    for p in (*result["iteration_time"], *result["decode"], *result["chunked_prefill"],
              *result["batched_prefill"]):
        assert len(p["samples_s"]) == 1 and p["time_s"] == p["samples_s"][0]
    assert [(p["prompts"], p["tokens"]) for p in result["batched_prefill"]] == [(4, 64), (2, 128)]
    assert all(p["vs_one_prompt"] > 0 for p in result["batched_prefill"])
    # the summary for a person, before the JSON line
    assert "iteration time: 1 tok" in out.stdout and "engine overhead:" in out.stdout
    assert "prompts batched vs one prompt of as many tokens: 4 x 16 " in out.stdout
    assert "rounds of one point" not in out.stdout  # one round: no spread to report
    assert result["iteration_time"][0]["tokens"] == 1 and result["peaks"]["matmul_flops"] > 0
    for name in ("iteration_time", "throughput", "chunked_prefill_overhead", "stall_timeline"):
        assert (tmp_path / f"{name}.png").stat().st_size > 1000


def test_bad_input_files_and_shapes_are_one_line_errors(tiny_model_dir, tmp_path):
    """A missing or wrong file, or a parallel size the model's shape rules out (found by the
    engine-core process while it starts), is exit code 2 and one line saying what, with no
    traceback."""
    not_a_profile = tmp_path / "summary.json"
    not_a_profile.write_text(json.dumps({"p50_ttft": 1.0}))
    garbled = tmp_path / "telemetry.jsonl"
    garbled.write_text('{"type": "iteration"}\nnot json\n')
    cases = [
        (("simulate", "--cost-model", "cpu", "--num-prompts", "2", "--cpu-profile",
          str(tmp_path / "missing.json")), "--cpu-profile", "one of the shipped: epyc-zen3"),
        (("simulate", "--cost-model", "cpu", "--num-prompts", "2", "--cpu-profile",
          str(not_a_profile)), "--cpu-profile", "not a `fluidserve profile` result"),
        (("simulate", "--cost-model", "cpu", "--num-prompts", "2", "--cpu-calibration",
          str(garbled)), "--cpu-calibration", "not JSON lines"),
        (("serve", "--model", str(tiny_model_dir), "--dtype", "float32", "--port", "8719",
          "--tensor-parallel-size", "3"), "tensor-parallel size 3", "must divide"),
        (("serve", "--model", str(tmp_path / "nope")), "nope", "no such directory"),
        (("generate", "--prompt", "x", "--model", str(tmp_path / "nope")), "nope",
         "does not exist"),
        (("generate", "--prompt-file", str(tmp_path / "prompts.txt")), "prompts.txt",
         "No such file"),
        (("train-predictor", "--request-log", str(tmp_path / "log.jsonl")), "log.jsonl",
         "No such file"),
    ]
    for args, what, why in cases:
        r = cli(*args, check=False)
        assert r.returncode == 2, (args, r.stderr[-2000:])
        last = r.stderr.strip().splitlines()[-1]
        assert last.startswith("fluidserve: error:") and what in last and why in last, last
        assert "Traceback" not in r.stderr, r.stderr[-2000:]
