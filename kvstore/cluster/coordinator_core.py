"""The coordinator's decisions, with no I/O and no clock of its own: the core that the daemon's asyncio
shell (:mod:`kvstore.cluster.coordinator`) and the simulated replay's shell
(:mod:`kvstore.replay.sim_coord`) both drive.

Events come in as calls: ``observe`` (a recorded request), ``on_report`` (directory adds, for
``full``), ``on_claims_landed``, a planner tick (:meth:`CoordinatorCore.tick_steps`, a step at a time,
or :meth:`CoordinatorCore.tick_full`), and the end of each copy (:meth:`CoordinatorCore.copy_ended`).
What the core decides goes out as data, one :data:`Effect` at a time, to the ``perform`` callable the
shell gives it:

* :class:`Copy`: one ``Replicate`` of a prefix (or one part of it) from a source to a target. The shell
  carries it out and calls :meth:`CoordinatorCore.copy_ended` with what the target reported.
* :class:`Renew`: renew a speculative replica's TTL on its node.
* :class:`Drop`: drop a speculative replica.
* :class:`Promote`: bring a forecast prefix's pages up from a node's tiers into its pool before the
  burst (:meth:`~kvstore.cluster.tickplan.TickPlanner.promote`); the daemon's shell sends the node a
  ``Replicate`` from itself.

The time comes from the shell's ``clock`` (``time.monotonic`` in the daemon, the simulated daemons'
clock in the replay). A copy tree's next wave runs when its copies' :class:`Signal`\\ s fire, through
the shell's ``defer`` (the daemon's ``loop.call_soon``, the simulator's zero-delay event), so the
core never waits and never spawns anything: the trees, relays and waves are written once, here.

All of it is soft state: the replicas a coordinator placed expire on their nodes when it goes away,
and a new coordinator starts with an empty predictor (or the ``--predictor-model`` file).
"""

from __future__ import annotations

import logging
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvstore.cluster.claims import Claim, waiter_tree
from kvstore.cluster.directory import Directory
from kvstore.cluster.membership import Membership
from kvstore.cluster.tickplan import TickPlanner
from kvstore.config import NodeConfig
from kvstore.loops.slices import Steps
from kvstore.placement.copytree import arrival_waves, chunk_bounds, relay_parts
from kvstore.placement.links import LinkRates
from kvstore.placement.planner_types import Decision, NodeState, PlannerConfig
from kvstore.placement.warming import Warming
from kvstore.pool.pool import PageKind
from kvstore.predict.types import Access, Outcome, PredictorConfig
from kvstore.v1 import kvstore_pb2 as pb

decision_log = logging.getLogger("kvstore.decisions")

CARRY_STEP = 32
"""Decisions, renewals or drops the tick carries out between two yields."""

Defer = Callable[..., None]
"""``defer(fn, *args)``: call ``fn(*args)`` soon, after what is running now (never inline)."""


class Signal:
    """Something that happens once (a copy landed or not, a part reached a node); callbacks given to
    :meth:`then` run with its value through the shell's ``defer``, never inline."""

    __slots__ = ("_defer", "_callbacks", "fired", "value")

    def __init__(self, defer: Defer) -> None:
        self._defer, self._callbacks, self.fired, self.value = defer, [], False, None

    def succeed(self, value: Any = None) -> None:
        """Fire with ``value``; a second call does nothing."""
        if self.fired:
            return
        self.fired, self.value = True, value
        callbacks, self._callbacks = self._callbacks, []
        for cb in callbacks:
            self._defer(cb, value)

    def then(self, cb: Callable[[Any], None]) -> None:
        if self.fired:
            self._defer(cb, self.value)
        else:
            self._callbacks.append(cb)


@dataclass(eq=False, slots=True)
class Copy:
    """Effect: ``Replicate`` ``keys`` of ``namespace`` from ``source`` onto ``target`` as ``kind``. The
    shell reports the reply with :meth:`CoordinatorCore.copy_ended`; ``done`` then fires with whether
    ``target`` holds every key. ``part``: one part of a relayed copy. ``started`` and ``contention``
    are the core's own bookkeeping (when it began, the links' load then)."""

    target: str
    namespace: str
    keys: list[bytes]
    source: str
    kind: PageKind
    ttl_s: float
    nbytes: int
    part: bool
    started: float
    contention: Any
    done: Signal = field(repr=False)


