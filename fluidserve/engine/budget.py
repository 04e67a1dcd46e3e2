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

With pipeline stages a token gap is a micro-batch's pass plus its wait behind the one ahead:
the wait is learned from the engine's token gaps (``GapExcess``), and no micro-batch grows
beyond the chunk where the device's prefill rate saturates (a bigger one buys nothing and
keeps the other stages waiting).

If even the decodes alone are predicted to miss the SLO, the budget degrades to the smallest
chunk that still makes prefill progress (new requests never starve), and says so once.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable

import numpy as np

from fluidserve.core.scheduler.output import SchedulerOutput
from fluidserve.core.token_budget import (
    Predictor,
    efficient_chunk,
    largest_chunk,
    pass_target,
    saturation_chunk,
)

log = logging.getLogger(__name__)

AUTO_MAX_BUDGET = 8192  # the largest budget `auto` may choose

# Token gaps teach the gap excess only from batches planned near the target (at least this
# share of it): a small batch waiting behind a full one has a long gap relative to its own
# pass, yet is far inside the SLO.
FULL_BATCH = 0.75
# With pipeline stages, no micro-batch beyond the chunk that reaches this share of the best
# prefill rate (core.token_budget.saturation_chunk): a bigger one buys no throughput and
# keeps the other stages waiting.
SATURATION = 0.9
# The quantile of (token gap - predicted pass) that the pipeline plans for. Aimed inside
# the P99: the excess is learned from near-target micro-batches over a short window, and at
# its 99th percentile the run's P99 TBT sat a hair over the SLO (1.02% of gaps over it, in
# the Llama-2-70B TP4-PP2 simulation at 0.5 s).
GAP_QUANTILE = 0.995
# The iteration-time scatter is taken over the iterations predicted at half the target or
# more, where the window holds at least this many of them (OnlineIterationModel._scatter).
NEAR_SHARE, NEAR_MIN = 0.5, 32
# The SLO bounds this quantile of all token gaps; the scatter is the quantile of the near
# iterations' excess that leaves that share of gaps over it, no lower than SCATTER_LEVEL_MIN
# (OnlineIterationModel._scatter).
TBT_QUANTILE, SCATTER_LEVEL_MIN = 0.99, 0.9
# Below the largest chunk that fits, `auto` weighs the chunks that end the iteration on a
# multiple of this many tokens (or of the tile size) and takes the best prefill rate
# (core.token_budget.efficient_chunk).
EFFICIENT_STEP = 64


def max_iteration_tokens(scheduler) -> int:
    """The most tokens one iteration can hold under a SchedulerConfig: its token budget, or
    for `auto` the largest budget it may choose."""
    return AUTO_MAX_BUDGET if scheduler.token_budget == "auto" else scheduler.token_budget


def plan_features(plan: SchedulerOutput) -> tuple[int, int, int, int, int]:
    """(tokens, sum q^2, sum q x cached, sum of the one-token runs' contexts, requests)."""
    w = plan.attention_work
    return plan.num_tokens, w.sq, w.prefix, w.single_ctx_sum, len(plan.chunks)


def candidate_features(decode_ctxs: list[int], chunk: int, prefix: int
                       ) -> tuple[int, int, int, int, int]:
    d, ctx_sum = len(decode_ctxs), sum(decode_ctxs)
    if chunk == 1:
        return d + 1, 0, 0, ctx_sum + prefix + 1, d + 1
    return d + chunk, chunk * chunk, chunk * prefix, ctx_sum, d + (chunk > 0)


