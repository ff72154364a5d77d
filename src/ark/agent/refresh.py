"""Path refresh by probing, off the agent's main loop.

Probing waits on ICMP answers, so it runs in a worker thread; its result goes into a
queue and a byte on a pipe wakes the main loop, which reloads the maps and re-paths
(:meth:`ark.agent.daemon.Agent.finish_refresh`). A periodic check (``probe_check_s``)
re-probes a few known ports and refreshes only the peers whose map no longer holds.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from typing import Any

from ark.agent.cluster import Cluster
from ark.agent.probe import check as probe_check
from ark.agent.probe import load_routers, refresh

Result = tuple[bytes | None, dict[str, Any]]


class PathRefresher:
    """One probe job at a time; finished jobs wait in :meth:`results` for the main loop."""

    def __init__(self, cluster: Cluster, host: str) -> None:
        self.cluster, self.host = cluster, host
        # Read once: the periodic check would otherwise re-read it every probe_check_s.
        self._routers = load_routers(cluster.routers_file) if cluster.routers_file else None
        self._thread: threading.Thread | None = None
        self._done: queue.SimpleQueue[Result] = queue.SimpleQueue()
        self.wake_r, self._wake_w = os.pipe()
        os.set_blocking(self.wake_r, False)
        self.next_check = time.time() + cluster.probe_check_s if cluster.probe_check_s else float("inf")
        self.refreshes = 0  # path maps re-probed and reloaded
        self.detected = 0  # of those, started by the periodic check
        self.check_probes = 0
        self.refresh_probes = 0
        self.repathed = 0
        self.last_refresh: float | None = None

    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self, rid: bytes | None, peers: list[str] | None, check: bool = False) -> None:
        """Probe in the worker. ``check``: re-probe a few ports first, refresh only the
        peers whose map no longer holds (nobody waits for an answer)."""
        if self.busy():
            raise ValueError("refresh: one is already running")
        if self.cluster.routers_file is None:
            raise ValueError("refresh: the cluster file has no routers_file to probe with")
        self._thread = threading.Thread(target=self._work, args=(rid, peers, check), name="ark-refresh", daemon=True)
        self._thread.start()

    def maybe_check(self, now: float) -> None:
        """Start the periodic check when it is due and nothing else is probing."""
        if now < self.next_check:
            return
        self.next_check = now + self.cluster.probe_check_s
        if not self.busy():
            self.start(None, None, check=True)

    def _work(self, rid: bytes | None, peers: list[str] | None, check: bool) -> None:
        res: dict[str, Any]
        try:
            todo = peers
            if check:
                todo, sent = probe_check(self.cluster, self.host, seed=int(time.time() * 1000), routers=self._routers)
                self.check_probes += sent
                if not todo:
                    return
            res = {"ok": True, "probed": refresh(self.cluster, self.host, todo, self._routers), "detected": check}
        except Exception as e:  # reported to the caller, never fatal to the agent
            res = {"ok": False, "error": f"refresh: {e}"}
        self._done.put((rid, res))
        os.write(self._wake_w, b"x")

    def results(self) -> list[Result]:
        try:
            while os.read(self.wake_r, 512):
                pass
        except BlockingIOError:
            pass
        out = []
        while not self._done.empty():
            out.append(self._done.get())
        return out

    def applied(self, res: dict[str, Any]) -> None:
        self.refreshes += 1
        self.refresh_probes += sum(int(v["probes_sent"]) for v in res["probed"].values())
        self.detected += bool(res.get("detected"))
        self.last_refresh = time.time()

    def counters(self) -> dict[str, Any]:
        return {"refreshes": self.refreshes, "detected": self.detected, "repathed": self.repathed,
                "check_probes": self.check_probes, "refresh_probes": self.refresh_probes,
                "last_refresh": self.last_refresh}

    def close(self) -> None:
        for fd in (self.wake_r, self._wake_w):
            os.close(fd)
