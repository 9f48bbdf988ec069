"""In-flight prefill claims: the pure table (kvstore.cluster.claims), no sockets."""

from __future__ import annotations

from kvstore.cluster.claims import Claims, waiter_tree

NS = "ns"
CHAIN = [b"k%d" % i for i in range(6)]


def test_first_claimant_wins_and_followers_see_it_with_its_ready_time() -> None:
    c = Claims()
    assert c.claim(NS, CHAIN, "a", 2.0, now=10.0) is not None
    assert c.claim(NS, CHAIN, "b", 1.0, now=10.1) is None  # every key taken: b is a follower, not a claimant
    [seen] = c.seen(NS, CHAIN[:4] + [b"other"], now=10.5, asker="b")
    assert (seen.node, seen.length) == ("a", 4)
    assert abs(seen.ready_in - 1.5) < 1e-9


def test_claim_starts_after_what_the_cluster_holds_and_a_deeper_run_stacks() -> None:
    c = Claims()
    c.claim(NS, CHAIN[:3], "a", 1.0, now=0.0, start=1)   # k0 is held somewhere: a claims k1, k2
    c.claim(NS, CHAIN, "b", 3.0, now=0.0, start=1)       # b wins only k3..k5 (k1, k2 are a's)
    seen = c.seen(NS, CHAIN, now=0.5, held={"x": 1}, asker="y")
    assert [(s.node, s.length) for s in seen] == [("a", 3), ("b", 6)]
    assert c.seen(NS, CHAIN, now=0.5) == []  # without the held prefix the chain starts unclaimed (k0)


def test_put_resolves_and_returns_the_claim_with_its_waiters() -> None:
    c = Claims()
    c.claim(NS, CHAIN, "a", 1.0, now=0.0)
    c.seen(NS, CHAIN[:4], now=0.1, asker="b")
    c.seen(NS, CHAIN[:4], now=0.2, asker="c")
    c.seen(NS, CHAIN[:4], now=0.25, asker="c", record=False)  # c looks again: it waits; b computes
    c.seen(NS, CHAIN[:4], now=0.25, asker="d", record=False)  # a re-look never shown the claim: no waiter
    assert c.resolve("b", NS, CHAIN) == []               # only the claimant's report resolves it
    assert c.resolve("a", NS, CHAIN[:3]) == []           # partly stored: still in flight
    [done] = c.resolve("a", NS, CHAIN[3:])
    assert done.asked == {"b", "c"} and done.waiters == {"c"} and done.needed == 4
    assert len(c) == 0 and c.seen(NS, CHAIN, now=0.3) == []


def test_claims_expire_and_die_with_their_node() -> None:
    c = Claims(grace_s=0.5)
    c.claim(NS, CHAIN[:2], "a", 1.0, now=0.0)
    c.claim(NS, CHAIN[2:4], "b", 5.0, now=0.0)
    assert c.seen(NS, CHAIN[:2], now=1.6) == []          # past ready + grace: a follower stops waiting on it
    assert c.claim(NS, CHAIN[:2], "c", 1.0, now=1.6) is not None  # and the next claimant takes it over
    assert c.drop_node("b") == 2
    assert c.claim(NS, CHAIN[2:4], "d", 1.0, now=1.7) is not None


def test_table_is_bounded() -> None:
    c = Claims(max_keys=4)
    assert c.claim(NS, CHAIN[:3], "a", 1.0, now=0.0) is not None
    assert c.claim(NS, CHAIN[3:], "b", 1.0, now=0.0) is None
    assert c.refused == 1 and len(c) == 3


def test_copies_ahead_counts_tree_waves_not_waiters_under_a_tree() -> None:
    star, tree = Claims(), Claims(tree_fanout=2)
    for table in (star, tree):
        table.claim(NS, CHAIN, "a", 1.0, now=0.0)
        for w in "bcdefg":
            table.seen(NS, CHAIN, now=0.1, asker=w)
    [s] = star.seen(NS, CHAIN, now=0.2, asker="h")
    [t] = tree.seen(NS, CHAIN, now=0.2, asker="h")
    assert s.copies_ahead == 6         # six other waiters pull from a's egress
    assert t.copies_ahead == 3         # 7 targets, fanout 2: 2 waves of 2 copies sharing a sender: 4 copy times


