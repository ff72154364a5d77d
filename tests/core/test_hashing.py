"""Every hash model against an independent reference implementation."""

from __future__ import annotations

import random
import struct
import zlib

import crc32c
import mmh3
import numpy as np
import pytest
from crc import Calculator, Configuration

from ark.core.hashing import HASH_MODELS, HashError, hash_model, select, select_many

RNG = random.Random(1234)
KEYS = [
    (RNG.getrandbits(32), RNG.getrandbits(32), RNG.getrandbits(32), RNG.getrandbits(16), RNG.getrandbits(16))
    for _ in range(300)
]  # (seed, src_ip, dst_ip, sport, dport)

_CRC16 = {
    "crc16-bisync": Calculator(Configuration(16, 0x8005, 0, 0, reverse_input=True, reverse_output=False)),
    "crc16-ccitt": Calculator(Configuration(16, 0x1021, 0, 0, reverse_input=True, reverse_output=False)),
}


def canonical(seed: int, s: int, d: int, sport: int, dport: int, proto: int = 17) -> bytes:
    return struct.pack(">IIIBHH", seed, s, d, proto, sport, dport)


def reference(name: str, seed: int, s: int, d: int, sport: int, dport: int) -> int:
    if name == "murmur3-hpcc":
        return mmh3.hash(struct.pack("<III", s, d, sport | (dport << 16)), seed, signed=False)
    key = canonical(seed, s, d, sport, dport)
    if name == "crc32":
        return zlib.crc32(key)
    if name == "crc32-lo":
        return crc32c.crc32c(key) & 0xFFFF
    if name == "crc32-hi":
        return crc32c.crc32c(key) >> 16
    if name in _CRC16:
        return _CRC16[name].checksum(key)
    if name == "xor16":
        words = np.frombuffer(key + b"\0", dtype=">u2")
        return int(np.bitwise_xor.reduce(words))
    raise AssertionError(name)


@pytest.mark.parametrize("name", list(HASH_MODELS))
def test_scalar_matches_reference(name: str) -> None:
    m = hash_model(name)
    for seed, s, d, sport, dport in KEYS:
        assert m.hash_one(seed, s, d, sport, dport) == reference(name, seed, s, d, sport, dport)


@pytest.mark.parametrize("name", list(HASH_MODELS))
def test_vectorised_matches_reference_for_every_port(name: str) -> None:
    m = hash_model(name)
    ports = np.arange(65536)
    for seed, s, d, _, dport in KEYS[:3]:
        vec = m.hash_ports(seed, s, d, dport, ports)
        sample = RNG.sample(range(65536), 200) + [0, 1, 255, 256, 65535]
        for p in sample:
            assert int(vec[p]) == reference(name, seed, s, d, p, dport), (name, p)


def test_protocol_byte_is_hashed_by_canonical_models_only() -> None:
    key = (5, 0x0A000001, 0x0A000101, 50000, 4791)
    assert HASH_MODELS["crc32"].hash_one(*key, proto=17) != HASH_MODELS["crc32"].hash_one(*key, proto=6)
    assert HASH_MODELS["murmur3-hpcc"].hash_one(*key, proto=17) == HASH_MODELS["murmur3-hpcc"].hash_one(*key, proto=6)


def test_crc16_check_values() -> None:
    # CRC-16/ARC check 0xBB3D is the fully reflected variant; refout=False bit-reverses it.
    rev = int(f"{0xBB3D:016b}"[::-1], 2)
    assert HASH_MODELS["crc16-bisync"]._fn(b"123456789") == rev  # type: ignore[attr-defined]


def test_selection_modulo_and_threshold() -> None:
    assert select(10, 4, "modulo", 16) == 2
    assert select(0, 4, "threshold", 16) == 0
    assert select(0xFFFF, 4, "threshold", 16) == 3
    assert select(0x4000, 4, "threshold", 16) == 1
    h = np.arange(0, 1 << 16, dtype=np.uint64)
    t = select_many(h, 4, "threshold", 16)
    assert np.bincount(t).tolist() == [16384] * 4
    assert np.array_equal(select_many(h, 3, "modulo", 16), (h % 3).astype(np.int64))
    with pytest.raises(HashError, match="selection"):
        select(1, 2, "bogus", 16)


def test_unknown_model_error_names_choices() -> None:
    with pytest.raises(HashError, match="hash: must be one of murmur3-hpcc"):
        hash_model("md5")
