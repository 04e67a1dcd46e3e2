"""Load a Hugging Face-format directory: config.json, *.safetensors (single or sharded)."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import torch
from safetensors import safe_open

from fluidserve.model.arch import ArchConfig, ModelLoadError, read_arch
from fluidserve.model.llama import LlamaForCausalLM, Rotary, Shard, TensorParallel

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(requested: str, arch, device: str = "cpu") -> str:
    """The dtype to run: ``requested``, or for ``auto`` (the default, as in ``vllm serve``) the
    checkpoint's own (config.json ``torch_dtype``; float32 when it names none). A float16
    checkpoint runs in bfloat16 on the CPU, whose matrix units and kernels are built for it."""
    if requested != "auto":
        return requested
    name = str(arch.dtype or "float32").removeprefix("torch.")
    if name not in DTYPES:
        name = "float32"
    if name == "float16" and device.startswith("cpu"):
        log.info("the float16 checkpoint runs in bfloat16 on the CPU (--dtype float16 keeps"
                 " it, slower)")
        name = "bfloat16"
    return name


_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
# HF parameter suffix -> (our module path, slot in the fused tensor or None)
_FUSED = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
}


def safetensors_files(model_dir: Path) -> list[Path]:
    """The checkpoint's files, found as transformers finds them: ``model.safetensors``, else
    the shards its index names (an index left beside a newer single file is stale), else the
    one ``*.safetensors`` file there is; never several files that were not named together."""
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted({model_dir / f for f in weight_map.values()})
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
            raise ModelLoadError(f"{index}: malformed index, not a weight_map of tensor names"
                                 f" to file names ({type(e).__name__}: {e})") from None
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ModelLoadError(f"{model_dir}: shards named in the index are missing: {missing}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        other = [p.name for p in model_dir.glob("*.bin")] + [p.name for p in model_dir.glob("*.pt")]
        hint = f" (found {other}; only safetensors is supported)" if other else ""
        raise ModelLoadError(f"{model_dir}: no *.safetensors weight files{hint}")
    if len(files) > 1:
        raise ModelLoadError(
            f"{model_dir}: several weight files ({', '.join(f.name for f in files[:5])}) and"
            " no model.safetensors.index.json saying they are one checkpoint; name the"
            " checkpoint model.safetensors or give its index")
    return files


def read_weights(files: list[Path], wanted=lambda name: True) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as fh:
                for name in fh.keys():  # noqa: SIM118 - safe_open has no __iter__
                    if wanted(name):
                        if name in out:
                            raise ModelLoadError(f"tensor {name} is in more than one file")
                        out[name] = fh.get_tensor(name)
        except ModelLoadError as e:
            raise ModelLoadError(f"{f}: {e}") from None
        except Exception as e:  # safetensors raises its own error types
            raise ModelLoadError(f"{f}: cannot read safetensors file ({e})") from None
    return out


def map_hf_weights(hf: dict[str, torch.Tensor], cfg: ArchConfig) -> dict[str, torch.Tensor]:
    """Rename HF tensors to this model's names and fuse QKV and gate/up projections."""
    out: dict[str, torch.Tensor] = {}
    parts: dict[str, list[torch.Tensor | None]] = {}
    if cfg.tie_word_embeddings:
        hf = _tie(hf)
    for name, t in hf.items():
        if name.endswith("rotary_emb.inv_freq"):
            continue
        m = _LAYER.match(name)
        if m is None:
            out[name.removeprefix("model.")] = t
            continue
        layer, rest = m.groups()
        module, _, kind = rest.rpartition(".")
        if module in _FUSED:
            target, slot = _FUSED[module]
            key = f"layers.{layer}.{target}.{kind}"
            parts.setdefault(key, [None, None, None])[slot] = t
        else:
            out[f"layers.{layer}.{rest}"] = t
    for key, ts in parts.items():
        present = [t for t in ts if t is not None]
        expected = 3 if "qkv" in key else 2
        if len(present) != expected:
            names = ("q_proj", "k_proj", "v_proj") if "qkv" in key else ("gate_proj", "up_proj")
            lost = [n for n, t in zip(names, ts, strict=False) if t is None]
            raise ModelLoadError(f"incomplete fused weight {key}: the checkpoint has no {lost}"
                                 " for it")
        out[key] = torch.cat(present, dim=0)
    return out


