"""Prometheus metrics of one node (prometheus-client).

Each node gets its own registry, so several nodes in one process (tests)
don't collide; pool gauges are read at scrape time from the pools
themselves rather than kept in step by hand.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily


class HasNamespaces(Protocol):
    """What the pool collector reads of a node (``kvstore.node.Node``)."""

    namespaces: Mapping[str, Any]

_LATENCY_BUCKETS = (1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)


class _PoolCollector:
    """Occupancy and eviction counts, read from the pools at scrape time."""

    def __init__(self, node: HasNamespaces) -> None:
        self._node = node

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        slots = GaugeMetricFamily("kvstore_pool_slots", "Page slots by state", labels=["namespace", "state"])
        cap = GaugeMetricFamily("kvstore_pool_capacity_bytes", "Bytes reserved for a namespace", labels=["namespace"])
        evictions = CounterMetricFamily("kvstore_evictions", "Pages evicted, by reason", labels=["namespace", "reason"])
        spec = CounterMetricFamily("kvstore_speculative_pages", "Speculative replicas read (hit) or dropped "
                                   "unread (wasted)", labels=["namespace", "outcome"])
        remote = CounterMetricFamily("kvstore_remote_hit_pages", "Pages Gets found on other nodes and pulled "
                                     "(of kvstore_pages_total{op=\"get\",outcome=\"hit\"})", labels=["namespace"])
        for ns in self._node.namespaces.values():
            pool = ns.pool
            slots.add_metric([ns.name, "total"], pool.num_slots)
            slots.add_metric([ns.name, "used"], pool.used_slots)
            slots.add_metric([ns.name, "pinned"], pool.pinned_slots)
            slots.add_metric([ns.name, "speculative"], pool.speculative_slots)
            cap.add_metric([ns.name], ns.capacity)
            for reason in ("speculative", "lru"):
                evictions.add_metric([ns.name, reason], pool.evictions[reason])
            spec.add_metric([ns.name, "hit"], pool.spec_hits)
            spec.add_metric([ns.name, "wasted"], pool.spec_wasted)
            counters = getattr(ns, "counters", None)
            if counters is not None:
                remote.add_metric([ns.name], counters.remote_hits)
        yield spec
        yield remote
        yield slots
        yield cap
        yield evictions


class _TierCollector:
    """The tiers below the pool (``kvstore.tiers.stack.TierStack``), read at scrape time."""

    _COUNTERS = (("hits", "Pages read from a tier"), ("misses", "Reads that did not find the page in a tier"),
                 ("demotions", "Pages written into a tier (from the pool, or cascaded from the tier above)"),
                 ("promotions", "Pages read from a tier into the pool"),
                 ("drops", "Pages that could not go down into a tier (staging full, tier refused or degraded)"),
                 ("declined", "Pages the pool evicted that were not written down by choice (--tier-admit)"),
                 ("evictions", "Pages a tier evicted (into the next tier, or gone from the last)"),
                 ("corrupt", "Tier records that failed their checksum on read (dropped, never served)"),
                 ("bytes_written", "Bytes a tier wrote, headers and padding included (a disk's wear)"),
                 ("recovered", "Pages a tier found when it opened (kept over a restart)"))

    def __init__(self, node: Any) -> None:
        self._node = node

    def collect(self) -> Iterator[Any]:
        stack = getattr(self._node, "tiers", None)
        if not stack:
            return
        summary = stack.summary()
        gauges = {name: GaugeMetricFamily(f"kvstore_tier_{name}", text, labels=["tier"]) for name, text in (
            ("capacity_bytes", "Bytes a tier may hold"), ("used_bytes", "Bytes of pages a tier holds"),
            ("pages", "Pages a tier holds"), ("staged_bytes", "Evicted bytes waiting in staging memory for their "
                                              "write into the first tier"),
            ("degraded", "1 while a tier stores nothing more (a failed write, its folder removed): see the log"))}
        counters = {name: CounterMetricFamily(f"kvstore_tier_{name}", text, labels=["tier"])
                    for name, text in self._COUNTERS}
        for t in summary:
            for name, family in gauges.items():
                family.add_metric([t["tier"]], float(bool(t["degraded"])) if name == "degraded" else t[name])
            for name, family in counters.items():
                family.add_metric([t["tier"]], t[name])
        yield from gauges.values()
        yield from counters.values()
        for op in ("read", "write"):
            family = HistogramMetricFamily(f"kvstore_tier_{op}_seconds", f"Latency of one page {op} in a tier",
                                           labels=["tier"])
            for level in stack.levels:
                hist = level.counters.reads if op == "read" else level.counters.writes
                buckets, total = [], 0
                for bound, count in zip([*hist.bounds, float("inf")], hist.counts):
                    total += count
                    buckets.append((str(bound) if bound != float("inf") else "+Inf", total))
                family.add_metric([level.name], buckets, hist.total)
            yield family


class _CoordinatorCollector:
    """The predictor's online quality and the planner's state, at scrape time."""

    def __init__(self, coordinator: Any) -> None:
        self._coordinator = coordinator

    def collect(self) -> Iterator[GaugeMetricFamily]:
        stats = self._coordinator.stats()
        quality = GaugeMetricFamily("kvstore_predictor_online", "Online quality of the burst forecast (labels "
                                    "known H seconds later), by scorer and measure", labels=["scorer", "measure"])
        for key, value in stats.get("online", {}).items():
            measure, _, scorer = key.rpartition("_")  # e.g. pr_auc_model -> (pr_auc, model)
            if measure and scorer in ("model", "momentum") and isinstance(value, float):
                quality.add_metric([scorer, measure], value)
        yield quality
        state = GaugeMetricFamily("kvstore_coordinator", "Coordinator state", labels=["what"])
        for key in ("speculative_prefixes", "pending", "bandwidth_bps", "tick_p99_ms", "tracked_prefixes",
                    "labelled_rows", "retrains", "egress_saved_bytes"):
            if isinstance(stats.get(key), (int, float)):
                state.add_metric([key], float(stats[key]))
        yield state
        links = GaugeMetricFamily("kvstore_copy_link_bps", "Copy rate of a node's link measured by the "
                                  "coordinator's copies, by node and direction", labels=["node", "direction"])
        for node, rates in stats.get("links", {}).items():
            links.add_metric([node, "egress"], float(rates["egress_bps"]))
            links.add_metric([node, "ingress"], float(rates["ingress_bps"]))
        yield links
        source = GaugeMetricFamily("kvstore_predictor_source", "1 for the scorer in use (lightgbm or momentum)",
                                   labels=["source"])
        if stats.get("source"):
            source.add_metric([str(stats["source"])], 1.0)
        yield source


class _ClusterCollector:
    """This node's view of the cluster, read from its cluster agent at scrape time."""

    def __init__(self, agent: Any) -> None:
        self._agent = agent

    def collect(self) -> Iterator[GaugeMetricFamily]:
        agent = self._agent
        yield GaugeMetricFamily("kvstore_cluster_members", "Live members in this node's view, itself included",
                                value=len(agent.membership.live_ids()))
        yield GaugeMetricFamily("kvstore_cluster_is_coordinator", "1 on the node that coordinates, else 0",
                                value=1.0 if agent.membership.is_coordinator else 0.0)
        yield GaugeMetricFamily("kvstore_claimed_keys", "Keys under in-flight prefill claims in this node's table",
                                value=len(agent.claims))
        yield GaugeMetricFamily("kvstore_pulls_in_flight", "Pages this node is pulling from peers now",
                                value=agent.replicator.pulls_in_flight)


