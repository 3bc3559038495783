"""``kvtiers encrypt scan|rewrite``: which key ids seal the chunks on a medium, and moving
the chunks under retired keys to the current key (docs/security.md, "Rotation").

Both work for tiers that keep one file per chunk, its sealed bytes at offset 0, under a
directory their options name, with the namespace's ``config.json`` beside the chunks (the
fs tier). ``scan`` reads the 144-byte header of each file, no key needed; ``rewrite`` loads
each chunk under a retired key through the tier (the retired key opens it), stores it
through a second instance of the tier opened on a staging directory beside the chunks
(sealed under the current key, in the tier's own format and trailer), and renames the new
file over the old one: at every moment the chunk's path holds one whole chunk, old or new,
so a rewrite killed at any point loses nothing. No key material is printed.

The staging directory is made with ``mkdtemp`` (a fresh name nobody can have planted, mode
0700, this user's), held open, and handed to the tier through that descriptor
(``/proc/self/fd/N``): a link or directory another user put inside the root, at any name, is
never written through, and its removal goes through the descriptor too (``O_NOFOLLOW``).

Anyone who can write the medium can put anything under it, so both read it as hostile: only
regular files are opened (``lstat`` first, then ``O_NONBLOCK | O_NOFOLLOW`` and ``fstat``:
a FIFO, device, socket or link is skipped, never waited on), and a header's length, which
no key authenticates, is believed only when the file is big enough to hold what it claims
(a forged one is skipped and reported; memory stays bounded by the files' real sizes).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import stat
import tempfile
from collections import Counter, defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import click

from ..engine.closing import Closing
from ..errors import ConfigError
from ..launcher import pid_running

#: keys per load/store job of a rewrite
BATCH = 16
#: the most chunk bytes one load/store job of a rewrite holds (fewer keys per job for bigger
#: chunks; one chunk per job when a single one is bigger)
BATCH_BYTES = 256 << 20
#: a rewrite's staging directory, beside the chunks: this prefix, 8 random characters
#: (``mkdtemp``), then ``-<pid>@<host>``
STAGING_PREFIX = ".kvtiers-rewrite-"
#: staging directories a rewrite makes in one root before it gives up on that root
STAGING_TRIES = 3
#: what follows :data:`STAGING_PREFIX` in a staging directory's name: pid and host (the
#: random part is absent in the names of rewrites before it had one)
_STAGING_TAIL = re.compile(r"(?:[a-z0-9_]{8}-)?([0-9]+)@(.+)\Z")
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
#: the largest ``config.json`` either command reads
CONFIG_LIMIT = 1 << 20
#: skipped files named on stderr; the rest are counted
SHOW_SKIPPED = 20
_OPEN_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC


@dataclass(frozen=True)
class SealedFile:
    """One chunk file with a sealed header, found under ``root`` (a medium directory)."""

    path: str
    key_id: str
    key: bytes
    payload: int
    digest: str
    root: str = ""
    size: int = 0


def medium_dirs(options: dict[str, Any]) -> list[str]:
    """The existing directories a tier's options name (absolute paths)."""
    return list(_dir_options(options).values())


def _dir_options(options: dict[str, Any]) -> dict[str, str]:
    out = {}
    for k, v in options.items():
        if k != "encrypt" and isinstance(v, str) and os.path.isabs(v) and os.path.isdir(v):
            out[k] = v
    return out


def _kind(mode: int) -> str:
    for test, what in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISLNK, "a symbolic link"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISDIR, "a directory")):
        if test(mode):
            return what
    return f"not a regular file (mode {stat.filemode(mode)})"


def _open_regular(path: str) -> tuple[int, os.stat_result]:
    """A descriptor and ``fstat`` of the regular file at ``path``; ``ValueError`` naming what
    is there instead. Never blocks: the name is ``lstat``-ed first, then opened
    ``O_NONBLOCK | O_NOFOLLOW`` and checked again (it may have been swapped in between)."""
    st = os.lstat(path)
    if not stat.S_ISREG(st.st_mode):
        raise ValueError(_kind(st.st_mode))
    fd = os.open(path, _OPEN_FLAGS)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(_kind(st.st_mode))
    except BaseException:
        os.close(fd)
        raise
    return fd, st


