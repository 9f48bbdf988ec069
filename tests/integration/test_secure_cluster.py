"""The secured cluster as the README starts it: credentials from
``scripts/dev-certs``, three ``kvstored`` processes with TLS, a token file and
the cluster secret, clients with a token. A client or a node without the
cluster's credentials can neither read nor join."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest

from tests.conftest import REPO_ROOT, wait_until
from kvstore.errors import Unauthenticated, Unavailable
from kvstore.launch import NodeProcess
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc as pb_grpc
from kvstore_client import KvClient, chain_keys

ROOT = REPO_ROOT
PAGE = 4096
FAST = ("--heartbeat-interval", "0.1", "--heartbeat-timeout", "1.0", "--transport", "tcp")

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="scripts/dev-certs needs openssl")


def dev_certs(out: Path, *names: str) -> Path:
    subprocess.run(["bash", str(ROOT / "scripts" / "dev-certs"), str(out), *(f"{n}=127.0.0.1" for n in names)],
                   check=True, capture_output=True, timeout=60)
    return out


def tokens(creds: Path) -> dict[str, str]:
    return dict(line.split() for line in (creds / "tokens.txt").read_text().splitlines())


def node_args(creds: Path, name: str, *peers: str) -> list[str]:
    args = ["--node-id", name, "--capacity", "64MiB", *FAST,
            "--tls-cert", str(creds / f"{name}.pem"), "--tls-key", str(creds / f"{name}.key"),
            "--tls-ca", str(creds / "ca.pem"), "--token-file", str(creds / "tokens.toml"),
            "--cluster-secret-file", str(creds / "cluster.secret")]
    return args + (["--peers", ",".join(peers)] if peers else [])


def client(creds: Path, address: str, token: str | None) -> KvClient:
    return KvClient(address, tls_ca=str(creds / "ca.pem"), token=token, timeout=10)


def members(creds: Path, address: str) -> list[str]:
    """The members ``address`` lists, asked as an admin client (Cluster.Status takes an admin token)."""
    credentials = grpc.ssl_channel_credentials((creds / "ca.pem").read_bytes())
    with grpc.secure_channel(address, credentials) as channel:
        reply = pb_grpc.ClusterStub(channel).Status(
            pb.ClusterStatusRequest(), timeout=5, metadata=[("authorization", f"Bearer {tokens(creds)['admin']}")])
    return sorted(m.node_id for m in reply.members)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, dict[str, NodeProcess]]]:
    creds = dev_certs(tmp_path_factory.mktemp("creds") / "c", "node1", "node2", "node3", "node4")
    nodes: dict[str, NodeProcess] = {}
    try:
        nodes["node1"] = NodeProcess(node_args(creds, "node1"), capture_stderr=True)
        for name in ("node2", "node3"):
            nodes[name] = NodeProcess(node_args(creds, name, nodes["node1"].address), capture_stderr=True)
        for node in nodes.values():
            wait_until(lambda node=node: members(creds, node.address) == ["node1", "node2", "node3"], 20,
                       "membership over TLS with the cluster secret")
        yield creds, nodes
    finally:
        for node in nodes.values():
            node.kill()


def test_the_ready_line_says_secure(cluster) -> None:  # type: ignore[no-untyped-def]
    _, nodes = cluster
    assert all(node.fields.get("mode") == "secure" for node in nodes.values()), [n.fields for n in nodes.values()]


def test_a_client_with_a_token_puts_on_one_node_and_gets_on_another(cluster) -> None:  # type: ignore[no-untyped-def]
    creds, nodes = cluster
    keys = chain_keys(np.arange(4 * 16), 16)
    pages = np.random.default_rng(0).integers(0, 256, (4, PAGE), dtype=np.uint8)
    write = tokens(creds)["write"]
    for node in nodes.values():
        with client(creds, node.address, write) as kv:
            kv.create_namespace("m", PAGE, capacity=1 << 20)
    with client(creds, nodes["node1"].address, write) as kv:
        assert kv.put("m", keys, pages).stored == 4
    with client(creds, nodes["node3"].address, write) as kv:
        def pulled() -> bool:
            got = kv.get("m", keys)
            return bool(got.found.all()) and np.array_equal(got.pages, pages)
        wait_until(pulled, 10, "node3 to pull the pages from node1 over the TLS peer transport")


def test_without_a_token_or_without_tls_a_client_reads_nothing(cluster) -> None:  # type: ignore[no-untyped-def]
    creds, nodes = cluster
    address = nodes["node1"].address
    with client(creds, address, None) as kv, pytest.raises(Unauthenticated):
        kv.list_namespaces()
    with client(creds, address, "not-a-token") as kv, pytest.raises(Unauthenticated):
        kv.list_namespaces()
    with KvClient(address, token=tokens(creds)["write"], timeout=3) as kv, pytest.raises(Unavailable):
        kv.list_namespaces()  # plaintext to a TLS port


def test_a_node_without_the_cluster_secret_cannot_join(cluster, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    creds, nodes = cluster
    # the right CA and certificate, a different secret
    wrong = tmp_path / "wrong.secret"
    wrong.write_text("f" * 64)
    args = node_args(creds, "node4", nodes["node1"].address)
    args[args.index("--cluster-secret-file") + 1] = str(wrong)
    intruder = NodeProcess(args, capture_stderr=True)
    try:
        with pytest.raises(AssertionError):
            wait_until(lambda: "node4" in members(creds, nodes["node1"].address), 2.0, "node4 to join")
        assert "node4" not in members(creds, nodes["node2"].address)
    finally:
        intruder.kill()


def test_a_node_of_another_ca_cannot_join(cluster, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    creds, nodes = cluster
    other = dev_certs(tmp_path / "other", "node5")
    args = node_args(other, "node5", nodes["node1"].address)
    args[args.index("--cluster-secret-file") + 1] = str(creds / "cluster.secret")  # even with the secret
    intruder = NodeProcess(args, capture_stderr=True)
    try:
        with pytest.raises(AssertionError):
            wait_until(lambda: "node5" in members(creds, nodes["node1"].address), 2.0, "node5 to join")
    finally:
        intruder.kill()

