"""Pick the event loop implementation by name, with an ``auto`` choice."""

from __future__ import annotations

import asyncio
from collections.abc import Callable


def resolve_loop(name: str = "auto") -> str:
    """``auto`` -> ``uvloop`` when importable, else ``asyncio``."""
    if name == "asyncio":
        return "asyncio"
    try:
        import uvloop  # noqa: F401
    except ImportError:
        if name == "uvloop":
            raise RuntimeError("--loop uvloop asked for, but uvloop is not installed") from None
        return "asyncio"
    if name not in ("auto", "uvloop"):
        raise ValueError(f"unknown loop {name!r}: auto, uvloop or asyncio")
    return "uvloop"


def loop_factory(name: str = "auto") -> Callable[[], asyncio.AbstractEventLoop]:
    """A factory for ``asyncio.run(..., loop_factory=...)``."""
    if resolve_loop(name) == "uvloop":
        import uvloop

        return uvloop.new_event_loop
    return asyncio.new_event_loop
