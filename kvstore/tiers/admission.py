"""Which evicted pages are worth a disk write: reuse rates learned per page class, spent under a write budget.

``--tier-admit predicted`` (the replay's ``tiers-predictive``). Writing every page the pool evicts
(``all``) wears a drive at the pool's eviction rate, whatever comes back; writing only pages read since
they were stored (``reused``) spares the drive but drops every first turn of a conversation, which its
next turn would have read. This admission learns, on the node, how often an evicted page of each class
is asked for again within ``horizon_s``, and writes the classes most likely to be reused first, as many
as the drive's write budget (bytes per second: its rated drive writes per day) allows:

* **classes**: a page's client reads since it was stored (0, 1, 2 or more) and its kind (primary,
  replica: a page another node pulled);
* **outcomes**: every evicted page (written or not) leaves a *ghost* (its class and eviction time) for
  ``horizon_s``; a Lookup that names a ghost's key within that time counts a reuse of its class. The
  reuse rate of a class is ``(reused + 1) / (evicted + 2)`` over the outcomes seen;
* **budget**: a token bucket at ``budget_bytes_s`` holding at most ``horizon_s`` of it. A page is
  written when its class's rate is at or above the threshold and the bucket holds its bytes; the
  threshold rises (by ``step``) each time the bucket cannot pay, and falls at each eviction that finds
  the bucket more than half full, so the classes written are the most reused ones the budget pays for.

Pure logic over an explicit clock: the daemon (``kvstore.tiers.stack``) and the replay's simulator
(``kvstore.replay.sim_cluster``) both build their admission with :func:`admission_for`, for every
``--tier-admit`` mode but ``all``.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Iterable
from typing import Protocol

Class = tuple[int, int]  # (reads since stored, capped at 2; kind)
DAY_S = 86400.0


class Admission(Protocol):
    """Which evicted pages go down into the first tier."""

    def admit(self, key: bytes, reads: int, kind: int, now: float) -> bool: ...

    def seen(self, keys: Iterable[bytes], now: float) -> None: ...


class ReadSinceStored:
    """``--tier-admit reused``: a page goes down only if a client read it since it was stored (seen at
    least twice)."""

    def admit(self, key: bytes, reads: int, kind: int, now: float) -> bool:
        return reads > 0

    def seen(self, keys: Iterable[bytes], now: float) -> None:
        pass


def admission_for(mode: str, *, budget_bytes_s: float, tier_bytes: float, page_bytes: int,
                  horizon_s: float) -> Admission | None:
    """The admission of ``--tier-admit mode`` into a first tier of ``tier_bytes`` (None for ``all``: every
    page goes down). ``budget_bytes_s`` 0: one drive write a day of the tier."""
    if mode == "all":
        return None
    if mode == "reused":
        return ReadSinceStored()
    budget = budget_bytes_s or tier_bytes / DAY_S
    return ReuseAdmission(max(1e-9, budget), page_bytes, horizon_s, learn=mode == "predicted")


class ReuseAdmission:
    """The admission of one namespace's pages into its first tier (module doc)."""

    def __init__(self, budget_bytes_s: float, page_bytes: int, horizon_s: float = 600.0, step: float = 0.01,
                 max_ghosts: int = 1 << 20, learn: bool = True) -> None:
        if budget_bytes_s <= 0 or page_bytes <= 0 or horizon_s <= 0:
            raise ValueError("the write budget, the page size and the horizon must be > 0")
        self.budget, self.page_bytes, self.horizon_s, self.step = budget_bytes_s, page_bytes, horizon_s, step
        self.capacity = budget_bytes_s * horizon_s
        self.tokens = self.capacity
        self.threshold = 0.0
        self.max_ghosts = max_ghosts
        self.ghosts: OrderedDict[bytes, tuple[float, Class]] = OrderedDict()  # oldest first
        self.evicted: Counter[Class] = Counter()
        self.reused: Counter[Class] = Counter()
        self.admitted = self.declined = 0
        self.learn = learn  # False: the budget alone (every page while the bucket pays: ``--tier-admit budget``)
        self._t = 0.0

    @staticmethod
    def classify(reads: int, kind: int) -> Class:
        return (min(2, max(0, reads)), int(kind))

    def rate(self, cls: Class) -> float:
        """The chance a page of ``cls`` is asked for again within the horizon after its eviction."""
        return (self.reused[cls] + 1) / (self.evicted[cls] + 2)

    def _advance(self, now: float) -> None:
        if now > self._t:
            self.tokens = min(self.capacity, self.tokens + (now - self._t) * self.budget)
            self._t = now
        while self.ghosts:  # outcomes past the horizon: not reused
            key, (t, _) = next(iter(self.ghosts.items()))
            if now - t <= self.horizon_s and len(self.ghosts) <= self.max_ghosts:
                break
            self.ghosts.popitem(last=False)

    def seen(self, keys: Iterable[bytes], now: float) -> None:
        """A Lookup named ``keys``: each one evicted within the horizon is a reuse of its class."""
        self._advance(now)
        if not self.ghosts or not self.learn:
            return
        for key in keys:
            ghost = self.ghosts.pop(key, None)
            if ghost is not None:
                self.reused[ghost[1]] += 1

    def admit(self, key: bytes, reads: int, kind: int, now: float) -> bool:
        """The pool evicts ``key`` (read ``reads`` times since stored, of ``kind``): write it down?"""
        self._advance(now)
        if not self.learn:
            if self.tokens < self.page_bytes:
                self.declined += 1
                return False
            self.tokens -= self.page_bytes
            self.admitted += 1
            return True
        cls = self.classify(reads, kind)
        self.evicted[cls] += 1
        self.ghosts[key] = (now, cls)
        self.ghosts.move_to_end(key)
        if self.tokens > self.capacity / 2:  # the budget goes unspent: less likely classes may be written too
            self.threshold = max(0.0, self.threshold - self.step)
        if self.rate(cls) < self.threshold:
            self.declined += 1
            return False
        if self.tokens < self.page_bytes:  # it cannot pay: keep the writes for more likely classes
            self.threshold = min(1.0, self.threshold + self.step)
            self.declined += 1
            return False
        self.tokens -= self.page_bytes
        self.admitted += 1
        return True
