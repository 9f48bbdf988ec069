"""The asyncio driver of one policy run: arrivals, router, simulated engines, oracle.

One event loop, one :class:`AsyncKvClient` per node. Arrivals are scheduled
at ``t / speedup`` real seconds from the start. Each arrival is routed (the
cache-aware router asks ``n0``, the coordinator, for the per-node prefixes
and placement hints) and queued on its node's :class:`Engine`.

An engine has ``concurrency`` slots (its batch) and one prefill unit (prefill is compute-bound: one
at a time). Once a request has a slot, the engine steps the serve loop of
:mod:`kvstore.replay.serve` (the same one the simulated replay steps) and carries out its operations
for real: ``Lookup`` and ``Get`` on its node (the node serves local pages and, under
reactive/predictive/full, pulls the rest from peers; the fetched pages' bytes are checked against
their keys), the prefill unit held for the modelled prefill / speedup, ``Put`` on the engine's second
client, as the vLLM connector saves on a connection of its own (``--shared-save``: on the one client,
behind its Gets), and sleeps of the modelled times / speedup.

Every loop is bounded (request count, ``drain_timeout_s``); the caller owns
the cluster and stops it in a ``finally``.
"""

from __future__ import annotations

import asyncio
import gc
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
import numpy as np

from kvstore.replay.costmodel import CostModel
from kvstore.replay.metrics import RequestRecord
from kvstore.replay.oracle import Plan, Step, plan
from kvstore.replay.routers import NodeView, Router, views_from_lookup
from kvstore.replay.serve import (EngineState, Get, Lookup, Op, Prefill, Put, Rules, Sleep, StoreError, WaitHeld,
                                  advance, serve)
from kvstore.replay.workload import Workload, reusable_blocks
from kvstore.errors import KvError
from kvstore.workloads.traces import hash_key
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc as pb_grpc
from kvstore_client import AsyncKvClient

SALT = np.uint64(0x9E3779B97F4A7C15)  # page word = hash id ^ SALT: deterministic, checkable content


def page_words(hash_ids: np.ndarray) -> np.ndarray:
    """The uint64 word every 8 bytes of a block's page hold."""
    return hash_ids.astype(np.uint64) ^ SALT


