"""A weight-digest cache someone else could have written is not believed (issue 51.3).

The forgery is the real attack: model A's cache entry (its weight file's device, inode, size,
mtime and ctime) made to hold model B's digest, so A would get B's identity, share B's
namespace and load B's KV. Each way another user could have written the entry (a cache
directory they own or anyone can write, a cache file they own, a link to theirs, a file
anyone in the group or beyond can write) must make kvtiers read the weights instead, give A its
true identity, and say why in one log line per process, however often it meets it. The other
user is real where the test runs as root (files chowned to ``nobody``, uid 65534); the cases
that need it are skipped, saying so, elsewhere.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

import pytest

pytest.importorskip("vllm.v1.kv_offload.tiering.spec", reason="vLLM 0.33.0 is installed by `make test`")
pytest.importorskip("safetensors.numpy")

from test_model_identity import checkpoint, fine_tuned, identity_and_read, weights  # noqa: E402

from kvtiers.integrations.vllm.model_identity import digest_cache_path, file_digest, model_identity  # noqa: E402

NOBODY = 65534
LOGGER = "kvtiers.integrations.vllm"
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="making a file another user's (chown to uid 65534) needs root")


class Forgery:
    """Models A and B (same config and file size, other weights), their true identities, and
    a cache file under ``$XDG_CACHE_HOME`` whose entry for A's weight file holds B's digest."""

    def __init__(self, tmp: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        self.tmp = tmp
        self.a = checkpoint(tmp / "a", weights())
        self.b = checkpoint(tmp / "b", fine_tuned(weights()))
        monkeypatch.setenv("XDG_CACHE_HOME", str(tmp / "clean"))
        self.true_a, self.true_b = model_identity(str(self.a)), model_identity(str(self.b))
        assert None not in (self.true_a, self.true_b) and self.true_a != self.true_b
        # the forger lets kvtiers write A's entry, then puts B's digest in it
        monkeypatch.setenv("XDG_CACHE_HOME", str(tmp / "xdg"))
        model_identity(str(self.a))
        da, db = (file_digest(m / "model.safetensors") for m in (self.a, self.b))
        self.file = digest_cache_path()
        self.dir = self.file.parent
        self.text = self.file.read_text().replace(da, db)
        assert db in self.text

    def plant(self, case: str) -> None:
        """Lay the forged cache out as ``case`` says, from scratch."""
        shutil.rmtree(self.dir, ignore_errors=True)
        self.dir.mkdir(mode=0o700)
        theirs = self.tmp / "theirs.json"
        for p in (self.file, theirs):
            p.unlink(missing_ok=True)
        if case == "file is a link":
            theirs.write_text(self.text)
            if os.geteuid() == 0:
                os.chown(theirs, NOBODY, NOBODY)
            self.file.symlink_to(theirs)
            return
        self.file.write_text(self.text)
        os.chmod(self.file, 0o600)
        if case == "directory of another user":
            for p in (self.dir, self.file):
                os.chown(p, NOBODY, NOBODY)
            os.chmod(self.dir, 0o755)
            os.chmod(self.file, 0o644)
        elif case == "world-writable directory":
            os.chmod(self.dir, 0o777)
        elif case == "file of another user":
            os.chown(self.file, NOBODY, NOBODY)
            os.chmod(self.file, 0o644)
        elif case == "group-writable file":
            os.chmod(self.file, 0o620)
        elif case == "world-writable file":
            os.chmod(self.file, 0o666)
        else:
            raise AssertionError(case)


#: each case and the words of the reason kvtiers gives
CASES = {
    "directory of another user": (f"is owned by uid {NOBODY}, not this user", as_root),
    "world-writable directory": ("is writable by group or others (mode 777)", None),
    "file of another user": (f"is owned by uid {NOBODY}, not this user", as_root),
    "file is a link": ("is a symbolic link", None),
    "group-writable file": ("is writable by group or others (mode 620)", None),
    "world-writable file": ("is writable by group or others (mode 666)", None),
}


@pytest.mark.parametrize("case", [pytest.param(c, marks=m) if m else c for c, (_, m) in CASES.items()])
def test_a_forged_cache_entry_is_not_believed_and_the_reason_is_said_once(case, tmp_path, monkeypatch, caplog):
    f = Forgery(tmp_path, monkeypatch)
    reason = CASES[case][0]
    with caplog.at_level(logging.INFO, logger=LOGGER):
        for _ in range(3):  # three engine starts in one process, each meeting the forgery
            f.plant(case)
            ident = model_identity(str(f.a))
            assert ident == f.true_a, "model A got the forged identity" if ident == f.true_b else ident
    said = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and reason in r.getMessage()]
    assert len(said) == 1, [r.getMessage() for r in caplog.records]
    assert "not using the weight digest cache" in said[0]
    where = str(f.dir if "directory" in case else f.file)
    assert where in said[0], said[0]
    if case == "file is a link":  # their file is left as it was: the cache was rewritten beside it
        assert (tmp_path / "theirs.json").read_text() == f.text
        assert not f.file.is_symlink()


def test_the_cache_kvtiers_writes_is_trusted_only_by_its_user(tmp_path, monkeypatch, caplog) -> None:
    """The directory is made 0700 and the file 0600 even under umask 0, and the next start
    believes them: nothing read, nothing said."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    a = checkpoint(tmp_path / "a", weights())
    old = os.umask(0)
    try:
        first = model_identity(str(a))
    finally:
        os.umask(old)
    f = digest_cache_path()
    assert (f.parent.stat().st_mode & 0o777, f.stat().st_mode & 0o777) == (0o700, 0o600)
    assert [p.name for p in f.parent.iterdir()] == [f.name]  # no temporary file left behind
    with caplog.at_level(logging.INFO, logger=LOGGER):
        again, read = identity_and_read(str(a))
    assert again == first and read < (a / "model.safetensors").stat().st_size // 8, read
    assert not [r for r in caplog.records if "weight digest cache" in r.getMessage()]
