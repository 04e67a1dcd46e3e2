"""Bad words: token sequences the output may not contain. The scheduler's bans against the
output so far, the sampler's bans on a token still in flight, and the engine against a
step-by-step transformers loop under chunking, preemption, asynchronous scheduling and a
pipeline."""

from __future__ import annotations

import pytest
import torch

from fluidserve.core.scheduler.base import PLACEHOLDER, word_bans
from fluidserve.core.scheduler.output import ScheduledChunk
from fluidserve.model.inputs import sampling_metadata
from fluidserve.model.sampler import sample_on_device, to_host
from fluidserve.sampling_params import SamplingParams

WORDS = ((5,), (7, 8), (1, 7, 9), (3, 3, 3), (2, 7, 8))


def test_a_word_is_banned_only_where_the_output_ends_with_the_rest_of_it():
    p = SamplingParams(bad_words_token_ids=WORDS)
    assert word_bans(p, []) == ([5], ())  # a one-token word always; the others need output
    assert word_bans(p, [4, 7])[0] == [5, 8]  # (7, 8); (2, 7, 8) needs a 2 before the 7
    assert sorted(word_bans(p, [2, 7])[0]) == [5, 8, 8]  # both words end in 8 here
    assert sorted(word_bans(p, [1, 7])[0]) == [5, 8, 9]
    assert word_bans(p, [7])[0] == [5, 8]  # (1, 7, 9): the output is too short for it
    assert word_bans(p, [3, 3])[0] == [5, 3] and word_bans(p, [4, 3])[0] == [5]
    assert word_bans(p, [7, 4])[0] == [5]


def test_a_word_ending_in_the_token_in_flight_is_banned_if_that_token_is_sampled():
    """Asynchronous scheduling: the last output token is a placeholder, so every word whose
    earlier tokens match is banned on the condition of its next-to-last token."""
    p = SamplingParams(bad_words_token_ids=WORDS)
    now, later = word_bans(p, [1, PLACEHOLDER])
    assert now == [5] and sorted(later) == [(8, 7), (9, 7)]  # (2, 7, 8) needs a 2, not a 1
    assert sorted(word_bans(p, [PLACEHOLDER])[1]) == [(8, 7)]
    assert sorted(word_bans(p, [3, PLACEHOLDER])[1]) == [(3, 3), (8, 7)]


def metadata(params, outputs, rows=None):
    return sampling_metadata([
        ScheduledChunk(f"r{i}", 0, (1,), (), True, p, 0, len(out), True,
                       *_bans(p, out)) for i, (p, out) in enumerate(
            zip(params, outputs, strict=True))], rows)


def _bans(p: SamplingParams, out) -> tuple:
    now, later = word_bans(p, list(out))
    return tuple(now), 0, None, (), later


def test_the_sampler_resolves_bans_on_the_token_in_flight_on_the_device():
    """Rows 0 and 1 have the token in flight of the last step's rows 1 and 0; only row 0's
    is the next-to-last token of a word, so only row 0 loses its best token."""
    p = SamplingParams(temperature=0.0, bad_words_token_ids=((4, 6), (11, 6)))
    logits = torch.zeros(3, 12)
    logits[:, 6], logits[:, 2] = 5.0, 4.0  # 6 is every row's best, then 2
    meta = metadata([p, p, SamplingParams(temperature=0.0)],
                    [[9, PLACEHOLDER], [9, PLACEHOLDER], [9]], rows={"r0": 1, "r1": 0})
    assert meta.banned_if.tolist() == [[0, 6, 1, 4], [0, 6, 1, 11], [1, 6, 0, 4], [1, 6, 0, 11]]
    last = torch.tensor([3, 4, 0])  # the last step sampled 3 for r1, 4 for r0
    tokens, _ = to_host(sample_on_device(logits, meta, last))
    assert tokens == [2, 6, 6]
    assert logits[0, 6] == 5.0  # (the bans went into a copy)
    with pytest.raises(ValueError, match="previous step"):
        sample_on_device(logits, meta, None)


def test_a_ban_never_takes_the_last_allowed_token_and_logprobs_stay_the_models():
    p = SamplingParams(temperature=0.0, logprobs=1, allowed_token_ids=[3],
                       bad_words_token_ids=((3,),))
    logits = torch.linspace(0, 1, 10)[None]
    tokens, lps = to_host(sample_on_device(logits, metadata([p], [[]])))
    assert tokens == [3]
    assert lps[0][0] == pytest.approx(float(logits[0].log_softmax(-1)[3]))


