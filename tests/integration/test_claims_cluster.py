"""In-flight prefill claims across real ``kvstored`` processes: a Lookup that claims its prefill is seen
by the other nodes' lookups as ``computing`` until its Put lands; under predictive the coordinator then
copies the prefix to the nodes that waited for it."""

from __future__ import annotations

import math
import urllib.request

import grpc
import pytest

from tests.conftest import keys_for, random_pages, wait_until
from kvstore.errors import InvalidArgument
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc as pb_grpc
from kvstore_client import KvClient

MiB = 1 << 20
FAST = ("--heartbeat-interval", "0.2", "--heartbeat-timeout", "2.0")


def _live(address: str) -> list[str]:
    with grpc.insecure_channel(address) as channel:
        reply = pb_grpc.ClusterStub(channel).Status(pb.ClusterStatusRequest(), timeout=5)
    return sorted(m.node_id for m in reply.members)


def _start(daemon, policy: str, ids: str = "abc", *extra: str):  # type: ignore[no-untyped-def]
    nodes, seed = {}, None
    for node_id in ids:
        args = ["--node-id", node_id, "--transport", "tcp", "--namespace", f"m:{MiB}", "--replication", policy,
                "--metrics-port", "0", *FAST, *extra]
        nodes[node_id] = daemon(*args, *(["--peers", seed] if seed else []))
        seed = seed or nodes[node_id].address
    for d in nodes.values():
        wait_until(lambda d=d: _live(d.address) == sorted(ids), 15, "membership to converge")
    wait_until(lambda: _warm(nodes["a"].address), 15, "the coordinator's directory to warm up")
    return nodes


def _warm(address: str) -> bool:
    """The coordinator answers a miss itself (a new coordinator refuses those while it may lack a
    member's report, and its askers fall back to the standby, which keeps no claims)."""
    with grpc.insecure_channel(address) as channel:
        try:
            pb_grpc.ClusterStub(channel).ClusterLookup(pb.LookupRequest(namespace="m", keys=[b"absent"]), timeout=5)
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.UNAVAILABLE:
                return False
            raise
    return True


def _entry(kv: KvClient, keys: list[bytes], node: str) -> pb.NodePrefix | None:
    return next((n for n in kv.lookup_nodes("m", keys).nodes if n.node_id == node), None)


@pytest.mark.parametrize("policy", ["reactive", "predictive"])
def test_a_claim_is_seen_as_computing_until_its_put_lands(daemon, policy) -> None:  # type: ignore[no-untyped-def]
    nodes = _start(daemon, policy)
    keys, pages = keys_for(8, b"claim"), random_pages(8, MiB)
    with KvClient(nodes["b"].address) as kb, KvClient(nodes["c"].address) as kc:
        first = kb.lookup_nodes("m", keys, record=True, claim_seconds=5.0)
        assert first.prefix_length == 0 and not [n for n in first.nodes if n.node_id != "b"]
        seen = _entry(kc, keys[:6] + [b"own suffix"], "b")   # a follower sharing 6 blocks, on another node
        assert seen is not None and seen.computing and seen.pending and seen.prefix_length == 6
        assert 0 < seen.ready_in_seconds <= 5.0
        # a second claimant of the same chain wins nothing: it still sees b
        kc.lookup_nodes("m", keys, claim_seconds=1.0)
        assert _entry(kc, keys, "b").computing  # type: ignore[union-attr]
        kb.put("m", keys, pages)
        # b reports at once while it holds claims: well under the 2 s heartbeat timeout
        took = wait_until(lambda: (e := _entry(kc, keys, "b")) is not None and not e.computing
                          and not e.pending and e.prefix_length == 8, 3, "b's Put to resolve its claim")
        assert took < 1.0
        # c alone waited for b's claim: one copy is no faster than c's own pull, so no tree (c's Get pulls)
        got = kc.get("m", keys)
        assert got.found.all() and (got.pages == pages).all()
        assert 'kvstore_planner_decisions_total{kind="claim_tree"} 1.0' not in _metrics(nodes["a"])


