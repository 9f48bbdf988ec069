"""The coordinator of the simulated replay: the real predictor and planner, driven on the simulated clock.

A real :class:`kvstore.cluster.coordinator.Coordinator` is built from the
same ``NodeConfig`` the daemons get (``ClusterSpec.args`` plus every
``--kvstored-arg``, parsed by ``kvstore.config``), over the simulated
cluster's real :class:`~kvstore.cluster.directory.Directory` and a
membership shim. Its pure parts run as they are: the
:class:`~kvstore.predict.online.Predictor` it builds (same model file, same
config), ``_node_states``, and the tick's candidates and plan
(:class:`kvstore.cluster.tickplan.TickPlanner`). What lives in the coordinator entangled
with the wall clock or with RPCs is replicated here, line for line in
behaviour, on the daemons' clock (``SimCluster.dnow``):

* ``observe`` (``time.monotonic() - age``), ``speculative`` and ``hints``
  (they read ``time.monotonic()``);
* ``tick`` / ``_tick_full`` (they spawn asyncio tasks), ``_copy`` (a
  ``Replicate``: the target renews what it holds as speculative and pulls the
  rest from the source over the simulated links; the per-node link rates
  are measured from the copies as there, ``LinkRates``), ``_copy_tree``,
  ``_renew`` and ``_drop``.

Retraining (``maybe_retrain``) is joined at once, so a run is deterministic.
"""

from __future__ import annotations

import argparse
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

from kvstore.replay.sim_cluster import REPLICA, SPECULATIVE, SimCluster
from kvstore.replay.sim_kernel import Event
from kvstore.cluster.coordinator import Coordinator
from kvstore.config import NodeConfig, add_arguments, build_config
from kvstore.placement.copytree import chunk_bounds
from kvstore.predict.types import Access, Outcome
from kvstore.v1 import kvstore_pb2 as pb


def node_config(daemon_args: Sequence[str]) -> NodeConfig:
    """The ``NodeConfig`` a kvstored started with these flags has."""
    parser = argparse.ArgumentParser(add_help=False)
    add_arguments(parser)
    return build_config(parser.parse_args(list(daemon_args)), environ={})


def _in_waves(queue: list[str], fanout: int, start: Callable[[str, Callable[[], None]], None]) -> None:
    """One sender's copies in waves: ``start(target, done)`` for ``fanout`` targets of ``queue`` at a
    time, the next wave once each of them called ``done`` (``queue`` may grow meanwhile)."""
    if not queue:
        return
    wave = queue[:fanout]
    del queue[:fanout]
    left = [len(wave)]

    def one_done() -> None:
        left[0] -= 1
        if not left[0]:
            _in_waves(queue, fanout, start)
    for dst in wave:
        start(dst, one_done)


