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

from kvstore.replay.claiming import margin_for, split_policy
from kvstore.replay.cluster import LocalCluster
from kvstore.replay.config import (POLICIES, TIER_POLICIES, ReplayConfig, add_daemon_overrides, cluster_and_router,
                                   link_of)
from kvstore.replay.costmodel import LINKS, PRESETS, CostModel
from kvstore.replay.engine import Driver, RunConfig
from kvstore.replay.metrics import after_kill, aggregate, check, cluster_summary, metric_sum, replica_fields
from kvstore.replay.report import (capacity_summary, capacity_table, plot_capacity, plot_cdf, plot_timeline,
                                   ratios, render, sweep_table)
from kvstore.replay.routers import ROUTERS
from kvstore.replay.sim import run_policy_sim
from kvstore.replay.sim_report import compare_section
from kvstore.replay.sweep import compare, key, router_configs
from kvstore.replay.workload import (
    SynthSpec, Workload, mooncake_workload, shape_requests, shape_workload, synth_requests,
    synth_workload, write_mooncake,
)
from kvstore.workloads.shapes import SHAPES


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


def _synth_spec(a: argparse.Namespace | ReplayConfig, prefix: str = "") -> SynthSpec:
    g = lambda name: getattr(a, prefix.replace("-", "_") + name)  # noqa: E731
    return SynthSpec(bursts=g("bursts"), requests=g("requests"), prefix_tokens=g("prefix_tokens"),
                     window_s=g("window"), decoys=g("decoys"), background=g("background"),
                     duration_s=g("duration"), suffix_tokens=g("suffix_tokens"), output_tokens=g("output_tokens"),
                     seed=a.seed)


