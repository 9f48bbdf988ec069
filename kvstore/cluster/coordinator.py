"""The coordinator role's placement work: the access stream feeds the burst
predictor; every planner tick the planner turns its scores and the cluster
state into speculative copies, which this module carries out with
``Replicate`` calls to the targets.

Policies (``--replication``): ``none`` and ``reactive`` place nothing here;
``predictive`` places speculative replicas ahead of forecast bursts;
``full`` copies every new page to every other node (the cost ceiling).

All of it is soft state on the coordinator: a new coordinator starts with an
empty predictor (or the ``--predictor-model`` file) and an empty placement
map, and the nodes' speculative replicas simply expire.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import grpc
import numpy as np

from kvstore.pool.pool import PageKind
from kvstore.predict.types import Access, Candidate, NodeState, Outcome, PlannerConfig, PredictorConfig
from kvstore.v1 import kvstore_pb2 as pb

if TYPE_CHECKING:
    from kvstore.cluster.agent import ClusterAgent

log = logging.getLogger(__name__)
decision_log = logging.getLogger("kvstore.decisions")
_BANDWIDTH_ALPHA = 0.3


class Coordinator:
    """Predictive and full replication, run on whichever node coordinates."""

    def __init__(self, agent: "ClusterAgent") -> None:
        self.agent = agent
        cfg = agent.config
        self.policy = cfg.replication
        self.pcfg = PredictorConfig(depths=cfg.predictor_depths, horizon_s=cfg.predictor_horizon)
        self.plan_cfg = PlannerConfig(threshold=cfg.spec_threshold, spec_budget=cfg.spec_budget,
                                      spec_bandwidth=cfg.spec_bandwidth, tick_s=cfg.planner_tick,
                                      ttl_s=cfg.spec_ttl)
        self.predictor = None
        if self.policy == "predictive":
            from kvstore.predict.online import Predictor

            self.predictor = Predictor(self.pcfg, model_path=cfg.predictor_model or None,
                                       holders_count=self._holders_count)
        # (namespace, deepest key) -> {node: expires_at (monotonic)}
        self.speculative: dict[tuple[str, bytes], dict[str, float]] = {}
        self._spec_depth: dict[tuple[str, bytes], int] = {}  # blocks each placed prefix spans
        # (namespace, deepest key) -> {node: expected ready time}
        self.pending: dict[tuple[str, bytes], dict[str, float]] = {}
        self.bandwidth = cfg.spec_bandwidth  # bytes/s per copy, refined by measurement
        self._in_flight_bytes = 0
        self._tasks: set[asyncio.Task[Any]] = set()
        self._full_queue: deque[tuple[str, str, list[bytes]]] = deque(maxlen=100_000)
        self.tick_seconds: list[float] = []

    # ---- inputs ------------------------------------------------------------
    def _holders_count(self, namespace: str, key: bytes) -> int:
        return len(self.agent.directory.holders(namespace, key))

    def observe(self, node: str, event: pb.AccessEvent) -> None:
        """One recorded request (from a heartbeat or from this node)."""
        if self.predictor is None or not event.keys:
            return
        self.predictor.observe(Access(
            t=time.monotonic() - event.age_seconds, namespace=event.namespace, node=node, keys=tuple(event.keys),
            outcome=Outcome(min(event.outcome, 2)), page_bytes=self._page_bytes(event.namespace),
            total_blocks=event.total_blocks or len(event.keys), local_blocks=event.local_blocks))

    def added(self, node: str, batches: Sequence[pb.DirectoryBatch]) -> None:
        """Directory adds from ``node``: under ``full``, copy them everywhere."""
        if self.policy != "full":
            return
        for batch in batches:
            if batch.adds:
                self._full_queue.append((batch.namespace, node, list(batch.adds)))

    def _page_bytes(self, namespace: str) -> int:
        ns = self.agent.node.namespaces.get(namespace)
        return ns.layout.page_bytes if ns is not None else 0

    # ---- placement hints ---------------------------------------------------
    def hints(self, namespace: str, chain: Sequence[bytes]) -> list[pb.NodePrefix]:
        """Nodes about to hold (copy in flight) or holding as speculative
        replicas a prefix of ``chain``, with the replica's remaining life."""
        now = time.monotonic()
        out: dict[str, pb.NodePrefix] = {}
        for depth in range(len(chain), 0, -1):
            key = (namespace, chain[depth - 1])
            for node, ready in self.pending.get(key, {}).items():
                if node not in out:
                    out[node] = pb.NodePrefix(node_id=node, prefix_length=depth, pending=True,
                                              expires_in_seconds=self.plan_cfg.ttl_s)
            for node, expires in self.speculative.get(key, {}).items():
                if node not in out and expires > now:
                    out[node] = pb.NodePrefix(node_id=node, prefix_length=depth, expires_in_seconds=expires - now)
        for node_id, hint in out.items():
            member = self.agent.membership.member(node_id)
            hint.address = member.address if member is not None else ""
        return list(out.values())

    # ---- the tick ----------------------------------------------------------
    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.plan_cfg.tick_s)
            if not self.agent.membership.is_coordinator or self.policy in ("none", "reactive"):
                continue
            start = time.perf_counter()
            try:
                await self.tick()
            except Exception:  # a bad tick must not stop placement
                log.exception("planner tick failed")
            took = time.perf_counter() - start
            self.agent.metrics.tick_latency.observe(took)
            self.tick_seconds.append(took)
            del self.tick_seconds[:-1000]

    async def tick(self) -> None:
        if self.policy == "full":
            self._tick_full()
            return
        from kvstore.predict.planner import plan, select_candidates  # only the predictive policy needs them

        assert self.predictor is not None
        now = time.monotonic()
        self._expire(now)
        scores = await self.predictor.score_async(now)
        self.predictor.maybe_retrain(now)
        # Candidates at the keep threshold (hysteresis), plus every prefix
        # that holds replicas now, so hot replicas are renewed, not dropped.
        rows = set(select_candidates(scores.probs, self.plan_cfg.keep_threshold,
                                     self.plan_cfg.max_decisions * 2).tolist())
        if self.speculative:
            index = {pid: i for i, pid in enumerate(scores.ids)}
            rows.update(index[pid] for pid in self.speculative if pid in index)
        candidates = [c for c in (self._candidate(scores, int(i)) for i in sorted(rows)) if c is not None]
        nodes = self._node_states()
        pending = {pid: set(nodes_) for pid, nodes_ in self.pending.items()}
        result = plan(candidates, nodes, self.bandwidth, self.plan_cfg, now, self.speculative,
                      self._in_flight_bytes, pending=pending)
        for decision in result.decisions:
            decision_log.info("replicate %s depth=%d %s -> %s: %s", decision.keys[-1].hex()[:12], decision.depth,
                              decision.source, ",".join(decision.targets), decision.reason)
            self.agent.metrics.decisions.labels("replicate").inc()
            for target in decision.targets:
                self._spawn(self._copy(target, decision.namespace, list(decision.keys), decision.source,
                                       PageKind.SPECULATIVE, decision.ttl_s, decision.bytes // max(1, len(decision.targets))))
        for namespace, key, node, expires in getattr(result, "renewals", []):
            self.speculative.setdefault((namespace, key), {})[node] = expires
            self._spawn(self._renew(node, namespace, key, expires - now))
        for namespace, key, node, reason in getattr(result, "drops", []):
            decision_log.info("drop %s on %s: %s", key.hex()[:12], node, reason)
            self.agent.metrics.decisions.labels("drop").inc()
            self.speculative.get((namespace, key), {}).pop(node, None)
            self._spawn(self._drop(node, namespace, key))
        for reason, count in result.skipped.items():
            self.agent.metrics.decisions.labels(f"skip_{reason}").inc(count)

    def _candidate(self, scores: Any, row: int) -> Candidate | None:
        namespace, key = scores.ids[row]
        chain = self.predictor.chain(scores.ids[row]) if self.predictor is not None else ()
        page_bytes = self._page_bytes(namespace)
        if not chain or not page_bytes:
            return None
        depth = len(chain)
        options = tuple(d for d in self.pcfg.depths if d <= depth) or (depth,)
        live = set(self.agent.membership.live_ids())
        holders = {d: frozenset(self.agent.directory.holders(namespace, chain[d - 1]) & live) for d in options}
        return Candidate(namespace=namespace, chain=tuple(chain), depth_options=options, holders=holders,
                         prob=float(scores.probs[row]), need_in_s=float(scores.need_in_s[row]),
                         page_bytes=page_bytes)

    def _node_states(self) -> list[NodeState]:
        spec: dict[str, int] = {}
        for (namespace, key), nodes in self.speculative.items():
            nbytes = self._spec_depth.get((namespace, key), 1) * self._page_bytes(namespace)
            for node in nodes:
                spec[node] = spec.get(node, 0) + nbytes
        return [NodeState(node_id=m.node_id, capacity_bytes=m.capacity_bytes, used_bytes=m.used_bytes,
                          spec_bytes=max(spec.get(m.node_id, 0), m.speculative_bytes))
                for m in self.agent.membership.view()]

    def _expire(self, now: float) -> None:
        for key in list(self.speculative):
            nodes = {n: t for n, t in self.speculative[key].items() if t > now and self.agent.membership.alive(n)}
            if nodes:
                self.speculative[key] = nodes
            else:
                del self.speculative[key]
                self._spec_depth.pop(key, None)

    def _tick_full(self) -> None:
        """Copy every newly added page to every live node lacking it."""
        live = self.agent.membership.live_ids()
        groups: dict[tuple[str, str], list[bytes]] = {}
        while self._full_queue:
            namespace, source, keys = self._full_queue.popleft()
            groups.setdefault((namespace, source), []).extend(keys)
        for (namespace, source), keys in groups.items():
            for target in live:
                if target != source:
                    missing = [k for k in keys if target not in self.agent.directory.holders(namespace, k)]
                    if missing:
                        self.agent.metrics.decisions.labels("full").inc()
                        self._spawn(self._copy(target, namespace, missing, source, PageKind.REPLICA, 0.0,
                                               len(missing) * self._page_bytes(namespace)))

    # ---- carrying out ------------------------------------------------------
    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _copy(self, target: str, namespace: str, keys: list[bytes], source: str, kind: PageKind,
                    ttl: float, nbytes: int) -> None:
        key = (namespace, keys[-1])
        now = time.monotonic()
        if kind is PageKind.SPECULATIVE:
            eta = now + (nbytes / self.bandwidth if self.bandwidth else 0.0)
            self.pending.setdefault(key, {})[target] = eta
        self._in_flight_bytes += nbytes
        request = pb.ReplicateRequest(namespace=namespace, keys=keys, source_node_id=source, kind=kind,
                                      ttl_seconds=ttl)
        start = time.perf_counter()
        try:
            reply = await self.agent.call(target, "Replicate", request, timeout=max(5.0, 4 * self.plan_cfg.tick_s))
        except grpc.RpcError as exc:
            log.warning("replicate to %s failed: %s", target, exc.code())
            return
        finally:
            self._in_flight_bytes -= nbytes
            pending = self.pending.get(key)
            if pending is not None:
                pending.pop(target, None)
                if not pending:
                    del self.pending[key]
        took = time.perf_counter() - start
        moved = reply.copied * (nbytes // max(1, len(keys)))
        if moved and took > 0:
            self.bandwidth = (1 - _BANDWIDTH_ALPHA) * self.bandwidth + _BANDWIDTH_ALPHA * moved / took
        self.agent.metrics.spec_bytes.labels(kind.name.lower()).inc(moved)
        if kind is PageKind.SPECULATIVE and reply.copied + reply.already_present:
            self.speculative.setdefault(key, {})[target] = time.monotonic() + ttl
            self._spec_depth[key] = len(keys)

    async def _renew(self, node: str, namespace: str, key: bytes, ttl: float) -> None:
        chain = self.predictor.chain((namespace, key)) if self.predictor is not None else (key,)
        request = pb.ReplicateRequest(namespace=namespace, keys=list(chain) or [key], source_node_id=node,
                                      kind=PageKind.SPECULATIVE, ttl_seconds=ttl)
        try:
            await self.agent.call(node, "Replicate", request, timeout=5.0)
        except grpc.RpcError:
            pass

    async def _drop(self, node: str, namespace: str, key: bytes) -> None:
        chain = self.predictor.chain((namespace, key)) if self.predictor is not None else (key,)
        try:
            await self.agent.call(node, "DropSpeculative",
                                  pb.DropSpeculativeRequest(namespace=namespace, keys=list(chain) or [key]),
                                  timeout=5.0)
        except grpc.RpcError:
            pass

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.predictor is not None and hasattr(self.predictor, "close"):
            self.predictor.close()

    def stats(self) -> dict[str, Any]:
        ticks = np.array(self.tick_seconds) if self.tick_seconds else np.zeros(1)
        out = {"policy": self.policy, "speculative_prefixes": len(self.speculative), "pending": len(self.pending),
               "bandwidth_bps": self.bandwidth, "tick_p50_ms": float(np.percentile(ticks, 50) * 1e3),
               "tick_p99_ms": float(np.percentile(ticks, 99) * 1e3)}
        if self.predictor is not None:
            out.update(self.predictor.stats())
        return out

