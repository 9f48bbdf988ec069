"""The simulated cluster of the simulated replay: pools, the directory, heartbeats, lookups and pulls.

Pure logic over :mod:`kvstore.replay.sim_kernel`; the same code as the daemons
where that code is pure: the coordinator's :class:`~kvstore.cluster.directory.Directory`
and each node's :class:`~kvstore.cluster.directory.Outbox` (reports every
heartbeat, so the directory lags one heartbeat as it does for real), the
replicator's :func:`~kvstore.cluster.replicator.assign_sources`.

Clocks: the event clock is trace seconds; the daemons' clock (expiries, the
directory, the predictor, the planner) is ``trace s / speedup`` -- the real
seconds the daemons see in a real replay -- and their byte counts are the
scaled page bytes, so the planner sees the same numbers as in a real run.

Modelled, kept simple:

* a node's pool: ``capacity / scaled page`` slots, evicted as the daemon's
  (:mod:`kvstore.pool.room`: least recently used plain pages, a speculative
  copy only when none is left); a speculative replica read becomes a plain
  replica (a speculative hit); the node drops expired speculative replicas
  at its heartbeat (wasted bytes), and they sink to the disk below as
  replicas;
* a disk tier below it (the daemons' ``--tier disk:...``, as ``--tier-policies
  tiers-lru`` sets it): what the pool evicts for room goes down, written once
  (a page read back up keeps its copy below),
  least recently used out of the tier and gone (``--tier-admit reused``:
  only pages read since they were stored go down, the others are declined);
  a Get reads the pages only
  the tier holds at ``--tier-read-rate``, one node's reads in turn, and
  brings them into the pool; a page on disk counts as held (Lookup, the
  directory), with the pool's leading part as ``pool_length``;
* a pull (a Get's reactive fetch, a Replicate): the keys the node lacks that
  no other pull is bringing (single flight per node and key: later readers
  wait on the pull in flight), grouped by source as the replicator does, one
  transfer per source over the links; a source serves the pages it holds when
  the pull starts; the reader waits at most the fetch deadline;
* a killed node: its engine's KV calls fail, its pages are gone, and the
  directory forgets it a heartbeat timeout later.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from itertools import takewhile
from dataclasses import dataclass
from typing import Any, NamedTuple

from kvstore.replay.sim_kernel import Event, Network, Sim
from kvstore.cluster import answer
from kvstore.cluster.claims import Claims, Pulls
from kvstore.cluster.directory import Directory, Outbox
from kvstore.cluster.replicator import assign_sources
from kvstore.pool.pool import PageKind
from kvstore.pool.room import cold_price, victim
from kvstore.tiers.admission import Admission, admission_for
from kvstore.v1 import kvstore_pb2 as pb

PRIMARY, REPLICA, SPECULATIVE = int(PageKind.PRIMARY), int(PageKind.REPLICA), int(PageKind.SPECULATIVE)


class _Page(NamedTuple):  # what an Outbox reads of an added page
    key: bytes
    kind: int
    expires_at: float
    tier: int = 0             # 0: the pool; 1: the disk tier below it


@dataclass(slots=True)
class ClusterParams:
    nodes: int
    namespace: str
    page_bytes: int               # unscaled (what crosses the modelled links)
    scaled_page_bytes: int        # what the daemons count
    capacity_bytes: int           # per node, scaled
    policy: str                   # none | reactive | full | predictive (oracle runs reactive daemons)
    speedup: float
    heartbeat_s: float            # daemon seconds
    heartbeat_timeout_s: float    # daemon seconds
    fetch_timeout_s: float        # daemon seconds (the Get deadline)
    link_rate: float              # unscaled bytes per trace second, per node and direction
    link_latency: float           # trace seconds, one way
    depth_cap: int = 16           # the deepest predictor depth (the access log keeps this many keys)
    disk_pages: int = 0           # a disk tier's pages below each pool (0: none)
    disk_read_rate: float = 0.0   # its reads, unscaled bytes per trace second (0: free)
    disk_admit: str = "all"       # kvstored --tier-admit
    disk_write_budget: float = 0.0  # ... predicted: its write budget, scaled bytes per daemon second
    disk_reuse_horizon: float = 600.0  # ... and its horizon, daemon seconds
    deadline_share: float = 0.8   # kvstored --deadline-share: of a Get's deadline, what the node spends reading


class SimPool:
    """One node's pages of the namespace (see the module doc)."""

    def __init__(self, capacity_pages: int, namespace: str = "ns", disk_pages: int = 0,
                 admission: Admission | None = None, clock: Callable[[], float] = lambda: 0.0) -> None:
        self.capacity, self.ns = max(1, capacity_pages), namespace
        self.spec: OrderedDict[bytes, float] = OrderedDict()   # key -> expires_at (daemon s)
        self.lru: OrderedDict[bytes, int] = OrderedDict()      # key -> kind
        self.disk: OrderedDict[bytes, int] = OrderedDict()     # the tier below: key -> kind, LRU first
        self.disk_capacity = max(0, disk_pages)
        self.sunk: set[bytes] = set()                          # speculative copies that sank onto the disk
        self.admission = admission                             # kvstored --tier-admit, the daemons' own rule
        self.clock = clock                                     # the daemons' clock (admission)
        self.reads: Counter[bytes] = Counter()                 # pool pages' Get reads since they were stored
        self.outbox = Outbox()
        self.hits = self.misses = self.remote_hits = self.spec_hits = self.puts = 0
        self.spec_wasted_pages = 0
        self.disk_writes = self.disk_reads = self.disk_evictions = self.disk_declined = 0  # pages
        self.evictions: Counter[str] = Counter()

    def __contains__(self, key: bytes) -> bool:
        """Held by the node: in its pool or on its disk."""
        return key in self.lru or key in self.spec or key in self.disk

    def in_pool(self, key: bytes) -> bool:
        return key in self.lru or key in self.spec

    def __len__(self) -> int:
        """Pages in the pool (what its capacity bounds)."""
        return len(self.lru) + len(self.spec)

    def prefix(self, keys: Sequence[bytes]) -> int:
        return sum(1 for _ in takewhile(self.__contains__, keys))

    def pool_prefix(self, keys: Sequence[bytes]) -> int:
        return sum(1 for _ in takewhile(self.in_pool, keys))

    def store(self, keys: Sequence[bytes], kind: int, expires_at: float = 0.0) -> list[bytes]:
        """Store the keys not in the pool (evicting as needed); returns the keys stored."""
        changes: dict[bytes, _Page | None] = {}  # what the directory hears, the last change of each key
        stored = []
        for k in dict.fromkeys(keys):
            if self.in_pool(k):
                if kind == PRIMARY and k in self.lru:
                    self.lru.move_to_end(k)
                continue
            while len(self) >= self.capacity:
                self._evict(changes)
            if kind == SPECULATIVE:
                self.spec[k] = expires_at
            else:
                self.lru[k] = kind
            self.reads.pop(k, None)
            changes[k] = _Page(k, kind, expires_at if kind == SPECULATIVE else 0.0)
            stored.append(k)
        self._record(changes)
        return [k for k in stored if self.in_pool(k)]

    def _record(self, changes: dict[bytes, _Page | None]) -> None:
        """Tell the directory the last change of each key (a page added or moved, or None: gone)."""
        self.outbox.record(self.ns, [p for p in changes.values() if p is not None],
                           [k for k, p in changes.items() if p is None])

    def _evict(self, changes: dict[bytes, _Page | None]) -> None:
        """Make room for one page (``room.victim``: the least recently used plain page, a speculative copy
        only when none is left), demoted to the disk (written once) or, without one, dropped."""
        queue, reason = victim(self.spec, self.lru)
        key, kind = queue.popitem(last=False)
        self.evictions[reason] += 1
        if queue is self.spec:
            self.spec_wasted_pages += 1
            self._sink(key, changes)
        else:
            self._down(key, kind, self.reads.pop(key, 0), changes)

    def _sink(self, key: bytes, changes: dict[bytes, _Page | None]) -> None:
        """A speculative copy leaves the pool unread: down onto the disk as a replica (counted as sunk), if the
        admission takes it."""
        self._down(key, REPLICA, 0, changes)
        if key in self.disk:
            self.sunk.add(key)

    def _down(self, key: bytes, kind: int, reads: int, changes: dict[bytes, _Page | None]) -> None:
        """A page leaves the pool: onto the disk if the admission takes it (a copy already there is
        touched), else gone."""
        if not self.disk_capacity:
            changes[key] = None
            return
        if key not in self.disk and self.admission is not None and not self.admission.admit(key, reads, kind,
                                                                                              self.clock()):
            self.disk_declined += 1
            changes[key] = None
            return
        if key in self.disk:
            self.disk.move_to_end(key)
        else:
            self.disk_writes += 1
            self.disk[key] = kind
            while len(self.disk) > self.disk_capacity:
                gone, _ = self.disk.popitem(last=False)
                self.disk_evictions += 1
                self.sunk.discard(gone)
                if not self.in_pool(gone):
                    changes[gone] = None
        if key in self.disk:
            changes[key] = _Page(key, kind, 0.0, 1)

    def below(self, keys: Sequence[bytes]) -> int:
        """How many of ``keys`` (held) only the disk holds: what a read brings up first."""
        return len(self.below_keys(keys))

    def read(self, keys: Sequence[bytes]) -> None:
        """A Get read these (held) pages: LRU touch; a speculative replica read becomes a replica; a page
        only on disk comes up into the pool (its copy below stays)."""
        promoted: list[_Page] = []
        up = self.below_keys(keys)
        for k in keys:
            if k in self.spec:
                self.spec.pop(k)
                self.lru[k] = REPLICA
                self.spec_hits += 1
                promoted.append(_Page(k, REPLICA, 0.0))
            elif k in self.lru:
                self.lru.move_to_end(k)
        if promoted:
            self.outbox.record(self.ns, promoted)
        self.promote(up)
        self.reads.update(k for k in keys if self.in_pool(k))

    def below_keys(self, keys: Sequence[bytes]) -> list[bytes]:
        """Those of ``keys`` only the disk holds."""
        return [k for k in keys if not self.in_pool(k) and k in self.disk]

    def promote(self, keys: Sequence[bytes]) -> None:
        """Bring ``keys`` held on disk up into the pool (their copies below stay)."""
        for k in keys:
            if k in self.disk and not self.in_pool(k):  # (an earlier promotion may have evicted it)
                self.disk.move_to_end(k)
                self.disk_reads += 1
                self.store([k], self.disk[k])

    def asked(self, keys: Sequence[bytes]) -> None:
        """A Lookup named ``keys`` (the admission counts the evicted ones as asked for again)."""
        if self.admission is not None:
            self.admission.seen(keys, self.clock())

    def renew(self, keys: Sequence[bytes], expires_at: float) -> None:
        renewed = [_Page(k, SPECULATIVE, expires_at) for k in keys if k in self.spec]
        for p in renewed:
            self.spec[p.key] = expires_at
        if renewed:
            self.outbox.record(self.ns, renewed)

    def drop_speculative(self, keys: Sequence[bytes] | None = None, now: float | None = None) -> int:
        """Drop the given speculative replicas (DropSpeculative), or those expired at ``now``; unread: wasted.
        They sink: onto the disk as replicas where the admission takes them (``kvstore.pool.room``)."""
        if keys is None:
            keys = [k for k, exp in self.spec.items() if now is not None and 0 < exp <= now]
        gone = [k for k in keys if self.spec.pop(k, None) is not None]
        self.spec_wasted_pages += len(gone)
        changes: dict[bytes, _Page | None] = {}
        for k in gone:
            self._sink(k, changes)
        if changes:
            self._record(changes)
        return len(gone)

    def clear(self) -> None:
        self.spec.clear()
        self.lru.clear()
        self.disk.clear()
        self.reads.clear()
        self.sunk.clear()

    def snapshot(self) -> list[_Page]:
        return [_Page(k, v, 0.0) for k, v in self.lru.items()] + \
               [_Page(k, SPECULATIVE, e) for k, e in self.spec.items()] + \
               [_Page(k, v, 0.0, 1) for k, v in self.disk.items() if not self.in_pool(k)]


