"""Throwaway TLS material for tests, made with ``trustme`` when the tests run
(never committed, valid from now on, so it cannot expire mid-CI).

``make_certs(folder)`` writes a CA, a node certificate whose SANs are the
loopback names a test node listens on (``127.0.0.1``, ``localhost``: the
SAN rule of docs/security.md), a client certificate, and a second CA with
its own node certificate (a "foreign" cluster). The ``tls_certs`` fixture
makes one set per test session: import it into a test module
(``from tests.tls_certs import tls_certs``) to use it.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import trustme


@dataclass(frozen=True)
class Leaf:
    cert: str
    key: str


@dataclass(frozen=True)
class Certs:
    folder: Path
    ca: str  # PEM of the CA that signed node and client
    node: Leaf
    client: Leaf
    foreign_ca: str  # another CA: what a stranger's node trusts
    foreign_node: Leaf  # signed by foreign_ca

    def node_settings(self, client_auth: bool = False) -> dict[str, object]:
        """NodeConfig fields of a TLS node with these files."""
        return dict(tls_cert=self.node.cert, tls_key=self.node.key, tls_ca=self.ca, tls_client_auth=client_auth)

    def node_flags(self, client_auth: bool = False) -> list[str]:
        """The same as kvstored flags."""
        flags = ["--tls-cert", self.node.cert, "--tls-key", self.node.key, "--tls-ca", self.ca]
        return flags + (["--tls-client-auth", "true"] if client_auth else [])


def write_leaf(ca: trustme.CA, folder: Path, name: str, *identities: str) -> Leaf:
    """A certificate of ``ca`` for ``identities`` (trustme makes it good for
    server and client authentication), written as ``name.pem``/``name.key``."""
    issued = ca.issue_cert(*identities)
    cert, key = folder / f"{name}.pem", folder / f"{name}.key"
    cert.write_bytes(b"".join(blob.bytes() for blob in issued.cert_chain_pems))
    issued.private_key_pem.write_to_path(str(key))
    return Leaf(str(cert), str(key))


def make_certs(folder: Path, hosts: tuple[str, ...] = ("127.0.0.1", "localhost")) -> Certs:
    folder.mkdir(parents=True, exist_ok=True)
    ca, foreign = trustme.CA(), trustme.CA()
    ca.cert_pem.write_to_path(str(folder / "ca.pem"))
    foreign.cert_pem.write_to_path(str(folder / "foreign-ca.pem"))
    return Certs(folder, str(folder / "ca.pem"), write_leaf(ca, folder, "node", *hosts),
                 write_leaf(ca, folder, "client", "client.kvstore.test"), str(folder / "foreign-ca.pem"),
                 write_leaf(foreign, folder, "foreign-node", *hosts))


@pytest.fixture(scope="session")
def tls_certs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Certs]:
    yield make_certs(tmp_path_factory.mktemp("tls"))
