"""``kvctl``: admin CLI for kvstore nodes (stats, health, namespaces, bench).

One argparse command tree (:func:`make_parser`). The commands that run
something big (``replay``, ``trace``, ``train``, ``eval-predictor``, ``bench
NAME``) take their options from the module that runs them (``add_*_arguments``
there) and run on the parsed namespace (``run_*``); those modules import
LightGBM, numpy and the replay, so their options are added when the command
line names them (:class:`_Commands`): ``kvctl stats`` and ``kvctl --help``
import none of it.
"""

from __future__ import annotations

import os

# gRPC's fork handlers print fork_posix.cc lines whenever this process starts a daemon (the replay
# does): turn them off before grpc is imported. kvctl never uses gRPC across a fork.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "0")

import argparse  # noqa: E402
import functools
import importlib
import json
import sys
from collections.abc import Callable
from typing import Any

from google.protobuf.json_format import MessageToDict

from kvstore import bench
from kvstore.bench import BENCH_HELP, BENCHES
from kvstore.errors import KvError
from kvstore.units import format_size, parse_size

TABLE_FORMAT = "plain"  # aligned columns under one header line, no rules: the lines the hand-padded tables had


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


STATS_COLUMNS = ("namespace", "page", "used", "pinned", "spec", "hits", "misses", "hit%", "puts", "evict lru/spec")


def _hit_rate(hits: int, misses: int) -> str:
    lookups = hits + misses
    return f"{100 * hits / lookups:.1f}" if lookups else "-"


def render_stats(stats: Any) -> str:
    """``kvctl stats``'s text for a StatsResponse: the node's line, then one row per namespace."""
    head = (f"node {stats.node_id}  device {stats.device}  up {stats.uptime_seconds:.0f}s  "
            f"capacity {format_size(stats.capacity_bytes)} ({format_size(stats.reserved_bytes)} reserved)")
    rows = [[ns.namespace, format_size(ns.page_bytes), f"{ns.used_slots}/{ns.num_slots}", ns.pinned_slots,
             ns.speculative_slots, ns.hits, ns.misses, _hit_rate(ns.hits, ns.misses), ns.puts,
             f"{ns.evictions.get('lru', 0)}/{ns.evictions.get('speculative', 0)}"] for ns in stats.namespaces]
    text = head + "\n" + _table(rows, STATS_COLUMNS, left=1)
    if stats.tiers:
        tiers = [[t.tier, t.path or "-", t.io or "-", f"{format_size(t.used_bytes)}/{format_size(t.capacity_bytes)}",
                  t.pages, t.hits, t.demotions, t.promotions, t.drops, t.evictions, t.corrupt,
                  format_size(t.bytes_written), t.recovered, t.degraded or "ok"] for t in stats.tiers]
        text += "\n\n" + _table(tiers, TIER_COLUMNS, left=3)
    return text


TIER_COLUMNS = ("tier", "path", "io", "used", "pages", "hits", "down", "up", "drops", "evicted", "corrupt", "written",
                "recovered", "state")


CLUSTER_COLUMNS = ("node", "role", "address", "transport", "capacity", "used", "hit%", "remote", "seen")


def render_cluster_status(status: Any) -> str:
    """``kvctl cluster status``'s text for a ClusterStatusResponse: one row per member."""
    head = f"view of {status.node_id}: {len(status.members)} live members, coordinator {status.coordinator}"
    if status.joining:
        head += f"; joining (warmed from the forecast, no traffic yet): {', '.join(status.joining)}"
    rows = [[m.node_id, m.role, m.address, ",".join(f"{e.kind}:{e.port}" for e in m.endpoints),
             format_size(m.capacity_bytes), format_size(m.used_bytes), _hit_rate(m.hits, m.misses), m.remote_hits,
             f"{m.last_seen_seconds_ago:.1f}s"] for m in status.members]
    return head + "\n" + _table(rows, CLUSTER_COLUMNS, left=4)


def _table(rows: list[list[Any]], headers: tuple[str, ...], left: int) -> str:
    """Aligned text columns, the first ``left`` to the left and the rest to the right; cells are printed as
    given (no number parsing: "1.0" stays "1.0")."""
    from tabulate import tabulate  # here: it reads its version with importlib.metadata, 40 ms of every kvctl

    cells = [[str(c) for c in row] for row in rows]
    return tabulate(cells, headers=headers, tablefmt=TABLE_FORMAT, disable_numparse=True,
                    colalign=["left"] * left + ["right"] * (len(headers) - left))


def cmd_stats(args: argparse.Namespace) -> int:
    with _client(args) as kv:
        stats = kv.stats(args.namespace)
    if args.json:
        print(json.dumps(MessageToDict(stats, preserving_proto_field_name=True), indent=2))
        return 0
    print(render_stats(stats))
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
    print(render_cluster_status(status))
    return 0


