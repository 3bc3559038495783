"""The weight-digest cache of vLLM's model identity: a file this user alone can have written.

:mod:`kvtiers.integrations.vllm.model_identity` remembers each weight file's xxh3 digest in
``$XDG_CACHE_HOME/kvtiers/weight-digests.json`` under the file's device, inode, size, mtime and
ctime, so the next engine start reads nothing. A digest read from there decides which KV an
engine loads: a forged entry gives model A model B's identity, and A loads B's KV. So the cache
is used only where nobody else can have written it:

- the directory ``kvtiers/`` is created ``0700`` when absent; it is opened without following a
  link, and trusted only if it is a directory owned by this user and not writable by group or
  others (checked on the opened descriptor, and every later access goes through it);
- the file is opened without following a link and trusted only if it is a regular file owned
  by this user and not writable by group or others;
- it is written whole under a fresh name (``O_CREAT | O_EXCL | O_NOFOLLOW``, mode ``0600``) in
  that directory and renamed over the old one.

Anything else: the cache is not used (the weights are read, their digests computed), and the
reason is logged once per process.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import secrets
import stat
import threading
from collections.abc import Iterable
from pathlib import Path

log = logging.getLogger("kvtiers.integrations.vllm")

__all__ = ["DigestCache", "digest_cache_path", "stamp"]

NAME = "weight-digests.json"
_VERSION = 2  # files: {stamp: [digest, path]}
_ENTRIES = 4096  # digests the file keeps (the newest)
_MAX_BYTES = 64 << 20  # a cache file larger than this is not read (4096 entries are well under 1 MiB)

_said: set[str] = set()
_said_lock = threading.Lock()


def digest_cache_path() -> Path:
    """The file that remembers weight files' xxh3 digests: ``$XDG_CACHE_HOME/kvtiers/weight-digests.json``
    (``~/.cache`` without ``XDG_CACHE_HOME``)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "kvtiers" / NAME


def stamp(st: os.stat_result) -> str:
    """What must not change for a remembered digest to hold: device, inode, size, mtime and
    ctime (ctime too: a rewrite that puts the old mtime back still moves it). A write through a
    shared mapping of a page already dirty can leave all five as they were."""
    return f"{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}"


def _say_once(why: str) -> None:
    """Log why the cache is not used, once per process per reason."""
    with _said_lock:
        if why in _said:
            return
        _said.add(why)
    log.warning("kvtiers: not using the weight digest cache: %s; the weights are read and their digests computed",
                why)


def _not_ours(st: os.stat_result) -> str | None:
    """Why ``st`` may have been written by someone else (None: only this user can have)."""
    me = os.geteuid()
    if st.st_uid != me:
        return f"is owned by uid {st.st_uid}, not this user (uid {me})"
    if st.st_mode & 0o022:
        return f"is writable by group or others (mode {stat.S_IMODE(st.st_mode):o})"
    return None


