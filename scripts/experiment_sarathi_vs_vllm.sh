#!/usr/bin/env bash
# Sarathi vs vLLM scheduling behind `fluidserve serve`, measured black-box with `fluidserve bench`
# and `fluidserve capacity` on the 250M bf16 model. Results land in runs/sarathi-vs-vllm/.
set -euo pipefail
OUT=${OUT:-runs/sarathi-vs-vllm}
MODEL=${MODEL:-$(python -c 'from fluidserve.model.builder import cached_model_dir; print(cached_model_dir("250m", "bfloat16"))')}
RATE=${RATE:-0.6}
N=${N:-60}
# sharegpt-shaped lengths scaled to this CPU: prompts x0.25 (median ~430), outputs x0.1 (~40).
WORKLOAD=(--dataset-name sharegpt --prompt-scale 0.25 --output-scale 0.1 --max-prompt-len 1024
          --max-output-len 128 --num-prompts "$N" --seed 0 --tbt-deadline 0.25 --ttft-deadline 5)
SERVE=(--model "$MODEL" --dtype bfloat16 --max-model-len 2048 --kv-cache-memory-gb 2)
declare -A SCHED=([sarathi]="--scheduler sarathi --token-budget 256" [vllm]="--scheduler vllm")
mkdir -p "$OUT"
for name in sarathi vllm; do
  port=$((8300 + RANDOM % 500))
  # shellcheck disable=SC2086
  fluidserve serve "${SERVE[@]}" ${SCHED[$name]} --port "$port" > "$OUT/$name-server.log" 2>&1 &
  pid=$!
  until curl -sf "http://127.0.0.1:$port/health" > /dev/null; do sleep 0.5; done
  fluidserve bench --base-url "http://127.0.0.1:$port" "${WORKLOAD[@]}" --request-rate "$RATE" \
    --label "$name" --output-dir "$OUT/$name" | tail -n 1 > "$OUT/$name.json"
  kill -TERM "$pid"; wait "$pid" || true
done
fluidserve bench --compare "$OUT/sarathi" "$OUT/vllm" | tee "$OUT/compare.txt"
fluidserve capacity "${WORKLOAD[@]}" --slo tbt --tbt-slo 0.5 --max-scheduling-delay 2 \
  --start-rate "$RATE" --max-probes 5 --granularity 0.1 --output-dir "$OUT/capacity" \
  --launch "sarathi=${SERVE[*]} ${SCHED[sarathi]}" --launch "vllm=${SERVE[*]} ${SCHED[vllm]}" \
  | tail -n 1 > "$OUT/capacity.json"
