"""Node settings: each one defined once, as a typed field of :class:`NodeConfig`.

A field carries its type, default, bounds, help text, group and flag metavar
(:func:`setting`); the ``--flags`` and ``--help`` (:func:`add_arguments`), the
TOML file and the ``KVSTORED_*`` environment (:func:`build_config`) and
``docs/configuration.md`` (:func:`markdown`) are all made from those fields.
Precedence: defaults < config file < environment < flags.

The model is a frozen pydantic model: a value from any source goes through
the same validators (sizes such as ``4GiB`` or ``1e9``, booleans such as
``true``/``off``, comma lists), and a bad one is rejected naming the setting
and where it came from.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

from annotated_types import Ge, Gt, Le, Lt
from pydantic import (
    AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, TypeAdapter, ValidationError, model_validator,
)
from pydantic.fields import FieldInfo

from kvstore.units import parse_size

ENV_PREFIX = "KVSTORED_"
GROUPS: dict[str, str] = {
    "node": "The node: its address, id, event loop, logs and local endpoints.",
    "pool": "The page pool: its memory, where it lives and the namespaces made at start-up.",
    "tiers": "Storage below the pool (host memory, local disks) that takes what the pool evicts and serves it back.",
    "cluster": "Peers, membership, the peer transport and how a Get pulls what it lacks.",
    "predictor": "The burst predictor that forecasts which prefixes are about to be requested.",
    "planner": "The coordinator's planner: which forecast prefixes are copied, where, how fast and for how long.",
    "security": "TLS, client tokens and the cluster secret (required off loopback).",
    "limits": "Bounds on what one client, call or connection may take.",
}
DEVICES_HELP = ("auto (a GPU when CuPy finds one, else cpu), cpu, cuda:N, or cpu-staged (host memory driven "
                "like a GPU pool, through staging copies: tests and CI)")


# ---------------------------------------------------------------------------
# value parsers shared by the fields (and by the replay's flags)
# ---------------------------------------------------------------------------

def parse_hostport(text: str, *, allow_zero_port: bool = True) -> tuple[str, int]:
    """Split ``host:port`` (``[v6]:port`` too); raises ValueError."""
    if not isinstance(text, str):
        raise ValueError(f"bad address {text!r}: expected a string HOST:PORT")
    host, sep, port = text.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:
        raise ValueError(f"bad address {text!r}: write IPv6 hosts in brackets, [::1]:PORT")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"bad address {text!r}: expected HOST:PORT")
    value = int(port)
    if not (0 if allow_zero_port else 1) <= value <= 65535:
        raise ValueError(f"bad port in {text!r}")
    return host, value


def parse_peers(value: Any) -> tuple[str, ...]:
    """``host:port,host:port`` (or a TOML list) -> validated tuple."""
    if not isinstance(value, (str, list, tuple)):
        raise ValueError(f"expected a string or list of HOST:PORT, got {value!r}")
    items = value if isinstance(value, (list, tuple)) else [p for p in value.split(",") if p.strip()]
    peers = []
    for item in items:
        if not isinstance(item, str):
            raise ValueError(f"peer {item!r} is not a HOST:PORT string")
        parse_hostport(item.strip(), allow_zero_port=False)
        peers.append(item.strip())
    if len(set(peers)) != len(peers):
        raise ValueError(f"duplicate peer in {value!r}")
    return tuple(peers)


def parse_device(value: Any) -> str:
    if isinstance(value, str) and (value in ("auto", "cpu", "cpu-staged")
                                   or (value.startswith("cuda:") and value[5:].isdigit())):
        return value
    raise ValueError(f"bad device {value!r}: {DEVICES_HELP}")


def parse_bool(value: Any) -> bool:
    """The booleans users write: true/false, 1/0, yes/no, on/off (any case)."""
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{value!r} is not a boolean (true/false)")


def parse_depths(value: Any) -> tuple[int, ...]:
    items = value.split(",") if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)):
        raise ValueError(f"expected a comma list of block counts, got {value!r}")
    depths = tuple(int(x) for x in items)
    if not depths or any(d <= 0 for d in depths) or list(depths) != sorted(set(depths)):
        raise ValueError("must be ascending positive block counts, e.g. 1,2,4,8")
    return depths


def _check_listen(value: str) -> str:
    parse_hostport(value)
    return value


def _check_membership(value: str) -> str:
    if value == "gossip" or value.startswith(("etcd://", "etcds://")):
        return value
    raise ValueError("must be 'gossip' or etcd://HOST:PORT[,HOST:PORT...] (etcds:// for TLS)")


@dataclass(frozen=True, slots=True)
class NamespaceSpec:
    """A namespace created at start-up (``--namespace NAME:PAGE_BYTES[:CAPACITY]``)."""

    name: str
    page_bytes: int
    capacity: int = 0

    @classmethod
    def parse(cls, value: str | dict[str, Any] | NamespaceSpec) -> NamespaceSpec:
        if isinstance(value, NamespaceSpec):
            return value
        if isinstance(value, dict):
            return cls(str(value["name"]), parse_size(value["page_bytes"]), parse_size(value.get("capacity", 0)))
        if not isinstance(value, str):
            raise ValueError(f"bad namespace {value!r}: expected NAME:PAGE_BYTES[:CAPACITY] or a table")
        parts = value.split(":")
        if len(parts) not in (2, 3):
            raise ValueError(f"bad namespace {value!r}: expected NAME:PAGE_BYTES[:CAPACITY]")
        return cls(parts[0], parse_size(parts[1]), parse_size(parts[2]) if len(parts) == 3 else 0)


def _items(value: Any) -> list[Any]:
    """A repeatable setting's values: a list (flags, TOML), a comma list (the environment) or one value."""
    return list(value) if isinstance(value, (list, tuple)) else value.split(",") if isinstance(value, str) else [value]


