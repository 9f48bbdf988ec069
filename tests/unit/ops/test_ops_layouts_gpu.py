"""CuPy gather/scatter of the ``kv_first`` and ``blocks`` engine layouts
against the numpy path, byte for byte (an even segment count runs the raw
kernels; an odd one the CuPy fallback). Skipped cleanly without a GPU."""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

from tests.conftest import require_gpu  # noqa: E402

cupy = require_gpu()

from kvstore.ops import NumpyPageOps, select  # noqa: E402

CPU = NumpyPageOps()
GPU = select("cupy", "cuda:0")


@pytest.mark.parametrize("layout,num_layers", [("blocks", 1), ("blocks", 2), ("blocks", 3), ("kv_first", 2)])
def test_layout_parity(layout: str, num_layers: int) -> None:
    rng = np.random.default_rng(num_layers)
    shape = (12, 2, 32, 16) if layout == "blocks" else (2, 12, 32, 2, 8)
    host = [rng.integers(0, 256, shape, dtype=np.uint8) for _ in range(num_layers)]
    seg = int(np.prod(shape[1:] if layout == "blocks" else shape[2:]))
    page_bytes = num_layers * (1 if layout == "blocks" else 2) * seg
    blocks, slots = [3, 11, 0, 3], [4, 0, 2, 1]
    want = np.zeros((5, page_bytes), dtype=np.uint8)
    CPU.gather(host, blocks, want, slots, layout=layout)
    pool = cupy.zeros((5, page_bytes), dtype=cupy.uint8)
    dev = [cupy.asarray(t) for t in host]
    GPU.gather(dev, blocks, pool, slots, layout=layout)
    np.testing.assert_array_equal(cupy.asnumpy(pool), want)
    back = [cupy.zeros_like(t) for t in dev]
    GPU.scatter(pool, [4, 0, 2], back, [5, 6, 7], layout=layout)
    ref = [np.zeros_like(t) for t in host]
    CPU.scatter(want, [4, 0, 2], ref, [5, 6, 7], layout=layout)
    for d, r in zip(back, ref):
        np.testing.assert_array_equal(cupy.asnumpy(d), r)
