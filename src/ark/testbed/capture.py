"""Spine counters: which spine each TCP connection's payload bytes actually crossed (3-tier:
which aggregation switches and which core).

``python -m ark.testbed.capture STATE_DIR OUT READY`` counts in its own process until
SIGTERM (capture threads would starve the experiment of the GIL) and writes OUT.
"""

from __future__ import annotations

import contextlib
import json
import math
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from ark.testbed import netns
from ark.testbed.fabric import State, TestbedError

_PACKET_OUTGOING = 4
_ETH_P_ALL = 0x0003  # transmitted packets reach only ETH_P_ALL taps


# TPACKET_V2 receive ring (linux/if_packet.h): the kernel copies each packet's first
# bytes into a shared ring, so a capture that falls behind for a moment loses nothing.
_SOL_PACKET, _PACKET_RX_RING, _PACKET_VERSION, _PACKET_STATISTICS, _TPACKET_V2 = 263, 5, 10, 6, 1
_TP_STATUS_USER = 1
_FRAME = 256  # tpacket2_hdr + sockaddr_ll + the first ~180 bytes of the packet
_BLOCK = 1 << 20
_BLOCKS = 16  # 64 Ki frames per spine: seconds of traffic at the scaled rates
_HDR = struct.Struct("=IIIHHII")  # tp_status, tp_len, tp_snaplen, tp_mac, tp_net, tp_sec, tp_nsec
_PKTTYPE_OFF = 32 + 10  # sockaddr_ll follows the 32-byte aligned header; sll_pkttype at +10
_GAP_S = 0.02  # a pause this long starts a new interval (a later connection may reuse the tuple)

Interval = list[float]  # [first packet time, last packet time, payload bytes]


class SpineCounters:
    """Payload bytes per TCP 4-tuple leaving each spine, from AF_PACKET rings in the spines.

    Counting at the spine's egress sees each packet once; the key is
    (src ip, src port, dst ip, dst port). Only payload is counted, so ACKs (which ECMP
    may send over any spine on the way back) do not blur which spine carried a flow.
    Bytes are kept in time intervals stamped by the kernel, so that a later connection
    reusing a 4-tuple is told apart from an earlier one by when its bytes passed.
    ``drops`` is the kernel's count of packets the rings had no room for.
    """

    def __init__(self, st: State, open_sockets: bool = True) -> None:
        import mmap

        self.st = st
        # One table per counted switch (spines; 3-tier: aggregation switches, then cores).
        switches = st.layout.counted()
        self.bytes: list[dict[tuple[str, int, str, int], list[Interval]]] = [{} for _ in switches]
        self.drops = 0
        self.packets = 0
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._socks: list[socket.socket] = []
        self._rings: list[mmap.mmap] = []
        for ns in switches if open_sockets else []:
            with netns.inside(ns):
                s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(_ETH_P_ALL))
            s.setsockopt(_SOL_PACKET, _PACKET_VERSION, _TPACKET_V2)
            frames = _BLOCK // _FRAME * _BLOCKS
            s.setsockopt(_SOL_PACKET, _PACKET_RX_RING, struct.pack("IIII", _BLOCK, _BLOCKS, _FRAME, frames))
            self._rings.append(mmap.mmap(s.fileno(), _BLOCK * _BLOCKS, mmap.MAP_SHARED,
                                         mmap.PROT_READ | mmap.PROT_WRITE))
            self._socks.append(s)

    def start(self) -> None:
        for k, s in enumerate(self._socks):
            t = threading.Thread(target=self._loop, args=(s, self._rings[k], self.bytes[k]), daemon=True)
            t.start()
            self._threads.append(t)

    def _loop(self, s: socket.socket, ring: Any, counts: dict[tuple[str, int, str, int], list[Interval]]) -> None:
        import select

        nframes = len(ring) // _FRAME
        i = 0
        poller = select.poll()
        poller.register(s.fileno(), select.POLLIN)
        while True:
            off = i * _FRAME
            if not ring[off] & _TP_STATUS_USER:  # tp_status low byte
                if self._stop.is_set():
                    return
                poller.poll(100)
                continue
            _, length, snap, mac, _net, sec, nsec = _HDR.unpack_from(ring, off)
            if ring[off + _PKTTYPE_OFF] == _PACKET_OUTGOING and snap >= 54:
                b = off + mac
                if ring[b + 12:b + 14] == b"\x08\x00" and ring[b + 23] == 6:  # IPv4, TCP
                    t = b + 14 + (ring[b + 14] & 0x0F) * 4
                    # length is the packet's full length, GSO packets included
                    payload = length - (t - b) - (ring[t + 12] >> 4) * 4
                    if payload > 0:
                        self._count(counts, ring, b, t, sec + nsec * 1e-9, payload)
            ring[off:off + 4] = b"\0\0\0\0"  # tp_status = TP_STATUS_KERNEL: the slot is free again
            i = (i + 1) % nframes

    @staticmethod
    def _count(counts: dict[tuple[str, int, str, int], list[Interval]], ring: Any, b: int, t: int, now: float,
               payload: int) -> None:
        key = (socket.inet_ntoa(ring[b + 26:b + 30]), (ring[t] << 8) | ring[t + 1],
               socket.inet_ntoa(ring[b + 30:b + 34]), (ring[t + 2] << 8) | ring[t + 3])
        ivs = counts.get(key)
        if ivs is None:
            counts[key] = [[now, now, payload]]
        elif now - ivs[-1][1] > _GAP_S:
            ivs.append([now, now, payload])
        else:
            last = ivs[-1]
            last[1] = max(last[1], now)
            last[2] += payload

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join()
        for s in self._socks:
            packets, drops = struct.unpack("II", s.getsockopt(_SOL_PACKET, _PACKET_STATISTICS, 8))
            self.packets += packets
            self.drops += drops
        for r in self._rings:
            r.close()
        for s in self._socks:
            s.close()

    def spines_of(self, key: tuple[str, int, str, int], t0: float = -math.inf, t1: float = math.inf,
                  slack_s: float = 0.005) -> dict[int, int]:
        """Switch -> payload bytes of one 4-tuple that passed between wall times ``t0`` and ``t1``
        (switches numbered as :meth:`ark.testbed.fabric.Layout.counted` lists them)."""
        out = {}
        for k, c in enumerate(self.bytes):
            total = sum(int(b) for a, z, b in c.get(key, ()) if z >= t0 - slack_s and a <= t1 + slack_s)
            if total:
                out[k] = total
        return out