def _tie(hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A tied checkpoint's one matrix as the embedding: the file may hold it under either
    name (transformers loads both); an LM head that differs from the embedding is not used,
    as in vLLM (transformers would untie the two), and is reported."""
    hf = dict(hf)
    head = hf.pop("lm_head.weight", None)
    embed = hf.get("model.embed_tokens.weight")
    if head is None:
        return hf
    if embed is None:
        hf["model.embed_tokens.weight"] = head
    elif head.shape != embed.shape or not torch.equal(head, embed):
        log.warning("config.json ties the LM head to the embedding, but the checkpoint's"
                    " lm_head.weight differs from model.embed_tokens.weight: the embedding"
                    " is used for both (set tie_word_embeddings false to use the head)")
    return hf


def wanted_for(cfg: ArchConfig, shard: Shard):
    """Which HF tensors a shard needs (its layers; embedding, norm and LM head by stage)."""
    span = shard.layers(cfg.num_layers)

    def wanted(name: str) -> bool:
        m = _LAYER.match(name)
        if m is not None:
            return int(m.group(1)) in span
        if name.startswith("model.embed_tokens."):
            return shard.first or (shard.last and cfg.tie_word_embeddings)
        if name.startswith("lm_head."):  # (tied, it may be the only copy of the embedding)
            return shard.last or (shard.first and cfg.tie_word_embeddings)
        if name.startswith("model.norm."):
            return shard.last
        return True

    return wanted


def shard_weights(weights: dict[str, torch.Tensor], cfg: ArchConfig, shard: Shard
                  ) -> dict[str, torch.Tensor]:
    """Renumber this stage's layers from 0 and keep this tensor-parallel rank's slices:
    column-parallel QKV and gate/up by output rows (per fused part), row-parallel output and
    down projections by input columns (their bias added by rank 0 only)."""
    r, n = shard.tp_rank, shard.tp_size
    h, hkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    offset = shard.layers(cfg.num_layers).start
    out = {}
    for key, t in weights.items():
        m = re.match(r"^layers\.(\d+)\.(.+)$", key)
        if m is None:
            out[key] = t
            continue
        key = f"layers.{int(m.group(1)) - offset}.{m.group(2)}"
        if n > 1:
            t = _tp_slice(m.group(2), t, r, n, [h * d, hkv * d, hkv * d])
        out[key] = t
    if shard.last and cfg.tie_word_embeddings and not shard.first:
        out["lm_head.weight"] = out.pop("embed_tokens.weight")
    return out


def _tp_slice(name: str, t: torch.Tensor, r: int, n: int, qkv: list[int]) -> torch.Tensor:
    if name.startswith("self_attn.qkv_proj."):
        return torch.cat([p.chunk(n, 0)[r] for p in t.split(qkv, 0)], 0)
    if name.startswith("mlp.gate_up_proj."):
        return torch.cat([p.chunk(n, 0)[r] for p in t.chunk(2, 0)], 0)
    if name in ("self_attn.o_proj.weight", "mlp.down_proj.weight"):
        return t.chunk(n, 1)[r]
    if name in ("self_attn.o_proj.bias", "mlp.down_proj.bias"):
        return t if r == 0 else torch.zeros_like(t)
    return t  # norms: replicated


def load_model(
    model_dir: str | Path, dtype: str = "float32", device: str = "cpu",
    max_len: int | None = None, shard: Shard | None = None, tp: TensorParallel | None = None,
) -> tuple[ArchConfig, LlamaForCausalLM]:
    shard = shard or Shard()
    model_dir = Path(model_dir)
    cfg = read_arch(model_dir)  # a missing directory is its ModelLoadError
    try:
        shard.check(cfg)
    except ValueError as e:
        raise ModelLoadError(f"{model_dir}: {e}") from None
    hf = read_weights(safetensors_files(model_dir), wanted_for(cfg, shard))
    try:
        weights = shard_weights(map_hf_weights(hf, cfg), cfg, shard)
    except ModelLoadError as e:
        raise ModelLoadError(f"{model_dir}: {e}") from None
    with torch.device("meta"):
        expected = dict(LlamaForCausalLM(cfg, 1, shard, tp).state_dict())
    if cfg.tie_word_embeddings and shard.first:
        expected.pop("lm_head.weight", None)
    missing = sorted(set(expected) - set(weights))
    unexpected = sorted(set(weights) - set(expected))
    if missing or unexpected:
        raise ModelLoadError(
            f"{model_dir}: weights do not match {cfg.architecture}:"
            f" missing {missing[:5]}{'...' if len(missing) > 5 else ''},"
            f" unexpected {unexpected[:5]}{'...' if len(unexpected) > 5 else ''}"
        )
    for k, t in weights.items():
        if not t.is_floating_point():  # cast, they would run as numbers of another meaning
            raise ModelLoadError(f"{model_dir}: weight {k} is {str(t.dtype).removeprefix('torch.')}"
                                 ": quantized or integer weights are not supported")
        if tuple(t.shape) != tuple(expected[k].shape):
            raise ModelLoadError(
                f"{model_dir}: weight {k} has shape {tuple(t.shape)}, config implies"
                f" {tuple(expected[k].shape)}"
            )
    torch_dtype = DTYPES[dtype]
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg, 1, shard, tp)
    tensors = {k: t.to(device=device, dtype=torch_dtype) for k, t in weights.items()}
    model.load_state_dict(tensors, strict=False, assign=True)
    if cfg.tie_word_embeddings and shard.first and shard.last:
        model.lm_head.weight = model.embed_tokens.weight
    # RoPE tables stay float32 whatever the weight dtype.
    model.rotary = Rotary(cfg, max_len or cfg.max_position_embeddings).to(device)
    return cfg, model.eval()
