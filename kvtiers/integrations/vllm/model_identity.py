"""A model's identity for the namespace: its config and weights, not the string it was served by.

vLLM passes tiers the model argument as given (``./models/llama``, ``/srv/llama``,
``org/llama``). Two engines serving the same checkpoint from two paths, or by name and by
path, compute the same KV bytes for the same tokens, so they should share a cache; two
checkpoints with the same config but other weights must not. :func:`model_identity` reads,
cheaply (no full pass over the weights):

- ``config.json``, parsed, without the keys that name where it was loaded from
  (``_name_or_path``, ``_commit_hash``, ``transformers_version``);
- for each weight file (``*.safetensors``, ``*.bin``, ``*.pt``, ``*.pth``, ``*.gguf``): its name,
  its size, and :data:`SAMPLES` pages of 4 KiB read at fixed offsets spread over the file;
  for a safetensors file also its header (tensor names, dtypes, shapes, offsets) and the
  first 256 bytes of every tensor (of at most 4096 per file, evenly spread), so checkpoints of
  one architecture whose weights differ (a fine-tune, even of a few layers) differ: a few MB
  read per model, whatever its size.

A Hugging Face repository id is resolved through the local Hugging Face cache (vLLM has
downloaded it there before any tier starts), when the cache holds exactly one snapshot of it.
Where the model cannot be read (a remote loader, several cached revisions), the identity is
``None`` and the namespace keeps the name as given.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import struct
from pathlib import Path

log = logging.getLogger("kvtiers.integrations.vllm")

__all__ = ["SAMPLES", "model_identity", "resolve_model_dir"]

#: pages of 4 KiB read from each weight file, evenly spread from its first byte to its last
SAMPLES = 16
_PAGE = 4096
_TENSOR_BYTES = 256  # read from the start of each tensor
_TENSORS = 4096  # tensors sampled per file at most (evenly), for MoE checkpoints of 100k tensors
_WEIGHTS = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
_NOT_IDENTITY = ("_name_or_path", "_commit_hash", "transformers_version")


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


def _weight_digest(path: Path, h: hashlib._Hash) -> None:
    """Name, size, safetensors header and sampled pages of one weight file, into ``h``."""
    size = path.stat().st_size
    h.update(f"{path.name}\0{size}\0".encode())
    with open(path, "rb") as f:
        if path.suffix == ".safetensors" and size >= 8:
            (n,) = struct.unpack("<Q", f.read(8))
            if n <= min(size - 8, 1 << 28):
                header = f.read(n)
                h.update(hashlib.sha256(header).digest())
                starts = sorted({int(t["data_offsets"][0]) for name, t in json.loads(header).items()
                                 if name != "__metadata__" and isinstance(t, dict) and "data_offsets" in t})
                step = max(1, len(starts) // _TENSORS)
                for start in starts[::step]:  # the first bytes of every tensor (of at most _TENSORS per file)
                    f.seek(8 + n + start)
                    h.update(f.read(_TENSOR_BYTES))
        last = max(size - _PAGE, 0)
        for i in range(SAMPLES):
            f.seek(last * i // max(SAMPLES - 1, 1))
            h.update(f.read(_PAGE))


@functools.lru_cache(maxsize=16)
def _identity(where: str, stamp: tuple) -> str | None:
    p = Path(where)
    h = hashlib.sha256(b"kvtiers-model-identity-1\0")
    if p.is_file():
        _weight_digest(p, h)
        return h.hexdigest()[:32]
    cfg_file = p / "config.json"
    if not cfg_file.is_file():
        return None
    cfg = json.loads(cfg_file.read_text())
    if not isinstance(cfg, dict):
        return None
    for k in _NOT_IDENTITY:
        cfg.pop(k, None)
    h.update(json.dumps(cfg, sort_keys=True, separators=(",", ":")).encode())
    weights = sorted(q for q in p.iterdir() if q.suffix in _WEIGHTS and q.is_file())
    if not weights:
        return None
    for q in weights:
        _weight_digest(q, h)
    return h.hexdigest()[:32]


def model_identity(name: str) -> str | None:
    """``sha256:<32 hex digits>`` of model ``name``'s config and weights (see the module), or
    None where they cannot be read here (then the namespace keeps ``name``)."""
    where = resolve_model_dir(name)
    if where is None:
        return None
    try:
        entries = [where] if where.is_file() else sorted(where.iterdir())
        stamp = tuple((q.name, q.stat().st_size, q.stat().st_mtime_ns) for q in entries if q.is_file())
        digest = _identity(str(where), stamp)
    except (OSError, ValueError) as e:
        log.warning("kvtiers: could not read model %r for its identity (%s): the namespace keeps the name", name, e)
        return None
    return None if digest is None else f"sha256:{digest}"
