"""Speculative replicas expire on the node that holds them: at their TTL, at
a renewed TTL, or when the coordinator's planner drops a decayed prefix.

Everything here goes through public RPCs only (KvStore Put/Get/Exists/Lookup/
Stats through ``KvClient``, ``kvstore.v1.Cluster/Replicate`` through the
generated stub) against real in-process nodes, and every check is on the
target node's own pool (its Stats and local reads), never on the
coordinator's placement map.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import grpc
import numpy as np
import pytest

from tests.conftest import check_pools_sound, keys_for, random_pages, wait_until
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc as pb_grpc
from kvstore_client import KvClient, chain_keys

PAGE = 64 << 10
HEARTBEAT = 0.05  # the node drops expired speculative replicas on its heartbeat tick
SLACK = 1.5  # how late past its expiry a replica may still be seen (many heartbeat ticks on a busy machine)


# ---- helpers ---------------------------------------------------------------------
def wait_by(cond: Callable[[], bool], deadline: float, what: str, state: Callable[[], Any] | None = None) -> float:
    """:func:`tests.conftest.wait_until` with a deadline on time.monotonic(); returns when ``cond`` first held."""
    now = time.monotonic()
    return now + wait_until(cond, deadline - now, what, state)


def sleep_until(when: float) -> None:
    """A bounded sleep to a point in time (to check that something is still there then)."""
    time.sleep(max(0.0, when - time.monotonic()))


def ns_stats(kv: KvClient) -> pb.NamespaceStats:
    return kv.stats("m").namespaces[0]


def spec_state(kv: KvClient, keys: list[bytes]) -> dict[str, Any]:
    """What a node's pool says about ``keys`` (for failure messages)."""
    ns = ns_stats(kv)
    return {"speculative_slots": ns.speculative_slots, "speculative_wasted_bytes": ns.speculative_wasted_bytes,
            "used_slots": ns.used_slots, "present": sum(kv.exists("m", keys))}


def replicate(address: str, keys: list[bytes], ttl: float, source: str = "a") -> pb.ReplicateResponse:
    with grpc.insecure_channel(address) as channel:
        return pb_grpc.ClusterStub(channel).Replicate(
            pb.ReplicateRequest(namespace="m", keys=keys, source_node_id=source, kind=pb.SPECULATIVE,
                                ttl_seconds=ttl), timeout=20)


def wait_members(servers: list[Any], timeout: float = 10.0) -> None:
    """Every node's Stats lists every node as a live member."""
    def node_id(srv: Any) -> str:
        with KvClient(srv.address) as kv:
            return kv.stats().node_id

    ids = {node_id(s) for s in servers}

    def seen(srv: Any) -> set[str]:
        with KvClient(srv.address) as kv:
            return {m.node_id for m in kv.stats().members if m.alive}

    wait_by(lambda: all(seen(s) == ids for s in servers), time.monotonic() + timeout, "membership",
               lambda: {s.address: sorted(seen(s)) for s in servers})


# ---- fixtures --------------------------------------------------------------------
@pytest.fixture(params=["tcp", "ucx"])
def pair(request, make_server, pool_ops):  # type: ignore[no-untyped-def]
    """Nodes a (the source, holding primaries) and b (the target), both with namespace m."""
    if request.param == "ucx":
        pytest.importorskip("ucxx")
    common = dict(transport=request.param, heartbeat_interval=HEARTBEAT, heartbeat_timeout=2.0,
                  capacity=16 << 20)
    a = make_server(ops=pool_ops, node_id="a", **common)
    b = make_server(ops=pool_ops, node_id="b", peers=(a.address,), **common)
    for srv in (a, b):
        with KvClient(srv.address) as kv:
            kv.create_namespace("m", PAGE)
    wait_members([a, b])
    yield a, b
    for srv in (a, b):
        check_pools_sound(srv)


# ---- a: expiry at the TTL ----------------------------------------------------------
def test_speculative_replica_expires_at_its_ttl(pair) -> None:  # type: ignore[no-untyped-def]
    a, b = pair
    n, ttl = 6, 1.0
    keys = keys_for(n, b"x")
    with KvClient(a.address) as ka, KvClient(b.address) as kb:
        ka.put("m", keys, random_pages(n, PAGE))
        start = time.monotonic()  # the node sets the expiry after this: it is >= start + ttl
        reply = replicate(b.address, keys, ttl)
        assert (reply.copied, reply.already_present, reply.missing) == (n, 0, 0)
        ns = ns_stats(kb)
        assert ns.speculative_slots == n, "the copy is not held as speculative replicas"
        assert ns.speculative_wasted_bytes == 0
        assert all(kb.exists("m", keys))

        gone = wait_by(lambda: ns_stats(kb).speculative_slots == 0, start + ttl + SLACK,
                          f"the speculative replicas on b to expire ({ttl:g} s TTL, {SLACK:g} s slack)",
                          lambda: spec_state(kb, keys))
        assert gone >= start + ttl, f"expired {start + ttl - gone:.3f} s before its TTL"
        assert not any(kb.exists("m", keys)), "expired replicas are still in b's pool"
        got = kb.get("m", keys, local_only=True)
        assert not got.found.any(), "a local read on b still finds expired replicas"
        ns = ns_stats(kb)
        assert ns.speculative_wasted_bytes == n * PAGE, "unread expired replicas are not counted as waste"
        assert ns.speculative_hits == 0 and ns.used_slots == 0
        assert all(ka.exists("m", keys)), "the source's primaries must stay"