def cmd_top(args: argparse.Namespace) -> int:
    import grpc

    from kvstore.cli import top

    try:
        return top.run(args, _security(args))
    except grpc.RpcError as exc:
        print(f"kvctl: {args.addr}: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1


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


Build = Callable[[argparse.ArgumentParser], None]


def _command(module: str, add: str, run: str, description: str = "__doc__",
             formatter: type[argparse.HelpFormatter] = argparse.HelpFormatter) -> Build:
    """The builder of a command whose options live in the module that runs it: it imports ``module``, adds its
    options (``add``) to the sub-parser and makes ``run`` the command's; ``description`` names the module's
    text for ``--help``."""
    def build(parser: argparse.ArgumentParser) -> None:
        mod = importlib.import_module(module)
        parser.description = getattr(mod, description)
        parser.formatter_class = formatter
        getattr(mod, add)(parser)
        parser.set_defaults(fn=getattr(mod, run))

    return build


_replay_command = _command("kvstore.replay.cli", "add_replay_arguments", "run_replay",
                           formatter=argparse.ArgumentDefaultsHelpFormatter)


class _Commands(argparse._SubParsersAction):  # type: ignore[type-arg]
    """Sub-commands whose options are added when the command line names one (or at once: ``lazy=False``).

    :meth:`add_command` adds the sub-parser with its name and help (what ``kvctl --help`` lists) and keeps
    ``build``, which adds its options; parsing runs it just before the sub-parser parses, so only the chosen
    command's module is imported. Everything else is argparse's own sub-parser action.
    """

    def __init__(self, *args: Any, lazy: bool = True, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.lazy = lazy
        self._pending: dict[argparse.ArgumentParser, Callable[[argparse.ArgumentParser], None]] = {}

    def add_command(self, name: str, build: Callable[[argparse.ArgumentParser], None],
                    **kwargs: Any) -> argparse.ArgumentParser:
        parser: argparse.ArgumentParser = self.add_parser(name, **kwargs)
        if self.lazy:
            self._pending[parser] = build
        else:
            build(parser)
        return parser

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        chosen = self.choices.get(values[0]) if values else None  # type: ignore[union-attr]
        if chosen is not None and chosen in self._pending:
            self._pending.pop(chosen)(chosen)
        super().__call__(parser, namespace, values, option_string)


def make_parser(lazy: bool = True) -> argparse.ArgumentParser:
    """kvctl's command tree. ``lazy=False`` adds every command's options now (the tests walk the whole tree);
    by default a command's options are added when the command line names it."""
    parser = argparse.ArgumentParser(prog="kvctl", description="Admin CLI for kvstore nodes.")
    sub = parser.add_subparsers(dest="command", required=True, action=_Commands, lazy=lazy)
    conn = _connection_flags()

    p = sub.add_parser("stats", help="print a node's pool and hit statistics", parents=[conn])
    p.add_argument("--namespace", default="", help="one namespace (default: all)")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(fn=cmd_stats)

    p = sub.add_parser("cluster", help="cluster commands: kvctl cluster status --addr HOST:PORT", parents=[conn])
    p.add_argument("action", choices=["status"])
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=cmd_cluster_status)

    p = sub.add_parser("top", help="the cluster refreshing in the terminal: per node pages by kind, hits, remote "
                       "hits, copies coming in, claims (an admin token where nodes have token files)", parents=[conn])
    p.add_argument("--interval", type=float, default=2.0, help="seconds between refreshes")
    p.add_argument("--once", action="store_true", help="print the table once and exit")
    p.set_defaults(fn=cmd_top)

    p = sub.add_parser("health", help="print the node's health status; exit 1 unless SERVING", parents=[conn])
    p.set_defaults(fn=cmd_health)

    p = sub.add_parser("create-namespace", help="create a namespace on a node", parents=[conn])
    p.add_argument("name")
    p.add_argument("--page-bytes", required=True, help="bytes per page, e.g. 1MiB")
    p.add_argument("--capacity", default="0", help="bytes reserved (default: all unreserved)")
    p.add_argument("--exist-ok", action="store_true")
    p.set_defaults(fn=cmd_create_namespace)

    train, evaluate = (_command("kvstore.training.cli", f"add_{name}_arguments", f"run_{name}", text)
                       for name, text in (("train", "TRAIN_DESCRIPTION"), ("eval_predictor", "EVAL_DESCRIPTION")))
    sub.add_command("train", train, help="train the burst predictor from a Mooncake-format trace "
                    "(kvctl train --trace FILE --out MODEL)")
    sub.add_command("eval-predictor", evaluate, help="LightGBM vs momentum on a time-held-out part of a trace "
                    "(kvctl eval-predictor --trace FILE)")
    sub.add_command("replay", _replay_command, help="trace replay on a local cluster, policies side by side "
                    "(also `kvctl bench replay`)")
    sub.add_command("trace", _command("kvstore.replay.cli", "add_trace_arguments", "run_trace", "TRACE_DESCRIPTION"),
                    help="trace tools: kvctl trace synth ... --out FILE")

    p = sub.add_parser("bench", help="run a benchmark of this machine (e.g. kvctl bench micro --total 64MiB; "
                       "kvctl bench replay is the trace replay)", description="Benchmarks of this machine.")
    benches = p.add_subparsers(dest="which", required=True, action=_Commands, lazy=lazy)
    for name in BENCHES:
        benches.add_command(name, functools.partial(bench.configure, name), help=BENCH_HELP[name])
    benches.add_command("engine", functools.partial(bench.configure, "engine"),
                        help="a real vLLM (CPU) with the kvstore connector against vLLM alone, driven by "
                        "`vllm bench serve` (run from the vLLM venv)")
    benches.add_command("replay", _replay_command, help="the trace replay: the same as `kvctl replay`")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = make_parser().parse_args(argv)
    try:
        return int(args.fn(args))
    except KvError as exc:
        print(f"kvctl: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
