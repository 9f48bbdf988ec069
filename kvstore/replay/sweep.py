"""Sweeps over routers, thresholds and seeds: the best baseline and ratios with their spread.

Pure logic over per-run summaries (``results.json`` entries), no I/O.

* A **configuration** is a policy under a router setting: ``reactive|least-load``,
  ``none|cache-aware@8`` (cache-aware with ``--balance-abs 8``). The oracle
  routes itself: ``oracle|plan``.
* With ``--repeats N`` each configuration runs with N seeds; a statistic of a
  configuration is reported as its median over the seeds, with min and max.
* The **best baseline** of a workload is the configuration of ``engine-only``,
  ``none`` or ``reactive`` (with or without claims, under any tier policy but
  ``tiers-predictive``) with the
  lowest median TTFT p99 over every router and threshold that ran: the best
  a user could do without prediction.
* A ratio (predictive / best baseline, per seed) is a **result** only when its
  whole min-max range is on one side of 1.0; otherwise it is within the spread.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

from kvstore.replay.claiming import split_policy, tier_policy

BASELINES = ("none", "reactive", "reactive+claims")  # what a user can run without prediction
RATIO_KEYS = ("ttft_p50_s", "ttft_p95_s", "ttft_p99_s", "ttft_mean_s")


def router_configs(routers: Sequence[str], balance_abs: Sequence[float]) -> list[tuple[str, str, float]]:
    """``(label, router, balance_abs)`` for every router; cache-aware once per threshold."""
    out = []
    for r in routers:
        if r == "cache-aware":
            out.extend((f"cache-aware@{b:g}", r, b) for b in balance_abs)
        else:
            out.append((r, r, balance_abs[0] if balance_abs else 32.0))
    return out


def key(policy: str, router: str) -> str:
    return f"{policy}|{router}"


def spread(values: Sequence[float]) -> dict[str, float]:
    v = [float(x) for x in values]
    return {"median": statistics.median(v), "min": min(v), "max": max(v), "n": len(v)} if v else \
        {"median": 0.0, "min": 0.0, "max": 0.0, "n": 0}


def verdict(s: dict[str, float]) -> str:
    """'lower' / 'higher' when the whole range (of >= 2 seeds) is below / above 1.0, else 'within spread'
    (one seed has no range: never a result)."""
    if s["n"] < 2:
        return "one seed"
    if s["max"] < 1.0:
        return "lower"
    if s["n"] and s["min"] > 1.0:
        return "higher"
    return "within spread"


def best_baseline(runs: dict[str, list[dict[str, Any]]]) -> str | None:
    """The configuration key of ``engine-only``/``none``/``reactive`` with the lowest median TTFT p99."""
    cands = [(spread([s["ttft_p99_s"] for s in v])["median"], k) for k, v in runs.items()
             if is_baseline(k.split("|")[0]) and v]
    return min(cands)[1] if cands else None


def is_baseline(policy: str) -> bool:
    """Runs without prediction: ``engine-only`` (no store), ``none`` or ``reactive``, with or without claims,
    under any tier policy but ``tiers-predictive``."""
    return split_policy(policy)[0] in ("none", "reactive", "engine-only") and tier_policy(policy) != "tiers-predictive"


def ratio_spread(num: list[dict[str, Any]], den: list[dict[str, Any]], k: str) -> dict[str, Any]:
    """Per-seed ratios ``num[i][k] / den[i][k]`` (same seed order), with median, min, max and verdict."""
    vals = [float(a[k]) / float(b[k]) for a, b in zip(num, den) if float(b[k]) > 0]
    s: dict[str, Any] = spread(vals)
    s["verdict"] = verdict(s)
    return s


def compare(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Best baseline, predictive's (and the oracle's) ratios against it, and per-router ratios."""
    best = best_baseline(runs)
    out: dict[str, Any] = {"best_baseline": None, "vs_best": {}, "per_router": {}, "oracle_bound": {}}
    if best is None:
        return out
    b = runs[best]
    out["best_baseline"] = {"config": best, "policy": best.split("|")[0], "router": best.split("|")[1],
                            **{k: spread([s[k] for s in b]) for k in RATIO_KEYS}}
    for k, v in runs.items():
        policy, router = k.split("|")
        if split_policy(policy)[0] in ("predictive", "oracle") or tier_policy(policy) == "tiers-predictive":
            out["vs_best"][k] = {m: ratio_spread(v, b, m) for m in RATIO_KEYS}
        if split_policy(policy)[0] == "predictive":
            for base in BASELINES:
                if key(base, router) in runs:
                    out["per_router"][f"{k} / {base}"] = {m: ratio_spread(v, runs[key(base, router)], m)
                                                          for m in RATIO_KEYS}
    floors = [s["ttft_floor_p99_s"] for s in b if "ttft_floor_p99_s" in s]
    if floors:  # the same for every configuration of a seed: what no configuration's p99 can go under
        out["floor"] = {"p99": spread(floors), "vs_best": spread([f / s["ttft_p99_s"] for f, s in zip(floors, b)
                                                                  if s["ttft_p99_s"] > 0])}
    oracle = runs.get(key("oracle", "plan"))
    if oracle:
        o = spread([s["ttft_p99_s"] for s in oracle])
        for k, v in runs.items():
            if k.startswith("oracle|"):
                continue
            other = spread([s["ttft_p99_s"] for s in v])
            out["oracle_bound"][k] = {"oracle_p99": o["median"], "p99": other["median"],
                                      "at_or_below": o["min"] <= other["max"]}
    return out
