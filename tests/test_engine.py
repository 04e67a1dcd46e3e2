"""Engine on a real (tiny, random-weight) model: greedy equivalence, preemption, sampling."""

from __future__ import annotations

import json

import pytest

from fluidserve.config import SCHEDULERS
from fluidserve.engine.llm import LLM
from fluidserve.sampling_params import SamplingParams

PROMPTS = [
    "The river rose slowly in the spring, and the people of the valley moved their goats to the"
    " higher fields. Every morning the baker opened her shop before the sun came over the hills.",
    "Hi",
    "A good teacher explains a hard idea twice: once in words and once with a picture.",
    "Computers follow instructions one after another, very quickly. A program is a list of such"
    " instructions, written so that people can read it and machines can run it. Good programs"
    " are short, clear and honest about what they do. They check their inputs.",
    "Why is the sky blue?",
]
MAX_TOKENS = [12, 20, 7, 16, 9]


def greedy(i: int) -> SamplingParams:
    return SamplingParams(max_tokens=MAX_TOKENS[i], temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    llm = LLM(model=str(tiny_model_dir), scheduler="sarathi", token_budget=4096)
    outs = llm.generate(PROMPTS, [greedy(i) for i in range(len(PROMPTS))])
    return [o.token_ids for o in outs]


@pytest.mark.parametrize("scheduler", SCHEDULERS)
@pytest.mark.parametrize("budget", [8, 37, 512])
def test_greedy_outputs_identical_across_schedulers_and_budgets(
    tiny_model_dir, reference, scheduler, budget
):
    llm = LLM(model=str(tiny_model_dir), scheduler=scheduler, token_budget=budget, block_size=8)
    outs = llm.generate(PROMPTS, [greedy(i) for i in range(len(PROMPTS))])
    assert [o.token_ids for o in outs] == reference
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks


def test_greedy_independent_of_batch_mix(tiny_model_dir, reference):
    llm = LLM(model=str(tiny_model_dir), token_budget=16)
    alone = [llm.generate(p, greedy(i))[0].token_ids for i, p in enumerate(PROMPTS)]
    assert alone == reference


def test_preemption_under_tiny_kv_cache_loses_nothing(tiny_model_dir, reference):
    # 10 blocks of 8 tokens: far less than the 5 requests need together.
    llm = LLM(model=str(tiny_model_dir), token_budget=32, block_size=8, num_kv_blocks=10)
    outs = llm.generate(PROMPTS, [greedy(i) for i in range(len(PROMPTS))])
    assert llm.engine.scheduler.num_preemptions > 0
    assert [o.token_ids for o in outs] == reference
    assert all(o.finish_reason == "length" for o in outs)


def test_seeded_sampling_is_reproducible_and_schedule_independent(tiny_model_dir):
    params = [
        SamplingParams(
            max_tokens=15, temperature=0.9, top_p=0.9, top_k=50, seed=100 + i, ignore_eos=True
        )
        for i in range(len(PROMPTS))
    ]
    a = LLM(model=str(tiny_model_dir), scheduler="sarathi", token_budget=8)
    b = LLM(
        model=str(tiny_model_dir),
        scheduler="vllm",
        token_budget=512,
        num_kv_blocks=20,
        block_size=8,
    )
    out_a = [o.token_ids for o in a.generate(PROMPTS, params)]
    out_b = [o.token_ids for o in b.generate(PROMPTS, params)]
    assert out_a == out_b
    other = a.generate(
        PROMPTS[0], SamplingParams(max_tokens=15, temperature=0.9, seed=7, ignore_eos=True)
    )[0].token_ids
    assert other != out_a[0]


def test_n_samples_offline_are_each_seed_plus_j_and_read_as_vllms_outputs(tiny_model_dir):
    """SamplingParams(n=3): the output's ``outputs`` are the three samples, this output first
    (``generate(...)[i].outputs[0].text``, as vLLM's RequestOutput reads); sample j is the
    one a request of seed + j draws."""
    llm = LLM(model=str(tiny_model_dir))
    base = dict(max_tokens=10, temperature=1.2, ignore_eos=True)
    outs = llm.generate(["Once upon a time", PROMPTS[1]], [
        SamplingParams(**base, seed=7, n=3), SamplingParams(**base, seed=2**63 - 1, n=2)])
    alone = llm.generate(["Once upon a time"] * 3 + [PROMPTS[1]] * 2, [
        SamplingParams(**base, seed=s) for s in (7, 8, 9, 2**63 - 1, -2**63)])
    got = [o for out in outs for o in out.outputs]
    assert [o.token_ids for o in got] == [o.token_ids for o in alone]
    assert [o.index for o in got] == [0, 1, 2, 0, 1] and outs[0].outputs[0] is outs[0]
    assert outs[0].prompt == "Once upon a time" and outs[1].prompt == PROMPTS[1]
    assert llm.generate([[1, 5, 6]], SamplingParams(max_tokens=2))[0].prompt is None
    assert len({tuple(o.token_ids) for o in outs[0].outputs}) == 3
    assert llm.generate(PROMPTS[0], SamplingParams(max_tokens=4))[0].outputs[0].samples == []
    from fluidserve.core.scheduler import RequestRejected
    with pytest.raises(RequestRejected, match="one sample"):
        llm.engine.add_request("direct", PROMPTS[0], SamplingParams(n=2))
    with pytest.raises(ValueError, match="n must be"):
        SamplingParams(n=0)


def test_chat_and_vllms_dict_prompts_offline(tiny_model_dir):
    """LLM.chat renders as the server's chat endpoint does (one conversation or several);
    generate takes vLLM's {"prompt": ...} and {"prompt_token_ids": ...} prompts."""
    llm = LLM(model=str(tiny_model_dir))
    greedy4 = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    talk = [{"role": "user", "content": "Who goes there?"}]
    more = talk + [{"role": "assistant", "content": "A friend"}]
    ids = [llm.tokenizer.chat(talk),
           llm.tokenizer.chat(more, add_generation_prompt=False, continue_final_message=True)]
    want = [o.token_ids for o in llm.generate(ids, greedy4)]
    assert llm.chat(talk, greedy4)[0].token_ids == want[0]
    got = llm.chat([more], greedy4, add_generation_prompt=False, continue_final_message=True)
    assert got[0].token_ids == want[1]
    with pytest.raises(ValueError, match="add_generation_prompt"):
        llm.chat(more, greedy4, continue_final_message=True)
    both = llm.generate([{"prompt": "Hi"}, {"prompt_token_ids": ids[0]}], greedy4)
    assert both[0].token_ids == llm.generate("Hi", greedy4)[0].token_ids
    assert both[1].token_ids == want[0] and both[0].prompt == "Hi"
    with pytest.raises(ValueError, match="either"):
        llm.generate({"prompt": "Hi", "prompt_token_ids": [1]})


def test_top_k_one_is_greedy(tiny_model_dir, reference):
    llm = LLM(model=str(tiny_model_dir))
    out = llm.generate(
        PROMPTS[0], SamplingParams(max_tokens=12, temperature=1.5, top_k=1, ignore_eos=True)
    )
    assert out[0].token_ids == reference[0]


def test_stop_strings_and_stop_tokens(tiny_model_dir, reference):
    llm = LLM(model=str(tiny_model_dir))
    full = llm.generate(PROMPTS[1], greedy(1))[0]
    # Stop on a string that appears in the greedy text: output ends right before it.
    word = full.text.strip().split()[1] if len(full.text.split()) > 1 else full.text[2:5]
    cut = llm.generate(
        PROMPTS[1], SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, stop=(word,))
    )[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == word
    assert cut.text == full.text[: full.text.find(word)]
    tok = reference[1][3]
    by_id = llm.generate(
        PROMPTS[1], SamplingParams(max_tokens=20, temperature=0.0, stop_token_ids=(tok,))
    )[0]
    assert by_id.finish_reason == "stop" and by_id.stop_reason == tok
    assert by_id.token_ids == reference[1][: reference[1].index(tok) + 1]
    # The stop token counts but, as in vLLM, its text is not part of the output.
    assert by_id.text == llm.tokenizer.decode(reference[1][: reference[1].index(tok)])
    # The last allowed token, a stop token: a stop all the same (vLLM checks it first).
    n = reference[1].index(tok) + 1
    last = llm.generate(PROMPTS[1], SamplingParams(max_tokens=n, temperature=0.0,
                                                   stop_token_ids=(tok,)))[0]
    assert (last.finish_reason, last.stop_reason, last.text) == ("stop", tok, by_id.text)
    assert full.stop_reason is None
    eos = llm.tokenizer.eos_token_id
    both = llm.generate(PROMPTS[1], SamplingParams(max_tokens=3, temperature=0.0,
                                                   allowed_token_ids=[eos],
                                                   stop_token_ids=(eos,)))[0]
    assert both.finish_reason == "stop" and both.stop_reason is None  # EOS comes first


def test_min_tokens_holds_stop_strings_off_without_matching_them_later(tiny_model_dir):
    """A stop string only matches after min_tokens tokens, and only where it takes in the
    newest text: an occurrence inside the first min_tokens tokens neither ends the request
    when min_tokens is reached nor leaks, cut, into the output (as in vLLM)."""
    llm = LLM(model=str(tiny_model_dir))
    decode = llm.tokenizer.decode
    base = dict(max_tokens=24, temperature=0.0, ignore_eos=True)
    ids = llm.generate(PROMPTS[1], SamplingParams(**base))[0].token_ids
    stop = decode(ids)[:2]  # it occurs at once, in the first token or two

    def expected(min_tokens: int) -> tuple[str, int]:
        for n in range(min_tokens + 1, len(ids) + 1):
            text, before = decode(ids[:n]), len(decode(ids[: n - 1]))
            i = text.find(stop, max(0, before - len(stop) + 1))
            if i >= 0:
                return text[:i], n
        return decode(ids), len(ids)

    cases = (0, 1, 2, 5)
    outs = llm.generate([PROMPTS[1]] * len(cases),
                        [SamplingParams(**base, stop=(stop,), min_tokens=m) for m in cases])
    assert outs[0].text == "" and outs[0].finish_reason == "stop"
    for m, out in zip(cases, outs, strict=True):
        want_text, want_n = expected(m)
        assert (out.text, len(out.token_ids)) == (want_text, want_n), m
        assert out.finish_reason == ("stop" if want_n < len(ids) else "length")


def test_model_eos_ends_a_request_unless_ignored(tiny_model_dir, reference):
    llm = LLM(model=str(tiny_model_dir))
    eos = llm.tokenizer.eos_token_id
    llm.engine.core.force_eos_at = frozenset({3, 6})  # the model "says" EOS twice
    base = dict(max_tokens=10, temperature=0.0)
    stop, ignored, min3, min4 = llm.generate(
        [PROMPTS[2]] * 4,
        [SamplingParams(**base), SamplingParams(**base, ignore_eos=True),
         SamplingParams(**base, min_tokens=3), SamplingParams(**base, min_tokens=4)],
    )
    assert stop.finish_reason == "stop" and stop.token_ids == reference[2][:3] + [eos]
    assert stop.text == llm.tokenizer.decode(reference[2][:3])  # EOS adds no text
    assert ignored.finish_reason == "length" and len(ignored.token_ids) == 10
    assert ignored.token_ids[3] == ignored.token_ids[6] == eos
    # The first min_tokens tokens cannot stop a request (as in vLLM): EOS as the 4th token
    # ends one with min_tokens 3, not one with 4, which the EOS as the 7th ends.
    assert min3.finish_reason == "stop" and min3.token_ids == stop.token_ids
    assert min4.finish_reason == "stop" and len(min4.token_ids) == 7
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks


def test_every_end_of_sequence_the_model_declares_ends_a_request(tiny_model_dir, reference,
                                                                  tmp_path):
    """generation_config.json may declare more EOS ids than the tokenizer's one (Llama 3.1
    Instruct: three); each ends a request, as in vLLM and transformers."""
    import shutil

    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    said = reference[1][-1]  # the token the model turns to after a few others
    eos = json.loads((model / "config.json").read_text())["eos_token_id"]
    (model / "generation_config.json").write_text(json.dumps({"eos_token_id": [eos, said]}))
    llm = LLM(model=str(model))
    base = dict(max_tokens=MAX_TOKENS[1], temperature=0.0)
    stop, ignored = llm.generate([PROMPTS[1]] * 2, [SamplingParams(**base),
                                                    SamplingParams(**base, ignore_eos=True)])
    end = reference[1].index(said) + 1
    assert 1 < end < MAX_TOKENS[1]
    assert stop.finish_reason == "stop" and stop.token_ids == reference[1][:end]
    assert stop.text == llm.tokenizer.decode(reference[1][:end - 1])  # its text is not output
    assert ignored.finish_reason == "length" and ignored.token_ids == reference[1]


def test_prompt_too_long_is_rejected(tiny_model_dir):
    llm = LLM(model=str(tiny_model_dir), max_model_len=64)
    with pytest.raises(ValueError, match="context window"):
        llm.generate("word " * 80, SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="token ids"):
        llm.generate([[1, 2, 10**9]], SamplingParams(max_tokens=4))
    # A bad prompt among good ones: the ones before it are not left running, and the next
    # call is served as if nothing had happened (vLLM aborts them too).
    params = SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.0)
    with pytest.raises(ValueError, match="context window"):
        llm.generate(["Hello", "Hi there", "word " * 80, "Hi"], params)
    assert not llm.engine.has_unfinished()
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    out = llm.generate(["Hi there"], params)
    assert out[0].token_ids and out[0].finish_reason == "length"


