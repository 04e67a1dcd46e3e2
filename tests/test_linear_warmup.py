"""The oneDNN linears are warmed up at start-up: every product shape a batch of up to the
token budget can give them is built then, so no request's iteration builds one."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from fluidserve.config import ConfigError, EngineConfig
from fluidserve.model.linear import packed_linear_supported
from fluidserve.model.worker import warmup_rows

# A fresh process (oneDNN's primitive cache is process-wide) with ONEDNN_VERBOSE=2, which
# logs each primitive's creation as a cache miss or hit: an executor built with or without
# the warm-up, then a prompt chunk and decodes of sizes it has not run before.
CODE = """
import sys
from fluidserve.core.scheduler.output import SchedulerOutput
from fluidserve.model.runner import ModelExecutor
from fluidserve.profiler.run import _chunk as chunk

rows = int(sys.argv[2])
ex = ModelExecutor(sys.argv[1], dtype="float32", num_blocks=64, block_size=16,
                   max_num_seqs=8, warmup_rows=(rows, min(rows, 8)))
print("SERVING", flush=True)

ex.execute(SchedulerOutput(0, [chunk("a", 0, 150, 16, 0)]))
ex.execute(SchedulerOutput(1, [chunk("a", 150, 1, 16, 0), chunk("b", 0, 37, 16, 20)]))
print("DONE", flush=True)
"""


def _misses_while_serving(model_dir, rows: int) -> list[str]:
    env = {**os.environ, "ONEDNN_VERBOSE": "2"}
    out = subprocess.run([sys.executable, "-c", CODE, str(model_dir), str(rows)], env=env,
                         capture_output=True, text=True, check=True, timeout=300).stdout
    assert "DONE" in out
    serving = out.split("SERVING", 1)[1]
    return [line for line in serving.splitlines()
            if "create:cache_miss" in line and ("inner_product" in line or "matmul" in line)]


@pytest.mark.skipif(not packed_linear_supported(torch.float32, torch.device("cpu")),
                    reason="no oneDNN linears in this PyTorch")
def test_no_iteration_builds_a_onednn_kernel_after_the_warm_up(tiny_model_dir):
    # Without the warm-up the same batches build their products as they come (the check
    # can fail); with it, none does.
    assert _misses_while_serving(tiny_model_dir, 0)
    assert _misses_while_serving(tiny_model_dir, 256) == []


def test_the_warm_up_covers_the_token_budget_and_the_lm_heads_rows():
    cfg = EngineConfig.create(token_budget=512, max_num_seqs=64)
    assert warmup_rows(cfg) == (512, 64)
    assert warmup_rows(EngineConfig.create(token_budget=8192)) == (2048, 128)
    assert warmup_rows(EngineConfig.create(token_budget="auto", tbt_slo=0.2,
                                           warmup_max_rows=1024)) == (1024, 128)
    assert warmup_rows(EngineConfig.create(warmup_max_rows=0)) == (0, 0)
    assert warmup_rows(EngineConfig.create(device="cuda")) == (0, 0)
    with pytest.raises(ConfigError, match="warmup_max_rows"):
        EngineConfig.create(warmup_max_rows=-1)
