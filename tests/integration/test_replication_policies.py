"""The replication policies end to end on in-process nodes: ``full`` copies every
page to every node; ``reactive`` pulls on a miss and ``none`` never does."""

from __future__ import annotations

import time

import numpy as np
import pytest

from tests.conftest import check_pools_sound, keys_for, random_pages
from kvstore_client import KvClient


def test_full_policy_copies_every_page_everywhere(make_server) -> None:  # type: ignore[no-untyped-def]
    common = dict(replication="full", transport="tcp", heartbeat_interval=0.05, heartbeat_timeout=2.0,
                  planner_tick=0.05, capacity=16 << 20)
    a = make_server(node_id="a", **common)
    b = make_server(node_id="b", peers=(a.address,), **common)
    c = make_server(node_id="c", peers=(a.address,), **common)
    for srv in (a, b, c):
        with KvClient(srv.address) as kv:
            kv.create_namespace("m", 4096)
    pages = random_pages(6, 4096)
    with KvClient(b.address) as kb, KvClient(c.address) as kc, KvClient(a.address) as ka:
        kb.put("m", keys_for(6), pages)
        deadline = time.monotonic() + 10
        while not (all(kc.exists("m", keys_for(6))) and all(ka.exists("m", keys_for(6)))):
            assert time.monotonic() < deadline, "full replication did not reach every node"
            time.sleep(0.02)
        for kv in (ka, kc):
            got = kv.get("m", keys_for(6), local_only=True)
            assert got.found.all() and np.array_equal(got.pages, pages)
            assert kv.stats("m").namespaces[0].replica_slots == 6
    for srv in (a, b, c):
        check_pools_sound(srv)


def _pair(make_server, policy: str) -> tuple:  # type: ignore[no-untyped-def]
    """Nodes ``a`` and ``b`` under ``policy``, each with namespace ``m`` of 4 KiB pages."""
    common = dict(replication=policy, transport="tcp", heartbeat_interval=0.05, heartbeat_timeout=2.0,
                  planner_tick=0.05, capacity=16 << 20)
    a = make_server(node_id="a", **common)
    b = make_server(node_id="b", peers=(a.address,), **common)
    for srv in (a, b):
        with KvClient(srv.address) as kv:
            kv.create_namespace("m", 4096)
    return a, b


@pytest.mark.parametrize("policy", ["none", "reactive"])
def test_reactive_and_none_place_nothing(make_server, policy: str) -> None:  # type: ignore[no-untyped-def]
    a, b = _pair(make_server, policy)
    with KvClient(a.address) as ka, KvClient(b.address) as kb:
        ka.put("m", keys_for(3), random_pages(3, 4096))
        deadline = time.monotonic() + 5
        while a.call(lambda: len(a.server.agent.directory)) < 3:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        got = kb.get("m", keys_for(3), timeout=2)
        assert got.found.all() == (policy == "reactive")
        assert kb.stats("m").namespaces[0].replica_slots == (3 if policy == "reactive" else 0)


def test_a_heartbeat_tells_the_coordinator_what_a_forecast_copy_may_push_out(make_server) -> None:  # type: ignore[no-untyped-def]
    """Each node's heartbeat carries its unheld plain pages (what a forecast copy may displace on a full
    pool) and their price; the coordinator's view of it is what the planner plans with."""
    a, b = _pair(make_server, "predictive")
    with KvClient(b.address) as kb:
        kb.put("m", keys_for(3), random_pages(3, 4096))
        lease = kb.pin("m", keys_for(1), ttl=60.0)  # a pinned page is never displaced
        try:
            seen = lambda: a.call(lambda: a.server.agent.membership.member("b"))  # noqa: E731
            deadline = time.monotonic() + 10
            while (seen() is None or seen().cold_bytes != 2 * 4096) and time.monotonic() < deadline:
                time.sleep(0.02)
            info = seen()
            assert info is not None and info.cold_bytes == 2 * 4096 and info.cold_reads == pytest.approx(0.5)
        finally:
            kb.unpin("m", lease)
