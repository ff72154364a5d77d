"""The agent's local API: what serving engines on the host ask for, one op per request.

A request is a msgpack map ``{"op": NAME, ...}``; the reply is a map with ``ok`` and the
op's result, or ``ok = False`` and a one-line ``error`` (``not_ready`` tells a resync
apart). Each op is a method named ``op_<name>`` found through :data:`OPS`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import msgpack

from ark.agent.cluster import ClusterError
from ark.core.messages import ProtocolError
from ark.core.node import Lease, NotReady
from ark.core.protocol import CoreError

if TYPE_CHECKING:
    from ark.agent.daemon import Agent

API_MAX_BYTES = 4096
MORE_PORTS_MAX = 1024  # ports one more_ports request may claim
Reply = dict[str, Any]


def lease_dict(lease: Lease) -> dict[str, Any]:
    d = lease._asdict()
    d["flow_id"] = list(lease.flow_id)
    return dict(d)


class LocalApi:
    """Decodes, checks and answers local API requests for one agent."""

    def __init__(self, agent: Agent) -> None:
        self.agent = agent
        self.ops: dict[str, Callable[[dict[str, Any], bytes, float], Reply | None]] = {
            name: getattr(self, f"op_{name}") for name in OPS
        }

    def handle(self, body: bytes, rid: bytes = b"") -> Reply | None:
        """The reply to one request (None: answered later, e.g. ``refresh``)."""
        try:
            req = self._decode(body)
            return self.ops[req["op"]](req, rid, time.time())
        except (CoreError, ProtocolError, ValueError, KeyError, TypeError) as e:
            return {"ok": False, "error": str(e), "not_ready": isinstance(e, NotReady)}

    def _decode(self, body: bytes) -> dict[str, Any]:
        if len(body) > API_MAX_BYTES:
            raise ValueError(f"request: larger than {API_MAX_BYTES} bytes")
        try:
            req = msgpack.unpackb(body, raw=False)
        except Exception:
            raise ValueError("request: not valid msgpack") from None
        if not isinstance(req, dict) or not isinstance(req.get("op"), str):
            raise ValueError("request: expected a map with an 'op'")
        if req["op"] not in self.ops:
            raise ValueError(f"op: must be one of {', '.join(OPS)}; got {req['op']!r}")
        return req

    # ------------------------------------------------------------------ arguments
    def _host(self, v: Any, field: str) -> int:
        cluster = self.agent.cluster
        try:
            if isinstance(v, str):
                return cluster.host(v).index
            if isinstance(v, int) and not isinstance(v, bool):
                return cluster.by_index(v).index
        except ClusterError:
            pass
        names = ", ".join(h.name for h in cluster.hosts)
        raise ValueError(f"{field}: expected a cluster host ({names}); got {v!r}")

    @staticmethod
    def _flow(req: dict[str, Any]) -> tuple[int, int]:
        f = req.get("flow")
        if not (isinstance(f, list) and len(f) == 2 and all(isinstance(x, int) for x in f)):
            raise ValueError("flow: expected [host, seq]")
        return (f[0], f[1])

    def _dport(self, req: dict[str, Any]) -> int:
        dport = req.get("dport", self.agent.cluster.dport)
        if not isinstance(dport, int) or isinstance(dport, bool) or not 0 <= dport <= 0xFFFF:
            raise ValueError("dport: expected 0..65535")
        return dport

    # ------------------------------------------------------------------ ops
    def op_reserve(self, req: dict[str, Any], rid: bytes, now: float) -> Reply:
        nbytes = req.get("nbytes")
        if not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes < 0:
            raise ValueError("nbytes: expected an integer >= 0")
        lease, outs = self.agent.node.reserve(self._host(req.get("dst"), "dst"), nbytes, now, self._dport(req))
        self.agent.emit(outs)
        return {"ok": True, "lease": lease_dict(lease)}

    def op_renew(self, req: dict[str, Any], rid: bytes, now: float) -> Reply:
        lease, outs = self.agent.node.renew(self._flow(req), now)
        self.agent.emit(outs)
        return {"ok": True, "lease": lease_dict(lease)}

    def op_release(self, req: dict[str, Any], rid: bytes, now: float) -> Reply:
        self.agent.emit(self.agent.node.release(self._flow(req), now))
        return {"ok": True}

    def op_lease(self, req: dict[str, Any], rid: bytes, now: float) -> Reply:
        return {"ok": True, "lease": lease_dict(self.agent.node.lease_of(self._flow(req)))}

    def op_more_ports(self, req: dict[str, Any], rid: bytes, now: float) -> Reply:
        """More source ports of a flow's path (an engine opening several connections)."""
        n = req.get("n")
        if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= MORE_PORTS_MAX:
            raise ValueError(f"n: expected an integer 1..{MORE_PORTS_MAX}")
        node, flow = self.agent.node, self._flow(req)
        ports = node.more_ports(flow, n)
        return {"ok": True, "ports": ports, "path": node.lease_of(flow).path}  # the path they lead over

    def op_reload(self, req: dict[str, Any], rid: bytes, now: float) -> Reply:
        """New path-map files (re-probed after a fabric change): reload and re-path."""
        return {"ok": True, "repathed": self.agent.reload(now)}

    def op_refresh(self, req: dict[str, Any], rid: bytes, now: float) -> None:
        """Re-probe (the fabric changed), then reload: the reply comes when done."""
        peers = req.get("peers")
        if peers is not None and not (isinstance(peers, list) and all(isinstance(p, str) for p in peers)):
            raise ValueError("peers: expected a list of host names")
        for p in peers or ():
            self.agent.cluster.host(p)
        self.agent.refresher.start(rid, peers)

    def op_status(self, req: dict[str, Any], rid: bytes, now: float) -> Reply:
        agent = self.agent
        st = agent.node.status(now)
        st["name"] = agent.me.name
        st["node"]["unsent"] = agent.dropped_out
        st["peers"] = {agent.peers[int(p)].name: v for p, v in st["peers"].items()}
        samples = list(agent.node.propagation_s)
        n = req.get("samples", 0)
        st["propagation_samples"] = samples[-int(n):] if n else []
        st["propagation_count"] = len(samples)
        st["paths"] = agent.refresher.counters()
        return {"ok": True, "status": st}

    def op_table(self, req: dict[str, Any], rid: bytes, now: float) -> Reply:
        core = self.agent.node.core
        return {"ok": True, "flows": [[f[0], f[1], p, sh] for f, (p, sh) in sorted(core.table().items())],
                "digest": core.digest()}

    def op_ports(self, req: dict[str, Any], rid: bytes, now: float) -> Reply:
        peer = self._host(req.get("peer"), "peer")
        return {"ok": True, "ports": self.agent.maps(self.agent.me.index, peer, self._dport(req)).static_ports()}

    def op_metrics(self, req: dict[str, Any], rid: bytes, now: float) -> Reply:
        from prometheus_client import generate_latest

        return {"ok": True, "text": generate_latest(self.agent.metrics_registry()).decode()}


OPS = ("reserve", "renew", "release", "lease", "more_ports", "reload", "refresh", "status", "table", "ports", "metrics")
