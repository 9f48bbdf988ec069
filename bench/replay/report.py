"""The replay's report: a markdown table per workload, the ratios, and the plots.

Rendering only; the numbers come from ``results.json`` (see
:mod:`bench.replay.metrics` for what is measured and what is modelled).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

POLICIES = ("none", "reactive", "full", "predictive", "oracle")
MiB = 1 << 20


def ratio(a: float, b: float) -> float | None:
    return a / b if b else None


def ratios(policies: dict[str, dict[str, Any]]) -> dict[str, dict[str, float | None]]:
    """predictive/reactive and predictive/oracle for the TTFT and fetch statistics (lower is better)."""
    keys = ("ttft_p50_s", "ttft_p95_s", "ttft_p99_s", "ttft_mean_s", "ttft_link_p99_s", "kv_fetch_p99_s")
    out: dict[str, dict[str, float | None]] = {}
    p = policies.get("predictive")
    for base in ("reactive", "oracle"):
        b = policies.get(base)
        if p is not None and b is not None:
            out[f"predictive/{base}"] = {k: ratio(float(p[k]), float(b[k])) for k in keys}
    return out


def _fmt(x: float | None, digits: int = 3) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def table(policies: dict[str, dict[str, Any]]) -> str:
    """The per-policy table (markdown). Columns say measured or modelled."""
    head = ("| policy | requests | TTFT p50 s | TTFT p95 s | TTFT p99 s | TTFT mean s | TTFT(link) p99 s | "
            "queue p99 s | KV fetch p99 ms (measured) | KV fetch p99 ms (link model) | local | remote | miss | "
            "spec MiB moved | spec GiB unscaled | wasted % |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for name in [p for p in POLICIES if p in policies] + [p for p in policies if p not in POLICIES]:
        s = policies[name]
        lines.append(
            f"| {name} | {s['completed']}/{s['requests']} | {_fmt(s['ttft_p50_s'])} | {_fmt(s['ttft_p95_s'])} | "
            f"{_fmt(s['ttft_p99_s'])} | {_fmt(s['ttft_mean_s'])} | {_fmt(s['ttft_link_p99_s'])} | "
            f"{_fmt(s['queue_p99_s'])} | {s['kv_fetch_p99_s'] * 1e3:.1f} | {s['kv_fetch_link_p99_s'] * 1e3:.1f} | "
            f"{s['local_hit_ratio']:.3f} | {s['remote_hit_ratio']:.3f} | {s['miss_ratio']:.3f} | "
            f"{s['spec_bytes'] / MiB:.1f} | {s['spec_bytes_unscaled'] / (1 << 30):.1f} | "
            f"{100 * s['spec_waste_ratio']:.0f} |")
    return "\n".join(lines)


def ratio_lines(policies: dict[str, dict[str, Any]]) -> str:
    out = []
    for name, r in ratios(policies).items():
        out.append(f"- **{name}**: TTFT p50 {_fmt(r['ttft_p50_s'], 2)}x, p95 {_fmt(r['ttft_p95_s'], 2)}x, "
                   f"p99 {_fmt(r['ttft_p99_s'], 2)}x, mean {_fmt(r['ttft_mean_s'], 2)}x; "
                   f"TTFT(link) p99 {_fmt(r['ttft_link_p99_s'], 2)}x; KV fetch p99 {_fmt(r['kv_fetch_p99_s'], 2)}x")
    return "\n".join(out) or "- (needs predictive with reactive and/or oracle in the run)"


MEASURED_NOTE = """\
What is measured and what is modelled:

