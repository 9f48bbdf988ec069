"""kvctl's command tree: every command's help, no argparse.REMAINDER pass-through
anywhere, the replay's options the same under ``kvctl replay``, ``kvctl bench
replay`` and ``replay_main``, and the stats and cluster tables (rendered from
constructed responses; no node is started)."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from collections.abc import Iterator

import pytest

from kvstore.cli import kvctl
from kvstore.v1 import kvstore_pb2 as pb

COMMANDS = [
    [], ["stats"], ["cluster"], ["health"], ["create-namespace"], ["train"], ["eval-predictor"], ["replay"],
    ["trace"], ["trace", "synth"], ["bench"], ["bench", "micro"], ["bench", "replication"],
    ["bench", "replication_raw"], ["bench", "replay"],
]
REPLAY_ARGV = ["--sim", "--policies", "none,predictive", "--window", "30"]
KVCTL_DESTS = {"command", "which", "fn"}  # kvctl's own: the sub-command chosen and the function that runs it


@pytest.fixture(autouse=True)
def _environ() -> Iterator[None]:
    """Importing kvstore.bench.replication_raw sets UCX_* variables (loopback): keep them out of other tests."""
    saved = os.environ.copy()
    yield
    os.environ.clear()
    os.environ.update(saved)


def _help(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as exc:
        kvctl.main([*argv, "--help"])
    assert exc.value.code == 0, argv
    return capsys.readouterr().out


@pytest.mark.parametrize("argv", COMMANDS, ids=lambda a: " ".join(a) or "kvctl")
def test_every_command_has_help(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    out = _help(argv, capsys)
    assert out.startswith(f"usage: {' '.join(['kvctl', *argv])} "), out[:200]


def test_replay_help_is_the_replays_full_help(capsys: pytest.CaptureFixture[str]) -> None:
    from kvstore.replay.cli import replay_parser

    full = replay_parser().format_help()
    for argv in (["replay"], ["bench", "replay"]):
        out = _help(argv, capsys)
        # all but the usage lines (their wrapping follows the program name): the description and every option
        assert out.split("\n\n", 1)[1] == full.split("\n\n", 1)[1]
        for flag in ("--sim-rpc-ms", "--kvstored-arg", "--synth-output-tokens", "(default: 4.0)"):
            assert flag in out


def test_kvctl_help_lists_every_command_without_importing_them() -> None:
    code = ("import sys\n"
            "from kvstore.cli.kvctl import main\n"
            "try:\n"
            "    main(['--help'])\n"
            "except SystemExit:\n"
            "    pass\n"
            "try:\n"
            "    main(['stats', '--help'])\n"
            "except SystemExit:\n"
            "    pass\n"
            "heavy = [m for m in ('lightgbm', 'numpy', 'kvstore.replay.cli', 'kvstore.training.cli', "
            "'kvstore.bench.micro') if m in sys.modules]\n"
            "print('HEAVY', heavy)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60).stdout
    assert "HEAVY []" in out, out
    for name in ("stats", "cluster", "health", "create-namespace", "train", "eval-predictor", "replay", "trace",
                 "bench"):
        assert name in out


def _parsers(parser: argparse.ArgumentParser, path: str = "kvctl") -> Iterator[tuple[str, argparse.ArgumentParser]]:
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _parsers(sub, f"{path} {name}")


def test_one_tree_without_remainder() -> None:
    seen = dict(_parsers(kvctl.make_parser(lazy=False)))
    for want in ("kvctl replay", "kvctl trace synth", "kvctl train", "kvctl eval-predictor", "kvctl bench micro",
                 "kvctl bench replication", "kvctl bench replication_raw", "kvctl bench replay"):
        assert want in seen
        assert len(seen[want]._actions) > 3, f"{want} has no options"  # built with its module's options
    for path, parser in seen.items():
        for action in parser._actions:
            assert action.nargs not in (argparse.REMAINDER, argparse.PARSER) \
                or isinstance(action, argparse._SubParsersAction), f"{path}: {action.dest} passes arguments through"
    assert not hasattr(kvctl, "_PASS_THROUGH")


def test_lazy_and_eager_trees_parse_alike() -> None:
    argv = ["bench", "micro", "--total", "8MiB", "--peers", "redis"]
    lazy, eager = vars(kvctl.make_parser().parse_args(argv)), vars(kvctl.make_parser(lazy=False).parse_args(argv))
    assert lazy == eager
    assert lazy["total"] == "8MiB" and lazy["which"] == "micro" and lazy["fn"].__module__ == "kvstore.bench.micro"


def _without_kvctl(ns: argparse.Namespace) -> dict[str, object]:
    return {k: v for k, v in vars(ns).items() if k not in KVCTL_DESTS}


@pytest.mark.parametrize("prefix", [["replay"], ["bench", "replay"]])
def test_replay_parses_as_replay_main(prefix: list[str]) -> None:
    from kvstore.replay.cli import replay_parser, run_replay
    from kvstore.replay.config import ReplayConfig

    alone = replay_parser().parse_args(REPLAY_ARGV)
    ns = kvctl.make_parser().parse_args([*prefix, *REPLAY_ARGV])
    assert _without_kvctl(ns) == vars(alone)
    assert ns.fn is run_replay
    assert set(vars(ns)) - set(vars(alone)) <= KVCTL_DESTS
    # results.json records the replay's arguments: the same, and nothing of kvctl's
    config = ReplayConfig.from_args(ns).to_json()
    assert config == ReplayConfig.from_args(alone).to_json()
    assert not KVCTL_DESTS & set(config)
    assert config["window"] == 30.0 and config["policies"] == "none,predictive" and config["sim"] is True


def test_other_commands_parse_as_their_modules() -> None:
    from kvstore.bench import micro
    from kvstore.training import cli as predict
    from kvstore.replay.cli import trace_parser

    def alone(add, argv: list[str]) -> dict[str, object]:  # type: ignore[no-untyped-def]
        p = argparse.ArgumentParser()
        add(p)
        return vars(p.parse_args(argv))

    trace = ["synth", "--bursts", "3", "--out", "x.jsonl"]
    assert _without_kvctl(kvctl.make_parser().parse_args(["trace", *trace])) == vars(trace_parser().parse_args(trace))
    train = ["--out", "m.json", "--depths", "1,2", "--threads", "2"]
    assert _without_kvctl(kvctl.make_parser().parse_args(["train", *train])) == alone(predict.add_train_arguments,
                                                                                        train)
    ev = ["--labels", "remote", "--source", "synth"]
    assert _without_kvctl(kvctl.make_parser().parse_args(["eval-predictor", *ev])) == \
        alone(predict.add_eval_predictor_arguments, ev)
    bench = ["--total", "8MiB"]
    assert _without_kvctl(kvctl.make_parser().parse_args(["bench", "micro", *bench])) == \
        alone(micro.add_arguments, bench)


def test_unknown_option_is_an_error_of_the_command(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        kvctl.main(["replay", "--no-such-flag"])
    assert exc.value.code == 2
    assert "--no-such-flag" in capsys.readouterr().err


def _cells(line: str) -> list[tuple[int, int, str]]:
    """(start, end, text) of each cell of a table line: runs of text apart by two or more spaces."""
    return [(m.start(), m.end(), m.group()) for m in re.finditer(r"\S+(?: \S+)*", line)]


def _check_aligned(header: str, rows: list[str], left: int) -> None:
    """The first ``left`` columns start under their headers, the others end under them."""
    head = _cells(header)
    for row in rows:
        cells = _cells(row)
        assert len(cells) == len(head), (header, row)
        for i, (h, c) in enumerate(zip(head, cells)):
            assert (c[0] == h[0]) if i < left else (c[1] == h[1]), f"{h[2]!r} / {c[2]!r}:\n{header}\n{row}"


def _stats() -> pb.StatsResponse:
    stats = pb.StatsResponse(node_id="n0", device="cpu", uptime_seconds=12.4, capacity_bytes=8 << 30,
                             reserved_bytes=1 << 30)
    ns = stats.namespaces.add(namespace="llama3-8b", page_bytes=1 << 20, num_slots=1024, used_slots=300,
                              pinned_slots=2, speculative_slots=7, hits=75, misses=25, puts=310)
    ns.evictions["lru"] = 4
    ns.evictions["speculative"] = 11
    stats.namespaces.add(namespace="m", page_bytes=64 << 10, num_slots=16, used_slots=0)
    return stats


def test_stats_table() -> None:
    lines = kvctl.render_stats(_stats()).splitlines()
    assert lines[0] == "node n0  device cpu  up 12s  capacity 8.0 GiB (1.0 GiB reserved)"
    header, *rows = lines[1:]
    assert [c[2] for c in _cells(header)] == ["namespace", "page", "used", "pinned", "spec", "hits", "misses",
                                              "hit%", "puts", "evict lru/spec"]
    assert [[c[2] for c in _cells(r)] for r in rows] == [
        ["llama3-8b", "1.0 MiB", "300/1024", "2", "7", "75", "25", "75.0", "310", "4/11"],
        ["m", "64.0 KiB", "0/16", "0", "0", "0", "0", "-", "0", "0/0"],  # no lookups: no hit rate
    ]
    _check_aligned(header, rows, left=1)  # the namespace left-aligned, the numbers right-aligned


def test_stats_table_without_namespaces() -> None:
    lines = kvctl.render_stats(pb.StatsResponse(node_id="n1", device="cpu")).splitlines()
    assert len(lines) == 2 and lines[1].split()[:2] == ["namespace", "page"]


def test_cluster_table() -> None:
    status = pb.ClusterStatusResponse(node_id="a", coordinator="a")
    m = status.members.add(node_id="a", role="coordinator", address="127.0.0.1:7401", capacity_bytes=1 << 30,
                           used_bytes=1 << 20, hits=1, misses=3, remote_hits=9, last_seen_seconds_ago=0.4)
    m.endpoints.add(kind="tcp", port=7501)
    m.endpoints.add(kind="ucx", port=7502)
    status.members.add(node_id="b", role="member", address="127.0.0.1:7402", last_seen_seconds_ago=1.0) \
        .endpoints.add(kind="tcp", port=7503)
    lines = kvctl.render_cluster_status(status).splitlines()
    assert lines[0] == "view of a: 2 live members, coordinator a"
    header, *rows = lines[1:]
    assert [c[2] for c in _cells(header)] == ["node", "role", "address", "transport", "capacity", "used", "hit%",
                                              "remote", "seen"]
    assert [[c[2] for c in _cells(r)] for r in rows] == [
        ["a", "coordinator", "127.0.0.1:7401", "tcp:7501,ucx:7502", "1.0 GiB", "1.0 MiB", "25.0", "9", "0.4s"],
        ["b", "member", "127.0.0.1:7402", "tcp:7503", "0 B", "0 B", "-", "0", "1.0s"],
    ]
    _check_aligned(header, rows, left=4)  # names and addresses left-aligned, sizes and numbers right-aligned
    status.joining.append("b")
    assert kvctl.render_cluster_status(status).splitlines()[0] == \
        "view of a: 2 live members, coordinator a; joining (warmed from the forecast, no traffic yet): b"
