"""The vLLM namespace's model identity covers every byte of the weights, cheaply.

Real safetensors checkpoints (``safetensors.numpy.save_file``): two that differ only in 48
rows of the token embedding (a fine-tune that trained only the rows of added special tokens)
get different identities and different namespace digests; a Hugging Face cache's snapshot is
identified by its blobs' names (sha256 of their content) without reading the weights; elsewhere
the one xxh3 pass is remembered in the digest cache file, so the next start reads nothing, and
is redone when the file changes, even in place with its mtime put back. What is read is
measured with the kernel's count of bytes this process read (``/proc/self/io``, ``rchar``).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("vllm.v1.kv_offload.tiering.spec", reason="vLLM 0.33.0 is installed by `make test`")
safetensors_numpy = pytest.importorskip("safetensors.numpy")

from test_vllm_namespace import digest  # noqa: E402

from kvtiers.integrations.vllm.model_identity import digest_cache_path, model_identity  # noqa: E402

VOCAB, HIDDEN, LAYERS = 32000, 64, 4
ADDED = slice(31000, 31048)  # the 48 rows of the added special tokens


def weights(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    t = {"model.embed_tokens.weight": rng.standard_normal((VOCAB, HIDDEN)).astype(np.float16),
         "model.norm.weight": np.ones(HIDDEN, dtype=np.float16)}
    for i in range(LAYERS):
        t[f"model.layers.{i}.mlp.up_proj.weight"] = rng.standard_normal((4 * HIDDEN, HIDDEN)).astype(np.float16)
        t[f"model.layers.{i}.mlp.down_proj.weight"] = rng.standard_normal((HIDDEN, 4 * HIDDEN)).astype(np.float16)
    return t


def checkpoint(where: Path, tensors: dict[str, np.ndarray]) -> Path:
    """A model directory: config.json and one real safetensors file."""
    where.mkdir(parents=True)
    (where / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "hidden_size": HIDDEN,
                                                   "vocab_size": VOCAB, "num_hidden_layers": LAYERS}))
    safetensors_numpy.save_file(tensors, str(where / "model.safetensors"))
    return where


def fine_tuned(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """``tensors`` with the 48 added tokens' embedding rows trained, nothing else."""
    out = {k: v.copy() for k, v in tensors.items()}
    out["model.embed_tokens.weight"][ADDED] = np.random.default_rng(9).standard_normal((48, HIDDEN))
    return out


def read_bytes() -> int:
    """Bytes this process has read through read(2) and the like so far."""
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("rchar:")).split()[1])


def identity_and_read(name: str) -> tuple[str | None, int]:
    before = read_bytes()
    ident = model_identity(name)
    return ident, read_bytes() - before


@pytest.fixture(autouse=True)
def own_digest_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg-cache"))


def test_checkpoints_differing_in_48_embedding_rows_get_different_identities_and_namespaces(tmp_path) -> None:
    base = weights()
    a = checkpoint(tmp_path / "base", base)
    b = checkpoint(tmp_path / "tuned", fine_tuned(base))
    assert (a / "model.safetensors").stat().st_size == (b / "model.safetensors").stat().st_size
    copy = tmp_path / "copy"
    shutil.copytree(a, copy)
    ia, ib = model_identity(str(a)), model_identity(str(b))
    assert ia is not None and ib is not None
    assert ia != ib  # before: equal, and the tuned engine loaded the base engine's KV (wrong tokens)
    assert model_identity(str(copy)) == ia  # the same bytes by another path: one cache still
    root = tmp_path / "kv"
    assert digest(root, model=str(a)) != digest(root, model=str(b))
    assert digest(root, model=str(a)) == digest(root, model=str(copy))


def hf_cache(hub: Path, repo: str, rev: str, files: dict[str, bytes]) -> Path:
    """``files`` laid out as the Hugging Face cache keeps them: content in ``blobs/<sha256>``,
    the snapshot's files links to them. Returns the snapshot directory."""
    top = hub / ("models--" + repo.replace("/", "--"))
    (top / "blobs").mkdir(parents=True, exist_ok=True)
    snap = top / "snapshots" / rev
    snap.mkdir(parents=True)
    for name, data in files.items():
        sha = hashlib.sha256(data).hexdigest()
        (top / "blobs" / sha).write_bytes(data)
        (snap / name).symlink_to(Path("..") / ".." / "blobs" / sha)
    return snap


