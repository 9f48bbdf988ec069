"""The engine connectors' side of in-flight prefill claims without sockets: the wait rule
(kvstore_client.claims), the vLLM connector's decision from a Lookup answer (claim_wait) and its
scheduler state machine over a scripted client, and the SGLang backend's claim (where SGLang is
installed). The same flow on real kvstored processes: tests/integration/test_vllm_connector_core.py."""

from __future__ import annotations

import importlib.util
import math
import time
from collections.abc import Callable

import pytest

from kvstore.v1 import kvstore_pb2 as pb
from kvstore_client import claims
from kvstore_vllm import ConnectorConfig, SchedulerCore, claim_wait

BS = 32
PAGE = 1 << 20            # bytes per block
LINK = 1e9                # bytes/s: one block's copy is ~1 ms
TPS = 1000.0              # prefill tokens/s: one block is 32 ms


def entry(node: str, length: int, *, pending: bool = False, computing: bool = False, ready: float = 0.0,
          ahead: int = 0) -> pb.NodePrefix:
    return pb.NodePrefix(node_id=node, address=f"{node}:1", prefix_length=length, pending=pending or computing,
                         computing=computing, ready_in_seconds=ready, copies_ahead=ahead)


def rule(nodes: list[pb.NodePrefix], local: int = 0, me: str = "b", **kw) -> claims.Wait | None:  # type: ignore[no-untyped-def]
    args = dict(block_tokens=BS, page_bytes=PAGE, prefill_tokens_per_s=TPS, link_bytes_per_s=LINK) | kw
    return claims.wait_for(nodes, me, local, **args)


# ---- the rule --------------------------------------------------------------------------------
def test_worth_waiting_and_claim_seconds() -> None:
    assert claims.worth_waiting(1.0, 0.5, 2.0) and not claims.worth_waiting(1.0, 1.0, 2.0)
    assert claims.worth_waiting(1.0, 1.0, 2.0, margin=1.5)
    assert claims.claim_seconds(1000, 1000.0) == 1.0
    assert claims.claim_seconds(1000, 1000.0, backlog_tokens=3000) == 4.0
    assert claims.claim_seconds(10**9, 1000.0, max_s=60) == 60        # the daemon refuses more
    assert claims.claim_seconds(0, 1000.0) == 0.0 and claims.claim_seconds(100, 0.0) == 0.0
    assert claims.prefill_s(10, 0.0) == math.inf


def test_wait_for_a_remote_claim_when_ready_plus_copy_beats_own_prefill() -> None:
    # 8 blocks: own prefill 0.256 s; ready in 0.1 s, the copy 8 ms
    wait = rule([entry("a", 8, computing=True, ready=0.1)])
    assert wait == claims.Wait(node="a", length=8, ready_in_s=0.1, budget_s=pytest.approx(0.256),
                               prefill_s=pytest.approx(0.256))
    assert rule([entry("a", 8, computing=True, ready=0.3)]) is None            # later than computing it
    # the copy waits behind 40 waves to other waiters: 8 ms x 41 > what is left
    assert rule([entry("a", 8, computing=True, ready=0.1, ahead=40)]) is None
    assert rule([entry("a", 8, computing=True, ready=0.1)], link_bytes_per_s=0) is None  # no link: never
    # queued prefill here makes computing slower, so waiting pays for a later claim
    assert rule([entry("a", 8, computing=True, ready=0.3)], backlog_tokens=200) is not None
    # a margin over 1 counts in full once a prefill's worth is queued, not at all with nothing queued
    late = [entry("a", 8, computing=True, ready=0.6)]                       # own: 0.256 + 0.256 queued
    assert rule(late, backlog_tokens=256) is None and rule(late, margin=1.5) is None
    assert rule(late, backlog_tokens=256, margin=1.5).budget_s == pytest.approx(1.5 * 0.512)  # type: ignore[union-attr]
    assert rule(late, backlog_tokens=128, margin=1.5) is None               # m = 1.25: 0.48 s
    assert claims.scaled_margin(2.0, 0.0, 1.0) == 1.0 and claims.scaled_margin(2.0, 5.0, 1.0) == 2.0
    assert claims.scaled_margin(0.8, 5.0, 1.0) == 0.8
    assert rule([entry("a", 8, computing=True, ready=0.1)], prefill_tokens_per_s=0) is None


