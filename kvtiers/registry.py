"""Finding tiers (entry points, import paths), validating them, and the tier handle.

Plugin modules are found through the entry-point group ``kvtiers`` and implement the
registration hooks of :class:`~kvtiers.hookspecs.RegistrationSpec`. A tier instance is
registered in its own pluggy ``PluginManager``, so pluggy validates its hook
implementations, and wrapper plugins (metrics, KV events, fault injection) can surround
every tier hook without the tier knowing.
"""

from __future__ import annotations

import importlib
import importlib.metadata as md
import logging
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import pluggy

from .errors import ConfigError, TierError
from .hookspecs import PROJECT, REQUIRED_TIER_HOOKS, RegistrationSpec, TierSpec
from .options import check_options, parse_admit
from .types import Job, JobResult, Lookup, TierContext

log = logging.getLogger("kvtiers")

ENTRY_POINT_GROUP = "kvtiers"
LEVELS = ("core", "durable", "shared", "bounded")


@dataclass(frozen=True)
class TierInfo:
    """One known tier type: where it came from and what it claims."""

    name: str
    cls: type
    distribution: str
    version: str
    origin: str  # "entry point <ep name>" or "import path"

    @property
    def levels(self) -> frozenset[str]:
        return tier_levels(self.cls)


def tier_levels(cls: type) -> frozenset[str]:
    """The conformance levels a tier class claims (default ``{"core"}``)."""
    levels = frozenset(getattr(cls, "levels", None) or {"core"})
    unknown = levels - set(LEVELS)
    if unknown:
        raise TierError(
            f"{cls.__qualname__}: unknown conformance level(s) {sorted(unknown)} (known: {', '.join(LEVELS)})"
        )
    return levels


def _one_line(e: Exception) -> str:
    """Pluggy's validation messages span lines; ours are one line."""
    return "; ".join(part.strip() for part in str(e).splitlines() if part.strip())


def validate_tier_class(name: str, cls: type) -> None:
    """Let pluggy check the hook implementations of ``cls``; raise :class:`TierError`."""
    if not isinstance(cls, type):
        raise TierError(f"tier {name!r}: expected a class, got {type(cls).__name__}")
    pm = pluggy.PluginManager(PROJECT)
    pm.add_hookspecs(TierSpec)
    try:
        pm.register(cls, name=f"class:{name}")
        pm.check_pending()
    except pluggy.PluginValidationError as e:
        raise TierError(f"tier {name!r}: {_one_line(e)}") from None
    missing = [h for h in REQUIRED_TIER_HOOKS if not getattr(pm.hook, h).get_hookimpls()]
    if missing:
        raise TierError(
            f"tier {name!r}: missing required hook(s) {', '.join(missing)} (mark them with @kvtiers.hookimpl)"
        )
    tier_levels(cls)