@dataclass(frozen=True, slots=True)
class Renew:
    """Effect: ``node`` keeps its speculative replica of ``keys`` until ``expires_at`` (``ttl_s`` from now)."""

    node: str
    namespace: str
    keys: tuple[bytes, ...]
    expires_at: float
    ttl_s: float


@dataclass(frozen=True, slots=True)
class Drop:
    """Effect: ``node`` drops its speculative replica of ``keys``."""

    node: str
    namespace: str
    keys: tuple[bytes, ...]


@dataclass(frozen=True, slots=True)
class Promote:
    """Effect: ``node`` reads ``keys``, held below its pool, up into it (a forecast burst is due)."""

    node: str
    namespace: str
    keys: tuple[bytes, ...]


Effect = Copy | Renew | Drop | Promote


def in_waves(queue: list[str], fanout: int, start: Callable[[str, Callable[[], None]], None]) -> None:
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
            in_waves(queue, fanout, start)
    for dst in wave:
        start(dst, one_done)


class CoordinatorCore:
    """Predictive and full replication's decisions (the module doc): the predictor, the planner tick,
    the copies in flight and the trees that carry them out, as effects for a shell to perform."""

    def __init__(self, config: NodeConfig, directory: Directory, membership: Membership,
                 page_bytes: Callable[[str], int], clock: Callable[[], float], defer: Defer,
                 perform: Callable[[Effect], None]) -> None:
        self.directory = directory
        self.membership = membership
        self._page_bytes = page_bytes
        self.clock, self.defer, self.perform = clock, defer, perform
        self.policy = config.replication
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
        # per node and direction, refined by the copies; until the first is measured, the shaped link's rate
        # where one is set (benchmarks, the replay), else the copy budget
        self.links = LinkRates(float(config.link_rate or config.spec_bandwidth))
        self._in_flight_bytes = 0
        self._full_queue: deque[tuple[str, str, list[bytes]]] = deque(maxlen=100_000)
        self.decisions: Counter[str] = Counter()  # kvstore_planner_decisions_total, by kind
        self.replicated: Counter[str] = Counter()  # kvstore_replication_bytes_total, by page kind
        self.decision_sources: Counter[str] = Counter()  # replicate decisions by the scorer behind them
        self.egress_saved_bytes = 0  # holder egress copy trees saved against copying all from one source
        self.pages_from: Counter[str] = Counter()  # speculative pages copied, by the node that sent them
        self.warming = Warming(self.plan_cfg.join_warm_s if self.policy == "predictive" else 0.0,
                               settle_s=config.heartbeat_timeout)

    # ---- inputs ---------------------------------------------------------------
    def _holders_count(self, namespace: str, key: bytes) -> int:
        """The predictor's ``holders`` feature: the nodes holding the page other than as a speculative replica
        no request has read yet (a read one is a replica like any other). The model learns the feature from
        the nodes that served a prefix. Counted, the coordinator's own unread copies would lower a prefix's
        score as soon as they land; the review would drop them as decayed, the score would rise again with
        them gone, and the planner would copy them once more, every few ticks for as long as no request
        goes to them."""
        held = self.directory.holders(namespace, key)
        unread = self.directory.speculative.get((namespace, key))
        return len(held.difference(unread)) if unread else len(held)

    def observe(self, node: str, event: pb.AccessEvent) -> None:
        """One recorded request (from a heartbeat or from this node)."""
        if self.predictor is None or not event.keys:
            return
        self.predictor.observe(Access(
            t=self.clock() - event.age_seconds, namespace=event.namespace, node=node, keys=tuple(event.keys),
            outcome=Outcome(min(event.outcome, 2)), page_bytes=self._page_bytes(event.namespace),
            total_blocks=event.total_blocks or len(event.keys), local_blocks=event.local_blocks))

    def on_report(self, node: str, batches: Sequence[pb.DirectoryBatch]) -> None:
        """Directory adds from ``node``: under ``full``, copy them everywhere (next :meth:`tick_full`)."""
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
        shared = claim.chain[:claim.needed]
        holders = [n for n, length in self.directory.prefixes(claim.namespace, shared).items()
                   if length >= len(shared)]  # none for an empty chain: the directory answers {}
        return waiter_tree(claim, alive, self.plan_cfg.fanout, self.plan_cfg.ttl_s,
                           self._page_bytes(claim.namespace), others=self.membership.live_ids(),
                           parts=self.relay_parts(claim.namespace, min(claim.needed, len(claim.chain))),
                           bytes_per_s=self.bandwidth, holders=holders)

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
                self.decisions["claim_tree"] += 1
                self.decision_sources["claim-waiters"] += 1
                self.copy_tree(d, len(d.keys) * self._page_bytes(d.namespace))

    @property
    def speculative(self) -> dict[tuple[str, bytes], dict[str, float]]:
        """The replicas of the prefixes this coordinator placed, as their nodes
        report them: ``{(namespace, deepest key): {node: expires_at}}``."""
        reported, now = self.directory.speculative, self.clock()
        out = {}
        for pid, touched in list(self._placed.items()):
            nodes = reported.get(pid)
            if nodes:
                out[pid] = {n: t for n, t in nodes.items() if self.membership.alive(n)}
            elif pid not in self.pending and now - touched > self.plan_cfg.ttl_s:
                del self._placed[pid]  # reported by no node for a whole TTL: nothing left to renew
        return {pid: nodes for pid, nodes in out.items() if nodes}

    def hints(self, namespace: str, chain: Sequence[bytes]) -> list[pb.NodePrefix]:
        """Nodes about to hold (copy in flight: ``ready_in_seconds`` is when
        the coordinator expects it landed) or holding as speculative
        replicas a prefix of ``chain``, with the replica's remaining life."""
        now = self.clock()
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

    # ---- the tick -------------------------------------------------------------
    def tick_steps(self, scores: Any, now: float) -> Steps[None]:
        """One ``predictive`` tick from the predictor's ``scores``: plan it and carry it out as effects, a
        step at a time (``kvstore.loops.slices``; the shell runs it in slices or in one go)."""
        assert self.tick_planner is not None
        joiners = self.warming.see(self.membership.live_ids(), now)
        result = yield from self.tick_planner.steps(scores, self.speculative, now, self.node_states(),
                                                    self.bandwidth, self._in_flight_bytes, self.planner_pending(),
                                                    joiners)
        self._warm(joiners)
        for namespace, keys, node in self.tick_planner.promotions:
            decision_log.info("promote %s on %s: %d pages below its pool, burst forecast", keys[-1].hex()[:12],
                              node, len(keys))
            self.decisions["promote"] += 1
            self.perform(Promote(node, namespace, keys))
        for i, d in enumerate(result.decisions, 1):
            if i % CARRY_STEP == 0:
                yield
            if decision_log.isEnabledFor(logging.INFO):
                decision_log.info("replicate %s depth=%d %s -> %s: %s", d.keys[-1].hex()[:12], d.depth,
                                  d.source, ",".join(d.targets), d.explain())
            self.decisions["replicate"] += 1
            scorer = self.tick_planner.scorer.get((d.namespace, d.keys[-1]), scores.source)
            self.decision_sources[scorer] += 1
            self.decisions[f"scorer_{scorer}"] += 1
            per_target = d.bytes // max(1, len(d.targets))
            if d.tree:
                self.copy_tree(d, per_target)
                continue
            for target in d.targets:
                self.copy(target, d.namespace, list(d.keys), d.source, PageKind.SPECULATIVE, d.ttl_s, per_target)
        for i, (namespace, key, node, expires) in enumerate(result.renewals, 1):
            if i % CARRY_STEP == 0:
                yield
            self._placed[(namespace, key)] = now
            self.perform(Renew(node, namespace, self._chain(namespace, key), expires, expires - now))
        for i, (namespace, key, node, reason) in enumerate(result.drops, 1):
            if i % CARRY_STEP == 0:
                yield
            decision_log.info("drop %s on %s: %s", key.hex()[:12], node, reason)
            self.decisions["drop"] += 1
            self.perform(Drop(node, namespace, self._chain(namespace, key)))
        for reason, count in result.skipped.items():
            self.decisions[f"skip_{reason}"] += count

    def _warm(self, joiners: Sequence[str]) -> None:
        """Start this tick's copies to joining nodes (``kvstore.placement.warming``); each one's end counts
        toward the joiner's warm mark."""
        assert self.tick_planner is not None
        copies = Counter(node for *_, node in self.tick_planner.warmups)
        for node in joiners:
            self.warming.planned(node, copies[node])
        for namespace, keys, source, node in self.tick_planner.warmups:
            decision_log.info("warm %s on joining %s from %s: %d pages", keys[-1].hex()[:12], node, source,
                              len(keys))
            self.decisions["warm"] += 1
            done = self.copy(node, namespace, list(keys), source, PageKind.SPECULATIVE, self.plan_cfg.ttl_s,
                             len(keys) * self._page_bytes(namespace))
            done.then(lambda _, n=node: self.warming.ended(n))

    def joining(self) -> list[str]:
        """Members that joined and are being warmed: routers leave them out (``kvstore.placement.warming``)."""
        return self.warming.joining(self.clock())

    def _chain(self, namespace: str, key: bytes) -> tuple[bytes, ...]:
        """The keys of the placed prefix whose deepest key is ``key``."""
        chain = self.predictor.chain((namespace, key)) if self.predictor is not None else ()
        return tuple(chain) or (key,)

    def tick_full(self) -> None:
        """A ``full`` tick: copy every newly added page to every live node lacking it."""
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
                        self.decisions["full"] += 1
                        self.copy(target, namespace, missing, source, PageKind.REPLICA, 0.0,
                                  len(missing) * self._page_bytes(namespace))

    def node_states(self) -> list[NodeState]:
        """Live nodes as their heartbeats describe them, plus the speculative
        bytes on their way to each (copies in flight)."""
        coming: dict[str, int] = {}
        for (namespace, _), nodes in self.pending.items():
            for node in nodes:
                coming[node] = coming.get(node, 0) + self._page_bytes(namespace)
        links = self.links
        return [NodeState(node_id=m.node_id, capacity_bytes=m.capacity_bytes, used_bytes=m.used_bytes,
                          spec_bytes=m.speculative_bytes + coming.get(m.node_id, 0),
                          cold_bytes=m.cold_bytes, cold_reads=m.cold_reads,
                          egress_bps=links.egress_bps(m.node_id), ingress_bps=links.ingress_bps(m.node_id),
                          sending=links.sending[m.node_id], receiving=links.receiving[m.node_id])
                for m in self.membership.view()]

    # ---- copies ---------------------------------------------------------------
    def copy(self, target: str, namespace: str, keys: list[bytes], source: str, kind: PageKind, ttl: float,
             nbytes: int, part: bool = False) -> Signal:
        """Start one Replicate (a :class:`Copy` effect); the returned signal fires with True when ``target``
        holds every key. ``part``: one part of a relayed copy, whose pending entry and placement the
        copy tree keeps for the whole prefix."""
        key, now = (namespace, keys[-1]), self.clock()
        if kind is PageKind.SPECULATIVE and not part:
            self.note_pending(key, keys, target, now + self.links.copy_s(source, target, nbytes))
            self._placed[key] = now
        self._in_flight_bytes += nbytes
        effect = Copy(target, namespace, keys, source, kind, ttl, nbytes, part, now, self.links.start(source, target),
                      Signal(self.defer))
        self.perform(effect)
        return effect.done

    def copy_ended(self, copy: Copy, copied: int | None, present: int = 0) -> None:
        """``copy``'s Replicate is over: the target copied ``copied`` pages and had ``present`` already
        (``copied`` None: the call failed)."""
        self._in_flight_bytes -= copy.nbytes
        if not copy.part:
            self._landed((copy.namespace, copy.keys[-1]), copy.target)
        n = copied or 0
        moved = n * (copy.nbytes // max(1, len(copy.keys)))
        self.links.end(copy.source, copy.target, moved, self.clock() - copy.started, copy.contention)
        self.replicated[copy.kind.name.lower()] += moved
        if copy.kind is PageKind.SPECULATIVE:
            self.pages_from[copy.source] += n
        copy.done.succeed(copied is not None and n + present == len(set(copy.keys)))

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

    def copy_tree(self, d: Decision, nbytes: int) -> None:
        """A copy tree. Every holder sends ``fanout`` copies a wave, its next wave once those landed (so its
        egress is shared by one wave, not by every edge out of it); a landed target serves its own subtree
        at once, a failed one's subtree is served by its sender in later waves. With ``--copy-chunks``
        N > 1 the copies relay instead (:meth:`_relay`). Every target is pending from the start, so
        routers see the whole set coming."""
        now = self.clock()
        key, children, roots = self.book_tree(d, nbytes, now)
        parts = chunk_bounds(len(d.keys), d.parts)
        if len(parts) > 1:
            self._placed[key] = now
            self._relay(d, nbytes, children, parts)
            return
        fanout = max(1, self.plan_cfg.fanout)

        def serve(node: str) -> None:
            queue = list(children.get(node, []))

            def start(dst: str, done: Callable[[], None]) -> None:
                def landed(ok: bool) -> None:
                    if ok:
                        serve(dst)
                    else:
                        queue.extend(children.get(dst, []))
                    done()
                self.copy(dst, d.namespace, list(d.keys), node, PageKind.SPECULATIVE, d.ttl_s, nbytes).then(landed)

            in_waves(queue, fanout, start)

        for src in roots:
            serve(src)

    def book_tree(self, d: Decision, nbytes: int,
                  now: float) -> tuple[tuple[str, bytes], dict[str, list[str]], list[str]]:
        """What a copy tree notes before its first copy: every target pending from the start (due after the
        tree's waves at the links' measured rates), and the holder egress the tree spares against copying
        every target from one source. Returns the prefix's key, each sender's targets, and the roots (the
        senders that held it before the tree)."""
        children: dict[str, list[str]] = {}
        for src, dst in d.tree:
            children.setdefault(src, []).append(dst)
        key = (d.namespace, d.keys[-1])
        at_once = {src: min(max(1, self.plan_cfg.fanout), len(dsts)) for src, dsts in children.items()}
        per_wave = max((self.links.copy_s(src, dst, nbytes, at_once[src]) for src, dst in d.tree), default=0.0)
        # store and forward: each target is due after its own wave; relayed, after the chain's copy times
        wave = arrival_waves(d.tree, self.plan_cfg.fanout) if d.parts <= 1 else {}
        for _, dst in d.tree:
            self.note_pending(key, d.keys, dst, now + per_wave * wave.get(dst, d.waves))
        targets = set(d.targets)
        root_edges = [s for s, _ in d.tree if s not in targets]
        self.egress_saved_bytes += (len(d.targets) - len(root_edges)) * nbytes
        return key, children, list(dict.fromkeys(root_edges))

    def _relay(self, d: Decision, nbytes: int, children: dict[str, list[str]], parts: list[tuple[int, int]]) -> None:
        """A relayed copy tree: a target starts sending part j to its own targets once part j reached it,
        so a chain of L targets holds the prefix after about ``1 + (L - 1) / len(parts)`` copy times
        instead of L (the planner shapes relayed trees as chains:
        :func:`~kvstore.placement.copytree.copy_tree`). Every node sends to ``fanout`` targets at a time.
        A part that did not land on a node is sent from the nearest node above it that has it; the failed
        node gets nothing more. Each target stops being pending once its copy is over, landed or not."""
        parent = {dst: src for src, dst in d.tree}
        key, keys = (d.namespace, d.keys[-1]), list(d.keys)
        has = {dst: [Signal(self.defer) for _ in parts] for dst in parent}  # part j landed on dst
        fanout = max(1, self.plan_cfg.fanout)

        def holder(node: str, j: int, then: Callable[[str], None]) -> None:  # nearest node from ``node`` up with part j
            if node not in has:
                then(node)  # a root holds every part
            else:
                has[node][j].then(lambda ok: then(node) if ok else holder(parent[node], j, then))

        def send(src: str, dst: str, done: Callable[[], None]) -> None:
            got = has[dst]

            def end() -> None:
                for s in got:
                    s.succeed(False)  # does nothing where it fired
                self._landed(key, dst)
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
                holder(src, j, lambda s: self.copy(dst, d.namespace, keys[a:b], s, PageKind.SPECULATIVE, d.ttl_s,
                                                   nbytes * (b - a) // len(keys), part=True).then(copied))
            part(0)

        for node in dict.fromkeys([s for s, _ in d.tree] + list(parent)):
            in_waves(list(children.get(node, [])), fanout, lambda dst, done, node=node: send(node, dst, done))

    # ---- reporting ------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """What both shells report of the core."""
        out: dict[str, Any] = {"policy": self.policy, "speculative_prefixes": len(self.speculative),
                               "pending": len(self.pending), "bandwidth_bps": self.bandwidth,
                               "links": self.links.stats()}
        if self.predictor is not None:
            out.update(self.predictor.stats())
        out["egress_saved_bytes"] = self.egress_saved_bytes
        out["pages_from"] = dict(self.pages_from)
        total = sum(self.decision_sources.values())
        out["decision_sources"] = {k: v / total for k, v in self.decision_sources.items()} if total else {}
        return out
