"""Protocol messages and their versioned msgpack wire format.

Wire layout (msgpack array): ``[version, type, owner, seq, ts, ...]``

* RESERVE (type 1): ``[1, 1, owner, seq, ts, src, dst, dport, path, port, nbytes, rate_bps, shared, expires]``
* RELEASE (type 2): ``[1, 2, owner, seq, ts]``
* RENEW   (type 3): ``[1, 3, owner, seq, ts, expires]``

``(owner, seq)`` is the flow id; the reservation key is ``(ts, owner, seq)``. ``expires``
is the lease end on the owner's clock (``inf``: no lease); RENEW moves it later.
:func:`decode` validates every field and raises :class:`ProtocolError` on anything
malformed; it never returns a partially valid message.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, NamedTuple

import msgpack
import msgspec

WIRE_VERSION = 1
T_RESERVE = 1
T_RELEASE = 2
T_RENEW = 3
MAX_MESSAGE_BYTES = 512

FlowId = tuple[int, int]
Key = tuple[float, int, int]

_U16 = 0xFFFF
_U32 = 0xFFFFFFFF
_U63 = 2**63 - 1


class ProtocolError(ValueError):
    """A peer message that is malformed, out of range or of another version."""


class VersionError(ProtocolError):
    """Well-formed, but of a wire version this code does not speak (counted on its own)."""


class Reserve(NamedTuple):
    """Owner ``flow[0]`` asks for ``path`` (links implied by the topology) at ``ts``.

    ``shared`` marks an ``ark-balance`` overflow reservation: chosen when no path was free,
    it shares its links instead of holding them alone.
    """

    flow: FlowId
    ts: float
    src: int
    dst: int
    dport: int
    path: int
    port: int
    nbytes: int
    rate_bps: float
    shared: bool = False
    expires: float = math.inf

    @property
    def key(self) -> Key:
        return (self.ts, self.flow[0], self.flow[1])


class Release(NamedTuple):
    flow: FlowId
    ts: float


class Renew(NamedTuple):
    """The owner extends a reservation's lease to ``expires``."""

    flow: FlowId
    ts: float
    expires: float


Message = Reserve | Release | Renew


# msgspec writes the same msgpack bytes as msgpack.packb(use_bin_type=True) for these bodies
# (ints in their smallest form, floats as float64), several times faster; a test holds it.
_ENCODER = msgspec.msgpack.Encoder()


def encode(msg: Message) -> bytes:
    if isinstance(msg, Reserve):
        body = [
            WIRE_VERSION,
            T_RESERVE,
            msg.flow[0],
            msg.flow[1],
            float(msg.ts),
            msg.src,
            msg.dst,
            msg.dport,
            msg.path,
            msg.port,
            msg.nbytes,
            float(msg.rate_bps),
            bool(msg.shared),
            float(msg.expires),
        ]
    elif isinstance(msg, Release):
        body = [WIRE_VERSION, T_RELEASE, msg.flow[0], msg.flow[1], float(msg.ts)]
    elif isinstance(msg, Renew):
        body = [WIRE_VERSION, T_RENEW, msg.flow[0], msg.flow[1], float(msg.ts), float(msg.expires)]
    else:
        raise TypeError(f"not a protocol message: {type(msg).__name__}")
    return _ENCODER.encode(body)


def _int(v: object, name: str, hi: int) -> int:
    if type(v) is not int or not 0 <= v <= hi:
        raise ProtocolError(f"{name}: expected an integer in 0..{hi}, got {v!r:.40}")
    return v


def _time(v: object, name: str) -> float:
    if type(v) is not float or not math.isfinite(v) or v < 0:
        raise ProtocolError(f"{name}: expected a finite float >= 0, got {v!r:.40}")
    return v


def _expires(v: object, ts: float) -> float:
    if type(v) is not float or math.isnan(v) or v < ts:
        raise ProtocolError(f"expires: expected a float >= ts (inf: no lease), got {v!r:.40}")
    return v


# The fast path: a typed decoder per message type (msgspec checks the layout, the types
# and the integer ranges in C), then what a type cannot say (finite, ordered times; the
# owner is the source). Anything it refuses goes through the field-by-field checks below,
# which are the reference and name what is wrong.
_Time = int | float  # typed so that an int where a float belongs is seen, not widened
_Fix = tuple[int, int, Annotated[int, msgspec.Meta(ge=0, le=_U32)], Annotated[int, msgspec.Meta(ge=0, le=_U63)], _Time]
_U16T = Annotated[int, msgspec.Meta(ge=0, le=_U16)]
_TYPED: dict[int, msgspec.msgpack.Decoder[Any]] = {
    T_RESERVE: msgspec.msgpack.Decoder(tuple[
        int, int, Annotated[int, msgspec.Meta(ge=0, le=_U32)], Annotated[int, msgspec.Meta(ge=0, le=_U63)], _Time,
        Annotated[int, msgspec.Meta(ge=0, le=_U32)], Annotated[int, msgspec.Meta(ge=0, le=_U32)], _U16T, _U16T, _U16T,
        Annotated[int, msgspec.Meta(ge=0, le=_U63)], _Time, bool, _Time]),
    T_RELEASE: msgspec.msgpack.Decoder(_Fix),
    T_RENEW: msgspec.msgpack.Decoder(tuple[
        int, int, Annotated[int, msgspec.Meta(ge=0, le=_U32)], Annotated[int, msgspec.Meta(ge=0, le=_U63)], _Time, _Time]),
}