def read(nodes: list[pb.NodePrefix], local: int = 0, me: str = "b", link: float = LINK) -> int:
    return claims.worth_reading(nodes, me, local, page_bytes=PAGE, link_bytes_per_s=link,
                                prefill_blocks_s=lambda blocks: claims.prefill_s(blocks * BS, TPS))


def test_read_pulls_a_held_prefix_only_where_the_pull_beats_computing_it() -> None:
    """Load or recompute, pure: a block's copy ~1 ms against 32 ms of prefill here."""
    assert read([entry("a", 8)]) == 8                               # 8 ms of copies against 256 ms of prefill
    assert read([entry("a", 8)], local=3) == 8 and read([entry("a", 2)], local=3) == 3
    assert read([entry("a", 8)], link=PAGE / 0.040) == 0            # a slow link: a block's copy is 40 ms
    # recomputing is faster than a pull that shares its holder with 40 others (41 ms a block): no pull
    assert read([entry("a", 8, ahead=40)]) == 0
    assert read([entry("a", 8, ahead=28)]) == 8                     # 30 ms a block: still pulls
    # a less contended holder of a shorter prefix is read when the deeper one is not worth it
    assert read([entry("a", 8, ahead=40), entry("c", 4)]) == 4
    assert read([entry("a", 8, pending=True)]) == 0                 # a copy in flight is not held yet
    assert read([entry("b", 8)]) == 0 and read([entry("a", 8)], link=0) == 0
    # a copy tree's copy on its way here that the engine did not wait for: a pull would race it, compute
    assert read([entry("a", 8), entry("b", 8, pending=True)]) == 0
    assert read([entry("a", 8), entry("b", 8, pending=True)], local=3) == 3


def test_in_a_cell_where_recomputing_wins_nobody_pulls_or_waits_and_where_it_loses_all_do() -> None:
    """The two sides of one comparison: a burst's followers over a slow link for a short prefix
    compute; over a fast link for a long one they read and wait."""
    short_slow = dict(link_bytes_per_s=PAGE / 0.040)
    for ahead in range(8):
        assert read([entry("a", 4, ahead=ahead)], link=PAGE / 0.040) == 0
        assert rule([entry("a", 4, computing=True, ready=0.05, ahead=ahead)], **short_slow) is None
    for ahead in range(8):
        assert read([entry("a", 64, ahead=ahead)]) == 64
        assert rule([entry("a", 64, computing=True, ready=0.5, ahead=ahead)]) is not None


def test_a_tier_run_is_read_only_where_its_load_beats_computing_it() -> None:
    """Load or recompute below the pool: 10 ms of prefill a block; the pool's blocks are always read, a disk
    run only while its load (after the runs before it) costs less than computing its blocks."""
    def prefill(blocks: int) -> float:
        return 0.010 * blocks

    # a disk run at 2 ms a block: read (the 70B presets' case: 3.3 ms from NVMe against 18 ms of prefill)
    assert claims.worth_loading([(4, 0.0), (6, 0.012)], 10, prefill_blocks_s=prefill) == 10
    # the drive is busy: 6 blocks would take 0.2 s to come up; computing them takes 0.06 s
    assert claims.worth_loading([(4, 0.0), (6, 0.2)], 10, prefill_blocks_s=prefill) == 4
    # a slow run first, then a long cheap one: reading through both still beats computing all of them
    assert claims.worth_loading([(1, 0.015), (20, 0.0)], 21, prefill_blocks_s=prefill) == 21
    # everything below the pool and slow: compute the whole prompt
    assert claims.worth_loading([(5, 1.0)], 5, prefill_blocks_s=prefill) == 0
    # no runs (no tiers): every local block; runs past local are cut at it
    assert claims.worth_loading([], 7, prefill_blocks_s=prefill) == 7
    assert claims.worth_loading([(3, 0.0), (9, 0.0)], 5, prefill_blocks_s=prefill) == 5