# ---- b: a renewal extends the expiry ---------------------------------------------------
def test_renewal_extends_a_speculative_replica(pair) -> None:  # type: ignore[no-untyped-def]
    """Two prefixes are copied with the same short TTL; only one is renewed
    (a second Replicate of its keys with a longer TTL) before it expires.
    The other one shows the first TTL on the node; the renewed one outlives
    it and is gone after the second TTL."""
    a, b = pair
    n, ttl1, ttl2 = 4, 1.0, 2.5
    renewed, control = keys_for(n, b"r"), keys_for(n, b"c")
    with KvClient(a.address) as ka, KvClient(b.address) as kb:
        ka.put("m", renewed + control, random_pages(2 * n, PAGE))
        start = time.monotonic()
        reply = replicate(b.address, renewed + control, ttl1)
        assert reply.copied == 2 * n
        assert ns_stats(kb).speculative_slots == 2 * n
        renew_at = time.monotonic()
        assert renew_at < start + ttl1 / 2, "the first Replicate took too long to renew before expiry"
        again = replicate(b.address, renewed, ttl2)
        assert (again.copied, again.already_present, again.missing) == (0, n, 0)

        # the unrenewed prefix goes at the first TTL, counted as waste
        wait_by(lambda: not any(kb.exists("m", control)), start + ttl1 + SLACK,
                   f"the unrenewed replicas on b to expire at the first TTL ({ttl1:g} s)",
                   lambda: spec_state(kb, control))
        wait_by(lambda: ns_stats(kb).speculative_wasted_bytes == n * PAGE, start + ttl1 + SLACK,
                   "the expired replicas to be counted as waste", lambda: spec_state(kb, control))
        # the renewed one is still there past the first TTL ...
        sleep_until(start + ttl1 + 0.3)
        assert time.monotonic() < renew_at + ttl2, "too slow to check before the renewed expiry"
        assert all(kb.exists("m", renewed)), "the renewal did not extend the replicas past the first TTL"
        assert ns_stats(kb).speculative_slots == n

        # ... and gone after the second
        gone = wait_by(lambda: ns_stats(kb).speculative_slots == 0, renew_at + ttl2 + SLACK,
                          f"the renewed replicas on b to expire at the renewed TTL ({ttl2:g} s)",
                          lambda: spec_state(kb, renewed))
        assert gone >= renew_at + ttl2, f"the renewed replicas expired {renew_at + ttl2 - gone:.3f} s early"
        assert not kb.get("m", renewed, local_only=True).found.any()
        assert ns_stats(kb).speculative_wasted_bytes == 2 * n * PAGE
        assert all(ka.exists("m", renewed + control))


# ---- c: the planner drops a decayed prefix from the target's pool ------------------------
def test_planner_drop_of_a_decayed_prefix_empties_the_target(make_server) -> None:  # type: ignore[no-untyped-def]
    """A burst of recorded lookups makes the coordinator copy the prefix to
    the nodes lacking it; once traffic stops, the momentum rule forgets the
    prefix after its window and the planner drops it. The TTL is long
    (120 s), so only that drop can empty the targets' pools in time."""
    window = 2.0
    # node_rate 0.01 req/s: a few requests ask for every node (at the default 2 req/s one node serves them)
    common = dict(replication="predictive", transport="tcp", heartbeat_interval=HEARTBEAT, heartbeat_timeout=2.0,
                  node_rate=0.01, planner_tick=0.1, spec_ttl=120.0, capacity=32 << 20, predictor_momentum_window=window)
    a = make_server(node_id="a", **common)  # the coordinator (lowest id), and the holder
    b = make_server(node_id="b", peers=(a.address,), **common)
    c = make_server(node_id="c", peers=(a.address,), **common)
    for srv in (a, b, c):
        with KvClient(srv.address) as kv:
            kv.create_namespace("m", PAGE)
    wait_members([a, b, c])
    n = 8
    keys = chain_keys(np.arange(n * 16), 16)  # an 8-block prefix of 16-token blocks
    with KvClient(a.address) as ka, KvClient(b.address) as kb, KvClient(c.address) as kc:
        ka.put("m", keys, random_pages(n, PAGE))
        # the fan-out: requests for the prefix recorded on several nodes
        assert ka.lookup("m", keys, record=True) == n
        assert ka.lookup("m", keys, record=True) == n
        assert kb.lookup("m", keys, record=True) == 0
        last_request = time.monotonic()
        wait_by(lambda: ns_stats(kb).speculative_slots == n and ns_stats(kc).speculative_slots == n,
                   last_request + 5.0, "the coordinator's speculative copies on b and c",
                   lambda: {"b": spec_state(kb, keys), "c": spec_state(kc, keys)})
        # traffic has stopped: after the momentum window the prefix has decayed
        wait_by(lambda: ns_stats(kb).speculative_slots == 0 and ns_stats(kc).speculative_slots == 0,
                   last_request + window + 3.0,
                   f"the planner to drop the decayed prefix from b and c (momentum window {window:g} s, "
                   "spec_ttl 120 s)", lambda: {"b": spec_state(kb, keys), "c": spec_state(kc, keys)})
        for kv in (kb, kc):
            assert not any(kv.exists("m", keys)), "a dropped prefix is still in the target's pool"
            assert not kv.get("m", keys, local_only=True).found.any()
            ns = ns_stats(kv)
            assert ns.speculative_wasted_bytes == n * PAGE, "a dropped unread replica is not counted as waste"
            assert ns.speculative_hits == 0
        assert all(ka.exists("m", keys)), "the holder's primaries must stay"
    for srv in (a, b, c):
        check_pools_sound(srv)
