"""Backend selection: CuPy on a usable GPU, numpy otherwise.

``select()`` never imports CuPy unless a GPU backend may be chosen, and an
explicit GPU request fails loudly instead of silently falling back.
"""

from __future__ import annotations

from .base import BackendUnavailableError, KernelArgumentError, PageOps
from .numpy_ops import NumpyPageOps

__all__ = ["cupy_available", "select"]

_NUMPY_NAMES = frozenset({"numpy", "cpu"})
_STAGED_NAMES = frozenset({"numpy-staged", "cpu-staged"})
_CUPY_NAMES = frozenset({"cupy", "cuda", "gpu"})


def cupy_available() -> bool:
    """True when ``import cupy`` works and ``cupy.is_available()`` is true."""
    try:
        import cupy
    except Exception:  # ImportError, or CUDA libraries failing to load
        return False
    try:
        return bool(cupy.is_available())
    except Exception:
        return False


def _parse_device(device: str) -> int | None:
    """``"auto"`` -> -1, ``"cpu"``/``"cpu-staged"`` -> None, ``"cuda"``/``"cuda:N"`` -> N."""
    text = str(device).strip().lower()
    if text == "auto":
        return -1
    if text in ("cpu", "cpu-staged"):
        return None
    if text == "cuda":
        return 0
    if text.startswith("cuda:") and text[5:].isdigit():
        return int(text[5:])
    raise KernelArgumentError(
        f"device must be 'auto', 'cpu', 'cpu-staged', 'cuda' or 'cuda:N', got {device!r}")


def select(name: str = "auto", device: str = "auto") -> PageOps:
    """Return page ops for ``name`` ("auto", "numpy"/"cpu", "cupy"/"cuda",
    "numpy-staged") on ``device`` ("auto", "cpu", "cpu-staged", "cuda:N").

    "auto" picks CuPy when it imports and a GPU is available (device "auto"
    meaning cuda:0), else numpy. Asking for CuPy or a CUDA device where
    neither is usable raises BackendUnavailableError.
    """
    backend = str(name).strip().lower()
    if str(device).strip().lower() == "cpu-staged" or backend in _STAGED_NAMES:
        if backend not in _STAGED_NAMES | {"auto"} or str(device).strip().lower() not in ("cpu-staged", "auto"):
            raise KernelArgumentError(f"backend {name!r} cannot run on device {device!r}")
        from .staged import StagedNumpyPageOps

        return StagedNumpyPageOps()
    if backend not in _NUMPY_NAMES | _CUPY_NAMES | {"auto"}:
        raise KernelArgumentError(
            f"unknown page-ops backend {name!r}; use 'auto', 'numpy' or 'cupy'")
    device_id = _parse_device(device)
    if backend in _NUMPY_NAMES:
        if device_id is not None and device_id >= 0:
            raise KernelArgumentError(f"backend {name!r} runs on the CPU, not {device!r}")
        return NumpyPageOps()
    if backend == "auto":
        if device_id is None:
            return NumpyPageOps()
        if device_id < 0 and not cupy_available():
            return NumpyPageOps()
    elif device_id is None:
        raise KernelArgumentError(f"backend {name!r} needs a CUDA device, not 'cpu'")
    if not cupy_available():
        raise BackendUnavailableError(
            f"page-ops backend {name!r} on device {device!r} needs CuPy and a CUDA "
            "GPU, but CuPy is not installed or no GPU is available; install the "
            "'gpu' extra on a GPU machine or use select('numpy')")
    from .cupy_ops import CupyPageOps

    return CupyPageOps(max(device_id, 0))