def test_a_hugging_face_snapshot_is_identified_by_its_blob_names_without_reading_the_weights(
        tmp_path, monkeypatch) -> None:
    src = checkpoint(tmp_path / "src", weights())
    files = {n: (src / n).read_bytes() for n in ("config.json", "model.safetensors")}
    size = len(files["model.safetensors"])
    hub = tmp_path / "hub"
    snap = hf_cache(hub, "org/llama", "0123abcd", files)
    tuned = checkpoint(tmp_path / "tuned", fine_tuned(weights()))
    hf_cache(hub, "org/llama-tuned", "4567cdef", {n: (tuned / n).read_bytes() for n in files})
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(hub))

    ident, read = identity_and_read("org/llama")
    assert ident is not None and read < size // 8, read  # the blob's name, not its bytes
    assert not digest_cache_path().exists()  # nothing to remember: the cache names the content
    assert model_identity(str(snap)) == ident  # the snapshot's path: the same blobs
    assert model_identity("org/llama-tuned") not in (None, ident)
    # the same bytes outside the cache are read (another kind of digest: they share no cache with it)
    ident_src, read = identity_and_read(str(src))
    assert ident_src not in (None, ident) and read >= size


def test_the_digest_pass_is_remembered_until_the_file_changes(tmp_path) -> None:
    a = checkpoint(tmp_path / "m", weights())
    f = a / "model.safetensors"
    size = f.stat().st_size

    first, read = identity_and_read(str(a))
    assert first is not None and read >= size  # one pass over every byte
    cached = json.loads(digest_cache_path().read_text())["files"]
    assert len(cached) == 1 and next(iter(cached.values()))[0].startswith("xxh3:")

    again, read = identity_and_read(str(a))  # the next engine start
    assert again == first and read < size // 8, read

    # one byte rewritten in place, size and mtime put back: ctime still moves
    st = f.stat()
    with open(f, "r+b") as fh:
        fh.seek(size // 2)
        b = fh.read(1)
        fh.seek(size // 2)
        fh.write(bytes([b[0] ^ 0xFF]))
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert f.stat().st_mtime_ns == st.st_mtime_ns and f.stat().st_size == size
    changed, read = identity_and_read(str(a))
    assert changed != first and read >= size

    digest_cache_path().write_text("{not json")  # a damaged cache file: read again, written anew
    again, read = identity_and_read(str(a))
    assert again == changed and read >= size
    assert json.loads(digest_cache_path().read_text())["version"] == 2


def sharded(where: Path, big_bytes: int = 20 << 20) -> Path:
    """A model directory as large checkpoints come: config.json and two safetensors shards (with
    their index), the first over 16 MiB (one pass reads 16 MiB at a time)."""
    where.mkdir(parents=True)
    (where / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "hidden_size": HIDDEN,
                                                   "vocab_size": big_bytes // (2 * HIDDEN),
                                                   "num_hidden_layers": LAYERS}))
    t = weights()
    rng = np.random.default_rng(1)
    first = {"model.embed_tokens.weight": rng.standard_normal((big_bytes // (2 * HIDDEN), HIDDEN)).astype(np.float16)}
    second = {k: v for k, v in t.items() if k != "model.embed_tokens.weight"}
    names = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")
    for name, part in zip(names, (first, second), strict=True):
        safetensors_numpy.save_file(part, str(where / name))
    (where / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {k: names[0] if k in first else names[1] for k in [*first, *second]}}))
    return where


def flip(path: Path, at: int) -> None:
    """One byte of ``path`` inverted in place, at offset ``at``."""
    with open(path, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0xFF]))


def test_every_weight_file_and_every_byte_past_16_mib_is_in_the_identity(tmp_path) -> None:
    """Issue 51.12: an identity of only the first weight file, or of a file's first 16 MiB, got
    through every test (each checkpoint was one file of about 4 MB)."""
    a = sharded(tmp_path / "a")
    big, small = sorted(a.glob("*.safetensors"))
    assert big.stat().st_size > (16 << 20) + (1 << 20)
    ident = model_identity(str(a))
    assert ident is not None

    same = tmp_path / "same"
    shutil.copytree(a, same)
    assert model_identity(str(same)) == ident  # a copy: the same identity, so a change below is the change

    past = tmp_path / "past-16-mib"
    shutil.copytree(a, past)
    flip(past / big.name, (16 << 20) + (512 << 10))  # a byte in the tensor data past the first 16 MiB
    assert model_identity(str(past)) not in (None, ident)

    second = tmp_path / "second-file"
    shutil.copytree(a, second)
    flip(second / small.name, small.stat().st_size - 2)  # a byte of the second shard's last tensor
    assert model_identity(str(second)) not in (None, ident)
