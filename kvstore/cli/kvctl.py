"""``kvctl``: admin CLI for kvstore nodes (stats, health, namespaces, bench)."""

from __future__ import annotations

import os

# gRPC's fork handlers print fork_posix.cc lines whenever this process starts a daemon (the replay
# does): turn them off before grpc is imported. kvctl never uses gRPC across a fork.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "0")

import argparse  # noqa: E402
import importlib
import json
import sys

from google.protobuf.json_format import MessageToDict

from kvstore.bench import BENCHES
from kvstore.errors import KvError
from kvstore.units import format_size, parse_size


def _security(args: argparse.Namespace) -> dict[str, str | None]:
    """The client credentials of the connection flags (the token also from KVSTORE_TOKEN)."""
    return dict(tls_ca=args.tls_ca, tls_cert=args.tls_cert, tls_key=args.tls_key,
                token=args.token or os.environ.get("KVSTORE_TOKEN") or None, server_name=args.server_name)


def _client(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    from kvstore_client import KvClient

    return KvClient(args.addr, timeout=10.0, **_security(args))


def _connection_flags() -> argparse.ArgumentParser:
    """--addr and the client credentials, shared by the commands that call a node."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--addr", required=True, help="node gRPC address HOST:PORT")
    p.add_argument("--tls-ca", metavar="FILE", help="PEM CA of the node's certificate: connect with TLS")
    p.add_argument("--tls-cert", metavar="FILE", help="PEM client certificate (nodes with --tls-client-auth)")
    p.add_argument("--tls-key", metavar="FILE", help="PEM key of --tls-cert")
    p.add_argument("--server-name", metavar="NAME", help="name the node's certificate must carry "
                   "(default: the host of --addr)")
    p.add_argument("--token", metavar="TOKEN", help="client token (default: $KVSTORE_TOKEN)")
    return p


def cmd_stats(args: argparse.Namespace) -> int:
    with _client(args) as kv:
        stats = kv.stats(args.namespace)
    if args.json:
        print(json.dumps(MessageToDict(stats, preserving_proto_field_name=True), indent=2))
        return 0
    print(f"node {stats.node_id}  device {stats.device}  up {stats.uptime_seconds:.0f}s  "
          f"capacity {format_size(stats.capacity_bytes)} ({format_size(stats.reserved_bytes)} reserved)")
    header = f"{'namespace':<20} {'page':>9} {'used':>17} {'pinned':>7} {'spec':>6} {'hits':>9} {'misses':>9} " \
             f"{'hit%':>6} {'puts':>9} {'evict lru/spec':>15}"
    print(header)
    for ns in stats.namespaces:
        lookups = ns.hits + ns.misses
        rate = f"{100 * ns.hits / lookups:.1f}" if lookups else "-"
        print(f"{ns.namespace:<20} {format_size(ns.page_bytes):>9} "
              f"{ns.used_slots:>8}/{ns.num_slots:<8} {ns.pinned_slots:>7} {ns.speculative_slots:>6} {ns.hits:>9} "
              f"{ns.misses:>9} {rate:>6} {ns.puts:>9} "
              f"{ns.evictions.get('lru', 0):>7}/{ns.evictions.get('speculative', 0):<7}")
    return 0


def cmd_cluster_status(args: argparse.Namespace) -> int:
    import grpc

    from kvstore.v1 import kvstore_pb2 as pb
    from kvstore.v1 import kvstore_pb2_grpc as pb_grpc
    from kvstore_client._common import Credentials, blocking_channel

    with blocking_channel(args.addr, Credentials(**_security(args))) as channel:
        try:
            status = pb_grpc.ClusterStub(channel).Status(pb.ClusterStatusRequest(), timeout=10)
        except grpc.RpcError as exc:
            print(f"kvctl: {args.addr}: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 1
    if args.json:
        print(json.dumps(MessageToDict(status, preserving_proto_field_name=True), indent=2))
        return 0
    print(f"view of {status.node_id}: {len(status.members)} live members, coordinator {status.coordinator}")
    print(f"{'node':<16} {'role':<12} {'address':<22} {'transport':<22} {'capacity':>10} {'used':>10} "
          f"{'hit%':>6} {'remote':>8} {'seen':>6}")
    for m in status.members:
        lookups = m.hits + m.misses
        rate = f"{100 * m.hits / lookups:.1f}" if lookups else "-"
        transport = ",".join(f"{e.kind}:{e.port}" for e in m.endpoints)
        print(f"{m.node_id:<16} {m.role:<12} {m.address:<22} {transport:<22} {format_size(m.capacity_bytes):>10} "
              f"{format_size(m.used_bytes):>10} {rate:>6} {m.remote_hits:>8} {m.last_seen_seconds_ago:>5.1f}s")
    return 0


def cmd_health(args: argparse.Namespace) -> int:
    with _client(args) as kv:
        status = kv.health()
    print(status)
    return 0 if status == "SERVING" else 1


def cmd_create_namespace(args: argparse.Namespace) -> int:
    with _client(args) as kv:
        info = kv.create_namespace(args.name, parse_size(args.page_bytes), capacity=parse_size(args.capacity),
                                   exist_ok=args.exist_ok)
    print(f"{info.namespace}: {info.num_slots} slots of {format_size(info.layout.page_bytes)} on {info.device}")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    bench = importlib.import_module(f"kvstore.bench.{args.which}")
    return int(bench.main(args.rest) or 0)


def cmd_train(args: argparse.Namespace) -> int:
    from kvstore.predict.cli import train_main

    return train_main(args.rest)


def cmd_eval(args: argparse.Namespace) -> int:
    from kvstore.predict.cli import eval_main

    return eval_main(args.rest)


def cmd_replay(args: argparse.Namespace) -> int:
    from kvstore.replay.cli import replay_main

    return replay_main(args.rest)


def cmd_trace(args: argparse.Namespace) -> int:
    from kvstore.replay.cli import trace_main

    return trace_main(args.rest)


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvctl", description="Admin CLI for kvstore nodes.")
    sub = parser.add_subparsers(dest="command", required=True)
    conn = _connection_flags()

    p = sub.add_parser("stats", help="print a node's pool and hit statistics", parents=[conn])
    p.add_argument("--namespace", default="", help="one namespace (default: all)")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(fn=cmd_stats)

    p = sub.add_parser("cluster", help="cluster commands: kvctl cluster status --addr HOST:PORT", parents=[conn])
    p.add_argument("action", choices=["status"])
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=cmd_cluster_status)

    p = sub.add_parser("health", help="print the node's health status; exit 1 unless SERVING", parents=[conn])
    p.set_defaults(fn=cmd_health)

    p = sub.add_parser("create-namespace", help="create a namespace on a node", parents=[conn])
    p.add_argument("name")
    p.add_argument("--page-bytes", required=True, help="bytes per page, e.g. 1MiB")
    p.add_argument("--capacity", default="0", help="bytes reserved (default: all unreserved)")
    p.add_argument("--exist-ok", action="store_true")
    p.set_defaults(fn=cmd_create_namespace)

    p = sub.add_parser("train", help="train the burst predictor from a Mooncake-format trace "
                       "(kvctl train --trace FILE --out MODEL; --help for all options)", add_help=False)
    p.add_argument("rest", nargs=argparse.REMAINDER)
    p.set_defaults(fn=cmd_train)

    p = sub.add_parser("eval-predictor", help="LightGBM vs momentum on a time-held-out part of a trace "
                       "(kvctl eval-predictor --trace FILE; --help for all options)", add_help=False)
    p.add_argument("rest", nargs=argparse.REMAINDER)
    p.set_defaults(fn=cmd_eval)

    p = sub.add_parser("replay", help="trace replay on a local cluster, policies side by side (also "
                       "`kvctl bench replay`; --help for all options)", add_help=False)
    p.add_argument("rest", nargs=argparse.REMAINDER)
    p.set_defaults(fn=cmd_replay)

    p = sub.add_parser("trace", help="trace tools: kvctl trace synth ... --out FILE (--help for all options)",
                       add_help=False)
    p.add_argument("rest", nargs=argparse.REMAINDER)
    p.set_defaults(fn=cmd_trace)

    p = sub.add_parser("bench", help="run a benchmark of this machine (e.g. kvctl bench micro --total 64MiB; "
                       "kvctl bench replay --help for the trace replay)")
    p.add_argument("which", choices=BENCHES)
    p.add_argument("rest", nargs=argparse.REMAINDER, help="arguments for the benchmark")
    p.set_defaults(fn=cmd_bench)
    return parser


_PASS_THROUGH = {"train": cmd_train, "eval-predictor": cmd_eval, "replay": cmd_replay, "trace": cmd_trace}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in _PASS_THROUGH:  # these parse their own options (argparse REMAINDER drops --flags)
        return _PASS_THROUGH[argv[0]](argparse.Namespace(rest=argv[1:]))
    if argv[:2] == ["bench", "replay"]:  # the replay is a package, not a bench/*.py script
        return cmd_replay(argparse.Namespace(rest=argv[2:]))
    args = make_parser().parse_args(argv)
    try:
        return args.fn(args)
    except KvError as exc:
        print(f"kvctl: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
