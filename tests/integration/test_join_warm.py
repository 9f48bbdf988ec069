"""A node joining a running cluster, on real daemons: the coordinator copies it the prefixes its forecast
expects hot and marks it ``joining`` in Status (routers leave it out) until they landed; with
``--join-warm 0`` it serves at once and gets nothing."""

from __future__ import annotations

import time

import pytest

from tests.conftest import check_pools_sound, keys_for, random_pages
from kvstore_client import KvClient


@pytest.mark.parametrize("warm", [10.0, 0.0])
def test_a_joining_node_gets_the_hot_prefix_before_it_serves(make_server, warm: float) -> None:  # type: ignore[no-untyped-def]
    common = dict(replication="predictive", transport="tcp", heartbeat_interval=0.05, heartbeat_timeout=0.5,
                  planner_tick=0.05, capacity=16 << 20, predictor_depths=(1, 2, 4), join_warm=warm)
    a = make_server(node_id="a", **common)
    b = make_server(node_id="b", peers=(a.address,), **common)
    for srv in (a, b):
        with KvClient(srv.address) as kv:
            kv.create_namespace("m", 4096)
    keys = keys_for(4)
    with KvClient(a.address) as ka, KvClient(b.address) as kb:
        ka.put("m", keys, random_pages(4, 4096))
        for i in range(40):  # a burst on the prefix, served by both nodes
            (ka if i % 2 else kb).lookup("m", keys, record=True)
            time.sleep(0.01)
        core = a.call(lambda: a.server.agent.placement.core)
        deadline = time.monotonic() + 10
        while not a.call(lambda: core.warming.settled(core.clock())):  # members from now on join
            assert time.monotonic() < deadline
            time.sleep(0.02)
        c = make_server(node_id="c", peers=(a.address,), **common)
        with KvClient(c.address) as kc:
            kc.create_namespace("m", 4096)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            st = a.call(lambda: a.server.agent.status())
            if "c" in {m.node_id for m in st.members} and "c" not in st.joining and \
                    (not warm or c.call(lambda: c.server.node.namespace("m").pool.prefix_length(keys)) == 4):
                break
            time.sleep(0.02)
        else:
            raise AssertionError("c never served")
        warmed = a.call(lambda: core.decisions["warm"])
        assert warmed == (1 if warm else 0)  # the hot prefix, once, before c left the joining list
    for srv in (a, b, c):
        check_pools_sound(srv)
