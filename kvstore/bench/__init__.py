"""Benchmarks users run against their own machine: ``kvctl bench NAME``.

Each module has ``add_arguments(parser)`` (its options) and ``run(args) -> int``
(the benchmark, on the parsed options); :func:`configure` puts both on a
parser and :func:`main` runs one on an argument list. Each writes JSON, a Markdown table and a PNG to ``--out``
(default ``./kvstore-out/bench``); every number is a ratio against a ceiling
measured in the same run (:mod:`kvstore.bench.ceilings`).

* :mod:`kvstore.bench.micro` -- one node's data paths against memcpy and raw TCP (and Redis, Mooncake Store)
* :mod:`kvstore.bench.replication` -- Replicate between two nodes against the raw transports
* :mod:`kvstore.bench.replication_raw` -- the raw TCP and UCX transfers alone
* :mod:`kvstore.bench.tiers` -- the tiers below the pool against raw O_DIRECT file I/O and memcpy, and through real nodes
"""

import argparse
import importlib

BENCHES = ("micro", "replication", "replication_raw", "tiers")

# kvctl's one-line help of each, listed by `kvctl bench --help` without importing the modules (numpy, grpc, ucx)
BENCH_HELP = {
    "micro": "one node's data paths against memcpy and raw TCP (and Redis, Mooncake Store)",
    "replication": "Replicate between two nodes against the raw transports",
    "replication_raw": "the raw TCP and UCX transfers alone",
    "tiers": "the tiers below the pool against raw O_DIRECT file I/O and memcpy, and through real nodes",
}


def configure(name: str, parser: argparse.ArgumentParser) -> None:
    """Give ``parser`` the description and options of bench ``name``, and its ``run`` as ``fn``."""
    bench = importlib.import_module(f"{__name__}.{name}")
    parser.description = bench.__doc__
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    bench.add_arguments(parser)
    parser.set_defaults(fn=bench.run)


def main(name: str, argv: list[str] | None = None) -> int:
    """``kvctl bench NAME ARGV...``: bench ``name`` on an argument list."""
    parser = argparse.ArgumentParser(prog=f"kvctl bench {name}")
    configure(name, parser)
    args = parser.parse_args(argv)
    return int(args.fn(args))
