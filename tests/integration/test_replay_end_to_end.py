"""The trace replay (``kvctl replay``) end to end on real ``kvstored`` processes: a smoke run
(a few seconds), a run that SIGKILLs a node, and the simulated replay's calibration against the
real one on the same smoke workload. The pure parts: tests/unit/replay/."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tests.unit.replay.test_replay_sim import SMOKE


def _kvstored_children() -> list[int]:
    """kvstored processes whose parent is this test process (Linux /proc)."""
    import os

    out = []
    for d in Path("/proc").glob("[0-9]*"):
        try:
            ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            if ppid == os.getpid() and b"kvstored" in (d / "cmdline").read_bytes():
                out.append(int(d.name))
        except (OSError, ValueError, IndexError):
            continue
    return out


def test_replay_smoke_end_to_end(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """2 real nodes, ~20 requests, 3 policies under 2 routers, shaped links, 4 KiB pages: structure, and
    the oracle is a bound (p99 below none's, at or below every configuration's) on a workload where the
    policies differ: bursts of 8 requests within 0.5 s on a 16k-token prefix (recomputing it costs
    0.53 s on the serial prefill unit, copying it 43 ms), so without a copy the followers queue behind
    each other's recomputations."""
    from kvstore.replay.cli import replay_main

    out = tmp_path / "replay"
    rc = replay_main(["--trace", "synth", "--synth-bursts", "2", "--synth-requests", "8", "--synth-prefix-tokens",
                      "16384", "--synth-window", "0.5", "--synth-decoys", "1", "--synth-background", "0.5",
                      "--synth-duration", "10", "--synth-output-tokens", "64", "--nodes", "2",
                      "--policies", "none,predictive,oracle", "--routers", "cache-aware,least-load",
                      "--speedup", "8", "--byte-scale", "16384", "--network", "shaped",
                      "--capacity", "16MiB", "--heartbeat", "0.1", "--heartbeat-timeout", "24", "--planner-tick", "0.1",
                      "--oracle-lead", "2", "--drain-timeout", "30", "--no-progress", "--out", str(out)])
    # --heartbeat-timeout 24 trace s = 3 real s: nobody dies here, so membership stays well clear of the
    # 4-heartbeat floor (0.4 real s)
    assert rc == 0
    assert not _kvstored_children(), "daemons left behind"
    results = json.loads((out / "results.json").read_text())
    assert results["config"]["nodes"] == 2 and results["config"]["cost"]["page_bytes_scaled"] == 4096
    (name, w), = results["workloads"].items()
    n = w["workload"]["requests"]
    assert 14 <= n <= 30
    assert set(w["policies"]) == {"none", "predictive", "oracle"}
    assert set(w["runs"]) == {"none|cache-aware@32", "none|least-load", "predictive|cache-aware@32",
                              "predictive|least-load", "oracle|plan"}
    assert w["best_baseline"]["policy"] == "none" and "predictive|least-load" in w["vs_best"]
    assert results["config"]["link"]["network"] == "shaped"
    assert w["policies"]["predictive"]["network"]["kind"] == "shaped"

    for policy, s in w["policies"].items():
        assert all(v == [] for v in w["problems"].values()), w["problems"]
        for key in ("ttft_p50_s", "ttft_p95_s", "ttft_p99_s", "ttft_mean_s", "kv_fetch_p99_s", "local_hit_ratio",
                    "ttft_cached_p99_s", "slo_attainment", "throughput_rps", "prefill_gpu_s", "link_bytes",
                    "recomputed_cached_tokens", "fetch_critical_s",
                    "remote_hit_ratio", "miss_ratio", "spec_bytes", "spec_wasted_bytes", "requests"):
            assert isinstance(s[key], (int, float)) and math.isfinite(s[key]), (policy, key)
        assert s["requests"] == n and s["completed"] == n
        assert (s["local_blocks"] + s["remote_blocks"] + s["miss_blocks"] + s["engine_cached_blocks"] == s["blocks"]
                == w["workload"]["blocks"])
        ratios = [s["local_hit_ratio"], s["remote_hit_ratio"], s["miss_ratio"], s["engine_cached_ratio"]]
        assert all(0.0 <= r <= 1.0 for r in ratios) and sum(ratios) == pytest.approx(1.0)
        assert s["ttft_p50_s"] <= s["ttft_p95_s"] <= s["ttft_p99_s"]
        assert s["corrupt_pages"] == 0
        assert 0 <= s["spec_wasted_bytes"] <= s["spec_bytes"]
        assert sum(s["requests_per_node"].values()) == n
    oracle = w["policies"]["oracle"]["oracle"]  # the plan had the followers wait for or copy their prefix
    assert oracle["plan"] in oracle["candidates"] and oracle["planned_waits"] >= 8
    assert oracle.get("replicate_errors", 0) == 0
    rows = [json.loads(line) for line in (out / "requests" / f"{name}-oracle.jsonl").read_text().splitlines()]
    assert len(rows) == n
    for r in rows:
        assert r["ttft_s"] >= r["prefill_s"] > 0
        assert r["local"] + r["remote"] + r["miss"] + r["engine_cached"] == r["blocks"]
    report = (out / "report.md").read_text()
    assert "best baseline" in report and "| oracle | plan |" in report
    assert (out / f"{name}_ttft_cdf.png").stat().st_size > 0
    assert (out / f"{name}_predictive_timeline.png").stat().st_size > 0
    # the oracle as a bound: p99 below none's under every router, at or below every
    # configuration's
    oracle_p99 = w["policies"]["oracle"]["ttft_p99_s"]
    none_p99 = min(r[0]["ttft_p99_s"] for k, r in w["runs"].items() if k.startswith("none|"))
    assert oracle_p99 < none_p99, (oracle_p99, w["oracle_bound"], w["policies"]["oracle"]["oracle"])
    assert all(v["at_or_below"] for v in w["oracle_bound"].values()), w["oracle_bound"]


