"""CuPy page ops (the raw CUDA kernels) against the numpy path, byte for byte.

Skipped cleanly without CuPy or a CUDA device. Sizes cover the 16-byte path,
the narrower 8/4/2/1-byte paths, misaligned base pointers, several thread
blocks per page, and more pages than the grid cap (grid-stride loop).
"""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

from tests.conftest import require_gpu  # noqa: E402

cupy = require_gpu()

from kvstore.ops import KernelArgumentError, NumpyPageOps, select  # noqa: E402

CPU = NumpyPageOps()
GPU = select("cupy", "cuda:0")

DTYPES = {"fp16": np.float16, "bf16": np.uint16, "fp8": np.uint8, "fp32": np.float32}
BLOCK_SHAPES = {"aligned": (4, 2, 8), "odd": (3, 1, 5), "large": (16, 8, 128)}
# 16-aligned, 8-, 4-, 2-, 1-aligned, and multi-block-per-page sizes.
PAGE_SIZES = [16, 4096, 8, 12, 6, 7, 1, 100, 200_000, 3 * 65536 + 8, 65537 * 3]


def random_bytes(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """Random host uint8 array."""
    return rng.integers(0, 256, size=shape, dtype=np.uint8)


def device_copy(host: np.ndarray, offset: int = 0) -> "cupy.ndarray":
    """Device copy of ``host``, optionally starting ``offset`` bytes into a
    larger allocation (a C-contiguous array with a misaligned base)."""
    if not offset:
        return cupy.asarray(host)
    raw = cupy.empty(host.nbytes + offset, dtype=cupy.uint8)[offset:]
    dev = raw.view(host.dtype).reshape(host.shape)
    dev.set(host)
    assert dev.flags.c_contiguous and dev.data.ptr % 16 == offset % 16
    return dev


def make_engine(rng: np.random.Generator, layers: int, num_blocks: int,
                block_shape: tuple[int, int, int], dtype: type) -> list[tuple[np.ndarray, np.ndarray]]:
    """Random host engine cache: per layer a (K, V) pair of [num_blocks, *block_shape]."""
    itemsize = np.dtype(dtype).itemsize
    shape = (num_blocks, *block_shape[:-1], block_shape[-1] * itemsize)
    return [tuple(random_bytes(rng, shape).view(dtype) for _ in range(2)) for _ in range(layers)]


def to_device(kv: list[tuple[np.ndarray, np.ndarray]], offset: int = 0) -> list[tuple]:
    """Device copies of an engine cache (layer 0's K at a misaligned base if asked)."""
    return [tuple(device_copy(t, offset if (l, i) == (0, 0) else 0) for i, t in enumerate(pair))
            for l, pair in enumerate(kv)]


def assert_engine_equal(dev: list[tuple], host: list[tuple[np.ndarray, np.ndarray]]) -> None:
    """Byte equality of a device and a host engine cache."""
    for dpair, hpair in zip(dev, host):
        for d, h in zip(dpair, hpair):
            assert cupy.asnumpy(d).tobytes() == h.tobytes()


@pytest.fixture
def rng() -> np.random.Generator:
    """Seeded generator so failures reproduce."""
    return np.random.default_rng(4321)


def test_select_picks_cupy() -> None:
    ops = select()
    assert ops.name == "cupy" and ops.device == "cuda:0" and not ops.host_visible
    assert ops.xp is cupy


@pytest.mark.parametrize("offset", [0, 1, 4], ids=["aligned", "off1", "off4"])
@pytest.mark.parametrize("page_bytes", PAGE_SIZES)
def test_pack_parity(rng: np.random.Generator, page_bytes: int, offset: int) -> None:
    host = random_bytes(rng, (9, page_bytes))
    slots = [8, 0, 3, 3, 5, 1]
    expected = CPU.pack(host, slots)
    got = GPU.pack(device_copy(host, offset), slots)
    assert isinstance(got, cupy.ndarray) and got.shape == expected.shape
    np.testing.assert_array_equal(cupy.asnumpy(got), expected)
    out = device_copy(np.zeros_like(expected), offset)
    assert GPU.pack(device_copy(host), cupy.asarray(slots), out) is out
    np.testing.assert_array_equal(cupy.asnumpy(out), expected)


@pytest.mark.parametrize("offset", [0, 2], ids=["aligned", "off2"])
@pytest.mark.parametrize("page_bytes", PAGE_SIZES)
def test_unpack_parity(rng: np.random.Generator, page_bytes: int, offset: int) -> None:
    host = random_bytes(rng, (9, page_bytes))
    staging = random_bytes(rng, (4, page_bytes))
    slots = np.array([7, 2, 0, 8], dtype=np.int32)
    pool = device_copy(host, offset)
    GPU.unpack(device_copy(staging, offset), slots, pool)
    CPU.unpack(staging, slots, host)
    np.testing.assert_array_equal(cupy.asnumpy(pool), host)


def test_many_small_pages_grid_stride(rng: np.random.Generator) -> None:
    host = random_bytes(rng, (80_000, 16))
    slots = rng.permutation(80_000)[:70_000]
    np.testing.assert_array_equal(cupy.asnumpy(GPU.pack(device_copy(host), slots)),
                                  CPU.pack(host, slots))
    staging = random_bytes(rng, (70_000, 16))
    pool = device_copy(host)
    GPU.unpack(device_copy(staging), cupy.asarray(slots), pool)
    CPU.unpack(staging, slots, host)
    np.testing.assert_array_equal(cupy.asnumpy(pool), host)


@pytest.mark.parametrize("offset", [0, 4], ids=["aligned", "off4"])
@pytest.mark.parametrize("layers", [1, 3])
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("block_shape", BLOCK_SHAPES.values(), ids=BLOCK_SHAPES.keys())
def test_gather_parity(rng: np.random.Generator, layers: int, dtype: type,
                       block_shape: tuple[int, int, int], offset: int) -> None:
    kv = make_engine(rng, layers, 7, block_shape, dtype)
    page_bytes = layers * 2 * kv[0][0][0].nbytes
    host = random_bytes(rng, (9, page_bytes))
    block_ids, slots = [6, 0, 3, 0], [1, 8, 4, 2]
    pool = device_copy(host)
    GPU.gather(to_device(kv, offset), block_ids, pool, slots)
    CPU.gather(kv, block_ids, host, slots)
    np.testing.assert_array_equal(cupy.asnumpy(pool), host)


@pytest.mark.parametrize("offset", [0, 4], ids=["aligned", "off4"])
@pytest.mark.parametrize("layers", [1, 3])
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("block_shape", BLOCK_SHAPES.values(), ids=BLOCK_SHAPES.keys())
def test_scatter_parity(rng: np.random.Generator, layers: int, dtype: type,
                        block_shape: tuple[int, int, int], offset: int) -> None:
    kv = make_engine(rng, layers, 7, block_shape, dtype)
    page_bytes = layers * 2 * kv[0][0][0].nbytes
    host = random_bytes(rng, (9, page_bytes))
    slots, block_ids = [5, 0, 5], [2, 6, 0]
    dev = to_device(kv, offset)
    GPU.scatter(device_copy(host), cupy.asarray(slots), dev, block_ids)
    CPU.scatter(host, slots, kv, block_ids)
    assert_engine_equal(dev, kv)


def test_gather_scatter_round_trip_on_device(rng: np.random.Generator) -> None:
    kv = to_device(make_engine(rng, 4, 32, BLOCK_SHAPES["large"], np.float16))
    pool = GPU.empty_pool(16, 4 * 2 * kv[0][0][0].nbytes)
    block_ids, slots = [31, 2, 17, 9], [0, 15, 7, 3]
    GPU.gather(kv, block_ids, pool, slots)
    restored = [(cupy.zeros_like(k), cupy.zeros_like(v)) for k, v in kv]
    GPU.scatter(pool, slots, restored, block_ids)
    GPU.synchronize()
    for pair, back in zip(kv, restored):
        for tensor, got in zip(pair, back):
            tensor, got = tensor.view(cupy.uint16), got.view(cupy.uint16)  # NaN-safe
            assert bool((got[block_ids] == tensor[block_ids]).all())
            untouched = [b for b in range(32) if b not in block_ids]
            assert not bool(got[untouched].any())


def test_empty_ids_and_host_transfers(rng: np.random.Generator) -> None:
    host = random_bytes(rng, (4, 32))
    pool = GPU.from_host(host)
    assert isinstance(pool, cupy.ndarray)
    assert GPU.pack(pool, []).shape == (0, 32)
    GPU.unpack(cupy.empty((0, 32), cupy.uint8), [], pool)
    out = np.zeros_like(host)
    assert GPU.to_host(pool, out) is out
    np.testing.assert_array_equal(out, host)
    np.testing.assert_array_equal(GPU.to_host(pool), host)


def _rejections(ops: object, xp: object, pool: object, kv: list) -> list:
    """Calls that must each raise KernelArgumentError on either backend."""
    pb = int(pool.shape[1])
    ones = xp.ones((2, pb), dtype=xp.uint8)
    return [
        lambda: ops.pack(pool, [0, 8]),
        lambda: ops.pack(pool, [-1]),
        lambda: ops.pack(pool, [0], xp.zeros((1, pb), dtype=xp.int8)),
        lambda: ops.unpack(ones, [0, 8], pool),
        lambda: ops.unpack(ones, [3, 3], pool),
        lambda: ops.unpack(ones[:, :-1], [1, 2], pool),
        lambda: ops.gather(kv, [0, 6], pool, [0, 1]),
        lambda: ops.gather(kv, [0, 1], pool, [2, 2]),
        lambda: ops.gather(kv[:1], [0], pool, [0]),
        lambda: ops.scatter(pool, [0, 1], kv, [4, 4]),
        lambda: ops.scatter(pool, [0, 1], kv, [0, -3]),
        lambda: ops.scatter(pool, [0, 1], kv, [0]),
        lambda: ops.gather(kv, [0.5], pool, [0]),
    ]


def test_rejections_match_and_write_nothing(rng: np.random.Generator) -> None:
    kv = make_engine(rng, 2, 6, BLOCK_SHAPES["odd"], np.float16)
    host = random_bytes(rng, (8, 2 * 2 * kv[0][0][0].nbytes))
    pool, dev_kv = device_copy(host), to_device(kv)
    cpu_calls = _rejections(CPU, np, host.copy(), kv)
    gpu_calls = _rejections(GPU, cupy, pool, dev_kv)
    for i, (cpu_call, gpu_call) in enumerate(zip(cpu_calls, gpu_calls)):
        with pytest.raises(KernelArgumentError) as cpu_err:
            cpu_call()
        with pytest.raises(KernelArgumentError) as gpu_err:
            gpu_call()
        assert type(cpu_err.value) is type(gpu_err.value), f"case {i}"
    np.testing.assert_array_equal(cupy.asnumpy(pool), host)
    assert_engine_equal(dev_kv, kv)


def test_device_ids_validated_on_device(rng: np.random.Generator) -> None:
    host = random_bytes(rng, (8, 48))
    pool = device_copy(host)
    with pytest.raises(KernelArgumentError, match="out of range"):
        GPU.pack(pool, cupy.asarray([1, 8]))
    with pytest.raises(KernelArgumentError, match="unique"):
        GPU.unpack(cupy.ones((2, 48), cupy.uint8), cupy.asarray([5, 5]), pool)
    with pytest.raises(KernelArgumentError, match="integers"):
        GPU.pack(pool, cupy.asarray([1.0]))
    np.testing.assert_array_equal(cupy.asnumpy(pool), host)


def test_host_arrays_rejected_as_device_operands(rng: np.random.Generator) -> None:
    host = random_bytes(rng, (4, 16))
    with pytest.raises(KernelArgumentError, match="cupy array"):
        GPU.pack(host, [0])
    with pytest.raises(KernelArgumentError, match="cupy array"):
        GPU.unpack(host[:1].copy(), [0], device_copy(host))
