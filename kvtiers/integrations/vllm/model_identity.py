"""A model's identity for the namespace: its config and weights, not the string it was served by.

vLLM passes tiers the model argument as given (``./models/llama``, ``/srv/llama``,
``org/llama``). Two engines serving the same checkpoint from two paths, or by name and by
path, compute the same KV bytes for the same tokens, so they should share a cache; two
checkpoints with the same config but other weights, in any byte, must not (one would load the
other's KV and answer wrong tokens). :func:`model_identity` covers every byte:

- ``config.json``, parsed, without the keys that name where it was loaded from
  (``_name_or_path``, ``_commit_hash``, ``transformers_version``);
- for each weight file (``*.safetensors``, ``*.bin``, ``*.pt``, ``*.pth``, ``*.gguf``): its name,
  its size and a digest of all its bytes. In a Hugging Face cache, where a snapshot's file is a
  link to ``../../blobs/<sha256 of its content>``, that is the blob's name (nothing read);
  elsewhere one xxh3-128 pass over the file, remembered in a small cache file
  (:func:`digest_cache_path`, trusted only if this user alone can have written it: see
  :mod:`kvtiers.integrations.weight_digests`) under the file's device, inode, size, mtime and ctime, so the next
  engine start reads nothing again until one of them changes. A write through a shared mapping
  can leave all five as they were: ``kvtiers_weight_digest_cache: false``
  (:func:`digest_cache_enabled`) or ``kvtiers digest-cache drop PATH`` forces a fresh pass.

A Hugging Face repository id is resolved through the local Hugging Face cache (vLLM has
downloaded it there before any tier starts), when the cache holds exactly one snapshot of it.
Where the model cannot be read (a remote loader, several cached revisions), the identity is
``None`` and the namespace keeps the name as given.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import xxhash

from ...errors import ConfigError
from ..weight_digests import DigestCache, digest_cache_path, stamp

log = logging.getLogger("kvtiers.integrations.vllm")

__all__ = ["WEIGHT_DIGEST_CACHE", "digest_cache_enabled", "digest_cache_path", "file_digest", "model_identity",
           "resolve_model_dir", "weight_files"]

#: the ``kv_connector_extra_config`` key that turns the weight digest cache's answers off
WEIGHT_DIGEST_CACHE = "kvtiers_weight_digest_cache"

_WEIGHTS = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
_NOT_IDENTITY = ("_name_or_path", "_commit_hash", "transformers_version")
_SHA256 = re.compile(r"[0-9a-f]{64}")
_READ = 16 << 20  # bytes per read of the xxh3 pass


def resolve_model_dir(name: str) -> Path | None:
    """The local directory (or single weight file) of model ``name``: a path as given, else the
    one cached snapshot of a Hugging Face repository id; None where there is none."""
    p = Path(name).expanduser()
    if p.is_dir() or (p.is_file() and p.suffix in _WEIGHTS):
        return p.resolve()
    if name.count("/") != 1 or name.startswith(("/", ".")):
        return None
    try:
        from huggingface_hub.constants import HF_HUB_CACHE
    except ImportError:
        return None
    snapshots = Path(HF_HUB_CACHE) / ("models--" + name.replace("/", "--")) / "snapshots"
    try:
        found = [s for s in snapshots.iterdir() if (s / "config.json").is_file()]
    except OSError:
        return None
    return found[0].resolve() if len(found) == 1 else None


def _hf_blob(path: Path) -> str | None:
    """The sha256 a Hugging Face cache names ``path``'s content by, if ``path`` is a snapshot's
    link ``<repo>/snapshots/<rev>/<file> -> <repo>/blobs/<sha256>``; else None."""
    if not path.is_symlink():
        return None
    target = path.resolve()
    repo = path.parent.parent.parent
    if (_SHA256.fullmatch(target.name) and target.parent.name == "blobs" and path.parent.parent.name == "snapshots"
            and target.parent.parent == repo.resolve()):
        return target.name
    return None


def file_digest(path: Path, cache: DigestCache | None = None) -> str:
    """A digest of every byte of file ``path``: ``sha256:<hex>`` from a Hugging Face cache's
    blob name, else ``xxh3:<hex>`` from one pass over it (remembered in ``cache``)."""
    blob = _hf_blob(path)
    if blob is not None:
        return f"sha256:{blob}"
    with open(path, "rb", buffering=0) as f:
        before = stamp(os.fstat(f.fileno()))
        if cache is not None and (known := cache.get(before)) is not None:
            return known
        h = xxhash.xxh3_128()
        buf = bytearray(_READ)
        view = memoryview(buf)
        while n := f.readinto(buf):
            h.update(view[:n])
        digest = f"xxh3:{h.hexdigest()}"
        if cache is not None and stamp(os.fstat(f.fileno())) == before:  # not written to meanwhile
            cache.put(before, digest, path)
    return digest


def weight_files(p: Path) -> list[Path]:
    """The weight files the identity covers: ``p`` itself (a single weight file), else every
    weight file directly in directory ``p``, by name."""
    if p.is_file():
        return [p]
    return sorted(q for q in p.iterdir() if q.suffix in _WEIGHTS and q.is_file())


def _identity(p: Path, cache: DigestCache) -> str | None:
    h = hashlib.sha256(b"kvtiers-model-identity-2\0")
    if not p.is_file():
        cfg_file = p / "config.json"
        if not cfg_file.is_file():
            return None
        cfg = json.loads(cfg_file.read_text())
        if not isinstance(cfg, dict):
            return None
        for k in _NOT_IDENTITY:
            cfg.pop(k, None)
        h.update(json.dumps(cfg, sort_keys=True, separators=(",", ":")).encode())
    weights = weight_files(p)
    if not weights:
        return None
    for q in weights:
        h.update(f"{q.name}\0{q.stat().st_size}\0{file_digest(q, cache)}\0".encode())
    return h.hexdigest()[:32]


def model_identity(name: str, use_cache: bool = True) -> str | None:
    """``sha256:<32 hex digits>`` of model ``name``'s config and every byte of its weights (see
    the module), or None where they cannot be read here (then the namespace keeps ``name``).
    ``use_cache=False``: no remembered digest is believed, every weight file is read, and the
    digests found replace the remembered ones (those of other files are kept)."""
    where = resolve_model_dir(name)
    if where is None:
        return None
    cache = DigestCache(believe=use_cache)
    try:
        digest = _identity(where, cache)
    except (OSError, ValueError) as e:
        log.warning("kvtiers: could not read model %r for its identity (%s): the namespace keeps the name", name, e)
        return None
    finally:
        cache.save()
    return None if digest is None else f"sha256:{digest}"


def digest_cache_enabled(extra_config: Mapping[str, Any] | None) -> bool:
    """``kvtiers_weight_digest_cache`` of ``kv_connector_extra_config`` (default true)."""
    value = (extra_config or {}).get(WEIGHT_DIGEST_CACHE, True)
    if not isinstance(value, bool):
        raise ConfigError(f"kv_connector_extra_config: {WEIGHT_DIGEST_CACHE!r} expects true or false, "
                          f"got {type(value).__name__} {value!r}")
    return value
