"""The tier stack's tests (tests/unit/tiers/test_stack.py) over a pool on the GPU: demotion through a pack
kernel and a download into pinned host memory, a pinned host tier above a disk tier, promotion through
an upload. Skipped cleanly without CuPy or a CUDA device; ``scripts/gpu-check`` runs it on one."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.gpu

from tests.conftest import require_gpu  # noqa: E402

require_gpu()

from kvstore.ops.cupy_ops import CupyPageOps  # noqa: E402
from tests.unit.tiers.test_stack import *  # noqa: E402,F401,F403  (the same tests, collected here again)
from tests.unit.tiers.test_stack import PB  # noqa: E402


@pytest.fixture
def stack(tmp_path: Path) -> tuple[Any, list[str]]:  # overrides test_stack's: a GPU pool
    return CupyPageOps, [f"host:{8 * PB}", f"disk:{tmp_path}/d0:{64 * 8 * 1024 + 4096}"]
