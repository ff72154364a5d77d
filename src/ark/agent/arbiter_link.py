"""An agent under ``control = "arbiter"``: the local API's leases decided by the arbiters.

The agent keeps no replica. Its :class:`~ark.core.node.Node` has no peers and holds only
this host's flows, for their source ports, leases and the local API's bookkeeping; every
decision is the arbiters'. :class:`ArbiterForwarder` moves the bytes of an
:class:`ark.core.arbiter_host.ArbiterLink`: one DEALER per arbiter (CURVE client with the
host's own keys, pinned to the arbiter's public key), polled by the agent's loop. Each
new connection says hello at once (a ``Ping``): an arbiter counts a connection as its
host's only once it has spoken, and closes the oldest silent ones first.

* ``reserve``: an ``Ask`` (destination, bytes, destination port, parts); the engine's
  reply waits for the ``Grant``, whose paths the node turns into source ports
  (:meth:`ark.core.node.Node.place`). No arbiter answering: plain ECMP ports, and the
  lease says so (``fallback = "no arbiter answered"``), at once while none answers;
* ``renew``: an ``Extend`` for the reserved flows; the reply waits for the answer. A flow
  the arbiter no longer holds keeps its port, unreserved; no answer: the lease stands
  as it was (it is never extended without the arbiter);
* ``release``: answered at once; a ``Drop`` goes to the arbiter (lost, the lease ends
  there by itself);
* a new leader (a takeover): the reserved flows of earlier epochs are registered with it;
  one it cannot keep on its path goes on unreserved.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

import zmq

from ark.agent.logs import event as _ev
from ark.agent.sockets import readable
from ark.core import arbiter_wire as w
from ark.core.arbiter_host import (
    ArbiterLink,
    Done,
    LinkOut,
    apply_registration,
    held_leases,
    place_part,
    renewed_lease,
)
from ark.core.node import Lease

if TYPE_CHECKING:
    from ark.agent.daemon import Agent

log = logging.getLogger("ark.agent")


class ArbiterForwarder:
    """The agent's sockets to the arbiters and its requests in flight."""

    def __init__(self, agent: Agent) -> None:
        self.agent = agent
        c = agent.cluster
        self.link = ArbiterLink(len(c.arbiters), timeout_s=c.arbiter_timeout_s, probe_s=c.takeover_s / 5,
                                forget_epoch_s=c.max_lease_s + c.takeover_s, held=self._held,
                                incarnation=agent.node.incarnation, max_epoch_jump=c.arbiter_max_epoch_jump)
        self.socks: dict[int, zmq.Socket] = {}
        self._rank: dict[zmq.Socket, int] = {}
        self._hello: dict[zmq.Socket, int] = {}  # a DEALER's monitor (handshakes done) -> its arbiter
        self.unsent = 0
        self.bad_grants = 0  # grant parts this node could not take (an id not ours, or held already)
        self._up = True

    def open(self, ctx: zmq.Context, pollers: list[zmq.Poller]) -> None:
        for a in self.agent.cluster.arbiters:
            d = ctx.socket(zmq.DEALER)
            d.curve_secretkey, d.curve_publickey = self.agent.secret, self.agent.public
            d.curve_serverkey = a.public_key.encode()
            for opt, val in ((zmq.SNDHWM, 10_000), (zmq.LINGER, 0), (zmq.MAXMSGSIZE, w.MAX_ARBITER_MESSAGE_BYTES + 1024)):
                d.setsockopt(opt, val)
            d.connect(a.control)
            self.socks[a.rank] = d
            self._rank[d] = a.rank
            mon = d.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
            self._hello[mon] = a.rank
            for p in pollers:
                p.register(d, zmq.POLLIN)
                p.register(mon, zmq.POLLIN)

    def close(self) -> None:
        for mon in self._hello:
            mon.close(0)
        for s in self.socks.values():
            s.close(0)

    # ------------------------------------------------------------------ bytes
    def send(self, outs: list[LinkOut]) -> None:
        for o in outs:
            try:
                self.socks[o.rank].send(o.data, zmq.NOBLOCK)
            except zmq.Again:  # that arbiter has been away a while: the request times out there
                self.unsent += 1
        self._finish(time.time())

    def drain(self, events: dict[Any, int], limit: int = 1024) -> None:
        for mon, rank in self._hello.items():
            if mon in events:
                new = 0
                while new < limit and readable(mon):
                    mon.recv_multipart()
                    new += 1
                if new:  # a new connection: say who we are at once
                    self.send(self.link.hello(rank))
        for sock, rank in self._rank.items():
            if sock not in events:
                continue
            for _ in range(limit):
                if not readable(sock):
                    break
                data = sock.recv()
                try:
                    self.send(self.link.on_arbiter(rank, data, time.time()))
                except Exception:  # a message that breaks a handler is dropped, never fatal
                    self.agent._error("arbiter_message", arbiter=rank)
        self._finish(time.time())

    def tick(self, now: float) -> None:
        if now >= self.link.next_deadline():
            self.send(self.link.tick(now))
        if self.link.up != self._up:
            self._up = self.link.up
            log.warning(**_ev("arbiter_up" if self._up else "arbiter_down", host=self.agent.me.name,
                              leader=self.link.leader, epoch=self.link.epoch))

    def next_deadline(self) -> float:
        return self.link.next_deadline()

    # ------------------------------------------------------------------ requests
    def reserve(self, rid: bytes, pid: int, dst: int, nbytes: int, dport: int, parts: int | None,
                connections: int) -> None:
        tag = ("reserve", rid, pid, dst, nbytes, dport, parts, connections)
        self.send(self.link.ask(tag, dst, nbytes, dport, parts or 1, time.time()))

    def renew(self, rid: bytes, flows: list[tuple[int, int]], one: bool) -> dict[str, Any] | None:
        """Renew: the reply now when no flow is the arbiter's, else when it answers."""
        node, now = self.agent.node, time.time()
        for f in flows:  # all or nothing: a part that is gone fails the whole lease
            node.lease_of(f, now)
        held = [node.resolve(f) for f in flows if self._reserved(f)]
        if not held:
            return self._renewed(flows, one, {}, now)
        self.send(self.link.extend(("renew", rid, tuple(flows), one, tuple(held)), held, now))
        return None

    def drop(self, flows: list[tuple[int, int]]) -> None:
        step = w.MAX_FLOWS_PER_MESSAGE
        for i in range(0, len(flows), step):
            self.send(self.link.drop(flows[i:i + step], time.time()))

    def _reserved(self, flow: tuple[int, int]) -> bool:
        local = self.agent.node.core.local_flows().get(self.agent.node.resolve(flow))
        return bool(local and local[3])

    def reserved_of(self, flows: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """The flows among these that the arbiter holds for this host (before a release)."""
        return [self.agent.node.resolve(f) for f in flows if self._reserved(f)]

    def _held(self, now: float) -> list[w.Held]:
        return held_leases(self.agent.node, now)

    # ------------------------------------------------------------------ answers
    def _finish(self, now: float) -> None:
        for done in self.link.take_done():
            try:
                self._done(done, now)
            except Exception as e:  # never fatal, and the engine waiting for it gets an answer
                self.agent._error("arbiter_answer")
                tag: Any = done.tag
                if tag[0] in ("reserve", "renew"):
                    self.agent.reply(tag[1], {"ok": False, "error": f"internal error ({type(e).__name__}); counted "
                                                                    "and logged", "not_ready": False})

    def _done(self, done: Done, now: float) -> None:
        tag: Any = done.tag
        kind = tag[0]
        if kind == "reserve":
            self._granted(tag, done, now)
        elif kind == "renew":
            _, rid, flows, one, held = tag
            lease_s = done.answer.lease_s if isinstance(done.answer, w.Extended) else None
            left = [done.left(s, now) if s >= 0 else s for s in lease_s or ()]
            self.agent.reply(rid, self._renewed(list(flows), one, dict(zip(held, left, strict=False)), now,
                                                answered=lease_s is not None))
        elif kind == "register":
            self._registered(tag[1], done, now)

    def _granted(self, tag: tuple[Any, ...], done: Done, now: float) -> None:
        _, rid, pid, dst, nbytes, dport, parts, connections = tag
        api = self.agent.api
        answer = done.answer
        grant = answer if isinstance(answer, w.Grant) and answer.parts else None
        q, r = divmod(nbytes, parts or 1)
        leases: list[Lease] = []
        shares = grant.parts[:parts or 1] if grant is not None else [None] * (parts or 1)
        if grant is not None and len(grant.parts) > len(shares):  # never more parts than asked
            self.bad_grants += len(grant.parts) - len(shares)
        for i, part in enumerate(shares):
            leases.append(self._part_lease(part, dst, q + (i < r), dport, now,
                                           None if part is None else done.left(part.lease_s, now)))
        api.pid = pid
        api.hold(leases)
        if parts is None:
            self.agent.reply(rid, {"ok": True, "lease": api.with_ports(leases[0], connections)})
            return
        share = -(-connections // max(1, sum(le.reserved for le in leases)))
        self.agent.reply(rid, {"ok": True, "leases": [api.with_ports(le, share) for le in leases]})

    def _part_lease(self, part: w.Part | None, dst: int, nbytes: int, dport: int, now: float,
                    lease_s: float | None) -> Lease:
        placed = place_part(self.agent.node, part, dst, nbytes, dport, now, lease_s)
        self.bad_grants += placed.bad
        self.drop(placed.drop)
        return placed.lease

    def _renewed(self, flows: list[tuple[int, int]], one: bool, lease_s: dict[tuple[int, int], float], now: float,
                 answered: bool = True) -> dict[str, Any]:
        from ark.agent.api import lease_dict

        node = self.agent.node
        leases = [renewed_lease(node, f, lease_s.get(node.resolve(f)), answered, now) for f in flows]
        self.agent.api.hold(leases)
        if one:
            return {"ok": True, "lease": lease_dict(leases[0])}
        return {"ok": True, "leases": [lease_dict(le) for le in leases]}

    def _registered(self, flows: tuple[tuple[int, int], ...], done: Done, now: float) -> None:
        """A new leader's verdict on this host's leases: kept on their path, or unreserved."""
        kept, lost = apply_registration(self.agent.node, flows, done.answer, now, lambda s: done.left(s, now))
        self.drop(lost)
        log.info(**_ev("leases_registered", host=self.agent.me.name, flows=len(flows), epoch=self.link.epoch,
                       kept=len(kept)))

    def status(self) -> dict[str, Any]:
        st = self.link.status(time.time())
        st.update(unsent=self.unsent, bad_grants=self.bad_grants)
        return st
