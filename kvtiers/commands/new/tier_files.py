"""The files ``kvtiers new tier NAME`` writes, by path relative to the new directory.

Tokens replaced in paths and texts: ``__NAME__`` (the tier type), ``__DIST__`` (the
distribution), ``__PKG__`` (the package) and ``__CLASS__`` (the tier class). No path of the
machine that ran ``kvtiers new`` is written into any file.
"""

from __future__ import annotations

PYPROJECT = '''\
[build-system]
requires = ["setuptools>=77"]
build-backend = "setuptools.build_meta"

[project]
name = "__DIST__"
version = "0.1.0"
description = "A kvtiers storage tier: __NAME__."
readme = "README.md"
requires-python = ">=3.10"
dependencies = ["kvtiers"]

[project.optional-dependencies]
test = ["pytest>=8"]

# The line that makes it a kvtiers plugin: group "kvtiers", the tier's name, the module that
# implements register_tiers.
[project.entry-points.kvtiers]
__NAME__ = "__PKG__"

[tool.setuptools]
packages = ["__PKG__"]

[tool.pytest.ini_options]
pythonpath = ["."]  # the tests import the package from here, installed or not
testpaths = ["tests"]
'''

TIER = '''\
"""__DIST__: the kvtiers tier ``__NAME__`` (scaffolded by ``kvtiers new tier __NAME__``).

One file per chunk under ``root_dir/<namespace digest>/``: the chunk's bytes, then a
16-byte blake2b tag, published atomically (a temporary file linked into place). With
``max_bytes`` set, the least recently used chunks are deleted and reported with
``self.evicted`` (so they answer MISS and reach ``ctx.removed``).

To put the tier on your storage, replace the file calls in ``_write``, ``_read``,
``_exists`` and ``_unlink`` and keep the rest; ``make test`` runs the conformance suite.
The rules every tier keeps are kvtiers' docs/contract.md.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import secrets
import shutil
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import kvtiers

__version__ = "0.1.0"

TAG_BYTES = 16


def _tag(data: bytes | memoryview) -> bytes:
    return hashlib.blake2b(data, digest_size=TAG_BYTES).digest()


def write_once(path: Path, data: bytes) -> None:
    """Publish ``data`` at ``path`` atomically; if a file is there already, keep it (keys
    are content addresses: it holds the same bytes)."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    tmp.write_bytes(data)
    try:
        os.link(tmp, path)  # atomic, and fails if another writer was first
    except FileExistsError:
        pass
    finally:
        tmp.unlink()


class __CLASS__(kvtiers.AsyncTier):
    """Chunks as checksummed files under ``root_dir``; ``max_bytes`` bounds them (LRU)."""

    levels = frozenset({"core", "bounded"})  # what `make test` certifies

    def __init__(self, ctx: kvtiers.TierContext, *, root_dir: str, max_bytes: int | None = None,
                 threads: int = 4) -> None:
        super().__init__(ctx)  # first: the base class keeps its state there
        if max_bytes is not None and max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.max_bytes = max_bytes
        self.max_concurrency = threads
        self.dir = Path(root_dir, ctx.namespace.digest)
        self.dir.mkdir(parents=True, exist_ok=True)
        doc = self.dir / "config.json"
        if not doc.exists():
            write_once(doc, ctx.namespace.document_bytes())
        ctx.namespace.check_document(doc.read_bytes(), where=str(doc))  # ValueError if not ours
        self._lru: OrderedDict[bytes, int] = OrderedDict()  # key -> bytes, oldest first
        self._used = 0
        self._lru_lock = threading.Lock()  # also held while an eviction deletes files
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="__NAME__")

    # -- for the conformance suite ------------------------------------------------------
    @classmethod
    def conformance_config(cls, scratch: Path) -> dict:
        """Options for a test instance: a directory in the suite's scratch space."""
        return {"root_dir": str(scratch / "kv")}

    @classmethod
    def conformance_corrupt(cls, config: dict, namespace: kvtiers.Namespace, key: bytes) -> None:
        """Flip one byte of the stored chunk of ``key`` in place, as a disk fault would."""
        path = Path(config["root_dir"], namespace.digest, key.hex() + ".bin")
        with open(path, "r+b") as f:
            f.seek(os.fstat(f.fileno()).st_size // 2)
            b = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([b[0] ^ 0xFF]))

    @classmethod
    def conformance_cleanup(cls, config: dict) -> None:
        """Remove what the conformance suite stored with options ``config``: the namespace
        directories whose config.json describes one of the suite's namespaces (its fields
        hold ``kvtiers_conformance``). On your storage, delete those namespaces' keys."""
        for doc in Path(config["root_dir"]).glob("*/config.json"):
            try:
                fields = json.loads(doc.read_bytes()).get("fields") or {}
            except (OSError, ValueError, AttributeError):
                continue
            if "kvtiers_conformance" in fields:
                shutil.rmtree(doc.parent, ignore_errors=True)

    # -- storage: blocking calls, run on the tier's threads ------------------------------
    def path(self, key: bytes) -> Path:
        return self.dir / f"{key.hex()}.bin"  # the full hex: no traversal, no two keys alike

    def _exists(self, key: bytes) -> bool:
        return self.path(key).exists()

    def _write(self, key: bytes, blob: bytes) -> list[bytes]:
        write_once(self.path(key), blob)
        return self._admit(key, blob) if self.max_bytes is not None else []

    def _read(self, key: bytes) -> bytes | None:
        try:
            blob = self.path(key).read_bytes()
        except FileNotFoundError:
            return None
        with self._lru_lock:
            if key in self._lru:
                self._lru.move_to_end(key)  # recently used: evicted last
        return blob

    def _unlink(self, key: bytes) -> None:
        with self._lru_lock:
            self.path(key).unlink(missing_ok=True)
            self._used -= self._lru.pop(key, 0)

    def _admit(self, key: bytes, blob: bytes) -> list[bytes]:
        """Count ``key`` against ``max_bytes`` and delete the oldest chunks over it; return
        them. Under the lock that every deletion takes, so no chunk counted is lost."""
        size = len(blob) - TAG_BYTES
        with self._lru_lock:
            if not self.path(key).exists():  # an eviction deleted it after our write
                write_once(self.path(key), blob)
            if key in self._lru:
                self._lru.move_to_end(key)
                return []
            self._lru[key] = size
            self._used += size
            victims = []
            while self._used > self.max_bytes and len(self._lru) > 1:
                old, n = self._lru.popitem(last=False)
                self._used -= n
                self.path(old).unlink(missing_ok=True)
                victims.append(old)
            return victims

    async def io(self, fn, *args):
        """Blocking I/O runs on the tier's threads, never on the shared I/O loop."""
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

    # -- the four coroutines AsyncTier turns into the hooks --------------------------------
    async def exists(self, key: bytes) -> bool:
        return await self.io(self._exists, key)

    async def put(self, key: bytes, data: memoryview) -> None:
        if self.max_bytes is not None and len(data) > self.max_bytes:
            raise ValueError(f"a chunk of {len(data)} bytes exceeds max_bytes={self.max_bytes}")
        blob = bytes(data) + _tag(data)  # copy before the first await: the slot is ours only now
        victims = await self.io(self._write, key, blob)
        if victims:
            self.evicted(victims)  # MISS from now on, and reported through ctx.removed

    async def get_into(self, key: bytes, out: memoryview) -> bool:
        blob = await self.io(self._read, key)
        if blob is None:
            return False  # missing: a failed key
        data, tag = blob[:-TAG_BYTES], blob[-TAG_BYTES:]
        if len(data) != len(out) or _tag(data) != tag:
            await self.io(self._unlink, key)
            self.evicted([key], reason="corrupt")
            raise ValueError(f"chunk {key.hex()} is corrupt (length or checksum); removed")
        out[:] = data  # after the checks, on the loop: the slot is still ours
        return True

    async def delete(self, key: bytes) -> None:
        await self.io(self._unlink, key)
        self.forget([key])

    async def aclose(self) -> None:
        self.pool.shutdown(wait=True)


@kvtiers.hookimpl
def register_tiers(register) -> None:
    """Offer the ``__NAME__`` tier type (found through the ``kvtiers`` entry point)."""
    register("__NAME__", __CLASS__)
'''

