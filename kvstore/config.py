"""Node configuration: one typed object, built once and passed down.

One table of settings (:data:`SETTINGS`) drives the command-line flags, the
TOML config file and the ``KVSTORED_*`` environment overrides, so the three
never drift apart. Precedence: defaults < config file < environment < flags.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Callable

from kvstore.units import parse_size

DEVICES_HELP = ("auto (a GPU when CuPy finds one, else cpu), cpu, cuda:N, or cpu-staged (host memory driven "
                "like a GPU pool, through staging copies: tests and CI)")


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


def parse_peers(value: str | list[str]) -> tuple[str, ...]:
    """``host:port,host:port`` (or a TOML list) -> validated tuple."""
    if not isinstance(value, (str, list)):
        raise ValueError(f"expected a string or list of HOST:PORT, got {value!r}")
    items = value if isinstance(value, list) else [p for p in value.split(",") if p.strip()]
    peers = []
    for item in items:
        if not isinstance(item, str):
            raise ValueError(f"peer {item!r} is not a HOST:PORT string")
        parse_hostport(item.strip(), allow_zero_port=False)
        peers.append(item.strip())
    if len(set(peers)) != len(peers):
        raise ValueError(f"duplicate peer in {value!r}")
    return tuple(peers)


def parse_device(value: str) -> str:
    if not isinstance(value, str):
        raise ValueError(f"bad device {value!r}: {DEVICES_HELP}")
    if value in ("auto", "cpu", "cpu-staged") or (value.startswith("cuda:") and value[5:].isdigit()):
        return value
    raise ValueError(f"bad device {value!r}: {DEVICES_HELP}")


def parse_bool(value: str | bool) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{value!r} is not a boolean (true/false)")


def parse_choice(*choices: str) -> Callable[[str], str]:
    def parse(value: str) -> str:
        if value not in choices:
            raise ValueError(f"{value!r} is not one of {', '.join(choices)}")
        return value
    return parse


@dataclass(frozen=True, slots=True)
class NamespaceSpec:
    """A namespace created at start-up (``--namespace NAME:PAGE_BYTES[:CAPACITY]``)."""

    name: str
    page_bytes: int
    capacity: int = 0

    @classmethod
    def parse(cls, value: str | dict[str, Any]) -> "NamespaceSpec":
        if isinstance(value, dict):
            return cls(str(value["name"]), parse_size(value["page_bytes"]), parse_size(value.get("capacity", 0)))
        if not isinstance(value, str):
            raise ValueError(f"bad namespace {value!r}: expected NAME:PAGE_BYTES[:CAPACITY] or a table")
        parts = value.split(":")
        if len(parts) not in (2, 3):
            raise ValueError(f"bad namespace {value!r}: expected NAME:PAGE_BYTES[:CAPACITY]")
        return cls(parts[0], parse_size(parts[1]), parse_size(parts[2]) if len(parts) == 3 else 0)


def _parse_namespaces(value: Any) -> tuple[NamespaceSpec, ...]:
    items = value if isinstance(value, list) else [value]
    return tuple(NamespaceSpec.parse(v) for v in items)


@dataclass(frozen=True, slots=True)
class NodeConfig:
    """Everything a node needs to start; validated on construction."""

    listen: str = "127.0.0.1:7400"
    node_id: str = ""
    capacity: int = 1 << 30
    device: str = "auto"
    peers: tuple[str, ...] = ()
    namespace: tuple[NamespaceSpec, ...] = ()
    prefault: bool = True
    checksum: bool = True
    data_port: int = 0
    heartbeat_interval: float = 0.5
    heartbeat_timeout: float = 2.0
    transport: str = "auto"
    transport_port: int = 0
    replication: str = "reactive"
    predictor_model: str = ""
    predictor_depths: tuple[int, ...] = (1, 2, 4, 8)
    predictor_horizon: float = 300.0
    planner_tick: float = 1.0
    spec_threshold: float = 0.65  # above the model's best-F1 point (0.5): an unread copy costs link time (docs/predictor.md)
    spec_budget: float = 0.2
    spec_bandwidth: int = 10**9
    spec_ttl: float = 120.0
    node_rate: float = 2.0  # sizes replica sets from forecast demand (docs/predictor.md); 0: unsized, 2 copies a tick
    copy_fanout: int = 2
    copy_chunks: int = 1
    copy_part_min: float = 0.02
    keep_fetched: bool = True
    fetch_timeout: float = 5.0
    max_pull_bytes: int = 64 << 20
    link_rate: float = 0.0
    link_latency: float = 0.0
    metrics_port: int = -1
    log_level: str = "info"
    loop: str = "auto"
    max_message_bytes: int = 64 << 20
    max_batch_pages: int = 65536
    max_batch_bytes: int = 1 << 30
    max_pin_ttl: float = 3600.0
    max_claim_seconds: float = 600.0   # the longest in-flight prefill claim a Lookup may make
    grace: float = 5.0
    deadline_share: float = 0.8
    control_timeout: float = 5.0
    transfer_timeout: float = 30.0
    read_timeout: float = 5.0
    idle_timeout: float = 120.0
    max_connections: int = 256
    predictor_momentum_window: float = 60.0
    shm: bool = True
    shm_dir: str = ""
    shm_hold_timeout: float = 30.0
    tls_cert: str = ""
    tls_key: str = ""
    tls_ca: str = ""
    tls_client_auth: bool = False
    token_file: str = ""
    cluster_secret_file: str = ""
    insecure: bool = False
    membership: str = "gossip"
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        try:
            parse_hostport(self.listen)
        except ValueError as exc:
            raise ValueError(f"listen: {exc}") from None
        parse_device(self.device)
        if self.capacity <= 0:
            raise ValueError("capacity must be > 0")
        if self.max_message_bytes < 1 << 20:
            raise ValueError("max_message_bytes must be >= 1 MiB")
        if self.max_batch_pages <= 0:
            raise ValueError("max_batch_pages must be > 0")
        if self.max_batch_bytes <= 0:
            raise ValueError("max_batch_bytes must be > 0")
        if not 0 < self.max_pin_ttl <= 86400 * 7:
            raise ValueError("max_pin_ttl must be in (0, 604800] seconds")
        if not 0 < self.max_claim_seconds <= 86400:
            raise ValueError("max_claim_seconds must be in (0, 86400] seconds")
        if not self.grace >= 0:  # also rejects NaN
            raise ValueError("grace must be >= 0")
        if not self.predictor_depths or any(d <= 0 for d in self.predictor_depths) \
                or list(self.predictor_depths) != sorted(set(self.predictor_depths)):
            raise ValueError("predictor_depths must be ascending positive block counts, e.g. 1,2,4,8")
        if not 0 < self.planner_tick <= 60 or not 0 < self.spec_ttl or not 0 < self.predictor_horizon:
            raise ValueError("planner_tick must be in (0, 60]; spec_ttl and predictor_horizon > 0")
        if not self.shm_hold_timeout > 0:
            raise ValueError("shm_hold_timeout must be > 0")
        if not self.node_rate >= 0:
            raise ValueError("node_rate must be >= 0")
        if not 1 <= self.copy_fanout <= 64:
            raise ValueError("copy_fanout must be in [1, 64]")
        if not 1 <= self.copy_chunks <= 256:
            raise ValueError("copy_chunks must be in [1, 256]")
        if not self.copy_part_min > 0:
            raise ValueError("copy_part_min must be > 0")
        if not 0 <= self.spec_threshold <= 1 or not 0 <= self.spec_budget <= 1:
            raise ValueError("spec_threshold and spec_budget must be in [0, 1]")
        if self.spec_bandwidth <= 0:
            raise ValueError("spec_bandwidth must be > 0")
        if not 0 < self.heartbeat_interval < self.heartbeat_timeout:
            raise ValueError("need 0 < heartbeat_interval < heartbeat_timeout")
        if not 0 < self.deadline_share <= 1:
            raise ValueError("deadline_share must be in (0, 1]")
        if not (self.control_timeout > 0 and self.transfer_timeout > 0 and self.predictor_momentum_window > 0):
            raise ValueError("control_timeout, transfer_timeout and predictor_momentum_window must be > 0")
        if not (self.read_timeout > 0 and self.idle_timeout > 0):
            raise ValueError("read_timeout and idle_timeout must be > 0")
        if self.max_connections <= 0:
            raise ValueError("max_connections must be > 0")
        if not self.fetch_timeout >= 0:
            raise ValueError("fetch_timeout must be >= 0")
        if self.max_pull_bytes < 1 << 20:
            raise ValueError("max_pull_bytes must be >= 1 MiB")
        if not (self.link_rate >= 0 and self.link_latency >= 0):
            raise ValueError("link_rate and link_latency must be >= 0")
        if not 0 <= self.transport_port <= 65535:
            raise ValueError("transport_port must be 0..65535")
        for port_name in ("data_port", "metrics_port"):
            if not -1 <= getattr(self, port_name) <= 65535:
                raise ValueError(f"{port_name} must be -1..65535")

        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("tls_cert and tls_key go together")
        if self.tls_client_auth and not self.tls_ca:
            raise ValueError("tls_client_auth needs tls_ca (the CA that signs client certificates)")
        if not (self.membership == "gossip" or self.membership.startswith(("etcd://", "etcds://"))):
            raise ValueError("membership must be 'gossip' or etcd://HOST:PORT[,HOST:PORT...] (etcds:// for TLS)")

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


_DEFAULTS: dict[str, Any] = {f.name: f.default for f in fields(NodeConfig) if f.name != "extra"}


@dataclass(frozen=True, slots=True)
class Setting:
    """How one :class:`NodeConfig` field is set from a flag, the file or env.

    The default lives once, on the field; :attr:`default` reads it there."""

    name: str
    parse: Callable[[Any], Any]
    help: str
    metavar: str | None = None
    repeat: bool = False  # flag may repeat; values accumulate

    @property
    def default(self) -> Any:
        return _DEFAULTS[self.name]




SETTINGS: tuple[Setting, ...] = (
    Setting("listen", str, "gRPC address HOST:PORT (port 0 picks a free one)", "HOST:PORT"),
    Setting("node_id", str, "this node's id in the cluster (default: the listen address)", "ID"),
    Setting("capacity", parse_size, "bytes of page memory for all namespaces, e.g. 4GiB", "SIZE"),
    Setting("device", parse_device, f"where pages live: {DEVICES_HELP}", "DEVICE"),
    Setting("peers", parse_peers, "other nodes, HOST:PORT,HOST:PORT,... (used by the cluster layer)", "LIST"),
    Setting("namespace", _parse_namespaces, "create a namespace at start-up, NAME:PAGE_BYTES[:CAPACITY]; repeatable",
            "SPEC", repeat=True),
    Setting("prefault", parse_bool, "touch host pool memory at namespace creation so first puts don't "
            "page-fault (true/false)", "BOOL"),
    Setting("checksum", parse_bool, "xxh3 checksum of every page at put, verified on peer transfers",
            "BOOL"),
    Setting("data_port", int, "port of the bulk data channel on the listen host (0: pick one, -1: off)", "PORT"),
    Setting("heartbeat_interval", float, "seconds between heartbeats to each peer", "SECONDS"),
    Setting("heartbeat_timeout", float, "a peer silent this long is dead: its directory entries are dropped",
            "SECONDS"),
    Setting("transport", parse_choice("auto", "ucx", "tcp"), "peer page transport: auto prefers UCX (ucxx) when it imports, else TCP", "NAME"),
    Setting("transport_port", int, "port of the peer transport listener (0: pick one)", "PORT"),
    Setting("replication", parse_choice("none", "reactive", "predictive", "full"), "none: a Get serves local pages only; reactive: a Get pulls missing pages from the peers that hold "
            "them; predictive: reactive, plus the coordinator copies prefixes it forecasts to nodes before "
            "their requests arrive; full: every page is copied to every node (the cost ceiling)", "POLICY"),
    Setting("predictor_model", str, "LightGBM model file from `kvctl train` (default: the shipped model, "
            "kvstore/data/burst_model.json; 'none': the momentum rule until online retraining has enough data)",
            "FILE"),
    Setting("predictor_depths", lambda v: tuple(int(x) for x in (v.split(",") if isinstance(v, str) else v)),
            "prefix depths in blocks the predictor tracks", "LIST"),
    Setting("predictor_horizon", float, "H: the predictor forecasts requests within this many seconds",
            "SECONDS"),
    Setting("planner_tick", float, "seconds between planner ticks on the coordinator", "SECONDS"),
    Setting("spec_threshold", float, "replicate a prefix when its forecast probability is at least this",
            "P"),
    Setting("spec_budget", float, "share of each node's capacity that speculative replicas may use",
            "FRACTION"),
    Setting("spec_bandwidth", parse_size, "bytes/s the planner may spend on speculative "
            "copies, cluster-wide", "BYTES"),
    Setting("spec_ttl", float, "seconds an unread speculative replica lives unless renewed", "SECONDS"),
    Setting("node_rate", float, "requests/s one node's engines serve: sizes each prefix's replica set from its "
            "forecast demand, copied as a tree (0: unknown; at most 2 new copies per prefix per tick)", "RPS"),
    Setting("copy_fanout", int, "copies one node sends at once in a copy tree (each wave's copies share its "
            "egress): 1 doubles the holders every single-copy time", "N"),
    Setting("copy_chunks", int, "> 1: a copy tree relays instead, each source heading a chain of its targets "
            "and every target forwarding each of this many parts of the copy once it landed (the last of L "
            "targets holds it after 1 + (L - 1) / N copy times); 1: store and forward in waves", "N"),
    Setting("copy_part_min", float, "a relayed copy is cut only into parts that take at least this long at the "
            "measured copy bandwidth (each part costs a Replicate round trip per hop), so a copy short next to "
            "its round trips is not relayed", "SECONDS"),
    Setting("keep_fetched", parse_bool, "keep pages a Get pulled from a peer as local replicas", "BOOL"),
    Setting("fetch_timeout", float, "longest a Get waits for remote pages when the client gives no deadline; "
            "what has not arrived by then is reported missing", "SECONDS"),
    Setting("max_pull_bytes", parse_size, "largest single peer transfer; bigger pulls are "
            "chunked so a deadline keeps what arrived", "SIZE"),
    Setting("link_rate", float, "shape peer transfers to this many bytes/s per node and direction, shared "
            "fairly by concurrent transfers (0: unshaped; benchmarks set it)", "BYTES_PER_S"),
    Setting("link_latency", float, "one-way latency added to each peer transfer's request and reply "
            "(with --link-rate)", "SECONDS"),
    Setting("metrics_port", int, "Prometheus metrics port on the listen host (0: pick one, -1: off)", "PORT"),
    Setting("log_level", parse_choice("debug", "info", "warning", "error"), "logging level", "LEVEL"),
    Setting("loop", parse_choice("auto", "uvloop", "asyncio"), "event loop: auto prefers uvloop", "LOOP"),
    Setting("max_message_bytes", parse_size, "largest gRPC message either way", "SIZE"),
    Setting("max_batch_pages", int, "most pages in one Put/Get batch", "N"),
    Setting("max_batch_bytes", parse_size, "most page bytes in one Put/Get batch", "SIZE"),
    Setting("max_pin_ttl", float, "longest lease a Pin may ask for, seconds", "SECONDS"),
    Setting("max_claim_seconds", float, "longest in-flight prefill claim a Lookup may make, seconds", "SECONDS"),
    Setting("grace", float, "seconds in-flight calls get to finish on SIGTERM", "SECONDS"),
    Setting("deadline_share", float, "share of a Get's deadline spent fetching from peers; the rest is left to "
            "send what arrived", "FRACTION"),
    Setting("control_timeout", float, "timeout of the coordinator's control calls to nodes (Replicate, "
            "DropSpeculative), seconds", "SECONDS"),
    Setting("transfer_timeout", float, "longest a Put or a peer transfer may hold reserved slots waiting for its "
            "bytes; then it aborts and frees them", "SECONDS"),
    Setting("read_timeout", float, "longest a data-channel frame, a peer pull or a gRPC Put stream may go "
            "without a byte (a message) once it started; then it gets an error, is closed and its slots freed",
            "SECONDS"),
    Setting("idle_timeout", float, "a data-channel or peer-transport connection that starts no frame for this "
            "long is closed", "SECONDS"),
    Setting("max_connections", int, "most open connections on the data channel and on the peer transport "
            "listener (each); one more is answered with an error and closed", "N"),
    Setting("shm", parse_bool, "serve clients on this host through shared memory: host pools live in memfds a "
            "client maps after asking on a unix socket (true/false)", "BOOL"),
    Setting("shm_dir", str, "folder of the shared-memory unix socket (default: a 0700 folder "
            "/tmp/kvstored-UID)", "DIR"),
    Setting("shm_hold_timeout", float, "longest a shared-memory client may hold pages it was granted (a Get's "
            "read holds, a Put's reserved slots) before the node takes them back", "SECONDS"),
    Setting("tls_cert", str, "PEM certificate chain of this node: every port (gRPC, data channel, peer transport, "
            "metrics) speaks TLS with it; re-read when the file changes", "FILE"),
    Setting("tls_key", str, "PEM private key of --tls-cert", "FILE"),
    Setting("tls_ca", str, "PEM CA bundle that signs the cluster's node certificates (peers are verified "
            "against it) and, with --tls-client-auth, client certificates", "FILE"),
    Setting("tls_client_auth", parse_bool, "require a client certificate signed by --tls-ca on every port "
            "(mTLS; true/false)", "BOOL"),
    Setting("token_file", str, "TOML file of client tokens, each with a tenant and a role (read, write, admin), "
            "and tenant quotas; re-read when it changes (rotation without restart). Unset: no client "
            "authentication (loopback development mode only)", "FILE"),
    Setting("cluster_secret_file", str, "file holding the cluster's shared secret: peers prove membership with "
            "an HMAC of every cluster call (replay-protected). Unset: any caller may act as a peer (loopback "
            "development mode only)", "FILE"),
    Setting("insecure", parse_bool, "allow listening beyond loopback without TLS, tokens and a cluster secret "
            "(logged loudly; never in production)", "BOOL"),
    Setting("membership", str, "gossip (heartbeats between --peers) or etcd://HOST:PORT[,HOST:PORT] "
            "(etcds:// for TLS with --tls-ca/--tls-cert/--tls-key): liveness and the coordinator by etcd "
            "leases", "URL"),
    Setting("predictor_momentum_window", float, "W of the momentum rule: a prefix seen at least twice within W "
            "seconds is forecast to recur", "SECONDS"),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per setting, plus ``--config``."""
    parser.add_argument("--config", type=Path, metavar="FILE",
                        help="TOML file with any of the settings below (keys as the flags, '-' or '_')")
    for s in SETTINGS:
        flag = "--" + s.name.replace("_", "-")
        env = "KVSTORED_" + s.name.upper()
        default_text = s.default if not isinstance(s.default, tuple) else ",".join(map(str, s.default)) or "none"
        kwargs: dict[str, Any] = dict(dest=s.name, metavar=s.metavar, default=None,
                                      help=f"{s.help} [default: {default_text}; env {env}]")
        if s.repeat:
            kwargs["action"] = "append"
        parser.add_argument(flag, **kwargs)


