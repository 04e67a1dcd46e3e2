"""The Llama-family architecture description, parsed from a Hugging Face ``config.json``."""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
MODEL_TYPES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
               "qwen2": "Qwen2ForCausalLM"}  # for a config.json naming no architectures
# max_position_embeddings where config.json leaves it out (transformers' defaults)
DEFAULT_POSITIONS = {"LlamaForCausalLM": 2048, "MistralForCausalLM": 131072,
                     "Qwen2ForCausalLM": 32768}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
ROPE_FIELDS = {"default": (), "linear": ("factor",),  # what each rope type cannot do without
               "llama3": ("factor", "original_max_position_embeddings")}
_MISSING = object()


def kv_bytes_per_token(layers: int, kv_heads: int, head_dim: int, dtype_bytes: int,
                       tp: int = 1, pp: int = 1) -> int:
    """Bytes of keys and values one token occupies on one worker: the stage with the most
    layers, and this tensor-parallel rank's share of the KV heads (at least one head)."""
    return 2 * -(-layers // pp) * max(1, kv_heads // tp) * head_dim * dtype_bytes


class ModelLoadError(ValueError):
    """The model directory cannot be served; the message says what is wrong."""


@dataclass(frozen=True)
class ArchConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    rope_scaling: dict = field(default_factory=dict)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    sliding_window: int | None = None
    dtype: str | None = None

    @property
    def num_params(self) -> int:
        h, f, d = self.hidden_size, self.intermediate_size, self.head_dim
        attn = h * (self.num_heads + 2 * self.num_kv_heads) * d + self.num_heads * d * h
        layer = attn + 3 * h * f + 2 * h
        emb = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * layer + emb + h

    @property
    def prefill_matmul_params(self) -> int:
        """Weights a prompt token is multiplied through: the decoder layers' linears. The
        embedding is a lookup, and the LM head runs only on the tokens that are sampled."""
        h, f, d = self.hidden_size, self.intermediate_size, self.head_dim
        return self.num_layers * (h * (self.num_heads + 2 * self.num_kv_heads) * d
                                  + self.num_heads * d * h + 3 * h * f)

    def kv_bytes_per_token(self, dtype_bytes: int, tp: int = 1, pp: int = 1) -> int:
        return kv_bytes_per_token(self.num_layers, self.num_kv_heads, self.head_dim,
                                  dtype_bytes, tp, pp)


def read_arch(model_dir: str | Path) -> ArchConfig:
    if not Path(model_dir).is_dir():
        raise ModelLoadError(f"model directory {str(model_dir)!r} does not exist")
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ModelLoadError(f"{model_dir}: no config.json (not a Hugging Face model directory)")
    try:
        cfg = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{path}: invalid JSON ({e})") from None
    arch = parse_arch(cfg, str(path))
    # generation_config.json may declare more ends of sequence than config.json (Llama 3.1
    # Instruct: <|end_of_text|>, <|eom_id|>, <|eot_id|>); every one of them ends a request.
    gen = Path(model_dir) / "generation_config.json"
    if gen.is_file():
        try:
            more = _token_ids(json.loads(gen.read_text()).get("eos_token_id"))
        except (json.JSONDecodeError, AttributeError, TypeError, ValueError) as e:
            raise ModelLoadError(f"{gen}: invalid ({e})") from None
        arch = replace(arch, eos_token_ids=tuple(dict.fromkeys(arch.eos_token_ids + more)))
    return arch


def _token_ids(value) -> tuple[int, ...]:
    """A config's token id or list of ids (``eos_token_id``), as a tuple."""
    if value is None:
        return ()
    ids = value if isinstance(value, list) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in ids):
        raise ValueError(f"{value!r} is not a token id or a list of them")
    return tuple(ids)