def test_a_context_window_beyond_the_models_is_refused(tiny_model_dir):
    from fluidserve.config import ConfigError

    with pytest.raises(ConfigError, match="--max-model-len 4096 is longer than the model's"
                                          " context window .max_position_embeddings 2048"):
        LLM(model=str(tiny_model_dir), max_model_len=4096)


def test_telemetry_records_tokens_and_iterations(tiny_model_dir, tmp_path):
    llm = LLM(model=str(tiny_model_dir), token_budget=16)
    outs = llm.generate(PROMPTS[:3], [greedy(i) for i in range(3)])
    tel = llm.engine.telemetry
    assert len(tel.tokens) == sum(len(o.token_ids) for o in outs)
    # The most recent records only: an offline engine that runs for days stays bounded.
    assert tel.tokens.maxlen == tel.iterations.maxlen == tel.finished.maxlen == 100_000
    assert all(r.num_prefill_tokens + r.num_decode_tokens <= 16 for r in tel.iterations)
    assert sum(r.num_prefill_tokens for r in tel.iterations) == sum(
        len(o.prompt_token_ids) for o in outs
    )
    # cost-model features: chunks attend to themselves and (after the first) to their prefix
    assert all(r.sq_work <= r.num_prefill_tokens**2 for r in tel.iterations)
    assert any(r.sq_work for r in tel.iterations) and any(r.prefix_work for r in tel.iterations)
    # one-token runs: their count, longest and summed context (prompts of different lengths)
    assert any(r.num_single > 1 for r in tel.iterations)
    for r in tel.iterations:
        assert r.single_ctx_max <= r.single_ctx_sum <= r.num_single * r.single_ctx_max
    assert any(r.single_ctx_sum < r.num_single * r.single_ctx_max for r in tel.iterations)
    for o in outs:
        m = o.metrics
        assert m.ttft > 0 and len(m.tbt) == len(o.token_ids) - 1 and m.scheduling_delay >= 0
    path = tmp_path / "t.jsonl"
    tel.export_jsonl(path)
    kinds = {json.loads(line)["type"] for line in path.read_text().splitlines()}
    assert kinds == {"iteration", "token", "request"}