def test_replay_kill_a_node(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """--kill SIGKILLs a real node mid-run: every request still completes (its engine recomputes), the report
    has the after-kill TTFT, and no daemon is left."""
    from kvstore.replay.cli import replay_main

    out = tmp_path / "kill"
    rc = replay_main(["--trace", "synth", "--synth-bursts", "2", "--synth-requests", "6", "--synth-prefix-tokens",
                      "4096", "--synth-window", "1", "--synth-decoys", "0", "--synth-background", "1",
                      "--synth-duration", "8", "--synth-output-tokens", "32", "--nodes", "2", "--policies", "reactive",
                      "--routers", "round-robin", "--speedup", "8", "--byte-scale", "16384", "--capacity", "16MiB",
                      "--heartbeat", "0.1", "--kill", "n1@3", "--drain-timeout", "30", "--no-progress",
                      "--no-plots", "--out", str(out)])
    assert rc == 0
    assert not _kvstored_children(), "daemons left behind"
    (w,) = json.loads((out / "results.json").read_text())["workloads"].values()
    s = w["policies"]["reactive"]
    assert s["completed"] == s["requests"] and s["kv_errors"] >= 1
    (f,) = s["failover"]
    assert f["node"] == "n1" and f["t"] == 3.0 and f["requests"] >= 1 and f["on_killed_node"] >= 1
    assert "After the kill" in (out / "report.md").read_text()


# ---- the simulated replay against the real one --------------------------------------------

# sim/real of a configuration's TTFT p50 and p99 on the smoke workload. Measured on the 2-core dev machine
# at the smoke's --speedup 8: none, reactive, full, predictive 0.93-0.99x, oracle 0.87-0.89x (the real oracle pays
# a Replicate round trip and dispatch lag per copy that the model charges at a fixed 1.5 ms). That real cost is
# ~10 ms of wall time whatever the speedup, and the speedup multiplies it into trace seconds: a CI run on a
# busier machine saw the oracle's p50 at 0.73x, and one busy core beside the dev machine's run gave 0.82x. The
# agreement test therefore replays at --speedup 4 (7 s more): none and predictive 0.98-1.00x, the oracle
# 0.92x alone and 0.94x beside a busy core (3 runs). 0.75-1.25 is a band a sound model stays inside and a
# broken one (a lost wait, a link at the wrong rate: 2x and more) leaves.
TOLERANCE = (0.75, 1.25)
CALIBRATION_SPEEDUP = ["--speedup", "4"]


def test_sim_agrees_with_the_real_replay_on_the_smoke_workload(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """--sim-compare runs the smoke workload on real kvstored nodes and simulated: every configuration's
    TTFT p50 and p99 agree within TOLERANCE, the results carry the same keys (the real ones, the daemons'
    CPU besides), and in both the oracle's p99
    is at or below every other configuration's."""
    from kvstore.replay.cli import replay_main

    out = tmp_path / "both"
    assert replay_main([*SMOKE, *CALIBRATION_SPEEDUP, "--sim-compare", "--no-plots", "--out", str(out)]) == 0
    results = json.loads((out / "results.json").read_text())
    (w,) = results["workloads"].values()
    twins = w["sim_compare"]
    assert set(twins) == set(w["runs"])
    lo, hi = TOLERANCE
    for label, runs in w["runs"].items():
        real, sim = runs[0], twins[label][0]
        # the daemons' CPU seconds exist only where daemons ran
        assert set(real) - {"daemon_cpu_s", "coordinator_cpu_s"} == set(sim) - {"simulated", "sim"}, label
        assert real["daemon_cpu_s"] > 0, label
        for k in ("ttft_p50_s", "ttft_p99_s"):
            assert lo <= sim[k] / real[k] <= hi, (label, k, sim[k], real[k])
    for side in (lambda k: w["runs"][k][0], lambda k: twins[k][0]):
        oracle = side("oracle|plan")["ttft_p99_s"]
        assert all(oracle <= side(k)["ttft_p99_s"] for k in w["runs"]), "the oracle is a bound"
    assert "measured vs simulated" in (out / "report.md").read_text()


def test_tiers_hit_ratios_agree_live_and_simulated(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """--tier-policies tiers-lru on real daemons (a disk tier of slab files under the run's folder, paced at the
    modelled NVMe's rates) and simulated, on the mixed workload with pools small enough that a third of
    what they held went down to disk: the share of blocks found in the pool, on disk, on other nodes, in
    the engine's cache and computed agree within 5 percentage points. The p99 is printed, not asserted
    (under CI load it would flake)."""
    from kvstore.replay.cli import replay_main

    out = tmp_path / "tiers"
    assert replay_main(["--trace", "mixed", "--preset", "llama3-70b-tp8", "--nodes", "2", "--policies", "reactive",
                        "--routers", "cache-aware", "--capacity", "640KiB", "--tier-policies", "tiers-lru",
                        "--sim-compare", "--no-plots", "--no-progress", "--out", str(out)]) == 0
    (w,) = json.loads((out / "results.json").read_text())["workloads"].values()
    label = "reactive+tiers-lru|cache-aware@32"
    real, sim = w["runs"][label][0], w["sim_compare"][label][0]
    for side in (real, sim):
        assert side["disk_write_pages"] > 0 and side["disk_hit_ratio"] > 0.02, side
    for k in ("pool_hit_ratio", "disk_hit_ratio", "remote_hit_ratio", "engine_cached_ratio", "miss_ratio"):
        assert abs(real[k] - sim[k]) <= 0.05, (k, real[k], sim[k])
    print(f"tiers p99: real {real['ttft_p99_s']:.3f} s, simulated {sim['ttft_p99_s']:.3f} s")
    assert (out / "logs").is_dir() and not list(out.rglob("tiers"))  # the modelled disks are removed


def test_capacity_search_checks_the_knees_on_real_daemons(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """``--search capacity`` without ``--sim``: the search on the simulator, then engine-only, the best
    baseline and the best configuration on 2 real nodes at the knees, each beside its simulated twin."""
    from kvstore.replay.cli import replay_main

    out = tmp_path / "capacity"
    rc = replay_main(["--search", "capacity", "--trace", "synth", "--synth-bursts", "2", "--synth-requests", "8",
                      "--synth-prefix-tokens", "8192", "--synth-window", "2", "--synth-decoys", "1",
                      "--synth-background", "0.5", "--synth-duration", "10", "--synth-output-tokens", "64",
                      "--nodes", "2", "--configs", "engine-only|least-load,reactive|cache-aware,bound",
                      "--search-resolution", "0.25", "--jobs", "1", "--speedup", "4", "--byte-scale", "16384",
                      "--network", "shaped", "--capacity", "16MiB", "--heartbeat", "0.1", "--drain-timeout",
                      "30", "--no-progress", "--no-plots", "--out", str(out)])
    assert rc == 0
    assert not _kvstored_children(), "daemons left behind"
    w = json.loads((out / "results.json").read_text())["workloads"]["synth-fanout"]
    cap = w["capacity"]
    assert cap["reference"] == "engine-only|least-load" and cap["bound"] == "bound|plan"
    assert set(w["live"]) == {"best_baseline", "best"}
    for knee in w["live"].values():
        assert knee["rate_scale"] > 0
        assert "bound|plan" not in knee["configs"]  # the bound has no live twin
        for label, got in knee["configs"].items():
            assert got["live"]["completed"] == got["live"]["requests"] == got["simulated"]["requests"], label
            assert 0 <= got["live"]["slo_attainment"] <= 1
    assert "live / sim attainment" in (out / "report.md").read_text()
