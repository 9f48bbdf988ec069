"""Causal per-prefix features from the access stream, in bounded memory.

:class:`FeatureStore` keeps one row per tracked prefix (``PrefixId`` -> row)
in struct-of-arrays numpy state. ``observe`` only queues the access (and asks
``holders_count`` for each tracked depth, since that answer changes with
time); the queue is folded into the arrays in one vectorised pass when it
fills up or when anything reads the state (``snapshot``, ``chain``,
``momentum_scores``). Windowed counts are decayed counters (value at the
last update + that time, decayed lazily), inter-arrival statistics are sums
that add up across a batch, fan-out is a two-epoch node bitmask, and the
exact "seen in the last W seconds" count comes from a small ring of the last
sighting times. Memory is bounded: rows idle longer than ``idle_drop_s`` are
dropped, and beyond ``max_prefixes`` the stalest rows are dropped first.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np

from kvstore.predict.snapshot import RowsTaken, feature_names, momentum_seen, windows
from kvstore.predict.types import Access, Outcome, PredictorConfig, PrefixId

HoldersCount = Callable[[str, bytes], int]
_NO_EPOCH = -(1 << 40)
_FLUSH_AT = 4096  # queued accesses that trigger a fold into the arrays


FEATURE_NAMES: tuple[str, ...] = feature_names(PredictorConfig())


def momentum_prob(score: np.ndarray, m: int) -> np.ndarray:
    """Squash a momentum score into [0, 1): monotone, and >= 0.5 exactly when the rule fires.

    The score is ``count in the last W seconds + 0.5 * recency`` (recency in
    [0, 1]), so the rule "count >= m" is ``score >= m``; ``s / (s + m - 0.25)``
    crosses 0.5 between ``m - 0.5`` and ``m``.
    """
    s = np.asarray(score, dtype=np.float32)
    return (s / (s + np.float32(m - 0.25))).astype(np.float32)


def need_in_s(X: np.ndarray, cfg: PredictorConfig, names: Sequence[str] = FEATURE_NAMES) -> np.ndarray:
    """Predicted seconds until a prefix's next request, from its inter-arrival stats.

    Expected next arrival is ``last + mean non-zero gap``; when that is already
    past, a quarter of the mean gap (the request is overdue); unknown gaps
    give the horizon. Floored at ``need_in_floor_s`` (timestamps are batched).
    """
    gap = X[:, names.index("gap_nz_mean_s")].astype(np.float64)
    since = X[:, names.index("since_last_s")].astype(np.float64)
    out = np.where(np.isnan(gap), cfg.horizon_s, np.maximum(gap - since, 0.25 * np.nan_to_num(gap)))
    return np.clip(out, cfg.need_in_floor_s, cfg.horizon_s).astype(np.float32)


class FeatureStore:
    """Per-prefix causal features over a bounded set of tracked prefixes."""

    _ROW_FIELDS: dict[str, tuple[type, float]] = {
        "alive": (np.bool_, 0), "depth": (np.int32, 0), "uid": (np.int64, -1), "first_t": (np.float64, np.nan),
        "last_t": (np.float64, -np.inf), "count": (np.float64, 0), "n_nz": (np.float64, 0),
        "sum_gap2": (np.float64, 0), "last_gap": (np.float64, np.nan), "mask_cur": (np.uint64, 0),
        "mask_prev": (np.uint64, 0), "mask_ep": (np.int64, _NO_EPOCH), "mask_all": (np.uint64, 0),
        "holders": (np.float32, 0), "outcome": (np.int8, int(Outcome.MISS)), "lacked": (np.int8, 0),
        "req_blocks": (np.int32, 0), "block_tokens": (np.int64, 0), "page_bytes": (np.int64, 0),
        "parent_row": (np.int64, -1), "parent_uid": (np.int64, -1),
    }

    def __init__(self, cfg: PredictorConfig | None = None, holders_count: HoldersCount | None = None,
                 capacity: int = 1024) -> None:
        self.cfg = cfg = cfg or PredictorConfig()
        self.holders_count = holders_count
        self.names = feature_names(cfg)
        self.depths = tuple(sorted(set(int(d) for d in cfg.depths)))
        self._win = windows(cfg)
        self._mom_col = len(cfg.windows_s)
        self._ring_n = max(int(cfg.momentum_min), 3)
        self._cap = 0
        self._hi = 0                               # rows [0, hi) have been used
        self._free: list[int] = []
        self._index: dict[PrefixId, int] = {}
        self.snapshot_rows = np.zeros(0, dtype=np.int64)  # the rows of the last snapshot(), ascending
        self._chains: list[tuple[bytes, ...] | None] = []
        self._ids = np.empty(0, dtype=object)
        self._next_uid = 0
        self._grow(max(16, capacity))
        self._nodes: dict[str, int] = {}
        self._g_dec = np.zeros(len(self._win))     # cluster request counters (decayed)
        self._g_t = -math.inf
        self._t_max = -math.inf
        self._last_maint = -math.inf
        self._pending: list[Access] = []
        self._pending_h: list[tuple[int, ...]] = []
        self.dropped_idle = 0
        self.dropped_full = 0

    # -- storage -----------------------------------------------------------
    def _grow(self, cap: int) -> None:
        for name, (dt, init) in self._ROW_FIELDS.items():
            a = np.full(cap, init, dtype=dt)
            if self._cap:
                a[: self._cap] = getattr(self, "_" + name)
            setattr(self, "_" + name, a)
        for name, width, init in (("dec", len(self._win), 0.0), ("ring", self._ring_n, -np.inf)):
            a = np.full((cap, width), init, dtype=np.float64)
            if self._cap:
                a[: self._cap] = getattr(self, "_" + name)
            setattr(self, "_" + name, a)
        ids = np.empty(cap, dtype=object)
        ids[: self._cap] = self._ids
        self._ids = ids
        self._chains.extend([None] * (cap - self._cap))
        self._cap = cap

    def _reset(self, rows: np.ndarray) -> None:
        for name, (_, init) in self._ROW_FIELDS.items():
            getattr(self, "_" + name)[rows] = init
        self._dec[rows] = 0.0
        self._ring[rows] = -np.inf

    def _free_rows(self, rows: np.ndarray) -> None:
        """Forget ``rows`` (the only per-row Python here; each row is freed once)."""
        index, ids, chains = self._index, self._ids, self._chains
        for r in rows.tolist():
            del index[ids[r]]
            ids[r] = None
            chains[r] = None
        self._alive[rows] = False
        self._free.extend(rows.tolist())

    def _maintain(self, now: float) -> None:
        """Drop rows idle longer than ``idle_drop_s``, and the stalest rows beyond ``max_prefixes``."""
        cfg = self.cfg
        if now - self._last_maint >= cfg.idle_drop_s / 16:
            self._last_maint = now
            hi = self._hi
            idle = np.flatnonzero(self._alive[:hi] & (self._last_t[:hi] < now - cfg.idle_drop_s))
            if idle.size:
                self.dropped_idle += int(idle.size)
                self._free_rows(idle)
        excess = len(self._index) - cfg.max_prefixes
        if excess > 0:  # evict a little more than needed, so this runs once per many flushes
            alive = np.flatnonzero(self._alive[: self._hi])
            k = min(alive.size, excess + cfg.max_prefixes // 32)
            stalest = alive[np.argpartition(self._last_t[alive], k - 1)[:k]] if k < alive.size else alive
            self.dropped_full += int(stalest.size)
            self._free_rows(stalest)

    def __len__(self) -> int:
        self._flush()
        return len(self._index)

    @property
    def nbytes(self) -> int:
        """Bytes held by the numpy row state (excluding the dict and key objects)."""
        return sum(getattr(self, "_" + n).nbytes for n in (*self._ROW_FIELDS, "dec", "ring", "ids"))

    def node_bit(self, node: str) -> int:
        """The fan-out bitmask bit of ``node`` (nodes beyond 64 share bits)."""
        b = self._nodes.get(node)
        if b is None:
            b = self._nodes[node] = len(self._nodes)
        return b & 63

    # -- updates -----------------------------------------------------------
    def observe(self, access: Access) -> None:
        """Queue one request; O(depths) work now, the rest in the next vectorised fold."""
        self._pending.append(access)
        hc = self.holders_count
        if hc is not None:
            ns, keys = access.namespace, access.keys
            self._pending_h.append(tuple(hc(ns, keys[d - 1]) for d in self.depths if d <= len(keys)))
        if len(self._pending) >= _FLUSH_AT:
            self._flush()

    def fold(self, limit: int) -> int:
        """Fold the first ``limit`` queued requests into the arrays; how many are still queued.

        Any read folds every queued request first, in one pass; a caller on the event loop folds in
        batches of ``limit`` before it reads, giving the loop back between them (the coordinator, before
        a snapshot: a second's requests take tens of milliseconds to fold). Folding in batches is
        folding at once (tested)."""
        self._flush(limit)
        return len(self._pending)

    def _flush(self, limit: int | None = None) -> None:
        acc = self._pending
        if not acc:
            return
        held = self._pending_h
        if limit is not None and limit < len(acc):
            acc, self._pending = acc[:limit], acc[limit:]
            held, self._pending_h = held[:limit], held[limit:]
        else:
            self._pending, self._pending_h = [], []
        t_acc = np.array([a.t for a in acc], dtype=np.float64)
        t_acc = np.maximum.accumulate(np.maximum(t_acc, self._t_max))  # clamp late arrivals
        self._t_max = float(t_acc[-1])
        new_max = len(acc) * len(self.depths)
        if self._cap - self._hi + len(self._free) < new_max:  # grow once, before the loop
            cap = self._cap
            while cap - self._hi + len(self._free) < new_max:
                cap *= 2
            self._grow(cap)
        index, free, ids, chains, depths = self._index, self._free, self._ids, self._chains, self.depths
        rows: list[int] = []
        ev_acc: list[int] = []
        parents: list[int] = []
        lacked: list[int] = []
        new_rows: list[int] = []
        bits: list[int] = []
        per_acc: list[tuple[int, int, int, int]] = []
        has_h = len(held) == len(acc)
        holders: list[int] = []
        for i, a in enumerate(acc):
            keys, ns = a.keys, a.namespace
            bits.append(self.node_bit(a.node))
            per_acc.append((int(a.outcome), a.total_blocks or len(keys), a.block_tokens, a.page_bytes))
            lb = a.local_blocks
            miss = int(a.outcome != Outcome.LOCAL)
            if has_h:
                holders.extend(held[i])
            parent = -1
            for d in depths:
                if d > len(keys):
                    break
                pid = (ns, keys[d - 1])
                r = index.get(pid)
                if r is None:
                    if free:
                        r = free.pop()
                    else:
                        r = self._hi
                        self._hi += 1
                    index[pid] = r
                    ids[r] = pid
                    new_rows.append(r)
                    new_rows.append(d)
                chains[r] = keys
                rows.append(r)
                ev_acc.append(i)
                parents.append(parent)
                lacked.append(int(d > lb) if lb >= 0 else miss)
                parent = r
        if new_rows:
            nr = np.array(new_rows[0::2], dtype=np.int64)
            self._reset(nr)
            self._alive[nr] = True
            self._depth[nr] = new_rows[1::2]
            self._uid[nr] = np.arange(self._next_uid, self._next_uid + nr.size)
            self._next_uid += nr.size
        ev = np.array(ev_acc, dtype=np.int64)
        self._fold(t_acc, np.array(per_acc, dtype=np.int64).reshape(-1, 4), np.array(rows, dtype=np.int64), ev,
                   np.array(parents, dtype=np.int64), np.array(lacked, dtype=np.int8),
                   np.array(bits, dtype=np.uint64)[ev],
                   np.array(holders, dtype=np.float32) if has_h else None)
        self._maintain(self._t_max)

    def _fold(self, t_acc: np.ndarray, per_acc: np.ndarray, rows: np.ndarray, ev_acc: np.ndarray,
              parents: np.ndarray, lacked: np.ndarray, bits: np.ndarray, holders: np.ndarray | None) -> None:
        """Vectorised update of every touched row from a time-ordered batch of events."""
        win = self._win
        # cluster-wide request counters
        t_end = t_acc[-1]
        self._g_dec = self._g_dec * np.exp(-(t_end - self._g_t) / win) \
            + np.exp(-(t_end - t_acc[:, None]) / win[None, :]).sum(axis=0)
        self._g_t = t_end
        if rows.size == 0:
            return
        order = np.argsort(rows, kind="stable")       # by row, then time
        rs, ts = rows[order], t_acc[ev_acc[order]]
        start = np.ones(rs.size, dtype=bool)
        start[1:] = rs[1:] != rs[:-1]
        starts = np.flatnonzero(start)
        lasts = np.append(starts[1:], rs.size) - 1
        gsize = lasts - starts + 1
        gid = np.cumsum(start) - 1
        ur = rs[starts]
        t_last = ts[lasts]
        old_last = self._last_t[ur]
        old_count = self._count[ur]
        # gaps: to the previous event of the row (in this batch or before it)
        prev = np.empty_like(ts)
        prev[1:] = ts[:-1]
        prev[starts] = np.where(old_count > 0, old_last, np.nan)
        gap = ts - prev
        valid = ~np.isnan(gap)
        self._n_nz[ur] += np.add.reduceat((gap > 0).astype(np.float64), starts)
        self._sum_gap2[ur] += np.add.reduceat(np.where(valid, gap * gap, 0.0), starts)
        lg = gap[lasts]
        self._last_gap[ur] = np.where(np.isnan(lg), self._last_gap[ur], lg)
        self._first_t[ur] = np.where(old_count > 0, self._first_t[ur], ts[starts])
        self._count[ur] = old_count + gsize
        # decayed counters, evaluated at each row's last event
        age = (t_last[gid] - ts)[:, None]
        add = np.add.reduceat(np.exp(-age / win[None, :]), starts, axis=0)
        keep = np.exp(-np.maximum(t_last - old_last, 0.0)[:, None] / win[None, :])
        self._dec[ur] = self._dec[ur] * keep + add
        # ring of the last sighting times (most recent first)
        k = np.arange(self._ring_n)
        use_new = k[None, :] < gsize[:, None]
        new_t = ts[np.maximum(lasts[:, None] - k[None, :], 0)]
        old_t = self._ring[ur[:, None], np.clip(k[None, :] - gsize[:, None], 0, self._ring_n - 1)]
        self._ring[ur] = np.where(use_new, new_t, old_t)
        # fan-out: node bitmasks of the current and the previous epoch
        ep = np.floor(ts / self.cfg.fanout_window_s).astype(np.int64)
        ep_f = ep[lasts]
        b = np.left_shift(np.uint64(1), bits[order])
        zero = np.uint64(0)
        cur = np.bitwise_or.reduceat(np.where(ep == ep_f[gid], b, zero), starts)
        prv = np.bitwise_or.reduceat(np.where(ep == ep_f[gid] - 1, b, zero), starts)
        old_ep, old_cur, old_prv = self._mask_ep[ur], self._mask_cur[ur], self._mask_prev[ur]
        same = old_ep == ep_f
        self._mask_cur[ur] = cur | np.where(same, old_cur, zero)
        self._mask_prev[ur] = prv | np.where(same, old_prv, zero) | np.where(old_ep == ep_f - 1, old_cur, zero)
        self._mask_ep[ur] = ep_f
        self._mask_all[ur] |= np.bitwise_or.reduceat(b, starts)
        # values of the last event
        last_ev = order[lasts]
        la = ev_acc[last_ev]
        if holders is not None:
            self._holders[ur] = holders[last_ev]
        else:  # no directory: nodes that served it (an upper bound of its holders)
            self._holders[ur] = np.bitwise_count(self._mask_all[ur]).astype(np.float32)
        self._lacked[ur] = lacked[last_ev]
        pa = per_acc[la]
        self._outcome[ur] = pa[:, 0]
        self._req_blocks[ur] = pa[:, 1]
        self._block_tokens[ur] = pa[:, 2]
        self._page_bytes[ur] = pa[:, 3]
        pr = parents[last_ev]
        self._parent_row[ur] = pr
        self._parent_uid[ur] = np.where(pr >= 0, self._uid[np.maximum(pr, 0)], -1)
        self._last_t[ur] = t_last

    # -- reads -------------------------------------------------------------
    def _rows(self, now: float, active_within_s: float | None) -> np.ndarray:
        self._flush()
        self._maintain(now)
        hi = self._hi
        m = self._alive[:hi]
        if active_within_s is not None:
            m = m & (self._last_t[:hi] >= now - active_within_s)
        return np.flatnonzero(m)

    def _momentum(self, rows: np.ndarray, now: float, since: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return momentum_seen(self._ring[rows], now, since, self.cfg.momentum_window_s)

    def momentum_scores(self, now: float, active_within_s: float | None = None
                        ) -> tuple[list[PrefixId], np.ndarray, np.ndarray]:
        """(ids, depths, score): the momentum baseline, vectorised; rule fires at ``score >= m``."""
        rows = self._rows(now, active_within_s)
        since = np.maximum(now - self._last_t[rows], 0.0)
        return self._ids[rows].tolist(), self._depth[rows].copy(), self._momentum(rows, now, since)[1]

    def snapshot(self, now: float, active_within_s: float | None = None
                 ) -> tuple[list[PrefixId], np.ndarray, np.ndarray]:
        """(ids, depths, X[n, F] float32) for every tracked row (seen within ``active_within_s``)."""
        taken = self.take(now, active_within_s)
        return taken.ids(), taken.depth.copy(), taken.features()

    def take(self, now: float, active_within_s: float | None = None) -> RowsTaken:
        """What a snapshot reads of every tracked row (seen within ``active_within_s``), copied out.

        The only part of a snapshot that reads the store, so the only part that must run on the thread
        that owns it (the event loop): :meth:`RowsTaken.features` computes X from the copies alone, on
        any thread, while the store takes more requests."""
        rows = self._rows(now, active_within_s)
        cfg, hi = self.cfg, self._hi

        def at(a: np.ndarray, where: np.ndarray = rows) -> np.ndarray:  # np.take: 4x a[rows] on 2-D rows
            return np.take(a, where, axis=0)

        pr = at(self._parent_row)
        prc = np.maximum(pr, 0)
        all_pr = self._parent_row[:hi]
        act_all = self._alive[:hi] & (self._last_t[:hi] >= now - cfg.momentum_window_s)
        act = act_all & (all_pr >= 0)
        depth = at(self._depth)
        per_depth = np.bincount(self._depth[:hi][act_all], minlength=max(self.depths) + 1)
        self.snapshot_rows = rows
        return RowsTaken(
            cfg=cfg, now=now, rows=rows, id_array=at(self._ids), depth=depth,
            block_tokens=at(self._block_tokens), page_bytes=at(self._page_bytes), req_blocks=at(self._req_blocks),
            last_t=at(self._last_t), first_t=at(self._first_t), count=at(self._count), dec=at(self._dec),
            ring=at(self._ring), sum_gap2=at(self._sum_gap2), n_nz=at(self._n_nz), last_gap=at(self._last_gap),
            mask_ep=at(self._mask_ep), mask_cur=at(self._mask_cur), mask_prev=at(self._mask_prev),
            mask_all=at(self._mask_all), holders=at(self._holders), outcome=at(self._outcome),
            lacked=at(self._lacked), n_nodes=float(len(self._nodes)),
            parent_ok=(pr >= 0) & (at(self._uid, prc) == at(self._parent_uid)) & at(self._alive, prc),
            parent_last_t=at(self._last_t, prc), parent_count=at(self._count, prc),
            parent_dec_mom=self._dec[prc, self._mom_col],
            children=at(np.bincount(all_pr[act], minlength=hi)), active_at_depth=per_depth[depth],
            active=float(act_all.sum()), g_dec=self._g_dec.copy(), g_t=self._g_t,
        )

    def rows_of(self, prefix_ids: Sequence[PrefixId]) -> np.ndarray:
        """The rows of ``prefix_ids`` (-1 where untracked), as :attr:`snapshot_rows` numbers them."""
        self._flush()
        index = self._index
        return np.fromiter((index.get(p, -1) for p in prefix_ids), dtype=np.int64, count=len(prefix_ids))

    def chain(self, prefix_id: PrefixId) -> tuple[bytes, ...]:
        """Keys of blocks 1..depth of a tracked prefix, from its last request (() if untracked)."""
        self._flush()
        r = self._index.get(prefix_id)
        if r is None:
            return ()
        keys = self._chains[r]
        return keys[: int(self._depth[r])] if keys is not None else ()

    def row_uid(self, prefix_id: PrefixId) -> int:
        """A unique id of the prefix's current row (-1 if untracked); changes if it is dropped."""
        self._flush()
        r = self._index.get(prefix_id)
        return -1 if r is None else int(self._uid[r])
