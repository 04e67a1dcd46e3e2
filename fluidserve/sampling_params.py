"""Per-request sampling and stopping parameters (torch-free, validated on construction)."""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field, replace

MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 100.0  # |bias| (OpenAI's range)
# (beyond these a float32 logit divided or multiplied by it overflows or vanishes: a huge
# value arrives as a JSON number that parses to infinity, a tiny one as a subnormal)
MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = 0.01, 100.0
# Below this a temperature is greedy (as in vLLM): dividing float32 logits by 1e-39 gives
# infinities and a meaningless token, where the user asked for the most likely one.
GREEDY_BELOW = 1e-5


@dataclass(eq=False)
class TokenLists:
    """What ``SamplingParams`` derives from its long token lists (``allowed_token_ids`` can
    hold the whole vocabulary, ``bad_words_token_ids`` hundreds of thousands of tokens), each
    with the normalized list it was made from. ``dataclasses.replace`` hands it to the copy,
    which reuses every part whose list is still the same object: the n samples of a request,
    copies with other seeds, neither rebuild nor pickle it n times (2-core Zen 4 EPYC: 128
    copies allowing 128k tokens and banning 256 words of 2000 tokens took 7.6 s and pickled
    to 581 MB when each rebuilt it, 1.4 ms and 4.6 MB sharing it)."""

    allowed: tuple[int, ...] | None = None
    allowed_array: array | None = None
    masks: dict = field(default_factory=dict)  # vocabulary size -> numpy bool mask
    words: tuple[tuple[int, ...], ...] = ()
    # The one-token words, banned always, and the longer ones by the token before their
    # last: (the tokens before it, the last).
    single: tuple[int, ...] = ()
    after: dict = field(default_factory=dict)

    def with_allowed(self, ids) -> TokenLists:
        if ids is self.allowed:
            return self
        if ids is None:
            return TokenLists(None, None, {}, self.words, self.single, self.after)
        norm = tuple(sorted(set(ids)))
        if not norm or norm[0] < 0:
            raise ValueError("allowed_token_ids must be token ids (>= 0), at least one")
        return TokenLists(norm, array("q", norm), {}, self.words, self.single, self.after)

    def with_words(self, words) -> TokenLists:
        if words is self.words:
            return self
        norm = tuple(dict.fromkeys(tuple(int(t) for t in w) for w in words))
        if any(not w or min(w) < 0 for w in norm):
            raise ValueError("bad_words_token_ids must be non-empty sequences of token ids"
                             " (>= 0)")
        after: dict[int, list[tuple[tuple[int, ...], int]]] = {}
        for w in norm:
            if len(w) > 1:
                after.setdefault(w[-2], []).append((w[:-2], w[-1]))
        return TokenLists(self.allowed, self.allowed_array, self.masks, norm,
                          tuple(w[0] for w in norm if len(w) == 1),
                          {k: tuple(v) for k, v in after.items()})


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples and when it stops.

    temperature 0 (or below ``GREEDY_BELOW``) is greedy (exact argmax). ``min_tokens``: no
    stop token (``stop_token_ids``, or EOS without ``ignore_eos``) can be sampled and no stop
    string matched among the first ``min_tokens`` output tokens. ``seed`` makes sampling
    reproducible: the n-th token of a request is drawn with a number made from (seed, n), so
    the draw does not depend on batch composition, scheduling policy or preemption; the
    logits it draws from can (a preempted request recomputes its context in other chunks,
    and bf16 sums in another order differ in their last bits).

    The logits are changed, in this order, before any token is picked (greedy too) and as
    in vLLM: ``logit_bias`` (token id -> a number in [-100, 100]) is added;
    ``repetition_penalty`` divides the positive logits, and multiplies the negative ones, of
    every token in the prompt or the output (CTRL's rule, 1 = off); ``frequency_penalty``
    subtracts itself times the number of times a token is in the output so far and
    ``presence_penalty`` itself once for a token that is there (OpenAI's, in [-2, 2], 0 =
    off). After the temperature, ``min_p`` drops the tokens less likely than ``min_p`` times
    the most likely one, and then top-k and top-p filter. Logprobs are the model's, before
    any of this.
    """

    max_tokens: int = 16
    # Samples of the prompt (``LLM.generate`` returns them as the output's ``outputs``; the
    # server's ``n``): sample j is an engine request of its own, drawn with seed + j
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    min_tokens: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (a dict is taken too)
    # The logprob of every prompt token but the first (that of the token given the ones
    # before it), and this many most likely tokens at each position: computed once, by the
    # prefill (never from a cached prefix), and returned with the first output token.
    prompt_logprobs: int | None = None
    # Only these tokens may be sampled (None: any), before any bias or penalty, greedy too.
    allowed_token_ids: tuple[int, ...] | None = None
    # Output text: with the special tokens' text (EOS's, a chat template's markers), and with
    # the stop string (or stop token's text) that ended it.
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # Token sequences the output may not contain (vLLM's bad words, as token ids): the last
    # token of each is never sampled right after the others, and a one-token sequence never.
    # They match the output only, not the prompt. ``bad_words``: the same as text, tokenized
    # by the engine (each word both as it is and after a space: ``Tokenizer.bad_words_ids``)
    # before the request is queued.
    bad_words: tuple[str, ...] = ()
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()
    extra: dict = field(default_factory=dict, compare=False, hash=False, repr=False)
    # (derived, not given: kept by dataclasses.replace)
    token_lists: TokenLists | None = field(default=None, compare=False, hash=False,
                                           repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        # The token lists the sampler reads every step, also as machine arrays: a step turns
        # them into tensors by copying bytes, not by converting Python ints (16k allowed
        # tokens for each of 64 requests took 530 ms a step as lists of pairs, 11 ms as
        # arrays: one thread of the 2-core Zen 4 EPYC).
        lists = (self.token_lists or TokenLists()).with_allowed(
            self.allowed_token_ids).with_words(self.bad_words_token_ids)
        object.__setattr__(self, "token_lists", lists)
        object.__setattr__(self, "allowed_token_ids", lists.allowed)
        object.__setattr__(self, "allowed_array", lists.allowed_array)
        if isinstance(self.bad_words, str):
            object.__setattr__(self, "bad_words", (self.bad_words,))
        object.__setattr__(self, "bad_words", tuple(self.bad_words))
        words = lists.words
        object.__setattr__(self, "bad_words_token_ids", words)
        # What the scheduler reads each step (``TokenLists`` says what).
        object.__setattr__(self, "bad_single", lists.single)
        object.__setattr__(self, "bad_after", lists.after)
        object.__setattr__(self, "bans_words", bool(words))
        # Looked up for every sampled token: a set, however many ids were given.
        object.__setattr__(self, "stop_token_set", frozenset(self.stop_token_ids))
        bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias
        # (one entry per token, the last given winning, in token order: equal params compare
        # equal however their dict was built)
        object.__setattr__(self, "logit_bias", tuple(sorted(
            {int(t): float(b) for t, b in bias}.items())))
        object.__setattr__(self, "bias_arrays", (
            array("q", (t for t, _ in self.logit_bias)),
            array("f", (b for _, b in self.logit_bias))) if self.logit_bias else None)
        # Read for every scheduled chunk: whether its sampler needs the request's tokens.
        object.__setattr__(self, "penalizes", self.presence_penalty != 0.0
                           or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0)
        object.__setattr__(self, "adjusts_logits", self.penalizes or self.min_p > 0.0
                           or bool(self.logit_bias) or self.allowed_token_ids is not None
                           or bool(words))
        if 0.0 < self.temperature < GREEDY_BELOW:
            object.__setattr__(self, "temperature", 0.0)
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        if not 0.0 <= self.temperature <= 100.0:
            raise ValueError(f"temperature must be in [0, 100], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (disabled) or >= 1, got {self.top_k}")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and not 0 <= k <= MAX_LOGPROBS:
                raise ValueError(f"{name} must be in [0, {MAX_LOGPROBS}], got {k}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be in [0, max_tokens], got {self.min_tokens}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not MIN_REPETITION_PENALTY <= self.repetition_penalty <= MAX_REPETITION_PENALTY:
            raise ValueError(f"repetition_penalty must be in [{MIN_REPETITION_PENALTY:g},"
                             f" {MAX_REPETITION_PENALTY:g}], got {self.repetition_penalty}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if any(not w.lstrip() for w in self.bad_words):
            raise ValueError("bad_words must be words: strings with more than spaces")
        for t, b in self.logit_bias:
            if t < 0 or not -MAX_LOGIT_BIAS <= b <= MAX_LOGIT_BIAS:
                raise ValueError(f"logit_bias must map token ids >= 0 to numbers in"
                                 f" [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], got {t}: {b}")

    def sample(self, j: int) -> SamplingParams:
        """The parameters of sample ``j`` of ``n``: one sample, drawn with seed + j (kept in
        int64, as vLLM seeds them); what the token lists derive is shared, not rebuilt."""
        seed = None if self.seed is None else (self.seed + j + 2**63) % 2**64 - 2**63
        return replace(self, n=1, seed=seed)

    def allowed_mask(self, vocab_size: int):
        """A numpy bool [vocab_size] of ``allowed_token_ids`` (ids past it dropped), made
        once per vocabulary size: a step stacks its rows' masks instead of building them
        (``scripts/bench_penalties.py``, 2-core Zen 4 EPYC: a sampling step of 128 requests
        allowing 16k tokens each took 27.7 ms building them, 3.0 ms stacking them; plain
        0.16 ms)."""
        masks = self.token_lists.masks  # (shared with copies that allow the same ids)
        mask = masks.get(vocab_size)
        if mask is None:
            import numpy as np

            ids = np.frombuffer(self.allowed_array, np.int64)
            mask = masks[vocab_size] = np.zeros(vocab_size, dtype=bool)
            mask[ids[ids < vocab_size]] = True
        return mask

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
