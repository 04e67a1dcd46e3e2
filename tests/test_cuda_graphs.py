"""Decode steps replayed from captured graphs (model/cuda_graphs.py).

The bookkeeping (one input buffer at fixed addresses, padding a batch up to a captured size,
which captured step runs, when a batch runs eagerly instead) is checked on every machine with a
capture that replays the step eagerly, through the Triton kernels (interpreted on the CPU); on a
GPU the same test captures real CUDA graphs.
"""

from __future__ import annotations

import pytest
import torch

from fluidserve.config import EngineConfig
from fluidserve.core.scheduler.output import ScheduledChunk, SchedulerOutput
from fluidserve.model.cuda_graphs import DecodeGraphs, capture_sizes
from fluidserve.model.runner import ModelExecutor
from fluidserve.model.worker import cuda_graph_batch
from fluidserve.sampling_params import SamplingParams

CUDA = torch.cuda.is_available()
GREEDY = SamplingParams(temperature=0.0)
CAPTURES = ["eager-replay"] + (["cuda"] if CUDA else [])


def chunk(rid: str, start: int, n: int, table: tuple[int, ...]) -> ScheduledChunk:
    ids = tuple((7 * start + 3 * i + ord(rid)) % 250 + 3 for i in range(n))
    return ScheduledChunk(rid, start, ids, table, True, GREEDY, 0, 0, is_decode=n == 1)


class Counting:
    """A capture that replays eagerly and counts which captured size ran."""

    def __init__(self) -> None:
        self.sizes: list[int] = []
        self.replays: list[int] = []

    def __call__(self, step):
        size = len(self.sizes)
        self.sizes.append(size)

        def replay():
            self.replays.append(size)
            return step()

        return replay


@pytest.mark.parametrize("capture", CAPTURES)
def test_decode_batches_replay_the_captured_step_with_padding(hf_models, capture,
                                                             few_key_splits):
    device = "cuda" if CUDA else "cpu"
    # The reference runs every batch through the eager PyTorch layers (no interpreted
    # kernels): the graphed executor must match the model's own reference, not itself.
    make = lambda attention: ModelExecutor(  # noqa: E731
        hf_models["llama"], dtype="float32", device=device, num_blocks=64, block_size=16,
        max_model_len=256, attention_backend=attention, linear_backend="eager")
    graphed, eager = make("triton"), make("eager")
    counting = Counting() if capture == "eager-replay" else None
    graphed.worker.graphs = DecodeGraphs(graphed.worker, 4, counting)
    assert graphed.worker.graphs.sizes == [1, 2, 4]
    tables = {"a": (5, 9, 2), "b": (11, 3), "c": (20, 21, 22, 23), "d": (0,), "e": (40,)}
    plans = [[chunk("a", 0, 20, tables["a"]), chunk("b", 0, 9, tables["b"])],  # eager: prefill
             [chunk("c", 0, 33, tables["c"]), chunk("d", 0, 4, tables["d"]),
              chunk("e", 0, 2, tables["e"])]]
    # Decode-only batches of 2 (captured size 2), 3 (padded to 4), 1, and 5 (above 4: eager).
    plans += [[chunk("a", 20, 1, tables["a"]), chunk("b", 9, 1, tables["b"])],
              [chunk("c", 33, 1, tables["c"]), chunk("a", 21, 1, tables["a"]),
               chunk("d", 4, 1, tables["d"])],
              [chunk("b", 10, 1, tables["b"])],
              [chunk(r, s, 1, tables[r]) for r, s in
               (("a", 22), ("b", 11), ("c", 34), ("d", 5), ("e", 2))],
              [chunk("e", 3, 1, tables["e"]), chunk("a", 23, 1, tables["a"])]]
    expect_size = [None, None, 2, 4, 1, None, 2]
    for i, chunks in enumerate(plans):
        plan = SchedulerOutput(i, chunks)
        inputs_size = graphed.worker.graphs.size_for(_inputs(plan))
        assert inputs_size == expect_size[i], i
        with torch.inference_mode():
            got, want = graphed.logits(plan), eager.logits(plan)
        assert got.shape == want.shape == (len(chunks), graphed.arch.vocab_size)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4, msg=f"plan {i}")
    if counting is not None:  # captured largest first: 4, 2, 1 -> indices 0, 1, 2
        assert counting.replays == [1, 0, 2, 1]


def _inputs(plan):
    from fluidserve.model.inputs import prepare_inputs

    return prepare_inputs(plan, 16)


