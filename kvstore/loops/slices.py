"""Long synchronous work cut into slices, so that it gives the event loop back between them.

The planner tick is pure Python over hundreds of candidates: run in one go it holds the loop (every
gRPC call of the node waits) for as long as it takes. Written as a generator of steps instead
(``Steps``: it yields between steps and returns its result), the same code runs

* to completion in one go (:func:`finish`, :func:`in_one_go`: tests, the simulated replay), or
* in slices of about ``slice_s`` each on the loop (:func:`sliced`, driven by :func:`on_loop`): a
  slice ends at the first step boundary past ``slice_s``, and the loop runs whatever is ready before
  the next slice starts. What a slice holds the loop for is recorded, so the longest one (the delay
  the work adds to a request) can be reported.

A step must not await; what the work reads between two of its steps may change (that is the point),
so it reads shared state within a step, as it is then.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Callable, Generator
from typing import ParamSpec, TypeVar

T = TypeVar("T")
P = ParamSpec("P")
Steps = Generator[None, None, T]
"""Work that yields between its steps and returns its result."""


def finish(steps: Steps[T]) -> T:
    """Run ``steps`` to the end in one go; its result."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value  # type: ignore[no-any-return]


def in_one_go(work: Callable[P, Steps[T]]) -> Callable[P, T]:
    """``work``, a function returning steps, as a plain function that runs them all (:func:`finish`)."""
    @functools.wraps(work)
    def run(*args: P.args, **kwargs: P.kwargs) -> T:
        return finish(work(*args, **kwargs))
    return run


def sliced(steps: Steps[T], slice_s: float, lengths: list[float],
           clock: Callable[[], float] = time.perf_counter) -> Steps[T]:
    """``steps`` grouped into slices: yields once a slice has run ``slice_s`` or more (at a step
    boundary), and appends the seconds of every slice, the last one too, to ``lengths``."""
    start = clock()
    while True:
        try:
            next(steps)
        except StopIteration as done:
            lengths.append(clock() - start)
            return done.value  # type: ignore[no-any-return]
        took = clock() - start
        if took >= slice_s:
            lengths.append(took)
            yield
            start = clock()


async def on_loop(steps: Steps[T]) -> T:
    """Run ``steps`` on the running loop, giving it back wherever ``steps`` yields."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value  # type: ignore[no-any-return]
        await asyncio.sleep(0)


__all__ = ["Steps", "finish", "in_one_go", "on_loop", "sliced"]
