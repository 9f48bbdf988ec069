"""One replay's settings, typed and checked once: :class:`ReplayConfig`.

``kvctl replay`` builds it from its command line (:meth:`ReplayConfig.from_args`)
and hands it down; the live driver, the simulator, the workloads and the
report read it and nothing else. Field names are the command line's
(``--link-gbs`` is ``link_gbs``), so ``results.json``'s ``config`` section
keeps the keys users' scripts read. :meth:`ReplayConfig.from_args` resolves
the ``auto`` values (byte scale, capacity) and rejects what cannot run, with
the flag named in the message.

The daemons' settings of one run (:func:`cluster_and_router`) and the
modelled link (:func:`link_of`) are derived here too, once for the live and
the simulated replay.
"""

from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from kvstore.config import add_override
from kvstore.replay import netns
from kvstore.replay.claiming import (REUSE_HORIZON_S, TIER_ADMIT, TIER_POLICIES, margin_for, split_policy,
                                     tier_policy)
from kvstore.replay.cluster import ClusterSpec
from kvstore.replay.costmodel import LINKS, MODELLED_CAPACITY, CostModel, auto_byte_scale
from kvstore.replay.routers import ROUTERS, make_router
from kvstore.replay.sweep import router_configs
from kvstore.replay.workload import DEFAULT_TRACE, SynthSpec
from kvstore.units import parse_size

POLICIES = ("none", "reactive", "full", "predictive", "oracle", "engine-only", "bound")
SELF_ROUTED = ("oracle", "bound")  # route themselves, by the oracle's plan
SINGLE = (*SELF_ROUTED, "engine-only")  # run single-tier only, without claims


# The replay's deliberate departures from kvstored's defaults, each a replay flag that carries the
# setting's own help (kvstore.config.add_override): a replay lasts minutes of real time, so membership,
# the planner and speculative replicas run on faster clocks; pools are host memory and the transport is
# TCP, which every machine has; the predictor tracks deeper prefixes.
# (kvstored setting, replay flag and ReplayConfig field, default here, why)
DAEMON_OVERRIDES: tuple[tuple[str, str, Any, str], ...] = (
    ("device", "device", "cpu", "the replay's pools"),
    ("transport", "transport", "tcp", "the replay's peer transport"),
    ("heartbeat_interval", "heartbeat", 0.2, "real seconds"),
    ("planner_tick", "planner_tick", 0.2, "real seconds, for predictive"),
    ("spec_ttl", "spec_ttl", 60.0, "real seconds; also the oracle's copies"),
    ("predictor_depths", "predictor_depths", "1,2,4,8,16",
     "16 lets the planner copy prefixes up to 8k tokens deep"),
)
_OVERRIDE_DEFAULT = {field_name: default for _, field_name, default, _ in DAEMON_OVERRIDES}


def add_daemon_overrides(group: Any) -> None:
    """The replay's flags for :data:`DAEMON_OVERRIDES`."""
    for name, field_name, default, why in DAEMON_OVERRIDES:
        add_override(group, name, default, flag="--" + field_name.replace("_", "-"), dest=field_name, note=why)


def daemon_settings(cfg: ReplayConfig) -> dict[str, Any]:
    """The kvstored settings the replay's daemons get beyond their defaults (the simulator parses the same)."""
    out = {name: getattr(cfg, field_name) for name, field_name, _, _ in DAEMON_OVERRIDES}
    # a fleet's membership timeout in trace seconds: divided by --speedup, but at least 4 real heartbeats
    out["heartbeat_timeout"] = max(cfg.heartbeat_timeout / cfg.speedup, 4 * cfg.heartbeat)
    return out


_SYNTH = SynthSpec()
DEFAULT_RPC_MS = 1.5   # real ms per KV round trip (Lookup, Get, Put, Replicate) on the harness machine (--sim)
# repeatable flags: argparse appends to a list, the config keeps a tuple
LISTS = ("trace", "kill", "join", "kvstored_arg")


