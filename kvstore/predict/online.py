"""The coordinator's predictor: features, scores, a self-labelled log, retraining, fallback.

Threading: ``observe``, ``score``, ``maybe_retrain`` and ``stats`` run on the
event-loop thread. ``score_async`` copies the rows it scores out of the
feature store on it (``FeatureStore.take``) and computes their features and
the model's probabilities in a worker thread. LightGBM training runs in a
worker thread too, on arrays copied out of the labelled log; the finished
model is installed by one reference assignment (a frozen :class:`_Slot`), so
scoring never waits.

Labels online: every ``log_every_s`` seconds, ``score`` records a random
subset of the scored rows (features, the model's and momentum's
probabilities). ``H`` seconds later the rows are labelled from the requests
observed meanwhile (:class:`~kvstore.predict.labels.EventLog`) and join the
labelled log, which feeds both retraining and the online evaluation.

Fallback: momentum scores when no model is loaded, and while the model's
PR-AUC on the most recent labelled rows (scored by the current model) is
below momentum's minus ``gate_margin``; until enough such rows exist, the
comparison made on the retraining's validation slice decides.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kvstore.predict.evaluate import best_f1_threshold, gate, pr_auc, precision_recall_at, roc_auc
from kvstore.predict.features import FeatureStore, HoldersCount, momentum_prob, need_in_s
from kvstore.predict.forecast import Forecast, RateForecaster
from kvstore.predict.labels import EventLog, make_labels
from kvstore.predict.model import BurstModel, ModelError
from kvstore.predict.snapshot import RowsTaken
from kvstore.predict.types import Access, PredictorConfig, PrefixId

log = logging.getLogger(__name__)
_MIN_EVAL_ROWS = 200
_MIN_EVAL_POS = 10
_THREAD_ROWS = 2048  # score_async computes the features and runs inference in a thread from this many rows
_FOLD_BATCH = 512    # queued requests score_async folds into the feature store at a time (~5 ms) ...
_MAX_FOLDS = 16      # ... at most this many times, giving the loop back between (take() folds the rest)


@dataclass
class Scores:
    """One scoring pass: per prefix, P(requested within H on a node lacking it)."""

    ids: list[PrefixId]
    depths: np.ndarray            # int32 blocks
    probs: np.ndarray             # float32
    need_in_s: np.ndarray         # float32 predicted seconds until the next request
    source: str                   # "lightgbm" | "momentum"
    fanout: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))      # distinct recent nodes
    page_bytes: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # bytes per page (0 = unknown)
    rows: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # the feature store's rows, ascending

    def __len__(self) -> int:
        return len(self.ids)


@dataclass(frozen=True)
class _Slot:
    """The installed model with what the gate knows about it (swapped as one reference)."""

    model: BurstModel | None
    version: int
    gate_ok: bool
    valid: dict[str, float]


@dataclass(frozen=True, slots=True)
class _Scored:
    """What a scoring pass computes from the rows taken alone (on any thread)."""

    ids: list[PrefixId]
    X: np.ndarray
    p_model: np.ndarray | None         # the model's raw probabilities (None: no model)
    p_calibrated: np.ndarray | None    # ... mapped to its operating point
    p_mom: np.ndarray
    need_in_s: np.ndarray
    fanout: np.ndarray
    page_bytes: np.ndarray


@dataclass
class _Pending:
    t0: float
    uids: np.ndarray
    X: np.ndarray
    p_model: np.ndarray
    p_mom: np.ndarray
    version: int


class Predictor:
    """Burst predictor of the coordinator (see module doc)."""

    def __init__(self, cfg: PredictorConfig | None = None, model_path: str | Path | None = None,
                 holders_count: HoldersCount | None = None, clock: Callable[[], float] = time.monotonic,
                 seed: int = 0) -> None:
        self.cfg = cfg = cfg or PredictorConfig()
        self.clock = clock
        self.fs = FeatureStore(cfg, holders_count)
        self.forecaster = RateForecaster()  # burst onsets per prefix: forecasts before a burst's first request
        self.names = self.fs.names
        self._mom_col = self.names.index("momentum")
        self._fan_col = self.names.index("fanout")
        self._bytes_col = self.names.index("prefix_bytes")
        self._events = EventLog(cfg.depths)
        self._rng = np.random.default_rng(seed)
        self._slot = _Slot(None, 0, False, {})
        self._base: BurstModel | None = None  # the offline model online retraining starts from
        self.load_error: str | None = None
        if model_path is not None:
            self.load(model_path)
        F = len(self.names)
        n = max(int(cfg.max_log_rows), 1)
        self._X = np.zeros((n, F), np.float32)
        self._y_reuse = np.zeros(n, np.uint8)
        self._y_remote = np.zeros(n, np.uint8)
        self._t = np.zeros(n, np.float64)
        self._p_model = np.full(n, np.nan, np.float32)
        self._p_mom = np.zeros(n, np.float32)
        self._ver = np.zeros(n, np.int32)
        self._n = 0          # rows ever written
        self._pending: list[_Pending] = []
        self._last_log = -np.inf
        self._last_prune = -np.inf
        self._last_train = -np.inf
        self._thread: threading.Thread | None = None
        self._closed = False
        self._online: dict[str, float] = {}
        self._online_ok: bool | None = None
        self.retrains = 0
        self.train_error: str | None = None
        self.single_class = False  # the last retrain window had one class only: the model in place was kept
        self.last_train_s = 0.0
        self.last_score_ms = 0.0
        self.loop_stretches: tuple[float, ...] = ()  # seconds the last score_async held the loop, stretch by stretch
        self.last_source = "momentum"

    # -- model -------------------------------------------------------------
    def load(self, path: str | Path) -> bool:
        """Install a saved model (momentum stays in charge if it cannot be used)."""
        try:
            model = BurstModel.load(path, feature_names=self.names, num_threads=self.cfg.num_threads)
        except ModelError as exc:
            self.load_error = str(exc)
            log.warning("predictor: %s; using momentum", exc)
            return False
        self._base = model
        self.install(model, gate_ok=bool(model.meta.get("gate_ok", True)))
        return True

    def install(self, model: BurstModel, gate_ok: bool = True) -> None:
        """Install a trained model now (one reference swap); the online gate re-evaluates it."""
        self._slot = _Slot(model, self._slot.version + 1, gate_ok, {})
        self._online_ok = None

    @property
    def model(self) -> BurstModel | None:
        return self._slot.model

    @property
    def model_version(self) -> int:
        return self._slot.version

    # -- event-loop side -----------------------------------------------------
    def observe(self, access: Access) -> None:
        """Account one request (features, the label log and the rate forecaster;
        the cluster-wide stream is only forecast offline, by ``forecast_eval``)."""
        self.fs.observe(access)
        self._events.append(access)
        depth = max((d for d in self.cfg.depths if d <= len(access.keys)), default=0)
        if depth:
            self.forecaster.observe((access.namespace, access.keys[depth - 1]), access.t)

    def forecast(self, now: float | None = None, lead_s: float | None = None,
                 keys: Sequence[PrefixId] | None = None) -> Forecast:
        """Per tracked prefix (or ``keys``): will its next burst start within
        ``lead_s`` (default ``forecast_lead_s``)? See forecast.py."""
        now = self.clock() if now is None else float(now)
        return self.forecaster.forecast(now, self.cfg.forecast_lead_s if lead_s is None else lead_s, keys)

    def chain(self, prefix_id: PrefixId) -> tuple[bytes, ...]:
        """Keys of blocks 1..depth of a scored prefix (for the planner)."""
        return self.fs.chain(prefix_id)

    def positions(self, scores: Scores, prefix_ids: Sequence[PrefixId]) -> list[int]:
        """Where each of ``prefix_ids`` is in ``scores`` (-1: not scored), without indexing every id."""
        rows = self.fs.rows_of(prefix_ids)
        at = np.searchsorted(scores.rows, rows).clip(0, max(len(scores.rows) - 1, 0))
        out = []
        for pid, r, i in zip(prefix_ids, rows.tolist(), at.tolist()):
            ok = r >= 0 and len(scores.rows) and int(scores.rows[i]) == r and scores.ids[i] == pid  # a reused row
            out.append(i if ok else -1)
        return out

    def _use_model(self, slot: _Slot) -> bool:
        if slot.model is None:
            return False
        return self._online_ok if self._online_ok is not None else slot.gate_ok

    def score(self, now: float | None = None) -> Scores:
        """Score every prefix seen within ``active_within_s``; log a labelled sample on schedule."""
        t_start = time.perf_counter()
        now = self.clock() if now is None else float(now)
        taken, slot = self.fs.take(now, active_within_s=self.cfg.active_within_s), self._slot
        return self._finish(t_start, now, taken, slot, self._score_rows(taken, slot))

    async def score_async(self, now: float | None = None) -> Scores:
        """:meth:`score` with the features and LightGBM inference in a worker thread.

        On the calling (event loop) thread run only the fold of the queued requests, in batches with
        the loop given back between them, the feature store's copy of the rows it scores
        (``FeatureStore.take``) and the log, before and after the ``await``: the store takes requests
        meanwhile, and the features are computed from the copy alone. ``loop_stretches`` says how long
        each of those held the loop.
        """
        stretches: list[float] = []
        for _ in range(_MAX_FOLDS):  # the queued requests, a batch at a time, the loop given back between
            t0 = time.perf_counter()
            left = self.fs.fold(_FOLD_BATCH)
            stretches.append(time.perf_counter() - t0)
            if not left:
                break
            await asyncio.sleep(0)
        t_start = time.perf_counter()
        now = self.clock() if now is None else float(now)
        taken, slot = self.fs.take(now, active_within_s=self.cfg.active_within_s), self._slot  # one slot read
        t_back = t_start  # the stretch on the loop that ends with the result starts here ...
        if len(taken) >= _THREAD_ROWS:
            stretches.append(time.perf_counter() - t_start)
            scored = await asyncio.to_thread(self._score_rows, taken, slot)
            t_back = time.perf_counter()  # ... or here, when the worker thread did the rest
        else:
            scored = self._score_rows(taken, slot)
        out = self._finish(t_start, now, taken, slot, scored)
        self.loop_stretches = (*stretches, time.perf_counter() - t_back)
        return out

    def _score_rows(self, taken: RowsTaken, slot: _Slot) -> _Scored:
        """The features of ``taken`` and what follows from them alone: thread-safe (it reads ``taken``,
        ``slot`` and settings fixed at construction)."""
        cfg = self.cfg
        X = taken.features()
        p_model = p_cal = None
        if slot.model is not None:
            p_model = slot.model.predict(X)
            calibrate = getattr(slot.model, "calibrate", None)  # models without an operating point: raw
            p_cal = calibrate(p_model) if calibrate is not None else p_model
        return _Scored(taken.ids(), X, p_model, p_cal, momentum_prob(X[:, self._mom_col], cfg.momentum_min),
                       need_in_s(X, cfg, self.names), X[:, self._fan_col].astype(np.int32),
                       (X[:, self._bytes_col] / np.maximum(taken.depth, 1)).astype(np.int64))

    def _finish(self, t_start: float, now: float, taken: RowsTaken, slot: _Slot, scored: _Scored) -> Scores:
        """Choose the scores, log a sample on schedule, label what is due (on the loop)."""
        cfg = self.cfg
        ids = scored.ids
        use = scored.p_calibrated is not None and self._use_model(slot)
        probs = scored.p_calibrated if use and scored.p_calibrated is not None else scored.p_mom
        source = "lightgbm" if use else "momentum"
        if now - self._last_log >= cfg.log_every_s and len(ids):
            self._last_log = now
            self._record(now, ids, scored.X, scored.p_model, scored.p_mom, slot.version)
        self._resolve(now)
        self.last_source = source
        out = Scores(ids, taken.depth, probs.astype(np.float32, copy=False), scored.need_in_s, source,
                     scored.fanout, scored.page_bytes, taken.rows)
        self.last_score_ms = (time.perf_counter() - t_start) * 1e3
        return out

    def _record(self, now: float, ids: list[PrefixId], X: np.ndarray, p_model: np.ndarray | None,
                p_mom: np.ndarray, version: int) -> None:
        n = len(ids)
        idx = np.arange(n)
        if n > self.cfg.log_rows:
            idx = np.sort(self._rng.choice(n, size=self.cfg.log_rows, replace=False))
        uids = self._events.uids([ids[i] for i in idx.tolist()], create=True)
        pm = p_model[idx] if p_model is not None else np.full(idx.size, np.nan, np.float32)
        self._pending.append(_Pending(now, uids, X[idx].copy(), pm, p_mom[idx], version))

    def _resolve(self, now: float) -> None:
        """Label the pending samples whose horizon has passed; refresh the online evaluation."""
        H = self.cfg.horizon_s
        done = [p for p in self._pending if p.t0 + H <= now]
        if not done:
            return
        self._pending = [p for p in self._pending if p.t0 + H > now]
        for p in done:
            y_reuse, y_remote = make_labels(np.full(p.uids.size, p.t0), p.uids, self._events, self.cfg)
            self._append(p, y_reuse, y_remote)
        # forget events no pending sample can need any more
        if now - self._last_prune >= H:
            self._last_prune = now
            oldest = min((p.t0 for p in self._pending), default=now)
            keep = np.concatenate([p.uids for p in self._pending]) if self._pending else None
            remap = self._events.prune(oldest, keep)
            for p in self._pending:
                p.uids = np.where(p.uids >= 0, remap[np.maximum(p.uids, 0)], -1)
        self._evaluate_online()

    def _append(self, p: _Pending, y_reuse: np.ndarray, y_remote: np.ndarray) -> None:
        N = self._X.shape[0]
        for j in range(0, p.uids.size, N):
            k = min(p.uids.size - j, N)
            pos = (self._n + np.arange(k)) % N
            self._X[pos] = p.X[j:j + k]
            self._y_reuse[pos] = y_reuse[j:j + k]
            self._y_remote[pos] = y_remote[j:j + k]
            self._t[pos] = p.t0
            self._p_model[pos] = p.p_model[j:j + k]
            self._p_mom[pos] = p.p_mom[j:j + k]
            self._ver[pos] = p.version
            self._n += k

    def _ordered(self, last: int | None = None) -> np.ndarray:
        """Positions of the labelled rows in time order (the most recent ``last`` of them)."""
        N = self._X.shape[0]
        n = min(self._n, N)
        if last is not None:
            n = min(n, last)
        return (self._n - n + np.arange(n)) % N

    def _evaluate_online(self) -> None:
        slot = self._slot
        pos = self._ordered(self.cfg.eval_rows)
        pos = pos[(self._ver[pos] == slot.version) & ~np.isnan(self._p_model[pos])]
        y = self._y_remote[pos]
        if slot.model is None or pos.size < _MIN_EVAL_ROWS or int(y.sum()) < _MIN_EVAL_POS or y.all():
            self._online_ok = None
            self._online = {"rows": int(pos.size), "positives": int(y.sum())}
            return
        pm, pb = self._p_model[pos], self._p_mom[pos]
        ap_m, ap_b = pr_auc(y, pm), pr_auc(y, pb)
        (pr_m, rc_m), (pr_b, rc_b) = precision_recall_at(y, pm, self.cfg.threshold), \
            precision_recall_at(y, pb, self.cfg.threshold)
        self._online = {"rows": int(pos.size), "positives": int(y.sum()), "pr_auc_model": ap_m,
                        "pr_auc_momentum": ap_b, "roc_auc_model": roc_auc(y, pm), "roc_auc_momentum": roc_auc(y, pb),
                        "precision_model": pr_m, "recall_model": rc_m, "precision_momentum": pr_b,
                        "recall_momentum": rc_b}
        self._online_ok = gate(ap_m, ap_b, self.cfg.gate_margin) == "lightgbm"

    # -- retraining ----------------------------------------------------------
    @property
    def labelled_rows(self) -> int:
        return min(self._n, self._X.shape[0])

    @property
    def training(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def maybe_retrain(self, now: float | None = None, force: bool = False) -> bool:
        """Start a background retrain when due (every ``retrain_every_s``, >= ``min_train_rows``).

        A window whose training rows are all of one class (a quiet cluster where no prefix came back, or
        one where every one did) has nothing to learn from: the model in place stays, the predictor says
        so once (again only after a window with both classes) and tries the next window when due."""
        now = self.clock() if now is None else float(now)
        if self.training or self._closed:
            return False
        if not force and now - self._last_train < self.cfg.retrain_every_s:
            return False
        if self.labelled_rows < self.cfg.min_train_rows:
            return False
        self._last_train = now
        pos = self._ordered()
        n_va = max(pos.size // 5, 1)
        tr, va = pos[:-n_va], pos[-n_va:]
        t_cut = self._t[va[0]]
        purged = tr[self._t[tr] + self.cfg.horizon_s <= t_cut]  # no label window reaches validation
        if purged.size >= pos.size // 2:
            tr = purged
        y = self._y_remote[tr]
        if not y.size or y.min() == y.max():
            if not self.single_class:
                kept = "current model" if self._slot.model is not None else "momentum rule"
                log.warning("predictor retrain skipped: the %d labelled rows of its window have a single class; "
                            "keeping the %s", y.size, kept)
            self.single_class = True
            return False
        self.single_class = False
        age = self._t[tr] - self._t[pos[-1]]
        weight = np.exp(age / self.cfg.recency_tau_s) if self.cfg.recency_tau_s > 0 else np.ones(tr.size)
        job = (self._X[tr].copy(), self._y_remote[tr].copy(), self._X[va].copy(), self._y_remote[va].copy(),
               self._p_mom[va].copy(), weight)
        self._thread = threading.Thread(target=self._train_job, args=job, name="kvstore-predictor-retrain",
                                        daemon=True)
        self._thread.start()
        return True

    def _train_job(self, X: np.ndarray, y: np.ndarray, Xv: np.ndarray, yv: np.ndarray, mom_v: np.ndarray,
                   weight: np.ndarray | None = None) -> None:
        """Worker thread: train on copies, compare with momentum on validation, swap the slot.

        With an offline model loaded, training continues from it (its trees
        plus up to 100 new ones fit to the recent, recency-weighted rows), so
        a retrain adapts the shipped model to this cluster instead of
        starting from scratch on a few thousand rows.
        """
        t0 = time.perf_counter()
        try:
            if y.min() == y.max():
                raise ValueError("labelled log has a single class")
            base = self._base
            model = BurstModel(self.names, num_threads=self.cfg.num_threads,
                               num_boost_round=100 if base is not None else 300)
            model.train(X, y, valid=(Xv, yv), weight=weight, init_model=base)
            pv = model.predict(Xv)
            model.operating_threshold = best_f1_threshold(yv, pv)
            ap_m, ap_b = pr_auc(yv, pv), pr_auc(yv, mom_v)
            ok = gate(ap_m, ap_b, self.cfg.gate_margin) == "lightgbm"
            self._slot = _Slot(model, self._slot.version + 1, ok, {"pr_auc_model": ap_m, "pr_auc_momentum": ap_b,
                                                                  "rows": int(len(y))})
            self._online_ok = None  # the online evaluation restarts with the new model's scores
            self.retrains += 1
            self.train_error = None
        except Exception as exc:  # a failed retrain must never take the coordinator down
            self.train_error = f"{type(exc).__name__}: {exc}"
            log.warning("predictor retrain failed: %s", self.train_error)
        finally:
            self.last_train_s = time.perf_counter() - t0

    def close(self, timeout: float = 0.0) -> None:
        """Start no more retrains; wait up to ``timeout`` s for a running one (it is a daemon thread)."""
        self._closed = True
        self.wait_retrain(timeout)

    def wait_retrain(self, timeout: float | None = None) -> bool:
        """Join a running retrain; True when none is running afterwards."""
        th = self._thread
        if th is not None:
            th.join(timeout)
        return not self.training

    def stats(self) -> dict[str, Any]:
        """Counters and gauges for metrics and logs."""
        slot = self._slot
        return {
            "source": self.last_source, "model_version": slot.version, "model_loaded": slot.model is not None,
            "gate_ok_valid": slot.gate_ok, "gate_ok_online": self._online_ok, "valid": dict(slot.valid),
            "online": dict(self._online), "tracked_prefixes": len(self.fs), "labelled_rows": self.labelled_rows,
            "pending_samples": len(self._pending), "events_logged": len(self._events), "training": self.training,
            "retrains": self.retrains, "last_train_s": self.last_train_s, "train_error": self.train_error,
            "single_class": self.single_class,
            "load_error": self.load_error, "last_score_ms": self.last_score_ms,
            "base_model": self._base is not None,
            "dropped_idle": self.fs.dropped_idle, "dropped_full": self.fs.dropped_full,
        }
