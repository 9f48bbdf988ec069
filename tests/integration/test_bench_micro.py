"""kvctl bench micro end to end on a small budget: a real kvstored, the shared-
memory and socket paths, batches, several clients at once, the raw baselines
measured in the same run, and the report written (JSON, Markdown). The
numbers are not judged here (benchmarks, not timed tests); that every row
was measured, is consistent and lands in the table is."""

from __future__ import annotations

import json
from pathlib import Path


from kvstore import bench
from kvstore.bench import peers


def test_page_count_is_at_least_one_batch() -> None:
    # 64 pages of 4 MiB per call with 128 MiB per row once asked for 0 pages
    assert peers.page_count(4 << 20, 128 << 20, 64) == 64
    assert peers.page_count(1 << 20, 64 << 20, 8) == 64
    assert peers.page_count(64 << 10, 1 << 20, 1) == 16


def test_micro_runs_and_reports_every_row(tmp_path: Path) -> None:
    out = tmp_path / "out"
    assert bench.main("micro", ["--out", str(out), "--total", "4MiB", "--paths", "shm,tcp", "--batch", "1,8",
                       "--sizes", "64KiB,1MiB", "--clients", "2"]) == 0
    results = json.loads((out / "micro.json").read_text())
    rows = {(r["path"], r["page"], r["batch"]) for r in results["rows"]}
    assert rows == {(p, s, b) for p in ("shm", "tcp") for s in ("64KiB", "1MiB") for b in (1, 8)}
    for row in results["rows"]:
        assert row["put_gbps"] > 0 and row["get_gbps"] > 0
        assert row["put_p50_ms"] <= row["put_p99_ms"]
        if row["path"] == "shm":  # set against memcpy of the same pages, measured beside it
            assert row["memcpy_gbps"] > 0
    assert results["raw_tcp_gbps"] > 0 and results["memcpy_gbps"] > 0
    concurrent = results["concurrent"]
    assert [(r["page"], r["batch"], r["clients"]) for r in concurrent] == [("4MiB", 1, 2), ("1MiB", 8, 2)]
    assert results["raw_tcp_streams_gbps"] > 0
    table = (out / "micro.md").read_text()
    assert "memcpy of the same bytes" in table
    assert "2 clients at once" in table and "concurrent raw TCP streams" in table
