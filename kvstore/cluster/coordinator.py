"""The coordinator role's placement work: the access stream feeds the burst
predictor; every planner tick the planner turns its scores and the cluster
state into speculative copies, which this module carries out with
``Replicate`` calls to the targets.

Policies (``--replication``): ``none`` and ``reactive`` place nothing here;
``predictive`` places speculative replicas ahead of forecast bursts;
``full`` copies every new page to every other node (the cost ceiling).

Inputs are narrow: the directory (who holds what, and the speculative
replicas nodes report with their expiry), the membership view, a
:class:`PeerClient` to send Replicate and DropSpeculative, and the page size
of each namespace. The agent feeds it through the ``Placement`` calls
(``observe``, ``on_report``, ``hints``) and does not import this module.

Expiry has one path: a node enforces each speculative replica's TTL and
reports it; the replica map the planner renews and drops from is the
directory's report-built map, restricted to the prefixes this coordinator
placed. All of it is soft state: a new coordinator starts with an empty
predictor (or the ``--predictor-model`` file); the replicas the old one
placed simply expire on their nodes.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from kvstore.cluster.claims import Claim, waiter_tree
from kvstore.cluster.directory import Directory
from kvstore.cluster.membership import Membership
from kvstore.cluster.peers import PeerClient
from kvstore.cluster.relay import relay
from kvstore.cluster.tickplan import TickPlanner
from kvstore.config import NodeConfig
from kvstore.errors import KvError
from kvstore.loops.slices import Steps, on_loop, sliced
from kvstore.metrics import NodeMetrics
from kvstore.pool.pool import PageKind
from kvstore.placement.copytree import chunk_bounds, relay_parts
from kvstore.placement.links import LinkRates
from kvstore.placement.planner_types import Decision, NodeState, PlannerConfig
from kvstore.predict.types import Access, Outcome, PredictorConfig
from kvstore.v1 import kvstore_pb2 as pb

log = logging.getLogger(__name__)
decision_log = logging.getLogger("kvstore.decisions")

TICK_SLICE_S = 0.002
"""A planner tick holds the event loop for slices of about this long (``kvstore.loops.slices``):
a request that arrives during a tick waits behind one slice, not the whole tick."""
CARRY_STEP = 32
"""Decisions, renewals or drops the tick carries out between two yields."""


class Coordinator:
    """Predictive and full replication, run on whichever node coordinates."""

    def __init__(self, config: NodeConfig, directory: Directory, membership: Membership, peers: PeerClient,
                 metrics: NodeMetrics, page_bytes: Callable[[str], int]) -> None:
        self.directory = directory
        self.membership = membership
        self.peers = peers
        self.metrics = metrics
        self._page_bytes = page_bytes
        self.policy = config.replication
        self.control_timeout = config.control_timeout
        self.pcfg = PredictorConfig(**config.feeding("predictor"))
        self.plan_cfg = PlannerConfig(**config.feeding("planner"))
        self.predictor = None
        if self.policy == "predictive":
            from kvstore.predict.model import DEFAULT_MODEL_PATH
            from kvstore.predict.online import Predictor  # LightGBM loads only for this policy

            model = config.predictor_model or (str(DEFAULT_MODEL_PATH) if DEFAULT_MODEL_PATH.is_file() else "")
            self.predictor = Predictor(self.pcfg, model_path=None if model in ("", "none") else model,
                                       holders_count=self._holders_count)
        self.tick_planner = (TickPlanner(self.predictor, directory, membership, self.pcfg, self.plan_cfg, page_bytes)
                             if self.predictor is not None else None)
        # prefixes this coordinator placed: (namespace, deepest key) -> when last copied or renewed
        self._placed: dict[tuple[str, bytes], float] = {}
        # (namespace, deepest key) -> {node: expected ready time}: copies in flight
        self.pending: dict[tuple[str, bytes], dict[str, float]] = {}
        self._pending_chain: dict[tuple[str, bytes], tuple[bytes, ...]] = {}  # a pending prefix's keys
        self.links = LinkRates(float(config.spec_bandwidth))  # per node and direction, refined by the copies
        self._in_flight_bytes = 0
        self._tasks: set[asyncio.Task[Any]] = set()
        self._full_queue: deque[tuple[str, str, list[bytes]]] = deque(maxlen=100_000)
        self.tick_seconds: list[float] = []  # each tick's wall time, scoring off the loop included
        self.tick_slices: list[float] = []   # each tick's longest stretch on the loop (scoring's too)
        self.decision_sources: Counter[str] = Counter()  # replicate decisions by the scorer behind them
        self.egress_saved_bytes = 0  # holder egress copy trees saved against copying all from one source
        self.pages_from: Counter[str] = Counter()  # speculative pages copied, by the node that sent them

    # ---- inputs (the agent's Placement calls) --------------------------------
    def _holders_count(self, namespace: str, key: bytes) -> int:
        return len(self.directory.holders(namespace, key))

    def observe(self, node: str, event: pb.AccessEvent) -> None:
        """One recorded request (from a heartbeat or from this node)."""
        if self.predictor is None or not event.keys:
            return
        self.predictor.observe(Access(
            t=time.monotonic() - event.age_seconds, namespace=event.namespace, node=node, keys=tuple(event.keys),
            outcome=Outcome(min(event.outcome, 2)), page_bytes=self._page_bytes(event.namespace),
            total_blocks=event.total_blocks or len(event.keys), local_blocks=event.local_blocks))

    def on_report(self, node: str, batches: Sequence[pb.DirectoryBatch]) -> None:
        """Directory adds from ``node``: under ``full``, copy them everywhere."""
        if self.policy != "full":
            return
        for batch in batches:
            if batch.adds:
                self._full_queue.append((batch.namespace, node, list(batch.adds)))

    def claim_tree(self, claim: Claim, alive: Callable[[str], bool]) -> Decision | None:
        """The copy tree to a landed claim's waiters (:func:`~kvstore.cluster.claims.waiter_tree`), under
        ``predictive`` (the copy-tree rule of the planner, fed by demand that is known, not forecast)."""
        if self.policy != "predictive":
            return None
        return waiter_tree(claim, alive, self.plan_cfg.fanout, self.plan_cfg.ttl_s,
                           self._page_bytes(claim.namespace), others=self.membership.live_ids(),
                           parts=self.relay_parts(claim.namespace, min(claim.needed, len(claim.chain))))

    @property
    def bandwidth(self) -> float:
        """One copy's rate on an idle link (:meth:`LinkRates.typical`), where one number is needed: the
        relay's part count and the planner's rate for a node it has no measurement of. The planner, the
        hints' landing times and the trees' waves go by each node's rates (``self.links``)."""
        return self.links.typical()

    def relay_parts(self, namespace: str, keys: int) -> int:
        """Parts a copy tree of ``keys`` pages relays in at the measured copy bandwidth (1: store and
        forward; :func:`~kvstore.placement.copytree.relay_parts`), for the claims' copy-time estimate too."""
        copy_s = keys * self._page_bytes(namespace) / self.bandwidth if self.bandwidth > 0 else 0.0
        return relay_parts(copy_s, self.plan_cfg.chunks, self.plan_cfg.min_part_s)

    def on_claims_landed(self, claims: Sequence[Claim]) -> None:
        """Claims whose Put reached the directory: copy each to the nodes that waited for it, as a tree."""
        for claim in claims:
            d = self.claim_tree(claim, self.membership.alive)
            if d is not None:
                self.decision_sources["claim-waiters"] += 1
                self.metrics.decisions.labels("claim_tree").inc()
                self._spawn(self._copy_tree(d, len(d.keys) * self._page_bytes(d.namespace)))

    @property
    def speculative(self) -> dict[tuple[str, bytes], dict[str, float]]:
        """The replicas of the prefixes this coordinator placed, as their nodes
        report them: ``{(namespace, deepest key): {node: expires_at}}``."""
        reported, now = self.directory.speculative, time.monotonic()
        out = {}
        for pid, touched in list(self._placed.items()):
            nodes = reported.get(pid)
            if nodes:
                out[pid] = {n: t for n, t in nodes.items() if self.membership.alive(n)}
            elif pid not in self.pending and now - touched > self.plan_cfg.ttl_s:
                del self._placed[pid]  # reported by no node for a whole TTL: nothing left to renew
        return {pid: nodes for pid, nodes in out.items() if nodes}

    # ---- placement hints ---------------------------------------------------
    def hints(self, namespace: str, chain: Sequence[bytes], now: float | None = None) -> list[pb.NodePrefix]:
        """Nodes about to hold (copy in flight: ``ready_in_seconds`` is when
        the coordinator expects it landed) or holding as speculative
        replicas a prefix of ``chain``, with the replica's remaining life."""
        now = time.monotonic() if now is None else now
        out: dict[str, pb.NodePrefix] = {}
        for depth in range(len(chain), 0, -1):
            key = (namespace, chain[depth - 1])
            for node, ready in self.pending.get(key, {}).items():
                if node not in out:
                    out[node] = pb.NodePrefix(node_id=node, prefix_length=depth, pending=True,
                                              expires_in_seconds=self.plan_cfg.ttl_s,
                                              ready_in_seconds=max(0.0, ready - now))
            for node, expires in self.directory.speculative.get(key, {}).items():
                if node not in out and expires > now:
                    out[node] = pb.NodePrefix(node_id=node, prefix_length=depth, expires_in_seconds=expires - now)
        for node_id, hint in out.items():
            member = self.membership.member(node_id)
            hint.address = member.address if member is not None else ""
        return list(out.values())

    # ---- the tick ----------------------------------------------------------
    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.plan_cfg.tick_s)
            if not self.membership.is_coordinator or self.policy in ("none", "reactive"):
                continue
            start = time.perf_counter()
            try:
                await self.tick()
            except Exception:  # a bad tick must not stop placement
                log.exception("planner tick failed")
            took = time.perf_counter() - start
            self.metrics.tick_latency.observe(took)
            self.tick_seconds.append(took)
            del self.tick_seconds[:-1000]

    async def tick(self) -> None:
        if self.policy == "full":
            self._tick_full()
            return
        assert self.predictor is not None and self.tick_planner is not None
        now = time.monotonic()
        scores = await self.predictor.score_async(now)
        slices = list(self.predictor.loop_stretches)  # scoring's own stretches on the loop count too
        start = time.perf_counter()
        self.predictor.maybe_retrain(now)
        slices.append(time.perf_counter() - start)
        await on_loop(sliced(self._tick_steps(scores, now), TICK_SLICE_S, slices))
        longest = max(slices)
        self.metrics.tick_slice.observe(longest)
        self.tick_slices.append(longest)
        del self.tick_slices[:-1000]

    def _tick_steps(self, scores: Any, now: float) -> Steps[None]:
        """Plan the tick and carry it out, a step at a time (``kvstore.loops.slices``)."""
        assert self.tick_planner is not None
        result = yield from self.tick_planner.steps(scores, self.speculative, now, self._node_states(),
                                                    self.bandwidth, self._in_flight_bytes, self.planner_pending())
        for i, decision in enumerate(result.decisions, 1):
            if i % CARRY_STEP == 0:
                yield
            if decision_log.isEnabledFor(logging.INFO):
                decision_log.info("replicate %s depth=%d %s -> %s: %s", decision.keys[-1].hex()[:12], decision.depth,
                                  decision.source, ",".join(decision.targets), decision.explain())
            self.metrics.decisions.labels("replicate").inc()
            scorer = self.tick_planner.scorer.get((decision.namespace, decision.keys[-1]), scores.source)
            self.decision_sources[scorer] += 1
            self.metrics.decisions.labels(f"scorer_{scorer}").inc()
            per_target = decision.bytes // max(1, len(decision.targets))
            if decision.tree:
                self._spawn(self._copy_tree(decision, per_target))
                continue
            for target in decision.targets:
                self._spawn(self._copy(target, decision.namespace, list(decision.keys), decision.source,
                                       PageKind.SPECULATIVE, decision.ttl_s, per_target))
        for i, (namespace, key, node, expires) in enumerate(result.renewals, 1):
            if i % CARRY_STEP == 0:
                yield
            self._spawn(self._renew(node, namespace, key, expires - now))
        for i, (namespace, key, node, reason) in enumerate(result.drops, 1):
            if i % CARRY_STEP == 0:
                yield
            decision_log.info("drop %s on %s: %s", key.hex()[:12], node, reason)
            self.metrics.decisions.labels("drop").inc()
            self._spawn(self._drop(node, namespace, key))
        for reason, count in result.skipped.items():
            self.metrics.decisions.labels(f"skip_{reason}").inc(count)

    def _node_states(self) -> list[NodeState]:
        """Live nodes as their heartbeats describe them, plus the speculative
        bytes on their way to each (copies in flight)."""
        coming: dict[str, int] = {}
        for (namespace, _), nodes in self.pending.items():
            for node in nodes:
                coming[node] = coming.get(node, 0) + self._page_bytes(namespace)
        links = self.links
        return [NodeState(node_id=m.node_id, capacity_bytes=m.capacity_bytes, used_bytes=m.used_bytes,
                          spec_bytes=m.speculative_bytes + coming.get(m.node_id, 0),
                          egress_bps=links.egress_bps(m.node_id), ingress_bps=links.ingress_bps(m.node_id),
                          sending=links.sending[m.node_id], receiving=links.receiving[m.node_id])
                for m in self.membership.view()]

    def _tick_full(self) -> None:
        """Copy every newly added page to every live node lacking it."""
        live = self.membership.live_ids()
        groups: dict[tuple[str, str], list[bytes]] = {}
        while self._full_queue:
            namespace, source, keys = self._full_queue.popleft()
            groups.setdefault((namespace, source), []).extend(keys)
        for (namespace, source), keys in groups.items():
            for target in live:
                if target != source:
                    missing = [k for k in keys if target not in self.directory.holders(namespace, k)]
                    if missing:
                        self.metrics.decisions.labels("full").inc()
                        self._spawn(self._copy(target, namespace, missing, source, PageKind.REPLICA, 0.0,
                                               len(missing) * self._page_bytes(namespace)))

    # ---- carrying out ------------------------------------------------------
    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _copy(self, target: str, namespace: str, keys: list[bytes], source: str, kind: PageKind,
                    ttl: float, nbytes: int, part: bool = False) -> bool:
        """One Replicate; True when ``target`` now holds every key. ``part``: one part of a relayed copy,
        whose pending entry and placement the copy tree keeps for the whole prefix."""
        key = (namespace, keys[-1])
        now = time.monotonic()
        if kind is PageKind.SPECULATIVE and not part:
            self.note_pending(key, keys, target, now + self.links.copy_s(source, target, nbytes))
        self._in_flight_bytes += nbytes
        contention = self.links.start(source, target)
        request = pb.ReplicateRequest(namespace=namespace, keys=keys, source_node_id=source, kind=kind,
                                      ttl_seconds=ttl)
        start = time.perf_counter()
        if kind is PageKind.SPECULATIVE and not part:
            self._placed[key] = now
        reply = None
        try:
            reply = await self.peers.replicate(target, request,
                                               timeout=max(self.control_timeout, 4 * self.plan_cfg.tick_s))
        except KvError as exc:
            log.warning("replicate to %s failed: %s", target, exc)
            return False
        finally:
            self._in_flight_bytes -= nbytes
            if not part:
                self._landed(key, target)
            moved = reply.copied * (nbytes // max(1, len(keys))) if reply is not None else 0
            self.links.end(source, target, moved, time.perf_counter() - start, contention)
        self.metrics.spec_bytes.labels(kind.name.lower()).inc(moved)
        if kind is PageKind.SPECULATIVE:
            self.pages_from[source] += reply.copied
        return reply.copied + reply.already_present == len(set(keys))

    def note_pending(self, key: tuple[str, bytes], keys: Sequence[bytes], target: str, ready_at: float) -> None:
        """A copy of the prefix ``keys`` (``key``: its deepest) is on its way to ``target``."""
        self.pending.setdefault(key, {})[target] = ready_at
        self._pending_chain[key] = tuple(keys)

    def _landed(self, key: tuple[str, bytes], target: str) -> None:
        """``target``'s copy of the prefix ``key`` ended (landed or not): it is no longer pending there."""
        pending = self.pending.get(key)
        if pending is not None:
            pending.pop(target, None)
            if not pending:
                del self.pending[key]
                self._pending_chain.pop(key, None)

    def planner_pending(self) -> dict[tuple[str, bytes], set[str]]:
        """The planner's ``pending``: each copy in flight under every prefix of its chain, so that a
        shorter candidate of the same chain plans no second copy to a node the longer one is on its way
        to (a relayed copy shows its first parts landed while the rest are still coming)."""
        out: dict[tuple[str, bytes], set[str]] = {}
        for (namespace, key), nodes in self.pending.items():
            for k in self._pending_chain.get((namespace, key), (key,)):
                out.setdefault((namespace, k), set()).update(nodes)
        return out

    async def _copy_tree(self, d: Decision, nbytes: int) -> None:
        """A copy tree. Every holder sends ``fanout`` copies at a time and
        each target serves its own targets; with ``--copy-chunks`` N > 1 the
        copies relay (:func:`~kvstore.cluster.relay.relay`), else each target serves once its whole
        copy landed (:meth:`_store_and_forward`). Every target is pending from
        the start, so routers see the whole set coming."""
        now = time.monotonic()
        key, children, roots = self.book_tree(d, nbytes, now)
        parts = chunk_bounds(len(d.keys), d.parts)
        if len(parts) > 1:
            self._placed[key] = now
            await self._relay(d, nbytes, children, parts)
            return
        fanout = max(1, self.plan_cfg.fanout)

        async def serve(node: str) -> None:
            # ``node`` sends ``fanout`` copies a wave, its next wave once those landed (so its egress is
            # shared by one wave, not by every edge out of it); a landed target serves its own subtree at
            # once, a failed one's subtree is served from here.
            queue = list(children.get(node, []))
            async with asyncio.TaskGroup() as below:
                while queue:
                    wave, queue = queue[:fanout], queue[fanout:]
                    landed = await asyncio.gather(*(self._copy(dst, d.namespace, list(d.keys), node,
                                                               PageKind.SPECULATIVE, d.ttl_s, nbytes)
                                                    for dst in wave))
                    for dst, ok in zip(wave, landed):
                        if ok:
                            below.create_task(serve(dst))
                        else:
                            queue.extend(children.get(dst, []))

        await asyncio.gather(*(serve(src) for src in roots))

    def book_tree(self, d: Decision, nbytes: int,
                  now: float) -> tuple[tuple[str, bytes], dict[str, list[str]], list[str]]:
        """What a copy tree notes before its first copy, here and in the simulator: every target pending
        from the start (due after the tree's waves at the links' measured rates), and the holder egress the
        tree spares against copying every target from one source. Returns the prefix's key, each
        sender's targets, and the roots (the senders that held it before the tree)."""
        children: dict[str, list[str]] = {}
        for src, dst in d.tree:
            children.setdefault(src, []).append(dst)
        key = (d.namespace, d.keys[-1])
        at_once = {src: min(max(1, self.plan_cfg.fanout), len(dsts)) for src, dsts in children.items()}
        per_wave = max((self.links.copy_s(src, dst, nbytes, at_once[src]) for src, dst in d.tree), default=0.0)
        for _, dst in d.tree:
            self.note_pending(key, d.keys, dst, now + per_wave * d.waves)
        targets = set(d.targets)
        root_edges = [s for s, _ in d.tree if s not in targets]
        self.egress_saved_bytes += (len(d.targets) - len(root_edges)) * nbytes
        return key, children, list(dict.fromkeys(root_edges))

    async def _relay(self, d: Decision, nbytes: int, children: dict[str, list[str]],
                     parts: list[tuple[int, int]]) -> None:
        key = (d.namespace, d.keys[-1])

        async def copy(dst: str, keys: list[bytes], src: str, part_bytes: int) -> bool:
            return await self._copy(dst, d.namespace, keys, src, PageKind.SPECULATIVE, d.ttl_s, part_bytes, part=True)

        await relay(d.tree, list(d.keys), nbytes, children, parts, max(1, self.plan_cfg.fanout), copy,
                    lambda dst: self._landed(key, dst))

    async def _renew(self, node: str, namespace: str, key: bytes, ttl: float) -> None:
        self._placed[(namespace, key)] = time.monotonic()
        chain = self.predictor.chain((namespace, key)) if self.predictor is not None else (key,)
        request = pb.ReplicateRequest(namespace=namespace, keys=list(chain) or [key], source_node_id=node,
                                      kind=PageKind.SPECULATIVE, ttl_seconds=ttl)
        try:
            await self.peers.replicate(node, request, timeout=self.control_timeout)
        except KvError as exc:
            log.debug("renewal on %s failed: %s", node, exc)

    async def _drop(self, node: str, namespace: str, key: bytes) -> None:
        chain = self.predictor.chain((namespace, key)) if self.predictor is not None else (key,)
        try:
            await self.peers.drop_speculative(
                node, pb.DropSpeculativeRequest(namespace=namespace, keys=list(chain) or [key]),
                timeout=self.control_timeout)
        except KvError as exc:
            log.debug("drop on %s failed: %s", node, exc)

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.predictor is not None and hasattr(self.predictor, "close"):
            self.predictor.close()

    def stats(self) -> dict[str, Any]:
        ticks = np.array(self.tick_seconds) if self.tick_seconds else np.zeros(1)
        slices = np.array(self.tick_slices) if self.tick_slices else np.zeros(1)
        out = {"policy": self.policy, "speculative_prefixes": len(self.speculative), "pending": len(self.pending),
               "bandwidth_bps": self.bandwidth, "links": self.links.stats(), "tick_p50_ms": float(np.percentile(ticks, 50) * 1e3),
               "tick_p99_ms": float(np.percentile(ticks, 99) * 1e3),
               "tick_slice_p50_ms": float(np.percentile(slices, 50) * 1e3),
               "tick_slice_p99_ms": float(np.percentile(slices, 99) * 1e3)}
        if self.predictor is not None:
            out.update(self.predictor.stats())
        out["egress_saved_bytes"] = self.egress_saved_bytes
        out["pages_from"] = dict(self.pages_from)
        total = sum(self.decision_sources.values())
        out["decision_sources"] = {k: v / total for k, v in self.decision_sources.items()} if total else {}
        return out

