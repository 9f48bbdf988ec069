"""Page keys from token ids (``kvstore_client.keys``): a chained BLAKE2b-16
hash that must be identical in every process and on every host."""

from __future__ import annotations

import hashlib
import os
import struct
import subprocess
import sys

import numpy as np
import pytest

from kvstore_client.keys import KEY_BYTES, chain_keys, root_key

BT = 4  # block tokens in most tests


def reference_keys(tokens: list[int], block_tokens: int, salt: bytes = b"", parent: bytes | None = None) -> list[bytes]:
    """The documented formula, written out with hashlib and struct only."""
    key = hashlib.blake2b(b"kvstore/v1/root" + salt, digest_size=16).digest() if parent is None else parent
    keys = []
    for start in range(0, len(tokens) - block_tokens + 1, block_tokens):
        block = tokens[start:start + block_tokens]
        key = hashlib.blake2b(key + struct.pack(f"<{block_tokens}I", *block), digest_size=16).digest()
        keys.append(key)
    return keys


def test_keys_are_16_bytes_one_per_full_block() -> None:
    assert KEY_BYTES == 16
    tokens = list(range(4 * BT + 3))  # 4 full blocks and a partial one
    keys = chain_keys(tokens, BT)
    assert len(keys) == 4
    assert all(isinstance(k, bytes) and len(k) == 16 for k in keys)
    assert len(set(keys)) == 4
    assert len(root_key()) == 16 and len(root_key(b"salt")) == 16


@pytest.mark.parametrize("n", [0, 1, BT - 1])
def test_no_full_block_no_keys(n: int) -> None:
    assert chain_keys(list(range(n)), BT) == []


def test_partial_block_does_not_change_full_block_keys() -> None:
    base = list(range(3 * BT))
    assert chain_keys(base + [7, 8], BT) == chain_keys(base, BT) == chain_keys(base + [9], BT)


def test_equal_prefixes_equal_keys_and_divergence_changes_every_later_key() -> None:
    a = list(range(100, 100 + 6 * BT))
    b = list(a)
    b[3 * BT + 1] += 1  # one token of block 3 differs
    ka, kb = chain_keys(a, BT), chain_keys(b, BT)
    assert ka[:3] == kb[:3]
    assert all(x != y for x, y in zip(ka[3:], kb[3:]))
    assert len(set(ka[3:]) & set(kb[3:])) == 0
    # a shorter equal prefix gives the leading keys of the longer one
    assert chain_keys(a[:2 * BT], BT) == ka[:2]


def test_same_block_at_another_position_gets_another_key() -> None:
    block = [5, 6, 7, 8]
    keys = chain_keys(block * 3, BT)
    assert len(set(keys)) == 3  # keys name the whole prefix, not one block


def test_parent_continues_a_chain() -> None:
    a = list(range(3 * BT))
    b = list(range(1000, 1000 + 2 * BT + 1))
    ka = chain_keys(a, BT)
    assert chain_keys(a + b, BT) == ka + chain_keys(b, BT, parent=ka[-1])
    assert chain_keys(b, BT, parent=ka[-1]) != chain_keys(b, BT)
    assert chain_keys(a, BT, parent=root_key()) == ka
    assert chain_keys(a, BT, salt=b"s") == chain_keys(a, BT, parent=root_key(b"s"))
    # with a parent, the salt plays no part
    assert chain_keys(b, BT, parent=ka[-1], salt=b"x") == chain_keys(b, BT, parent=ka[-1])


def test_salt_changes_every_key() -> None:
    tokens = list(range(5 * BT))
    plain, s1, s2 = chain_keys(tokens, BT), chain_keys(tokens, BT, salt=b"model-a"), chain_keys(tokens, BT, salt=b"model-b")
    for i in range(5):
        assert len({plain[i], s1[i], s2[i]}) == 3
    assert chain_keys(tokens, BT, salt=b"") == plain
    assert root_key(b"") == root_key() != root_key(b"model-a")


def test_known_answer_from_the_documented_formula() -> None:
    tokens = [1, 2, 3, 4, 5, 6, 7, 0xFFFFFFFF, 9]  # two full blocks of 4, one partial token
    salt = b"model-a"
    root = hashlib.blake2b(b"kvstore/v1/root" + salt, digest_size=16).digest()
    k0 = hashlib.blake2b(root + b"".join(t.to_bytes(4, "little") for t in tokens[0:4]), digest_size=16).digest()
    k1 = hashlib.blake2b(k0 + b"".join(t.to_bytes(4, "little") for t in tokens[4:8]), digest_size=16).digest()
    # pinned: these literals must never change (keys are shared across versions and hosts)
    assert root_key() == bytes.fromhex("903800141195c90fcfa91ec34371bb7b")
    assert root.hex() == "3692156af7e537ee9ec88c49527e1fd6"
    assert [k0.hex(), k1.hex()] == ["22d51f3f290fc20d42796e89b302a0a9", "a93b3c5218c456c4a8edad2bb785125e"]
    assert root_key(salt) == root
    assert chain_keys(tokens, 4, salt=salt) == [k0, k1]