def test_capture_sizes_and_when_graphs_are_used():
    assert capture_sizes(1) == [1]
    assert capture_sizes(100) == [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 100]
    assert capture_sizes(0) == []
    cfg = EngineConfig.create(model="m", device="cuda", max_num_seqs=64)
    assert cuda_graph_batch(cfg) == 64
    assert cuda_graph_batch(cfg.replace(max_cudagraph_capture_size=16)) == 16
    assert cuda_graph_batch(cfg.replace(enforce_eager=True)) == 0
    assert cuda_graph_batch(cfg.replace(device="cpu")) == 0
    assert cuda_graph_batch(cfg.replace(tensor_parallel_size=2)) == 0


@pytest.mark.parametrize("capture", CAPTURES)
def test_graphed_decodes_read_tokens_in_flight_on_the_device(hf_models, capture,
                                                            few_key_splits):
    """Asynchronous scheduling: a decode whose input token the previous step is still
    sampling reads it on the device, inside the graph; logits as with the token known."""
    from fluidserve.core.scheduler.base import PLACEHOLDER
    from fluidserve.model.inputs import prepare_inputs

    device = "cuda" if CUDA else "cpu"
    make = lambda attention, **kw: ModelExecutor(  # noqa: E731
        hf_models["llama"], dtype="float32", device=device, num_blocks=64, block_size=16,
        max_model_len=256, attention_backend=attention, linear_backend="eager", **kw)
    graphed, eager = make("triton", async_scheduling=True, max_num_seqs=8), make("eager")
    counting = Counting() if capture == "eager-replay" else None
    graphed.worker.graphs = DecodeGraphs(graphed.worker, 4, counting)
    tables = {"a": (5, 9, 2), "b": (11, 3), "c": (20, 21)}
    first = SchedulerOutput(0, [chunk("a", 0, 20, tables["a"]), chunk("b", 0, 9, tables["b"]),
                                chunk("c", 0, 17, tables["c"])])
    known = graphed.submit(first).result().sampled
    assert known == eager.execute(first).sampled

    def decode(rid, start, token):
        return ScheduledChunk(rid, start, (token,), tables[rid], True, GREEDY, 0, 1,
                              is_decode=True)

    # Two decodes of tokens in flight (graph of 2), then three with one token known (of 4).
    steps = [[("a", 20), ("b", 9)], [("a", 21), ("c", 17), ("b", 10)]]
    for i, rows in enumerate(steps):
        in_flight = {rid for rid, _ in steps[i - 1]} if i else {"a", "b"}
        plan = SchedulerOutput(i + 1, [decode(r, s, PLACEHOLDER if r in in_flight else known[r])
                                       for r, s in rows])
        real = SchedulerOutput(i + 1, [decode(r, s, known[r]) for r, s in rows])
        x = prepare_inputs(plan, 16, graphed._rows)
        assert graphed.worker.graphs.size_for(x) == (2, 4)[i]
        assert (x.token_ids < 0).sum() == len(in_flight)
        with torch.inference_mode():
            got = graphed.worker.forward(x).clone()  # (the graph's output is overwritten)
            want = eager.logits(real)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4, msg=f"step {i}")
        # As the engine runs it (the KV writes again, the same): its tokens, for the next.
        sampled = graphed.submit(plan).result().sampled
        assert sampled == eager.execute(real).sampled
        known.update(sampled)
    if counting is not None:  # captured 4, 2, 1 -> indices 0, 1, 2; each step ran twice
        assert counting.replays == [1, 1, 0, 0]


def test_only_batches_whose_every_run_samples_replay_a_graph():
    """A graph returns every run's logits in run order, which the sampler takes as its rows:
    a one-token chunk inside a prompt (it samples nothing) or one that computes prompt
    logprobs runs eagerly."""
    from types import SimpleNamespace

    from fluidserve.model.inputs import prepare_inputs

    def size(chunks) -> int | None:
        inputs = prepare_inputs(SchedulerOutput(0, chunks), 16)
        return DecodeGraphs.size_for(SimpleNamespace(sizes=[1, 2, 4, 8]), inputs)

    decodes = [chunk("a", 5, 1, (0,)), chunk("b", 9, 1, (1,))]
    assert size(decodes) == 2
    inside = ScheduledChunk("p", 3, (7,), (2,), False, GREEDY, 0, 0)
    assert size(decodes + [inside]) is None
    logprobs = SamplingParams(temperature=0.0, prompt_logprobs=1)
    scored = ScheduledChunk("q", 3, (7,), (3,), False, logprobs, 0, 0, prompt_targets=(9,))
    assert size(decodes + [scored]) is None  # (its one row after the sampled ones)
    assert size(decodes + [chunk("c", 4, 1, (4,))]) == 4
