"""Which implementation each ``auto`` choice picks here (no GPU, uvloop and
ucxx installed), and that explicit choices are honoured."""

from __future__ import annotations

import asyncio

import pytest

from kvstore.loops import loop_factory, resolve_loop
from kvstore.ops.auto import cupy_available, select


def test_auto_loop_is_uvloop() -> None:
    pytest.importorskip("uvloop")
    assert resolve_loop("auto") == "uvloop"
    loop = loop_factory("auto")()
    try:
        assert type(loop).__module__.startswith("uvloop")
    finally:
        loop.close()


def test_asyncio_loop_when_asked() -> None:
    assert resolve_loop("asyncio") == "asyncio"
    loop = loop_factory("asyncio")()
    try:
        assert isinstance(loop, asyncio.BaseEventLoop)
    finally:
        loop.close()
    with pytest.raises(ValueError):
        resolve_loop("trio")


def test_auto_ops_is_numpy_without_a_gpu() -> None:
    if cupy_available():
        pytest.skip("a GPU is present: auto picks CuPy (covered by the gpu tests)")
    ops = select("auto", "auto")
    assert (ops.name, ops.device, ops.host_visible) == ("numpy", "cpu", True)
