"""The shared-memory data path against clients that die or stall with a
grant: a real client process SIGKILLed after the node granted it a Get's
read holds or a Put's reserved slots leaks nothing, a client that sits on a
grant loses it at --shm-hold-timeout, and an uncommitted Put publishes
nothing. (The API suite runs over shm too: the ``node`` fixture.)"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from tests.conftest import check_pools_sound, keys_for, random_pages, wait_until
from kvstore_client import KvClient
from kvstore_client.shm import ShmConn
from kvstore.v1 import kvstore_pb2 as pb

PAGE = 64 << 10

pytestmark = pytest.mark.skipif(not hasattr(os, "memfd_create"), reason="shared memory needs memfd (Linux)")


def shm_path(address: str) -> str:
    with KvClient(address) as kv:
        (endpoint,) = [e for e in kv.node_info().data_endpoints if e.protocol == "kvs-shm"]
    return endpoint.path


def pool_state(srv) -> tuple[int, int, int]:  # type: ignore[no-untyped-def]
    """(read holds, slots in use, pages stored) of namespace m."""
    def read() -> tuple[int, int, int]:
        pool = srv.node.namespace("m").pool
        return sum(e.readers for e in pool._table.values()), pool.used_slots, len(pool)
    return srv.call(read)


CLIENT = textwrap.dedent("""
    import sys
    sys.path[:0] = {paths!r}
    from kvstore_client.shm import ShmConn
    from kvstore.v1 import kvstore_pb2 as pb
    conn = ShmConn({path!r}, 10.0)
    conn._pool("m")
    keys = [b"k" + i.to_bytes(4, "little") for i in range({n})]
    if {op!r} == "get":
        conn._exchange(pb.DataHeader(op=pb.DataHeader.GET, namespace="m", keys=keys, local_only=True))
    else:
        fresh = [b"new" + k for k in keys]
        conn._exchange(pb.DataHeader(op=pb.DataHeader.PUT, namespace="m", keys=fresh, page_bytes={page}))
    print("granted", flush=True)
    sys.stdin.read()  # hold the grant until killed
