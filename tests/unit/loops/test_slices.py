"""``kvstore.loops.slices``: work written as steps runs in one go or in slices on a real event loop,
with the same result, and the loop runs other work between slices."""

from __future__ import annotations

import asyncio

from tests.conftest import drain_steps

from kvstore.loops.slices import Steps, finish, in_one_go, on_loop, sliced


def counting(n: int, log: list[str]) -> Steps[int]:
    total = 0
    for i in range(n):
        log.append(f"step {i}")
        total += i
        yield
    return total


def test_finish_runs_every_step_and_returns_the_result() -> None:
    log: list[str] = []
    assert finish(counting(5, log)) == 10
    assert log == [f"step {i}" for i in range(5)]
    assert in_one_go(counting)(4, log) == 6 and len(log) == 9


def test_a_slice_ends_at_the_first_step_past_its_length() -> None:
    """A fake clock that advances 1 s a read: a slice of 2.5 s holds the steps until its clock passes
    2.5 s, and every slice's length is recorded, the last (shorter) one too."""
    t = iter(range(1000))
    lengths: list[float] = []
    result, yields = drain_steps(sliced(counting(6, []), 2.5, lengths, clock=lambda: float(next(t))))
    assert result == 15 and yields >= 1 and len(lengths) == yields + 1
    assert all(length >= 2.5 for length in lengths[:-1])


def test_on_loop_gives_the_loop_back_between_slices() -> None:
    """Another task runs between the slices of a long piece of work, not only after it."""
    log: list[str] = []

    async def other() -> None:
        for _ in range(3):
            log.append("other")
            await asyncio.sleep(0)

    async def main() -> int:
        task = asyncio.get_running_loop().create_task(other())
        lengths: list[float] = []
        result = await on_loop(sliced(counting(6, log), 0.0, lengths))  # every step is a slice
        await task
        assert len(lengths) == 7  # six yields, and the stretch from the last one to the result
        return result

    assert asyncio.run(main()) == 15
    first_other = log.index("other")
    assert 0 < first_other < log.index("step 5"), log