class SimCoordinator:
    """Placement for the simulated cluster (the agent's ``Placement`` calls plus the planner tick)."""

    def __init__(self, config: NodeConfig, cluster: SimCluster, rpc_s: float = 0.0) -> None:
        self.cluster, self.sim = cluster, cluster.sim
        self.rpc_s = rpc_s  # daemon seconds a Replicate's round trip adds beyond its transfer
        page = cluster.p.scaled_page_bytes
        self.coord = Coordinator(config, cluster.directory, cluster.membership, peers=None, metrics=None,
                                 page_bytes=lambda ns: page)
        self.policy = config.replication
        self.predictor = self.coord.predictor
        self.spec_bytes: Counter[str] = Counter()   # kvstore_replication_bytes_total by kind
        self.decisions: Counter[str] = Counter()    # kvstore_planner_decisions_total by kind

    # ---- the agent's Placement calls ---------------------------------------------
    def observe(self, node: str, event: pb.AccessEvent) -> None:
        if self.predictor is None or not event.keys:
            return
        self.predictor.observe(Access(
            t=self.cluster.dnow() - event.age_seconds, namespace=event.namespace, node=node, keys=tuple(event.keys),
            outcome=Outcome(min(event.outcome, 2)), page_bytes=self.cluster.p.scaled_page_bytes,
            total_blocks=event.total_blocks or len(event.keys), local_blocks=event.local_blocks))

    def on_report(self, node: str, batches: Sequence[pb.DirectoryBatch]) -> None:
        if self.policy == "full":
            for b in batches:
                if b.adds:
                    self.coord._full_queue.append((b.namespace, node, list(b.adds)))

    def speculative(self) -> dict[tuple[str, bytes], dict[str, float]]:
        """``Coordinator.speculative`` on the simulated clock."""
        c, now = self.coord, self.cluster.dnow()
        reported, out = c.directory.speculative, {}
        for pid, touched in list(c._placed.items()):
            nodes = reported.get(pid)
            if nodes:
                out[pid] = {n: t for n, t in nodes.items() if c.membership.alive(n)}
            elif pid not in c.pending and now - touched > c.plan_cfg.ttl_s:
                del c._placed[pid]
        return {pid: nodes for pid, nodes in out.items() if nodes}

    def hints(self, namespace: str, chain: Sequence[bytes]) -> list[pb.NodePrefix]:
        """``Coordinator.hints`` on the simulated clock."""
        if self.policy != "predictive":
            return []
        return self.coord.hints(namespace, chain, now=self.cluster.dnow())

    # ---- the tick ------------------------------------------------------------------
    def start(self) -> None:
        if self.policy in ("predictive", "full"):
            self.sim.at(self.cluster.trace_s(self.coord.plan_cfg.tick_s), self._run)

    def _run(self) -> None:
        if self.cluster.alive(0):  # n0 coordinates; a killed coordinator places nothing more
            self.tick()
            self.sim.at(self.cluster.trace_s(self.coord.plan_cfg.tick_s), self._run)

    def tick(self) -> None:
        if self.policy == "full":
            self._tick_full()
            return
        c, now = self.coord, self.cluster.dnow()
        assert self.predictor is not None and c.tick_planner is not None
        speculative = self.speculative()
        scores = self.predictor.score(now)
        if self.predictor.maybe_retrain(now):
            self.predictor.wait_retrain()
        result = c.tick_planner.plan(scores, speculative, now, c._node_states(), c.bandwidth, c._in_flight_bytes,
                                     c.planner_pending())
        for d in result.decisions:
            self.decisions["replicate"] += 1
            c.decision_sources[c.tick_planner.scorer.get((d.namespace, d.keys[-1]), scores.source)] += 1
            per_target = d.bytes // max(1, len(d.targets))
            if d.tree:
                self._copy_tree(d, per_target)
                continue
            for target in d.targets:
                self.copy(target, list(d.keys), d.source, SPECULATIVE, d.ttl_s, per_target)
        for namespace, key, node, expires in result.renewals:
            c._placed[(namespace, key)] = now
            chain = self.predictor.chain((namespace, key)) or (key,)
            self._pool(node).renew(list(chain), expires)
        for namespace, key, node, _reason in result.drops:
            self.decisions["drop"] += 1
            chain = self.predictor.chain((namespace, key)) or (key,)
            self._pool(node).drop_speculative(list(chain))

    def _tick_full(self) -> None:
        c = self.coord
        live = c.membership.live_ids()
        groups: dict[tuple[str, str], list[bytes]] = {}
        while c._full_queue:
            namespace, source, keys = c._full_queue.popleft()
            groups.setdefault((namespace, source), []).extend(keys)
        for (namespace, source), keys in groups.items():
            for target in live:
                if target != source:
                    missing = [k for k in keys if target not in c.directory.holders(namespace, k)]
                    if missing:
                        self.decisions["full"] += 1
                        self.copy(target, missing, source, REPLICA, 0.0,
                                  len(missing) * self.cluster.p.scaled_page_bytes)

    def _pool(self, node: str) -> Any:
        return self.cluster.pools[self.cluster.index[node]]

    # ---- carrying out ---------------------------------------------------------------
    def copy(self, target: str, keys: list[bytes], source: str, kind: int, ttl: float, nbytes: int,
             part: bool = False) -> Event:
        """``Coordinator._copy``: one Replicate; fires with True when ``target`` now holds every key."""
        c, cl, done = self.coord, self.cluster, self.sim.event()
        key, now = (self.cluster.p.namespace, keys[-1]), cl.dnow()
        if kind == SPECULATIVE and not part:
            c.note_pending(key, keys, target, now + c.links.copy_s(source, target, nbytes))
            c._placed[key] = now
        c._in_flight_bytes += nbytes
        contention = c.links.start(source, target)
        ti, si = cl.index[target], cl.index[source]
        expires_at = now + ttl if kind == SPECULATIVE and ttl > 0 else 0.0

        def replicate() -> None:
            pool = cl.pools[ti]
            if not cl.alive(ti):
                finish([])
                return
            if expires_at:
                pool.renew(keys, expires_at)
            todo = [k for k in dict.fromkeys(keys) if k not in pool]
            present = len(set(keys)) - len(todo)
            if not todo:
                finish([], present)
                return
            cl.pull(ti, si, todo, kind, expires_at).then(lambda got: finish(got or [], present))

        def finish(copied: list[bytes], present: int = 0) -> None:
            c._in_flight_bytes -= nbytes
            if not part:
                c._landed(key, target)
            took = cl.dnow() - now
            moved = len(copied) * (nbytes // max(1, len(keys)))
            c.links.end(source, target, moved, took, contention)
            self.spec_bytes["speculative" if kind == SPECULATIVE else "replica"] += moved
            if kind == SPECULATIVE:
                c.pages_from[source] += len(copied)
            done.succeed(len(copied) + present == len(set(keys)))

        self.sim.at(cl.trace_s(self.rpc_s / 2), replicate)
        return done

    def on_claims_landed(self, claims: Sequence[Any]) -> None:
        """``Coordinator.on_claims_landed``: a copy tree to each landed claim's waiters."""
        c = self.coord
        for claim in claims:
            d = c.claim_tree(claim, self.cluster.membership.alive)
            if d is not None:
                self.decisions["claim_tree"] += 1
                c.decision_sources["claim-waiters"] += 1
                self._copy_tree(d, len(d.keys) * self.cluster.p.scaled_page_bytes)

    def _copy_tree(self, d: Any, nbytes: int) -> None:
        """``Coordinator._copy_tree``: every holder sends a wave of ``fanout`` copies at a time; each
        target, once its copy landed, serves its own (or relays each part, :meth:`_relay`)."""
        c, now = self.coord, self.cluster.dnow()
        key, children, roots = c.book_tree(d, nbytes, now)
        parts = chunk_bounds(len(d.keys), d.parts)
        if len(parts) > 1:
            c._placed[key] = now
            self._relay(d, nbytes, children, parts)
            return

        fanout = max(1, c.plan_cfg.fanout)

        def serve(node: str) -> None:  # as the coordinator: fanout copies a wave, the next once they landed
            queue = list(children.get(node, []))

            def start(dst: str, done: Callable[[], None]) -> None:
                def landed(ok: bool) -> None:
                    if ok:
                        serve(dst)
                    else:  # a failed target's subtree is served from here, in later waves
                        queue.extend(children.get(dst, []))
                    done()
                self.copy(dst, list(d.keys), node, SPECULATIVE, d.ttl_s, nbytes).then(landed)

            _in_waves(queue, fanout, start)

        for src in roots:
            serve(src)

    def _relay(self, d: Any, nbytes: int, children: dict[str, list[str]], parts: list[tuple[int, int]]) -> None:
        """``Coordinator._relay``: each part forwarded as soon as it landed."""
        c = self.coord
        parent = {dst: src for src, dst in d.tree}
        key, keys = (d.namespace, d.keys[-1]), list(d.keys)
        has = {dst: [self.sim.event() for _ in parts] for dst in parent}
        fanout = max(1, c.plan_cfg.fanout)

        def holder(node: str, j: int, then: Any) -> None:  # the nearest node from ``node`` up with part j
            if node not in has:
                then(node)
            else:
                has[node][j].then(lambda ok: then(node) if ok else holder(parent[node], j, then))

        def send(src: str, dst: str, done: Any) -> None:
            got = has[dst]

            def end() -> None:
                for e in got:
                    e.succeed(False)  # no-op where it fired
                c._landed(key, dst)
                done()

            def part(j: int) -> None:
                if j == len(parts):
                    end()
                    return
                a, b = parts[j]

                def copied(ok: bool) -> None:
                    got[j].succeed(ok)
                    if ok:
                        part(j + 1)
                    else:
                        end()
                holder(src, j, lambda s: self.copy(dst, keys[a:b], s, SPECULATIVE, d.ttl_s,
                                                   nbytes * (b - a) // len(keys), part=True).then(copied))
            part(0)

        for node in dict.fromkeys([s for s, _ in d.tree] + list(parent)):
            _in_waves(list(children.get(node, [])), fanout, lambda dst, done, node=node: send(node, dst, done))

    # ---- for results.json -------------------------------------------------------------
    def metrics_text(self) -> str:
        """The coordinator's counters that ``cluster_summary`` reads, as Prometheus text."""
        lines = [f'kvstore_replication_bytes_total{{kind="{k}"}} {v}' for k, v in self.spec_bytes.items()]
        lines += [f'kvstore_planner_decisions_total{{kind="{k}"}} {v}' for k, v in self.decisions.items()]
        lines.append(f'kvstore_coordinator{{what="egress_saved_bytes"}} {self.coord.egress_saved_bytes}')
        return "\n".join(lines) + "\n"

    def stats(self) -> dict[str, Any]:
        c = self.coord
        out: dict[str, Any] = {"policy": self.policy, "bandwidth_bps": c.bandwidth, "egress_saved_bytes": c.egress_saved_bytes,
                               "pages_from": dict(c.pages_from), "decisions": dict(self.decisions)}
        if self.predictor is not None:
            out["predictor_source"] = self.predictor.last_source
            out["tracked_prefixes"] = len(self.predictor.fs)
        return out