""")


@pytest.mark.parametrize("op", ["get", "put"])
def test_a_client_killed_holding_a_grant_leaks_nothing(make_server, op: str) -> None:  # type: ignore[no-untyped-def]
    srv = make_server(capacity=16 << 20)
    with KvClient(srv.address) as kv:
        kv.create_namespace("m", PAGE)
        kv.put("m", keys_for(8), random_pages(8, PAGE))
    before = pool_state(srv)
    paths = [p for p in sys.path if p]
    script = CLIENT.format(paths=paths, path=shm_path(srv.address), n=8, op=op, page=PAGE)
    with subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                          text=True) as proc:
        try:
            assert proc.stdout is not None and proc.stdout.readline().strip() == "granted"
            held = pool_state(srv)
            if op == "get":
                assert held[0] == 8  # the node holds the granted pages for the client
            else:
                assert held[1] == before[1] + 8 and held[2] == before[2]  # reserved, not published
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait(10)
    wait_until(lambda: pool_state(srv) == before, 5, "the dead client's grant to be taken back",
               state=lambda: pool_state(srv))
    check_pools_sound(srv)


def test_a_stalled_grant_is_taken_back_at_the_hold_timeout(make_server) -> None:  # type: ignore[no-untyped-def]
    srv = make_server(capacity=16 << 20, shm_hold_timeout=0.5)
    with KvClient(srv.address) as kv:
        kv.create_namespace("m", PAGE)
        kv.put("m", keys_for(4), random_pages(4, PAGE))
        conn = ShmConn(shm_path(srv.address), 10.0)
        try:
            conn._pool("m")
            reply, _ = conn._exchange(pb.DataHeader(op=pb.DataHeader.PUT, namespace="m", keys=keys_for(4, b"s"),
                                                    page_bytes=PAGE))
            assert pool_state(srv)[1] == 8
            wait_until(lambda: pool_state(srv)[1] == 4, 5, "the stalled reservation to be freed")
            from kvstore.errors import ResourceExhausted

            with pytest.raises(ResourceExhausted, match="not a live reservation"):
                conn._exchange(pb.DataHeader(op=pb.DataHeader.COMMIT, grant=reply.grant))
            assert not any(kv.exists("m", keys_for(4, b"s")))  # nothing published
        finally:
            conn.close()
    check_pools_sound(srv)


def test_shm_is_chosen_on_the_host_and_matches_the_socket_path(make_server) -> None:  # type: ignore[no-untyped-def]
    srv = make_server(capacity=16 << 20)
    pages = random_pages(6, PAGE, seed=3)
    with KvClient(srv.address) as auto, KvClient(srv.address, data_path="tcp") as tcp:
        auto.create_namespace("m", PAGE)
        assert auto.put("m", keys_for(6), pages).stored == 6
        assert auto._shm is not None and tcp._shm is None  # auto took shared memory; tcp did not
        via_tcp = tcp.get("m", keys_for(6))
        assert via_tcp.found.all() and np.array_equal(via_tcp.pages, pages)
        assert srv.call(lambda: srv.server.metrics.bytes.labels("put", "shm")._value.get()) == 6 * PAGE


def test_no_shm_endpoint_for_a_device_pool_or_when_off(make_server) -> None:  # type: ignore[no-untyped-def]
    staged = make_server(ops="staged", capacity=16 << 20)
    off = make_server(capacity=16 << 20, shm=False)
    for srv in (staged, off):
        with KvClient(srv.address) as kv:
            assert not [e for e in kv.node_info().data_endpoints if e.protocol == "kvs-shm"]
            kv.create_namespace("m", PAGE)
            kv.put("m", keys_for(2), random_pages(2, PAGE))
            assert kv._shm is None and kv.get("m", keys_for(2)).found.all()


class Counting(ShmConn):
    """A ShmConn that counts its round trips."""

    def __init__(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__(*args, **kwargs)
        self.trips = 0

    def _exchange(self, header, want_fd=False, retry=True):  # type: ignore[no-untyped-def]
        self.trips += 1
        return super()._exchange(header, want_fd, retry)


def shm_put(conn: ShmConn, keys: list[bytes], pages: np.ndarray):  # type: ignore[no-untyped-def]
    return conn.put("m", keys, [memoryview(p) for p in pages], PAGE, 0)


def test_a_put_after_the_first_takes_one_round_trip_into_write_ahead_slots(make_server) -> None:  # type: ignore[no-untyped-def]
    srv = make_server(capacity=16 << 20)
    with KvClient(srv.address, data_path="tcp") as kv:
        kv.create_namespace("m", PAGE)
        conn = Counting(shm_path(srv.address), 10.0)
        try:
            conn._pool("m")
            pages = random_pages(12, PAGE, seed=5)
            conn.trips = 0
            assert shm_put(conn, keys_for(4), pages[:4]).stored == 4
            assert conn.trips == 2 and "m" in conn._ahead  # PUT + COMMIT, which lent slots for the next
            assert pool_state(srv)[1:] == (4, 4)  # lent slots are not counted as used
            conn.trips = 0
            # one already stored: written ahead anyway, counted present, its slot given back
            result = shm_put(conn, [*keys_for(3, b"n"), keys_for(1)[0]], np.concatenate([pages[4:7], pages[:1]]))
            assert (result.stored, result.already_present, conn.trips) == (3, 1, 1)
            got = kv.get("m", [*keys_for(4), *keys_for(3, b"n")])
            assert got.found.all() and np.array_equal(got.pages, pages[:7])
            conn.trips = 0
            assert shm_put(conn, keys_for(5, b"big"), pages[7:12]).stored == 5  # more pages than lent: two trips
            assert conn.trips == 2
        finally:
            conn.close()  # gives the lent slots back at once
        assert pool_state(srv)[1:] == (12, 12)
    check_pools_sound(srv)
    assert srv.call(lambda: srv.node.namespace("m").pool._lent) == 0


def test_write_ahead_never_evicts_a_full_pool(make_server) -> None:  # type: ignore[no-untyped-def]
    srv = make_server(capacity=16 << 20)
    with KvClient(srv.address, data_path="tcp") as kv:
        kv.create_namespace("m", PAGE, capacity=8 * PAGE)
        conn = Counting(shm_path(srv.address), 10.0)
        try:
            conn._pool("m")
            pages = random_pages(9, PAGE, seed=6)
            for i in range(8):  # fill the pool one page at a time
                shm_put(conn, keys_for(1, b"%d" % i), pages[i:i + 1])
            assert pool_state(srv)[2] == 8 and "m" not in conn._ahead  # full: nothing lent
            assert all(kv.exists("m", [k for i in range(8) for k in keys_for(1, b"%d" % i)]))
            conn.trips = 0
            assert shm_put(conn, keys_for(1, b"x"), pages[8:9]).evicted == 1  # an ordinary Put evicts
            assert conn.trips == 2
        finally:
            conn.close()
    check_pools_sound(srv)


def test_write_ahead_slots_of_a_killed_client_lapse_with_their_lease(make_server) -> None:  # type: ignore[no-untyped-def]
    srv = make_server(capacity=16 << 20)
    with KvClient(srv.address, data_path="tcp") as kv:
        kv.create_namespace("m", PAGE)
    paths = [p for p in sys.path if p]
    script = textwrap.dedent(f"""
        import sys
        sys.path[:0] = {paths!r}
        import numpy as np
        from kvstore_client.shm import ShmConn
        conn = ShmConn({shm_path(srv.address)!r}, 10.0)
        pages = np.ones((4, {PAGE}), dtype=np.uint8)
        conn.put("m", [b"a%d" % i for i in range(4)], [memoryview(p) for p in pages], {PAGE}, 0)
        assert "m" in conn._ahead
        print("lent", flush=True)
        sys.stdin.read()
    """)
    with subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                          text=True) as proc:
        try:
            assert proc.stdout is not None and proc.stdout.readline().strip() == "lent"
            assert srv.call(lambda: srv.node.namespace("m").pool._lent) == 4
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait(10)
    # the node keeps them to the end of their lease (the client may have been writing), then takes them back
    wait_until(lambda: srv.call(lambda: srv.node.namespace("m").pool._lent) == 0, 10, "the lent slots to lapse")
    assert pool_state(srv)[1:] == (4, 4)
    check_pools_sound(srv)


def test_a_write_ahead_commit_for_another_namespace_is_refused_and_returns_the_slots(make_server) -> None:  # type: ignore[no-untyped-def]
    srv = make_server(capacity=16 << 20)
    with KvClient(srv.address, data_path="tcp") as kv:
        kv.create_namespace("m", PAGE, capacity=4 << 20)
        kv.create_namespace("other", PAGE, capacity=4 << 20)
        conn = ShmConn(shm_path(srv.address), 10.0)
        try:
            conn._pool("m")
            shm_put(conn, keys_for(2), random_pages(2, PAGE))
            spare = conn._ahead.pop("m")
            from kvstore.errors import InvalidArgument

            with pytest.raises(InvalidArgument, match="another namespace"):
                conn._exchange(pb.DataHeader(op=pb.DataHeader.COMMIT, grant=spare.grant, namespace="other",
                                             keys=keys_for(2, b"z"), page_bytes=PAGE))
            assert srv.call(lambda: srv.node.namespace("m").pool._lent) == 0
            assert not any(kv.exists("other", keys_for(2, b"z")))
        finally:
            conn.close()
    check_pools_sound(srv)
