"""Every CUDA kernel source compiles standalone with nvcc for sm_80 and sm_90.

Files are globbed, so a new ``kernels/*.cu`` is covered without editing this
test; the kernels cupy_ops launches by name must appear in the cubin.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT

KERNEL_DIR = REPO_ROOT / "kvstore" / "ops" / "kernels"
SOURCES = sorted(KERNEL_DIR.glob("*.cu"))
ARCHES = ["sm_80", "sm_90"]
# Entry points the Python side looks up with RawModule.get_function().
EXPECTED = {
    "pages.cu": ["pack_pages", "unpack_pages"],
    "engine.cu": ["gather_blocks", "scatter_blocks"],
}


def test_expected_sources_exist() -> None:
    names = {path.name for path in SOURCES}
    assert set(EXPECTED) <= names, f"missing kernel sources: {set(EXPECTED) - names}"


@pytest.mark.parametrize("arch", ARCHES)
@pytest.mark.parametrize("source", SOURCES, ids=[path.name for path in SOURCES])
def test_nvcc_compiles(source: Path, arch: str, tmp_path: Path) -> None:
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc is not on PATH")
    cubin = tmp_path / f"{source.stem}.{arch}.cubin"
    result = subprocess.run([nvcc, f"-arch={arch}", "-cubin", "-o", str(cubin), str(source)],
                            capture_output=True, text=True, timeout=110)
    assert result.returncode == 0, f"nvcc failed for {source.name} ({arch}):\n{result.stderr}"
    data = cubin.read_bytes()
    assert data[:4] == b"\x7fELF"
    for name in EXPECTED.get(source.name, []):
        # extern "C" names sit unmangled and NUL-terminated in the ELF string table.
        assert re.search(rb"[\x00.]" + name.encode() + rb"\x00", data), \
            f"kernel {name} missing from {source.name} ({arch})"
