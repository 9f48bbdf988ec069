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
