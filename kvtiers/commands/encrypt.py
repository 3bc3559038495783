"""``kvtiers encrypt scan|rewrite``: which key ids seal the chunks on a medium, and moving
the chunks under retired keys to the current key (docs/security.md, "Rotation").

Both work for tiers that keep one file per chunk, its sealed bytes at offset 0, under a
directory their options name, with the namespace's ``config.json`` beside the chunks (the
fs tier). ``scan`` reads the 144-byte header of each file, no key needed; ``rewrite`` loads
each chunk under a retired key through the tier (the retired key opens it), removes the
file and stores the chunk again (sealed under the current key), so the tier's own format,
trailer and bound stay its own. No key material is printed.
"""

from __future__ import annotations

import json
import os
from collections import Counter, defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import click

from ..errors import ConfigError

#: keys per load/store job of a rewrite
BATCH = 16


@dataclass(frozen=True)
class SealedFile:
    """One chunk file with a sealed header."""

    path: str
    key_id: str
    key: bytes
    payload: int
    digest: str


def medium_dirs(options: dict[str, Any]) -> list[str]:
    """The existing directories a tier's options name (absolute paths)."""
    out = []
    for k, v in options.items():
        if k != "encrypt" and isinstance(v, str) and os.path.isabs(v) and os.path.isdir(v):
            out.append(v)
    return out


def sealed_files(dirs: list[str]) -> Iterator[SealedFile]:
    """Every file under ``dirs`` that starts with a sealed header."""
    from ..encryption import HEADER, read_header

    for root in dirs:
        for d, _subdirs, names in os.walk(root):
            for n in names:
                p = os.path.join(d, n)
                try:
                    with open(p, "rb") as f:
                        head = f.read(HEADER.size)
                except OSError:
                    continue
                h = read_header(head)
                if h is not None:
                    yield SealedFile(p, h[0], h[1], h[2], h[3])


def namespaces(dirs: list[str]) -> dict[str, dict[str, Any]]:
    """Namespace digest -> fields, from the ``config.json`` documents under ``dirs``."""
    out: dict[str, dict[str, Any]] = {}
    for root in dirs:
        for d, _subdirs, names in os.walk(root):
            if "config.json" not in names:
                continue
            try:
                with open(os.path.join(d, "config.json"), encoding="utf-8") as f:
                    doc = json.load(f)
            except (OSError, ValueError):
                continue
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
    for f in sealed_files(dirs):
        counts[f.digest, f.key_id] += 1
        sizes[f.digest, f.key_id] += f.payload
    rows = []
    for (ns, kid), n in sorted(counts.items()):
        who = _owner(kid, keys)
        rows.append({"namespace": ns, "key_id": kid, "status": who.status, "owner": who.label, "chunks": n,
                     "bytes": sizes[ns, kid]})
    if as_json:
        click.echo(json.dumps({"tier": tier_type, "dirs": dirs, "rows": rows}, indent=1))
        return
    click.echo(f"{'namespace':<18} {'key id':<34} {'status':<15} {'owner':<15} {'chunks':>8} {'bytes':>14}")
    for r in rows:
        click.echo(f"{r['namespace']:<18} {r['key_id']:<34} {r['status']:<15} {r['owner']:<15} {r['chunks']:>8} "
                   f"{r['bytes']:>14}")
    if not rows:
        click.echo(f"no sealed chunks under {', '.join(dirs)}")


@encrypt.command()
@_with_config
def rewrite(tier_type: str, config_text: str | None, config_file: str | None, as_json: bool) -> None:
    """Seal every chunk under a retired key (in 'encrypt': 'retired', or a tenant's) again
    under its owner's current key: load it through TYPE, remove its file, store it again (a
    tenant's chunks as that tenant's). Chunks under key ids that are not configured are
    counted, never touched."""
    options, dirs, keys = _setup(tier_type, config_text, config_file, need_keys=True)
    ns_fields = namespaces(dirs)
    todo: dict[tuple[str, int, str | None], list[SealedFile]] = defaultdict(list)
    report: Counter[str] = Counter()
    for f in sealed_files(dirs):
        who = _owner(f.key_id, keys)
        if who.status == "current":
            report["current"] += 1
        elif who.status == "retired":
            todo[f.digest, f.payload, who.tenant].append(f)
        else:
            report["not_configured"] += 1
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
                   f"not configured {report['not_configured']}; no namespace {report['no_namespace']}")
    if report["failed"]:
        raise SystemExit(1)


def _rewrite(tier_type: str, options: dict[str, Any], fields: dict[str, Any], slot_bytes: int,
             files: list[SealedFile], report: Counter[str], tenant: str | None = None) -> None:
    """Load, remove, store again: ``files`` (one namespace, one slot size, one owner:
    ``tenant``, None for the default key) in batches."""
    from ..encryption.tenants import note_tenant
    from ..integrations.blocking import BlockingTier
    from ..registry import open_tier
    from ..types import Arena, Namespace, TierContext

    ctx = TierContext(Arena.allocate(BATCH, slot_bytes), Namespace(fields))
    handle = open_tier(tier_type, options, ctx)
    tier = BlockingTier(handle)
    try:
        for i in range(0, len(files), BATCH):
            part = files[i:i + BATCH]
            note_tenant(handle, [f.key for f in part], tenant)
            r = tier.run("load", [f.key for f in part], range(len(part)))
            ok = [(s, f) for s, f in enumerate(part) if f.key not in r.failed_keys]
            report["failed"] += len(part) - len(ok)
            if r.failed_keys:
                click.echo(f"load failed, left as is: {r.error}", err=True)
            for _s, f in ok:
                os.unlink(f.path)
            if not ok:
                continue
            r = tier.run("store", [f.key for _s, f in ok], [s for s, _f in ok])
            report["rewritten"] += len(ok) - len(r.failed_keys)
            report["failed"] += len(r.failed_keys)
            if r.failed_keys:  # removed and not stored again: a cache miss, said out loud
                click.echo(f"store failed, {len(r.failed_keys)} chunk(s) dropped: {r.error}", err=True)
    finally:
        tier.close()