def test_executor_failure_fails_the_batch_and_engine_keeps_serving(tiny_model_dir):
    llm = LLM(model=str(tiny_model_dir))
    real = llm.engine.executor.execute
    llm.engine.executor.execute = lambda plan: (_ for _ in ()).throw(RuntimeError("boom"))
    bad = llm.generate("Hello", SamplingParams(max_tokens=3))[0]
    assert bad.finish_reason == "error" and "boom" in bad.error
    llm.engine.executor.execute = real
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks
    good = llm.generate("Hello", SamplingParams(max_tokens=3, ignore_eos=True))[0]
    assert good.finish_reason == "length" and len(good.token_ids) == 3


def test_engine_core_freezes_its_startup_heap_before_serving(tiny_model_dir, monkeypatch):
    """A full collection in the engine core walks the whole heap (the model, the tokenizer):
    ~110 ms for the race model, every running stream stalled for it. The core freezes what
    start-up left alive before its first iteration, so collections only see the newer."""
    import gc
    import multiprocessing as mp

    from fluidserve.config import EngineConfig
    from fluidserve.engine import core_proc
    from fluidserve.engine.messages import CoreReady

    seen = {}
    monkeypatch.setattr(core_proc, "ignore_group_signals", lambda: None)
    monkeypatch.setattr(core_proc, "_busy_loop",
                        lambda *a: seen.setdefault("frozen", gc.get_freeze_count()))
    inbox, _ = mp.Pipe(duplex=False)
    got, outbox = mp.Pipe(duplex=False)
    gc.unfreeze()
    try:
        core_proc.run_engine_core(EngineConfig.create(model=str(tiny_model_dir), num_threads=1),
                                  inbox, outbox, None, None)
        assert isinstance(got.recv(), CoreReady)
        assert seen["frozen"] > 1000  # the loaded model's and libraries' objects
    finally:
        gc.unfreeze()