def _files(root: str) -> Iterator[str]:
    """Every name under ``root`` that is not a directory (directory links are not followed;
    rewrite staging directories are left out)."""
    for d, subdirs, names in os.walk(root):
        subdirs[:] = [s for s in subdirs if not s.startswith(STAGING_PREFIX)]
        for n in names:
            yield os.path.join(d, n)


def sealed_files(dirs: list[str], skipped: list[tuple[str, str]] | None = None) -> Iterator[SealedFile]:
    """Every regular file under ``dirs`` that starts with a sealed header whose length the
    file can hold. Files that are not regular (FIFOs, devices, sockets, links: never opened
    for reading, never waited on) and files whose header claims more than they hold (a
    forged header: nothing authenticates its length) go to ``skipped`` as ``(path, why)``."""
    from ..encryption import HEADER, read_header, sealed_bytes
    from ..types import PAGE

    for root in dirs:
        for p in _files(root):
            try:
                fd, st = _open_regular(p)
            except ValueError as e:
                if skipped is not None:
                    skipped.append((p, f"{e}, not opened"))
                continue
            except OSError:  # gone, unreadable, or swapped for a link (ELOOP): not a chunk we can read
                continue
            try:
                head = os.pread(fd, HEADER.size, 0)
            except OSError:
                continue
            finally:
                os.close(fd)
            h = read_header(head)
            if h is None:
                continue
            kid, key, payload, digest = h
            if payload <= 0 or payload % PAGE or sealed_bytes(payload) > st.st_size:
                if skipped is not None:
                    skipped.append((p, f"a forged sealed header: it says {payload} bytes of chunk, which a file of "
                                       f"{st.st_size} bytes cannot hold (a sealed chunk of N bytes takes N + "
                                       f"{sealed_bytes(0)}, N a multiple of {PAGE}); left alone"))
                continue
            yield SealedFile(p, kid, key, payload, digest, root, st.st_size)


def _report_skipped(skipped: list[tuple[str, str]]) -> None:
    for path, why in skipped[:SHOW_SKIPPED]:
        click.echo(f"skipped {path}: {why}", err=True)
    if len(skipped) > SHOW_SKIPPED:
        click.echo(f"skipped {len(skipped) - SHOW_SKIPPED} more file(s)", err=True)


def namespaces(dirs: list[str]) -> dict[str, dict[str, Any]]:
    """Namespace digest -> fields, from the ``config.json`` documents under ``dirs``."""
    out: dict[str, dict[str, Any]] = {}
    for root in dirs:
        for p in _files(root):
            if os.path.basename(p) != "config.json":
                continue
            try:
                fd, st = _open_regular(p)  # a FIFO named config.json is skipped, never waited on
            except (OSError, ValueError):
                continue
            try:
                if st.st_size > CONFIG_LIMIT:
                    continue
                doc = json.loads(os.pread(fd, CONFIG_LIMIT + 1, 0))
            except (OSError, ValueError, RecursionError):
                continue
            finally:
                os.close(fd)
            if isinstance(doc, dict) and doc.get("kvtiers_namespace") == 1 and isinstance(doc.get("fields"), dict):
                out[str(doc.get("digest"))] = doc["fields"]
    return out


def _setup(tier_type: str, config_text: str | None, config_file: str | None,
           need_keys: bool) -> tuple[dict[str, Any], list[str], Any]:
    """The tier's options, its directories and its keys (a :class:`TenantKeys`, or None
    without ``encrypt``)."""
    from ..config import parse_json_option
    from ..encryption.tenants import TenantKeys
    from ..registry import get_registry

    options = parse_json_option(config_text, config_file)
    options.pop("type", None)
    get_registry().tier_info(tier_type)
    spec = options.get("encrypt")
    keys = None
    if spec is not None:
        try:
            keys = TenantKeys.from_spec(spec, providers=get_registry().key_providers())
        except ConfigError as e:
            raise ConfigError(f"tier {tier_type!r}: {e}") from None
    elif need_keys:
        raise ConfigError("rewrite needs the tier's 'encrypt' option (the current key and the retired ones)")
    dirs = medium_dirs(options)
    if not dirs:
        raise ConfigError(f"tier {tier_type!r}: its options name no existing directory: 'kvtiers encrypt' "
                          "reads tiers that keep a file per chunk under one (fs)")
    return options, dirs, keys


