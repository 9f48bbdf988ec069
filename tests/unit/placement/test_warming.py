"""A node that joins a running cluster, warmed from the forecast (pure): who joins, what it gets, when it
serves."""

from __future__ import annotations

from kvstore.placement.warming import Warming, warm_copies


def test_the_first_members_are_the_cluster_a_later_one_joins_and_serves_once_its_copies_ended() -> None:
    w = Warming(30.0)
    assert w.see(["a", "b"], 0.0) == [] and w.joining(0.0) == []
    assert w.see(["a", "b", "c"], 1.0) == ["c"] and w.joining(1.0) == ["c"]  # not planned yet: left out
    w.planned("c", 2)
    assert w.see(["a", "b", "c"], 2.0) == [] and w.joining(2.0) == ["c"]
    w.ended("c")
    assert w.joining(3.0) == ["c"]
    w.ended("c")
    assert w.joining(3.0) == [] and w.joined == 1


def test_the_members_seen_while_the_coordinator_settles_are_the_cluster_as_it_started() -> None:
    w = Warming(30.0, settle_s=2.0)
    assert w.see(["a"], 10.0) == [] and w.see(["a", "b"], 11.0) == [] and w.see(["a", "b", "c"], 12.0) == []
    assert w.see(["a", "b", "c", "d"], 12.5) == ["d"] and w.joining(12.5) == ["d"]


def test_a_joiner_with_nothing_to_get_serves_at_once_and_the_bound_ends_a_slow_warm() -> None:
    w = Warming(30.0)
    w.see(["a"], 0.0)
    w.see(["a", "b", "c"], 10.0)
    w.planned("b", 0)
    w.planned("c", 5)
    assert w.joining(10.0) == ["c"]
    assert w.joining(39.9) == ["c"] and w.joining(40.0) == []


def test_no_warming_with_a_zero_bound_and_a_node_that_left_and_came_back_joins_again() -> None:
    cold = Warming(0.0)
    cold.see(["a"], 0.0)
    assert cold.see(["a", "b"], 1.0) == [] and cold.joining(1.0) == []
    w = Warming(30.0)
    w.see(["a", "b"], 0.0)
    assert w.see(["a"], 1.0) == []  # b left
    assert w.see(["a", "b"], 2.0) == ["b"]  # and came back: a replaced node
    assert w.see(["a"], 3.0) == [] and w.joining(3.0) == []  # gone again before it was warm


def test_warm_copies_take_the_hottest_chains_at_their_deepest_held_depth_within_the_room() -> None:
    chain = lambda name, n: tuple(f"{name}/{i}".encode() for i in range(n))  # noqa: E731
    rows = [(("ns", chain("p", 2)[-1]), chain("p", 2), 10), (("ns", chain("p", 4)[-1]), chain("p", 4), 10),
            (("ns", chain("q", 3)[-1]), chain("q", 3), 10), (("ns", chain("r", 1)[-1]), chain("r", 1), 10),
            (("ns", chain("s", 2)[-1]), chain("s", 2), 10)]
    expected = {rows[0][0]: 9.0, rows[1][0]: 3.0, rows[2][0]: 20.0, rows[3][0]: 5.0, rows[4][0]: 1.0}
    held = {"p": {"a": 3, "b": 1}, "q": {"a": 3, "b": 3}, "r": {}, "s": {"j2": 2}}
    copies = warm_copies(rows, expected, lambda ns, c: held[c[0].decode()[0]], ["j1", "j2"], {"j1": 100, "j2": 30})
    # q (20 expected) first, then p (9, its longest chain at the deepest depth a node holds: 3); r is held
    # nowhere; s only by a joiner; j2's room takes q only; the holders of q take turns
    assert copies == [("ns", chain("q", 3), "a", "j1"), ("ns", chain("q", 3), "b", "j2"),
                      ("ns", chain("p", 4)[:3], "a", "j1")]