class Registry:
    """Tier types, CLI commands and eviction policies offered by installed plugins."""

    def __init__(self, group: str = ENTRY_POINT_GROUP) -> None:
        self.pm = pluggy.PluginManager(PROJECT)
        self.pm.add_hookspecs(RegistrationSpec)
        self._tiers: dict[str, TierInfo] = {}
        self._policies: dict[str, Any] = {}
        self._key_providers: dict[str, Any] = {}  # name -> provider(fields) -> 32 key bytes
        self.blocks: dict[str, tuple[str, Any]] = {}  # config block name -> (plugin, attach)
        self._by_path: dict[str, TierInfo] = {}  # import path -> resolved tier
        self.errors: dict[str, str] = {}  # plugin name -> why it failed to load
        self._dists: dict[str, tuple[str, str]] = {}
        self._load(group)

    def _load(self, group: str) -> None:
        for ep in md.entry_points(group=group):
            if self.pm.has_plugin(ep.name) or ep.name in self.errors:
                continue
            try:
                module = ep.load()
                self.pm.register(module, name=ep.name)
                self.pm.check_pending()
            except Exception as e:  # one broken plugin must not take the others down
                self.errors[ep.name] = f"{type(e).__name__}: {e}"
                log.warning("kvtiers plugin %r failed to load: %s", ep.name, e)
                if self.pm.has_plugin(ep.name):
                    self.pm.unregister(name=ep.name)
                continue
            dist = ep.dist
            self._dists[ep.name] = (dist.name, dist.version) if dist else ("?", "?")
        for impl in self.pm.hook.register_tiers.get_hookimpls():
            dist, version = self._dists.get(impl.plugin_name, ("?", "?"))

            def register(name: str, tier_class: type, _p=impl.plugin_name, _d=dist, _v=version) -> None:
                if not isinstance(name, str) or not name:
                    raise TierError(f"plugin {_p!r}: tier name must be a non-empty str")
                if name in self._tiers:
                    first = self._tiers[name].origin
                    raise TierError(f"tier {name!r} registered twice (by {first} and entry point {_p})")
                validate_tier_class(name, tier_class)
                self._tiers[name] = TierInfo(name, tier_class, _d, _v, f"entry point {_p}")

            try:
                impl.function(register=register)
            except Exception as e:
                self.errors[impl.plugin_name] = f"{type(e).__name__}: {e}"
                log.warning("kvtiers plugin %r failed to register tiers: %s", impl.plugin_name, e)
        for impl in self.pm.hook.register_eviction_policies.get_hookimpls():
            impl.function(register=self._policies.__setitem__)
        for impl in self.pm.hook.register_key_providers.get_hookimpls():
            try:
                impl.function(register=self._key_providers.__setitem__)
            except Exception as e:
                self.errors[impl.plugin_name] = f"{type(e).__name__}: {e}"
                log.warning("kvtiers plugin %r failed to register key providers: %s", impl.plugin_name, e)
        for impl in self.pm.hook.register_manager_blocks.get_hookimpls():

            def register_block(name: str, attach: Any, _p=impl.plugin_name) -> None:
                if not isinstance(name, str) or not name or not callable(attach):
                    raise TierError(f"plugin {_p!r}: register(name, attach) needs a non-empty str and a callable")
                if name in self.blocks:
                    raise TierError(f"config block {name!r} registered twice (by {self.blocks[name][0]} and {_p})")
                self.blocks[name] = (_p, attach)

            try:
                impl.function(register=register_block)
            except Exception as e:
                self.errors[impl.plugin_name] = f"{type(e).__name__}: {e}"
                log.warning("kvtiers plugin %r failed to register config blocks: %s", impl.plugin_name, e)

    def tiers(self) -> list[TierInfo]:
        """Every registered tier type, sorted by name."""
        return [self._tiers[k] for k in sorted(self._tiers)]

    def tier_info(self, type_name: str) -> TierInfo:
        """Resolve a registered name or an import path ``pkg.module:Class``."""
        if not isinstance(type_name, str) or not type_name:
            raise ConfigError(f"tier type must be a non-empty string, got {type_name!r}")
        if type_name in self._tiers:
            return self._tiers[type_name]
        if ":" in type_name:
            info = self._by_path.get(type_name)
            if info is None:  # resolved once: finding the distribution scans every installed one
                info = self._by_path[type_name] = self._import_path(type_name)
            return info
        known = ", ".join(sorted(self._tiers)) or "none installed"
        raise ConfigError(f"unknown tier type {type_name!r} (registered: {known}; or use 'pkg.module:Class')")

    def _import_path(self, path: str) -> TierInfo:
        mod_name, _, attr = path.partition(":")
        try:
            obj: Any = importlib.import_module(mod_name)
            for part in attr.split("."):
                obj = getattr(obj, part)
        except (ImportError, AttributeError) as e:
            raise ConfigError(f"tier type {path!r}: cannot import ({e})") from None
        validate_tier_class(path, obj)
        top = mod_name.split(".")[0]
        dists = md.packages_distributions().get(top, [])
        dist = dists[0] if dists else "?"
        try:
            version = md.version(dist) if dists else "?"
        except md.PackageNotFoundError:
            version = "?"
        return TierInfo(path, obj, dist, version, "import path")

    def eviction_policies(self) -> dict[str, Any]:
        """Eviction policies registered by plugins, by name."""
        return dict(self._policies)

    def key_providers(self) -> dict[str, Any]:
        """Encryption key providers registered by plugins (``register_key_providers``), by name."""
        return dict(self._key_providers)

    def manager_blocks(self) -> dict[str, Any]:
        """Config blocks registered by plugins: name -> ``attach(manager, block)``."""
        return {name: attach for name, (_p, attach) in self.blocks.items()}

    def add_commands(self, cli: Any) -> None:
        """Let every plugin add its CLI subcommands to ``cli``."""
        for impl in self.pm.hook.register_commands.get_hookimpls():
            try:
                impl.function(cli=cli)
            except Exception as e:
                log.warning("kvtiers plugin %r failed to add commands: %s", impl.plugin_name, e)


