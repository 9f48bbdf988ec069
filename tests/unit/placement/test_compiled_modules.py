"""The planner's mypyc build: used when it matches its source, never when it does not, same plans either way.

``setup.py`` compiles ``kvstore.placement.compiled_modules.COMPILED``; ``compiled_modules.choose`` picks
the compiled modules or the sources. CI sets ``KVSTORE_REQUIRE_COMPILED=1`` (``.ci/run``), so a build
that silently fell back to pure Python fails there instead of passing slower.
"""

from __future__ import annotations

import importlib.machinery
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvstore.placement import compiled_modules
from tests.conftest import REPO_ROOT

ROOT = REPO_ROOT
PLACEMENT = ROOT / "kvstore" / "placement"
IS_COMPILED = compiled_modules.BUILD == "compiled (mypyc)"
PROBE = ("import kvstore.placement.planner as p; from kvstore.placement import compiled_modules as c; "
         "print(p.__file__); print(c.BUILD)")


def _is_extension(path: str) -> bool:
    return path.endswith(tuple(importlib.machinery.EXTENSION_SUFFIXES))


def test_build_is_what_runs() -> None:
    """``BUILD`` says what this process imported: every module compiled, or every one from source."""
    modules = [sys.modules.get(f"kvstore.placement.{name}") or __import__(f"kvstore.placement.{name}", fromlist=["_"])
               for name in compiled_modules.COMPILED]
    kinds = {_is_extension(m.__file__) for m in modules}
    assert kinds == {IS_COMPILED}, (compiled_modules.BUILD, [m.__file__ for m in modules])
    if os.environ.get("KVSTORE_REQUIRE_COMPILED"):
        assert IS_COMPILED, f"KVSTORE_REQUIRE_COMPILED is set but the planner runs {compiled_modules.BUILD}"


def _copy_package(dest: Path) -> None:
    """What importing the planner needs: the package roots, kvstore.loops, kvstore.predict (the types the planner reads), kvstore.placement and mypyc's
    shared library (compiled modules and manifest included, as built)."""
    (dest / "kvstore").mkdir()
    shutil.copy2(ROOT / "kvstore" / "__init__.py", dest / "kvstore" / "__init__.py")
    for part in ("loops", "predict", "placement"):
        shutil.copytree(ROOT / "kvstore" / part, dest / "kvstore" / part,
                        ignore=shutil.ignore_patterns("__pycache__"))
    for lib in ROOT.glob("*__mypyc*"):
        shutil.copy2(lib, dest / lib.name)


def _probe(where: Path, **env: str) -> tuple[str, str]:
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=where, capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": str(where), **env}, check=True)
    module_file, build = out.stdout.strip().splitlines()
    assert Path(module_file).is_relative_to(where), module_file  # the copy, not the install
    return module_file, build


@pytest.mark.skipif(not IS_COMPILED, reason=f"the planner is not compiled here ({compiled_modules.BUILD})")
def test_an_edited_source_runs_from_source(tmp_path: Path) -> None:
    """A compiled module built from another source is never run: all of them load from source, and the
    log names the changed one."""
    _copy_package(tmp_path)
    module_file, build = _probe(tmp_path)
    assert _is_extension(module_file) and build == "compiled (mypyc)"

    _, build = _probe(tmp_path, KVSTORE_PURE_PYTHON="1")
    assert build == "pure Python (KVSTORE_PURE_PYTHON is set)"

    with (tmp_path / "kvstore" / "placement" / "planner.py").open("a") as f:
        f.write("\n# edited after the build\n")
    module_file, build = _probe(tmp_path)
    assert module_file.endswith("planner.py")
    assert build.startswith("pure Python (planner changed since compiled"), build

    (tmp_path / "kvstore" / "placement" / "planner.py").write_bytes((PLACEMENT / "planner.py").read_bytes())
    (tmp_path / "kvstore" / "placement" / compiled_modules.MANIFEST).unlink()  # e.g. a build that fell back
    module_file, build = _probe(tmp_path)
    assert module_file.endswith("planner.py") and "changed since compiled" in build


@pytest.mark.skipif(not IS_COMPILED, reason=f"the planner is not compiled here ({compiled_modules.BUILD})")
def test_compiled_and_source_plan_the_same(tmp_path: Path) -> None:
    """The bench's stateful cluster, 40 ticks at 5,000 prefixes: every decision, renewal, drop and skip
    count the same from the compiled modules as from their source."""
    reports = {}
    for build, env in (("compiled", {}), ("source", {"KVSTORE_PURE_PYTHON": "1"})):
        out = tmp_path / build
        subprocess.run([sys.executable, str(ROOT / "bench" / "planner.py"), "--prefixes", "5000", "--ticks", "40",
                        "--out", str(out)], cwd=ROOT, capture_output=True, timeout=120, check=True,
                       env={**os.environ, **env})
        reports[build] = json.loads((out / "planner.json").read_text())
    assert reports["compiled"]["planner_build"] == "compiled (mypyc)"
    assert reports["source"]["planner_build"].startswith("pure Python")
    assert sum(reports["source"]["skipped_total"].values()) > 0
    assert reports["source"]["per_tick"]["decisions"]["max"] > 0  # the ticks planned copies: a real comparison
    assert reports["compiled"]["plans_sha256"] == reports["source"]["plans_sha256"]
