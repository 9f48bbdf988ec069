"""One planner tick's inputs, from the predictor's scores, the directory and the membership, and its plan.

The coordinator core (:mod:`kvstore.cluster.coordinator_core`, in the daemon and in the simulated replay) calls
:meth:`TickPlanner.steps` once a tick, on the event loop: it keeps that step short at 100k scored prefixes by building
:class:`~kvstore.placement.planner_types.Candidate` objects only where the planner reads them.

* Candidates come from three scorers (:meth:`TickPlanner.chosen`): the classifier's best rows at the
  keep threshold, the placed prefixes under review this tick (``renewals.to_review``: a slice of the
  placed chains in turn, and those due for renewal), and the rate forecaster's due bursts.
* They are grouped by chain (the prefixes sharing a first block, scored apart at each tracked depth:
  they read each other's scores and demands). A chain under review is built at once; the others go
  to the planner as :class:`~kvstore.placement.candidates.Ranked` rows, one a chain, that it builds
  only as far as its room and byte budget last. A chain with nothing under review and no prefix at
  the copy threshold is not built at all.
* Holders are looked up lazily (:class:`~kvstore.placement.planner_types.LazyHolders`), when the
  planner reads them.
* Promotions (:meth:`TickPlanner.promote`): a prefix at the copy threshold, due back on its own period
  (or, a shared one, on a borrowed period), that a live node holds partly below its pool (evicted down
  a tier since its last burst) is read back up on that node just before the burst (``PROMOTE_LEAD_S``),
  as deep as the predictor tracks it, so the burst's first request finds it in the pool and the
  planner's copies to other nodes start from there. Pages a node promoted are not promoted again for
  ``PROMOTE_AGAIN_S``.
* Warm copies (:func:`~kvstore.placement.warming.warm_copies`): a node that joined the running cluster
  gets the prefixes the forecast expects hot, before routers send it traffic (``warmups``).
* The tick runs a step at a time (:meth:`TickPlanner.steps`, :mod:`kvstore.loops.slices`): the
  coordinator gives the loop back between slices of a few milliseconds, so a long tick delays no
  request by more than one slice.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import numpy as np

from kvstore.cluster.directory import Directory
from kvstore.cluster.membership import Membership
from kvstore.placement.candidates import Ranked, select_candidates
from kvstore.loops.slices import Steps, finish
from kvstore.placement.planner import plan_steps
from kvstore.placement.planner_types import Candidate, LazyHolders, NodeState, PlannerConfig, PlanResult
from kvstore.placement.renewals import Speculative, to_review_steps
from kvstore.placement.warming import WarmCopy, warm_copies
from kvstore.predict.types import PredictorConfig, PrefixId

BUILD_STEP = 64
"""Candidates built between two yields of :meth:`TickPlanner.steps`."""
Chosen = dict[PrefixId, tuple[float, float, str]]
"""pid -> (prob, need_in_s, scorer)."""
Row = tuple[PrefixId, tuple[bytes, ...], int]
"""(pid, its chain, its page bytes)."""
RETURN_EVIDENCE = 2.0
"""A prefix whose bursts average at least this many requests may borrow the period of the prefixes that
recur for its promotion; one asked for once (a unique prompt) needs a period of its own."""
PROMOTE_LEAD_S = 5.0
"""A promotion starts when the burst's earliest expected start (``need_in_s``) is this close: late enough that
the other traffic does not push the pages back down before it (a pool turns over in minutes when it is
full), early enough for a drive to read the prefix (a 64k-token Llama-3-70B prefix, 21 GB, in about 3 s
from one 6.4 GB/s NVMe drive; 0.4 s from a DGX H100's eight)."""
PROMOTE_AGAIN_S = 30.0
"""Seconds before the same pages of a node are promoted again (the directory hears of a promotion a
heartbeat later)."""


class TickPlanner:
    """Builds a tick's candidates and plans it; remembers which scorer chose each prefix."""

    def __init__(self, predictor: Any, directory: Directory, membership: Membership, pcfg: PredictorConfig,
                 plan_cfg: PlannerConfig, page_bytes: Callable[[str], int]) -> None:
        self.predictor, self.directory, self.membership = predictor, directory, membership
        self.pcfg, self.plan_cfg, self._page_bytes = pcfg, plan_cfg, page_bytes
        self.scorer: dict[PrefixId, str] = {}  # (namespace, key at a depth option) -> the scorer behind it
        self.turn = 0                          # review slice of the next tick
        self._chains = _ChainNumbers(predictor)  # placed pid -> its chain's number (to_review)
        self.promotions: list[tuple[str, tuple[bytes, ...], str]] = []  # this tick's (namespace, keys, node)
        self.recurring: set[PrefixId] = set()  # this tick's forecasts worth a promotion (RETURN_EVIDENCE)
        self._promoted: dict[tuple[str, bytes, str], float] = {}       # (namespace, deepest key, node) -> when
        self.warmups: list[WarmCopy] = []      # this tick's copies to joining nodes (namespace, keys, source, node)
        self._joiners: dict[str, int] = {}     # this tick's joiners -> bytes they take

    # ---- the tick ----------------------------------------------------------------------------------
    def plan(self, scores: Any, speculative: Speculative, now: float, nodes: list[NodeState], bandwidth: float,
             in_flight_bytes: int, pending: Mapping[PrefixId, Collection[str]],
             joiners: Sequence[str] = ()) -> PlanResult:
        """Plan one tick in one go: :meth:`steps` run to the end."""
        return finish(self.steps(scores, speculative, now, nodes, bandwidth, in_flight_bytes, pending, joiners))

    def steps(self, scores: Any, speculative: Speculative, now: float, nodes: list[NodeState], bandwidth: float,
              in_flight_bytes: int, pending: Mapping[PrefixId, Collection[str]],
              joiners: Sequence[str] = ()) -> Steps[PlanResult]:
        """Plan one tick, a step at a time (``kvstore.loops.slices``): review a slice of the placed
        chains, build what the planner reads, plan (``planner.plan_steps``). Between steps
        ``speculative`` and the directory may change; a candidate reads its holders when planned.
        ``joiners``: live nodes that joined and wait for their warm copies (``warmups``)."""
        cfg = self.plan_cfg
        self._joiners = {n.node_id: max(0, min(int(cfg.spec_budget * n.capacity_bytes) - n.spec_bytes,
                                               n.capacity_bytes - n.used_bytes))
                         for n in nodes if n.node_id in joiners}
        review = yield from to_review_steps(speculative, self._chains, self.turn, cfg, now)
        self.turn += 1
        if len(self._chains) > 2 * len(speculative) + 1024:
            for pid in [pid for pid in self._chains if pid not in speculative]:
                del self._chains[pid]
        eager, ranked = yield from self._split_steps(scores, review, now)
        return (yield from plan_steps(eager, nodes, bandwidth, cfg, now, speculative, in_flight_bytes,
                                      pending=pending, review=review, ranked=ranked))

    def candidates(self, scores: Any, speculative: Speculative, now: float) -> list[Candidate]:
        """Every candidate of a tick reviewing all of ``speculative``, built (for tests and tools)."""
        chosen, demand, live, rows = finish(self._rows(scores, set(speculative), now))
        return [self._candidate(row, chosen, demand, live) for row in rows]

    # ---- candidates --------------------------------------------------------------------------------
    def chosen(self, scores: Any, review: Collection[PrefixId], now: float) -> Chosen:
        """What the planner considers, from three scorers.

        The classifier (LightGBM or momentum): prefixes at the keep threshold
        (hysteresis) plus the placed prefixes under review, so hot replicas
        are renewed, not dropped. The rate forecaster: prefixes whose next
        burst is due within ``forecast_lead_s`` (copied before its first
        request), and placed prefixes under review whose next burst is due
        within a TTL (kept alive between the bursts of a recurring prefix).
        Per prefix the most confident scorer wins."""
        cfg, predictor = self.plan_cfg, self.predictor
        keep = cfg.keep_threshold
        chosen: Chosen = {}
        self.recurring = set()
        rows = set(select_candidates(scores.probs, keep, cfg.max_decisions * 2).tolist())
        if review:
            rows.update(i for i in predictor.positions(scores, list(review)) if i >= 0)
        if rows:
            ordered = np.fromiter(rows, dtype=np.intp, count=len(rows))
            for i, prob, need_in in zip(ordered.tolist(), scores.probs[ordered].tolist(),
                                        scores.need_in_s[ordered].tolist()):
                chosen[scores.ids[i]] = (prob, need_in, scores.source)
        soon = predictor.forecast(now)
        later = predictor.forecast(now, cfg.ttl_s, keys=list(review))
        floor = self.pcfg.need_in_floor_s
        for fc in (soon, later):
            for j in np.flatnonzero(fc.p_onset >= keep):
                pid, prob = fc.keys[j], float(fc.p_onset[j])
                if prob > chosen.get(pid, (-1.0, 0.0, ""))[0]:
                    need_in = max(float(fc.onset_in_s[j] - fc.sigma_s[j]), floor)
                    chosen[pid] = (prob, need_in, "forecast")
                    if fc.seasonal[j] or fc.burst_size[j] >= RETURN_EVIDENCE:
                        self.recurring.add(pid)
        return chosen

    def split(self, scores: Any, review: Collection[PrefixId], now: float) -> tuple[list[Candidate], Ranked | None]:
        """The candidates to build now, and the rows the planner builds as it goes (module docstring)."""
        return finish(self._split_steps(scores, review, now))

    def _split_steps(self, scores: Any, review: Collection[PrefixId], now: float
                     ) -> Steps[tuple[list[Candidate], Ranked | None]]:
        cfg = self.plan_cfg
        chosen, demand, live, rows = yield from self._rows(scores, review, now)
        self.promotions = self.promote(chosen, rows, live, now)
        self.warmups = self.warm(live, now) if self._joiners else []
        yield
        chains: dict[tuple[str, bytes], list[Row]] = {}
        for row in rows:
            chains.setdefault((row[0][0], row[1][0]), []).append(row)
        eager: list[Candidate] = []
        later: list[tuple[float, list[Row]]] = []
        for members in chains.values():
            best = max(chosen[pid][0] for pid, _, _ in members)
            if any(pid in review for pid, _, _ in members):
                before = len(eager)
                eager.extend(self._candidate(row, chosen, demand, live) for row in members)
                if before // BUILD_STEP != len(eager) // BUILD_STEP:
                    yield
            elif best >= cfg.threshold:
                later.append((best, members))  # nothing to review: built only if the tick gets to it
        if not later:
            return eager, None
        later.sort(key=lambda entry: -entry[0])

        def build(lo: int, hi: int) -> list[Candidate]:
            return [self._candidate(row, chosen, demand, live) for _, members in later[lo:hi] for row in members]

        ranked = Ranked(
            prob=np.array([best for best, _ in later], dtype=np.float64),
            need_in_s=np.array([max(chosen[pid][1] for pid, _, _ in m) for _, m in later], dtype=np.float64),
            least_bytes=np.array([min(self._options(chain)[0] * page for _, chain, page in m) for _, m in later],
                                 dtype=np.int64),
            count=np.array([sum(chosen[pid][0] >= cfg.threshold for pid, _, _ in m) for _, m in later], dtype=np.int64),
            build=build,
        )
        return eager, ranked

    def _rows(self, scores: Any, review: Collection[PrefixId], now: float
              ) -> Steps[tuple[Chosen, dict[PrefixId, float], frozenset[str], list[Row]]]:
        """The chosen prefixes, their forecast demand, the live nodes, and a row per prefix with a chain."""
        self.scorer = {}
        chosen = self.chosen(scores, review, now)
        yield
        demand: dict[PrefixId, float] = {}
        if self.plan_cfg.node_rate > 0 and chosen:  # size each replica set from the forecast demand
            pids = list(chosen)
            window = self.predictor.forecast(now, self.plan_cfg.demand_window_s, keys=pids)
            demand = {pid: float(e) for pid, e in zip(pids, window.expected)}  # plan() spreads it along chains
        rows: list[Row] = []
        for pid in chosen:
            chain, page = self.predictor.chain(pid), self._page_bytes(pid[0])
            if chain and page:
                rows.append((pid, tuple(chain), page))
        return chosen, demand, frozenset(self.membership.live_ids()), rows

    def promote(self, chosen: Chosen, rows: list[Row], live: frozenset[str], now: float
                ) -> list[tuple[str, tuple[bytes, ...], str]]:
        """(namespace, keys, node) to read up: of each prefix at the copy threshold whose burst the rate
        forecaster expects on the prefix's own period, or on a period borrowed from the prefixes that recur
        where its bursts were shared (``recurring``: a prompt asked for once is no evidence of a return worth
        a disk read), due within ``PROMOTE_LEAD_S``, the pages each live holder keeps below its pool (those
        past the leading run its pool holds), unless promoted lately."""
        out: list[tuple[str, tuple[bytes, ...], str]] = []
        for k in [k for k, t in self._promoted.items() if now - t >= PROMOTE_AGAIN_S]:
            del self._promoted[k]
        for pid, chain, _ in rows:
            prob, need_in_s, _ = chosen[pid]
            if prob < self.plan_cfg.threshold or need_in_s > PROMOTE_LEAD_S or pid not in self.recurring:
                continue
            namespace = pid[0]
            held = {n: length for n, length in self.directory.prefixes(namespace, chain).items() if n in live}
            if not held:
                continue
            for node, top in self.directory.pool_lengths(namespace, chain, held).items():
                length = held[node]
                done = (namespace, chain[length - 1], node)
                if top < length and done not in self._promoted:
                    self._promoted[done] = now
                    out.append((namespace, chain[top:length], node))
        return out

    def warm(self, live: frozenset[str], now: float) -> list[WarmCopy]:
        """The copies that warm this tick's joiners (:func:`~kvstore.placement.warming.warm_copies`): the
        prefixes the rate forecaster expects at least one request a live node within the horizon."""
        fc = self.predictor.forecast(now, self.pcfg.horizon_s)
        hot = {fc.keys[j]: float(fc.expected[j]) for j in np.flatnonzero(fc.expected >= max(1, len(live)))}
        rows = [(pid, tuple(chain), page) for pid in hot
                if (chain := self.predictor.chain(pid)) and (page := self._page_bytes(pid[0]))]

        def holders(namespace: str, chain: tuple[bytes, ...]) -> dict[str, int]:
            return {n: length for n, length in self.directory.prefixes(namespace, chain).items() if n in live}

        return warm_copies(rows, hot, holders, sorted(self._joiners), self._joiners)

    def _options(self, chain: tuple[bytes, ...]) -> tuple[int, ...]:
        """A prefix's depth options, shallowest first: the tracked depths within its chain, else its own."""
        return tuple(d for d in self.pcfg.depths if d <= len(chain)) or (len(chain),)

    def _candidate(self, row: Row, chosen: Chosen,
                   demand: Mapping[PrefixId, float], live: frozenset[str]) -> Candidate:
        pid, chain, page_bytes = row
        namespace = pid[0]
        prob, need_in_s, scorer = chosen[pid]
        options = self._options(chain)
        for d in options:
            self.scorer[(namespace, chain[d - 1])] = scorer
        holders = self.directory.holders

        def held(d: int) -> frozenset[str]:  # read when plan() gets that far with it (few do): as of then
            return frozenset(holders(namespace, chain[d - 1]) & live)

        return Candidate(namespace=namespace, chain=chain, depth_options=options, holders=LazyHolders(options, held),
                         prob=prob, need_in_s=need_in_s, page_bytes=page_bytes, demand=demand.get(pid, 0.0))


class _ChainNumbers(dict[PrefixId, int]):
    """A placed prefix's chain number: the first 8 bytes of its block 1's key (its own key if untracked),
    worked out once (``__missing__``); later reads are a plain dict lookup, which ``to_review`` makes
    for every placed prefix each tick."""

    def __init__(self, predictor: Any) -> None:
        super().__init__()
        self.predictor = predictor

    def __missing__(self, pid: PrefixId) -> int:
        chain = self.predictor.chain(pid)
        n = self[pid] = int.from_bytes((chain[0] if chain else pid[1])[:8], "little")
        return n


__all__ = ["TickPlanner"]