def test_wait_for_skips_what_is_held_and_picks_the_deepest() -> None:
    held = [entry("c", 8), entry("a", 8, computing=True, ready=0.01)]
    assert rule(held) is None                                   # c holds it already: load it
    assert rule([entry("a", 8, pending=True)]) is None          # a speculative copy is not a claim
    both = [entry("a", 4, computing=True, ready=0.01), entry("c", 8, computing=True, ready=0.05)]
    assert rule(both).node == "c"                               # type: ignore[union-attr]
    # own prefill counts only the blocks past what the cluster holds (c holds 6 of 8: 64 ms)
    part = [entry("c", 6), entry("a", 8, computing=True, ready=0.07)]
    assert rule(part) is None and rule([entry("c", 6), entry("a", 8, computing=True, ready=0.05)]) is not None


def test_same_node_claim_has_no_copy() -> None:
    far = [entry("a", 8, computing=True, ready=0.25, ahead=3)]
    assert rule(far) is None                                    # 0.25 + 4 x 8 ms > 0.256
    assert rule([entry("b", 8, computing=True, ready=0.25, ahead=3)]) is not None  # on this node


def test_incoming_copy_and_landed() -> None:
    coming = [entry("a", 8), entry("b", 8, pending=True)]
    assert claims.incoming(coming, "b", 2, block_tokens=BS, prefill_tokens_per_s=TPS) == claims.Wait(
        node="b", length=8, ready_in_s=0.0, budget_s=pytest.approx(6 * BS / TPS), computing=False,
        prefill_s=pytest.approx(6 * BS / TPS))
    assert claims.incoming(coming, "b", 8, block_tokens=BS, prefill_tokens_per_s=TPS) is None
    assert claims.incoming([entry("b", 8, computing=True)], "b", 0, block_tokens=BS, prefill_tokens_per_s=TPS) is None
    # the coordinator's expected landing: wait when it beats computing the 6 blocks (0.192 s), not when later
    soon, late = [entry("b", 8, pending=True, ready=0.1)], [entry("b", 8, pending=True, ready=0.2)]
    assert claims.incoming(soon, "b", 2, block_tokens=BS, prefill_tokens_per_s=TPS).ready_in_s == 0.1  # type: ignore[union-attr]
    assert claims.incoming(late, "b", 2, block_tokens=BS, prefill_tokens_per_s=TPS) is None
    # with a prefill's worth queued, the claim margin applies as to a wait for a claim: 0.5 s against
    # (0.192 + 0.192) x 2; with nothing queued, no margin
    later = [entry("b", 8, pending=True, ready=0.5)]
    kw = dict(block_tokens=BS, prefill_tokens_per_s=TPS, margin=2.0)
    assert claims.incoming(later, "b", 2, backlog_tokens=6 * BS, **kw).budget_s == pytest.approx(4 * 6 * BS / TPS)  # type: ignore[union-attr,arg-type]
    assert claims.incoming(later, "b", 2, backlog_tokens=0, **kw) is None  # type: ignore[arg-type]
    assert claims.incoming(late, "b", 2, block_tokens=BS, prefill_tokens_per_s=TPS, backlog_tokens=64) is not None
    # landed: held elsewhere (pull it) -- unless a copy is on its way here; own claim: only here counts
    assert claims.landed([entry("a", 8)], "b", 0, 8, "a")
    assert not claims.landed([entry("a", 8, computing=True)], "b", 0, 8, "a")
    assert not claims.landed(coming, "b", 0, 8, "a")
    assert claims.landed(coming, "b", 8, 8, "a")
    assert not claims.landed([entry("a", 8)], "b", 3, 8, "b") and claims.landed([], "b", 8, 8, "b")
    assert claims.still_coming([entry("a", 8, computing=True)], "b", 8, "a")
    assert claims.still_coming(coming, "b", 8, "a") and not claims.still_coming([entry("a", 8)], "b", 8, "a")
    assert not claims.still_coming([entry("a", 5, computing=True)], "b", 8, "a")
    # the waiter's own claim of its suffix (its own entry, computing, deeper) is not the awaited one
    assert not claims.still_coming([entry("b", 9, computing=True)], "b", 8, "a")
    assert claims.still_coming([entry("b", 9, computing=True)], "b", 8, "b")  # a claimant on this node