@contextlib.contextmanager
def counting(st: State) -> Iterator[SpineCounters]:
    """Spine counters in a separate process (capture threads would starve the caller of the GIL).

    The yielded counters are filled when the block ends.
    """
    import sys

    out = st.dir / "capture.json"
    ready = st.dir / "capture.ready"
    for f in (out, ready):
        f.unlink(missing_ok=True)
    p = subprocess.Popen([sys.executable, "-m", "ark.testbed.capture", "capture", str(st.dir), str(out), str(ready)],
                         stdin=subprocess.DEVNULL)
    counters = SpineCounters(st, open_sockets=False)
    try:
        deadline = time.monotonic() + 30
        while not ready.exists():
            if p.poll() is not None or time.monotonic() > deadline:
                raise TestbedError("spine capture did not start")
            time.sleep(0.02)
        yield counters
    finally:
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(30)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    if out.exists():
        raw = json.loads(out.read_text())
        counters.bytes = [{tuple(json.loads(k)): v for k, v in c.items()} for c in raw["bytes"]]
        counters.packets, counters.drops = raw["packets"], raw["drops"]


def _capture_main(argv: Sequence[str]) -> int:
    """``python -m ark.testbed.capture capture STATE_DIR OUT READY``: count until SIGTERM, write OUT."""
    d, out, ready = Path(argv[0]), Path(argv[1]), Path(argv[2])
    st = State.load(d)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    c = SpineCounters(st)
    c.start()
    ready.write_text("ready\n")
    while not stop.wait(0.2):
        pass
    c.stop()
    out.write_text(json.dumps({"packets": c.packets, "drops": c.drops,
                               "bytes": [{json.dumps(list(k)): v for k, v in sp.items()} for sp in c.bytes]}))
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "capture":
        sys.exit(_capture_main(sys.argv[2:]))
    sys.exit("usage: python -m ark.testbed.capture capture STATE_DIR OUT READY")
