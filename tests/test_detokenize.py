"""The text a client sees, on a SentencePiece-style tokenizer (Llama 2, Mistral): a word's
leading space belongs to its token and the decoder strips it from the first token decoded."""

from __future__ import annotations

import json

import pytest

from fluidserve.engine.messages import RequestDelta
from fluidserve.engine.output import OutputProcessor
from fluidserve.model.tokenizer import IncrementalDetokenizer, Tokenizer
from fluidserve.sampling_params import SamplingParams

WORDS = ["<unk>", "<s>", "</s>", "▁The", "▁king", "▁said", "▁the", "▁lord", "▁is", "▁here",
         "▁x", "▁!=", "▁y", "▁,", "▁?"]


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Tokenizer:
    from tokenizers import Tokenizer as Fast
    from tokenizers import decoders, models, pre_tokenizers

    t = Fast(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    t.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    t.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    d = tmp_path_factory.mktemp("sp")
    t.save(str(d / "tokenizer.json"))
    # As Llama 3's files ask (and transformers would honour, but a server must not).
    (d / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
        "unk_token": "<unk>", "clean_up_tokenization_spaces": True}))
    return Tokenizer(d)


def stream(tok: Tokenizer, prompt: str, output: str, **params) -> tuple[str, str | None]:
    """The text and finish reason the front end makes of ``output``'s tokens, one a step."""
    ids = tok.encode(prompt + output, add_special_tokens=False)
    n = len(tok.encode(prompt, add_special_tokens=False))
    proc = OutputProcessor(tok)
    proc.add("r", SamplingParams(max_tokens=len(ids) - n, **params), ids[:n])
    text, reason = "", None
    for i, t in enumerate(ids[n:]):
        last = i == len(ids) - n - 1
        out, _ = proc.process(RequestDelta("r", [t], "length" if last else None))
        if out is None:
            break
        text += out.new_text
        reason = out.finish_reason
        if out.finished:
            break
    return text, reason


def test_the_first_output_token_keeps_its_leading_space(tok):
    """Decoded alone, the first token lost its space ('The king said' + 'the lord'); decoded
    after the prompt's last tokens, as vLLM does, it keeps it, and stop strings see it."""
    assert stream(tok, "The king said", " the lord is here") == (" the lord is here", "length")
    assert stream(tok, "The king said", " the lord is here", stop=(" the",)) == ("", "stop")
    assert stream(tok, "", "The king said") == ("The king said", "length")  # no prompt


def test_decoding_never_cleans_up_tokenization_spaces(tok):
    ids = tok.encode("x != y , the ?", add_special_tokens=False)
    assert tok.decode(ids) == "x != y , the ?"
    det = IncrementalDetokenizer(tok)
    for t in ids:
        det.push([t])
    assert det.text == "x != y , the ?"