def test_look_again_is_an_eighth_of_what_is_left() -> None:
    def again(nodes: list[pb.NodePrefix], wait: claims.Wait, local: int = 0, floor: float = 0.001) -> float:
        return claims.look_again_s(nodes, "b", local, wait, page_bytes=PAGE, link_bytes_per_s=LINK, floor_s=floor)

    remote = claims.Wait(node="a", length=8, ready_in_s=0.8, budget_s=2.0)
    copy = 8 * PAGE / LINK
    # a prefill on another node: its ready time, then one copy of the blocks this node lacks
    assert again([entry("a", 8, computing=True, ready=0.8)], remote) == pytest.approx((0.8 + copy) / 8)
    assert again([entry("a", 8, computing=True, ready=0.8)], remote, local=6) == pytest.approx((0.8 + copy / 4) / 8)
    # its Put landed and a copy tree brings it here: the coordinator's expected landing counts
    assert again([entry("a", 8), entry("b", 8, pending=True, ready=0.4)], remote) == pytest.approx((0.4 + copy) / 8)
    # on this node: no copy; a copy on its way here: its own entry's ready time
    own = claims.Wait(node="b", length=8, ready_in_s=0.8, budget_s=2.0)
    assert again([entry("b", 8, computing=True, ready=0.8)], own) == pytest.approx(0.1)
    incoming = claims.Wait(node="b", length=8, ready_in_s=0.4, budget_s=2.0, computing=False)
    assert again([entry("a", 8), entry("b", 8, pending=True, ready=0.4)], incoming) == pytest.approx(0.05)
    # nothing left to expect: the floor; and never below it
    assert again([entry("a", 8)], own) == 0.001
    assert again([entry("b", 8, computing=True, ready=0.08)], own, floor=0.02) == 0.02
    # another node's pending entry is not the awaited one
    assert again([entry("c", 8, pending=True, ready=5.0)], own) == 0.001
    # a copy due long after: still at least 8 looks over this engine's own prefill of the blocks (the
    # prefix may come sooner: another request here computed it)
    slow = claims.Wait(node="b", length=8, ready_in_s=6.0, budget_s=9.0, computing=False, prefill_s=0.8)
    assert again([entry("b", 8, pending=True, ready=6.0)], slow) == pytest.approx(0.1)
    # a tree's copy due sooner than the floor is looked for when it is due (a pull would land that
    # soon); past due (ready 0), or not coming here, the floor holds
    assert again([entry("a", 8), entry("b", 8, pending=True, ready=0.004)], incoming, floor=0.01) == 0.004
    assert again([entry("a", 8), entry("b", 8, pending=True, ready=0.0)], incoming, floor=0.01) == 0.01
    assert again([entry("a", 8), entry("b", 8, pending=True, ready=0.004)], incoming, local=8, floor=0.01) == 0.01


