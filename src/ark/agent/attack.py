"""Hostile inputs, for the adversarial tests and the flood benchmarks.

Everything here is invalid by construction: a correct agent counts and drops it, stays
up, and keeps its table as it was. :func:`hostile_envelopes` yields envelopes a listed
peer could send with its real keys (so they pass CURVE and ZAP and reach the node);
:func:`hostile_requests` yields local API requests. Both are seeded.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Iterator
from typing import Any

import msgpack

from ark.core.envelope import K_DATA, K_HELLO, K_SYNC_REP, K_SYNC_REQ, encode_envelope
from ark.core.messages import (
    T_RELEASE,
    T_RENEW,
    T_RESERVE,
    WIRE_VERSION,
    ProtocolError,
    Renew,
    Reserve,
    decode,
)

KINDS = ("reserve", "release", "renew", "hello", "sync_request", "sync_reply")
_BAD_FLOATS = (math.inf, -math.inf, math.nan, 1.7e308, -1.0, 1e30)
_BAD_VALUES: tuple[Any, ...] = ("x", b"\0", [], {}, None, True, 2**64 - 1, -(2**63), 1.5)


def _bad_time(rng: random.Random, now: float) -> Any:
    return rng.choice([*_BAD_FLOATS, now + 3600.0, now - 3600.0, *_BAD_VALUES])


def _reserve_fields(sender: int, dst: int, now: float) -> list[Any]:
    return [WIRE_VERSION, T_RESERVE, sender, 1, now, sender, dst, 4791, 0, 49152, 10**6, 1e11, False, now + 2.0]


def _corrupt(fields: list[Any], rng: random.Random, now: float, time_slots: tuple[int, ...]) -> list[Any]:
    """Make at least one field of a message invalid (a type, a range, a time or the length)."""
    out = list(fields)
    how = rng.randrange(4)
    if how == 0:
        i = rng.choice(time_slots)
        out[i] = _bad_time(rng, now)
    elif how == 1:
        i = rng.randrange(len(out))
        out[i] = rng.choice(_BAD_VALUES) if i not in time_slots else _bad_time(rng, now)
    elif how == 2:
        out = out[: rng.randrange(len(out))] if rng.random() < 0.5 else [*out, rng.choice(_BAD_VALUES)]
    else:
        out[rng.choice((2, 3))] = rng.choice([2**40, -1, 2**64 - 1])  # owner or seq out of range
    return out


def _data(fields: list[Any], sender: int, inc: int, seq: int, rng: random.Random) -> bytes:
    raw = msgpack.packb(fields, use_bin_type=True)
    sig = rng.choice([b"", b"\0" * 64])
    return encode_envelope(K_DATA, sender, inc, seq, [raw, sig])


def _invalid(fields: list[Any], sender: int, now: float) -> bool:
    """Would any replica drop this message? (Only such messages are generated.)"""
    try:
        m = decode(msgpack.packb(fields, use_bin_type=True))
    except ProtocolError:
        return True
    if m.flow[0] != sender or abs(m.ts - now) > 60:
        return True
    if isinstance(m, Reserve) and (m.path >= 16 or m.dst >= 1 << 16 or m.dst == m.src):
        return True
    return isinstance(m, Reserve | Renew) and not m.ts <= m.expires <= m.ts + 600


def _message(kind: str, sender: int, dst: int, now: float, rng: random.Random) -> list[Any]:
    while True:
        fields = _draft(kind, sender, dst, now, rng)
        if _invalid(fields, sender, now):
            return fields


def _draft(kind: str, sender: int, dst: int, now: float, rng: random.Random) -> list[Any]:
    if kind == "reserve":
        fields = _reserve_fields(sender, dst, now)
        if rng.random() < 0.3:  # valid in form, but a lease past the cap or a path that does not exist
            fields[13 if rng.random() < 0.5 else 8] = now + 1e6 if rng.random() < 0.5 else 9999
            return fields
        return _corrupt(fields, rng, now, (4, 13))
    if kind == "release":
        return _corrupt([WIRE_VERSION, T_RELEASE, sender, 1, now], rng, now, (4,))
    return _corrupt([WIRE_VERSION, T_RENEW, sender, 1, now, now + 2.0], rng, now, (4, 5))


def hostile_envelopes(kind: str, sender: int, dst: int, now: Callable[[], float], count: int,
                      seed: int = 0, incarnation: int = 7) -> Iterator[bytes]:
    """``count`` invalid envelopes of ``kind`` (one of :data:`KINDS`) from ``sender``."""
    rng = random.Random(seed)
    for k in range(count):
        t = now()
        if kind in ("reserve", "release", "renew"):
            yield _data(_message(kind, sender, dst, t, rng), sender, incarnation, k + 1, rng)
        elif kind == "hello":
            payload = [b"\0" * 8, t - 2.5, t - 1.0, t, []]
            i = rng.randrange(5)
            payload[i] = _bad_time(rng, t) if i in (1, 2, 3) else rng.choice([*_BAD_VALUES, list(range(5000))])
            yield encode_envelope(K_HELLO, sender, incarnation, k, payload)
        elif kind == "sync_request":
            yield encode_envelope(K_SYNC_REQ, sender, incarnation, 0, rng.choice(_BAD_VALUES[:-1]))
        else:  # unsolicited or malformed snapshot parts, with a forged third-party reservation
            forged = msgpack.packb(_reserve_fields((sender + 1) % 2**32, dst, t), use_bin_type=True)
            payload = [[[forged, b"\1" * 64]], t, [[sender + 1, 1, 0, False]], 0, 1]
            if rng.random() < 0.5:
                payload[rng.randrange(5)] = rng.choice(_BAD_VALUES)
            yield encode_envelope(K_SYNC_REP, sender, incarnation, k, payload)


_API_FIELDS = ("dst", "nbytes", "dport", "flow", "peers", "samples", "peer", "extra")
OP_ARGS: dict[str, tuple[str, ...]] = {
    "reserve": ("dst", "nbytes", "dport"), "renew": ("flow",), "release": ("flow",), "lease": ("flow",),
    "reload": (), "refresh": ("peers",), "status": ("samples",), "table": (), "ports": ("peer", "dport"),
    "metrics": (),
}
_API_BAD: tuple[Any, ...] = (*_BAD_VALUES, *_BAD_FLOATS, -5, 2**64 - 1, [1], [1, 2, 3], ["x", "y"], [-1, 2**64 - 1],
                             "gpu99999", "x" * 5000)


def hostile_requests(op: str, count: int, seed: int = 0) -> Iterator[bytes]:
    """``count`` invalid local API requests for ``op``: bad types, ranges, keys or framing."""
    rng = random.Random(seed)
    args = OP_ARGS[op]
    for _ in range(count):
        how = rng.randrange(4) if args else rng.choice((2, 3))
        req: dict[str, Any] = {"op": op}
        if how in (0, 1):  # every argument present, at least one hostile
            for a in args:
                req[a] = rng.choice(_API_BAD)
        elif how == 2:  # an unknown key
            req[rng.choice(("bogus", "x" * 100, "__class__"))] = rng.choice(_API_BAD)
        else:  # not a request at all
            yield rng.choice([b"", b"\xc1", msgpack.packb([op]), msgpack.packb({"op": rng.choice(_API_BAD[:4])}),
                              b"\x80" * 5000])
            continue
        yield msgpack.packb(req, use_bin_type=True)