@pytest.mark.parametrize("kw,says", [
    (dict(bad_words_token_ids=((),)), "non-empty"),
    (dict(bad_words_token_ids=((3, -1),)), "token ids"),
    (dict(bad_words=("  ",)), "more than spaces"),
])
def test_malformed_bad_words_are_refused(kw, says):
    with pytest.raises(ValueError, match=says):
        SamplingParams(**kw)


def test_words_are_tokenized_at_the_start_of_the_text_and_after_a_space(tiny_model_dir):
    from fluidserve.model.tokenizer import Tokenizer

    tok = Tokenizer(tiny_model_dir)
    ids = tok.bad_words_ids(["  the", "the"])
    assert set(ids) == {tuple(tok.encode("the", False)), tuple(tok.encode(" the", False))}
    assert len(ids) == 2  # each sequence once
    with pytest.raises(ValueError, match="only spaces"):
        tok.bad_words_ids([" \t"])


def reference(model, prompt: list[int], p: SamplingParams) -> list[int]:
    """Greedy, one token at a time over the whole sequence (a transformers model), every
    word's last token banned where the output ends with the rest of it."""
    out: list[int] = []
    with torch.no_grad():
        for _ in range(p.max_tokens):
            logits = model(torch.tensor([prompt + out])).logits[0, -1]
            for w in p.bad_words_token_ids:
                if len(out) >= len(w) - 1 and out[len(out) - len(w) + 1:] == list(w[:-1]):
                    logits[w[-1]] = float("-inf")
            out.append(int(logits.argmax()))
    return out


PROMPTS = [[1, 5, 9, 9, 30, 41, 7, 7, 7, 12, 60, 33], [1, 40, 41, 42, 40, 41, 42, 9], [1, 8],
           [1, 77, 3, 77, 3, 77, 3, 77, 3, 77, 3, 77, 3, 77, 3]]


@pytest.fixture(scope="module")
def cases(tiny_model_dir):
    """Per prompt: greedy parameters whose words each bite, and transformers' outputs under
    them. The tiny model repeats one token c, so the first word is (c, c); each word after
    it is taken from the reference's output under the words before it (a 3-token word, a
    2-token one, one token), where it would come next."""
    import transformers as tf

    model = tf.AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()

    def params(words) -> SamplingParams:
        return SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True,
                              bad_words_token_ids=tuple(words))

    out, want = [], []
    for i, prompt in enumerate(PROMPTS):
        plain = reference(model, prompt, params(()))
        c = plain[0]
        assert plain == [c] * 16  # (else the words below need another choice)
        words = [(c, c)]
        for a, b in [(1, 4), (5, 7), (9, 10)][: i % 3 + 1]:
            words.append(tuple(reference(model, prompt, params(words))[a:b]))
        # a word of the prompt's last token and the output's first bans nothing: words are
        # matched against the output only
        words.append((prompt[-1], c))
        out.append(params(words))
        want.append(reference(model, prompt, out[-1]))
        assert want[-1][0] == c or (c,) in words
    return out, want


@pytest.mark.parametrize("setup", ["whole", "chunked", "preempted", "async", "pipeline"])
def test_bad_words_hold_across_chunking_preemption_async_scheduling_and_pipelines(
        tiny_model_dir, cases, setup):
    from fluidserve.engine.llm import LLM

    params, want = cases
    kw = {"whole": dict(token_budget=4096),
          "chunked": dict(token_budget=5, block_size=8),
          "preempted": dict(token_budget=32, block_size=8, num_kv_blocks=7),
          "async": dict(token_budget=7, async_scheduling=True),
          "pipeline": dict(token_budget=9, pipeline_parallel_size=2, num_threads=1)}[setup]
    with LLM(model=str(tiny_model_dir), **kw) as llm:
        got = [o.token_ids for o in llm.generate(PROMPTS, params)]
        if setup == "preempted":
            assert llm.engine.scheduler.num_preemptions > 0
    assert got == want
    for out, p in zip(got, params, strict=True):
        for w in p.bad_words_token_ids[:-1]:
            assert all(tuple(out[i:i + len(w)]) != w for i in range(len(out)))


def test_seeded_samples_avoid_their_words_and_do_not_depend_on_async_scheduling(
        tiny_model_dir):
    from fluidserve.engine.llm import LLM

    p = [SamplingParams(max_tokens=24, temperature=1.5, seed=s, ignore_eos=True)
         for s in range(4)]
    with LLM(model=str(tiny_model_dir)) as llm:
        free = [o.token_ids for o in llm.generate(PROMPTS, p)]
    banned = [SamplingParams(max_tokens=24, temperature=1.5, seed=s, ignore_eos=True,
                             bad_words_token_ids=(tuple(f[2:4]), (f[5],)))
              for s, f in enumerate(free)]
    outs = []
    for asyn in (False, True):
        with LLM(model=str(tiny_model_dir), async_scheduling=asyn) as llm:
            outs.append([o.token_ids for o in llm.generate(PROMPTS, banned)])
    assert outs[0] == outs[1]
    for out, q in zip(outs[0], banned, strict=True):
        for w in q.bad_words_token_ids:
            assert all(tuple(out[i:i + len(w)]) != w for i in range(len(out)))