def test_waiter_tree_copies_the_shared_part_from_the_claimant_out() -> None:
    c = Claims()
    claim = c.claim(NS, CHAIN, "a", 1.0, now=0.0)
    assert claim is not None
    assert waiter_tree(claim, lambda n: True, 2, 30.0, 100) is None  # nobody waited
    for w in ("b", "c", "d", "e", "f", "dead"):
        c.seen(NS, CHAIN[:4], now=0.1, asker=w)
    assert waiter_tree(claim, lambda n: True, 2, 30.0, 100) is None  # shown it, nobody looked again: they compute
    for w in ("b", "c", "d", "e", "f", "dead"):
        c.seen(NS, CHAIN[:4], now=0.2, asker=w, record=False)
    d = waiter_tree(claim, lambda n: n != "dead", 2, 30.0, 100)
    assert d is not None
    assert d.keys == tuple(CHAIN[:4]) and d.targets == ("b", "c", "d", "e", "f")
    assert d.tree[0][0] == "a" and {t for _, t in d.tree} == {"b", "c", "d", "e", "f"} and d.waves == 2
    assert d.bytes == 4 * 100 * 5
    # followers that computed it meanwhile hold it and get nothing; with three senders for the three
    # left, each pulls from its own: as fast as a tree, which is not started
    assert waiter_tree(claim, lambda n: n != "dead", 2, 30.0, 100, holders=["b", "c", "a"]) is None


def test_holders_of_the_prefix_send_in_the_waiter_tree_and_get_nothing() -> None:
    c = Claims()
    claim = c.claim(NS, CHAIN, "a", 1.0, now=0.0)
    assert claim is not None
    for w in ("b", "c", "d", "e", "f", "g", "h", "i", "j", "k"):
        c.seen(NS, CHAIN[:4], now=0.1, asker=w)
        c.seen(NS, CHAIN[:4], now=0.2, asker=w, record=False)
    alone = waiter_tree(claim, lambda n: True, 2, 30.0, 100)
    assert alone is not None and len(alone.targets) == 10 and alone.waves == 3
    # b computed it itself: 9 targets from two senders land in 2 waves (4 copy times, 5 as pulls)
    two = waiter_tree(claim, lambda n: True, 2, 30.0, 100, holders=["b"])
    assert two is not None and "b" not in two.targets and len(two.targets) == 9 and two.waves == 2
    assert {s for s, _ in two.tree[:4]} == {"a", "b"}


def test_a_tree_no_faster_than_its_targets_pulling_at_once_is_not_started() -> None:
    """Three waiters, fanout 2: the tree's two waves take as long as three pulls sharing the claimant's
    egress, and add the coordinator's round trips: they pull. Relayed in parts, the tree is faster."""
    c = Claims()
    claim = c.claim(NS, CHAIN, "a", 1.0, now=0.0)
    assert claim is not None
    c.seen(NS, CHAIN[:4], now=0.1, asker="b")
    c.seen(NS, CHAIN[:4], now=0.2, asker="b", record=False)
    assert waiter_tree(claim, lambda n: True, 2, 30.0, 100) is None    # one waiter: one copy, or one pull
    for w in ("c", "d"):
        c.seen(NS, CHAIN[:4], now=0.1, asker=w)
        c.seen(NS, CHAIN[:4], now=0.2, asker=w, record=False)
    assert waiter_tree(claim, lambda n: True, 2, 30.0, 100) is None
    relayed = waiter_tree(claim, lambda n: True, 2, 30.0, 100, parts=4)
    assert relayed is not None and relayed.targets == ("b", "c", "d") and relayed.parts == 4


