"""Request traces and a cluster simulator that turns them into :class:`Access` streams.

Offline the predictor needs what the coordinator sees online: which node
served each request and which nodes held each prefix. :class:`Simulator`
routes a trace over ``nodes`` nodes and keeps a holders model: a node holds a
block once it served a request containing it, in a per-node LRU of
``capacity_blocks`` blocks.

Keys: a Mooncake ``hash_id`` (which names the whole prefix up to its block)
becomes the 8-byte little-endian encoding of the integer, ``hash_key(h)``;
all requests live in one namespace (``"mooncake"`` by default).

Loaders: :func:`load_mooncake` (jsonl), :func:`load_azure` (arrival times
only; prompts synthesised from a Zipf pool) and :func:`synth_fanout`
(agent fan-out bursts with decoys and background). All return
:class:`Request` lists sorted by time, so benchmarks can replay any of them.
"""

from __future__ import annotations

import bisect
import json
import math
import random
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from kvstore.predict.types import Access, Outcome

BLOCK_TOKENS = 512
# KV bytes of one 512-token block of a Llama-3-8B-like model (32 layers,
# 8 KV heads, head_dim 128, fp16, K and V): 512 * 2 * 32 * 8 * 128 * 2.
PAGE_BYTES = 512 * 2 * 32 * 8 * 128 * 2
ROUTERS = ("round_robin", "random", "least_load", "cache_aware")


@dataclass(frozen=True, slots=True)
class Request:
    """One trace request: arrival ``t`` (seconds from the trace start) and its block ids."""

    t: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def hash_key(h: int) -> bytes:
    """The store key of a trace block id: 8-byte little-endian."""
    return int(h).to_bytes(8, "little")


def key_hash(key: bytes) -> int:
    """Inverse of :func:`hash_key`."""
    return int.from_bytes(key, "little")


def load_mooncake(path: str | Path, limit: int | None = None) -> list[Request]:
    """Load a Mooncake-format jsonl trace (``timestamp`` in ms, ``hash_ids``)."""
    out: list[Request] = []
    with open(path) as f:
        for line in f:
            if not line.strip():
                continue
            r = json.loads(line)
            out.append(Request(r["timestamp"] / 1000.0, int(r.get("input_length", 0)),
                               int(r.get("output_length", 0)), tuple(int(h) for h in r["hash_ids"])))
            if limit is not None and len(out) >= limit:
                break
    out.sort(key=lambda r: r.t)
    return out


def _parse_azure_time(text: str) -> float:
    """Seconds since the epoch day of ``YYYY-MM-DD HH:MM:SS.fffffff`` (7 fraction digits)."""
    date, clock = text.strip().split(" ")
    y, mo, d = (int(x) for x in date.split("-"))
    h, mi, s = clock.split(":")
    days = (y * 372 + mo * 31 + d)  # monotone day index; only differences matter
    return days * 86400.0 + int(h) * 3600.0 + int(mi) * 60.0 + float(s)


