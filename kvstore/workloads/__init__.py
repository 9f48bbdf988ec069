"""Workloads: the request type, trace loaders, generators, named shapes and the shipped traces.

The replay (:mod:`kvstore.replay`), the predictor's offline training
(:mod:`kvstore.training`) and the benchmarks all read requests from here.
The traces this package ships live in ``data/`` (package data); see
:func:`kvstore.workloads.data_path`.
"""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path

# Named traces shipped in data/: `kvctl replay --trace conversation` and friends.
SHIPPED = {
    "conversation": "mooncake_conversation.jsonl",
    "azure-code": "azure_code_2023.csv",
}


def data_path(name: str) -> Path:
    """The path of a shipped trace, by its name in :data:`SHIPPED` or its file name.

    The package data is a real directory in every install kvstore supports
    (a checkout, an editable install, a wheel unpacked into site-packages)."""
    file = SHIPPED.get(name, name)
    path = Path(str(files("kvstore.workloads") / "data" / file))
    if not path.is_file():
        raise FileNotFoundError(f"no shipped trace {name!r} (shipped: {', '.join(SHIPPED)})")
    return path


def resolve_path(path: str | Path) -> Path:
    """A shipped trace by name (``conversation``; :data:`kvstore.workloads.SHIPPED`), else a file path."""
    if str(path) in SHIPPED:
        return data_path(str(path))
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"no trace file {str(path)!r} (shipped traces by name: {', '.join(SHIPPED)})")
    return p
