"""Event loop choice: uvloop when it imports, asyncio otherwise."""

from kvstore.loops.auto import loop_factory, resolve_loop

__all__ = ["loop_factory", "resolve_loop"]
