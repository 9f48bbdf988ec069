"""The link shaper (kvstore.transport.shaper): processor sharing in loop time, no sockets."""

from __future__ import annotations

import asyncio

import pytest

from kvstore.transport.shaper import Link, LinkShaper


def _run(coro):  # type: ignore[no-untyped-def]
    return asyncio.run(asyncio.wait_for(coro, 10))


async def _timed(coro) -> float:  # type: ignore[no-untyped-def]
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    await coro
    return loop.time() - t0


def test_one_transfer_takes_bytes_over_rate() -> None:
    link = Link(10e6)
    assert _run(_timed(link.transfer(1e6))) == pytest.approx(0.1, rel=0.15)
    assert link.active == 0 and link.bytes_total == pytest.approx(1e6)


def test_concurrent_transfers_share_fairly() -> None:
    async def body() -> list[float]:
        link = Link(10e6)
        return list(await asyncio.gather(*(_timed(link.transfer(n)) for n in (1e6, 1e6, 0.25e6))))

    big, big2, small = _run(body())
    # three flows: the small one finishes at 3 x 0.25 MB / 10 MB/s; the big ones share the rest
    assert small == pytest.approx(0.075, rel=0.2)
    assert big == pytest.approx(big2, rel=0.05) and big == pytest.approx(0.225, rel=0.15)


def test_flow_of_unknown_size_takes_its_share_and_keeps_credit() -> None:
    async def body() -> tuple[float, float]:
        link = Link(10e6)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        flow = link.open(None)
        other = asyncio.ensure_future(_timed(link.transfer(1e6)))
        await asyncio.sleep(0.1)   # two flows: each credited ~0.5 MB
        flow.resize(0.5e6)         # already through
        await flow.wait()
        flow.close()
        return loop.time() - t0, await other

    sized_at, other = _run(body())
    assert sized_at == pytest.approx(0.1, rel=0.2)
    assert other == pytest.approx(0.15, rel=0.2)  # 0.5 MB in the first 0.1 s, then alone at full rate


def test_cancelled_flow_leaves_the_link() -> None:
    async def body() -> float:
        link = Link(10e6)
        hog = asyncio.ensure_future(link.transfer(100e6))
        await asyncio.sleep(0.01)
        hog.cancel()
        await asyncio.gather(hog, return_exceptions=True)
        assert link.active == 0
        return await _timed(link.transfer(1e6))

    assert _run(body()) == pytest.approx(0.1, rel=0.15)


def test_shaper_has_two_directions_and_checks_rates() -> None:
    s = LinkShaper(5e6, 1e-3)
    assert s.egress is not s.ingress and s.describe() == {"egress_bytes_s": 5e6, "ingress_bytes_s": 5e6,
                                                          "latency_s": 1e-3}
    with pytest.raises(ValueError):
        Link(0)
    with pytest.raises(ValueError):
        Link(1e6, -1)
