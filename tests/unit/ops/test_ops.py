"""Numpy page ops against plain per-page loop references, and their checks.

Every rejection test also asserts that nothing was written: arguments are
validated before the first byte moves.
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from kvstore.ops import (
    BackendUnavailableError,
    KernelArgumentError,
    NumpyPageOps,
    cupy_available,
    select,
)
from tests.conftest import REPO_ROOT

OPS = NumpyPageOps()

# Engine dtypes as the numpy path sees them: bf16 and fp8 arrive as raw views.
DTYPES = {"fp16": np.float16, "bf16": np.uint16, "fp8": np.uint8, "fp32": np.float32}
# (block_tokens, kv_heads, head_dim): block bytes a multiple of 16, and not.
BLOCK_SHAPES = {"aligned": (4, 2, 8), "odd": (3, 1, 5)}
PAGE_SIZES = [1, 7, 16, 48, 100, 4096]


# ------------------------------------------------------------------ helpers
def random_bytes(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """Random uint8 array of ``shape``."""
    return rng.integers(0, 256, size=shape, dtype=np.uint8)


def make_engine(rng: np.random.Generator, layers: int, num_blocks: int,
                block_shape: tuple[int, int, int], dtype: type) -> list[tuple[np.ndarray, np.ndarray]]:
    """Random engine KV cache: per layer a (K, V) pair of [num_blocks, *block_shape]."""
    itemsize = np.dtype(dtype).itemsize
    shape = (num_blocks, *block_shape)
    return [tuple(random_bytes(rng, shape[:-1] + (shape[-1] * itemsize,)).view(dtype)
                  for _ in range(2)) for _ in range(layers)]


def page_bytes_of(kv: list[tuple[np.ndarray, np.ndarray]]) -> int:
    """Page size matching an engine cache."""
    return len(kv) * 2 * kv[0][0][0].nbytes


def copy_engine(kv: list[tuple[np.ndarray, np.ndarray]]) -> list[tuple[np.ndarray, np.ndarray]]:
    """Deep copy of an engine cache."""
    return [(k.copy(), v.copy()) for k, v in kv]


def engine_bytes(kv: list[tuple[np.ndarray, np.ndarray]]) -> list[bytes]:
    """Raw bytes of every tensor (NaN-safe comparison)."""
    return [t.tobytes() for pair in kv for t in pair]


def ref_pack(pool: np.ndarray, slots: list[int]) -> np.ndarray:
    """out[i] = pool[slots[i]], one page at a time."""
    out = np.empty((len(slots), pool.shape[1]), dtype=np.uint8)
    for i, s in enumerate(slots):
        out[i] = pool[s]
    return out


def ref_unpack(staging: np.ndarray, slots: list[int], pool: np.ndarray) -> None:
    """pool[slots[i]] = staging[i], one page at a time."""
    for i, s in enumerate(slots):
        pool[s] = staging[i]


def ref_gather(kv: list[tuple[np.ndarray, np.ndarray]], block_ids: list[int],
               pool: np.ndarray, slots: list[int]) -> None:
    """Each page is the concatenation over layers and K/V of one block's bytes."""
    for b, s in zip(block_ids, slots):
        page = b"".join(kv[l][t][b].tobytes() for l in range(len(kv)) for t in range(2))
        pool[s] = np.frombuffer(page, dtype=np.uint8)


def ref_scatter(pool: np.ndarray, slots: list[int], kv: list[tuple[np.ndarray, np.ndarray]],
                block_ids: list[int]) -> None:
    """Inverse of ref_gather, walking the page byte offsets by hand."""
    for s, b in zip(slots, block_ids):
        offset = 0
        for l in range(len(kv)):
            for t in range(2):
                block = kv[l][t][b]
                raw = pool[s][offset:offset + block.nbytes].tobytes()
                block[...] = np.frombuffer(raw, dtype=block.dtype).reshape(block.shape)
                offset += block.nbytes


@pytest.fixture
def rng() -> np.random.Generator:
    """Seeded generator so failures reproduce."""
    return np.random.default_rng(1234)