def load_azure(path: str | Path, pool: int = 2000, zipf_s: float = 1.1, max_shared_blocks: int = 16,
               drift_s: float = 900.0, limit: int | None = None, seed: int = 0) -> list[Request]:
    """Load the Azure LLM trace (arrival times and lengths only) with synthesised prefixes.

    The trace has no prefix information, so each request draws a prompt from a
    pool of ``pool`` prompts with Zipf(``zipf_s``) popularity; prompt ``j`` is
    a shared system block (id 0) plus ``1..max_shared_blocks`` blocks of its own.
    The request's blocks beyond the prompt (from ``ContextTokens``) are unique.
    Every ``drift_s`` seconds the popularity ranking is reshuffled, so the hot
    set drifts (0 disables).
    """
    rng = random.Random(seed)
    shared_len = [rng.randint(1, max_shared_blocks) for _ in range(pool)]
    weights = [1.0 / (k + 1) ** zipf_s for k in range(pool)]
    cum = [0.0]
    for w in weights:
        cum.append(cum[-1] + w)
    ranks = list(range(pool))
    next_id = 1 + pool * max_shared_blocks
    rows: list[tuple[float, int, int]] = []
    with open(path) as f:
        header = f.readline()
        if "TIMESTAMP" not in header.upper():
            raise ValueError(f"{path}: not an Azure LLM trace (header {header.strip()!r})")
        for line in f:
            parts = line.strip().split(",")
            if len(parts) < 3:
                continue
            rows.append((_parse_azure_time(parts[0]), int(parts[1]), int(parts[2])))
            if limit is not None and len(rows) >= limit:
                break
    rows.sort()
    out: list[Request] = []
    t0 = rows[0][0] if rows else 0.0
    epoch = 0
    for ts, ctx, gen in rows:
        t = ts - t0
        if drift_s > 0 and int(t // drift_s) != epoch:
            epoch = int(t // drift_s)
            rng.shuffle(ranks)
        j = ranks[bisect.bisect_right(cum, rng.random() * cum[-1]) - 1]
        n = max(1, math.ceil(ctx / BLOCK_TOKENS))
        base = 1 + j * max_shared_blocks
        ids = [0] + [base + i for i in range(min(shared_len[j], n - 1))]
        while len(ids) < n:
            ids.append(next_id)
            next_id += 1
        out.append(Request(t, ctx, gen, tuple(ids)))
    return out


def synth_fanout(bursts: int = 200, reqs_per_burst: int = 16, prefix_blocks: int = 8, window_s: float = 60.0,
                 decoys: int = 200, background_rate: float = 1.0, seed: int = 0,
                 duration_s: float = 3600.0, suffix_blocks: int = 2) -> list[Request]:
    """A synthetic agent fan-out trace in the Mooncake request format.

    * ``bursts`` bursts at uniform random times: a new shared prefix of
      ``prefix_blocks`` blocks (after the common block 0) is requested
      ``reqs_per_burst`` times, the first at the burst start and the rest
      uniformly over ``window_s`` seconds, each with ``suffix_blocks`` unique
      blocks after the prefix.
    * ``decoys`` prefixes that look like the start of a burst (two requests
      0.5-5 s apart) and are never requested again.
    * background: unique single-use prompts (1..prefix_blocks+suffix_blocks
      blocks after block 0) at ``background_rate`` req/s (Poisson).

    Times are rounded to 1 ms; lengths are whole blocks.
    """
    rng = random.Random(seed)
    next_id = 1
    reqs: list[tuple[float, tuple[int, ...]]] = []

    def fresh(n: int) -> list[int]:
        nonlocal next_id
        ids = list(range(next_id, next_id + n))
        next_id += n
        return ids

    for _ in range(bursts):
        start = rng.uniform(0.0, max(duration_s - window_s, 1.0))
        prefix = [0] + fresh(prefix_blocks)
        offsets = [0.0] + [rng.uniform(0.0, window_s) for _ in range(reqs_per_burst - 1)]
        for off in offsets:
            reqs.append((start + off, tuple(prefix + fresh(suffix_blocks))))
    for _ in range(decoys):
        start = rng.uniform(0.0, duration_s)
        prefix = [0] + fresh(prefix_blocks)
        for k in range(2):
            reqs.append((start + k * rng.uniform(0.5, 5.0), tuple(prefix + fresh(suffix_blocks))))
    t = 0.0
    while background_rate > 0:
        t += rng.expovariate(background_rate)
        if t >= duration_s:
            break
        reqs.append((t, tuple([0] + fresh(rng.randint(1, prefix_blocks + suffix_blocks)))))
    reqs.sort(key=lambda r: r[0])
    return [Request(round(t, 3), len(ids) * BLOCK_TOKENS, 128, ids) for t, ids in reqs]


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


def load_trace(path: str | Path, limit: int | None = None, seed: int = 0) -> list[Request]:
    """Load a trace by extension: ``.jsonl`` Mooncake, ``.csv`` Azure; ``synth:`` the fan-out generator."""
    p = str(path)
    if p.startswith("synth"):
        return synth_fanout(seed=seed)
    if p.endswith(".csv"):
        return load_azure(p, limit=limit, seed=seed)
    return load_mooncake(p, limit=limit)