def _parse_namespaces(value: Any) -> tuple[NamespaceSpec, ...]:
    try:
        return tuple(NamespaceSpec.parse(v) for v in _items(value))
    except KeyError as exc:
        raise ValueError(f"a namespace table needs {exc}") from None


@dataclass(frozen=True, slots=True)
class TierSpec:
    """A tier below the pool (``--tier host:SIZE`` or ``--tier disk:PATH:SIZE``)."""

    kind: Literal["host", "disk"]
    capacity: int
    path: str = ""

    def __str__(self) -> str:  # as written on the command line
        return f"host:{self.capacity}" if self.kind == "host" else f"disk:{self.path}:{self.capacity}"

    @classmethod
    def parse(cls, value: str | dict[str, Any] | TierSpec) -> TierSpec:
        if isinstance(value, TierSpec):
            return value
        if isinstance(value, dict):
            kind, path, size = str(value.get("kind", "")), str(value.get("path", "")), value.get("capacity", "")
        elif isinstance(value, str):
            # the kind before the first ':', the size after the last: a path may hold ':' itself
            kind, _, rest = value.partition(":")
            path, _, size = rest.rpartition(":")
        else:
            raise ValueError(f"bad tier {value!r}: expected host:SIZE, disk:PATH:SIZE or a table")
        if kind == "host" and not path:
            return cls("host", _positive_size(size, value))
        if kind == "disk" and path:
            if not os.path.isabs(path):
                raise ValueError(f"bad tier {value!r}: the disk path must be absolute")
            return cls("disk", _positive_size(size, value), path)
        raise ValueError(f"bad tier {value!r}: expected host:SIZE or disk:PATH:SIZE")


def _positive_size(size: Any, value: Any) -> int:
    n = parse_size(size)
    if n <= 0:
        raise ValueError(f"bad tier {value!r}: its size must be > 0")
    return n


def _parse_tiers(value: Any) -> tuple[TierSpec, ...]:
    tiers = tuple(TierSpec.parse(v) for v in _items(value) if not isinstance(v, str) or v.strip())
    paths = [t.path for t in tiers if t.kind == "disk"]
    if len(set(paths)) != len(paths):
        raise ValueError("two disk tiers name one folder")
    if any(t.kind == "host" for t in tiers) and tiers[0].kind != "host":
        raise ValueError("a host tier goes above the disk tiers (list it first)")
    if sum(t.kind == "host" for t in tiers) > 1:
        raise ValueError("at most one host tier")
    return tiers


Size = Annotated[int, BeforeValidator(parse_size)]
Tiers = Annotated[tuple[TierSpec, ...], BeforeValidator(_parse_tiers)]
Bool = Annotated[bool, BeforeValidator(parse_bool)]
Address = Annotated[str, AfterValidator(_check_listen)]
Device = Annotated[str, BeforeValidator(parse_device)]
Peers = Annotated[tuple[str, ...], BeforeValidator(parse_peers)]
Namespaces = Annotated[tuple[NamespaceSpec, ...], BeforeValidator(_parse_namespaces)]
Depths = Annotated[tuple[int, ...], BeforeValidator(parse_depths)]
Membership = Annotated[str, AfterValidator(_check_membership)]
Port = Annotated[int, Field(ge=-1, le=65535)]


