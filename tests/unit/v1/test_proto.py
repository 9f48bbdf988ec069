"""The committed generated code matches proto/ (run ``make proto`` if not)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvstore import protogen


def test_generated_code_is_fresh(tmp_path: Path) -> None:
    pytest.importorskip("grpc_tools")
    for path in protogen.generate(tmp_path):
        committed = protogen.ROOT / path.relative_to(tmp_path)
        assert committed.exists(), f"{committed} missing: run `make proto`"
        assert committed.read_text() == path.read_text(), f"{committed} is stale: run `make proto`"


def test_wire_version_is_in_the_prefix() -> None:
    from kvstore.framing import PREFIX, WIRE_VERSION, WireError, decode_prefix, encode_prefix

    prefix = encode_prefix(b"hdr", 10)
    assert len(prefix) == PREFIX.size and decode_prefix(prefix) == (3, 10)
    wrong = bytearray(prefix)
    wrong[4] = WIRE_VERSION + 1
    with pytest.raises(WireError, match="version"):
        decode_prefix(bytes(wrong))
    with pytest.raises(WireError, match="magic"):
        decode_prefix(b"XXXX" + prefix[4:])
