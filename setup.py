"""Build hook: the planner's pure modules compiled with mypyc, where this machine can.

Everything else about the package is in ``pyproject.toml``. mypyc compiles the
same typed source to C extension modules (no second implementation to keep in
step): a planner tick runs about a third fewer instructions
(``docs/benchmarks.md``). Where it cannot compile (``KVSTORE_PURE_PYTHON=1``,
no mypy, no C compiler, a type error), the package installs as pure Python and
says so; ``kvstore.placement`` also loads the sources whenever a compiled module
no longer matches its source (``kvstore/placement/__init__.py``).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.build_ext import build_ext

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "kvstore" / "placement"))
from compiled_modules import COMPILED, MANIFEST, source_hashes  # noqa: E402  (shared with the loader)

sys.path.pop(0)
PLACEMENT = HERE / "kvstore" / "placement"


def _warn(why: str) -> None:
    print(f"kvstore: installing the planner as pure Python ({why})", file=sys.stderr)


def _ext_modules() -> list:  # type: ignore[type-arg]
    manifest = PLACEMENT / MANIFEST
    manifest.unlink(missing_ok=True)  # no manifest: the loader never trusts an old compiled module
    if os.environ.get("KVSTORE_PURE_PYTHON"):
        _warn("KVSTORE_PURE_PYTHON is set")
        return []
    try:
        from mypyc.build import mypycify
    except ImportError:
        _warn("mypy is not installed")
        return []
    paths = [f"kvstore/placement/{name}.py" for name in COMPILED]  # mypy's settings: [tool.mypy] in pyproject.toml
    try:
        old = os.getcwd()
        os.chdir(HERE)
        try:
            modules = mypycify(paths, opt_level="3")
        finally:
            os.chdir(old)
    except (Exception, SystemExit) as exc:  # mypy's type errors end in SystemExit
        _warn(f"mypyc failed: {exc!r}")
        return []
    manifest.write_text(json.dumps(source_hashes(PLACEMENT), indent=1, sort_keys=True) + "\n")
    return modules


class OptionalBuildExt(build_ext):
    """A failed C build leaves a working pure-Python install (and no manifest), not a failed install."""

    def run(self) -> None:
        try:
            super().run()
        except Exception as exc:  # noqa: BLE001 -- compiler missing or failing: fall back, loudly
            (PLACEMENT / MANIFEST).unlink(missing_ok=True)
            _warn(f"the C build failed: {exc!r}")


setup(ext_modules=_ext_modules(), cmdclass={"build_ext": OptionalBuildExt})
