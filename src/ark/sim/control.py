"""The simulator's control planes: one interface, one class per control mode.

The event loop (:class:`ark.sim.engine.FluidSim`) schedules, the network
(:class:`ark.sim.maxmin.FairShares`) shares, and a control plane decides where the ARK
schemes' flows go. Every control plane answers the same calls:

* :meth:`ControlPlane.ask`: a KV flow arrived at its host. The control plane decides
  (now, or after a request round trip) and starts the flow through
  :meth:`Loop.start` with one :class:`Part` per sub-flow;
* :meth:`ControlPlane.on_event`: one of its own events, scheduled with
  :meth:`Loop.control_at`, is due;
* :meth:`ControlPlane.done`: a flow finished;
* :meth:`ControlPlane.rebuild`: the hosts rebuild their path maps after a link failure;
* :meth:`ControlPlane.holds`: does a sub-flow hold a reservation now;
* :meth:`ControlPlane.counters`: what the run's records report of it.

The modes: every host on a replica, hearing the others' messages a one-way delay late
(:class:`ark.sim.broadcast_control.BroadcastControl`, ``broadcast``), one arbiter that
every host asks (:class:`ark.sim.arbiter_control.ArbiterControl`, ``arbiter``), and
:class:`NoControl` for the schemes that have none. A new mode is one more class here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple, Protocol

from ark.core.flows import FlowSpec
from ark.core.messages import FlowId
from ark.core.protocol import Repath
from ark.sim.transfer import Transfer

CONTROLS = ("broadcast", "arbiter")


class Part(NamedTuple):
    """One sub-flow as its host starts it."""

    flow: FlowId  # the control plane's id of it
    path: int  # the path the control plane expects the switches to send the port over (-1: none)
    port: int
    reserved: bool
    fallback: bool  # no free path: shared (ark-balance, ark-split) or plain ECMP; as a core counts it


class Counters(NamedTuple):
    """What a control plane reports at the end of a run."""

    races: int
    messages: int  # messages (broadcast) or requests (arbiter) the hosts sent
    by_host: list[int]
    delay_mean_s: float  # one-way delay the control messages met
    delay_max_s: float
    events: int  # its events the loop handed it (those it counts: a superseded timer is not one)
    rebuild_repathed: int = 0
    rtt_s: float = 0.0  # arbiter: the request round trip


class Loop(Protocol):
    """What a control plane may ask of the simulation it decides for."""

    @property
    def now(self) -> float:
        """The simulated instant."""
        ...

    @property
    def pending(self) -> int:
        """Flows not finished yet (a timer is armed only while some remain)."""
        ...

    def control_at(self, t: float, ev: object) -> None:
        """Hand ``ev`` back to :meth:`ControlPlane.on_event` at ``t``."""
        ...

    def control_due(self, same: Callable[[object], bool]) -> list[object]:
        """Take the control plane's further events due now, from the head of the heap,
        while ``same`` holds for them (messages arriving at one instant, as one batch)."""
        ...

    def start(self, f: FlowSpec, parts: Sequence[Part]) -> Transfer:
        """The flow starts now on these parts (the switches hash each port)."""
        ...

    def repath(self, moves: Sequence[tuple[Transfer, int, Repath]]) -> bool:
        """Sub-flows whose port or reservation a race changed; True if any moved."""
        ...

    def replace(self, t: Transfer, k: int, part: Part) -> None:
        """Sub-flow ``k`` of ``t`` now goes as ``part`` (reserved again after a rebuild)."""
        ...

    def mismatch(self) -> None:
        """Count a reserved sub-flow that the switches send elsewhere."""
        ...

    def control_delay(self, src: int, dst: int) -> float:
        """In-band control: the one-way delay from ``src`` to ``dst`` across the data's queues now."""
        ...


class ControlPlane(Protocol):
    """Who decides for the ARK schemes (see the module docstring)."""

    name: str

    def ask(self, f: FlowSpec, now: float) -> None: ...

    def on_event(self, ev: object, now: float) -> None: ...

    def done(self, t: Transfer, now: float) -> None: ...

    def rebuild(self, now: float) -> None: ...

    def holds(self, flow: FlowId) -> bool: ...

    def counters(self) -> Counters: ...


class NoControl:
    """The schemes without a control plane (ECMP, spraying, the baselines): nothing to decide."""

    name = "none"

    def __init__(self, n_hosts: int, delay_s: float) -> None:
        self._n, self._delay = n_hosts, delay_s

    def ask(self, f: FlowSpec, now: float) -> None:
        raise AssertionError("a scheme without a control plane asks nobody")

    def on_event(self, ev: object, now: float) -> None:
        raise AssertionError("a scheme without a control plane schedules nothing")

    def done(self, t: Transfer, now: float) -> None:
        pass

    def rebuild(self, now: float) -> None:
        pass

    def holds(self, flow: FlowId) -> bool:
        return False

    def counters(self) -> Counters:
        return Counters(0, 0, [0] * self._n, self._delay, self._delay, 0)
