"""The regime map: its grid, what it keeps of a cell, the targets it checks, and one small real run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvstore.replay import regimes
from kvstore.replay.cli import replay_main


def test_the_default_grid_is_every_value_of_every_axis() -> None:
    grid = regimes.parse_axes([])
    assert grid["context"] == (4096, 8192, 16384, 32768, 65536)
    assert grid["link"] == ("eth-100g", "rdma-400g", "rdma-8x400g")
    assert len(regimes.cells(grid)) == 5 * 3 * 3 * 3 * 3
    thin = regimes.parse_axes(["nodes=4,8", "window=2"])
    assert thin["nodes"] == (4, 8) and thin["window"] == (2.0,)
    ids = {regimes.cell_id(c) for c in regimes.cells(thin)}
    assert len(ids) == 5 * 3 * 2 * 3 and "eth-100g_n4_b16_w2_c4096" in ids
    assert regimes.overrides(regimes.cells(thin)[0]) == {"link": "eth-100g", "nodes": 4, "synth_requests": 16,
                                                         "synth_window": 2.0, "synth_prefix_tokens": 4096}
    for bad in (["depth=1"], ["nodes"], ["nodes=four"], ["nodes="]):
        with pytest.raises(ValueError):
            regimes.parse_axes(bad)


def _runs(p99: dict[str, list[float]]) -> dict[str, list[dict[str, float]]]:
    keys = ("ttft_p50_s", "ttft_p95_s", "ttft_p99_s", "ttft_mean_s")
    return {k: [dict.fromkeys(keys, v) for v in vals] for k, vals in p99.items()}


def test_a_cell_keeps_the_best_baseline_the_best_predictive_and_the_oracle() -> None:
    from kvstore.replay.sweep import compare

    runs = _runs({"none|least-load": [1.0, 1.2, 1.1], "reactive|least-load": [0.9, 1.0, 0.95],
                  "reactive+claims|round-robin": [2.0, 2.0, 2.0], "predictive|least-load": [0.99, 1.1, 0.9],
                  "predictive+claims|least-load": [0.5, 0.6, 0.4], "oracle|plan": [0.3, 0.3, 0.3]})
    s = regimes.cell_summary({"runs": runs, **compare(runs)})
    assert s["best_baseline"]["config"] == "reactive|least-load" and s["seeds"] == 3
    assert s["predictive"]["config"] == "predictive+claims|least-load"
    # the median of the per-seed ratios (seed by seed against the best baseline's run of that seed)
    assert s["predictive"]["ratio"] == pytest.approx(0.5 / 0.9) and s["oracle"]["ratio"] == pytest.approx(0.3 / 0.95)
    assert (s["predictive"]["min"], s["predictive"]["max"]) == pytest.approx((0.4 / 0.95, 0.6 / 1.0))
    assert s["by_policy"]["none"]["p99"] == pytest.approx(1.1)


def test_misses_name_the_cells_over_each_target() -> None:
    def row(name: str, pred: float, oracle: float) -> dict:
        return {"id": name, "cell": {}, "seeds": 1, "predictive": {"ratio": pred, "min": pred, "max": pred,
                                                                   "config": "predictive|rr"},
                "oracle": {"ratio": oracle}, "best_baseline": {"config": "none|rr", "p99": 1.0}}

    rows = [row("fine", 0.9, 0.8), row("costs", 1.2, 0.9), row("short", 0.7, 0.4), row("won", 0.5, 0.4)]
    got = regimes.misses(rows)
    assert [r["id"] for r in got["over"]] == ["costs"] and [r["id"] for r in got["short"]] == ["short"]
    text = "\n".join(regimes.summary_lines(rows))
    assert "3 of 4" in text and "1 of 2" in text and "`costs`: 1.20x" in text


def test_a_thin_map_runs_resumes_and_writes_its_files(tmp_path: Path) -> None:
    """Two simulated cells, one job; the second call runs nothing again (each cell's folder is kept)."""
    argv = ["--sim", "--regimes", "--preset", "llama3-70b-tp8", "--policies", "none,predictive,oracle",
            "--routers", "least-load", "--regimes-axis", "context=4096,8192", "--regimes-axis", "link=eth-100g",
            "--regimes-axis", "nodes=4", "--regimes-axis", "burst=16", "--regimes-axis", "window=2",
            "--regimes-jobs", "1", "--regimes-seeds", "2", "--synth-duration", "30", "--out", str(tmp_path)]
    assert replay_main(argv) == 0
    got = json.loads((tmp_path / "regimes.json").read_text())
    assert [c["id"] for c in got["cells"]] == ["eth-100g_n4_b16_w2_c4096", "eth-100g_n4_b16_w2_c8192"]
    assert all("predictive" in c and "oracle" in c for c in got["cells"])
    assert (tmp_path / "regimes.png").stat().st_size > 0 and "### eth-100g" in (tmp_path / "regimes.md").read_text()
    stamps = {p: p.stat().st_mtime_ns for p in tmp_path.glob("cells/*/results.json")}
    assert replay_main(argv) == 0
    assert {p: p.stat().st_mtime_ns for p in tmp_path.glob("cells/*/results.json")} == stamps


def _capacity_summary(caps: dict[str, list[float]]) -> dict:
    """What kvstore.replay.capacity.summarize makes of these per-seed capacities (rate scales)."""
    from kvstore.replay.capacity import summarize

    def one(x: float) -> dict:
        return {"rate_scale": x, "requests_per_s": x, "attainment": 0.9, "ttft_p50": 0.1, "ttft_p99": 1.0,
                "capped": False}

    return summarize({k: [one(x) for x in v] for k, v in caps.items()})


def test_a_cell_at_load_keeps_each_capacity_as_a_ratio_to_the_best_baseline() -> None:
    cap = _capacity_summary({"engine-only|least-load": [2.0, 2.0, 2.0], "reactive|mooncake": [2.2, 2.4, 2.0],
                             "predictive|least-load": [2.0, 2.0, 2.0], "predictive|mooncake": [2.4, 2.4, 2.4],
                             "oracle|plan": [3.3, 3.6, 3.0], "bound|plan": [4.4, 4.8, 4.0]})
    got = regimes.capacity_cell(cap)
    assert got["engine_only"] == {"config": "engine-only|least-load", "rate_scale": 2.0}
    assert got["best_baseline"] == {"config": "reactive|mooncake", "rate_scale": 2.2}
    # the best predictive configuration by its median ratio, seed by seed against the best baseline
    assert got["predictive"]["config"] == "predictive|mooncake"
    assert got["predictive"]["ratio"] == pytest.approx(2.4 / 2.2)
    assert (got["predictive"]["min"], got["predictive"]["max"]) == pytest.approx((1.0, 1.2))
    assert got["oracle"]["ratio"] == pytest.approx(1.5) and got["bound"]["ratio"] == pytest.approx(2.0)


def test_misses_at_load_name_the_cells_where_prediction_costs_or_falls_short() -> None:
    def row(name: str, pred: float, oracle: float) -> dict:
        return {"id": name, "cell": {}, "seeds": 3, "capacity": {
            "predictive": {"ratio": pred, "min": pred, "max": pred, "config": "predictive|least-load"},
            "oracle": {"ratio": oracle}, "bound": {"ratio": oracle + 0.1},
            "best_baseline": {"config": "engine-only|least-load", "rate_scale": 2.0}}}

    rows = [row("ties", 1.0, 1.0), row("costs", 0.8, 1.1), row("short", 1.1, 1.4), row("won", 1.2, 1.5)]
    got = regimes.capacity_misses(rows)
    assert [r["id"] for r in got["under"]] == ["costs"] and [r["id"] for r in got["short"]] == ["short"]
    text = "\n".join(regimes.capacity_summary_lines(rows))
    assert "3 of 4; over it: 2" in text and "1 of 2" in text
    assert "`won`: 1.20x" in text and "`costs`: 0.80x" in text


def test_a_thin_map_at_load_searches_then_replays_at_each_load(tmp_path: Path) -> None:
    """One simulated cell, one seed: the capacity search, then one replay at each of two shares of
    engine-only's capacity; a second call runs nothing again."""
    argv = ["--sim", "--regimes", "--search", "capacity", "--preset", "llama3-70b-tp8",
            "--configs", "engine-only|least-load,reactive|least-load,predictive|least-load,oracle,bound",
            "--regimes-axis", "context=4096", "--regimes-axis", "link=eth-100g", "--regimes-axis", "nodes=4",
            "--regimes-axis", "burst=16", "--regimes-axis", "window=2", "--regimes-loads", "0.5,1.0",
            "--regimes-jobs", "1", "--regimes-seeds", "1", "--synth-duration", "30", "--out", str(tmp_path)]
    assert replay_main(argv) == 0
    got = json.loads((tmp_path / "regimes.json").read_text())
    cell = got["cells"][0]
    assert cell["id"] == "eth-100g_n4_b16_w2_c4096" and cell["seeds"] == 1
    cap = cell["capacity"]
    assert {"engine_only", "best_baseline", "predictive", "oracle", "bound"} <= set(cap)
    assert cap["bound"]["ratio"] >= cap["predictive"]["ratio"] > 0
    x = cap["engine_only"]["rate_scale"]
    assert set(cell["loads"]) == {"0.5", "1"}
    assert cell["loads"]["0.5"]["rate_scale"] == pytest.approx(0.5 * x)
    assert all("predictive" in v and "attainment" in v["best_baseline"] for v in cell["loads"].values())
    md = (tmp_path / "regimes.md").read_text()
    assert "# Regime map at load" in md and "### eth-100g: capacity" in md and "p99 TTFT at 0.5, 1" in md
    assert (tmp_path / "regimes.png").stat().st_size > 0
    stamps = {p: p.stat().st_mtime_ns for p in tmp_path.glob("cells/**/results.json")}
    assert len(stamps) == 3
    assert replay_main(argv) == 0
    assert {p: p.stat().st_mtime_ns for p in tmp_path.glob("cells/**/results.json")} == stamps


def test_the_map_at_load_refuses_live_runs_and_bad_loads(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base = ["--regimes", "--search", "capacity", "--preset", "llama3-70b-tp8", "--out", str(tmp_path)]
    assert replay_main(base) == 2
    assert "add --sim" in capsys.readouterr().err
    assert replay_main(["--sim", *base, "--regimes-loads", "0.5,x"]) == 2
    assert "--regimes-loads" in capsys.readouterr().err
    assert replay_main(["--sim", *base, "--regimes-loads", "0,1"]) == 2
    assert not (tmp_path / "cells").exists()
