"""Carrying out a relayed copy tree: each part of the copy is forwarded as soon as it landed.

The coordinator's ``_copy_tree`` hands a tree here when the planner cut its copy into parts
(:func:`~kvstore.placement.copytree.relay_parts`); the I/O (one ``Replicate`` per part and hop, and the
end of a target's pending entry) comes in as two callables, so the scheduling is all this module does.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence

Copy = Callable[[str, list[bytes], str, int], Awaitable[bool]]  # (target, keys, source, bytes) -> landed


async def relay(tree: Sequence[tuple[str, str]], keys: list[bytes], nbytes: int, children: dict[str, list[str]],
                parts: list[tuple[int, int]], fanout: int, copy: Copy, ended: Callable[[str], None]) -> None:
    """Copy ``keys`` (``nbytes`` per target) down ``tree`` in ``parts``: a target starts sending part j to
    its own targets once part j reached it, so a chain of L targets holds the prefix after about
    ``1 + (L - 1) / len(parts)`` copy times instead of L (the planner shapes relayed trees as chains:
    :func:`~kvstore.placement.copytree.copy_tree`). Every node sends to ``fanout`` targets at a time. A part
    that did not land on a node is sent from the nearest node above it that has it; the failed node gets
    nothing more. ``ended(target)`` runs once per target when its copy is over, landed or not."""
    parent = {dst: src for src, dst in tree}
    loop = asyncio.get_running_loop()
    has = {dst: [loop.create_future() for _ in parts] for dst in parent}  # part j landed on dst

    async def holder(node: str, j: int) -> str:
        while node in has:  # a target: if its part j did not land, the nearest node above that got it
            if await asyncio.shield(has[node][j]):
                return node
            node = parent[node]
        return node  # a root holds every part

    async def send(src: str, dst: str) -> None:
        got = has[dst]
        try:
            for j, (a, b) in enumerate(parts):
                ok = await copy(dst, keys[a:b], await holder(src, j), nbytes * (b - a) // len(keys))
                got[j].set_result(ok)
                if not ok:
                    break
        finally:
            for f in got:
                if not f.done():
                    f.set_result(False)
            ended(dst)

    async def serve(node: str) -> None:
        queue = children.get(node, [])
        for i in range(0, len(queue), fanout):
            await asyncio.gather(*(send(node, dst) for dst in queue[i:i + fanout]))

    await asyncio.gather(*(serve(n) for n in dict.fromkeys([s for s, _ in tree] + list(parent))))
