"""``kvctl top`` against a live 3-node cluster of real kvstored processes: what it prints once, per node."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from kvstore_client import KvClient
from tests.conftest import keys_for, random_pages, wait_until
from tests.integration.test_cluster import FAST, MiB, live_ids


def _top(address: str) -> str:
    kvctl = Path(sys.executable).with_name("kvctl")
    done = subprocess.run([str(kvctl), "top", "--addr", address, "--once"], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout


def _row(text: str, node: str) -> list[str]:
    """The cells of ``node``'s row (rich draws cells between │ bars)."""
    for line in text.splitlines():
        cells = [c.strip() for c in re.split(r"[│┃|]", line)]
        if len(cells) > 3 and cells[1] == node:
            return cells[1:-1]
    raise AssertionError(f"no row for {node} in:\n{text}")


def test_top_shows_each_node_its_pages_and_hits(daemon) -> None:  # type: ignore[no-untyped-def]
    nodes = {}
    for node_id in "abc":
        extra = ["--peers", nodes["a"].address] if nodes else []
        nodes[node_id] = daemon("--node-id", node_id, "--transport", "tcp", "--capacity", "64MiB",
                                "--namespace", f"m:{MiB}", *FAST, *extra)
    for d in nodes.values():
        wait_until(lambda d=d: live_ids(d.address) == ["a", "b", "c"], 10, "membership to converge")
    keys = keys_for(8)
    with KvClient(nodes["a"].address) as ka, KvClient(nodes["c"].address) as kc:
        ka.put("m", keys, random_pages(8, MiB))
        wait_until(lambda: kc.lookup_nodes("m", keys).nodes, 5, "the directory to show a's pages")
        assert kc.get("m", keys + [b"absent"]).found.sum() == 8  # c pulls all 8 from a: replicas, remote hits
    text = _top(nodes["b"].address)  # any node sees the whole cluster
    assert "coordinator a" in text
    a, b, c = (_row(text, n) for n in "abc")
    assert a[:6] == ["a", "coordinator", "8/64", "8", "0", "0"] and a[6] == "8.0 MiB"
    assert b[:3] == ["b", "member", "0/64"] and b[7] == "-"
    assert c[:6] == ["c", "member", "8/64", "0", "8", "0"]
    assert c[7] == "88.9" and c[8] == "8"  # 8 of 9 pages found, all 8 from a peer


def test_top_names_the_node_it_cannot_reach(tmp_path: Path) -> None:
    kvctl = Path(sys.executable).with_name("kvctl")
    done = subprocess.run([str(kvctl), "top", "--addr", "127.0.0.1:1", "--once"], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 1 and "127.0.0.1:1: UNAVAILABLE" in done.stderr and "Traceback" not in done.stderr
