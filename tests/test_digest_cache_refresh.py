"""A weight file edited through a shared mapping: the stale digest, and the two ways to a
fresh one (issue 51.4).

A byte written through ``mmap`` to a page already dirty in that mapping is written without a
page fault, so the kernel moves neither mtime nor ctime (nor size, inode, device): the cache's
key stays the same and the remembered digest is stale. That is shown first (it is the limit
docs/vllm.md states); then ``"kvtiers_weight_digest_cache": false`` in
``kv_connector_extra_config`` (through vLLM's own ``TieringOffloadingSpec`` and the kvtiers
adapter), and ``kvtiers digest-cache drop PATH`` (the real command, in a subprocess), each give
the identity of the edited bytes: that of an untouched copy of them.
"""

from __future__ import annotations

import json
import mmap
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

pytest.importorskip("vllm.v1.kv_offload.tiering.spec", reason="vLLM 0.33.0 is installed by `make test`")
pytest.importorskip("safetensors.numpy")

from test_model_identity import checkpoint, weights  # noqa: E402
from test_vllm_namespace import digest  # noqa: E402

from kvtiers.errors import ConfigError  # noqa: E402
from kvtiers.integrations.vllm.model_identity import digest_cache_path, model_identity  # noqa: E402
from kvtiers.integrations.weight_digests import stamp  # noqa: E402

KVTIERS = str(Path(sys.executable).parent / "kvtiers")


@pytest.fixture(autouse=True)
def own_digest_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg-cache"))


@contextmanager
def stale(model: Path) -> Iterator[tuple[str, Path]]:
    """``model``'s weights edited through a shared mapping after its identity was remembered,
    with the file's stamp unchanged. Yields the remembered (stale) identity and a copy of the
    edited model (a new file: its identity is the truth)."""
    f = model / "model.safetensors"
    fd = os.open(f, os.O_RDWR)
    m = mmap.mmap(fd, 0)
    try:
        at = len(m) // 2
        m[at] = m[at]  # a process writes its page: that write faults, the stamp moves before the identity
        remembered = model_identity(str(model))
        before = stamp(os.stat(f))
        m[at] ^= 0xFF  # later, to the same page, still dirty: no fault, no new mtime or ctime
        m.flush()  # msync
        if stamp(os.stat(f)) != before:
            pytest.skip("the kernel moved the file's mtime or ctime on this write through the mapping "
                        "(its dirty page was written back in between): the stale case did not arise")
        assert model_identity(str(model)) == remembered  # the limit: what the cache cannot see
        copy = model.parent / (model.name + "-copy")
        shutil.copytree(model, copy)
        assert model_identity(str(copy)) != remembered
        yield remembered, copy
    finally:
        m.close()
        os.close(fd)


def test_the_option_gives_the_edited_bytes_identity_through_vllm_spec(tmp_path) -> None:
    model = checkpoint(tmp_path / "m", weights())
    root = tmp_path / "kv"
    with stale(model) as (remembered, copy):
        truth = digest(root, model=str(copy))
        assert digest(root, model=str(model)) != truth  # stale: the other bytes' namespace
        assert digest(root, model=str(model), kvtiers_weight_digest_cache=False) == truth
        remembered_files = [p for _, p in json.loads(digest_cache_path().read_text())["files"].values()]
        assert str(copy / "model.safetensors") in remembered_files  # other files' digests are kept
        # that pass replaced the remembered digest: the cache on again gives the fresh one
        assert digest(root, model=str(model)) == truth
        assert model_identity(str(model)) == model_identity(str(copy)) != remembered
    with pytest.raises(ConfigError, match="'kvtiers_weight_digest_cache' expects true or false, got str 'no'"):
        digest(root, model=str(model), kvtiers_weight_digest_cache="no")


def kvtiers(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([KVTIERS, *args], capture_output=True, text=True, timeout=120)


def test_kvtiers_digest_cache_drop_gives_the_edited_bytes_identity(tmp_path) -> None:
    model = checkpoint(tmp_path / "m", weights())
    f = model / "model.safetensors"
    with stale(model) as (remembered, copy):
        listed = kvtiers("digest-cache", "list", "--json")
        assert listed.returncode == 0, listed.stderr
        entries = {e["path"]: e for e in map(json.loads, listed.stdout.splitlines())}
        assert entries[str(f)]["state"] == "current" and entries[str(f)]["size"] == f.stat().st_size
        assert model_identity(str(model)) == remembered  # listing changes nothing

        r = kvtiers("digest-cache", "drop", str(model))
        assert (r.returncode, r.stdout.strip()) == (0, f"dropped 1 remembered digest(s) of {model}"), r.stderr
        assert model_identity(str(model)) == model_identity(str(copy)) != remembered

    r = kvtiers("digest-cache", "drop", str(f))  # a weight file by its own path
    assert (r.returncode, r.stdout.strip()) == (0, f"dropped 1 remembered digest(s) of {f}"), r.stderr
    r = kvtiers("digest-cache", "drop", "--all")
    assert (r.returncode, r.stdout.strip()) == (0, "dropped all 1 remembered digest(s)"), r.stderr
    assert kvtiers("digest-cache", "list").stdout == ""


def test_kvtiers_digest_cache_drop_without_a_path_is_a_usage_error(tmp_path) -> None:
    r = kvtiers("digest-cache", "drop")
    assert r.returncode == 2 and "give the weight files or model directories to forget" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
