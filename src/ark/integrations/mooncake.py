"""Mooncake's ``TransferEngine`` with every write steered onto a path ARK reserved.

    from ark.integrations.mooncake import SteeredTransferEngine

    engine = SteeredTransferEngine.from_cluster("cluster.toml", "gpu0")   # wraps a new TransferEngine
    engine.initialize("10.0.0.1", "P2PHANDSHAKE", "tcp", "")
    engine.register_memory(buf, size)
    engine.batch_transfer_sync_write("10.0.1.1:15123", bufs, peer_addrs, lengths)   # steered

The process must run with the ``connect()`` interposer preloaded (``ark preload -- python
serve.py``): Mooncake's TCP transport opens its connections itself, without binding. With
``MC_TCP_ENABLE_CONNECTION_POOL=0`` (the default of mooncake-transfer-engine 0.3.12) it opens
one connection per request, from the thread that submits it, and closes it when the request
is done. Pooled connections (0.3.12 with the variable set to 1; 0.3.13's default of up to
``MC_TCP_LANES_PER_PEER`` connections per peer, opened from its I/O thread) are reused by
every later transfer: no lease can steer a connection that outlives its transfer. The
wrapper therefore sets that variable to ``0`` when it is unset (before the engine's
``initialize``, which reads it) and refuses a pooled setting.

0.3.13 and 0.3.13.post1 hang in that one-connection-per-request mode (:data:`HANGING`): the
submitting thread arms a session's progress timer while the engine's I/O thread re-arms it,
a data race that corrupts the heap; within seconds to minutes of concurrent writes every
sender thread waits forever. The extras pin 0.3.12.post1, which has no such timer, and the
wrapper warns when it finds one of those versions.

``poll_s`` > 0 replaces the engine's synchronous writes, which wait for their requests by
asking for the status in a loop without pause (a core per write in flight), by the same
requests submitted one by one (``transfer_submit_write``, from the calling thread, so they
are steered the same way) and checked every ``poll_s`` seconds in between sleeps.

A steered write (``transfer_sync_write``, ``batch_transfer_sync_write``, ``transfer_sync`` and
``batch_transfer_sync`` with the write opcode, or any engine call inside :meth:`steer`):

1. enters a rule for the peer's address that skips its handshake (RPC) port;
2. when the engine opens its first data connection, the rule's resolver learns the data
   port it connects to and takes a lease from the local agent for (peer, bytes, that port),
   which comes with a port of the leased path (of each part's path, with ``parts``) for
   every connection the call is expected to open, all in one round trip;
3. each connection is bound to the next free one of those ports (ports still in TIME_WAIT
   from earlier transfers are skipped, and more are asked for when they run out);
4. the lease is renewed in the background while the call runs and released when it returns
   or fails.

Reads are not steered: their bytes flow from the peer, over the path its leaf picks for the
reversed 4-tuple, which a lease of this host does not name. Everything else (``initialize``,
``register_memory``, reads, the asynchronous calls, ...) goes to the engine unchanged. When
the agent cannot be reached, the transfer goes out unsteered (plain ECMP) and its record says
why (:meth:`last_transfer`).
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import ipaddress
import itertools
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ark.agent.api import MORE_PORTS_MAX
from ark.agent.client import ArkClient, ArkClientError, HeldSplit
from ark.core.node import MAX_SPLIT_PARTS, Lease
from ark.integrations.preload import Connection, Laned, Rule, RuleStats, require

log = logging.getLogger("ark.integrations.mooncake")
POOL_ENV = "MC_TCP_ENABLE_CONNECTION_POOL"
HANGING = ("0.3.13", "0.3.13.post1")  # Mooncake releases whose unpooled TCP writes hang (see above)
TIMEOUT_S = 30.0  # a polled write's time limit, plus a second per GiB: the engine's own default


class SteeringError(ValueError):
    """A steered call that cannot be steered as asked (bad target, pooled connections)."""


@dataclass
class Transfer:
    """What one steered call did: its lease, the ports it was given, its connections."""

    target: str
    dst: str
    nbytes: int
    dport: int | None = None  # the peer's data port, learnt at the first connection
    lease: Lease | None = None  # the first part's (the only one without ``parts``)
    leases: list[Lease] = field(default_factory=list)  # one per part of the lease
    ports: list[int] = field(default_factory=list)
    # The path each port was handed for (the lease's, or the one a race moved the flow to),
    # and the part of the lease it belongs to.
    port_paths: dict[int, int] = field(default_factory=dict)
    port_parts: dict[int, int] = field(default_factory=dict)
    connections: list[Connection] = field(default_factory=list)
    stats: RuleStats | None = None
    reserve_s: float | None = None
    t0: float = 0.0  # wall-clock time the call began and ended (time.time())
    t1: float = 0.0
    error: str | None = None  # why (part of) it went out unsteered
    # The lease's parts as they stood when the call ended: another path than in ``leases``
    # means the table re-pathed that part (a race lost) while its connections stayed put.
    finals: list[Lease] = field(default_factory=list)

    @property
    def repathed(self) -> bool:
        return any(f.path != le.path for f, le in zip(self.finals, self.leases, strict=False))

    def connection_parts(self) -> list[int | None]:
        """The part of the lease each connection used (None: it went out unbound)."""
        return [self.port_parts.get(c.sport) if c.steered else None for c in self.connections]

    @property
    def steered(self) -> bool:
        """Every connection of the call was bound to a port of its leased path."""
        return bool(self.connections) and all(c.steered for c in self.connections) and self.error is None

    @property
    def ecmp(self) -> bool:
        """The lease reserved nothing (every path busy): the connections were left to ECMP."""
        return bool(self.leases) and not any(le.reserved for le in self.leases)


def pool_enabled(env: Mapping[str, str] | None = None) -> bool:
    """Whether Mooncake's TCP transport may pool connections (unset counts as pooled: 0.3.13's
    default, though not 0.3.12's)."""
    v = (os.environ if env is None else env).get(POOL_ENV)
    return v is None or v.lower() not in ("0", "false", "no")