def _fast(data: bytes) -> Message | None:
    """The message, when the typed path can tell it valid; None sends it to :func:`decode`'s checks."""
    if len(data) < 3 or not 0x95 <= data[0] <= 0x9E or data[1] != WIRE_VERSION:
        return None
    dec = _TYPED.get(data[2])
    if dec is None:
        return None
    try:
        b = dec.decode(data)
    except (msgspec.ValidationError, msgspec.DecodeError):
        return None
    ts = b[4]
    if type(ts) is not float or not 0 <= ts < math.inf:
        return None
    flow = (b[2], b[3])
    if data[2] == T_RELEASE:
        return Release(flow, ts)
    exp = b[-1]
    if type(exp) is not float or not exp >= ts:  # also false for NaN
        return None
    if data[2] == T_RENEW:
        return Renew(flow, ts, exp)
    rate = b[11]
    if b[5] != b[2] or type(rate) is not float or not 0 < rate < math.inf:
        return None
    return Reserve(flow, ts, b[5], b[6], b[7], b[8], b[9], b[10], rate, b[12], exp)


def decode(data: bytes) -> Message:
    """Parse and validate one wire message."""
    if type(data) is bytes and len(data) <= MAX_MESSAGE_BYTES:
        m = _fast(data)
        if m is not None:
            return m
    return decode_checked(data)


def decode_checked(data: bytes) -> Message:
    """The reference: every field checked in turn, the first bad one named."""
    if not isinstance(data, bytes | bytearray | memoryview):
        raise ProtocolError("message: expected bytes")
    if len(data) > MAX_MESSAGE_BYTES:
        raise ProtocolError(f"message: {len(data)} bytes exceeds {MAX_MESSAGE_BYTES}")
    try:
        body = msgpack.unpackb(
            bytes(data), raw=False, use_list=True, max_array_len=16, max_map_len=0,
            max_str_len=0, max_bin_len=0, max_ext_len=0, strict_map_key=True,
        )
    except Exception as e:  # msgpack raises many types on garbage; all mean malformed
        raise ProtocolError(f"message: not valid msgpack ({type(e).__name__})") from None
    if not isinstance(body, list) or len(body) < 5:
        raise ProtocolError("message: expected an array of at least 5 fields")
    if body[0] != WIRE_VERSION or type(body[0]) is not int:
        raise VersionError(f"version: expected {WIRE_VERSION}, got {body[0]!r:.40}")
    mtype = body[1]
    flow = (_int(body[2], "owner", _U32), _int(body[3], "seq", _U63))
    ts = _time(body[4], "ts")
    if mtype == T_RESERVE and type(mtype) is int:
        if len(body) != 14:
            raise ProtocolError(f"reserve: expected 14 fields, got {len(body)}")
        src = _int(body[5], "src", _U32)
        if src != flow[0]:
            raise ProtocolError(f"src: reservation by host {flow[0]} for source {src}")
        rate = body[11]
        if type(rate) is not float or not math.isfinite(rate) or rate <= 0:
            raise ProtocolError(f"rate_bps: expected a finite float > 0, got {rate!r:.40}")
        if type(body[12]) is not bool:
            raise ProtocolError(f"shared: expected a bool, got {body[12]!r:.40}")
        return Reserve(
            flow,
            ts,
            src,
            _int(body[6], "dst", _U32),
            _int(body[7], "dport", _U16),
            _int(body[8], "path", _U16),
            _int(body[9], "port", _U16),
            _int(body[10], "nbytes", _U63),
            rate,
            body[12],
            _expires(body[13], ts),
        )
    if mtype == T_RELEASE and type(mtype) is int:
        if len(body) != 5:
            raise ProtocolError(f"release: expected 5 fields, got {len(body)}")
        return Release(flow, ts)
    if mtype == T_RENEW and type(mtype) is int:
        if len(body) != 6:
            raise ProtocolError(f"renew: expected 6 fields, got {len(body)}")
        return Renew(flow, ts, _expires(body[5], ts))
    raise ProtocolError(
        f"type: expected {T_RESERVE} (reserve), {T_RELEASE} (release) or {T_RENEW} (renew), got {mtype!r:.40}"
    )
