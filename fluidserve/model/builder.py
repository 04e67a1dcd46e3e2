"""Model directories that need no download: the embedded default, and benchmark shapes.

The default model (``default_model_dir``) is a small Llama trained on Shakespeare's plays by
``scripts/train_default_model.py`` and shipped with the package (``model/assets/default``).
Benchmark shapes (``cached_model_dir``) are built locally: a byte-level BPE trained
(``tokenizers``) on a small text corpus shipped with the package, and seeded random weights.
Either is an ordinary Hugging Face directory, loaded by the same code as any other model.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from importlib import resources
from pathlib import Path

BUILDER_VERSION = 1
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


@dataclass(frozen=True)
class ModelShape:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    vocab_size: int | None = None  # None: the tokenizer's size
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = True
    rope_theta: float = 10000.0


SHAPES = {
    "tiny": ModelShape(256, 768, 4, 8, 4),
    "small": ModelShape(512, 1408, 8, 8, 4),
    # ~250M parameters with a Llama-2-like 32000-token vocabulary.
    "250m": ModelShape(1024, 2816, 20, 16, 8, vocab_size=32000, max_position_embeddings=4096),
    # ~213M parameters, grouped-query attention 16/4: the shape of the engine races.
    "200m-gqa": ModelShape(1024, 2816, 16, 16, 4, vocab_size=32000, max_position_embeddings=4096),
    # TinyLlama-1.1B's shape (1.10B parameters, GQA 32/4, untied head): the race at a size
    # whose weights (2.2 GB in bf16) no CPU cache holds.
    "1b-gqa": ModelShape(2048, 5632, 22, 32, 4, vocab_size=32000, max_position_embeddings=4096,
                         tie_word_embeddings=False),
    # Llama-3-8B's shape (8.03B parameters, GQA 32/8, 128256-token vocabulary, untied head):
    # the GPU decode benchmark. Random weights; use build-model --device cuda to make them fast.
    "llama3-8b": ModelShape(4096, 14336, 32, 32, 8, vocab_size=128256,
                            max_position_embeddings=8192, tie_word_embeddings=False,
                            rope_theta=500000.0),
}
DEFAULT_SHAPE = "tiny"


def cache_root() -> Path:
    env = os.environ.get("FLUIDSERVE_CACHE")
    base = Path(env) if env else Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return base if env else base / "fluidserve"


def corpus_text() -> str:
    return resources.files("fluidserve.model").joinpath("assets/corpus.txt").read_text()


def build_tokenizer(out_dir: Path, vocab_size: int = 2048, corpus: Iterable[str] | None = None
                    ) -> int:
    """Train a byte-level BPE on ``corpus`` (default: the lines of the shipped corpus); write
    HF tokenizer files (BOS added, the chat template). Returns its size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus_text().splitlines() if corpus is None else corpus,
                            trainer=trainer)
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)]
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "add_bos_token": True,
        "model_max_length": 1 << 20,
        "chat_template": CHAT_TEMPLATE,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return tok.get_vocab_size()


def hf_config(shape: ModelShape, vocab_size: int, dtype: str, bos: int, eos: int) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": shape.hidden_size,
        "intermediate_size": shape.intermediate_size,
        "num_hidden_layers": shape.num_layers,
        "num_attention_heads": shape.num_heads,
        "num_key_value_heads": shape.num_kv_heads,
        "head_dim": shape.hidden_size // shape.num_heads,
        "vocab_size": vocab_size,
        "max_position_embeddings": shape.max_position_embeddings,
        "rms_norm_eps": 1e-5,
        "rope_theta": shape.rope_theta,
        "hidden_act": "silu",
        "tie_word_embeddings": shape.tie_word_embeddings,
        "attention_bias": False,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "torch_dtype": dtype,
    }


