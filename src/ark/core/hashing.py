"""Switch ECMP hash models, scalar and vectorised over all source ports.

Every model exposes two implementations that must agree: ``hash_one`` hashes the bytes
of one key exactly as the switch does (used by the simulated switches), and
``hash_ports`` hashes many source ports at once with numpy (used for the boot-time path
maps). Key layouts:

``murmur3-hpcc``
    The HPCC / AstraSim ns-3 ``SwitchNode::EcmpHash``: MurmurHash3_x86_32 over 12 bytes,
    three little-endian u32 ``{src_ip, dst_ip, src_port | dst_port << 16}`` (IPs as host
    integers, e.g. 10.0.0.1 = 0x0A000001); seed = the switch's seed (its node id in
    ns-3). The IP protocol is not hashed.

every other model
    Seed-prefixed canonical key, 17 bytes, all big-endian (network order):
    ``seed(4) src_ip(4) dst_ip(4) ip_proto(1) src_port(2) dst_port(2)``. The seed is key
    data, not the CRC init, as on Broadcom RTAG7.

    * ``crc32``: zlib's CRC-32 (IEEE 802.3, reflected, init/xorout 0xFFFFFFFF).
    * ``crc32-lo`` / ``crc32-hi``: CRC-32C (Castagnoli, poly 0x1EDC6F41, reflected,
      init/xorout 0xFFFFFFFF); low / high 16 bits.
    * ``crc16-bisync``: poly 0x8005, init 0, input reflected, output not, xorout 0.
    * ``crc16-ccitt``: poly 0x1021, same settings.
    * ``xor16``: XOR of the key's 16-bit big-endian words (key zero-padded to 18 bytes).

All but murmur are affine over GF(2) for equal-length keys, so
``h(key with sport s) = h(sport 0) ^ T_hi[s >> 8] ^ T_lo[s & 255]`` where the tables
come from 16 single-bit evaluations: 17 scalar hashes give all 65,536 ports.

Next-hop selection: ``modulo`` (member = h % n, Broadcom and HPCC) or ``threshold``
(RFC 2992 hash-threshold over the model's output width, member = (h * n) >> bits, the
way Linux splits its hash space into equal regions).
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Callable

import numpy as np
import numpy.typing as npt

U32 = np.uint32
UintArray = npt.NDArray[np.uint64]
# One seed, or (seed per switch, switch per port): each port hashed under its switch's seed.
Seeds = int | tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]


# ---------------------------------------------------------------------------------------
# Scalar primitives
# ---------------------------------------------------------------------------------------
def _reflect(value: int, width: int) -> int:
    out = 0
    for _ in range(width):
        out = (out << 1) | (value & 1)
        value >>= 1
    return out


_REFLECT8 = [_reflect(b, 8) for b in range(256)]


class Crc:
    """Table-driven CRC with independent input/output reflection (Rocksoft model)."""

    def __init__(
        self, width: int, poly: int, init: int, refin: bool, refout: bool, xorout: int
    ) -> None:
        self.width, self.poly, self.init = width, poly, init
        self.refin, self.refout, self.xorout = refin, refout, xorout
        self._mask = (1 << width) - 1
        top = 1 << (width - 1)
        table = []
        for b in range(256):
            crc = b << (width - 8)
            for _ in range(8):
                crc = ((crc << 1) ^ poly) if crc & top else (crc << 1)
            table.append(crc & self._mask)
        self._table = table

    def __call__(self, data: bytes) -> int:
        crc, mask, table, shift = self.init, self._mask, self._table, self.width - 8
        for byte in data:
            if self.refin:
                byte = _REFLECT8[byte]
            crc = ((crc << 8) & mask) ^ table[((crc >> shift) ^ byte) & 0xFF]
        if self.refout:
            crc = _reflect(crc, self.width)
        return crc ^ self.xorout


CRC32C = Crc(32, 0x1EDC6F41, 0xFFFFFFFF, True, True, 0xFFFFFFFF)
CRC16_BISYNC = Crc(16, 0x8005, 0, True, False, 0)
CRC16_CCITT = Crc(16, 0x1021, 0, True, False, 0)

_C1, _C2 = 0xCC9E2D51, 0x1B873593
_M32 = 0xFFFFFFFF


def murmur3_32(data: bytes, seed: int) -> int:
    """MurmurHash3_x86_32, unsigned (reference: Austin Appleby's MurmurHash3.cpp)."""
    h = seed & _M32
    n = len(data)
    nblocks = n // 4
    for (k,) in struct.iter_unpack("<I", data[: nblocks * 4]):
        k = (k * _C1) & _M32
        k = ((k << 15) | (k >> 17)) & _M32
        k = (k * _C2) & _M32
        h ^= k
        h = ((h << 13) | (h >> 19)) & _M32
        h = (h * 5 + 0xE6546B64) & _M32
    tail = data[nblocks * 4 :]
    k = 0
    if len(tail) >= 3:
        k ^= tail[2] << 16
    if len(tail) >= 2:
        k ^= tail[1] << 8
    if len(tail) >= 1:
        k ^= tail[0]
        k = (k * _C1) & _M32
        k = ((k << 15) | (k >> 17)) & _M32
        k = (k * _C2) & _M32
        h ^= k
    h ^= n
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & _M32
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & _M32
    h ^= h >> 16
    return h


def _xor16(data: bytes) -> int:
    if len(data) % 2:
        data += b"\0"
    h = 0
    for (w,) in struct.iter_unpack(">H", data):
        h ^= w
    return h


# ---------------------------------------------------------------------------------------
# Models
# ---------------------------------------------------------------------------------------
class HashModel:
    """A switch hash: ``hash_one`` (exact bytes) and ``hash_ports`` (vectorised)."""

    def __init__(self, name: str, bits: int) -> None:
        self.name, self.bits = name, bits

    def key(self, seed: int, src_ip: int, dst_ip: int, proto: int, sport: int, dport: int) -> bytes:
        raise NotImplementedError

    def digest(self, key: bytes) -> int:
        raise NotImplementedError

    def hash_one(
        self, seed: int, src_ip: int, dst_ip: int, sport: int, dport: int, proto: int = 17
    ) -> int:
        return self.digest(self.key(seed, src_ip, dst_ip, proto, sport, dport))

    def hash_ports(
        self,
        seed: Seeds,
        src_ip: int,
        dst_ip: int,
        dport: int,
        sports: npt.ArrayLike,
        proto: int = 17,
    ) -> UintArray:
        """Hash of every port of ``sports``; ``seed`` is one seed or one per port (the
        switches of one tier hashing the ports each of them receives)."""
        raise NotImplementedError


def _per_seed(seed: Seeds, fn: Callable[[int], int]) -> np.uint64 | UintArray:
    """``fn`` of one seed, or of every port's seed (computed once per distinct seed)."""
    if isinstance(seed, int):
        return np.uint64(fn(seed))
    per_switch, which = seed
    out: UintArray = np.asarray([fn(int(s)) for s in per_switch], dtype=np.uint64)[which]
    return out


class Murmur3Hpcc(HashModel):
    def __init__(self) -> None:
        super().__init__("murmur3-hpcc", 32)

    def key(self, seed: int, src_ip: int, dst_ip: int, proto: int, sport: int, dport: int) -> bytes:
        return struct.pack("<III", src_ip, dst_ip, (sport | (dport << 16)) & _M32)

    def digest(self, key: bytes) -> int:
        raise TypeError("murmur3-hpcc needs the seed: use hash_one")

    def hash_one(
        self, seed: int, src_ip: int, dst_ip: int, sport: int, dport: int, proto: int = 17
    ) -> int:
        return murmur3_32(self.key(seed, src_ip, dst_ip, proto, sport, dport), seed)

    @staticmethod
    def _prefix(seed: int, src_ip: int, dst_ip: int) -> int:
        """The state after the first two blocks, which do not depend on the port."""
        h0 = seed & _M32
        for k in (src_ip, dst_ip):
            k = (k * _C1) & _M32
            k = ((k << 15) | (k >> 17)) & _M32
            k = (k * _C2) & _M32
            hs = h0 ^ k
            hs = ((hs << 13) | (hs >> 19)) & _M32
            h0 = (hs * 5 + 0xE6546B64) & _M32
        return h0

    @staticmethod
    def _mix_block(k: int) -> int:
        k = (k * _C1) & _M32
        k = ((k << 15) | (k >> 17)) & _M32
        return (k * _C2) & _M32

    @classmethod
    def _prefixes(cls, seeds: npt.NDArray[np.int64], src_ip: int, dst_ip: int) -> npt.NDArray[np.uint32]:
        """:meth:`_prefix` of many seeds at once (uint32 arithmetic wraps as the scalar's masks do)."""
        h0 = (seeds & _M32).astype(np.uint32)
        for k in (src_ip, dst_ip):
            hs = h0 ^ np.uint32(cls._mix_block(k))
            hs = (hs << np.uint32(13)) | (hs >> np.uint32(19))
            h0 = hs * np.uint32(5) + np.uint32(0xE6546B64)
        return h0

    def hash_ports(
        self,
        seed: Seeds,
        src_ip: int,
        dst_ip: int,
        dport: int,
        sports: npt.ArrayLike,
        proto: int = 17,
    ) -> UintArray:
        # Array arithmetic in uint32 wraps without warnings: the scalar's "& _M32" for free.
        sp = np.asarray(sports, dtype=np.uint32)
        if isinstance(seed, int):
            h0: np.uint32 | npt.NDArray[np.uint32] = np.uint32(self._prefix(seed, src_ip, dst_ip))
        else:
            per_switch, which = seed
            h0 = self._prefixes(np.asarray(per_switch, dtype=np.int64), src_ip, dst_ip)[which]
        k2 = sp | np.uint32((dport << 16) & _M32)
        k2 *= np.uint32(_C1)
        k2 = (k2 << np.uint32(15)) | (k2 >> np.uint32(17))
        k2 *= np.uint32(_C2)
        h = h0 ^ k2
        h = (h << np.uint32(13)) | (h >> np.uint32(19))
        h *= np.uint32(5)
        h += np.uint32(0xE6546B64)
        h ^= np.uint32(12)
        h ^= h >> np.uint32(16)
        h *= np.uint32(0x85EBCA6B)
        h ^= h >> np.uint32(13)
        h *= np.uint32(0xC2B2AE35)
        h ^= h >> np.uint32(16)
        return h.astype(np.uint64)


class LinearHash(HashModel):
    """A hash that is affine over GF(2) in the key bits, on the canonical 17-byte key."""

    _SPORT_OFFSET = 13  # seed 4 + src 4 + dst 4 + proto 1

    def __init__(self, name: str, bits: int, fn: Callable[[bytes], int]) -> None:
        super().__init__(name, bits)
        self._fn = fn

    def key(self, seed: int, src_ip: int, dst_ip: int, proto: int, sport: int, dport: int) -> bytes:
        return struct.pack(">IIIBHH", seed & _M32, src_ip, dst_ip, proto, sport, dport)

    def digest(self, key: bytes) -> int:
        return self._fn(key)

    def hash_ports(
        self,
        seed: Seeds,
        src_ip: int,
        dst_ip: int,
        dport: int,
        sports: npt.ArrayLike,
        proto: int = 17,
    ) -> UintArray:
        sp = np.asarray(sports, dtype=np.int64)
        one = seed if isinstance(seed, int) else int(seed[0][0])
        base_key = bytearray(self.key(one, src_ip, dst_ip, proto, 0, dport))
        base = self._fn(bytes(base_key))
        # delta[i] = h(only bit i of the port set) ^ h(port 0): the linear part.
        deltas = []
        for i in range(16):
            k = bytearray(base_key)
            k[self._SPORT_OFFSET : self._SPORT_OFFSET + 2] = (1 << i).to_bytes(2, "big")
            deltas.append(self._fn(bytes(k)) ^ base)
        idx = np.arange(256)
        t_lo = np.zeros(256, dtype=np.uint64)
        t_hi = np.zeros(256, dtype=np.uint64)
        for i in range(8):
            bit = (idx >> i) & 1 == 1
            t_lo[bit] ^= np.uint64(deltas[i])
            t_hi[bit] ^= np.uint64(deltas[i + 8])
        # The delta of a port bit is the same whatever the seed (the hash is affine), so
        # only the port-0 hash depends on it.
        bases = np.uint64(base) if isinstance(seed, int) else _per_seed(
            seed, lambda s: self._fn(self.key(s, src_ip, dst_ip, proto, 0, dport)))
        out: UintArray = bases ^ t_hi[sp >> 8] ^ t_lo[sp & 0xFF]
        return out


HASH_MODELS: dict[str, HashModel] = {
    m.name: m
    for m in (
        Murmur3Hpcc(),
        LinearHash("crc32", 32, zlib.crc32),
        LinearHash("crc32-lo", 16, lambda d: CRC32C(d) & 0xFFFF),
        LinearHash("crc32-hi", 16, lambda d: CRC32C(d) >> 16),
        LinearHash("crc16-bisync", 16, CRC16_BISYNC),
        LinearHash("crc16-ccitt", 16, CRC16_CCITT),
        LinearHash("xor16", 16, _xor16),
    )
}


class HashError(ValueError):
    """Unknown hash model or selection."""


def hash_model(name: str) -> HashModel:
    try:
        return HASH_MODELS[name]
    except KeyError:
        raise HashError(f"hash: must be one of {', '.join(HASH_MODELS)}; got {name!r}") from None


def select(h: int, n: int, selection: str, bits: int) -> int:
    """Next-hop member for one hash value."""
    if selection == "modulo":
        return h % n
    if selection == "threshold":
        return (h * n) >> bits
    raise HashError(f"selection: must be modulo or threshold; got {selection!r}")


def select_many(h: UintArray, n: int, selection: str, bits: int) -> npt.NDArray[np.int64]:
    """Next-hop members for an array of hash values."""
    if selection == "modulo":
        return (h % np.uint64(n)).astype(np.int64)
    if selection == "threshold":
        return ((h * np.uint64(n)) >> np.uint64(bits)).astype(np.int64)
    raise HashError(f"selection: must be modulo or threshold; got {selection!r}")
