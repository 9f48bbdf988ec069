"""Labels from the future access stream, for snapshot rows.

For a row of prefix ``p`` snapshotted at time ``t0``:

* ``y_reuse``  = ``p`` is requested at least K times in ``(t0, t0 + H]``;
* ``y_remote`` = ``p`` is requested at least K times in ``(t0, t0 + H]`` on a
  node that lacked it when the request arrived (the requests a speculative
  copy made at ``t0`` could have served locally). This is the planner's label.

"Lacked" comes from each :class:`Access`: ``depth > local_blocks`` when the
serving node reported how many leading blocks it held, else
``outcome != LOCAL`` (exact for the deepest tracked prefix, conservative for
shallower ones). Offline the :class:`~kvstore.training.trace.Simulator` fills
``local_blocks`` from its holders model, so the oracle is exact there.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

from kvstore.predict.types import Access, Outcome, PredictorConfig, PrefixId


class EventLog:
    """Time-ordered ``(t, uid, lacked)`` events, one per request and tracked depth.

    ``uid`` is a dense integer per prefix id (its own dict). ``prune`` keeps
    the log bounded online: events older than a cut-off are dropped and the
    dict is rebuilt from the prefixes still referenced.
    """

    def __init__(self, depths: Sequence[int]) -> None:
        self.depths = tuple(sorted(set(int(d) for d in depths)))
        self._uid: dict[PrefixId, int] = {}
        self._t: list[float] = []
        self._u: list[int] = []
        self._lacked: list[int] = []
        self._arrays: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None

    def __len__(self) -> int:
        return len(self._t)

    def append(self, access: Access) -> None:
        """Record one request (one event per tracked depth it reaches)."""
        uid, keys, ns, lb = self._uid, access.keys, access.namespace, access.local_blocks
        miss = int(access.outcome != Outcome.LOCAL)
        for d in self.depths:
            if d > len(keys):
                break
            pid = (ns, keys[d - 1])
            u = uid.get(pid)
            if u is None:
                u = uid[pid] = len(uid)
            self._t.append(access.t)
            self._u.append(u)
            self._lacked.append(int(d > lb) if lb >= 0 else miss)
        self._arrays = None

    def extend(self, accesses: Iterable[Access]) -> "EventLog":
        for a in accesses:
            self.append(a)
        return self

    def uids(self, ids: Sequence[PrefixId], create: bool = False) -> np.ndarray:
        """Dense uids of ``ids``: -1 for a prefix never logged, or a new uid with ``create``.

        Online, a sampled prefix may have no event left after ``prune``; it needs
        a uid all the same so that its future requests are matched.
        """
        if create:
            uid = self._uid
            out = np.empty(len(ids), dtype=np.int64)
            for i, p in enumerate(ids):
                u = uid.get(p)
                if u is None:
                    u = uid[p] = len(uid)
                out[i] = u
            return out
        get = self._uid.get
        return np.fromiter((get(p, -1) for p in ids), dtype=np.int64, count=len(ids))

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(t float64, uid int64, lacked bool) of every logged event, in log order."""
        if self._arrays is None:
            self._arrays = (np.asarray(self._t, dtype=np.float64), np.asarray(self._u, dtype=np.int64),
                            np.asarray(self._lacked, dtype=bool))
        return self._arrays

    def prune(self, before_t: float, keep_uids: np.ndarray | None = None) -> np.ndarray:
        """Drop events older than ``before_t``; renumber uids. Returns the old->new uid map (-1 = gone).

        Prefixes with no event left are forgotten unless listed in ``keep_uids``.
        """
        t, u, lk = self.arrays()
        keep = t >= before_t
        live = np.zeros(len(self._uid), dtype=bool)
        live[u[keep]] = True
        if keep_uids is not None and keep_uids.size:
            live[keep_uids[keep_uids >= 0]] = True
        remap = np.full(len(self._uid), -1, dtype=np.int64)
        remap[live] = np.arange(int(live.sum()))
        rl = remap.tolist()
        self._uid = {p: rl[i] for p, i in self._uid.items() if rl[i] >= 0}
        self._t = t[keep].tolist()
        self._u = remap[u[keep]].tolist()
        self._lacked = lk[keep].astype(int).tolist()
        self._arrays = None
        return remap


def future_counts(sample_t: np.ndarray, sample_uid: np.ndarray, ev_t: np.ndarray, ev_uid: np.ndarray,
                  ev_lacked: np.ndarray, horizon_s: float) -> tuple[np.ndarray, np.ndarray]:
    """Per sample, the number of events of its prefix in ``(t0, t0 + H]`` and how many of them lacked it.

    Vectorised: events are sorted by ``(uid, t)`` and each sample's window is
    found with two ``searchsorted`` calls on a composite key.
    """
    sample_t = np.asarray(sample_t, dtype=np.float64)
    sample_uid = np.asarray(sample_uid, dtype=np.int64)
    n = sample_t.size
    if n == 0 or ev_t.size == 0:
        return np.zeros(n, dtype=np.int64), np.zeros(n, dtype=np.int64)
    t_lo = min(float(ev_t.min()), float(sample_t.min()))
    span = max(float(ev_t.max()), float(sample_t.max()) + horizon_s) - t_lo + 1.0
    order = np.lexsort((ev_t, ev_uid))
    eu, et = ev_uid[order], ev_t[order]
    ekey = eu.astype(np.float64) * span + (et - t_lo)
    cum_lacked = np.concatenate([[0], np.cumsum(ev_lacked[order].astype(np.int64))])
    su = np.maximum(sample_uid, 0).astype(np.float64) * span
    lo = np.searchsorted(ekey, su + (sample_t - t_lo), side="right")
    hi = np.searchsorted(ekey, su + ((sample_t + horizon_s) - t_lo), side="right")
    unknown = sample_uid < 0
    cnt = np.where(unknown, 0, hi - lo)
    lacked = np.where(unknown, 0, cum_lacked[hi] - cum_lacked[lo])
    return cnt, lacked


def make_labels(sample_t: np.ndarray, sample_ids: Sequence[PrefixId] | np.ndarray, log: EventLog,
                cfg: PredictorConfig) -> tuple[np.ndarray, np.ndarray]:
    """(y_reuse, y_remote) as uint8 for samples ``(t0, prefix id)`` (ids or uids from ``log``)."""
    uids = sample_ids if isinstance(sample_ids, np.ndarray) else log.uids(sample_ids)
    t, u, lk = log.arrays()
    cnt, lacked = future_counts(sample_t, uids, t, u, lk, cfg.horizon_s)
    k = max(int(cfg.min_future), 1)
    return (cnt >= k).astype(np.uint8), (lacked >= k).astype(np.uint8)


def labels_for(accesses: Sequence[Access], sample_t: np.ndarray, sample_ids: Sequence[PrefixId],
               cfg: PredictorConfig) -> tuple[np.ndarray, np.ndarray]:
    """Convenience: labels of samples from a whole time-ordered access list."""
    return make_labels(np.asarray(sample_t, dtype=np.float64), sample_ids,
                       EventLog(cfg.depths).extend(accesses), cfg)
