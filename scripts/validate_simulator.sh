#!/usr/bin/env bash
# Simulator vs real engine on this machine. The cpu cost model is calibrated on served runs
# of one seeded workload (seed 1 at CAL_RATE, default RATE), then predicts a held-out
# workload (seed 0 at RATE) that is also measured with `fluidserve bench` against `fluidserve serve`;
# it is also simulated calibrated on its own served telemetry. The script prints measured vs
# simulated P50 TTFT, P99 TBT, the share of stalled gaps and throughput for both schedulers and
# both calibrations, with a bootstrap interval of each measured figure over its requests and the
# median and range of DRAWS simulations that differ only in their --cpu-jitter-seed. A third
# protocol, profile, prices the measured workload from a `fluidserve profile` run alone (no
# served telemetry, no jitter: PROFILE=path/profile.json, default the shipped profile): what
# `fluidserve simulate --cost-model cpu` predicts before anything was served on the machine.
# Results: runs/sim-validation/ (validation.json).
set -euo pipefail
OUT=${OUT:-runs/sim-validation}
RATE=${RATE:-0.4}
CAL_RATE=${CAL_RATE:-$RATE}
N=${N:-200}
DRAWS=${DRAWS:-5}  # simulations per calibration, each with its own --cpu-jitter-seed
PROFILE=${PROFILE:-}  # profile.json for the profile protocol (empty: the shipped one)
MODEL=${MODEL:-$(python -c 'from fluidserve.model.builder import cached_model_dir; print(cached_model_dir("250m", "bfloat16"))')}
LENGTHS=(--dataset-name sharegpt --prompt-scale 0.25 --output-scale 0.1 --max-prompt-len 1024
         --max-output-len 128 --tbt-deadline 0.25 --ttft-deadline 5)
declare -A SCHED=([sarathi]="--scheduler sarathi --token-budget 256" [vllm]="--scheduler vllm")
mkdir -p "$OUT"

serve_and_bench() {  # name, run dir, telemetry file, bench args...
  local name=$1 dir=$2 tel=$3; shift 3
  local port=$((8300 + RANDOM % 500))
  # shellcheck disable=SC2086
  fluidserve serve --model "$MODEL" --dtype bfloat16 --max-model-len 2048 \
    --kv-cache-memory-gb 2 ${SCHED[$name]} --port "$port" --telemetry-file "$tel" \
    > "$dir.server.log" 2>&1 &
  local pid=$!
  until curl -sf "http://127.0.0.1:$port/health" > /dev/null; do sleep 0.5; done
  fluidserve bench --base-url "http://127.0.0.1:$port" "${LENGTHS[@]}" "$@" --label "$name" \
    --output-dir "$dir" > /dev/null
  kill -TERM "$pid"; wait "$pid" || true
}

calib=()
for name in sarathi vllm; do
  tel="$OUT/calibration-$name-$CAL_RATE.jsonl"
  [ -f "$tel" ] || serve_and_bench "$name" "$OUT/calibration-$name-$CAL_RATE" "$tel" --seed 1 \
    --num-prompts "$N" --request-rate "$CAL_RATE" --no-plots
  calib+=("$tel")
  [ -f "$OUT/measured-$name/summary.json" ] || serve_and_bench "$name" "$OUT/measured-$name" \
    "$OUT/measured-$name.jsonl" --seed 0 --num-prompts "$N" --request-rate "$RATE"
