"""Scoring the rate forecaster against naive and seasonal-naive forecasts.

Replayed online over a trace: the forecaster sees every arrival up to each
evaluation time ``t`` (every ``bucket_s`` seconds of the held-out last part of
the trace) and forecasts ``(t, t + horizon_s]``. Two questions, per prefix
(the deepest tracked depth each request reaches) and for the cluster stream:

* **rate**: mean absolute error of the forecast arrivals in the next window
  (per second; the forecaster's median-optimal ``point``), against *naive* (the last window's count) and
  *seasonal-naive* (the count one period ago: the prefix's own last onset
  spacing; for the cluster stream, the strongest autocorrelation lag of the
  warm-up part);
* **burst onset**: precision and recall of "a burst starts within the next
  ``horizon_s`` seconds" for prefixes not in a burst at ``t``. A prefix burst
  starts with an arrival after a quiet gap (``ForecastConfig.gap_s``); a
  cluster surge starts where the window count first reaches twice the
  trailing median. The forecaster says yes when ``p_onset >= 0.5`` (cluster:
  when its expected count reaches the surge level); naive when a burst
  started within the last window; seasonal-naive when one started a period
  ago.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvstore.predict.forecast import CLUSTER, ForecastConfig, RateForecaster
from kvstore.workloads.traces import Request

_ACTIVE_S = 600.0  # prefixes seen this recently are scored


@dataclass
class _Tally:
    abs_err: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    n: int = 0
    tp: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    fp: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    fn: dict[str, int] = field(default_factory=lambda: defaultdict(int))

    def err(self, which: str, forecast: float, actual: float) -> None:
        self.abs_err[which] += abs(forecast - actual)

    def onset(self, which: str, said: bool, happened: bool) -> None:
        if said and happened:
            self.tp[which] += 1
        elif said:
            self.fp[which] += 1
        elif happened:
            self.fn[which] += 1

    def result(self, horizon_s: float) -> dict[str, dict[str, float]]:
        out = {}
        for which in ("forecast", "naive", "seasonal"):
            tp, fp, fn = self.tp[which], self.fp[which], self.fn[which]
            out[which] = {
                "mae_per_s": self.abs_err[which] / max(1, self.n) / horizon_s,
                "precision": tp / (tp + fp) if tp + fp else math.nan,
                "recall": tp / (tp + fn) if tp + fn else math.nan,
            }
        out["samples"] = {"windows": float(self.n), "onsets": float(self.tp["forecast"] + self.fn["forecast"])}
        return out


def prefix_key(req: Request, max_depth: int) -> tuple[str, int]:
    """The prefix a request is counted under: its deepest tracked depth."""
    depth = min(len(req.hash_ids), max_depth)
    return ("m", req.hash_ids[depth - 1])


def _onsets(times: np.ndarray, gap_s: float) -> np.ndarray:
    if not len(times):
        return times
    starts = np.concatenate([[True], np.diff(times) >= gap_s])
    return times[starts]


def _dominant_lag(counts: np.ndarray, bucket_s: float, lo_s: float = 30.0, hi_s: float = 900.0) -> float:
    """The lag (seconds) of the strongest autocorrelation of ``counts`` in [lo, hi]."""
    x = counts - counts.mean()
    lags = range(max(1, int(lo_s / bucket_s)), min(len(x) - 1, int(hi_s / bucket_s)) + 1)
    if not len(lags) or not x.any():
        return hi_s
    scores = [float(np.dot(x[:-k], x[k:])) / (len(x) - k) for k in lags]
    return float(lags[int(np.argmax(scores))] * bucket_s)


def evaluate_forecasts(requests: Sequence[Request], *, max_depth: int = 8, bucket_s: float = 10.0,
                       horizon_s: float = 10.0, test_frac: float = 0.4,
                       cfg: ForecastConfig | None = None) -> dict[str, Any]:
    """Both tables for one trace: ``{"prefix": ..., "cluster": ...}``."""
    cfg = cfg or ForecastConfig()
    reqs = sorted(requests, key=lambda r: r.t)
    if not reqs:
        return {}
    t0, t_end = reqs[0].t, reqs[-1].t
    test_start = t0 + (1 - test_frac) * (t_end - t0)
    keys = [prefix_key(r, max_depth) for r in reqs]
    times = np.array([r.t for r in reqs])
    by_key: dict[Any, list[float]] = defaultdict(list)
    for key, t in zip(keys, times):
        by_key[key].append(t)
    arrivals = {k: np.array(v) for k, v in by_key.items()}
    onsets = {k: _onsets(v, cfg.gap_s) for k, v in arrivals.items()}
    warm = times[times < test_start]
    edges = np.arange(t0, test_start + bucket_s, bucket_s)
    cluster_period = _dominant_lag(np.histogram(warm, edges)[0].astype(float), bucket_s) if len(warm) else 300.0

    fc = RateForecaster(cfg)
    prefix, cluster = _Tally(), _Tally()
    cluster_counts: list[float] = []
    i = 0
    for t in np.arange(t0 + bucket_s, t_end - horizon_s, bucket_s):
        while i < len(reqs) and times[i] <= t:
            fc.observe(keys[i], float(times[i]))
            fc.observe(CLUSTER, float(times[i]))
            i += 1
        cluster_counts.append(float(np.searchsorted(times, t) - np.searchsorted(times, t - bucket_s)))
        if t < test_start:
            continue
        _score_prefixes(fc, t, horizon_s, bucket_s, arrivals, onsets, prefix)
        _score_cluster(fc, t, horizon_s, bucket_s, times, cluster_counts, cluster_period, cluster)
    return {"prefix": prefix.result(horizon_s), "cluster": cluster.result(horizon_s),
            "cluster_period_s": cluster_period, "horizon_s": horizon_s, "bucket_s": bucket_s,
            "test_from_s": test_start - t0}


def _count(times: np.ndarray, lo: float, hi: float) -> int:
    return int(np.searchsorted(times, hi, "right") - np.searchsorted(times, lo, "right"))


def _score_prefixes(fc: RateForecaster, t: float, horizon_s: float, bucket_s: float,
                    arrivals: dict[Any, np.ndarray], onsets: dict[Any, np.ndarray], tally: _Tally) -> None:
    f = fc.forecast(t, horizon_s)
    for j, key in enumerate(f.keys):
        if key == CLUSTER:
            continue
        times, starts = arrivals[key], onsets[key]
        if t - fc.last[fc._row[key]] > _ACTIVE_S:
            continue
        actual = _count(times, t, t + horizon_s)
        past = starts[starts <= t]
        period = float(past[-1] - past[-2]) if len(past) >= 2 else math.nan
        naive = _count(times, t - horizon_s, t)
        seasonal = _count(times, t - period, t - period + horizon_s) if math.isfinite(period) else naive
        tally.n += 1
        tally.err("forecast", float(f.point[j]), actual)
        tally.err("naive", naive, actual)
        tally.err("seasonal", seasonal, actual)
        if f.in_burst[j]:
            continue
        happened = bool(((starts > t) & (starts <= t + horizon_s)).any())
        tally.onset("forecast", bool(f.p_onset[j] >= 0.5), happened)
        tally.onset("naive", bool(((starts > t - horizon_s) & (starts <= t)).any()), happened)
        seasonal_said = math.isfinite(period) and bool(
            ((starts > t - period) & (starts <= t - period + horizon_s)).any())
        tally.onset("seasonal", seasonal_said, happened)


def _score_cluster(fc: RateForecaster, t: float, horizon_s: float, bucket_s: float, times: np.ndarray,
                   counts: list[float], period: float, tally: _Tally) -> None:
    f = fc.forecast(t, horizon_s, [CLUSTER])
    actual = _count(times, t, t + horizon_s)
    naive = _count(times, t - horizon_s, t)
    seasonal = _count(times, t - period, t - period + horizon_s)
    tally.n += 1
    tally.err("forecast", float(f.point[0]), actual)
    tally.err("naive", naive, actual)
    tally.err("seasonal", seasonal, actual)
    trailing = counts[-60:]
    level = 2 * max(1.0, float(np.median(trailing))) * horizon_s / bucket_s
    if naive >= level:  # already surging: an onset cannot start now
        return
    happened = actual >= level
    tally.onset("forecast", float(f.point[0]) >= level, happened)
    tally.onset("naive", False, happened)  # below the level now: persistence says no surge
    tally.onset("seasonal", seasonal >= level, happened)


def markdown(results: Sequence[tuple[str, dict[str, Any]]]) -> str:
    """One row per trace, stream and forecaster."""
    lines = ["| trace | stream | forecaster | rate MAE /s | onset precision | onset recall | windows | onsets |",
             "|---|---|---|---|---|---|---|---|"]

    def fmt(x: float) -> str:
        return "–" if not math.isfinite(x) else f"{x:.3f}"

    for name, r in results:
        for stream in ("prefix", "cluster"):
            block = r[stream]
            for which in ("forecast", "seasonal", "naive"):
                m = block[which]
                lines.append(f"| {name} | {stream} | {which} | {fmt(m['mae_per_s'])} | {fmt(m['precision'])} | "
                             f"{fmt(m['recall'])} | {int(block['samples']['windows'])} | "
                             f"{int(block['samples']['onsets'])} |")
    return "\n".join(lines)