def test_read_after_a_spent_wait_pulls_what_landed_when_that_beats_computing_it() -> None:
    def after(nodes: list[pb.NodePrefix], local: int = 0, base: int = 0, link: float = LINK) -> int:
        return claims.read_after_wait(nodes, local, base, page_bytes=PAGE, link_bytes_per_s=link,
                                      prefill_blocks_s=lambda b: claims.prefill_s(b * BS, TPS))
    # the claimant's Put landed while a tree copy to this node is still on its way: 8 blocks cost 8 ms
    # to pull and 256 ms to compute, so read them
    assert after([entry("a", 8), entry("b", 8, pending=True)]) == 8
    assert after([entry("a", 8)], local=2, base=3) == 8
    # nothing landed yet (the claimant still computes, or its Put is in flight): compute after base
    assert after([entry("a", 8, computing=True)], base=3) == 3
    assert after([entry("a", 8, pending=True)], local=1, base=1) == 1
    assert after([], local=4, base=4) == 4
    # the pull shares its source with the copies in flight: 40 of them (8 blocks each, 40 x 8 ms) take
    # longer than computing the 8 blocks (256 ms), 20 do not
    tree = [entry(f"t{i}", 8, pending=True) for i in range(40)]
    assert after([entry("a", 8), *tree]) == 0 and after([entry("a", 8), *tree[:20]]) == 8
    # a link too slow for the pull to beat the prefill: compute (1 MB/s: 8 s against 256 ms)
    assert after([entry("a", 8)], base=0, link=1e6) == 0
    assert after([entry("a", 8)], base=0, link=0.0) == 0


# ---- the vLLM connector's decision ----------------------------------------------------------
def cfg(**kw) -> ConnectorConfig:  # type: ignore[no-untyped-def]
    base = dict(address="h:1", claims=True, prefill_tokens_per_s=TPS, link_bytes_per_s=LINK,
                claim_poll_ms=0.0)
    return ConnectorConfig(**(base | kw))


def reply(*nodes: pb.NodePrefix, local: int = 0, lease: str = "") -> pb.LookupResponse:
    return pb.LookupResponse(prefix_length=local, nodes=list(nodes), lease_id=lease)


def test_claim_wait_follows_the_knobs() -> None:
    answer = reply(entry("a", 8, computing=True, ready=0.1))
    kw = dict(block_size=BS, page_bytes=PAGE)
    assert claim_wait(cfg(), answer, "b", **kw).node == "a"                       # type: ignore[union-attr]
    assert claim_wait(cfg(claims=False, prefill_tokens_per_s=0), answer, "b", **kw) is None
    assert claim_wait(cfg(load=False), answer, "b", **kw) is None
    assert claim_wait(cfg(), answer, "b", engine_blocks=8, **kw) is None          # vLLM's own cache has it
    assert claim_wait(cfg(claim_max_wait_s=0), answer, "b", **kw) is None
    assert claim_wait(cfg(link_bytes_per_s=1e6), answer, "b", **kw) is None       # an 8 s copy
    assert claim_wait(cfg(), reply(entry("a", 8), entry("b", 8, pending=True)), "b", **kw).computing is False  # type: ignore[union-attr]


def test_config_claim_knobs_are_validated() -> None:
    assert ConnectorConfig(address="h:1").claims is False                          # off by default
    with pytest.raises(ValueError, match="prefill_tokens_per_s"):
        ConnectorConfig(address="h:1", claims=True)
    for bad in ({"claim_margin": 0}, {"link_bytes_per_s": -1}, {"claim_max_wait_s": math.nan},
                {"max_claim_seconds": 0}):
        with pytest.raises(ValueError):
            ConnectorConfig(address="h:1", **bad)
    got = ConnectorConfig.from_dict({"address": "h:1", "claims": "true", "prefill_tokens_per_s": "2e4",
                                     "kvstore_claim_margin": "1.5"})
    assert (got.claims, got.prefill_tokens_per_s, got.claim_margin) == (True, 2e4, 1.5)


# ---- the vLLM scheduler's state machine over a scripted client -------------------------------
class _Call:
    def __init__(self, answer: pb.LookupResponse | None) -> None:
        self.answer, self.cancelled = answer, False

    def done(self) -> bool:
        return self.answer is not None

    def result(self, timeout: float | None = None) -> pb.LookupResponse:
        assert self.answer is not None
        return self.answer

    def cancel(self) -> bool:
        self.cancelled = True
        return True


