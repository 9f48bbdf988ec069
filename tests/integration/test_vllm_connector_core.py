"""The vLLM connector's core (scheduler and worker sides) without vLLM:
numpy arrays in vLLM's CPU layout stand in for the engine's paged KV, and
real kvstored processes (a 2-node cluster) and real gRPC do the rest."""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator

import grpc
import numpy as np
import pytest

from kvstore.ops import NumpyPageOps
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc as pb_grpc
from kvstore_client import KvClient
from tests.kvstore_cluster import start_cluster, wait_until
from kvstore_vllm import ConnectorConfig, SchedulerCore, WorkerCore, block_keys, namespace_for, request_salt

BS = 32                  # tokens per block
LAYERS, HEADS, DIM = 2, 2, 16
NUM_BLOCKS = 24
NS = namespace_for("vllm", "/models/tiny llama", "float32", LAYERS, HEADS, DIM, BS, "cpu", 0, 1)


@pytest.fixture(scope="module")
def cluster() -> Iterator[dict]:  # type: ignore[type-arg]
    nodes = start_cluster("ab")
    yield nodes
    for node in nodes.values():
        node.kill()


def engine(seed: int | None = None) -> list[np.ndarray]:
    """Per-layer KV in vLLM's CPU layout [num_blocks, kv_heads, block_size, 2 * head_dim]."""
    shape = (NUM_BLOCKS, HEADS, BS, 2 * DIM)
    if seed is None:
        return [np.zeros(shape, np.float32) for _ in range(LAYERS)]
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(shape).astype(np.float32) for _ in range(LAYERS)]


def make_pair(address: str, kv: list[np.ndarray], engine_id: str, **cfg) -> tuple[SchedulerCore, WorkerCore]:  # type: ignore[no-untyped-def]
    config = ConnectorConfig(address=address, **cfg)
    sched = SchedulerCore(config, NS, BS, engine_id)
    worker = WorkerCore(config, NS, BS, NumpyPageOps())
    worker.register([f"layer.{i}" for i in range(LAYERS)], [t.view(np.uint8) for t in kv], "blocks")
    return sched, worker


def run_prefill(sched: SchedulerCore, worker: WorkerCore, req_id: str, tokens: list[int],
                block_ids: list[int], salt: bytes = b"") -> int:
    """Drive one request through the scheduler calls vLLM makes for a prefill,
    then the worker calls of that step. Returns the tokens it loaded."""
    ext = None
    for _ in range(200):
        ext = sched.matched_tokens(req_id, tokens, salt, 0)
        if ext is not None:
            break
        time.sleep(0.005)
    assert ext is not None
    sched.after_alloc(req_id, ext)
    plan = sched.build_plan([(req_id, block_ids, ext)], [], {req_id: len(tokens) - ext})
    worker.start_load(plan.loads)
    worker.wait_layer("layer.0")
    worker.save(plan.saves)
    return ext


def test_saved_on_one_node_loaded_from_the_other(cluster) -> None:  # type: ignore[no-untyped-def]
    prompt = list(range(5, 5 + 4 * BS + 7))                # 4 full blocks and a tail
    kv_a, kv_b = engine(seed=1), engine()
    sched_a, worker_a = make_pair(cluster["a"].address, kv_a, "engine-a")
    sched_b, worker_b = make_pair(cluster["b"].address, kv_b, "engine-b")
    try:
        assert run_prefill(sched_a, worker_a, "r1", prompt, [3, 9, 4, 11, 2]) == 0
        assert worker_a.flush(10)
        assert worker_a.stats.saved_blocks == 4
        with KvClient(cluster["a"].address) as kv:
            wait_until(lambda: kv.lookup_nodes(NS, block_keys(prompt, BS)).nodes[0].prefix_length == 4, 5,
                       "the saved prefix in the directory")
            time.sleep(0.3)  # the coordinator's directory learns it from the next heartbeats

        longer = prompt[:4 * BS] + [1000 + i for i in range(40)]
        loaded = run_prefill(sched_b, worker_b, "r2", longer, [7, 0, 15, 20, 1])
        assert loaded == 4 * BS                            # the whole shared prefix
        assert worker_b.stats.loaded_tokens == 4 * BS
        assert worker_b.take_load_errors() == set()
        for a, b in zip(kv_a, kv_b):                       # page by page: B's blocks hold A's KV
            for src, dst in zip([3, 9, 4, 11], [7, 0, 15, 20]):
                np.testing.assert_array_equal(b[dst], a[src])
            assert not b[[1, 2, 3]].any()                  # nothing written where nothing was loaded
    finally:
        for part in (worker_a, worker_b, sched_a, sched_b):
            part.close()