@pytest.fixture
def engine_case(rng: np.random.Generator) -> tuple[list, np.ndarray]:
    """A 2-layer fp16 engine (6 blocks) and a matching random pool (8 slots)."""
    kv = make_engine(rng, 2, 6, BLOCK_SHAPES["aligned"], np.float16)
    return kv, random_bytes(rng, (8, page_bytes_of(kv)))


# ------------------------------------------------------- pack and unpack
@pytest.mark.parametrize("page_bytes", PAGE_SIZES)
@pytest.mark.parametrize("given_out", [False, True], ids=["alloc", "out"])
def test_pack_matches_reference(rng: np.random.Generator, page_bytes: int, given_out: bool) -> None:
    pool = random_bytes(rng, (10, page_bytes))
    slots = [3, 0, 9, 3, 5]  # duplicates are allowed when reading
    out = np.zeros((len(slots), page_bytes), dtype=np.uint8) if given_out else None
    got = OPS.pack(pool, slots, out)
    if given_out:
        assert got is out
    assert got.dtype == np.uint8 and got.flags.c_contiguous
    np.testing.assert_array_equal(got, ref_pack(pool, slots))


@pytest.mark.parametrize("page_bytes", PAGE_SIZES)
def test_unpack_matches_reference(rng: np.random.Generator, page_bytes: int) -> None:
    pool = random_bytes(rng, (10, page_bytes))
    expected = pool.copy()
    staging = random_bytes(rng, (4, page_bytes))
    slots = np.array([7, 2, 0, 9], dtype=np.int32)
    OPS.unpack(staging, slots, pool)
    ref_unpack(staging, slots.tolist(), expected)
    np.testing.assert_array_equal(pool, expected)


def test_pack_unpack_round_trip(rng: np.random.Generator) -> None:
    source = random_bytes(rng, (12, 100))
    target = np.zeros_like(source)
    slots = [11, 4, 6, 0]
    OPS.unpack(OPS.pack(source, slots), slots, target)
    np.testing.assert_array_equal(target[slots], source[slots])
    untouched = [s for s in range(12) if s not in slots]
    assert not target[untouched].any()


# ---------------------------------------------------- gather and scatter
@pytest.mark.parametrize("layers", [1, 2, 3])
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("block_shape", BLOCK_SHAPES.values(), ids=BLOCK_SHAPES.keys())
def test_gather_matches_reference(rng: np.random.Generator, layers: int, dtype: type,
                                  block_shape: tuple[int, int, int]) -> None:
    kv = make_engine(rng, layers, 7, block_shape, dtype)
    pool = random_bytes(rng, (9, page_bytes_of(kv)))
    expected = pool.copy()
    before = engine_bytes(kv)
    block_ids, slots = [6, 0, 3, 0], [1, 8, 4, 2]  # repeated block ids may be read twice
    OPS.gather(kv, block_ids, pool, slots)
    ref_gather(kv, block_ids, expected, slots)
    np.testing.assert_array_equal(pool, expected)
    assert engine_bytes(kv) == before


@pytest.mark.parametrize("layers", [1, 2, 3])
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("block_shape", BLOCK_SHAPES.values(), ids=BLOCK_SHAPES.keys())
def test_scatter_matches_reference(rng: np.random.Generator, layers: int, dtype: type,
                                   block_shape: tuple[int, int, int]) -> None:
    kv = make_engine(rng, layers, 7, block_shape, dtype)
    expected = copy_engine(kv)
    pool = random_bytes(rng, (9, page_bytes_of(kv)))
    before = pool.copy()
    slots, block_ids = [5, 0, 5], [2, 6, 0]  # repeated source slots are fine
    OPS.scatter(pool, slots, kv, np.array(block_ids, dtype=np.uint64))
    ref_scatter(pool, slots, expected, block_ids)
    assert engine_bytes(kv) == engine_bytes(expected)
    np.testing.assert_array_equal(pool, before)


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_gather_scatter_round_trip(rng: np.random.Generator, dtype: type) -> None:
    kv = make_engine(rng, 3, 8, BLOCK_SHAPES["odd"], dtype)
    pool = OPS.empty_pool(5, page_bytes_of(kv))
    block_ids, slots = [7, 1, 4], [0, 3, 2]
    OPS.gather(kv, block_ids, pool, slots)
    restored = [(np.zeros_like(k), np.zeros_like(v)) for k, v in kv]
    OPS.scatter(pool, slots, restored, block_ids)
    for pair, back in zip(kv, restored):
        for tensor, got in zip(pair, back):
            raw, raw_got = tensor.view(np.uint8), got.view(np.uint8)
            np.testing.assert_array_equal(raw_got[block_ids], raw[block_ids])
            untouched = [b for b in range(8) if b not in block_ids]
            assert not raw_got[untouched].any()


