"""Benchmarks users run against their own machine: ``kvctl bench NAME``.

Each module has ``add_arguments(parser)`` (its options), ``run(args) -> int``
(the benchmark, on the parsed options) and ``main(argv) -> int`` (both, on an
argument list), and writes JSON, a Markdown table and a PNG to ``--out``
(default ``./kvstore-out/bench``); every number is a ratio against a ceiling
measured in the same run (:mod:`kvstore.bench.ceilings`).

* :mod:`kvstore.bench.micro` -- one node's data paths against memcpy and raw TCP (and Redis, Mooncake Store)
* :mod:`kvstore.bench.replication` -- Replicate between two nodes against the raw transports
* :mod:`kvstore.bench.replication_raw` -- the raw TCP and UCX transfers alone
"""

BENCHES = ("micro", "replication", "replication_raw")

# kvctl's one-line help of each, listed by `kvctl bench --help` without importing the modules (numpy, grpc, ucx)
BENCH_HELP = {
    "micro": "one node's data paths against memcpy and raw TCP (and Redis, Mooncake Store)",
    "replication": "Replicate between two nodes against the raw transports",
    "replication_raw": "the raw TCP and UCX transfers alone",
}
