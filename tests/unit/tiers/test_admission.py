"""``--tier-admit predicted`` (kvstore.tiers.admission): reuse rates learned per class, spent under a write
budget. Pure logic on an explicit clock."""

from __future__ import annotations

import pytest

from kvstore.tiers.admission import ReuseAdmission

PAGE = 100


def test_it_learns_which_class_comes_back_and_writes_that_one_when_the_budget_binds() -> None:
    """Pages read once come back, pages never read do not; with room for a third of the evictions, the
    writes go to the read-once class."""
    adm = ReuseAdmission(budget_bytes_s=PAGE / 3, page_bytes=PAGE, horizon_s=30.0)
    adm.tokens = 0.0
    written = {0: 0, 1: 0}
    for t in range(3000):
        reads = t % 2
        key = b"k%d" % t
        if adm.admit(key, reads, 1, float(t)):
            written[reads] += 1
        if reads and t >= 10:
            adm.seen([b"k%d" % (t - 10)], float(t))  # the read-once page evicted 10 s ago is asked for again
    assert adm.rate((1, 1)) > 0.9 and adm.rate((0, 1)) < 0.05
    late = adm.admitted
    assert written[1] > 5 * written[0]
    assert late <= 3000 / 3 + 30 / 3 + 1  # never past the budget (and the bucket it started with)


def test_with_budget_to_spare_it_writes_every_class() -> None:
    adm = ReuseAdmission(budget_bytes_s=10 * PAGE, page_bytes=PAGE, horizon_s=60.0)
    assert all(adm.admit(b"k%d" % t, 0, 1, t / 2) for t in range(200))
    assert adm.threshold == 0.0 and adm.declined == 0


def test_ghosts_past_the_horizon_count_as_not_reused() -> None:
    adm = ReuseAdmission(budget_bytes_s=PAGE, page_bytes=PAGE, horizon_s=10.0)
    adm.admit(b"a", 0, 1, 0.0)
    adm.seen([b"a"], 11.0)                      # too late: the ghost is gone
    assert adm.reused[(0, 1)] == 0 and adm.rate((0, 1)) == pytest.approx(1 / 3)
    adm.admit(b"b", 0, 1, 12.0)
    adm.seen([b"b", b"b"], 13.0)                # once per eviction
    assert adm.reused[(0, 1)] == 1
    with pytest.raises(ValueError):
        ReuseAdmission(budget_bytes_s=0.0, page_bytes=PAGE)


def test_without_learning_it_spends_the_budget_on_whatever_comes_first() -> None:
    """--tier-admit budget (the budget-capped LRU baseline): every page while the bucket pays, no class."""
    adm = ReuseAdmission(budget_bytes_s=PAGE / 3, page_bytes=PAGE, horizon_s=30.0, learn=False)
    adm.tokens = 0.0
    got = [adm.admit(b"k%d" % t, t % 2, 1, float(t)) for t in range(300)]
    assert sum(got) == pytest.approx(100, abs=2) and adm.threshold == 0.0 and not adm.evicted
    adm.seen([b"k1"], 300.0)
    assert not adm.reused