def parse_target(target: Any) -> tuple[str, int]:
    """``"host:port"`` (Mooncake's session name) -> (IPv4 address, handshake port)."""
    if not isinstance(target, str) or target.count(":") != 1:
        raise SteeringError(f"target_hostname: expected 'HOST:PORT'; got {target!r}")
    host, port_s = target.split(":")
    if not port_s.isdigit() or not 1 <= int(port_s) <= 0xFFFF:
        raise SteeringError(f"target_hostname: port must be 1..65535; got {target!r}")
    try:
        ip = str(ipaddress.IPv4Address(host))
    except ValueError:
        try:
            ip = socket.gethostbyname(host)
        except OSError:
            raise SteeringError(f"target_hostname: {host!r} is neither an IPv4 address nor a resolvable name") from None
    return ip, int(port_s)


def hanging_release() -> str | None:
    """The installed Mooncake wheel's version when it is one of :data:`HANGING`."""
    for dist in ("mooncake-transfer-engine-non-cuda", "mooncake-transfer-engine"):
        try:
            version = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
        return version if version in HANGING else None
    return None


def _byte_count(lengths: Sequence[Any]) -> int:
    if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in lengths):
        raise SteeringError("lengths: expected integers >= 0")
    return sum(lengths)


def polled_write(engine: Any, target_hostname: str, buffers: Sequence[int], peer_buffer_addresses: Sequence[int],
                 lengths: Sequence[int], transport_hint: str = "", poll_s: float = 0.002) -> int:
    """A batch written as a Mooncake engine's synchronous call writes it (0, or -1 when a
    request failed or the time ran out), without its busy wait: each request submitted on
    its own from this thread, then all checked every ``poll_s`` seconds. It returns only
    once no request still reads the caller's buffers, or when the time limit (the engine's
    30 s plus a second per GiB) is over, as the engine's own call does."""
    if not len(buffers) == len(peer_buffer_addresses) == len(lengths):
        log.error("polled write: buffers, peer_buffer_addresses and lengths differ in length")
        return -1
    deadline = time.monotonic() + TIMEOUT_S + _byte_count(lengths) / 2**30
    pending, failed = [], False
    for buf, peer, n in zip(buffers, peer_buffer_addresses, lengths, strict=True):
        batch = int(engine.transfer_submit_write(target_hostname, buf, peer, n, transport_hint))
        if batch == 0:  # the engine's failure sentinel: nothing in flight for this request
            failed = True
            break
        pending.append(batch)
    while pending:
        # 1 done, 0 in flight, -1 failed, -2 timed out (left to the engine, as its own call does)
        states = [int(engine.transfer_check_status(b)) for b in pending]
        failed = failed or any(st < 0 for st in states)
        pending = [b for b, st in zip(pending, states, strict=True) if st == 0]
        if pending and time.monotonic() > deadline:
            log.error("polled write to %s: %d requests not done after the time limit", target_hostname, len(pending))
            return -1
        if pending:
            time.sleep(poll_s)
    return -1 if failed else 0