class ScriptedClient:
    """``lookup_lease_future`` answers with ``script(call)``; every call is kept."""

    def __init__(self, script: Callable[[dict], pb.LookupResponse | None], node_id: str = "b") -> None:  # type: ignore[type-arg]
        self.script, self.node_id, self.calls = script, node_id, []   # type: ignore[var-annotated]

    def lookup_lease_future(self, namespace, keys, *, ttl, lease_id="", record=False, timeout=None,  # type: ignore[no-untyped-def]
                            claim_seconds=0.0):
        call = dict(keys=list(keys), ttl=ttl, lease_id=lease_id, record=record, claim_seconds=claim_seconds)
        self.calls.append(call)
        return _Call(self.script(call))

    def node_info(self) -> pb.NodeInfoResponse:
        return pb.NodeInfoResponse(node_id=self.node_id)

    def page_bytes(self, namespace: str) -> int:
        return PAGE

    def close(self) -> None:
        pass


PROMPT = list(range(8 * BS + 5))     # 8 full blocks and a tail


def core(client: ScriptedClient, **kw) -> SchedulerCore:  # type: ignore[no-untyped-def]
    return SchedulerCore(cfg(**kw), "ns", BS, "eng", client_factory=lambda: client)  # type: ignore[arg-type,return-value]


def test_claimant_passes_claim_seconds_once_and_computes() -> None:
    client = ScriptedClient(lambda call: reply())
    sched = core(client)
    assert sched.matched_tokens("r", PROMPT, b"", 0) == 0
    assert sched.matched_tokens("r", PROMPT, b"", 0) == 0
    [call] = client.calls
    assert call["record"] and call["lease_id"] == "eng/r" and call["ttl"] > 0
    assert call["claim_seconds"] == pytest.approx(len(PROMPT) / TPS)
    assert sched.stats.claims == 1 and sched.stats.claim_waits == 0
    # the next request's claim waits behind r's prefill queued on this engine
    assert sched.matched_tokens("s", PROMPT[:BS + 3], b"", 2 * 0) == 0
    assert client.calls[1]["claim_seconds"] == pytest.approx((len(PROMPT) + BS + 3) / TPS)
    # no claim when the engine does not save what it computes, nor with claims off
    for kw in ({"save": False}, {"claims": False}):
        quiet = ScriptedClient(lambda call: reply())
        assert core(quiet, **kw).matched_tokens("r", PROMPT, b"", 0) == 0
        assert quiet.calls[0]["claim_seconds"] == 0.0


def test_follower_defers_until_the_claim_lands_then_gets_the_hit() -> None:
    state = {"stored": False}

    def script(call: dict) -> pb.LookupResponse | None:  # type: ignore[type-arg]
        if call["ttl"] > 0:
            return reply(entry("a", 8, computing=True, ready=0.0), lease="L1")
        if not state["stored"]:
            return reply(entry("a", 8, computing=True, ready=0.0))
        return reply(entry("a", 8))

    client = ScriptedClient(script)
    sched = core(client)
    for _ in range(3):
        assert sched.matched_tokens("f", PROMPT, b"", 0) is None                  # deferred
    assert sched.waiting("f") is not None and sched.waiting("f").node == "a"      # type: ignore[union-attr]
    state["stored"] = True
    got = None
    for _ in range(5):  # re-looks come an eighth of the copy (1 ms here) apart
        time.sleep(0.002)
        got = sched.matched_tokens("f", PROMPT, b"", 0)
        if got is not None:
            break
    assert got == 8 * BS
    assert sched.matched_tokens("f", PROMPT, b"", 0) == 8 * BS                    # answered: no more RPCs
    leasing = [c for c in client.calls if c["ttl"] > 0]
    polls = [c for c in client.calls if c["ttl"] == 0]
    assert len(leasing) == 1 and polls and not any(c["record"] or c["claim_seconds"] or c["lease_id"] for c in polls)
    assert (sched.stats.claim_waits, sched.stats.claim_waits_landed) == (1, 1)
    sched.after_alloc("f", 8 * BS)
    plan = sched.build_plan([("f", list(range(9)), 8 * BS)], [], {"f": 5})
    assert [(len(s.keys), s.lease_id) for s in plan.loads] == [(8, "L1")]        # the first Lookup's lease
    assert plan.saves == []                                                       # held: not saved again