def replay_parser() -> argparse.ArgumentParser:
    """A stand-alone parser of ``kvctl replay``'s options (kvctl builds its sub-command the same way)."""
    p = argparse.ArgumentParser(prog="kvctl replay", description=__doc__,
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_replay_arguments(p)
    return p


def add_replay_arguments(p: argparse.ArgumentParser) -> None:
    """Add ``kvctl replay``'s options to ``p``; their dests are :class:`ReplayConfig`'s field names.

    Give ``p`` ``formatter_class=argparse.ArgumentDefaultsHelpFormatter``: the help texts leave the defaults to it.
    """
    w = p.add_argument_group("workloads")
    w.add_argument("--trace", action="append", default=None, metavar="NAME|PATH|synth|SHAPE",
                   help="'conversation' (the shipped Mooncake conversation trace), a Mooncake-format jsonl file, "
                        "'synth' for the built-in fan-out generator, or a workload shape (" + ", ".join(SHAPES) +
                        "; 'mixed' overlays fan-out bursts on the conversation window); repeatable. "
                        "Default: conversation and synth")
    w.add_argument("--start", type=float, help="trace window start, trace seconds (jsonl traces)")
    w.add_argument("--window", type=float, help="trace window length, trace seconds (jsonl traces)")
    w.add_argument("--max-requests", type=int, help="at most this many requests per jsonl trace")
    w.add_argument("--speedup", "--time-scale", dest="speedup", type=float,
                   help="compress arrivals AND the engines' modelled sleeps by this factor (one factor for both, "
                        "so the load the trace implies is kept); reported times are rescaled to the trace")
    w.add_argument("--quiet", type=float, metavar="SECONDS", help="--trace recurring: its bursts this far apart "
                   "over a heavy background of long unique prompts (kvstore/workloads/shapes.py), so other traffic "
                   "pushes a prefix out of the pools between its bursts; 0: the compact default")
    w.add_argument("--rate-scale", type=float, metavar="X",
                   help="load: X times the workload's arrival rate (the same requests, X times closer together; "
                        "the engines' costs unchanged), for every workload, simulated and live; composes with "
                        "--speedup")
    w.add_argument("--burstiness", type=float, help="synthetic arrivals (synth and the shapes): gamma "
                   "inter-arrivals of this shape, the same mean rate; 1.0 is Poisson, under 1 burstier (as "
                   "vllm bench serve --burstiness)")
    _synth_args(w, "synth-")
    c = p.add_argument_group("cluster and policies")
    c.add_argument("--nodes", type=int)
    c.add_argument("--policies", help="comma list of " + ",".join(POLICIES) +
                   "; each but oracle may take +claims (engines claim their prefills and wait for each other's)")
    c.add_argument("--claim-margin",
                   help="+claims: an engine waits for another's prefill, or for a copy on its way to it, when "
                        "the wait < this x its own queue + prefill (with prefill queued; 1 with none); auto: 1.0 "
                        "(wait only where it is expected to be faster). Pulls take no margin: a prefix another "
                        "node holds is pulled only where the pull beats computing it")
    c.add_argument("--configs", metavar="POLICY|ROUTER,...", help="the configurations to run, instead of every "
                   "--policies under every --routers: e.g. 'engine-only|kv-router,reactive|mooncake,"
                   "predictive+claims|cache-aware@32,bound' (cache-aware@N: its --balance-abs; the oracle and the "
                   "bound route themselves)")
    c.add_argument("--router", choices=ROUTERS, help="the router (see --routers)")
    c.add_argument("--routers", help="comma list of routers; every policy runs under each "
                   "(the oracle routes itself). Default: --router")
    c.add_argument("--balance-abs", help="cache-aware: imbalance if max-min load > this; a comma "
                   "list (e.g. 4,8,16,32) runs cache-aware once per threshold")
    c.add_argument("--balance-rel", type=float, help="... and max load > this x min load")
    c.add_argument("--match-threshold", type=float,
                   help="cache-aware: least-load unless the best prefix covers this share of the request")
    c.add_argument("--no-hints", action="store_true", help="cache-aware ignores pending/speculative placement hints")
    c.add_argument("--hint-cover", type=float, help="cache-aware: a hinted copy covering this share "
                   "of the longest cached prefix counts as holding all of it")
    c.add_argument("--capacity", help="kvstored --capacity per node (real bytes); auto: 1 TiB "
                   "modelled, i.e. 1 TiB / --byte-scale; preset: the host memory a node of the preset gives KV "
                   "(docs/benchmarks.md, 'Node storage'), scaled the same way")
    c.add_argument("--tier-policies", metavar="LIST", help="tiers below each node's pool, a comma list, each run "
                   "with every policy but the oracle (its label gets the suffix, as +claims): " +
                   ", ".join(TIER_POLICIES) + ". single-tier: the pool only; tiers-lru: a disk tier of the "
                   "preset's NVMe (its bytes scaled, slab files under --out, reads and writes paced at the drives' "
                   "rated rates like the links) taking every page the pool evicts; tiers-freq: the same disk "
                   "taking only pages read since they were stored (kvstored --tier-admit reused); tiers-budget: "
                   "every page while one drive write a day pays for it (--tier-admit budget); "
                   "tiers-predictive: the same disk taking the classes of page most often asked for again within "
                   "600 trace s, as each node learns them, within one drive write a day (--tier-admit predicted)"),
    c.add_argument("--network", choices=["shaped", "netns", "none"],
                   help="how node-to-node bytes cost time: shaped = a fair link shaper in each kvstored's peer "
                        "transport (any user); netns = each kvstored in its own network namespace on a bridge "
                        "with tc on its veth (root, iproute2; TCP transport); none = loopback, free")
    c.add_argument("--link", choices=sorted(LINKS),
                   help="link preset per node and direction: " + ", ".join(
                       f"{k} {v[0] / 1e9:g} GB/s" for k, v in LINKS.items()))
    c.add_argument("--link-latency-us", type=float, help="one-way link latency, us (default: preset)")

    c.add_argument("--heartbeat-timeout", type=float, help="kvstored --heartbeat-timeout in trace s "
                   "(a fleet's membership timeout): the daemons get it divided by --speedup, as every other time of "
                   "the replay, but at least 4 real heartbeats")
    c.add_argument("--oracle-lead", type=float, help="the oracle copies a prefix to a request's node "
                   "no earlier than this before the request arrives (trace s)")
    c.add_argument("--kill", action="append", default=[], metavar="NODE@T",
                   help="failover: SIGKILL node NODE (n3, or 3) at trace second T of every run (repeatable); the "
                        "report gives TTFT in the 30 s after it; the engine in front of it recomputes")
    c.add_argument("--join", action="append", default=[], metavar="NODE@T",
                   help="scale-out: node NODE (of --nodes) starts absent and joins the running cluster at trace second "
                        "T (repeatable; --nodes 9 --join n8@60: eight nodes, a ninth joins at 60 s); the report gives "
                        "its hit ratio and TTFT over its first minute against the nodes already serving (simulated "
                        "only; kvstored --join-warm sets how long it is warmed from the forecast before routers use "
                        "it, 0: a cold join)")
    add_daemon_overrides(c)
    c.add_argument("--kvstored-arg", action="append", default=[], help="extra kvstored flag (repeat; e.g. "
                   "--kvstored-arg=--spec-threshold=0.3)")
    e = p.add_argument_group("engines and cost model")
    e.add_argument("--preset", choices=sorted(PRESETS))
    e.add_argument("--byte-scale", help="stored page bytes = modelled page bytes / this; auto: "
                   "the scale that stores 4 KiB pages (40960 for the 70B presets, 16384 for llama3-8b; runs before "
                   "2026-12-02 used 4096)")
    e.add_argument("--mfu", type=float, help="override the preset's prefill MFU")
    e.add_argument("--link-gbs", type=float, help="node-to-node link, GB/s (overrides --link's rate)")
    e.add_argument("--pool-medium", choices=["auto", "host", "hbm"],
                   help="where a node's pool lives, for the modelled load of local pages into the engine: host "
                        "memory over PCIe or HBM (auto: hbm for a cuda device, else host)")
    e.add_argument("--slo-factor", type=float, help="SLO: TTFT at most the larger of --slo-ttft and this x "
                   "the request's own cold prefill")
    e.add_argument("--slo-ttft", type=float, metavar="SECONDS", help="SLO: a TTFT every request may take, "
                   "however short its prompt (an idle cluster meets it: a short prompt's TTFT is mostly round "
                   "trips, not its prefill)")
    e.add_argument("--concurrency", type=int, help="slots (batch) per engine")
    e.add_argument("--fetch-timeout", type=float, help="Get deadline (real s)")
    e.add_argument("--data-connections", type=int,
                   help="data-channel connections per engine's client (AsyncKvClient data_connections): 1 runs "
                        "its Gets in turn, more side by side")
    e.add_argument("--shared-save", action="store_true",
                   help="Puts on the engine's one client with its Gets (before 2026-12-02), not on a client of "
                        "their own as the vLLM connector saves")
    o = p.add_argument_group("output")
    o.add_argument("--out", type=Path,
                   help="folder for results.json, report.md, the plots and the daemons' logs")
    o.add_argument("--seed", type=int)
    o.add_argument("--repeats", type=int, help="run every configuration with this many seeds "
                   "(seed, seed+1, ...); ratios carry median and min-max")
    o.add_argument("--drain-timeout", type=float, help="real s to finish after the last arrival")
    o.add_argument("--no-plots", action="store_true")
    o.add_argument("--no-progress", action="store_true")
    k = p.add_argument_group("capacity")
    k.add_argument("--search", choices=["capacity"], help="capacity: per configuration, the highest --rate-scale "
                   "at which at least --slo-attainment of the requests meet the SLO, by bisection on the simulator "
                   "(per seed; ratios to engine-only and to the best baseline); without --sim, engine-only's best "
                   "router, the best baseline and the best configuration then run live (first seed) once at the "
                   "best baseline's capacity and once at the best configuration's")
    k.add_argument("--jobs", type=int, help="capacity: searches run at once on the simulator (0: one per core)")
    k.add_argument("--slo-attainment", type=float, help="capacity: the share of requests that must meet the SLO")
    k.add_argument("--search-resolution", type=float, help="capacity: bisect until the bracket's upper end is "
                   "within this share of its lower end")
    m = p.add_argument_group("simulation")
    m.add_argument("--sim", action="store_true", help="simulate the cluster instead of starting kvstored processes: "
                   "the same workloads, routers, cost model, predictor, planner, directory and link model on a "
                   "simulated clock, seconds per run; results.json is marked \"simulated\": true")
    m.add_argument("--sim-compare", action="store_true", help="run every configuration for real AND simulated; the "
                   "report shows the simulated numbers beside the measured ones (results.json: sim_compare)")
    m.add_argument("--sim-rpc-ms", type=float,
                   help="simulation: real ms one KV round trip (Lookup, Get, Put, Replicate) costs, x speedup in "
                        "trace time like every measured wait")
    r = p.add_argument_group("regime map")
    r.add_argument("--regimes", action="store_true", help="run the regime map instead of one replay: the synthetic "
                   "fan-out over a grid of shared context x link x nodes x burst size x burst window, each cell every "
                   "--policies under every --routers (kvstore/replay/regimes.py); resumes what --out holds")
    r.add_argument("--regimes-axis", action="append", default=[], metavar="NAME=V1,V2",
                   help="replace an axis's values (context, link, nodes, burst, window); repeatable")
    r.add_argument("--regimes-jobs", type=int, default=0, help="cells run at once (0: one per core with --sim, "
                   "else 1)")
    r.add_argument("--regimes-seeds", type=int, default=3, help="seeds each cell runs (a cell is judged on their "
                   "median)")
    r.add_argument("--regimes-loads", default="0.5,0.8,1.0", metavar="S1,S2",
                   help="at load (--regimes --search capacity): each cell also replays at these shares of "
                        "engine-only's capacity in the cell")
    p.set_defaults(**ReplayConfig.flag_defaults())


def build_workloads(a: ReplayConfig, seed: int | None = None) -> list[Workload]:
    seed = a.seed if seed is None else seed
    out = []
    bursty = {"burstiness": a.burstiness} if a.burstiness != 1.0 else {}
    for t in a.trace:
        if t == "synth":
            spec = _synth_spec(a, "synth-")
            out.append(synth_workload(SynthSpec(**{**asdict(spec), "seed": seed}), burstiness=a.burstiness))
        elif t in SHAPES:
            out.append(shape_workload(t, seed, **({"quiet_s": a.quiet} if t == "recurring" and a.quiet else {}),
                                      **bursty))
        else:
            wl = mooncake_workload(t, a.start, a.window, a.max_requests)
            if wl.name.startswith("mooncake_"):
                wl.name = wl.name[len("mooncake_"):]
            out.append(wl)
    if a.rate_scale != 1.0:
        out = [w.at_rate(a.rate_scale) for w in out]
    names = [w.name for w in out]
    for i, w in enumerate(out):  # unique names
        if names.count(w.name) > 1:
            w.name = f"{w.name}-{i}"
    return out


def run_policy(wl: Workload, policy: str, router_cfg: tuple[str, str, float], a: ReplayConfig,
               cost: CostModel, progress: Any, log_name: str) -> dict[str, Any]:
    """One fresh cluster, one replay; returns the summary, the records and the timeline."""
    from kvstore.loops import loop_factory

    spec, router = cluster_and_router(a, policy, router_cfg, cost)
    base, claims = split_policy(policy)
    cfg = RunConfig(policy=base, claims=claims, claim_margin=margin_for(a.claim_margin),
                    link_bytes_s=link_of(a)[0],
                    router=router, cost=cost, namespace=a.preset, speedup=a.speedup,
                    concurrency=a.concurrency, oracle_lead_s=a.oracle_lead, spec_ttl_s=a.spec_ttl,
                    fetch_timeout_s=a.fetch_timeout, data_connections=a.data_connections,
                    save_client=not a.shared_save, drain_timeout_s=a.drain_timeout, kills=list(a.kills))
    with LocalCluster(spec, a.out / "logs" / log_name) as cluster:  # stops the daemons on any exit
        cfg.kill = cluster.kill
        ids = [n.node_id for n in cluster.nodes]
        network = cluster.network()
        def ingress(i: int) -> float:  # a node's peer ingress so far, scaled bytes
            return metric_sum(cluster.scrape(i), "kvstore_peer_bytes_total", {"direction": "in"})
        driver = Driver(wl, ids, [n.address for n in cluster.nodes], cfg, progress, ingress)
        cpu_before = cluster.cpu_seconds()
        with asyncio.Runner(loop_factory=loop_factory("auto")) as runner:
            result = runner.run(driver.run())
        cpu = [max(0.0, b - a) for a, b in zip(cpu_before, cluster.cpu_seconds())]
        coordinator_metrics = cluster.scrape(0)
        link_bytes = sum(metric_sum(cluster.scrape(i), "kvstore_peer_bytes_total", {"direction": "in"})
                         for i in range(len(ids)) if i not in result.killed)
    summary = aggregate(result.records, cluster_summary(
        base, result.node_stats, coordinator_metrics, cost.scaled_page_bytes, cost.byte_scale,
        result.oracle.get("copied_pages", 0), result.placed_used_pages, link_bytes, link_of(a)[0]),
        slo_factor=a.slo_factor, gpus=cost.gpus, block_tokens=cost.block_tokens,
        slo_ttft=a.slo_ttft)
    summary.update(replica_fields(result.timeline, cost.page_bytes))
    summary.update(put_errors=result.put_errors, wall_s=round(result.wall_s, 2), oracle=result.oracle,
                   daemon_args=spec.args("nX"), router=router_cfg[0], network=network,
                   # the daemons' CPU over the replay (real s; n0 is the coordinator): a cost the simulator
                   # does not see, and on this machine all daemons share its cores
                   daemon_cpu_s=round(sum(cpu), 2), coordinator_cpu_s=round(cpu[0], 2) if cpu else 0.0)
    if cfg.kills:
        summary["failover"] = [after_kill(result.records, ids[i], t) for i, t in cfg.kills]
    return {"summary": summary, "records": result.records, "timeline": result.timeline, "node_ids": ids}


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def replay_main(argv: list[str] | None = None) -> int:
    """``kvctl replay`` on an argument list (tests and scripts; kvctl itself calls :func:`run_replay`)."""
    return run_replay(replay_parser().parse_args(argv))


def run_replay(args: argparse.Namespace) -> int:
    """Run the replay the parsed options describe (those of :func:`add_replay_arguments`; other attributes,
    such as kvctl's own ``command`` and ``fn``, are ignored); returns the process exit code."""
    try:
        a = ReplayConfig.from_args(args)
    except (ValueError, OSError) as exc:
        print(f"kvctl replay: {exc}", file=sys.stderr)
        return 2
    if getattr(args, "regimes", False):
        from kvstore.replay import regimes

        try:
            loads = tuple(float(x) for x in args.regimes_loads.split(",") if x.strip())
        except ValueError:
            print(f"kvctl replay: --regimes-loads {args.regimes_loads!r}: numbers, e.g. 0.5,0.8,1.0", file=sys.stderr)
            return 2
        return regimes.main(_replay, a, args.regimes_axis, args.regimes_jobs,
                            args.regimes_seeds, sys.argv[1:], loads)
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


def _replay(a: ReplayConfig) -> int:
    policies = a.policy_list()
    balance = a.balances()
    try:
        cost = a.cost()
        seeds = [a.seed + k for k in range(a.repeats)]
        workloads_by_seed = {seed: build_workloads(a, seed) for seed in seeds}
    except (ValueError, OSError) as exc:
        print(f"kvctl replay: {exc}", file=sys.stderr)
        return 2
    from tqdm import tqdm

    configs = router_configs(a.router_list(), balance)
    plan = a.run_plan()  # (policy, router config) per run
    if a.configs:
        policies = list(dict.fromkeys(p for p, _ in plan))
        configs = list(dict.fromkeys(rc for _, rc in plan if rc[0] != "plan")) or configs
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "requests").mkdir(exist_ok=True)
    config = a.to_json()
    rate, latency = link_of(a)
    config.update(trace=list(a.trace), policies=policies, cost=cost.describe(),
                  routers=[c[0] for c in configs], seeds=seeds,
                  link={"preset": a.link, "bytes_s": rate, "latency_s": latency, "network": a.network,
                        "real_bytes_s": rate * a.speedup / cost.byte_scale},
                  cpus=os.cpu_count(), platform=platform.platform(), python=platform.python_version())
    results: dict[str, Any] = {"config": config, "workloads": {}}
    if a.search == "capacity":
        return _capacity(a, cost, workloads_by_seed, plan, results)
    if a.sim:
        results["simulated"] = True  # no kvstored ran: every number below comes from kvstore/replay/sim.py
    runner = run_policy_sim if a.sim else run_policy
    started = time.perf_counter()
    total = sum(len(w.requests) for ws in workloads_by_seed.values() for w in ws) * len(plan)
    bar = tqdm(total=total, desc="replay", unit="req", disable=a.no_progress, dynamic_ncols=True,
               mininterval=0.5 if sys.stderr.isatty() else 10.0)
    try:
        for wi, wl0 in enumerate(workloads_by_seed[seeds[0]]):
            w_start = time.perf_counter()
            entry: dict[str, Any] = {"workload": wl0.describe(), "policies": {}, "problems": {}, "runs": {}}
            results["workloads"][wl0.name] = entry
            ttfts: dict[str, list[float]] = {}
            for seed in seeds:
                wl = workloads_by_seed[seed][wi]
                for policy, rc in plan:
                    label = key(policy, rc[0])
                    bar.set_description(f"{wl.name}/{label}/s{seed}")
                    run = runner(wl, policy, rc, a, cost, bar, f"{wl.name}-{policy}-{rc[0]}-s{seed}")
                    s = run["summary"]
                    if a.sim_compare:  # the simulated twin of this run, for the calibration table
                        twin = run_policy_sim(wl, policy, rc, a, cost)["summary"]
                        twin["seed"] = seed
                        entry.setdefault("sim_compare", {}).setdefault(label, []).append(twin)
                    s["seed"] = seed
                    entry["runs"].setdefault(label, []).append(s)
                    entry["problems"][f"{label}/s{seed}"] = check(s)
                    entry["node_ids"] = run["node_ids"]
                    primary = rc[0] in (configs[0][0], "plan")
                    if seed == seeds[0] and primary:
                        entry["policies"][policy] = s  # the first router's runs, as before
                    tag = "" if primary else f"-{rc[0]}"  # the first router keeps the old file names
                    again = "" if seed == seeds[0] else f"-s{seed}"  # and the first seed; every seed's rows are kept
                    with open(a.out / "requests" / f"{wl.name}-{policy}{tag}{again}.jsonl", "w") as f:
                        for r in run["records"]:
                            f.write(json.dumps(r.row()) + "\n")
                    if seed == seeds[0]:
                        ttfts[label] = [r.ttft_s for r in run["records"] if r.done and not r.error]
                        if not a.no_plots:
                            arrivals: dict[str, list[float]] = {}
                            for r in run["records"]:
                                arrivals.setdefault(r.node, []).append(r.t)
                            plot_timeline(a.out / f"{wl.name}_{policy}{tag.replace('-', '_', 1)}_timeline.png",
                                          f"{wl.name} / {policy} / {rc[0]}", run["node_ids"], arrivals,
                                          run["timeline"], wl.duration_s, run["records"],
                                          cost.page_bytes, rate)
                    bar.write(f"{wl.name:>14} {label:<28} s{seed} TTFT p50 {s['ttft_p50_s']:.3f}s "
                              f"p99 {s['ttft_p99_s']:.3f}s local {s['local_hit_ratio']:.2f} "
                              f"remote {s['remote_hit_ratio']:.2f} miss {s['miss_ratio']:.2f} "
                              f"({s['completed']}/{s['requests']} done, {s['wall_s']:.0f}s)")
                    entry["ratios"] = ratios(entry["policies"])
                    entry.update(compare(entry["runs"]))
                    entry["wall_s"] = time.perf_counter() - w_start
                    _write(a.out / "results.json", results)
            if not a.no_plots:
                plot_cdf(a.out / f"{wl0.name}_ttft_cdf.png", f"TTFT CDF: {wl0.name} (seed {seeds[0]})", ttfts)
    finally:
        bar.close()
        results["wall_s"] = time.perf_counter() - started
        if results["workloads"]:
            _write(a.out / "results.json", results)
            (a.out / "report.md").write_text(render(results) + compare_section(results))
    print()
    for name, w in results["workloads"].items():
        print(f"## {name} ({w['workload']['requests']} requests; times in trace seconds)")
        print(sweep_table(w))
        print()
    return _finish(a, results)


