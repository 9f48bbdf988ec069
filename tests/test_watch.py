"""Watched lookups (``LookupRequest.wait_seconds``): the pure wake-up logic without sockets, then real
``kvstored`` processes, where a follower's watch on one node answers when another node's Put resolves
the claim it waits for, long before the wait is up."""

from __future__ import annotations

import asyncio
import math
import threading
import time

import pytest

from conftest import keys_for, random_pages
from kvstore.cluster.watch import Watches, shape
from kvstore.errors import InvalidArgument
from kvstore.v1 import kvstore_pb2 as pb
from kvstore_client import KvClient
from test_claims_cluster import MiB, _entry, _start


def _np(node: str, length: int, pending: bool = False, computing: bool = False, ready: float = 0.0) -> pb.NodePrefix:
    return pb.NodePrefix(node_id=node, prefix_length=length, pending=pending, computing=computing,
                         ready_in_seconds=ready)


def test_shape_ignores_the_times_that_move_on_their_own() -> None:
    assert shape([_np("a", 4, True, True, ready=2.0)]) == shape([_np("a", 4, True, True, ready=0.5)])
    assert shape([_np("a", 4, True, True)]) != shape([_np("a", 8)])
    assert shape([_np("a", 4)]) != shape([_np("a", 4), _np("b", 4)])


def test_a_watch_answers_on_the_change_not_at_the_end_of_its_wait() -> None:
    async def main() -> tuple[list[pb.NodePrefix], float]:
        w = Watches()
        state = [_np("a", 4, True, True)]
        loop = asyncio.get_running_loop()

        def land() -> None:
            state[:] = [_np("a", 8)]
            w.changed()

        loop.call_later(0.05, land)
        t0 = loop.time()
        got = await w.until_changed(list(state), lambda: list(state), 10.0)
        return got, loop.time() - t0

    got, took = asyncio.run(main())
    assert [(n.node_id, n.prefix_length, n.pending) for n in got] == [("a", 8, False)]
    assert took < 1.0


def test_a_change_wakes_only_the_watches_of_its_keys() -> None:
    async def main() -> tuple[int, int]:
        w = Watches()
        draws = {"a": 0, "b": 0}

        def draw(name: str) -> list[pb.NodePrefix]:
            draws[name] += 1
            return [_np(name, 1)]

        tasks = [asyncio.create_task(w.until_changed([_np(n, 1)], lambda n=n: draw(n), 0.05, "ns", [n.encode()]))
                 for n in "ab"]
        await asyncio.sleep(0)
        for _ in range(20):
            w.changed("ns", [b"a"])  # a's key only: b's watch sleeps on
            for _ in range(3):
                await asyncio.sleep(0)
        await asyncio.gather(*tasks)
        assert w.active == 0 and not w._by_key  # every watch unregistered
        return draws["a"], draws["b"]

    woken_a, woken_b = asyncio.run(main())
    assert woken_a >= 5 and woken_b <= 2  # b: its end-of-wait draw (and at most one re-check)


def test_a_watch_without_change_ends_with_its_wait_and_catches_unannounced_changes() -> None:
    async def main() -> tuple[float, float, int]:
        w = Watches()
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        same = await w.until_changed([_np("a", 4)], lambda: [_np("a", 4)], 0.3)
        quiet = loop.time() - t0
        # a change nobody announces (a claim that expired): found by the periodic re-draw
        flip = {"at": loop.time() + 0.05}
        t1 = loop.time()
        await w.until_changed([_np("a", 4, True, True)],
                              lambda: [_np("a", 4, True, True)] if loop.time() < flip["at"] else [], 10.0)
        return quiet, loop.time() - t1, len(same)

    quiet, unannounced, n = asyncio.run(main())
    assert 0.3 <= quiet < 1.0 and n == 1
    assert unannounced < 1.0


def test_a_node_at_its_watch_limit_answers_at_once() -> None:
    async def main() -> float:
        w = Watches(limit=1)
        hold = asyncio.create_task(w.until_changed([_np("a", 1)], lambda: [_np("a", 1)], 5.0))
        await asyncio.sleep(0)
        assert w.active == 1
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        await w.until_changed([_np("a", 1)], lambda: [_np("a", 1)], 5.0)
        took = loop.time() - t0
        hold.cancel()
        await asyncio.gather(hold, return_exceptions=True)
        assert w.active == 0  # a cancelled watch gives its place back
        return took

    assert asyncio.run(main()) < 0.1


def test_a_follower_watching_a_claim_on_another_node_wakes_when_the_put_lands(daemon) -> None:  # type: ignore[no-untyped-def]
    nodes = _start(daemon, "reactive")
    keys, pages = keys_for(8, b"watch"), random_pages(8, MiB)
    with KvClient(nodes["b"].address) as kb, KvClient(nodes["c"].address) as kc:
        kb.lookup_nodes("m", keys, record=True, claim_seconds=20.0)  # b computes the prefix
        seen = _entry(kc, keys, "b")
        assert seen is not None and seen.computing
        out: dict[str, object] = {}

        def follow() -> None:
            t0 = time.perf_counter()
            out["reply"] = kc.lookup_nodes("m", keys, wait_seconds=15.0)  # c's follower watches, not polls
            out["took"] = time.perf_counter() - t0

        t = threading.Thread(target=follow)
        t.start()
        time.sleep(0.5)
        assert t.is_alive()  # nothing changed yet: the watch holds
        t_put = time.perf_counter()
        kb.put("m", keys, pages)
        t.join(10)
        assert not t.is_alive()
        landed = time.perf_counter() - t_put
        b = next(n for n in out["reply"].nodes if n.node_id == "b")  # type: ignore[attr-defined]
        assert b.prefix_length == 8 and not b.computing and not b.pending
        assert landed < 3.0 and out["took"] < 10.0  # type: ignore[operator]  # the Put, not the 15 s wait


def test_a_bad_watch_is_invalid_argument(daemon) -> None:  # type: ignore[no-untyped-def]
    nodes = _start(daemon, "reactive")
    keys = keys_for(4, b"badwatch")
    with KvClient(nodes["b"].address) as kb:
        for bad in (-1.0, math.nan, math.inf, 1e9):
            with pytest.raises(InvalidArgument, match="wait_seconds"):
                kb.lookup_nodes("m", keys, wait_seconds=bad)
        with pytest.raises(InvalidArgument, match="plain lookup"):
            kb.lookup_nodes("m", keys, wait_seconds=1.0, record=True)
        with pytest.raises(InvalidArgument, match="plain lookup"):
            kb.lookup_nodes("m", keys, wait_seconds=1.0, claim_seconds=1.0)
        assert _entry(kb, keys, "b") is None  # no claim was made