TESTS = '''\
"""The kvtiers conformance suite on __CLASS__: every check of the levels it claims."""

from __future__ import annotations

import pytest
from kvtiers_conformance import TierTests


class Test__CLASS__(TierTests):
    """One test per check, named for its rule (pytest -k rule11 runs one rule)."""

    strict = True  # a check the tier gives the suite no means to run fails (kvtiers conformance --strict)

    @pytest.fixture
    def tier_config(self, tmp_path):
        # by import path, so subprocesses of the suite (crash test, shared level) import it too
        return "__PKG__:__CLASS__", {"root_dir": str(tmp_path / "kv")}
'''

MAKEFILE = '''\
# make test: the kvtiers conformance suite on this tier, strict (a check the tier gives the
# suite no means to run fails). It installs pytest first if the interpreter lacks it.
# PYTHON: an interpreter that has kvtiers; default: python3 on PATH (an activated venv's);
# another one: make test PYTHON=/path/to/venv/bin/python
# make install: install this distribution (editable) into that interpreter, so `kvtiers tiers`
# lists __NAME__ and configs can name it.
PYTHON ?= python3

.PHONY: test test-deps install conformance

test: test-deps
\t$(PYTHON) -m pytest -q -p no:cacheprovider

# what the tests need: kvtiers (said if missing) and pytest (installed if missing)
test-deps:
\t@$(PYTHON) -c "import kvtiers" 2>/dev/null || { \\
\t  echo "$(PYTHON) has no kvtiers: activate its environment, or make test PYTHON=/path/to/python" >&2; \\
\t  exit 1; }
\t@$(PYTHON) -c "import pytest" 2>/dev/null || $(PYTHON) -m pip install "pytest>=8"

install:
\t$(PYTHON) -m pip install -e ".[test]"

# the same checks through the CLI, once installed
conformance:
\t$(PYTHON) -m kvtiers.commands conformance __NAME__ --strict
'''