def test_loads_with_and_without_a_deadline_each_land_in_their_blocks(cluster) -> None:  # type: ignore[no-untyped-def]
    """A step's loads: those with a deadline (pages from the node's tiers) get a Get of their own, the
    others share one; every page lands in its own block either way."""
    prompt = list(range(700, 700 + 4 * BS + 1))
    kv_a, kv_b = engine(seed=5), engine()
    sched_a, worker_a = make_pair(cluster["a"].address, kv_a, "dl-a")
    _, worker_b = make_pair(cluster["a"].address, kv_b, "dl-b")
    try:
        run_prefill(sched_a, worker_a, "d", prompt, [1, 2, 3, 4, 5])
        assert worker_a.flush(10)
        from kvstore_vllm import LoadSpec

        keys = block_keys(prompt, BS)
        worker_b.start_load([LoadSpec("x", keys[:1], [20]), LoadSpec("y", keys[1:3], [21, 22], deadline_s=5.0),
                             LoadSpec("z", keys[3:], [23])])
        worker_b.wait_layer()
        assert worker_b.take_load_errors() == set() and worker_b.stats.loaded_tokens == 4 * BS
        for a, b in zip(kv_a, kv_b):
            for src, dst in zip([1, 2, 3, 4], [20, 21, 22, 23]):
                np.testing.assert_array_equal(b[dst], a[src])
    finally:
        for part in (worker_a, worker_b, sched_a):
            part.close()


def test_repeat_calls_are_idempotent_and_lookup_is_one_rpc(cluster) -> None:  # type: ignore[no-untyped-def]
    prompt = list(range(100, 100 + 3 * BS + 1))
    kv = engine(seed=2)
    sched, worker = make_pair(cluster["a"].address, kv, "engine-idem")
    try:
        run_prefill(sched, worker, "w", prompt, [0, 1, 2, 3])
        assert worker.flush(10)
        sched.finished("w")
        with KvClient(cluster["a"].address) as client:
            before = client.stats(NS).namespaces[0].active_leases
            answers = {sched.matched_tokens("again", prompt, b"", 0) for _ in range(5)}
            answers |= {sched.matched_tokens("again", prompt, b"", 0) for _ in range(5)}
            assert answers == {3 * BS}
            assert client.stats(NS).namespaces[0].active_leases == before + 1
        assert sched.stats.lookups == 2                    # "w" and "again": one RPC each
        # a request whose prompt is exactly its cached blocks still computes one token
        assert sched.matched_tokens("exact", prompt[:3 * BS], b"", 0) == 2 * BS
    finally:
        worker.close()
        sched.close()


def test_lookup_never_blocks_the_scheduler() -> None:
    """A node that does not answer (SIGSTOP) costs the scheduler at most
    lookup_wait_ms per call: it answers None, and the hit once the node wakes."""
    nodes = start_cluster("a")
    node = nodes["a"]
    tokens = list(range(3 * BS + 1))
    sched = SchedulerCore(ConnectorConfig(address=node.address, lookup_wait_ms=20), NS, BS, "nb")
    try:
        sched.client.wait_ready(10)                        # connected before the node stops
        sched.client.create_namespace(NS, 4096)
        node.proc.send_signal(signal.SIGSTOP)
        start = time.monotonic()
        assert sched.matched_tokens("q", tokens, b"", 0) is None
        assert sched.matched_tokens("q", tokens, b"", 0) is None
        assert time.monotonic() - start < 1.0              # two calls, each bounded by the wait
        node.proc.send_signal(signal.SIGCONT)
        wait_until(lambda: sched.matched_tokens("q", tokens, b"", 0) is not None, 10, "the answer")
        assert sched.matched_tokens("q", tokens, b"", 0) == 0  # nothing stored: a miss, after one RPC
        assert (sched.stats.lookups, sched.stats.lookup_errors) == (1, 0)
    finally:
        node.proc.send_signal(signal.SIGCONT)
        sched.close()
        node.kill()