def test_follower_gives_up_at_the_budget_or_when_the_claim_vanishes() -> None:
    computing = reply(entry("a", 8, computing=True, ready=0.0))
    client = ScriptedClient(lambda call: computing)
    sched = core(client, claim_max_wait_s=0.05)
    assert sched.matched_tokens("t", PROMPT, b"", 0) is None
    time.sleep(0.06)
    assert sched.matched_tokens("t", PROMPT, b"", 0) == 0                         # computes it itself
    assert (sched.stats.claim_waits, sched.stats.claim_waits_landed) == (1, 0)

    # a wait that overran, with a holder known now (its copy here still on the way): pulling the 7
    # blocks (7 ms) beats computing them (224 ms), so it loads them (the rule, slow links included:
    # test_read_after_a_spent_wait_pulls_what_landed_when_that_beats_computing_it)
    late = iter([computing, reply(entry("a", 8), entry("b", 8, pending=True), local=1)])
    client = ScriptedClient(lambda call: next(late, None))
    sched = core(client, claim_max_wait_s=0.05)
    assert sched.matched_tokens("u", PROMPT, b"", 0) is None
    assert sched.matched_tokens("u", PROMPT, b"", 0) is None                      # not landed: a copy comes
    time.sleep(0.06)
    assert sched.matched_tokens("u", PROMPT, b"", 0) == 8 * BS

    # then the claim expires; the follower's own claim of its suffix (its own entry) does not hold it
    answers = iter([computing, computing, reply(entry("b", 9, computing=True))])
    gone = ScriptedClient(lambda call: next(answers))
    sched = core(gone)
    results = []
    for _ in range(4):
        results.append(sched.matched_tokens("v", PROMPT, b"", 0))
        time.sleep(0.002)  # past the next re-look (an eighth of the 8 ms copy)
    assert results[0] is None and results[-1] == 0 and len(gone.calls) == 3
    assert sched.stats.claim_waits_landed == 0


def test_finished_cancels_a_re_lookup_in_flight() -> None:
    client = ScriptedClient(lambda call: reply(entry("a", 8, computing=True)) if call["ttl"] else None)
    sched = core(client)
    assert sched.matched_tokens("x", PROMPT, b"", 0) is None
    assert sched.matched_tokens("x", PROMPT, b"", 0) is None                      # the re-lookup is in flight
    poll = sched._reqs["x"].poll
    assert poll is not None
    sched.finished("x")
    assert poll.cancelled                                                         # type: ignore[attr-defined]


# ---- SGLang: the claim on batch_exists --------------------------------------------------------
@pytest.mark.skipif(importlib.util.find_spec("sglang") is None, reason="SGLang is not installed")
def test_sglang_backend_claims_what_it_will_compute() -> None:
    from kvstore_sglang.backend import KvstoreHiCacheStorage

    class Client:
        def __init__(self) -> None:
            self.calls: list[tuple[list[bytes], float]] = []

        def lookup_nodes(self, namespace, keys, *, record=False, claim_seconds=0.0):  # type: ignore[no-untyped-def]
            self.calls.append((list(keys), claim_seconds))
            return reply(local=2)

    backend = KvstoreHiCacheStorage.__new__(KvstoreHiCacheStorage)
    backend.namespace, backend._ready, backend.client = "ns", True, Client()
    backend.claims, backend.prefill_tokens_per_s, backend.max_claim_seconds = True, 100.0, 600.0
    backend.page_tokens = 4
    assert backend.batch_exists([f"k{i}" for i in range(6)]) == 2
    [(keys, seconds)] = backend.client.calls
    assert len(keys) == 6 and seconds == pytest.approx(6 * 4 / 100.0)  # every page of the batch, at most
    backend.claims = False
    assert backend.batch_exists(["k0"]) == 2 and backend.client.calls[-1][1] == 0.0