def setting(default: Any, help: str, metavar: str, *, group: str, repeat: bool = False,
            planner: str = "", predictor: str = "", **bounds: Any) -> Any:
    """One setting: its default, help, flag metavar, group and bounds (``gt``, ``ge``, ``le``, ``lt``).

    ``planner``/``predictor`` name the :class:`~kvstore.placement.planner_types.PlannerConfig` or
    :class:`~kvstore.predict.types.PredictorConfig` field the setting feeds; ``repeat``: the flag may
    repeat and its values accumulate."""
    extra = {"group": group, "metavar": metavar, "repeat": repeat, "planner": planner, "predictor": predictor}
    return Field(default, description=help, json_schema_extra=extra, **bounds)


def _in(group: str) -> Any:
    def make(default: Any, help: str, metavar: str, **kw: Any) -> Any:
        return setting(default, help, metavar, group=group, **kw)
    return make


node, pool, tiers_, cluster, predictor, planner, security, limits = (_in(g) for g in GROUPS)


class NodeConfig(BaseModel):
    """Everything a node needs to start; validated on construction, frozen after."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    # -- node
    listen: Address = node("127.0.0.1:7400", "gRPC address HOST:PORT (port 0 picks a free one)", "HOST:PORT")
    node_id: str = node("", "this node's id in the cluster (default: the listen address)", "ID")
    data_port: Port = node(0, "port of the bulk data channel on the listen host (0: pick one, -1: off)", "PORT")
    metrics_port: Port = node(-1, "Prometheus metrics port on the listen host (0: pick one, -1: off)", "PORT")
    log_level: Literal["debug", "info", "warning", "error"] = node("info", "logging level", "LEVEL")
    loop: Literal["auto", "uvloop", "asyncio"] = node("auto", "event loop: auto prefers uvloop", "LOOP")
    grace: float = node(5.0, "seconds in-flight calls get to finish on SIGTERM", "SECONDS", ge=0)
    shm: Bool = node(True, "serve clients on this host through shared memory: host pools live in memfds a client "
                     "maps after asking on a unix socket (true/false)", "BOOL")
    shm_dir: str = node("", "folder of the shared-memory unix socket (default: a 0700 folder /tmp/kvstored-UID)",
                        "DIR")

    # -- pool
    capacity: Size = pool(1 << 30, "bytes of page memory for all namespaces, e.g. 4GiB", "SIZE", gt=0)
    device: Device = pool("auto", f"where pages live: {DEVICES_HELP}", "DEVICE")
    namespace: Namespaces = pool((), "create a namespace at start-up, NAME:PAGE_BYTES[:CAPACITY]; repeatable (a "
                                 "comma list in the environment)", "SPEC", repeat=True)
    prefault: Bool = pool(True, "touch host pool memory at namespace creation so first puts don't page-fault "
                          "(true/false)", "BOOL")
    checksum: Bool = pool(True, "xxh3 checksum of every page at put, verified on peer transfers", "BOOL")

    # -- tiers
    tier: Tiers = tiers_(
        (), "a tier below the pool, fastest first: host:SIZE (pinned host memory under a GPU pool; ignored under a "
        "host pool, which is host memory already) or disk:PATH:SIZE (slab files in PATH, an absolute folder the node "
        "owns; the size is after the last ':', so PATH may hold ':'); repeatable (a comma list in the environment: "
        "a PATH with ',' goes in the file or a flag). The pool's evictions go down the tiers and reads bring them "
        "back up", "SPEC", repeat=True)
    tier_write: Literal["back", "through"] = tiers_(
        "back", "back: a page goes down when the pool evicts it (staged in host memory until written); through: "
        "also copied down in the background as soon as it is stored, so an eviction needs no write", "MODE")
    tier_staging: Size = tiers_(
        256 << 20, "host memory for evicted pages waiting for their write down (write-back); an eviction that "
        "finds it full drops the page (counted)", "SIZE", ge=0)
    tier_io: Literal["auto", "direct", "buffered"] = tiers_(
        "auto", "disk tier I/O: direct (O_DIRECT, aligned buffers), buffered (page cache, posix_fadvise) or auto "
        "(probes O_DIRECT once per folder and logs its choice)", "MODE")
    tier_threads: int = tiers_(4, "I/O threads per tier (reads of one batch run in parallel)", "N", ge=1, le=64)
    tier_admit: Literal["all", "reused", "budget", "predicted"] = tiers_(
        "all", "which pages the pool's evictions write down: all (every primary and replica page); reused "
        "(only pages a client read since they were stored: seen at least twice, a frequency filter that keeps "
        "one-off prompts off the disk and its wear); budget (every page while --tier-write-budget pays for it); or "
        "predicted (the classes of page most often asked for again within --tier-reuse-horizon, as this node "
        "has seen, within --tier-write-budget). The others are declined, counted; with any but all, "
        "--tier-write through writes at the eviction only", "MODE")
    tier_write_budget: float = tiers_(
        0.0, "--tier-admit budget or predicted: bytes/s the first tier may be written at, averaged over the horizon (0: one "
        "drive write a day of its size)", "BYTES_PER_S", ge=0)
    tier_reuse_horizon: float = tiers_(
        600.0, "--tier-admit predicted: seconds after its eviction within which a page asked for again counts as "
        "reused", "SECONDS", gt=0)
    tier_read_rate: float = tiers_(
        0.0, "cap each disk tier's reads at this many bytes/s (0: as fast as the drive serves them): leaves the "
        "rest of a shared drive to other work; the replay shapes its modelled NVMe with it", "BYTES_PER_S", ge=0)
    tier_write_rate: float = tiers_(
        0.0, "cap each disk tier's writes at this many bytes/s (0: as fast as the drive takes them); evictions "
        "that outrun it wait in staging memory (--tier-staging), then are dropped (counted)", "BYTES_PER_S", ge=0)

    # -- cluster
    peers: Peers = cluster((), "other nodes, HOST:PORT,HOST:PORT,... (used by the cluster layer)", "LIST")
    membership: Membership = cluster(
        "gossip", "gossip (heartbeats between --peers) or etcd://HOST:PORT[,HOST:PORT] (etcds:// for TLS with "
        "--tls-ca/--tls-cert/--tls-key): liveness and the coordinator by etcd leases", "URL")
    heartbeat_interval: float = cluster(0.5, "seconds between heartbeats to each peer", "SECONDS", gt=0)
    heartbeat_timeout: float = cluster(2.0, "a peer silent this long is dead: its directory entries are dropped",
                                       "SECONDS", gt=0)
    transport: Literal["auto", "ucx", "tcp"] = cluster(
        "auto", "peer page transport: auto prefers UCX (ucxx) when it imports, else TCP", "NAME")
    transport_port: int = cluster(0, "port of the peer transport listener (0: pick one)", "PORT", ge=0, le=65535)
    replication: Literal["none", "reactive", "predictive", "full"] = cluster(
        "reactive", "none: a Get serves local pages only; reactive: a Get pulls missing pages from the peers that "
        "hold them; predictive: reactive, plus the coordinator copies prefixes it forecasts to nodes before their "
        "requests arrive; full: every page is copied to every node (the cost ceiling)", "POLICY")
    keep_fetched: Bool = cluster(True, "keep pages a Get pulled from a peer as local replicas", "BOOL")
    fetch_timeout: float = cluster(5.0, "longest a Get waits for remote pages when the client gives no deadline; "
                                   "what has not arrived by then is reported missing", "SECONDS", ge=0)
    deadline_share: float = cluster(0.8, "share of a Get's deadline spent fetching from peers; the rest is left to "
                                    "send what arrived", "FRACTION", gt=0, le=1)
    max_pull_bytes: Size = cluster(64 << 20, "largest single peer transfer; bigger pulls are chunked so a deadline "
                                   "keeps what arrived", "SIZE", ge=1 << 20)
    control_timeout: float = cluster(5.0, "timeout of the coordinator's control calls to nodes (Replicate, "
                                     "DropSpeculative), seconds", "SECONDS", gt=0)
    link_rate: float = cluster(0.0, "shape peer transfers to this many bytes/s per node and direction, shared "
                               "fairly by concurrent transfers (0: unshaped; benchmarks set it)", "BYTES_PER_S", ge=0)
    link_latency: float = cluster(0.0, "one-way latency added to each peer transfer's request and reply (with "
                                  "--link-rate)", "SECONDS", ge=0)

    # -- predictor
    predictor_model: str = predictor(
        "", "LightGBM model file from `kvctl train` (default: the shipped model, kvstore/data/burst_model.json; "
        "'none': the momentum rule until online retraining has enough data)", "FILE")
    predictor_depths: Depths = predictor((1, 2, 4, 8), "prefix depths in blocks the predictor tracks", "LIST",
                                         predictor="depths")
    predictor_horizon: float = predictor(300.0, "H: the predictor forecasts requests within this many seconds",
                                         "SECONDS", gt=0, predictor="horizon_s")
    predictor_momentum_window: float = predictor(
        60.0, "W of the momentum rule: a prefix seen at least twice within W seconds is forecast to recur",
        "SECONDS", gt=0, predictor="momentum_window_s")

    # -- planner
    planner_tick: float = planner(1.0, "seconds between planner ticks on the coordinator", "SECONDS",
                                  gt=0, le=60, planner="tick_s")
    # above the model's best-F1 point (0.5): an unread copy costs link time (docs/predictor.md)
    spec_threshold: float = planner(0.65, "replicate a prefix when its forecast probability is at least this", "P",
                                    ge=0, le=1, planner="threshold")
    spec_budget: float = planner(0.2, "share of each node's capacity that speculative replicas may use",
                                 "FRACTION", ge=0, le=1, planner="spec_budget")
    spec_bandwidth: Size = planner(10**9, "bytes/s the planner may spend on speculative copies, cluster-wide",
                                   "BYTES", gt=0, planner="spec_bandwidth")
    spec_ttl: float = planner(120.0, "seconds an unread speculative replica lives unless renewed", "SECONDS",
                              gt=0, planner="ttl_s")
    node_rate: float = planner(
        2.0, "requests/s one node's engines serve: sizes each prefix's replica set from its forecast demand, "
        "copied as a tree (0: unknown; at most 2 new copies per prefix per tick)", "RPS", ge=0, planner="node_rate")
    copy_fanout: int = planner(2, "copies one node sends at once in a copy tree (each wave's copies share its "
                               "egress): 1 doubles the holders every single-copy time", "N", ge=1, le=64,
                               planner="fanout")
    copy_chunks: int = planner(
        1, "> 1: a copy tree relays instead, each source heading a chain of its targets and every target "
        "forwarding each of this many parts of the copy once it landed (the last of L targets holds it after "
        "1 + (L - 1) / N copy times); 1: store and forward in waves", "N", ge=1, le=256, planner="chunks")
    copy_part_min: float = planner(
        0.02, "a relayed copy is cut only into parts that take at least this long at the measured copy bandwidth "
        "(each part costs a Replicate round trip per hop), so a copy short next to its round trips is not relayed",
        "SECONDS", gt=0, planner="min_part_s")
    join_warm: float = planner(
        30.0, "a node that joins a running cluster gets copies of the prefixes the forecast expects hot before "
        "routers send it traffic (it is listed in `joining` of the coordinator's Status meanwhile), for at most "
        "this long (0: no warming, it serves at once)", "SECONDS", ge=0, planner="join_warm_s")

    # -- security
    tls_cert: str = security("", "PEM certificate chain of this node: every port (gRPC, data channel, peer "
                             "transport, metrics) speaks TLS with it; re-read when the file changes", "FILE")
    tls_key: str = security("", "PEM private key of --tls-cert", "FILE")
    tls_ca: str = security("", "PEM CA bundle that signs the cluster's node certificates (peers are verified "
                           "against it) and, with --tls-client-auth, client certificates", "FILE")
    tls_client_auth: Bool = security(False, "require a client certificate signed by --tls-ca on every port (mTLS; "
                                     "true/false)", "BOOL")
    token_file: str = security("", "TOML file of client tokens, each with a tenant and a role (read, write, admin), "
                               "and tenant quotas; re-read when it changes (rotation without restart). Unset: no "
                               "client authentication (loopback development mode only)", "FILE")
    cluster_secret_file: str = security(
        "", "file holding the cluster's shared secret: peers prove membership with an HMAC of every cluster call "
        "(replay-protected). Unset: any caller may act as a peer (loopback development mode only)", "FILE")
    insecure: Bool = security(False, "allow listening beyond loopback without TLS, tokens and a cluster secret "
                              "(logged loudly; never in production)", "BOOL")

    # -- limits
    max_message_bytes: Size = limits(64 << 20, "largest gRPC message either way", "SIZE", ge=1 << 20)
    max_batch_pages: int = limits(65536, "most pages in one Put/Get batch", "N", gt=0)
    max_batch_bytes: Size = limits(1 << 30, "most page bytes in one Put/Get batch", "SIZE", gt=0)
    max_pin_ttl: float = limits(3600.0, "longest lease a Pin may ask for, seconds", "SECONDS", gt=0, le=86400 * 7)
    max_claim_seconds: float = limits(600.0, "longest in-flight prefill claim a Lookup may make, seconds",
                                      "SECONDS", gt=0, le=86400)
    transfer_timeout: float = limits(30.0, "longest a Put or a peer transfer may hold reserved slots waiting for "
                                     "its bytes; then it aborts and frees them", "SECONDS", gt=0)
    read_timeout: float = limits(5.0, "longest a data-channel frame, a peer pull or a gRPC Put stream may go "
                                 "without a byte (a message) once it started; then it gets an error, is closed "
                                 "and its slots freed", "SECONDS", gt=0)
    idle_timeout: float = limits(120.0, "a data-channel or peer-transport connection that starts no frame for this "
                                 "long is closed", "SECONDS", gt=0)
    max_connections: int = limits(256, "most open connections on the data channel and on the peer transport "
                                  "listener (each); one more is answered with an error and closed", "N", gt=0)
    shm_hold_timeout: float = limits(30.0, "longest a shared-memory client may hold pages it was granted (a Get's "
                                     "read holds, a Put's reserved slots) before the node takes them back",
                                     "SECONDS", gt=0)

    @model_validator(mode="after")
    def _together(self) -> NodeConfig:
        """Checks that span two settings."""
        if not self.heartbeat_interval < self.heartbeat_timeout:
            raise ValueError("need heartbeat_interval < heartbeat_timeout")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("tls_cert and tls_key go together")
        if self.tls_client_auth and not self.tls_ca:
            raise ValueError("tls_client_auth needs tls_ca (the CA that signs client certificates)")
        return self

    @property
    def host(self) -> str:
        return parse_hostport(self.listen)[0]

    @property
    def tls(self) -> bool:
        """Whether this node's ports speak TLS (it has a certificate)."""
        return bool(self.tls_cert)

    @property
    def loopback_only(self) -> bool:
        """Whether the listen host is a loopback address (development mode is allowed there)."""
        host = self.host
        if host == "localhost":
            return True
        try:
            return ipaddress.ip_address(host).is_loopback
        except ValueError:
            return False

    @property
    def secured(self) -> bool:
        """TLS, client tokens and a cluster secret: what a node off loopback needs."""
        return self.tls and bool(self.token_file) and bool(self.cluster_secret_file)

    def replace(self, **changes: Any) -> NodeConfig:
        """A copy with ``changes``, validated like any other construction."""
        return NodeConfig(**{**dict(self), **changes})

    def feeding(self, part: Literal["planner", "predictor"]) -> dict[str, Any]:
        """The values of the settings that feed ``part``, by the names of its knobs: ``PlannerConfig(
        **config.feeding("planner"))`` (:mod:`kvstore.placement.planner_types`) and the same for the
        predictor's ``PredictorConfig``; knobs no setting names keep their defaults there."""
        return {s.extra[part]: getattr(self, s.name) for s in SETTINGS if s.extra[part]}


