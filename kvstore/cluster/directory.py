"""Which node holds which page: the coordinator's soft state, pure logic.

Nodes report page adds and removes in numbered batches (``Outbox``); the
coordinator applies them (``Directory.report``). A batch out of sequence, an
unknown node or a new incarnation makes the coordinator ask for a full
snapshot, so a new coordinator rebuilds the whole directory from the nodes'
next reports without any hand-over.

Speculative replicas are reported with their remaining life, so the
directory also holds :attr:`Directory.speculative`: which node holds which
page as a speculative replica, and until when. The node enforces the TTL
(it drops the page and reports the removal); the coordinator's planner
reads this map to renew or drop replicas, so there is one expiry path.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from kvstore.v1 import kvstore_pb2 as pb

SPECULATIVE = pb.SPECULATIVE


class PageState(Protocol):
    """What the outbox reads of an added page (a pool ``Entry``)."""

    key: bytes
    kind: int
    expires_at: float
    # and ``tier`` when it has one (0, the pool, when not): a tier page (``kvstore.tiers.stack.TierPage``)


@dataclass(slots=True)
class _NodeState:
    incarnation: str
    seq: int
    keys: dict[str, set[bytes]] = field(default_factory=dict)  # namespace -> keys


class Directory:
    """namespace -> key -> node ids, plus each node's key sets for drops."""

    def __init__(self) -> None:
        self._holders: dict[str, dict[bytes, set[str]]] = {}
        self._nodes: dict[str, _NodeState] = {}
        self._below: dict[str, dict[bytes, set[str]]] = {}  # namespace -> key -> nodes holding it below the pool
        # (namespace, key) -> {node: expires_at on the reader's clock}
        self.speculative: dict[tuple[str, bytes], dict[str, float]] = {}

    def clear(self) -> None:
        """Forget everything (this node no longer keeps a directory)."""
        self._holders.clear()
        self._nodes.clear()
        self._below.clear()
        self.speculative.clear()

    def __len__(self) -> int:
        return sum(len(keys) for keys in self._holders.values())

    def nodes(self) -> list[str]:
        return sorted(self._nodes)

    def report(self, node_id: str, incarnation: str, seq: int, full: bool,
               batches: Iterable[pb.DirectoryBatch], now: float = 0.0) -> bool:
        """Apply one report received at ``now``; returns True when a full
        snapshot is needed."""
        state = self._nodes.get(node_id)
        if full:
            self.drop(node_id)
            state = self._nodes[node_id] = _NodeState(incarnation, seq)
        elif state is None or state.incarnation != incarnation or seq != state.seq + 1:
            return True
        else:
            state.seq = seq
        for batch in batches:
            self._apply(node_id, state, batch.namespace, batch.adds, batch.removes, batch.below)
            self._apply_speculative(node_id, batch, now)
        return False

    def _apply_speculative(self, node_id: str, batch: pb.DirectoryBatch, now: float) -> None:
        ns, spec = batch.namespace, self.speculative
        for key in batch.removes:
            self._unspec(node_id, ns, key)
        lives = {p.key: p.expires_in_seconds for p in batch.speculative}
        for key in batch.adds:
            if key in lives:
                spec.setdefault((ns, key), {})[node_id] = now + lives[key]
            else:
                self._unspec(node_id, ns, key)

    def _unspec(self, node_id: str, namespace: str, key: bytes) -> None:
        nodes = self.speculative.get((namespace, key))
        if nodes is not None:
            nodes.pop(node_id, None)
            if not nodes:
                del self.speculative[(namespace, key)]

    def _apply(self, node_id: str, state: _NodeState, namespace: str, adds: Sequence[bytes],
               removes: Sequence[bytes], below: Sequence[bytes] = ()) -> None:
        holders = self._holders.setdefault(namespace, {})
        mine = state.keys.setdefault(namespace, set())
        lower = self._below.setdefault(namespace, {})
        if below or lower:  # (nothing to do in a cluster without tiers)
            down = set(below)
            for key in (*removes, *adds):
                nodes = lower.get(key)
                if key in down:
                    lower.setdefault(key, set()).add(node_id)
                elif nodes is not None:
                    nodes.discard(node_id)
                    if not nodes:
                        del lower[key]
        for key in removes:
            if key in mine:
                mine.discard(key)
                nodes = holders.get(key)
                if nodes is not None:
                    nodes.discard(node_id)
                    if not nodes:
                        del holders[key]
        for key in adds:
            if key not in mine:
                mine.add(key)
                holders.setdefault(key, set()).add(node_id)

    def drop(self, node_id: str) -> int:
        """Forget everything a node held (it died or restarted)."""
        state = self._nodes.pop(node_id, None)
        if state is None:
            return 0
        dropped = 0
        for namespace, keys in state.keys.items():
            holders = self._holders.get(namespace, {})
            lower = self._below.get(namespace, {})
            for key in keys:
                self._unspec(node_id, namespace, key)
                if key in lower:
                    lower[key].discard(node_id)
                    if not lower[key]:
                        del lower[key]
                nodes = holders.get(key)
                if nodes is not None:
                    nodes.discard(node_id)
                    dropped += 1
                    if not nodes:
                        del holders[key]
        return dropped

    def holders(self, namespace: str, key: bytes) -> set[str]:
        return set(self._holders.get(namespace, {}).get(key, ()))

    def locate(self, namespace: str, keys: Sequence[bytes]) -> list[set[str]]:
        table = self._holders.get(namespace, {})
        return [set(table.get(key, ())) for key in keys]

    def prefixes(self, namespace: str, chain: Sequence[bytes]) -> dict[str, int]:
        """Per node, the length of the longest leading run of ``chain`` it holds."""
        table = self._holders.get(namespace, {})
        if not chain:
            return {}
        active = set(table.get(chain[0], ()))
        lengths: dict[str, int] = {}
        for i, key in enumerate(chain[1:], start=1):
            if not active:
                break
            nodes = table.get(key, set())
            for node in active - nodes:
                lengths[node] = i
            active &= nodes
        for node in active:
            lengths[node] = len(chain)
        return lengths


    def pool_lengths(self, namespace: str, chain: Sequence[bytes], nodes: Iterable[str]) -> dict[str, int]:
        """Per node of ``nodes``, how many leading pages of ``chain`` are not below its pool (reported in
        its tiers): of its prefix, the part it serves without reading a tier first."""
        lower = self._below.get(namespace, {})
        if not lower:  # no node holds a page of the namespace below its pool
            return dict.fromkeys(nodes, len(chain))
        out = {}
        for node in nodes:
            n = 0
            for key in chain:
                if node in lower.get(key, ()):
                    break
                n += 1
            out[node] = n
        return out


