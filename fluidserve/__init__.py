"""fluidserve: LLM serving with stall-free chunked-prefill batching, and tools to measure it."""

from __future__ import annotations

from typing import TYPE_CHECKING

from fluidserve.config import EngineConfig, ServerConfig
from fluidserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from fluidserve.engine.llm import LLM

__version__ = "0.1.0"
__all__ = ["LLM", "EngineConfig", "SamplingParams", "ServerConfig", "__version__"]


def __getattr__(name: str):
    if name == "LLM":  # import torch only when the model is actually needed
        from fluidserve.engine.llm import LLM

        return LLM
    raise AttributeError(name)
