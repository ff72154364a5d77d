"""The agent's local API: what serving engines on the host ask for, one op per request.

A request is a msgpack map ``{"op": NAME, ...}``; the reply is a map with ``ok`` and the
op's result, or ``ok = False`` and a one-line ``error`` (``not_ready`` tells a resync
apart). Every op's arguments are a typed struct (:data:`REQUESTS`) checked on decoding,
so a bad request gets a one-line error naming the field; a request that breaks a handler
anyway is answered with an error and counted, never fatal.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Annotated, Any

import msgpack
import msgspec

from ark.agent.cluster import ClusterError
from ark.core.messages import ProtocolError
from ark.core.node import MAX_SPLIT_PARTS, Lease, NotReady
from ark.core.protocol import CoreError
from ark.core.schema import ConfigError, Port, convert

if TYPE_CHECKING:
    from ark.agent.daemon import Agent

API_MAX_BYTES = 4096
MAX_NBYTES = 2**62
MORE_PORTS_MAX = 1024  # ports one more_ports request may claim
Reply = dict[str, Any]
_U32 = Annotated[int, msgspec.Meta(ge=0, le=2**32 - 1)]
_U63 = Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)]
Host = str | _U32  # a cluster host's name or fabric index


class _Req(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    op: str


class ReserveReq(_Req):
    dst: Host
    nbytes: Annotated[int, msgspec.Meta(ge=0, le=MAX_NBYTES)]
    dport: Port | None = None
    # A multi-path lease of this many parts (0: the agent's size-aware choice); the reply
    # then has "leases", one per part. None: one path, the reply has "lease".
    parts: Annotated[int, msgspec.Meta(ge=0, le=MAX_SPLIT_PARTS)] | None = None
    # The connections the caller will open for this lease: each reserved part then comes
    # with the ports for its share of them (its own and more of its path), so that an
    # engine opening many connections needs no more_ports round trip. 0 or 1: none extra.
    connections: Annotated[int, msgspec.Meta(ge=0, le=MORE_PORTS_MAX)] = 0
    # Paths to stay off while others remain (a connection lease: the paths the same peer
    # pair's live connections hold). Broadcast control only: an arbiter places on its own.
    avoid: Annotated[list[Annotated[int, msgspec.Meta(ge=0, le=63)]], msgspec.Meta(max_length=64)] = []


FlowId = tuple[_U32, _U63]


class FlowReq(_Req):
    flow: FlowId


class FlowsReq(_Req):
    """renew and release: one flow, or the parts of a multi-path lease as one."""

    flow: FlowId | None = None
    flows: Annotated[list[FlowId], msgspec.Meta(min_length=1, max_length=MAX_SPLIT_PARTS)] | None = None

    def __post_init__(self) -> None:
        if (self.flow is None) == (self.flows is None):
            raise ValueError("flow: give either flow (one lease) or flows (the parts of one); not both, not neither")

    def ids(self) -> list[tuple[int, int]]:
        return [self.flow] if self.flow is not None else list(self.flows or ())


class RefreshReq(_Req):
    peers: Annotated[list[Annotated[str, msgspec.Meta(max_length=256)]], msgspec.Meta(max_length=65536)] | None = None


class StatusReq(_Req):
    samples: Annotated[int, msgspec.Meta(ge=0, le=1_000_000)] = 0


class PortsReq(_Req):
    peer: Host
    dport: Port | None = None


class MorePortsReq(_Req):
    flow: tuple[_U32, _U63]
    n: Annotated[int, msgspec.Meta(ge=1, le=MORE_PORTS_MAX)]


REQUESTS: dict[str, type[_Req]] = {
    "reserve": ReserveReq, "renew": FlowsReq, "release": FlowsReq, "lease": FlowReq, "more_ports": MorePortsReq,
    "reload": _Req,
    "refresh": RefreshReq, "status": StatusReq, "table": _Req, "ports": PortsReq, "metrics": _Req,
}
OPS = tuple(REQUESTS)


def split_parts(nbytes: int, paths: int, part_bytes: int) -> int:
    """The size-aware part count of a multi-path lease: one part per ``part_bytes`` of the
    transfer, at most one per path between the hosts (and at most MAX_SPLIT_PARTS); a
    part smaller than that would pay a connection and a reservation for little gain."""
    return max(1, min(paths, MAX_SPLIT_PARTS, -(-nbytes // part_bytes)))


def lease_dict(lease: Lease) -> dict[str, Any]:
    d = lease._asdict()
    d["flow_id"] = list(lease.flow_id)
    return dict(d)


class LocalApi:
    """Decodes, checks and answers local API requests for one agent."""

    def __init__(self, agent: Agent) -> None:
        self.agent = agent
        self.ops: dict[str, Callable[[Any, bytes, float], Reply | None]] = {
            name: getattr(self, f"op_{name}") for name in OPS
        }
        self.pid = 0  # the process the request being handled came from (0: not known)
        self.rid = b""  # and the connection it came on

    def handle(self, body: bytes, rid: bytes = b"", pid: int = 0) -> Reply | None:
        """The reply to one request (None: answered later, e.g. ``refresh``) from process
        ``pid``, which holds the flows it reserves or renews (:mod:`ark.agent.holders`)."""
        self.pid, self.rid = pid, rid
        try:
            req = self._decode(body)
            return self.ops[req.op](req, rid, time.time())
        except (CoreError, ProtocolError, ValueError) as e:
            return {"ok": False, "error": str(e), "not_ready": isinstance(e, NotReady)}
        except Exception as e:  # a request must never end the agent
            self.agent._error("api")
            return {"ok": False, "error": f"internal error ({type(e).__name__}); counted and logged",
                    "not_ready": False}

    def _decode(self, body: bytes) -> _Req:
        if len(body) > API_MAX_BYTES:
            raise ValueError(f"request: larger than {API_MAX_BYTES} bytes")
        try:
            raw = msgpack.unpackb(body, raw=False, max_str_len=API_MAX_BYTES, max_bin_len=0, max_ext_len=0,
                                  strict_map_key=True)
        except Exception:
            raise ValueError("request: not valid msgpack") from None
        if not isinstance(raw, dict) or not isinstance(raw.get("op"), str):
            raise ValueError("request: expected a map with an 'op'")
        op = raw["op"]
        if op not in REQUESTS:
            raise ValueError(f"op: must be one of {', '.join(OPS)}; got {op!r:.60}")
        if op == "refresh" and not isinstance(raw.get("peers", []), list | type(None)):
            raise ValueError("peers: expected a list of host names")
        try:
            return convert(raw, REQUESTS[op])
        except ConfigError as e:
            raise ValueError(str(e)) from None

    # ------------------------------------------------------------------ arguments
    def _host(self, v: str | int, field: str) -> int:
        cluster = self.agent.cluster
        try:
            return cluster.host(v).index if isinstance(v, str) else cluster.by_index(v).index
        except ClusterError:
            names = ", ".join(h.name for h in cluster.hosts)
            raise ValueError(f"{field}: expected a cluster host ({names}); got {v!r:.60}") from None

    def _dport(self, dport: int | None) -> int:
        return self.agent.cluster.dport if dport is None else dport

    # ------------------------------------------------------------------ ops
    def op_reserve(self, req: ReserveReq, rid: bytes, now: float) -> Reply | None:
        node, dst, dport = self.agent.node, self._host(req.dst, "dst"), self._dport(req.dport)
        arb = self.agent.arbiter
        if arb is not None:  # the arbiter decides; the reply comes with its answer
            node.core.check_request(dst, req.nbytes, dport)
            parts = req.parts if req.parts is None else req.parts or split_parts(
                req.nbytes, node.core.routes.n_paths(node.host, dst), self.agent.cluster.split_part_bytes)
            arb.reserve(rid, self.pid, dst, req.nbytes, dport, parts, req.connections)
            return None
        if req.parts is None:
            lease, outs = node.reserve(dst, req.nbytes, now, dport, avoid=sum({1 << p for p in req.avoid}))
            self.agent.emit(outs)
            self.hold([lease])
            return {"ok": True, "lease": self.with_ports(lease, req.connections)}
        parts = req.parts or split_parts(req.nbytes, node.core.routes.n_paths(node.host, dst),
                                         self.agent.cluster.split_part_bytes)
        leases, outs = node.reserve_split(dst, req.nbytes, now, parts, dport)
        self.agent.emit(outs)
        self.hold(leases)
        share = -(-req.connections // max(1, sum(le.reserved for le in leases)))
        return {"ok": True, "leases": [self.with_ports(le, share) for le in leases]}

    def with_ports(self, lease: Lease, connections: int) -> dict[str, Any]:
        """The lease's reply; asked for ``connections`` > 1 and reserved, it also names
        ``ports``: its own source port and more of its path, one per connection (fewer when
        the path's bucket or the flow's cap of extra ports has no more)."""
        d = lease_dict(lease)
        if connections > 1 and lease.reserved and self.agent.node.holds(lease.flow_id):
            d["ports"] = [lease.src_port, *self.agent.node.more_ports(lease.flow_id, connections - 1)]
        return d

    def op_renew(self, req: FlowsReq, rid: bytes, now: float) -> Reply | None:
        node, flows = self.agent.node, req.ids()
        if self.agent.arbiter is not None:  # the arbiter's flows are renewed there (None: answered later)
            return self.agent.arbiter.renew(rid, flows, req.flow is not None)
        for f in flows:  # all or nothing: a part that is gone fails the whole lease
            node.lease_of(f, now)
        leases = []
        for f in flows:
            lease, outs = node.renew(f, now)
            self.agent.emit(outs)
            leases.append(lease)
        self.hold(leases)
        if req.flow is not None:
            return {"ok": True, "lease": lease_dict(leases[0])}
        return {"ok": True, "leases": [lease_dict(le) for le in leases]}

    def op_release(self, req: FlowsReq, rid: bytes, now: float) -> Reply:
        gone: CoreError | None = None
        arb = self.agent.arbiter
        if arb is not None:  # released here at once; the arbiter hears of it after
            arb.drop(arb.reserved_of(req.ids()))
        for f in req.ids():  # every part that is still held is released, even after one that is not
            try:
                self.agent.emit(self.agent.node.release(f, now))
            except CoreError as e:
                gone = gone or e
            self.agent.holders.drop(f)
        if gone is not None:
            raise gone
        return {"ok": True}

    def hold(self, leases: list[Lease]) -> None:
        """The requesting process holds these flows (released if it vanishes)."""
        for lease in leases:
            if self.agent.node.holds(lease.flow_id):  # an untracked ECMP lease holds nothing to release
                self.agent.holders.hold(lease.flow_id, self.pid, self.rid)

    def op_lease(self, req: FlowReq, rid: bytes, now: float) -> Reply:
        return {"ok": True, "lease": lease_dict(self.agent.node.lease_of(req.flow, now))}

    def op_more_ports(self, req: MorePortsReq, rid: bytes, now: float) -> Reply:
        """More source ports of a flow's path (an engine opening several connections)."""
        node = self.agent.node
        ports = node.more_ports(req.flow, req.n)
        return {"ok": True, "ports": ports, "path": node.lease_of(req.flow, now).path}  # the path they lead over

    def op_reload(self, req: _Req, rid: bytes, now: float) -> Reply:
        """New path-map files (re-probed after a fabric change): reload and re-path."""
        return {"ok": True, "repathed": self.agent.reload(now)}

    def op_refresh(self, req: RefreshReq, rid: bytes, now: float) -> None:
        """Re-probe (the fabric changed), then reload: the reply comes when done."""
        for p in req.peers or ():
            self._host(p, "peers")
        self.agent.refresher.start(rid, req.peers)

    def op_status(self, req: StatusReq, rid: bytes, now: float) -> Reply:
        agent = self.agent
        st = agent.node.status(now)
        st["name"] = agent.me.name
        st["node"].update(unsent=agent.dropped_out, errors=agent.errors, rate_limited=agent.rate_limited,
                          connections_shed=agent.guard.shed if hasattr(agent, "guard") else 0,
                          vanished_client_releases=agent.holders.released if hasattr(agent, "holders") else 0,
                          client_lookups=agent.holders.lookups if hasattr(agent, "holders") else 0,
                          **(agent.http.counters() if agent.http is not None else {}))
        st["peers"] = {agent.peers[int(p)].name: v for p, v in st["peers"].items()}
        st["control"] = agent.cluster.control
        if agent.arbiter is not None:
            st["arbiter"] = agent.arbiter.status()
        samples = list(agent.node.propagation_s)
        st["propagation_samples"] = samples[-req.samples:] if req.samples else []
        st["propagation_count"] = len(samples)
        st["paths"] = agent.refresher.counters()
        return {"ok": True, "status": st}

    def op_table(self, req: _Req, rid: bytes, now: float) -> Reply:
        core = self.agent.node.core
        return {"ok": True, "flows": [[f[0], f[1], p, sh] for f, (p, sh) in sorted(core.table().items())],
                "digest": core.digest()}

    def op_ports(self, req: PortsReq, rid: bytes, now: float) -> Reply:
        peer = self._host(req.peer, "peer")
        return {"ok": True, "ports": self.agent.maps.peek(self.agent.me.index, peer, self._dport(req.dport)).static_ports()}

    def op_metrics(self, req: _Req, rid: bytes, now: float) -> Reply:
        from prometheus_client import generate_latest

        return {"ok": True, "text": generate_latest(self.agent.metrics_registry()).decode()}

