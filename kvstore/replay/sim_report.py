"""The calibration section of a replay report: each configuration's simulated run beside its real one.

``kvctl replay --sim-compare`` runs every configuration both ways and keeps
the simulated summaries in ``results.json`` under each workload's
``sim_compare`` (same keys as ``runs``); this renders them. Pure rendering.
"""

from __future__ import annotations

import statistics
from typing import Any

KEYS = ("ttft_p50_s", "ttft_p99_s", "ttft_mean_s")


def _med(runs: list[dict[str, Any]], k: str) -> float:
    return statistics.median(float(r[k]) for r in runs) if runs else 0.0


def agreement(real: list[dict[str, Any]], sim: list[dict[str, Any]]) -> dict[str, float]:
    """Per statistic, simulated / measured (medians over the seeds)."""
    return {k: (_med(sim, k) / _med(real, k)) if _med(real, k) > 0 else float("nan") for k in KEYS}


def compare_section(results: dict[str, Any]) -> str:
    """Markdown: measured beside simulated TTFT per configuration ('' when no workload has a twin)."""
    parts: list[str] = []
    for name, w in results.get("workloads", {}).items():
        twins = w.get("sim_compare") or {}
        if not twins:
            continue
        parts += [f"### {name}: measured vs simulated (`--sim-compare`)", "",
                  "| config | measured p50 / p99 / mean s | simulated p50 / p99 / mean s | sim/real p50 | sim/real p99 |",
                  "|---|---|---|---|---|"]
        for label, runs in w.get("runs", {}).items():
            sim = twins.get(label)
            if not sim:
                continue
            r = agreement(runs, sim)
            m = " / ".join(f"{_med(runs, k):.3f}" for k in KEYS)
            s = " / ".join(f"{_med(sim, k):.3f}" for k in KEYS)
            parts.append(f"| {label} | {m} | {s} | {r['ttft_p50_s']:.2f}x | {r['ttft_p99_s']:.2f}x |")
        parts.append("")
    if not parts:
        return ""
    return "\n## Calibration: the simulated replay beside the measured one\n\n" + \
        "The simulated rows come from `kvstore/replay/sim.py` (no kvstored, a simulated clock) with the same " \
        "configuration and seeds; they are a model, the measured rows are the result.\n\n" + "\n".join(parts)