def test_missing_page_is_a_load_error_and_the_rest_loads(cluster) -> None:  # type: ignore[no-untyped-def]
    prompt = list(range(300, 300 + 3 * BS + 1))
    kv_a, kv_b = engine(seed=3), engine()
    sched_a, worker_a = make_pair(cluster["a"].address, kv_a, "ea")
    sched_b, worker_b = make_pair(cluster["a"].address, kv_b, "eb")
    try:
        run_prefill(sched_a, worker_a, "s", prompt, [1, 2, 3, 4])
        assert worker_a.flush(10)
        keys = block_keys(prompt, BS)
        ext = sched_b.matched_tokens("l", prompt, b"", 0)
        assert ext == 3 * BS                               # leased: the pages are pinned now
        with KvClient(cluster["a"].address) as kv:
            assert list(kv.delete(NS, [keys[1]]).pinned) == [keys[1]]
        sched_b.after_alloc("l", ext)
        plan = sched_b.build_plan([("l", [10, 11, 12, 13], ext)], [], {"l": 1})
        assert [s.lease_id != "" for s in plan.loads] == [True]
        # the lease protects against eviction, not against a page vanishing some other way:
        # simulate a lost page by releasing the lease first, then deleting it
        with KvClient(cluster["a"].address) as kv:
            kv.unpin(NS, plan.loads[0].lease_id)
            assert kv.delete(NS, [keys[1]]).deleted == 1
        worker_b.start_load(plan.loads)
        worker_b.wait_layer()
        assert worker_b.take_load_errors() == {11}
        assert worker_b.stats.loaded_tokens == 2 * BS
        for a, b in zip(kv_a, kv_b):
            np.testing.assert_array_equal(b[10], a[1])
            np.testing.assert_array_equal(b[12], a[3])
            assert not b[11].any()
    finally:
        for part in (worker_a, worker_b, sched_a, sched_b):
            part.close()


def test_dead_node_means_recompute_not_a_stall() -> None:
    nodes = start_cluster("a")
    address = nodes["a"].address
    kv = engine(seed=4)
    sched, worker = make_pair(address, kv, "dead", load_timeout_s=1.0, lookup_timeout_s=0.5)
    nodes["a"].kill()
    try:
        start = time.monotonic()
        assert sched.matched_tokens("x", list(range(3 * BS + 1)), b"", 0) in (None, 0)
        wait_until(lambda: sched.matched_tokens("x", list(range(3 * BS + 1)), b"", 0) == 0, 5, "a miss")
        assert sched.stats.lookup_errors == 1
        from kvstore_vllm import LoadSpec

        worker.start_load([LoadSpec("x", block_keys(list(range(2 * BS)), BS), [5, 6])])
        worker.wait_layer()
        assert worker.take_load_errors() == {5, 6}
        assert worker.stats.load_errors == 1
        assert time.monotonic() - start < 5
    finally:
        worker.close()
        sched.close()


def test_request_finished_holds_blocks_until_the_save_is_done(cluster) -> None:  # type: ignore[no-untyped-def]
    prompt = list(range(600, 600 + 2 * BS + 3))
    kv = engine(seed=5)
    sched, worker = make_pair(cluster["a"].address, kv, "fin")
    gate = __import__("threading").Event()
    try:
        run_prefill(sched, worker, "f", prompt[:5], [0])   # too short to save anything
        assert sched.finished("f")[0] is False
        assert worker.finished_sending({"f"}) == set()
        ext = sched.matched_tokens("g", prompt, b"salt-g", 0)
        sched.after_alloc("g", ext)
        plan = sched.build_plan([("g", [4, 5, 6], ext)], [], {"g": len(prompt)})
        assert [len(s.keys) for s in plan.saves] == [2]
        worker.save(plan.saves, ready=lambda: gate.wait(10))  # the save waits on the gate
        still_saving, params = sched.finished("g")
        assert still_saving is True
        assert worker.finished_sending({"g"}) == set()     # blocks stay with the connector
        gate.set()
        assert worker.flush(10)
        assert worker.finished_sending(set()) == {"g"}     # reported once, in a later step
        assert worker.finished_sending(set()) == set()
        with KvClient(cluster["a"].address) as client:
            assert client.lookup(NS, block_keys(prompt, BS, b"salt-g")) == 2
            assert client.lookup(NS, block_keys(prompt, BS)) == 0  # the salt is in the keys
    finally:
        gate.set()
        worker.close()
        sched.close()


def _warm(address: str) -> bool:
    """The coordinator answers lookups itself (while it warms up after taking the role, its askers fall
    back to the standby, which keeps no claims)."""
    with grpc.insecure_channel(address) as channel:
        try:
            pb_grpc.ClusterStub(channel).ClusterLookup(pb.LookupRequest(namespace=NS, keys=[b"absent"]), timeout=5)
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.UNAVAILABLE:
                return False
            raise
    return True


