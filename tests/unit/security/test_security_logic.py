"""Tokens, roles, quotas and cluster-secret proofs as pure logic: no sockets."""

from __future__ import annotations

import logging
import os

import pytest

from kvstore.errors import Unauthenticated
from kvstore.security.identity import ClusterSecret
from kvstore.security.tokens import DEVELOPMENT, Principal, Quota, TokenStore, bearer, parse_tokens, token_hash

SECRET = b"0123456789abcdef-cluster"


class Clock:
    def __init__(self, t: float = 1_700_000_000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


# ---- roles -----------------------------------------------------------------------------
def test_roles_nest_and_node_is_apart() -> None:
    read, write, admin, node = (Principal("t", r) for r in ("read", "write", "admin", "node"))
    assert read.allows("read") and not read.allows("write") and not read.allows("admin")
    assert write.allows("read") and write.allows("write") and not write.allows("admin")
    assert admin.allows("read") and admin.allows("write") and admin.allows("admin")
    assert node.allows("node") and not node.allows("read")
    assert not admin.allows("node") and not admin.allows("superuser")
    assert DEVELOPMENT.tenant == "" and DEVELOPMENT.allows("admin")


# ---- token files -----------------------------------------------------------------------
def _write(path, text: str) -> None:
    path.write_text(text)
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))  # a visible change on coarse clocks


FILE = f"""
[[token]]
sha256 = "{token_hash('acme-secret')}"
tenant = "acme"
role = "write"

[[token]]
token = "globex-reader"
tenant = "globex"
role = "read"

[tenant.acme]
max_bytes = "4GiB"
max_namespaces = 8
"""


def test_token_file_tenants_roles_and_quotas(tmp_path) -> None:
    path = tmp_path / "tokens.toml"
    _write(path, FILE)
    store = TokenStore(str(path))
    assert store.authenticate("acme-secret") == Principal("acme", "write")
    assert store.authenticate(b"globex-reader") == Principal("globex", "read")
    assert store.quota("acme") == Quota(4 << 30, 8)
    assert store.quota("globex") == Quota(None, None)


@pytest.mark.parametrize("token", ["", None, "wrong", "x" * 10_000, "acme-secret "])
def test_unknown_tokens_are_rejected_without_echo(tmp_path, token) -> None:
    path = tmp_path / "tokens.toml"
    _write(path, FILE)
    with pytest.raises(Unauthenticated) as info:
        TokenStore(str(path)).authenticate(token)
    assert len(str(info.value)) < 120
    if token:
        assert token.strip() not in str(info.value)


@pytest.mark.parametrize("text, says", [
    ("[[token]]\ntoken = 'a'\ntenant = 'x'\nrole = 'root'\n", "role"),
    ("[[token]]\ntoken = 'a'\nrole = 'read'\n", "tenant"),
    ("[[token]]\ntoken = 'a'\ntenant = 'a/b'\nrole = 'read'\n", "tenant"),
    ("[[token]]\nsha256 = 'abc'\ntenant = 'x'\nrole = 'read'\n", "sha256"),
    ("[[token]]\ntoken = 'a'\nsha256 = '00'\ntenant = 'x'\nrole = 'read'\n", "exactly one"),
    ("[tenant.x]\nmax_bytes = 'lots'\n", "size"),
    ("[tenant.x]\nmax_namespaces = -1\n", "max_namespaces"),
    ("not toml = = =", "TOML"),
    ("[users]\n", "unknown"),
])
def test_broken_token_files_say_what_is_wrong(text: str, says: str) -> None:
    with pytest.raises(ValueError, match=says) as info:
        parse_tokens(text)
    assert "'a'" not in str(info.value)  # never a token


def test_rotation_without_restart_and_broken_file_keeps_old(tmp_path, caplog) -> None:
    path = tmp_path / "tokens.toml"
    _write(path, "[[token]]\ntoken = 'old'\ntenant = 'acme'\nrole = 'write'\n")
    clock = Clock(100.0)
    store = TokenStore(str(path), recheck_s=1.0, clock=clock)
    assert store.authenticate("old").tenant == "acme"
    _write(path, "[[token]]\ntoken = 'new'\ntenant = 'acme'\nrole = 'write'\n")
    clock.t += 0.5  # not re-checked yet
    assert store.authenticate("old").tenant == "acme"
    clock.t += 1.0
    assert store.authenticate("new").tenant == "acme"
    with pytest.raises(Unauthenticated):
        store.authenticate("old")
    _write(path, "[[token]]\ntoken = 'newer'\nrole = 'write'\n")  # broken: no tenant
    clock.t += 2.0
    with caplog.at_level(logging.ERROR):
        assert store.authenticate("new").tenant == "acme"
    assert "previous tokens stay in force" in caplog.text
    os.remove(path)  # gone: also keeps the old table
    clock.t += 2.0
    assert store.authenticate("new").tenant == "acme"


def test_a_broken_file_at_start_is_an_error(tmp_path) -> None:
    path = tmp_path / "tokens.toml"
    _write(path, "[[token]]\n")
    with pytest.raises(ValueError, match="token file"):
        TokenStore(str(path))


