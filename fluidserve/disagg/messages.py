"""The control plane's messages between the front end and served prefill/decode instances.

A request's hand-off, as the front end relays it (the KV itself goes straight from one
instance to the other over the KV transport):

1. the prefill instance prefills the request, samples its first token, predicts its length
   and picks a decode instance: ``Handoff`` (an event in its outputs);
2. the front end sends the request to that decode instance: ``Migrate``;
3. the decode instance admits it (its admission policy), reserves KV blocks and posts a
   receive: ``ReadyToReceive``;
4. the front end tells the prefill instance to send: ``SendKV``;
5. the decode instance has the KV in its cache and decodes from its next iteration:
   ``KVReceived``; the front end tells the prefill instance to free the blocks: ``ReleaseKV``.

A request that fails on either side ends with an error delta as usual; the front end then
aborts it wherever else it is held. With instance flips, the control plane drains an instance
and, once it holds nothing, sends it ``SetRole``.
"""

from __future__ import annotations

from dataclasses import dataclass

from fluidserve.disagg.dispatch import DecodeLoad
from fluidserve.request import Request

# ---------------------------------------------------------------- front end -> instance


@dataclass(frozen=True, slots=True)
class Migrate:
    """To a decode instance: a prefilled request (prompt computed, first token sampled)."""

    request: Request
    predicted_len: int
    src: int  # the prefill instance holding its KV


@dataclass(frozen=True, slots=True)
class SendKV:
    """To a prefill instance: send this request's KV blocks to ``dst`` under ``tag``."""

    request_id: str
    dst: int
    tag: int
    num_blocks: int  # what the receiver posted for, also if the request ended meanwhile


@dataclass(frozen=True, slots=True)
class ReleaseKV:
    """To a prefill instance: the decode instance has the KV; free the blocks."""

    request_id: str


@dataclass(frozen=True, slots=True)
class SetRole:
    """To an instance the control plane drained: change role (an instance flip)."""

    role: str


@dataclass(frozen=True, slots=True)
class Redispatch:
    """To a prefill instance: the decode instance it picked changed role; pick again."""

    request_id: str


@dataclass(frozen=True, slots=True)
class DecodeLoads:
    """To prefill instances: the cluster monitor's broadcast of the decode instances' loads."""

    loads: tuple[DecodeLoad, ...]


# ---------------------------------------------------------------- instance -> front end


@dataclass(frozen=True, slots=True)
class Handoff:
    request: Request
    dst: int
    predicted_len: int


@dataclass(frozen=True, slots=True)
class ReadyToReceive:
    request_id: str
    src: int
    dst: int
    tag: int
    num_blocks: int


@dataclass(frozen=True, slots=True)
class PrefillLoad:
    """A prefill instance's report: prefilled requests waiting for a decode instance."""

    undispatched: int


@dataclass(frozen=True, slots=True)
class KVReceived:
    request_id: str
    src: int
