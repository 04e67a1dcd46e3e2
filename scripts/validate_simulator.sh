#!/usr/bin/env bash
# Simulator vs real engine on this machine: calibrate the cpu cost model on served runs of
# one seeded workload (seed 1), then predict another (seed 0) and compare with what
# `fluidserve bench` measured against `fluidserve serve` (runs/sarathi-vs-vllm, see
# experiment_sarathi_vs_vllm.sh). Results: runs/sim-validation/.
set -euo pipefail
OUT=${OUT:-runs/sim-validation}
MEASURED=${MEASURED:-runs/sarathi-vs-vllm}
MODEL=${MODEL:-$(python -c 'from fluidserve.model.builder import cached_model_dir; print(cached_model_dir("250m", "bfloat16"))')}
WORKLOAD=(--dataset-name sharegpt --prompt-scale 0.25 --output-scale 0.1 --max-prompt-len 1024
          --max-output-len 128 --num-prompts 60 --request-rate 0.6 --tbt-deadline 0.25
          --ttft-deadline 5)
declare -A SCHED=([sarathi]="--scheduler sarathi --token-budget 256" [vllm]="--scheduler vllm")
mkdir -p "$OUT"
calib=()
for name in sarathi vllm; do
  port=$((8300 + RANDOM % 500))
  # shellcheck disable=SC2086
  fluidserve serve --model "$MODEL" --dtype bfloat16 --max-model-len 2048 \
    --kv-cache-memory-gb 2 ${SCHED[$name]} --port "$port" \
    --telemetry-file "$OUT/calibration-$name.jsonl" > "$OUT/calibration-$name.log" 2>&1 &
  pid=$!
  until curl -sf "http://127.0.0.1:$port/health" > /dev/null; do sleep 0.5; done
  fluidserve bench --base-url "http://127.0.0.1:$port" "${WORKLOAD[@]}" --seed 1 --no-plots \
    --output-dir "$OUT/calibration-$name" > /dev/null
  kill -TERM "$pid"; wait "$pid" || true
  calib+=("$OUT/calibration-$name.jsonl")
done
cal=$(IFS=,; echo "${calib[*]}")
for name in sarathi vllm; do
  # shellcheck disable=SC2086
  fluidserve simulate --cost-model cpu --cpu-calibration "$cal" "${WORKLOAD[@]}" --seed 0 \
    --max-model-len 2048 ${SCHED[$name]} --label "sim-$name" \
    --output-dir "$OUT/sim-$name" | tail -n 1 > /dev/null
  fluidserve simulate --cost-model cpu "${WORKLOAD[@]}" --seed 0 --max-model-len 2048 \
    ${SCHED[$name]} --label "sim-uncalibrated-$name" --output-dir "$OUT/sim-uncalibrated-$name" \
    | tail -n 1 > /dev/null
done
python - "$OUT" "$MEASURED" <<'PY'
import json, sys
out, measured = sys.argv[1], sys.argv[2]
rows = {"P50 TTFT (s)": lambda s: s["ttft_s"]["p50"], "P99 TBT (s)": lambda s: s["tbt_s"]["p99"],
        "output tokens/s": lambda s: s["output_token_throughput"]}
result = {}
for name in ("sarathi", "vllm"):
    m = json.load(open(f"{measured}/{name}/summary.json"))
    for kind in ("sim", "sim-uncalibrated"):
        s = json.load(open(f"{out}/{kind}-{name}/summary.json"))
        for metric, f in rows.items():
            err = (f(s) - f(m)) / f(m)
            result.setdefault(name, {}).setdefault(metric, {"measured": f(m)})[kind] = f(s)
            result[name][metric][kind + " error"] = err
            print(f"{name:8s} {metric:16s} measured {f(m):8.4f}  {kind:17s} {f(s):8.4f}"
                  f"  ({err:+.1%})")
json.dump(result, open(f"{out}/validation.json", "w"), indent=1)
PY
