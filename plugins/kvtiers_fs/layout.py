"""Where chunks live under ``root_dir`` and what a chunk file holds.

Layout::

    root_dir/<namespace digest>/config.json          the namespace description
    root_dir/<namespace digest>/<h1>/<h2>/<key hex>.bin
    root_dir/<namespace digest>/<h1>/<h2>/<key hex>.<pid>@<host>.<rand>.tmp   (a store in flight)

``h1``/``h2`` are the first two and next two hex digits of xxh3-64 of the key, so short or
skewed keys still spread over 65536 directories. The file name is the full hex of the key:
no key can escape the root and two distinct keys never share a name.

A chunk file is the chunk's bytes at offset 0 (a multiple of 4096 long) followed by one
4096-byte trailer page, so both halves stay O_DIRECT-aligned and one ``preadv`` reads them
into [arena slot, trailer buffer]. The trailer (little-endian), format version 2::

    magic "KVTFSCH1" | version u32 | flags u32 | data_len u64 | key_len u32 | pad u32 |
    key (64 bytes, zero-padded) | xxh3-128 of the data (16 bytes) |
    namespace digest (8 bytes: its 16 hex digits as binary) | xxh3-64 of the above (8)

followed by zeros up to 4096 bytes. Version 1 (no namespace field; its xxh3-64 at offset
112) is still read. A temporary file is held under an exclusive ``flock`` by its writer from
before it has a name until it is published: that, not the pid in its name, is how cleaners
tell a live writer (:func:`create_locked_temp`, :func:`remove_if_abandoned`).
"""

from __future__ import annotations

import errno
import fcntl
import os
import secrets
import socket
import stat
import struct
import time

import xxhash

from kvtiers.launcher import flock_held

TRAILER_BYTES = 4096
MAGIC = b"KVTFSCH1"
VERSION = 2
CHUNK_SUFFIX = ".bin"
TEMP_SUFFIX = ".tmp"
CONFIG_NAME = "config.json"

_HEAD_V1 = struct.Struct("<8sIIQI4x64s16s")
_HEAD = struct.Struct("<8sIIQI4x64s16s8s")
_TAIL = struct.Struct("<Q")
TRAILER_USED = _HEAD.size + _TAIL.size
#: a temporary file of this host whose lock nobody holds, but whose pid is alive, is removed
#: once it is this old (seconds): a writer that does not lock (an older kvtiers)
LOCK_GRACE_SECONDS = 60.0
_LOCK_UNSUPPORTED = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EINVAL, errno.ENOSYS}


class NotOurs(ValueError):
    """A valid chunk file this instance must leave alone: another slot size (geometry) or
    a newer on-disk format. A load of it is a miss; the file is never deleted for it."""

_HOST = socket.gethostname().split(".")[0].replace("@", "_")[:32] or "host"


def key_dirs(key: bytes) -> tuple[str, str]:
    """The two directory levels of ``key``: hex digits of a hash of the key."""
    h = xxhash.xxh3_64_hexdigest(key)
    return h[0:2], h[2:4]


def chunk_relpath(key: bytes) -> str:
    """``<h1>/<h2>/<key hex>.bin`` relative to the namespace directory."""
    h1, h2 = key_dirs(key)
    return f"{h1}/{h2}/{key.hex()}{CHUNK_SUFFIX}"


def chunk_path(nsdir: str, key: bytes) -> str:
    """The final path of ``key``'s chunk under namespace directory ``nsdir``."""
    return f"{nsdir}/{chunk_relpath(key)}"


def temp_path(final: str) -> str:
    """A unique temporary name next to ``final``: ``<key hex>.<pid>@<host>.<rand>.tmp``."""
    stem = final[: -len(CHUNK_SUFFIX)]
    return f"{stem}.{os.getpid()}@{_HOST}.{secrets.token_hex(4)}{TEMP_SUFFIX}"


def key_of_name(name: str) -> bytes | None:
    """The key of a chunk file name ``<key hex>.bin``, or ``None`` if it is not one."""
    if not name.endswith(CHUNK_SUFFIX):
        return None
    stem = name[: -len(CHUNK_SUFFIX)]
    if not stem or len(stem) > 128 or len(stem) % 2:
        return None
    try:
        return bytes.fromhex(stem)
    except ValueError:
        return None


