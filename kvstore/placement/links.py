"""Copy rates per node and direction, measured from the copies themselves.

Pure bookkeeping (no clock, no I/O): the coordinator tells it when a copy
starts and when it ends with the bytes it moved, and asks how long a copy
from one node to another would take now. One number for the whole cluster
would be wrong twice over: nodes differ (a node behind a slower NIC, a
node whose link carries the engines' own traffic), and a node's egress is
shared by every copy it sends at once -- seven pulls from one holder each
get a seventh of its link. So the estimate is kept per node and per
direction, with the copies in flight on each as its contention:

* a copy from ``src`` to ``dst`` that had ``n_out`` copies leaving ``src``
  and ``n_in`` arriving at ``dst`` (itself included; the more of when it
  started and when it ended) and moved at
  ``r`` bytes/s saw a share of the more contended side: ``r * n_out`` is a
  sample of ``src``'s egress when ``n_out >= n_in``, ``r * n_in`` one of
  ``dst``'s ingress when ``n_in >= n_out`` (both when equal: one copy alone
  on its link measures both ends). Samples average as an EWMA; a node never
  measured has the seed rate (``--spec-bandwidth``).
* a copy about to start gets ``min(egress(src) / (out(src) + 1),
  ingress(dst) / (in(dst) + 1))``: its fair share at both ends.
"""

from __future__ import annotations

import statistics
from collections import Counter
from typing import NamedTuple


class Contention(NamedTuple):
    """Copies on a copy's two ends when it started, itself included."""

    out: int
    into: int


class LinkRates:
    """Per-node egress and ingress copy rates (bytes/s) and the copies in flight on each."""

    __slots__ = ("seed_bps", "alpha", "egress", "ingress", "sending", "receiving")

    def __init__(self, seed_bps: float, alpha: float = 0.3) -> None:
        if seed_bps <= 0:
            raise ValueError(f"seed rate must be > 0, got {seed_bps}")
        if not 0 < alpha <= 1:
            raise ValueError(f"alpha must be in (0, 1], got {alpha}")
        self.seed_bps = float(seed_bps)
        self.alpha = alpha
        self.egress: dict[str, float] = {}
        self.ingress: dict[str, float] = {}
        self.sending: Counter[str] = Counter()
        self.receiving: Counter[str] = Counter()

    # ---- copies --------------------------------------------------------------
    def start(self, src: str, dst: str) -> Contention:
        """A copy from ``src`` to ``dst`` starts; returns its contention, for :meth:`end`."""
        self.sending[src] += 1
        self.receiving[dst] += 1
        return Contention(self.sending[src], self.receiving[dst])

    def end(self, src: str, dst: str, moved: int, took: float, contention: Contention) -> None:
        """The copy :meth:`start` returned ``contention`` for ended, having moved ``moved`` bytes in
        ``took`` seconds (0 bytes: it failed or found everything there, and teaches nothing)."""
        out, into = max(contention.out, self.sending[src]), max(contention.into, self.receiving[dst])
        for counter, node in ((self.sending, src), (self.receiving, dst)):
            counter[node] -= 1
            if counter[node] <= 0:
                del counter[node]
        if moved <= 0 or took <= 0:
            return
        rate = moved / took
        if out >= into:
            self._sample(self.egress, src, rate * out)
        if into >= out:
            self._sample(self.ingress, dst, rate * into)

    def _sample(self, rates: dict[str, float], node: str, bps: float) -> None:
        old = rates.get(node, self.seed_bps)
        rates[node] = (1 - self.alpha) * old + self.alpha * bps

    # ---- estimates -------------------------------------------------------------
    def egress_bps(self, node: str) -> float:
        """``node``'s whole egress for copies (its seed rate until measured)."""
        return self.egress.get(node, self.seed_bps)

    def ingress_bps(self, node: str) -> float:
        """``node``'s whole ingress for copies (its seed rate until measured)."""
        return self.ingress.get(node, self.seed_bps)

    def rate(self, src: str, dst: str, at_once: int = 1) -> float:
        """The rate a copy from ``src`` to ``dst`` starting now would get, one of ``at_once`` copies
        leaving ``src`` together: its share of both ends."""
        return min(self.egress_bps(src) / (self.sending[src] + at_once),
                   self.ingress_bps(dst) / (self.receiving[dst] + 1))

    def copy_s(self, src: str, dst: str, nbytes: int, at_once: int = 1) -> float:
        """Seconds a copy of ``nbytes`` from ``src`` to ``dst`` starting now would take (one of
        ``at_once`` leaving ``src`` together)."""
        return nbytes / self.rate(src, dst, at_once)

    def typical(self) -> float:
        """One number for what needs one (the relay's part count, the claims' copy-time estimate, the
        planner's default for a node it was not told about): the median measured rate of a single copy
        on an idle link, the seed rate while nothing was measured."""
        measured = [*self.egress.values(), *self.ingress.values()]
        return statistics.median(measured) if measured else self.seed_bps

    def stats(self) -> dict[str, dict[str, float]]:
        """``{node: {"egress_bps", "ingress_bps"}}`` of every node measured."""
        nodes = sorted(set(self.egress) | set(self.ingress))
        return {n: {"egress_bps": self.egress_bps(n), "ingress_bps": self.ingress_bps(n)} for n in nodes}


__all__ = ["Contention", "LinkRates"]