class OnlineIterationModel:
    """Iteration time learned from the engine's own iterations (see the module docstring)."""

    def __init__(self, prior: np.ndarray | None = None, window: int = 1024,
                 refit_every: int = 16, min_fit: int = 24, ema: float = 0.5,
                 recent: int = 8, shape_of: Callable[[int], int] | None = None,
                 token_rows: Callable[[int], int] | None = None, near: float = 0.0) -> None:
        from fluidserve.sim.cost_model import CPUCostModel, load_cpu_profile

        self._features = CPUCostModel.features
        self.coef = prior if prior is not None else CPUCostModel(load_cpu_profile(None)).coef
        self.rows: deque[np.ndarray] = deque(maxlen=window)
        self.times: deque[float] = deque(maxlen=window)
        self.gaps: deque[int] = deque(maxlen=window)  # token gaps each ended: its decodes
        self.refit_every, self.min_fit, self.ema = refit_every, min_fit, ema
        self.recent = recent  # iterations that set the correction after a refit
        self.correction = 1.0  # measured / predicted, exponentially averaged
        self.scatter, self.scatter_window = 1.0, 256  # see _scatter
        self.near = near  # seconds: the iterations whose scatter counts (see _scatter)
        self.max_tokens_seen = 0
        self._since_fit = 0
        # The first batch of each shape (``shape_of(tokens)``: the rows the executor pads to)
        # pays one-off setup: oneDNN builds its primitives, the first forward initializes
        # lazily (~15-35 ms more on the 200M CPU model, several times the prediction for the
        # very first). Learned from, such a batch would raise the speed correction and, for
        # a whole window, the scatter, and shrink every budget while the server is fresh.
        self.shape_of = shape_of or (lambda n: n)
        self.shapes_seen: set[int] = set()
        self.first_of_shape = 0  # batches not learned from, for that reason
        # The rows the matrix products run on for a batch of n tokens (``token_rows(n)``):
        # the CPU engine pads its rows to a bounded set of sizes, and an iteration costs what
        # its padded batch costs (577 tokens take as long as 640). Priced on its padded rows,
        # a chunk that would leave padding unused is predicted no faster than one that fills
        # it, so the budget fills it (``efficient_chunk``).
        self.token_rows = token_rows or (lambda n: n)

    def _x(self, f: tuple) -> np.ndarray:
        return self._features(self.token_rows(f[0]), *f[1:])

    def _raw(self, f: tuple) -> float:
        return float(self.coef @ self._x(f))

    def predict(self, decode_ctxs: list[int], chunk: int, prefix: int) -> float:
        return self._raw(candidate_features(decode_ctxs, chunk, prefix)) * self.correction

    def predict_plan(self, plan: SchedulerOutput) -> float:
        return self._raw(plan_features(plan)) * self.correction

    def observe(self, plan: SchedulerOutput, seconds: float) -> None:
        f = plan_features(plan)
        self.max_tokens_seen = max(self.max_tokens_seen, f[0])
        shape = self.shape_of(f[0])
        if shape not in self.shapes_seen:
            self.shapes_seen.add(shape)
            self.first_of_shape += 1
            return
        x = self._x(f)
        raw = float(self.coef @ x)
        if raw > 0:
            # Wide bounds: the shipped prior is one CPU's profile, and the machine serving
            # may be 10-100x faster (a GPU) or slower; until the first refit the correction
            # alone carries the scale.
            ratio = min(max(seconds / raw, 0.01), 100.0)
            self.correction = (1 - self.ema) * self.correction + self.ema * ratio
        self.rows.append(x)
        self.times.append(seconds)
        self.gaps.append(plan.num_decode_tokens)
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
        self.scatter = self._scatter(y, x @ self.coef, np.array(self.gaps, float))
        self._since_fit = 0

    def _scatter(self, y: np.ndarray, pred: np.ndarray, gaps: np.ndarray | None = None
                 ) -> float:
        """The 99th percentile, over the last ``scatter_window`` iterations, of measured time
        over the prediction as the correction would have had it (the median ratio of the
        ``recent`` iterations before): how far one iteration strays from a prediction that
        follows the machine's speed. At least 1, at most 2.

        Counted over the iterations predicted at ``near`` seconds or more where the window
        holds at least NEAR_MIN of them: those are the ones the SLO binds, and a stall of a
        few ms (the front end taking a core) is a large share of a 20 ms decode step but a
        small one of a 150 ms iteration. On a 2-core AMX Xeon VM, a 60-request probe at
        12 req/s: 99th percentile 1.58 over all iterations, 1.20 over those predicted at
        100 ms or more (1.71 under 50 ms); planned for 1.5, that probe's iterations stopped at
        512 tokens and ~140 ms, and its P99 TBT at 0.14-0.17 s against a 0.2 s SLO.

        ``gaps``: the token gaps each iteration ended (its decodes). The SLO bounds the 99th
        percentile of all gaps, not of the near iterations' alone: where those end a share f
        of the gaps (the others, shorter steps, far inside the SLO), one gap in a hundred over
        it is one in 100 f of theirs, so the scatter is their excess at that level, weighted
        by their gaps (at least SCATTER_LEVEL_MIN). A 1.1B model on that VM, 0.25 req/s of
        512-token prompts: the near iterations ended a quarter of the gaps, and their 99th
        percentile over the run, 1.39, held them at ~140 ms and the P99 TBT at 0.166 s."""
        r = (y / pred)[-self.scatter_window:]
        if len(r) <= self.recent:
            return self.scatter
        before = np.median(np.lib.stride_tricks.sliding_window_view(r, self.recent)[:-1], axis=1)
        ahead = r[self.recent:] / before  # each iteration over the median of those before it
        near = pred[-self.scatter_window:][self.recent:] >= self.near
        level, weight = TBT_QUANTILE, None
        if self.near > 0 and near.sum() >= NEAR_MIN:
            ahead = ahead[near]
            if gaps is not None:
                ended = gaps[-self.scatter_window:][self.recent:]
                inside = ended[near].sum()
                if inside > 0:
                    level = max(1 - (1 - TBT_QUANTILE) * ended.sum() / inside,
                                SCATTER_LEVEL_MIN)
                    weight = ended[near]
        return float(np.clip(weighted_quantile(ahead, level, weight), 1.0, 2.0))


