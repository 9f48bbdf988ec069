"""Scheduler side of the connector, free of vLLM imports.

Per request it holds the block keys, one leasing Lookup (issued without
blocking the scheduler loop, idempotent per request), what to load into
which blocks, and how far the prompt's blocks have been saved. Each step it
turns this into a :class:`StepPlan` that the worker side carries out.

With ``claims`` (docs/vllm.md "Prefill claims") the leasing Lookup also
claims the request's prefill, and a request whose Lookup shows another one
computing its prefix (:func:`claim_wait`) is deferred -- ``matched_tokens``
answers None, vLLM asks again next step -- while non-recording re-lookups
run, until the prefix is held, the claim vanishes, or the wait budget is
spent; then it loads what is held as usual.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvstore.errors import KvError
from kvstore.v1 import kvstore_pb2 as pb
from kvstore_client import KvClient
from kvstore_client import claims as claiming
from kvstore_client.sync import LookupFuture

from .config import ConnectorConfig
from .naming import block_keys
from .stats import ConnectorStats

log = logging.getLogger("kvstore_vllm")


@dataclass(frozen=True, slots=True)
class LoadSpec:
    """Load pages ``keys[i]`` into engine blocks ``block_ids[i]``."""

    req_id: str
    keys: list[bytes]
    block_ids: list[int]
    lease_id: str = ""
    deadline_s: float = 0.0  # >0: of these pages, those only the node's tiers held are worth no more than
    # computing them: its Get gives the node this long (what does not land in time, vLLM recomputes)


@dataclass(frozen=True, slots=True)
class SaveSpec:
    """Store engine blocks ``block_ids[i]`` as pages ``keys[i]``."""

    req_id: str
    keys: list[bytes]
    block_ids: list[int]


@dataclass(slots=True)
class StepPlan:
    """What the workers do in one engine step (vLLM's connector metadata)."""

    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)


@dataclass(slots=True)
class NodeHint:
    """Where a prefix lives, for a router: from the request's Lookup."""

    node_id: str
    address: str
    prefix_blocks: int
    pending: bool
    expires_in_seconds: float


@dataclass(slots=True)
class _Request:
    keys: list[bytes]              # every full prompt block
    max_hit_blocks: int            # a hit leaves at least one prompt token to compute
    lease_key: str
    future: LookupFuture | None = None
    issued_at: float = 0.0
    hit_blocks: int | None = None  # answered
    lease_id: str = ""
    hints: list[NodeHint] = field(default_factory=list)
    local_tokens: int = 0          # vLLM's own prefix-cache hit at the lookup
    load_tokens: int = 0           # tokens to load (after allocation)
    block_ids: list[int] = field(default_factory=list)
    saved_blocks: int = 0          # prompt blocks [0, saved_blocks) are stored or known stored
    has_saves: bool = False
    prompt_tokens: int = 0
    progress: int = 0              # tokens computed after the last planned step
    # in-flight prefill claims
    wait: claiming.Wait | None = None   # deferred for this prefill (or copy) in flight
    waited: bool = False
    wait_started: float = 0.0
    wait_until: float = 0.0
    next_poll: float = 0.0
    poll: LookupFuture | None = None
    last_reply: pb.LookupResponse | None = None
    held_before: int = 0           # blocks the cluster held when the wait began
    pulls: bool = False            # its hit reads blocks another node holds (its load pulls them here)
    below_blocks: int = 0          # of its hit, blocks only the node's tiers below the pool held