_registry: Registry | None = None
_registry_lock = threading.Lock()


def get_registry(reload: bool = False) -> Registry:
    """The process-wide registry, loaded from entry points on first use."""
    global _registry
    with _registry_lock:
        if _registry is None or reload:
            _registry = Registry()
        return _registry


class TierHandle:
    """A live tier instance behind its own pluggy ``PluginManager``.

    Calls go through pluggy, so wrapper plugins added with :meth:`add_wrapper` (hookimpls
    with ``wrapper=True``) see every tier hook. Optional hooks a tier does not implement
    answer ``None`` (``touch``, ``close``) or ``0`` (``backlog``).
    """

    def __init__(self, info: TierInfo, tier: Any, ctx: TierContext, options: Mapping[str, Any],
                 *, hooks: Any = None) -> None:
        self.info = info
        self.name = info.name
        self.tier = tier
        self.ctx = ctx
        self.options = dict(options)
        #: what answers the hooks: the tier, or a wrapper around it (kvtiers.encryption)
        self.hooks = tier if hooks is None else hooks
        self.pm = pluggy.PluginManager(PROJECT)
        self.pm.add_hookspecs(TierSpec)
        try:
            self.pm.register(self.hooks, name="tier")
            self.pm.check_pending()
        except pluggy.PluginValidationError as e:
            raise TierError(f"tier {self.name!r}: {_one_line(e)}") from None
        self._hook = self.pm.hook
        self.closed = False
        #: the tier's ``"admit"`` option (docs/admission.md), applied by the manager's cascade, or None
        self.admit: dict[str, Any] | None = None

    @property
    def levels(self) -> frozenset[str]:
        return self.info.levels

    def add_wrapper(self, plugin: Any, name: str | None = None) -> None:
        """Register a wrapper plugin around this tier's hooks."""
        self.pm.register(plugin, name=name)

    def lookup(self, keys: Sequence[bytes]) -> list[Lookup]:
        return self._hook.lookup(keys=keys)

    def submit_store(self, job: Job) -> None:
        self._hook.submit_store(job=job)

    def submit_load(self, job: Job) -> None:
        self._hook.submit_load(job=job)

    def get_finished_jobs(self) -> list[JobResult]:
        return self._hook.get_finished_jobs() or []

    def touch(self, keys: Sequence[bytes]) -> None:
        self._hook.touch(keys=keys)

    def backlog(self) -> int:
        return self._hook.backlog() or 0

    @property
    def takes_pins(self) -> bool:
        """Whether the tier (or the wrapper in front of it) implements the optional ``pin`` hook."""
        return bool(self._hook.pin.get_hookimpls())

    def pin(self, keys: Sequence[bytes], seconds: float | None) -> str | None:
        """The optional ``pin`` hook: ``None`` when pinned, else why not (also for a tier without it)."""
        if not self.takes_pins:
            return f"tier {self.name!r} does not take pins (no pin hook)"
        return self._hook.pin(keys=keys, seconds=seconds)

    def unpin(self, keys: Sequence[bytes]) -> None:
        if self._hook.unpin.get_hookimpls():
            self._hook.unpin(keys=keys)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._hook.close()

    def __repr__(self) -> str:
        return f"<TierHandle {self.name} {type(self.tier).__qualname__}>"