GITIGNORE = '''\
__pycache__/
*.egg-info/
build/
dist/
.hypothesis/
.pytest_cache/
'''

README = '''\
# __DIST__

A storage tier for kvtiers (pluggable KV-cache offloading tiers): the tier type `__NAME__`,
scaffolded by `kvtiers new tier __NAME__`. It keeps one checksummed file per chunk under
`root_dir`, and with `max_bytes` evicts the least recently used chunks, reporting them.

## Try it

```sh
make test        # the conformance suite, strict: levels core and bounded (installs pytest if missing)
make install     # pip install -e . into the same interpreter
kvtiers tiers    # now lists __NAME__
kvtiers conformance __NAME__
```

`make test` uses `python3` from `PATH` (an activated virtual environment's); give another
with `make test PYTHON=/path/to/python`. That interpreter needs `kvtiers`; `make test`
installs `pytest` into it if it is missing.

## Options

| option | type | meaning |
|---|---|---|
| `root_dir` | str | directory holding the chunks (one subdirectory per namespace) |
| `max_bytes` | int or null | bound on stored chunk bytes; the oldest chunks go first |
| `threads` | int | I/O threads and coroutines in flight |

```json
{"tiers": [{"type": "__NAME__", "root_dir": "/mnt/kv", "max_bytes": 100000000000}]}
```

## Making it yours

- `__PKG__/__init__.py` holds the tier. Replace the blocking calls `_exists`, `_write`,
  `_read` and `_unlink` with your storage's client; keep the checksum, the copy of the slot
  before the first `await`, and `self.evicted(keys)` for whatever your tier drops itself.
- `conformance_config(scratch)` gives the suite a test instance; `conformance_corrupt` lets
  it damage a stored chunk to prove a load fails instead of returning wrong bytes (without
  it the tier is not certified); `conformance_cleanup(config)` removes what the suite
  stored, so a run leaves nothing behind on your storage.
- Claim more levels in `levels` once they pass: `durable` (data survives a new instance and
  a killed process), `shared` (two instances, in two processes, on one backend). The file
  layout as generated passes both: `kvtiers conformance __NAME__ --level durable,shared`.
- `tests/test___NAME__.py` subclasses `kvtiers_conformance.TierTests`: every rule of the
  contract is a test; add your own tests next to it.
'''

FILES: dict[str, str] = {
    "pyproject.toml": PYPROJECT,
    "__PKG__/__init__.py": TIER,
    "tests/test___NAME__.py": TESTS,
    "Makefile": MAKEFILE,
    ".gitignore": GITIGNORE,
    "README.md": README,
}