def test_bearer_header() -> None:
    assert bearer("Bearer abc") == "abc"
    assert bearer("bearer  abc ") == "abc"
    assert bearer(b"Bearer abc") == "abc"
    assert bearer("Basic abc") == "" and bearer("") == "" and bearer(None) == ""


# ---- cluster secret ------------------------------------------------------------------
def test_proof_round_trip_names_the_node() -> None:
    clock = Clock()
    secret = ClusterSecret(SECRET, clock=clock)
    proof = secret.sign("Heartbeat", "node-a:7000", b"body")
    assert ClusterSecret(SECRET, clock=clock).verify(proof, "Heartbeat", b"body") == "node-a:7000"


def test_short_secret_refused(tmp_path) -> None:
    with pytest.raises(ValueError, match="at least 16"):
        ClusterSecret(b"short")
    path = tmp_path / "secret"
    path.write_bytes(b"  tiny \n")
    with pytest.raises(ValueError, match="cluster secret file"):
        ClusterSecret.from_file(str(path))
    path.write_bytes(SECRET + b"\n")
    clock = Clock()
    assert ClusterSecret.from_file(str(path), clock=clock).verify(
        ClusterSecret(SECRET, clock=clock).sign("p", "n"), "p") == "n"


def test_wrong_secret_purpose_or_body_is_rejected() -> None:
    clock = Clock()
    ours = ClusterSecret(SECRET, clock=clock)
    theirs = ClusterSecret(b"another-secret-of-16+", clock=clock)
    with pytest.raises(Unauthenticated, match="wrong MAC"):
        ours.verify(theirs.sign("Heartbeat", "n"), "Heartbeat")
    with pytest.raises(Unauthenticated, match="wrong MAC"):
        ours.verify(ours.sign("Heartbeat", "n"), "Replicate")
    with pytest.raises(Unauthenticated, match="wrong MAC"):
        ours.verify(ours.sign("Replicate", "n", b"pages"), "Replicate", b"other pages")


def test_tampered_node_id_is_rejected() -> None:
    clock = Clock()
    secret = ClusterSecret(SECRET, clock=clock)
    proof = secret.sign("Heartbeat", "node-b")
    forged = secret.sign("Heartbeat", "node-a").split(".")
    parts = proof.split(".")
    parts[1] = forged[1]
    with pytest.raises(Unauthenticated, match="wrong MAC"):
        secret.verify(".".join(parts), "Heartbeat")


@pytest.mark.parametrize("proof", [None, "", "v1", "v2.bm9kZQ.1.00.00", "v1.!!.1.aa.bb", "v1.bm9kZQ.x.aa.bb",
                                   "v1.bm9kZQ.1." + "aa" * 16 + ".zz", "v1..1.aabb.cc", "x" * 10_000,
                                   b"\xff\xfe"])
def test_malformed_proofs_are_rejected_with_a_short_message(proof) -> None:
    with pytest.raises(Unauthenticated, match="malformed") as info:
        ClusterSecret(SECRET).verify(proof, "Heartbeat")
    assert len(str(info.value)) < 100


def test_clock_window() -> None:
    clock = Clock()
    signer = ClusterSecret(SECRET, clock=clock)
    verifier_clock = Clock(clock.t)
    verifier = ClusterSecret(SECRET, clock=verifier_clock)
    verifier_clock.t = clock.t + 29.0
    assert verifier.verify(signer.sign("p", "n"), "p") == "n"
    verifier_clock.t = clock.t + 31.0
    with pytest.raises(Unauthenticated, match="window"):
        verifier.verify(signer.sign("p", "n"), "p")
    verifier_clock.t = clock.t - 31.0  # a proof from the future
    with pytest.raises(Unauthenticated, match="window"):
        verifier.verify(signer.sign("p", "n"), "p")


def test_replay_is_rejected_and_the_cache_stays_bounded() -> None:
    clock = Clock()
    secret = ClusterSecret(SECRET, clock=clock, max_nonces=50)
    proof = secret.sign("Heartbeat", "n")
    secret.verify(proof, "Heartbeat")
    with pytest.raises(Unauthenticated, match="replayed"):
        secret.verify(proof, "Heartbeat")
    proofs = []
    for _ in range(120):
        clock.t += 0.01
        proofs.append(secret.sign("Heartbeat", "n"))
        secret.verify(proofs[-1], "Heartbeat")
    assert secret.remembered <= 50
    for old in proofs[:10]:  # evicted from the cache, still refused
        with pytest.raises(Unauthenticated, match="replayed"):
            secret.verify(old, "Heartbeat")
    clock.t += 60.0  # everything expires out of the cache
    secret.verify(secret.sign("Heartbeat", "n"), "Heartbeat")
    assert secret.remembered == 1


def test_nonces_are_random() -> None:
    secret = ClusterSecret(SECRET)
    assert len({secret.sign("p", "n").split(".")[3] for _ in range(100)}) == 100
