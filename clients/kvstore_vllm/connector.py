"""vLLM's ``KVConnectorBase_V1`` on top of :class:`SchedulerCore` and
:class:`WorkerCore` (load with ``kv_connector_module_path=
"kvstore_vllm.connector"``, ``kv_connector="KvstoreConnector"``).

This module is the only one that imports vLLM and torch. It turns vLLM's
requests and scheduler output into the cores' plain arguments, and the
engine's torch KV tensors into numpy (CPU) or CuPy (CUDA) views of the same
memory, so the page ops read and write the engine's blocks in place.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1, KVConnectorMetadata, KVConnectorRole,
)

from kvstore.ops import select as select_ops

from .config import ConnectorConfig
from .naming import namespace_for, request_salt
from .scheduler import SchedulerCore, StepPlan
from .stats import ConnectorStats
from .worker import WorkerCore

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger("kvstore_vllm")


class KvstoreMetadata(KVConnectorMetadata):
    """One step's plan, handed from the scheduler to the workers."""

    def __init__(self, plan: StepPlan) -> None:
        self.plan = plan


def _dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def engine_namespace(vllm_config: "VllmConfig", cfg: ConnectorConfig, tp_rank: int) -> str:
    """The namespace of this engine's pages: model, KV layout, TP rank."""
    if cfg.namespace:
        return cfg.namespace
    from vllm.platforms import current_platform

    model, cache, par = vllm_config.model_config, vllm_config.cache_config, vllm_config.parallel_config
    dtype = model.dtype if cache.cache_dtype == "auto" else cache.cache_dtype
    return namespace_for(cfg.namespace_prefix, model.model, _dtype_name(dtype), model.get_num_layers(par),
                         model.get_num_kv_heads(par), model.get_head_size(), cache.block_size,
                         str(current_platform.device_type), tp_rank, par.tensor_parallel_size, cfg.layout_tag)


def byte_view(tensor: torch.Tensor) -> Any:
    """The tensor's memory as a uint8 numpy (CPU) or CuPy (CUDA) array, no copy."""
    if not tensor.is_contiguous():
        raise ValueError("kvstore needs C-contiguous KV cache tensors")
    raw = tensor.view(torch.uint8) if tensor.dtype != torch.uint8 else tensor
    if raw.is_cuda:
        import cupy

        return cupy.from_dlpack(raw)
    return raw.numpy()


def engine_layout(tensor: torch.Tensor, num_blocks: int) -> str:
    """``kv_first`` for ``[2, num_blocks, ...]`` (FlashAttention), else
    ``blocks``: each block row holds the layer's K and V (CPU backend,
    FlashInfer)."""
    if tensor.dim() >= 3 and tensor.shape[0] == 2 and tensor.shape[1] == num_blocks and num_blocks != 2:
        return "kv_first"
    if tensor.shape[0] != num_blocks:
        raise ValueError(f"unrecognised KV cache shape {tuple(tensor.shape)} for {num_blocks} blocks")
    return "blocks"


