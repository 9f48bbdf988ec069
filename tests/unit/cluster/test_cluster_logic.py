"""The cluster layer's pure logic without sockets: membership, the heartbeat
round, the directory with its report-built speculative map, the outbox,
source assignment, and the coordinator's view of the replicas it placed."""

from __future__ import annotations

import time
from dataclasses import dataclass

import pytest

from kvstore.cluster.coordinator import Coordinator
from kvstore.cluster.directory import Directory, Outbox
from kvstore.cluster.membership import Membership, plan_round
from kvstore.cluster.peers import PeerClient
from kvstore.cluster.replicator import assign_sources
from kvstore.config import NodeConfig
from kvstore.metrics import NodeMetrics
from kvstore.pool.pool import PageKind
from kvstore.v1 import kvstore_pb2 as pb


class Clock:
    def __init__(self, t: float = 100.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


@dataclass
class Page:  # what the outbox reads of a pool entry
    key: bytes
    kind: int
    expires_at: float = 0.0


def info(node_id: str, incarnation: str = "1") -> pb.MemberInfo:
    return pb.MemberInfo(node_id=node_id, address=f"127.0.0.1:{7400 + ord(node_id[0])}", incarnation=incarnation)


def membership(self_id: str = "b", timeout: float = 2.0) -> tuple[Membership, Clock]:
    clock = Clock()
    return Membership(info(self_id), timeout, clock=clock), clock


# ---- membership and the round -----------------------------------------------
def test_lowest_live_id_coordinates_and_the_role_moves_on_death() -> None:
    m, clock = membership("b")
    assert m.coordinator() == "b" and m.is_coordinator
    m.observe(info("a"))
    m.observe(info("c"))
    assert m.live_ids() == ["a", "b", "c"] and m.coordinator() == "a"
    clock.t += 3
    m.observe(info("c"))
    assert [d.node_id for d in m.expire()] == ["a"]
    assert m.coordinator() == "b"


def test_a_new_incarnation_is_a_restart() -> None:
    m, _ = membership("b")
    assert m.observe(info("a", "1")).joined
    change = m.observe(info("a", "2"))
    assert change is not None and change.restarted


def test_plan_round_reports_to_the_coordinator_and_probes_everyone() -> None:
    m, clock = membership("b")
    m.observe(info("a"))
    me = info("b").address
    learned = {"127.0.0.1:9000": clock.t - 1, "127.0.0.1:9001": clock.t - 100}
    plan = plan_round(m, me, {info("a").address, me}, learned, "", clock.t, horizon=20)
    assert plan.coordinator == "a" and plan.coordinator_changed and not plan.report_locally
    assert plan.report_to == info("a").address
    assert plan.targets == tuple(sorted({info("a").address, "127.0.0.1:9000"}))  # stale gossip dropped, not self
    assert plan.learned == {"127.0.0.1:9000": clock.t - 1}
    again = plan_round(m, me, {info("a").address}, plan.learned, "a", clock.t, horizon=20)
    assert not again.coordinator_changed


def test_plan_round_applies_the_report_locally_on_the_coordinator() -> None:
    m, clock = membership("a")
    m.observe(info("b"))
    plan = plan_round(m, info("a").address, {info("b").address}, {}, "a", clock.t, horizon=20)
    assert plan.report_locally and plan.report_to == "" and plan.targets == (info("b").address,)


# ---- directory and outbox ---------------------------------------------------------
def test_reports_in_sequence_and_a_gap_asks_for_a_snapshot() -> None:
    d, out = Directory(), Outbox()
    out.record("m", [Page(b"k1", PageKind.PRIMARY), Page(b"k2", PageKind.PRIMARY)])
    seq, batches = out.take_full({"m": [Page(b"k1", PageKind.PRIMARY)]}, now=0.0)
    assert not d.report("a", "i1", seq, True, batches)
    assert d.locate("m", [b"k1", b"k2"]) == [{"a"}, set()]
    out.record("m", [Page(b"k2", PageKind.REPLICA)], [b"k1"])
    seq, batches = out.take(now=0.0)
    assert not d.report("a", "i1", seq, False, batches)
    assert d.locate("m", [b"k1", b"k2"]) == [set(), {"a"}]
    assert d.report("a", "i1", seq + 5, False, [])  # out of sequence
    assert d.report("a", "i2", seq + 1, False, [])  # a new incarnation
    assert d.report("z", "i1", 1, False, [])  # unknown node


def test_prefix_lengths_per_node() -> None:
    d = Directory()
    d.report("a", "i", 1, True, [pb.DirectoryBatch(namespace="m", adds=[b"1", b"2", b"3"])])
    d.report("b", "i", 1, True, [pb.DirectoryBatch(namespace="m", adds=[b"1", b"3"])])
    assert d.prefixes("m", [b"1", b"2", b"3"]) == {"a": 3, "b": 1}
    assert d.drop("a") == 3 and d.prefixes("m", [b"1", b"2"]) == {"b": 1}


def test_speculative_pages_are_reported_with_their_remaining_life() -> None:
    d, out = Directory(), Outbox()
    spec = Page(b"s", PageKind.SPECULATIVE, expires_at=50.0)
    out.record("m", [spec, Page(b"p", PageKind.PRIMARY)])
    seq, batches = out.take(now=40.0)
    assert [(p.key, p.expires_in_seconds) for p in batches[0].speculative] == [(b"s", 10.0)]
    d.report("a", "i", seq, True, batches, now=1000.0)  # the reader's own clock
    assert d.speculative == {("m", b"s"): {"a": 1010.0}}
    spec.expires_at = 70.0  # renewed on the node: reported as added again
    out.record("m", [spec])
    seq, batches = out.take(now=45.0)
    d.report("a", "i", seq, False, batches, now=1005.0)
    assert d.speculative == {("m", b"s"): {"a": 1030.0}}
    out.record("m", [Page(b"s", PageKind.REPLICA)])  # a read promoted it
    seq, batches = out.take(now=46.0)
    d.report("a", "i", seq, False, batches, now=1006.0)
    assert d.speculative == {} and d.locate("m", [b"s"]) == [{"a"}]


def test_expiry_and_death_clear_the_speculative_map() -> None:
    d = Directory()
    batch = pb.DirectoryBatch(namespace="m", adds=[b"s", b"t"],
                              speculative=[pb.SpeculativePage(key=b"s", expires_in_seconds=5),
                                           pb.SpeculativePage(key=b"t", expires_in_seconds=5)])
    d.report("a", "i", 1, True, [batch], now=0.0)
    d.report("b", "i", 1, True, [batch], now=0.0)
    d.report("a", "i", 2, False, [pb.DirectoryBatch(namespace="m", removes=[b"s"])], now=6.0)  # the node dropped it
    assert d.speculative == {("m", b"s"): {"b": 5.0}, ("m", b"t"): {"a": 5.0, "b": 5.0}}
    d.drop("b")
    assert d.speculative == {("m", b"t"): {"a": 5.0}}


def test_assign_sources_batches_keys_per_holder() -> None:
    keys = [b"1", b"2", b"3", b"4"]
    holders = [{"a", "b"}, {"a"}, {"b"}, set()]
    assert assign_sources(keys, holders, {"a", "b"}) == {"a": [b"1", b"2"], "b": [b"3"]}
    assert assign_sources(keys, holders, {"b"}) == {"b": [b"1", b"3"]}


def test_pullers_of_one_prefix_spread_over_its_equal_holders() -> None:
    keys = [b"%d" % i for i in range(8)]
    full = {"h1", "h2", "h3", "h4"}
    picks = {p: next(iter(assign_sources(keys, [full] * 8, full, puller=p))) for p in (f"n{i}" for i in range(16))}
    assert len(set(picks.values())) >= 3  # not every puller on one holder's egress
    again = {p: next(iter(assign_sources(keys, [full] * 8, full, puller=p))) for p in picks}
    assert again == picks                   # each puller's order is stable
    partial = [full] * 7 + [{"h2"}]         # more keys still win over the spread: one batch per holder
    assert set(assign_sources(keys, partial, full, puller="n0")) == {"h2"}


# ---- the coordinator's replica map -------------------------------------------------
class NoNamespaces:
    namespaces: dict[str, object] = {}


def test_the_coordinator_sees_only_replicas_it_placed_on_live_nodes() -> None:
    members, clock = membership("a")
    members.observe(info("b"))
    members.observe(info("c"))
    directory = Directory()
    config = NodeConfig(listen="127.0.0.1:0", replication="full", spec_ttl=30.0)
    coordinator = Coordinator(config, directory, members, PeerClient(members), NodeMetrics(NoNamespaces()),
                              page_bytes=lambda ns: 4096)
    spec = [pb.SpeculativePage(key=b"deep", expires_in_seconds=20)]
    for node in ("b", "c"):
        directory.report(node, "i", 1, True, [pb.DirectoryBatch(namespace="m", adds=[b"deep", b"other"],
                                                                speculative=spec)], now=0.0)
    assert coordinator.core.speculative == {}  # not placed by this coordinator
    coordinator.core._placed[("m", b"deep")] = 0.0
    assert coordinator.core.speculative == {("m", b"deep"): {"b": 20.0, "c": 20.0}}
    clock.t += 5  # c falls silent past the timeout
    members.observe(info("b"))
    assert coordinator.core.speculative == {("m", b"deep"): {"b": 20.0}}


def test_hints_name_reported_replicas_with_their_remaining_life() -> None:
    members, _ = membership("a")
    members.observe(info("b"))
    directory = Directory()
    config = NodeConfig(listen="127.0.0.1:0", replication="full")
    coordinator = Coordinator(config, directory, members, PeerClient(members), NodeMetrics(NoNamespaces()),
                              page_bytes=lambda ns: 4096)
    now = time.monotonic()
    directory.report("b", "i", 1, True, [pb.DirectoryBatch(
        namespace="m", adds=[b"k1", b"k2"], speculative=[pb.SpeculativePage(key=b"k2", expires_in_seconds=20)])],
        now=now)
    (hint,) = coordinator.core.hints("m", [b"k1", b"k2", b"k3"])
    assert (hint.node_id, hint.prefix_length, hint.pending) == ("b", 2, False)
    assert 19 < hint.expires_in_seconds <= 20 and hint.address == info("b").address
    coordinator.core.pending[("m", b"k3")] = {"b": now + 1}  # a deeper copy on its way
    (hint,) = coordinator.core.hints("m", [b"k1", b"k2", b"k3"])
    assert (hint.prefix_length, hint.pending) == (3, True)


def test_a_member_heard_from_is_listed_only_once_it_answers() -> None:
    m, clock = membership("b")
    change = m.heard(info("a"))
    assert change is not None and change.joined and m.live_ids() == ["b"]  # pending: not listed
    assert m.heard(info("a")) is None  # still waiting: no new change
    m.observe(info("a"))  # it answered a call
    assert m.live_ids() == ["a", "b"] and m.heard(info("a")) is None
    restart = m.heard(info("a", "2"))  # a new incarnation: the old one is gone at once
    assert restart is not None and restart.restarted and m.live_ids() == ["b"]
    m.observe(info("a", "2"))
    clock.t += 3  # timed out, then heard again: pending again
    m.expire()
    assert m.heard(info("a", "2")) is not None and m.live_ids() == ["b"]


def test_the_standby_is_the_next_id_and_gets_the_same_report() -> None:
    m, clock = membership("c")
    for node_id in "abd":
        m.observe(info(node_id))
    assert (m.coordinator(), m.standby(), m.keeps_directory) == ("a", "b", False)
    plan = plan_round(m, info("c").address, set(), {}, "a", clock.t, horizon=20)
    assert plan.report_to == info("a").address and plan.standby_to == info("b").address
    clock.t += 3
    m.observe(info("b"))
    m.observe(info("d"))
    m.expire()  # a died: b coordinates, c stands by
    assert (m.coordinator(), m.standby(), m.keeps_directory) == ("b", "c", True)
    plan = plan_round(m, info("c").address, set(), {}, "a", clock.t, horizon=20)
    assert plan.report_to == info("b").address and plan.standby_to == ""


class _RecordingPeers:
    """The coordinator's Replicate calls, answered after a short wait, with the
    copies each source had in flight at once (no sockets: scheduling only)."""

    def __init__(self, fail: set[str] = frozenset()) -> None:  # type: ignore[assignment]
        self.in_flight: dict[str, int] = {}
        self.most: dict[str, int] = {}
        self.sent: list[tuple[str, str]] = []
        self.parts: list[tuple[str, str, tuple[bytes, ...]]] = []  # (source, target, keys), in landing order
        self.fail = fail

    async def replicate(self, target: str, request, timeout: float):  # type: ignore[no-untyped-def]
        import asyncio

        src = request.source_node_id
        self.in_flight[src] = self.in_flight.get(src, 0) + 1
        self.most[src] = max(self.most.get(src, 0), self.in_flight[src])
        await asyncio.sleep(0.01)
        self.in_flight[src] -= 1
        self.sent.append((src, target))
        self.parts.append((src, target, tuple(request.keys)))
        ok = target not in self.fail
        return pb.ReplicateResponse(copied=len(request.keys) if ok else 0)


async def _carry(coordinator, decision, nbytes: int) -> None:  # type: ignore[no-untyped-def]
    """Start ``decision``'s copy tree in the daemon's coordinator and wait until every copy of it ended."""
    import asyncio

    coordinator.core.copy_tree(decision, nbytes)
    for _ in range(2000):
        if not coordinator.core.pending and not coordinator._tasks:
            return
        await asyncio.sleep(0.005)
    raise AssertionError("the copy tree did not end")


@pytest.mark.parametrize("fail", [set(), {"b"}])
def test_a_copy_tree_sends_one_wave_at_a_time_from_each_holder(fail: set[str]) -> None:
    """With fanout 2 and 7 targets, the holder sends two copies at a time
    (not its four edges at once); landed targets serve their own; a failed
    target's subtree is served by the node that was to send to it."""
    import asyncio

    from kvstore.cluster.coordinator import Coordinator
    from kvstore.cluster.directory import Directory
    from kvstore.metrics import NodeMetrics
    from kvstore.placement.planner import copy_tree
    from kvstore.placement.planner_types import Decision

    class NoNamespaces:
        namespaces: dict[str, object] = {}

    members = Membership(pb.MemberInfo(node_id="a", address="127.0.0.1:1", incarnation="1"), 2.0)
    config = NodeConfig(listen="127.0.0.1:0", replication="predictive", node_rate=1.0)
    peers = _RecordingPeers(fail)
    coordinator = Coordinator(config, Directory(), members, peers, NodeMetrics(NoNamespaces()),  # type: ignore[arg-type]
                              page_bytes=lambda ns: 4096)
    targets = list("bcdefgh")
    edges, waves = copy_tree(["a"], targets, coordinator.plan_cfg.fanout)
    decision = Decision(namespace="m", keys=(b"k" * 16,), depth=1, source="a", targets=tuple(targets), prob=1.0,
                        ttl_s=30.0, reason="test", bytes=7 * 4096, tree=tuple(edges), waves=waves)
    asyncio.run(_carry(coordinator, decision, 4096))
    assert sorted(dst for _, dst in peers.sent) == targets  # every target got exactly one copy
    assert max(peers.most.values()) <= coordinator.plan_cfg.fanout, peers.most
    if not fail:
        assert {src for src, _ in peers.sent} > {"a"}  # landed targets sent copies too
    else:
        by = dict((dst, src) for src, dst in peers.sent)
        orphans = [dst for src, dst in edges if src == "b"]
        assert orphans and all(by[o] == "a" for o in orphans)  # b failed: a served b's subtree


@pytest.mark.parametrize("fail", [set(), {"d"}])
def test_a_relayed_copy_tree_forwards_each_part_as_it_lands(fail: set[str]) -> None:
    """--copy-chunks 4 over a chain of 7 targets: every target gets every part once, each from the node
    before it in the chain, and a target sends part 0 on before its own last part came (relay, not store
    and forward). A failed target sends nothing; the one after it gets its parts from the node before."""
    import asyncio

    from kvstore.cluster.coordinator import Coordinator
    from kvstore.cluster.directory import Directory
    from kvstore.metrics import NodeMetrics
    from kvstore.placement.planner import copy_tree
    from kvstore.placement.planner_types import Decision

    class NoNamespaces:
        namespaces: dict[str, object] = {}

    members = Membership(pb.MemberInfo(node_id="a", address="127.0.0.1:1", incarnation="1"), 2.0)
    config = NodeConfig(listen="127.0.0.1:0", replication="predictive", node_rate=1.0, copy_chunks=4)
    peers = _RecordingPeers(fail)
    coordinator = Coordinator(config, Directory(), members, peers, NodeMetrics(NoNamespaces()),  # type: ignore[arg-type]
                              page_bytes=lambda ns: 4096)
    targets, keys = list("bcdefgh"), tuple(bytes([i]) * 16 for i in range(8))
    edges, waves = copy_tree(["a"], targets, coordinator.plan_cfg.fanout, coordinator.plan_cfg.chunks)
    decision = Decision(namespace="m", keys=keys, depth=len(keys), source="a", targets=tuple(targets), prob=1.0,
                        ttl_s=30.0, reason="test", bytes=7 * 8 * 4096, tree=tuple(edges), waves=waves, parts=4)
    asyncio.run(_carry(coordinator, decision, 8 * 4096))
    chain = ["a", *targets]
    for i, dst in enumerate(targets):
        got = [(src, part) for src, t, part in peers.parts if t == dst]
        if dst in fail:
            assert len(got) == 1  # its first part failed: nothing more is sent to it
            continue
        assert [k for _, part in got for k in part] == list(keys)  # four parts, in order, once each
        before = chain[i] if chain[i] not in fail else chain[i - 1]
        assert {src for src, _ in got} == {before}
    assert not coordinator.core.pending  # every target's pending entry ended with its copy
    if not fail:
        order = [(src, t, part[0]) for src, t, part in peers.parts]
        assert order.index(("b", "c", keys[0])) < order.index(("a", "b", keys[6]))  # b relayed part 0 early



def test_a_copy_in_flight_is_pending_under_every_prefix_of_its_chain() -> None:
    """The planner sees a copy on its way under each prefix of the copied chain, so a shorter
    candidate of the same chain (the predictor scores depths 1, 2, 4, ...) plans no second copy to that
    node while it is coming (seen as duplicate pages in a relayed copy, whose first parts land early);
    the entries go when the copy ended."""
    from kvstore.cluster.coordinator import Coordinator
    from kvstore.cluster.directory import Directory
    from kvstore.metrics import NodeMetrics

    class NoNamespaces:
        namespaces: dict[str, object] = {}

    members = Membership(pb.MemberInfo(node_id="a", address="127.0.0.1:1", incarnation="1"), 2.0)
    config = NodeConfig(listen="127.0.0.1:0", replication="predictive")
    coordinator = Coordinator(config, Directory(), members, _RecordingPeers(),  # type: ignore[arg-type]
                              NodeMetrics(NoNamespaces()), page_bytes=lambda ns: 4096)  # type: ignore[arg-type]
    keys = tuple(bytes([i]) * 16 for i in range(8))
    coordinator.core.note_pending(("m", keys[-1]), keys, "e", 1.0)
    coordinator.core.note_pending(("m", keys[3]), keys[:4], "f", 1.0)
    pending = coordinator.core.planner_pending()
    assert set(pending) == {("m", k) for k in keys}
    assert all(pending[("m", k)] == {"e", "f"} for k in keys[:4]) and pending[("m", keys[5])] == {"e"}
    coordinator.core._landed(("m", keys[-1]), "e")
    assert set(coordinator.core.planner_pending()) == {("m", k) for k in keys[:4]}
    coordinator.core._landed(("m", keys[3]), "f")
    assert coordinator.core.planner_pending() == {} and not coordinator.core._pending_chain
