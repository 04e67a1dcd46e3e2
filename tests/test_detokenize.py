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
    # As Llama 3's files ask (and transformers would honour, but a server must not).
    return Tokenizer(word_level_files(tmp_path_factory.mktemp("sp"),
                                      clean_up_tokenization_spaces=True))


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



def test_chat_template_variables_reach_the_template_and_reserved_names_do_not(tmp_path):
    """chat_template_kwargs are the template's variables; a name of the rendering's own
    parameters is refused (the server's schema names the same ones)."""
    from fluidserve.model.tokenizer import TemplateKwargsError, chat_template_parameters
    from fluidserve.serve.protocol import RESERVED_TEMPLATE_NAMES

    tok = Tokenizer(word_level_files(tmp_path, chat_template=(
        "{% for m in messages %}{{ m['content'] }}{% endfor %}{% if shout %} here{% endif %}")))
    messages = [{"role": "user", "content": "the king"}]
    assert tok.hf.decode(tok.chat(messages)) == "the king"
    assert tok.hf.decode(tok.chat(messages, template_kwargs={"shout": True})) \
        == "the king here"
    for name in ("tokenize", "messages", "return_tensors"):
        with pytest.raises(TemplateKwargsError, match=name):
            tok.chat(messages, template_kwargs={name: 1})
    assert RESERVED_TEMPLATE_NAMES == chat_template_parameters()


def word_level_files(d, **config):
    """A word-level tokenizer's files over ``WORDS``, written into ``d`` (``config``: more
    of its tokenizer_config.json)."""
    from tokenizers import Tokenizer as Fast
    from tokenizers import decoders, models, pre_tokenizers

    t = Fast(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    t.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    t.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    t.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
        "unk_token": "<unk>", **config}))
    return d
