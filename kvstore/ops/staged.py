"""Host memory driven exactly like a GPU pool: the CPU fallback of the GPU path.

:class:`StagedNumpyPageOps` keeps the pool in numpy memory but says it is not
host-visible, so every caller takes the device route: pages leave the pool
through ``pack`` and ``to_host`` and enter it through ``from_host`` and
``unpack``, with staging buffers in between. ``to_host`` and ``from_host``
really copy, as a device download and upload do, so code that forgets one
of them stores or sends stale bytes and fails its tests. The daemon offers
it as ``--device cpu-staged`` so CI runs the GPU node's code paths
(packed serving, device staging, the upload finisher) without a GPU.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .numpy_ops import NumpyPageOps

__all__ = ["StagedNumpyPageOps"]


class StagedNumpyPageOps(NumpyPageOps):
    """numpy pages behind a device-style interface (copies in and out)."""

    name = "numpy-staged"
    device = "cpu-staged"
    host_visible = False

    def to_host(self, array: Any, out: np.ndarray | None = None) -> np.ndarray:
        """A copy, like a device-to-host download (into ``out`` if given)."""
        self._check_array(array, "array")
        if out is None:
            return np.array(array, copy=True)
        return super().to_host(array, out)

    def from_host(self, host: np.ndarray) -> np.ndarray:
        """A copy, like a host-to-device upload."""
        self._check_array(host, "host")
        return np.array(host, copy=True)