class SchedulerCore:
    """The scheduler's connector state machine (see the module docstring)."""

    def __init__(self, config: ConnectorConfig, namespace: str, block_size: int, engine_id: str,
                 client_factory: Callable[[], KvClient] | None = None, stats: ConnectorStats | None = None) -> None:
        self.config = config
        self.namespace = namespace
        self.block_size = block_size
        self.engine_id = engine_id
        self.stats = stats or ConnectorStats()
        self._client_factory = client_factory or (lambda: KvClient(
            config.address, data_path=config.data_path, **config.client_options))
        self._client: KvClient | None = None
        self._reqs: dict[str, _Request] = {}
        self._claim_ctx: tuple[str, int] | None = None   # (this node's id, page bytes), once known

    @property
    def client(self) -> KvClient:
        if self._client is None:
            self._client = self._client_factory()
        return self._client

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None

    # ---- get_num_new_matched_tokens ------------------------------------------
    def matched_tokens(self, req_id: str, prompt_token_ids: Sequence[int], salt: bytes,
                       num_computed_tokens: int) -> int | None:
        """Tokens beyond ``num_computed_tokens`` that can be loaded, or None
        while the Lookup is still in flight (ask again next step).

        The first call issues one leasing Lookup (``record`` set) and waits
        at most ``lookup_wait_ms`` for it; repeats reuse its answer, so they
        neither lease nor record again. With ``claims`` the Lookup claims the
        prefill, and while the request waits for another's claim this
        answers None (see the module docstring).
        """
        req = self._reqs.get(req_id)
        if req is None:
            keys = block_keys(prompt_token_ids, self.block_size, salt)
            req = _Request(keys=keys, max_hit_blocks=(len(prompt_token_ids) - 1) // self.block_size,
                           lease_key=f"{self.engine_id}/{req_id}", prompt_tokens=len(prompt_token_ids))
            self._reqs[req_id] = req
        req.local_tokens = num_computed_tokens
        if req.hit_blocks is None and not self._answer(req):
            return None
        assert req.hit_blocks is not None
        return max(0, req.hit_blocks * self.block_size - num_computed_tokens)

    def _answer(self, req: _Request) -> bool:
        """Advance the request's Lookup; True once ``hit_blocks`` is known."""
        lookup_keys = req.keys[:req.max_hit_blocks]
        if not self.config.load or not lookup_keys:
            req.hit_blocks = 0
            return True
        if req.wait is not None:
            return self._follow(req, lookup_keys)
        if req.future is None:
            self.stats.add(lookups=1)
            req.issued_at = time.monotonic()
            claim = self._claim_seconds(req)
            try:
                req.future = self.client.lookup_lease_future(
                    self.namespace, lookup_keys, ttl=self.config.lease_ttl_s, lease_id=req.lease_key,
                    record=self.config.record, timeout=self.config.lookup_timeout_s, claim_seconds=claim)
            except KvError as exc:
                return self._lookup_failed(req, exc)
            if claim:
                self.stats.add(claims=1)
        if not req.future.done():
            wait = self.config.lookup_wait_ms / 1000 - (time.monotonic() - req.issued_at)
            if wait <= 0:
                return False
            try:
                reply = req.future.result(timeout=wait)
            except KvError as exc:
                if req.future.done():
                    return self._lookup_failed(req, exc)
                return False
        else:
            try:
                reply = req.future.result()
            except KvError as exc:
                return self._lookup_failed(req, exc)
        req.future = None
        req.lease_id = reply.lease_id
        if self.config.claims and not req.waited and self._start_wait(req, reply):
            return False
        self._settle(req, reply)
        return True

    def _settle(self, req: _Request, reply: pb.LookupResponse, hit: int | None = None) -> None:
        """``hit_blocks`` from a Lookup's answer, or ``hit`` (the lease is the first Lookup's)."""
        if hit is None:
            hit = self._worth_reading(req, reply)
        req.hit_blocks = min(hit, req.max_hit_blocks)
        req.pulls = req.hit_blocks > int(reply.prefix_length)
        pooled = 0  # the leading blocks its node's pool (or staging) holds: the tiers' runs at no load time
        for run in reply.tiers:
            if run.load_seconds > 0:
                break
            pooled += int(run.pages)
        req.below_blocks = 0 if req.pulls or not reply.tiers else max(0, req.hit_blocks - pooled)
        req.hints = [NodeHint(n.node_id, n.address, n.prefix_length, n.pending, n.expires_in_seconds)
                     for n in reply.nodes]
        # blocks the store already holds are not saved again
        req.saved_blocks = req.hit_blocks
        self.stats.add(lookup_hit_tokens=req.hit_blocks * self.block_size)

    def _worth_reading(self, req: _Request, reply: pb.LookupResponse) -> int:
        """Blocks to load: what this node holds where loading it beats computing it (its pool's blocks, and
        each run in its tiers whose expected load time is below the prefill of its blocks:
        :func:`kvstore_client.claims.worth_loading`), and another node's deeper prefix where pulling it
        beats computing it (:func:`kvstore_client.claims.worth_reading`), or that another request of this
        engine is pulling here now (:func:`kvstore_client.claims.joined`). They need
        ``prefill_tokens_per_s``, without which every held block is loaded."""
        local = int(reply.prefix_length)
        held = claiming.held(reply.nodes, local)
        tps = self.config.prefill_tokens_per_s
        if not tps > 0:
            return held
        def prefill(blocks: int) -> float:
            return claiming.prefill_s(blocks * self.block_size, tps)
        loadable = claiming.worth_loading([(int(r.pages), float(r.load_seconds)) for r in reply.tiers], local,
                                          prefill_blocks_s=prefill)
        if held <= local or (ctx := self._context()) is None:
            return held if loadable >= local else loadable
        read = claiming.worth_reading(reply.nodes, ctx[0], loadable, page_bytes=ctx[1],
                                      link_bytes_per_s=self.config.link_bytes_per_s, prefill_blocks_s=prefill)
        if loadable < local:
            return read
        # another request of this engine pulling the same prefix: join its pull (kvstore_client.claims.joined)
        pulling = ((r.keys, r.hit_blocks) for r in self._reqs.values()
                   if r is not req and r.pulls and r.hit_blocks)
        return max(read, min(held, claiming.joined(req.keys, local, pulling)))

    # ---- in-flight prefill claims ----------------------------------------------
    def backlog_tokens(self, but: _Request | None = None) -> int:
        """Prefill tokens queued on this engine: what the answered requests still have to compute of
        their prompts (an estimate: vLLM's own cache hits are known only at their lookup)."""
        total = 0
        for r in self._reqs.values():
            if r is not but and r.hit_blocks is not None:
                done = max(r.progress, r.hit_blocks * self.block_size, r.local_tokens)
                total += max(0, r.prompt_tokens - done)
        return total

    def _claim_seconds(self, req: _Request) -> float:
        """The first Lookup's ``claim_seconds``: this request's prefill of what vLLM lacks, behind the
        engine's queued prefill (0: no claim, when claims are off or the engine does not save)."""
        if not (self.config.claims and self.config.save):
            return 0.0
        return claiming.claim_seconds(req.prompt_tokens - req.local_tokens, self.config.prefill_tokens_per_s,
                                      self.backlog_tokens(req), self.config.max_claim_seconds)

    def _context(self) -> tuple[str, int] | None:
        """This node's id and the namespace's page bytes (two RPCs, once); None while unknown."""
        if self._claim_ctx is None:
            try:
                self._claim_ctx = (self.client.node_info().node_id, self.client.page_bytes(self.namespace))
            except KvError as exc:
                log.debug("kvstore claims: node or namespace not known yet: %s", exc)
        return self._claim_ctx

    def _start_wait(self, req: _Request, reply: pb.LookupResponse) -> bool:
        """Defer the request when its first answer shows a prefill (or copy) worth waiting for."""
        if not any(n.pending for n in reply.nodes):
            return False  # nothing in flight (the usual answer): no RPC for the context
        ctx = self._context()
        if ctx is None:
            return False
        wait = claim_wait(self.config, reply, ctx[0], block_size=self.block_size, page_bytes=ctx[1],
                          backlog_tokens=self.backlog_tokens(req),
                          engine_blocks=req.local_tokens // self.block_size)
        if wait is None:
            return False
        now = time.monotonic()
        req.wait, req.wait_started, req.last_reply = wait, now, reply
        req.held_before = claiming.held(reply.nodes, int(reply.prefix_length))
        req.wait_until = now + min(wait.budget_s, self.config.claim_max_wait_s)
        # the claimant Puts in about ready_in: the re-lookups start halfway there
        req.next_poll = now + min(wait.ready_in_s / 2, wait.budget_s)
        self.stats.add(claim_waits=1)
        return True

    def _follow(self, req: _Request, lookup_keys: list[bytes]) -> bool:
        """One step of a deferred request: True once the wait is over (``hit_blocks`` known)."""
        assert req.wait is not None and req.last_reply is not None
        now = time.monotonic()
        if req.poll is not None and req.poll.done():
            try:
                reply = req.poll.result()
            except KvError as exc:
                log.debug("kvstore claim re-lookup failed: %s", exc)
                return self._end_wait(req, landed=False)
            req.poll, req.last_reply = None, reply
            me = self._claim_ctx[0] if self._claim_ctx else ""
            local = int(reply.prefix_length)
            if claiming.landed(reply.nodes, me, local, req.wait.length, req.wait.node):
                return self._end_wait(req, landed=True)
            if not claiming.still_coming(reply.nodes, me, req.wait.length, req.wait.node):
                return self._end_wait(req, landed=False)  # the claim vanished (claimant gone, or gave up)
        if now >= req.wait_until:
            return self._end_wait(req, landed=False)
        if req.poll is None and now >= req.next_poll:
            reply = req.last_reply
            me, page_bytes = self._claim_ctx if self._claim_ctx else ("", 0)
            req.next_poll = now + claiming.look_again_s(  # about 8 looks over what is left, at least claim_poll_ms
                reply.nodes, me, int(reply.prefix_length), req.wait, page_bytes=page_bytes,
                link_bytes_per_s=self.config.link_bytes_per_s, floor_s=self.config.claim_poll_ms / 1000)
            try:  # no ttl, no lease_id: a plain, non-recording Lookup, without blocking
                req.poll = self.client.lookup_lease_future(self.namespace, lookup_keys, ttl=0.0,
                                                           timeout=self.config.lookup_timeout_s)
            except KvError as exc:
                log.debug("kvstore claim re-lookup failed: %s", exc)
                return self._end_wait(req, landed=False)
        return False

    def _end_wait(self, req: _Request, landed: bool) -> bool:
        if req.poll is not None:
            req.poll.cancel()
            req.poll = None
        self.stats.add(claim_waits_landed=int(landed), claim_wait_seconds=time.monotonic() - req.wait_started)
        wait, reply, req.wait, req.waited, req.last_reply = req.wait, req.last_reply, None, True, None
        assert reply is not None and wait is not None
        # it came: load what is held; it did not (budget spent, claim gone): compute it, loading what was
        # held before the wait -- or what landed meanwhile, when pulling that beats computing it
        # (kvstore_client.claims.read_after_wait); after a copy to this node that did not come, only
        # what is here
        self._settle(req, reply, None if landed else self._after_wait(req, wait, reply))
        return True

    def _after_wait(self, req: _Request, wait: claiming.Wait, reply: pb.LookupResponse) -> int:
        local = int(reply.prefix_length)
        base = max(req.held_before, local)
        if not wait.computing or self._claim_ctx is None:
            return base
        tps = self.config.prefill_tokens_per_s
        return claiming.read_after_wait(reply.nodes, local, base, page_bytes=self._claim_ctx[1],
                                        link_bytes_per_s=self.config.link_bytes_per_s,
                                        prefill_blocks_s=lambda b: claiming.prefill_s(b * self.block_size, tps))

    def _lookup_failed(self, req: _Request, exc: KvError) -> bool:
        log.warning("kvstore lookup failed, computing the prompt instead: %s", exc)
        self.stats.add(lookup_errors=1)
        req.future, req.hit_blocks = None, 0
        return True

    def waiting(self, req_id: str) -> claiming.Wait | None:
        """The claim a request is deferred for, if any."""
        req = self._reqs.get(req_id)
        return req.wait if req else None

    # ---- update_state_after_alloc / build_connector_meta ----------------------
    def after_alloc(self, req_id: str, num_external_tokens: int) -> None:
        """vLLM allocated blocks; ``num_external_tokens`` of them are to load."""
        req = self._reqs.get(req_id)
        if req is not None and num_external_tokens > 0:
            req.load_tokens = num_external_tokens

    def build_plan(self, new: Sequence[tuple[str, Sequence[int], int]],
                   cached: Sequence[tuple[str, Sequence[int] | None, bool, int]],
                   num_scheduled: dict[str, int]) -> StepPlan:
        """One step's plan. ``new``: (req_id, block_ids, num_computed_tokens)
        of newly scheduled requests; ``cached``: (req_id, new_block_ids,
        resumed, num_computed_tokens) of running ones; ``num_scheduled``:
        tokens scheduled per request this step."""
        plan = StepPlan()
        for req_id, block_ids, computed in new:
            req = self._reqs.get(req_id)
            if req is None:
                continue
            req.block_ids = list(block_ids)
            req.progress = computed + num_scheduled.get(req_id, 0)
            self._plan_load(req_id, req, plan)
            self._plan_save(req_id, req, req.progress, plan)
        for req_id, new_block_ids, resumed, computed in cached:
            req = self._reqs.get(req_id)
            if req is None:
                continue
            if resumed:
                req.block_ids = list(new_block_ids or [])
                self._plan_load(req_id, req, plan)
            elif new_block_ids:
                req.block_ids.extend(new_block_ids)
            req.progress = computed + num_scheduled.get(req_id, 0)
            self._plan_save(req_id, req, req.progress, plan)
        return plan

    def _plan_load(self, req_id: str, req: _Request, plan: StepPlan) -> None:
        if not req.load_tokens:
            return
        first = req.local_tokens // self.block_size
        count = req.load_tokens // self.block_size
        req.load_tokens = 0
        if count and first + count <= len(req.block_ids):
            below = min(count, req.below_blocks)
            deadline = claiming.prefill_s(below * self.block_size, self.config.prefill_tokens_per_s) if below else 0.0
            plan.loads.append(LoadSpec(req_id, req.keys[first:first + count], req.block_ids[first:first + count],
                                       req.lease_id, deadline if math.isfinite(deadline) else 0.0))

    def _plan_save(self, req_id: str, req: _Request, computed_after: int, plan: StepPlan) -> None:
        if not self.config.save:
            return
        full = min(computed_after // self.block_size, len(req.keys), len(req.block_ids))
        if full > req.saved_blocks:
            plan.saves.append(SaveSpec(req_id, req.keys[req.saved_blocks:full], req.block_ids[req.saved_blocks:full]))
            req.saved_blocks = full
            req.has_saves = True

    # ---- request_finished -----------------------------------------------------
    def finished(self, req_id: str) -> tuple[bool, dict[str, Any] | None]:
        """Forget the request. True when a save of its blocks may still be
        running: vLLM then keeps the blocks until the worker reports the
        request in ``finished_sending``."""
        req = self._reqs.pop(req_id, None)
        if req is None:
            return False, None
        for call in (req.future, req.poll):
            if call is not None:
                call.cancel()
        params = {"kvstore": {"namespace": self.namespace, "nodes": [vars_of(h) for h in req.hints]}} \
            if req.hints else None
        return req.has_saves, params

    def hints(self, req_id: str) -> list[NodeHint]:
        """Placement hints of a request's Lookup (which nodes hold its prefix)."""
        req = self._reqs.get(req_id)
        return list(req.hints) if req else []


def claim_wait(config: ConnectorConfig, reply: pb.LookupResponse, me: str, *, block_size: int, page_bytes: int,
               backlog_tokens: int = 0, engine_blocks: int = 0) -> claiming.Wait | None:
    """What a request's first Lookup answer says to do with claims: the prefill in flight (another
    request's claim, or a copy on its way to this node) to defer for, or None -- load what is held and
    compute the rest. ``me``: this node's id; ``engine_blocks``: vLLM's own prefix-cache hit in blocks
    (a claim no deeper than that is not waited for). Pure: the rule is
    :func:`kvstore_client.claims.wait_for`, with this connector's knobs."""
    if not (config.claims and config.load):
        return None
    local, nodes = int(reply.prefix_length), list(reply.nodes)
    wait = claiming.wait_for(nodes, me, local, block_tokens=block_size, page_bytes=page_bytes,
                             prefill_tokens_per_s=config.prefill_tokens_per_s,
                             link_bytes_per_s=config.link_bytes_per_s, backlog_tokens=backlog_tokens,
                             margin=config.claim_margin)
    if wait is None:
        wait = claiming.incoming(nodes, me, local, block_tokens=block_size,
                                 prefill_tokens_per_s=config.prefill_tokens_per_s, backlog_tokens=backlog_tokens,
                                 margin=config.claim_margin)
    if wait is None or wait.length <= engine_blocks or min(wait.budget_s, config.claim_max_wait_s) <= 0:
        return None
    return wait


def vars_of(hint: NodeHint) -> dict[str, Any]:
    return {"node_id": hint.node_id, "address": hint.address, "prefix_blocks": hint.prefix_blocks,
            "pending": hint.pending, "expires_in_seconds": hint.expires_in_seconds}


def router_hints(client: KvClient, namespace: str, token_ids: Sequence[int], block_size: int,
                 salt: bytes = b"") -> list[NodeHint]:
    """For a router: the nodes holding a prompt's prefix (longest first),
    with speculative-copy hints, without recording or leasing anything."""
    reply = client.lookup_nodes(namespace, block_keys(token_ids, block_size, salt))
    return [NodeHint(n.node_id, n.address, n.prefix_length, n.pending, n.expires_in_seconds) for n in reply.nodes]