@dataclass(frozen=True)
class Owner:
    """Whose a key id is: the default key (``tenant`` None) or a tenant's, and its status."""

    status: str  # "current", "retired", "not configured" or "-" (no keys given)
    tenant: str | None = None

    @property
    def label(self) -> str:
        """``default``, a tenant's label (``t-`` and 12 hex digits, never its name), or ``-``."""
        from ..encryption.tenants import tenant_label

        if self.status in ("-", "not configured"):
            return "-"
        return "default" if self.tenant is None else tenant_label(self.tenant)


def _owner(kid: str, keys: Any) -> Owner:
    if keys is None:
        return Owner("-")
    rings = ([(None, keys.default)] if keys.default is not None else []) + list(keys.tenants.items())
    for tenant, kr in rings:
        if kid in kr.specs:
            return Owner("current" if kid == kr.current else "retired", tenant)
    return Owner("not configured")


def _current_ids(keys: Any) -> dict[str, str]:
    """Owner label -> its current key id."""
    out = {"default": keys.default.current} if keys.default is not None else {}
    for tenant, kr in keys.tenants.items():
        out[Owner("current", tenant).label] = kr.current
    return out


@click.group()
def encrypt() -> None:
    """Encrypted chunks on a medium, by key id (docs/security.md)."""


_config = [
    click.argument("tier_type", metavar="TYPE"),
    click.option("--config", "config_text", metavar="JSON", help="The tier's options, with 'encrypt'."),
    click.option("--config-file", type=click.Path(dir_okay=False), help="A file holding that JSON object."),
    click.option("--json", "as_json", is_flag=True, help="Print the report as JSON."),
]


def _with_config(fn):
    for opt in reversed(_config):
        fn = opt(fn)
    return fn


@encrypt.command()
@_with_config
def scan(tier_type: str, config_text: str | None, config_file: str | None, as_json: bool) -> None:
    """Count the sealed chunks under TYPE's directories by namespace and key id, and say
    which key ids are current, retired or not configured, and whose (the default key, or a
    tenant by its label), with 'encrypt' in --config."""
    _options, dirs, keys = _setup(tier_type, config_text, config_file, need_keys=False)
    counts: Counter[tuple[str, str]] = Counter()
    sizes: Counter[tuple[str, str]] = Counter()
    skipped: list[tuple[str, str]] = []
    for f in sealed_files(dirs, skipped):
        counts[f.digest, f.key_id] += 1
        sizes[f.digest, f.key_id] += f.payload
    rows = []
    for (ns, kid), n in sorted(counts.items()):
        who = _owner(kid, keys)
        rows.append({"namespace": ns, "key_id": kid, "status": who.status, "owner": who.label, "chunks": n,
                     "bytes": sizes[ns, kid]})
    _report_skipped(skipped)
    if as_json:
        click.echo(json.dumps({"tier": tier_type, "dirs": dirs, "rows": rows, "skipped": len(skipped)}, indent=1))
        return
    click.echo(f"{'namespace':<18} {'key id':<34} {'status':<15} {'owner':<15} {'chunks':>8} {'bytes':>14}")
    for r in rows:
        click.echo(f"{r['namespace']:<18} {r['key_id']:<34} {r['status']:<15} {r['owner']:<15} {r['chunks']:>8} "
                   f"{r['bytes']:>14}")
    if not rows:
        click.echo(f"no sealed chunks under {', '.join(dirs)}")
    if skipped:
        click.echo(f"skipped {len(skipped)} file(s) that are not regular or whose sealed header is forged")