def _metrics(node) -> str:  # type: ignore[no-untyped-def]
    url = f"http://127.0.0.1:{node.fields['metrics_port']}/metrics"
    return urllib.request.urlopen(url, timeout=5).read().decode()


def test_under_predictive_a_burst_of_waiters_gets_the_claim_as_a_copy_tree(daemon) -> None:  # type: ignore[no-untyped-def]
    """Three nodes wait for b's claim: with one copy at a time per node (``--copy-fanout 1``) the tree
    lands its last copy sooner than three pulls sharing b's egress, so the coordinator copies it to them
    (and on to the rest of the live nodes: a wide burst), no Get needed. Each waiter does what an
    engine's connector does: its request's recorded Lookup shows it the claim, and its re-look (a Lookup
    that records nothing) says it waits."""
    nodes = _start(daemon, "predictive", "abcde", "--copy-fanout", "1")
    keys, pages = keys_for(8, b"tree"), random_pages(8, MiB)
    with KvClient(nodes["b"].address) as kb:
        kb.lookup_nodes("m", keys, record=True, claim_seconds=5.0)
        waiters = {w: KvClient(nodes[w].address) for w in "cde"}
        try:
            for client in waiters.values():
                assert any(n.node_id == "b" and n.computing for n in client.lookup_nodes("m", keys, record=True).nodes)
                assert _entry(client, keys, "b").computing  # type: ignore[union-attr]
            kb.put("m", keys, pages)
            for w, client in waiters.items():
                wait_until(lambda client=client: client.lookup("m", keys) == 8, 10, f"the waiter tree to reach {w}")
        finally:
            for client in waiters.values():
                client.close()
    assert 'kvstore_planner_decisions_total{kind="claim_tree"} 1.0' in _metrics(nodes["a"])


def test_a_bad_claim_is_invalid_argument_and_changes_nothing(daemon) -> None:  # type: ignore[no-untyped-def]
    nodes = _start(daemon, "reactive")
    keys = keys_for(4, b"bad")
    with KvClient(nodes["b"].address) as kb, KvClient(nodes["c"].address) as kc:
        for bad in (-1.0, math.nan, math.inf, 1e9):
            with pytest.raises(InvalidArgument, match="claim_seconds"):
                kb.lookup_nodes("m", keys, claim_seconds=bad)
        assert _entry(kc, keys, "b") is None


def test_a_recorded_lookup_announces_its_pull_to_the_next_asker_until_it_lands(daemon) -> None:  # type: ignore[no-untyped-def]
    """The coordinator counts the pulls of a prefix in flight on its holder (``copies_ahead`` on the
    holder's entry): a recorded Lookup from a node that lacks it announces one, a router's look does
    not, and the puller holding the prefix ends it."""
    nodes = _start(daemon, "reactive")
    keys, pages = keys_for(8, b"pull"), random_pages(8, MiB)
    with KvClient(nodes["a"].address) as ka, KvClient(nodes["b"].address) as kb, \
            KvClient(nodes["c"].address) as kc:
        ka.put("m", keys, pages)
        wait_until(lambda: (e := _entry(kc, keys, "a")) is not None and e.prefix_length == 8, 5,
                   "a's pages in the directory")
        assert _entry(kc, keys, "a").copies_ahead == 0  # type: ignore[union-attr]   # a look, not a pull
        assert _entry(kc, keys, "a").copies_ahead == 0  # type: ignore[union-attr]
        kb.lookup_nodes("m", keys, record=True)                     # b is about to pull it from a
        ahead = next(n for n in kc.lookup_nodes("m", keys, record=True).nodes if n.node_id == "a")
        assert ahead.copies_ahead == 1                              # c's pull would share a with b's
        assert _entry(kb, keys, "a").copies_ahead == 1  # type: ignore[union-attr]   # b's own aside: c's
        assert kb.get("m", keys).found.all()                         # b pulls it and reports it
        wait_until(lambda: (e := _entry(kc, keys, "a")) is not None and e.copies_ahead == 0, 5,
                   "b's pull to end when the directory shows b holding the prefix")
        assert _entry(kc, keys, "b").prefix_length == 8  # type: ignore[union-attr]