@pytest.mark.parametrize("block_tokens", [1, 3, 16])
def test_matches_reference_formula(block_tokens: int) -> None:
    rng = np.random.default_rng(block_tokens)
    tokens = [int(t) for t in rng.integers(0, 2**32, size=50, dtype=np.uint64)]
    for salt in (b"", b"tenant-7"):
        assert chain_keys(tokens, block_tokens, salt=salt) == reference_keys(tokens, block_tokens, salt)
    parent = bytes(range(16))
    assert chain_keys(tokens, block_tokens, parent=parent) == reference_keys(tokens, block_tokens, parent=parent)


def test_stable_across_processes_and_hash_seeds() -> None:
    tokens = list(range(7, 7 + 5 * BT))
    here = [k.hex() for k in chain_keys(tokens, BT, salt=b"s")]
    code = (
        "from kvstore_client.keys import chain_keys\n"
        f"print(','.join(k.hex() for k in chain_keys({tokens!r}, {BT}, salt=b's')))\n"
    )
    for seed in ("1", "98765"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60,
                             check=True)
        assert out.stdout.strip().split(",") == here


@pytest.mark.parametrize("tokens", [
    [-1], [0, 1, -5, 3], [2**32], [0, 2**32 + 7], [2**63], [2**64],
    np.array([-1], dtype=np.int8), np.array([-(2**31)], dtype=np.int32), np.array([2**32], dtype=np.int64),
    np.array([2**64 - 1], dtype=np.uint64),
], ids=lambda t: repr(t))
def test_rejects_token_ids_outside_uint32(tokens: object) -> None:
    with pytest.raises(ValueError, match="uint32"):
        chain_keys(tokens, 1)  # type: ignore[arg-type]


def test_accepts_uint32_bounds() -> None:
    assert chain_keys([0, 2**32 - 1], 2) == reference_keys([0, 2**32 - 1], 2)
    assert chain_keys(np.array([2**32 - 1], dtype=np.uint32), 1) == reference_keys([2**32 - 1], 1)


@pytest.mark.parametrize("block_tokens", [0, -1, -16])
def test_rejects_non_positive_block_tokens(block_tokens: int) -> None:
    with pytest.raises(ValueError, match="block_tokens must be > 0"):
        chain_keys([1, 2, 3, 4], block_tokens)


def test_rejects_non_1d_tokens() -> None:
    with pytest.raises(ValueError, match="1-D"):
        chain_keys(np.zeros((2, 4), dtype=np.int32), 4)
    with pytest.raises(ValueError, match="1-D"):
        chain_keys(np.int32(5), 1)  # type: ignore[arg-type]


INT_DTYPES = ["int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64", ">i4", ">u8", "<i2", ">u2"]


@pytest.mark.parametrize("dtype", INT_DTYPES)
def test_any_int_dtype_gives_the_same_keys(dtype: str) -> None:
    values = [0, 1, 2, 7, 42, 99, 126, 127, 5, 3, 64, 100]  # fit in every dtype
    expected = reference_keys(values, BT)
    assert chain_keys(values, BT) == expected
    assert chain_keys(tuple(values), BT) == expected
    assert chain_keys(np.array(values, dtype=dtype), BT) == expected
    # a non-contiguous view too
    doubled = np.repeat(np.array(values, dtype=dtype), 2)[::2]
    assert not doubled.flags.c_contiguous
    assert chain_keys(doubled, BT) == expected


def test_large_token_ids_in_wide_dtypes() -> None:
    values = [50_000, 2**31, 2**32 - 2, 128_256]
    expected = reference_keys(values, 2)
    for dtype in ("int64", "uint32", "uint64", ">u4"):
        assert chain_keys(np.array(values, dtype=dtype), 2) == expected
    assert chain_keys(range(8), 4) == reference_keys(list(range(8)), 4)  # type: ignore[arg-type]


def test_empty_inputs() -> None:
    assert chain_keys([], BT) == []
    assert chain_keys(np.array([], dtype=np.int64), BT) == []
    assert chain_keys([], BT, parent=b"p" * 16) == []