def _capacity(a: ReplayConfig, cost: CostModel, workloads_by_seed: dict[int, list[Workload]],
              plan: list[tuple[str, tuple[str, str, float]]], results: dict[str, Any]) -> int:
    """``--search capacity``: each configuration's capacity per seed on the simulator, then (without
    ``--sim``) engine-only's best router, the best baseline and the best configuration live, on the first
    seed, once at the best baseline's knee and once at the best configuration's, beside the simulated run at
    the same load (kvstore/replay/capacity.py)."""
    from tqdm import tqdm

    from kvstore.replay import capacity

    seeds = sorted(workloads_by_seed)
    results["simulated"] = bool(a.sim)  # the search is simulated; the live check, when run, says so itself
    results["config"]["search"] = {"kind": "capacity", "slo_attainment": a.slo_attainment,
                                   "resolution": a.search_resolution, "slo_ttft_s": a.slo_ttft,
                                   "slo_factor": a.slo_factor}
    started = time.perf_counter()
    bar = tqdm(total=len(workloads_by_seed[seeds[0]]) * len(seeds) * len(plan), desc="capacity", unit="config",
               disable=a.no_progress, dynamic_ncols=True, mininterval=0.5 if sys.stderr.isatty() else 10.0)

    def simulate(wl: Workload, policy: str, rc: tuple[str, str, float]) -> dict[str, Any]:
        return run_policy_sim(wl, policy, rc, a, cost)["summary"]

    jobs = a.jobs or (os.cpu_count() or 1)

    def step(desc: str) -> None:  # one configuration's search done
        bar.set_description(desc)
        bar.update(1)

    try:
        for wi, wl0 in enumerate(workloads_by_seed[seeds[0]]):
            w_start = time.perf_counter()
            entry: dict[str, Any] = {"workload": wl0.describe(), "problems": {}}
            results["workloads"][wl0.name] = entry
            entry["capacity"] = capacity.run_search(a, cost, workloads_by_seed, wi, plan, jobs, step)
            cap = entry["capacity"]
            entry["problems"] = {"bound": [f"capacity above the bound: {k}" for k in
                                           capacity.over_bound(cap, a.search_resolution)]}
            if not a.sim:  # the simulator's knees, checked on real daemons
                live: dict[str, Any] = entry.setdefault("live", {})
                wl = workloads_by_seed[seeds[0]][wi]
                checked = {cap.get(k) for k in ("reference", "best_baseline", "best")} - {None}
                for name, x in capacity.knees(cap).items():
                    same = next((v for v in live.values() if v["rate_scale"] == x), None)
                    if same is not None:  # both knees at one load: the same runs
                        live[name] = same
                        continue
                    for policy, rc in plan:
                        label = key(policy, rc[0])
                        if label not in checked:
                            continue
                        bar.set_description(f"{wl.name}/live {label} x{x:.3g}")
                        run = run_policy(wl.at_rate(x), policy, rc, a, cost, None,
                                         f"{wl.name}-{policy}-{rc[0]}-{name}")["summary"]
                        twin = simulate(wl.at_rate(x), policy, rc)
                        keys = ("slo_attainment", "ttft_p50_s", "ttft_p99_s", "completed", "requests",
                                "queue_p99_s", "kv_fetch_p99_s", "lag_p99_s")
                        live.setdefault(name, {"rate_scale": x, "configs": {}})["configs"][label] = {
                            "live": {k: run[k] for k in keys}, "simulated": {k: twin[k] for k in keys}}
                        _write(a.out / "results.json", results)
            entry["wall_s"] = time.perf_counter() - w_start
            _write(a.out / "results.json", results)
            if not a.no_plots:
                plot_capacity(a.out / f"{wl0.name}_capacity.png", wl0.name, cap, a.slo_attainment)
    finally:
        bar.close()
        results["wall_s"] = time.perf_counter() - started
        if results["workloads"]:
            _write(a.out / "results.json", results)
            (a.out / "report.md").write_text(render(results))
    print()
    for name, w in results["workloads"].items():
        print(f"## {name} ({w['workload']['requests']} requests; capacity as a rate scale of the workload)")
        print(capacity_table(w))
        print()
    print("## capacity against engine-only (no kvstore), every workload")
    print(capacity_summary(results))
    print()
    return _finish(a, results)


