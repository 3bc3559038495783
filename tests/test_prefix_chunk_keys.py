"""kvtiers.prefix_chunk_keys: chained SHA-256 keys, one per full chunk, as documented."""

from __future__ import annotations

import hashlib
import struct

import numpy as np
import pytest

import kvtiers
from kvtiers import prefix_chunk_keys


def test_the_documented_encoding() -> None:
    ids = list(range(100, 140))
    h = hashlib.sha256(b"kvtiers-prefix-v1\0" + b"lora-7").digest()
    want = []
    for i in range(2):  # 40 tokens: two full chunks of 16, the last 8 tokens get no key
        h = hashlib.sha256(h + struct.pack("<16I", *ids[16 * i : 16 * (i + 1)])).digest()
        want.append(h)
    assert prefix_chunk_keys(ids, 16, salt=b"lora-7") == want
    assert all(len(k) == 32 for k in want)


def test_a_key_names_its_whole_prefix() -> None:
    a = list(range(64))
    b = a[:32] + [7] * 32  # shares the first two chunks
    c = [1] + a[1:]  # differs in the first token: no key in common
    ka, kb, kc = prefix_chunk_keys(a, 16), prefix_chunk_keys(b, 16), prefix_chunk_keys(c, 16)
    assert ka[:2] == kb[:2] and ka[2] != kb[2] and ka[3] != kb[3]
    assert not set(ka) & set(kc)
    assert prefix_chunk_keys(a, 16, salt=b"x") != ka
    assert prefix_chunk_keys(a[:63], 16) == ka[:3]


def test_lists_arrays_and_tensors_give_the_same_keys() -> None:
    torch = pytest.importorskip("torch")
    ids = [5, 2**32 - 1, 0, 9] * 8
    want = prefix_chunk_keys(ids, 8)
    assert prefix_chunk_keys(np.asarray(ids, dtype=np.int64), 8) == want
    assert prefix_chunk_keys(np.asarray(ids, dtype=np.uint32), 8) == want
    assert prefix_chunk_keys(torch.tensor(ids), 8) == want
    assert prefix_chunk_keys([], 8) == [] and prefix_chunk_keys(ids[:7], 8) == []


def test_bad_input_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="tokens_per_chunk must be positive"):
        prefix_chunk_keys([1, 2], 0)
    with pytest.raises(ValueError, match="flat"):
        prefix_chunk_keys([[1, 2]], 1)
    with pytest.raises(TypeError, match="ints"):
        prefix_chunk_keys([1.5, 2.0], 1)
    with pytest.raises(ValueError, match="2\\*\\*32"):
        prefix_chunk_keys([-1], 1)
    with pytest.raises(TypeError, match="not str"):
        prefix_chunk_keys("abc", 1)
    with pytest.raises(TypeError, match="salt must be bytes"):
        prefix_chunk_keys([1], 1, salt="s")
    assert "prefix_chunk_keys" in kvtiers.__all__
