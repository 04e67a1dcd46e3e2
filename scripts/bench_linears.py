"""The prepacked linears of the race model's decoder stack against the row count.

The 64 linear layers of a 16-layer, 1024-hidden bf16 Llama (QKV 1024x1536, output 1024x1024,
gate/up 1024x5632, down 2816x1024; ``--shape`` takes another of ``build-model``'s shapes, e.g.
``1b-gqa``: 88 layers of 2048x2560, 2048x2048, 2048x11264, 5632x2048), each with its own
weight, so that every call reads its weight from memory as a decode step does (one weight
reused sixteen times would sit in the cache and flatter the kernel). For each row count: the
median time of the whole stack over a few rounds, the weight bytes read per second, and the
arithmetic rate. Prints JSON lines.
With ``--backend tiles`` the stack multiplies on tile copies (``--linear-backend tiles``: AMX
tiles, AVX-512 or AVX2 panels, with the panel product ``auto`` picks; ``tiles-fma`` and
``tiles-dot`` name it); several backends, comma-separated (``both``: packed,tiles), are built
and alternated round by round, so that they are compared side by side. ``--against FILE`` builds a
variant of the kernels (the main file of an edited copy of ``fluidserve/kernels/csrc``, or
one self-contained source) and times its ``tile_linear`` beside the package's, on its own
packed copy of the same weights (outputs compared: ``identical`` in the JSON); repeat it for
several variants.

    python scripts/bench_linears.py 1 16 32 48 64 128 256
    python scripts/bench_linears.py --backend both 1 40 256 2048
    python scripts/bench_linears.py --backend packed,tiles-fma,tiles-dot 1 40 256 2048
    python scripts/bench_linears.py --backend tiles --against /tmp/csrc/cpu_kernels.cpp 1 40 2048
    python scripts/bench_linears.py --shape 1b-gqa --backend both 1 32 40 48
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from torch import nn

from fluidserve.kernels import variant_label, variant_ops
from fluidserve.model.builder import SHAPES as MODEL_SHAPES
from fluidserve.model.linear import PackedLinear, dot_panels, packed_linear_supported


def layer_shapes(name: str) -> tuple[tuple[tuple[int, int], ...], int]:
    """(in, out) of a decoder layer's QKV, output, gate/up and down linears, and the layer
    count, of ``build-model``'s shape ``name`` (head_dim hidden / heads)."""
    m = MODEL_SHAPES[name]
    kv = 2 * m.num_kv_heads * (m.hidden_size // m.num_heads)
    h, i = m.hidden_size, m.intermediate_size
    return ((h, h + kv), (h, h), (h, 2 * i), (i, h)), m.num_layers


def weights(shapes, layers: int) -> list[nn.Linear]:
    torch.manual_seed(0)
    return [nn.Linear(i, o, bias=False).to(torch.bfloat16) for _ in range(layers)
            for i, o in shapes]


BACKENDS = ("packed", "tiles", "tiles-fma", "tiles-dot")


def build(backend: str, linears: list[nn.Linear]) -> list[PackedLinear]:
    tiles, _, product = backend.partition("-")
    dot = tiles == "tiles" and dot_panels(product or "auto")
    stack = [PackedLinear(linear, tiles=tiles == "tiles", dot=dot) for linear in linears]
    if tiles == "tiles" and stack[0].tiles is None:
        raise SystemExit("no tile kernel here (needs AMX, AVX-512 or AVX2 and the compiled"
                         " kernels)")
    return stack


class VariantLinear:
    """One linear of the stack on a variant build's own tile copy of the same weight."""

    def __init__(self, module, linear: nn.Linear) -> None:
        self.module, self.in_features = module, linear.in_features
        self.out_features = linear.out_features
        self.tiles = module.tile_pack(linear.weight.detach(), dot=dot_panels("auto"))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.module.tile_linear(x, self.tiles, self.out_features, None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("rows", nargs="*", type=int, default=[1, 16, 32, 48, 64, 128, 256])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--backend", default="packed",
                    help="packed: oneDNN (bf16 widened to float32 where the CPU has no bf16"
                    " kernels); tiles: the compiled kernels' tile_linear (tiles-fma,"
                    " tiles-dot: the AVX-512 panels' product); several, comma-separated, side"
                    " by side (both: packed,tiles).")
    ap.add_argument("--against", type=Path, action="append", default=[], metavar="FILE",
                    help="a variant of the kernel source whose tile_linear to time beside the"
                    " package's (with --backend tiles); repeat for several")
    ap.add_argument("--shape", default="200m-gqa", choices=sorted(MODEL_SHAPES),
                    help="the model shape whose decoder linears to stack (default: the race"
                    " model's)")
    args = ap.parse_args()
    if not packed_linear_supported(torch.bfloat16, torch.device("cpu")):
        raise SystemExit("this CPU/PyTorch has no oneDNN linear")
    names = ("packed", "tiles") if args.backend == "both" else tuple(args.backend.split(","))
    if unknown := [n for n in names if n not in BACKENDS]:
        ap.error(f"--backend: unknown {', '.join(unknown)} (of {', '.join(BACKENDS)}, both)")
    if args.against and names != ("tiles",):
        ap.error("--against compares tile kernels: use it with --backend tiles")
    shapes, layers = layer_shapes(args.shape)
    linears = weights(shapes, layers)
    stacks = {name: build(name, linears) for name in names}
    for i, path in enumerate(args.against):
        module = variant_ops(path, i)
        label = variant_label(path)
        if label in stacks:
            raise SystemExit(f"--against: two variants named {label!r}")
        stacks[label] = [VariantLinear(module, linear) for linear in linears]
    names = tuple(stacks)
    weight_bytes = layers * sum(i * o for i, o in shapes) * 2
    for m in args.rows:
        xs = {i: torch.randn(m, i, dtype=torch.bfloat16) for i, _ in shapes}
        times = {name: [] for name in names}
        outs = {}
        for _ in range(args.rounds + 1):  # the first round builds oneDNN's primitives
            for name, stack in stacks.items():  # alternated: drift hits both alike
                t0 = time.perf_counter()
                outs[name] = [layer(xs[layer.in_features]) for layer in stack]
                times[name].append(time.perf_counter() - t0)
        for name in names:
            t = statistics.median(times[name][1:])
            row = {"backend": name, "rows": m, "ms": round(t * 1e3, 2),
                   "weight_gb_s": round(weight_bytes / t / 1e9, 1),
                   "tflop_s": round(m * weight_bytes / t / 1e12, 3)}
            if args.against:
                row["identical"] = all(torch.equal(a, b)
                                       for a, b in zip(outs["tiles"], outs[name], strict=True))
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
