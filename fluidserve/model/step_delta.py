"""What crosses from the driver to the worker ranks each step: only what changed.

A multi-process executor's ranks keep a mirror of each request they run: its sampling
parameters, seed and block table, and for a penalized request the prompt and output tokens its
sampler counts. The driver sends a request's parameters and table once (``NewRequest``), then
per step only the chunks' tokens, starts and counts, the blocks each request gained, the output
tokens a penalty counts that the ranks have not seen, and the requests to forget. Every rank
rebuilds the same plan from its mirror (``StepDecoder``) and prepares its inputs from it, as
the single-process executor does from the scheduler's plan.

So a step of 128 decodes with 2000 tokens of context and a repetition penalty sends ~128
tokens and a handful of new blocks, not 128 block tables and 128 x 2000 counted tokens.

Ranks run steps in the order the driver submits them, so a mirror is always as of the step
being run. The plans say which requests to forget (``released``, ``preempted``; a plan the
executor never gets hands them to the next, ``Scheduler.not_submitted``). A request id the
driver still tracks is sent anew all the same if its ``SamplingParams`` object, seed or
preemption count changed, or its table or counted output shrank. The mirrors start afresh
(``reset``) with the first step, after a step that failed to encode, and with a plan of
another scheduler (its iteration not after the last one's: engines sharing the executor one
after the other, or a plan made by hand).
"""

from __future__ import annotations

import pickle
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import chain

from fluidserve.core.scheduler.output import ScheduledChunk, SchedulerOutput
from fluidserve.sampling_params import SamplingParams

SAMPLES, DECODE = 1, 2  # flags of a chunk


@dataclass
class NewRequest:
    """A request the ranks do not hold yet (or hold an older admission of)."""

    request_id: str
    params: SamplingParams
    seed: int
    block_table: tuple[int, ...]


@dataclass
class StepDelta:
    iteration: int
    reset: bool  # the ranks drop every request first
    forget: list[str]  # requests the ranks drop first
    new: list[NewRequest]
    # One entry per chunk of the plan, in its order:
    request_ids: list[str]
    starts: list[int]
    counts: list[int]
    flags: bytes  # SAMPLES | DECODE
    output_index: list[int]
    token_ids: array  # int64: the chunks' tokens, concatenated
    blocks: dict[str, tuple[int, ...]] = field(default_factory=dict)  # blocks each gained
    # Chunk index -> its stop-token and bad-word bans / its prompt-logprob targets, where any
    banned: dict[int, tuple[int, ...]] = field(default_factory=dict)
    prompt_targets: dict[int, tuple[int, ...]] = field(default_factory=dict)
    # A repetition penalty's prompt, sent with a request's first penalized chunk
    penalty_prompt: dict[str, Sequence[int]] = field(default_factory=dict)
    # Chunk index -> (n, tokens): the request's counted output is the n tokens the ranks
    # hold, then these
    penalty_output: dict[int, tuple[int, Sequence[int]]] = field(default_factory=dict)


@dataclass(slots=True)
class _Sent:
    """What the ranks hold of a request, as the driver tracks it."""

    params: SamplingParams
    seed: int
    epoch: int
    blocks: int
    prompt: Sequence[int] | None = None  # the penalty prompt sent (by identity)
    output: int = 0  # counted output tokens sent


