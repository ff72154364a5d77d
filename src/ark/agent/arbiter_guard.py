"""The arbiter's connections, shared out per listed host.

An agent's :class:`~ark.agent.sockets.ConnectionGuard` judges a connection by its address
when it is accepted; at the arbiter every listed host and arbiter has a share of its own,
counted once the connection has said who it is:

* a connection is *pending* from its accept until its first message, whose sender the
  CURVE handshake proved (the ZAP handler stamps the sender's key on every message, and
  ZeroMQ names the descriptor it came in on). Pending connections are capped per address
  (:data:`PENDING_PER_ADDRESS`; addresses no listed host or arbiter has share
  :data:`~ark.agent.sockets.STRANGERS` between them), a new one closes the oldest of
  its address beyond that, and none lives past :data:`PENDING_S` (agents say hello on
  every new connection): keyless TCP, handshakes that go nowhere and silent keys crowd
  out only their own address's, and only for a while;
* a connection that has spoken counts against its sender's share
  (:data:`PER_SENDER`); a sender's connection beyond it closes that sender's oldest, so
  one host holding hundreds of connections holds only its own share;
* the whole budget (the agents' one) is kept by closing the oldest pending connection.

The arbiter handles each wakeup's messages before its accept events, so a connection
that has spoken is its sender's before any later accept can close it as a silent one.
"""

from __future__ import annotations

import time
from collections import OrderedDict

import zmq

from ark.agent.sockets import STRANGERS, ConnectionGuard, _peer_ip

PER_SENDER = 4  # connections one listed host (or arbiter) keeps open at once
PENDING_PER_ADDRESS = 16  # connections from one listed address that have not said who they are
PENDING_S = 5.0  # how long a connection may stay silent (the handshake alone may take 2 s)


class SharedGuard(ConnectionGuard):
    """:class:`ConnectionGuard` with per-sender shares (see the module docstring)."""

    def __init__(self, sock: zmq.Socket, budget: int, listed_ips: set[str]) -> None:
        super().__init__(sock, budget, listed_ips)
        # fd -> its pool (an address, or "" for strangers) and when it was accepted, oldest first
        self._pending: OrderedDict[int, tuple[str, float]] = OrderedDict()
        self._owner: dict[int, object] = {}  # fd -> the sender that spoke on it
        self._of: dict[object, OrderedDict[int, None]] = {}  # sender -> its fds, oldest first
        self.shed_pending = 0
        self.shed_sender = 0

    def drain(self, limit: int = 4096) -> None:
        for event, fd in self.events(limit):
            if event == zmq.EVENT_DISCONNECTED:
                self._forget(fd)
            elif fd not in self._owner:  # a message may have come in (and named it) before its accept
                self._accepted(fd)

    def _accepted(self, fd: int) -> None:
        self._forget(fd)
        ip = _peer_ip(fd)
        pool = ip if ip in self.listed_ips else ""
        cap = PENDING_PER_ADDRESS if pool else STRANGERS
        same = [f for f, (p, _) in self._pending.items() if p == pool]  # oldest first
        if len(same) >= cap:
            self._close(same[0])
            self.shed_pending += 1
        if len(self._pending) + len(self._owner) >= self.budget:
            if not self._pending:  # every share is full (a budget below the shares): the new one waits
                self._shed(fd)
                return
            self._close(next(iter(self._pending)))
            self.shed_pending += 1
        self._pending[fd] = (pool, time.monotonic())
        self.open[fd] = not pool

    def expire(self, now: float) -> None:
        """Close the connections silent for longer than :data:`PENDING_S` (``now``: monotonic)."""
        while self._pending:
            fd, (_, since) = next(iter(self._pending.items()))
            if now - since < PENDING_S:
                return
            self._close(fd)
            self.shed_pending += 1

    def spoke(self, fd: int, sender: object) -> None:
        """A message from ``sender`` (its key authenticated) came in on descriptor ``fd``."""
        owner = self._owner.get(fd)
        if owner == sender:
            return
        if owner is not None:  # the descriptor was another's: that connection's end first
            self.drain()
        # Not drained otherwise: accepts that came after it must not close it now that it
        # has spoken (its accept, if not seen yet, is passed over when it comes).
        self._forget(fd)
        self._owner[fd] = sender
        self.open[fd] = False
        fds = self._of.setdefault(sender, OrderedDict())
        fds[fd] = None
        if len(fds) > PER_SENDER:
            self._close(next(iter(fds)))
            self.shed_sender += 1

    def _close(self, fd: int) -> None:
        self._forget(fd)
        self._shed(fd)

    def _forget(self, fd: int) -> None:
        self.open.pop(fd, None)
        self._pending.pop(fd, None)
        sender = self._owner.pop(fd, None)
        if sender is not None:
            fds = self._of[sender]
            fds.pop(fd, None)
            if not fds:
                del self._of[sender]

    def counts(self) -> dict[str, int]:
        return {"pending": len(self._pending), "spoken": len(self._owner), "shed_pending": self.shed_pending,
                "shed_sender": self.shed_sender, "shed": self.shed}
