"""The RoCEv2 wire check (``ark testbed roce-check``): does every QP of an unmodified RDMA
program take its leased port and spine?

Needs root, Linux >= 5.17 with the rdma_rxe module (Soft-RoCE), iproute2's ``rdma``,
perftest's ``ib_write_bw``, libibverbs' rxe provider (ibverbs-providers), and a 2-tier
namespace testbed (``ark testbed up``). It

1. adds an rxe device on the data interface (eth0) of a writer host and of a reader host
   behind another leaf (``rdma link add rxe_<ns> type rxe netdev eth0``, inside each host's
   namespace), and finds each one's RoCEv2 GID (::ffff:<host address>);
2. picks ``per_spine`` ports in 0xC000-0xFFFF for every spine, asking the writer's leaf
   which spine it sends each UDP 5-tuple to (``ip route get ... ipproto udp sport P dport
   4791``): what a lease of that path would hand out;
3. starts ``ib_write_bw -q <spines x per_spine>`` (one RC QP per port) on the reader, and on
   the writer under the verbs interposer (``LD_PRELOAD``) with ``ARK_VERBS_RULES`` naming
   those ports, spine k's ports in lane k: QP i takes lane i mod spines;
4. counts, at every spine, the writer's RoCEv2 packets to the reader by UDP source port
   (AF_PACKET sockets opened inside each spine's namespace), and reads every spine's
   interface counters before and after;
5. passes when every leased port's packets crossed its spine and no other, every QP was
   steered (the interposer's log), no packet left with a port no lease gave, and each
   spine's counters saw at least the RoCEv2 packets captured there.

The writes may not complete where rxe listens for RoCEv2 only in the initial namespace (its
per-namespace sockets are recent): the writer's requests still cross the spines, which is
what is checked; the verdict says whether the transfer completed too. Where the machine
cannot run it (no Soft-RoCE, ...), it says why in one line and does nothing.
"""

from __future__ import annotations

import json
import os
import selectors
import socket
import subprocess
import tempfile
import threading
import time
from contextlib import ExitStack, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ark.core.roce import flow_label_for_sport
from ark.integrations import rocewire, verbs
from ark.integrations.preload import Laned
from ark.testbed import kernel, netns
from ark.testbed.fabric import State

TCP_PORT = 18515  # perftest's exchange port


class WireCheckError(RuntimeError):
    """The check could not be run as asked (a 3-tier testbed, an rxe device refused, ...)."""