@dataclass(frozen=True)
class ReplayConfig:
    """Everything one ``kvctl replay`` needs; the defaults are the command line's."""

    # workloads
    trace: tuple[str, ...] = (DEFAULT_TRACE, "synth")
    start: float = 0.0
    window: float = 120.0
    max_requests: int | None = None
    speedup: float = 4.0
    synth_bursts: int = _SYNTH.bursts
    synth_requests: int = _SYNTH.requests
    synth_prefix_tokens: int = _SYNTH.prefix_tokens
    synth_window: float = _SYNTH.window_s
    synth_decoys: int = _SYNTH.decoys
    synth_background: float = _SYNTH.background
    synth_duration: float = _SYNTH.duration_s
    synth_suffix_tokens: int = _SYNTH.suffix_tokens
    synth_output_tokens: int = _SYNTH.output_tokens
    quiet: float = 0.0
    rate_scale: float = 1.0
    burstiness: float = 1.0
    # cluster and policies
    nodes: int = 4
    policies: str = "none,reactive,full,predictive,oracle"
    claim_margin: str = "auto"
    router: str = "cache-aware"
    routers: str | None = None
    configs: str = ""
    balance_abs: str = "32"
    balance_rel: float = 1.5
    match_threshold: float = 0.0
    no_hints: bool = False
    hint_cover: float = 0.5
    predictor_depths: str = _OVERRIDE_DEFAULT["predictor_depths"]
    device: str = _OVERRIDE_DEFAULT["device"]
    capacity: str = "auto"
    tier_policies: str = "single-tier"
    transport: str = _OVERRIDE_DEFAULT["transport"]
    network: str = "shaped"
    link: str = "rdma-400g"
    link_latency_us: float | None = None
    heartbeat: float = _OVERRIDE_DEFAULT["heartbeat"]
    heartbeat_timeout: float = 3.0
    planner_tick: float = _OVERRIDE_DEFAULT["planner_tick"]
    spec_ttl: float = _OVERRIDE_DEFAULT["spec_ttl"]
    oracle_lead: float = 4.0
    kill: tuple[str, ...] = ()
    join: tuple[str, ...] = ()
    kvstored_arg: tuple[str, ...] = ()
    # engines and cost model
    preset: str = "llama3-8b"
    byte_scale: int | str = "auto"
    mfu: float | None = None
    link_gbs: float | None = None
    pool_medium: str = "auto"
    slo_factor: float = 2.0
    slo_ttft: float = 1.0
    slo_attainment: float = 0.9
    search: str = ""
    search_resolution: float = 0.05
    jobs: int = 0
    concurrency: int = 8
    fetch_timeout: float = 5.0
    data_connections: int = 1
    shared_save: bool = False
    # output
    out: Path = Path("kvstore-out") / "replay"
    seed: int = 0
    repeats: int = 1
    drain_timeout: float = 120.0
    no_plots: bool = False
    no_progress: bool = False
    # simulation
    sim: bool = False
    sim_compare: bool = False
    sim_rpc_ms: float = DEFAULT_RPC_MS
    # derived by from_args, not set on the command line
    kills: tuple[tuple[int, float], ...] = field(default=(), compare=False)
    joins: tuple[tuple[int, float], ...] = field(default=(), compare=False)

    @classmethod
    def flag_defaults(cls) -> dict[str, Any]:
        """Every flag's default, by dest: the command line's defaults are these fields' (``set_defaults``)."""
        return {f.name: f.default for f in fields(cls) if f.name not in (*LISTS, "kills", "joins")}

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "ReplayConfig":
        """The parsed command line, checked and with ``auto`` resolved; ValueError names the bad flag."""
        names = {f.name for f in fields(cls)} - {"kills", "joins"}
        values: dict[str, Any] = {k: v for k, v in vars(args).items() if k in names}
        for name in LISTS:
            if values.get(name) is not None:
                values[name] = tuple(values[name])
        if values.get("trace") is None:
            values.pop("trace", None)
        cfg = cls(**values)
        cfg.check()
        scale = cfg.byte_scale
        if scale == "auto":
            scale = auto_byte_scale(CostModel.preset(cfg.preset).page_bytes)
        try:
            scale = int(scale)
        except ValueError:
            raise ValueError(f"--byte-scale {cfg.byte_scale!r}: expected an integer or auto") from None
        capacity = {"auto": str(MODELLED_CAPACITY // scale),
                    "preset": str(CostModel.preset(cfg.preset, scale).host_kv_bytes // scale)}.get(cfg.capacity,
                                                                                                   cfg.capacity)
        try:
            parse_size(capacity)
        except ValueError:
            raise ValueError(f"--capacity {cfg.capacity!r}: expected auto, preset or a size, e.g. 4GiB") from None
        return cls(**{**values, "byte_scale": scale, "capacity": capacity,
                      "kills": tuple(parse_kills(list(cfg.kill), cfg.nodes)),
                      "joins": tuple(parse_kills(list(cfg.join), cfg.nodes, "--join"))})

    def check(self) -> None:
        """Raise ValueError for settings no replay can run."""
        bad = [p for p in self.policy_list() if not _known_policy(p)]
        if bad or not self.policy_list():
            raise ValueError(f"unknown policies {bad}; choose from {','.join(POLICIES)} (each but oracle may take "
                             "+claims: engines claim their prefills and wait for each other's; --tier-policies "
                             "adds the tiers' suffix)")
        margin_for(self.claim_margin)
        if self.quiet < 0:
            raise ValueError("--quiet must be >= 0 seconds")
        if not self.rate_scale > 0 or not self.burstiness > 0:
            raise ValueError("--rate-scale and --burstiness must be > 0")
        if self.slo_ttft < 0 or not 0 < self.slo_attainment <= 1:
            raise ValueError("--slo-ttft must be >= 0 seconds and --slo-attainment in (0, 1]")
        if self.search not in ("", "capacity"):
            raise ValueError(f"--search {self.search!r}: the one search is 'capacity'")
        if not 0 < self.search_resolution < 1:
            raise ValueError("--search-resolution must be in (0, 1), e.g. 0.05 for 5 %")
        plan = self.run_plan()
        if not self.sim and not self.search and any(p.partition("+")[0] == "bound" for p, _ in plan):
            raise ValueError("the bound runs simulated only (--sim, or --search capacity, which searches on the "
                             "simulator)")
        if self.join and not (self.sim or self.search):
            raise ValueError("--join runs simulated only (--sim, or --search capacity)")
        if self.join and any(p.partition("+")[0] in ("oracle", "bound") for p, _ in plan):
            raise ValueError("--join: the oracle and the bound plan for a fixed set of nodes; leave them out")
        bad_t = [t for t in self.tier_policy_list() if t not in TIER_POLICIES]
        if bad_t or not self.tier_policy_list():
            raise ValueError(f"unknown tier policies {bad_t}; choose from {','.join(TIER_POLICIES)}")
        if self.nodes < 1 or self.speedup <= 0 or self.concurrency < 1 or self.repeats < 1 \
                or self.data_connections < 1:
            raise ValueError("--nodes, --speedup, --concurrency, --repeats and --data-connections must be positive")
        bad_r = [r for r in self.router_list() if r not in ROUTERS]
        if bad_r or not self.balances():
            raise ValueError(f"unknown routers {bad_r}; choose from {','.join(ROUTERS)}")
        if self.sim and self.sim_compare:
            raise ValueError("--sim and --sim-compare exclude each other (--sim-compare runs both)")
        if self.network == "netns" and not self.sim:
            if netns.available():
                raise ValueError(netns.available())
            if self.transport != "tcp":
                raise ValueError("--network netns needs --transport tcp (UCX shared memory would bypass tc)")

    # ---- derived values -------------------------------------------------------------
    def run_plan(self) -> list[tuple[str, tuple[str, str, float]]]:
        """``(policy, (label, router, balance_abs))`` of every configuration to run: ``--configs`` as given,
        else every policy under every router (cache-aware once per ``--balance-abs``); the oracle routes
        itself (``plan``), and so does the bound (the oracle's routes, every reusable block free once it can exist)."""
        balance = self.balances()
        own = {p: ("plan", "least-load", balance[0]) for p in SELF_ROUTED}
        if self.configs:
            out = []
            for item in (c.strip() for c in self.configs.split(",") if c.strip()):
                policy, _, router = item.partition("|")
                base = policy.partition("+")[0]
                if not _known_policy(policy):
                    raise ValueError(f"--configs {item!r}: unknown policy {policy!r}; choose from "
                                     f"{','.join(POLICIES)}")
                if base in own:
                    out.append((policy, own[base]))
                    continue
                name, _, threshold = router.partition("@")
                if name not in ROUTERS:
                    raise ValueError(f"--configs {item!r}: expected POLICY|ROUTER with a router of "
                                     f"{','.join(ROUTERS)}")
                try:
                    b = float(threshold) if threshold else balance[0]
                except ValueError:
                    raise ValueError(f"--configs {item!r}: cache-aware@N takes a number") from None
                label = f"cache-aware@{b:g}" if name == "cache-aware" else name
                out.append((policy, (label, name, b)))
            return out
        configs = router_configs(self.router_list(), balance)
        plan: list[tuple[str, tuple[str, str, float]]] = []
        for policy in self.policy_list():
            base = policy.partition("+")[0]
            plan.extend([(policy, own[base])] if base in own else [(policy, rc) for rc in configs])
        return plan

    def policy_list(self) -> list[str]:
        """Every policy to run: each of --policies under each of --tier-policies (a suffix, as +claims;
        single-tier adds none; the oracle runs single-tier only)."""
        out: list[str] = []
        for p in (p.strip() for p in self.policies.split(",") if p.strip()):
            if p.partition("+")[0] in SINGLE:
                out.append(p)
                continue
            out.extend(p if t == TIER_POLICIES[0] else f"{p}+{t}" for t in self.tier_policy_list())
        return out

    def tier_policy_list(self) -> list[str]:
        return [t.strip() for t in self.tier_policies.split(",") if t.strip()]

    def router_list(self) -> list[str]:
        return [r.strip() for r in (self.routers or self.router).split(",") if r.strip()]

    def balances(self) -> list[float]:
        """--balance-abs as numbers: cache-aware runs once per threshold."""
        try:
            return [float(x) for x in str(self.balance_abs).split(",") if x.strip()]
        except ValueError:
            raise ValueError(f"--balance-abs {self.balance_abs!r}: expected numbers, e.g. 4,8,16,32") from None

    def medium(self) -> str:
        """Where a node's pool lives, for the modelled load into the engine."""
        if self.pool_medium != "auto":
            return self.pool_medium
        return "hbm" if self.device.startswith("cuda") else "host"

    def cost(self) -> CostModel:
        """The cost model of this replay (after :meth:`from_args` resolved the byte scale)."""
        return CostModel.preset(self.preset, int(self.byte_scale), self.mfu, link_of(self)[0] / 1e9,
                                pool_medium=self.medium())

    def to_json(self) -> dict[str, Any]:
        """The command line's settings as ``results.json`` records them (paths as text)."""
        out = asdict(self)
        out.pop("kills")
        for k in LISTS:
            out[k] = list(out[k])
        return {k: (str(v) if isinstance(v, Path) else v) for k, v in out.items()}


def _known_policy(name: str) -> bool:
    """One of POLICIES, each but the oracle optionally with +claims and a tier policy's suffix."""
    try:
        base, claims = split_policy(name)
        tier = tier_policy(name)
    except ValueError:
        return False
    return base in POLICIES and not (base in SINGLE and (claims or tier != TIER_POLICIES[0]))


def parse_kills(specs: list[str], nodes: int, flag: str = "--kill") -> list[tuple[int, float]]:
    """``["n3@20", "1@5.5"]`` -> ``[(3, 20.0), (1, 5.5)]`` (node index, trace s), of ``--kill`` or ``--join``."""
    out = []
    for spec in specs:
        node, sep, t = spec.partition("@")
        try:
            index, at = int(node.strip().lstrip("n")), float(t)
        except ValueError:
            raise ValueError(f"{flag} {spec!r}: expected NODE@T, e.g. n3@20") from None
        if not sep or not 0 <= index < nodes or at < 0 or (flag == "--join" and index == 0):
            first = 1 if flag == "--join" else 0  # n0 starts the cluster (and coordinates)
            raise ValueError(f"{flag} {spec!r}: node must be n{first}..n{nodes - 1} and T >= 0 trace seconds")
        out.append((index, at))
    if len({i for i, _ in out}) < len(out):
        raise ValueError(f"{flag}: a node named twice")
    return out


def link_of(cfg: ReplayConfig) -> tuple[float, float]:
    """(bytes/s, one-way latency s) of the modelled link: the preset, with --link-gbs/--link-latency-us."""
    rate, latency = LINKS[cfg.link]
    if cfg.link_gbs is not None:
        rate = cfg.link_gbs * 1e9
    if cfg.link_latency_us is not None:
        latency = cfg.link_latency_us * 1e-6
    return rate, latency


def cluster_and_router(cfg: ReplayConfig, policy: str, router_cfg: tuple[str, str, float],
                       cost: CostModel) -> tuple[ClusterSpec, Any]:
    """The daemons' settings and the router of one configuration (the real and the simulated replay)."""
    rate, latency = link_of(cfg)
    base, _ = split_policy(policy)
    tier = tier_policy(policy)
    disk = tier != TIER_POLICIES[0]
    daemon_policy = {"oracle": "reactive", "bound": "none", "engine-only": "none"}.get(base, base)
    spec = ClusterSpec(nodes=cfg.nodes, policy=daemon_policy, namespace=cfg.preset,
                       page_bytes=cost.scaled_page_bytes, capacity=cfg.capacity, settings=daemon_settings(cfg),
                       extra=list(cfg.kvstored_arg),
                       network=cfg.network, link_rate=rate * cfg.speedup / cost.byte_scale,
                       link_latency=latency / cfg.speedup,
                       # the modelled NVMe: its bytes scaled, its rates scaled and on the daemons' clock
                       disk_tier=cost.nvme_bytes // cost.byte_scale if disk else 0,
                       disk_read_rate=cost.nvme_read_bytes_s * cfg.speedup / cost.byte_scale if disk else 0.0,
                       disk_write_rate=cost.nvme_write_bytes_s * cfg.speedup / cost.byte_scale if disk else 0.0,
                       disk_admit=TIER_ADMIT.get(tier, "all"),
                       # tiers-predictive: one drive write a day, on the daemons' clock and in scaled bytes
                       disk_write_budget=cost.disk_write_budget_bytes_s * cfg.speedup / cost.byte_scale,
                       disk_reuse_horizon=REUSE_HORIZON_S / cfg.speedup)
    _, router_name, balance_abs = router_cfg
    pull = None if base in ("none", "engine-only") else cost.link_s  # under none a node recomputes what it lacks
    router = make_router(router_name, balance_abs, cfg.balance_rel, not cfg.no_hints, cfg.match_threshold,
                         cfg.hint_cover,
                         prefill_s=lambda blocks, cached: cost.prefill_s(
                             cost.uncached_tokens(blocks * cost.block_tokens, cached)),
                         pull_s=pull)
    return spec, router
