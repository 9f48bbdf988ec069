"""``kvctl replay --sim``: the replay as a discrete-event simulation, seconds per run instead of minutes.

The same workloads, routers, cost model, oracle plan and metrics as the real
replay (:mod:`kvstore.replay.engine`), and the same predictor, planner,
directory and link physics as the daemons (:mod:`kvstore.replay.sim_cluster`,
:mod:`kvstore.replay.sim_coord`, :mod:`kvstore.replay.sim_kernel`), on a
simulated clock in trace seconds. No sockets, no processes, no wall clock.

One engine per node, as in :mod:`kvstore.replay.engine`: ``concurrency`` slots (FIFO) and one serial
prefill unit. Once a request has a slot, the engine steps the same serve loop as the live replay
(:mod:`kvstore.replay.serve`) and carries out its operations on the simulated clock: ``Lookup`` and
``Get`` (with the node's reactive fetch, under every policy but ``none``) after an RPC's time, the
prefill unit, ``Put``, sleeps. TTFT = queueing + fetch + local load + prefill, as
:class:`~kvstore.replay.metrics.RequestRecord` defines it.

What the simulation does not have, and the real run does: CPU contention and
dispatch lag on the harness machine, and RPC overheads other than a fixed
``rpc_ms`` per KV round trip (real milliseconds, x speedup in trace time like
every measured wait). ``results.json`` marks every simulated summary
``"simulated": true``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from kvstore.replay import claiming
from kvstore.replay.serve import (EngineState, Get, Lookup, Op, Prefill, Put, Rules, Sleep, StoreError, WaitHeld,
                                  serve, step_through)
from kvstore.replay.config import DEFAULT_RPC_MS, ReplayConfig, cluster_and_router, link_of
from kvstore.replay.costmodel import CostModel
from kvstore.replay.metrics import (RequestRecord, after_join, after_kill, aggregate, cluster_summary,
                                  replica_fields)
from kvstore.replay.oracle import RULES, Plan, Step, plan
from kvstore.replay.routers import NodeView, Router, views_from_lookup
from kvstore.replay.sim_cluster import PRIMARY, SPECULATIVE, ClusterParams, SimCluster
from kvstore.replay.sim_coord import SimCoordinator, node_config
from kvstore.replay.sim_kernel import Event, Process, Semaphore, Sim
from kvstore.replay.workload import Workload, reusable_blocks, reuse_ready
from kvstore.workloads.traces import hash_key
from kvstore.units import parse_size

KILLED = "UNAVAILABLE: node killed (simulated)"


@dataclass(slots=True)
class SimConfig:
    policy: str
    router: Router
    cost: CostModel
    namespace: str
    nodes: int
    speedup: float = 4.0
    concurrency: int = 8
    daemon_args: list[str] = field(default_factory=list)  # what the real daemons would get (ClusterSpec.args)
    link_rate: float = 50e9          # unscaled bytes per trace second
    link_latency: float = 5e-6       # trace seconds
    capacity_bytes: int = 256 << 20
    oracle_lead_s: float = 4.0
    oracle_rpc_s: float = 0.005      # real s, as RunConfig
    spec_ttl_s: float = 60.0
    fetch_timeout_s: float = 5.0     # real s
    drain_timeout_s: float = 120.0   # real s
    sample_s: float = 0.25           # real s
    rpc_ms: float = DEFAULT_RPC_MS
    kills: list[tuple[int, float]] = field(default_factory=list)
    joins: list[tuple[int, float]] = field(default_factory=list)  # (node index, trace s): absent until then
    oracle_rules: tuple[str, ...] = ()  # oracle/bound: the candidate plans to choose from (): every rule
    claims: bool = False             # +claims: engines claim their prefills and wait for others' claims
    claim_margin: float = 1.0        # wait when ready + copy < margin x own prefill (claiming.wait_for)


class Held:
    """The oracle's harness-side knowledge of which pages each node holds, as events (engine.Held)."""

    def __init__(self, sim: Sim, nodes: int) -> None:
        self.sim, self._ev = sim, [dict[bytes, Event]() for _ in range(nodes)]

    def _event(self, n: int, k: bytes) -> Event:
        ev = self._ev[n].get(k)
        if ev is None:
            ev = self._ev[n][k] = self.sim.event()
        return ev

    def has(self, n: int, k: bytes) -> bool:
        ev = self._ev[n].get(k)
        return ev is not None and ev.fired

    def mark(self, n: int, keys: Sequence[bytes]) -> None:
        for k in keys:
            self._event(n, k).succeed()

    def wait(self, n: int, keys: Sequence[bytes], timeout: float | None) -> Event:
        every = self.sim.all_of(self._event(n, k) for k in keys if not self.has(n, k))
        return every if timeout is None else self.sim.any_of([every, self.sim.timeout(timeout)])