class NodeMetrics:
    """Operation counters, byte counters and latency histograms."""

    def __init__(self, node: HasNamespaces) -> None:
        self.registry = CollectorRegistry()
        self.ops = Counter("kvstore_operations", "Client operations by result code",
                           ["op", "code"], registry=self.registry)
        self.bytes = Counter("kvstore_page_bytes", "Page bytes moved for clients",
                             ["op", "path"], registry=self.registry)
        self.pages = Counter("kvstore_pages", "Pages by outcome (get: hit/miss; put: stored/present)",
                             ["op", "outcome"], registry=self.registry)
        self.latency = Histogram("kvstore_operation_latency_seconds", "Operation latency at the node",
                                 ["op", "path"], buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.remote_fetch = Histogram("kvstore_remote_fetch_seconds", "Time a Get spent pulling pages from peers",
                                      buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.peer_bytes = Counter("kvstore_peer_bytes", "Page bytes moved between nodes", ["direction"],
                                  registry=self.registry)
        self.checksum_failures = Counter("kvstore_checksum_failures", "Pulled pages that failed their checksum",
                                         registry=self.registry)
        self.decisions = Counter("kvstore_planner_decisions", "Planner decisions by kind (replicate, drop, "
                                 "full, skip_<reason>)", ["kind"], registry=self.registry)
        self.tick_latency = Histogram("kvstore_planner_tick_seconds", "Coordinator planner tick latency "
                                      "(wall time, scoring off the loop included)",
                                      buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.tick_slice = Histogram("kvstore_planner_tick_slice_seconds", "Longest stretch a planner tick "
                                    "(scoring included) held the event loop", buckets=_LATENCY_BUCKETS,
                                    registry=self.registry)
        self.spec_bytes = Counter("kvstore_replication_bytes", "Bytes the coordinator had copied, by kind "
                                  "(speculative, replica for the full policy)", ["kind"], registry=self.registry)
        self.auth_rejected = Counter("kvstore_auth_rejected", "Calls refused for their credentials, by plane "
                                     "(client: token missing, unknown or of too low a role; peer: cluster "
                                     "proof missing, forged, stale or replayed)", ["plane"], registry=self.registry)
        # every label value known ahead is exported from the start (at 0), so that a scraper sees the first
        # copy, decision or refusal as an increase rather than as a series that appeared with it
        for kind in ("speculative", "replica"):
            self.spec_bytes.labels(kind)
        for kind in ("replicate", "drop", "full", "claim_tree", "promote"):
            self.decisions.labels(kind)
        for plane in ("client", "peer"):
            self.auth_rejected.labels(plane)
        self.coordinator_changes = Counter("kvstore_coordinator_changes", "Times the coordinator in this node's "
                                           "view changed (its first election included)", registry=self.registry)
        self.registry.register(_PoolCollector(node))
        self.registry.register(_TierCollector(node))

    def watch_coordinator(self, coordinator: Any) -> None:
        self.registry.register(_CoordinatorCollector(coordinator))

    def watch_cluster(self, agent: Any) -> None:
        self.registry.register(_ClusterCollector(agent))

    def count_get(self, path: str, hits: int, misses: int, page_bytes: int, seconds: float) -> None:
        """One served Get (gRPC or data channel): result, pages, bytes, latency."""
        self.ops.labels("get", "OK").inc()
        self.pages.labels("get", "hit").inc(hits)
        self.pages.labels("get", "miss").inc(misses)
        self.bytes.labels("get", path).inc(hits * page_bytes)
        self.latency.labels("get", path).observe(seconds)

    @contextmanager
    def timed(self, op: str, path: str = "grpc") -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.latency.labels(op, path).observe(time.perf_counter() - start)
