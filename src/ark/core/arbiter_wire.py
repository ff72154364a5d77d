"""The arbiter's wire format: what a host asks an arbiter, what it answers, and what the
two arbiters tell each other.

Every message is a msgpack array whose first element names its kind (msgspec tagged
structs, ``array_like``): small, and decoded and range-checked in C. The sender's
identity is never in the message: the transport says who sent it (CURVE keys, see
:mod:`ark.agent.arbiter`). Times a host and an arbiter exchange are *durations*
(``lease_s``): their clocks need not agree.

Host -> arbiter: :class:`Ask` (a lease of one or more parts), :class:`Extend` (renew),
:class:`Drop` (release), :class:`Register` (leases a host holds from an earlier arbiter,
after a takeover), :class:`Ping`. Arbiter -> host: :class:`Grant`, :class:`Extended`,
:class:`Dropped`, :class:`Pong`, :class:`Refused` (this arbiter does not lead; the host
asks the other). Arbiter <-> arbiter: :class:`Beat` (alive, epoch, leading),
:class:`Changes` (table messages, :mod:`ark.core.messages` bytes, in the order the leader
applied them), :class:`SyncAsk` and :class:`SyncPart` (the leader's whole table in parts).

``epoch`` in a host's message is the highest epoch the host has seen: an arbiter that
leads with a lower one learns that it has been replaced and steps down.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec

MAX_ARBITER_MESSAGE_BYTES = 256 * 1024
MAX_FLOWS_PER_MESSAGE = 64  # flows one renew, release or register names
MAX_CHANGES_PER_MESSAGE = 1024  # table messages in one Changes or SyncPart

_U16 = Annotated[int, msgspec.Meta(ge=0, le=0xFFFF)]
_U32 = Annotated[int, msgspec.Meta(ge=0, le=0xFFFF_FFFF)]
_U63 = Annotated[int, msgspec.Meta(ge=0, le=(1 << 63) - 1)]
_Epoch = Annotated[int, msgspec.Meta(ge=0, le=(1 << 30) - 1)]
_Parts = Annotated[int, msgspec.Meta(ge=1, le=16)]
_Seconds = Annotated[float, msgspec.Meta(ge=0, le=86400.0)]
_Why = Annotated[str, msgspec.Meta(max_length=80)]
_Clock = Annotated[float, msgspec.Meta(ge=0.0, le=1e12)]  # an arbiter's own clock, seconds
# A flow the arbiter named: (owner host, seq). The owner is always the asking host; it is
# carried so that a flow id reads the same on the host, the arbiters and in logs.
_Flow = tuple[_U32, _U63]
_Flows = Annotated[list[_Flow], msgspec.Meta(min_length=1, max_length=MAX_FLOWS_PER_MESSAGE)]


class _Msg(msgspec.Struct, array_like=True, frozen=True, forbid_unknown_fields=True, tag_field="k"):
    pass


class Ask(_Msg, frozen=True, tag=1):
    """A lease for one transfer of ``nbytes`` to ``dst``, as ``parts`` flows (``ark-split``);
    ``avoid``: paths to stay off while others remain (a bit mask)."""

    rid: _U63
    epoch: _Epoch
    dst: _U32
    nbytes: _U63
    dport: _U16
    parts: _Parts = 1
    avoid: _U63 = 0


class Extend(_Msg, frozen=True, tag=2):
    rid: _U63
    epoch: _Epoch
    flows: _Flows


class Drop(_Msg, frozen=True, tag=3):
    rid: _U63
    epoch: _Epoch
    flows: _Flows


class Held(msgspec.Struct, array_like=True, frozen=True, forbid_unknown_fields=True):
    """A lease a host holds from an earlier arbiter (:class:`Register`)."""

    flow: _Flow
    dst: _U32
    dport: _U16
    path: _U16
    nbytes: _U63
    shared: bool
    lease_s: _Seconds  # what is left of it, by the host's clock


class Register(_Msg, frozen=True, tag=4):
    rid: _U63
    epoch: _Epoch
    held: Annotated[list[Held], msgspec.Meta(min_length=1, max_length=MAX_FLOWS_PER_MESSAGE)]


class Ping(_Msg, frozen=True, tag=5):
    rid: _U63
    epoch: _Epoch


class Part(msgspec.Struct, array_like=True, frozen=True, forbid_unknown_fields=True):
    """One flow of a grant: ``reserved`` False is plain ECMP (``why`` says why), the host
    picks any port; else the host picks a port of ``path``."""

    flow: _Flow
    path: _U16
    reserved: bool
    shared: bool
    lease_s: _Seconds
    why: _Why = ""


class Grant(_Msg, frozen=True, tag=11):
    rid: _U63
    epoch: _Epoch
    parts: Annotated[list[Part], msgspec.Meta(max_length=MAX_FLOWS_PER_MESSAGE)]


class Extended(_Msg, frozen=True, tag=12):
    """Per flow of the :class:`Extend`: the new lease left, or -1: not held here."""

    rid: _U63
    epoch: _Epoch
    lease_s: Annotated[list[Annotated[float, msgspec.Meta(ge=-1, le=86400.0)]],
                       msgspec.Meta(max_length=MAX_FLOWS_PER_MESSAGE)]


class Dropped(_Msg, frozen=True, tag=13):
    rid: _U63
    epoch: _Epoch


class Pong(_Msg, frozen=True, tag=14):
    rid: _U63
    epoch: _Epoch


class Refused(_Msg, frozen=True, tag=15):
    """This arbiter does not lead (``leader``: the rank it follows, -1: none known)."""

    rid: _U63
    epoch: _Epoch
    leader: Annotated[int, msgspec.Meta(ge=-1, le=15)]
    why: _Why


class Beat(_Msg, frozen=True, tag=21):
    """Alive, and the leader lease: a leader's beat carries its own clock at sending
    (``sent``) and ``needs``, the ranks whose acknowledgements its lease takes (a bit
    each); a follower's beat acknowledges the last leading beat it heard: that beat's
    ``echo_epoch`` and ``sent`` (``echo``; -1: none)."""

    epoch: _Epoch
    leading: bool
    synced: bool  # a follower holding the leader's whole table
    sent: _Clock = 0.0
    echo: Annotated[float, msgspec.Meta(ge=-1.0, le=1e12)] = -1.0
    echo_epoch: _Epoch = 0
    needs: _U16 = 0


class Changes(_Msg, frozen=True, tag=22):
    epoch: _Epoch
    at: _U63  # position of its first message in the leader's stream of this epoch
    msgs: Annotated[list[Annotated[bytes, msgspec.Meta(max_length=256)]],
                    msgspec.Meta(max_length=MAX_CHANGES_PER_MESSAGE)]


class SyncAsk(_Msg, frozen=True, tag=23):
    epoch: _Epoch


class SyncPart(_Msg, frozen=True, tag=24):
    epoch: _Epoch
    first: bool
    last: bool
    at: _U63  # the stream's position when the snapshot was taken
    msgs: Annotated[list[Annotated[bytes, msgspec.Meta(max_length=256)]],
                    msgspec.Meta(max_length=MAX_CHANGES_PER_MESSAGE)]


FromHost = Ask | Extend | Drop | Register | Ping
ToHost = Grant | Extended | Dropped | Pong | Refused
Between = Beat | Changes | SyncAsk | SyncPart

_ENCODER = msgspec.msgpack.Encoder()
_FROM_HOST = msgspec.msgpack.Decoder(FromHost)
_TO_HOST = msgspec.msgpack.Decoder(ToHost)
_BETWEEN = msgspec.msgpack.Decoder(Between)


class ArbiterWireError(ValueError):
    """Bytes that are not a valid message of the expected kind."""


def encode(msg: FromHost | ToHost | Between) -> bytes:
    return _ENCODER.encode(msg)


def _decode(dec: msgspec.msgpack.Decoder[Any], data: bytes, what: str) -> Any:
    if len(data) > MAX_ARBITER_MESSAGE_BYTES:
        raise ArbiterWireError(f"{what}: {len(data)} bytes exceeds {MAX_ARBITER_MESSAGE_BYTES}")
    try:
        return dec.decode(data)
    except (msgspec.ValidationError, msgspec.DecodeError) as e:
        raise ArbiterWireError(f"{what}: {e}") from None


def decode_from_host(data: bytes) -> FromHost:
    out: FromHost = _decode(_FROM_HOST, data, "host message")
    return out


def decode_to_host(data: bytes) -> ToHost:
    out: ToHost = _decode(_TO_HOST, data, "arbiter reply")
    return out


def decode_between(data: bytes) -> Between:
    out: Between = _decode(_BETWEEN, data, "arbiter message")
    return out
