"""Schemathesis hooks for the schema fuzz run (loaded with SCHEMATHESIS_HOOKS).

Three rules of the API cannot be written in JSON Schema. The prompt, once tokenized, must
leave the context window a token to generate (a max_tokens beyond what the window leaves
is cut to it),
and the request must fit the KV cache: a schema-valid request that breaks either gets 400
with code ``context_length_exceeded``. And min_tokens may not exceed the max_tokens in force,
the one given (cut to what the window leaves) or its default (16 for completions; for chat,
what the window leaves after the prompt): above it, 400 with param ``min_tokens`` naming
both. And a completion's prompts × n may not exceed the requests the server lets wait (each
alone is bounded by the schema): above it, 400 with param ``n``. All three are documented on
the route. ``positive_data_acceptance`` is run as is for every other response; for those three
answers it is replaced by checking that the error really is that one, and nothing else.
"""

from __future__ import annotations

import json
import re

import schemathesis
from schemathesis.specs.openapi.checks import positive_data_acceptance

CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"


COMPLETIONS_DEFAULT_MAX_TOKENS = 16


def _error(response) -> dict:
    try:
        error = json.loads(response.content)["error"]
    except (ValueError, KeyError, TypeError):
        return {}
    return error if isinstance(error, dict) else {}


def _min_tokens_above_max_tokens(error: dict, case) -> bool:
    """The error is the min_tokens one, and the request's own fields bear it out: its
    min_tokens above the max_tokens the message names, which is the one given if any. (JSON
    Schema integers include 308.0, which the server takes as 308.)"""
    body = case.body if isinstance(case.body, dict) else {}
    named = re.search(r"which is (\d+)", str(error.get("message", "")))
    asked = body.get("min_tokens")
    if (error.get("param") != "min_tokens" or named is None or isinstance(asked, bool)
            or not isinstance(asked, (int, float))):
        return False
    in_force = int(named.group(1))
    chat = case.path.endswith("/chat/completions")
    given = body.get("max_completion_tokens") if chat else None
    given = body.get("max_tokens") if given is None else given
    if given is not None:  # (cut to what the window leaves)
        return in_force <= given and asked > in_force
    return asked > in_force and (chat or in_force <= COMPLETIONS_DEFAULT_MAX_TOKENS)


def _too_many_choices(error: dict, case) -> bool:
    """The error is the choices one, and the request's prompts × n bear it out (each is
    within its own bound, which the schema states)."""
    body = case.body if isinstance(case.body, dict) else {}
    named = re.search(r"^(\d+) choices \(prompts × n\).* at most (\d+)",
                      str(error.get("message", "")))
    prompt, n = body.get("prompt"), body.get("n") or 1
    prompts = len(prompt) if isinstance(prompt, list) and prompt and isinstance(
        prompt[0], str | list) else 1
    return error.get("param") == "n" and named is not None \
        and int(named.group(1)) == prompts * n > int(named.group(2))


@schemathesis.check
def positive_data_acceptance_but_unwritable_rules(ctx, response, case):
    if response.status_code == 400:
        error = _error(response)
        if error.get("code") == CONTEXT_LENGTH_EXCEEDED or _min_tokens_above_max_tokens(
                error, case) or _too_many_choices(error, case):
            return None
    return positive_data_acceptance(ctx, response, case)
