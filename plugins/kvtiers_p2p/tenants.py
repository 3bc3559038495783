"""CurveZMQ allowlists that bind client keys to namespaces, and key files written safely.

An allowlist file (``kvtiers p2p serve --allow FILE``) has one client per line::

    # client key                                namespaces
    decode-0.key                                1f0c2a3b4c5d6e7f
    Yne@$w-vo<fVvi]a<NY6T1ed:M$fCG*[IaLV{hID    1f0c2a3b4c5d6e7f,0123456789abcdef
    ops.key                                     *

The key is a public key file (``kvtiers p2p keygen`` makes them; relative to the
allowlist's directory) or the 40-character Z85 text of a public key; the namespaces are
digests separated by commas, or ``*`` for any. Blank lines and ``#`` comments are skipped.
A client whose key is not listed is refused at the CurveZMQ handshake; a listed one may say
HELLO only for its namespaces (``forbidden`` otherwise), so it can read, write and cap
(``max_bytes``) no other tenant's chunks.
"""

from __future__ import annotations

import datetime
import os
import re

import zmq

_Z85 = re.compile(r"[0-9A-Za-z.\-:+=^!/*?&<>()\[\]{}@%$#]{40}")
_NS = re.compile(r"[0-9a-f]{1,64}")


class AllowlistError(ValueError):
    """An allowlist file that cannot be read; the message names the file and line."""


def _public_key(text: str, base: str, where: str) -> str:
    """The Z85 public key a line names (a key file or the key itself)."""
    path = text if os.path.isabs(text) else os.path.join(base, text)
    if os.path.isfile(path):
        import zmq.auth

        try:
            public, _ = zmq.auth.load_certificate(path)
        except (OSError, ValueError) as e:
            raise AllowlistError(f"{where}: key file {text}: {e}") from None
        return public.decode("ascii")
    if _Z85.fullmatch(text):
        return text
    raise AllowlistError(f"{where}: {text!r} is neither a public key file nor a 40-character Z85 key")


def load_allowlist(path: str) -> dict[str, frozenset[str] | None]:
    """Client public key (Z85) -> the namespace digests it may use (``None``: any)."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise AllowlistError(f"--allow {path}: {e}") from None
    base = os.path.dirname(os.path.abspath(path))
    out: dict[str, frozenset[str] | None] = {}
    for n, line in enumerate(lines, 1):
        line = "" if line.lstrip().startswith("#") else re.sub(r"\s+#.*$", "", line).strip()  # Z85 has '#'
        if not line:
            continue
        where = f"--allow {path}, line {n}"
        parts = line.split()
        if len(parts) != 2:
            raise AllowlistError(f"{where}: expected 'KEY NAMESPACE[,NAMESPACE...]' (or '*'), got {line!r}")
        key = _public_key(parts[0], base, where)
        if parts[1] == "*":
            spaces = None
        else:
            names = parts[1].split(",")
            bad = [x for x in names if not _NS.fullmatch(x)]
            if bad:
                raise AllowlistError(f"{where}: {bad[0]!r} is not a namespace digest (hex, as Namespace.digest)")
            spaces = frozenset(names)
        prev = out.get(key, frozenset())
        out[key] = None if spaces is None or prev is None else prev | spaces
    return out


class AllowlistAuth:
    """The ZAP credentials provider of an allowlist: listed keys pass the CurveZMQ handshake."""

    def __init__(self, allowed: dict[str, frozenset[str] | None]) -> None:
        self.allowed = allowed

    def callback(self, domain: str, key: bytes) -> bool:
        return (key.decode("ascii") if isinstance(key, bytes) else key) in self.allowed


def write_key_pair(directory: str, name: str, *, force: bool = False) -> tuple[str, str]:
    """Write ``NAME.key`` (public) and ``NAME.key_secret`` (created 0600, never readable
    by others) in ``directory``; an existing pair is kept unless ``force``. Returns both paths."""
    os.makedirs(directory, exist_ok=True)
    public_file = os.path.join(directory, f"{name}.key")
    secret_file = os.path.join(directory, f"{name}.key_secret")
    if not force:
        for p in (public_file, secret_file):
            if os.path.exists(p):
                raise FileExistsError(f"{p} exists: keep it, or pass --force to replace the key pair")
    public, secret = zmq.curve_keypair()
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
    head = f"#   ****  Generated on {stamp} by kvtiers p2p keygen  ****\n"
    keys = f'metadata\ncurve\n    public-key = "{public.decode()}"\n'
    for path, text, mode in (
        (secret_file, head + "#   ZeroMQ CURVE **Secret** Certificate\n#   DO NOT PROVIDE THIS FILE TO OTHER USERS.\n\n"
                      + keys + f'    secret-key = "{secret.decode()}"\n', 0o600),
        (public_file, head + "#   ZeroMQ CURVE Public Certificate\n\n" + keys, 0o644),
    ):  # fmt: skip
        tmp = f"{path}.tmp{os.getpid()}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
        try:
            os.fchmod(fd, mode)  # whatever the umask
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(text)
        except BaseException:
            os.unlink(tmp)
            raise
        os.replace(tmp, path)
    return public_file, secret_file


def add_to_allowlist(path: str, public_file: str, namespaces: list[str]) -> None:
    """Append a line allowing the key in ``public_file`` the ``namespaces`` (``["*"]``: any)."""
    for ns in namespaces:
        if ns != "*" and not _NS.fullmatch(ns):
            raise AllowlistError(f"--namespace {ns!r} is not a namespace digest (hex, as Namespace.digest)")
    base = os.path.dirname(os.path.abspath(path))
    key = os.path.relpath(os.path.abspath(public_file), base)
    if key.startswith(".."):
        key = os.path.abspath(public_file)
    spaces = "*" if "*" in namespaces else ",".join(namespaces)
    with open(path, "a", encoding="utf-8") as f:
        f.write(f"{key} {spaces}\n")
