"""A token budget that holds a TBT SLO by itself (``--token-budget auto --tbt-slo S``).

Sarathi-Serve fixes the budget offline from a profile; the right budget, though, moves with
the decodes' context lengths, the batch size and the machine's speed. Here, before each
iteration, the scheduler asks for the largest prefill chunk whose predicted iteration time,
for this batch's decodes and contexts, stays within ``(1 - margin) x S``.

The prediction comes from an iteration-time model of the same family as the simulator's CPU
cost model (piecewise linear in the batch's tokens plus attention terms), learned online
from the engine's own iterations: it starts from a `fluidserve profile` fit, refits by
non-negative least squares on a sliding window, and a fast multiplicative correction (an
exponential average of measured / predicted) follows sudden changes in the machine's speed
within a few iterations. In simulation the cost model itself is the predictor.

If even the decodes alone are predicted to miss the SLO, the budget degrades to the smallest
chunk that still makes prefill progress (new requests never starve), and says so once.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable

import numpy as np

from fluidserve.core.scheduler.output import SchedulerOutput
from fluidserve.core.token_budget import Predictor, largest_chunk, pass_target

log = logging.getLogger(__name__)

AUTO_MAX_BUDGET = 8192  # the largest budget `auto` may choose


def plan_features(plan: SchedulerOutput) -> tuple[int, int, int, int, int, int]:
    """(tokens, sum q^2, sum q x cached, one-token runs, their longest context, requests)."""
    sq = prefix = singles = ctx_max = 0
    for c in plan.chunks:
        n = len(c.token_ids)
        if n == 1:
            singles += 1
            ctx_max = max(ctx_max, c.start + 1)
        else:
            sq += n * n
            prefix += n * c.start
    return plan.num_tokens, sq, prefix, singles, ctx_max, len(plan.chunks)


def candidate_features(decode_ctxs: list[int], chunk: int, prefix: int
                       ) -> tuple[int, int, int, int, int, int]:
    d = len(decode_ctxs)
    ctx_max = max(decode_ctxs, default=0)
    if chunk == 1:
        return d + 1, 0, 0, d + 1, max(ctx_max, prefix + 1), d + 1
    return d + chunk, chunk * chunk, chunk * prefix, d, ctx_max, d + (chunk > 0)


class OnlineIterationModel:
    """Iteration time learned from the engine's own iterations (see the module docstring)."""

    def __init__(self, prior: np.ndarray | None = None, window: int = 1024,
                 refit_every: int = 16, min_fit: int = 24, ema: float = 0.5,
                 recent: int = 8) -> None:
        from fluidserve.sim.cost_model import CPUCostModel, load_cpu_profile

        self._features = CPUCostModel.features
        self.coef = prior if prior is not None else CPUCostModel(load_cpu_profile(None)).coef
        self.rows: deque[np.ndarray] = deque(maxlen=window)
        self.times: deque[float] = deque(maxlen=window)
        self.refit_every, self.min_fit, self.ema = refit_every, min_fit, ema
        self.recent = recent  # iterations that set the correction after a refit
        self.correction = 1.0  # measured / predicted, exponentially averaged
        self.max_tokens_seen = 0
        self._since_fit = 0

    def _raw(self, f: tuple) -> float:
        return float(self.coef @ self._features(*f))

    def predict(self, decode_ctxs: list[int], chunk: int, prefix: int) -> float:
        return self._raw(candidate_features(decode_ctxs, chunk, prefix)) * self.correction

    def observe(self, plan: SchedulerOutput, seconds: float) -> None:
        f = plan_features(plan)
        raw = self._raw(f)
        if raw > 0:
            ratio = min(max(seconds / raw, 0.05), 20.0)
            self.correction = (1 - self.ema) * self.correction + self.ema * ratio
        self.rows.append(self._features(*f))
        self.times.append(seconds)
        self.max_tokens_seen = max(self.max_tokens_seen, f[0])
        self._since_fit += 1
        if self._since_fit >= self.refit_every and len(self.times) >= self.min_fit:
            self._refit()

    def _refit(self) -> None:
        from scipy.optimize import nnls

        x, y = np.array(self.rows), np.array(self.times)
        scale = np.abs(x).max(axis=0)
        scale[scale == 0] = 1.0
        coef, _ = nnls(x / y[:, None] / scale, np.ones_like(y))  # relative error
        coef = coef / scale
        pred = x @ coef
        if not np.all(pred > 0):
            return
        self.coef = coef * float(np.mean(y / pred))
        # The window mixes old and new speeds; the latest iterations say which holds now.
        recent = slice(-min(len(y), self.recent), None)
        self.correction = float(np.median(y[recent] / (x[recent] @ self.coef)))
        self._since_fit = 0


