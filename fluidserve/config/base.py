"""What every config module shares: the policy names, the error type, ``knob``."""

from __future__ import annotations

import math
import re
from dataclasses import field

# Policies that run with a fixed token budget (sarathi_slack needs --token-budget auto).
SCHEDULERS = (
    "sarathi",
    "vllm",
    "orca",
    "faster_transformer",
    "decode_maximal",
    "hybrid_only",
    "chunked_only",
)
SLO_SCHEDULERS = ("sarathi_slack",)  # need --token-budget auto --tbt-slo
DTYPES = ("float32", "bfloat16", "float16")
DTYPE_ALIASES = {"half": "float16", "float": "float32"}  # as vLLM's --dtype takes them


def dtype_name(value: str) -> str:
    """A dtype as given (``half``, ``float`` too, as vLLM takes them), by its one name."""
    return DTYPE_ALIASES.get(value, value)


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the knob and the reason."""


def is_config_error(e: BaseException) -> bool:
    """Whether ``e`` says what is wrong with the user's input (a knob, the model directory,
    a value the model's shape rules out, a prompt the engine refuses): told as one line, not
    a traceback."""
    from fluidserve.core.scheduler.base import RequestRejected
    from fluidserve.model.arch import ModelLoadError

    return isinstance(e, (ConfigError, ModelLoadError, RequestRejected)) or type(e) is ValueError


def knob(default, help: str, **kw):  # noqa: A002 - "help" mirrors argparse
    return field(default=default, metadata={"help": help, **kw})


def check_device(device: str) -> None:
    if not re.fullmatch(r"cpu|cuda(:\d+)?", device):
        raise ConfigError(f"device must be cpu, cuda or cuda:N, got {device!r}")


def require_finite(name: str, value: float, zero_ok: bool = False) -> None:
    """A float knob: finite, and above zero (at least zero with ``zero_ok``); NaN fails both."""
    if not ((0 <= value if zero_ok else 0 < value) and value < math.inf):
        raise ConfigError(f"{name} must be {'>=' if zero_ok else '>'} 0 and finite, got {value}")


def require_positive(name: str, value: int) -> None:
    if value < 1:
        raise ConfigError(f"{name} must be >= 1, got {value}")


MAX_THREADS = 1024  # OpenMP fails to create (or crashes creating) tens of thousands


def check_threads(value: int | None) -> None:
    if value is not None:
        require_positive("num_threads", value)
        if value > MAX_THREADS:
            raise ConfigError(f"num_threads must be at most {MAX_THREADS}, got {value} (threads"
                              f" beyond the cores only share them)")
