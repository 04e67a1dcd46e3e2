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

On a CPU with AVX2 but neither AMX nor bf16 instructions (AMD Zen 3, for one), oneDNN has no
bf16 kernels at all. There the compiled kernels' ``tile_linear`` is a float32-FMA kernel on
bf16 weights copied into 16-column panels, and it takes every batch size, so the panels are
the only copy of the weights (no oneDNN copy, no padded rows). Measured on a 2-core EPYC (Zen
3) for a [M, 1024] x [1024, 5632] product, panels against oneDNN on the weight widened to
float32, alternated in one process: 0.34 vs 0.85 ms at 1 row, 3.75 vs 4.99 at 40, 21.6 vs
24.0 at 256, 194 vs 208 ms at 2048; for the 64 decoder linears of the race model, after the
kernel's loop lost its per-step prefetch test: 15.6 vs 37.3 ms at 1 row, 121 vs 195 at 40, 671
vs 772 at 256, 6.11 vs 7.14 s at 2048 (docs/performance.md).

On a CPU with AVX-512 but no AMX (an Emerald Rapids class Xeon VM whose matrix unit is not
exposed, for one), oneDNN has bf16 kernels, but their VDPBF16PS products run at about half
the float32 FMA rate (172 against 314 GFLOP/s for [2048, 1024] x [1024, 5632] on two cores).
There the same panel kernel runs on 512-bit registers, panels of 32 columns, and takes every
batch: for that product, against oneDNN on the bf16 weight, 0.22 vs 0.27 ms at 1 row, 1.66 vs
2.71 at 40, 10.7 vs 17.5 at 256, 96.6 vs 138.6 ms at 2048 (docs/performance.md).

