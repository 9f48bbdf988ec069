"""Per-node, per-direction copy rates (kvstore.placement.links): pure bookkeeping, no sockets."""

from __future__ import annotations

import pytest

from kvstore.placement.links import LinkRates

GB = 1e9


def test_an_unmeasured_node_has_the_seed_rate() -> None:
    links = LinkRates(2 * GB)
    assert links.egress_bps("a") == links.ingress_bps("b") == 2 * GB
    assert links.copy_s("a", "b", int(1 * GB)) == pytest.approx(0.5)
    assert links.typical() == 2 * GB and links.stats() == {}


def test_a_copy_alone_measures_both_ends() -> None:
    links = LinkRates(10 * GB, alpha=1.0)
    c = links.start("a", "b")
    links.end("a", "b", int(1 * GB), 1.0, c)
    assert links.egress_bps("a") == links.ingress_bps("b") == pytest.approx(1 * GB)
    assert links.egress_bps("b") == 10 * GB  # the other direction was not measured
    assert links.stats()["a"] == {"egress_bps": pytest.approx(1 * GB), "ingress_bps": 10 * GB}


def test_copies_sharing_a_source_measure_its_egress_not_the_targets_ingress() -> None:
    """Four copies out of one holder at once each see a quarter of its egress: the holder's egress is
    4 x the copy rate, and the targets' ingress (not the bottleneck) is not lowered to it."""
    links = LinkRates(10 * GB, alpha=1.0)
    started = [(t, links.start("h", t)) for t in "wxyz"]
    assert links.rate("h", "v") == pytest.approx(10 * GB / 5)  # a fifth copy would share with four
    for t, c in started:
        links.end("h", t, int(0.25 * GB), 1.0, c)
    assert links.egress_bps("h") == pytest.approx(1 * GB)  # the last sample: 0.25 GB/s x 4 copies
    assert all(links.ingress_bps(t) == 10 * GB for t in "wxyz")
    assert not links.sending and not links.receiving


def test_a_copy_shares_both_ends_and_the_slower_end_decides() -> None:
    links = LinkRates(10 * GB)
    links.ingress["slow"] = 1 * GB
    links.start("a", "x")
    assert links.rate("a", "slow") == pytest.approx(1 * GB)        # its ingress, idle
    assert links.rate("a", "fast") == pytest.approx(10 * GB / 2)   # a's egress, shared with the copy to x


def test_a_failed_copy_teaches_nothing_and_frees_its_slot() -> None:
    links = LinkRates(10 * GB)
    c = links.start("a", "b")
    links.end("a", "b", 0, 0.5, c)
    assert links.egress == {} and links.ingress == {} and not links.sending


def test_samples_average() -> None:
    links = LinkRates(10 * GB, alpha=0.5)
    for _ in range(2):
        c = links.start("a", "b")
        links.end("a", "b", int(2 * GB), 1.0, c)
    assert links.egress_bps("a") == pytest.approx(0.25 * 10 * GB + 0.75 * 2 * GB)
    assert links.typical() == pytest.approx(links.egress_bps("a"))


@pytest.mark.parametrize(("seed", "alpha"), [(0.0, 0.3), (-1.0, 0.3), (1e9, 0.0), (1e9, 1.5)])
def test_bad_settings_are_refused(seed: float, alpha: float) -> None:
    with pytest.raises(ValueError):
        LinkRates(seed, alpha)
