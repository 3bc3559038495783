"""Code blocks of the Markdown docs, and the checks that keep them true.

``tests/test_docs.py`` runs these over README.md and docs/*.md. The conventions a page
follows (also in docs/development.md):

- ```python blocks run, in page order, in one namespace per page, in a fresh temporary
  directory, with this interpreter; a traceback names the page and its line.
- An HTML comment on the line(s) just before a fence says how to treat the block:
  ``<!-- docs: skip REASON -->`` (never run, the reason is shown as the test's skip reason),
  ``<!-- docs: needs gpu -->`` (runs only where torch finds an accelerator), or
  ``<!-- docs: needs s3 -->`` (runs against a live SeaweedFS server: the literal endpoint
  ``http://127.0.0.1:8333`` in the block is replaced by the server's).
- ```console blocks: ``$ CMD`` lines are commands, the lines after one (up to the next
  ``$``) its expected output. Each ``kvtiers`` command that shows output is run and its
  output (stdout and stderr) compared: runs of whitespace compare equal, a line ``...``
  matches any number of lines, ``...`` inside a line matches any text, except at the end of
  a line right after a word (``watch a...``, as click cuts a long help line): there it is
  literal, so a changed help line fails.
- ```json blocks parse; an object with ``"tiers"`` is checked as a whole config, one with
  ``"type"`` as a tier entry (its options against the tier's signature; a config without
  an arena size is checked as if it had one).
"""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>```+|~~~+)[ \t]*(?P<lang>[\w+-]*)[^\n]*$")
DIRECTIVE = re.compile(r"^\s*<!--\s*docs:\s*(?P<body>.*?)\s*-->\s*$")
S3_PLACEHOLDER = "http://127.0.0.1:8333"
NEEDS = {"gpu", "s3"}
LANGS = {"python", "console", "sh", "bash", "json", "toml", "text", "ini", "yaml", "diff", ""}


class DocsError(ValueError):
    """A page breaks a docs convention (unknown directive, unclosed fence, ...)."""


@dataclass
class Block:
    """One fenced block: where it is, its language and text, and its directives."""

    path: str
    line: int  # line number (1-based) of the block's first text line
    lang: str
    text: str
    skip: str | None = None
    needs: set[str] = field(default_factory=set)

    @property
    def where(self) -> str:
        return f"{self.path}:{self.line}"


def parse_directive(body: str, where: str) -> tuple[str | None, set[str]]:
    words = body.split(None, 1)
    if words and words[0] == "skip":
        if len(words) < 2:
            raise DocsError(f"{where}: 'docs: skip' needs a reason")
        return words[1], set()
    if words and words[0] == "needs":
        needs = set(words[1].replace(",", " ").split()) if len(words) > 1 else set()
        if not needs or needs - NEEDS:
            raise DocsError(f"{where}: 'docs: needs' takes {sorted(NEEDS)}, got {body!r}")
        return None, needs
    raise DocsError(f"{where}: unknown docs directive {body!r} (use 'skip REASON' or 'needs gpu|s3')")


def blocks(path: Path, root: Path | None = None) -> list[Block]:
    """Every fenced block of the Markdown file ``path``, with its directives."""
    name = str(path.relative_to(root)) if root else str(path)
    lines = path.read_text(encoding="utf-8").splitlines()
    out: list[Block] = []
    pending: list[tuple[int, str]] = []  # directives seen since the last non-blank line
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        d = DIRECTIVE.match(lines[i])
        if d:
            pending.append((i + 1, d.group("body")))
        elif m:
            start, indent, fence, lang = i, m.group("indent"), m.group("fence"), m.group("lang").lower()
            if lang not in LANGS:
                raise DocsError(f"{name}:{i + 1}: unknown fence language {lang!r} (known: {sorted(LANGS)})")
            i += 1
            body = []
            while i < len(lines) and not lines[i].strip().startswith(fence):
                body.append(lines[i][len(indent):] if lines[i].startswith(indent) else lines[i].lstrip())
                i += 1
            if i == len(lines):
                raise DocsError(f"{name}:{start + 1}: fence never closed")
            b = Block(name, start + 2, lang, "\n".join(body) + "\n")
            for where, body_text in pending:
                skip, needs = parse_directive(body_text, f"{name}:{where}")
                b.skip = b.skip or skip
                b.needs |= needs
            out.append(b)
            pending = []
        elif lines[i].strip():
            if pending:
                raise DocsError(f"{name}:{pending[0][0]}: a docs directive must stand just before a fence")
        i += 1
    if pending:
        raise DocsError(f"{name}:{pending[0][0]}: a docs directive must stand just before a fence")
    return out


# -- python -------------------------------------------------------------------------------

# Runs a page's blocks in one namespace; line numbers in tracebacks are the page's.
DRIVER = r"""
import json, sys
ns = {"__name__": "__main__"}
for b in json.load(sys.stdin):
    code = compile("\n" * (b["line"] - 1) + b["text"], b["path"], "exec")
    exec(code, ns)
print("docs: ran ok")
"""


def python_source(b: Block, s3_endpoint: str | None = None) -> str:
    """The text to run for ``b`` (the live S3 endpoint substituted when it needs one)."""
    if "s3" in b.needs:
        if not s3_endpoint:
            raise DocsError(f"{b.where}: needs s3 but no server was given")
        return b.text.replace(S3_PLACEHOLDER, s3_endpoint)
    return b.text


# -- console ------------------------------------------------------------------------------


@dataclass
class Command:
    """A ``$ kvtiers ...`` line of a console block and the output shown after it."""

    where: str
    command: str
    expected: list[str]


def commands(b: Block) -> list[Command]:
    """The commands of a console block that show output (only those are checked)."""
    out: list[Command] = []
    cur: Command | None = None
    for n, line in enumerate(b.text.splitlines()):
        if line.startswith("$ "):
            cur = Command(f"{b.path}:{b.line + n}", strip_comment(line[2:]), [])
            out.append(cur)
        elif cur is not None:
            cur.expected.append(line)
        elif line.strip():
            raise DocsError(f"{b.path}:{b.line + n}: console output before any '$ ' command")
    for c in out:
        while c.expected and not c.expected[-1].strip():
            c.expected.pop()
    return [c for c in out if c.expected and c.command.split()[:1] == ["kvtiers"]]


def strip_comment(cmd: str) -> str:
    """``cmd`` without a trailing shell comment (quotes respected)."""
    lex = shlex.shlex(cmd, posix=True, punctuation_chars=False)
    lex.whitespace_split = True
    lex.commenters = "#"
    try:
        words = list(lex)
    except ValueError:
        return cmd.strip()
    return shlex.join(words)


def _norm(line: str) -> str:
    return " ".join(line.split())


def _line_matches(expected: str, actual: str) -> bool:
    expected, actual = _norm(expected), _norm(actual)
    cut = re.search(r"\S\.\.\.$", expected) is not None  # "watch a...": click's cut, literal
    body = expected[:-3] if cut else expected
    parts = [re.escape(p) for p in body.split("...")]
    return re.fullmatch(".*".join(parts) + (re.escape("...") if cut else ""), actual) is not None


def output_matches(expected: list[str], actual: list[str]) -> bool:
    """Whether ``actual`` lines match ``expected`` (``...`` lines match any run of lines)."""
    actual = list(actual)
    while actual and not actual[-1].strip():
        actual.pop()
    memo: dict[tuple[int, int], bool] = {}

    def m(i: int, j: int) -> bool:
        if (i, j) not in memo:
            if i == len(expected):
                r = j == len(actual)
            elif expected[i].strip() == "...":
                r = any(m(i + 1, k) for k in range(j, len(actual) + 1))
            else:
                r = j < len(actual) and _line_matches(expected[i], actual[j]) and m(i + 1, j + 1)
            memo[i, j] = r
        return memo[i, j]

    return m(0, 0)


# -- json ---------------------------------------------------------------------------------


def check_json(b: Block) -> None:
    """Parse a json block; check configs and tier entries against the code."""
    from kvtiers.config import parse_config
    from kvtiers.options import check_options
    from kvtiers.registry import get_registry

    try:
        obj = json.loads(b.text)
    except json.JSONDecodeError as e:
        raise DocsError(f"{b.where}: not JSON: {e}") from None
    if not isinstance(obj, dict) or not ({"tiers", "secondary_tiers", "type"} & obj.keys()):
        return
    if "type" in obj:
        obj = {"tiers": [obj]}
    if not ({"host_bytes", "cpu_bytes_to_use", "host_blocks_factor"} & obj.keys()):
        obj = {**obj, "host_bytes": 1 << 30}  # a fragment about tiers: any arena size will do
    cfg = parse_config(obj)
    reg = get_registry()
    for t in cfg.tiers:
        check_options(t.type, reg.tier_info(t.type).cls, t.options)
