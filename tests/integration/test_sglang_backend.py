"""The SGLang HiCache backend against SGLang's real ``HiCacheStorage`` and
backend factory, on a real kvstored process. Skipped where SGLang is not
installed; ``make test-vllm`` installs it (``pip install --no-deps sglang``
beside vLLM's CPU torch, plus orjson and ipython)."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator

import pytest

if importlib.util.find_spec("sglang") is None:
    if os.environ.get("KVSTORE_REQUIRE_VLLM"):
        raise RuntimeError("KVSTORE_REQUIRE_VLLM is set but SGLang is not installed")
    pytest.skip("SGLang is not installed (make test-vllm installs it)", allow_module_level=True)

import torch  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig  # noqa: E402
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory  # noqa: E402

from kvstore.launch import NodeProcess  # noqa: E402
from kvstore_client import KvClient  # noqa: E402

pytestmark = pytest.mark.sglang

LAYERS, PAGE_TOKENS, TOKEN_BYTES = 2, 4, 64   # a page: [layers, page_tokens * token elements] float32


@pytest.fixture(scope="module")
def node() -> Iterator[NodeProcess]:
    proc = NodeProcess(["--capacity", "64MiB"], capture_stderr=True)
    yield proc
    proc.kill()


_open: list[HiCacheStorage] = []


@pytest.fixture(autouse=True)
def close_backends() -> Iterator[None]:
    yield
    while _open:
        _open.pop().close()  # type: ignore[attr-defined]


def make_backend(address: str, **extra) -> HiCacheStorage:  # type: ignore[no-untyped-def]
    config = HiCacheStorageConfig(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1, is_mla_model=False,
        enable_storage_metrics=False, is_page_first_layout=True, model_name="org/tiny-model",
        extra_config={"backend_name": "kvstore", "module_path": "kvstore_sglang.backend",
                      "class_name": "KvstoreHiCacheStorage", "address": address, "capacity": 4 << 20, **extra})
    backend = StorageBackendFactory.create_backend("dynamic", config, None)
    _open.append(backend)
    return backend


def page(seed: int) -> torch.Tensor:
    return torch.randn(LAYERS, PAGE_TOKENS * TOKEN_BYTES // 4, generator=torch.Generator().manual_seed(seed))


class HostPool:
    """The part of SGLang's host KV pool a storage backend uses, page-first:
    ``kv_buffer[page]`` is one contiguous page (as in ``MHATokenToKVPoolHost``)."""

    page_size = PAGE_TOKENS
    layout = "page_first"

    def __init__(self, pages: int) -> None:
        self.kv_buffer = torch.zeros(pages, LAYERS, PAGE_TOKENS * TOKEN_BYTES // 4)

    def get_data_page(self, index: int, flat: bool = True) -> torch.Tensor:
        data = self.kv_buffer[int(index) // self.page_size]
        return data.flatten() if flat else data

    def set_from_flat_data_page(self, index: int, data_page: torch.Tensor) -> None:
        self.kv_buffer[int(index) // self.page_size].copy_(data_page.view(torch.float32).reshape(LAYERS, -1))


def test_factory_loads_it_by_module_path(node) -> None:  # type: ignore[no-untyped-def]
    backend = make_backend(node.address)
    assert isinstance(backend, HiCacheStorage)
    assert type(backend).__name__ == "KvstoreHiCacheStorage"
    assert backend.namespace == "sglang.org-tiny-model.tp0of1.pp0"


def test_set_get_exists_round_trip(node) -> None:  # type: ignore[no-untyped-def]
    backend = make_backend(node.address, namespace="sg-a")
    pages = [page(i) for i in range(4)]
    keys = [f"{i:064x}" for i in range(4)]
    assert backend.exists(keys[0]) is False and backend.get(keys[0]) is None  # nothing yet
    assert backend.set(keys[0], pages[0]) is True
    assert backend.batch_set(keys[1:3], pages[1:3]) is True
    assert backend.exists(keys[0]) and not backend.exists(keys[3])
    assert backend.batch_exists(keys) == 3                      # the longest stored prefix
    assert backend.batch_exists([keys[3], keys[0]]) == 0
    got = backend.get(keys[1])
    assert got is not None and torch.equal(got.view(torch.float32).reshape(pages[1].shape), pages[1])
    targets = [torch.zeros_like(p) for p in pages]
    results = backend.batch_get(keys, targets)
    assert [r is not None for r in results] == [True, True, True, False]
    assert results[2] is targets[2]                            # filled in place
    for i in range(3):
        assert torch.equal(targets[i], pages[i])
    assert not targets[3].any()
    assert backend.set(keys[3], torch.zeros(7)) is False       # wrong page size: refused, not stored
    assert backend.batch_exists(keys) == 3


def test_v1_variants_move_pages_between_host_pool_and_store(node) -> None:  # type: ignore[no-untyped-def]
    backend = make_backend(node.address, namespace="sg-b")
    src, dst = HostPool(6), HostPool(6)
    for i in range(6):
        src.kv_buffer[i] = page(10 + i)
    backend.register_mem_pool_host(src)
    keys = [f"k{i}" for i in range(3)]
    indices = torch.tensor([PAGE_TOKENS * p + t for p in (4, 1, 5) for t in range(PAGE_TOKENS)])
    assert backend.batch_set_v1(keys, indices) == [True] * 3
    backend.register_mem_pool_host(dst)
    back = torch.tensor([PAGE_TOKENS * p + t for p in (0, 2, 3) for t in range(PAGE_TOKENS)])
    assert backend.batch_get_v1(keys + ["absent"], torch.cat([back, torch.arange(4 * PAGE_TOKENS,
                                                                               5 * PAGE_TOKENS)])) == \
        [True, True, True, False]
    for d, s in zip((0, 2, 3), (4, 1, 5)):
        assert torch.equal(dst.kv_buffer[d], src.kv_buffer[s])
    assert not dst.kv_buffer[4].any()
    with KvClient(node.address) as kv:
        assert kv.stats("sg-b").namespaces[0].used_slots == 3


def test_dead_node_is_a_miss_not_an_error() -> None:
    proc = NodeProcess(["--capacity", "16MiB"], capture_stderr=True)
    backend = make_backend(proc.address, namespace="sg-c", get_timeout_s=0.5, page_bytes=page(0).numel() * 4)
    assert backend.set("x", page(0))
    proc.kill()
    assert backend.get("x") is None
    assert backend.batch_exists(["x"]) == 0
    assert backend.set("y", page(1)) is False
