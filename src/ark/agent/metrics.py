"""Prometheus view of an agent: the node's counters and RESERVE propagation latency."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5, 1.0)


class Collector:
    """A custom collector: read at scrape time, nothing kept per message."""

    def __init__(self, agent: Any) -> None:
        self.agent = agent

    def collect(self) -> Iterable[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

        node = self.agent.node
        c, n = node.core.counters, node.counters
        host = self.agent.me.name
        for name, value, doc in (
            ("ark_reservations", c.reserved, "reservations made by this host"),
            ("ark_requests", c.requests, "path requests from local engines"),
            ("ark_races_lost", c.races_lost, "local flows re-pathed after a race"),
            ("ark_fallbacks", c.fallbacks, "requests that found no free path"),
            ("ark_renewals", c.renewals, "lease renewals applied"),
            ("ark_expired", c.expired, "reservations whose lease ran out"),
            ("ark_invalid_messages", n.invalid + c.invalid, "malformed or unauthorised peer messages dropped"),
            ("ark_wrong_version_messages", n.wrong_version, "peer messages of another wire version dropped"),
            ("ark_dropped_messages", n.dropped + c.duplicates + c.stale, "duplicate or stale peer messages dropped"),
            ("ark_unsent_messages", self.agent.dropped_out, "messages not sent: a peer's queue was full"),
            ("ark_sequence_gaps", n.gaps, "gaps in a peer's sequence numbers"),
            ("ark_syncs_applied", n.sync_applied, "table resynchronisations applied"),
        ):
            m = CounterMetricFamily(name, doc, labels=["host"])
            m.add_metric([host], value)
            yield m
        g = GaugeMetricFamily("ark_reserved_links", "links this host's table holds", labels=["host"])
        g.add_metric([host], len(node.core.link_holders()))
        yield g
        samples = list(node.propagation_s)
        buckets = [(str(b), sum(1 for s in samples if s <= b)) for b in BUCKETS]
        buckets.append(("+Inf", len(samples)))
        h = HistogramMetricFamily("ark_reserve_propagation_seconds", "RESERVE ts to arrival here", labels=["host"])
        h.add_metric([host], buckets, sum_value=math.fsum(samples))
        yield h


def registry(agent: Any) -> Any:
    from prometheus_client import CollectorRegistry

    reg = CollectorRegistry()
    reg.register(Collector(agent))
    return reg
