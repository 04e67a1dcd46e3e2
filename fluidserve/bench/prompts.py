"""Prompts of an exact token length, cut from a text corpus with the server's tokenizer."""

from __future__ import annotations

import numpy as np

from fluidserve.data import data_dir
from fluidserve.model.builder import corpus_text


def load_corpus() -> tuple[str, str]:
    """(text, where it came from): the shared prompt corpus when present, else the built-in."""
    root = data_dir()
    if root is not None and (root / "corpus.txt").is_file():
        return (root / "corpus.txt").read_text(), str(root / "corpus.txt")
    return corpus_text(), "built-in corpus"


class PromptBuilder:
    """Builds text whose tokenization (as the server will do it) has exactly ``n`` tokens.

    Windows of the tokenized corpus are decoded back to text; because re-tokenizing text may
    merge tokens differently at the edges, the window is adjusted until the count matches
    (or the closest count found is used and counted in ``inexact``). With ``prefix_len``,
    every prompt's first ``prefix_len`` tokens (all of a shorter prompt's) are one window of
    the corpus, drawn once: a shared system prompt, the rest each prompt's own.
    """

    def __init__(self, tokenizer, text: str, seed: int = 0, add_special_tokens: bool = True,
                 prefix_len: int = 0):
        self.tok = tokenizer
        self.ids = tokenizer.encode(text, add_special_tokens=False)
        if len(self.ids) < 16:
            raise ValueError("the prompt corpus is too small")
        self.special = len(tokenizer.encode("", add_special_tokens=True)) if add_special_tokens \
            else 0
        self.add_special = add_special_tokens
        self.rng = np.random.default_rng(seed)
        self.inexact = 0
        self.prefix_ids = max(0, prefix_len - self.special)
        # (drawn only with a prefix: the prompts of a seed without one stay what they were)
        self.prefix_start = int(self.rng.integers(0, len(self.ids))) if prefix_len else 0

    def _window(self, start: int, n: int) -> list[int]:
        reps = -(-(start + n) // len(self.ids))
        return (self.ids * (reps + 1))[start : start + n]

    def count(self, text: str) -> int:
        return len(self.tok.encode(text, add_special_tokens=self.add_special))

    def build(self, n: int) -> str:
        start = int(self.rng.integers(0, len(self.ids)))
        want = max(1, n - self.special)
        take, best = want, None
        for _ in range(8):
            shared = min(max(1, take), self.prefix_ids)
            text = self.tok.decode(self._window(self.prefix_start, shared)
                                   + self._window(start, max(1, take) - shared))
            got = self.count(text)
            if best is None or abs(got - n) < abs(best[0] - n):
                best = (got, text)
            if got == n:
                return text
            take += n - got
        self.inexact += 1
        return best[1]
