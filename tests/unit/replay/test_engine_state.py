"""What the replay's engines keep between requests (kvstore.replay.serve.EngineState): pure, no sockets."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvstore.replay.costmodel import CostModel
from kvstore.replay.metrics import RequestRecord
from kvstore.replay.serve import EngineState, Get, Lookup, Op, Prefill, Rules, Serve, advance, serve
from kvstore.v1 import kvstore_pb2 as pb


def engine(cache_blocks: int | None = None) -> EngineState:
    cost = CostModel.preset("llama3-70b-tp8")
    if cache_blocks is not None:  # a smaller GPU: its KV cache holds fewer blocks
        hw = replace(cost.hw, hbm_bytes=(cost.model.weight_bytes + cache_blocks * cost.page_bytes) / cost.gpus / 0.9)
        cost = replace(cost, hw=hw)
    return EngineState(index=0, node_id="n0", rules=Rules(cost=cost, speedup=1.0))


def test_the_engine_cache_holds_what_its_gpus_leave_for_kv() -> None:
    assert CostModel.preset("llama3-70b-tp8").engine_cache_blocks == 2591  # (640 GB x 0.9 - 141 GB) / 160 MiB
    e = engine(cache_blocks=4)
    assert e.rules.cost.engine_cache_blocks == 4
    e.remember([b"a", b"b", b"c"])
    e.remember([b"a", b"d", b"e"])          # a is used again; b, the least recently used, goes
    assert e.cached_prefix([b"a", b"b"]) == 1 and e.cached_prefix([b"a", b"d", b"e", b"x"]) == 3
    assert e.cached_prefix([b"c"]) == 1 and e.cached_prefix([b"b"]) == 0


def test_a_request_queued_behind_its_engines_own_prefill_of_a_prefix_will_find_it() -> None:
    e = engine()
    e.remember([b"a"])
    e.queued.update([b"b", b"c"])           # a request ahead computes b, c
    assert e.prefix_ahead([b"a", b"b", b"c", b"d"]) == 3
    assert e.prefix_ahead([b"b"]) == 1 and e.prefix_ahead([b"x", b"a"]) == 0


def test_the_backlog_counts_what_is_left_of_the_prefill_on_the_unit() -> None:
    e = engine()
    e.backlog_s = 3.0                       # 1 s queued, 2 s on the unit since t = 10
    e.running, e.running_end = RequestRecord(idx=0, t=10.0, prefill_s=2.0), 12.0
    assert e.backlog(10.0) == pytest.approx(3.0)
    assert e.backlog(11.5) == pytest.approx(1.5)
    assert e.backlog(13.0) == pytest.approx(1.0)  # past its end (not yet removed): only the queue
    e.backlog_s = 1.0                       # the books off by a rounding: never below nothing
    assert e.backlog(13.0) == 0.0


def test_a_request_joins_the_pull_of_its_prefix_another_request_on_its_engine_started() -> None:
    """The first request of a prefix on an engine pulls it (faster than computing); a second one arriving
    while that pull runs sees the holder's egress shared by two (slower than computing) but Gets the same
    pages, joining the pull in flight, instead of putting a whole prefill ahead of the first's short one."""
    e = engine()
    keys = [bytes([i]) for i in range(9)]  # 8 shared blocks and one of its own
    cost = e.rules.cost
    pull_s = 8 * cost.page_bytes / e.rules.link_bytes_s
    assert pull_s < cost.prefill_s(8 * cost.block_tokens) < 2 * pull_s

    def answer(ahead: int) -> tuple[int, list[pb.NodePrefix], list[pb.TierRun]]:
        return 0, [pb.NodePrefix(node_id="n1", prefix_length=8, copies_ahead=ahead)], []

    def first_ops(rec: RequestRecord) -> tuple[Serve, Op | None]:
        gen = serve(e, rec, keys, None, 0.0, lambda: 0.0)
        assert isinstance(advance(gen, None, None), Lookup)
        return gen, advance(gen, answer(1 if e.fetching else 0), None)

    tokens = 9 * cost.block_tokens
    first, op = first_ops(RequestRecord(idx=0, t=0.0, blocks=9, input_tokens=tokens))
    assert isinstance(op, Get) and op.keys == keys[:8]  # pulls: faster than computing
    assert e.prefix_fetching(keys, 0) == 8
    second, op = first_ops(RequestRecord(idx=1, t=0.0, blocks=9, input_tokens=tokens))
    assert isinstance(op, Get) and op.keys == keys[:8]  # joins it
    assert isinstance(advance(first, (8, 0), None), Prefill)
    assert isinstance(advance(second, (8, 0), None), Prefill)
    assert not e.fetching  # both Gets ended: nothing left marked as on its way
    # the same answer with no pull of this engine in flight (the holder busy with another node's): computes
    third = serve(e, RequestRecord(idx=2, t=0.0, blocks=9, input_tokens=tokens), keys, None, 0.0, lambda: 0.0)
    advance(third, None, None)
    assert isinstance(advance(third, answer(1), None), Prefill)