class SimEngine:
    """An engine's slots (FIFO) and serial prefill unit on the simulated clock, and what the serve loop keeps."""

    def __init__(self, sim: Sim, concurrency: int, state: EngineState) -> None:
        self.slots = Semaphore(sim, concurrency)
        self.prefill = Semaphore(sim, 1)
        self.waiting = self.running = 0
        self.state = state

    @property
    def load(self) -> int:
        return self.waiting + self.running


class SimDriver:
    """One policy run of one workload on the simulated cluster."""

    def __init__(self, workload: Workload, cfg: SimConfig) -> None:
        self.workload, self.cfg = workload, cfg
        self.sim = Sim()
        S = cfg.speedup
        dcfg = node_config(cfg.daemon_args)
        params = ClusterParams(
            nodes=cfg.nodes, namespace=cfg.namespace, page_bytes=cfg.cost.page_bytes,
            scaled_page_bytes=cfg.cost.scaled_page_bytes, capacity_bytes=cfg.capacity_bytes,
            policy="reactive" if cfg.policy == "oracle" else cfg.policy, speedup=S,
            heartbeat_s=dcfg.heartbeat_interval, heartbeat_timeout_s=dcfg.heartbeat_timeout,
            fetch_timeout_s=min(cfg.fetch_timeout_s, dcfg.fetch_timeout), link_rate=cfg.link_rate,
            link_latency=cfg.link_latency, depth_cap=dcfg.predictor_depths[-1],
            # the daemons' disk tier (--tier-policies tiers-*): its scaled bytes in pages, its read rate from the
            # daemons' clock and scaled bytes back to trace seconds and modelled bytes
            disk_pages=sum(t.capacity for t in dcfg.tier if t.kind == "disk") // cfg.cost.scaled_page_bytes,
            disk_read_rate=dcfg.tier_read_rate * cfg.cost.byte_scale / S, disk_admit=dcfg.tier_admit,
            disk_write_budget=dcfg.tier_write_budget, disk_reuse_horizon=dcfg.tier_reuse_horizon,
            deadline_share=dcfg.deadline_share)
        self.cluster = SimCluster(self.sim, params)
        self.cluster.rpc_s = cfg.rpc_ms / 1e3
        self.coord: SimCoordinator | None = None
        if cfg.policy in ("predictive", "full"):
            self.coord = SimCoordinator(dcfg, self.cluster, rpc_s=cfg.rpc_ms / 1e3)
            self.cluster.placement = self.coord
            if cfg.policy == "predictive":  # the coordinator copies a landed claim to its waiters as a tree
                self.cluster.claims.tree_fanout = self.coord.core.plan_cfg.fanout
                self.cluster.claims.tree_parts = self.coord.core.relay_parts
        rules = Rules.of(cfg.policy, cfg.cost, S, claims=cfg.claims, claim_margin=cfg.claim_margin,
                         link_bytes_s=cfg.link_rate)
        self.oracle: dict[str, Any] = {}
        self.engines = [SimEngine(self.sim, cfg.concurrency, EngineState(
            i, self.cluster.ids[i], rules, oracle=self.oracle, on_hits=self._remote_hits(i))) for i in range(cfg.nodes)]
        self.rpc = cfg.rpc_ms / 1e3 * S          # one KV round trip, trace s
        self.records: list[RequestRecord] = []
        self.timeline: dict[str, Any] = {"t": [], "waiting": [], "running": [], "stats_t": [], "spec_slots": [],
                                         "replica_slots": [], "sunk_slots": []}
        self.oracle_plan: Plan | None = None
        self.held: Held | None = None
        self.killed: dict[int, float] = {}
        self._left = 0

    # ---- requests ----------------------------------------------------------------
    def _remote_hits(self, i: int) -> Callable[[RequestRecord], None]:
        """Node ``i`` counts the pages its Gets found on other nodes (its Stats' ``remote_hits``)."""
        def count(rec: RequestRecord) -> None:
            self.cluster.pools[i].remote_hits += rec.remote
        return count

    def _views(self, keys: list[bytes]) -> tuple[list[NodeView], float]:
        loads = [float(e.load) for e in self.engines]
        work = [e.state.backlog_s for e in self.engines]
        asks = self.cfg.router.needs_prefix and self.cluster.alive(0)
        entries = self.cluster.prefixes(keys) if asks else ()
        views = views_from_lookup(self.cluster.ids, loads, entries, work)
        joining = self.coord.core.joining() if self.coord is not None and self.cfg.joins else ()
        for i, v in enumerate(views):  # a fleet router watching Status: down a heartbeat timeout after a kill,
            v.down = not self.cluster.known_alive(i) or v.node_id in joining  # and while it joins (warming)
            e = self.engines[i]
            e.state.show(v, e.load, self.cfg.concurrency, keys, self.cfg.router.needs_engine_cache)
        return views, self.cfg.rpc_ms / 1e3 if asks else 0.0

    def _arrive(self, i: int, keys: list[bytes], step: Step | None) -> None:
        rec = self.records[i]
        if step is not None and self.oracle_plan is not None:
            node, reason, route_s = step.node, f"{self.cfg.policy}-{self.oracle_plan.name}", 0.0
        else:
            views, route_s = self._views(keys)
            node, reason = self.cfg.router.choose(views, len(keys))
        rec.route_s, rec.node, rec.route_reason = route_s, self.cluster.ids[node], reason
        eng = self.engines[node]
        eng.waiting += 1
        self.sim.process(self._serve(node, rec, keys, step, eng.state.admit(keys, rec.input_tokens)))

    def _serve(self, n: int, rec: RequestRecord, keys: list[bytes], step: Step | None, est: float) -> Process:
        """The engine's slot, then :func:`~kvstore.replay.serve.serve` on the simulated clock."""
        sim, eng = self.sim, self.engines[n]
        t_enq = sim.now
        yield eng.slots.acquire()
        eng.state.seated(est)
        eng.waiting -= 1
        eng.running += 1
        yield from step_through(serve(eng.state, rec, keys, step, sim.now - t_enq, lambda: sim.now),
                                lambda op: self._perform(n, op))
        eng.running -= 1
        eng.slots.release()
        self._left -= 1

    def _perform(self, n: int, op: Op) -> Process:
        """One operation of the serve loop as the simulated node and engine carry it out."""
        sim, cl, eng = self.sim, self.cluster, self.engines[n]
        if isinstance(op, Sleep):
            yield sim.timeout(op.seconds)
            return None
        if isinstance(op, Lookup):
            if not cl.alive(n):
                raise StoreError(KILLED)
            yield sim.timeout(self.rpc)
            return cl.lookup(n, op.keys, record=op.record, claim_seconds=op.claim_s)
        if isinstance(op, Get):
            yield cl.fetch_missing(n, op.keys)
            yield sim.timeout(self.rpc)
            if not cl.alive(n):
                raise StoreError(KILLED)
            pool = cl.pools[n]
            cached = pool.prefix(op.keys)
            if op.deadline_s > 0:  # only what its disk reads within the deadline
                cached = cl.in_time(n, op.keys[:cached], op.deadline_s)
            yield cl.disk_read(n, pool.below(op.keys[:cached]))  # what only its disk holds comes up first
            if not cl.alive(n):
                raise StoreError(KILLED)
            cached = min(cached, pool.prefix(op.keys))
            pool.read(op.keys[:cached])
            pool.hits += cached
            pool.misses += len(op.keys) - cached
            return cached, 0
        if isinstance(op, Prefill):
            t1 = sim.now
            yield eng.prefill.acquire()
            waited = sim.now - t1
            yield sim.timeout(op.seconds())
            eng.prefill.release()
            return waited
        if isinstance(op, Put):
            yield sim.timeout(self.rpc)
            if not cl.alive(n):
                return False, self.rpc / self.cfg.speedup
            cl.pools[n].store(op.keys, PRIMARY)
            cl.pools[n].puts += len(op.keys)
            cl.stored(n)
            return True, self.rpc / self.cfg.speedup
        assert isinstance(op, WaitHeld) and self.held is not None
        yield self.held.wait(n, op.keys, op.timeout_s)
        return all(self.held.has(n, k) for k in op.keys)

    # ---- the oracle's copies ----------------------------------------------------------
    def _copy(self, step: Step, keys: list[bytes]) -> Process:
        held, cl = self.held, self.cluster
        assert held is not None
        part = keys[step.copy_from:step.depth]
        yield held.wait(step.source, part, None)
        egress, ingress = self._links[step.source][0], self._links[step.node][1]
        yield egress.acquire()
        yield ingress.acquire()
        try:
            need = [k for k in part if not held.has(step.node, k)]
            if not need:
                return
            yield self.sim.timeout(self.rpc / 2)
            expires = cl.dnow() + self.cfg.spec_ttl_s
            got = yield cl.pull(step.node, step.source, need, SPECULATIVE, expires)
            yield self.sim.timeout(self.rpc / 2)
            self.oracle["replicate_calls"] = self.oracle.get("replicate_calls", 0) + 1
            copied = [k for k in (got or []) if k in need]
            self.oracle["copied_pages"] = self.oracle.get("copied_pages", 0) + len(copied)
            if len(copied) >= len(need) or all(k in cl.pools[step.node] for k in need):
                held.mark(step.node, need)
        finally:
            ingress.release()
            egress.release()

    # ---- timeline --------------------------------------------------------------------
    def _sample(self, k: int = 0) -> None:
        tl, now = self.timeline, self.sim.now
        tl["t"].append(now)
        tl["waiting"].append([e.waiting for e in self.engines])
        tl["running"].append([e.running for e in self.engines])
        if k % 4 == 0:
            tl["stats_t"].append(now)
            tl["spec_slots"].append([len(p.spec) if self.cluster.alive(i) else 0
                                     for i, p in enumerate(self.cluster.pools)])
            tl["replica_slots"].append([sum(1 for v in p.lru.values() if v == 2) if self.cluster.alive(i) else 0
                                        for i, p in enumerate(self.cluster.pools)])
            tl["sunk_slots"].append([len(p.sunk) if self.cluster.alive(i) else 0
                                     for i, p in enumerate(self.cluster.pools)])
        if self._left > 0:
            self.sim.at(self.cfg.sample_s * self.cfg.speedup, self._sample, k + 1)

    def _kill(self, i: int) -> None:
        self.cluster.kill(i)
        self.killed[i] = self.sim.now

    # ---- the run ------------------------------------------------------------------------
    def run(self) -> "SimResult":
        cfg, reqs, sim = self.cfg, self.workload.requests, self.sim
        wall = time.perf_counter()
        reusable = reusable_blocks(reqs)
        if cfg.policy in ("oracle", "bound"):  # the bound takes the oracle's routes, and every reuse for nothing
            self.oracle_plan = plan(reqs, reusable, cfg.nodes, cfg.concurrency, cfg.cost, cfg.oracle_lead_s,
                                    cfg.oracle_rpc_s * cfg.speedup, rules=cfg.oracle_rules or tuple(RULES),
                                    down=dict(cfg.kills))
        if cfg.policy == "oracle":
            self.held = Held(sim, cfg.nodes)
            for e in self.engines:
                e.state.held = self.held
            self._links = [(Semaphore(sim), Semaphore(sim)) for _ in range(cfg.nodes)]
            op = self.oracle_plan
            self.oracle.update(plan=op.name, plan_p99_s=round(op.p99, 4), candidates=op.candidates,
                               planned_copies=sum(s.source >= 0 for s in op.steps),
                               planned_waits=sum(s.depth > 0 for s in op.steps))
        keys_of = [[hash_key(h) for h in r.hash_ids] for r in reqs]
        cost = cfg.cost
        ready = reuse_ready(reqs, reusable, lambda blocks: cost.prefill_s(blocks * cost.block_tokens)) \
            if cfg.policy == "bound" else None
        for i, r in enumerate(reqs):
            self.records.append(RequestRecord.of(i, r, reusable[i]))
            if ready is not None:
                self.records[-1].ready = ready[i]
            step = self.oracle_plan.steps[i] if self.oracle_plan is not None else None
            sim.at(r.t, self._arrive, i, keys_of[i], step)
            if step is not None and step.source >= 0 and self.held is not None:
                sim.at(step.copy_at, lambda s=step, k=keys_of[i]: sim.process(self._copy(s, k)))
        for i, t in cfg.kills:
            sim.at(t, self._kill, i)
        for i, t in cfg.joins:
            self.cluster.absent(i)
            sim.at(t, self.cluster.join, i)
        self._left = len(reqs)
        self.cluster.start()
        if self.coord is not None:
            self.coord.start()
        sim.at(0.0, self._sample)
        end = (reqs[-1].t if reqs else 0.0) + cfg.drain_timeout_s * cfg.speedup
        while sim._heap and self._left > 0 and sim._heap[0][0] <= end:
            sim.run(until=min(end, sim.now + 10.0))
        placed_used = sum(len(e.state.used_placed) for e in self.engines)
        put_errors = sum(e.state.put_errors for e in self.engines)
        return SimResult(self.records, self.timeline, self.oracle, put_errors, placed_used,
                         self.cluster.stats(), dict(self.killed), time.perf_counter() - wall,
                         self.coord.metrics_text() if self.coord is not None else "",
                         sum(b for i, b in enumerate(self.cluster.peer_bytes_in) if self.cluster.alive(i)),
                         self.coord.stats() if self.coord is not None else {})