class StepEncoder:
    """The driver's side: one per executor, fed every plan in the order it is submitted."""

    def __init__(self) -> None:
        self.sent: dict[str, _Sent] = {}
        self._reset = True
        self._iteration = 0

    def payload(self, plan: SchedulerOutput) -> bytes:
        """``plan``'s delta, pickled. If that fails, the ranks never get this step, and the
        next starts their mirrors afresh."""
        try:
            return pickle.dumps(self.encode(plan), protocol=pickle.HIGHEST_PROTOCOL)
        except BaseException:
            self._reset = True
            raise

    def encode(self, plan: SchedulerOutput) -> StepDelta:
        sent = self.sent
        reset = self._reset or plan.iteration <= self._iteration
        self._reset, self._iteration = False, plan.iteration
        if reset:
            sent.clear()
        forget = [] if reset else [rid for rid in chain(plan.released, plan.preempted)
                                   if sent.pop(rid, None) is not None]
        chunks = plan.chunks
        d = StepDelta(plan.iteration, reset, forget, [], [c.request_id for c in chunks],
                      [c.start for c in chunks], [len(c.token_ids) for c in chunks],
                      bytes(c.samples | c.is_decode << 1 for c in chunks),
                      [c.output_index for c in chunks],
                      array("q", chain.from_iterable(c.token_ids for c in chunks)))
        for i, c in enumerate(chunks):
            rid, table = c.request_id, c.block_table
            if c.banned_if:  # (asynchronous scheduling: the single-process executor only)
                raise ValueError("bans on a token in flight do not cross to worker ranks")
            st = sent.get(rid)
            if (st is None or st.params is not c.params or st.seed != c.seed
                    or st.epoch != c.epoch or len(table) < st.blocks
                    or (c.penalized is not None and len(c.penalized[1]) < st.output)):
                st = sent[rid] = _Sent(c.params, c.seed, c.epoch, len(table))
                d.new.append(NewRequest(rid, c.params, c.seed, table))
            elif len(table) > st.blocks:  # (tables only grow within an admission)
                d.blocks[rid] = table[st.blocks:]
                st.blocks = len(table)
            if c.banned:
                d.banned[i] = c.banned
            if c.prompt_targets:
                d.prompt_targets[i] = c.prompt_targets
            if c.penalized is not None:
                prompt, output = c.penalized
                if len(prompt) and st.prompt is not prompt:
                    d.penalty_prompt[rid] = st.prompt = prompt
                d.penalty_output[i] = (st.output, output[st.output:])
                st.output = len(output)
        return d


@dataclass(slots=True)
class _Held:
    """A rank's mirror of one request."""

    params: SamplingParams
    seed: int
    table: list[int]
    prompt: Sequence[int] = ()
    output: array = field(default_factory=lambda: array("q"))


class StepDecoder:
    """A rank's side: rebuilds each plan's chunks from the deltas, in the driver's order."""

    def __init__(self) -> None:
        self.held: dict[str, _Held] = {}

    def decode(self, d: StepDelta) -> SchedulerOutput:
        held = self.held
        if d.reset:
            held.clear()
        for rid in d.forget:
            held.pop(rid, None)
        for n in d.new:
            held[n.request_id] = _Held(n.params, n.seed, list(n.block_table))
        try:
            for rid, blocks in d.blocks.items():
                held[rid].table.extend(blocks)
            for rid, prompt in d.penalty_prompt.items():
                held[rid].prompt = prompt
            return SchedulerOutput(d.iteration, self._chunks(d))
        except KeyError as e:
            raise RuntimeError(f"this rank holds no request {e.args[0]!r}: the driver and the"
                               " ranks are out of step") from None

    def _chunks(self, d: StepDelta) -> list[ScheduledChunk]:
        held, tokens = self.held, d.token_ids
        chunks, at = [], 0
        for i, (rid, start, n, flags) in enumerate(zip(d.request_ids, d.starts, d.counts,
                                                       d.flags, strict=True)):
            h = held[rid]
            penalized = None
            counted = d.penalty_output.get(i)
            if counted is not None:  # (the sampler copies the tokens before the next step)
                if len(h.output) != counted[0]:
                    raise RuntimeError(f"this rank holds {len(h.output)} counted tokens of"
                                       f" {rid!r}, the driver {counted[0]}: out of step")
                h.output.extend(counted[1])
                penalized = (h.prompt, h.output)
            chunks.append(ScheduledChunk(
                rid, start, tuple(tokens[at:at + n]), h.table, bool(flags & SAMPLES), h.params,
                h.seed, d.output_index[i], bool(flags & DECODE), d.banned.get(i, ()),
                penalized=penalized, prompt_targets=d.prompt_targets.get(i, ())))
            at += n
        return chunks
