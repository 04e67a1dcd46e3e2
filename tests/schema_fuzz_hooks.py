"""Schemathesis hooks for the schema fuzz run (loaded with SCHEMATHESIS_HOOKS).

One rule of the API cannot be written in JSON Schema: the prompt, once tokenized, plus
max_tokens must fit the context window. A schema-valid request that breaks it gets 400 with
code ``context_length_exceeded`` (documented on the route). ``positive_data_acceptance`` is run
as is for every other response; for that one answer it is replaced by checking that the error
really is that one, and nothing else.
"""

from __future__ import annotations

import json

import schemathesis
from schemathesis.specs.openapi.checks import positive_data_acceptance

CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"


def _error_code(response) -> str | None:
    try:
        return json.loads(response.content)["error"]["code"]
    except (ValueError, KeyError, TypeError):
        return None


@schemathesis.check
def positive_data_acceptance_but_context_window(ctx, response, case):
    if response.status_code == 400 and _error_code(response) == CONTEXT_LENGTH_EXCEEDED:
        return None
    return positive_data_acceptance(ctx, response, case)