# ---------------------------------------------------------------------------
# the settings, as flags, file keys, environment variables and a document
# ---------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Setting:
    """One field of :class:`NodeConfig` seen from outside: its names in each source and its text."""

    name: str
    info: FieldInfo

    @property
    def extra(self) -> dict[str, Any]:
        return self.info.json_schema_extra  # type: ignore[return-value]

    @property
    def group(self) -> str:
        return str(self.extra["group"])

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.name.upper()

    @property
    def help(self) -> str:
        return self.info.description or ""

    @property
    def metavar(self) -> str:
        return str(self.extra["metavar"])

    @property
    def repeat(self) -> bool:
        return bool(self.extra["repeat"])

    @property
    def default(self) -> Any:
        return self.info.default

    @property
    def default_text(self) -> str:
        d = self.default
        if isinstance(d, bool):
            return "true" if d else "false"
        if isinstance(d, tuple):
            return ",".join(map(str, d)) or "none"
        return '""' if d == "" else str(d)

    @property
    def choices(self) -> tuple[str, ...]:
        """The values a ``Literal`` setting takes; empty for the others."""
        literal = getattr(self.info.annotation, "__origin__", None) is Literal
        return tuple(self.info.annotation.__args__) if literal else ()  # type: ignore[union-attr]

    @property
    def bounds_text(self) -> str:
        """The bounds, e.g. ``> 0``, ``-1..65535``; empty when free."""
        low = high = ""
        for m in self.info.metadata:
            if isinstance(m, Gt):
                low = f"> {m.gt}"
            elif isinstance(m, Ge):
                low = f">= {m.ge}"
            elif isinstance(m, Lt):
                high = f"< {m.lt}"
            elif isinstance(m, Le):
                high = f"<= {m.le}"
        if low.startswith(">=") and high.startswith("<="):
            return f"{low[3:]}..{high[3:]}"
        return ", ".join(x for x in (low, high) if x)


