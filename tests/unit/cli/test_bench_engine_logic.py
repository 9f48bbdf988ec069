"""``kvctl bench engine``'s pure parts, without vLLM: the workloads' warm start and bound, and ``--combine``
(several runs folded into medians with ranges)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kvstore.bench import engine
from kvstore.bench.engine import BLOCK, WORKLOADS


def test_warm_start_sends_each_shared_prefix_once_and_nothing_a_request_asks() -> None:
    a = WORKLOADS["a"]
    warm = engine.warm_prompts(a)
    prompts = engine.make_prompts(a, seen=warm)
    assert len(warm) == a.docs
    docs = {tuple(p[:a.doc_tokens]) for p in warm}
    assert {tuple(p["tokens"][:a.doc_tokens]) for p in prompts} <= docs  # every request's document was sent
    assert not {tuple(p) for p in warm} & {tuple(p["tokens"]) for p in prompts}  # no measured question was
    # warm: every request may reuse its whole document (block-granular); cold: first sights may not
    assert all(p["reusable"] == a.doc_tokens // BLOCK * BLOCK for p in prompts)
    cold = engine.make_prompts(a)
    assert [p["tokens"] for p in cold] == [p["tokens"] for p in prompts]  # the same requests either way
    assert engine.reuse_bound(cold) < engine.reuse_bound(prompts)


def test_sessions_warm_only_the_shared_system_prompt() -> None:
    c = WORKLOADS["c"]
    warm = engine.warm_prompts(c)
    assert len(warm) == 1 and len(warm[0]) == c.system_tokens + c.question_tokens
    prompts = engine.make_prompts(c, seen=warm)
    first_round = prompts[:c.users]
    assert all(p["reusable"] == c.system_tokens // BLOCK * BLOCK for p in first_round)
    assert engine.make_prompts(c)[0]["reusable"] == 0


def _run(capacities: dict[str, float], goodputs: dict[str, list[float]], rates: list[float]) -> dict[str, Any]:
    setups = {s: {"capacity": capacities[s],
                  "points": [{"rate": r, "goodput": g, "ttft_p99_ms": 100.0 * (i + 1), "attainment": 0.95}
                             for i, (r, g) in enumerate(zip(rates, goodputs[s]))]} for s in ("vllm", "kvstore")}
    return {"slo_ttft_ms": 1000.0, "slo_attainment": 0.9, "command": "kvctl bench engine --workload a",
            "workloads": [{"workload": {"name": "a", "title": "docs"}, "engines": 1, "start": "warm",
                           "rates": rates, "bound": 25.0, "setups": setups,
                           "capacity_ratio": capacities["kvstore"] / capacities["vllm"],
                           "goodput_ratios": [k / v for v, k in zip(goodputs["vllm"], goodputs["kvstore"])]}]}


def test_combine_gives_medians_and_ranges_and_marks_capacity_floors() -> None:
    rates = [2.0, 4.0]
    runs = [_run({"vllm": 3.0, "kvstore": 4.0}, {"vllm": [2.0, 1.0], "kvstore": [2.0, 4.0]}, rates),
            _run({"vllm": 2.0, "kvstore": 4.0}, {"vllm": [2.0, 2.0], "kvstore": [2.0, 4.0]}, rates),
            _run({"vllm": 2.5, "kvstore": 3.5}, {"vllm": [1.0, 1.0], "kvstore": [2.0, 3.0]}, rates)]
    combined = engine.combine(runs)
    (res,) = combined["workloads"]
    assert res["runs"] == 3
    assert res["setups"]["vllm"]["capacity"] == {"median": 2.5, "min": 2.0, "max": 3.0}
    assert res["setups"]["kvstore"]["capacity_is_floor"] == [True, True, False]
    assert res["capacity_ratio"]["median"] == pytest.approx(3.5 / 2.5)  # the median of the runs' ratios
    assert res["goodput_ratios"][1] == {"median": 3.0, "min": 2.0, "max": 4.0}  # 4/1, 4/2, 3/1
    text = engine.combined_report(combined)
    assert "3 runs" in text and "kvstore >= 4.00 (3.50-4.00)" in text


def test_combine_refuses_runs_over_different_rates() -> None:
    one = _run({"vllm": 1.0, "kvstore": 1.0}, {"vllm": [1.0], "kvstore": [1.0]}, [1.0])
    two = _run({"vllm": 1.0, "kvstore": 1.0}, {"vllm": [1.0], "kvstore": [1.0]}, [2.0])
    with pytest.raises(ValueError, match="different rates"):
        engine.combine([one, two])


def test_combine_from_the_cli_writes_table_json_and_plot(tmp_path: Path) -> None:
    rates = [1.0, 4.0]
    folders = []
    for i in range(3):
        folder = tmp_path / f"run{i}"
        folder.mkdir()
        run = _run({"vllm": 1.0 + i, "kvstore": 2.0}, {"vllm": [1.0, 1.0], "kvstore": [1.0, 2.0]}, rates)
        (folder / "results.json").write_text(json.dumps(run))
        folders.append(str(folder))
    out = tmp_path / "combined"
    proc = subprocess.run([sys.executable, "-m", "kvstore.cli.kvctl", "bench", "engine", "--combine", *folders,
                           "--out", str(out)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert json.loads((out / "combined.json").read_text())["workloads"][0]["runs"] == 3
    assert "capacity: vllm 2.00 (1.00-3.00)" in (out / "combined.md").read_text()
    assert (out / "combined.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    missing = subprocess.run([sys.executable, "-m", "kvstore.cli.kvctl", "bench", "engine", "--combine",
                              str(tmp_path / "nothing"), "--out", str(out)], capture_output=True, text=True,
                             timeout=120)
    assert missing.returncode == 2 and "no readable results.json" in missing.stderr


def test_no_capacity_ratio_where_both_setups_met_the_slo_at_every_rate() -> None:
    both = _run({"vllm": 4.0, "kvstore": 4.0}, {"vllm": [2.0, 4.0], "kvstore": [2.0, 4.0]}, [2.0, 4.0])
    assert "ratio not found (both met the SLO at every rate swept)" in engine.combined_report(engine.combine([both]))
    only_kv = _run({"vllm": 3.0, "kvstore": 4.0}, {"vllm": [2.0, 1.0], "kvstore": [2.0, 4.0]}, [2.0, 4.0])
    assert "ratio >= 1.33 (1.33-1.33)x" in engine.combined_report(engine.combine([only_kv]))
