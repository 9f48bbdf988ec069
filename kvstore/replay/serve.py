"""One request's path through an inference engine, written once for the live and the simulated replay.

:func:`serve` is a generator: it decides, records the request's :class:`~kvstore.replay.metrics.RequestRecord`
and yields each thing that takes time or touches the store as an operation for its driver to carry out,
resuming with the result:

* :class:`Sleep`: wait this many trace seconds (a claim's re-look, the decode);
* :class:`WaitHeld`: the oracle's wait for its planned prefix on this node (True once it is there);
* :class:`Lookup`: the node's ``Lookup`` (recorded for the predictor, with a prefill claim) → (local prefix,
  every node's prefix, the local prefix's runs by tier with their load times);
* :class:`Get`: the node's ``Get`` of a prefix (its reactive fetch included) → (pages found, corrupt pages);
* :class:`Prefill`: the engine's serial prefill unit, held for as many trace seconds as its ``seconds()`` says
  once held → trace seconds queued;
* :class:`Put`: store what the node lacked → (stored, real seconds it took).

A failed ``Lookup`` or ``Get`` (the node is gone) comes back as :class:`StoreError` thrown into the
generator: the engine recomputes the prompt. The live replay (:mod:`kvstore.replay.engine`) carries the
operations out with asyncio and real RPCs against real daemons; the simulated replay
(:mod:`kvstore.replay.sim`) with events on its clock against its simulated cluster. Both step this same
generator, so the engine's rules (claim, wait, fetch, prefill, store) exist once.

Per request (the engine's slot is the driver's: it starts this once a slot is free): (oracle) wait for
the planned prefix; ``Lookup``; (+claims) wait for another node's claimed prefill and re-look; ``Get`` of
the cluster-cached prefix, as far as pulling it beats computing it (``claiming.readable``); the prefill
unit, for the uncached tokens (first token); ``Put`` what the node lacked; decode. TTFT = queueing +
fetch + local load + prefill, as ``RequestRecord`` defines it.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Callable, Generator, Sequence
from itertools import takewhile
from dataclasses import dataclass, field
from typing import Any

from kvstore.replay import claiming
from kvstore.replay.costmodel import CostModel
from kvstore.replay.metrics import RequestRecord, record_hits
from kvstore.replay.oracle import Step


class StoreError(Exception):
    """A Lookup or Get failed (the node is gone); the message is what the request records."""


@dataclass(frozen=True, slots=True)
class Sleep:
    seconds: float  # trace seconds


@dataclass(frozen=True, slots=True)
class WaitHeld:
    keys: list[bytes]
    timeout_s: float  # trace seconds


@dataclass(frozen=True, slots=True)
class Lookup:
    keys: list[bytes]
    record: bool = False
    claim_s: float = 0.0  # daemon seconds of a prefill claim on what the cluster lacks (0: no claim)


@dataclass(frozen=True, slots=True)
class Get:
    keys: list[bytes]
    deadline_s: float = 0.0  # trace seconds the node has to bring what only its tiers hold into the pool
    # (0: the run's fetch timeout): the pages below the pool it reads are worth no more than computing them


@dataclass(frozen=True, slots=True)
class Prefill:
    seconds: Callable[[], float]  # trace seconds on the prefill unit, asked once the unit is held


@dataclass(frozen=True, slots=True)
class Put:
    start: int  # the first key's index in the request
    keys: list[bytes]


Op = Sleep | WaitHeld | Lookup | Get | Prefill | Put
Serve = Generator[Op, Any, None]


@dataclass(slots=True)
class Rules:
    """What the engines' rules read of the run."""

    cost: CostModel
    speedup: float
    claims: bool = False           # +claims: claim this engine's prefills, wait for others' (claiming.py)
    claim_margin: float = 1.0
    link_bytes_s: float = 12.5e9   # unscaled bytes per trace second of the modelled link (the wait rule)
    store: bool = True             # engine-only: False, the engine neither asks nor tells the store anything
    free_reuse: bool = False       # the bound: every reusable block at hand, at no cost, once it can exist

    @classmethod
    def of(cls, policy: str, cost: CostModel, speedup: float, **kw: Any) -> Rules:
        """The rules of a base policy: ``engine-only`` and ``bound`` leave the store out."""
        return cls(cost, speedup, store=policy not in ("engine-only", "bound"), free_reuse=policy == "bound", **kw)