def _parse_value(setting: Setting, value: Any, origin: str) -> Any:
    try:
        if setting.repeat and isinstance(value, list):
            return tuple(x for v in value for x in setting.parse(v))
        return setting.parse(value)
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        raise ValueError(f"{origin}: {setting.name}: {exc}") from None


def build_config(args: argparse.Namespace, environ: dict[str, str] | None = None) -> NodeConfig:
    """Merge defaults, the config file, ``KVSTORED_*`` env and flags."""
    environ = os.environ if environ is None else environ
    by_name = {s.name: s for s in SETTINGS}
    values: dict[str, Any] = {}
    if getattr(args, "config", None):
        with open(args.config, "rb") as fh:
            data = tomllib.load(fh)
        for key, value in data.items():
            name = key.replace("-", "_")
            if name not in by_name:
                raise ValueError(f"{args.config}: unknown setting {key!r}")
            values[name] = _parse_value(by_name[name], value, str(args.config))
    for s in SETTINGS:
        env = environ.get("KVSTORED_" + s.name.upper())
        if env is not None:
            values[s.name] = _parse_value(s, env, "KVSTORED_" + s.name.upper())
        flag = getattr(args, s.name, None)
        if flag is not None:
            values[s.name] = _parse_value(s, flag, "--" + s.name.replace("_", "-"))
    known = {f.name for f in fields(NodeConfig)}
    return NodeConfig(**{k: v for k, v in values.items() if k in known})