def weighted_quantile(values: np.ndarray, level: float, weights: np.ndarray | None = None
                      ) -> float:
    """The ``level`` quantile of ``values``, each counted ``weights`` times (numpy's
    ``inverted_cdf``: the least value whose cumulative weight reaches ``level`` of the whole);
    without weights numpy's default (linear) quantile."""
    if weights is None or weights.sum() <= 0:
        return float(np.quantile(values, level))
    order = np.argsort(values)
    cum = np.cumsum(weights[order])
    return float(values[order][np.searchsorted(cum, level * cum[-1])])


class GapExcess:
    """How much longer a token gap is than the predicted pass of the micro-batch that ended
    it, learned online: a high quantile of (gap - prediction) over the last ``window`` tokens
    of micro-batches planned near the target.

    With pipeline stages a micro-batch may wait at the first stage behind the one ahead: at
    worst that one's stage time, target / pp (the prior, token_budget.pass_target), in
    practice less, since micro-batches are alike. Each sample is capped at ``cap`` (half the
    SLO) so that a preempted request's gap cannot freeze the budget; the window is a few
    iterations' tokens, so that the iteration-time model's errors while it catches up with a
    change of speed do not linger."""

    def __init__(self, prior: float, cap: float, quantile: float = 0.99, window: int = 1024,
                 every: int = 8, min_samples: int = 256) -> None:
        self.value, self.cap = prior, cap
        self.quantile, self.every, self.min_samples = quantile, every, min_samples
        self.samples: deque[float] = deque(maxlen=window)
        self._since = 0

    def observe(self, predicted: float, gaps: list[float]) -> None:
        if not gaps:
            return
        self.samples.extend(min(g - predicted, self.cap) for g in gaps)
        self._since += 1
        if self._since >= self.every and len(self.samples) >= self.min_samples:
            self._since = 0
            self.value = max(0.0, float(np.quantile(np.fromiter(self.samples, float),
                                                    self.quantile)))