SETTINGS: tuple[Setting, ...] = tuple(Setting(name, info) for name, info in NodeConfig.model_fields.items())
"""Every setting, in the order of their groups."""
_BY_NAME: dict[str, Setting] = {s.name: s for s in SETTINGS}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per setting, in a help section per group, plus ``--config``."""
    parser.add_argument("--config", type=Path, metavar="FILE",
                        help="TOML file with any of the settings below: keys as the flags ('-' or '_'), at the top "
                             "level or in a table named by the setting's group, e.g. [pool] capacity = \"4GiB\"")
    for group, text in GROUPS.items():
        section = parser.add_argument_group(group, text)
        for s in SETTINGS:
            if s.group != group:
                continue
            allowed = f"one of {', '.join(s.choices)}" if s.choices else s.bounds_text
            bounds = f"; {allowed}" if allowed else ""
            kwargs: dict[str, Any] = dict(dest=s.name, metavar=s.metavar, default=None,
                                          help=f"{s.help} [default: {s.default_text}{bounds}; env {s.env}]")
            if s.repeat:
                kwargs["action"] = "append"
            section.add_argument(s.flag, **kwargs)


def add_override(parser: Any, name: str, default: Any, *, flag: str | None = None, dest: str | None = None,
                 note: str = "") -> None:
    """A flag for a program that starts nodes (the replay) with its own default for one setting.

    The help is the setting's own, with ``note``; a value is checked by the setting's own validators and
    kept in the type of ``default`` (a string stays as written, to be passed on as a flag)."""
    s = _BY_NAME[name]
    typ = Annotated[(s.info.annotation, *s.info.metadata)] if s.info.metadata else s.info.annotation  # type: ignore[misc]
    adapter: TypeAdapter[Any] = TypeAdapter(typ)
    keep = type(default)

    def check(text: str) -> Any:
        try:
            value = adapter.validate_python(text)
        except ValidationError as exc:
            raise ValueError(_explain(exc)) from None
        return text if keep is str else keep(value)

    check.__name__ = name  # argparse says "invalid <name> value: ..."
    parser.add_argument(flag or s.flag, dest=dest or name, metavar=s.metavar, default=default, type=check,
                        help=f"kvstored {s.flag}: {s.help}{'; ' + note if note else ''}")


def _file_values(path: Path) -> dict[str, Any]:
    """A TOML file's settings, flat: top-level keys and the keys of each group's table."""
    with open(path, "rb") as fh:
        data = tomllib.load(fh)
    flat: dict[str, Any] = {}

    def put(key: str, value: Any, group: str = "") -> None:
        name = key.replace("-", "_")
        where = f" in [{group}]" if group else ""
        if name not in _BY_NAME:
            raise ValueError(f"{path}: unknown setting {key!r}{where}")
        if group and _BY_NAME[name].group != group:
            raise ValueError(f"{path}: {key!r} belongs in [{_BY_NAME[name].group}], not{where}")
        flat[name] = value

    for key, value in data.items():
        if key in GROUPS and isinstance(value, dict):
            for k, v in value.items():
                put(k, v, key)
        else:
            put(key, value)
    return flat


def _explain(exc: ValidationError, origins: Mapping[str, str] | None = None, everywhere: str = "") -> str:
    """One line per error: where the value came from, the setting, what is wrong (a check across settings
    names no setting; ``everywhere`` is where its values came from)."""
    lines = []
    for err in exc.errors(include_url=False):
        name = str(err["loc"][0]) if err["loc"] else ""
        where = (origins or {}).get(name, everywhere) if name else everywhere
        lines.append(": ".join(x for x in (where, name, str(err["msg"]).removeprefix("Value error, ")) if x))
    return "; ".join(lines)[:2000]


def build_config(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> NodeConfig:
    """Merge defaults < the config file < ``KVSTORED_*`` environment < flags into one :class:`NodeConfig`.

    ``environ`` replaces ``os.environ`` (``{}``: ignore the environment, as the simulator does). Raises
    ValueError naming the source and the setting of a bad value, OSError for an unreadable file."""
    environ = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    origins: dict[str, str] = {}  # setting -> where its value came from: the file, its variable or its flag
    if getattr(args, "config", None):
        values = _file_values(Path(args.config))
        origins = dict.fromkeys(values, str(args.config))
    for s in SETTINGS:
        if s.env in environ:
            values[s.name], origins[s.name] = environ[s.env], s.env
        if (flag := getattr(args, s.name, None)) is not None:
            values[s.name], origins[s.name] = flag, s.flag
    try:
        return NodeConfig(**values)
    except ValidationError as exc:
        raise ValueError(_explain(exc, origins, everywhere=", ".join(dict.fromkeys(origins.values())))) from None


def setting_flags(values: Mapping[str, Any]) -> list[str]:
    """kvstored flags that set these settings (by name) to these values: how a program that starts nodes
    passes settings on, written as a user would write them (``--predictor-depths 1,2,4``, ``--shm false``)."""
    out: list[str] = []
    for name, value in values.items():
        s = _BY_NAME[name]
        if s.repeat:
            for v in value:
                out += [s.flag, f"{v.name}:{v.page_bytes}:{v.capacity}" if isinstance(v, NamespaceSpec) else str(v)]
        elif isinstance(value, bool):
            out += [s.flag, "true" if value else "false"]
        else:
            out += [s.flag, ",".join(map(str, value)) if isinstance(value, tuple) else str(value)]
    return out


def markdown() -> str:
    """``docs/configuration.md``, made from the settings (``python -m kvstore.config > docs/configuration.md``)."""
    out = [
        "# Configuration",
        "",
        "<!-- generated by `python -m kvstore.config` from kvstore/config.py; "
        "tests/unit/config/test_config.py fails when it is stale -->",
        "",
        "Every `kvstored` setting can be given four ways. Later ones win:",
        "",
        "1. its default (below);",
        "2. a TOML file named by `--config FILE`: the key is the flag's name with `-` or `_`, at the top level or",
        "   in a table named by the setting's group (`[pool]`, `[limits]`, ...);",
        f"3. the environment: `{ENV_PREFIX}` and the name in capitals, e.g. `{ENV_PREFIX}CAPACITY=4GiB`;",
        "4. the flag, e.g. `--capacity 4GiB`.",
        "",
        "Sizes take a number with an optional unit: `4096`, `1e9`, `512MiB`, `4GiB`, `2TB` (`KiB`, `MiB`, `GiB`,",
        "`TiB` are powers of 1024; `KB`, `MB`, `GB`, `TB` and the short `k`, `m`, `g`, `t` powers of 1000).",
        "Booleans take `true`/`false`, `1`/`0`, `yes`/`no`, `on`/`off`. Lists are comma-separated in flags and",
        "the environment and TOML arrays in the file. A bad value stops `kvstored` at start-up with a message",
        "that names the setting and where the value came from.",
        "",
        "```toml",
        "# kvstored --config kvstored.toml",
        'listen = "10.0.0.5:7400"',
        'peers = ["10.0.0.6:7400", "10.0.0.7:7400"]',
        "",
        "[pool]",
        'capacity = "64GiB"',
        'namespace = [{ name = "llama3-70b", page_bytes = "160MiB" }]',
        "",
        "[security]",
        'tls_cert = "/etc/kvstore/node.pem"',
        'tls_key = "/etc/kvstore/node.key"',
        'tls_ca = "/etc/kvstore/ca.pem"',
        'token_file = "/etc/kvstore/tokens.toml"',
        'cluster_secret_file = "/etc/kvstore/cluster.secret"',
        "```",
    ]
    for group, text in GROUPS.items():
        out += ["", f"## {group}", "", text, "", "| flag | environment | default | bounds | what it does |",
                "|---|---|---|---|---|"]
        for s in SETTINGS:
            if s.group == group:
                bounds = ", ".join(s.choices) or s.bounds_text
                repeat = " (repeatable)" if s.repeat else ""
                out.append(f"| `{s.flag} {s.metavar}`{repeat} | `{s.env}` | `{s.default_text}` | {bounds} | "
                           f"{s.help.replace('|', '/')} |")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    print(markdown(), end="")
