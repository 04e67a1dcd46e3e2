"""The published schema is the truth: schemathesis, with all its checks, against a live server.

The default run takes the cases schemathesis derives from the schema itself (its coverage
phase: each field at its bounds, just past them, of the wrong type; half a minute). The
fuzzing runs with marker ``fuzz`` (a few minutes):

    python -m pytest -m fuzz tests/test_server_fuzz.py

``positive_data_acceptance`` runs narrowed by ``tests/schema_fuzz_hooks.py``: a schema-valid
request whose tokenized prompt does not fit the context window may get its documented 400
``context_length_exceeded`` (JSON Schema cannot count tokens), one whose min_tokens exceeds
the max_tokens in force its documented 400 on ``min_tokens`` (JSON Schema cannot compare two
fields, nor know a default that depends on the prompt), and one whose prompts × n exceed the
requests the server lets wait its documented 400 on ``n`` (nor multiply them); every other
check runs as is.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from .server_utils import InProcessServer

ROOT = Path(__file__).resolve().parents[1]
GENERATE = r"^/v1/(chat/)?completions$"
# Few choices per request (prompts × n), so that a case at the schema's bounds runs in the
# client's ten seconds.
MAX_WAITING = 8


def schemathesis(url: str, max_examples: int, *extra: str, cwd: Path) -> tuple[int, str]:
    cli = Path(sys.executable).with_name("schemathesis")
    if not cli.exists():
        pytest.skip("schemathesis is not installed (pip install -e '.[test]')")
    env = os.environ | {"SCHEMATHESIS_HOOKS": "tests.schema_fuzz_hooks",
                        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH",
                                                                                  "")])}
    proc = subprocess.run(
        [str(cli), "run", url + "/openapi.json", "--checks", "all", "--exclude-checks",
         "positive_data_acceptance", "--workers", "1", "--max-examples", str(max_examples),
         "--continue-on-failure", "--seed", "1", "--no-color", *extra],
        env=env, capture_output=True, text=True, timeout=1800, cwd=cwd)  # its cache goes there
    return proc.returncode, proc.stdout + proc.stderr


def generated(output: str) -> int:
    m = re.search(r"(\d+) generated, (\d+) passed", output)
    assert m and m.group(1) == m.group(2), output[-3000:]
    return int(m.group(1))


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):
    return tiny_model_dir


def test_generation_routes_answer_the_schemas_own_cases_as_it_says(model_dir, tmp_path):
    """The coverage phase alone on /v1/completions and /v1/chat/completions: a rule the server
    enforces and the schema does not state (min_tokens above the default max_tokens was one)
    fails here, in the default run."""
    with InProcessServer(model_dir, engine_kw={"max_model_len": 64, "max_num_seqs": 8},
                         max_waiting_requests=MAX_WAITING) as s:
        rc, out = schemathesis(s.url, 50, "--include-path-regex", GENERATE, "--phases",
                               "coverage", cwd=tmp_path)
    print(out[-1500:])
    assert rc == 0, out[-5000:]
    assert generated(out) >= 100


@pytest.mark.fuzz
def test_generation_routes_conform_to_their_schema(model_dir, tmp_path):
    """At least 1,000 cases on /v1/completions and /v1/chat/completions, no failure, no 5xx."""
    with InProcessServer(model_dir, engine_kw={"max_model_len": 64, "max_num_seqs": 8},
                         max_waiting_requests=MAX_WAITING) as s:
        rc, out = schemathesis(s.url, 400, "--include-path-regex", GENERATE, cwd=tmp_path)
    print(out[-1500:])
    assert rc == 0, out[-5000:]
    assert generated(out) >= 1000


@pytest.mark.fuzz
def test_every_route_conforms_with_an_api_key(model_dir, tmp_path):
    """Every route, with --api-key and --protect-metrics: the key is enforced where the schema
    says (ignored_auth), and nowhere else."""
    with InProcessServer(model_dir, engine_kw={"max_model_len": 64, "max_num_seqs": 8},
                         max_waiting_requests=MAX_WAITING,
                         api_key="fuzz-key", protect_metrics=True) as s:
        rc, out = schemathesis(s.url, 60, "--header", "Authorization: Bearer fuzz-key",
                               cwd=tmp_path)
    print(out[-1500:])
    assert rc == 0, out[-5000:]
    assert generated(out) > 0