def test_a_memory_sized_kv_cache_holds_no_more_than_the_sequences_can_fill():
    """--kv-cache-memory-gb sizes the cache, capped at what --max-num-seqs sequences of the
    context window can fill with the watermark kept free; every such sequence still fits."""
    from fluidserve.config import EngineConfig
    from fluidserve.core.block_manager import BlockManager
    from fluidserve.engine.engine import build_model_executor
    from fluidserve.model.arch import read_arch
    from fluidserve.model.builder import default_model_dir
    from fluidserve.model.worker import kv_cache_blocks

    arch = read_arch(default_model_dir())  # 1,024-token context
    assert kv_cache_blocks(arch, "bfloat16", 16, 1.0) == 21845  # memory alone
    capped = kv_cache_blocks(arch, "bfloat16", 16, 1.0, max_seqs=128, max_len=1024,
                             watermark=0.01)
    assert 8192 < capped < 8400
    bm = BlockManager(capped, 16, 0.01)
    for i in range(128):  # each admitted (watermark kept), then grown to the whole window
        assert bm.can_allocate(str(i), 16, admit=True) and bm.allocate(str(i), 16)
        assert bm.allocate(str(i), 1024)
    assert kv_cache_blocks(arch, "bfloat16", 16, 0.1, max_seqs=128, max_len=1024) == 2184
    ex, _ = build_model_executor(EngineConfig.create(max_num_seqs=4, num_threads=1))
    assert ex.num_blocks == kv_cache_blocks(arch, "bfloat16", 16, 1.0, max_seqs=4,
                                            max_len=1024, watermark=0.01) < 300