def parse_arch(cfg: dict, where: str = "config.json") -> ArchConfig:
    if not isinstance(cfg, dict):
        raise ModelLoadError(f"{where}: not a JSON object")
    archs = cfg.get("architectures") or []
    arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    typed = MODEL_TYPES.get(cfg.get("model_type"))
    if not archs:  # transformers then goes by model_type
        arch = typed
    elif arch is not None and typed is not None and typed != arch:
        # vLLM builds the architecture, transformers the model type: two different models
        # (a Mistral's window, a Qwen2's biases), and no telling which one was trained.
        raise ModelLoadError(f"{where}: architectures names {arch} but model_type"
                             f" {cfg['model_type']!r} is {typed}")
    if arch is None:
        raise ModelLoadError(
            f"{where}: architecture {archs or cfg.get('model_type')!r} is not supported;"
            f" supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )

    def need(key: str) -> int | float:
        if key not in cfg:
            raise ModelLoadError(f"{where}: missing required field {key!r}")
        return cfg[key]

    def number(key: str, kind: type = int, default=_MISSING, value=_MISSING) -> int | float:
        """Field ``key`` as ``kind`` (``value``: what to convert, if not the field itself),
        or one line naming it when it is not a number of that kind."""
        if value is _MISSING:
            value = need(key) if default is _MISSING else cfg.get(key, default)
        what = "an integer" if kind is int else "a number"
        try:
            if isinstance(value, bool) or (kind is int and isinstance(value, float)
                                           and not value.is_integer()):
                raise TypeError
            return kind(value)
        except (TypeError, ValueError, OverflowError):
            raise ModelLoadError(f"{where}: {key} must be {what}, got {value!r}") from None

    # What fluidserve cannot run must not run as something else (wrong outputs, silently).
    if quant := cfg.get("quantization_config"):
        method = quant.get("quant_method", "?") if isinstance(quant, dict) else quant
        raise ModelLoadError(f"{where}: quantized checkpoints are not supported"
                             f" (quantization_config: {method})")
    if number("partial_rotary_factor", float, 1.0) != 1.0:
        raise ModelLoadError(f"{where}: partial_rotary_factor"
                             f" {cfg['partial_rotary_factor']!r} is not supported (only 1)")
    hidden = number("hidden_size")
    heads = number("num_attention_heads")
    if heads < 1:
        raise ModelLoadError(f"{where}: num_attention_heads must be >= 1, got {heads}")
    act = cfg.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise ModelLoadError(f"{where}: hidden_act {act!r} is not supported (only silu)")
    # As transformers reads them: a legacy rope_scaling wins over rope_parameters, and
    # rope_parameters' own rope_theta over a top-level one.
    rope = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    if not isinstance(rope, dict):
        raise ModelLoadError(f"{where}: rope_scaling must be an object, got {rope!r}")
    if any(isinstance(v, dict) for v in rope.values()):
        raise ModelLoadError(f"{where}: RoPE parameters per layer type ({', '.join(rope)}) are"
                             " not supported")
    rope = dict(rope)
    theta = number("rope_theta", float, value=rope.get("rope_theta",
                                                       cfg.get("rope_theta", 10000.0)))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type == "llama3" and "original_max_position_embeddings" in cfg:
        # (transformers: the top-level field, where a checkpoint has one, wins)
        rope["original_max_position_embeddings"] = cfg["original_max_position_embeddings"]
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelLoadError(
            f"{where}: rope type {rope_type!r} is not supported;"
            f" supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    rope["rope_type"] = rope_type
    for key in ROPE_FIELDS[rope_type]:
        value = rope.get(key)
        if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
            raise ModelLoadError(f"{where}: rope scaling {rope_type!r} needs {key} (a number"
                                 f" > 0), got {value!r}")
    if rope_type == "llama3":  # transformers' defaults; the smoothing divides by their gap
        low, high = (rope.get(k, d) for k, d in (("low_freq_factor", 1.0),
                                                  ("high_freq_factor", 4.0)))
        if not all(isinstance(v, int | float) and not isinstance(v, bool) for v in (low, high)) \
                or not 0 < low < high:
            raise ModelLoadError(f"{where}: rope scaling 'llama3' needs 0 < low_freq_factor <"
                                 f" high_freq_factor, got {low!r} and {high!r}")
    try:
        eos_ids = _token_ids(cfg.get("eos_token_id"))
    except (TypeError, ValueError):
        raise ModelLoadError(f"{where}: eos_token_id {cfg.get('eos_token_id')!r} is not a"
                             f" token id or a list of them") from None
    # What transformers' class of each architecture reads, with its defaults: Llama has no
    # window and the only optional biases; Mistral's window is 4096 unless set (null: none);
    # Qwen2's applies to the layers from max_window_layers on, and has fixed biases.
    is_qwen, is_llama = arch == "Qwen2ForCausalLM", arch == "LlamaForCausalLM"
    layers = number("num_hidden_layers")
    window = None if is_llama else cfg.get("sliding_window", 4096 if not is_qwen else None)
    if is_qwen:  # windowed layers: those layer_types says, else max_window_layers onwards
        kinds = cfg.get("layer_types")
        windowed = any(k == "sliding_attention" for k in kinds) if isinstance(kinds, list) \
            else cfg.get("max_window_layers", 28) < layers
        if not (cfg.get("use_sliding_window", False) and windowed):
            window = None  # (some layers windowed: the context is capped at the window, below)
    attention_bias = is_llama and bool(cfg.get("attention_bias", False))
    out = ArchConfig(
        architecture=arch,
        vocab_size=number("vocab_size"),
        hidden_size=hidden,
        intermediate_size=number("intermediate_size"),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=number("num_key_value_heads", value=cfg.get("num_key_value_heads") or heads),
        head_dim=number("head_dim", value=cfg.get("head_dim") or hidden // heads),
        rms_norm_eps=number("rms_norm_eps", float, 1e-6),
        rope_theta=theta,
        max_position_embeddings=number("max_position_embeddings", int,
                                       DEFAULT_POSITIONS[arch]),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=is_qwen or attention_bias,
        o_bias=attention_bias,
        mlp_bias=is_llama and bool(cfg.get("mlp_bias", False)),
        rope_scaling=rope,
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=eos_ids,
        sliding_window=number("sliding_window", value=window) if window else None,
        dtype=cfg.get("torch_dtype") or cfg.get("dtype"),
    )
    for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                 "num_kv_heads", "head_dim", "max_position_embeddings"):
        if getattr(out, name) < 1:
            raise ModelLoadError(f"{where}: {name} must be >= 1, got {getattr(out, name)}")
    if out.num_heads % out.num_kv_heads:
        raise ModelLoadError(f"{where}: {out.num_heads} attention heads do not share"
                             f" {out.num_kv_heads} key-value heads evenly")
    return out