class DigestCache:
    """The cache file's entries ``{stamp: (digest, path)}``, read once per identity and written
    back whole when it gained entries. A damaged file counts as empty; one that cannot be
    trusted (see the module) is neither read nor written; one that cannot be written only costs
    the next start a pass. ``believe=False``: :meth:`get` answers nothing (every file is read
    again), and what :meth:`put` adds replaces the old entries, the other files' kept."""

    def __init__(self, believe: bool = True) -> None:
        self.path = digest_cache_path()
        self.entries: dict[str, tuple[str, str]] = {}
        self.added = False
        self.believe = believe
        self._load()

    # -- the checked directory and file ---------------------------------------------------

    def _open_dir(self, create: bool) -> int | str:
        """A descriptor of the cache directory if it can be trusted (created ``0700`` when
        ``create`` and absent), else why not (an untrusted one said once)."""
        d = self.path.parent
        if create:
            try:
                d.parent.mkdir(parents=True, exist_ok=True)
                os.mkdir(d, 0o700)
            except FileExistsError:
                pass
            except OSError as e:
                return f"could not create the directory {d} ({e})"
        try:
            fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as e:
            if e.errno not in (errno.ELOOP, errno.ENOTDIR):
                return f"could not open the directory {d} ({e})"
            why = f"{d} is {'a symbolic link' if os.path.islink(d) else 'not a directory'}"
            _say_once(why)
            return why
        why = _not_ours(os.fstat(fd))
        if why is not None:
            os.close(fd)
            _say_once(f"the directory {d} {why}")
            return f"the directory {d} {why}"
        return fd

    def _load(self) -> None:
        dfd = self._open_dir(create=False)
        if isinstance(dfd, str):
            return
        try:
            try:
                fd = os.open(NAME, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dfd)
            except FileNotFoundError:
                return
            except OSError as e:
                if e.errno == errno.ELOOP:
                    _say_once(f"{self.path} is a symbolic link")
                else:
                    log.info("kvtiers: could not read the weight digest cache %s (%s)", self.path, e)
                return
            with os.fdopen(fd, "rb") as f:
                st = os.fstat(f.fileno())
                why = "is not a regular file" if not stat.S_ISREG(st.st_mode) else _not_ours(st)
                if why is not None:
                    _say_once(f"{self.path} {why}")
                    return
                if st.st_size > _MAX_BYTES:
                    return
                data = json.loads(f.read(_MAX_BYTES))
        except (OSError, ValueError):
            return
        finally:
            os.close(dfd)
        if isinstance(data, dict) and data.get("version") == _VERSION and isinstance(data.get("files"), dict):
            self.entries = {k: (v[0], v[1]) for k, v in data["files"].items()
                            if isinstance(k, str) and isinstance(v, list) and len(v) == 2
                            and all(isinstance(x, str) for x in v)}

    # -- entries ----------------------------------------------------------------------------

    def get(self, stamp: str) -> str | None:
        """The digest remembered under ``stamp``, or None."""
        entry = self.entries.get(stamp) if self.believe else None
        return None if entry is None else entry[0]

    def put(self, stamp: str, digest: str, path: Path) -> None:
        """Remember ``digest`` of the file at ``path`` under ``stamp`` (the newest last)."""
        self.entries.pop(stamp, None)
        self.entries[stamp] = (digest, str(path))
        self.added = True

    def drop(self, stamps: Iterable[str] = (), paths: Iterable[str] = ()) -> int:
        """Forget the entries under ``stamps`` and those of files at ``paths``; how many."""
        stamps, paths = set(stamps), set(paths)
        gone = [k for k, (_, p) in self.entries.items() if k in stamps or p in paths]
        for k in gone:
            del self.entries[k]
        if gone:
            self.added = True
        return len(gone)

    def save(self, force: bool = False) -> str | None:
        """Write the entries back if they changed (or ``force``): a fresh ``0600`` file in the
        checked directory, renamed over the old one. None if written (or nothing to write), else
        why not (logged: the next start only reads the weights again)."""
        if not (self.added or force):
            return None
        keep = dict(list(self.entries.items())[-_ENTRIES:])
        dfd = self._open_dir(create=True)
        if isinstance(dfd, str):
            log.info("kvtiers: did not write the weight digest cache %s: %s", self.path, dfd)
            return dfd
        tmp = f".weight-digests-{secrets.token_hex(8)}.tmp"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                         dir_fd=dfd)
            try:
                with os.fdopen(fd, "w") as f:
                    json.dump({"version": _VERSION, "files": {k: list(v) for k, v in keep.items()}}, f)
                os.replace(tmp, NAME, src_dir_fd=dfd, dst_dir_fd=dfd)
            except BaseException:
                os.unlink(tmp, dir_fd=dfd)
                raise
        except OSError as e:
            log.info("kvtiers: could not write the weight digest cache %s (%s): the next start reads the weights again",
                     self.path, e)
            return f"could not write it ({e})"
        finally:
            os.close(dfd)
        return None