def open_tier(
    type_name: str | type,
    options: Mapping[str, Any] | None,
    ctx: TierContext,
    *,
    registry: Registry | None = None,
) -> TierHandle:
    """Check ``options`` and construct the tier ``type_name`` (a registered name, an import
    path ``pkg.module:Class`` or a class) on ``ctx``; return its :class:`TierHandle`.

    The options ``"compress"`` and ``"encrypt"`` are the core's, for any tier: they are taken
    out, and the tier is opened behind :mod:`kvtiers.compression`'s compressing wrapper
    (docs/compression.md) in front of :mod:`kvtiers.encryption`'s sealing wrapper
    (docs/security.md): chunks are compressed, then sealed, then stored."""
    options = dict(options or {})
    encrypt = options.pop("encrypt", None)
    compress = options.pop("compress", None)
    admit = options.pop("admit", None)  # the manager's cascade reads it (kvtiers.engine.admission): kept on the handle
    if isinstance(type_name, type):
        name = f"{type_name.__module__}:{type_name.__qualname__}"
        validate_tier_class(name, type_name)
        info = TierInfo(name, type_name, "?", "?", "class")
    else:
        info = (registry or get_registry()).tier_info(type_name)
    check_options(info.name, info.cls, options)
    if admit is not None:
        parse_admit(info.name, admit)  # a bad "admit" is an error at open
    if compress is not None:
        handle = _open_compressed(info, options, ctx, encrypt, compress, registry)
    else:
        handle = _open_handle(info, options, ctx, encrypt, registry)
    handle.admit = admit
    return handle


def _open_handle(info: TierInfo, options: dict[str, Any], ctx: TierContext, encrypt: Any,
                 registry: Registry | None) -> TierHandle:
    """The handle of the tier ``info`` on ``ctx``, behind the sealing wrapper with ``encrypt``."""
    if encrypt is not None:  # the tier on a staging arena, sealing hooks in front (kvtiers.encryption)
        from .encryption import Sealing

        sealing = Sealing.prepare(info.name, encrypt, options, ctx, (registry or get_registry()).key_providers())
        tier = construct_tier(info, sealing.options, sealing.ctx)
        inner = TierHandle(info, tier, sealing.ctx, sealing.options)
        return TierHandle(info, tier, ctx, options, hooks=sealing.wrap(inner))
    return TierHandle(info, construct_tier(info, options, ctx), ctx, options)


def _open_compressed(info: TierInfo, options: dict[str, Any], ctx: TierContext, encrypt: Any, compress: Any,
                     registry: Registry | None) -> TierHandle:
    """The tier (sealed with ``encrypt``) on a staging arena of pieces, the compressing
    wrapper in front (kvtiers.compression)."""
    from .compression import Compression

    compression = Compression.prepare(info.name, compress, ctx)
    inner = _open_handle(info, options, compression.ctx, encrypt, registry)
    return TierHandle(info, inner.tier, ctx, options, hooks=compression.wrap(inner))


def construct_tier(info: TierInfo, options: Mapping[str, Any], ctx: TierContext) -> Any:
    """``info.cls(ctx, **options)`` (options already checked); a failure other than a
    :class:`ConfigError` / :class:`TierError` becomes a one-line :class:`TierError`."""
    try:
        return info.cls(ctx, **options)
    except (ConfigError, TierError):
        raise
    except Exception as e:
        raise TierError(f"tier {info.name!r}: could not open: {type(e).__name__}: {e}") from e
