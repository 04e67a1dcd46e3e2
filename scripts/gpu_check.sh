#!/usr/bin/env bash
# The CUDA path checked and measured on a GPU in one command, in the order that makes a short
# lease count: the card and versions; the tests of the one-row decode chain on the card (CUDA
# graphs with the few-rows path and its PDL launches, one launch per projection, RoPE with the
# KV write, the logits against transformers on CUDA, asynchronous scheduling); the decode-step
# benchmark of the Llama-3-8B shape at batch 1, and its token gaps through the engine core
# with and without asynchronous scheduling (scripts/bench_cuda.py); then the rest of the CUDA
# tests (every dtype and fold of the kernels); with PROFILE_S > 0, last, `fluidserve profile
# --quick --device cuda` on the benchmark's model. Each part has its own time limit, so a slow part
# leaves the others their time; everything lands in OUT (bench_cuda.json, pytest-*.log, ...).
# tests/test_triton_compile.py (the sm_90 machine code) needs no GPU and runs with the suite.
#
#   OUT=runs/gpu-check bash scripts/gpu_check.sh
#   OUT=/tmp/o KEY_S=150 BENCH_S=300 TESTS_S=120 MODES=graphs,skinny,skinny-proj-pdl bash scripts/gpu_check.sh
#
# Not a test: nothing depends on a GPU. Exit status: the tests' (0: all passed; 124: a test
# part ran out of its time, and what ran of it passed unless its log says otherwise); the
# benchmark's and the profile's are printed, not returned.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/gpu-check}
KEY_S=${KEY_S:-150}
BENCH_S=${BENCH_S:-300}
TESTS_S=${TESTS_S:-240}
PROFILE_S=${PROFILE_S:-0}
MODES=${MODES:-graphs,skinny,skinny-proj-pdl}
CONTEXTS=${CONTEXTS:-128,1024}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
PY=${PYTHON:-python3}
KEY="test_cuda_graphs or single_row_takes_one_launch or rope_and_write_kv or argmax_rows"
KEY="$KEY or sampling_on_the_device"
KEY="$KEY or (test_model_vs_transformers and cuda) or (test_async_scheduling and cuda)"
FILES="tests/test_triton_kernels.py tests/test_cuda_graphs.py tests/test_sampler.py
  tests/test_model_vs_transformers.py tests/test_async_scheduling.py"

{
  date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
  "$PY" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
} > "$OUT/machine.txt" 2>&1
cat "$OUT/machine.txt"

tests() {  # name, limit, -k expression
  timeout -k 10 "$2" "$PY" -m pytest -q -p no:cacheprovider -rfE $FILES -k "$3" \
    > "$OUT/pytest-$1.log" 2>&1
  local rc=$?
  tail -n 8 "$OUT/pytest-$1.log"
  echo "tests ($1): exit $rc ($( (grep -oE '^[.sFE]+' "$OUT/pytest-$1.log" || true) \
    | tr -d '\n' | tr -cd '.' | wc -c) passed)"
  return $rc
}

echo "== the one-row chain's tests (limit ${KEY_S} s)"
tests key "$KEY_S" "$KEY"
key_rc=$?

echo "== decode steps (limit ${BENCH_S} s): $MODES"
timeout -k 10 "$BENCH_S" "$PY" scripts/bench_cuda.py --out "$OUT" --batch-sizes 1 \
  --contexts "$CONTEXTS" --steps 30 --rounds 3 --modes "$MODES" --no-linears \
  --engine-batches 1 \
  > "$OUT/bench.log" 2>&1
echo "bench: exit $?"
tail -n 24 "$OUT/bench.log"

echo "== the other CUDA tests (limit ${TESTS_S} s)"
REST="not ($KEY) and not (test_model_vs_transformers and not cuda)"
tests rest "$TESTS_S" "$REST and not test_async_scheduling"
rest_rc=$?

if [ "$PROFILE_S" -gt 0 ]; then
  echo "== fluidserve profile --quick --device cuda (limit ${PROFILE_S} s)"
  timeout -k 10 "$PROFILE_S" "$PY" -m fluidserve.cli profile --quick --device cuda \
    --no-plots --model "$OUT/../model-llama3-8b" --output-dir "$OUT/profile" \
    > "$OUT/profile.log" 2>&1
  echo "profile: exit $?"
  tail -n 20 "$OUT/profile.log"
fi
exit $(( key_rc != 0 ? key_rc : rest_rc ))
