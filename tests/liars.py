"""What a Byzantine listed peer does to the envelopes it sends, for the tests and the fault
harness: its node stays correct, its words on the wire do not."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

from ark.core.envelope import K_HELLO, K_SYNC_REP, decode_envelope, encode_envelope


def sign(host: int, raw: bytes) -> bytes:
    """A stand-in for Ed25519 (what the tests need of it: only the owner can make it)."""
    return hashlib.sha512(b"%d:" % host + raw).digest()


def verify(owner: int, raw: bytes, sig: bytes) -> bool:
    return sig == sign(owner, raw)


def shift_clock(data: bytes, shift: float) -> bytes:
    """A HELLO as if its sender's clock read ``shift`` seconds off (its ``sent_at`` and the
    arrival times it echoes); any other envelope as it is."""
    env = decode_envelope(data)
    if env.kind != K_HELLO or not shift:
        return data
    p = env.payload
    return encode_envelope(K_HELLO, env.sender, env.incarnation, env.seq,
                           [p[0], p[1], p[2], p[3] + shift, [[h, t1, t2 + shift] for h, t1, t2 in p[4]]])


def add_to_sync_reply(data: bytes, items: Sequence[list[bytes]] = (), claims: Sequence[list[Any]] = ()) -> bytes:
    """A sync reply with signed messages added to its first part and frozen-assignment
    claims to its last; any other envelope as it is."""
    env = decode_envelope(data)
    if env.kind != K_SYNC_REP:
        return data
    got, sent_at, frozen, part, parts = env.payload
    if part == 0:
        got = [*got, *items]
    if part == parts - 1:
        frozen = [*frozen, *claims]
    return encode_envelope(K_SYNC_REP, env.sender, env.incarnation, env.seq, [got, sent_at, frozen, part, parts])
