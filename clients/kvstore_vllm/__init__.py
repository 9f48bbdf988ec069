"""kvstore as vLLM's KV cache: a ``KVConnectorBase_V1`` connector.

Load it with::

    --kv-transfer-config '{"kv_connector": "KvstoreConnector",
        "kv_connector_module_path": "kvstore_vllm.connector", "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"address": "127.0.0.1:7400"}}'

The scheduler- and worker-side logic (:mod:`.scheduler`, :mod:`.worker`) is
free of vLLM imports and is tested without vLLM; :mod:`.connector` adapts it
to vLLM's interface.
"""

from .config import ConnectorConfig
from .naming import block_keys, namespace_for, request_salt
from .scheduler import LoadSpec, NodeHint, SaveSpec, SchedulerCore, StepPlan, claim_wait, router_hints
from .stats import ConnectorStats
from .worker import WorkerCore

__all__ = [
    "ConnectorConfig", "ConnectorStats", "LoadSpec", "NodeHint", "SaveSpec", "SchedulerCore", "StepPlan",
    "WorkerCore", "block_keys", "claim_wait", "namespace_for", "request_salt", "router_hints",
]