- **measured** on this machine: queue wait (real seconds x speedup, so in trace time), KV fetch (the
  serving node's Lookup + Get, real seconds, loopback, scaled page bytes), router lookups, hit/miss block
  counts, bytes copied and wasted (scaled bytes that really moved; "unscaled" = x byte scale).
- **modelled** (cost model, unscaled, never slept at full length): prefill of the uncached tokens,
  decode, and "link": the remote blocks' unscaled bytes over the stated link.
- TTFT = route + queue + KV fetch (measured) + prefill (modelled);
  TTFT(link) = route + queue + link transfer (modelled) + local load (modelled) + prefill (modelled).
"""


def render(results: dict[str, Any]) -> str:
    """The whole report.md."""
    cfg = results["config"]
    parts = ["# Trace replay", "",
             f"{cfg['nodes']} real kvstored nodes on 127.0.0.1 (`--device {cfg['device']}`, "
             f"transport {cfg['transport']}), router `{cfg['router']}`, preset `{cfg['preset']}` "
             f"({cfg['cost']['model']['name']} on {cfg['cost']['gpus']}x {cfg['cost']['hardware']['name']}: "
             f"{cfg['cost']['hardware']['flops'] / 1e12:.0f} TFLOP/s, MFU {cfg['cost']['hardware']['mfu']}, "
             f"HBM {cfg['cost']['hardware']['hbm_bytes_s'] / 1e12:.2f} TB/s; link "
             f"{cfg['cost']['hardware']['link_bytes_s'] / 1e9:.0f} GB/s), page "
             f"{cfg['cost']['page_bytes_unscaled'] / MiB:.0f} MiB modelled / "
             f"{cfg['cost']['page_bytes_scaled'] / 1024:.0f} KiB stored (byte scale {cfg['byte_scale']}), "
             f"speedup {cfg['speedup']}, concurrency {cfg['concurrency']} per engine. "
             f"All times in trace seconds.", "", MEASURED_NOTE]
    for name, w in results["workloads"].items():
        d = w["workload"]
        parts += [f"## {name}", "",
                  f"{d['requests']} requests over {d['duration_s']:.0f} s of trace, {d['blocks']} blocks; "
                  f"at most {100 * d['reusable_ratio']:.1f} % of blocks are reusable (an earlier request had "
                  f"them). Wall time {w.get('wall_s', 0):.0f} s.", "",
                  table(w["policies"]), "", ratio_lines(w["policies"]), ""]
        problems = w.get("problems") or {}
        for policy, probs in problems.items():
            if probs:
                parts.append(f"- sanity ({policy}): {'; '.join(probs)}")
    return "\n".join(parts) + "\n"


# ---- plots -------------------------------------------------------------------

def plot_cdf(path: Path, title: str, ttft: dict[str, Sequence[float]]) -> None:
    """TTFT CDF, one line per policy (log x)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for policy, values in ttft.items():
        v = np.sort(np.asarray(values, dtype=float))
        if v.size:
            ax.plot(np.maximum(v, 1e-4), np.arange(1, v.size + 1) / v.size, label=policy)
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (trace seconds)")
    ax.set_ylabel("fraction of requests")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_timeline(path: Path, title: str, node_ids: Sequence[str], arrivals: dict[str, Sequence[float]],
                  timeline: dict[str, Any], duration_s: float) -> None:
    """Three panels: arrivals per node, queue length per node, replicas held per node."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, 1, figsize=(9, 7.5), sharex=True)
    bins = np.linspace(0, max(duration_s, 1.0), min(120, max(10, int(duration_s))) + 1)
    for node in node_ids:
        counts, edges = np.histogram(arrivals.get(node, []), bins=bins)
        axes[0].step(edges[:-1], counts, where="post", label=node)
    axes[0].set_ylabel("arrivals / bin")
    axes[0].legend(ncol=len(node_ids), fontsize=8)
    t = np.asarray(timeline.get("t", []))
    if t.size:
        load = np.asarray(timeline["waiting"]) + np.asarray(timeline["running"])
        for j, node in enumerate(node_ids):
            axes[1].plot(t, load[:, j], label=node)
    axes[1].set_ylabel("queued + running")
    st = np.asarray(timeline.get("stats_t", []))
    if st.size:
        spec = np.asarray(timeline["spec_slots"])
        rep = np.asarray(timeline["replica_slots"])
        for j, node in enumerate(node_ids):
            line, = axes[2].plot(st, rep[:, j] + spec[:, j], label=f"{node} replica+spec")
            axes[2].plot(st, spec[:, j], linestyle=":", color=line.get_color())
    axes[2].set_ylabel("replica pages (dotted: unread spec)")
    axes[2].set_xlabel("trace seconds")
    axes[0].set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
