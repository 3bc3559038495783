"""An encrypted kvtiers tier as a vLLM 0.33.0 secondary tier (``secondary_tiers`` entry with
``"encrypt"``), in vLLM's own tiering classes on CPU: the cascade lands sealed on disk (no
chunk's bytes readable there) and a new engine with the key promotes every byte; a new
engine without it promotes nothing."""

from __future__ import annotations

import os

import pytest

pytest.importorskip("vllm.v1.kv_offload.tiering.spec", reason="vLLM 0.33.0 is installed by `make test`")

from test_integration_vllm import MODULE, Engine, chunks_for  # noqa: E402
from vllm.v1.kv_offload.base import LookupResult  # noqa: E402


def _key(tmp_path, name: str) -> str:
    p = tmp_path / name
    p.write_bytes(os.urandom(32))
    p.chmod(0o600)
    return str(p)


def test_encrypted_fs_secondary_tier_in_vllm(tmp_path) -> None:
    root = tmp_path / "kv"
    tier = {"type": "kvtiers_fs", "module_path": MODULE, "root_dir": str(root),
            "encrypt": {"key_file": _key(tmp_path, "key"), "key_id": "vllm-1"}}
    chunks = chunks_for(6, seed=7)
    a = Engine(tier)
    try:
        a.store("r1", chunks)
        assert a.tier.handle.hooks.stats["sealed"] == len(chunks)
    finally:
        a.close()
    on_disk = b"".join(p.read_bytes() for p in root.rglob("*.bin"))
    assert len(list(root.rglob("*.bin"))) == len(chunks)
    assert not any(data[:64] in on_disk or data[-64:] in on_disk for data in chunks.values())

    b = Engine(tier)  # a new engine with the key: every byte comes back
    try:
        got, seen = b.load("r2", list(chunks))
        assert LookupResult.HIT_PENDING in seen
        assert got == chunks
    finally:
        b.close()

    other = {**tier, "encrypt": {"key_file": _key(tmp_path, "other"), "key_id": "vllm-2"}}
    c = Engine(other)  # another key: the loads fail, vLLM answers MISS, no wrong bytes
    try:
        got, _seen = c.load("r3", list(chunks))
        assert got == {}
        assert c.tier.handle.hooks.stats["open_failed_unknown_key"] == len(chunks)
    finally:
        c.close()