def _finish(a: ReplayConfig, results: dict[str, Any]) -> int:
    """Say where the results went; exit 1 if a run had sanity problems."""
    print(f"wrote {a.out / 'results.json'} and {a.out / 'report.md'} in {results['wall_s']:.0f}s")
    problems = {f"{w}/{p}": v for w, e in results["workloads"].items() for p, v in e["problems"].items() if v}
    if problems:
        print(f"sanity problems: {problems}", file=sys.stderr)
        return 1
    return 0


def _write(path: Path, obj: dict[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(obj, indent=1, default=str))
    tmp.replace(path)


TRACE_DESCRIPTION = "Trace tools."


def trace_parser() -> argparse.ArgumentParser:
    """A stand-alone parser of ``kvctl trace``'s actions and options."""
    p = argparse.ArgumentParser(prog="kvctl trace", description=TRACE_DESCRIPTION)
    add_trace_arguments(p)
    return p


def add_trace_arguments(p: argparse.ArgumentParser) -> None:
    """Add ``kvctl trace``'s actions (``synth``) and their options to ``p``."""
    sub = p.add_subparsers(dest="action", required=True)
    s = sub.add_parser("synth", help="write a synthetic workload as Mooncake jsonl",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    s.add_argument("--shape", default="fanout", choices=["fanout", *SHAPES],
                   help="fanout: the --bursts/--requests/... generator; the others: kvstore.workloads.shapes "
                        "with their defaults ('mixed' overlays bursts on the shipped conversation trace)")
    _synth_args(s)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--out", type=Path, required=True, help="jsonl file to write")


def trace_main(argv: list[str] | None = None) -> int:
    """``kvctl trace`` on an argument list (tests and scripts; kvctl itself calls :func:`run_trace`)."""
    return run_trace(trace_parser().parse_args(argv))


def run_trace(a: argparse.Namespace) -> int:
    """Run the trace action the parsed options name (``synth``: write the workload as Mooncake jsonl)."""
    spec = _synth_spec(a)
    reqs = synth_requests(spec) if a.shape == "fanout" else shape_requests(a.shape, a.seed)
    n = write_mooncake(reqs, a.out)
    blocks = sum(len(r.hash_ids) for r in reqs)
    print(f"wrote {n} requests ({blocks} blocks of 512 tokens, {reqs[-1].t if reqs else 0:.1f}s) to {a.out}: "
          f"{json.dumps(asdict(spec)) if a.shape == 'fanout' else a.shape}")
    return 0


if __name__ == "__main__":
    sys.exit(replay_main())
