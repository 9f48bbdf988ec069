"""``kvctl bench engine`` at a small size: workload (a) (its disk tier included) at two rates with two dozen
requests each, vLLM alone and vLLM with kvstore, each driven by ``vllm bench serve``. Asserts the outputs
are well formed and that every request of both runs completed; the figures come from the full run
(docs/bench-engine.md). Skipped where vLLM is not installed; ``make test-vllm`` runs it with none skipped.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

if importlib.util.find_spec("vllm") is None:
    if os.environ.get("KVSTORE_REQUIRE_VLLM"):
        raise RuntimeError("KVSTORE_REQUIRE_VLLM is set but vLLM is not installed")
    pytest.skip("vLLM is not installed (make test-vllm installs it)", allow_module_level=True)

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1200)]

RATES = (2.0, 4.0)
PROMPTS = 24
POINT_KEYS = {"rate", "requests", "completed", "failed", "duration_s", "goodput", "vllm_goodput", "attainment",
              "ttft_p50_ms", "ttft_p90_ms", "ttft_p99_ms", "ttft_mean_ms", "pages"}


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("bench-engine")
    argv = [sys.executable, "-m", "kvstore.cli.kvctl", "bench", "engine", "--workload", "a", "--rates",
            *map(str, RATES), "--num-prompts", str(PROMPTS), "--calibrate", "no", "--out", str(out)]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=1100)
    assert proc.returncode == 0, f"kvctl bench engine failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n" \
                                 f"{proc.stderr[-6000:]}"
    return out


def test_every_request_of_both_setups_completed(run: Path) -> None:
    results = json.loads((run / "results.json").read_text())
    [workload] = results["workloads"]
    assert workload["workload"]["name"] == "a" and workload["rates"] == list(RATES)
    assert set(workload["setups"]) == {"vllm", "kvstore"}
    for setup, data in workload["setups"].items():
        assert [p["rate"] for p in data["points"]] == list(RATES), setup
        for point in data["points"]:
            assert POINT_KEYS <= set(point), (setup, point)
            assert point["requests"] == point["completed"] == PROMPTS and point["failed"] == 0, (setup, point)
            assert 0 <= point["attainment"] <= 1 and point["goodput"] >= 0
            assert 0 < point["ttft_p50_ms"] <= point["ttft_p90_ms"] <= point["ttft_p99_ms"] < 600_000
        assert data["capacity"] >= 0
    assert workload["bound"] >= 1
    assert len(workload["goodput_ratios"]) == len(RATES)
    assert all(r >= 0 or math.isnan(r) for r in workload["goodput_ratios"])
    # the kvstore setup's node saw the engine: its lookups (leased pages) are counted
    assert any(p["pages"] for p in workload["setups"]["kvstore"]["points"])


def test_report_and_plot_are_written(run: Path) -> None:
    report = (run / "report.md").read_text()
    assert "## workload a" in report and "capacity: vllm" in report
    assert report.count("| vllm ") == len(RATES) and report.count("| kvstore ") == len(RATES)
    assert (run / "engine.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # vllm bench serve's own saved results are kept beside ours
    assert len(list((run / "workload-a").glob("*-r*-0-0.json"))) == 2 * len(RATES)


def test_every_request_decoded_the_workloads_output_length(run: Path) -> None:
    """vllm bench serve's custom dataset decodes 256 tokens unless told to read each line's own length."""
    from kvstore.bench.engine import WORKLOADS
    for saved in (run / "workload-a").glob("*-r*-0-0.json"):
        lens = json.loads(saved.read_text())["output_lens"]
        assert lens and set(lens) == {WORKLOADS["a"].output_len}, (saved.name, sorted(set(lens)))
