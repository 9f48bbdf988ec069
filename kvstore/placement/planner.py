"""Placement planner: which prefixes to copy where, ahead of a forecast burst.

A pure function of its inputs (scores, cluster state, measured bandwidth,
the replicas already placed, ``now``): no sockets, no clocks, no randomness.
The coordinator calls it once per tick and carries out what it returns:

* :class:`~kvstore.predict.types.Decision`\\ s -- copy the first ``depth``
  blocks of a prefix from ``source`` to each of ``targets``, tagged
  speculative with a TTL;
* :class:`~kvstore.predict.types.Renewal`\\ s -- extend a replica that is
  still predicted hot instead of copying it again;
* :class:`~kvstore.predict.types.Drop`\\ s -- remove a replica whose TTL ran
  out or whose score decayed below the hysteresis threshold.

Rules, and why:

1. **Candidates.** :func:`select_candidates` turns the predictor's score
   vector (100k+ prefixes) into the few hundred row indices worth building
   :class:`Candidate` objects for. The caller should select with
   ``cfg.keep_threshold`` (not ``cfg.threshold``) so that candidates between
   the two keep their existing replicas alive (hysteresis); :func:`plan` only
   *copies* for ``prob >= cfg.threshold``. A replica under review whose
   prefix is absent from ``candidates`` counts as decayed, so the caller
   passes the candidates of the prefixes under review (``to_review``: a
   slice of the placed chains a tick, and those due).
2. **Order.** Candidates are planned by probability, highest first (ties:
   sooner need, then namespace and keys), so the byte and room budgets go to
   the surest bets.
3. **Depth gate.** From the deepest depth option down: a copy of ``depth``
   pages from ``src`` to ``dst`` takes ``depth * page_bytes / rate`` seconds,
   ``rate`` being its share of both ends: ``min(egress(src) / (copies
   leaving src + 1), ingress(dst) / (copies entering dst + 1))``, from each
   node's measured rates (:class:`~kvstore.placement.links.LinkRates`;
   ``bandwidth_bps`` for a node that reports none) and the copies in flight
   or planned this tick. A target is kept only if its copy from the chosen
   source fits ``transfer_s * cfg.safety <= need_in_s``; the fastest copy
   the cluster could make gates the depths first, cheaply. No depth fits ->
   skip ``too_late``: never warm what cannot land before it is needed. A
   depth also needs a live source holding it, else the next shallower is
   tried.
4. **Targets.** Live nodes not holding the prefix at that depth (directory
   holders of that depth or deeper, plus unexpired speculative replicas of
   that depth or deeper) and not about to (a copy of it planned earlier in
   this tick, or in flight from an earlier one: ``pending``). A target must
   have room in *both* its speculative share (``spec_bytes + planned + bytes
   <= spec_budget * capacity``) and its free space (``used + planned + bytes
   <= capacity``), or, where the copy pays for what it pushes out, its free
   space plus its cold pages (``used + planned + bytes <= capacity +
   cold_bytes``, when ``copy_value(prob, demand, copies) > cold_reads``: the
   expected reads of a page of the copy against those of the coldest page it
   displaces; :mod:`kvstore.pool.room`). A copy placed is kept until its
   forecast has passed, and sinks to the tier below then.
   ``used_bytes`` includes ``spec_bytes``. Up to ``cfg.max_targets`` targets
   with the most headroom (``capacity - used - planned``: free space before
   displacing; ties: fewer speculative bytes, then node id).
5. **Source.** A live holder of the depth with the least load, then the
   fastest egress share, then the fewest bytes already planned out of it
   this tick, then the most headroom, then node id.
6. **Budgets.** Copy bytes this tick stay within ``cfg.spec_bandwidth *
   cfg.tick_s - transfers_in_flight_bytes`` (a candidate that does not fit
   tries a shallower depth, then fewer targets); at most
   ``cfg.max_decisions`` decisions. Bytes planned on a node in this tick
   count against its budgets for the following candidates. Drops planned in
   the same tick are not credited back (the space frees only once the node
   has evicted them).

Skip reasons (``PlanResult.skipped``): ``too_late``, ``no_source``,
``held_everywhere``, ``no_room``, ``bandwidth``, ``cap``, ``no_target`` (no
live node at all), ``unknown_size`` (``page_bytes <= 0``). They are checked
cheapest first: ``too_late`` (no depth fits in time), then cluster-wide
``no_room`` / ``bandwidth`` (no depth that fits in time fits in the largest
room any node has left, or in the byte budget left) -- this keeps a tick
with a full cluster O(candidates x depths) -- then, depth by depth, the
holders (``held_everywhere``, ``no_source``) and each node's room. When
several depths were tried, the reason is that of the shallowest one tried
(the last barrier); a decision's ``reason`` string names the deeper ones
that failed and why.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from kvstore.loops.slices import Steps, in_one_go
from kvstore.placement.candidates import Bounds, Ranked, select_candidates, unfold
from kvstore.placement.copytree import chunk_bounds, copy_times, copy_tree, relay_parts
from kvstore.placement.holderwalk import HolderWalk
from kvstore.placement.planner_types import Candidate, Decision, NodeState, PlannerConfig, PlanResult, usable_depths
from kvstore.placement.renewals import Coverage, Speculative, renew_or_drop, renew_or_drop_steps
from kvstore.pool.room import copy_value
from kvstore.predict.types import PrefixId

SKIP_REASONS = (
    "too_late", "no_target", "no_room", "bandwidth", "no_source",
    "held_everywhere", "cap", "unknown_size", "enough_copies",
)


# --------------------------------------------------------------------------
# per-tick node bookkeeping
# --------------------------------------------------------------------------


@dataclass(slots=True)
class _NodeTick:
    """A live node as seen during one tick: its report plus what this tick planned."""

    state: NodeState
    spec_limit: int
    egress: float = 0.0     # its copy egress, bytes/s (its report, else plan()'s bandwidth_bps)
    ingress: float = 0.0    # its copy ingress, bytes/s
    planned_in: int = 0     # bytes planned onto it this tick
    planned_out: int = 0    # bytes planned out of it (as a source) this tick
    sends: int = 0          # copies planned out of it this tick
    receives: int = 0       # copies planned into it this tick
    room: int = 0           # speculative bytes it can still take in free space (``book`` keeps it)
    displacing: int = 0     # ... and pushing out its cold pages (a copy that pays for them: ``room_for``)

    def __post_init__(self) -> None:
        self._set_room()

    @property
    def node_id(self) -> str:
        return self.state.node_id

    @property
    def headroom(self) -> int:
        """Free bytes left after what this tick already planned onto it."""
        return self.state.capacity_bytes - self.state.used_bytes - self.planned_in

    def book(self, nbytes: int) -> None:
        """Plan a copy of ``nbytes`` onto it."""
        self.planned_in += nbytes
        self.receives += 1
        self._set_room()

    def _set_room(self) -> None:
        """``room``: what fits both its speculative share (``spec_bytes + planned <= spec_limit``) and free
        space; ``displacing``: its share and free space plus its cold pages."""
        share = self.spec_limit - self.state.spec_bytes - self.planned_in
        self.room = max(0, min(share, self.headroom))
        self.displacing = max(0, min(share, self.headroom + self.state.cold_bytes))

    def room_for(self, value: float) -> int:
        """The bytes a copy whose pages each expect ``value`` reads may take here: its free room, and its
        cold pages too where they expect fewer (``kvstore.pool.room``, rule 2)."""
        return self.displacing if value > self.state.cold_reads else self.room

    def out_share(self, at_once: int = 1) -> float:
        """Bytes/s each of ``at_once`` more copies out of it would get (its egress shared with those leaving)."""
        return self.egress / (self.state.sending + self.sends + at_once)

    @property
    def in_share(self) -> float:
        """Bytes/s one more copy into it would get."""
        return self.ingress / (self.state.receiving + self.receives + 1)

    def source_key(self) -> tuple[float, float, int, int, str]:
        """Sort key for sources: least load, fastest egress share, least planned out, most headroom, id."""
        return (self.state.load, -self.out_share(), self.planned_out, -self.headroom, self.node_id)


def _target_key(pair: tuple[_NodeTick, float]) -> tuple[int, int, str]:
    """Sort key for targets, of a (node, copy seconds) pair: most headroom, fewer speculative bytes, id."""
    n, state = pair[0], pair[0].state
    return (-n.headroom, state.spec_bytes + n.planned_in, state.node_id)


def _node_ticks(nodes: Sequence[NodeState], cfg: PlannerConfig, bandwidth_bps: float) -> dict[str, _NodeTick]:
    """Live nodes by id, with their speculative byte limit and link rates (else ``bandwidth_bps``)."""
    return {
        n.node_id: _NodeTick(n, spec_limit=int(cfg.spec_budget * n.capacity_bytes),
                             egress=n.egress_bps or bandwidth_bps, ingress=n.ingress_bps or bandwidth_bps)
        for n in nodes
    }


# --------------------------------------------------------------------------
# helpers of one candidate
# --------------------------------------------------------------------------


def _order_key(c: Candidate) -> tuple[float, float, str, tuple[bytes, ...]]:
    """Planning order: highest prob, then soonest need, then identity (determinism)."""
    return (-c.prob, c.need_in_s, c.namespace, c.chain)


@dataclass(slots=True)
class _Tick:
    """Mutable state of one planning pass: nodes, budgets, result."""

    cfg: PlannerConfig
    live: dict[str, _NodeTick]
    speculative: Speculative
    now: float
    budget_left: int
    result: PlanResult
    room: int = 0           # most bytes any live node can still take (``refresh``)
    rate: float = 0.0       # fastest rate any copy could get now (``refresh``)
    planned: dict[PrefixId, set[str]] = field(default_factory=dict)  # block key -> targets copied to this tick
    demand: dict[str, dict[bytes, float]] = field(default_factory=dict)  # [ns][block key] -> demand (Coverage)

    def skip(self, reason: str, n: int = 1) -> None:
        self.result.skipped[reason] = self.result.skipped.get(reason, 0) + n

    def refresh(self) -> None:
        """Recompute the cluster-wide bounds, at the start and after each decision.

        ``room``: the most speculative bytes any live node can still take, pushing out its cold pages
        (a full cluster rejects a candidate in O(depths), not O(depths x nodes)). ``rate``: that of the
        fastest copy any source could send any target now: a depth too late at it is too late everywhere."""
        room, send, receive = 0, 0.0, 0.0
        for n in self.live.values():  # once a decision: one loop, out_share() and in_share inlined
            state = n.state
            if n.displacing > room:
                room = n.displacing
            if (share := n.egress / (state.sending + n.sends + 1)) > send:
                send = share
            if (share := n.ingress / (state.receiving + n.receives + 1)) > receive:
                receive = share
        self.room, self.rate = room, min(send, receive)

    def bounds(self) -> Bounds | str:
        """What any further copy can get at best now, or why none can start (``unfold``'s state)."""
        if len(self.result.decisions) >= self.cfg.max_decisions:
            return "cap"
        if self.budget_left <= 0:
            return "bandwidth"
        return self.limits()

    def limits(self) -> Bounds:
        """The cluster-wide bounds of any further copy now (``candidates.gate_row`` takes them)."""
        return Bounds(self.rate, self.room, self.budget_left, len(self.live))

    def plan_one(self, c: Candidate) -> Decision | str:
        """A decision for candidate ``c``, or the reason it is skipped."""
        if not self.live:
            return "no_target"
        page = c.page_bytes
        if page <= 0:
            return "unknown_size"
        bandwidth = self.rate
        if bandwidth <= 0:
            return "too_late"
        # Depth gate, then the cheap cluster-wide checks: most candidates of a
        # busy tick stop here, before any per-node work.
        need, safety = c.need_in_s, self.cfg.safety
        room_max, budget = self.room, self.budget_left
        depths = usable_depths(c.depth_options, len(c.chain))
        if not depths:
            return "too_late"
        least = depths[-1] * page  # the shallowest copy: when it does not fit, no deeper one does
        if least / bandwidth * safety > need:
            return "too_late"
        if least > room_max:
            return "no_room"
        if least > budget:
            return "bandwidth"
        notes: list[tuple[int, str]] = []          # deeper depths that fit in time but not elsewhere
        viable: list[tuple[int, int, float]] = []  # (depth, bytes per target, transfer s); the shallowest is in
        for d in depths:
            nbytes = d * page
            t = nbytes / bandwidth
            if t * safety > need:
                continue
            if nbytes <= room_max and nbytes <= budget:
                viable.append((d, nbytes, t))
            elif not viable:
                notes.append((d, "no_room" if nbytes > room_max else "bandwidth"))
        walk = HolderWalk(c, self.live, self.speculative, self.planned, self.now)
        reason = "too_late"
        for d, nbytes, _ in viable:
            held, pending = walk.at(d)
            if len(held) + len(pending) == len(self.live):
                reason = "held_everywhere"  # then every shallower depth is too
                break
            if not held:
                reason = "no_source"
            elif (wanted := self._wanted(c, d, len(held) + len(pending))) == 0:
                return "enough_copies"  # the replica set (copies in flight too) already serves the forecast demand
            else:
                value = copy_value(c.prob, self._demand(c, d), len(held) + len(pending) + (wanted or 1))
                room = [n for n in self.live.values()
                        if n.room_for(value) >= nbytes and n.node_id not in held and n.node_id not in pending]
                reason = "no_room"
                if room:
                    sources = sorted((self.live[n] for n in held), key=_NodeTick.source_key)
                    send = sources[0].out_share()
                    rates = [(n, min(send, n.in_share)) for n in room]
                    in_time = [(n, nbytes / r) for n, r in rates if r > 0 and nbytes / r * safety <= need]
                    if in_time:
                        return self._decide(c, d, nbytes, sources, in_time, wanted, notes)
                    reason = "too_late"  # at the links' measured rates and their copies in flight
            notes.append((d, reason))
        return reason

    def _demand(self, c: Candidate, depth: int) -> float:
        """The forecast requests reading ``c``'s first ``depth`` blocks in the demand window: that of every
        candidate reading them (0: unknown)."""
        return self.demand.get(c.namespace, {}).get(c.chain[depth - 1], 0.0)

    def _wanted(self, c: Candidate, depth: int, have: int) -> int | None:
        """New copies of ``c``'s first ``depth`` blocks the forecast demand
        asks for (``None``: demand or node rate unknown, so ``max_targets``
        caps the copies as before)."""
        cfg = self.cfg
        demand = self._demand(c, depth)
        if cfg.node_rate <= 0 or demand <= 0:
            return None
        want = min(len(self.live), math.ceil(demand / (cfg.node_rate * cfg.demand_window_s)))
        return max(0, want - have)

    def _decide(
        self,
        c: Candidate,
        depth: int,
        nbytes: int,
        sources: list[_NodeTick],
        room: list[tuple[_NodeTick, float]],
        wanted: int | None,
        notes: list[tuple[int, str]],
    ) -> Decision:
        """Pick targets for ``c`` at ``depth`` among ``room`` (nodes with room whose copy from the best
        of ``sources`` lands in time, with that copy's seconds) and book their bytes and copies.
        ``wanted``: the new copies the forecast demand asks for (``_wanted``), None when unknown.

        Without a demand forecast: up to ``max_targets`` targets, all copied
        from one source. With one: as many targets as the demand asks for,
        copied as a tree (every holder serves ``fanout`` targets a wave, and
        each target serves the next wave once its copy landed), trimmed to
        the waves that land in time (at the slowest chosen target's rate)."""
        cfg = self.cfg
        room.sort(key=_target_key)
        src, need, safety = sources[0], c.need_in_s, cfg.safety

        def wave_s(targets: Sequence[_NodeTick], at_once: int) -> float:
            """Seconds of a wave of copies to ``targets``, ``at_once`` of them leaving ``src`` together."""
            send = src.out_share(at_once)
            return max(nbytes / min(send, n.in_share) for n in targets)

        if wanted is None:  # up to max_targets copies from one source at once, as many as land in time
            k = min(cfg.max_targets, self.budget_left // nbytes, len(room))
            while k > 1 and wave_s([n for n, _ in room[:k]], k) * safety > need:
                k -= 1
            transfer_s, parts = wave_s([n for n, _ in room[:k]], k), 1
        else:
            fanout = max(1, cfg.fanout)
            transfer_s = wave_s([n for n, _ in room], min(fanout, len(room)))
            single = transfer_s * safety > need  # a wave of fanout copies is too slow: one copy alone lands in time
            if single:
                transfer_s = room[0][1]
            parts = relay_parts(transfer_s, cfg.chunks, cfg.min_part_s)
            if single:
                reach = 1
            elif parts > 1:  # a chain of L relays lands in 1 + (L - 1) / parts copy times
                reach = len(sources) * (1 + (int(need // (transfer_s * safety)) - 1) * parts)
            else:
                waves_ok = max(1, int(need // (transfer_s * safety))) if transfer_s > 0 else 1
                reach = len(sources) * ((1 + fanout) ** min(waves_ok, 16) - 1)
            k = min(wanted, reach, self.budget_left // nbytes, len(room))
        targets = [n for n, _ in room[:k]]
        if wanted is None:
            edges = [(sources[0].node_id, n.node_id) for n in targets]
            waves = 1
        else:
            edges, waves = copy_tree([n.node_id for n in sources], [n.node_id for n in targets], cfg.fanout,
                                     parts)
        # what the decision's numbers do not say (``Decision.explain`` adds them when it is logged)
        why = "max_targets, no demand forecast" if wanted is None else f"wants {wanted} more"
        if notes:
            why += "; deeper: " + ", ".join(f"depth {d} {r}" for d, r in notes)
        total = nbytes * k
        for n in targets:
            n.book(nbytes)
        for sender, _ in edges:
            self.live[sender].planned_out += nbytes
            self.live[sender].sends += 1
        self.budget_left -= total
        self.refresh()
        names = {n.node_id for n in targets}
        planned, ns = self.planned, c.namespace
        for key in c.chain[:depth]:
            if (pending := planned.get((ns, key))) is None:
                planned[(ns, key)] = set(names)
            else:
                pending.update(names)
        return Decision(
            namespace=c.namespace,
            keys=c.chain[:depth],
            depth=depth,
            source=sources[0].node_id,
            targets=tuple(n.node_id for n in targets),
            prob=c.prob,
            ttl_s=cfg.ttl_s,
            reason=why,
            bytes=total,
            transfer_s=transfer_s,
            need_in_s=c.need_in_s,
            tree=tuple(edges) if wanted is not None else (),
            waves=waves,
            parts=parts,
            demand=self.demand[c.namespace][c.chain[depth - 1]] if wanted is not None else 0.0,
        )


# --------------------------------------------------------------------------
# the tick
# --------------------------------------------------------------------------


def _start(nodes: Sequence[NodeState], bandwidth_bps: float, cfg: PlannerConfig, now: float,
           speculative: Speculative, transfers_in_flight_bytes: int) -> _Tick:
    """A tick before any decision: the live nodes, and the byte budget less the copies in flight."""
    budget = max(0, int(cfg.spec_bandwidth * cfg.tick_s) - int(transfers_in_flight_bytes))
    tick = _Tick(cfg, _node_ticks(nodes, cfg, bandwidth_bps), speculative, now, budget, PlanResult(bytes_budget=budget))
    tick.refresh()
    return tick


def tick_bounds(nodes: Sequence[NodeState], bandwidth_bps: float, cfg: PlannerConfig,
                transfers_in_flight_bytes: int = 0) -> Bounds:
    """The bounds :func:`plan` starts a tick with, for ``candidates.gate_row``."""
    return _start(nodes, bandwidth_bps, cfg, 0.0, {}, transfers_in_flight_bytes).limits()


PLAN_STEP = 16
"""Candidates :func:`plan_steps` plans between two yields (a step of tens to hundreds of microseconds)."""
COVER_STEP = 256
"""Candidates :func:`plan_steps` folds into its coverage between two yields."""


def plan_steps(
    candidates: Sequence[Candidate],
    nodes: Sequence[NodeState],
    bandwidth_bps: float,
    cfg: PlannerConfig,
    now: float,
    speculative: Speculative | None = None,
    transfers_in_flight_bytes: int = 0,
    pending: Mapping[PrefixId, Collection[str]] | None = None,
    review: Collection[PrefixId] | None = None,
    ranked: Ranked | None = None,
) -> Steps[PlanResult]:
    """One planner tick: copy decisions, renewals and drops.

    ``candidates``: scored prefixes (any order; typically the rows of
    :func:`select_candidates` at ``cfg.keep_threshold``). ``nodes``: the
    live nodes, each with its measured link rates and copies in flight.
    ``bandwidth_bps``: the rate of a node whose ``NodeState`` carries none.
    ``speculative``: replicas already placed,
    ``{(namespace, key of deepest block): {node: expires_at}}``.
    ``transfers_in_flight_bytes``: copy bytes still on the wire from earlier
    ticks; they are charged to this tick's byte budget. ``pending``: those
    copies' targets, ``{(namespace, key of deepest block copied): nodes}``;
    a node with a copy in flight is no target (no second copy while the
    first is on the wire) and no source yet. ``review``: the placed prefixes
    whose replicas this tick renews or drops (``renewals.to_review``; None:
    all). ``ranked``: more candidates, built only as far as the tick gets
    (``candidates.Ranked``; a row turned away before its turn counts under
    the reason it had then). ``now`` is on the same clock as the expiries.
    Same inputs, same result.

    The tick a step at a time (:mod:`kvstore.loops.slices`): it yields every
    :data:`COVER_STEP` candidates folded into the coverage, every
    :data:`PLAN_STEP` candidates planned, and in the renewals
    (``renewals.renew_or_drop_steps``); :func:`plan` runs it in one go. Between two steps
    ``speculative`` may change (the coordinator's, as copies land and
    replicas go): each step reads it as it is then, and a prefix under
    review that is gone by the renewals is passed over.
    """
    tick = _start(nodes, bandwidth_bps, cfg, now, speculative if speculative is not None else {},
                  transfers_in_flight_bytes)
    for pid, targets in (pending or {}).items():
        tick.planned[pid] = set(targets)
    result = tick.result

    ordered = sorted(candidates, key=_order_key)
    # one pass: the demand along chains, and the scores of the placed keys under review
    coverage = Coverage.of((), tick.speculative if review is None else review)
    for lo in range(0, len(ordered), COVER_STEP):
        coverage.add(ordered[lo:lo + COVER_STEP])
        yield
    if cfg.node_rate > 0:
        tick.demand = coverage.demand
    stream: Iterable[Candidate] = ordered
    if ranked is not None and len(ranked):
        stream = unfold(ranked, ordered, cfg.threshold, tick.bounds, cfg.safety, tick.skip, coverage.add, _order_key)
    for i, c in enumerate(stream, 1):
        if i % PLAN_STEP == 0:
            yield
        if c.prob < cfg.threshold:
            break  # ordered by prob: the rest only keep existing replicas alive
        if len(result.decisions) >= cfg.max_decisions:
            tick.skip("cap")
            continue
        if tick.budget_left <= 0:
            tick.skip("bandwidth")
            continue
        outcome = tick.plan_one(c)
        if isinstance(outcome, str):
            tick.skip(outcome)
        else:
            result.decisions.append(outcome)
            result.bytes_planned += outcome.bytes

    yield
    result.renewals, result.drops = yield from renew_or_drop_steps(ordered, tick.speculative, tick.live, cfg, now,
                                                                   coverage, review)
    return result


plan = in_one_go(plan_steps)
"""One planner tick in one go (:func:`plan_steps` run to the end): its decisions, renewals and drops."""


__all__ = ["PLAN_STEP", "SKIP_REASONS", "Speculative", "chunk_bounds", "copy_times", "copy_tree", "plan", "plan_steps",
           "relay_parts", "renew_or_drop", "select_candidates", "tick_bounds"]