def test_the_connector_loads_a_remote_prefix_only_where_pulling_it_beats_computing_it() -> None:
    """vLLM's scheduler, with and without claims: a holder serving 40 other pulls (41 ms a block against
    32 ms of prefill) is not read; an idle one is; without a throughput every held block is loaded."""
    for claims_on in (True, False):
        busy = ScriptedClient(lambda call: reply(entry("a", 8, ahead=40)))
        assert core(busy, claims=claims_on).matched_tokens("r", PROMPT, b"", 0) == 0
        idle = ScriptedClient(lambda call: reply(entry("a", 8)))
        assert core(idle, claims=claims_on).matched_tokens("r", PROMPT, b"", 0) == 8 * BS
    unknown = ScriptedClient(lambda call: reply(entry("a", 8, ahead=40)))
    assert core(unknown, claims=False, prefill_tokens_per_s=0).matched_tokens("r", PROMPT, b"", 0) == 8 * BS


def test_the_connector_loads_its_own_tier_runs_only_where_loading_beats_computing() -> None:
    """vLLM's scheduler, on a node holding 8 blocks: 3 in its pool, 5 on disk. At 2 ms a block from disk
    (32 ms of prefill a block) it loads all 8; with the drive busy (1 s for the 5) only the pool's 3;
    without a throughput every held block is loaded."""
    def answer(disk_s: float) -> pb.LookupResponse:
        out = reply(local=8)
        out.tiers.extend([pb.TierRun(tier="pool", pages=3), pb.TierRun(tier="disk0", pages=5, load_seconds=disk_s)])
        return out

    for claims_on in (True, False):
        assert core(ScriptedClient(lambda call: answer(0.010)), claims=claims_on).matched_tokens(
            "r", PROMPT, b"", 0) == 8 * BS
        assert core(ScriptedClient(lambda call: answer(1.0)), claims=claims_on).matched_tokens(
            "r", PROMPT, b"", 0) == 3 * BS
    assert core(ScriptedClient(lambda call: answer(1.0)), claims=False, prefill_tokens_per_s=0).matched_tokens(
        "r", PROMPT, b"", 0) == 8 * BS
    # the load of the 5 from disk gives the node their prefill (160 ms) to bring them up: what its disk was
    # given since the Lookup cannot keep the engine waiting longer than computing them (the pool's alone: none)
    for disk_s, deadline in ((0.010, 5 * BS / TPS), (1.0, 0.0)):
        c = core(ScriptedClient(lambda call: answer(disk_s)), claims=False)
        ext = c.matched_tokens("r", PROMPT, b"", 0)
        c.after_alloc("r", ext)
        (load,) = c.build_plan([("r", list(range(9)), ext)], [], {"r": len(PROMPT) - ext}).loads
        assert len(load.keys) == ext // BS and load.deadline_s == pytest.approx(deadline)


def test_the_connector_joins_a_pull_another_request_of_its_engine_started() -> None:
    """vLLM's scheduler: a first request pulls 8 blocks from an idle holder; a second one with the same
    prompt, answered while that pull runs (the holder now counted busy, 41 ms a block against 32 ms of
    prefill), loads the same 8 blocks (its Get joins the pull on the node) instead of computing them.
    Once the first request finished, the same answer is not read; a different prompt never joins."""
    answers = iter([reply(entry("a", 8)), reply(entry("a", 8, ahead=40)), reply(entry("a", 8, ahead=40)),
                    reply(entry("a", 8, ahead=40))])
    c = core(ScriptedClient(lambda call: next(answers)), claims=False)
    assert c.matched_tokens("r1", PROMPT, b"", 0) == 8 * BS
    assert c.matched_tokens("r2", PROMPT, b"", 0) == 8 * BS
    other = [t + 10_000 for t in PROMPT]
    assert c.matched_tokens("r3", other, b"", 0) == 0
    c.finished("r1")
    c.finished("r2")
    assert c.matched_tokens("r4", PROMPT, b"", 0) == 0
    assert claims.joined([1, 2, 3, 4], 1, [([1, 2, 9], 3), ([1, 2, 3, 4], 2)]) == 2
    assert claims.joined([1, 2, 3], 0, []) == 0 and claims.joined([5], 1, [([6], 1)]) == 1