@dataclass(slots=True)
class SimResult:
    records: list[RequestRecord]
    timeline: dict[str, Any]
    oracle: dict[str, Any]
    put_errors: int
    placed_used_pages: int
    node_stats: list[Any]
    killed: dict[int, float]
    wall_s: float
    coordinator_metrics: str
    link_bytes: float
    coordinator: dict[str, Any]


def run_policy_sim(wl: Workload, policy: str, router_cfg: tuple[str, str, float], a: ReplayConfig,
                   cost: CostModel, progress: Any = None, log_name: str = "") -> dict[str, Any]:
    """``cli.run_policy`` with the cluster simulated: the same arguments, the same return shape."""
    spec, router = cluster_and_router(a, policy, router_cfg, cost)
    rate, latency = link_of(a)
    free = a.network == "none"
    base, claims = claiming.split_policy(policy)
    cfg = SimConfig(policy=base, claims=claims, router=router,
                    claim_margin=claiming.margin_for(a.claim_margin), cost=cost,
                    namespace=a.preset, nodes=a.nodes, speedup=a.speedup,
                    concurrency=a.concurrency, daemon_args=spec.args("n0"), link_rate=1e18 if free else rate,
                    link_latency=0.0 if free else latency, capacity_bytes=parse_size(a.capacity),
                    oracle_lead_s=a.oracle_lead, spec_ttl_s=a.spec_ttl, fetch_timeout_s=a.fetch_timeout,
                    drain_timeout_s=a.drain_timeout, rpc_ms=a.sim_rpc_ms,
                    kills=list(a.kills), joins=list(a.joins))
    if base not in ("oracle", "bound"):
        return _sim_run(wl, cfg, spec, router_cfg, a, cost, progress)
    # The oracle's (and the bound's) candidate plans, each scored by the simulated replay itself (engines' own
    # prefix caches, the pools' capacities and tiers included): the one serving the most requests within the
    # SLO wins, then the lowest TTFT p99 and mean.
    runs = {rule: _sim_run(wl, replace(cfg, oracle_rules=(rule,)), spec, router_cfg, a, cost, None) for rule in RULES}
    best = min(runs, key=lambda r: (-runs[r]["summary"]["slo_attainment"], runs[r]["summary"]["ttft_p99_s"],
                                    runs[r]["summary"]["ttft_mean_s"], r))
    out = runs[best]
    out["summary"]["oracle"]["scored"] = {
        r: {"slo_attainment": round(v["summary"]["slo_attainment"], 4), "ttft_p99_s": round(v["summary"]["ttft_p99_s"], 4)}
        for r, v in runs.items()}
    if progress is not None:
        progress.update(len(out["records"]))
    return out


