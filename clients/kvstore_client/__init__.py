"""Python client for kvstore nodes.

>>> from kvstore_client import KvClient, chain_keys
>>> with KvClient("127.0.0.1:7400") as kv:
...     kv.create_namespace("llama3-8b", page_bytes=1 << 20, exist_ok=True)
...     keys = chain_keys(token_ids, block_tokens=16)
...     kv.put("llama3-8b", keys, pages)          # pages: uint8 [len(keys), page_bytes]
...     hit = kv.lookup("llama3-8b", keys)         # longest cached prefix
...     res = kv.get("llama3-8b", keys[:hit])      # res.pages, res.found, res.missing
"""

from kvstore.errors import (
    AlreadyExists, InvalidArgument, KvError, NotFound, PermissionDenied, PoolExhausted, ResourceExhausted,
    Unauthenticated, Unavailable,
)
from kvstore.v1.kvstore_pb2 import PRIMARY, REPLICA, SPECULATIVE
from kvstore_client._common import GetResult, Lease, PutResult
from kvstore_client.aio import AsyncKvClient
from kvstore_client.keys import KEY_BYTES, chain_keys, root_key
from kvstore_client.sync import KvClient

__all__ = [
    "AsyncKvClient", "KvClient", "GetResult", "PutResult", "Lease", "chain_keys", "root_key", "KEY_BYTES",
    "KvError", "InvalidArgument", "NotFound", "AlreadyExists", "ResourceExhausted", "PoolExhausted",
    "Unavailable", "Unauthenticated", "PermissionDenied", "PRIMARY", "REPLICA", "SPECULATIVE",
]
