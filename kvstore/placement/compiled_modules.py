"""Which planner modules the install compiles with mypyc, and whether this process runs them compiled.

``setup.py`` compiles :data:`COMPILED` (the planner's pure, typed modules: same source, a third fewer
instructions a tick) and writes :data:`MANIFEST`, the SHA-256 of each source it compiled. Python
imports a compiled module in preference to its ``.py``, so an edited source would otherwise run stale
machine code: :func:`choose` (called by ``kvstore/placement/__init__.py`` before any of them is imported)
loads every one of them from source instead when any compiled module is missing or no longer matches
its source, or when ``KVSTORE_PURE_PYTHON`` is set. All or none: compiled modules reach each other's
classes directly, so a mix would not work. :data:`BUILD` says which was chosen and why.

Plain Python on purpose, with no imports from the package: ``setup.py`` reads it before installing.
"""

from __future__ import annotations

import hashlib
import importlib.abc
import importlib.machinery
import importlib.util
import json
import logging
import os
import sys
from pathlib import Path

COMPILED = ("planner_types", "copytree", "holderwalk", "renewals", "candidates", "planner")
"""Modules of ``kvstore.predict`` that ``setup.py`` compiles (they import nothing outside this list but
the standard library, numpy, ``kvstore.loops.slices``, ``kvstore.predict.types`` and ``kvstore.pool.room``)."""
MANIFEST = "compiled.json"
"""Written by ``setup.py`` beside the sources: ``{module: sha256 of the source compiled}``."""
PACKAGE = "kvstore.placement"
HERE = Path(__file__).resolve().parent

BUILD = "pure Python (not compiled)"
"""How this process runs the planner: ``"compiled (mypyc)"`` or ``"pure Python (<why>)"``."""


class _Sources(importlib.abc.MetaPathFinder):
    """Imports the modules of :data:`COMPILED` from their ``.py`` files, ahead of any compiled module."""

    def find_spec(self, fullname: str, path: object = None, target: object = None) -> importlib.machinery.ModuleSpec | None:
        package, _, name = fullname.rpartition(".")
        if package != PACKAGE or name not in COMPILED:
            return None
        return importlib.util.spec_from_file_location(fullname, HERE / f"{name}.py")


def _extension(name: str) -> Path | None:
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        if (path := HERE / f"{name}{suffix}").exists():
            return path
    return None


def source_hashes(where: Path = HERE) -> dict[str, str]:
    """SHA-256 of each source of :data:`COMPILED` in ``where``: what ``setup.py`` writes to the manifest."""
    return {name: hashlib.sha256((where / f"{name}.py").read_bytes()).hexdigest() for name in COMPILED}


def _stale(compiled: list[str]) -> list[str]:
    """The modules whose compiled form is missing or was built from another source."""
    try:
        manifest = json.loads((HERE / MANIFEST).read_text())
    except (OSError, ValueError):
        manifest = {}
    sources = source_hashes()
    return [name for name in COMPILED if name not in compiled or manifest.get(name) != sources[name]]


def choose() -> str:
    """Run the compiled modules if they match their sources, else the sources; sets and returns :data:`BUILD`."""
    global BUILD
    compiled = [name for name in COMPILED if _extension(name) is not None]
    if not compiled:
        BUILD = "pure Python (not compiled)"
        return BUILD
    if os.environ.get("KVSTORE_PURE_PYTHON"):
        why = "KVSTORE_PURE_PYTHON is set"
    elif stale := _stale(compiled):
        why = f"{', '.join(stale)} changed since compiled: `make install` compiles them again"
        logging.getLogger("kvstore").warning("running the planner as pure Python: %s", why)
    else:
        BUILD = "compiled (mypyc)"
        return BUILD
    if not any(isinstance(f, _Sources) for f in sys.meta_path):
        sys.meta_path.insert(0, _Sources())
    BUILD = f"pure Python ({why})"
    return BUILD


__all__ = ["BUILD", "COMPILED", "MANIFEST", "choose", "source_hashes"]