def _sim_run(wl: Workload, cfg: SimConfig, spec: Any, router_cfg: tuple[str, str, float], a: ReplayConfig,
             cost: CostModel, progress: Any) -> dict[str, Any]:
    """One simulated run of ``cfg`` and its summary (``run_policy_sim``'s return shape)."""
    base, (rate, _), free = cfg.policy, link_of(a), a.network == "none"
    driver = SimDriver(wl, cfg)
    result = driver.run()
    if progress is not None:
        progress.update(len(result.records))
    ids = driver.cluster.ids
    summary = aggregate(result.records, cluster_summary(
        base, result.node_stats, result.coordinator_metrics, cost.scaled_page_bytes, cost.byte_scale,
        result.oracle.get("copied_pages", 0), result.placed_used_pages, result.link_bytes, rate),
        slo_factor=a.slo_factor, gpus=cost.gpus, block_tokens=cost.block_tokens,
        slo_ttft=a.slo_ttft)
    network = driver.cluster.net.describe() if not free else {"kind": "none"}
    summary.update(replica_fields(result.timeline, cost.page_bytes))
    summary.update(put_errors=result.put_errors, wall_s=round(result.wall_s, 2), oracle=result.oracle,
                   daemon_args=spec.args("nX"), router=router_cfg[0], network=network, simulated=True,
                   sim={"rpc_ms": cfg.rpc_ms, "coordinator": result.coordinator})
    if cfg.kills:
        summary["failover"] = [after_kill(result.records, ids[i], t) for i, t in cfg.kills]
    if cfg.joins:
        summary["joins"] = [after_join(result.records, ids[i], t) for i, t in cfg.joins]
    return {"summary": summary, "records": result.records, "timeline": result.timeline, "node_ids": ids}
