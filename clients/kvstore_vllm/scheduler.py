"""Scheduler side of the connector, free of vLLM imports.

Per request it holds the block keys, one leasing Lookup (issued without
blocking the scheduler loop, idempotent per request), what to load into
which blocks, and how far the prompt's blocks have been saved. Each step it
turns this into a :class:`StepPlan` that the worker side carries out.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvstore.errors import KvError
from kvstore_client import KvClient
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
        neither lease nor record again.
        """
        req = self._reqs.get(req_id)
        if req is None:
            keys = block_keys(prompt_token_ids, self.block_size, salt)
            req = _Request(keys=keys, max_hit_blocks=(len(prompt_token_ids) - 1) // self.block_size,
                           lease_key=f"{self.engine_id}/{req_id}")
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
        if req.future is None:
            self.stats.add(lookups=1)
            req.issued_at = time.monotonic()
            try:
                req.future = self.client.lookup_lease_future(
                    self.namespace, lookup_keys, ttl=self.config.lease_ttl_s, lease_id=req.lease_key,
                    record=self.config.record, timeout=self.config.lookup_timeout_s)
            except KvError as exc:
                return self._lookup_failed(req, exc)
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
        best = max((n.prefix_length for n in reply.nodes if not n.pending), default=0)
        req.hit_blocks = min(max(best, reply.prefix_length), req.max_hit_blocks)
        req.lease_id = reply.lease_id
        req.hints = [NodeHint(n.node_id, n.address, n.prefix_length, n.pending, n.expires_in_seconds)
                     for n in reply.nodes]
        # blocks the store already holds are not saved again
        req.saved_blocks = req.hit_blocks
        self.stats.add(lookup_hit_tokens=req.hit_blocks * self.block_size)
        return True

    def _lookup_failed(self, req: _Request, exc: KvError) -> bool:
        log.warning("kvstore lookup failed, computing the prompt instead: %s", exc)
        self.stats.add(lookup_errors=1)
        req.future, req.hit_blocks = None, 0
        return True

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
            self._plan_load(req_id, req, plan)
            self._plan_save(req_id, req, computed + num_scheduled.get(req_id, 0), plan)
        for req_id, new_block_ids, resumed, computed in cached:
            req = self._reqs.get(req_id)
            if req is None:
                continue
            if resumed:
                req.block_ids = list(new_block_ids or [])
                self._plan_load(req_id, req, plan)
            elif new_block_ids:
                req.block_ids.extend(new_block_ids)
            self._plan_save(req_id, req, computed + num_scheduled.get(req_id, 0), plan)
        return plan

    def _plan_load(self, req_id: str, req: _Request, plan: StepPlan) -> None:
        if not req.load_tokens:
            return
        first = req.local_tokens // self.block_size
        count = req.load_tokens // self.block_size
        req.load_tokens = 0
        if count and first + count <= len(req.block_ids):
            plan.loads.append(LoadSpec(req_id, req.keys[first:first + count],
                                       req.block_ids[first:first + count], req.lease_id))

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
        if req.future is not None:
            req.future.cancel()
        params = {"kvstore": {"namespace": self.namespace, "nodes": [vars_of(h) for h in req.hints]}} \
            if req.hints else None
        return req.has_saves, params

    def hints(self, req_id: str) -> list[NodeHint]:
        """Placement hints of a request's Lookup (which nodes hold its prefix)."""
        req = self._reqs.get(req_id)
        return list(req.hints) if req else []


def vars_of(hint: NodeHint) -> dict[str, Any]:
    return {"node_id": hint.node_id, "address": hint.address, "prefix_blocks": hint.prefix_blocks,
            "pending": hint.pending, "expires_in_seconds": hint.expires_in_seconds}


def router_hints(client: KvClient, namespace: str, token_ids: Sequence[int], block_size: int,
                 salt: bytes = b"") -> list[NodeHint]:
    """For a router: the nodes holding a prompt's prefix (longest first),
    with speculative-copy hints, without recording or leasing anything."""
    reply = client.lookup_nodes(namespace, block_keys(token_ids, block_size, salt))
    return [NodeHint(n.node_id, n.address, n.prefix_length, n.pending, n.expires_in_seconds) for n in reply.nodes]
