"""The daemon's coordinator and the simulated replay's drive one core and decide the same.

Two identical simulated clusters (:class:`~kvstore.replay.sim_cluster.SimCluster`: pools, directory,
membership, heartbeat reports) see the same event sequence: a prefix stored on one node, a burst of
recorded lookups for it on the others, heartbeat reports, planner ticks. One cluster's placement is
the simulated replay's shell (:class:`~kvstore.replay.sim_coord.SimCoordinator`), the other's the
daemon's asyncio shell (:class:`~kvstore.cluster.coordinator.Coordinator`, on a running event loop,
its ``Replicate`` calls carried out on the second cluster's pools). Both must make the same
decisions: the same effects out of each tick, in the same order, and the same copies in all.
No sockets: the live shell's RPCs land in its cluster's pools in process.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any

import pytest

from kvstore.cluster.coordinator import Coordinator
from kvstore.cluster.coordinator_core import Copy, Drop, Effect, Renew
from kvstore.config import NodeConfig
from kvstore.metrics import NodeMetrics
from kvstore.pool.pool import PageKind
from kvstore.replay.sim_cluster import PRIMARY, ClusterParams, SimCluster
from kvstore.replay.sim_coord import SimCoordinator
from kvstore.replay.sim_kernel import Sim
from kvstore.v1 import kvstore_pb2 as pb

NODES, PAGE, PREFIX = 6, 4096, 8


def _params() -> ClusterParams:
    return ClusterParams(nodes=NODES, namespace="m", page_bytes=PAGE, scaled_page_bytes=PAGE,
                         capacity_bytes=1024 * PAGE, policy="predictive", speedup=1.0, heartbeat_s=0.5,
                         heartbeat_timeout_s=3.0, fetch_timeout_s=5.0, link_rate=200e6, link_latency=0.0)


def _config(**kw: Any) -> NodeConfig:
    """A predictive coordinator that sizes a burst of a dozen lookups for every other node (``node_rate``
    low: each node serves few requests a second) and ticks twice a heartbeat, scoring by momentum (no
    model file: the shells, not the model, are under test)."""
    return NodeConfig(listen="127.0.0.1:0", replication="predictive", planner_tick=0.25, spec_ttl=30.0,
                      node_rate=0.01, predictor_model="none", **kw)


class _NoNamespaces:
    namespaces: dict[str, object] = {}


class _Peers:
    """The live shell's peer calls, carried out on its simulated cluster's pools at once."""

    def __init__(self, cluster: SimCluster) -> None:
        self.cluster = cluster

    async def replicate(self, target: str, request: pb.ReplicateRequest, timeout: float) -> pb.ReplicateResponse:
        await asyncio.sleep(0)
        pool = self.cluster.pools[self.cluster.index[target]]
        keys = list(dict.fromkeys(request.keys))
        expires = self.cluster.dnow() + request.ttl_seconds if request.kind == PageKind.SPECULATIVE else 0.0
        if expires:
            pool.renew(keys, expires)
        todo = [k for k in keys if k not in pool]
        source = self.cluster.pools[self.cluster.index[request.source_node_id]]
        copied = [k for k in todo if k in source]
        pool.store(copied, int(request.kind), expires)
        return pb.ReplicateResponse(copied=len(copied), already_present=len(keys) - len(todo))

    async def drop_speculative(self, target: str, request: pb.DropSpeculativeRequest, timeout: float) -> Any:
        self.cluster.pools[self.cluster.index[target]].drop_speculative(list(request.keys))


def _key(effect: Effect) -> tuple[Any, ...]:
    if isinstance(effect, Copy):
        return ("copy", effect.source, effect.target, tuple(effect.keys), effect.kind, effect.ttl_s, effect.nbytes,
                effect.part)
    if isinstance(effect, Renew):
        return ("renew", effect.node, effect.keys, round(effect.expires_at, 9))
    assert isinstance(effect, Drop)
    return ("drop", effect.node, effect.keys)


def _tap(core: Any, log: list[tuple[Any, ...]]) -> None:
    """Record every effect the core hands its shell (and hand it on)."""
    perform = core.perform

    def record(effect: Effect) -> None:
        log.append(_key(effect))
        perform(effect)
    core.perform = record


@pytest.mark.parametrize("chunks", [1, 4])
def test_the_daemon_and_the_simulator_drive_one_core_to_the_same_decisions(chunks: int) -> None:
    config = _config(copy_chunks=chunks, copy_part_min=1e-9)
    keys = [bytes([i]) * 16 for i in range(PREFIX)]

    async def scenario() -> tuple[list[list[tuple[Any, ...]]], list[list[tuple[Any, ...]]], int]:
        worlds = [SimCluster(Sim(), _params()) for _ in range(2)]
        simulated, live = worlds
        shells: list[Any] = [SimCoordinator(config, simulated, rpc_s=0.001)]
        daemon = Coordinator(config, live.directory, live.membership, _Peers(live),  # type: ignore[arg-type]
                             NodeMetrics(_NoNamespaces()), page_bytes=lambda ns: PAGE, clock=live.dnow)
        shells.append(daemon)
        logs: list[list[tuple[Any, ...]]] = [[], []]
        for world, shell, log in zip(worlds, shells, logs):
            world.placement = shell
            _tap(shell.core, log)
            world.pools[0].store(keys, PRIMARY)
            world.start()

        async def until(t: float) -> None:
            """Both clusters' clocks to ``t``, 10 ms at a time; the event loop runs what the live shell started
            after each step (its copies land in the step they began, the simulated ones after their links)."""
            while worlds[0].sim.now < t:
                step = min(t, worlds[0].sim.now + 0.01)
                for world in worlds:
                    world.sim.run(until=step)
                    world.sim.now = step
                for _ in range(20):
                    await asyncio.sleep(0)

        ticks: list[list[list[tuple[Any, ...]]]] = [[], []]

        async def tick(t: float) -> None:
            await until(t)
            for i, (shell, log) in enumerate(zip(shells, logs)):
                before = len(log)
                result = shell.tick()
                if asyncio.iscoroutine(result):
                    await result
                ticks[i].append(log[before:])

        await until(1.0)
        for j in range(12):  # a burst of recorded lookups for the prefix on nodes 1..5
            for world in worlds:
                world.lookup(1 + j % (NODES - 1), keys, record=True)
            await until(1.0 + 0.02 * (j + 1))
        await tick(2.0)  # heartbeats reported the burst by now
        await tick(12.0)
        await tick(40.0)  # long after the burst: renew or drop
        await until(45.0)
        await daemon.close()
        return ticks[0], ticks[1], len(logs[0])

    sim_ticks, live_ticks, effects = asyncio.run(scenario())
    assert any(e[0] == "copy" for e in sim_ticks[0]), "the burst placed no copy: nothing was compared"
    assert sim_ticks == live_ticks
    assert effects > len(sim_ticks[0])  # the trees' later waves (or relayed parts) came from their copies' ends


def test_both_shells_count_the_same_copies_over_a_whole_tree() -> None:
    """Over every effect of a copy tree (its waves, not only the tick's first), the two shells start the
    same copies: same (source, target, keys) multiset."""
    config = _config()
    keys = [bytes([i]) * 16 for i in range(PREFIX)]

    async def scenario() -> list[Counter[tuple[Any, ...]]]:
        worlds = [SimCluster(Sim(), _params()) for _ in range(2)]
        shells: list[Any] = [SimCoordinator(config, worlds[0], rpc_s=0.001),
                             Coordinator(config, worlds[1].directory, worlds[1].membership,  # type: ignore[arg-type]
                                         _Peers(worlds[1]), NodeMetrics(_NoNamespaces()),
                                         page_bytes=lambda ns: PAGE, clock=worlds[1].dnow)]
        logs: list[list[tuple[Any, ...]]] = [[], []]
        for world, shell, log in zip(worlds, shells, logs):
            world.placement = shell
            _tap(shell.core, log)
            world.pools[0].store(keys, PRIMARY)
            world.start()
        for step in range(1, 301):
            for world in worlds:
                world.sim.run(until=step * 0.01)
            if step <= 12:
                for world in worlds:
                    world.lookup(1 + step % (NODES - 1), keys, record=True)
            if step == 100:
                shells[0].tick()
                await shells[1].tick()
            for _ in range(20):
                await asyncio.sleep(0)
        await shells[1].close()
        return [Counter(e[:4] for e in log if e[0] == "copy") for log in logs]

    simulated, live = asyncio.run(scenario())
    assert sum(simulated.values()) > 1 and simulated == live
