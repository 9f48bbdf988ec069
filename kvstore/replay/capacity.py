"""Capacity at an SLO: the highest load at which a configuration still serves its requests in time.

A configuration's **capacity** on a workload is the highest rate scale (``--rate-scale``: the same
requests, that many times closer together) at which at least ``--slo-attainment`` of the requests meet
the SLO (TTFT at most the larger of ``--slo-ttft`` and ``--slo-factor`` x the request's own cold prefill;
a request left unfinished misses it). It is found per seed by :func:`search` on the simulator:
doubling or halving from 1.0 until the target is bracketed, then bisecting (geometrically) until the
bracket's upper end is within ``--search-resolution`` of its lower end. The lower end is the capacity;
its requests per second are the workload's mean arrival rate times it.

Read against:

* ``engine-only`` (no kvstore: each engine's own prefix cache), its best router: the 1.0x of every
  capacity ratio, as the field reports goodput against vLLM alone;
* the **best baseline**: the configuration that does not predict (``engine-only``, ``none`` and
  ``reactive`` with or without claims and tiers but ``tiers-predictive``) with the highest median
  capacity;
* the **bound**: ``bound|plan``, every reusable block at hand for nothing on every node from the moment
  it can first exist -- the arrival of the first request that has it plus that request's prefill of it on
  an idle engine -- each request waiting for its prefix where that ends before computing it (the floor's
  physics with queueing, no link: :func:`kvstore.replay.serve.bound_reuse`), each routed where the
  oracle's plan sends it. That no configuration's capacity exceeds it is checked
  (:func:`over_bound`), not proven: another router could in principle place work better.

Pure logic over run summaries (the caller runs the simulator); no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict, dataclass, field
from typing import Any

from kvstore.replay.claiming import split_policy
from kvstore.replay.sweep import is_baseline, spread

LOWEST = 1 / 64     # rate scales searched: from 1/64 of the workload's rate ...
HIGHEST = 256.0     # ... to 256 times it
REFERENCE = "engine-only"
BOUND = "bound"


@dataclass(slots=True)
class Probe:
    """One run at one rate scale."""

    rate_scale: float
    attainment: float
    ttft_p50_s: float
    ttft_p99_s: float
    requests_per_s: float
    completed: int
    requests: int

    @classmethod
    def of(cls, rate_scale: float, summary: dict[str, Any], base_rps: float) -> Probe:
        return cls(rate_scale, float(summary["slo_attainment"]), float(summary["ttft_p50_s"]),
                   float(summary["ttft_p99_s"]), base_rps * rate_scale, int(summary["completed"]),
                   int(summary["requests"]))


@dataclass(slots=True)
class Capacity:
    """One configuration's capacity on one seed: the last probe that met the target (None: none did, even at
    :data:`LOWEST`), and every probe in the order run."""

    knee: Probe | None
    probes: list[Probe] = field(default_factory=list)
    capped: bool = False  # met the target at HIGHEST: the capacity is at least that

    @property
    def rate_scale(self) -> float:
        return self.knee.rate_scale if self.knee is not None else 0.0

    def to_json(self) -> dict[str, Any]:
        k = self.knee or Probe(0.0, 0.0, 0.0, 0.0, 0.0, 0, 0)
        return {"rate_scale": k.rate_scale, "requests_per_s": k.requests_per_s, "attainment": k.attainment,
                "ttft_p50": k.ttft_p50_s, "ttft_p99": k.ttft_p99_s, "capped": self.capped,
                "probes": [asdict(p) for p in self.probes]}


def search(run: Callable[[float], dict[str, Any]], target: float, resolution: float, base_rps: float,
           start: float = 1.0) -> Capacity:
    """The highest rate scale whose run meets ``target`` attainment, to ``resolution`` (see the module doc).
    ``run(x)`` returns the summary of one run at rate scale ``x``. Assumes attainment falls as load grows;
    where it does not, the bracket found is still one whose lower end met the target and upper end did not."""
    probes: list[Probe] = []

    def probe(x: float) -> bool:
        p = Probe.of(x, run(x), base_rps)
        probes.append(p)
        return p.attainment >= target

    x = min(max(start, LOWEST), HIGHEST)
    if probe(x):
        lo, hi = x, None
        while hi is None:
            if lo >= HIGHEST:
                return Capacity(probes[-1], probes, capped=True)
            x = min(lo * 2, HIGHEST)
            if probe(x):
                lo = x
            else:
                hi = x
    else:
        lo, hi = None, x
        while lo is None:
            if hi <= LOWEST:
                return Capacity(None, probes)
            x = max(hi / 2, LOWEST)
            if probe(x):
                lo = x
            else:
                hi = x
    while hi / lo > 1 + resolution:
        x = math.sqrt(lo * hi)
        if probe(x):
            lo = x
        else:
            hi = x
    knee = max((p for p in probes if p.rate_scale == lo), key=lambda p: p.attainment)
    return Capacity(knee, probes)


def summarize(per_config: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Per configuration (``policy|router`` -> one :meth:`Capacity.to_json` per seed, seeds in the same
    order): the median capacity and its range, and per-seed ratios to the reference (``engine-only``'s best
    router), to the best baseline and to the bound. Returns ``{"configs": {...}, "reference": label,
    "best_baseline": label, "best": label, "bound": label}`` (a label None where no such run)."""
    med = {k: spread([c["rate_scale"] for c in v]) for k, v in per_config.items()}

    def best(labels: list[str]) -> str | None:
        return max(labels, key=lambda k: (med[k]["median"], med[k]["min"])) if labels else None

    policies = {k: k.split("|")[0] for k in per_config}
    reference = best([k for k, p in policies.items() if split_policy(p)[0] == REFERENCE])
    baseline = best([k for k, p in policies.items() if is_baseline(p)])
    bound = best([k for k, p in policies.items() if split_policy(p)[0] == BOUND])
    best_config = best([k for k, p in policies.items() if split_policy(p)[0] not in (BOUND, "oracle")])

    def ratio(k: str, den: str | None) -> dict[str, float] | None:
        if den is None:
            return None
        vals = [a["rate_scale"] / b["rate_scale"] for a, b in zip(per_config[k], per_config[den])
                if b["rate_scale"] > 0]
        return spread(vals) if vals else None

    configs = {}
    for k, v in per_config.items():
        configs[k] = {"rate_scale": med[k],
                      "requests_per_s": spread([c["requests_per_s"] for c in v]),
                      "attainment": spread([c["attainment"] for c in v]),
                      "ttft_p50": spread([c["ttft_p50"] for c in v]),
                      "ttft_p99": spread([c["ttft_p99"] for c in v]),
                      "vs_engine_only": ratio(k, reference), "vs_best_baseline": ratio(k, baseline),
                      "vs_bound": ratio(k, bound), "capped": any(c["capped"] for c in v)}
    return {"configs": configs, "reference": reference, "best_baseline": baseline, "best": best_config,
            "bound": bound}


