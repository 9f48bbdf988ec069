"""Scoring a forecast against what happened (numpy only): ROC-AUC, PR-AUC, precision and recall at a
threshold, the best-F1 threshold, and the gate that keeps the momentum rule when the model scores worse.
The online predictor gates its retrained models with these; the offline evaluation
(:mod:`kvstore.training.evaluate`) reports them.
"""

from __future__ import annotations

import numpy as np


def roc_auc(y: np.ndarray, s: np.ndarray) -> float:
    """ROC-AUC (Mann-Whitney U, ties count one half); NaN without both classes."""
    y = np.asarray(y).astype(bool)
    s = np.asarray(s, dtype=np.float64)
    n_pos = int(y.sum())
    n_neg = y.size - n_pos
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    order = np.argsort(s, kind="mergesort")
    ss = s[order]
    ranks = np.empty(s.size, dtype=np.float64)
    # average ranks over ties
    start = np.flatnonzero(np.r_[True, ss[1:] != ss[:-1]])
    end = np.r_[start[1:], ss.size]
    avg = (start + end + 1) / 2.0  # 1-based average rank of each tie group
    ranks[order] = np.repeat(avg, end - start)
    return float((ranks[y].sum() - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg))


def _pr_points(y: np.ndarray, s: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(precision, recall, threshold) at each distinct score, highest score first."""
    y = np.asarray(y).astype(bool)
    s = np.asarray(s, dtype=np.float64)
    order = np.argsort(-s, kind="mergesort")
    ss, ys = s[order], y[order]
    last = np.r_[np.flatnonzero(ss[1:] != ss[:-1]), ss.size - 1]  # end of each tie group
    tp = np.cumsum(ys)[last].astype(np.float64)
    fp = (last + 1) - tp
    n_pos = max(int(y.sum()), 1)
    return tp / (tp + fp), tp / n_pos, ss[last]


def pr_auc(y: np.ndarray, s: np.ndarray) -> float:
    """Average precision: sum over thresholds of (R_n - R_{n-1}) * P_n; NaN without positives."""
    y = np.asarray(y).astype(bool)
    if y.size == 0 or not y.any():
        return float("nan")
    p, r, _ = _pr_points(y, s)
    return float(np.sum(np.diff(np.r_[0.0, r]) * p))


def pr_curve(y: np.ndarray, s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(precision, recall) points for plotting, highest threshold first."""
    p, r, _ = _pr_points(y, s)
    return p, r


def precision_recall_at(y: np.ndarray, s: np.ndarray, threshold: float) -> tuple[float, float]:
    """Precision and recall of ``s >= threshold`` (precision 0 when nothing is predicted)."""
    y = np.asarray(y).astype(bool)
    pred = np.asarray(s) >= threshold
    tp = int((pred & y).sum())
    n_pred, n_pos = int(pred.sum()), int(y.sum())
    return (tp / n_pred if n_pred else 0.0), (tp / n_pos if n_pos else float("nan"))


def best_f1_threshold(y: np.ndarray, s: np.ndarray, default: float = 0.5) -> float:
    """The score threshold with the best F1 on (y, s) (chosen on validation, applied on test)."""
    y = np.asarray(y).astype(bool)
    if y.size == 0 or not y.any():
        return default
    p, r, thr = _pr_points(y, s)
    f1 = np.where(p + r > 0, 2 * p * r / np.maximum(p + r, 1e-12), 0.0)
    return float(thr[int(np.argmax(f1))])


def metrics(y: np.ndarray, s: np.ndarray, threshold: float, op_threshold: float | None = None) -> dict[str, float]:
    """ROC-AUC, PR-AUC, precision/recall at ``threshold`` (and at ``op_threshold``) in one dict."""
    p, r = precision_recall_at(y, s, threshold)
    out = {"roc_auc": roc_auc(y, s), "pr_auc": pr_auc(y, s), "threshold": float(threshold), "precision": p,
           "recall": r, "rows": int(len(y)), "positives": int(np.sum(y))}
    if op_threshold is not None:
        po, ro = precision_recall_at(y, s, op_threshold)
        out.update({"op_threshold": float(op_threshold), "op_precision": po, "op_recall": ro})
    return out


def gate(model_ap: float, momentum_ap: float, margin: float) -> str:
    """The gated policy's choice on a validation slice: 'lightgbm' unless it is worse by > margin."""
    if np.isnan(model_ap):
        return "momentum"
    if np.isnan(momentum_ap):
        return "lightgbm"
    return "lightgbm" if model_ap >= momentum_ap - margin else "momentum"