def random_weights(cfg: dict, seed: int, dtype, device: str = "cpu"):
    """HF-named tensors, N(0, 0.02) for matrices and ones for norms, from a seeded generator
    on ``device`` (the same seed draws other values on a GPU than on the CPU)."""
    import torch

    g = torch.Generator(device).manual_seed(seed)
    h, f, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    d = cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d

    def normal(*shape: int):
        return (torch.randn(*shape, generator=g, device=device) * 0.02).to(dtype).cpu()

    w = {"model.embed_tokens.weight": normal(v, h), "model.norm.weight": torch.ones(h, dtype=dtype)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w |= {
            p + "self_attn.q_proj.weight": normal(q, h),
            p + "self_attn.k_proj.weight": normal(kv, h),
            p + "self_attn.v_proj.weight": normal(kv, h),
            p + "self_attn.o_proj.weight": normal(h, q),
            p + "mlp.gate_proj.weight": normal(f, h),
            p + "mlp.up_proj.weight": normal(f, h),
            p + "mlp.down_proj.weight": normal(h, f),
            p + "input_layernorm.weight": torch.ones(h, dtype=dtype),
            p + "post_attention_layernorm.weight": torch.ones(h, dtype=dtype),
        }
    if not cfg["tie_word_embeddings"]:
        w["lm_head.weight"] = normal(v, h)
    return w


def save_sharded(weights: dict, out_dir: Path, max_shard_bytes: int) -> None:
    from safetensors.torch import save_file

    # The weights of an earlier build here would be read with these (a stale index first).
    for old in [*out_dir.glob("*.safetensors"), out_dir / "model.safetensors.index.json"]:
        old.unlink(missing_ok=True)

    shards: list[dict] = [{}]
    size = 0
    for name, t in weights.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t.contiguous()
        size += nbytes
    if len(shards) == 1:
        save_file(shards[0], str(out_dir / "model.safetensors"), metadata={"format": "pt"})
        return
    weight_map = {}
    for i, shard in enumerate(shards, 1):
        fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out_dir / fname), metadata={"format": "pt"})
        weight_map |= {name: fname for name in shard}
    index = {
        "metadata": {"total_size": sum(t.numel() * t.element_size() for t in weights.values())},
        "weight_map": weight_map,
    }
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def build_model_dir(
    out_dir: str | Path,
    shape: str | ModelShape = DEFAULT_SHAPE,
    *,
    dtype: str = "float32",
    seed: int = 0,
    max_shard_bytes: int = 2 << 30,
    device: str = "cpu",
) -> Path:
    """Write a complete HF-format Llama model directory (tokenizer included) to ``out_dir``."""
    if isinstance(shape, str):
        if shape not in SHAPES:
            raise ValueError(f"unknown model shape {shape!r}; choose from {', '.join(SHAPES)}")
        shape = SHAPES[shape]
    out_dir = Path(out_dir)
    n_tok = build_tokenizer(out_dir)
    vocab = shape.vocab_size or n_tok
    if vocab < n_tok:
        raise ValueError(f"vocab_size {vocab} is smaller than the tokenizer ({n_tok})")
    import torch

    torch_dtype = getattr(torch, dtype)
    cfg = hf_config(shape, vocab, dtype, SPECIAL_TOKENS.index("<s>"), SPECIAL_TOKENS.index("</s>"))
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2))
    save_sharded(random_weights(cfg, seed, torch_dtype, device), out_dir, max_shard_bytes)
    return out_dir


def default_model_dir() -> Path:
    """The embedded default model: what serve / generate / ``LLM()`` load without --model."""
    path = Path(str(resources.files("fluidserve.model").joinpath("assets/default")))
    if not (path / "config.json").is_file() or not (path / "model.safetensors").is_file():
        raise FileNotFoundError(
            f"the embedded default model is missing from {path} (a broken install?);"
            " reinstall fluidserve, or pass --model")
    return path


def race_model_dir(shape: str = "200m-gqa", log=print) -> Path:
    """The model of the race against vLLM's CPU build and of the benchmarks beside it
    (``race-{shape}-bf16`` in the user cache: random bf16 weights, seed 0), built once
    (saying so through ``log``)."""
    target = cache_root() / "models" / f"race-{shape}-bf16"
    if not (target / "config.json").is_file():
        log(f"building the {shape} model (random bf16 weights) in {target}")
        tmp = target.with_suffix(".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        build_model_dir(tmp, shape, dtype="bfloat16")
        tmp.rename(target)
    return target


def cached_model_dir(shape: str = DEFAULT_SHAPE, dtype: str = "float32", seed: int = 0) -> Path:
    """The model directory for (shape, dtype, seed), built once into the user cache."""
    key = json.dumps([BUILDER_VERSION, asdict(SHAPES[shape]), dtype, seed, corpus_text()])
    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    target = cache_root() / "models" / f"fluidserve-{shape}-{dtype}-{digest}"
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    try:
        build_model_dir(tmp, shape, dtype=dtype, seed=seed)
        try:
            tmp.rename(target)
        except OSError:  # built concurrently by another process: keep theirs
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
