"""``kvtiers encrypt rewrite``'s staging directory inside a root other users can write (issue
51 item 7): run as root, the real CLI never writes through a link or a directory another user
planted there, at the name older rewrites used (``.kvtiers-rewrite-<pid>@<host>``) or any
other, nor through one swapped in for its own staging directory while it runs; stale staging
directories are removed only when they are real directories of this user whose rewrite died."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from test_encryption_cli import _all_load, _key_ids, _rotated

from kvtiers.commands import encrypt
from kvtiers.commands.encrypt import STAGING_PREFIX

KVTIERS = os.path.join(os.path.dirname(sys.executable), "kvtiers")
HOST = socket.gethostname()
NOBODY = 65534


def _attacker(tmp_path):
    """A directory outside the root, another user's where the test runs as root."""
    d = tmp_path / "attacker"
    d.mkdir()
    d.chmod(0o777)
    if os.geteuid() == 0:
        os.chown(d, NOBODY, NOBODY)
    return d


def _plant(link, target) -> None:
    os.symlink(target, link)
    if os.geteuid() == 0:
        os.lchown(link, NOBODY, NOBODY)


def _everything_under(d) -> list[str]:
    return sorted(str(p.relative_to(d)) for p in d.rglob("*"))


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def _rewrite_with_pid(config: str, before_start) -> subprocess.CompletedProcess:
    """The real ``kvtiers encrypt rewrite`` in a process whose pid is known before it starts
    (a shell-less exec of the script once ``before_start(pid)`` has planted what it wants)."""
    child = subprocess.Popen([sys.executable, "-c", "import os, sys; sys.stdin.readline(); "
                              "os.execv(sys.argv[1], sys.argv[1:])", KVTIERS, "encrypt", "rewrite", "fs",
                              "--config", config, "--json"],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        before_start(child.pid)
        out, err = child.communicate("go\n", timeout=120)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    return subprocess.CompletedProcess(child.args, child.returncode, out, err)


def test_links_planted_at_staging_names_are_never_written_through(tmp_path):
    """Links to another user's directory at the rewrite's own predictable old name (its pid,
    this host), at names of the current pattern and at a bare prefix: the rewrite succeeds,
    nothing lands in that directory (no config.json with the model name, no cleaner.lock, no
    index snapshot, no chunk), the links are left as they were, no staging directory stays."""
    root = tmp_path / "kv"
    config, keys, rotated, digest = _rotated(tmp_path, root, 24)
    theirs = _attacker(tmp_path)
    dead = _dead_pid()
    links: list = []

    def plant(pid: int) -> None:
        for name in (f"{pid}@{HOST}", f"aaaaaaaa-{pid}@{HOST}", f"zzzzzzzz-{pid}@{HOST}", f"{dead}@{HOST}",
                     f"bbbbbbbb-{dead}@{HOST}", "x"):
            links.append(root / (STAGING_PREFIX + name))
            _plant(links[-1], theirs)

    r = _rewrite_with_pid(config, plant)
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout)
    assert rep["rewritten"] == 24 and rep.get("failed", 0) == 0, rep
    assert _everything_under(theirs) == [], "the rewrite wrote into another user's directory through a link"
    assert all(p.is_symlink() and os.readlink(p) == str(theirs) for p in links)
    assert sorted(p.name for p in root.iterdir() if p.name.startswith(STAGING_PREFIX)) == sorted(p.name for p in links)
    assert _key_ids(root / digest) == {"k-new": 24}
    assert _all_load(root, keys, {"key_file": rotated["key_file"], "key_id": "k-new"}) == []
    assert "Traceback" not in r.stderr


