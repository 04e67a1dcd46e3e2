"""Tokenizer access (Hugging Face tokenizer files) and incremental detokenization."""

from __future__ import annotations

from collections.abc import Sequence
from functools import cache
from pathlib import Path

from fluidserve.model.arch import ModelLoadError

# Used when a tokenizer has no chat template of its own.
DEFAULT_CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def check_tokenizer_files(path: str | Path) -> None:
    """Raise ModelLoadError unless ``path`` has tokenizer files (cheap: no transformers)."""
    path = Path(path)
    if not path.is_dir():
        raise ModelLoadError(f"{path}: no such directory")
    if not (path / "tokenizer.json").is_file() and not (path / "tokenizer.model").is_file():
        raise ModelLoadError(f"{path}: no tokenizer files (tokenizer.json or tokenizer.model)")


# Tokenizers that AutoTokenizer loads as the plain ``tokenizer.json`` backend: the declared
# class (tokenizer_config.json) is the generic fast tokenizer, and the model type
# (config.json) is one for which transformers does not substitute a class of its own (for
# qwen2 it does). tests/test_loader.py checks the two loads agree.
GENERIC_TOKENIZER_CLASSES = ("PreTrainedTokenizerFast", "TokenizersBackend")
GENERIC_TOKENIZER_MODEL_TYPES = ("llama",)


def _read_json(path: Path) -> dict:
    import json

    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def loads_directly(path: Path) -> bool:
    """Whether ``path``'s tokenizer is the generic fast one, loaded without AutoTokenizer.

    AutoTokenizer first loads the model's config through transformers' modelling code, which
    imports torch and torch.distributed (~4 s and a few hundred MB on these machines, in a
    front end that otherwise never imports torch); for these tokenizers it then loads the
    generic class anyway. Anything else (another class, remote code, another model type)
    goes through AutoTokenizer."""
    tok_cfg = _read_json(path / "tokenizer_config.json")
    return (tok_cfg.get("tokenizer_class") in GENERIC_TOKENIZER_CLASSES
            and "auto_map" not in tok_cfg and (path / "tokenizer.json").is_file()
            and _read_json(path / "config.json").get("model_type")
            in GENERIC_TOKENIZER_MODEL_TYPES)


class Tokenizer:
    def __init__(self, path: str | Path) -> None:
        path = Path(path)
        check_tokenizer_files(path)
        if loads_directly(path):
            from transformers import PreTrainedTokenizerFast as cls
        else:
            from transformers import AutoTokenizer as cls
        try:
            self.hf = cls.from_pretrained(str(path), local_files_only=True)
        except Exception as e:  # transformers raises many types for broken files
            raise ModelLoadError(f"{path}: cannot load tokenizer ({e})") from None
        self.eos_token_id: int | None = self.hf.eos_token_id
        self.has_chat_template = bool(getattr(self.hf, "chat_template", None))

    def __len__(self) -> int:
        return len(self.hf)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def encode_many(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        """``encode`` of each text, in one call (a fast tokenizer's batch)."""
        return [list(ids) for ids in self.hf(texts, add_special_tokens=add_special_tokens)[
            "input_ids"]]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        # Never "clean up tokenization spaces" (Llama 3's tokenizer_config.json asks for it):
        # that rewrites " !=" as "!=" and " 's" as "'s" in the model's own text, and applied
        # to each window of an incremental decode it drops characters outright.
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens,
                              clean_up_tokenization_spaces=False)

    def bad_words_ids(self, words: Sequence[str]) -> tuple[tuple[int, ...], ...]:
        """The token sequences of ``bad_words``: each word (its leading spaces dropped) both
        as it is, which bans it at the start of the text, and after a space, which bans it
        within. vLLM keeps the second only when it has as many tokens as the first, which
        lets " the" through where the space merges into one token with the word; here it is
        kept whenever it differs."""
        found: dict[tuple[int, ...], None] = {}
        for word in words:
            if not word.lstrip():
                raise ValueError(f"bad word {word!r} is only spaces")
            for text in (word.lstrip(), " " + word.lstrip()):
                if ids := tuple(self.encode(text, add_special_tokens=False)):
                    found[ids] = None
        return tuple(found)

    def chat(self, messages: list[dict], add_generation_prompt: bool = True,
             continue_final_message: bool = False, template_kwargs: dict | None = None,
             add_special_tokens: bool = False) -> list[int]:
        """Token ids of a conversation rendered with the chat template: ready for a reply
        (``add_generation_prompt``: the assistant's turn opened), or for the last message to
        go on (``continue_final_message``: its turn left open). ``template_kwargs``: more
        variables for the template (``enable_thinking``, ...); a name that is one of
        ``apply_chat_template``'s own parameters is refused (ValueError).
        ``add_special_tokens``: the tokenizer's (BOS) before the text too, as it always
        adds them to the default template's."""
        extra = template_kwargs or {}
        if clash := sorted(set(extra) & chat_template_parameters()):
            raise TemplateKwargsError(
                f"chat_template_kwargs: {', '.join(clash)} would set a parameter of the"
                " template's rendering, not a variable of the template")
        template = None if self.has_chat_template else DEFAULT_CHAT_TEMPLATE
        text = self.hf.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message, chat_template=template, **extra
        )
        # Templates carry their own special tokens (BOS included when they want one).
        return self.encode(text, add_special_tokens=add_special_tokens
                           or not self.has_chat_template)


class TemplateKwargsError(ValueError):
    """A chat template variable that would set one of the rendering's own parameters."""


# What the template's renderer passes itself (a variable of that name would clash).
RENDERER_NAMES = frozenset({"self", "messages", "conversations"})


@cache
def chat_template_parameters() -> frozenset[str]:
    """The names no template variable may have: the named parameters of transformers'
    ``apply_chat_template`` (``tokenize``, ``return_tensors``...) and its renderer's."""
    import inspect

    from transformers import PreTrainedTokenizerBase

    params = inspect.signature(PreTrainedTokenizerBase.apply_chat_template).parameters
    return frozenset(n for n, p in params.items() if p.kind is not p.VAR_KEYWORD) \
        | RENDERER_NAMES


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas.

    A multi-byte character may span tokens; text is only emitted once the tail decodes
    without a replacement character, so deltas concatenate to the full decode. The first
    tokens decode after the end of the prompt (``context``, its last few ids), as in vLLM:
    alone, SentencePiece decoders strip the first token's leading space ("said" + "the"
    where the model wrote "said the").
    """

    CONTEXT = 5  # prompt tokens decoded before the output (vLLM's initial offset)

    def __init__(self, tokenizer: Tokenizer, context: Sequence[int] = (),
                 skip_special_tokens: bool = True) -> None:
        self.tok = tokenizer
        self.skip_special = skip_special_tokens
        self.ids: list[int] = list(context[-self.CONTEXT:]) if context else []
        self.text = ""
        self._prefix = 0  # ids[_prefix:_read] decode to the last few emitted characters
        self._read = len(self.ids)

    def push(self, token_ids: list[int]) -> str:
        self.ids.extend(token_ids)
        prefix_text = self.tok.decode(self.ids[self._prefix : self._read], self.skip_special)
        full = self.tok.decode(self.ids[self._prefix :], self.skip_special)
        if full.endswith("\ufffd") or len(full) <= len(prefix_text):
            return ""
        delta = full[len(prefix_text) :]
        self._prefix, self._read = self._read, len(self.ids)
        self.text += delta
        return delta
