from __future__ import annotations

import random

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from ark.core.messages import (
    MAX_MESSAGE_BYTES,
    ProtocolError,
    Release,
    Renew,
    Reserve,
    _fast,
    decode,
    decode_checked,
    encode,
)

RES = Reserve((3, 17), 12.5, 3, 9, 4791, 2, 50123, 1_700_000_000, 98e9, False, 14.0)
REL = Release((3, 17), 13.25)
REN = Renew((3, 17), 13.0, 16.5)


def test_roundtrip() -> None:
    for m in (RES, REL, REN, RES._replace(shared=True), RES._replace(expires=float("inf"))):
        assert decode(encode(m)) == m
        assert type(decode(encode(m))) is type(m)
    assert len(encode(RES)) < 64


@pytest.mark.parametrize(
    ("body", "match"),
    [
        ([2, 1, 3, 17, 12.5], "version"),
        ([1, 9, 3, 17, 12.5], "type"),
        ([1, 2, 3, 17, 12.5, 0], "release: expected 5 fields"),
        ([1, 2, -3, 17, 12.5], "owner"),
        ([1, 2, 3, 17, float("nan")], "ts"),
        ([1, 2, 3, 17, 5], "ts"),  # an int where a float belongs
        ([1, 1, 3, 17, 12.5, 4, 9, 4791, 2, 50123, 10, 1e9, False, 20.0], "src"),
        ([1, 1, 3, 17, 12.5, 3, 9, 70000, 2, 50123, 10, 1e9, False, 20.0], "dport"),
        ([1, 1, 3, 17, 12.5, 3, 9, 4791, 2, 50123, 10, 0.0, False, 20.0], "rate_bps"),
        ([1, 1, 3, 17, 12.5, 3, 9, 4791, 2, 50123, 10, 1e9, 1, 20.0], "shared"),
        ([1, 1, 3, 17, 12.5, 3, 9, 4791, 2, 50123, 10, 1e9, False], "reserve: expected 14"),
        ([1, 1, 3, 17, 12.5, 3, 9, 4791, 2, 50123, True, 1e9, False, 20.0], "nbytes"),
        ([1, 1, 3, 17, 12.5, 3, 9, 4791, 2, 50123, 10, 1e9, False, 1.0], "expires"),
        ([1, 3, 3, 17, 12.5, float("nan")], "expires"),
        ([1, 3, 3, 17, 12.5], "renew: expected 6"),
        ({"v": 1}, "message"),
        ([1, 2, 3], "array of at least 5"),
    ],
)
def test_malformed_fields_are_named(body, match: str) -> None:
    with pytest.raises(ProtocolError, match=match):
        decode(msgpack.packb(body))


def test_truncated_oversized_and_garbage() -> None:
    data = encode(RES)
    for n in range(len(data)):
        with pytest.raises(ProtocolError):
            decode(data[:n])
    with pytest.raises(ProtocolError, match="exceeds"):
        decode(b"\x90" * (MAX_MESSAGE_BYTES + 1))
    with pytest.raises(ProtocolError):
        decode(data + b"\x00")  # trailing bytes


@given(st.binary(max_size=600))
def test_random_bytes_never_escape_as_other_errors(data: bytes) -> None:
    try:
        m = decode(data)
    except ProtocolError:
        return
    assert isinstance(m, Reserve | Release | Renew)


def test_bit_flip_fuzz_thousands_of_inputs() -> None:
    rng = random.Random(0)
    base = [encode(RES), encode(REL), encode(REN)]
    ok = bad = 0
    for _ in range(5000):
        b = bytearray(rng.choice(base))
        for _ in range(rng.randint(1, 4)):
            b[rng.randrange(len(b))] = rng.randrange(256)
        try:
            m = decode(bytes(b))
            assert isinstance(m, Reserve | Release | Renew)
            ok += 1
        except ProtocolError:
            bad += 1
    assert bad > 1000 and ok + bad == 5000


_FIELD = st.one_of(st.integers(-2, 2**64 - 1), st.floats(allow_nan=True, allow_infinity=True), st.booleans(),
                   st.none(), st.binary(max_size=3), st.text(max_size=3))


@given(st.sampled_from([RES, REL, REN]), st.lists(st.tuples(st.integers(0, 13), _FIELD), max_size=3),
       st.integers(-1, 2))
def test_the_typed_fast_path_agrees_with_the_field_by_field_checks(base, edits, resize) -> None:
    """Whatever the fast path accepts, the reference accepts as the same message; every valid
    message takes the fast path."""
    body = msgpack.unpackb(encode(base))
    for i, v in edits:
        if i < len(body):
            body[i] = v
    if resize < 0:
        body = body[:-1]
    elif resize > 1:
        body.append(0)
    data = msgpack.packb(body, use_bin_type=True)
    try:
        ref = decode_checked(data)
    except ProtocolError:
        ref = None
    fast = _fast(data)
    assert fast is None or (fast == ref and type(fast) is type(ref))
    if ref is not None:
        assert fast == ref and type(fast) is type(ref)


_U32, _U63 = 2**32 - 1, 2**63 - 1
_TIMES = st.floats(min_value=0, max_value=1e12) | st.just(float("inf"))


@given(st.one_of(
    st.builds(Reserve, st.tuples(st.integers(0, _U32), st.integers(0, _U63)), st.floats(0, 1e12),
              st.integers(0, _U32), st.integers(0, _U32), st.integers(0, 0xFFFF), st.integers(0, 0xFFFF),
              st.integers(0, 0xFFFF), st.integers(0, _U63), st.floats(1, 1e15), st.booleans(), _TIMES),
    st.builds(Release, st.tuples(st.integers(0, _U32), st.integers(0, _U63)), st.floats(0, 1e12)),
    st.builds(Renew, st.tuples(st.integers(0, _U32), st.integers(0, _U63)), st.floats(0, 1e12), _TIMES),
))
def test_the_encoder_writes_what_msgpack_writes(msg) -> None:
    """The wire bytes are msgpack's own (the fast encoder changes no byte of the format)."""
    data = encode(msg)
    assert data == msgpack.packb(msgpack.unpackb(data), use_bin_type=True)
    assert msgpack.unpackb(data)[2:4] == list(msg.flow)