# --------------------------------------------------------------- edge cases
@pytest.mark.parametrize("empty", [[], (), np.array([], dtype=np.int64)], ids=["list", "tuple", "array"])
def test_empty_ids_are_no_ops(engine_case: tuple, empty: object) -> None:
    kv, pool = engine_case
    before, engine_before = pool.copy(), engine_bytes(kv)
    packed = OPS.pack(pool, empty)
    assert packed.shape == (0, pool.shape[1]) and packed.dtype == np.uint8
    OPS.unpack(np.empty((0, pool.shape[1]), np.uint8), empty, pool)
    OPS.gather(kv, empty, pool, empty)
    OPS.scatter(pool, empty, kv, empty)
    np.testing.assert_array_equal(pool, before)
    assert engine_bytes(kv) == engine_before


def test_accepts_int_like_id_types(rng: np.random.Generator) -> None:
    pool = random_bytes(rng, (6, 32))
    expected = ref_pack(pool, [5, 1])
    for ids in ([5, 1], (5, 1), np.array([5, 1], np.int32), np.array([5, 1], np.uint8),
                np.array([5, 0, 1], np.int64)[::2]):
        np.testing.assert_array_equal(OPS.pack(pool, ids), expected)


BAD_IDS = {"negative": -1, "at-end": None, "huge": 2**40}


def _bad(value: int | None, upper: int) -> int:
    """The bad id for a BAD_IDS case (None: exactly one past the end)."""
    return upper if value is None else value


@pytest.mark.parametrize("bad", BAD_IDS.values(), ids=BAD_IDS.keys())
def test_out_of_range_slots_rejected_without_writes(engine_case: tuple, bad: int | None) -> None:
    kv, pool = engine_case
    before, engine_before = pool.copy(), engine_bytes(kv)
    slots = [0, _bad(bad, pool.shape[0])]
    out = np.zeros((2, pool.shape[1]), np.uint8)
    staging = np.ones((2, pool.shape[1]), np.uint8)
    with pytest.raises(KernelArgumentError, match="slots out of range"):
        OPS.pack(pool, slots, out)
    with pytest.raises(KernelArgumentError, match="slots out of range"):
        OPS.unpack(staging, slots, pool)
    with pytest.raises(KernelArgumentError, match="slots out of range"):
        OPS.gather(kv, [0, 1], pool, slots)
    with pytest.raises(KernelArgumentError, match="slots out of range"):
        OPS.scatter(pool, slots, kv, [0, 1])
    assert not out.any()
    np.testing.assert_array_equal(pool, before)
    assert engine_bytes(kv) == engine_before


@pytest.mark.parametrize("bad", BAD_IDS.values(), ids=BAD_IDS.keys())
def test_out_of_range_block_ids_rejected_without_writes(engine_case: tuple, bad: int | None) -> None:
    kv, pool = engine_case
    before, engine_before = pool.copy(), engine_bytes(kv)
    block_ids = np.array([1, _bad(bad, kv[0][0].shape[0])], dtype=np.int64)
    with pytest.raises(KernelArgumentError, match="block_ids out of range"):
        OPS.gather(kv, block_ids, pool, [2, 3])
    with pytest.raises(KernelArgumentError, match="block_ids out of range"):
        OPS.scatter(pool, [2, 3], kv, block_ids)
    np.testing.assert_array_equal(pool, before)
    assert engine_bytes(kv) == engine_before


def test_duplicate_targets_rejected_without_writes(engine_case: tuple) -> None:
    kv, pool = engine_case
    before, engine_before = pool.copy(), engine_bytes(kv)
    staging = np.ones((3, pool.shape[1]), np.uint8)
    with pytest.raises(KernelArgumentError, match="slots must be unique.*4"):
        OPS.unpack(staging, [4, 1, 4], pool)
    with pytest.raises(KernelArgumentError, match="slots must be unique"):
        OPS.gather(kv, [0, 1, 2], pool, [2, 2, 3])
    with pytest.raises(KernelArgumentError, match="block_ids must be unique.*5"):
        OPS.scatter(pool, [0, 1, 2], kv, [5, 3, 5])
    np.testing.assert_array_equal(pool, before)
    assert engine_bytes(kv) == engine_before


