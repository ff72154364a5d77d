"""The pieces of the RoCEv2 wire check (``ark testbed roce-check``) that need no testbed.

The check runs RDMA writes between two hosts of the namespace testbed over Soft-RoCE
(``rdma_rxe``), the writer under the verbs interposer with a rule whose ports are spread
over the spines, and reads each RoCEv2 packet's UDP source port at every spine. These
helpers say whether the machine can (:func:`why_not`), find the RoCEv2 GID of an address
(:func:`roce_gid_index`), pick ports per spine (:func:`ports_per_spine`), parse captured
frames (:func:`parse_roce`) and judge what was seen (:func:`judge`). The testbed glue lives
in :mod:`ark.testbed.roce` (integrations import no testbed).
"""

from __future__ import annotations

import ipaddress
import os
import platform
import shutil
import socket
import struct
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from ark.core.roce import ROCE_SPORT_MAX, ROCE_SPORT_MIN

ROCE_DPORT = 4791
MIN_KERNEL = (5, 17)  # rxe derives the UDP source port from the flow label (rdma_get_udp_sport)
SYSFS_IB = Path("/sys/class/infiniband")
TOOLS = {"rdma": "iproute2", "ib_write_bw": "perftest"}


def _kernel(release: str) -> tuple[int, int]:
    parts = release.split(".")
    try:
        return int(parts[0]), int("".join(c for c in parts[1] if c.isdigit()) or 0)
    except (IndexError, ValueError):
        return (0, 0)


def _rxe_module(release: str) -> bool:
    if Path("/sys/module/rdma_rxe").exists():
        return True
    moddir = Path("/lib/modules") / release
    return moddir.is_dir() and any(moddir.rglob("rdma_rxe.ko*"))


def _rxe_provider() -> bool:
    """libibverbs' user-space provider for rxe (Debian: ibverbs-providers)."""
    return any(Path(d).glob("libibverbs/librxe-rdmav*.so") for d in ("/usr/lib/x86_64-linux-gnu", "/usr/lib64",
                                                                         "/usr/lib", "/usr/lib/aarch64-linux-gnu"))


def why_not(release: str | None = None) -> str | None:
    """Why Soft-RoCE cannot run the check on this machine (one line), or None."""
    release = release or platform.release()
    if _kernel(release) < MIN_KERNEL:
        return f"kernel {release}: rxe takes the source port from the flow label since 5.17"
    if not _rxe_module(release):
        return f"no rdma_rxe module for kernel {release} (Soft-RoCE): nothing can carry RoCEv2 here"
    if os.geteuid() != 0:
        return "needs root (rdma link add, network namespaces, packet capture)"
    for tool, package in TOOLS.items():
        if shutil.which(tool) is None:
            return f"no {tool} on PATH (install {package})"
    if not _rxe_provider():
        return "no rxe provider for libibverbs (install ibverbs-providers)"
    return None


def mapped_gid(ip: str) -> str:
    """The sysfs spelling of an IPv4 address's RoCEv2 GID (``::ffff:a.b.c.d``)."""
    raw = bytes(10) + b"\xff\xff" + ipaddress.IPv4Address(ip).packed
    return ":".join(raw[i:i + 2].hex() for i in range(0, 16, 2))


def roce_gid_index(dev: str, ip: str, port: int = 1, sysfs: Path = SYSFS_IB) -> int | None:
    """The GID index of ``ip``'s RoCEv2 entry on ``dev`` (None: not there yet)."""
    base = sysfs / dev / "ports" / str(port)
    want = mapped_gid(ip)
    for gid in sorted((base / "gids").glob("*"), key=lambda p: int(p.name) if p.name.isdigit() else -1):
        try:
            if gid.read_text().strip() != want:
                continue
            kind = (base / "gid_attrs" / "types" / gid.name).read_text().strip()
        except OSError:
            continue
        if kind.lower() == "roce v2":
            return int(gid.name)
    return None


def ports_per_spine(spine_of: Callable[[int], int], spines: int, per_spine: int,
                    ports: Iterable[int] = range(ROCE_SPORT_MIN, ROCE_SPORT_MAX + 1)) -> dict[int, list[int]]:
    """``per_spine`` ports for each spine (what a lease of that path would hand out), taking
    ports in order and asking ``spine_of`` (the leaf's own route choice) for each."""
    out: dict[int, list[int]] = {k: [] for k in range(spines)}
    for p in ports:
        k = spine_of(p)
        if k in out and len(out[k]) < per_spine:
            out[k].append(p)
        if all(len(v) == per_spine for v in out.values()):
            return out
    short = [k for k, v in out.items() if len(v) < per_spine]
    raise ValueError(f"ports: no {per_spine} RoCEv2 ports reach spine(s) {short}")


def parse_roce(frame: bytes) -> tuple[str, str, int] | None:
    """(source IP, destination IP, UDP source port) of an Ethernet frame carrying RoCEv2
    over IPv4 (UDP to 4791), else None."""
    if len(frame) < 14 + 20 + 8 or frame[12:14] != b"\x08\x00":
        return None
    ihl = (frame[14] & 0x0F) * 4
    if frame[14] >> 4 != 4 or frame[23] != 17 or len(frame) < 14 + ihl + 8:
        return None
    sport, dport = struct.unpack_from("!HH", frame, 14 + ihl)
    if dport != ROCE_DPORT:
        return None
    return socket.inet_ntoa(frame[26:30]), socket.inet_ntoa(frame[30:34]), sport


@dataclass(frozen=True)
class PortCheck:
    """One leased port: the spine it was leased for, and the spines its packets crossed."""

    port: int
    spine: int
    seen: tuple[int, ...]
    packets: int

    @property
    def ok(self) -> bool:
        return self.seen == (self.spine,)


def judge(leased: Mapping[int, int], seen: Mapping[int, Mapping[int, int]]) -> tuple[list[PortCheck], list[int]]:
    """Per leased port (port -> spine), where its packets went (``seen``: source port ->
    spine -> packets, for the writer's packets to the reader); and the source ports seen
    that no lease gave (QPs that escaped the interposer)."""
    checks = [PortCheck(p, k, tuple(sorted(seen.get(p, {}))), sum(seen.get(p, {}).values()))
              for p, k in sorted(leased.items())]
    return checks, sorted(set(seen) - set(leased))
