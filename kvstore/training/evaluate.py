"""Offline evaluation: dataset building and a time-ordered split.

``build_dataset`` replays a trace through the :class:`Simulator` and the
:class:`FeatureStore` in lockstep (so the holders feature is the directory's
answer at that moment), snapshots the tracked prefixes seen within
``active_within_s`` every ``sample_every_s`` seconds of trace time (at most
``max_rows`` per snapshot, a random subset), and labels the rows from the
future stream. ``evaluate`` splits the rows by time into train / validation /
test (dropping rows whose label window crosses into the next part, and the
censored tail), trains LightGBM, and reports the raw model, the momentum rule
and the gated policy (the model unless the validation slice shows it worse
than momentum by more than ``gate_margin``) on the test part.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from kvstore.predict.evaluate import best_f1_threshold, gate, metrics, pr_curve
from kvstore.predict.features import FeatureStore, momentum_prob
from kvstore.predict.labels import EventLog, make_labels
from kvstore.predict.model import BurstModel
from kvstore.predict.types import PredictorConfig
from kvstore.training.trace import Simulator
from kvstore.workloads.traces import Request


@dataclass
class Dataset:
    """Time-ordered labelled snapshot rows."""

    X: np.ndarray                  # [n, F] float32
    y_reuse: np.ndarray            # [n] uint8
    y_remote: np.ndarray           # [n] uint8
    t: np.ndarray                  # [n] snapshot time (s)
    depth: np.ndarray              # [n] int
    names: tuple[str, ...]
    t_end: float                   # last request time of the trace
    meta: dict[str, Any] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.t)

    def label(self, which: str) -> np.ndarray:
        return self.y_remote if which == "remote" else self.y_reuse

    def take(self, idx: np.ndarray) -> "Dataset":
        return replace(self, X=self.X[idx], y_reuse=self.y_reuse[idx], y_remote=self.y_remote[idx],
                       t=self.t[idx], depth=self.depth[idx])

    @property
    def momentum(self) -> np.ndarray:
        return self.X[:, self.names.index("momentum")]


def build_dataset(requests: Sequence[Request], cfg: PredictorConfig, nodes: int = 4, router: str = "round_robin",
                  capacity_blocks: int = 16384, sample_every_s: float = 30.0, max_rows: int = 2000, seed: int = 0,
                  progress: Callable[[int], None] | None = None) -> Dataset:
    """Replay ``requests`` (sorted by time) and return labelled snapshot rows (see module doc)."""
    sim = Simulator(nodes=nodes, router=router, capacity_blocks=capacity_blocks, depths=cfg.depths, seed=seed)
    fs = FeatureStore(cfg, sim.holders_count)
    log = EventLog(cfg.depths)
    rng = np.random.default_rng(seed)
    xs: list[np.ndarray] = []
    ts: list[np.ndarray] = []
    ds: list[np.ndarray] = []
    uids: list[np.ndarray] = []
    next_snap = (requests[0].t if requests else 0.0) + sample_every_s

    def snap(now: float) -> None:
        ids, depths, X = fs.snapshot(now, active_within_s=cfg.active_within_s)
        if len(ids) == 0:
            return
        idx = np.arange(len(ids))
        if len(ids) > max_rows:
            idx = np.sort(rng.choice(len(ids), size=max_rows, replace=False))
        xs.append(X[idx])
        ts.append(np.full(idx.size, now))
        ds.append(depths[idx])
        uids.append(log.uids([ids[i] for i in idx.tolist()]))

    for i, req in enumerate(requests):
        while req.t > next_snap:  # snapshot sees every request with t <= now, labels use t > now
            snap(next_snap)
            next_snap += sample_every_s
        a = sim.step(req)
        fs.observe(a)
        log.append(a)
        if progress is not None and i % 1000 == 999:
            progress(1000)
    t_end = requests[-1].t if requests else 0.0
    snap(next_snap)
    F = len(fs.names)
    X = np.concatenate(xs) if xs else np.zeros((0, F), np.float32)
    t = np.concatenate(ts) if ts else np.zeros(0)
    u = np.concatenate(uids) if uids else np.zeros(0, np.int64)
    y_reuse, y_remote = make_labels(t, u, log, cfg)
    return Dataset(X, y_reuse, y_remote, t, np.concatenate(ds) if ds else np.zeros(0, np.int32),
                   fs.names, t_end, {"requests": len(requests), "nodes": nodes, "router": router,
                                     "capacity_blocks": capacity_blocks, "sample_every_s": sample_every_s,
                                     "max_rows": max_rows})


def time_split(ds: Dataset, horizon_s: float, fractions: tuple[float, float] = (0.6, 0.2)
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Indices of train / validation / test by snapshot time.

    Boundaries at ``fractions`` of the labelled time span; rows whose label
    window ``(t, t + H]`` crosses a boundary are dropped (no label leakage),
    as are rows in the last ``H`` seconds (censored labels). Where that leaves
    a part without rows (a trace shorter than about six ``H``), the fractions
    apply instead to the labelled span less the two gaps of ``H`` the purge
    needs, so each part gets its share of the time that can be used.
    """
    t0 = float(ds.t.min()) if len(ds) else 0.0
    t_last = ds.t_end - horizon_s
    parts = _split(ds.t, t0, t_last, horizon_s, fractions, t_last - t0)
    if len(ds) and not all(p.size for p in parts):
        usable = t_last - t0 - 2 * horizon_s
        if usable > 0:
            short = _split(ds.t, t0, t_last, horizon_s, fractions, usable, gap=horizon_s)
            if all(p.size for p in short):
                return short
    return parts