def test_follower_waits_for_a_claimed_prefill_then_loads_it(cluster) -> None:  # type: ignore[no-untyped-def]
    """Engine A (node a) misses and claims its prefill; engine B (node b) gets a prompt sharing A's 4
    blocks while A computes: B defers (None), and once A's save lands B gets the whole prefix from the
    store (pulled from node a) instead of computing it."""
    prompt = list(range(900, 900 + 4 * BS + 7))
    kv_a, kv_b = engine(seed=6), engine()
    # A: 135 tokens at 27 tok/s claims 5 s; B's own prefill of the 4 blocks at 12.8 tok/s is 10 s
    sched_a, worker_a = make_pair(cluster["a"].address, kv_a, "claim-a", claims=True, prefill_tokens_per_s=27.0)
    sched_b, worker_b = make_pair(cluster["b"].address, kv_b, "claim-b", claims=True, prefill_tokens_per_s=12.8)
    try:
        wait_until(lambda: _warm(cluster["a"].address), 15, "the coordinator to answer lookups itself")
        wait_until(lambda: sched_a.matched_tokens("ra", prompt, b"", 0) is not None, 5, "A's lookup")
        assert sched_a.matched_tokens("ra", prompt, b"", 0) == 0 and sched_a.stats.claims == 1

        longer = prompt[:4 * BS] + [2000 + i for i in range(40)]
        wait_until(lambda: sched_b.matched_tokens("rb", longer, b"", 0) is None and sched_b.waiting("rb"), 5,
                   "B to defer for A's claim", lambda: sched_b.stats)
        wait = sched_b.waiting("rb")
        assert wait is not None and (wait.node, wait.length) == ("a", 4) and 0 < wait.ready_in_s <= 5.0
        for _ in range(5):                                 # still deferred while A computes
            assert sched_b.matched_tokens("rb", longer, b"", 0) is None
            time.sleep(0.05)

        sched_a.after_alloc("ra", 0)                       # A's prefill step: compute, then save (Put)
        plan = sched_a.build_plan([("ra", [3, 9, 4, 11, 2], 0)], [], {"ra": len(prompt)})
        worker_a.start_load(plan.loads)
        worker_a.save(plan.saves)
        assert worker_a.flush(10) and worker_a.stats.saved_blocks == 4

        wait_until(lambda: sched_b.matched_tokens("rb", longer, b"", 0) is not None, 9, "B's wait to end",
                   lambda: sched_b.stats)
        assert sched_b.matched_tokens("rb", longer, b"", 0) == 4 * BS   # the whole shared prefix
        assert (sched_b.stats.claim_waits, sched_b.stats.claim_waits_landed) == (1, 1)
        sched_b.after_alloc("rb", 4 * BS)
        plan = sched_b.build_plan([("rb", [7, 0, 15, 20, 1, 5], 4 * BS)], [], {"rb": len(longer) - 4 * BS})
        worker_b.start_load(plan.loads)
        worker_b.wait_layer("layer.0")
        assert worker_b.take_load_errors() == set() and worker_b.stats.loaded_tokens == 4 * BS
        for a, b in zip(kv_a, kv_b):                       # B's blocks hold A's KV, pulled from node a
            for src, dst in zip([3, 9, 4, 11], [7, 0, 15, 20]):
                np.testing.assert_array_equal(b[dst], a[src])
    finally:
        for part in (worker_a, worker_b, sched_a, sched_b):
            part.close()


def test_names_and_salts_are_stable() -> None:
    assert NS == namespace_for("vllm", "/models/tiny llama", "float32", 2, 2, 16, 32, "cpu", 0, 1)
    assert NS.startswith("vllm.tiny-llama-") and NS.endswith(".float32.L2H2D16B32.cpu.tp0of1")
    other = namespace_for("vllm", "/models/tiny llama", "bfloat16", 2, 2, 16, 32, "cpu", 0, 1)
    assert other != NS
    assert namespace_for("vllm", "m", "f", 1, 1, 1, 16, "cuda", 1, 2) != namespace_for("vllm", "m", "f", 1, 1, 1, 16,
                                                                                        "cuda", 0, 2)
    tokens = list(range(64))
    assert block_keys(tokens, 32, request_salt("tenant-1")) != block_keys(tokens, 32, request_salt("tenant-2"))
    assert block_keys(tokens, 32, request_salt(None)) == block_keys(tokens, 32)
    with pytest.raises(ValueError, match="unknown kvstore connector setting"):
        ConnectorConfig.from_dict({"address": "h:1", "lease_tll_s": 3})
    cfg = ConnectorConfig.from_dict({"kvstore_address": "h:1", "lease_ttl_s": "7", "record": "false"})
    assert (cfg.lease_ttl_s, cfg.record) == (7.0, False)