class AdaptiveBudget:
    """The scheduler's ``budget_policy`` for ``--token-budget auto``.

    An iteration is planned to take at most ``target`` = (1 - margin) x SLO / scatter - gap
    excess: the scatter of measured iteration times around the online model's predictions
    (``OnlineIterationModel._scatter``, the real engine only), the excess learned from the
    token gaps the engine core reports (``observe_gaps``, with pipeline stages)."""

    def __init__(self, predict: Predictor, tbt_slo: float, margin: float, tile: int = 1,
                 max_budget: int = AUTO_MAX_BUDGET, min_chunk: int | None = None,
                 trust: Callable[[], int] | None = None, pp: int = 1,
                 predict_plan: Callable[[SchedulerOutput], float] | None = None,
                 gap_quantile: float = GAP_QUANTILE, scatter: Callable[[], float] | None = None
                 ) -> None:
        self.predict, self.predict_plan = predict, predict_plan
        self.scatter = scatter  # measured / predicted time of a bad iteration (>= 1), if known
        self.pp = pp
        self._saturation, self._saturation_age = 0, 0
        self.tbt_slo, self.margin, self.tile, self.max_budget = tbt_slo, margin, tile, max_budget
        # Until gaps are measured, assume the pipeline's worst case (token_budget.pass_target).
        self.gap_excess = GapExcess(tbt_slo - pass_target(tbt_slo, pp), tbt_slo / 2, gap_quantile)
        self.min_chunk = min_chunk or max(tile, 16)
        self.trust = trust  # the largest chunk the predictor may be trusted with, if bounded
        self.last = 0
        self.reachable = True  # whether the last iteration's decodes alone fit the target
        self.unreachable = 0  # iterations where even the decodes alone miss the SLO
        self._warned = False
        self._predicted: dict[int, float] = {}  # iteration in flight -> its predicted pass

    @property
    def learns_gaps(self) -> bool:
        """Whether token gaps teach this budget anything: with pipeline stages, where a gap
        holds more than one pass."""
        return self.pp > 1 and self.predict_plan is not None

    @property
    def target(self) -> float:
        slo = self.tbt_slo / (self.scatter() if self.scatter is not None else 1.0)
        return slo * (1 - self.margin) - self.gap_excess.value

    def submitted(self, plan: SchedulerOutput) -> None:
        """A batch was submitted: remember its predicted pass for ``observe_gaps``."""
        if self.learns_gaps:
            self._predicted[plan.iteration] = self.predict_plan(plan)
            if len(self._predicted) > 64:  # batches that failed never complete
                del self._predicted[next(iter(self._predicted))]

    def observe_gaps(self, plan: SchedulerOutput, gaps: list[float]) -> None:
        """The batch completed; ``gaps``: for each of its decodes, the time since that
        request's previous token."""
        predicted = self._predicted.pop(plan.iteration, None)
        if predicted is not None and predicted >= FULL_BATCH * self.target:
            self.gap_excess.observe(predicted, gaps)

    def saturation(self) -> int:
        """Where the device saturates, by the predictor; re-read every 256 iterations, as
        the online model learns."""
        if self._saturation_age <= 0:
            self._saturation = saturation_chunk(self.predict, self.max_budget, self.tile,
                                                SATURATION)
            self._saturation_age = 256
        self._saturation_age -= 1
        return self._saturation

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
        if self.trust is not None:  # never below the smallest chunk (a tile, at least)
            cap = min(cap, max(self.trust(), self.min_chunk))
        if self.pp > 1:
            cap = min(cap, self.saturation())
        chunk, ok = largest_chunk(self.predict, decode_ctxs, prefix, target, max(cap, 0),
                                  self.tile, self.min_chunk)
        if ok and chunk > self.min_chunk:
            chunk = max(efficient_chunk(self.predict, decode_ctxs, prefix, chunk,
                                        EFFICIENT_STEP, self.tile), self.min_chunk)
        return chunk, ok


def learned_budget(tbt_slo: float, margin: float, tile: int, pp: int = 1,
                   pads_rows: bool = False) -> tuple[AdaptiveBudget, OnlineIterationModel]:
    """The real engine's adaptive budget: an online model, trusted up to 1.5x the largest
    batch it has seen (so a wrong prior ramps up instead of blowing the SLO at once).
    ``pads_rows``: the executor runs its linears on rows padded as ``padded_rows`` pads
    them (the CPU's prepacked linears), and the model prices each batch on those rows."""
    from fluidserve.model.linear import padded_rows

    model = OnlineIterationModel(shape_of=padded_rows,
                                 token_rows=padded_rows if pads_rows else None,
                                 near=NEAR_SHARE * (1 - margin) * pass_target(tbt_slo, pp))
    return AdaptiveBudget(model.predict, tbt_slo, margin, tile,
                          trust=lambda: max(64, model.max_tokens_seen * 3 // 2), pp=pp,
                          predict_plan=model.predict_plan, scatter=lambda: model.scatter), model


def cost_model_budget(cost, tbt_slo: float, margin: float, tile: int) -> AdaptiveBudget:
    """The simulator's adaptive budget: the cost model predicts exactly what it will charge."""
    from fluidserve.sim.cost_model import PlanShape

    def predict(decode_ctxs: list[int], chunk: int, prefix: int) -> float:
        pre = ((chunk, prefix),) if chunk > 1 else ()
        dec = tuple(decode_ctxs) + ((prefix + 1,) if chunk == 1 else ())
        return mean_time(PlanShape(len(decode_ctxs) + chunk, pre, dec, len(dec) + bool(pre)))

    def mean_time(shape: PlanShape) -> float:
        rng = getattr(cost, "_rng", None)
        cost._rng = None  # the mean time: a prediction must not consume the replayed jitter
        try:
            return sum(cost.stage_times(shape))
        finally:
            cost._rng = rng

    return AdaptiveBudget(predict, tbt_slo, margin, tile, pp=cost.pp,
                          predict_plan=lambda plan: mean_time(PlanShape.of(plan)))