def _split(t: np.ndarray, t0: float, t_last: float, horizon_s: float, fractions: tuple[float, float],
           span: float, gap: float = 0.0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    b1 = t0 + fractions[0] * span + gap
    b2 = b1 + fractions[1] * span + gap
    train = np.flatnonzero(t + horizon_s <= b1)
    valid = np.flatnonzero((t > b1) & (t + horizon_s <= b2))
    test = np.flatnonzero((t > b2) & (t <= t_last))
    return train, valid, test


def evaluate(ds: Dataset, cfg: PredictorConfig, label: str = "remote", num_threads: int = 1, seed: int = 0,
             fractions: tuple[float, float] = (0.6, 0.2)) -> dict[str, Any]:
    """Train on the early part, gate on validation, report raw model / momentum / gated on the test part."""
    tr, va, te = time_split(ds, cfg.horizon_s, fractions)
    y = ds.label(label)
    mom = momentum_prob(ds.momentum, cfg.momentum_min)
    out: dict[str, Any] = {"label": label, "split": {"train": int(tr.size), "valid": int(va.size),
                                                     "test": int(te.size)}}
    if tr.size == 0 or te.size == 0 or y[tr].min() == y[tr].max():
        out["error"] = "not enough labelled rows (or a single class) to train"
        return out
    model = BurstModel(ds.names, num_threads=num_threads, seed=seed)
    model.train(ds.X[tr], y[tr], valid=(ds.X[va], y[va]) if va.size else None, label=label)
    p_va = model.predict(ds.X[va]) if va.size else np.zeros(0, np.float32)
    p_te = model.predict(ds.X[te])
    val_model = metrics(y[va], p_va, cfg.threshold)
    val_mom = metrics(y[va], mom[va], cfg.threshold)
    choice = gate(val_model["pr_auc"], val_mom["pr_auc"], cfg.gate_margin)
    thr_model = best_f1_threshold(y[va], p_va, cfg.threshold)
    thr_mom = best_f1_threshold(y[va], mom[va], cfg.threshold)
    gated, thr_gated = (p_te, thr_model) if choice == "lightgbm" else (mom[te], thr_mom)
    out.update({
        "lightgbm": metrics(y[te], p_te, cfg.threshold, thr_model),
        "momentum": metrics(y[te], mom[te], cfg.threshold, thr_mom),
        "gated": {**metrics(y[te], gated, cfg.threshold, thr_gated), "choice": choice},
        "valid": {"lightgbm": val_model, "momentum": val_mom},
        "best_iteration": model.meta.get("best_iteration"),
        "importance": dict(sorted(model.feature_importance().items(), key=lambda kv: -kv[1])[:10]),
        "curves": {"lightgbm": pr_curve(y[te], p_te), "momentum": pr_curve(y[te], mom[te])},
    })
    out["model"] = model
    return out


def markdown_table(results: Sequence[tuple[str, dict[str, Any]]]) -> str:
    """A Markdown table: one row per (trace, label, policy) with ROC-AUC, PR-AUC and P/R at the
    planner's threshold (0.5 by default) and at thr* (best F1 on the validation part)."""
    lines = ["| trace | label | policy | ROC-AUC | PR-AUC | P@0.5 | R@0.5 | thr* | P@thr* | R@thr* | test rows (pos) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in results:
        if "error" in r:
            lines.append(f"| {name} | {r['label']} | - | - | - | - | - | - | - | - | {r['error']} |")
            continue
        for pol in ("lightgbm", "momentum", "gated"):
            m = r[pol]
            tag = f"gated ({m['choice']})" if pol == "gated" else pol
            lines.append(f"| {name} | {r['label']} | {tag} | {m['roc_auc']:.3f} | {m['pr_auc']:.3f} | "
                         f"{m['precision']:.3f} | {m['recall']:.3f} | {m['op_threshold']:.3f} | "
                         f"{m['op_precision']:.3f} | {m['op_recall']:.3f} | {m['rows']} ({m['positives']}) |")
    return "\n".join(lines)


def jsonable(r: dict[str, Any]) -> dict[str, Any]:
    """The result dict without the model object and the curves (for JSON files)."""
    return {k: v for k, v in r.items() if k not in ("model", "curves")}