@encrypt.command()
@_with_config
def rewrite(tier_type: str, config_text: str | None, config_file: str | None, as_json: bool) -> None:
    """Seal every chunk under a retired key (in 'encrypt': 'retired', or a tenant's) again
    under its owner's current key: load it through TYPE, store it through TYPE opened on a
    staging directory beside it, rename the new file over the old (a tenant's chunks as that
    tenant's). The chunk's file is never missing, even if the rewrite is killed. Chunks under
    key ids that are not configured are counted, never touched; files that are not regular
    or whose header is forged are skipped and named."""
    options, dirs, keys = _setup(tier_type, config_text, config_file, need_keys=True)
    for d in dirs:
        _remove_stale_staging(d)
    ns_fields = namespaces(dirs)
    todo: dict[tuple[str, int, str | None], list[SealedFile]] = defaultdict(list)
    report: Counter[str] = Counter()
    skipped: list[tuple[str, str]] = []
    for f in sealed_files(dirs, skipped):
        who = _owner(f.key_id, keys)
        if who.status == "current":
            report["current"] += 1
        elif who.status == "retired":
            todo[f.digest, f.payload, who.tenant].append(f)
        else:
            report["not_configured"] += 1
    report["skipped"] = len(skipped)
    _report_skipped(skipped)
    for (digest, payload, tenant), files in sorted(todo.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][2] or "")):
        fields = ns_fields.get(digest)
        if fields is None:
            report["no_namespace"] += len(files)
            click.echo(f"namespace {digest}: no config.json describes it; {len(files)} chunk(s) left", err=True)
            continue
        _rewrite(tier_type, options, fields, payload, files, report, tenant)
    current = _current_ids(keys)
    out = {"tier": tier_type, "current_key_id": current.get("default"), "current_key_ids": current, **dict(report)}
    if as_json:
        click.echo(json.dumps(out, indent=1))
    else:
        ids = ", ".join(f"{who} {kid!r}" for who, kid in current.items())
        click.echo(f"rewritten {report['rewritten']} chunk(s) under the current key ids ({ids}); "
                   f"already current {report['current']}; failed {report['failed']}; "
                   f"not configured {report['not_configured']}; no namespace {report['no_namespace']}; "
                   f"skipped {report['skipped']}")
    if report["failed"]:
        raise SystemExit(1)


def _remove_stale_staging(root: str) -> None:
    """Remove the staging directories under ``root`` that rewrites of this host killed before
    their end left behind (their pid is no longer alive here). What they hold are copies: every
    chunk's own path kept a whole chunk. Only real directories owned by this user are removed
    (never through a link; another user's directory of that name is left alone)."""
    try:
        entries = [e for e in os.scandir(root) if e.name.startswith(STAGING_PREFIX)]
    except OSError:
        return
    for e in entries:
        m = _STAGING_TAIL.match(e.name[len(STAGING_PREFIX):])
        if m is None or m[2] != socket.gethostname():
            continue
        try:
            st = e.stat(follow_symlinks=False)
        except OSError:
            continue
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
            continue
        if pid_running(int(m[1])):
            continue  # alive: another rewrite's
        try:
            shutil.rmtree(e.path)  # fd-based: never follows a link swapped in underneath
        except OSError as err:
            click.echo(f"could not remove the stale staging directory {e.path}: {err}", err=True)


class _Staging:
    """A rewrite's staging directory inside ``root``: created exclusively by ``mkdtemp``
    (fresh random name, 0700, this user's), held open as :attr:`fd`, and named to the tier as
    :attr:`where`, the descriptor's ``/proc/self/fd/N`` where there is one: if the directory
    is renamed away and a link put in its place, the tier still writes into this directory.
    One swapped before it could be held (between ``mkdtemp`` and the open) is given up, its
    name left alone, and a fresh one made, up to :data:`STAGING_TRIES` times."""

    def __init__(self, root: str) -> None:
        self.root = root
        for attempt in range(1, STAGING_TRIES + 1):
            self.path = tempfile.mkdtemp(prefix=STAGING_PREFIX, suffix=f"-{os.getpid()}@{socket.gethostname()}",
                                         dir=root)
            try:
                self.fd, st = self._hold()
                break
            except OSError as e:
                if attempt == STAGING_TRIES:
                    raise OSError(f"{STAGING_TRIES} staging directories made in {root} were each replaced "
                                  f"before they could be opened (the last: {e}); nothing was written there") from None
                click.echo(f"{e}; making another", err=True)
        self.name = os.path.basename(self.path)
        self.ident = (st.st_dev, st.st_ino)
        pinned = f"/proc/self/fd/{self.fd}"
        try:
            pst = os.stat(pinned)
            same = (pst.st_dev, pst.st_ino) == self.ident
        except OSError:
            same = False  # no /proc: the path, created fresh and only this user's to write in
        self.where = pinned if same else self.path

    def _hold(self) -> tuple[int, os.stat_result]:
        """Open :attr:`path` (no link followed) and check it is still this user's 0700
        directory: its descriptor and status."""
        try:
            fd = os.open(self.path, _DIR_FLAGS)
        except OSError as e:  # a link there now (ENOTDIR with O_DIRECTORY | O_NOFOLLOW) or nothing
            raise OSError(f"the staging directory {self.path} was replaced before it could be opened "
                          f"({os.strerror(e.errno) if e.errno else e})") from None
        st = os.fstat(fd)
        if st.st_uid != os.geteuid() or stat.S_IMODE(st.st_mode) & 0o077:
            os.close(fd)
            raise OSError(f"the staging directory {self.path} was replaced by someone else's (owner uid "
                          f"{st.st_uid}, mode {stat.filemode(st.st_mode)})")
        return fd, st

    def remove(self) -> None:
        """Empty the directory through its descriptor, then remove its name from ``root`` if
        the name is still this directory; what could not be removed is said on stderr."""
        try:
            _clear(self.fd)
            rfd = os.open(self.root, _DIR_FLAGS)
            try:
                st = os.stat(self.name, dir_fd=rfd, follow_symlinks=False)
                if (st.st_dev, st.st_ino) != self.ident:
                    raise OSError(f"{self.path} is no longer the staging directory (moved away); its contents "
                                  "were removed, the directory left")
                os.rmdir(self.name, dir_fd=rfd)
            finally:
                os.close(rfd)
        except OSError as e:
            click.echo(f"could not remove the staging directory {self.path}: {e}", err=True)
        finally:
            os.close(self.fd)


