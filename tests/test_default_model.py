"""The embedded default model: shipped in the package, loaded like any Hugging Face directory,
the same model under transformers, and it ends its answers by itself. Nothing here asserts
on its wording."""

from __future__ import annotations

import json

import pytest
import torch

from fluidserve import LLM, SamplingParams
from fluidserve.model.builder import default_model_dir

PROMPTS = [
    "What news from the court?",
    "Good morrow, friend. Whither goest thou so early?",
    "Tell me, is the king dead?",
    "I love thee not, and yet I cannot leave thee.",
    "Where is my lord?",
    "Come, let us go to supper.",
    "Why dost thou weep?",
    "The night is cold and the wind blows from the sea.",
]


@pytest.fixture(scope="module")
def llm():
    with LLM() as engine:  # no model given: the embedded default
        yield engine


def test_the_default_is_the_shipped_trained_model_within_20_mb(llm):
    d = default_model_dir()
    assert llm.engine.model_dir == str(d)
    assert sum(f.stat().st_size for f in d.iterdir()) <= 20 * 2**20
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["torch_dtype"] == "bfloat16"
    assert llm.tokenizer.eos_token_id == cfg["eos_token_id"]
    assert llm.tokenizer.has_chat_template


def test_runs_in_the_checkpoints_own_dtype_by_default(llm):
    assert llm.config.model.dtype == "auto"
    assert next(llm.engine.executor.model.parameters()).dtype == torch.bfloat16


def test_greedy_tokens_match_transformers():
    """Every token the engine picks greedily is transformers' best next token (up to 1e-3 in
    logit, for near-ties between two float32 implementations)."""
    from transformers import LlamaForCausalLM

    ref = LlamaForCausalLM.from_pretrained(str(default_model_dir()),
                                           torch_dtype=torch.float32).eval()
    with LLM(dtype="float32") as llm:
        chats = [llm.tokenizer.chat([{"role": "user", "content": t}]) for t in PROMPTS[:3]]
        outs = [o.token_ids for o in llm.generate(
            chats, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))]
    for ids, out in zip(chats, outs, strict=True):
        with torch.no_grad():
            logits = ref(torch.tensor([list(ids) + out])).logits[0, len(ids) - 1:-1]
        chosen = logits[torch.arange(len(out)), torch.tensor(out)]
        assert torch.all(chosen >= logits.max(dim=-1).values - 1e-3)


def test_answers_end_by_themselves_at_lengths_that_depend_on_the_prompt(llm):
    tok = llm.tokenizer
    chats = [tok.chat([{"role": "user", "content": p}]) for p in PROMPTS]
    outs = llm.generate(chats, SamplingParams(max_tokens=400, temperature=0))
    stopped = [o for o in outs if o.finish_reason == "stop"]
    assert len(stopped) >= 6, [o.finish_reason for o in outs]
    assert all(o.token_ids[-1] == tok.eos_token_id for o in stopped)
    assert len({len(o.token_ids) for o in stopped}) >= 3  # not one fixed length
    assert all(o.text.strip() for o in outs)  # and each says something
