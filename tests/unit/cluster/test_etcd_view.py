"""Membership on etcd as pure logic (``kvstore.cluster.membership.etcd_view``):
the etcd URL, lease TTLs and member keys, the view, the election and the
heartbeat round on etcd, with an injected clock; no etcd, no sockets. A real
etcd: tests/integration/test_etcd_membership.py."""

from __future__ import annotations

import pytest

from kvstore.cluster.membership import Membership, make_membership, plan_round
from kvstore.cluster.membership.etcd_view import EtcdView, decode_member, encode_member, lease_ttl, parse_etcd_url
from kvstore.config import NodeConfig
from kvstore.v1 import kvstore_pb2 as pb


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def info(node_id: str, incarnation: str = "1") -> pb.MemberInfo:
    return pb.MemberInfo(node_id=node_id, address=f"127.0.0.1:{1000 + ord(node_id[0])}", incarnation=incarnation)


def etcd_view(self_id: str, *others: str, holder: str = "") -> tuple[EtcdView, Clock]:
    clock = Clock()
    view = EtcdView(info(self_id), clock=clock)
    view.lease_held_until(clock.t + 2)
    view.reset([info(n) for n in others], holder)
    return view, clock


def test_url_ttl_and_member_encoding() -> None:
    target = parse_etcd_url("etcds://10.0.0.1:2379,[::1]:2380/fleet/a")
    assert target.endpoints == (("10.0.0.1", 2379), ("::1", 2380)) and target.tls
    assert target.member_key("n1") == b"/fleet/a/members/n1" and target.coordinator_key == b"/fleet/a/coordinator"
    assert parse_etcd_url("etcd://h:1").prefix == "/kvstore" and not parse_etcd_url("etcd://h:1").tls
    for bad in ("etcd://h", "http://h:1", "etcd://:1"):
        with pytest.raises(ValueError):
            parse_etcd_url(bad)
    assert (lease_ttl(0.8), lease_ttl(3.0), lease_ttl(3.2)) == (1, 3, 4)
    me = info("a")
    me.role, me.used_bytes = "coordinator", 5
    back = decode_member(b"/p/a", encode_member(me), b"/p/")
    assert back is not None and back.address == me.address and not back.role and not back.used_bytes
    assert decode_member(b"/p/b", encode_member(me), b"/p/") is None  # names another node than its key
    assert decode_member(b"/p/a", b"\xff\xff garbage", b"/p/") is None


def test_gossip_stays_the_default() -> None:
    assert isinstance(make_membership(NodeConfig(), info("a")), Membership)


def test_view_follows_member_keys_and_departures_are_reported_once() -> None:
    view, _ = etcd_view("b", "a", "c")
    assert view.live_ids() == ["a", "b", "c"] and view.alive("c") and view.member("a") is not None
    assert view.member_gone("c") and not view.alive("c") and view.member("c") is None
    assert view.member_put(info("a", incarnation="2"))  # a restarted: its old self departs
    assert [(m.node_id, m.incarnation) for m in view.expire()] == [("c", "1"), ("a", "1")]
    assert view.expire() == []
    assert not view.member_put(info("a", incarnation="2"))  # the same again: no change
    assert not view.member_put(info("b", incarnation="9"))  # its own key is not a member
    assert view.reset([info("d")], "") and view.live_ids() == ["b", "d"]
    assert [m.node_id for m in view.expire()] == ["a"]


def test_heartbeats_refresh_load_but_never_liveness_or_addresses() -> None:
    view, _ = etcd_view("a", "b")
    forged = info("b")
    forged.used_bytes, forged.address = 123, "10.6.6.6:1"
    assert view.heard(forged) is None and view.observe(info("z")) is None
    member = view.member("b")
    assert member is not None and member.used_bytes == 123 and member.address == info("b").address
    assert not view.alive("z") and view.live_ids() == ["a", "b"]
    stale = info("b", incarnation="0")
    stale.used_bytes = 7
    view.heard(stale)
    assert view.member("b").used_bytes == 123  # type: ignore[union-attr]


def test_coordinator_is_the_live_key_holder_and_the_standby_the_lowest_other() -> None:
    view, clock = etcd_view("b", "a", "c", holder="c")
    assert view.coordinator() == "c" and view.standby() == "a" and not view.is_coordinator
    assert not view.keeps_directory  # b neither coordinates nor stands by
    roles = {m.node_id: m.role for m in view.view()}
    assert roles == {"a": "member", "b": "member", "c": "coordinator"} and view.view()[0].node_id == "b"
    view.holder_set("z")  # a holder not (yet) listed as a member coordinates nowhere
    assert view.coordinator() == "" and view.standby() == "a"
    view.holder_set("b")
    assert view.is_coordinator and view.standby() == "a" and view.keeps_directory
    clock.t += 2.5  # b's lease may have expired (etcd unreachable): it steps down, keeping its view
    assert view.coordinator() == "" and not view.is_coordinator and view.live_ids() == ["a", "b", "c"]


def test_the_standby_campaigns_first_and_nobody_while_the_key_is_held() -> None:
    # c coordinated and died: a (the standby) tries at once, b a step later
    delays = {}
    for me in "ab":
        view, _ = etcd_view(me, *({"a", "b"} - {me}), holder="")
        delays[me] = view.campaign_delay(0.1)
    assert delays == {"a": 0.0, "b": 0.1}
    held, _ = etcd_view("a", "b", holder="b")
    assert held.campaign_delay(0.1) is None
    cut_off, clock = etcd_view("a", "b")
    clock.t += 3  # its lease is in doubt: it must not take the role
    assert cut_off.campaign_delay(0.1) is None


def test_plan_round_on_etcd_calls_only_the_coordinator_and_the_standby() -> None:
    view, _ = etcd_view("d", "a", "b", "c", holder="b")
    plan = plan_round(view, info("d").address, {"10.0.0.9:1"}, {"10.0.0.8:1": 99.0}, "", 100.0, horizon=20)
    assert plan.coordinator == "b" and plan.standby == "a" and not plan.report_locally
    assert plan.report_to == info("b").address and plan.standby_to == info("a").address
    assert plan.targets == tuple(sorted([info("a").address, info("b").address])) and plan.learned == {}
    mine = plan_round(etcd_view("b", "a", holder="b")[0], info("b").address, set(), {}, "b", 100.0, horizon=20)
    assert mine.report_locally and mine.targets == (info("a").address,)