def temp_owner(name: str) -> tuple[int, str] | None:
    """``(pid, host)`` of a temporary file name, or ``None`` if it is not one of ours."""
    if not name.endswith(TEMP_SUFFIX):
        return None
    parts = name[: -len(TEMP_SUFFIX)].split(".")
    if len(parts) != 3 or "@" not in parts[1]:
        return None
    pid, _, host = parts[1].partition("@")
    try:
        return int(pid), host
    except ValueError:
        return None


def lock_temp(fd: int, tries: int = 200) -> bool:
    """Take the writer's exclusive lock on a new temporary file (held until ``fd`` is
    closed). False where the file system does not support locks. A cleaner may hold the
    lock for a moment while it checks the file (:func:`temp_locked`): try again for a
    while (about 0.2 s) before giving up with ``EAGAIN``."""
    for i in range(tries):
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if i == tries - 1:
                raise
            time.sleep(0.001)
        except OSError as e:
            if e.errno in _LOCK_UNSUPPORTED:
                return False
            raise
        else:
            return True
    return False


def temp_locked(path: str) -> bool | None:
    """Whether a live writer holds the lock of temporary file ``path``: True (held),
    False (free: nobody writes it), None (unknown: the file system has no locks, or the file
    cannot be opened). Never blocks: ``O_NONBLOCK`` open, non-blocking lock attempt."""
    return flock_held(path)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie (killed, not yet reaped) writes nothing more
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rpartition(b")")[2].split()[0]
        return state not in (b"Z", b"X")
    except (OSError, IndexError):
        return True


def temp_is_stale(path: str, mtime: float, now: float, stale_after: float) -> bool:
    """Whether temporary file ``path`` (one of ours, by its name) is abandoned; nothing is
    removed (``kvtiers fs gc --dry-run``). Cleaners use :func:`remove_if_abandoned`, which
    decides and removes while holding the file's lock. Raises ``FileNotFoundError`` if the
    file is gone."""
    owner = temp_owner(os.path.basename(path))
    if owner is None:
        return False
    locked = temp_locked(path)
    return not locked and _abandoned(owner, locked, now - mtime, stale_after)


def _abandoned(owner: tuple[int, str], locked: bool | None, age: float, stale_after: float) -> bool:
    """The rules for a temporary file whose lock is not held (``locked`` False: free, None:
    unknown): see :func:`remove_if_abandoned`."""
    if locked is False and owner[1] == _HOST and (age > LOCK_GRACE_SECONDS or not _pid_alive(owner[0])):
        return True
    return age > stale_after


def remove_if_abandoned(path: str, now: float, stale_after: float) -> bool:
    """Remove temporary file ``path`` (one of ours, by its name) if its writer is gone;
    True if it was removed.

    A writer holds an exclusive ``flock`` on its temporary file from before the file has a
    name (``O_TMPFILE``, then a link; see :func:`create_locked_temp`) until it is published,
    and that lock is seen across PID namespaces and containers on one kernel: a held lock
    means a live writer, whatever its pid says, and the file is left alone. The cleaner
    takes the lock itself (never blocking) and decides and unlinks while holding it, so a
    writer can never lock a file that is then removed under it. With the lock free, a file
    whose writer's host (in its name) is this host is abandoned once its pid is not alive
    here or it is older than :data:`LOCK_GRACE_SECONDS` (a writer that does not lock, e.g.
    an older kvtiers; one that names its file before locking it, where ``O_TMPFILE`` is
    unsupported, checks after locking that its file still has a name and otherwise starts
    again). On another host a lock may be local to that host (some NFS mounts), so there,
    and where locks are unsupported, only age counts: older than ``stale_after`` seconds.
    Raises ``FileNotFoundError`` if the file is gone.
    """
    owner = temp_owner(os.path.basename(path))
    if owner is None:
        return False
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        raise
    except OSError:  # cannot be opened (permissions): ask nothing of its lock
        st = os.lstat(path)
        if not _abandoned(owner, None, now - st.st_mtime, stale_after):
            return False
        os.unlink(path)
        return True
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            locked: bool | None = False
        except BlockingIOError:
            return False  # a live writer
        except OSError:
            locked = None
        st = os.fstat(fd)
        if not _abandoned(owner, locked, now - st.st_mtime, stale_after):
            return False
        if os.lstat(path).st_ino != st.st_ino:
            return False  # replaced meanwhile: not the file we judged
        os.unlink(path)  # still holding its lock
        return True
    finally:
        os.close(fd)  # (releases the lock)


_AT_FDCWD = -100
_AT_SYMLINK_FOLLOW = 0x400
_libc = None


