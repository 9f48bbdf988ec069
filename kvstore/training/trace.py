"""A cluster simulator that turns request traces into :class:`Access` streams.

Offline the predictor needs what the coordinator sees online: which node
served each request and which nodes held each prefix. :class:`Simulator`
routes a trace over ``nodes`` nodes and keeps a holders model: a node holds a
block once it served a request containing it, in a per-node LRU of
``capacity_blocks`` blocks. The traces themselves come from
:mod:`kvstore.workloads.traces`.
"""

from __future__ import annotations

import math
import random
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence

from kvstore.predict.types import Access, Outcome
from kvstore.workloads.traces import BLOCK_TOKENS, PAGE_BYTES, Request, hash_key, key_hash

ROUTERS = ("round_robin", "random", "least_load", "cache_aware")


class Simulator:
    """Routes requests over nodes and models which node holds which block.

    Each node has an LRU of block ids (``capacity_blocks``). A request touches
    its blocks deepest-first, so a block is never older than its descendants
    and LRU evicts the deep end of a chain first: a node holds a prefix iff it
    holds its last block. ``holders_count`` is what the coordinator's
    directory answers; ``step`` returns the :class:`Access` the coordinator
    would see, with ``outcome`` and ``local_blocks`` as measured before serving.
    """

    def __init__(self, nodes: int = 4, router: str | Callable[["Simulator", Request], int] = "cache_aware",
                 capacity_blocks: int = 16384, depths: Sequence[int] = (1, 2, 4, 8), namespace: str = "mooncake",
                 block_tokens: int = BLOCK_TOKENS, page_bytes: int = PAGE_BYTES, load_tau_s: float = 30.0,
                 balance: float = 1.5, seed: int = 0) -> None:
        if isinstance(router, str) and router not in ROUTERS:
            raise ValueError(f"unknown router {router!r}; choose from {', '.join(ROUTERS)}")
        self.nodes = [f"n{i}" for i in range(nodes)]
        self.router = router
        self.capacity = int(capacity_blocks)
        self.max_depth = max(depths)
        self.namespace = namespace
        self.block_tokens = block_tokens
        self.page_bytes = page_bytes
        self.load_tau_s = load_tau_s
        self.balance = balance
        self._lru: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(nodes)]
        self._holders: dict[int, int] = {}
        self._load = [0.0] * nodes
        self._load_t = 0.0
        self._rr = 0
        self._rng = random.Random(seed)

    # -- holders model -------------------------------------------------------
    def holders_count(self, namespace: str, key: bytes) -> int:
        """How many nodes hold the prefix named by ``key`` (the directory's answer)."""
        if namespace != self.namespace:
            return 0
        return self._holders.get(key_hash(key), 0)

    def local_blocks(self, node: int, hash_ids: Sequence[int]) -> int:
        """Leading blocks of ``hash_ids`` held by ``node`` (a chain is held from the start)."""
        lru = self._lru[node]
        lo, hi = 0, len(hash_ids)  # invariant: the first lo are held; blocks >= hi are not
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if hash_ids[mid - 1] in lru:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def _touch(self, node: int, hash_ids: Sequence[int]) -> None:
        lru, holders = self._lru[node], self._holders
        for h in reversed(hash_ids):
            if h in lru:
                lru.move_to_end(h)
            else:
                lru[h] = None
                holders[h] = holders.get(h, 0) + 1
        while len(lru) > self.capacity:
            h, _ = lru.popitem(last=False)
            c = holders[h] - 1
            if c:
                holders[h] = c
            else:
                del holders[h]

    # -- routing -------------------------------------------------------------
    def _decay_load(self, t: float) -> None:
        if t > self._load_t:
            f = math.exp(-(t - self._load_t) / self.load_tau_s)
            self._load = [x * f for x in self._load]
            self._load_t = t

    def _least_load(self) -> int:
        m = min(self._load)
        n = len(self._load)
        for k in range(n):  # round-robin among the least loaded, so ties spread
            i = (self._rr + k) % n
            if self._load[i] <= m + 1e-9:
                self._rr = i + 1
                return i
        return 0

    def route(self, req: Request) -> int:
        """Pick the serving node for ``req``."""
        r = self.router
        if callable(r):
            return int(r(self, req))
        if r == "round_robin":
            i = self._rr % len(self.nodes)
            self._rr = i + 1
            return i
        if r == "random":
            return self._rng.randrange(len(self.nodes))
        if r == "least_load":
            return self._least_load()
        # cache_aware (SGLang-style): the node holding the longest prefix, unless
        # its load exceeds `balance` x the least load (+2 requests): then least loaded.
        lo = min(self._load)
        lens = [self.local_blocks(i, req.hash_ids) for i in range(len(self.nodes))]
        best, best_len = -1, min(lens)
        for i, n in enumerate(lens):
            if n > best_len and self._load[i] <= self.balance * lo + 2.0:
                best, best_len = i, n
        return best if best >= 0 else self._least_load()

    def step(self, req: Request) -> Access:
        """Route and serve one request; return the coordinator's view of it."""
        self._decay_load(req.t)
        node = self.route(req)
        ids = req.hash_ids
        local = self.local_blocks(node, ids)
        n = min(len(ids), self.max_depth)
        if n == 0:
            outcome = Outcome.MISS
        elif local >= n:
            outcome = Outcome.LOCAL
        elif self._holders.get(ids[n - 1], 0) > 0:
            outcome = Outcome.REMOTE
        else:
            outcome = Outcome.MISS
        self._touch(node, ids)
        self._load[node] += 1.0
        return Access(t=req.t, namespace=self.namespace, node=self.nodes[node],
                      keys=tuple(hash_key(h) for h in ids[:n]), outcome=outcome,
                      block_tokens=self.block_tokens, page_bytes=self.page_bytes,
                      total_blocks=len(ids), local_blocks=local)


def simulate(requests: Iterable[Request], nodes: int = 4, router: str = "cache_aware",
             capacity_blocks: int = 16384, depths: Sequence[int] = (1, 2, 4, 8), **kw: object) -> list[Access]:
    """Replay ``requests`` through a :class:`Simulator`; return the access stream."""
    sim = Simulator(nodes=nodes, router=router, capacity_blocks=capacity_blocks, depths=depths, **kw)  # type: ignore[arg-type]
    return [sim.step(r) for r in requests]