def over_bound(summary: dict[str, Any], slack: float = 0.0) -> list[str]:
    """Configurations whose capacity exceeds the bound's on some seed by more than ``slack`` (a share of the
    bound's): none, where the bound is one (:func:`summarize`'s ``vs_bound`` ranges)."""
    out = []
    for k, c in summary["configs"].items():
        r = c.get("vs_bound")
        if r is not None and r["max"] > 1.0 + slack and not k.startswith(BOUND + "|"):
            out.append(k)
    return out


# ---- the search over a replay's configurations (the simulator runs; the live check is the caller's) ----

def _search_one(task: tuple[Any, Any, Any, str, tuple[str, str, float]]) -> dict[str, Any]:
    """One configuration's search on one seed's workload, on the simulator (a process pool's task)."""
    from kvstore.replay.sim import run_policy_sim

    cfg, cost, wl, policy, rc = task
    base_rps = len(wl.requests) / wl.duration_s if wl.duration_s > 0 else 0.0
    cap = search(lambda x: run_policy_sim(wl.at_rate(x), policy, rc, cfg, cost)["summary"], cfg.slo_attainment,
                 cfg.search_resolution, base_rps)
    return cap.to_json()


def run_search(cfg: Any, cost: Any, workloads_by_seed: dict[int, list[Any]], wi: int,
               plan: list[tuple[str, tuple[str, str, float]]], jobs: int = 1,
               progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Every configuration of ``plan`` searched on workload ``wi`` of every seed (``cfg``: the replay's
    :class:`~kvstore.replay.config.ReplayConfig`), ``jobs`` searches at a time. Returns ``{"per_seed":
    {label: [capacity json per seed]}, **summarize(...)}``."""
    from kvstore.replay.sweep import key

    tasks = [(seed, policy, rc) for seed in sorted(workloads_by_seed) for policy, rc in plan]
    found: dict[tuple[int, str], dict[str, Any]] = {}

    def done(seed: int, policy: str, rc: tuple[str, str, float], cap: dict[str, Any]) -> None:
        found[seed, key(policy, rc[0])] = {**cap, "seed": seed}
        if progress is not None:
            progress(f"{workloads_by_seed[seed][wi].name}/{key(policy, rc[0])}/s{seed}")

    if jobs > 1 and len(tasks) > 1:
        with ProcessPoolExecutor(min(jobs, len(tasks))) as pool:
            futures = {pool.submit(_search_one, (cfg, cost, workloads_by_seed[seed][wi], policy, rc)):
                       (seed, policy, rc) for seed, policy, rc in tasks}
            for fut in as_completed(futures):
                done(*futures[fut], fut.result())
    else:
        for seed, policy, rc in tasks:
            done(seed, policy, rc, _search_one((cfg, cost, workloads_by_seed[seed][wi], policy, rc)))
    per: dict[str, list[dict[str, Any]]] = {}
    for seed, policy, rc in tasks:  # seeds in order in every configuration's list: ratios pair them
        per.setdefault(key(policy, rc[0]), []).append(found[seed, key(policy, rc[0])])
    return {"per_seed": per, **summarize(per)}


def knees(summary: dict[str, Any]) -> dict[str, float]:
    """The rate scales the live cluster is checked at: the best baseline's capacity and the best
    configuration's (medians over seeds), by name; none where that capacity is 0."""
    out = {}
    for name in ("best_baseline", "best"):
        label = summary.get(name)
        if label is not None:
            x = summary["configs"][label]["rate_scale"]["median"]
            if x > 0:
                out[name] = x
    return out