@pytest.mark.parametrize("staging", [
    np.zeros((2, 10), np.uint8),                  # wrong row length
    np.zeros((3, 12), np.uint8),                  # wrong row count
    np.zeros((2, 12), np.int8),                   # wrong dtype
    np.zeros((2, 12), np.uint16),                 # wrong dtype, right bytes
    np.zeros((24,), np.uint8),                    # flat
    np.zeros((12, 2), np.uint8).T,                # not C-contiguous
    [[0] * 12] * 2,                               # not an array
], ids=["short-rows", "rows", "int8", "uint16", "flat", "strided", "list"])
def test_bad_staging_rejected(rng: np.random.Generator, staging: object) -> None:
    pool = random_bytes(rng, (4, 12))
    before = pool.copy()
    with pytest.raises(KernelArgumentError):
        OPS.unpack(staging, [1, 2], pool)
    with pytest.raises(KernelArgumentError):
        OPS.pack(pool, [1, 2], staging)
    np.testing.assert_array_equal(pool, before)


@pytest.mark.parametrize("pool", [
    np.zeros((4, 12), np.int8),
    np.zeros((48,), np.uint8),
    np.zeros((4, 3, 4), np.uint8),
    np.zeros((12, 4), np.uint8).T,
], ids=["dtype", "1d", "3d", "strided"])
def test_bad_pool_rejected(pool: np.ndarray) -> None:
    with pytest.raises(KernelArgumentError, match="pool"):
        OPS.pack(pool, [0])
    with pytest.raises(KernelArgumentError, match="pool"):
        OPS.unpack(np.zeros((1, 12), np.uint8), [0], pool)
    assert not pool.any()


def test_read_only_targets_rejected(engine_case: tuple) -> None:
    kv, pool = engine_case
    pool.flags.writeable = False
    with pytest.raises(KernelArgumentError, match="read-only"):
        OPS.unpack(np.zeros((1, pool.shape[1]), np.uint8), [0], pool)
    with pytest.raises(KernelArgumentError, match="read-only"):
        OPS.gather(kv, [0], pool, [0])
    kv[1][0].flags.writeable = False
    with pytest.raises(KernelArgumentError, match="read-only"):
        OPS.scatter(pool, [0], kv, [0])


@pytest.mark.parametrize("ids", [[0.0, 1.0], [True, False], [[0, 1]], 3, ["a"]],
                         ids=["float", "bool", "2d", "scalar", "str"])
def test_bad_id_types_rejected(engine_case: tuple, ids: object) -> None:
    kv, pool = engine_case
    with pytest.raises(KernelArgumentError, match="slots"):
        OPS.pack(pool, ids)
    with pytest.raises(KernelArgumentError, match="block_ids"):
        OPS.gather(kv, ids, pool, [0, 1])


def test_length_mismatch_rejected(engine_case: tuple) -> None:
    kv, pool = engine_case
    before = pool.copy()
    with pytest.raises(KernelArgumentError, match="differ in length"):
        OPS.gather(kv, [0, 1, 2], pool, [0, 1])
    with pytest.raises(KernelArgumentError, match="differ in length"):
        OPS.scatter(pool, [0], kv, [0, 1])
    np.testing.assert_array_equal(pool, before)


def test_page_bytes_mismatch_rejected(engine_case: tuple, rng: np.random.Generator) -> None:
    kv, pool = engine_case
    short = random_bytes(rng, (8, pool.shape[1] - 2))
    before, engine_before = short.copy(), engine_bytes(kv)
    with pytest.raises(KernelArgumentError, match="page_bytes mismatch"):
        OPS.gather(kv, [0], short, [0])
    with pytest.raises(KernelArgumentError, match="page_bytes mismatch"):
        OPS.scatter(short, [0], kv, [0])
    with pytest.raises(KernelArgumentError, match="page_bytes mismatch"):
        OPS.gather(kv[:1], [0], pool, [0])  # one layer fills half a page
    np.testing.assert_array_equal(short, before)
    assert engine_bytes(kv) == engine_before


