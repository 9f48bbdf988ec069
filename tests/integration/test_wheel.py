"""kvstore as a user installs it: a wheel, in a fresh venv, run from an empty folder.

The wheel is built from a copy of the checkout with the packages already
installed (``--no-build-isolation --no-deps``, pure Python: ``KVSTORE_PURE_PYTHON``
skips the mypyc step, which ``test_compiled_modules`` covers) and installed
into a new venv that sees this venv's third-party packages through a ``.pth``
line, so nothing is downloaded. The commands then run from an empty folder
outside the checkout: whatever they need must come from the installed wheel.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT

ROOT = REPO_ROOT
SKIP = shutil.ignore_patterns(".git", ".venv*", "build", "dist", "*.egg-info", "__pycache__", "kvstore-out", "out",
                              "*.so", "compiled.json", ".pytest_cache", ".hypothesis", ".gpu-*")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    src = tmp_path_factory.mktemp("src") / "kvstore"
    shutil.copytree(ROOT, src, ignore=SKIP)
    out = tmp_path_factory.mktemp("wheel")
    env = {**os.environ, "KVSTORE_PURE_PYTHON": "1"}
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out),
                    str(src)], check=True, env=env, timeout=300, capture_output=True)
    (found,) = out.glob("kvstore-*.whl")
    return found


@pytest.fixture(scope="module")
def venv(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    env_dir = tmp_path_factory.mktemp("venv") / "v"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env_dir)], check=True, timeout=120)
    python = env_dir / "bin" / "python"
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())
    # this venv's third-party packages, as a plain path: its .pth files (the editable kvstore) are not run
    (site / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps",
                    "--no-index", str(wheel)], check=True, timeout=300, capture_output=True)
    return env_dir


def _run(venv: Path, cwd: Path, *argv: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    proc = subprocess.run(list(argv), cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{argv}: rc {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


@pytest.mark.timeout(600)  # builds the wheel (module fixture)
def test_the_wheel_carries_kernels_traces_and_the_model(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    for want in ("kvstore/ops/kernels/pages.cu", "kvstore/ops/kernels/engine.cu", "kvstore/ops/kernels/copy.cuh",
                 "kvstore/workloads/data/mooncake_conversation.jsonl", "kvstore/workloads/data/azure_code_2023.csv",
                 "kvstore/data/burst_model.json", "kvstore/replay/cli.py", "kvstore/bench/micro.py",
                 "kvstore_client/__init__.py", "kvstore_vllm/__init__.py"):
        assert want in names, f"{want} missing from {wheel.name}"
    assert not any(n.startswith(("bench/", "tests/")) for n in names)


@pytest.mark.timeout(600)
def test_cupy_ops_finds_the_installed_kernels(venv: Path, tmp_path: Path) -> None:
    code = ("import kvstore, pathlib\n"
            "from kvstore.ops.cupy_ops import kernel_dir\n"
            "with kernel_dir() as d:\n"
            "    print(pathlib.Path(kvstore.__file__).parent, sorted(p.name for p in d.iterdir()), d.is_dir())\n")
    out = _run(venv, tmp_path, str(venv / "bin" / "python"), "-c", code).stdout.split(" ", 1)
    assert Path(out[0]).is_relative_to(venv), f"kvstore imported from {out[0]}, not the wheel"
    assert out[1].strip() == "['copy.cuh', 'engine.cu', 'pages.cu'] True"


@pytest.mark.timeout(600)
def test_replay_and_bench_run_from_an_empty_folder(venv: Path, tmp_path: Path) -> None:
    work = tmp_path / "empty"
    work.mkdir()
    _run(venv, work, "kvctl", "replay", "--sim", "--policies", "none,predictive", "--window", "30", "--no-plots",
         "--no-progress")
    results = json.loads((work / "kvstore-out" / "replay" / "results.json").read_text())
    assert results["simulated"] is True
    assert set(results["workloads"]) == {"conversation", "synth-fanout"}  # the default workloads
    for entry in results["workloads"].values():
        assert set(entry["policies"]) == {"none", "predictive"}
        assert all(s["completed"] == s["requests"] > 0 for s in entry["policies"].values())
    _run(venv, work, "kvctl", "bench", "micro", "--total", "8MiB")
    micro = json.loads((work / "kvstore-out" / "bench" / "micro.json").read_text())
    assert micro["rows"], micro
    assert sorted(p.name for p in work.iterdir()) == ["kvstore-out"]  # nothing written elsewhere in the folder