def test_text_bad_words_are_tokenized_by_the_engine(tiny_model_dir):
    from fluidserve.engine.llm import LLM
    from fluidserve.model.tokenizer import Tokenizer

    tok = Tokenizer(tiny_model_dir)
    with LLM(model=str(tiny_model_dir)) as llm:
        plain = llm.generate("Once upon a time", SamplingParams(
            max_tokens=12, temperature=0.0, ignore_eos=True))[0]
        word = tok.decode(plain.token_ids[2:4]).strip() or "x"
        got = llm.generate("Once upon a time", SamplingParams(
            max_tokens=12, temperature=0.0, ignore_eos=True, bad_words=(word,)))[0]
    for w in tok.bad_words_ids([word]):
        assert all(tuple(got.token_ids[i:i + len(w)]) != w for i in range(12))
    assert got.token_ids != plain.token_ids


def test_the_core_refuses_untokenized_or_out_of_vocabulary_words(tiny_model_dir):
    from fluidserve.config import EngineConfig
    from fluidserve.core.scheduler import RequestRejected
    from fluidserve.engine.engine import LLMEngine
    from fluidserve.engine.messages import AddRequest

    eng = LLMEngine(EngineConfig.create(model=str(tiny_model_dir)))
    with pytest.raises(RequestRejected, match="front end"):
        eng.core.add(AddRequest("a", [1, 2], SamplingParams(bad_words=("x",)), None, None))
    vocab = eng.core.vocab_size
    with pytest.raises(RequestRejected, match=r"bad_words_token_ids must be in \[0"):
        eng.add_request("b", [1, 2], SamplingParams(bad_words_token_ids=((1, vocab),)))
    eng.add_request("c", [1, 2], SamplingParams(bad_words_token_ids=((1, vocab - 1),)))


def test_disaggregated_instances_keep_the_words_out_across_the_hand_off(tiny_model_dir, cases):
    """The prefill instance samples the first token, a decode instance the rest: both ban."""
    from fluidserve.config import EngineConfig
    from fluidserve.disagg.cluster import Cluster
    from fluidserve.disagg.transfer import LocalKVMover
    from fluidserve.engine.messages import AddRequest
    from fluidserve.model.runner import ModelExecutor

    params, want = cases
    eng = EngineConfig.create(model=str(tiny_model_dir), disaggregate=True, block_size=8,
                              num_decode_instances=2, prefill_chunk_size=8)
    cluster = Cluster(eng, lambda clock: ModelExecutor(tiny_model_dir, block_size=8,
                                                       num_blocks=64),
                      kv_bytes_per_token=1024, bandwidth_gbps=10.0, mover=LocalKVMover())
    res = cluster.run([(0.001 * i, AddRequest(str(i), prompt, p), p.max_tokens)
                       for i, (prompt, p) in enumerate(zip(PROMPTS, params, strict=True))])
    assert [res.requests[str(i)].output_token_ids for i in range(len(PROMPTS))] == want


def test_copies_share_what_the_long_token_lists_derive_until_a_list_changes():
    """The samples of n are copies with other seeds: they reuse the normalized lists, the
    allowed-token array and masks and the word index instead of rebuilding them."""
    from dataclasses import replace

    p = SamplingParams(allowed_token_ids=[9, 3, 3, 7], bad_words_token_ids=[(1, 2), (1, 2)])
    q = replace(p, seed=5)
    assert q.token_lists is p.token_lists and q.bad_after is p.bad_after
    assert p.allowed_token_ids == (3, 7, 9) and p.bad_words_token_ids == ((1, 2),)
    assert q.allowed_mask(12) is p.allowed_mask(12)
    r = replace(p, bad_words_token_ids=((4,),))
    assert r.allowed_array is p.allowed_array and r.bad_single == (4,) and p.bad_single == ()
    s = replace(p, allowed_token_ids=(1,))
    assert s.allowed_token_ids == (1,) and s.bad_after is p.bad_after
    assert s.allowed_mask(12).sum() == 1 and p.allowed_mask(12).sum() == 3
    with pytest.raises(ValueError, match="allowed_token_ids"):
        replace(p, allowed_token_ids=())
    free = replace(p, allowed_token_ids=None)
    assert free.allowed_token_ids is None and free.allowed_array is None
    assert free.bad_after is p.bad_after and replace(p, bad_words_token_ids=()).bad_after == {}
