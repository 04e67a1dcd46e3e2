from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, Phase, settings

# Without a GPU the Triton kernels (the CUDA fast path) run on the CPU through Triton's
# interpreter, so they are checked against the eager reference on every machine. Triton reads
# this when a kernel is defined: it must be set before anything imports them.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from fluidserve.model.builder import build_tokenizer, cached_model_dir  # noqa: E402

ARCHS = ("llama", "mistral", "qwen2")

# Property tests are deterministic by default (the same examples on every run, no deadline,
# no example database), so a test run never flakes; HYPOTHESIS_PROFILE=explore searches wider.
settings.register_profile(
    "ci",
    derandomize=True,
    deadline=None,
    database=None,
    max_examples=100,
    suppress_health_check=[HealthCheck.too_slow],
)
# The same examples without shrinking a failure: scripts/mutation.sh only needs to know
# that a test fails, and shrinking each killed mutant's counterexample costs minutes.
settings.register_profile(
    "mutation", settings.get_profile("ci"), phases=(Phase.explicit, Phase.generate)
)
settings.register_profile("explore", deadline=None, max_examples=2000)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def make_hf_model(
    kind: str,
    out: Path,
    vocab: int,
    *,
    tied: bool = False,
    seed: int = 0,
    rope_scaling: dict | None = None,
) -> Path:
    """A small random-weight model written by transformers itself (the reference)."""
    import transformers as tf

    common = dict(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        tie_word_embeddings=tied,
        bos_token_id=1,
        eos_token_id=2,
    )
    if kind == "llama":
        cfg = tf.LlamaConfig(rope_theta=10000.0, rope_scaling=rope_scaling, **common)
        cls = tf.LlamaForCausalLM
    elif kind == "mistral":
        cfg, cls = (
            tf.MistralConfig(rope_theta=1e6, sliding_window=None, **common),
            tf.MistralForCausalLM,
        )
    elif kind == "qwen2":
        cfg, cls = tf.Qwen2Config(rope_theta=1e6, **common), tf.Qwen2ForCausalLM
    else:
        raise ValueError(kind)
    torch.manual_seed(seed)
    cfg.initializer_range = 0.1  # wider logits: fewer near-ties in greedy comparisons
    model = cls(cfg).eval()
    model.save_pretrained(out, safe_serialization=True)
    return out


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("tok")
    build_tokenizer(d)
    return d


@pytest.fixture(scope="session")
def hf_models(tmp_path_factory, tokenizer_dir) -> dict[str, Path]:
    from fluidserve.model.tokenizer import Tokenizer

    vocab = len(Tokenizer(tokenizer_dir))
    out = {}
    for kind in ARCHS:
        d = make_hf_model(kind, tmp_path_factory.mktemp(kind), vocab)
        for f in tokenizer_dir.iterdir():
            shutil.copy(f, d / f.name)
        out[kind] = d
    return out


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    """The random-weight tiny model: engine mechanics, fast and deterministic (it never
    emits end-of-sequence on its own, so outputs run to max_tokens)."""
    return cached_model_dir()


@pytest.fixture
def few_key_splits(monkeypatch):
    """Under the Triton interpreter (no GPU), at most 2 key splits per decode attention launch.

    Decode batches of a few requests get 16 splits, sized for a GPU's multiprocessors, and the
    interpreter runs every one of them, most with no keys: 84 of the 122 s of the CUDA-graph
    replay test under cProfile. Two keep the split-and-merge path at an eighth of the
    programs; the split counts themselves are test_triton_kernels.py's. On a GPU, unchanged.
    """
    if torch.cuda.is_available():
        return
    from fluidserve.kernels import triton_ops

    shape = triton_ops.tile_shape
    monkeypatch.setattr(triton_ops, "tile_shape",
                        lambda *a: (shape(*a)[0], min(2, shape(*a)[1])))
