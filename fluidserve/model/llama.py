"""Llama-family decoder (Llama, Mistral, Qwen2) over a flattened batch and a paged KV cache.

Hidden states are ``[T, hidden]`` for the T tokens of one iteration across all requests;
there is no batch dimension and no padding. QKV and gate/up projections are fused.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from fluidserve.model.arch import ArchConfig
from fluidserve.model.attention import (
    AttentionMetadata,
    min_long_run,
    paged_attention,
    sampled_rows_metadata,
)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)

    # Kernel variants (``ops``: the compiled CPU or the Triton kernels), rounding as the eager
    # code does.
    def native(self, x: torch.Tensor, ops) -> torch.Tensor:
        out = torch.empty_like(x)
        ops.rms_norm(out, x, self.weight, self.eps)
        return out

    def add_native(self, x: torch.Tensor, residual: torch.Tensor, ops
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(residual + x), residual + x), computed in place in x and residual."""
        ops.fused_add_rms_norm(x, residual, self.weight, self.eps)
        return x, residual


def rope_inv_freq(cfg: ArchConfig) -> torch.Tensor:
    d = cfg.head_dim  # on the CPU whatever the default device (see ``Rotary``)
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64, device="cpu")
                                    / d))
    rs = cfg.rope_scaling
    if rs.get("rope_type") == "linear":
        inv = inv / float(rs["factor"])
    elif rs.get("rope_type") == "llama3":
        factor, orig = float(rs["factor"]), float(rs["original_max_position_embeddings"])
        low, high = float(rs.get("low_freq_factor", 1.0)), float(rs.get("high_freq_factor", 4.0))
        wavelen = 2 * math.pi / inv
        smooth = ((orig / wavelen) - low) / (high - low)
        scaled = torch.where(wavelen > orig / low, inv / factor, inv)
        mid = (wavelen <= orig / low) & (wavelen >= orig / high)
        inv = torch.where(mid, (1 - smooth) * inv / factor + smooth * inv, scaled)
    return inv.float()


class Rotary(nn.Module):
    """Non-interleaved (rotate-half) RoPE with a precomputed cos/sin table.

    The table is computed on the CPU (move the module where it is used), also when the model
    is built on the meta device: there ``arange`` runs PyTorch's Python decomposition, whose
    first call imports torch._dynamo (~2 s of every engine start)."""

    def __init__(self, cfg: ArchConfig, max_len: int) -> None:
        super().__init__()
        positions = torch.arange(max_len, dtype=torch.float32, device="cpu")
        freqs = torch.outer(positions, rope_inv_freq(cfg))
        emb = torch.cat([freqs, freqs], dim=-1)  # [max_len, D]
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cos[positions][:, None, :], self.sin[positions][:, None, :]  # [T, 1, D]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.float().chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (x.float() * cos + rotated * sin).to(x.dtype)