Where an AVX-512 CPU's bf16 dot product (VDPBF16PS) issues about as fast as its float32 FMA
(AMD Zen 4), it does twice the FMA's multiply-adds, and the panels multiply with it instead
(``dot``: the weights' pairs of k against x's, no widening): on a 2-core EPYC (Zen 4), for
that product, 0.087 against 0.106 ms at 1 row, 1.03 against 2.39 at 40 and 53 against 122 ms
at 2048 rows (445 GFLOP/s, oneDNN's bf16 kernels 53 ms). Which product runs is measured
per CPU (``kernels: bf16_dot_rates``), or chosen with ``--panel-product``.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from fluidserve.kernels import cpu_ops
from fluidserve.model.host_memory import on_huge_pages


def packed_linear_supported(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether linears of ``dtype`` can run prepacked: natively, or widened (``widened``)."""
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    return dtype in (torch.bfloat16, torch.float16, torch.float32)


def widened(dtype: torch.dtype) -> bool:
    """Whether a ``dtype`` weight is prepacked in float32 rather than in its own dtype.

    Where the CPU has no bf16 (fp16) instructions (AVX2, e.g. AMD Zen 3), oneDNN has no
    bf16 kernels and ``F.linear`` falls back to ATen's scalar loops: 19 GFLOP/s for a
    [M, 1024] x [1024, 5632] product at any M on a 2-core EPYC, against 95-126 GFLOP/s for
    oneDNN's float32 kernels from 40 rows up. There the weight is widened once, at load, and
    each product takes float32 rows and rounds its result back to the model's dtype, which
    is what a bf16 kernel computes too (float32 accumulation, one rounding of the output).
    """
    if dtype == torch.bfloat16:
        return not torch.ops.mkldnn._is_mkldnn_bf16_supported()
    if dtype == torch.float16:
        return not torch.ops.mkldnn._is_mkldnn_fp16_supported()
    return False


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


# tile_max_rows() of a tile kernel that takes every batch size (the panel ones).
ANY_ROWS = 2**31 - 1
# The compiled kernels' panel linears: float32 FMAs on bf16 weights in panels of 16 (AVX2) or
# 32 (AVX-512) output columns.
PANEL_KINDS = ("avx2", "avx512")


def tile_kind() -> str:
    """The small-batch kernel the compiled kernels have here: "amx", "avx512" or "avx2"
    (float32 FMAs on bf16 panels, every batch size) or ""."""
    ops = cpu_ops()
    return ops.tile_kind() if ops is not None else ""


def tiles_cover_every_batch() -> bool:
    """Whether tile copies take batches of any size here, replacing oneDNN's copy."""
    ops = cpu_ops()
    return ops is not None and ops.tile_max_rows() >= ANY_ROWS


def tiles_supported(weight: torch.Tensor) -> bool:
    """Whether ``weight`` can get a tile copy: bf16 on a CPU the compiled kernels have a tile
    kernel for (AMX tiles also need in_features a multiple of 32)."""
    if weight.dtype != torch.bfloat16 or weight.device.type != "cpu":
        return False
    kind = tile_kind()
    return kind in PANEL_KINDS or (kind == "amx" and weight.shape[1] % 32 == 0)


def panels_by_default() -> bool:
    """Whether ``auto`` multiplies bf16 linears on panels (which take every batch): on an
    AVX-512 CPU without AMX (float32 FMAs where they run at twice oneDNN's bf16 rate, the
    bf16 dot product where it issues as fast as the FMA: ``dot_panels``), and on an AVX2
    CPU, where oneDNN has no bf16 kernels at all."""
    kind = tile_kind()
    return kind == "avx512" or (kind == "avx2" and widened(torch.bfloat16))


# The dot-product panels are the default where the CPU issues its bf16 dot product at least at
# this share of its FMA rate (each does twice an FMA's multiply-adds: at a half they break
# even). Measured: 0.96-1.0 on AMD Zen 4, 0.25 on an Emerald Rapids class Xeon.
DOT_RATE_SHARE = 0.6
PANEL_PRODUCTS = ("auto", "fma", "dot")


@functools.cache
def dot_panels_by_default() -> bool:
    """Whether ``auto`` panels multiply with the bf16 dot product here: built (AVX-512 BF16)
    and issued at least DOT_RATE_SHARE as fast as the FMA (probed once, ~50 ms)."""
    ops = cpu_ops()
    if ops is None or not ops.dot_panels_built():
        return False
    fma, dot = ops.bf16_dot_rates()
    return fma > 0 and dot >= DOT_RATE_SHARE * fma


def dot_panels(product: str) -> bool:
    """Whether panels multiply with the bf16 dot product for ``--panel-product PRODUCT``."""
    if product not in PANEL_PRODUCTS:
        raise ValueError(f"panel product {product!r}: one of {', '.join(PANEL_PRODUCTS)}")
    if product == "dot":
        ops = cpu_ops()
        if ops is None or not ops.dot_panels_built():
            raise ValueError("panel product 'dot' unavailable: needs the compiled kernels on a"
                             " CPU with AVX-512 BF16 and without AMX")
        return True
    return product == "auto" and dot_panels_by_default()


class PackedLinear(nn.Module):
    """``y = x W^T + b`` on weights laid out once for the CPU's kernels: a tile copy
    (``tiles``, where ``tiles_supported``) for the batches of up to ``tile_rows`` tokens, and
    for the others W reordered into oneDNN's blocked layout (in float32 where the dtype is
    ``widened``; ``packed`` is None where the tiles take every batch). ``bias`` is the one
    the packed weight's product takes (float32 when widened). With ``dot`` the tile copy is
    of the dot-product panels (``dot_panels``)."""

    def __init__(self, linear: nn.Linear, tiles: bool = False, dot: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach()
        self.dtype, self.wide = weight.dtype, widened(weight.dtype)
        self.tiles: torch.Tensor | None = None
        self.tile_rows = 0
        if tiles and tiles_supported(weight):
            self._ops = cpu_ops()
            # (an odd in_features, where a model has one, keeps the FMA panels)
            # (on huge pages: a decode step streams every tile copy, 4 KB pages cost a TLB
            # miss per 4 KB of it)
            self.tiles = on_huge_pages(
                self._ops.tile_pack(weight, dot=dot and weight.shape[1] % 2 == 0))
            self.tile_rows = self._ops.tile_max_rows()
        self.packed: torch.Tensor | None = None
        if self.tile_rows < ANY_ROWS:
            with torch.no_grad():
                src = weight.float() if self.wide else weight
                self.packed = torch.ops.mkldnn._reorder_linear_weight(src, None)
        else:
            self.wide = False
        bias = linear.bias
        self.bias = bias.detach().float() if self.wide and bias is not None else bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2:
            return self(x.reshape(-1, x.shape[-1])).view(*x.shape[:-1], self.out_features)
        m = x.shape[0]
        if self.tiles is not None and m <= self.tile_rows:
            return self._ops.tile_linear(x.contiguous(), self.tiles, self.out_features,
                                         self.bias)
        rows = padded_rows(m)
        if self.wide:
            x = x.float()
        if rows != m:
            x = F.pad(x, (0, 0, 0, rows - m))
        y = torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        y = y[:m] if rows != m else y
        return y.to(self.dtype) if self.wide else y


def linear_weight_bytes(model: nn.Module) -> int:
    """Bytes of the weights of ``model``'s nn.Linear layers (a shared weight counted once)."""
    weights = {id(m.weight): m.weight for m in model.modules() if isinstance(m, nn.Linear)}
    return sum(w.numel() * w.element_size() for w in weights.values())


def warm_up_linears(model: nn.Module, max_rows: int, head_rows: int) -> int:
    """Run each distinct oneDNN product of ``model``'s PackedLinears once, on zeros, for
    every row count (``padded_rows``) a batch of up to ``max_rows`` tokens can give it
    (the LM head, which multiplies the sampled rows only: up to ``head_rows``). oneDNN builds
    and caches a kernel for each product shape on first use; built here, at start-up, no
    request's iteration pays for it. (It did: on a 2-core AMX Xeon VM the race model's first
    iteration of each new size took 20-55 ms longer, 576 tokens 173 against 117 ms after;
    one oneDNN product costs 2-12 ms to build.) The cache is keyed by shapes, not weights, so
    one layer's linears warm every layer's. Returns the number of products run."""
    head = getattr(model, "lm_head", None)
    distinct: dict[tuple, tuple[PackedLinear, int]] = {}
    for module in model.modules():
        if not isinstance(module, PackedLinear) or module.packed is None:
            continue
        rows = head_rows if module is head else max_rows
        key = (module.in_features, module.out_features, module.bias is not None,
               module.packed.dtype, tuple(module.packed.shape))
        if rows > distinct.get(key, (None, 0))[1]:
            distinct[key] = (module, rows)
    runs = 0
    with torch.no_grad():
        for module, rows in distinct.values():
            dtype = torch.float32 if module.wide else module.dtype
            for n in sorted({padded_rows(m) for m in range(module.tile_rows + 1, rows + 1)}):
                torch.ops.mkldnn._linear_pointwise(
                    torch.zeros(n, module.in_features, dtype=dtype), module.packed,
                    module.bias, "none", [], "")
                runs += 1
    return runs


def pack_linear_layers(model: nn.Module, tiles: bool = False, dot: bool = False) -> int:
    """Replace every nn.Linear of ``model`` by a PackedLinear; returns how many."""
    targets = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    for name, linear in targets:
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, attr, PackedLinear(linear, tiles, dot))
    return len(targets)