def make_pages(words: np.ndarray, page_bytes: int) -> np.ndarray:
    """``uint8 [n, page_bytes]`` pages, each filled with its word."""
    return np.ascontiguousarray(np.repeat(words[:, None], page_bytes // 8, axis=1)).view(np.uint8)


def bad_pages(pages: np.ndarray, words: np.ndarray) -> int:
    """How many rows of ``pages`` are not filled with their word."""
    if not len(words):
        return 0
    got = pages.view(np.uint64)
    return int((~(got == words[:, None]).all(axis=1)).sum())


@dataclass(slots=True)
class RunConfig:
    policy: str
    router: Router
    cost: CostModel
    namespace: str
    speedup: float = 4.0
    concurrency: int = 8
    oracle_lead_s: float = 4.0        # trace seconds: the oracle copies no earlier than this before a request
    oracle_rpc_s: float = 0.005       # real seconds the oracle's plan allows for one Put or Replicate round trip
    spec_ttl_s: float = 60.0          # real seconds (oracle copies)
    fetch_timeout_s: float = 5.0      # real seconds, the Get deadline
    rpc_timeout_s: float = 30.0
    data_connections: int = 1         # each engine's client: calls side by side on this many data channels
    save_client: bool = True          # Puts on a second client per engine (the vLLM connector's save connection)
    sample_s: float = 0.25            # real seconds between timeline samples
    drain_timeout_s: float = 120.0    # real seconds to finish after the last arrival
    verify: bool = True
    kills: list[tuple[int, float]] = field(default_factory=list)   # (node index, trace s): --kill
    kill: Callable[[int], None] | None = None                       # SIGKILLs node i
    claims: bool = False              # +claims: claim this engine's prefills, wait for others' (claiming.py)
    claim_margin: float = 1.0
    link_bytes_s: float = 12.5e9      # unscaled bytes per trace second of the modelled link (the wait rule)


@dataclass(slots=True)
class RunResult:
    records: list[RequestRecord]
    timeline: dict[str, Any]
    oracle: dict[str, int] = field(default_factory=dict)
    put_errors: int = 0
    placed_used_pages: int = 0        # local hits on pages the node got by replication, distinct
    node_stats: list[Any] = field(default_factory=list)
    killed: dict[int, float] = field(default_factory=dict)   # node index -> trace s it was killed
    wall_s: float = 0.0


class _Req:
    """A request with its keys and page words, ready to serve."""

    __slots__ = ("i", "req", "keys", "words", "rec", "t_enq", "step", "est")

    def __init__(self, i: int, req: Any, rec: RequestRecord) -> None:
        self.i, self.req, self.rec = i, req, rec
        ids = np.array(req.hash_ids, dtype=np.uint64)
        self.keys = [hash_key(h) for h in req.hash_ids]
        self.words = page_words(ids)
        self.t_enq = 0.0
        self.est = 0.0  # its prefill as admitted to its engine's slot queue (EngineState.admit)
        self.step: Step | None = None  # oracle: its planned node, depth and copy


async def _no_stats() -> Any:
    """Stats of a killed node: no namespaces (the sampler counts it as zero)."""
    return pb.StatsResponse(namespaces=[pb.NamespaceStats()])


class Held:
    """Which pages each node holds, as events the oracle's requests and copies wait on (harness-side: the
    engines know when their Get and Put finished, and the copies when their Replicate did)."""

    def __init__(self, nodes: int) -> None:
        self._events: list[dict[bytes, asyncio.Event]] = [{} for _ in range(nodes)]

    def _event(self, node: int, key: bytes) -> asyncio.Event:
        ev = self._events[node].get(key)
        if ev is None:
            ev = self._events[node][key] = asyncio.Event()
        return ev

    def has(self, node: int, key: bytes) -> bool:
        ev = self._events[node].get(key)
        return ev is not None and ev.is_set()

    def mark(self, node: int, keys: list[bytes]) -> None:
        for k in keys:
            self._event(node, k).set()

    async def wait(self, node: int, keys: list[bytes], timeout: float | None) -> bool:
        """True once ``node`` holds every key; False after ``timeout`` real seconds."""
        pending = [self._event(node, k).wait() for k in keys if not self.has(node, k)]
        if not pending:
            return True
        try:
            await asyncio.wait_for(asyncio.gather(*pending), timeout)
            return True
        except asyncio.TimeoutError:
            return False


class Engine:
    """One simulated inference engine, in front of one node."""

    def __init__(self, index: int, node_id: str, kv: AsyncKvClient, cfg: RunConfig, on_done: Callable[[], None],
                 result: RunResult, held: "Held | None" = None, saver: AsyncKvClient | None = None) -> None:
        self.index, self.node_id, self.kv, self.cfg = index, node_id, kv, cfg
        # Puts on a client of their own, as the vLLM connector saves on its own connection: a claimant's
        # Put never queues behind its engine's Get waiting on a remote pull (the followers wait on that Put)
        self.saver = saver or kv
        self.queue: asyncio.Queue[_Req | None] = asyncio.Queue()
        self.prefill = asyncio.Lock()
        self.waiting = 0        # queued for a slot
        self.running = 0        # in a slot
        self.state = EngineState(index, node_id, Rules.of(cfg.policy, cfg.cost, cfg.speedup, claims=cfg.claims,
                                                          claim_margin=cfg.claim_margin,
                                                          link_bytes_s=cfg.link_bytes_s),
                                 held=held, oracle=result.oracle)
        self._on_done = on_done
        self.clock_start = 0.0  # perf_counter of trace time 0 (set by the driver)
        self._buffers: list[np.ndarray] = []  # Get output buffers, reused: a fresh one per Get costs page faults
        self.workers = [asyncio.create_task(self._worker()) for _ in range(cfg.concurrency)]

    @property
    def load(self) -> int:
        return self.waiting + self.running

    def submit(self, item: _Req) -> None:
        item.t_enq = time.perf_counter()
        item.est = self.state.admit(item.keys, item.rec.input_tokens)
        self.waiting += 1
        self.queue.put_nowait(item)

    async def close(self) -> None:
        for _ in self.workers:
            self.queue.put_nowait(None)
        done, pending = await asyncio.wait(self.workers, timeout=5)
        for task in pending:
            task.cancel()
        await asyncio.gather(*self.workers, return_exceptions=True)

    async def _worker(self) -> None:
        while True:
            item = await self.queue.get()
            if item is None:
                return
            self.state.seated(item.est)
            self.waiting -= 1
            self.running += 1
            try:
                await self._serve(item, (time.perf_counter() - item.t_enq) * self.cfg.speedup)
            except (KvError, grpc.RpcError, OSError, ConnectionError, asyncio.TimeoutError) as exc:
                item.rec.error = f"{type(exc).__name__}: {exc}"[:200]
            finally:
                self.running -= 1
                self._on_done()

    def _buffer(self, pages: int) -> np.ndarray:
        """A Get output buffer of at least ``pages`` pages (give it back to ``_buffers`` after use)."""
        while self._buffers:
            buf = self._buffers.pop()
            if len(buf) >= pages:
                return buf
        return np.zeros((max(pages, 128), self.cfg.cost.scaled_page_bytes), dtype=np.uint8)

    def now(self) -> float:
        """The run's clock in trace seconds."""
        return (time.perf_counter() - self.clock_start) * self.cfg.speedup

    async def _serve(self, item: _Req, slot_wait: float) -> None:
        """:func:`~kvstore.replay.serve.serve`, its operations carried out by real RPCs and asyncio waits."""
        gen = serve(self.state, item.rec, item.keys, item.step, slot_wait, self.now)
        value: Any = None
        error: StoreError | None = None
        while (op := advance(gen, value, error)) is not None:
            value, error = None, None
            try:
                value = await self._perform(op, item)
            except (KvError, grpc.RpcError, OSError) as exc:  # the node is gone (--kill): the engine recomputes
                error = StoreError(f"{type(exc).__name__}: {exc}")

    async def _perform(self, op: Op, item: _Req) -> Any:
        cfg, S = self.cfg, self.cfg.speedup
        if isinstance(op, Sleep):
            await asyncio.sleep(op.seconds / S)
            return None
        if isinstance(op, Lookup):
            lk = await self.kv.lookup_nodes(cfg.namespace, op.keys, record=op.record, claim_seconds=op.claim_s)
            return int(lk.prefix_length), lk.nodes, lk.tiers
        if isinstance(op, Get):
            fetch = len(op.keys)
            buf = self._buffer(fetch)
            buf[:fetch].fill(0)  # no page of an earlier Get can pass for one this Get did not write
            try:
                timeout = op.deadline_s / S if op.deadline_s > 0 else cfg.fetch_timeout_s
                got = await self.kv.get(cfg.namespace, op.keys, timeout=timeout, out=buf[:fetch])
                found = got.found
                cached = int(found.argmin()) if not found.all() else len(found)
                return cached, bad_pages(got.pages[:cached], item.words[:cached]) if cfg.verify else 0
            finally:
                self._buffers.append(buf)
        if isinstance(op, Prefill):
            t1 = time.perf_counter()
            async with self.prefill:
                waited = (time.perf_counter() - t1) * S
                await asyncio.sleep(op.seconds() / S)
            return waited
        if isinstance(op, Put):
            t2 = time.perf_counter()
            try:
                await self.saver.put(cfg.namespace, op.keys,
                                     make_pages(item.words[op.start:op.start + len(op.keys)], cfg.cost.scaled_page_bytes))
                return True, time.perf_counter() - t2
            except (KvError, grpc.RpcError, OSError):
                return False, time.perf_counter() - t2
        assert isinstance(op, WaitHeld) and self.state.held is not None
        return await self.state.held.wait(self.index, op.keys, op.timeout_s / S)


class Driver:
    """Replays one workload against one running cluster under one policy."""

    def __init__(self, workload: Workload, node_ids: list[str], addresses: list[str], cfg: RunConfig,
                 progress: Any = None, ingress: Callable[[int], float] | None = None) -> None:
        self.workload, self.node_ids, self.addresses, self.cfg = workload, node_ids, addresses, cfg
        self.progress = progress
        self.ingress = ingress  # node index -> peer bytes it received so far (every kind of transfer), or None
        # ingress_bytes: per stats sample and node, modelled bytes received over links so far (all kinds)
        self.result = RunResult(records=[], timeline={"t": [], "waiting": [], "running": [],
                                                      "stats_t": [], "spec_slots": [], "replica_slots": [],
                                                      "ingress_bytes": []})
        self.oracle_plan: Plan | None = None
        self.held: Held | None = None
        self.store_down: set[int] = set()  # node indices whose kvstored is not a live member (Status)
        self._outstanding = 0
        self._all_done = asyncio.Event()
        self._start = 0.0

    # ---- helpers -------------------------------------------------------------
    def _done(self) -> None:
        self._outstanding -= 1
        if self.progress is not None:
            self.progress.update(1)
        if self._outstanding <= 0:
            self._all_done.set()

    def _loads(self) -> list[float]:
        return [float(e.load) for e in self.engines]

    def _work(self) -> list[float]:
        return [e.state.backlog_s for e in self.engines]

    async def _views(self, keys: list[bytes]) -> list[NodeView]:
        views = views_from_lookup(self.node_ids, self._loads(), (), self._work())
        if self.cfg.router.needs_prefix:
            for i in self._alive():  # the coordinator first; another node if it was killed
                try:
                    lk = await self.kvs[i].lookup_nodes(self.cfg.namespace, keys)
                    views = views_from_lookup(self.node_ids, self._loads(), lk.nodes, self._work())
                    break
                except (KvError, grpc.RpcError, OSError):
                    continue
        for i in self.store_down:
            views[i].down = True
        for v, e in zip(views, self.engines):
            e.state.show(v, e.load, self.cfg.concurrency, keys, self.cfg.router.needs_engine_cache)
        return views

    async def _watch_members(self) -> None:
        """The router's view of which stores are up: the cluster's Status (live members), every sample
        period, as a fleet router would watch it -- a killed node drops out a heartbeat timeout later."""
        while True:
            for i in self._alive():
                try:
                    st = await self.cluster_stubs[i].Status(pb.ClusterStatusRequest(), timeout=self.cfg.rpc_timeout_s)
                except grpc.RpcError:
                    continue
                live = {m.node_id for m in st.members}
                self.store_down = {j for j, n in enumerate(self.node_ids) if n not in live}
                break
            await asyncio.sleep(self.cfg.sample_s)

    def _alive(self) -> list[int]:
        return [i for i in range(len(self.node_ids)) if i not in self.result.killed]

    async def _kill(self) -> None:
        """SIGKILL the ``--kill`` nodes at their trace times (the cluster does it: ``cfg.kill``)."""
        loop = asyncio.get_running_loop()
        for index, t in sorted(self.cfg.kills, key=lambda k: k[1]):
            delay = self._real_at(t) - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            assert self.cfg.kill is not None
            self.cfg.kill(index)
            self.result.killed[index] = (loop.time() - self._start) * self.cfg.speedup

    def _real_at(self, t_trace: float) -> float:
        return self._start + t_trace / self.cfg.speedup

    # ---- arrivals --------------------------------------------------------------
    async def _arrive(self, item: _Req, lag: float) -> None:
        rec = item.rec
        rec.lag_s = lag
        t0 = time.perf_counter()
        try:
            if item.step is not None and self.oracle_plan is not None:
                index, reason = item.step.node, f"oracle-{self.oracle_plan.name}"
            else:
                views = await self._views(item.keys)
                index, reason = self.cfg.router.choose(views, len(item.keys))
        except (KvError, grpc.RpcError, OSError) as exc:
            rec.error = f"route: {type(exc).__name__}: {exc}"[:200]
            self._done()
            return
        rec.route_s = time.perf_counter() - t0
        rec.node, rec.route_reason = self.node_ids[index], reason
        self.engines[index].submit(item)

    async def _dispatch(self, items: list[_Req], tasks: set[asyncio.Task[Any]]) -> None:
        loop = asyncio.get_running_loop()
        for item in items:
            due = self._real_at(item.rec.t)
            delay = due - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            task = loop.create_task(self._arrive(item, max(0.0, loop.time() - due)))
            tasks.add(task)
            task.add_done_callback(tasks.discard)

    # ---- oracle ----------------------------------------------------------------
    async def _oracle(self, items: list[_Req], tasks: set[asyncio.Task[Any]]) -> None:
        """Start the plan's copies in their planned order; each waits for its planned time and its source."""
        loop = asyncio.get_running_loop()
        self._links = [(asyncio.Lock(), asyncio.Lock()) for _ in self.node_ids]  # (egress, ingress) per node
        copies = sorted((it.step.copy_at, it.i) for it in items if it.step is not None and it.step.source >= 0)
        for at, i in copies:
            delay = self._real_at(at) - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            task = loop.create_task(self._copy(items[i]))
            tasks.add(task)
            task.add_done_callback(tasks.discard)

    async def _copy(self, item: _Req) -> None:
        """``Replicate`` the planned blocks to the request's node once its source holds them, one copy at a
        time per link (the plan's schedule), only the pages the target still lacks."""
        cfg, stats, held = self.cfg, self.result.oracle, self.held
        step = item.step
        assert step is not None and held is not None
        keys = item.keys[step.copy_from:step.depth]
        await held.wait(step.source, keys, None)
        egress, ingress = self._links[step.source][0], self._links[step.node][1]
        async with egress, ingress:
            need = [k for k in keys if not held.has(step.node, k)]
            if not need:
                return
            try:
                reply = await self.cluster_stubs[step.node].Replicate(pb.ReplicateRequest(
                    namespace=cfg.namespace, keys=need, source_node_id=self.node_ids[step.source],
                    kind=pb.SPECULATIVE, ttl_seconds=cfg.spec_ttl_s), timeout=cfg.rpc_timeout_s)
            except (KvError, grpc.RpcError):
                stats["replicate_errors"] = stats.get("replicate_errors", 0) + 1
                return
        stats["replicate_calls"] = stats.get("replicate_calls", 0) + 1
        stats["copied_pages"] = stats.get("copied_pages", 0) + int(reply.copied)
        if reply.copied + reply.already_present >= len(need):
            held.mark(step.node, need)
        else:  # the source lacked some (evicted, or dropped from view): the request will not wait past its plan
            stats["short_copies"] = stats.get("short_copies", 0) + 1

    # ---- timeline --------------------------------------------------------------
    async def _sample(self) -> None:
        tl = self.result.timeline
        loop = asyncio.get_running_loop()
        k = 0
        while True:
            now = loop.time()
            tl["t"].append((now - self._start) * self.cfg.speedup)
            tl["waiting"].append([e.waiting for e in self.engines])
            tl["running"].append([e.running for e in self.engines])
            if k % 4 == 0:
                try:
                    st = await asyncio.gather(*(self.kvs[i].stats(self.cfg.namespace) if i in self._alive()
                                                else _no_stats() for i in range(len(self.kvs))))
                    tl["stats_t"].append((loop.time() - self._start) * self.cfg.speedup)
                    tl["spec_slots"].append([int(s.namespaces[0].speculative_slots) for s in st])
                    tl["replica_slots"].append([int(s.namespaces[0].replica_slots) for s in st])
                    if self.ingress is not None:
                        alive = self._alive()
                        got = await asyncio.gather(*(asyncio.to_thread(self.ingress, i) if i in alive
                                                     else asyncio.sleep(0, 0.0) for i in range(len(self.kvs))))
                        tl["ingress_bytes"].append([b * self.cfg.cost.byte_scale for b in got])
                except (KvError, grpc.RpcError):
                    pass
            k += 1
            await asyncio.sleep(max(0.0, self.cfg.sample_s - (loop.time() - now)))

    # ---- the run ---------------------------------------------------------------
    async def run(self) -> RunResult:
        cfg, reqs = self.cfg, self.workload.requests
        reusable = reusable_blocks(reqs)
        if cfg.policy == "oracle":
            self.oracle_plan = plan(reqs, reusable, len(self.node_ids), cfg.concurrency, cfg.cost,
                                    cfg.oracle_lead_s, cfg.oracle_rpc_s * cfg.speedup, down=dict(cfg.kills))
            self.held = Held(len(self.node_ids))
            self.result.oracle.update(plan=self.oracle_plan.name, plan_p99_s=round(self.oracle_plan.p99, 4),
                                      candidates=self.oracle_plan.candidates,
                                      planned_copies=sum(s.source >= 0 for s in self.oracle_plan.steps),
                                      planned_waits=sum(s.depth > 0 for s in self.oracle_plan.steps))
        items = []
        for i, r in enumerate(reqs):
            rec = RequestRecord.of(i, r, reusable[i])
            self.result.records.append(rec)
            items.append(_Req(i, r, rec))
            if self.oracle_plan is not None:
                items[-1].step = self.oracle_plan.steps[i]
        self._outstanding = len(items)
        self.kvs = [AsyncKvClient(a, timeout=cfg.rpc_timeout_s, data_connections=cfg.data_connections)
                    for a in self.addresses]
        savers = [AsyncKvClient(a, timeout=cfg.rpc_timeout_s) for a in self.addresses] if cfg.save_client else []
        channels = [grpc.aio.insecure_channel(a) for a in self.addresses]
        self.cluster_stubs = [pb_grpc.ClusterStub(c) for c in channels]
        self.engines = [Engine(i, n, kv, cfg, self._done, self.result, self.held, savers[i] if savers else None)
                        for i, (n, kv) in enumerate(zip(self.node_ids, self.kvs))]
        loop = asyncio.get_running_loop()
        tasks: set[asyncio.Task[Any]] = set()
        background: list[asyncio.Task[Any]] = []
        wall = time.perf_counter()
        try:
            for kv in [*self.kvs, *savers]:  # connect (and learn page sizes) before the clock starts
                await kv.page_bytes(cfg.namespace)
                await kv.lookup(cfg.namespace, [b"warmup"])
            # a full collection walks every object of the process: inside a long-lived one (a test
            # session, many runs) that paused the engines for 100-200 ms mid-run; frozen objects are
            # not walked again, so the run's own garbage is all a collection visits
            gc.collect()
            gc.freeze()
            self._start = loop.time() + 0.2
            for engine in self.engines:
                engine.clock_start = time.perf_counter() + (self._start - loop.time())
            background.append(loop.create_task(self._sample()))
            if cfg.policy == "oracle":
                background.append(loop.create_task(self._oracle(items, tasks)))
            if cfg.kills:
                background.append(loop.create_task(self._kill()))
                background.append(loop.create_task(self._watch_members()))
            await self._dispatch(items, tasks)
            if items:
                try:
                    await asyncio.wait_for(self._all_done.wait(), cfg.drain_timeout_s)
                except asyncio.TimeoutError:
                    pass  # unfinished requests stay done=False and are reported
            self.result.node_stats = [self.kvs[i].stats(cfg.namespace) for i in self._alive()]
            self.result.node_stats = list(await asyncio.gather(*self.result.node_stats))
        finally:
            gc.unfreeze()
            for task in [*background, *tasks]:
                task.cancel()
            await asyncio.gather(*background, *tasks, return_exceptions=True)
            for engine in self.engines:
                await engine.close()
            for kv in [*self.kvs, *savers]:
                await kv.close()
            for c in channels:
                await c.close()
        self.result.placed_used_pages = sum(len(e.state.used_placed) for e in self.engines)
        self.result.put_errors = sum(e.state.put_errors for e in self.engines)
        self.result.wall_s = time.perf_counter() - wall
        return self.result
