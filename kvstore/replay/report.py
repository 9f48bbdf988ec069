"""The replay's report: a markdown table per workload, the ratios, and the plots.

Rendering only; the numbers come from ``results.json`` (see
:mod:`kvstore.replay.metrics` for what is measured and what is modelled).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from kvstore.replay.sweep import is_baseline

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


def _med(runs: list[dict[str, Any]], k: str) -> float:
    v = sorted(float(r.get(k, 0.0)) for r in runs)
    return float(np.median(v)) if v else 0.0


def _rng(runs: list[dict[str, Any]], k: str) -> str:
    v = [float(r[k]) for r in runs]
    med = float(np.median(v))
    return f"{med:.3f}" if len(v) < 2 else f"{med:.3f} ({min(v):.3f}-{max(v):.3f})"


def sweep_table(w: dict[str, Any]) -> str:
    """One row per policy|router configuration (medians over seeds, p99 with its min-max), then the
    best baseline and predictive's ratios against it."""
    head = ("| policy | router | done | TTFT p50 s | TTFT p99 s (min-max) | TTFT mean s | p99 cached-prefix s | "
            "SLO % | req/s | KV fetch p99 s | fetch on crit. path s | prefill GPU-s | recomputed cached tok | "
            "link GiB reactive / spec / full (unscaled) | spec read / wasted % | replica GiB-s spec / sunk / kept |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    best = (w.get("best_baseline") or {}).get("config")
    order = {p: i for i, p in enumerate(POLICIES)}
    for label in sorted(w.get("runs", {}), key=lambda k: (order.get(k.split("|")[0], 9), k)):
        runs = w["runs"][label]
        policy, router = label.split("|")
        done = sum(r["completed"] for r in runs)
        total = sum(r["requests"] for r in runs)
        gib = [sum(float(r.get(k, 0)) for r in runs) / len(runs) * runs[0].get("byte_scale", 1) / (1 << 30)
               for k in ("link_bytes_reactive", "link_bytes_speculative", "link_bytes_full")]
        name = f"**{policy}**" if label == best else policy
        lines.append(
            f"| {name} | {router} | {done}/{total} | {_med(runs, 'ttft_p50_s'):.3f} | {_rng(runs, 'ttft_p99_s')} | "
            f"{_med(runs, 'ttft_mean_s'):.3f} | {_med(runs, 'ttft_cached_p99_s'):.3f} | "
            f"{100 * _med(runs, 'slo_attainment'):.0f} | {_med(runs, 'throughput_rps'):.2f} | "
            f"{_med(runs, 'kv_fetch_p99_s'):.3f} | {_med(runs, 'fetch_critical_s'):.1f} | "
            f"{_med(runs, 'prefill_gpu_s'):.1f} | {_med(runs, 'recomputed_cached_tokens'):.0f} | "
            f"{gib[0]:.1f} / {gib[1]:.1f} / {gib[2]:.1f} | "
            f"{100 * _med(runs, 'spec_read_share'):.0f} / {100 * _med(runs, 'spec_waste_ratio'):.0f} | "
            f"{_med(runs, 'replica_gib_s_speculative'):.0f} / {_med(runs, 'replica_gib_s_sunk'):.0f} / "
            f"{_med(runs, 'replica_gib_s'):.0f} |")
    lines.append("")
    lines.append(vs_best_lines(w))
    sources = decision_lines(w)
    if sources:
        lines += ["", sources]
    tiers = tier_table(w)
    if tiers:
        lines += ["", tiers]
    fail = failover_table(w)
    if fail:
        lines += ["", fail]
    joins = join_table(w)
    if joins:
        lines += ["", joins]
    return "\n".join(lines)


def tier_table(w: dict[str, Any]) -> str:
    """Where each configuration's blocks came from, by tier, and its disks' traffic (medians over seeds);
    empty when no run had a disk tier (``--tier-policies single-tier``)."""
    runs_of = w.get("runs", {})
    if not any(r.get("disk_write_pages", 0) or r.get("disk_blocks", 0) for runs in runs_of.values() for r in runs):
        return ""
    order = {p: i for i, p in enumerate(POLICIES)}
    rows = ["Blocks by where they were found (% of all blocks) and the disk tiers' traffic (modelled bytes):", "",
            "| policy | router | pool % | disk % | other nodes % | engine cache % | computed % | "
            "disk written GiB | declined GiB | disk read GiB | disk written / disk hit | repeat bursts in pool | "
            "disk Gets slower than computing |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for label in sorted(runs_of, key=lambda k: (order.get(k.split("|")[0], 9), k)):
        runs = runs_of[label]
        policy, router = label.split("|")
        page = runs[0].get("page_bytes_unscaled", 0)
        written, declined, read, hits = (_med(runs, k) for k in ("disk_write_pages", "disk_declined_pages",
                                                                 "disk_read_pages", "disk_blocks"))
        rows.append(f"| {policy} | {router} | {100 * _med(runs, 'pool_hit_ratio'):.1f} | "
                    f"{100 * _med(runs, 'disk_hit_ratio'):.1f} | {100 * _med(runs, 'remote_hit_ratio'):.1f} | "
                    f"{100 * _med(runs, 'engine_cached_ratio'):.1f} | {100 * _med(runs, 'miss_ratio'):.1f} | "
                    f"{written * page / (1 << 30):.0f} | {declined * page / (1 << 30):.0f} | "
                    f"{read * page / (1 << 30):.0f} | "
                    f"{written / hits if hits else float('inf'):.1f} | {_bursts(runs)} | "
                    f"{_span(runs, 'disk_slower_than_compute')} |")
    return "\n".join(rows)


def _span(runs: list[dict[str, Any]], k: str) -> str:
    """A count over the seeds: ``n`` or ``min-max``."""
    v = [int(r.get(k, 0)) for r in runs]
    return f"{min(v)}" if min(v) == max(v) else f"{min(v)}-{max(v)}"


def _bursts(runs: list[dict[str, Any]]) -> str:
    """Repeat bursts that found their prefix in the pool of every node serving them (summed over seeds)."""
    total = sum(int(r.get("bursts_repeat", 0)) for r in runs)
    found = sum(int(r.get("bursts_in_pool", 0)) for r in runs)
    return f"{100 * found / total:.0f} % of {total}" if total else "-"


def decision_lines(w: dict[str, Any]) -> str:
    """Per predictive configuration, what its copies came from (medians per seed): the planner's
    forecast decisions against the copy trees to landed claims' waiters, which answer demand already
    seen; a win with no forecast decision is the claim trees' alone."""
    out = []
    for label, runs in sorted(w.get("runs", {}).items()):
        if not label.startswith("predictive"):
            continue
        d = [r.get("planner_decisions") or {} for r in runs]
        forecast = float(np.median([x.get("replicate", 0) for x in d]))
        trees = float(np.median([x.get("claim_tree", 0) for x in d]))
        promoted = float(np.median([x.get("promote", 0) for x in d]))
        saved = float(np.median([r.get("egress_saved_s", 0.0) for r in runs]))
        out.append(f"- `{label}` copy decisions per run (median): {forecast:g} from the forecast (planner), "
                   f"{trees:g} claim trees to waiters" + (f", {promoted:g} promotions from a node's disk ahead of "
                                                          "a forecast burst" if promoted else "") +
                   f"; holder egress the trees saved against one source: {saved:.1f} trace s")
    return "\n".join(out)


def _event_rows(w: dict[str, Any], key: str, row: Callable[[str, str, dict[str, Any], list[dict[str, Any]]], str]
                ) -> list[str]:
    """One row per configuration and event of ``key`` (``failover``: a ``--kill``, ``joins``: a ``--join``)
    in the runs that have it: ``row(policy, router, the first seed's event, every seed's event)``."""
    rows = []
    order = {p: i for i, p in enumerate(POLICIES)}
    for label in sorted(w.get("runs", {}), key=lambda k: (order.get(k.split("|")[0], 9), k)):
        runs = [r for r in w["runs"][label] if r.get(key)]
        policy, router = label.split("|")
        for j, f in enumerate(runs[0][key] if runs else ()):
            rows.append(row(policy, router, f, [r[key][j] for r in runs]))
    return rows


def failover_table(w: dict[str, Any]) -> str:
    """TTFT of the requests in the 30 s after each ``--kill``, per configuration (medians over seeds)."""
    rows = _event_rows(w, "failover", lambda policy, router, f, per: (
        f"| {policy} | {router} | {f['node']}@{f['t']:g} | {_med(per, 'requests'):.0f} | "
        f"{_med(per, 'ttft_p50_s'):.3f} | {_rng(per, 'ttft_p99_s')} | {_med(per, 'ttft_mean_s'):.3f} | "
        f"{_med(per, 'on_killed_node'):.0f} | {_med(per, 'kv_errors'):.0f} | {_med(per, 'miss_ratio'):.2f} |"))
    if not rows:
        return ""
    span = w["runs"][next(iter(w["runs"]))][0]["failover"][0]["span_s"]
    head = (f"After the kill (requests arriving in the {span:g} s after it; the killed node's engine recomputes):\n\n"
            "| policy | router | kill | requests | TTFT p50 s | TTFT p99 s (min-max) | TTFT mean s | "
            "on killed node | failed KV calls | miss |\n|---|---|---|---|---|---|---|---|---|---|")
    return head + "\n" + "\n".join(rows) + "\n\n" + failover_ratio_lines(w)


def _join_row(policy: str, router: str, f: dict[str, Any], per: list[dict[str, Any]]) -> str:
    """A ``--join``'s row; the joined node's hit ratio and TTFT over the seeds where it served a request."""
    joined, rest = [e["joined"] for e in per], [e["serving"] for e in per]
    served = [(a, b) for a, b in zip(joined, rest) if a["requests"]]
    own = [a for a, _ in served]
    ratio = [a["hit_ratio"] / b["hit_ratio"] for a, b in served if b["hit_ratio"] > 0]
    first = [e["first_request_after_s"] for e in per if e["first_request_after_s"] is not None]
    cells = [
        f"{float(np.median(first)):.2f}" if first else "-",
        f"{_med(joined, 'requests'):.0f}",
        f"{_med(own, 'hit_ratio'):.3f}" if own else "-",
        f"{_med(rest, 'hit_ratio'):.3f}",
        f"{float(np.median(ratio)):.2f}x" if ratio else "-",
        f"{_med(own, 'ttft_p50_s'):.3f} / {_med(own, 'ttft_p99_s'):.3f}" if own else "-",
        f"{_med(rest, 'ttft_p50_s'):.3f} / {_med(rest, 'ttft_p99_s'):.3f}",
        f"{_med(joined, 'slower_than_cold_prefill'):.0f} / {_med(rest, 'slower_than_cold_prefill'):.0f}",
    ]
    return f"| {policy} | {router} | {f['node']}@{f['t']:g} | " + " | ".join(cells) + " |"


def join_table(w: dict[str, Any]) -> str:
    """The first minute after each ``--join``, per configuration (medians over seeds): the joined node's hit
    ratio and TTFT against the nodes already serving."""
    rows = _event_rows(w, "joins", _join_row)
    if not rows:
        return ""
    span = w["runs"][next(iter(w["runs"]))][0]["joins"][0]["span_s"]
    return (f"After the join (requests arriving in the {span:g} s after it, served by the joined node against the "
            "nodes already serving):\n\n"
            "| policy | router | join | first request after s | requests on it | its hit ratio | others' | ratio | "
            "its TTFT p50 / p99 s | others' | slower than own cold prefill (it / others) |\n"
            "|---|---|---|---|---|---|---|---|---|---|---|\n" + "\n".join(rows))


def failover_ratio_lines(w: dict[str, Any]) -> str:
    """Post-kill p99 of each predictive and oracle configuration over the best post-kill baseline (the
    none/reactive configuration with the lowest median post-kill p99), paired seed by seed."""
    post = {label: [r["failover"][0]["ttft_p99_s"] for r in runs if r.get("failover")]
            for label, runs in w.get("runs", {}).items()}
    base = {k: v for k, v in post.items() if v and is_baseline(k.split("|")[0])}
    if not base:
        return "- post-kill ratios: (need a none or reactive configuration in the run)"
    best = min(base, key=lambda k: float(np.median(base[k])))
    out = [f"- best post-kill baseline: `{best}` (p99 median {float(np.median(base[best])):.3f} s)"]
    for label, v in sorted(post.items()):
        if is_baseline(label.split("|")[0]) or not v or len(v) != len(base[best]):
            continue
        q = [a / b for a, b in zip(v, base[best]) if b > 0]
        if q:
            out.append(f"- `{label}` / best post-kill baseline, p99 per seed: {float(np.median(q)):.2f}x "
                       f"({min(q):.2f}-{max(q):.2f})")
    return "\n".join(out)


def vs_best_lines(w: dict[str, Any]) -> str:
    b = w.get("best_baseline")
    if not b:
        return "- best baseline: (needs none or reactive in the run)"
    p99 = b["ttft_p99_s"]
    out = [f"- **best baseline**: `{b['policy']}` under `{b['router']}` (TTFT p99 {p99['median']:.3f} s, "
           f"min-max {p99['min']:.3f}-{p99['max']:.3f} over {p99['n']} seed(s))"]
    for k, r in sorted(w.get("vs_best", {}).items()):
        parts = [f"{m.replace('ttft_', '').replace('_s', '')} {v['median']:.2f}x ({v['min']:.2f}-{v['max']:.2f}, "
                 f"{'result: ' + v['verdict'] if v['verdict'] in ('lower', 'higher') else v['verdict']})"
                 for m, v in r.items()]
        out.append(f"- `{k}` / best baseline: TTFT " + "; ".join(parts))
    for k, r in sorted(w.get("per_router", {}).items()):
        v = r["ttft_p99_s"]
        out.append(f"- `{k}` (same router): TTFT p99 {v['median']:.2f}x ({v['min']:.2f}-{v['max']:.2f}, "
                   f"{v['verdict']})")
    floor = w.get("floor")
    if floor:
        f, r = floor["p99"], floor["vs_best"]
        out.append(f"- floor: no configuration's TTFT p99 goes under {f['median']:.3f} s ({f['min']:.3f}-"
                   f"{f['max']:.3f}), {r['median']:.2f}x the best baseline ({r['min']:.2f}-{r['max']:.2f}): each "
                   f"request's prefill of the tokens no earlier request had, nothing queued or loaded")
    bound = w.get("oracle_bound") or {}
    if bound:
        worse = [k for k, v in bound.items() if not v["at_or_below"]]
        out.append("- oracle p99 at or below every other configuration (within the spread)" if not worse else
                   f"- oracle p99 NOT at or below: {', '.join(worse)}")
    return "\n".join(out)


MEASURED_NOTE = """\
What is measured and what is modelled:

- **measured** on this machine: queue wait and KV fetch (the serving node's Lookup + Get, whose peer
  transfers -- reactive pulls, and the speculative/full/oracle copies they compete with -- cross links
  shaped to link x speedup / byte scale), both real seconds x speedup, so in trace time; router lookups;
  hit/miss block counts; bytes on the links by kind (scaled bytes that really moved; "unscaled" = x byte
  scale).
- **modelled** (cost model, unscaled): prefill of the uncached tokens, decode, and the load of local pages
  from the node's pool (host memory over PCIe, or HBM). Each engine has its own prefix cache, as vLLM
  and SGLang do (the HBM its GPUs leave for KV, least recently used out): a request that queued behind an
  earlier request on its engine computing the same prefix prefills only the rest ("engine-cached" blocks).
- TTFT = route + queue + KV fetch (measured, links included) + local load (modelled) + prefill (modelled).
  `ttft_link_*` keeps the old fully modelled variant.
- SLO = TTFT under `--slo-factor` x the request's own cold prefill; "cached-prefix" = requests whose prefix
  some node held at their Lookup; "recomputed cached tok" = tokens prefilled although a node held them.
"""


def _link_desc(cfg: dict[str, Any]) -> str:
    link = cfg.get("link")
    if not link:
        return ""
    return (f", preset `{link['preset']}`, {link['latency_s'] * 1e6:.0f} us one way, network "
            f"`{link['network']}` at {link['real_bytes_s'] / 1e6:.1f} MB/s real; pool medium "
            f"{cfg['cost'].get('pool_medium', 'host')}; routers {', '.join(cfg.get('routers', []))}; "
            f"seeds {cfg.get('seeds', [cfg.get('seed')])}")


def render(results: dict[str, Any]) -> str:
    """The whole report.md."""
    cfg = results["config"]
    simulated = bool(results.get("simulated"))
    title = ["# Trace replay -- SIMULATED", "",
             "**Simulated** (`kvctl replay --sim`, `kvstore/replay/sim.py`): no kvstored ran; the cluster, its "
             "links and its engines are a discrete-event model on a simulated clock. These are not measured "
             "numbers of the product.", ""] if simulated else ["# Trace replay", ""]
    where = f"{cfg['nodes']} simulated nodes (" if simulated else \
        f"{cfg['nodes']} real kvstored nodes on 127.0.0.1 (`--device {cfg['device']}`, "
    parts = [*title,
             f"{where}"
             f"transport {cfg['transport']}), router `{cfg['router']}`, preset `{cfg['preset']}` "
             f"({cfg['cost']['model']['name']} on {cfg['cost']['gpus']}x {cfg['cost']['hardware']['name']}: "
             f"{cfg['cost']['hardware']['flops'] / 1e12:.0f} TFLOP/s, MFU {cfg['cost']['hardware']['mfu']}, "
             f"HBM {cfg['cost']['hardware']['hbm_bytes_s'] / 1e12:.2f} TB/s; link "
             f"{cfg['cost']['hardware']['link_bytes_s'] / 1e9:.0f} GB/s per node and direction"
             f"{_link_desc(cfg)}), page "
             f"{cfg['cost']['page_bytes_unscaled'] / MiB:.0f} MiB modelled / "
             f"{cfg['cost']['page_bytes_scaled'] / 1024:.0f} KiB stored (byte scale {cfg['byte_scale']}), "
             f"speedup {cfg['speedup']}, concurrency {cfg['concurrency']} per engine. "
             f"All times in trace seconds.", "", MEASURED_NOTE]
    if any("capacity" in w for w in results["workloads"].values()):
        parts += ["## Capacity against engine-only, every workload", "", capacity_summary(results), ""]
    for name, w in results["workloads"].items():
        d = w["workload"]
        parts += [f"## {name}", "",
                  f"{d['requests']} requests over {d['duration_s']:.0f} s of trace, {d['blocks']} blocks; "
                  f"at most {100 * d['reusable_ratio']:.1f} % of blocks are reusable (an earlier request had "
                  f"them). Wall time {w.get('wall_s', 0):.0f} s.", "",
                  capacity_section(w, cfg) if "capacity" in w else
                  sweep_table(w) if w.get("runs") else table(w["policies"]), ""]
        problems = w.get("problems") or {}
        for policy, probs in problems.items():
            if probs:
                parts.append(f"- sanity ({policy}): {'; '.join(probs)}")
    return "\n".join(parts) + "\n"


def _x(r: dict[str, float] | None, fmt: str = ".2f", unit: str = "x") -> str:
    """A statistic's median and its range over seeds (a ratio by default), or '-'."""
    if r is None:
        return "-"
    if r["n"] < 2 or r["min"] == r["max"]:
        return f"{r['median']:{fmt}}{unit}"
    return f"{r['median']:{fmt}}{unit} ({r['min']:{fmt}}-{r['max']:{fmt}})"


def capacity_table(w: dict[str, Any]) -> str:
    """One row per configuration of a capacity search (medians over seeds, ranges in brackets), best
    first; the reference (engine-only's best router), the best baseline and the bound marked; the live
    attainment at the two knees where the live cluster ran."""
    cap = w["capacity"]
    live = w.get("live") or {}
    knee_cols = [(name, live[name]) for name in ("best_baseline", "best") if name in live]
    head = ("| configuration | capacity (rate scale) | req/s | vs engine-only | vs best baseline | TTFT p50 s | "
            "TTFT p99 s | attainment |" + "".join(f" live / sim attainment at {n.replace('_', ' ')}'s knee "
                                                   f"(x{k['rate_scale']:.3g}) |" for n, k in knee_cols))
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    marks = [(cap.get("reference"), " (1.0x)"), (cap.get("best_baseline"), " **best baseline**"),
             (cap.get("best"), " **best**"), (cap.get("bound"), " (bound)")]
    order = sorted(cap["configs"], key=lambda k: -cap["configs"][k]["rate_scale"]["median"])
    for label in order:
        c = cap["configs"][label]
        rs = c["rate_scale"]
        rng = _x(rs, ".3g", "") + ("+" if c["capped"] else "")
        mark = "".join(m for k, m in marks if k == label)
        row = (f"| `{label}`{mark} | {rng} | {c['requests_per_s']['median']:.3g} | {_x(c['vs_engine_only'])} | "
               f"{_x(c['vs_best_baseline'])} | {c['ttft_p50']['median']:.3f} | {c['ttft_p99']['median']:.3f} | "
               f"{100 * c['attainment']['median']:.0f} % |")
        for _, k in knee_cols:
            got = k["configs"].get(label)
            row += (f" {100 * got['live']['slo_attainment']:.0f} / {100 * got['simulated']['slo_attainment']:.0f} % |"
                    if got else " - |")
        lines.append(row)
    return "\n".join(lines)


def capacity_summary(results: dict[str, Any]) -> str:
    """One table over every workload of a capacity search: per configuration, its capacity as a ratio to
    engine-only's (median, range over seeds), the bound's ratio beside it, and the live attainment (live /
    simulated) at the best configuration's knee where the live cluster ran."""
    names = [n for n, w in results["workloads"].items() if "capacity" in w]
    labels: list[str] = []
    for n in names:
        labels += [k for k in results["workloads"][n]["capacity"]["configs"] if k not in labels]
    live_any = any(results["workloads"][n].get("live") for n in names)
    head = "| configuration |" + "".join(f" {n}: capacity vs engine-only |" + (" live / sim at the knee |"
                                                                              if live_any else "") for n in names)
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for label in labels:
        row = f"| `{label}` |"
        for n in names:
            w = results["workloads"][n]
            c = w["capacity"]["configs"].get(label)
            tags = [t for t, k in (("best baseline", "best_baseline"), ("best", "best"))
                    if w["capacity"].get(k) == label]
            row += f" {_x(c['vs_engine_only']) if c else '-'}{' (' + ', '.join(tags) + ')' if tags else ''} |"
            if live_any:
                got = ((w.get("live") or {}).get("best") or {}).get("configs", {}).get(label)
                row += (f" {100 * got['live']['slo_attainment']:.0f} / "
                        f"{100 * got['simulated']['slo_attainment']:.0f} % |" if got else " - |")
        lines.append(row)
    return "\n".join(lines)


def capacity_section(w: dict[str, Any], cfg: dict[str, Any]) -> str:
    """The capacity table and what it is read against."""
    s = cfg.get("search") or {}
    cap = w["capacity"]
    parts = [f"Capacity: the highest rate scale (the workload's requests that many times closer together) at "
             f"which at least {100 * s.get('slo_attainment', 0.9):.0f} % of the requests have a TTFT of at most "
             f"max({s.get('slo_ttft_s', 0):g} s, {s.get('slo_factor', 0):g} x their own cold prefill), "
             f"searched on the simulator per seed to {100 * s.get('resolution', 0.05):.0f} %; medians over "
             f"seeds, ranges in brackets. Ratios are per seed. `+`: met at the highest scale searched.", "",
             capacity_table(w), ""]
    if cap.get("bound"):
        b = cap["configs"][cap["bound"]]
        parts.append(f"- the bound (`{cap['bound']}`: every reusable block at hand for nothing on every node once it can exist) "
                     f"serves {b['rate_scale']['median']:.3g}x the workload's rate, "
                     f"{_x(b['vs_engine_only'])} of engine-only's capacity: no configuration can exceed it.")
    best, base = cap.get("best"), cap.get("best_baseline")
    if best and base:
        c = cap["configs"][best]
        parts.append(f"- best configuration `{best}`: {_x(c['vs_best_baseline'])} the best baseline `{base}`, "
                     f"{_x(c['vs_engine_only'])} engine-only.")
    return "\n".join(parts)


# ---- plots -------------------------------------------------------------------

def plot_capacity(path: Path, workload: str, cap: dict[str, Any], target: float | None = None) -> None:
    """Two panels over the first seed's probes: SLO attainment (with the ``target`` line) and TTFT p99
    against the rate scale, one line per configuration (log x)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter, ScalarFormatter

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.5))
    xs = [p["rate_scale"] for seeds in cap["per_seed"].values() for p in seeds[0]["probes"]] or [1.0]
    ticks = [t for t in (1 / 64, 1 / 16, 1 / 8, 0.25, 0.5, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64, 128, 256)
             if min(xs) <= t <= max(xs)]
    for label, seeds in cap["per_seed"].items():
        probes = sorted(seeds[0]["probes"], key=lambda p: p["rate_scale"])
        x = [p["rate_scale"] for p in probes]
        style = "--" if label.startswith("bound|") else "-"
        a1.plot(x, [100 * p["attainment"] for p in probes], style, marker=".", label=label)
        a2.plot(x, [max(p["ttft_p99_s"], 1e-4) for p in probes], style, marker=".", label=label)
    for ax in (a1, a2):
        ax.set_xscale("log")
        ax.set_xticks(ticks)
        ax.xaxis.set_major_formatter(ScalarFormatter())
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_xlabel("rate scale (x the workload's arrival rate)")
        ax.grid(True, which="both", alpha=0.3)
    if target is not None:
        a1.axhline(100 * target, color="black", lw=0.8, ls=":", label=f"target {100 * target:.0f} %")
    a1.set_ylabel("requests within the SLO (%)")
    a2.set_ylabel("TTFT p99 (trace s)")
    a2.set_yscale("log")
    a2.yaxis.set_major_formatter(ScalarFormatter())
    a2.yaxis.set_minor_formatter(ScalarFormatter())
    a1.set_title(f"{workload}: SLO attainment against load")
    a2.set_title(f"{workload}: TTFT p99 against load")
    a2.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


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
                  timeline: dict[str, Any], duration_s: float, records: Sequence[Any] = (),
                  page_bytes: float = 0.0, link_bytes_s: float = 0.0) -> None:
    """Four panels: arrivals, queue length and replicas held per node, and the links' utilisation by
    reactive pulls (each request's pulled bytes over its fetch interval, / the link rate) and, dashed,
    by every transfer (the node's peer-ingress counter sampled over the run: speculative and full copies
    included)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(4, 1, figsize=(9, 9.5), sharex=True)
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
        sunk = np.asarray(timeline.get("sunk_slots") or np.zeros_like(spec))
        for j, node in enumerate(node_ids):
            line, = axes[2].plot(st, rep[:, j] + spec[:, j], label=f"{node} replica+spec")
            axes[2].plot(st, spec[:, j], linestyle=":", color=line.get_color())
            if sunk.any():
                axes[2].plot(st, sunk[:, j], linestyle="--", color=line.get_color())
    axes[2].set_ylabel("replica pages (dotted: unread spec;\ndashed: copies sunk to disk)")
    if records and page_bytes and link_bytes_s:
        edges = np.linspace(0, max(duration_s, 1.0) * 1.2, 121)
        width = edges[1] - edges[0]
        for node in node_ids:
            busy = np.zeros(len(edges) - 1)
            for r in records:
                if r.node != node or not r.remote or not r.done:
                    continue
                t1 = r.first_token_at - r.prefill_s
                t0 = max(0.0, t1 - r.fetch_s)
                lo, hi = np.searchsorted(edges, t0) - 1, np.searchsorted(edges, t1)
                busy[max(0, lo):max(0, hi)] += r.remote * page_bytes / link_bytes_s / max(t1 - t0, width)
            axes[3].step(edges[:-1], np.minimum(busy, 5.0), where="post", label=node)
        axes[3].set_ylabel("ingress utilisation\n(reactive pulls;\ndashed: all transfers)")
    ingress = np.asarray(timeline.get("ingress_bytes", []), dtype=float)
    if link_bytes_s and st.size and ingress.ndim == 2 and len(ingress) == len(st) and len(st) > 1:
        # every byte a node received over links (reactive, speculative, full, oracle copies), from its counter
        rate = np.maximum(np.diff(ingress, axis=0), 0.0) / np.maximum(np.diff(st), 1e-9)[:, None] / link_bytes_s
        for j, _ in enumerate(node_ids):
            axes[3].step(st[:-1], np.minimum(rate[:, j], 5.0), where="post", linestyle="--", color=f"C{j}")
    axes[3].set_xlabel("trace seconds")
    axes[0].set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
