#!/usr/bin/env bash
# The CUDA path checked and measured on a GPU in one command: the card and versions, the CUDA
# tests (Triton kernels, CUDA graphs, greedy sampling, logits against transformers on CUDA,
# the sm_90 compile check), then the decode-step benchmark of the Llama-3-8B shape at batch 1
# (scripts/bench_cuda.py). Each part has its own time limit, so a slow part leaves the others
# their time; everything lands in OUT (bench_cuda.json, pytest.log, ...).
#
#   OUT=runs/gpu-check bash scripts/gpu_check.sh
#   OUT=/tmp/o TESTS_S=200 BENCH_S=300 MODES=graphs,skinny,skinny-proj-pdl bash scripts/gpu_check.sh
#
# Not a test: nothing depends on a GPU. Exit status: the tests' (0 when they all passed).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/gpu-check}
TESTS_S=${TESTS_S:-240}
BENCH_S=${BENCH_S:-300}
MODES=${MODES:-graphs,skinny,skinny-proj-pdl}
CONTEXTS=${CONTEXTS:-128,1024}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
PY=${PYTHON:-python3}

{
  date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
  "$PY" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
} > "$OUT/machine.txt" 2>&1
cat "$OUT/machine.txt"

echo "== CUDA tests (limit ${TESTS_S} s)"
timeout "$TESTS_S" "$PY" -m pytest -q -p no:cacheprovider -rfE \
  tests/test_triton_kernels.py tests/test_cuda_graphs.py tests/test_sampler.py \
  tests/test_triton_compile.py tests/test_model_vs_transformers.py \
  -k "not (test_model_vs_transformers and not cuda)" > "$OUT/pytest.log" 2>&1
tests_rc=$?
tail -n 15 "$OUT/pytest.log"
echo "tests: exit $tests_rc ($( (grep -oE '^[.sFE]+' "$OUT/pytest.log" || true) | tr -d '\n' \
  | tr -cd '.' | wc -c) passed)"

echo "== decode steps (limit ${BENCH_S} s): $MODES"
timeout "$BENCH_S" "$PY" scripts/bench_cuda.py --out "$OUT" --batch-sizes 1 \
  --contexts "$CONTEXTS" --steps 30 --rounds 3 --modes "$MODES" --no-linears \
  > "$OUT/bench.log" 2>&1
echo "bench: exit $?"
tail -n 20 "$OUT/bench.log"
exit "$tests_rc"