def _clear(dfd: int) -> None:
    """Remove everything under the open directory ``dfd`` (no link followed)."""
    for e in list(os.scandir(dfd)):
        if e.is_dir(follow_symlinks=False):
            sub = os.open(e.name, _DIR_FLAGS, dir_fd=dfd)
            try:
                _clear(sub)
            finally:
                os.close(sub)
            os.rmdir(e.name, dir_fd=dfd)
        else:
            os.unlink(e.name, dir_fd=dfd)


def _rewrite(tier_type: str, options: dict[str, Any], fields: dict[str, Any], slot_bytes: int,
             files: list[SealedFile], report: Counter[str], tenant: str | None = None) -> None:
    """Load, store aside, rename over: ``files`` (one namespace, one slot size, one owner:
    ``tenant``, None for the default key) in batches of at most :data:`BATCH` chunks and
    :data:`BATCH_BYTES`. Whatever fails (a load, a store, opening the tier) leaves the files
    it concerns as they are, is counted in ``failed`` and said on stderr; the rest go on."""
    handled = 0
    try:
        with _Rewriter(tier_type, options, fields, slot_bytes, tenant) as rw:
            for i in range(0, len(files), rw.batch):
                part = files[i:i + rw.batch]
                rw.rewrite(part, report)
                handled += len(part)
    except Exception as e:  # noqa: BLE001 - one group that cannot be rewritten must not stop the others
        report["failed"] += len(files) - handled
        click.echo(f"namespace {files[0].digest}, chunks of {slot_bytes} bytes: {type(e).__name__}: {e}; "
                   f"{len(files) - handled} chunk(s) left as they were", err=True)


