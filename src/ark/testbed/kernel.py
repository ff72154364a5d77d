"""The kernel's own route choice in a leaf: what a probe's answer is checked against."""

from __future__ import annotations

import os
import socket
import struct

from ark.testbed import netns
from ark.testbed.fabric import State, TestbedError

_RTM_GETROUTE, _NLMSG_ERROR = 26, 2
_RTA_DST, _RTA_SRC, _RTA_IIF, _RTA_OIF, _RTA_GATEWAY = 1, 2, 3, 4, 5
_RTA_MULTIPATH, _RTA_IP_PROTO, _RTA_SPORT, _RTA_DPORT = 9, 27, 28, 29


def _rta(kind: int, payload: bytes) -> bytes:
    n = 4 + len(payload)
    return struct.pack("HH", n, kind) + payload + b"\0" * (-n % 4)


class KernelRoutes:
    """``ip route get ... iif ... ipproto ... sport ... dport ...`` in a leaf, over netlink.

    pyroute2 (0.9) has no RTA_SPORT/RTA_DPORT/RTA_IP_PROTO, so this speaks rtnetlink
    directly: one RTM_GETROUTE per question, answered with the chosen gateway.
    """

    def __init__(self, st: State, leaf: int, agg: int | None = None) -> None:
        """In ``leaf`` (packets from its hosts), or, with ``agg``, in that aggregation switch
        of a 3-tier testbed (packets that came up from ``leaf``)."""
        self.lay = st.layout
        spec = st.spec
        ns = self.lay.leaf_ns(leaf) if agg is None else self.lay.agg_ns(agg)
        with netns.inside(ns):
            self.sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, socket.NETLINK_ROUTE)
            self.sock.bind((0, 0))
            hosts = [i for i in range(spec.leaves * spec.gpus_per_leaf) if self.lay.leaf_of(i) == leaf]
            iif = socket.if_nametoindex(f"l{leaf}") if agg is not None else 0
            self._iif = {i: iif or socket.if_nametoindex(f"h{i}") for i in hosts}
        if spec.three_tier:
            hops = self.lay.hop_routers()["hops"]
            self._routers = hops[0 if agg is None else 1]["routers"]
        else:
            self._routers = self.lay.routers()
        self._seq = 0

    def gateway(self, src: int, dst_ip: str, sport: int, dport: int, proto: int = 6) -> str:
        self._seq += 1
        body = struct.pack("BBBBBBBBI", socket.AF_INET, 32, 32, 0, 0, 0, 0, 0, 0)
        body += (_rta(_RTA_DST, socket.inet_aton(dst_ip)) + _rta(_RTA_SRC, socket.inet_aton(self.lay.host_ip(src)))
                 + _rta(_RTA_IIF, struct.pack("I", self._iif[src])) + _rta(_RTA_IP_PROTO, bytes([proto]))
                 + _rta(_RTA_SPORT, struct.pack("!H", sport)) + _rta(_RTA_DPORT, struct.pack("!H", dport)))
        self.sock.send(struct.pack("IHHII", 16 + len(body), _RTM_GETROUTE, 1, self._seq, 0) + body)
        data = self.sock.recv(65536)
        ln, kind = struct.unpack_from("IH", data)
        if kind == _NLMSG_ERROR:
            (err,) = struct.unpack_from("i", data, 16)
            raise TestbedError(f"route get {dst_ip} sport {sport}: {os.strerror(-err)}")
        off = 16 + 12
        while off + 4 <= ln:
            n, t = struct.unpack_from("HH", data, off)
            if t == _RTA_GATEWAY:
                return socket.inet_ntoa(data[off + 4 : off + 8])
            off += (n + 3) & ~3
        raise TestbedError(f"route get {dst_ip} sport {sport}: no gateway in the answer")

    def spine(self, src: int, dst_ip: str, sport: int, dport: int, proto: int = 6) -> int:
        """The next hop's index: a spine; 3-tier: the aggregation switch a leaf picks (``j``),
        or the core an aggregation switch picks (its index, the path ``j * R + r``)."""
        return self._routers[self.gateway(src, dst_ip, sport, dport, proto)]

    def close(self) -> None:
        self.sock.close()
