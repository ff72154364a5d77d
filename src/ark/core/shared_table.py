"""One reservation table for every simulated host: the simulator's core (no agent uses it).

Replicas that hold the same messages hold the same table (:mod:`ark.core.protocol`: the
table is a pure function of the messages a replica holds). A simulator whose every host
receives every message after the same delay can therefore give all hosts one
:class:`~ark.core.table.ReservationTable` that receives each message once, at its
delivery: that table is exactly what every host holds *except* its own messages still on
their way to the others.

A :class:`SharedTableCore` keeps those (``pending``) and judges its decisions and its own
pending reservations against "the table plus my pending messages" (its *overlay*), with
the same rules (:meth:`ReservationTable.assign`) and the same key order, so each host
decides and re-paths exactly as it would with a private replica, at the same instants.
The owner of the table tells the sender when its message has reached the table
(:meth:`SharedTableCore.delivered`) and every host whose flows a table change touched
(:meth:`~ark.core.protocol.ArkCore.sync`, :meth:`SharedTableCore.resync`). Such a core
takes no leases, receives no messages and has no timers of its own: the table's owner
ticks the table.
"""

from __future__ import annotations

from collections.abc import Callable

from ark.core.messages import FlowId, Key, Message, Release, Reserve
from ark.core.protocol import ArkCore, CoreError, PathMaps, Released, Repath
from ark.core.table import INF, Entry, ReservationTable, backlog

__all__ = ["SharedTableCore"]


class SharedTableCore(ArkCore):
    """One host's core on a table it shares with every other host's core (see the module docstring)."""

    def __init__(
        self, host: int, table: ReservationTable, pathmaps: PathMaps, *, seed: int = 0,
        max_idle_peers: int | None = None,
    ) -> None:
        self._shared_table = table  # handed back by _new_table during ArkCore.__init__
        super().__init__(host, table.routes, pathmaps, policy=table.policy, seed=seed,
                         retention_s=table.retention_s, expiry_grace_s=table.expiry_grace_s,
                         max_idle_peers=max_idle_peers, limits=table.limits)
        # Our messages the table has not received yet, and our view of the reservations among them.
        self._pending: list[Message] = []
        self._overlay: dict[FlowId, Entry] = {}

    def _new_table(self, retention_s: float, expiry_grace_s: float, bookkeeping_grid: bool) -> ReservationTable:
        return self._shared_table

    # ------------------------------------------------------------------ what the table's owner calls
    def delivered(self, msg: Message) -> list[Repath]:
        """The shared table has received our pending message ``msg``."""
        try:
            self._pending.remove(msg)
        except ValueError:
            raise CoreError(f"delivered: {msg!r} is not a pending message of this core") from None
        events: list[Repath] = []
        if isinstance(msg, Reserve):
            del self._overlay[msg.flow]
            events.extend(self._sync_own(msg.flow))
        events.extend(self.resync())
        return events

    @property
    def pending(self) -> int:
        """Messages of ours the shared table has not received yet."""
        return len(self._pending)

    def resync(self) -> list[Repath]:
        """Judge our pending reservations again against the table plus our pending messages
        (after the table changed); report the local flows that moved."""
        events: list[Repath] = []
        for m in self._pending:
            if isinstance(m, Reserve):
                e = self._overlay[m.flow]
                e.path, e.shared = self._table.assign(m, self._held_before(m))
                e.held = e.path is not None
                events.extend(self._sync_own(m.flow))
        return events

    # ------------------------------------------------------------------ what differs from a replica
    def _record_reserve(self, msg: Reserve) -> list[Repath]:
        self._pending.append(msg)
        self._overlay[msg.flow] = Entry(msg, expires=msg.expires)
        return self.resync()

    def _record_release(self, msg: Release) -> Released:
        self._pending.append(msg)
        return Released((msg,), tuple(self.resync()))

    def receive(self, msg: Message, now: float, sender: int | None = None, *, defer: bool = False) -> list[Repath]:
        raise CoreError("receive: this core shares its table; the table receives the messages")

    def unreserve(self, flow: FlowId, now: float) -> Released:
        raise CoreError("unreserve: not on a shared table")

    def tick(self, now: float) -> list[Repath]:
        return []  # no timers of its own: the table's owner ticks the table

    def next_deadline(self) -> float:
        return INF

    def _settle(self) -> None:
        pass  # the table's owner settles it and tells each core itself

    # ------------------------------------------------------------------ the overlay
    def _entry(self, flow: FlowId) -> Entry | None:
        e = self._overlay.get(flow) if self._overlay else None
        return e if e is not None else self._table.get(flow)

    def _lowest_free(self, dst: int, n: int, usable: int, now: float) -> int | None:
        if not self._pending:  # the table is our whole view: its stage masks answer
            return super()._lowest_free(dst, n, usable, now)
        stages = self._table.stage_list(self.host, dst)
        key = (now, self.host, self._seq + 1)  # after everything we sent
        for k in range(n):
            if usable >> k & 1 and not any(self._view_held(st[k], key, now) for st in stages):
                return k
        return None

    def _held_before(self, m: Reserve) -> Callable[[int], bool]:
        return lambda lk: self._view_held(lk, m.key, m.ts)

    def _gone_at(self, ts: float) -> set[FlowId]:
        """Our flows whose pending RELEASE says they hold nothing at ``ts``."""
        return {m.flow for m in self._pending if isinstance(m, Release) and m.ts <= ts}

    def _view_held(self, lk: int, key: Key, ts: float) -> bool:
        """Is ``lk`` held at ``ts`` by a smaller key than ``key``, in the table plus our pending messages?"""
        gone = self._gone_at(ts)
        table = self._table
        for g in table.holders(lk):
            e = table.get(g)
            if e is not None and e.msg.key < key and e.end > ts and g not in gone:
                return True
        for f, e in self._overlay.items():
            if e.path is not None and e.msg.key < key and f not in gone and lk in table.links(e.msg, e.path):
                return True
        return False

    def _view_backlog(self, lk: int, now: float) -> float:
        if not self._pending:
            return super()._view_backlog(lk, now)
        gone = self._gone_at(now)
        msgs = [e.msg for g in self._table.holders(lk) if g not in gone and (e := self._table.get(g)) is not None]
        msgs += [e.msg for f, e in self._overlay.items()
                 if e.path is not None and f not in gone and lk in self._table.links(e.msg, e.path)]
        return backlog(msgs, now)
