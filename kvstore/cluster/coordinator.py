"""The coordinator role's placement work, in the daemon: an asyncio shell around
:class:`~kvstore.cluster.coordinator_core.CoordinatorCore`, which makes every decision. The
shell runs the planner tick on the event loop (in slices, ``kvstore.loops.slices``), carries out
the core's effects as RPCs (``Replicate`` for a :class:`~kvstore.cluster.coordinator_core.Copy` or a
:class:`~kvstore.cluster.coordinator_core.Renew`, ``DropSpeculative`` for a
:class:`~kvstore.cluster.coordinator_core.Drop`), reports each copy's reply back to the core, and
exports the core's counters as Prometheus metrics. The simulated replay drives the same core on its
own clock (:mod:`kvstore.replay.sim_coord`).

Policies (``--replication``): ``none`` and ``reactive`` place nothing here;
``predictive`` places speculative replicas ahead of forecast bursts;
``full`` copies every new page to every other node (the cost ceiling).

The agent feeds it through the ``Placement`` calls (``observe``, ``on_report``, ``hints``,
``on_claims_landed``) and does not import this module.

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
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from kvstore.cluster.claims import Claim
from kvstore.cluster.coordinator_core import Copy, CoordinatorCore, Drop, Effect, Promote, Renew
from kvstore.cluster.directory import Directory
from kvstore.cluster.membership import Membership
from kvstore.cluster.peers import PeerClient
from kvstore.config import NodeConfig
from kvstore.errors import KvError
from kvstore.loops.slices import on_loop, sliced
from kvstore.metrics import NodeMetrics
from kvstore.pool.pool import PageKind
from kvstore.tracing import TRACER
from kvstore.v1 import kvstore_pb2 as pb

log = logging.getLogger(__name__)

TICK_SLICE_S = 0.002
"""A planner tick holds the event loop for slices of about this long (``kvstore.loops.slices``):
a request that arrives during a tick waits behind one slice, not the whole tick."""


def _call_soon(fn: Callable[..., None], *args: Any) -> None:
    asyncio.get_running_loop().call_soon(fn, *args)


class Coordinator:
    """Predictive and full replication, run on whichever node coordinates."""

    def __init__(self, config: NodeConfig, directory: Directory, membership: Membership, peers: PeerClient,
                 metrics: NodeMetrics, page_bytes: Callable[[str], int],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.core = CoordinatorCore(config, directory, membership, page_bytes, clock=clock,
                                    defer=_call_soon, perform=self._perform)
        self.membership = membership
        self.peers = peers
        self.metrics = metrics
        self.control_timeout = config.control_timeout
        self._tasks: set[asyncio.Task[Any]] = set()
        self._closing = False
        self._exported: dict[str, Counter[str]] = {"decisions": Counter(), "replicated": Counter()}
        self.tick_seconds: list[float] = []  # each tick's wall time, scoring off the loop included
        self.tick_slices: list[float] = []   # each tick's longest stretch on the loop (scoring's too)

    # ---- the agent's Placement calls -------------------------------------------
    @property
    def policy(self) -> str:
        return self.core.policy

    @property
    def predictor(self) -> Any:
        return self.core.predictor

    @property
    def plan_cfg(self) -> Any:
        return self.core.plan_cfg

    def observe(self, node: str, event: pb.AccessEvent) -> None:
        self.core.observe(node, event)

    def on_report(self, node: str, batches: Sequence[pb.DirectoryBatch]) -> None:
        self.core.on_report(node, batches)

    def hints(self, namespace: str, chain: Sequence[bytes]) -> list[pb.NodePrefix]:
        return self.core.hints(namespace, chain)

    def on_claims_landed(self, claims: Sequence[Claim]) -> None:
        self.core.on_claims_landed(claims)
        self._export()

    def sending(self, node: str) -> int:
        return self.core.links.sending[node]

    def joining(self) -> list[str]:
        return self.core.joining()

    def relay_parts(self, namespace: str, keys: int) -> int:
        return self.core.relay_parts(namespace, keys)

    # ---- the tick ----------------------------------------------------------
    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.core.plan_cfg.tick_s)
            if not self.membership.is_coordinator or self.policy in ("none", "reactive"):
                continue
            start = time.perf_counter()
            try:
                with TRACER.start_as_current_span("kvstore.planner_tick", attributes={"kvstore.policy": self.policy}):
                    await self.tick()
            except Exception:  # a bad tick must not stop placement
                log.exception("planner tick failed")
            took = time.perf_counter() - start
            self.metrics.tick_latency.observe(took)
            self.tick_seconds.append(took)
            del self.tick_seconds[:-1000]

    async def tick(self) -> None:
        core = self.core
        if self.policy == "full":
            core.tick_full()
            self._export()
            return
        assert core.predictor is not None
        now = core.clock()
        scores = await core.predictor.score_async(now)
        slices = list(core.predictor.loop_stretches)  # scoring's own stretches on the loop count too
        start = time.perf_counter()
        core.predictor.maybe_retrain(now)
        slices.append(time.perf_counter() - start)
        await on_loop(sliced(core.tick_steps(scores, now), TICK_SLICE_S, slices))
        self._export()
        longest = max(slices)
        self.metrics.tick_slice.observe(longest)
        self.tick_slices.append(longest)
        del self.tick_slices[:-1000]

    # ---- carrying out the core's effects ------------------------------------
    def _perform(self, effect: Effect) -> None:
        if self._closing:
            return
        if isinstance(effect, Copy):
            coro: Any = self._replicate(effect)
        elif isinstance(effect, Renew):
            coro = self._renew(effect)
        elif isinstance(effect, Promote):
            coro = self._promote(effect)
        else:
            coro = self._drop(effect)
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _replicate(self, copy: Copy) -> None:
        request = pb.ReplicateRequest(namespace=copy.namespace, keys=copy.keys, source_node_id=copy.source,
                                      kind=copy.kind, ttl_seconds=copy.ttl_s)
        reply = None
        try:
            reply = await self.peers.replicate(copy.target, request,
                                               timeout=max(self.control_timeout, 4 * self.core.plan_cfg.tick_s))
        except KvError as exc:
            log.warning("replicate to %s failed: %s", copy.target, exc)
        finally:
            self.core.copy_ended(copy, reply.copied if reply is not None else None,
                                 reply.already_present if reply is not None else 0)
            self._export()

    async def _renew(self, renew: Renew) -> None:
        await self._from_itself(renew.node, renew.namespace, renew.keys, PageKind.SPECULATIVE, renew.ttl_s, "renewal")

    async def _promote(self, promote: Promote) -> None:
        await self._from_itself(promote.node, promote.namespace, promote.keys, PageKind.REPLICA, 0.0, "promotion")

    async def _from_itself(self, node: str, namespace: str, keys: Sequence[bytes], kind: PageKind, ttl_s: float,
                           what: str) -> None:
        """A ``Replicate`` to ``node`` from itself: it extends the expiry of the speculative pages of ``keys`` it
        holds (a renewal) and reads those its tiers hold up into its pool (a promotion)."""
        request = pb.ReplicateRequest(namespace=namespace, keys=list(keys), source_node_id=node, kind=kind,
                                      ttl_seconds=ttl_s)
        try:
            await self.peers.replicate(node, request, timeout=self.control_timeout)
        except KvError as exc:
            log.debug("%s on %s failed: %s", what, node, exc)

    async def _drop(self, drop: Drop) -> None:
        try:
            await self.peers.drop_speculative(
                drop.node, pb.DropSpeculativeRequest(namespace=drop.namespace, keys=list(drop.keys)),
                timeout=self.control_timeout)
        except KvError as exc:
            log.debug("drop on %s failed: %s", drop.node, exc)

    def _export(self) -> None:
        """The core's counters, as they grew since the last export, onto the Prometheus counters."""
        for name, counts, metric in (("decisions", self.core.decisions, self.metrics.decisions),
                                     ("replicated", self.core.replicated, self.metrics.spec_bytes)):
            done = self._exported[name]
            for kind, value in counts.items():
                if value > done[kind]:
                    metric.labels(kind).inc(value - done[kind])
                    done[kind] = value

    async def close(self) -> None:
        self._closing = True
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.core.predictor is not None and hasattr(self.core.predictor, "close"):
            self.core.predictor.close()

    def stats(self) -> dict[str, Any]:
        ticks = np.array(self.tick_seconds) if self.tick_seconds else np.zeros(1)
        slices = np.array(self.tick_slices) if self.tick_slices else np.zeros(1)
        out = self.core.stats()
        out.update({"tick_p50_ms": float(np.percentile(ticks, 50) * 1e3),
                    "tick_p99_ms": float(np.percentile(ticks, 99) * 1e3),
                    "tick_slice_p50_ms": float(np.percentile(slices, 50) * 1e3),
                    "tick_slice_p99_ms": float(np.percentile(slices, 99) * 1e3)})
        return out