def test_a_wide_burst_spreads_the_tree_to_every_live_node_after_the_waiters() -> None:
    c = Claims()
    claim = c.claim(NS, CHAIN, "a", 1.0, now=0.0)
    assert claim is not None
    nodes = ["a", "b", "c", "d", "e", "f", "g", "h"]
    for w in ("c", "e"):
        c.seen(NS, CHAIN, now=0.1, asker=w)
        c.seen(NS, CHAIN, now=0.2, asker=w, record=False)
    wide = waiter_tree(claim, lambda n: n != "d", 2, 30.0, 1, others=nodes)
    assert wide is not None and wide.targets == ("c", "e", "b", "f", "g", "h")  # waiters first, then the live rest
    # the spread pays only where a copy of the shared prefix lands before a prefill of it would end
    # (the claimant said 1 s): CHAIN's pages of 1 byte at 1 B/s take len(CHAIN) s; two waiters alone
    # then pull
    claim.needed = len(CHAIN)
    assert waiter_tree(claim, lambda n: True, 2, 30.0, 1, others=nodes, bytes_per_s=1.0) is None
    fast = waiter_tree(claim, lambda n: True, 2, 30.0, 1, others=nodes, bytes_per_s=10.0 * len(CHAIN))
    assert fast is not None and fast.targets == ("c", "e", "b", "d", "f", "g", "h")


def test_pulls_count_until_the_puller_holds_the_prefix_or_the_horizon() -> None:
    from kvstore.cluster.claims import Pulls

    pulls = Pulls(horizon_s=10.0, max_prefixes=2)
    for node in ("b", "c", "d"):
        pulls.note("ns", b"k8", node, 0.0)
    assert pulls.ahead("ns", b"k8", 1.0) == 3 and pulls.ahead("ns", b"k8", 1.0, asker="b") == 2
    assert pulls.ahead("ns", b"k8", 1.0, holding=lambda node: node == "c") == 2  # c's landed: gone for good
    assert pulls.ahead("ns", b"k8", 1.0) == 2
    assert pulls.ahead("ns", b"k8", 10.5) == 0 and len(pulls) == 0                # past the horizon
    pulls.note("ns", b"x", "b", 0.0)
    pulls.note("ns", b"y", "b", 0.0)
    pulls.note("ns", b"z", "b", 0.0)                                              # full, nothing expired
    assert pulls.ahead("ns", b"z", 1.0) == 0 and len(pulls) == 2
    pulls.note("ns", b"z", "b", 20.0)                                             # the others expired
    assert pulls.ahead("ns", b"z", 21.0) == 1


def test_the_answer_spreads_the_pulls_in_flight_over_the_prefix_holders() -> None:
    from kvstore.cluster import answer
    from kvstore.cluster.claims import Pulls
    from kvstore.v1 import kvstore_pb2 as pb

    keys = [bytes([i]) for i in range(8)]
    pulls = Pulls()

    sending = {"z": 2}  # the coordinator's copies leaving z now (a copy tree's)

    def ask(asker: str, local: int, holders: dict[str, int], record: bool = True) -> dict[str, int]:
        out = [pb.NodePrefix(node_id=n, prefix_length=length) for n, length in holders.items()]
        answer.pulls_ahead(out, pulls, "ns", keys, asker, local, 0.0, holders, record,
                           lambda node: sending.get(node, 0))
        return {n.node_id: n.copies_ahead for n in out}

    assert ask("b", 0, {"a": 8}) == {"a": 0}                  # the first puller shares with nobody
    assert ask("c", 0, {"a": 8}) == {"a": 1}
    assert ask("d", 0, {"a": 8}, record=False) == {"a": 2}    # a router's look: announces no pull
    assert ask("d", 0, {"a": 8}) == {"a": 2}
    assert ask("e", 0, {"a": 8, "f": 8, "g": 4}) == {"a": 2, "f": 2, "g": 0}  # 3 pulls over 2 holders
    assert ask("h", 0, {"a": 8, "b": 8}) == {"a": 2, "b": 2}  # b's pull landed: c, d, e left
    assert ask("a", 0, {"a": 8}) == {"a": 0}                  # a holder asking pulls nothing
    assert ask("i", 8, {"a": 8}) == {"a": 0}                  # nor does a node that holds it
    # a holder sending a copy tree's copies shares its egress with them as with pulls
    assert ask("j", 0, {"a": 8, "b": 8, "z": 8}, record=False) == {"a": 2, "b": 2, "z": 4}  # c, d, e, h: 4 over 3