class Membership:
    """What the coordinator's code asks of the membership (live ids, reported sizes)."""

    def __init__(self, cluster: "SimCluster") -> None:
        self._c = cluster
        self.reported: dict[str, pb.MemberInfo] = {}

    def live_ids(self) -> list[str]:
        return [n for i, n in enumerate(self._c.ids) if self._c.known_alive(i)]

    def alive(self, node_id: str) -> bool:
        i = self._c.index.get(node_id)
        return i is not None and self._c.known_alive(i)

    def member(self, node_id: str) -> pb.MemberInfo | None:
        return self.reported.get(node_id) if self.alive(node_id) else None

    def view(self) -> list[pb.MemberInfo]:
        return [self.reported[n] for n in self.live_ids() if n in self.reported]


class SimCluster:
    """N simulated kvstored nodes: pools, heartbeats into the directory, lookups, pulls."""

    def __init__(self, sim: Sim, p: ClusterParams, placement: Any = None) -> None:
        self.sim, self.p = sim, p
        self.ids = [f"n{i}" for i in range(p.nodes)]
        self.index = {n: i for i, n in enumerate(self.ids)}
        self.pools = [SimPool(p.capacity_bytes // max(1, p.scaled_page_bytes), p.namespace, p.disk_pages,
                              admission_for(p.disk_admit, budget_bytes_s=p.disk_write_budget,
                                            tier_bytes=p.disk_pages * p.scaled_page_bytes,
                                            page_bytes=p.scaled_page_bytes, horizon_s=p.disk_reuse_horizon)
                              if p.disk_pages else None, self.dnow) for _ in self.ids]
        self.disk_free_at = [0.0] * p.nodes  # trace s each node's disk has read what it was given
        self.net = Network(sim, p.nodes, p.link_rate, p.link_latency)
        self.directory = Directory()
        self.claims = Claims()              # in-flight prefill claims (the coordinator's, as in the daemons)
        self.pulls = Pulls()                # the reactive pulls its answers announced (as the agent's)
        self.membership = Membership(self)
        self.placement = placement          # the coordinator glue (predictive/full), or None
        self.inflight: list[dict[bytes, Event]] = [{} for _ in self.ids]
        self.accesses: list[list[pb.AccessEvent]] = [[] for _ in self.ids]
        self._access_t: list[list[float]] = [[] for _ in self.ids]
        self.dead: dict[int, float] = {}    # node -> daemon s it was killed
        self.seq = [0] * p.nodes
        self.claimed_until = [0.0] * p.nodes  # daemon s: node i holds claims until then (it reports on Put)
        self.rpc_s = 0.0015                   # daemon s of one report round trip (SimDriver sets its rpc_ms)
        self.peer_bytes_in = [0] * p.nodes  # scaled bytes pulled into each node (kvstore_peer_bytes_total in)

    # ---- clocks --------------------------------------------------------------
    def dnow(self) -> float:
        """The daemons' clock: real seconds of a real replay."""
        return self.sim.now / self.p.speedup

    def trace_s(self, daemon_s: float) -> float:
        return daemon_s * self.p.speedup

    def alive(self, i: int) -> bool:
        return i not in self.dead

    def known_alive(self, i: int) -> bool:
        """Alive as the membership sees it: a dead node counts until its heartbeat timeout passed."""
        died = self.dead.get(i)
        return died is None or self.dnow() - died < self.p.heartbeat_timeout_s

    # ---- heartbeats ------------------------------------------------------------
    def start(self) -> None:
        hb = self.p.heartbeat_s
        for i in range(self.p.nodes):  # nodes start at different moments: spread their phases
            self.sim.at(self.trace_s(hb * (i + 1) / self.p.nodes), self._beat, i)

    def _beat(self, i: int) -> None:
        if not self.alive(i):
            return
        self.report(i)
        now = self.dnow()
        for j, died in list(self.dead.items()):
            if now - died >= self.p.heartbeat_timeout_s:
                self.directory.drop(self.ids[j])
                self.claims.drop_node(self.ids[j])
        self.sim.at(self.trace_s(self.p.heartbeat_s), self._beat, i)

    def report(self, i: int) -> None:
        """Node ``i``'s directory report and recorded requests (every heartbeat, and at once after a Put of
        keys it claimed, as the agent does), applied by the coordinator; resolves the claims it fulfils."""
        if not self.alive(i):
            return
        now, pool, node = self.dnow(), self.pools[i], self.ids[i]
        pool.drop_speculative(now=now)
        if pool.outbox.need_full:
            seq, batches = pool.outbox.take_full({pool.ns: pool.snapshot()}, now)
            full = True
        else:
            seq, batches = pool.outbox.take(now)
            full = False
        self.directory.report(node, "sim", seq, full, batches, now)
        landed = [c for batch in batches for c in self.claims.resolve(node, batch.namespace, batch.adds)]
        if landed and self.placement is not None:
            self.placement.on_claims_landed(landed)
        self.membership.reported[node] = pb.MemberInfo(
            node_id=node, capacity_bytes=self.p.capacity_bytes, used_bytes=len(pool) * self.p.scaled_page_bytes,
            speculative_bytes=len(pool.spec) * self.p.scaled_page_bytes,
            cold_bytes=len(pool.lru) * self.p.scaled_page_bytes, cold_reads=cold_price(pool.admission))
        if self.placement is not None:
            self.placement.on_report(node, batches)
            for event, t in zip(self.accesses[i], self._access_t[i]):
                event.age_seconds = now - t
                self.placement.observe(node, event)
        self.accesses[i].clear()
        self._access_t[i].clear()

    def absent(self, i: int) -> None:
        """Node ``i`` is not started yet (``--join``): nobody sees it until :meth:`join`."""
        self.dead[i] = float("-inf")

    def join(self, i: int) -> None:
        """Node ``i`` starts, empty, and joins: its first heartbeat makes it a member."""
        self.dead.pop(i, None)
        self.pools[i].clear()
        self.pools[i].outbox = Outbox()
        self._beat(i)

    def kill(self, i: int) -> None:
        self.dead[i] = self.dnow()
        self.pools[i].clear()
        for ev in self.inflight[i].values():
            ev.succeed(False)
        self.inflight[i].clear()

    # ---- lookups -------------------------------------------------------------
    def prefixes(self, keys: Sequence[bytes], asker: str = "", claim_node: str = "",
                 claim_seconds: float = 0.0, claim_start: int = 0, record: bool = False) -> list[pb.NodePrefix]:
        """The coordinator's answer: per live node its longest prefix (directory), with the hints and the
        in-flight claims; a claim in the same call is recorded after the answer is drawn (as the agent)."""
        ns = self.p.namespace
        held = {n: length for n, length in self.directory.prefixes(ns, keys).items() if self.membership.alive(n)}
        now = self.dnow()
        seen = self.claims.seen(ns, keys, now, held, asker, record)
        hints = self.placement.hints(ns, keys) if self.placement is not None else []
        out = answer.merge(held, hints, seen, lambda n: "" if self.membership.alive(n) else None)
        answer.pulls_ahead(out, self.pulls, ns, keys, asker, claim_start, now, held, record,
                           self.placement.sending if self.placement is not None else lambda node: 0)
        if claim_seconds > 0 and claim_node:
            start = max([claim_start, *held.values()])
            if self.claims.claim(ns, keys, claim_node, claim_seconds, now, start=start) is not None:
                i = self.index[claim_node]
                self.claimed_until[i] = max(self.claimed_until[i], now + claim_seconds + self.claims.grace_s)
        return out

    def stored(self, i: int) -> None:
        """Node ``i`` stored pages (a Put): while it holds claims it reports at once (the agent wakes its
        heartbeat), so the claim resolves an RPC later instead of a heartbeat later."""
        if self.dnow() < self.claimed_until[i]:
            self.sim.at(self.rpc_s * self.p.speedup, self.report, i)

    def tier_runs(self, i: int, held: Sequence[bytes]) -> list[pb.TierRun]:
        """Node ``i``'s prefix ``held`` (keys it holds) as runs by where it is, each with its expected time
        into the pool (daemon seconds, as the daemons answer): 0 in the pool; on disk, the run's reads after
        those its disk was already given."""
        pool, out = self.pools[i], []
        queued = max(0.0, self.disk_free_at[i] - self.sim.now)
        for k in held:
            tier = "pool" if pool.in_pool(k) else "disk0"
            if out and out[-1].tier == tier:
                out[-1].pages += 1
            else:
                out.append(pb.TierRun(tier=tier, pages=1))
        for run in out:
            if run.tier != "pool" and self.p.disk_read_rate > 0:
                run.load_seconds = (queued + run.pages * self.p.page_bytes / self.p.disk_read_rate) / self.p.speedup
                queued = 0.0
        return out

    def lookup(self, i: int, keys: Sequence[bytes], record: bool = False,
               claim_seconds: float = 0.0) -> tuple[int, list[pb.NodePrefix], list[pb.TierRun]]:
        """Node ``i``'s Lookup: (its local prefix, every node's prefix, its prefix's tier runs) as the agent
        answers it."""
        self.pools[i].asked(keys)
        local = self.pools[i].prefix(keys)
        me = self.ids[i]
        reply = self.prefixes(keys, asker=me, claim_node=me, claim_seconds=claim_seconds, claim_start=local,
                              record=record)
        nodes = answer.as_seen_by(reply, me, local, local_pool=self.pools[i].pool_prefix(keys[:local]))
        if record and keys:
            depth = min(len(keys), self.p.depth_cap)
            remote = any(n.prefix_length >= depth and not n.pending for n in nodes if n.node_id != me)
            self.accesses[i].append(pb.AccessEvent(
                namespace=self.p.namespace, keys=list(keys[:self.p.depth_cap]),
                outcome=0 if local >= depth else 1 if remote else 2, total_blocks=len(keys), local_blocks=local))
            self._access_t[i].append(self.dnow())
        return local, nodes, self.tier_runs(i, keys[:local]) if self.pools[i].disk_capacity else []

    def in_time(self, i: int, held: Sequence[bytes], deadline_s: float) -> int:
        """Of node ``i``'s prefix ``held``, how many leading pages a Get with ``deadline_s`` (trace s) brings
        into its pool: those whose read from the disk, behind the reads it was given before, ends within the
        deadline's share (the daemon's ``NamespaceTiers._in_time``)."""
        rate = self.p.disk_read_rate
        if rate <= 0:
            return len(held)
        pool, budget = self.pools[i], deadline_s * self.p.deadline_share
        spent = max(0.0, self.disk_free_at[i] - self.sim.now)  # (counts only once a page is on disk)
        for n, k in enumerate(held):
            if pool.in_pool(k):
                continue
            spent += self.p.page_bytes / rate
            if spent > budget:
                return n
        return len(held)

    def disk_read(self, i: int, pages: int) -> Event:
        """Node ``i`` reads ``pages`` from its disk tier: after the reads it was given before (fires when
        they are in)."""
        rate = self.p.disk_read_rate
        if pages <= 0 or rate <= 0:
            return self.sim.event().succeed()
        now = self.sim.now
        self.disk_free_at[i] = max(now, self.disk_free_at[i]) + pages * self.p.page_bytes / rate
        return self.sim.timeout(self.disk_free_at[i] - now)

    def promote(self, i: int, keys: Sequence[bytes]) -> None:
        """The coordinator's promotion on node ``i``: its disk reads ``keys`` (behind the reads it was given
        before), then they are in its pool."""
        pool = self.pools[i]
        if not self.alive(i):
            return
        up = pool.below_keys(keys)
        if up:
            self.disk_read(i, len(up)).then(lambda _: self.alive(i) and pool.promote(up))

    # ---- pulls ---------------------------------------------------------------
    def fetch_missing(self, i: int, keys: Sequence[bytes]) -> Event:
        """A Get's reactive fetch into node ``i`` (fires when done or at the deadline)."""
        pool, flight = self.pools[i], self.inflight[i]
        missing = [k for k in dict.fromkeys(keys) if k not in pool]
        if not missing or self.p.policy == "none":
            return self.sim.event().succeed()
        jobs = [flight[k] for k in missing if k in flight]
        todo = [k for k in missing if k not in flight]
        if todo:
            holders = self.directory.locate(self.p.namespace, todo)
            usable = {n for j, n in enumerate(self.ids) if j != i and self.known_alive(j)}
            for src, ks in assign_sources(todo, holders, usable, self.ids[i]).items():
                jobs.append(self.pull(i, self.index[src], ks, REPLICA))
        deadline = self.sim.timeout(self.trace_s(self.p.fetch_timeout_s))
        return self.sim.any_of([self.sim.all_of(jobs), deadline])

    def pull(self, i: int, src: int, keys: Sequence[bytes], kind: int, expires_at: float = 0.0) -> Event:
        """Copy ``keys`` from ``src`` into node ``i`` (single flight per key); fires with the keys now held."""
        pool, flight = self.pools[i], self.inflight[i]
        mine = [k for k in dict.fromkeys(keys) if k not in pool and k not in flight]
        theirs = [flight[k] for k in dict.fromkeys(keys) if k not in pool and k in flight]
        done = self.sim.event()
        for k in mine:
            flight[k] = self.sim.event()
        found = [k for k in mine if self.alive(src) and k in self.pools[src]]
        nbytes = len(found) * self.p.page_bytes

        def landed(_: Any) -> None:
            if self.alive(i):
                pool.store(found, kind, expires_at)  # what the source held when it served the pull
                self.peer_bytes_in[i] += len(found) * self.p.scaled_page_bytes
            for k in mine:
                ev = flight.pop(k, None)
                if ev is not None:
                    ev.succeed(k in pool)
            self.sim.all_of(theirs).then(lambda _: done.succeed([k for k in keys if k in pool]))

        self.net.transfer(src, i, nbytes).then(landed)
        return done

    # ---- the nodes' Stats ----------------------------------------------------------------
    def stats(self) -> list[pb.StatsResponse]:
        out = []
        for i, pool in enumerate(self.pools):
            if not self.alive(i):
                continue
            ns = pb.NamespaceStats(
                namespace=self.p.namespace, page_bytes=self.p.scaled_page_bytes, capacity_bytes=self.p.capacity_bytes,
                used_bytes=len(pool) * self.p.scaled_page_bytes, num_slots=pool.capacity, used_slots=len(pool),
                speculative_slots=len(pool.spec), hits=pool.hits, misses=pool.misses, puts=pool.puts,
                remote_hits=pool.remote_hits, speculative_hits=pool.spec_hits,
                replica_slots=sum(1 for v in pool.lru.values() if v == REPLICA),
                speculative_wasted_bytes=pool.spec_wasted_pages * self.p.scaled_page_bytes)
            for reason, n in pool.evictions.items():
                ns.evictions[reason] = n
            tiers = [pb.TierStats(
                tier="disk0", capacity_bytes=pool.disk_capacity * self.p.scaled_page_bytes,
                used_bytes=len(pool.disk) * self.p.scaled_page_bytes, pages=len(pool.disk), hits=pool.disk_reads,
                demotions=pool.disk_writes, promotions=pool.disk_reads, evictions=pool.disk_evictions,
                bytes_written=pool.disk_writes * self.p.scaled_page_bytes, declined=pool.disk_declined)] \
                if pool.disk_capacity else []
            out.append(pb.StatsResponse(node_id=self.ids[i], namespaces=[ns], tiers=tiers))
        return out
