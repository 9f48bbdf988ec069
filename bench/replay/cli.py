"""``kvctl replay`` (= ``kvctl bench replay``) and ``kvctl trace synth``.

``replay`` runs every workload under every policy, each on a fresh local
cluster, and writes ``DIR/results.json``, ``DIR/report.md``, the plots,
per-request rows (``DIR/requests/``) and the daemons' logs (``DIR/logs/``).
Without ``--trace`` it replays the default pair of the main job: a window of
the Mooncake conversation trace and the synthetic fan-out workload.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import sys
import threading
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from bench.replay.cluster import ClusterSpec, LocalCluster
from bench.replay.costmodel import PRESETS, CostModel
from bench.replay.engine import Driver, RunConfig
from bench.replay.metrics import aggregate, check, cluster_summary
from bench.replay.report import plot_cdf, plot_timeline, ratios, render, table
from bench.replay.routers import ROUTERS, make_router
from bench.replay.workload import (
    DEFAULT_TRACE, ROOT, SynthSpec, Workload, mooncake_workload, synth_requests, synth_workload, write_mooncake,
)
from kvstore.units import parse_size

POLICIES = ("none", "reactive", "full", "predictive", "oracle")


def _synth_args(p: argparse.ArgumentParser, prefix: str = "") -> None:
    d = SynthSpec()
    p.add_argument(f"--{prefix}bursts", type=int, default=d.bursts, help="bursts (new shared prefixes)")
    p.add_argument(f"--{prefix}requests", type=int, default=d.requests, help="requests per burst")
    p.add_argument(f"--{prefix}prefix-tokens", type=int, default=d.prefix_tokens,
                   help="tokens of a burst's shared prefix (rounded up to 512-token blocks)")
    p.add_argument(f"--{prefix}window", type=float, default=d.window_s, help="seconds a burst's requests span")
    p.add_argument(f"--{prefix}decoys", type=int, default=d.decoys, help="prefixes requested twice, never again")
    p.add_argument(f"--{prefix}background", type=float, default=d.background, help="unique requests per second")
    p.add_argument(f"--{prefix}duration", type=float, default=d.duration_s, help="trace seconds")
    p.add_argument(f"--{prefix}suffix-tokens", type=int, default=d.suffix_tokens,
                   help="each request's own tokens after the prefix")
    p.add_argument(f"--{prefix}output-tokens", type=int, default=d.output_tokens, help="output tokens per request")


def _synth_spec(a: argparse.Namespace, prefix: str = "") -> SynthSpec:
    g = lambda name: getattr(a, prefix.replace("-", "_") + name)  # noqa: E731
    return SynthSpec(bursts=g("bursts"), requests=g("requests"), prefix_tokens=g("prefix_tokens"),
                     window_s=g("window"), decoys=g("decoys"), background=g("background"),
                     duration_s=g("duration"), suffix_tokens=g("suffix_tokens"), output_tokens=g("output_tokens"),
                     seed=a.seed)


def replay_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvctl replay", description=__doc__,
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    w = p.add_argument_group("workloads")
    w.add_argument("--trace", action="append", default=None, metavar="PATH|synth",
                   help="Mooncake-format jsonl (relative paths also resolve against the repository), or 'synth' "
                        "for the built-in fan-out generator; repeatable. Default: the conversation trace and synth")
    w.add_argument("--start", type=float, default=0.0, help="trace window start, trace seconds (jsonl traces)")
    w.add_argument("--window", type=float, default=120.0, help="trace window length, trace seconds (jsonl traces)")
    w.add_argument("--max-requests", type=int, default=None, help="at most this many requests per jsonl trace")
    w.add_argument("--speedup", "--time-scale", dest="speedup", type=float, default=4.0,
                   help="compress arrivals AND the engines' modelled sleeps by this factor (one factor for both, "
                        "so the load the trace implies is kept); reported times are rescaled to the trace")
    _synth_args(w, "synth-")
    c = p.add_argument_group("cluster and policies")
    c.add_argument("--nodes", type=int, default=4)
    c.add_argument("--policies", default=",".join(POLICIES), help="comma list of " + ",".join(POLICIES))
    c.add_argument("--router", default="cache-aware", choices=ROUTERS)
    c.add_argument("--balance-abs", type=float, default=32.0, help="cache-aware: imbalance if max-min load > this")
    c.add_argument("--balance-rel", type=float, default=1.5, help="... and max load > this x min load")
    c.add_argument("--match-threshold", type=float, default=0.0,
                   help="cache-aware: least-load unless the best prefix covers this share of the request")
    c.add_argument("--no-hints", action="store_true", help="cache-aware ignores pending/speculative placement hints")
    c.add_argument("--hint-cover", type=float, default=0.5, help="cache-aware: a hinted copy covering this share "
                   "of the longest cached prefix counts as holding all of it")
    c.add_argument("--predictor-depths", default="1,2,4,8,16", help="kvstored --predictor-depths for predictive "
                   "(16 lets the planner copy prefixes up to 8k tokens deep)")
    c.add_argument("--device", default="cpu", help="kvstored --device")
    c.add_argument("--capacity", default="256MiB", help="kvstored --capacity per node")
    c.add_argument("--transport", default="tcp", choices=["tcp", "ucx", "auto"])
    c.add_argument("--heartbeat", type=float, default=0.2, help="kvstored --heartbeat-interval (real s)")
    c.add_argument("--planner-tick", type=float, default=0.2, help="kvstored --planner-tick for predictive (real s)")
    c.add_argument("--spec-ttl", type=float, default=60.0, help="speculative replica TTL (real s), also the oracle's")
    c.add_argument("--oracle-lead", type=float, default=4.0, help="oracle decides and copies this long before "
                   "arrival (trace s)")
    c.add_argument("--kvstored-arg", action="append", default=[], help="extra kvstored flag (repeat; e.g. "
                   "--kvstored-arg=--spec-threshold=0.3)")
    e = p.add_argument_group("engines and cost model")
    e.add_argument("--preset", default="llama3-8b", choices=sorted(PRESETS))
    e.add_argument("--byte-scale", type=int, default=4096, help="stored page bytes = modelled page bytes / this")
    e.add_argument("--mfu", type=float, default=None, help="override the preset's prefill MFU")
    e.add_argument("--link-gbs", type=float, default=None, help="modelled node-to-node link, GB/s (default 50)")
    e.add_argument("--concurrency", type=int, default=8, help="slots (batch) per engine")
    e.add_argument("--fetch-timeout", type=float, default=5.0, help="Get deadline (real s)")
    o = p.add_argument_group("output")
    o.add_argument("--out", type=Path, default=ROOT / "bench" / "out" / "replay")
    o.add_argument("--seed", type=int, default=0)
    o.add_argument("--drain-timeout", type=float, default=120.0, help="real s to finish after the last arrival")
    o.add_argument("--no-plots", action="store_true")
    o.add_argument("--no-progress", action="store_true")
    return p


def build_workloads(a: argparse.Namespace) -> list[Workload]:
    out = []
    for t in a.trace or [DEFAULT_TRACE, "synth"]:
        if t == "synth":
            out.append(synth_workload(_synth_spec(a, "synth-")))
        else:
            wl = mooncake_workload(t, a.start, a.window, a.max_requests)
            if wl.name.startswith("mooncake_"):
                wl.name = wl.name[len("mooncake_"):]
            out.append(wl)
    names = [w.name for w in out]
    for i, w in enumerate(out):  # unique names
        if names.count(w.name) > 1:
            w.name = f"{w.name}-{i}"
    return out


def run_policy(wl: Workload, policy: str, a: argparse.Namespace, cost: CostModel, progress: Any) -> dict[str, Any]:
    """One fresh cluster, one replay; returns the summary, the records and the timeline."""
    from kvstore.loops import loop_factory

    spec = ClusterSpec(nodes=a.nodes, policy="reactive" if policy == "oracle" else policy, namespace=a.preset,
                       page_bytes=cost.scaled_page_bytes, capacity=a.capacity, device=a.device,
                       transport=a.transport, heartbeat_interval=a.heartbeat,
                       heartbeat_timeout=max(3.0, 10 * a.heartbeat), planner_tick=a.planner_tick,
                       spec_ttl=a.spec_ttl, predictor_depths=a.predictor_depths, extra=list(a.kvstored_arg))
    router = make_router(a.router, a.balance_abs, a.balance_rel, not a.no_hints, a.match_threshold, a.hint_cover)
    cfg = RunConfig(policy=policy, router=router, cost=cost, namespace=a.preset, speedup=a.speedup,
                    concurrency=a.concurrency, oracle_lead_s=a.oracle_lead, spec_ttl_s=a.spec_ttl,
                    fetch_timeout_s=a.fetch_timeout, drain_timeout_s=a.drain_timeout)
    with LocalCluster(spec, a.out / "logs" / f"{wl.name}-{policy}") as cluster:  # stops the daemons on any exit
        ids = [n.node_id for n in cluster.nodes]
        driver = Driver(wl, ids, [n.address for n in cluster.nodes], cfg, progress)
        with asyncio.Runner(loop_factory=loop_factory("auto")) as runner:
            result = runner.run(driver.run())
        coordinator_metrics = cluster.scrape(0)
    summary = aggregate(result.records, cluster_summary(
        policy, result.node_stats, coordinator_metrics, cost.scaled_page_bytes, cost.byte_scale,
        result.oracle.get("copied_pages", 0), result.placed_used_pages))
    summary.update(put_errors=result.put_errors, wall_s=round(result.wall_s, 2), oracle=result.oracle,
                   daemon_args=spec.args("nX"))
    return {"summary": summary, "records": result.records, "timeline": result.timeline, "node_ids": ids}


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def replay_main(argv: list[str] | None = None) -> int:
    a = replay_parser().parse_args(argv)
    if threading.current_thread() is not threading.main_thread():
        return _replay(a)
    # SIGTERM (and a SIGINT that a parent shell set to ignore) unwinds like Ctrl-C, so the daemons get stopped
    old = {sig: signal.signal(sig, _interrupt) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        return _replay(a)
    except KeyboardInterrupt as exc:
        print(f"kvctl replay: interrupted ({exc or 'Ctrl-C'}); daemons stopped; partial results in {a.out}",
              file=sys.stderr)
        return 130
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)


def _replay(a: argparse.Namespace) -> int:
    policies = [p.strip() for p in a.policies.split(",") if p.strip()]
    bad = [p for p in policies if p not in POLICIES]
    if bad or not policies:
        print(f"kvctl replay: unknown policies {bad}; choose from {','.join(POLICIES)}", file=sys.stderr)
        return 2
    if a.nodes < 1 or a.speedup <= 0 or a.concurrency < 1:
        print("kvctl replay: --nodes, --speedup and --concurrency must be positive", file=sys.stderr)
        return 2
    try:
        cost = CostModel.preset(a.preset, a.byte_scale, a.mfu, a.link_gbs)
        workloads = build_workloads(a)
        parse_size(a.capacity)
    except (ValueError, OSError) as exc:
        print(f"kvctl replay: {exc}", file=sys.stderr)
        return 2
    from tqdm import tqdm

    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "requests").mkdir(exist_ok=True)
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items()}
    config.update(trace=a.trace or [DEFAULT_TRACE, "synth"], policies=policies, cost=cost.describe(),
                  cpus=os.cpu_count(), platform=platform.platform(),
                  python=platform.python_version())
    results: dict[str, Any] = {"config": config, "workloads": {}}
    started = time.perf_counter()
    total = sum(len(w.requests) for w in workloads) * len(policies)
    bar = tqdm(total=total, desc="replay", unit="req", disable=a.no_progress, dynamic_ncols=True,
               mininterval=0.5 if sys.stderr.isatty() else 10.0)
    try:
        for wl in workloads:
            w_start = time.perf_counter()
            entry: dict[str, Any] = {"workload": wl.describe(), "policies": {}, "problems": {}}
            results["workloads"][wl.name] = entry
            ttfts: dict[str, list[float]] = {}
            for policy in policies:
                bar.set_description(f"{wl.name}/{policy}")
                run = run_policy(wl, policy, a, cost, bar)
                s = run["summary"]
                entry["policies"][policy] = s
                entry["problems"][policy] = check(s)
                entry["node_ids"] = run["node_ids"]
                ttfts[policy] = [r.ttft_s for r in run["records"] if r.done and not r.error]
                with open(a.out / "requests" / f"{wl.name}-{policy}.jsonl", "w") as f:
                    for r in run["records"]:
                        f.write(json.dumps(r.row()) + "\n")
                if not a.no_plots:
                    arrivals: dict[str, list[float]] = {}
                    for r in run["records"]:
                        arrivals.setdefault(r.node, []).append(r.t)
                    plot_timeline(a.out / f"{wl.name}_{policy}_timeline.png", f"{wl.name} / {policy}",
                                  run["node_ids"], arrivals, run["timeline"], wl.duration_s)
                bar.write(f"{wl.name:>14} {policy:<10} TTFT p50 {s['ttft_p50_s']:.3f}s p99 {s['ttft_p99_s']:.3f}s "
                          f"local {s['local_hit_ratio']:.2f} remote {s['remote_hit_ratio']:.2f} "
                          f"miss {s['miss_ratio']:.2f} ({s['completed']}/{s['requests']} done, {s['wall_s']:.0f}s)")
                entry["ratios"] = ratios(entry["policies"])
                entry["wall_s"] = time.perf_counter() - w_start
                _write(a.out / "results.json", results)
            if not a.no_plots:
                plot_cdf(a.out / f"{wl.name}_ttft_cdf.png", f"TTFT CDF: {wl.name} ({a.router})", ttfts)
    finally:
        bar.close()
        results["wall_s"] = time.perf_counter() - started
        if results["workloads"]:
            _write(a.out / "results.json", results)
            (a.out / "report.md").write_text(render(results))
    print()
    for name, w in results["workloads"].items():
        print(f"## {name} ({w['workload']['requests']} requests; times in trace seconds)")
        print(table(w["policies"]))
        for k, r in w.get("ratios", {}).items():
            print(f"  {k}: TTFT p50 {_r(r['ttft_p50_s'])} p99 {_r(r['ttft_p99_s'])} mean {_r(r['ttft_mean_s'])}")
        print()
    print(f"wrote {a.out / 'results.json'} and {a.out / 'report.md'} in {results['wall_s']:.0f}s")
    problems = {f"{w}/{p}": v for w, e in results["workloads"].items() for p, v in e["problems"].items() if v}
    if problems:
        print(f"sanity problems: {problems}", file=sys.stderr)
        return 1
    return 0


def _r(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"


def _write(path: Path, obj: dict[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(obj, indent=1, default=str))
    tmp.replace(path)


def trace_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvctl trace", description="Trace tools.")
    sub = p.add_subparsers(dest="action", required=True)
    s = sub.add_parser("synth", help="write the synthetic same-prefix fan-out workload as Mooncake jsonl",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    _synth_args(s)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--out", type=Path, required=True, help="jsonl file to write")
    return p


def trace_main(argv: list[str] | None = None) -> int:
    a = trace_parser().parse_args(argv)
    spec = _synth_spec(a)
    reqs = synth_requests(spec)
    n = write_mooncake(reqs, a.out)
    blocks = sum(len(r.hash_ids) for r in reqs)
    print(f"wrote {n} requests ({blocks} blocks of 512 tokens, {reqs[-1].t if reqs else 0:.1f}s) to {a.out}: "
          f"{json.dumps(asdict(spec))}")
    return 0


if __name__ == "__main__":
    sys.exit(replay_main())
