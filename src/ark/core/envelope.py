"""The envelope every agent-to-agent message travels in (wire version 2).

``[2, kind, sender, incarnation, seq, payload]`` as a msgpack array:

* ``DATA``     (1): ``[message bytes, signature]``: one RESERVE / RENEW / RELEASE
  (:mod:`ark.core.messages`) and its owner's Ed25519 signature over those bytes (empty
  when the cluster does not sign);
* ``HELLO``    (2): ``[digest, since, until, sent_at, ahead]``: the sender's digest of
  its own flows ending in ``[since, until)``, its clock when it sent the heartbeat, and
  the peers whose clocks it measured to be ahead of its own by more than the bound;
* ``SYNC_REQ`` (3): ``None``;
* ``SYNC_REP`` (4): ``[[[message bytes, signature], ...], sent_at, frozen, part, parts]``:
  one part of a snapshot, split so that no envelope exceeds :data:`MAX_ENVELOPE_BYTES`.

:func:`decode_envelope` checks types and sizes; the node checks meaning (timestamps
against its clock, signatures of relayed messages, who may send what).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import msgpack

from ark.core.messages import MAX_MESSAGE_BYTES, ProtocolError, VersionError

ENVELOPE_VERSION = 2
K_DATA, K_HELLO, K_SYNC_REQ, K_SYNC_REP = 1, 2, 3, 4
KINDS = (K_DATA, K_HELLO, K_SYNC_REQ, K_SYNC_REP)
MAX_ENVELOPE_BYTES = 1 << 20
SIGNATURE_BYTES = 64
MAX_AHEAD_LIST = 4096
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


def sync_parts(items: Sequence[SignedMessage], frozen: Sequence[list[Any]] = ()
               ) -> Iterator[tuple[int, int, list[list[bytes]], list[list[Any]]]]:
    """(part, parts, items, frozen) for a snapshot: at most :data:`SYNC_ITEMS_PER_PART`
    messages and :data:`SYNC_FROZEN_PER_PART` frozen assignments a part. Frozen assignments
    start in the last part that carries messages and go on in parts of their own: a receiver
    takes one only for a reservation it already holds, so they come after every message."""
    ipp, fpp = SYNC_ITEMS_PER_PART, SYNC_FROZEN_PER_PART
    item_parts = max(1, math.ceil(len(items) / ipp))
    n = item_parts + max(0, math.ceil(len(frozen) / fpp) - 1)
    for i in range(n):
        k = i - (item_parts - 1)  # the frozen chunk of this part (from the last message part on)
        yield (i, n, [[m, s] for m, s in items[i * ipp:(i + 1) * ipp]],
               list(frozen[k * fpp:(k + 1) * fpp]) if k >= 0 else [])


def decode_envelope(data: bytes) -> Envelope:
    """Parse and check an envelope's types and sizes (not its messages' meaning)."""
    if len(data) > MAX_ENVELOPE_BYTES:
        raise ProtocolError(f"envelope: {len(data)} bytes exceeds {MAX_ENVELOPE_BYTES}")
    try:
        body = msgpack.unpackb(
            data, raw=False, max_map_len=0, max_ext_len=0, max_str_len=0, strict_map_key=True,
            max_bin_len=MAX_MESSAGE_BYTES, max_array_len=max(SYNC_ITEMS_PER_PART, SYNC_FROZEN_PER_PART, MAX_AHEAD_LIST) + 8,
        )
    except Exception as e:  # garbage of any kind is malformed
        raise ProtocolError(f"envelope: not valid msgpack ({type(e).__name__})") from None
    if not isinstance(body, list) or len(body) != 6:
        raise ProtocolError("envelope: expected an array of 6 fields")
    v, kind, sender, inc, seq, payload = body
    if v != ENVELOPE_VERSION or type(v) is not int:
        raise VersionError(f"envelope version: expected {ENVELOPE_VERSION}, got {v!r:.40}")
    for name, val, hi in (("kind", kind, 4), ("sender", sender, _U32), ("incarnation", inc, _U63), ("seq", seq, _U63)):
        if type(val) is not int or not 0 <= val <= hi:
            raise ProtocolError(f"envelope {name}: expected an integer in 0..{hi}, got {val!r:.40}")
    check = _PAYLOAD_CHECKS.get(kind)
    if check is None:
        raise ProtocolError(f"envelope kind: expected 1..4, got {kind}")
    check(payload)
    return Envelope(kind, sender, inc, seq, payload)


def _is_signed(x: Any) -> bool:
    return (isinstance(x, list) and len(x) == 2 and isinstance(x[0], bytes) and isinstance(x[1], bytes)
            and len(x[1]) in (0, SIGNATURE_BYTES))


def _finite(x: Any) -> bool:
    return type(x) is float and math.isfinite(x)


def _check_data(p: Any) -> None:
    if not _is_signed(p):
        raise ProtocolError("envelope payload: data needs [message bytes, signature]")


def _check_hello(p: Any) -> None:
    if not (isinstance(p, list) and len(p) == 5 and isinstance(p[0], bytes) and len(p[0]) == 8
            and all(_finite(x) for x in p[1:4]) and isinstance(p[4], list) and len(p[4]) <= MAX_AHEAD_LIST
            and all(type(x) is int and 0 <= x <= _U32 for x in p[4])):
        raise ProtocolError("envelope payload: hello needs [8-byte digest, since, until, sent_at, [host ids]]")


def _check_sync_request(p: Any) -> None:
    if p is not None:
        raise ProtocolError("envelope payload: sync request carries nothing")


def _frozen_ok(x: Any) -> bool:
    return (isinstance(x, list) and len(x) == 4 and all(type(v) is int for v in x[:3]) and type(x[3]) is bool
            and 0 <= x[0] <= _U32 and 0 <= x[1] <= _U63 and -1 <= x[2] <= 0xFFFF)


def _check_sync_reply(p: Any) -> None:
    if not (isinstance(p, list) and len(p) == 5 and isinstance(p[0], list) and len(p[0]) <= SYNC_ITEMS_PER_PART
            and all(_is_signed(x) for x in p[0]) and _finite(p[1]) and isinstance(p[2], list)
            and len(p[2]) <= SYNC_FROZEN_PER_PART and all(_frozen_ok(x) for x in p[2]) and type(p[3]) is int and type(p[4]) is int
            and 0 <= p[3] < p[4] <= 1 << 20):
        raise ProtocolError("envelope payload: sync reply needs [[[bytes, sig]...], sent_at, "
                            "[[owner, seq, path, shared]...], part, parts]")


_PAYLOAD_CHECKS = {K_DATA: _check_data, K_HELLO: _check_hello, K_SYNC_REQ: _check_sync_request,
                   K_SYNC_REP: _check_sync_reply}