class KvstoreConnector(KVConnectorBase_V1):
    """kvstore as vLLM's external KV cache (see the package docstring)."""

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole,
                 kv_cache_config: "KVCacheConfig | None" = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self.cfg = ConnectorConfig.from_dict(dict(self._kv_transfer_config.kv_connector_extra_config))
        self.block_size = vllm_config.cache_config.block_size
        self.kv_stats = ConnectorStats()
        self._num_blocks = getattr(kv_cache_config, "num_blocks", 0)
        if self._kv_transfer_config.kv_load_failure_policy != "recompute":
            log.warning("kvstore: set kv_load_failure_policy='recompute' so a missed page is recomputed, "
                        "not a failed request")
        self.scheduler: SchedulerCore | None = None
        self.worker: WorkerCore | None = None
        if role == KVConnectorRole.SCHEDULER:
            # the scheduler looks up in TP rank 0's namespace; every rank saves the same blocks
            self.scheduler = SchedulerCore(self.cfg, engine_namespace(vllm_config, self.cfg, 0), self.block_size,
                                           str(self._kv_transfer_config.engine_id), stats=self.kv_stats)
        else:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            rank = get_tensor_model_parallel_rank() if vllm_config.parallel_config.tensor_parallel_size > 1 else 0
            self.worker = WorkerCore(self.cfg, engine_namespace(vllm_config, self.cfg, rank), self.block_size,
                                     select_ops("auto", "auto"), stats=self.kv_stats)
        self._device_is_cuda = False

    def stats(self) -> dict[str, float]:
        """The connector's counters (loaded tokens, load errors, bytes, seconds)."""
        return self.kv_stats.snapshot()

    # ==== worker side ==========================================================
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self.worker is not None
        names = list(kv_caches)
        tensors = [kv_caches[n] for n in names]
        num_blocks = self._num_blocks or int(tensors[0].shape[0])
        layout = engine_layout(tensors[0], num_blocks)
        self._device_is_cuda = tensors[0].is_cuda
        if self._device_is_cuda:
            self.worker.ops = select_ops("cupy", f"cuda:{tensors[0].device.index or 0}")
        else:
            self.worker.ops = select_ops("numpy", "cpu")
        self.worker.register(names, [byte_view(t) for t in tensors], layout)
        log.info("kvstore: %d layers, layout %s, %d-byte pages, namespace %s", len(names), layout,
                 self.worker.page_bytes, self.worker.namespace)

    def _plan(self) -> StepPlan:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvstoreMetadata)
        return meta.plan

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        assert self.worker is not None
        self.worker.start_load(self._plan().loads)

    def wait_for_layer_load(self, layer_name: str) -> None:
        assert self.worker is not None
        self.worker.wait_layer(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        """Nothing per layer: a page holds every layer, so blocks are saved
        in :meth:`wait_for_save` once the step's forward pass wrote them."""

    def wait_for_save(self) -> None:
        assert self.worker is not None
        saves = self._plan().saves
        if not saves:
            return
        ready = None
        if self._device_is_cuda:
            event = torch.cuda.Event()
            event.record()
            ready = event.synchronize
        self.worker.save(saves, ready)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        assert self.worker is not None
        return self.worker.finished_sending(finished_req_ids) or None, None

    def get_block_ids_with_load_errors(self) -> set[int]:
        assert self.worker is not None
        return self.worker.take_load_errors()

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.close()
        if self.scheduler is not None:
            self.scheduler.close()

    # ==== scheduler side =======================================================
    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self.scheduler is not None
        lora = request.lora_request.lora_name if request.lora_request is not None else None
        tokens = self.scheduler.matched_tokens(request.request_id, request.prompt_token_ids or [],
                                               request_salt(request.cache_salt, lora), num_computed_tokens)
        return tokens, False

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks",
                                 num_external_tokens: int) -> None:
        assert self.scheduler is not None
        self.scheduler.after_alloc(request.request_id, num_external_tokens)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        assert self.scheduler is not None
        new = [(r.req_id, r.block_ids[0], r.num_computed_tokens) for r in scheduler_output.scheduled_new_reqs]
        cached_out = scheduler_output.scheduled_cached_reqs
        cached = [(req_id, (ids[0] if ids else None), req_id in cached_out.resumed_req_ids,
                   cached_out.num_computed_tokens[i])
                  for i, (req_id, ids) in enumerate(zip(cached_out.req_ids, cached_out.new_block_ids))]
        return KvstoreMetadata(self.scheduler.build_plan(new, cached, dict(scheduler_output.num_scheduled_tokens)))

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        assert self.scheduler is not None
        return self.scheduler.finished(request.request_id)

    def placement_hints(self, request_id: str) -> list[Any]:
        """Which nodes hold a waiting request's prefix (for a router)."""
        assert self.scheduler is not None
        return self.scheduler.hints(request_id)
