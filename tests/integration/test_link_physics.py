"""Link physics of the replay's networks, over both implementations.

Three real ``kvstored`` processes (reactive replication, CPU pools) per
network: ``shaped`` (the link shaper in each node's peer transport) and
``netns`` (each node in its own network namespace on a bridge, ``tc`` on its
veth both ways). Pages are the replay's scaled pages: byte scale 256 and
speedup 1, so a modelled 1 GiB copy is 4 MiB here and a 12.5 GB/s link
(``eth-100g``) runs at 12.5e9 / 256 real bytes/s.

* a modelled 1 GiB copy at 12.5 GB/s takes 86 ms +- 20 % (a Get that pulls it);
* two concurrent pulls from one holder (into two nodes) take 1.7-2.3x one;
* two concurrent pulls of the same pages into the same node move the bytes once.

The netns tests need root and iproute2 (``.ci/run`` installs iproute2 and sets
``KVSTORE_REQUIRE_NETNS=1``, so in CI they fail instead of skipping); elsewhere
they skip with the reason.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Iterator

import numpy as np
import pytest


from kvstore.replay.cluster import ClusterSpec, LocalCluster
from kvstore.replay.metrics import metric_sum
from kvstore.replay.netns import available
from kvstore_client import AsyncKvClient

BYTE_SCALE = 256
GiB = 1 << 30
PAGE = (64 << 20) // BYTE_SCALE          # a Llama-3-8B 512-token block, scaled: 256 KiB
PAGES_PER_GIB = GiB // BYTE_SCALE // PAGE  # 16
RATE = 12.5e9 / BYTE_SCALE                # eth-100g at speedup 1
MODELLED_1GIB_S = GiB / 12.5e9            # 85.9 ms
NS = "phys"
TRIES = 3  # fresh pages per timed check: a busy machine only adds time (see each test)


@pytest.fixture(scope="module", params=["shaped", "netns"])
def cluster(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    if request.param == "netns" and available():
        if os.environ.get("KVSTORE_REQUIRE_NETNS"):  # CI (root, iproute2 installed by .ci/run): must run
            pytest.fail(f"KVSTORE_REQUIRE_NETNS is set but {available()}")
        pytest.skip(available())
    spec = ClusterSpec(nodes=3, policy="reactive", namespace=NS, page_bytes=PAGE, capacity="160MiB",
                       settings={"device": "cpu", "transport": "tcp", "heartbeat_interval": 0.1,
                                 "heartbeat_timeout": 3.0},
                       network=request.param, link_rate=RATE)
    with LocalCluster(spec, tmp_path_factory.mktemp(f"phys-{request.param}")) as c:
        yield c


def _keys(tag: str, n: int = PAGES_PER_GIB) -> list[bytes]:
    return [f"{tag}-{i:04d}".encode() for i in range(n)]


async def _put_on_n0(c: LocalCluster, *tags: str) -> None:
    """Store one modelled GiB per tag on n0 and wait until n1 and n2 see n0 hold it."""
    async with AsyncKvClient(c.nodes[0].address) as kv:
        for tag in tags:
            pages = np.random.default_rng(len(tag)).integers(0, 256, (PAGES_PER_GIB, PAGE), dtype=np.uint8)
            await kv.put(NS, _keys(tag), pages)
    for node in c.nodes[1:]:
        async with AsyncKvClient(node.address) as kv:
            deadline = time.monotonic() + 10
            for tag in tags:
                while True:
                    lk = await kv.lookup_nodes(NS, _keys(tag))
                    if any(e.node_id == "n0" and e.prefix_length == PAGES_PER_GIB for e in lk.nodes):
                        break
                    assert time.monotonic() < deadline, "n0's pages never reached the directory"
                    await asyncio.sleep(0.05)


async def _timed_get(address: str, tag: str) -> float:
    async with AsyncKvClient(address) as kv:
        await kv.lookup(NS, [b"warm"])  # connect first: the pull is what is timed
        t0 = time.perf_counter()
        got = await kv.get(NS, _keys(tag), timeout=30)
        dt = time.perf_counter() - t0
    assert got.found.all(), f"{tag}: {int(got.found.sum())}/{PAGES_PER_GIB} pages arrived"
    return dt


def _peer_bytes(c: LocalCluster, i: int, direction: str) -> float:
    return metric_sum(c.scrape(i), "kvstore_peer_bytes_total", {"direction": direction})


def _run(coro):  # type: ignore[no-untyped-def]
    return asyncio.run(asyncio.wait_for(coro, 120))


def test_one_modelled_gib_at_12_5_gbs_takes_86_ms(cluster: LocalCluster) -> None:
    """The copy = a Get that pulls the pages minus the same Get served locally (the per-Get overhead,
    no link in it: measured on the holder right before).

    A shaper may never be faster than its link, so every try must take at least 80 % of the
    modelled time. A busy machine (CI shares its two cores) only adds time, so each node gets up
    to ``TRIES`` fresh pages and passes on the first copy within 20 % of the model: a shaper that
    overcharges fails all of them."""
    async def one_try(node: int, tag: str) -> tuple[float, float]:
        await _put_on_n0(cluster, tag)
        local = min([await _timed_get(cluster.nodes[0].address, tag) for _ in range(3)])
        return await _timed_get(cluster.nodes[node].address, tag), local

    async def body() -> dict[int, list[tuple[float, float]]]:
        await _put_on_n0(cluster, "warm1")
        await _timed_get(cluster.nodes[1].address, "warm1")  # first pull opens the peer connections
        out: dict[int, list[tuple[float, float]]] = {}
        for node in (1, 2):
            out[node] = []
            for k in range(TRIES):
                pulled, local = await one_try(node, f"one-{node}-{k}")
                out[node].append((pulled, local))
                assert pulled - local >= MODELLED_1GIB_S * 0.8, \
                    f"{cluster.spec.network}: 1 GiB (scaled) copy took {(pulled - local) * 1e3:.1f} ms, " \
                    f"faster than the modelled {MODELLED_1GIB_S * 1e3:.1f} ms link allows"
                if pulled - local <= MODELLED_1GIB_S * 1.2:
                    break
        return out

    tries = _run(body())
    for node, times in tries.items():
        print(f"[{cluster.spec.network}] n{node}: 1 GiB scaled, Get that pulls / same Get local (ms): "
              f"{[(round(p * 1e3, 1), round(q * 1e3, 1)) for p, q in times]}; modelled {MODELLED_1GIB_S * 1e3:.1f}")
        best = min(p - q for p, q in times)
        assert best <= MODELLED_1GIB_S * 1.2, \
            f"{cluster.spec.network}: the fastest of {len(times)} 1 GiB (scaled) copies into n{node} took " \
            f"{best * 1e3:.1f} ms, modelled {MODELLED_1GIB_S * 1e3:.1f} ms"


def test_two_concurrent_pulls_from_one_holder_share_its_link(cluster: LocalCluster) -> None:
    """Up to ``TRIES`` tries on fresh pages, passing on the first in the band (noise moves a ratio
    either way; a link that is not shared, at about 1x, or shared unfairly fails every try)."""
    async def one_try(k: int) -> tuple[float, float]:
        solo, a, b = f"solo-{k}", f"pair-a-{k}", f"pair-b-{k}"
        await _put_on_n0(cluster, solo, a, b)
        one = await _timed_get(cluster.nodes[1].address, solo)
        t0 = time.perf_counter()
        await asyncio.gather(_timed_get(cluster.nodes[1].address, a), _timed_get(cluster.nodes[2].address, b))
        return one, time.perf_counter() - t0

    async def body() -> list[tuple[float, float]]:
        await _put_on_n0(cluster, "warm2a", "warm2b")
        await asyncio.gather(_timed_get(cluster.nodes[1].address, "warm2a"),
                             _timed_get(cluster.nodes[2].address, "warm2b"))
        out = []
        for k in range(TRIES):
            out.append(await one_try(k))
            if 1.7 <= out[-1][1] / out[-1][0] <= 2.3:
                break
        return out

    tries = _run(body())
    print(f"[{cluster.spec.network}] one pull / two concurrent (ms): "
          f"{[(round(o * 1e3, 1), round(t * 1e3, 1), round(t / o, 2)) for o, t in tries]}")
    one, two = tries[-1]
    assert 1.7 <= two / one <= 2.3, f"{cluster.spec.network}: in {len(tries)} tries, the last: " \
                                    f"one pull {one * 1e3:.1f} ms, two {two * 1e3:.1f} ms"


def test_two_concurrent_pulls_of_the_same_pages_move_them_once(cluster: LocalCluster) -> None:
    """Two Gets of the same pages at once pull them once: the bytes exactly, the time about one pull's.
    Up to ``TRIES`` tries on fresh pages, passing on the first under 1.4x (noise moves a ratio either
    way; two pulls of the pages, at about 2x, fail every try); every try checks the bytes."""
    async def one_try(k: int) -> tuple[float, float, int, int]:
        solo, same = f"solo3-{k}", f"same-{k}"
        await _put_on_n0(cluster, solo, same)
        in_before, out_before = _peer_bytes(cluster, 1, "in"), _peer_bytes(cluster, 0, "out")
        one = await _timed_get(cluster.nodes[1].address, solo)
        t0 = time.perf_counter()
        await asyncio.gather(_timed_get(cluster.nodes[1].address, same),
                             _timed_get(cluster.nodes[1].address, same))
        both = time.perf_counter() - t0
        return one, both, _peer_bytes(cluster, 1, "in") - in_before, _peer_bytes(cluster, 0, "out") - out_before

    async def body() -> list[tuple[float, float, int, int]]:
        await _put_on_n0(cluster, "warm3")
        await _timed_get(cluster.nodes[1].address, "warm3")
        out = []
        for k in range(TRIES):
            out.append(await one_try(k))
            if out[-1][1] / out[-1][0] < 1.4:
                break
        return out

    tries = _run(body())
    print(f"[{cluster.spec.network}] one pull / the same pages twice at once (ms): "
          f"{[(round(o * 1e3, 1), round(b * 1e3, 1), round(b / o, 2)) for o, b, _, _ in tries]}")
    for _, _, moved_in, moved_out in tries:  # solo3 and "same" once each: two modelled GiB, not three
        assert moved_in == moved_out == 2 * PAGES_PER_GIB * PAGE, (moved_in, moved_out)
    one, both, _, _ = tries[-1]
    assert both / one < 1.4, f"{cluster.spec.network}: in {len(tries)} tries, the last: one pull " \
                             f"{one * 1e3:.1f} ms, the same pages twice at once {both * 1e3:.1f} ms"


def test_a_local_read_does_not_wait_behind_a_remote_pull_on_the_same_client(cluster: LocalCluster) -> None:
    """One client with two data connections, two calls at once: a Get that pulls a modelled GiB from
    n0 (86 ms at least, the shaper's floor) and a Get of a page n1 holds itself. The local read ends
    first: the calls run side by side, not in turns on one connection (the default, one connection,
    fails this test: the read waits for the pull)."""
    async def body() -> list[str]:
        await _put_on_n0(cluster, "far")
        order: list[str] = []
        async with AsyncKvClient(cluster.nodes[1].address, data_connections=2) as kv:
            here = [b"here-0"]
            await kv.put(NS, here, np.ones((1, PAGE), dtype=np.uint8))

            async def get(tag: str, keys: list[bytes]) -> None:
                got = await kv.get(NS, keys, timeout=30)
                assert got.found.all(), tag
                order.append(tag)

            await asyncio.gather(get("remote", _keys("far")), get("local", here))
        return order

    order = _run(body())
    assert order == ["local", "remote"], order
