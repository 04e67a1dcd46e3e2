#!/usr/bin/env bash
# Mutation testing of the scheduling core and the metrics (mutmut, `pip install -e .[dev]`).
#
# Mutates fluidserve/core/, fluidserve/bench/fluidity.py, fluidserve/bench/report.py and
# fluidserve/metrics.py and runs, for each mutant, the fast pure-Python tests that cover the
# mutated function (the files listed in pyproject.toml [tool.mutmut]). Not part of the
# default test run: about an hour on 2 cores. Prints the score and the surviving mutants;
# `mutmut show NAME` in the work directory shows one (README, "Testing", lists the
# survivors and why each is equivalent or accepted).
#
#   scripts/mutation.sh                          # all cores, work directory in $TMPDIR
#   JOBS=1 WORKDIR=/tmp/mut scripts/mutation.sh  # one core, chosen work directory
set -euo pipefail

repo=$(cd "$(dirname "$0")/.." && pwd)
work=${WORKDIR:-${TMPDIR:-/tmp}/fluidserve-mutation}
jobs=${JOBS:-$(nproc)}

# mutmut writes mutants/ beside the sources: run on a copy of the checkout (tracked and
# untracked-but-not-ignored files, uncommitted edits included) so the checkout stays clean.
rm -rf "$work"
mkdir -p "$work"
git -C "$repo" ls-files -z --cached --others --exclude-standard \
    | (cd "$repo" && xargs -0 -I{} sh -c 'test -e "$1" && cp --parents "$1" "$0"' "$work" {})
# The mutants run from the copy: point them at the checkout's traces and GPU profiles.
export FLUIDSERVE_DATA_DIR=${FLUIDSERVE_DATA_DIR:-$(cd "$repo" && python -c \
    'from fluidserve.data import data_dir; print(data_dir() or "")')}
# mutmut forks each mutant's test run from a process that has already run torch: one
# OpenMP thread keeps libgomp fork-safe (a child would otherwise deadlock in its first
# parallel op, asleep, where the CPU-time limit never fires).
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
cd "$work"

HYPOTHESIS_PROFILE=mutation mutmut run --max-children "$jobs"
mutmut export-cicd-stats
python - <<'EOF'
import json

s = json.load(open("mutants/mutmut-cicd-stats.json"))
tested = s["total"] - s.get("skipped", 0) - s.get("not_checked", 0)
killed = s["killed"] + s["timeout"]
print(f"mutants: {s['total']}, killed {s['killed']}, timed out {s['timeout']},"
      f" survived {s['survived']}, no tests {s['no_tests']}, suspicious {s['suspicious']}")
print(f"score: {killed} / {tested} = {100 * killed / tested:.1f}% killed")
EOF
echo "surviving mutants (mutmut show NAME in $work):"
mutmut results
