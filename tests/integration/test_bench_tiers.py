"""``kvctl bench tiers`` end to end on a small size: it runs, writes its three files, and every number it
reports is a measurement (positive, finite), with the reopened slab holding every page."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path


def test_the_tiers_bench_runs_and_reports(tmp_path: Path) -> None:
    kvctl = Path(sys.executable).with_name("kvctl")
    done = subprocess.run([str(kvctl), "bench", "tiers", "--total", "16MiB", "--reopen-pages", "500", "--repeats", "1",
                           "--node-cases", "1MiB", "--readers", "1", "--latency-seconds", "2",
                           "--dir", str(tmp_path / "data"), "--out", str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    results = json.loads((tmp_path / "out" / "tiers.json").read_text())
    assert results["io"] in ("direct", "buffered") and set(results["cases"]) == {"1MiB", "4MiB", "8x1MiB"}
    for row in results["cases"].values():
        assert set(row) == {"disk", "host"}
        for tier in row.values():
            for side in ("raw", "store"):
                assert all(math.isfinite(v) and v > 0 for v in tier[side].values())
    reopen = results["reopen"]["500"]
    assert 0 < reopen["reopen_s"] < 60 and reopen["reopen_s"] < reopen["restart_s"] < 60
    (node,) = results["node"]  # Gets through a real node, promoted from its disk tier, every page back
    assert node["promote_missing"] == 0 and node["promotions"] > 0
    assert all(math.isfinite(node[k]) and node[k] > 0 for k in ("promote_gbps", "pool_gbps", "promote_over_tier"))
    assert len(results["latency"]) == 6 and all(r["calls"] > 0 and r["put_p99_ms"] > 0 for r in results["latency"])
    assert [r["tiers"] for r in results["latency"]] == [False, True, False] * 2
    assert all(r["demotion_gbps"] > 0 for r in results["latency"] if r["tiers"])
    assert (tmp_path / "out" / "tiers.md").read_text().count("|") > 10 and (tmp_path / "out" / "tiers.png").exists()
    assert not (tmp_path / "data").exists()  # its files are removed


def test_the_tiers_bench_help_works() -> None:
    kvctl = Path(sys.executable).with_name("kvctl")
    done = subprocess.run([str(kvctl), "bench", "tiers", "--help"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "--reopen-pages" in done.stdout and "--cases" in done.stdout