done
cal=$(IFS=,; echo "${calib[*]}")
for name in sarathi vllm; do
  # held-out: calibrated on the seed-1 runs of both schedulers; in-sample: on the measured
  # run's own telemetry (what remains is the simulator, not the machine's drift between runs)
  for protocol in heldout insample; do
    c=$cal; [ "$protocol" = insample ] && c="$OUT/measured-$name.jsonl"
    for ((draw = 0; draw < DRAWS; draw++)); do
      dir="$OUT/sim-$name-$protocol"; [ "$draw" = 0 ] || dir="$dir-draw$draw"
      # shellcheck disable=SC2086
      fluidserve simulate --cost-model cpu --cpu-calibration "$c" "${LENGTHS[@]}" --seed 0 \
        --cpu-jitter-seed "$draw" --num-prompts "$N" --request-rate "$RATE" \
        --max-model-len 2048 --kv-cache-memory-gb 2 ${SCHED[$name]} \
        --label "sim-$name-$protocol" --output-dir "$dir" > /dev/null 2>&1
    done
  done
  # shellcheck disable=SC2086
  fluidserve simulate --cost-model cpu ${PROFILE:+--cpu-profile "$PROFILE"} "${LENGTHS[@]}" \
    --seed 0 --num-prompts "$N" --request-rate "$RATE" --max-model-len 2048 \
    --kv-cache-memory-gb 2 ${SCHED[$name]} --label "sim-$name-profile" \
    --output-dir "$OUT/sim-$name-profile" > /dev/null 2>&1
done
python - "$OUT" <<'PY'
import glob, json, os, sys

import numpy as np

out = sys.argv[1]


def gaps(run: str) -> list[list[float]]:
    return [json.loads(line)["gaps"] for line in open(f"{out}/{run}/requests.jsonl")]


def p50_ttft(g): return float(np.median([r[0] for r in g if r]))
def p99_tbt(g): return float(np.percentile([x for r in g for x in r[1:]], 99))
# Share of token gaps over 0.5 s: a P99 lands among them when ~1% of gaps are stalls.
def stalled(g): return float(np.mean([x > 0.5 for r in g for x in r[1:]]))


def interval(g, f, n=1000):
    """90% bootstrap interval of f over the run's requests (resampled with replacement)."""
    rng = np.random.default_rng(0)
    vals = [f([g[i] for i in rng.integers(len(g), size=len(g))]) for _ in range(n)]
    return [float(v) for v in np.percentile(vals, [5, 95])]


rows = {"P50 TTFT (s)": p50_ttft, "P99 TBT (s)": p99_tbt, "TBT > 0.5 s (share)": stalled}
result = {}
for name in ("sarathi", "vllm"):
    ratio = json.load(open(f"{out}/measured-{name}/summary.json")).get("server_prompt_tokens_ratio")
    if ratio is not None and abs(ratio - 1) > 0.02:
        print(f"warning: the {name} server counted {ratio:.2f}x the workload's prompt tokens")
measured = {name: gaps(f"measured-{name}") for name in ("sarathi", "vllm")}
for protocol in ("heldout", "insample", "profile"):
    print(f"calibration: {protocol}  (measured [90% bootstrap interval over requests];"
          f" simulated: median [range] of the jitter draws; profile: one run, no jitter)")
    for name in ("sarathi", "vllm"):
        m = measured[name]
        sims = sorted(glob.glob(f"{out}/sim-{name}-{protocol}*/requests.jsonl"))
        runs = [os.path.basename(os.path.dirname(p)) for p in sims]
        cells = [(metric, f(m), [f(gaps(r)) for r in runs], interval(m, f))
                 for metric, f in rows.items()]
        tput = [json.load(open(f"{out}/{r}/summary.json"))["output_token_throughput"]
                for r in (f"measured-{name}", *runs)]
        cells.append(("output tokens/s", tput[0], tput[1:], None))
        for metric, fm, draws, ci in cells:
            fs = float(np.median(draws))
            err = (fs - fm) / fm if fm else float("nan")
            inside = ci is not None and ci[0] <= fs <= ci[1]
            result.setdefault(protocol, {}).setdefault(name, {})[metric] = {
                "measured": fm, "measured_interval_90": ci, "simulated": fs,
                "simulated_draws": draws, "error": err,
                "simulated_inside_interval": inside if ci else None}
            span = f"[{ci[0]:7.3f}, {ci[1]:7.3f}]{' inside' if inside else ''}" if ci else ""
            print(f"  {name:8s} {metric:20s} measured {fm:8.4f} {span:26s} simulated {fs:8.4f}"
                  f" [{min(draws):8.4f}, {max(draws):8.4f}]  ({err:+.1%})")
json.dump(result, open(f"{out}/validation.json", "w"), indent=1)
PY