def _ports_exhausted(t: Transfer) -> str:
    """Why connections of a reserved transfer went out unbound: every port the agent could
    give was held on this host (each closed connection keeps its port in TIME_WAIT for 60 s)."""
    assert t.stats is not None and t.lease is not None
    return (f"{t.stats.fallback} of {len(t.connections)} connections went out unsteered: all {len(t.ports)} ports "
            f"of path {t.lease.path} the agent could give were in use on this host (TIME_WAIT); a path sustains "
            "about its port count / 60 connections per second towards one peer's data port, so probe more "
            "source ports (a wider port range or a larger sample)")


class SteeredTransferEngine:
    """A drop-in for ``mooncake.engine.TransferEngine`` whose writes take ARK leases.

    ``hosts`` maps a peer's data address (what its ``target_hostname`` names) to its name in
    the cluster file; ``agent`` is the local agent's API endpoint. A transfer first asks for
    one port per connection it expects; when every port it holds is taken (still in TIME_WAIT
    from an earlier transfer), it asks for ``spare`` more than the connections still expected.

    ``parts``: each transfer takes a multi-path lease of that many parts (0: the agent's
    size-aware choice) and its connections go to the reserved parts round-robin, each on a
    port of its part's path; None: one path for all of a transfer's connections.

    ``agent`` None observes only: no lease, connections left to the engine, and each call
    still recorded (the control of an experiment). ``on_transfer`` is called with each
    call's :class:`Transfer` once it has ended and its lease is released.

    ``poll_s`` (0 .. 0.1): 0 leaves synchronous writes to the engine; above 0 they are
    polled writes that sleep that long between status checks (module docstring).
    """

    def __init__(self, engine: Any = None, *, agent: str | None, hosts: Mapping[str, str], spare: int = 4,
                 timeout_s: float = 5.0, parts: int | None = None, poll_s: float = 0.0,
                 on_transfer: Callable[[Transfer], None] | None = None) -> None:
        if POOL_ENV not in os.environ:
            os.environ[POOL_ENV] = "0"  # one connection per request, from the submitting thread
        if pool_enabled():
            raise SteeringError(f"{POOL_ENV}: pooled connections are kept per peer and outlive every transfer, so a "
                                "lease cannot steer them; unset it (one connection per request) or use TransferEngine")
        if isinstance(spare, bool) or not isinstance(spare, int) or not 0 <= spare <= 256:
            raise SteeringError(f"spare: expected an integer 0..256; got {spare!r}")
        if parts is not None and (isinstance(parts, bool) or not isinstance(parts, int)
                                  or not 0 <= parts <= MAX_SPLIT_PARTS):
            raise SteeringError(f"parts: expected None or an integer 0..{MAX_SPLIT_PARTS}; got {parts!r}")
        if isinstance(poll_s, bool) or not isinstance(poll_s, int | float) or not 0 <= poll_s <= 0.1:
            raise SteeringError(f"poll_s: expected seconds 0..0.1; got {poll_s!r}")
        if (version := hanging_release()) is not None:
            log.warning("mooncake-transfer-engine %s: its writes with one connection per request hang under "
                        "concurrent writes (a data race on a session's progress timer); install 0.3.12.post1", version)
        self.parts, self.poll_s = parts, float(poll_s)
        self.hosts = {str(ipaddress.IPv4Address(ip)): str(name) for ip, name in hosts.items()}
        require()  # the interposer must be loaded, or nothing could be steered
        if engine is None:
            from mooncake.engine import TransferEngine

            engine = TransferEngine()
        self.engine = engine
        self.agent, self.spare, self.timeout_s, self.on_transfer = agent, spare, timeout_s, on_transfer
        # Shared by the calling threads (it locks); none when only observing.
        self._client = ArkClient(agent, timeout_s) if agent is not None else None
        self.observing = agent is None  # True: later calls take no lease (an experiment's control)
        self._local = threading.local()

    @classmethod
    def from_cluster(cls, cluster_path: str, host: str, engine: Any = None, **kw: Any) -> SteeredTransferEngine:
        """The agent of ``host`` and every fabric host's address, from a cluster file."""
        from ark.agent.cluster import load

        cl = load(cluster_path)
        me = cl.host(host)
        return cls(engine, agent=me.api, hosts={cl.fabric.hosts[h.index].ip: h.name for h in cl.hosts}, **kw)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)  # every other engine call, unchanged

    def last_transfer(self) -> Transfer | None:
        """This thread's last steered call."""
        t: Transfer | None = getattr(self._local, "last", None)
        return t

    # ------------------------------------------------------------------ steering
    @contextlib.contextmanager
    def steer(self, target_hostname: str, nbytes: int, connections: int = 1) -> Iterator[Transfer]:
        """Engine calls of this thread inside the block: their data connections to the
        target take ports of a path reserved for ``nbytes`` (with ``parts``, of the parts'
        paths in turn; lease renewed, released at exit). While ``observing``, the
        connections are only recorded."""
        ip, rpc_port = parse_target(target_hostname)
        dst = self.hosts.get(ip)
        if dst is None and (self.observing or self._client is None):
            dst = ip  # only observing: no lease to name the peer in
        if dst is None:
            raise SteeringError(f"target_hostname: {ip} is not a cluster host's data address "
                                f"(known: {', '.join(sorted(self.hosts)) or 'none'})")
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
            raise SteeringError(f"nbytes: expected an integer >= 0; got {nbytes!r}")
        t = Transfer(target_hostname, dst, nbytes, t0=time.time())
        try:
            with self._steering(t, ip, rpc_port, connections):
                yield t
        finally:
            if self.on_transfer is not None:
                try:
                    self.on_transfer(t)
                except Exception:  # a recorder's failure must not fail the transfer
                    log.exception("on_transfer failed")

    @contextlib.contextmanager
    def _steering(self, t: Transfer, ip: str, rpc_port: int, connections: int) -> Iterator[Transfer]:
        target_hostname, nbytes = t.target, t.nbytes
        client = None if self.observing else self._client
        with contextlib.ExitStack() as stack:
            hint = max(1, min(connections, 4096))
            if client is None:
                rule = Rule(ip, skip_port=rpc_port, steer=False, hint=hint)
            else:
                rule = Rule(ip, skip_port=rpc_port, hint=hint,
                            resolver=lambda dport, need: self._ports(t, client, stack, dport, need))
            try:
                with rule:
                    yield t
            finally:
                t.t1 = time.time()
                t.connections, t.stats = rule.connections(), rule.stats()
                if not t.connections and nbytes > 0 and t.error is None and rule.resolver_error is None:
                    t.error = (f"no connection to {ip} was opened from this thread: the engine reused one "
                               f"(pooled connections: {POOL_ENV} was set after it initialized?)")
                if rule.resolver_error is not None:
                    t.error = f"{type(rule.resolver_error).__name__}: {rule.resolver_error}"
                    log.warning("transfer to %s went out unsteered: %s", target_hostname, t.error)
                elif t.error is None and t.lease is not None and t.lease.reserved and t.stats.fallback:
                    t.error = _ports_exhausted(t)
                    log.warning("transfer to %s went out partly unsteered: %s", target_hostname, t.error)
                rule.close()
                self._local.last = t
                with contextlib.suppress(ArkClientError):
                    t.finals = [client.current(le.flow_id) for le in t.leases] if client is not None else []
            # leaving the stack stops the renewer and releases the lease

    def _ports(self, t: Transfer, client: ArkClient, stack: contextlib.ExitStack, dport: int, need: int) -> Laned:
        """The rule's resolver: lease on the first data connection, then more ports.

        The ports come interleaved across the lease's reserved parts (part 0, part 1, ...,
        part 0, ...), each with its part's lane, so that the interposer puts the
        connections on the parts round-robin, and one whose port is held (TIME_WAIT) on
        another port of the same part."""
        first_call = not t.leases
        if first_call:  # the lease, with each part's ports for its share of the connections, in one round trip
            t0 = time.perf_counter()
            t.dport = dport
            held = stack.enter_context(client.lease(t.dst, t.nbytes, dport, parts=self.parts,  # renewed until exit
                                                    connections=min(need, MORE_PORTS_MAX)))
            t.leases = list(held.parts) if isinstance(held, HeldSplit) else [held.current]  # as reserved
            t.lease = t.leases[0]
            t.reserve_s = time.perf_counter() - t0
            # A part that reserved nothing has no ports: when none did (every path taken),
            # plain ECMP, which for several connections means each hashed on its own (one
            # port of one random path would pile them up).
            columns = [(k, t.leases[k].path, held.ports[k]) for k, le in enumerate(t.leases) if le.reserved]
        else:  # every port so far is held (TIME_WAIT): more, with spares
            live = [k for k, le in enumerate(t.leases) if le.reserved]
            per = -(-(need + self.spare) // max(1, len(live)))
            columns = [(k, *client.more_ports(t.leases[k].flow_id, per)) for k in live]
        for k, path, column in columns:
            t.port_paths.update(dict.fromkeys(column, path))
            t.port_parts.update(dict.fromkeys(column, k))
        lane_of = {k: lane for lane, (k, _p, _c) in enumerate(columns)}
        ports = [p for row in itertools.zip_longest(*(c for _k, _p, c in columns)) for p in row if p is not None]
        t.ports += ports
        return Laned(ports, [lane_of[t.port_parts[p]] for p in ports])

    # ------------------------------------------------------------------ drop-in calls
    def transfer_sync_write(self, target_hostname: str, buffer: int, peer_buffer_address: int, length: int,
                            transport_hint: str = "") -> int:
        with self.steer(target_hostname, _byte_count([length]), 1):
            if self.poll_s > 0:
                return polled_write(self.engine, target_hostname, [buffer], [peer_buffer_address], [length],
                                    transport_hint, self.poll_s)
            return int(self.engine.transfer_sync_write(target_hostname, buffer, peer_buffer_address, length,
                                                       transport_hint))

    def batch_transfer_sync_write(self, target_hostname: str, buffers: list[int], peer_buffer_addresses: list[int],
                                  lengths: list[int], transport_hint: str = "") -> int:
        with self.steer(target_hostname, _byte_count(lengths), len(lengths)):
            if self.poll_s > 0:
                return polled_write(self.engine, target_hostname, buffers, peer_buffer_addresses, lengths,
                                    transport_hint, self.poll_s)
            return int(self.engine.batch_transfer_sync_write(target_hostname, buffers, peer_buffer_addresses, lengths,
                                                             transport_hint))

    def transfer_sync(self, target_hostname: str, buffer: int, peer_buffer_address: int, length: int, opcode: Any,
                      notify: Any = None, transport_hint: str = "") -> int:
        args = (target_hostname, buffer, peer_buffer_address, length, opcode, notify, transport_hint)
        if opcode != self.engine.TransferOpcode.Write:
            return int(self.engine.transfer_sync(*args))
        with self.steer(target_hostname, _byte_count([length]), 1):
            return int(self.engine.transfer_sync(*args))

    def batch_transfer_sync(self, target_hostname: str, buffers: list[int], peer_buffer_addresses: list[int],
                            lengths: list[int], opcode: Any, notify: Any = None, transport_hint: str = "") -> int:
        args = (target_hostname, buffers, peer_buffer_addresses, lengths, opcode, notify, transport_hint)
        if opcode != self.engine.TransferOpcode.Write:
            return int(self.engine.batch_transfer_sync(*args))
        with self.steer(target_hostname, _byte_count(lengths), len(lengths)):
            return int(self.engine.batch_transfer_sync(*args))
