"""`fluidserve` command line: generate | serve | bench | capacity | simulate | profile |
train-predictor | build-model."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

from fluidserve.cli_args import (
    ALL_SECTIONS,
    add_dataclass_args,
    add_engine_args,
    dataclass_from_args,
    engine_config_from_args,
)
from fluidserve.config import (
    BenchConfig,
    BuildModelConfig,
    CapacityConfig,
    ConfigError,
    GenerateConfig,
    PredictorTrainConfig,
    ProfileConfig,
    ServerConfig,
    SimConfig,
    is_config_error,
)


def _cmd_generate(args: argparse.Namespace) -> int:
    from fluidserve.engine.llm import LLM
    from fluidserve.sampling_params import SamplingParams

    g = dataclass_from_args(GenerateConfig, args)
    prompts = list(g.prompt)
    if g.prompt_file:
        with open(g.prompt_file) as f:
            prompts += [line.rstrip("\n") for line in f if line.strip()]
    if not prompts:
        print("fluidserve: error: give at least one --prompt or --prompt-file", file=sys.stderr)
        return 2
    cfg = engine_config_from_args(args)
    try:
        params = SamplingParams(
            max_tokens=g.max_tokens,
            n=g.n,
            temperature=g.temperature,
            top_p=g.top_p,
            top_k=g.top_k,
            seed=g.sampling_seed,
            stop=g.stop,
            ignore_eos=g.ignore_eos,
            repetition_penalty=g.repetition_penalty,
            frequency_penalty=g.frequency_penalty,
            presence_penalty=g.presence_penalty,
            min_p=g.min_p,
            bad_words=g.bad_words,
        )
    except ValueError as e:
        print(f"fluidserve: error: {e}", file=sys.stderr)
        return 2
    with LLM(config=cfg) as llm:  # (closing stops the worker ranks of -tp / -pp)
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=len(prompts) > 1 and not g.json)
        elapsed = time.perf_counter() - t0
        samples = [(prompt, s) for prompt, out in zip(prompts, outs, strict=True)
                   for s in out.outputs]
        for prompt, out in samples:
            if g.json:
                m = out.metrics
                print(
                    json.dumps(
                        {
                            "prompt": prompt,
                            **({"sample": out.index} if g.n > 1 else {}),
                            "text": out.text,
                            "token_ids": out.token_ids,
                            "num_prompt_tokens": len(out.prompt_token_ids),
                            "finish_reason": out.finish_reason,
                            "stop_reason": out.stop_reason,
                            "error": out.error,
                            "ttft_s": m.ttft,
                            "tpot_s": m.tpot,
                            "e2e_s": m.e2e,
                        }
                    )
                )
            else:
                print(prompt + out.text)
        if g.telemetry:
            llm.engine.telemetry.export_jsonl(g.telemetry)
    n = sum(len(o.token_ids) for _, o in samples)
    each = f" x {g.n} samples" if g.n > 1 else ""
    print(
        f"{len(outs)} prompt{'s' * (len(outs) != 1)}{each}, {n} tokens in {elapsed:.2f}s"
        f" ({n / elapsed:.1f} tok/s)",
        file=sys.stderr,
    )
    return 0


def _cmd_build_model(args: argparse.Namespace) -> int:
    from fluidserve.model.builder import build_model_dir

    cfg = dataclass_from_args(BuildModelConfig, args)
    out = Path(cfg.out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"--out {out} exists and is not an empty directory: build-model"
                          " writes a new model there (files it does not write would stay beside"
                          " it); remove it first")
    out = build_model_dir(cfg.out, cfg.shape, dtype=cfg.dtype, seed=cfg.seed, device=cfg.device)
    from fluidserve.model.arch import read_arch

    print(f"wrote {out} ({read_arch(out).num_params / 1e6:.1f}M parameters, {cfg.dtype})")
    return 0


def _cmd_serve(args: argparse.Namespace) -> int:
    from fluidserve.serve.server import run_server

    if args.model_tag is not None:
        if args.model is not None and args.model != args.model_tag:
            raise ConfigError(f"two models: {args.model_tag} and --model {args.model}")
        args.model = args.model_tag
    return run_server(engine_config_from_args(args, (*ALL_SECTIONS, "disagg")),
                      dataclass_from_args(ServerConfig, args))


def _cmd_bench(args: argparse.Namespace) -> int:
    if args.compare:
        from pathlib import Path

        from fluidserve.bench.report import compare_table, load_run, run_names

        print(compare_table(args.compare))
        if args.output_dir and args.plots:
            from fluidserve.bench.plots import plot_compare

            plot_compare({name: load_run(d)[0] for name, d in zip(run_names(args.compare),
                                                                  args.compare, strict=True)},
                         Path(args.output_dir))
            print(f"wrote {Path(args.output_dir) / 'compare_cdfs.png'}", file=sys.stderr)
        return 0
    from fluidserve.bench.run import run_bench

    return run_bench(dataclass_from_args(BenchConfig, args))


def _cmd_capacity(args: argparse.Namespace) -> int:
    from fluidserve.bench.capacity_run import run_capacity

    return run_capacity(dataclass_from_args(BenchConfig, args),
                        dataclass_from_args(CapacityConfig, args), args.launch)


def _cmd_simulate(args: argparse.Namespace) -> int:
    from fluidserve.sim.run import SIM_SECTIONS, run_simulate

    # One --tbt-slo: the SLO of the capacity search and of --token-budget auto.
    if args.tbt_slo is None:
        args.tbt_slo = CapacityConfig.tbt_slo
    cap = dataclass_from_args(CapacityConfig, args)
    return run_simulate(dataclass_from_args(SimConfig, args),
                        engine_config_from_args(args, SIM_SECTIONS),
                        dataclass_from_args(BenchConfig, args), cap)


def _cmd_profile(args: argparse.Namespace) -> int:
    from fluidserve.profiler.run import run_profile

    return run_profile(dataclass_from_args(ProfileConfig, args))


def _cmd_train_predictor(args: argparse.Namespace) -> int:
    import json as _json
    from pathlib import Path

    from fluidserve.disagg.learned import read_request_log, train

    cfg = dataclass_from_args(PredictorTrainConfig, args)
    records = read_request_log(p.strip() for p in cfg.request_log.split(",") if p.strip())
    model, report = train(records, cfg.granularity, cfg.holdout, cfg.seed)
    Path(cfg.out).write_text(_json.dumps(model))
    print(report.text())
    print(f"wrote {cfg.out} (serve with --disaggregate --length-predictor learned"
          f" --length-predictor-path {cfg.out})", file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fluidserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="Generate completions offline.")
    add_dataclass_args(gen, GenerateConfig, "prompts, sampling and output")
    add_engine_args(gen)
    gen.set_defaults(func=_cmd_generate)

    srv = sub.add_parser("serve", help="OpenAI-compatible HTTP server.")
    srv.add_argument("model_tag", nargs="?", metavar="MODEL",
                     help="The model directory, as `vllm serve MODEL` takes it (or --model).")
    add_dataclass_args(srv, ServerConfig, "server")
    add_engine_args(srv, (*ALL_SECTIONS, "disagg"))
    srv.set_defaults(func=_cmd_serve)

    bench = sub.add_parser("bench", help="Evaluate an OpenAI-compatible endpoint (Etalon).")
    bench.add_argument("--compare", nargs="+", metavar="RUN_DIR",
                       help="Print the summaries of these run directories side by side (and,"
                       " with --output-dir, plot their CDFs together).")
    add_dataclass_args(bench, BenchConfig, "workload and client")
    bench.set_defaults(func=_cmd_bench)

    cap = sub.add_parser("capacity", help="Largest request rate that meets an SLO.")
    cap.add_argument("--launch", action="append", default=[], metavar="NAME=FLAGS",
                     help="Launch `fluidserve serve FLAGS` per probe instead of using"
                     " --base-url (repeat to compare variants).")
    add_dataclass_args(cap, CapacityConfig, "SLO and search")
    add_dataclass_args(cap, BenchConfig, "workload and client")
    cap.set_defaults(func=_cmd_capacity)

    from fluidserve.sim.run import SIM_SECTIONS, WORKLOAD_FIELDS

    sim = sub.add_parser("simulate", help="Run the schedulers against a cost model.")
    add_dataclass_args(sim, SimConfig, "simulation")
    add_engine_args(sim, SIM_SECTIONS)
    add_dataclass_args(sim, BenchConfig, "workload", only=WORKLOAD_FIELDS)
    add_dataclass_args(sim, CapacityConfig, "SLO and capacity search",
                       only={f.name for f in dataclasses.fields(CapacityConfig)} - {"tbt_slo"})
    # sharegpt_8k keeps requests up to 8k tokens: do not clip them in simulation.
    sim.set_defaults(max_prompt_len=8192, max_output_len=8192)
    sim.set_defaults(func=_cmd_simulate)

    prof = sub.add_parser("profile", help="Characterize iteration time on this machine.")
    add_dataclass_args(prof, ProfileConfig, "profile")
    prof.set_defaults(func=_cmd_profile)

    tp = sub.add_parser("train-predictor", help="Fit the generated-length predictor on a"
                        " request log (TetriInfer's length predictor).")
    add_dataclass_args(tp, PredictorTrainConfig, "training")
    tp.set_defaults(func=_cmd_train_predictor)

    bld = sub.add_parser("build-model", help="Write a random-weight Llama model directory.")
    add_dataclass_args(bld, BuildModelConfig, "model")
    bld.set_defaults(func=_cmd_build_model)
    for command in sub.choices.values():  # its own usage in its own errors (see ``main``)
        command.set_defaults(subparser=command)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # said by the subcommand's parser, with its usage, not the top-level one
        args.subparser.error(f"unrecognized arguments: {' '.join(unknown)}")
    try:
        return args.func(args)
    except (ConfigError, ValueError) as e:
        if is_config_error(e):
            print(f"fluidserve: error: {e}", file=sys.stderr)
            return 2
        raise
    except (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError) as e:
        if e.filename is None:  # not about a path the user gave
            raise
        print(f"fluidserve: error: {e.filename}: {e.strerror}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