@dataclass(slots=True, eq=False)
class EngineState:
    """One engine in front of one node, as :func:`serve` sees and keeps it."""

    index: int
    node_id: str
    rules: Rules
    held: Any = None                 # oracle: which pages each node holds (``mark(node, keys)``), or None
    oracle: dict[str, Any] = field(default_factory=dict)  # the run's oracle counters (late_waits)
    backlog_s: float = 0.0           # trace s of prefill queued for or on the prefill unit
    slot_queue_s: float = 0.0        # trace s of prefill of the requests waiting for a slot (as admitted)
    decode_avg_s: float = 0.0        # trace s a decode held its slot, a moving average of the engine's last ones
    running: RequestRecord | None = None  # the request whose prefill is on the unit now
    running_end: float = 0.0         # when that one ends (trace s)
    own: set[bytes] = field(default_factory=set)          # keys this node got by its own Put or Get's fetch
    used_placed: set[bytes] = field(default_factory=set)  # local hits on pages it got by replication
    put_errors: int = 0
    on_hits: Callable[[RequestRecord], None] | None = None  # the request's hits are known (the simulator counts)
    # the engine's own prefix cache (vLLM's automatic prefix caching, SGLang's radix cache): the blocks its
    # requests computed or loaded, least recently used first, at most the cost model's engine_cache_blocks
    cache: OrderedDict[bytes, None] = field(default_factory=OrderedDict)
    queued: Counter[bytes] = field(default_factory=Counter)  # blocks the requests in its prefill queue compute
    # its requests' Gets that bring pages to the node now: request index -> (its keys, the blocks it reads)
    fetching: dict[int, tuple[Sequence[bytes], int]] = field(default_factory=dict)

    def backlog(self, now: float) -> float:
        """Trace seconds of prefill ahead of a request joining the queue at ``now``: what is queued, and
        what is left of the prefill on the unit (not its whole length)."""
        running_s = self.running.prefill_s if self.running is not None else 0.0
        return max(0.0, self.backlog_s - running_s + max(0.0, self.running_end - now))

    def cached_prefix(self, keys: Sequence[bytes]) -> int:
        """Leading blocks of ``keys`` in the engine's own prefix cache."""
        return sum(1 for _ in takewhile(self.cache.__contains__, keys))

    def prefix_ahead(self, keys: Sequence[bytes]) -> int:
        """Leading blocks of ``keys`` the engine will hold before a request queued now reaches its prefill:
        cached, or computed by a request ahead of it in the queue."""
        return sum(1 for _ in takewhile(lambda k: k in self.cache or self.queued[k] > 0, keys))

    def prefix_fetching(self, keys: Sequence[bytes], local: int) -> int:
        """Leading blocks of ``keys`` the node holds (``local``) or that a Get of another request on this
        engine is bringing to it now: the connectors' rule (:func:`kvstore_client.claims.joined`)."""
        return claiming.joined(keys, local, self.fetching.values())

    def admit(self, keys: Sequence[bytes], input_tokens: int) -> float:
        """A request joins the queue for a slot: its prefill as it looks now (what the engine's cache or a
        request ahead of it will hold served), counted in :attr:`slot_queue_s` until :meth:`seated`."""
        cost = self.rules.cost
        est = cost.prefill_s(cost.uncached_tokens(input_tokens, self.prefix_ahead(keys)))
        self.slot_queue_s += est
        return est

    def seated(self, est: float) -> None:
        """The request admitted with ``est`` has its slot."""
        self.slot_queue_s = max(0.0, self.slot_queue_s - est)

    def queued_s(self, load: int, slots: int) -> float:
        """What a request joining now waits before its own prefill, as the engine's metrics tell a router:
        the prefill of the requests waiting for a slot, or, where every slot is taken, the decodes ahead of
        it at their recent mean length, shared by the slots (the longer)."""
        busy = max(0, load + 1 - slots) * self.decode_avg_s / max(1, slots)
        return max(self.slot_queue_s, busy)

    def show(self, view: Any, load: int, slots: int, keys: Sequence[bytes], cache: bool) -> None:
        """Fill a router's ``NodeView`` of this engine with what its metrics tell (:meth:`queued_s`) and, with
        ``cache``, what its KV events tell (its prefix of ``keys``, :meth:`prefix_ahead`)."""
        view.queued_s = self.queued_s(load, slots)
        if cache:
            view.engine = self.prefix_ahead(keys)

    def remember(self, keys: Sequence[bytes]) -> None:
        for k in keys:
            self.cache[k] = None
            self.cache.move_to_end(k)
        while len(self.cache) > self.rules.cost.engine_cache_blocks:
            self.cache.popitem(last=False)