class _Rewriter(Closing):
    """The tier opened on its directories (to load under the retired key) and on a staging
    directory inside each (to store under the current key), over one arena of ``batch``
    slots; the staging directories are removed at exit."""

    def __init__(self, tier_type: str, options: dict[str, Any], fields: dict[str, Any], slot_bytes: int,
                 tenant: str | None) -> None:
        from ..integrations.blocking import BlockingTier
        from ..registry import open_tier
        from ..types import Arena, Namespace, TierContext

        self.tenant, self.fsync = tenant, bool(options.get("fsync"))
        self.batch = max(1, min(BATCH, BATCH_BYTES // slot_bytes))
        arena, ns = Arena.allocate(self.batch, slot_bytes), Namespace(fields)
        self.dirs = _dir_options(options)
        self.aside: dict[str, _Staging] = {}
        self.src = self.dst = None
        try:
            for k, v in self.dirs.items():
                self.aside[k] = _Staging(v)
            self.staging = {k: a.where for k, a in self.aside.items()}
            self.src = BlockingTier(open_tier(tier_type, options, TierContext(arena, ns)))
            # the staging instance holds one batch at a time: no bound of its own to evict it by
            aside = {k: v for k, v in options.items() if k != "max_bytes"} | self.staging
            self.dst = BlockingTier(open_tier(tier_type, aside, TierContext(arena, ns)))
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        for t in (self.dst, self.src):
            if t is not None:
                t.close()
        self.src = self.dst = None
        for a in self.aside.values():
            a.remove()
        self.aside = {}

    def rewrite(self, part: list[SealedFile], report: Counter[str]) -> None:
        """One batch: load, store aside, rename each new file over its old one."""
        from ..encryption.tenants import note_tenant

        assert self.src is not None and self.dst is not None
        keys = [f.key for f in part]
        note_tenant(self.src.handle, keys, self.tenant)
        note_tenant(self.dst.handle, keys, self.tenant)
        r = self.src.run("load", keys, range(len(part)))
        ok = [(s, f) for s, f in enumerate(part) if f.key not in r.failed_keys]
        report["failed"] += len(part) - len(ok)
        if r.failed_keys:
            click.echo(f"load failed, left as is: {r.error}", err=True)
        if not ok:
            return
        r = self.dst.run("store", [f.key for _s, f in ok], [s for s, _f in ok])
        if r.failed_keys:  # not renamed: the old files stay, still under the retired key
            click.echo(f"store failed, {len(r.failed_keys)} chunk(s) left as they were: {r.error}", err=True)
            report["failed"] += len(r.failed_keys)
        touched = set()
        for _s, f in ok:
            if f.key not in r.failed_keys:
                report[_replace(f, self.dirs, self.staging)] += 1
                touched.add(os.path.dirname(f.path))
        if self.fsync:  # the renames, as durable as the tier's own stores
            for d in touched:
                _fsync_dir(d)


def _replace(f: SealedFile, dir_opts: dict[str, str], staging: dict[str, str]) -> str:
    """Rename the new copy of ``f`` from the staging directory over ``f``'s file; what
    happened (a report key). The file's directory is reached from the root one component at a
    time without following a link (:func:`_chunk_dir`): one who can write the root and swaps a
    directory for a link after the scan does not get the new file written elsewhere."""
    opt = next(k for k, v in dir_opts.items() if v == f.root)
    rel = os.path.relpath(f.path, f.root)
    new = os.path.join(staging[opt], rel)
    try:
        st = os.lstat(new)
    except OSError:
        st = None
    if st is None or not stat.S_ISREG(st.st_mode):
        click.echo(f"{f.path}: the tier stored no file at {new}; left as it was", err=True)
        return "failed"
    try:
        dfd, name = _chunk_dir(f.root, rel)
    except FileNotFoundError:  # its directory removed meanwhile: nothing to bring back
        os.unlink(new)
        return "gone"
    except OSError as e:  # ELOOP / ENOTDIR: a link or a file where a directory was
        os.unlink(new)
        click.echo(f"{f.path}: its directory is no longer a directory of the root ({os.strerror(e.errno)}); "
                   "left alone", err=True)
        return "failed"
    try:
        try:
            old = os.stat(name, dir_fd=dfd, follow_symlinks=False)
        except FileNotFoundError:  # removed meanwhile (evicted by a cleaner, gc): not brought back
            os.unlink(new)
            return "gone"
        if not stat.S_ISREG(old.st_mode):
            os.unlink(new)
            click.echo(f"{f.path}: {_kind(old.st_mode)} there now; left alone", err=True)
            return "failed"
        os.replace(new, name, dst_dir_fd=dfd)
        return "rewritten"
    finally:
        os.close(dfd)


def _chunk_dir(root: str, rel: str) -> tuple[int, str]:
    """A descriptor of the directory of the file ``rel`` (relative to ``root``), opened one
    component at a time with ``O_NOFOLLOW`` from ``root`` (the configured path itself may be a
    link), and the file's name in it. ``OSError`` where a component is a link or not a
    directory now."""
    *dirs, name = rel.split(os.sep)
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for d in dirs:
            sub = os.open(d, _DIR_FLAGS, dir_fd=fd)
            os.close(fd)
            fd = sub
    except BaseException:
        os.close(fd)
        raise
    return fd, name


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