class Outbox:
    """A node's page adds/removes not yet accepted by the coordinator."""

    def __init__(self) -> None:
        # namespace -> key -> (kind, expires_at, tier) when added, None when removed
        self._pending: dict[str, dict[bytes, tuple[int, float, int] | None]] = {}
        self.seq = 0
        self.need_full = True  # the first report is always a snapshot

    def record(self, namespace: str, added: Iterable[PageState] = (), removed: Iterable[bytes] = ()) -> None:
        pending = self._pending.setdefault(namespace, {})
        for key in removed:
            pending[key] = None
        for page in added:
            pending[page.key] = (int(page.kind), page.expires_at, getattr(page, "tier", 0))

    def pending(self) -> int:
        return sum(len(p) for p in self._pending.values())

    def take(self, now: float) -> tuple[int, list[pb.DirectoryBatch]]:
        """The next incremental batch (seq, batches) at ``now`` (the clock of
        the pages' ``expires_at``); clears the pending set."""
        batches = [_batch(namespace, pending, now) for namespace, pending in self._pending.items() if pending]
        self._pending.clear()
        self.seq += 1
        return self.seq, batches

    def take_full(self, snapshot: dict[str, Iterable[PageState]], now: float) -> tuple[int, list[pb.DirectoryBatch]]:
        """A full snapshot report replacing everything sent before."""
        self._pending.clear()
        self.seq += 1
        self.need_full = False
        return self.seq, [_batch(ns, {p.key: (int(p.kind), p.expires_at, getattr(p, "tier", 0)) for p in pages}, now)
                          for ns, pages in snapshot.items()]


def _batch(namespace: str, pending: dict[bytes, tuple[int, float, int] | None], now: float) -> pb.DirectoryBatch:
    adds = [k for k, state in pending.items() if state is not None]
    spec = [pb.SpeculativePage(key=k, expires_in_seconds=max(0.0, state[1] - now))
            for k, state in pending.items() if state is not None and state[0] == SPECULATIVE and state[1] > 0]
    return pb.DirectoryBatch(namespace=namespace, adds=adds, removes=[k for k, s in pending.items() if s is None],
                             speculative=spec, below=[k for k, s in pending.items() if s is not None and s[2]])