def test_a_staging_directory_swapped_for_a_link_midway_is_not_followed(tmp_path):
    """Another user who can write the root renames the running rewrite's staging directory
    away and puts a link to their own directory in its place: the rewrite goes on in its own
    directory (held open), every chunk is rewritten and loads, nothing lands in theirs, and
    the clean-up says the directory was moved instead of silently leaving it."""
    slot, n = 64 << 10, 96
    root = tmp_path / "kv"
    config, keys, rotated, digest = _rotated(tmp_path, root, n, slot=slot)
    root.chmod(0o777)
    theirs = _attacker(tmp_path)
    moved = root / "moved-away"
    child = subprocess.Popen([KVTIERS, "encrypt", "rewrite", "fs", "--config", config, "--json"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline, swapped = time.monotonic() + 60, None
        while swapped is None and child.poll() is None and time.monotonic() < deadline:
            for p in root.iterdir():
                # midway: once the rewrite holds it open (a swap before that is the next test's)
                if p.name.startswith(STAGING_PREFIX) and p.is_dir() and not p.is_symlink() and _held(child.pid, p):
                    os.rename(p, moved)
                    _plant(p, theirs)
                    swapped = p
                    break
        out, err = child.communicate(timeout=120)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert swapped is not None, "the rewrite ended before its staging directory could be swapped"
    assert child.returncode == 0, err
    rep = json.loads(out)
    assert rep["rewritten"] == n and rep.get("failed", 0) == 0, rep
    assert _everything_under(theirs) == [], "the rewrite wrote through the link swapped in for its staging directory"
    assert f"could not remove the staging directory {swapped}: {swapped} is no longer the staging directory" in err
    assert _everything_under(moved) == []  # emptied through its descriptor
    assert _key_ids(root / digest) == {"k-new": n}
    assert _all_load(root, keys, {"key_file": rotated["key_file"], "key_id": "k-new"}, slot) == []


def _held(pid: int, d) -> bool:
    """Whether process ``pid`` has directory ``d`` open."""
    st = d.stat()
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return False
    for fd in fds:
        try:
            fst = os.stat(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if (fst.st_dev, fst.st_ino) == (st.st_dev, st.st_ino):
            return True
    return False


def _swapping_mkdtemp(monkeypatch, theirs, swaps: int) -> list:
    """Fault injection: the first ``swaps`` staging directories are renamed away and a link
    to ``theirs`` put in their place the moment ``mkdtemp`` has made them, before the rewrite
    can open them; the swapped names are returned as they happen."""
    real, swapped = tempfile.mkdtemp, []

    def mkdtemp(*args, **kwargs):
        path = real(*args, **kwargs)
        if len(swapped) < swaps:
            os.rename(path, f"{path}.moved")
            _plant(path, theirs)
            swapped.append(path)
        return path

    monkeypatch.setattr(encrypt.tempfile, "mkdtemp", mkdtemp)
    return swapped


def test_a_staging_directory_swapped_before_it_is_held_is_given_up_for_a_fresh_one(tmp_path, monkeypatch):
    """Swapped between its making and its opening: the rewrite leaves that name (now a link)
    alone, makes another, and nothing is written through the link."""
    root, theirs = tmp_path / "kv", _attacker(tmp_path)
    root.mkdir()
    swapped = _swapping_mkdtemp(monkeypatch, theirs, swaps=2)
    staging = encrypt._Staging(str(root))
    try:
        assert len(swapped) == 2 and staging.path not in swapped
        with open(os.path.join(staging.where, "chunk"), "wb") as f:
            f.write(b"x")
        assert (Path(staging.path) / "chunk").read_bytes() == b"x"
    finally:
        staging.remove()
    assert _everything_under(theirs) == []
    assert all(Path(p).is_symlink() and os.readlink(p) == str(theirs) for p in swapped)
    assert not Path(staging.path).exists()


def test_a_root_whose_staging_directories_are_always_swapped_is_refused_with_the_reason(tmp_path, monkeypatch):
    root, theirs = tmp_path / "kv", _attacker(tmp_path)
    root.mkdir()
    swapped = _swapping_mkdtemp(monkeypatch, theirs, swaps=encrypt.STAGING_TRIES)
    with pytest.raises(OSError, match=rf"{encrypt.STAGING_TRIES} staging directories made in .* were each replaced "
                                      r"before they could be opened .*nothing was written there"):
        encrypt._Staging(str(root))
    assert len(swapped) == encrypt.STAGING_TRIES
    assert _everything_under(theirs) == []


def test_stale_staging_directories_removed_only_when_ours(tmp_path):
    """Staging directories of rewrites that died on this host are removed at the next run
    (old and current name pattern); a link of that name, another user's directory of that
    name, another host's and a live process's are left alone, their contents untouched."""
    root = tmp_path / "kv"
    config, _keys, _rotated_enc, _digest = _rotated(tmp_path, root, 4)
    theirs = _attacker(tmp_path)
    (theirs / "keep").write_text("theirs")
    dead = _dead_pid()

    def stale(name: str):
        d = root / (STAGING_PREFIX + name)
        (d / "sub").mkdir(parents=True)
        (d / "sub" / "copy.bin").write_bytes(b"x")
        return d

    gone = [stale(f"{dead}@{HOST}"), stale(f"k3j_9q0a-{dead}@{HOST}")]
    kept = [stale(f"{dead}@elsewhere.example"), stale(f"abcdefgh-{os.getpid()}@{HOST}")]
    link = root / f"{STAGING_PREFIX}cccccccc-{dead}@{HOST}"
    _plant(link, theirs)

    r = subprocess.run([KVTIERS, "encrypt", "rewrite", "fs", "--config", config, "--json"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["rewritten"] == 4
    assert [d for d in gone if os.path.lexists(d)] == []
    assert [d for d in kept if not (d / "sub" / "copy.bin").is_file()] == []
    assert link.is_symlink() and (theirs / "keep").read_text() == "theirs"


def test_another_users_stale_staging_directory_is_left(tmp_path):
    """Directories of a dead rewrite's name on this host (old and current pattern), but
    another user's: not removed."""
    if os.geteuid() != 0:
        pytest.skip("making a directory another user owns needs root (chown)")
    root = tmp_path / "kv"
    config, _keys, _enc, _digest = _rotated(tmp_path, root, 2)
    dead = _dead_pid()
    theirs = [root / f"{STAGING_PREFIX}{dead}@{HOST}", root / f"{STAGING_PREFIX}dddddddd-{dead}@{HOST}"]
    for d in theirs:
        (d / "sub").mkdir(parents=True)
        (d / "sub" / "copy.bin").write_bytes(b"x")
        for p in (d, d / "sub", d / "sub" / "copy.bin"):
            os.chown(p, NOBODY, NOBODY)
    r = subprocess.run([KVTIERS, "encrypt", "rewrite", "fs", "--config", config, "--json"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["rewritten"] == 2
    assert [d for d in theirs if not (d / "sub" / "copy.bin").is_file()] == []


def test_a_chunk_directory_swapped_for_a_link_before_the_rename_is_not_written_through(tmp_path, capsys,
                                                                                          monkeypatch):
    """One who can write the root swaps a chunk's directory for a link to their own directory,
    holding a file of the chunk's name, after the rewrite read the chunk and before it renames
    the new copy over it (fault injection at that moment): the rename does not follow the link,
    their file is left as it was, that chunk is reported failed and every other one rewritten
    (before: the new chunk was renamed into their directory)."""
    from kvtiers.commands.cli import main

    n = 24
    root = tmp_path / "kv"
    config, keys, rotated, digest = _rotated(tmp_path, root, n)
    theirs = _attacker(tmp_path)
    real, swapped = encrypt._replace, []

    def replace_after_a_swap(f, dir_opts, staging):
        if not swapped:
            d = os.path.dirname(f.path)
            os.rename(d, str(tmp_path / "moved-away"))
            (theirs / os.path.basename(f.path)).write_bytes(b"theirs")
            _plant(d, theirs)
            swapped.append(f.path)
        return real(f, dir_opts, staging)

    monkeypatch.setattr(encrypt, "_replace", replace_after_a_swap)
    with pytest.raises(SystemExit) as ended:  # a chunk failed: the command exits 1, after its report
        main(["encrypt", "rewrite", "fs", "--config", config, "--json"])
    out, err = capsys.readouterr()
    assert ended.value.code == 1, err
    rep = json.loads(out)
    assert swapped and rep["failed"] >= 1 and rep["rewritten"] == n - rep["failed"], rep
    assert _everything_under(theirs) == [os.path.basename(swapped[0])]
    assert (theirs / os.path.basename(swapped[0])).read_bytes() == b"theirs", "the rename wrote through the link"
    assert "is no longer a directory of the root" in err and "Traceback" not in err
