"""What the replay's engines keep between requests (kvstore.replay.serve.EngineState): pure, no sockets."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvstore.replay.costmodel import CostModel
from kvstore.replay.metrics import RequestRecord
from kvstore.replay.serve import EngineState, Rules


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
