"""The envelope every agent-to-agent message travels in (wire version 3).

``[3, kind, sender, incarnation, seq, payload]`` as a msgpack array:

* ``DATA``     (1): ``[message bytes, signature]``: one RESERVE / RENEW / RELEASE
  (:mod:`ark.core.messages`) and its owner's Ed25519 signature over those bytes (empty
  when the cluster does not sign);
* ``HELLO``    (2): ``[digest, since, until, sent_at, echoes]``: the sender's digest of
  its own flows ending in ``[since, until)``, its clock when it sent the heartbeat, and
  for up to :data:`MAX_ECHOES` peers ``[peer, that peer's last sent_at, the sender's
  clock when it arrived]``, from which each of those peers measures its offset to the
  sender over a round trip (:mod:`ark.core.clock`);
* ``SYNC_REQ`` (3): ``None``;
* ``SYNC_REP`` (4): ``[[[message bytes, signature], ...], sent_at, frozen, part, parts]``:
  one part of a snapshot, split so that no envelope exceeds :data:`MAX_ENVELOPE_BYTES`.

:func:`decode_envelope` checks types and sizes; the node checks meaning (timestamps
against its clock, signatures of relayed messages, who may send what).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Annotated, Any

import msgpack
import msgspec

from ark.core.messages import MAX_MESSAGE_BYTES, ProtocolError, VersionError

ENVELOPE_VERSION = 3
K_DATA, K_HELLO, K_SYNC_REQ, K_SYNC_REP = 1, 2, 3, 4
KINDS = (K_DATA, K_HELLO, K_SYNC_REQ, K_SYNC_REP)
MAX_ENVELOPE_BYTES = 1 << 20
SIGNATURE_BYTES = 64
MAX_ECHOES = 64
_U32 = 0xFFFFFFFF
_U63 = 2**63 - 1
_ITEM_BYTES = MAX_MESSAGE_BYTES + SIGNATURE_BYTES + 16
# A frozen assignment [owner, seq, path, shared]: at most 1 + 5 + 9 + 3 + 1 msgpack bytes.
_FROZEN_BYTES = 24
SYNC_FROZEN_PER_PART = 4096
# A part of a snapshot: this many signed messages and frozen assignments keep it under the
# envelope limit.
SYNC_ITEMS_PER_PART = (MAX_ENVELOPE_BYTES - 4096 - SYNC_FROZEN_PER_PART * _FROZEN_BYTES) // _ITEM_BYTES

SignedMessage = tuple[bytes, bytes]  # (message bytes, signature or b"")


@dataclass(frozen=True, slots=True)
class Envelope:
    kind: int
    sender: int
    incarnation: int
    seq: int
    payload: Any


def encode_envelope(kind: int, sender: int, incarnation: int, seq: int, payload: Any) -> bytes:
    out: bytes = msgpack.packb([ENVELOPE_VERSION, kind, sender, incarnation, seq, payload], use_bin_type=True)
    return out


def sync_parts(items: Sequence[SignedMessage], frozen: Sequence[list[Any]] = (),
               flows: Sequence[object] | None = None,
               ) -> Iterator[tuple[int, int, list[list[bytes]], list[list[Any]]]]:
    """(part, parts, items, frozen) for a snapshot: at most :data:`SYNC_ITEMS_PER_PART`
    messages and :data:`SYNC_FROZEN_PER_PART` frozen assignments a part. Frozen assignments
    start in the last part that carries messages and go on in parts of their own: a receiver
    takes one only for a reservation it already holds, so they come after every message.

    ``flows`` (one per item) keeps a flow's consecutive messages (its RESERVE, RENEW and
    RELEASE) in one part: a receiver judges whether a reservation is stale from all three.
    """
    chunks = _item_chunks(len(items), SYNC_ITEMS_PER_PART, flows)
    fpp = SYNC_FROZEN_PER_PART
    n = len(chunks) + max(0, math.ceil(len(frozen) / fpp) - 1)
    for i in range(n):
        k = i - (len(chunks) - 1)  # the frozen chunk of this part (from the last message part on)
        lo, hi = chunks[i] if i < len(chunks) else (0, 0)
        yield (i, n, [[m, s] for m, s in items[lo:hi]],
               list(frozen[k * fpp:(k + 1) * fpp]) if k >= 0 else [])


def _item_chunks(n: int, per: int, flows: Sequence[object] | None) -> list[tuple[int, int]]:
    """[lo, hi) ranges of at most ``per`` items (at least one range), cut between flows."""
    out: list[tuple[int, int]] = []
    lo = 0
    while lo < n:
        hi = min(n, lo + per)
        if flows is not None and hi < n:
            cut = hi
            while cut > lo + 1 and flows[cut] == flows[cut - 1]:
                cut -= 1
            hi = cut
        out.append((lo, hi))
        lo = hi
    return out or [(0, 0)]


# Typed decoders (msgspec): structure, types and ranges are checked while decoding, in C;
# what a type cannot say (finite times, signature sizes, part numbers) is checked after.
# Times are typed ``int | float`` so that an int where a float belongs is seen and
# refused, not silently widened.
_Time = int | float
_Bin = Annotated[bytes, msgspec.Meta(max_length=MAX_MESSAGE_BYTES)]
_Signed = tuple[_Bin, Annotated[bytes, msgspec.Meta(max_length=SIGNATURE_BYTES)]]
_Frozen = tuple[Annotated[int, msgspec.Meta(ge=0, le=_U32)], Annotated[int, msgspec.Meta(ge=0, le=_U63)],
                Annotated[int, msgspec.Meta(ge=-1, le=0xFFFF)], bool]
_Digest = Annotated[bytes, msgspec.Meta(min_length=8, max_length=8)]
_Echoes = Annotated[list[tuple[Annotated[int, msgspec.Meta(ge=0, le=_U32)], _Time, _Time]],
                   msgspec.Meta(max_length=MAX_ECHOES)]


class _Wire(msgspec.Struct, array_like=True):
    version: int
    kind: Annotated[int, msgspec.Meta(ge=1, le=4)]
    sender: Annotated[int, msgspec.Meta(ge=0, le=_U32)]
    incarnation: Annotated[int, msgspec.Meta(ge=0, le=_U63)]
    seq: Annotated[int, msgspec.Meta(ge=0, le=_U63)]
    payload: msgspec.Raw


_WIRE = msgspec.msgpack.Decoder(_Wire)
_PAYLOADS: dict[int, tuple[msgspec.msgpack.Decoder[Any], str]] = {
    K_DATA: (msgspec.msgpack.Decoder(_Signed), "data needs [message bytes, signature]"),
    K_HELLO: (msgspec.msgpack.Decoder(tuple[_Digest, _Time, _Time, _Time, _Echoes]),
              "hello needs [8-byte digest, since, until, sent_at, [[host, sent_at, arrival]...]]"),
    K_SYNC_REQ: (msgspec.msgpack.Decoder(None), "sync request carries nothing"),
    K_SYNC_REP: (msgspec.msgpack.Decoder(tuple[
        Annotated[list[_Signed], msgspec.Meta(max_length=SYNC_ITEMS_PER_PART)], _Time,
        Annotated[list[_Frozen], msgspec.Meta(max_length=SYNC_FROZEN_PER_PART)],
        Annotated[int, msgspec.Meta(ge=0)], Annotated[int, msgspec.Meta(ge=1, le=1 << 20)]]),
        "sync reply needs [[[bytes, sig]...], sent_at, [[owner, seq, path, shared]...], part, parts]"),
}


def decode_envelope(data: bytes) -> Envelope:
    """Parse and check an envelope's types and sizes (not its messages' meaning)."""
    if len(data) > MAX_ENVELOPE_BYTES:
        raise ProtocolError(f"envelope: {len(data)} bytes exceeds {MAX_ENVELOPE_BYTES}")
    try:
        w = _WIRE.decode(data)
    except (msgspec.ValidationError, msgspec.DecodeError) as e:
        v = _leading_version(data)
        if v is not None and v != ENVELOPE_VERSION:  # perhaps another layout: the version says so
            raise VersionError(f"envelope version: expected {ENVELOPE_VERSION}, got {v}") from None
        raise ProtocolError(f"envelope: {_reason(e)}") from None
    if w.version != ENVELOPE_VERSION:
        raise VersionError(f"envelope version: expected {ENVELOPE_VERSION}, got {w.version}")
    dec, shape = _PAYLOADS[w.kind]
    try:
        payload = dec.decode(w.payload)
    except (msgspec.ValidationError, msgspec.DecodeError):
        raise ProtocolError(f"envelope payload: {shape}") from None
    if not _CHECKS[w.kind](payload):
        raise ProtocolError(f"envelope payload: {shape}")
    return Envelope(w.kind, w.sender, w.incarnation, w.seq, payload)


def _leading_version(data: bytes) -> int | None:
    """The first element of a short msgpack array, when it is a small non-negative integer."""
    if len(data) >= 2 and 0x90 <= data[0] <= 0x9F and data[1] <= 0x7F:
        return data[1]
    return None


def _reason(e: Exception) -> str:
    if isinstance(e, msgspec.DecodeError):
        return "not valid msgpack"
    msg = str(e)
    return "expected an array of 6 fields" if "array" in msg and "$[" not in msg else msg[:120]


def _finite(x: Any) -> bool:
    return type(x) is float and math.isfinite(x)


def _signed_ok(p: SignedMessage) -> bool:
    return len(p[1]) in (0, SIGNATURE_BYTES)


def _hello_ok(p: Any) -> bool:
    return _finite(p[1]) and _finite(p[2]) and _finite(p[3]) and all(_finite(e[1]) and _finite(e[2]) for e in p[4])


def _sync_reply_ok(p: Any) -> bool:
    return _finite(p[1]) and p[3] < p[4] and all(len(x[1]) in (0, SIGNATURE_BYTES) for x in p[0])


_CHECKS: dict[int, Callable[[Any], bool]] = {
    K_DATA: _signed_ok, K_HELLO: _hello_ok, K_SYNC_REQ: lambda p: True, K_SYNC_REP: _sync_reply_ok,
}
