"""Model shapes and GPU devices the simulator knows, and which measured table stands in."""

from __future__ import annotations

from dataclasses import dataclass

from fluidserve.model.arch import kv_bytes_per_token


@dataclass(frozen=True)
class Shape:
    name: str
    hidden: int
    ffn: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    gated_mlp: bool = True  # SwiGLU (gate and up projections); Falcon's MLP has no gate
    tied_embeddings: bool = False

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def mlp_in(self) -> int:
        """Output features of the MLP's input projection(s)."""
        return (2 if self.gated_mlp else 1) * self.ffn

    @property
    def params(self) -> int:
        h, d = self.hidden, self.head_dim
        attn = h * (self.heads + 2 * self.kv_heads) * d + self.heads * d * h
        mlp = h * (self.mlp_in + self.ffn)
        return self.layers * (attn + mlp) + (1 if self.tied_embeddings else 2) * self.vocab * h

    def kv_bytes_per_token(self, dtype_bytes: int = 2, tp: int = 1, pp: int = 1) -> int:
        return kv_bytes_per_token(self.layers, self.kv_heads, self.head_dim, dtype_bytes, tp, pp)


SHAPES = {s.name: s for s in (
    Shape("mistral-7b", 4096, 14336, 32, 32, 8, 32000),
    Shape("llama-2-7b", 4096, 11008, 32, 32, 32, 32000),
    Shape("llama-3-8b", 4096, 14336, 32, 32, 8, 128256),
    Shape("codellama-34b", 8192, 22016, 48, 64, 8, 32000),
    Shape("yi-34b", 7168, 20480, 60, 56, 8, 64000),
    Shape("llama-2-70b", 8192, 28672, 80, 64, 8, 32000),
    Shape("falcon-180b", 14848, 59392, 80, 232, 8, 65024, gated_mlp=False,
          tied_embeddings=True),  # 178.6B parameters
)}

# The measured per-layer operator tables (../shared/data/profiles/compute/<device>/<table>).
TABLES = {
    "llama-2-7b": "meta-llama/Llama-2-7b-hf",
    "llama-3-8b": "meta-llama/Meta-Llama-3-8B",
    "codellama-34b": "codellama/CodeLlama-34b-Instruct-hf",
    "llama-2-70b": "meta-llama/Llama-2-70b-hf",
}
TABLE_SHAPES = {"meta-llama/Llama-2-7b-hf": "llama-2-7b",
                "meta-llama/Meta-Llama-3-8B": "llama-3-8b",
                "codellama/CodeLlama-34b-Instruct-hf": "codellama-34b",
                "meta-llama/Llama-2-70b-hf": "llama-2-70b"}
# Preferred stand-in order when a shape has no table of its own on a device.
STAND_INS = {
    "mistral-7b": ["meta-llama/Meta-Llama-3-8B", "meta-llama/Llama-2-7b-hf"],
    "yi-34b": ["codellama/CodeLlama-34b-Instruct-hf", "meta-llama/Llama-2-70b-hf"],
    "falcon-180b": ["meta-llama/Llama-2-70b-hf"],
    "llama-3-8b": ["meta-llama/Meta-Llama-3-8B", "meta-llama/Llama-2-7b-hf"],
}


@dataclass(frozen=True)
class Device:
    name: str
    peak_flops: float  # dense bf16 FLOP/s
    mem_bandwidth: float  # bytes/s
    memory_bytes: float
    network: dict  # tp or pp degree -> profiles/network folder


DEVICES = {
    "a100": Device("a100", 312e12, 2.039e12, 80e9,
                   {"pairwise": "a100_pairwise_nvlink", "node": "a100_dgx"}),
    "h100": Device("h100", 989e12, 3.35e12, 80e9,
                   {"pairwise": "h100_pairwise_nvlink", "node": "h100_dgx"}),
    "a40": Device("a40", 149.7e12, 0.696e12, 48e9,
                  {"pairwise": "a40_pairwise_nvlink", "node": "a40_dgx"}),
}
