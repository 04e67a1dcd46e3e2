"""Linear layers on weights prepacked for oneDNN, the CPU fast path.

``F.linear`` re-lays out (and, for bf16, re-blocks) the weight on every call; at batch 1 that
costs more than the matrix-vector product itself. PyTorch's own oneDNN ops can reorder a weight
once, at load time, into the blocked format its kernels read (AMX tiles where the CPU has them)
and then run every call on it. Measured on a 2-core Sapphire Rapids VM for the 64 linear layers
of a 16-layer, 1024-hidden bf16 model: 24.0 ms through F.linear, 16.8 ms prepacked at 1 token;
44.5 vs 33.1 ms at 128 tokens.

Batches are padded to a bounded set of row counts (``padded_rows``) so that oneDNN's cache of
per-shape primitives stays bounded.

With ``tiles``, a bf16 weight also gets a second copy laid out in the 1 KB tiles of the CPU's
matrix unit (``kernels: tile_pack``), and batches of up to ``tile_max_rows()`` tokens (the
decode steps) multiply on it: the product of a few rows is bound by reading the weight, which
that kernel streams at the machine's read bandwidth where oneDNN's reads slow down between 16
and 64 rows. Measured for the 64 decoder linears of the race model (361 MB, 2-core AMX VM,
three rounds, oneDNN -> tiles): 16.9-17.3 -> 13.1-13.6 ms at 1 row, 17.4-17.7 -> 14.1-14.5 at
16, 19.9-21.0 -> 15.7-16.8 at 32, 22.6-23.0 -> 18.2-18.6 at 48 (docs/performance.md).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fluidserve.kernels import cpu_ops


def packed_linear_supported(dtype: torch.dtype, device: torch.device) -> bool:
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.bfloat16:
        return torch.ops.mkldnn._is_mkldnn_bf16_supported()
    if dtype == torch.float16:
        return torch.ops.mkldnn._is_mkldnn_fp16_supported()
    return dtype == torch.float32


def padded_rows(m: int) -> int:
    """Rows a batch of ``m`` tokens is padded to.

    oneDNN builds (and caches, without a useful bound) one primitive per input shape: with
    the token count of every iteration a new shape, the engine's memory grew by ~0.2 MB per
    distinct count and layer shape (hundreds of MB over a long run). Rounding up to a small
    set of sizes bounds the cache; the padding is nearly free (the product is bound by reading
    the weights until well past 16 rows).
    """
    if m <= 16:  # sixteen shapes; a single row is the decode of one request
        return m
    step = 16 if m <= 256 else 64 if m <= 1024 else 256
    return -(-m // step) * step


def tiles_supported(weight: torch.Tensor) -> bool:
    """Whether ``weight`` can get a tile copy: bf16, in_features a multiple of 32, on a CPU
    whose matrix unit the compiled kernels can use."""
    if weight.dtype != torch.bfloat16 or weight.device.type != "cpu" or weight.shape[1] % 32:
        return False
    ops = cpu_ops()
    return ops is not None and ops.tile_max_rows() > 0


class PackedLinear(nn.Module):
    """``y = x W^T + b`` with W reordered once into oneDNN's blocked layout, and with
    ``tiles`` (where ``tiles_supported``) copied into AMX tiles for small batches too."""

    def __init__(self, linear: nn.Linear, tiles: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach()
        with torch.no_grad():
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
        self.bias = linear.bias
        self.tiles: torch.Tensor | None = None
        self.tile_rows = 0
        if tiles and tiles_supported(weight):
            self._ops = cpu_ops()
            self.tiles, self.tile_rows = self._ops.tile_pack(weight), self._ops.tile_max_rows()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        m = x.shape[0]
        if self.tiles is not None and m <= self.tile_rows and x.dim() == 2:
            return self._ops.tile_linear(x.contiguous(), self.tiles, self.out_features,
                                         self.bias)
        rows = padded_rows(m)
        if rows != m:
            x = F.pad(x, (0, 0, 0, rows - m))
        y = torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return y[:m] if rows != m else y


def linear_weight_bytes(model: nn.Module) -> int:
    """Bytes of the weights of ``model``'s nn.Linear layers (a shared weight counted once)."""
    weights = {id(m.weight): m.weight for m in model.modules() if isinstance(m, nn.Linear)}
    return sum(w.numel() * w.element_size() for w in weights.values())


def pack_linear_layers(model: nn.Module, tiles: bool = False) -> int:
    """Replace every nn.Linear of ``model`` by a PackedLinear; returns how many."""
    targets = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    for name, linear in targets:
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, attr, PackedLinear(linear, tiles))
    return len(targets)
