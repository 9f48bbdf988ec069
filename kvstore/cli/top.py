"""``kvctl top``: the cluster at a glance, refreshing in the terminal.

One node's ``Cluster.Status`` gives the members; each member's ``Stats`` (its node-wide view: an
``admin`` token where nodes have a token file) gives its pages by kind, hits and what is moving. One
row per node:

* **pages**: used / slots, and of them primary, replica (copies it pulled and kept) and speculative
  (copies placed ahead of a forecast), summed over the namespaces it serves this caller;
* **hit%**: pages its Gets found / pages asked; **remote**: of the hits, pages fetched from a peer;
* **spec hit / wasted**: speculative pages read, and bytes of speculative pages evicted or expired unread;
* **pulling**: pages it is pulling from peers right now; **claims**: keys under in-flight prefill claims
  it tracks; **evicted**: pages evicted (LRU and speculative).

``--once`` prints one table and exits (scripts, tests); otherwise it redraws every ``--interval``
seconds until interrupted. A member that does not answer shows as such and the view goes on.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvstore.units import format_size


@dataclass(slots=True)
class NodeRow:
    node_id: str
    role: str
    address: str
    stats: Any = None      # StatsResponse, or None when the node did not answer
    error: str = ""


def snapshot(addr: str, security: dict[str, Any], timeout: float = 5.0,
             clients: dict[str, Any] | None = None) -> tuple[str, list[NodeRow]]:
    """(coordinator, one row per member) as ``addr`` sees the cluster, each member's Stats asked of it.
    ``clients``: the members' clients by address, kept between refreshes (one that failed is dropped)."""
    from kvstore.v1 import kvstore_pb2 as pb
    from kvstore.v1 import kvstore_pb2_grpc as pb_grpc
    from kvstore_client import KvClient
    from kvstore_client._common import Credentials, blocking_channel

    with blocking_channel(addr, Credentials(**security)) as channel:
        status = pb_grpc.ClusterStub(channel).Status(pb.ClusterStatusRequest(), timeout=timeout)
    rows = []
    for member in sorted(status.members, key=lambda m: m.node_id):
        row = NodeRow(member.node_id, "coordinator" if member.node_id == status.coordinator else "member",
                      member.address)
        kept = {} if clients is None else clients
        try:
            if member.address not in kept:
                kept[member.address] = KvClient(member.address, timeout=timeout, **security)
            row.stats = kept[member.address].stats()
        except Exception as exc:  # one member that does not answer must not blank the view
            row.error = f"{type(exc).__name__}: {exc}"[:80]
            kv = kept.pop(member.address, None)
            if kv is not None:
                kv.close()
        rows.append(row)
        if clients is None and member.address in kept:
            kept.pop(member.address).close()
    return status.coordinator, rows


def render(coordinator: str, rows: list[NodeRow], title: str = "") -> Any:
    """The rich Table of one snapshot."""
    from rich.table import Table

    table = Table(title=title or f"kvstore: {len(rows)} nodes, coordinator {coordinator or '-'}",
                  title_justify="left")
    for name, justify in (("node", "left"), ("role", "left"), ("pages used/slots", "right"), ("primary", "right"),
                          ("replica", "right"), ("spec", "right"), ("bytes", "right"), ("hit%", "right"),
                          ("remote", "right"), ("spec hit", "right"), ("spec wasted", "right"),
                          ("pulling", "right"), ("claims", "right"), ("evicted", "right")):
        table.add_column(name, justify=justify)  # type: ignore[arg-type]
    for row in rows:
        s = row.stats
        if s is None:
            table.add_row(row.node_id, row.role, f"[red]no answer: {row.error}[/red]")
            continue
        ns = list(s.namespaces)
        used, slots = sum(n.used_slots for n in ns), sum(n.num_slots for n in ns)
        replica, spec = sum(n.replica_slots for n in ns), sum(n.speculative_slots for n in ns)
        hits, misses = sum(n.hits for n in ns), sum(n.misses for n in ns)
        table.add_row(
            row.node_id, row.role, f"{used}/{slots}", str(max(0, used - replica - spec)), str(replica), str(spec),
            format_size(sum(n.used_bytes for n in ns)),
            f"{100 * hits / (hits + misses):.1f}" if hits + misses else "-", str(sum(n.remote_hits for n in ns)),
            str(sum(n.speculative_hits for n in ns)), format_size(sum(n.speculative_wasted_bytes for n in ns)),
            str(s.pulls_in_flight), str(s.claimed_keys),
            str(sum(sum(n.evictions.values()) for n in ns)))
    return table


def run(args: argparse.Namespace, security: dict[str, Any],
        clock: Callable[[], float] = time.monotonic) -> int:
    from rich.console import Console
    from rich.live import Live

    console = Console()
    if not console.is_terminal:  # a pipe or a file: wide enough that no column is cut
        console = Console(width=max(console.width, 180))
    if args.once:
        console.print(render(*snapshot(args.addr, security)))
        return 0
    clients: dict[str, Any] = {}
    with Live(console=console, auto_refresh=False, screen=False) as live:
        try:
            while True:
                started = clock()
                live.update(render(*snapshot(args.addr, security, clients=clients)), refresh=True)
                time.sleep(max(0.0, args.interval - (clock() - started)))
        except KeyboardInterrupt:
            return 0
        finally:
            for kv in clients.values():
                kv.close()
