"""Page ops: copy KV pages between a node's page pool, staging buffers and
an inference engine's paged KV cache, on numpy (CPU) or CuPy (GPU).

Importing this package never imports CuPy; :func:`select` does so only when
a GPU backend may be chosen.
"""

from .auto import cupy_available, select
from .base import BackendUnavailableError, EngineLayout, KernelArgumentError, PageOps
from .numpy_ops import NumpyPageOps

__all__ = [
    "BackendUnavailableError",
    "EngineLayout",
    "KernelArgumentError",
    "NumpyPageOps",
    "PageOps",
    "cupy_available",
    "select",
]
