"""Engine layouts beyond (K, V) pairs: ``kv_first`` (one ``[2, num_blocks,
...]`` tensor per layer) and ``blocks`` (one ``[num_blocks, ...]`` tensor per
layer with K and V inside each block, vLLM's CPU backend). Page contents are
checked against an independent per-block construction, and every layout
round-trips. The same tests run on the host and the staged numpy ops."""

from __future__ import annotations

import numpy as np
import pytest

from tests.conftest import StagedNumpyOps
from kvstore.ops import KernelArgumentError, NumpyPageOps

OPS = {"numpy": NumpyPageOps(), "staged": StagedNumpyOps()}
NUM_BLOCKS = 9


@pytest.fixture(params=list(OPS))
def ops(request):  # type: ignore[no-untyped-def]
    return OPS[request.param]


def cpu_layers(rng: np.random.Generator, layers: int, dtype=np.float32) -> list[np.ndarray]:  # type: ignore[no-untyped-def]
    """vLLM CPU-backend shape: [num_blocks, kv_heads, block_size, 2 * head_size]."""
    return [rng.standard_normal((NUM_BLOCKS, 2, 4, 2 * 8)).astype(dtype) for _ in range(layers)]


def expected_page(layers: list[np.ndarray], block: int) -> bytes:
    """A ``blocks`` page: each layer's block row, layer after layer."""
    return b"".join(t[block].tobytes() for t in layers)


@pytest.mark.parametrize("num_layers", [1, 2, 3])
def test_blocks_layout_pages_are_layer_block_rows(ops, num_layers: int) -> None:  # type: ignore[no-untyped-def]
    rng = np.random.default_rng(num_layers)
    layers = cpu_layers(rng, num_layers)
    page_bytes = num_layers * layers[0][0].nbytes
    pool = np.zeros((6, page_bytes), dtype=np.uint8)
    blocks, slots = [7, 0, 3, 3], [5, 1, 0, 2]          # a block may repeat on the read side
    ops.gather(layers, blocks, pool, slots, layout="blocks")
    for b, s in zip(blocks, slots):
        assert pool[s].tobytes() == expected_page(layers, b)
    assert not pool[3].any() and not pool[4].any()      # untouched slots stay as they were

    back = [np.zeros_like(t) for t in layers]
    ops.scatter(pool, [5, 1, 0], back, [2, 4, 8], layout="blocks")
    for t, orig in zip(back, layers):
        np.testing.assert_array_equal(t[[2, 4, 8]], orig[[7, 0, 3]])
        assert not t[[0, 1, 3, 5, 6, 7]].any()


def test_kv_first_equals_pairs_without_copy(ops) -> None:  # type: ignore[no-untyped-def]
    rng = np.random.default_rng(1)
    stacked = [rng.standard_normal((2, NUM_BLOCKS, 4, 2, 8)).astype(np.float16) for _ in range(2)]
    page_bytes = 2 * 2 * stacked[0][0, 0].nbytes
    a = np.zeros((4, page_bytes), dtype=np.uint8)
    b = np.zeros_like(a)
    ops.gather(stacked, [1, 5, 8], a, [0, 1, 2], layout="kv_first")
    ops.gather([(t[0], t[1]) for t in stacked], [1, 5, 8], b, [0, 1, 2])
    np.testing.assert_array_equal(a, b)
    # page = [L][K, V][block]
    assert a[1].tobytes() == b"".join(t[kv, 5].tobytes() for t in stacked for kv in (0, 1))

    back = [np.zeros_like(t) for t in stacked]
    ops.scatter(a, [2, 0], back, [0, 6], layout="kv_first")
    for t, orig in zip(back, stacked):
        np.testing.assert_array_equal(t[:, 0], orig[:, 8])
        np.testing.assert_array_equal(t[:, 6], orig[:, 1])


def test_blocks_layout_any_dtype_round_trips_bytes(ops) -> None:  # type: ignore[no-untyped-def]
    rng = np.random.default_rng(2)
    layers = [rng.integers(0, 2**16, (NUM_BLOCKS, 2, 32, 5), dtype=np.uint16) for _ in range(2)]  # bf16 as bits
    pool = np.empty((NUM_BLOCKS, 2 * layers[0][0].nbytes), dtype=np.uint8)
    ops.gather(layers, range(NUM_BLOCKS), pool, range(NUM_BLOCKS), layout="blocks")
    back = [np.empty_like(t) for t in layers]
    ops.scatter(pool, range(NUM_BLOCKS), back, range(NUM_BLOCKS), layout="blocks")
    for t, orig in zip(back, layers):
        np.testing.assert_array_equal(t, orig)


def test_layout_argument_errors_write_nothing(ops) -> None:  # type: ignore[no-untyped-def]
    rng = np.random.default_rng(3)
    layers = cpu_layers(rng, 2)
    page_bytes = 2 * layers[0][0].nbytes
    pool = np.zeros((2, page_bytes), dtype=np.uint8)
    with pytest.raises(KernelArgumentError, match="layout must be one of"):
        ops.gather(layers, [0], pool, [0], layout="nhd")
    with pytest.raises(KernelArgumentError, match="page_bytes mismatch"):
        ops.gather(layers[:1], [0], pool, [0], layout="blocks")
    with pytest.raises(KernelArgumentError, match=r"\[2 \(K, V\), num_blocks"):
        ops.gather(layers, [0], pool, [0], layout="kv_first")
    with pytest.raises(KernelArgumentError, match="C-contiguous"):
        ops.gather([t[:, :, ::2] for t in layers], [0], pool, [0], layout="blocks")
    with pytest.raises(KernelArgumentError, match="all must match"):
        ops.gather([layers[0], layers[1].astype(np.float16)], [0], pool, [0], layout="blocks")
    with pytest.raises(KernelArgumentError, match="out of range"):
        ops.scatter(pool, [0], layers, [NUM_BLOCKS], layout="blocks")
    with pytest.raises(KernelArgumentError, match="aliases"):
        ops.scatter(pool, [0], [layers[0], layers[0]], [1], layout="blocks")
    assert not pool.any()