def _engine_variants(kv: list) -> dict[str, list]:
    """Engine caches each broken in one way."""
    k, v = kv[0]
    return {
        "empty": [],
        "not-pair": [(k,)],
        "shape": [(k, v), (kv[1][0][:-1], kv[1][1][:-1])],
        "dtype": [(k, v), (kv[1][0].view(np.uint16), kv[1][1].view(np.uint16))],
        "3d": [(k.reshape(k.shape[0], -1, k.shape[-1]), v)],
        "strided": [(k, v), (kv[1][0][::-1], kv[1][1])],
        "list": [(k.tolist(), v)],
    }


@pytest.mark.parametrize("case", ["empty", "not-pair", "shape", "dtype", "3d", "strided", "list"])
def test_bad_engine_rejected(engine_case: tuple, case: str) -> None:
    kv, pool = engine_case
    bad = _engine_variants(kv)[case]
    before, engine_before = pool.copy(), engine_bytes(kv)
    with pytest.raises(KernelArgumentError):
        OPS.gather(bad, [0], pool, [0])
    with pytest.raises(KernelArgumentError):
        OPS.scatter(pool, [0], bad, [0])
    np.testing.assert_array_equal(pool, before)
    assert engine_bytes(kv) == engine_before


def test_scatter_rejects_aliased_targets(engine_case: tuple) -> None:
    kv, pool = engine_case
    aliased = [(kv[0][0], kv[0][0]), kv[1]]
    with pytest.raises(KernelArgumentError, match="aliases"):
        OPS.scatter(pool, [0], aliased, [0])
    OPS.gather(aliased, [0], pool, [0])  # reading the same tensor twice is fine


# --------------------------------------------------------- allocation, host
def test_empty_pool_and_host_transfers() -> None:
    pool = OPS.empty_pool(3, 20)
    assert pool.shape == (3, 20) and pool.dtype == np.uint8 and pool.flags.c_contiguous
    assert OPS.empty_pool(0, 8).shape == (0, 8)
    assert OPS.to_host(pool) is pool and OPS.from_host(pool) is pool
    out = np.zeros_like(pool)
    pool[...] = 7
    assert OPS.to_host(pool, out) is out and (out == 7).all()
    with pytest.raises(KernelArgumentError):
        OPS.to_host(pool, np.zeros((3, 21), np.uint8))
    for args in [(-1, 8), (2, 0), (2.5, 8), (True, 8)]:
        with pytest.raises(KernelArgumentError):
            OPS.empty_pool(*args)
    OPS.synchronize()
    assert OPS.host_visible and OPS.device == "cpu" and OPS.xp is np


# ------------------------------------------------------------------ select
def test_select_auto_and_forced_numpy() -> None:
    if not cupy_available():
        assert select().name == "numpy"
        assert select("auto", "auto").device == "cpu"
    assert select("auto", "cpu").name == "numpy"
    for name in ("numpy", "cpu", "NumPy"):
        assert isinstance(select(name), NumpyPageOps)


def test_select_rejects_bad_requests() -> None:
    with pytest.raises(KernelArgumentError, match="unknown"):
        select("tpu")
    with pytest.raises(KernelArgumentError, match="device"):
        select("auto", "gpu0")
    with pytest.raises(KernelArgumentError, match="CPU"):
        select("numpy", "cuda:0")
    with pytest.raises(KernelArgumentError, match="CUDA"):
        select("cupy", "cpu")


@pytest.mark.skipif(cupy_available(), reason="CuPy and a GPU are available here")
def test_select_cupy_unavailable_is_clear() -> None:
    for name, device in [("cupy", "auto"), ("cupy", "cuda:0"), ("auto", "cuda:0")]:
        with pytest.raises(BackendUnavailableError, match="CuPy"):
            select(name, device)


def test_import_does_not_import_cupy() -> None:
    root = str(REPO_ROOT)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (root, os.environ.get("PYTHONPATH")) if p)}
    code = "import sys, kvstore.ops, kvstore.ops.cupy_ops; assert 'cupy' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=root, env=env)