@dataclass(frozen=True)
class WireCheck:
    per_spine: int = 2  # leased ports (QPs) per spine
    iters: int = 200  # RDMA writes per QP
    size: int = 4096  # bytes per write

    def __post_init__(self) -> None:
        for name, lo, hi in (("per_spine", 1, 64), ("iters", 1, 10**6), ("size", 1, 1 << 30)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
                raise WireCheckError(f"{name}: expected an integer {lo}..{hi}; got {v!r}")


def rdma(ns: str, *a: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", "netns", "exec", ns, "rdma", *a], capture_output=True, text=True, check=False)


def add_rxe(ns: str, ip: str) -> tuple[str, int]:
    """An rxe device on ``ns``'s eth0 and the GID index of ``ip``'s RoCEv2 entry."""
    dev = f"rxe_{ns.replace('-', '_')}"
    if not (rocewire.SYSFS_IB / dev).exists():
        res = rdma(ns, "link", "add", dev, "type", "rxe", "netdev", "eth0")
        if res.returncode != 0:
            raise WireCheckError(f"rdma link add {dev}: {res.stderr.strip()}")
    for _ in range(50):  # the GID table fills in from the interface's addresses
        idx = rocewire.roce_gid_index(dev, ip)
        if idx is not None:
            return dev, idx
        time.sleep(0.1)
    raise WireCheckError(f"{dev}: no RoCEv2 GID for {ip}")


class Capture:
    """Per spine, the writer's RoCEv2 packets to the reader, by UDP source port."""

    def __init__(self, spines: list[str], src: str, dst: str) -> None:
        self.src, self.dst = src, dst
        self.seen: dict[int, dict[int, int]] = {}
        self.sel = selectors.DefaultSelector()
        for k, ns in enumerate(spines):
            with netns.inside(ns):  # the socket stays in the namespace it was opened in
                s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(0x0003))
            s.setblocking(False)
            self.sel.register(s, selectors.EVENT_READ, k)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            for key, _ in self.sel.select(0.1):
                with suppress(BlockingIOError):
                    while True:
                        frame, addr = key.fileobj.recvfrom(2048)  # type: ignore[union-attr]
                        if addr[2] == socket.PACKET_OUTGOING:
                            continue  # count each packet once per spine: as it arrives
                        got = rocewire.parse_roce(frame)
                        if got and got[0] == self.src and got[1] == self.dst:
                            per = self.seen.setdefault(got[2], {})
                            per[key.data] = per.get(key.data, 0) + 1

    def close(self) -> dict[int, dict[int, int]]:
        self.stop.set()
        self.thread.join()
        for key in list(self.sel.get_map().values()):
            key.fileobj.close()  # type: ignore[union-attr]
        return self.seen


def write_bw(ns: str, dev: str, gid: int, qps: int, a: WireCheck, peer: str | None,
             env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    argv = ["ib_write_bw", "-d", dev, "-x", str(gid), "-q", str(qps), "-n", str(a.iters), "-s", str(a.size),
            "-p", str(TCP_PORT), "-F", *([peer] if peer else [])]
    fh = open(log, "wb")  # noqa: SIM115 - the child keeps its copy
    return netns.spawn(ns, argv, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)


def transfer(hosts: dict[str, Any], rules: str, qps: int, a: WireCheck, tmp: Path) -> tuple[bool, list[dict[str, Any]]]:
    """The reader, then the writer under the interposer; whether both exited 0, and the
    interposer's log of the writer's QPs."""
    qplog = tmp / "qps.jsonl"
    wenv = {**verbs.preload_env(), verbs.RULES_ENV: rules, verbs.LOG_ENV: str(qplog)}
    r, w = hosts["reader"], hosts["writer"]
    server = write_bw(r["ns"], r["dev"], r["gid"], qps, a, None, dict(os.environ), tmp / "reader.log")
    time.sleep(1.0)  # perftest's client does not retry its exchange connection
    client = write_bw(w["ns"], w["dev"], w["gid"], qps, a, r["ip"], wenv, tmp / "writer.log")
    done = True
    for p in (client, server):
        try:
            done &= p.wait(60) == 0
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
            done = False
    logged = [json.loads(x) for x in qplog.read_text().splitlines()] if qplog.exists() else []
    return done, logged


def plan(st: State, per_spine: int) -> tuple[int, int, dict[int, list[int]]]:
    """The writer (first host of leaf 0), the reader (first of leaf 1) and ports per spine."""
    lay, spec = st.layout, st.spec
    src, dst = 0, spec.gpus_per_leaf
    routes = kernel.KernelRoutes(st, lay.leaf_of(src))
    try:
        per = rocewire.ports_per_spine(
            lambda p: routes.spine(src, lay.host_ip(dst), p, rocewire.ROCE_DPORT, proto=17), spec.spines, per_spine)
    finally:
        routes.close()
    return src, dst, per


def spine_packets(spines: list[str]) -> list[int]:
    """Packets received so far by each spine, over all its interfaces (the kernel's counters)."""
    out = []
    for ns in spines:
        res = subprocess.run(["ip", "-n", ns, "-s", "-j", "link", "show"], capture_output=True, text=True, check=False)
        links = json.loads(res.stdout or "[]") if res.returncode == 0 else []
        out.append(sum(int(x.get("stats64", {}).get("rx", {}).get("packets", 0)) for x in links if x.get("ifname") != "lo"))
    return out


def counters_agree(seen: dict[int, dict[int, int]], before: list[int], after: list[int]) -> list[int]:
    """Spines whose counters saw fewer packets than the RoCEv2 packets captured there."""
    captured = [sum(per.get(k, 0) for per in seen.values()) for k in range(len(before))]
    return [k for k, (b, a, c) in enumerate(zip(before, after, captured, strict=True)) if a - b < c]


def report_lines(result: dict[str, Any]) -> list[str]:
    lines = [f"port {c['port']:5d} (flow label 0x{c['flow_label']:05x}) leased for spine {c['spine']}: "
             f"{c['packets']} packets at spine(s) {c['seen'] or 'none'} {'ok' if c['ok'] else 'WRONG'}"
             for c in result["ports"]]
    lines.append(f"QPs steered by the interposer: {result['qps_steered']} of {result['qps']}; ports no lease gave: "
                 f"{result['stray_ports'] or 'none'}; spine counters short of the capture: "
                 f"{result['counters_short'] or 'none'}; writes completed: {result['completed']}")
    lines.append(f"roce-wire-check: {'PASS' if result['pass'] else 'FAIL'}")
    return lines


def run(st: State, a: WireCheck) -> dict[str, Any]:
    """The check on the testbed ``st`` (see the module docstring); its verdict and evidence."""
    if st.spec.three_tier:
        raise WireCheckError("testbed: the wire check needs a 2-tier testbed (leaves and spines)")
    lay = st.layout
    src, dst, per = plan(st, a.per_spine)
    leased = {p: k for k, ps in per.items() for p in ps}
    laned = Laned([p for k in sorted(per) for p in per[k]], [k for k in sorted(per) for _ in per[k]])
    spines = [lay.spine_ns(k) for k in range(st.spec.spines)]
    with ExitStack() as stack:
        hosts: dict[str, dict[str, Any]] = {}
        for role, i in (("writer", src), ("reader", dst)):
            dev, gid = add_rxe(lay.host_ns(i), lay.host_ip(i))
            stack.callback(rdma, lay.host_ns(i), "link", "delete", dev)
            hosts[role] = {"ns": lay.host_ns(i), "ip": lay.host_ip(i), "dev": dev, "gid": gid}
        rules = verbs.rules_env({hosts["reader"]["ip"]: laned})
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="roce-wire-")))
        before = spine_packets(spines)
        cap = Capture(spines, hosts["writer"]["ip"], hosts["reader"]["ip"])
        try:
            done, logged = transfer(hosts, rules, len(leased), a, tmp)
            time.sleep(0.5)  # the last packets reach the spines
        finally:
            seen = cap.close()
        after = spine_packets(spines)
    checks, stray = rocewire.judge(leased, seen)
    steered = sum(e["kind"] == "steered" for e in logged)
    short = counters_agree(seen, before, after)
    ok = all(c.ok for c in checks) and not stray and steered == len(leased) and not short
    return {"writer": hosts["writer"], "reader": hosts["reader"], "completed": done, "qps": len(leased),
            "qps_steered": steered, "stray_ports": stray, "counters_short": short, "pass": ok,
            "spine_packets": [b - a for a, b in zip(before, after, strict=True)],
            "ports": [{**c.__dict__, "ok": c.ok, "flow_label": flow_label_for_sport(c.port)} for c in checks]}
