"""Trace-replay benchmark: real ``kvstored`` clusters, simulated engines, a router.

``kvctl replay`` replays Mooncake-format traces
and the synthetic fan-out workload against a fresh local cluster per
replication policy (none, reactive, full, predictive, oracle) and reports
TTFT, KV-fetch time, hit ratios and speculative bytes side by side.

Pure logic (no sockets, no processes), unit-tested in ``tests/unit/replay/``:

* :mod:`kvstore.replay.costmodel` -- model/hardware presets, prefill/decode/transfer times, page bytes
* :mod:`kvstore.replay.routers` -- round-robin, least-load, cache-aware (SGLang-style, hint-aware)
* :mod:`kvstore.replay.workload` -- trace windows, the synthetic generator's jsonl, reuse bounds
* :mod:`kvstore.replay.oracle` -- the oracle's look-ahead decisions
* :mod:`kvstore.replay.metrics` -- per-request records and per-policy aggregates
* :mod:`kvstore.replay.report` -- the markdown report and the plots

I/O: :mod:`kvstore.replay.cluster` (start/stop daemons, scrape stats) and
:mod:`kvstore.replay.engine` (the asyncio driver of one policy run);
:mod:`kvstore.replay.cli` wires them together. See ``docs/benchmarks.md``.
"""

import os as _os

_os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "0")  # before grpc loads: no fork_posix.cc lines per daemon
