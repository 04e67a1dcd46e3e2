"""A generated-length predictor learned from the server's own request log.

TetriInfer fine-tunes OPT-125M to classify a prompt into a length bucket. fluidserve learns a
much smaller classifier with the same contract, from what its own server saw
(``fluidserve serve --request-log``: one JSON line per finished request with its prompt token
ids and generated length), so it needs no model hub and trains in seconds on a CPU:

- features of the prompt only (the length it will generate is what is predicted): its
  length (log, log squared) and a hashed bag of its token ids (``hash_dims`` buckets, as
  frequencies), standardized;
- a multinomial logistic regression over length buckets of ``granularity`` tokens (the last
  bucket takes everything longer), with an L2 penalty (its strength chosen by
  cross-validation on the training requests), fitted by L-BFGS.

``fluidserve train-predictor`` fits it, reports its accuracy on held-out requests beside the
majority-bucket baseline and TetriInfer's 74.9%, and writes a JSON file that
``--length-predictor learned --length-predictor-path FILE`` loads.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fluidserve.disagg.predictor import PAPER_ACCURACY, LengthPredictor

FORMAT = "fluidserve-length-predictor/1"
MAX_LOGGED_TOKENS = 1024  # prompt token ids kept per request (log and features alike)


@dataclass(frozen=True)
class LoggedRequest:
    prompt_token_ids: list[int]  # the first MAX_LOGGED_TOKENS
    num_prompt_tokens: int
    generated: int


def read_request_log(paths: Iterable[str | Path]) -> list[LoggedRequest]:
    """Requests that ended by themselves or at max_tokens (errors and aborts say nothing
    about lengths and are skipped)."""
    out = []
    for path in paths:
        with open(path) as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    r = json.loads(line)
                    if r.get("finish_reason") not in ("stop", "length"):
                        continue
                    out.append(LoggedRequest(list(r["prompt_token_ids"]),
                                             int(r["num_prompt_tokens"]), int(r["generated"])))
                except (ValueError, KeyError, TypeError) as e:
                    raise ValueError(f"{path}:{n}: not a request-log line ({e})") from None
    return out


def featurize(prompt_ids: Sequence[int], num_prompt_tokens: int, hash_dims: int) -> np.ndarray:
    ids = np.asarray(prompt_ids[:MAX_LOGGED_TOKENS], dtype=np.int64)
    bag = np.bincount((ids * 2654435761) % hash_dims, minlength=hash_dims).astype(np.float64)
    bag /= max(len(ids), 1)
    n = math.log1p(num_prompt_tokens)
    return np.concatenate(([n, n * n], bag))


@dataclass
class TrainReport:
    samples: int
    heldout: int
    accuracy: float  # on the held-out requests
    majority_accuracy: float  # always predicting the most common bucket of the training set
    within_one: float  # held-out predictions off by at most one bucket
    num_buckets: int
    granularity: int
    l2: float  # chosen by cross-validation on the training requests

    def text(self) -> str:
        return (f"{self.samples} requests ({self.heldout} held out), {self.num_buckets} buckets"
                f" of {self.granularity} tokens, L2 {self.l2:g} (cross-validated):"
                f" held-out accuracy {self.accuracy:.1%}"
                f" (within one bucket {self.within_one:.1%}); always the most common bucket:"
                f" {self.majority_accuracy:.1%}; TetriInfer's OPT-125M: {PAPER_ACCURACY:.1%}")


L2_GRID = (1e-3, 1e-2, 1e-1, 1.0, 10.0, 100.0)


def train(records: list[LoggedRequest], granularity: int = 200, holdout: float = 0.2,
          seed: int = 0, hash_dims: int = 128, max_buckets: int = 16,
          steps: int = 400, folds: int = 4) -> tuple[dict, TrainReport]:
    """Fit on all but the held-out requests; the L2 strength is the one of ``L2_GRID`` with
    the best ``folds``-fold cross-validated accuracy on the training requests alone (a prompt
    that says little about the length gets a strongly regularized model, close to the
    majority bucket, instead of one that fits noise)."""
    if granularity < 1:
        raise ValueError("granularity must be >= 1")
    if not 0.0 < holdout < 1.0:
        raise ValueError("holdout must be in (0, 1)")
    if len(records) < 10:
        raise ValueError(f"{len(records)} usable requests in the log: need at least 10")
    order = list(range(len(records)))
    random.Random(seed).shuffle(order)
    cut = max(1, round(len(order) * holdout))
    test_i, train_i = order[:cut], order[cut:]
    x = np.stack([featurize(r.prompt_token_ids, r.num_prompt_tokens, hash_dims)
                  for r in records])
    y = np.minimum([r.generated // granularity for r in records], max_buckets - 1)
    k = int(y[train_i].max()) + 1
    y = np.minimum(y, k - 1)
    mean, std = x[train_i].mean(0), x[train_i].std(0)
    # A feature constant in training (a hash bucket no training prompt hit) stays unscaled:
    # dividing by its zero spread would blow up any prompt that does hit it.
    std[std < 1e-6] = 1.0
    xs = (x - mean) / std
    l2 = _pick_l2(xs[train_i], y[train_i], k, steps, folds)
    w, b = _fit(xs[train_i], y[train_i], k, l2, steps)
    pred = np.argmax(xs[test_i] @ w + b, axis=1)
    truth = y[test_i]
    majority = np.bincount(y[train_i], minlength=k).argmax()
    report = TrainReport(len(records), len(test_i), float(np.mean(pred == truth)),
                         float(np.mean(truth == majority)),
                         float(np.mean(np.abs(pred - truth) <= 1)), k, granularity, l2)
    model = {"format": FORMAT, "granularity": granularity, "hash_dims": hash_dims,
             "num_buckets": k, "mean": mean.tolist(), "std": std.tolist(),
             "weights": w.tolist(), "bias": b.tolist(), "report": report.__dict__}
    return model, report


def _pick_l2(x: np.ndarray, y: np.ndarray, k: int, steps: int, folds: int) -> float:
    folds = max(2, min(folds, len(y) // 2))
    fold = np.arange(len(y)) % folds
    best, best_acc = L2_GRID[0], -1.0
    for l2 in L2_GRID:
        acc = []
        for f in range(folds):
            fit, val = fold != f, fold == f
            w, b = _fit(x[fit], y[fit], k, l2, steps)
            acc.append(np.mean(np.argmax(x[val] @ w + b, axis=1) == y[val]))
        if np.mean(acc) > best_acc + 1e-12:  # ties go to the weaker regularization
            best, best_acc = l2, float(np.mean(acc))
    return best


def _fit(x: np.ndarray, y: np.ndarray, k: int, l2: float, steps: int
         ) -> tuple[np.ndarray, np.ndarray]:
    """Softmax regression: mean cross-entropy + l2/2 |W|^2 (the bias is not penalized),
    minimized by L-BFGS (convex, so any strength converges)."""
    from scipy.optimize import minimize

    n, d = x.shape
    onehot = np.eye(k)[y]

    def loss(theta: np.ndarray) -> tuple[float, np.ndarray]:
        w, b = theta[:d * k].reshape(d, k), theta[d * k:]
        z = x @ w + b
        z -= z.max(1, keepdims=True)
        logp = z - np.log(np.exp(z).sum(1, keepdims=True))
        g = (np.exp(logp) - onehot) / n
        value = -float((onehot * logp).sum()) / n + 0.5 * l2 * float((w * w).sum())
        return value, np.concatenate(((x.T @ g + l2 * w).ravel(), g.sum(0)))

    res = minimize(loss, np.zeros(d * k + k), jac=True, method="L-BFGS-B",
                   options={"maxiter": steps})
    return res.x[:d * k].reshape(d, k), res.x[d * k:]


class LearnedPredictor(LengthPredictor):
    name = "learned"

    def __init__(self, path: str | Path) -> None:
        try:
            m = json.loads(Path(path).read_text())
        except (OSError, ValueError) as e:
            raise ValueError(f"cannot read the length predictor {path}: {e}") from None
        if not isinstance(m, dict) or m.get("format") != FORMAT:
            raise ValueError(f"{path} is not a fluidserve length predictor"
                             " (write one with `fluidserve train-predictor`)")
        try:
            super().__init__(int(m["granularity"]))
            self.hash_dims = int(m["hash_dims"])
            self.mean, self.std = np.asarray(m["mean"], float), np.asarray(m["std"], float)
            self.w, self.b = np.asarray(m["weights"], float), np.asarray(m["bias"], float)
            d = self.mean.shape
            if self.w.ndim != 2 or self.std.shape != d or self.w.shape[:1] != d \
                    or self.b.shape != self.w.shape[1:]:
                raise ValueError("its weights, bias, mean and std do not fit together")
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{path}: a damaged length predictor ({type(e).__name__}: {e});"
                             " train it again with `fluidserve train-predictor`") from None

    def bucket(self, request_id: str, prompt_ids: Sequence[int], true_len: int) -> int:
        x = (featurize(prompt_ids, len(prompt_ids), self.hash_dims) - self.mean) / self.std
        return int(np.argmax(x @ self.w + self.b))