def _link_fd(fd: int, path: str) -> None:
    """Give the unnamed file open as ``fd`` (``O_TMPFILE``) the name ``path``:
    ``linkat(AT_FDCWD, "/proc/self/fd/N", AT_FDCWD, path, AT_SYMLINK_FOLLOW)``, which
    ``os.link`` does not call without a directory descriptor."""
    global _libc
    if _libc is None:
        import ctypes

        _libc = ctypes.CDLL(None, use_errno=True)
    if _libc.linkat(_AT_FDCWD, f"/proc/self/fd/{fd}".encode(), _AT_FDCWD, os.fsencode(path), _AT_SYMLINK_FOLLOW):
        import ctypes

        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), path)


_ANON_UNSUPPORTED = {errno.EOPNOTSUPP, errno.ENOTSUP, errno.EISDIR, errno.EINVAL, errno.ENOSYS}


def create_locked_temp(final: str, flags: int, anon: bool = True) -> tuple[str, int, bool]:
    """Create a temporary file next to ``final`` that is locked (:func:`lock_temp`) before
    any cleaner can see it; return ``(path, fd, anon)``. ``flags`` are the open flags
    besides ``O_CREAT``/``O_EXCL``/``O_TMPFILE`` (``O_WRONLY``, ``O_DIRECT``, ...).

    With ``anon`` it opens an unnamed file in the directory (``O_TMPFILE``), locks it, then
    links it under its temporary name: a cleaner never sees it unlocked. Where the file
    system (or ``/proc``) does not allow that, the returned ``anon`` is False (pass it next
    time) and the file is created under its name and then locked; a cleaner may remove it
    in between, which the writer notices (no name left after locking) and starts again
    under a new name. ``FileNotFoundError``: the directory does not exist."""
    d = os.path.dirname(final)
    for _ in range(3):
        tmp = temp_path(final)
        if anon:
            try:
                fd = os.open(d, (flags & ~(os.O_CREAT | os.O_EXCL)) | os.O_TMPFILE, 0o644)
            except OSError as e:
                if e.errno not in _ANON_UNSUPPORTED:
                    raise
                anon = False
            else:
                try:
                    lock_temp(fd)
                    _link_fd(fd, tmp)
                    return tmp, fd, True
                except FileExistsError:
                    os.close(fd)
                    continue
                except OSError as e:
                    os.close(fd)
                    if e.errno == errno.ENOENT and os.path.isdir("/proc/self/fd"):
                        raise FileNotFoundError(errno.ENOENT, "directory removed", d) from None
                    if e.errno not in _ANON_UNSUPPORTED | {errno.ENOENT, errno.EPERM, errno.EXDEV}:
                        raise
                    anon = False
                except BaseException:
                    os.close(fd)
                    raise
        fd = os.open(tmp, flags | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            if not lock_temp(fd) or os.fstat(fd).st_nlink:
                return tmp, fd, False
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)  # a cleaner removed it before the lock: a new one
    raise OSError(errno.EAGAIN, "temporary files removed as soon as created")


class Publishing:
    """``with Publishing(tmp, fd):`` around writing the temporary file ``tmp`` (open as
    ``fd``) and renaming it into place: ``fd`` is closed either way, and ``tmp`` removed if
    anything failed. A class, not a generator: it is on every store's path."""

    __slots__ = ("tmp", "fd")

    def __init__(self, tmp: str, fd: int) -> None:
        self.tmp, self.fd = tmp, fd

    def __enter__(self) -> int:
        return self.fd

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: object) -> None:
        try:
            os.close(self.fd)
        except BaseException:
            self._remove()
            raise
        if kind is not None:
            self._remove()

    def _remove(self) -> None:
        try:
            os.unlink(self.tmp)
        except OSError:
            pass


def namespace_tag(digest: str) -> bytes:
    """The 8 bytes a trailer records for a namespace: its 16-hex-digit digest as binary."""
    return bytes.fromhex(digest)


def pack_trailer(buf: memoryview, key: bytes, data_len: int, digest: bytes, ns: bytes) -> None:
    """Write the trailer of a chunk of ``data_len`` bytes with xxh3-128 ``digest`` of
    namespace tag ``ns`` (:func:`namespace_tag`) into ``buf`` (at least
    :data:`TRAILER_USED` bytes; the rest of the page must be zero)."""
    _HEAD.pack_into(buf, 0, MAGIC, VERSION, 0, data_len, len(key), key, digest, ns)
    _TAIL.pack_into(buf, _HEAD.size, xxhash.xxh3_64_intdigest(buf[: _HEAD.size]))


