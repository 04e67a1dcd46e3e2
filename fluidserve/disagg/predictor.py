"""Generated-length prediction at the prefill instance (TetriInfer section 3.3).

A predictor classifies a request into a length bucket of ``granularity`` tokens (bucket b
covers [b*g, (b+1)*g)); the decode side plans with the bucket's upper end. Pluggable:

- ``oracle``: the true length (an upper bound on what prediction can buy);
- ``learned``: a classifier fitted on the server's request log (``fluidserve.disagg.learned``);
- ``noisy``: the oracle right with probability ``accuracy`` (default: the 74.9% that
  TetriInfer's OPT-125M classifier reaches at granularity 200), otherwise a neighbouring
  bucket -- a classifier's mistakes are mostly near misses. The draw depends only on the
  request id and the seed, so a run is reproducible whatever the order of events.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Sequence

from fluidserve.config import LENGTH_PREDICTORS
from fluidserve.request import Request

PAPER_ACCURACY = 0.749


class LengthPredictor:
    name = "oracle"

    def __init__(self, granularity: int = 200) -> None:
        if granularity < 1:
            raise ValueError("length-predictor granularity must be >= 1")
        self.granularity = granularity

    def bucket(self, request_id: str, prompt_ids: Sequence[int], true_len: int) -> int:
        return true_len // self.granularity

    def predicted_len(self, bucket: int) -> int:
        """The length the decode side plans for: the bucket's upper end."""
        return (bucket + 1) * self.granularity

    def predict(self, request_id: str, prompt_ids: Sequence[int], true_len: int) -> int:
        return self.predicted_len(self.bucket(request_id, prompt_ids, true_len))


class NoisyPredictor(LengthPredictor):
    name = "noisy"

    def __init__(self, granularity: int = 200, accuracy: float = PAPER_ACCURACY,
                 seed: int = 0) -> None:
        super().__init__(granularity)
        if not 0.0 <= accuracy <= 1.0:
            raise ValueError("length-predictor accuracy must be in [0, 1]")
        self.accuracy, self.seed = accuracy, seed

    def bucket(self, request_id: str, prompt_ids: Sequence[int], true_len: int) -> int:
        true = true_len // self.granularity
        digest = hashlib.blake2b(f"{self.seed}:{request_id}".encode(), digest_size=8).digest()
        rng = random.Random(int.from_bytes(digest, "little"))
        if rng.random() < self.accuracy:
            return true
        if true == 0:
            return 1
        return true + rng.choice((-1, 1))


def make_predictor(name: str, granularity: int = 200, accuracy: float = PAPER_ACCURACY,
                   seed: int = 0, path: str | None = None) -> LengthPredictor:
    """``path``: the learned predictor's file (its granularity is the one it was trained
    with)."""
    if name == "learned":
        from fluidserve.disagg.learned import LearnedPredictor

        if path is None:
            raise ValueError("the learned length predictor needs its file")
        return LearnedPredictor(path)
    if name == "oracle":
        return LengthPredictor(granularity)
    if name == "noisy":
        return NoisyPredictor(granularity, accuracy, seed)
    raise ValueError(f"unknown length predictor {name!r};"
                     f" choose from {', '.join(LENGTH_PREDICTORS)}")


def predict_length(predictor, req: Request, true_len: int, cap: bool = True) -> int:
    """The predicted final output length; a request never outgrows its ``max_tokens`` (not
    applied with ``cap`` False: where ``max_tokens`` is the true length, it would tell)."""
    predicted = predictor.predict(req.request_id, req.prompt_token_ids, true_len)
    return min(predicted, req.params.max_tokens) if cap else predicted
