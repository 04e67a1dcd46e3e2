"""The control plane's messages between the front end and served prefill/decode instances.

A request's hand-off, as the front end relays it (the KV itself goes straight from one
instance to the other over the KV transport):

1. the prefill instance predicts the request's length and picks a decode instance:
   ``Handoff`` (an event in its outputs). With ``--kv-transfer-granularity request`` it does
   so when the prefill has ended (first token sampled); with ``chunk``, as soon as the first
   chunk is computed;
2. the front end sends the request to that decode instance: ``Migrate``;
3. the decode instance admits it (its admission policy), reserves KV blocks for the prompt
   and posts one receive per piece of the KV: ``ReadyToReceive``. A piece is a fixed run of
   blocks (the whole prompt at request granularity; a prefill chunk's worth at chunk
   granularity), so both sides agree on it whatever the prefill instance's batches were;
4. the front end tells the prefill instance to send: ``SendKV``; it sends each piece once
   its tokens are computed (at chunk granularity while the prefill goes on);
5. a request dispatched before its prefill ended: when it ends, ``PrefillDone`` carries the
   request with its first token, relayed as ``Prefilled``;
6. the decode instance has every piece in its cache (and, for an early dispatch, the
   prefilled request) and decodes from its next iteration: ``KVReceived``; the front end
   tells the prefill instance to free the blocks: ``ReleaseKV``.

A request that fails on either side ends with an error delta as usual; the front end then
aborts it wherever else it is held. With instance flips, the control plane drains an instance
and, once it holds nothing, sends it ``SetRole``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from fluidserve.disagg.dispatch import DecodeLoad
from fluidserve.net import boot_id
from fluidserve.request import Request

# A request's timestamps are its instance's monotonic clock. Instances that share a kernel
# share that clock; on other hosts (Ray placement) it counts from another boot, so a
# request crossing over carries its sender's clock (``ClockStamp``) and the receiver moves
# its times onto its own clock (``clock_offset``): the hand-off's transit time is then left
# out of the gap between its first two tokens, where the boot times would be in.
ClockStamp = tuple[str, float]  # (kernel boot id, monotonic time when sent)


def clock_stamp() -> ClockStamp:
    return boot_id(), time.monotonic()


def clock_offset(stamp: ClockStamp | None) -> float:
    """What to add to the sender's times to put them on this process's clock."""
    if stamp is None or stamp[0] == boot_id():
        return 0.0
    return time.monotonic() - stamp[1]

# ---------------------------------------------------------------- front end -> instance


@dataclass(frozen=True, slots=True)
class Migrate:
    """To a decode instance: a request to take over (prompt computed and first token
    sampled, unless ``prefilled`` is False: then ``Prefilled`` follows)."""

    request: Request
    predicted_len: int
    src: int  # the prefill instance holding its KV
    prefilled: bool = True
    stamp: ClockStamp | None = None  # the request's clock (``Handoff.stamp``)


@dataclass(frozen=True, slots=True)
class Prefilled:
    """To a decode instance: the prefill of a request it took early has ended (the request,
    with its first token)."""

    request: Request
    stamp: ClockStamp | None = None


@dataclass(frozen=True, slots=True)
class SendKV:
    """To a prefill instance: send this request's KV blocks to ``dst``, piece ``k`` (blocks
    ``k * piece_blocks`` onwards) under ``tags[k]``."""

    request_id: str
    dst: int
    tags: tuple[int, ...]
    num_blocks: int  # what the receiver posted for, also if the request ended meanwhile
    piece_blocks: int


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
    request: Request  # as it is now: prefilled, or (chunk granularity) still prefilling
    dst: int
    predicted_len: int
    prefilled: bool = True
    stamp: ClockStamp | None = None  # the clock of the request's times


@dataclass(frozen=True, slots=True)
class PrefillDone:
    """A request handed off before its prefill ended has ended it."""

    request: Request
    stamp: ClockStamp | None = None


@dataclass(frozen=True, slots=True)
class ReadyToReceive:
    request_id: str
    src: int
    dst: int
    tags: tuple[int, ...]  # one per piece
    num_blocks: int
    piece_blocks: int


@dataclass(frozen=True, slots=True)
class PrefillLoad:
    """A prefill instance's report: prefilled requests waiting for a decode instance, and the
    prompt tokens it has still to compute (what requests are routed by)."""

    undispatched: int
    queued_tokens: int = 0


@dataclass(frozen=True, slots=True)
class KVReceived:
    request_id: str
    src: int