@dataclass(frozen=True)
class Shard:
    """Which part of the model one worker holds: pipeline stage ``pp_rank`` of ``pp_size``
    (a contiguous range of layers) and tensor-parallel rank ``tp_rank`` of ``tp_size``
    (1/tp_size of the attention heads, KV heads and MLP columns of those layers)."""

    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1

    @property
    def first(self) -> bool:
        return self.pp_rank == 0

    @property
    def last(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    def layers(self, num_layers: int) -> range:
        return range(num_layers * self.pp_rank // self.pp_size,
                     num_layers * (self.pp_rank + 1) // self.pp_size)

    def check(self, cfg: ArchConfig) -> None:
        """Raise ValueError if ``cfg`` cannot be split this way."""
        tp, pp = self.tp_size, self.pp_size
        if cfg.num_heads % tp or cfg.num_kv_heads % tp or cfg.intermediate_size % tp:
            raise ValueError(
                f"tensor-parallel size {tp} must divide the attention heads ({cfg.num_heads}),"
                f" KV heads ({cfg.num_kv_heads}) and MLP width ({cfg.intermediate_size})")
        if pp > cfg.num_layers:
            raise ValueError(f"pipeline-parallel size {pp} exceeds the {cfg.num_layers} layers")


class TensorParallel:
    """The all-reduce of row-parallel layers over this stage's tensor-parallel group (through
    ``host``, a ``HostAllReduce`` of ranks on one host, where there is one)."""

    def __init__(self, size: int = 1, group=None, host=None) -> None:
        self.size, self.group, self.host = size, group, host

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.host is not None:
            return self.host.all_reduce(x)
        if self.size > 1:
            torch.distributed.all_reduce(x, group=self.group)
        return x


class Attention(nn.Module):
    """Column-parallel QKV (this rank's query and KV heads), row-parallel output projection."""

    def __init__(self, cfg: ArchConfig, tp: TensorParallel) -> None:
        super().__init__()
        self.tp = tp
        self.h, self.hkv = cfg.num_heads // tp.size, cfg.num_kv_heads // tp.size
        self.d = cfg.head_dim
        self.qkv_proj = nn.Linear(
            cfg.hidden_size, (self.h + 2 * self.hkv) * self.d, bias=cfg.qkv_bias
        )
        self.o_proj = nn.Linear(self.h * self.d, cfg.hidden_size, bias=cfg.o_bias)
        self.scale = self.d**-0.5

    def forward(self, x, cos, sin, meta: AttentionMetadata, kv: tuple[torch.Tensor, torch.Tensor]):
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split(
            [self.h * self.d, self.hkv * self.d, self.hkv * self.d], dim=-1
        )
        q = apply_rope(q.view(t, self.h, self.d), cos, sin)
        k = apply_rope(k.view(t, self.hkv, self.d), cos, sin)
        v = v.view(t, self.hkv, self.d)
        o = paged_attention(q, k, v, kv[0], kv[1], meta, self.scale)  # [T, H/tp, D]
        return self.tp.all_reduce(self.o_proj(o.reshape(t, self.h * self.d)))

    def split_qkv(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Views q [T, H, D], k and v [T, Hkv, D] of a fused [T, (H + 2 Hkv) D] QKV output."""
        t, h, hkv, d = qkv.shape[0], self.h, self.hkv, self.d
        return (qkv[:, : h * d].view(t, h, d), qkv[:, h * d : (h + hkv) * d].view(t, hkv, d),
                qkv[:, (h + hkv) * d :].view(t, hkv, d))

    def forward_native(self, x, positions, rotary, meta: AttentionMetadata, kv,
                       keep: SampledRows | None = None):
        """With ``keep``, every row's keys and values are written and the output is that of
        the kept rows only."""
        h, d = self.h, self.d
        q, k, v = self.split_qkv(self.qkv_proj(x))  # RoPE is applied in place
        meta.ops.rope(q, k, positions, rotary.cos, rotary.sin)
        if keep is not None:
            q, meta = q[keep.rows], keep.meta
            if not len(q):  # (the keys and values written, nothing else to compute)
                paged_attention(q, k, v, kv[0], kv[1], meta, self.scale)
                return x.new_empty(0, x.shape[1])
        o = paged_attention(q, k, v, kv[0], kv[1], meta, self.scale)  # views: no copies
        return self.tp.all_reduce(self.o_proj(o.reshape(q.shape[0], h * d)))


class MLP(nn.Module):
    """Column-parallel gate/up projection, row-parallel down projection."""

    def __init__(self, cfg: ArchConfig, tp: TensorParallel) -> None:
        super().__init__()
        self.tp = tp
        width = cfg.intermediate_size // tp.size
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * width, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(width, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.tp.all_reduce(self.down_proj(F.silu(gate) * up))

    def forward_native(self, x: torch.Tensor, ops) -> torch.Tensor:
        gu = self.gate_up_proj(x)
        act = gu.new_empty(gu.shape[0], gu.shape[1] // 2)
        ops.silu_and_mul(act, gu)
        return self.tp.all_reduce(self.down_proj(act))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ArchConfig, tp: TensorParallel) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, tp)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg, tp)

    def forward(self, x, cos, sin, meta, kv):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, meta, kv)
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward_native(self, h, residual, positions, rotary, meta, kv,
                       keep: SampledRows | None = None):
        """The same layer on the compiled kernels, as a (layer output, residual stream) pair:
        the residual add is fused into the next norm (x = residual + h). With ``keep``, the
        pair of the kept rows only (``LlamaForCausalLM.forward``)."""
        ops = meta.ops
        if residual is None:
            h, residual = self.input_layernorm.native(h, ops), h
        else:
            h, residual = self.input_layernorm.add_native(h, residual, ops)
        h = self.self_attn.forward_native(h, positions, rotary, meta, kv, keep)
        if keep is not None:
            residual = residual[keep.rows]
            if not len(h):
                return h, residual
        h, residual = self.post_attention_layernorm.add_native(h, residual, ops)
        return self.mlp.forward_native(h, ops), residual


@dataclass
class SampledRows:
    """The rows a step samples (``logits_idx``: each the last row of its run) and the
    attention metadata of those rows alone (``sampled_rows_metadata``)."""

    rows: torch.Tensor
    meta: AttentionMetadata


# The last decoder layer runs for the sampled rows only, where a batch samples fewer rows than
# it holds (a prefill chunk's rows but its last feed nothing past the last layer's keys and
# values): a sixteenth of a 16-layer model's projections and attention for every prefill token
# but the last of each prompt. The eager reference runs every row; tests set False to compare.
SAMPLED_ROWS_ONLY = True

# Batches run the decoder layers in one compiled call (``kernels: decoder_layers``): the same
# kernels and oneDNN calls as ``DecoderLayer.forward_native``, without the interpreter between
# them (a tenth of a decode step at batch 1; measured side by side at batch 40: 47.9 -> 43.1 ms,
# two 256-token prefills 132.6 -> 125.3 ms). Tests lower the bound to compare the two paths.
FUSED_MAX_ROWS: int | None = None  # None: every batch


class LlamaForCausalLM(nn.Module):
    """The decoder, or this worker's shard of it: the embedding on the first pipeline stage,
    the final norm and LM head on the last, a range of layers on each. ``layers[i]`` is model
    layer ``layer_offset + i``."""

    def __init__(self, cfg: ArchConfig, max_len: int, shard: Shard | None = None,
                 tp: TensorParallel | None = None) -> None:
        super().__init__()
        shard = shard or Shard()
        self.cfg, self.shard = cfg, shard
        tp = tp or TensorParallel()
        span = shard.layers(cfg.num_layers)
        self.layer_offset = span.start
        if shard.first:
            # Uninitialized (the loader assigns the weights): nn.Embedding's own normal_()
            # initialization, on the meta device the loader builds on, imports torch._dynamo
            # (~3 s of every engine start).
            self.embed_tokens = nn.Embedding(
                cfg.vocab_size, cfg.hidden_size,
                _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(cfg, tp) for _ in span)
        if shard.last:
            self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
            if cfg.tie_word_embeddings and shard.first:
                self.lm_head.weight = self.embed_tokens.weight
        self.rotary = Rotary(cfg, max_len)

    def _fused_layers(self, x, positions, meta, kv_caches, keep: SampledRows | None):
        """This stage's decoder layers in one compiled call, if every layer runs on the
        compiled CPU kernels and prepacked linears without a tensor-parallel all-reduce; else
        None."""
        if meta.backend != "native" or not self.layers or (
                FUSED_MAX_ROWS is not None and x.shape[0] > FUSED_MAX_ROWS):
            return None
        args = getattr(self, "_fused_args", None)
        if args is None:
            args = self._fused_args = self._collect_fused_args()
        if not args:
            return None
        ops = meta.ops
        if ops is None or not hasattr(ops, "decoder_layers"):
            return None
        norms, weights, biases, tiles, out_features = args
        attn = self.layers[0].self_attn
        h, residual = ops.decoder_layers(
            x, positions, self.rotary.cos, self.rotary.sin, norms, weights, biases,
            [kv[0] for kv in kv_caches], [kv[1] for kv in kv_caches], meta.slot_mapping,
            meta.cu_q, meta.ctx_lens, meta.block_tables, attn.h, attn.hkv, attn.d,
            self.layers[0].input_layernorm.eps, attn.scale, min_long_run(ops, x.dtype), tiles,
            out_features, *((keep.rows, keep.meta.cu_q, keep.meta.ctx_lens,
                             keep.meta.block_tables) if keep is not None else (None,) * 4))
        return h, residual

    def _sampled_rows(self, x: torch.Tensor, meta: AttentionMetadata, logits_idx: torch.Tensor
                      ) -> SampledRows | None:
        """The rows the last layer computes past its keys and values, where fewer than all
        (this stage holds the last layer, the layers run on kernels); else None."""
        if not (SAMPLED_ROWS_ONLY and self.shard.last and self.layers and meta.compiled
                and meta.last_rows_only and len(logits_idx) < x.shape[0]):
            return None
        attn = self.layers[-1].self_attn
        return SampledRows(logits_idx, sampled_rows_metadata(meta, logits_idx,
                                                             attn.h // attn.hkv, attn.hkv))

    def _collect_fused_args(self) -> tuple | tuple[()]:
        from fluidserve.model.linear import PackedLinear

        norms, weights, biases, tiles, out_features = [], [], [], [], []
        for layer in self.layers:
            a, m = layer.self_attn, layer.mlp
            linears = (a.qkv_proj, a.o_proj, m.gate_up_proj, m.down_proj)
            if a.tp.size > 1 or m.tp.size > 1 or not all(
                    isinstance(x, PackedLinear) for x in linears):
                return ()
            norms += [layer.input_layernorm.weight, layer.post_attention_layernorm.weight]
            # (a tile copy that takes every batch stands in for oneDNN's, which it replaces)
            weights += [x.packed if x.packed is not None else x.tiles for x in linears]
            biases += [x.bias for x in linears]
            tiles += [x.tiles for x in linears]
            out_features += [x.out_features for x in linears]
        if all(t is None for t in tiles):
            tiles, out_features = [], []
        return norms, weights, biases, tiles, out_features

    def _few_rows(self, x: torch.Tensor, meta: AttentionMetadata) -> bool:
        """Whether this batch takes ``_few_rows_forward``: at most ``SKINNY_MAX_ROWS`` rows
        (one decode) on the Triton kernels, no tensor parallelism, every projection a plain
        nn.Linear."""
        if meta.backend != "triton" or not 0 < x.shape[0] <= meta.ops.SKINNY_MAX_ROWS:
            return False
        ok = getattr(self, "_few_rows_ok", None)
        if ok is None:
            linears = [self.lm_head] if self.shard.last else []
            for layer in self.layers:
                attn, mlp = layer.self_attn, layer.mlp
                linears += [attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj]
            ok = self._few_rows_ok = all(type(m) is nn.Linear for m in linears) and all(
                layer.self_attn.tp.size == layer.mlp.tp.size == 1 for layer in self.layers)
        return ok

    def _few_rows_forward(self, r, positions, meta, kv_caches, logits_idx):
        """The layers for a single decode on a GPU, bound by reading the weights: each
        projection is one ``skinny_linear`` launch that also does the norm
        before it (QKV, gate/up, LM head), the SiLU (down) or the residual add after it (O,
        down), and RoPE stores the keys and values in the cache as it rotates them, so a layer
        is six launches: four projections, RoPE, attention (chained with programmatic
        dependent launch where the GPU has it). ``r``, the residual stream, is updated in
        place; the results round where the eager layers round."""
        ops = meta.ops
        t = r.shape[0]
        # Where the projections launch with PDL, so do RoPE and attention: every kernel of
        # the chain may start while the one before finishes (each waits before reading).
        pdl = ops.ATTENTION_PDL and ops.pdl_launch(r.device)
        for layer, kv in zip(self.layers, kv_caches, strict=True):
            a, mlp = layer.self_attn, layer.mlp
            h, d = a.h, a.d
            ln1, ln2 = layer.input_layernorm, layer.post_attention_layernorm
            q, k, v = a.split_qkv(ops.skinny_linear(r, a.qkv_proj.weight, a.qkv_proj.bias,
                                                    norm_weight=ln1.weight, eps=ln1.eps))
            ops.rope_and_write_kv(q, k, v, positions, self.rotary.cos, self.rotary.sin, kv[0],
                                  kv[1], meta.slot_mapping, pdl=pdl)
            o = q.new_empty(t, h, d)
            ops.paged_attention(o, q, k, v, kv[0], kv[1], meta.slot_mapping, meta.cu_q,
                                meta.ctx_lens, meta.block_tables, a.scale, meta.tiles,
                                kv_written=True, pdl=pdl)
            ops.skinny_linear(o.view(t, h * d), a.o_proj.weight, a.o_proj.bias, residual=r)
            gu = ops.skinny_linear(r, mlp.gate_up_proj.weight, mlp.gate_up_proj.bias,
                                   norm_weight=ln2.weight, eps=ln2.eps)
            ops.skinny_linear(gu, mlp.down_proj.weight, mlp.down_proj.bias, silu=True,
                              residual=r)
        if not self.shard.last:
            return r
        return ops.skinny_linear(r[logits_idx], self.lm_head.weight, self.lm_head.bias,
                                 norm_weight=self.norm.weight, eps=self.norm.eps)

    def forward(
        self,
        inputs: torch.Tensor,  # [T] token ids on the first stage, else [T, hidden] states
        positions: torch.Tensor,  # [T]
        meta: AttentionMetadata,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],  # this stage's layers
        logits_idx: torch.Tensor,  # [S]: batch positions whose next-token logits are needed
    ) -> torch.Tensor:
        """[S, vocab] logits on the last stage (model dtype), else [T, hidden] states."""
        x = self.embed_tokens(inputs) if self.shard.first else inputs
        if self._few_rows(x, meta):
            return self._few_rows_forward(x if self.shard.first else x.clone(), positions,
                                          meta, kv_caches, logits_idx)
        if meta.compiled and x.is_contiguous():
            keep = self._sampled_rows(x, meta, logits_idx)
            fused = self._fused_layers(x, positions, meta, kv_caches, keep)
            if fused is not None:
                h, residual = fused
            else:
                h, residual = x, None
                last = len(self.layers) - 1
                for i, (layer, kv) in enumerate(zip(self.layers, kv_caches, strict=True)):
                    h, residual = layer.forward_native(h, residual, positions, self.rotary,
                                                       meta, kv, keep if i == last else None)
            if residual is not None:
                if self.shard.last:  # only the sampled rows go on: norm(residual + h)
                    if keep is None:
                        h, residual = h[logits_idx], residual[logits_idx]
                    x, _ = self.norm.add_native(h, residual, meta.ops)
                    return self.lm_head(x)
                x = residual + h
            else:
                x = h
            if not self.shard.last:
                return x
            return self.lm_head(self.norm(x[logits_idx]))
        cos, sin = self.rotary(positions)
        for layer, kv in zip(self.layers, kv_caches, strict=True):
            x = layer(x, cos, sin, meta, kv)
        if not self.shard.last:
            return x
        return self.lm_head(self.norm(x[logits_idx]))
