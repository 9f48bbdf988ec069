"""Membership on etcd against a real ``etcd`` (Debian's etcd-server, started
here on free ports): in-process memberships, then real ``kvstored`` processes
whose coordinator is killed while a client keeps working. The view and the
election as pure logic: tests/unit/cluster/test_etcd_view.py.

Without an ``etcd`` binary the etcd-backed tests skip, unless
``KVSTORE_REQUIRE_ETCD=1`` (CI installs etcd-server) makes them fail."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from tests.conftest import keys_for, random_pages, wait_until
from kvstore.config import NodeConfig
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc as pb_grpc
from tests.unit.cluster.test_etcd_view import info

MiB = 1 << 20


# ---- a real etcd ---------------------------------------------------------------

def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


@dataclass
class Etcd:
    url: str        # what --membership takes (without a prefix)
    address: str    # HOST:PORT of the client port
    proc: subprocess.Popen  # type: ignore[type-arg]
    log: Path
    credentials: grpc.ChannelCredentials | None = None

    def prefixed(self) -> str:
        """The URL with a fresh key prefix: each test its own cluster."""
        return f"{self.url}/t{uuid.uuid4().hex[:8]}"


def etcd_binary() -> str:
    """The etcd to run, with the client it needs; skips without them (fails
    instead under KVSTORE_REQUIRE_ETCD=1)."""
    path = shutil.which("etcd") or ("/usr/bin/etcd" if os.path.exists("/usr/bin/etcd") else None)
    missing = "no etcd binary (apt-get install etcd-server)" if path is None else ""
    try:
        import aetcd  # noqa: F401
    except ImportError:
        missing = missing or "no aetcd (pip install kvstore[etcd])"
    if missing:
        if os.environ.get("KVSTORE_REQUIRE_ETCD") == "1":
            pytest.fail(f"KVSTORE_REQUIRE_ETCD=1 but {missing}")
        pytest.skip(missing)
    assert path is not None
    return path


def start_etcd(data: Path, tls: tuple[str, str, str] | None = None) -> Etcd:
    client, peer = free_ports(2)
    scheme = "https" if tls else "http"
    args = [etcd_binary(), "--name", "t", "--data-dir", str(data),
            "--listen-client-urls", f"{scheme}://127.0.0.1:{client}",
            "--advertise-client-urls", f"{scheme}://127.0.0.1:{client}",
            "--listen-peer-urls", f"http://127.0.0.1:{peer}",
            "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
            "--initial-cluster", f"t=http://127.0.0.1:{peer}",
            # fast raft ticks: leases of 1 s are allowed (min TTL = 1.5 election timeouts)
            "--heartbeat-interval", "10", "--election-timeout", "100", "--logger", "zap", "--log-level", "error"]
    credentials = None
    if tls:
        ca, cert, key = tls
        args += ["--trusted-ca-file", ca, "--cert-file", cert, "--key-file", key, "--client-cert-auth"]
        credentials = grpc.ssl_channel_credentials(*(Path(p).read_bytes() for p in (ca, key, cert)))
    log = data.parent / f"{data.name}.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(args, stdout=out, stderr=out)
    etcd = Etcd(f"{'etcds' if tls else 'etcd'}://127.0.0.1:{client}", f"127.0.0.1:{client}", proc, log, credentials)
    deadline = time.monotonic() + 30
    from aetcd import rpc

    while True:  # ready once it answers a client call
        if proc.poll() is not None:
            raise RuntimeError(f"etcd exited: {log.read_text()[-2000:]}")
        channel = (grpc.secure_channel(etcd.address, credentials) if credentials
                   else grpc.insecure_channel(etcd.address))
        try:
            rpc.MaintenanceStub(channel).Status(rpc.StatusRequest(), timeout=0.5)
            return etcd
        except grpc.RpcError:
            if time.monotonic() > deadline:
                proc.kill()
                raise
        finally:
            channel.close()


def stop_etcd(etcd: Etcd) -> None:
    etcd.proc.terminate()
    try:
        etcd.proc.wait(10)
    except subprocess.TimeoutExpired:
        etcd.proc.kill()
        etcd.proc.wait(10)


@pytest.fixture(scope="module")
def etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Etcd]:
    server = start_etcd(tmp_path_factory.mktemp("etcd") / "data")
    yield server
    stop_etcd(server)


def membership(url: str, node_id: str, timeout: float = 0.8, **tls: str):  # type: ignore[no-untyped-def]
    from kvstore.cluster.membership.etcd import EtcdMembership

    config = NodeConfig(membership=url, heartbeat_interval=0.1, heartbeat_timeout=timeout, **tls)
    return EtcdMembership.from_config(config, info(node_id, incarnation=uuid.uuid4().hex[:8]))


@contextlib.asynccontextmanager
async def started(members):  # type: ignore[no-untyped-def]
    """``members`` started in order, and stopped (each) however the block ends."""
    for m in members:
        await m.start()
    try:
        yield members
    finally:
        for m in members:
            await m.stop()


async def settle(members, cond, timeout: float, what: str) -> float:  # type: ignore[no-untyped-def]
    start = time.monotonic()
    while not cond(members):
        if time.monotonic() - start > timeout:
            state = [(m.self_id, m.live_ids(), m.coordinator()) for m in members]
            raise AssertionError(f"timed out after {timeout:.1f}s waiting for {what}; last state: {state}")
        await asyncio.sleep(0.01)
    return time.monotonic() - start


def agreed(members) -> bool:  # type: ignore[no-untyped-def]
    ids = sorted(m.self_id for m in members)
    return all(m.live_ids() == ids for m in members) and len({m.coordinator() for m in members}) == 1 \
        and members[0].coordinator() in ids


def test_members_register_watch_and_elect_one_coordinator(etcd: Etcd) -> None:
    async def main() -> None:
        url = etcd.prefixed()
        async with started([membership(url, n) for n in "abc"]) as members:
            await settle(members, agreed, 5, "one view and one coordinator")
            holder = next(m for m in members if m.is_coordinator)
            assert sum(m.is_coordinator for m in members) == 1
            rest = [m for m in members if m is not holder]
            assert rest[0].standby() == rest[1].standby() == min(m.self_id for m in rest)
            # a graceful stop revokes the lease: the others see it at once and elect the standby
            start = time.monotonic()
            await holder.stop()
            took = await settle(rest, agreed, 5, "a new coordinator")
            assert rest[0].coordinator() == min(m.self_id for m in rest)
            assert took < 0.8, f"{took:.2f}s after a revoke"
            assert {d.node_id for d in rest[0].expire()} == {holder.self_id}
            print(f"\nrevoked coordinator replaced in {(time.monotonic() - start) * 1000:.0f} ms")

    asyncio.run(main())


def test_a_member_whose_lease_expires_disappears(etcd: Etcd) -> None:
    async def main() -> None:
        url = etcd.prefixed()
        async with started([membership(url, n) for n in "abc"]) as members:
            await settle(members, agreed, 5, "one view")
            coordinator = members[0].coordinator()
            victim = next(m for m in members if m.self_id != coordinator)
            rest = [m for m in members if m is not victim]
            assert victim._task is not None
            victim._task.cancel()  # stops renewing, revokes nothing: as if it hung
            start = time.monotonic()
            took = await settle(rest, agreed, 5, "the silent member to leave the view")
            assert 0.5 < took < 3.0, f"gone after {took:.2f}s with a 1 s lease"
            assert all(m.coordinator() == coordinator for m in rest)  # the coordinator stays
            print(f"\nexpired member gone after {(time.monotonic() - start) * 1000:.0f} ms (TTL 1 s)")

    asyncio.run(main())


def test_an_etcd_outage_keeps_views_and_steps_the_coordinator_down(tmp_path: Path) -> None:
    """etcd frozen (SIGSTOP) for 3 lease TTLs: every node keeps its view, the
    holder stops acting as coordinator once its lease may have expired; etcd
    back: one coordinator again, everyone listed."""
    server = start_etcd(tmp_path / "data")
    try:
        async def main() -> None:
            async with started([membership(f"{server.url}/outage", n) for n in "abc"]) as members:
                await settle(members, agreed, 5, "one view")
                holder = next(m for m in members if m.is_coordinator)
                server.proc.send_signal(signal.SIGSTOP)
                try:
                    took = await settle([holder], lambda ms: not ms[0].is_coordinator, 3, "the holder to step down")
                    assert took < 1.5, f"still coordinating {took:.2f}s into the outage, with a 1 s lease"
                    await asyncio.sleep(2)
                    assert all(m.live_ids() == ["a", "b", "c"] for m in members)  # the last view, kept
                    assert not any(m.is_coordinator for m in members)
                finally:
                    server.proc.send_signal(signal.SIGCONT)
                took = await settle(members, agreed, 10, "one coordinator after etcd is back")
                print(f"\nholder stepped down into the outage; agreed again {took * 1000:.0f} ms after etcd resumed")

        asyncio.run(main())
    finally:
        stop_etcd(server)


def test_unreachable_etcd_keeps_the_view_and_drops_the_coordinator_role() -> None:
    """Nothing listens on the port: start gives up after its timeout, the node
    is alone and does not coordinate."""
    async def main() -> None:
        (port,) = free_ports(1)
        m = membership(f"etcd://127.0.0.1:{port}", "a")
        m._start_timeout = 0.5
        await m.start()
        try:
            assert m.live_ids() == ["a"] and m.coordinator() == "" and not m.is_coordinator and m.keeps_directory
        finally:
            await m.stop()

    asyncio.run(main())


def test_members_over_tls_to_etcd(tmp_path: Path) -> None:
    trustme = pytest.importorskip("trustme")
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1", "localhost")
    paths = {name: str(tmp_path / f"{name}.pem") for name in ("ca", "cert", "key")}
    ca.cert_pem.write_to_path(paths["ca"])
    cert.cert_chain_pems[0].write_to_path(paths["cert"])
    cert.private_key_pem.write_to_path(paths["key"])
    server = start_etcd(tmp_path / "data", (paths["ca"], paths["cert"], paths["key"]))
    try:
        async def main() -> None:
            url = server.prefixed()
            async with started([membership(url, n, tls_ca=paths["ca"], tls_cert=paths["cert"], tls_key=paths["key"])
                                for n in "ab"]) as members:
                await settle(members, agreed, 5, "one view over TLS")
            plain = membership(url.replace("etcds://", "etcd://"), "c")  # no TLS: etcd refuses it
            plain._start_timeout = 0.5
            await plain.start()
            assert plain.live_ids() == ["c"]
            await plain.stop()

        asyncio.run(main())
    finally:
        stop_etcd(server)


# ---- real kvstored processes ----------------------------------------------------

def status(address: str) -> pb.ClusterStatusResponse:
    with grpc.insecure_channel(address) as channel:
        return pb_grpc.ClusterStub(channel).Status(pb.ClusterStatusRequest(), timeout=5)


def roles(address: str) -> tuple[list[str], str]:
    reply = status(address)
    return sorted(m.node_id for m in reply.members), reply.coordinator


def test_etcd_cluster_survives_the_kill_of_its_coordinator(daemon, etcd: Etcd) -> None:  # type: ignore[no-untyped-def]
    """Three nodes find each other through etcd (no --peers) and agree on one
    coordinator; SIGKILL it: the other two elect a new one within about a
    lease TTL, while a client on a survivor puts new pages and gets pages
    held by the other survivor (pulled through the directory) without an error."""
    from kvstore_client import KvClient

    url = etcd.prefixed()
    args = ["--device", "cpu", "--capacity", "64MiB", "--namespace", f"m:{MiB}", "--keep-fetched", "false",
            "--heartbeat-interval", "0.1", "--heartbeat-timeout", "0.8", "--membership", url]
    nodes = {n: daemon("--node-id", n, *args) for n in "abc"}
    wait_until(lambda: all(roles(d.address)[0] == ["a", "b", "c"] for d in nodes.values())
               and len({roles(d.address)[1] for d in nodes.values()}) == 1, 10, "one view and one coordinator",
               lambda: {n: roles(d.address) for n, d in nodes.items()})
    coordinator = roles(nodes["a"].address)[1]
    assert coordinator in nodes
    holder_node, client_node = sorted(set(nodes) - {coordinator})  # the client asks the directory over the network
    theirs = keys_for(2, b"theirs")
    with KvClient(nodes[client_node].address) as kv, KvClient(nodes[holder_node].address) as other:
        other.put("m", theirs, random_pages(2, MiB, seed=2))
        wait_until(lambda: kv.get("m", theirs, timeout=1.0).hits == 2, 5, "a get through the directory")
        nodes[coordinator].proc.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        errors: list[str] = []
        ops = misses = 0
        elected = None
        i = 0
        while time.monotonic() - killed < 4.0:
            try:
                kv.put("m", [b"new%d" % i], random_pages(1, MiB, seed=i))
                got = kv.get("m", theirs, timeout=1.0)
                misses += 2 - got.hits
                ops += 2
            except Exception as exc:  # counted: the test fails on any
                errors.append(repr(exc)[:200])
            i += 1
            if elected is None:
                live, now_coordinator = roles(nodes[client_node].address)
                if now_coordinator and now_coordinator != coordinator and live == sorted([client_node, holder_node]):
                    elected = time.monotonic() - killed
        print(f"\netcd failover: new coordinator after {elected}s, {ops} ops, {misses} misses, "
              f"{len(errors)} errors")
        assert not errors, errors[:3]
        assert misses == 0
        assert elected is not None and elected < 3.0, f"no new coordinator within 3 s ({elected})"
        assert roles(nodes[holder_node].address) == roles(nodes[client_node].address)
