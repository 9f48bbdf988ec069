"""The coordinator of the simulated replay: the daemon's own coordinator core, driven on the simulated clock.

A real :class:`~kvstore.cluster.coordinator_core.CoordinatorCore` is built from the
same ``NodeConfig`` the daemons get (``ClusterSpec.args`` plus every
``--kvstored-arg``, parsed by ``kvstore.config``), over the simulated
cluster's real :class:`~kvstore.cluster.directory.Directory` and membership,
with the daemons' clock (``SimCluster.dnow``). Every decision is the core's:
the predictor, the tick's plan, the copy trees and their waves and relays,
renewals and drops. This shell is what the daemon's asyncio shell
(:mod:`kvstore.cluster.coordinator`) is, on simulated time: it runs the tick
every ``--planner-tick`` (scoring inline, retraining joined at once, so a run is
deterministic) and carries out the core's effects: a ``Copy`` is a
``Replicate`` (after half an RPC the target renews what it holds as
speculative and pulls the rest from the source over the simulated links; the
core hears how it ended), a ``Renew`` or ``Drop`` acts on the node's pool.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

from kvstore.cluster.coordinator_core import Copy, CoordinatorCore, Drop, Effect, Promote, Renew
from kvstore.config import NodeConfig, add_arguments, build_config
from kvstore.loops.slices import finish
from kvstore.pool.pool import PageKind
from kvstore.replay.sim_cluster import SimCluster
from kvstore.v1 import kvstore_pb2 as pb


def node_config(daemon_args: Sequence[str]) -> NodeConfig:
    """The ``NodeConfig`` a kvstored started with these flags has."""
    parser = argparse.ArgumentParser(add_help=False)
    add_arguments(parser)
    return build_config(parser.parse_args(list(daemon_args)), environ={})


class SimCoordinator:
    """Placement for the simulated cluster (the agent's ``Placement`` calls plus the planner tick)."""

    def __init__(self, config: NodeConfig, cluster: SimCluster, rpc_s: float = 0.0) -> None:
        self.cluster, self.sim = cluster, cluster.sim
        self.rpc_s = rpc_s  # daemon seconds a Replicate's round trip adds beyond its transfer
        page = cluster.p.scaled_page_bytes
        self.core = CoordinatorCore(config, cluster.directory, cluster.membership, page_bytes=lambda ns: page,
                                    clock=cluster.dnow, defer=lambda fn, *args: self.sim.at(0.0, fn, *args),
                                    perform=self._perform)
        self.policy = config.replication
        self.predictor = self.core.predictor

    # ---- the agent's Placement calls ---------------------------------------------
    def observe(self, node: str, event: pb.AccessEvent) -> None:
        self.core.observe(node, event)

    def on_report(self, node: str, batches: Sequence[pb.DirectoryBatch]) -> None:
        self.core.on_report(node, batches)

    def hints(self, namespace: str, chain: Sequence[bytes]) -> list[pb.NodePrefix]:
        return self.core.hints(namespace, chain) if self.policy == "predictive" else []

    def on_claims_landed(self, claims: Sequence[Any]) -> None:
        self.core.on_claims_landed(claims)

    def sending(self, node: str) -> int:
        return self.core.links.sending[node]

    # ---- the tick ------------------------------------------------------------------
    def start(self) -> None:
        if self.policy in ("predictive", "full"):
            self.sim.at(self.cluster.trace_s(self.core.plan_cfg.tick_s), self._run)

    def _run(self) -> None:
        if self.cluster.alive(0):  # n0 coordinates; a killed coordinator places nothing more
            self.tick()
            self.sim.at(self.cluster.trace_s(self.core.plan_cfg.tick_s), self._run)

    def tick(self) -> None:
        core = self.core
        if self.policy == "full":
            core.tick_full()
            return
        assert self.predictor is not None
        now = self.cluster.dnow()
        scores = self.predictor.score(now)
        if self.predictor.maybe_retrain(now):
            self.predictor.wait_retrain()
        finish(core.tick_steps(scores, now))

    # ---- carrying out the core's effects ----------------------------------------------
    def _perform(self, effect: Effect) -> None:
        cl = self.cluster
        if isinstance(effect, Copy):
            self.sim.at(cl.trace_s(self.rpc_s / 2), self._replicate, effect)
        elif isinstance(effect, Renew):
            cl.pools[cl.index[effect.node]].renew(list(effect.keys), effect.expires_at)
        elif isinstance(effect, Drop):
            cl.pools[cl.index[effect.node]].drop_speculative(list(effect.keys))
        elif isinstance(effect, Promote):
            self.sim.at(cl.trace_s(self.rpc_s / 2), cl.promote, cl.index[effect.node], list(effect.keys))

    def _replicate(self, copy: Copy) -> None:
        """The target's side of a ``Replicate``, half an RPC after the coordinator sent it."""
        cl, keys = self.cluster, copy.keys
        ti = cl.index[copy.target]
        pool = cl.pools[ti]
        if not cl.alive(ti):
            self.core.copy_ended(copy, 0)
            return
        speculative = copy.kind is PageKind.SPECULATIVE and copy.ttl_s > 0
        expires_at = copy.started + copy.ttl_s if speculative else 0.0
        if expires_at:
            pool.renew(keys, expires_at)
        todo = [k for k in dict.fromkeys(keys) if k not in pool]
        present = len(set(keys)) - len(todo)
        if not todo:
            self.core.copy_ended(copy, 0, present)
            return
        cl.pull(ti, cl.index[copy.source], todo, int(copy.kind), expires_at).then(
            lambda got: self.core.copy_ended(copy, len(got or []), present))

    # ---- for results.json -------------------------------------------------------------
    def metrics_text(self) -> str:
        """The coordinator's counters that ``cluster_summary`` reads, as Prometheus text."""
        core = self.core
        lines = [f'kvstore_replication_bytes_total{{kind="{k}"}} {v}' for k, v in core.replicated.items()]
        lines += [f'kvstore_planner_decisions_total{{kind="{k}"}} {v}' for k, v in core.decisions.items()]
        lines.append(f'kvstore_coordinator{{what="egress_saved_bytes"}} {core.egress_saved_bytes}')
        return "\n".join(lines) + "\n"

    def stats(self) -> dict[str, Any]:
        core = self.core
        out: dict[str, Any] = {"policy": self.policy, "bandwidth_bps": core.bandwidth,
                               "egress_saved_bytes": core.egress_saved_bytes, "pages_from": dict(core.pages_from),
                               "decisions": dict(core.decisions)}
        if self.predictor is not None:
            out["predictor_source"] = self.predictor.last_source
            out["tracked_prefixes"] = len(self.predictor.fs)
        return out
