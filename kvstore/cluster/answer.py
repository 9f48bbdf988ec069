"""The cluster's Lookup answer, from what the coordinator knows. Pure: the
agent (``ClusterAgent.prefixes`` / ``lookup``) and the simulated replay
(``kvstore.replay.sim_cluster``) both build it here.

Per node, one ``NodePrefix``: the directory's longest prefix, raised by a
placement hint (a copy in flight, or a live speculative replica) that goes
deeper, and by an in-flight prefill claim (``computing``) that goes deeper
than what the directory knows -- but not over a copy on its way (that copy
brings the shared part; the claim beyond it is the node's own suffix).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence

from kvstore.cluster.claims import Pulls, Seen
from kvstore.v1 import kvstore_pb2 as pb


def merge(held: Mapping[str, int], hints: Iterable[pb.NodePrefix], seen: Iterable[Seen],
          address_of: Callable[[str], str | None]) -> list[pb.NodePrefix]:
    """``held``: the directory's prefix length per member node; ``hints``: the placement's; ``seen``:
    the claims a lookup sees; ``address_of``: a live member's address (None: not one)."""
    out = {node: pb.NodePrefix(node_id=node, address=address_of(node) or "", prefix_length=length)
           for node, length in held.items()}
    for hint in hints:
        have = out.get(hint.node_id)
        if have is None or hint.prefix_length > have.prefix_length:
            out[hint.node_id] = hint  # about to hold more than the directory knows of
        elif hint.prefix_length == have.prefix_length and not hint.pending:
            have.expires_in_seconds = hint.expires_in_seconds
    for s in seen:
        address, have = address_of(s.node), out.get(s.node)
        if address is not None and (have is None or (s.length > have.prefix_length and not have.pending)):
            out[s.node] = pb.NodePrefix(node_id=s.node, address=address, prefix_length=s.length, pending=True,
                                        computing=True, ready_in_seconds=s.ready_in, copies_ahead=s.copies_ahead)
    return list(out.values())


def as_seen_by(nodes: Sequence[pb.NodePrefix], me: str, local: int, address: str = "",
               alive: Callable[[str], bool] = lambda node: True, local_pool: int | None = None) -> list[pb.NodePrefix]:
    """The answer as node ``me`` gives it: live nodes only, and its own entry what it holds here
    (``local``, of which ``local_pool`` leading pages in its pool; default all), or deeper, a claim or a copy
    on its way here."""
    out = [n for n in nodes if alive(n.node_id) and (n.node_id != me or (n.pending and n.prefix_length > local))]
    if local and not any(n.node_id == me for n in out):
        out.append(pb.NodePrefix(node_id=me, address=address, prefix_length=local,
                                 pool_length=local if local_pool is None else local_pool))
    return out


def pulls_ahead(out: Sequence[pb.NodePrefix], pulls: Pulls, namespace: str, keys: Sequence[bytes], asker: str,
                local: int, now: float, held: Mapping[str, int], record: bool,
                sending: Callable[[str], int] = lambda node: 0) -> None:
    """Set ``copies_ahead`` on the entries of the nodes that hold the deepest prefix of ``keys`` (not
    pending): the pulls of it in flight (:class:`~kvstore.cluster.claims.Pulls`; ``held``: the directory's
    prefix length per node, which ends a pull that landed), spread over those holders, plus the
    coordinator's copies leaving each holder now (``sending``: a copy tree's, the planner's), which share
    its egress as much. A recorded lookup from ``asker``, which holds ``local`` blocks, then announces its
    own pull."""
    holders = [n for n in out if not n.pending and n.node_id != asker]
    depth = max((int(n.prefix_length) for n in holders), default=0)
    if depth <= local or not asker:
        return
    deepest = [n for n in holders if int(n.prefix_length) == depth]
    key = keys[depth - 1]
    ahead = pulls.ahead(namespace, key, now, asker, lambda node: held.get(node, 0) >= depth)
    share = -(-ahead // len(deepest))
    for n in deepest:
        n.copies_ahead = share + sending(n.node_id)
    if record:
        pulls.note(namespace, key, asker, now)