def bound_reuse(rec: RequestRecord, reusable: int, cost: CostModel, t: float) -> tuple[int, float]:
    """The bound's reuse for ``rec`` at trace time ``t``: how many of its ``reusable`` leading blocks it takes
    for nothing, and how long it waits for them first. Each block is at hand from the earliest moment any
    computation of it could have ended (``rec.ready``, :func:`kvstore.replay.workload.reuse_ready`; always,
    without it); of every prefix length, the one whose wait plus the prefill of the rest ends first."""
    ready = rec.ready
    if not ready:
        return reusable, 0.0
    best, best_end = 0, cost.prefill_s(cost.uncached_tokens(rec.input_tokens, 0))
    for n in range(1, reusable + 1):
        end = max(0.0, ready[n - 1] - t) + cost.prefill_s(cost.uncached_tokens(rec.input_tokens, n))
        if end <= best_end:
            best, best_end = n, end
    return best, max(0.0, ready[best - 1] - t) if best else 0.0


def serve(e: EngineState, rec: RequestRecord, keys: Sequence[bytes], step: Step | None, slot_wait: float,
          now: Callable[[], float]) -> Serve:
    """Serve one request on engine ``e`` (see the module doc); ``slot_wait``: trace seconds it queued for
    its slot; ``now()``: the run's clock in trace seconds."""
    keys = list(keys)
    rules, cost, S = e.rules, e.rules.cost, e.rules.speedup
    t0 = now()
    if step is not None and step.depth > 0 and e.held is not None:
        # oracle: the plan has this request wait for its prefix (being computed, or copied here); never
        # longer than the plan's time plus recomputing it
        late = step.kv_at - now()
        if not (yield WaitHeld(keys[:step.depth], max(0.0, late) + cost.prefill_s(step.depth * cost.block_tokens))):
            e.oracle["late_waits"] = e.oracle.get("late_waits", 0) + 1  # the prefix never came: compute it
    local = cluster_max = cached = pool = 0
    if rules.free_reuse:  # the bound: what an earlier request had is here, loaded, for nothing, once it can exist
        n, wait = bound_reuse(rec, min(rec.reusable, len(keys)), cost, now())
        if wait > 0:
            yield Sleep(wait)
        local = cached = cluster_max = pool = n
    try:
        if rules.store:  # engine-only and the bound ask no store (the engine's own cache still serves)
            # the claim covers what the engine would compute knowing nothing cached (it learns its prefix from
            # this Lookup); the node claims from the cluster's prefix on (the agent)
            claim = claiming.claim_seconds(cost, rec.input_tokens, 0, e.backlog(now()), S) if rules.claims else 0.0
            local, nodes, runs = yield Lookup(keys, record=True, claim_s=claim)
            local = claiming.loadable(runs, local, cost, S)  # what its tiers hold only where loading beats computing
            pool = claiming.pooled(nodes, e.node_id, local)
            cluster_max = claiming.held(nodes, local)
            # pull only what beats computing, and nothing a request ahead of this one on the engine computes
            # (its prefix cache serves it when this one's prefill starts)
            ahead = e.prefix_ahead(keys)
            read = claiming.readable(nodes, e.node_id, local, cost, rules.link_bytes_s)
            if ahead >= read:
                read = local
            # a pull of its prefix another request on this engine started is joined, not raced or recomputed
            # (computing it would also put a whole prefill ahead of that request's short one)
            joined = e.prefix_fetching(keys, local)
            if joined > max(read, ahead):
                read = joined
            wait = claiming.choose(nodes, e.node_id, local, cost, S, rules.link_bytes_s, e.backlog(now()),
                                   rules.claim_margin) if rules.claims else None
            if wait is not None and max(ahead, joined) >= wait.length:
                wait = None  # queued behind this engine's own prefill of it, or its pull: no wait for another's
            if wait is not None:  # another request is computing this prefix: wait for it, then read it
                rec.claim_wait = True
                t_wait, held_before = now(), cluster_max
                while True:  # re-look about 8 times over what is left
                    yield Sleep(claiming.look_again(nodes, e.node_id, local, wait, cost, S, rules.link_bytes_s))
                    local, nodes, runs = yield Lookup(keys)
                    local = claiming.loadable(runs, local, cost, S)
                    pool = claiming.pooled(nodes, e.node_id, local)
                    came = claiming.landed(nodes, e.node_id, local, wait.length, wait.node)
                    if (came or now() - t_wait >= wait.budget_s
                            or not claiming.still_coming(nodes, e.node_id, wait.length, wait.node)):
                        break
                cluster_max = read = claiming.readable_after(wait, came, nodes, local, held_before, cost,
                                                             rules.link_bytes_s)
                rec.wait_real_s = (now() - t_wait) / S
                rec.wait_end = claiming.wait_end(came, now() - t_wait, wait)
                rec.wait_ready_s = wait.ready_in_s
            fetch = read if step is None else max(local, step.depth)  # the oracle gets what its plan says
            if fetch > 0:
                t_get = now()
                if fetch > local:
                    e.fetching[rec.idx] = (keys, fetch)
                try:
                    # a Get of its own node's pages only: the node reads from its tiers what lands before
                    # computing it would end (its disk may have been given others' reads since the Lookup)
                    below = max(0, fetch - pool) if fetch <= local else 0
                    deadline = cost.prefill_s(below * cost.block_tokens) if below and step is None else 0.0
                    cached, rec.corrupt = yield Get(keys[:fetch], deadline)
                finally:
                    e.fetching.pop(rec.idx, None)
                rec.get_s = now() - t_get
                rec.get_real_s = rec.get_s / S
    except StoreError as exc:  # the node is gone (--kill): the engine recomputes
        rec.kv_error = str(exc)[:200]
        local = cluster_max = cached = 0
    rec.fetch_real_s = (now() - t0) / S
    rec.fetch_s = now() - t0
    local = record_hits(rec, local, cached, cluster_max, cost)
    rec.disk = max(0, local - pool)  # of its local blocks, those its node's tiers held (read up first)
    if e.on_hits is not None:
        e.on_hits(rec)
    for k in keys[:local]:
        if k not in e.own:
            e.used_placed.add(k)
    e.own.update(keys[local:cached])
    if e.held is not None:
        e.held.mark(e.index, keys[:cached])
    rec.link_s = cost.link_s(rec.remote)
    rec.local_load_s = 0.0 if rules.free_reuse else cost.local_load_s(local)
    rec.prefill_s = cost.prefill_s(cost.uncached_tokens(rec.input_tokens, cached))
    rec.decode_s = cost.decode_s(rec.input_tokens, rec.output_tokens)
    # -- prefill: one at a time per engine --
    e.backlog_s += rec.prefill_s
    computes = keys[cached:]
    e.queued.update(computes)

    def prefill_now() -> float:
        """Once the prefill unit is this request's: an earlier request on this engine may have computed
        more of its prefix while it queued (a burst's followers behind their first), which the engine's
        own prefix cache serves, as vLLM's and SGLang's do."""
        hit = e.cached_prefix(keys)
        if hit > cached:
            rec.engine_cached = hit - cached
            rec.miss = max(0, rec.miss - rec.engine_cached)
            rec.recomputed_cached = max(0, rec.recomputed_cached - rec.engine_cached)
            now_s = cost.prefill_s(cost.uncached_tokens(rec.input_tokens, hit))
            e.backlog_s -= rec.prefill_s - now_s
            rec.prefill_s = now_s
        e.running, e.running_end = rec, now() + rec.prefill_s
        return rec.prefill_s

    try:
        prefill_wait = yield Prefill(prefill_now)
    finally:
        e.backlog_s -= rec.prefill_s
        if e.running is rec:  # it was on the unit (a request cancelled in the queue was not)
            e.running = None
        e.queued.subtract(computes)
        for k in computes:
            if e.queued[k] <= 0:
                del e.queued[k]
    e.remember(keys)
    rec.queue_s = slot_wait + prefill_wait
    rec.first_token_at = now()
    # -- store the KV this node lacked, then decode in the slot --
    if cached < len(keys) and rules.store:
        stored, rec.put_s = yield Put(cached, keys[cached:])
        if stored:
            e.own.update(keys[cached:])
            if e.held is not None:
                e.held.mark(e.index, keys[cached:])
        else:
            e.put_errors += 1
    yield Sleep(rec.decode_s)
    e.decode_avg_s = rec.decode_s if not e.decode_avg_s else 0.9 * e.decode_avg_s + 0.1 * rec.decode_s
    rec.done = True


def advance(gen: Serve, value: Any, error: StoreError | None) -> Op | None:
    """Resume ``gen`` with its last operation's result (or the :class:`StoreError` it raised); the next
    operation, or None once the request is served. Both drivers step the loop with it."""
    try:
        return gen.send(value) if error is None else gen.throw(error)
    except StopIteration:
        return None


def step_through(gen: Serve, perform: Callable[[Op], Generator[Any, Any, Any]]) -> Generator[Any, Any, None]:
    """Drive ``gen`` with a driver whose ``perform(op)`` is itself a generator (the simulator's: it yields
    its events and returns the result, or raises :class:`StoreError`)."""
    value: Any = None
    error: StoreError | None = None
    while (op := advance(gen, value, error)) is not None:
        value, error = None, None
        try:
            value = yield from perform(op)
        except StoreError as exc:
            error = exc