def check_trailer(buf: memoryview, key: bytes, data_len: int, ns: bytes | None) -> bytes:
    """Return the data digest recorded in trailer ``buf`` if it describes ``key`` with
    ``data_len`` bytes in namespace ``ns`` (``None``: any namespace); raise
    :class:`NotOurs` for a valid chunk of ``key`` with another length or a newer format,
    ``ValueError`` saying what is wrong otherwise (a corrupt or misplaced file)."""
    magic, version = struct.unpack_from("<8sI", buf, 0)
    if magic != MAGIC:
        raise ValueError("bad magic (not a chunk file, or truncated)")
    if version > VERSION:
        raise NotOurs(f"chunk format version {version} is newer than this kvtiers reads ({VERSION})")
    head = _HEAD if version >= 2 else _HEAD_V1
    if _TAIL.unpack_from(buf, head.size)[0] != xxhash.xxh3_64_intdigest(buf[: head.size]):
        raise ValueError("trailer checksum mismatch")
    if version < 1:
        raise ValueError(f"unknown chunk format version {version}")
    fields = head.unpack_from(buf, 0)
    dlen, klen, kbuf, digest = fields[3:7]
    if klen != len(key) or kbuf[:klen] != key:
        raise ValueError("trailer names a different key")
    if version >= 2 and ns is not None and fields[7] != ns:
        raise ValueError(f"chunk of another namespace ({fields[7].hex()})")
    if dlen != data_len:
        raise NotOurs(f"chunk holds {dlen} bytes, slot is {data_len} (another slot size)")
    return digest


def data_digest(data: memoryview) -> bytes:
    """The checksum kept for a chunk's bytes (xxh3-128; releases the GIL)."""
    return xxhash.xxh3_128_digest(data)


def data_hasher() -> xxhash.xxh3_128:
    """An incremental :func:`data_digest`: ``update`` with the bytes in order, then ``digest``."""
    return xxhash.xxh3_128()


def file_bytes(data_len: int) -> int:
    """On-disk size of a chunk file holding ``data_len`` bytes."""
    return data_len + TRAILER_BYTES


def read_regular(path: str, limit: int = 1 << 20) -> bytes:
    """The bytes of a small regular file; never blocks on a FIFO or device put there
    (``O_NONBLOCK``, then ``fstat``): anything else is ``ValueError``."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise ValueError(f"{path}: not a regular file (mode {stat.filemode(mode)})")
        chunks = []
        while data := os.read(fd, 65536):
            chunks.append(data)
            if sum(map(len, chunks)) > limit:
                raise ValueError(f"{path}: larger than {limit} bytes")
        return b"".join(chunks)
    finally:
        os.close(fd)


def ensure_namespace(root_dir: str, namespace, *, read_only: bool = False) -> str:
    """Create ``root_dir/<digest>/`` and its ``config.json`` (atomically, once), or check
    the stored one describes ``namespace``; return the namespace directory. With
    ``read_only`` nothing is created: a namespace that is not there is simply empty.

    Raises ``ValueError`` when the digest's directory holds a different description.
    """
    nsdir = os.path.join(os.path.abspath(root_dir), namespace.digest)
    if not read_only:
        os.makedirs(nsdir, exist_ok=True)
    cfg = os.path.join(nsdir, CONFIG_NAME)
    try:
        raw = read_regular(cfg)
    except FileNotFoundError:
        if read_only:
            return nsdir
        tmp = f"{cfg}.{os.getpid()}@{_HOST}.{secrets.token_hex(4)}{TEMP_SUFFIX}"
        try:
            with open(tmp, "wb") as f:
                f.write(namespace.document_bytes())
                f.flush()
                os.fsync(f.fileno())
            try:  # link, not rename: a description another instance wrote first wins
                os.link(tmp, cfg)
            except FileExistsError:
                pass
            except OSError:  # file systems without hard links
                if not os.path.exists(cfg):
                    os.rename(tmp, cfg)
        finally:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
        raw = read_regular(cfg)
    namespace.check_document(raw, where=cfg)
    return nsdir


_KINDS = (
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISLNK, "a symbolic link"),
)


def file_kind(mode: int) -> str:
    """What a file that is not a regular file is (``st_mode``), for the warnings and refusals
    that name a hostile file under the root."""
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")