class AdaptiveBudget:
    """The scheduler's ``budget_policy`` for ``--token-budget auto``."""

    def __init__(self, predict: Predictor, tbt_slo: float, margin: float, tile: int = 1,
                 max_budget: int = AUTO_MAX_BUDGET, min_chunk: int | None = None,
                 trust: Callable[[], int] | None = None, pp: int = 1) -> None:
        # The predictor prices one micro-batch's pass; with pipeline stages a token gap can
        # also include waiting behind the micro-batch ahead (core.token_budget.pass_target).
        self.predict, self.target = predict, pass_target(tbt_slo, pp) * (1 - margin)
        self.tbt_slo, self.tile, self.max_budget = tbt_slo, tile, max_budget
        self.min_chunk = min_chunk or max(tile, 16)
        self.trust = trust  # the largest chunk the predictor may be trusted with, if bounded
        self.last = 0
        self.reachable = True  # whether the last iteration's decodes alone fit the target
        self.unreachable = 0  # iterations where even the decodes alone miss the SLO
        self._warned = False

    def __call__(self, decode_ctxs: list[int], prefix: int) -> int:
        chunk, ok = self.chunk(decode_ctxs, prefix, self.target)
        self.reachable = ok
        if not ok:
            self.unreachable += 1
            if not self._warned:
                self._warned = True
                log.warning("TBT SLO %.3f s cannot be met even by decode-only iterations (%d"
                            " decodes predicted at %.3f s); prefill chunks of %d tokens keep"
                            " new requests moving", self.tbt_slo, len(decode_ctxs),
                            self.predict(decode_ctxs, 0, prefix), chunk)
        self.last = len(decode_ctxs) + chunk
        return self.last

    def chunk(self, decode_ctxs: list[int], prefix: int, target: float) -> tuple[int, bool]:
        """The largest chunk predicted to fit ``target`` with these decodes, and whether the
        decodes alone fit it."""
        cap = self.max_budget - len(decode_ctxs)
        if self.trust is not None:
            cap = min(cap, self.trust())
        return largest_chunk(self.predict, decode_ctxs, prefix, target, max(cap, 0), self.tile,
                             self.min_chunk)


def learned_budget(tbt_slo: float, margin: float, tile: int, pp: int = 1
                   ) -> tuple[AdaptiveBudget, OnlineIterationModel]:
    """The real engine's adaptive budget: an online model, trusted up to 1.5x the largest
    batch it has seen (so a wrong prior ramps up instead of blowing the SLO at once)."""
    model = OnlineIterationModel()
    return AdaptiveBudget(model.predict, tbt_slo, margin, tile,
                          trust=lambda: max(64, model.max_tokens_seen * 3 // 2), pp=pp), model


def cost_model_budget(cost, tbt_slo: float, margin: float, tile: int) -> AdaptiveBudget:
    """The simulator's adaptive budget: the cost model predicts exactly what it will charge."""
    from fluidserve.sim.cost_model import PlanShape

    def predict(decode_ctxs: list[int], chunk: int, prefix: int) -> float:
        pre = ((chunk, prefix),) if chunk > 1 else ()
        dec = tuple(decode_ctxs) + ((prefix + 1,) if chunk == 1 else ())
        shape = PlanShape(len(decode_ctxs) + chunk, pre, dec, len(dec) + bool(pre))
        rng = getattr(cost, "_rng", None)
        cost._rng = None  # the mean time: a prediction must not consume the replayed jitter
        try:
            return sum(cost.stage_times(shape))
        finally:
            cost._rng = rng

    return AdaptiveBudget(predict, tbt_slo, margin, tile, pp=cost.pp)
