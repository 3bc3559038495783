"""Checking a tier's options against the keyword-only parameters of its ``__init__``.

A config entry is checked before the tier is constructed, so a misspelled option or a
wrong type is a one-line :class:`~kvtiers.errors.ConfigError` naming the tier, the option
and what was expected, not a traceback from deep inside the tier.
"""

from __future__ import annotations

import inspect
import types
import typing
from collections.abc import Mapping
from typing import Any

from .errors import ConfigError

#: options the core takes out of every tier's options before the tier sees them:
#: ``encrypt`` (:mod:`kvtiers.encryption`, docs/security.md), accepted for any tier
CORE_OPTIONS = ("encrypt",)
#: ``admit`` (:mod:`kvtiers.engine.admission`, docs/admission.md): the manager's, checked at open
CORE_OPTIONS += ("admit",)
#: ``compress`` (:mod:`kvtiers.compression`, docs/compression.md), accepted for any tier
CORE_OPTIONS += ("compress",)
ADMIT_WHEN = ("stored", "evicted")


def tier_options(cls: type) -> dict[str, inspect.Parameter]:
    """The keyword-only parameters of ``cls.__init__``, with resolved annotations."""
    sig = inspect.signature(cls.__init__)
    try:
        hints = typing.get_type_hints(cls.__init__)
    except Exception:  # unresolvable annotations: check names only
        hints = {}
    out = {}
    for p in sig.parameters.values():
        if p.kind is inspect.Parameter.KEYWORD_ONLY:
            out[p.name] = p.replace(annotation=hints.get(p.name, p.annotation))
    return out


def describe(tp: Any) -> str:
    """A short human name for a type hint: ``int | None``, ``list[str]``."""
    if tp is inspect.Parameter.empty or tp is Any:
        return "any value"
    if tp is type(None) or tp is None:
        return "None"
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(describe(a) for a in typing.get_args(tp))
    if origin is typing.Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if origin is not None:
        args = ", ".join(describe(a) for a in typing.get_args(tp))
        return f"{getattr(origin, '__name__', str(origin))}[{args}]" if args else origin.__name__
    return getattr(tp, "__name__", str(tp))


def matches(value: Any, tp: Any) -> bool:
    """Whether a JSON-ish ``value`` fits the type hint ``tp``."""
    if tp is inspect.Parameter.empty or tp is Any:
        return True
    if tp is None or tp is type(None):
        return value is None
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        return any(matches(value, a) for a in args)
    if origin is typing.Literal:
        return value in args
    if tp is bool:
        return isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if origin in (list, tuple, typing.Sequence, set, frozenset) or tp in (list, tuple):
        if not isinstance(value, (list, tuple)):
            return False
        if origin is tuple and args and args[-1] is not Ellipsis:
            return len(value) == len(args) and all(matches(v, a) for v, a in zip(value, args, strict=True))
        return not args or all(matches(v, args[0]) for v in value)
    if origin in (dict, typing.Mapping, Mapping) or tp is dict:
        if not isinstance(value, dict):
            return False
        if len(args) == 2:
            return all(matches(k, args[0]) and matches(v, args[1]) for k, v in value.items())
        return True
    if isinstance(tp, type):
        return isinstance(value, tp)
    return True  # hints we cannot check (protocols, strings we could not resolve)


def check_options(name: str, cls: type, options: Mapping[str, Any]) -> dict[str, Any]:
    """Check ``options`` for tier ``name`` (class ``cls``); return them as a dict.

    Raises :class:`ConfigError` for an unknown option, a missing required one, or a value
    of the wrong type. The core's own options (:data:`CORE_OPTIONS`) are accepted for
    every tier; :func:`kvtiers.registry.open_tier` takes them out before construction.
    """
    params = tier_options(cls)
    for key, value in options.items():
        if key in CORE_OPTIONS:  # reserved: never passed to the tier
            if not isinstance(value, dict):
                raise ConfigError(f"tier {name!r}: option {key!r} expects an object, got {type(value).__name__}")
            continue
        if key not in params:
            known = ", ".join(sorted(params)) or "none"
            raise ConfigError(f"tier {name!r}: unknown option {key!r} (options: {known})")
        p = params[key]
        if not matches(value, p.annotation):
            raise ConfigError(
                f"tier {name!r}: option {key!r} expects {describe(p.annotation)}, "
                f"got {type(value).__name__} {value!r}"
            )
    missing = [p.name for p in params.values() if p.default is inspect.Parameter.empty and p.name not in options]
    if missing:
        expected = describe(params[missing[0]].annotation)
        raise ConfigError(f"tier {name!r}: missing required option {missing[0]!r} ({expected})")
    return dict(options)


def parse_admit(tier: str, value: Any) -> tuple[int, str]:
    """``(min_offers, when)`` of a tier's ``"admit"`` option (docs/admission.md), e.g.
    ``{"min_offers": 2}`` or ``{"when": "evicted"}``; anything else is a one-line
    :class:`ConfigError` naming the tier and what was wrong."""
    if not isinstance(value, Mapping):
        raise ConfigError(f"tier {tier!r}: option 'admit' expects an object, got {type(value).__name__}")
    unknown = sorted(set(value) - {"min_offers", "when"})
    if unknown:
        raise ConfigError(f"tier {tier!r}: option 'admit': unknown key {unknown[0]!r} (keys: min_offers, when)")
    n = value.get("min_offers", 1)
    if not isinstance(n, int) or isinstance(n, bool) or n < 1 or n > 0xFFFF:
        raise ConfigError(f"tier {tier!r}: option 'admit': 'min_offers' expects an integer 1-65535, got {n!r}")
    when = value.get("when", "stored")
    if when not in ADMIT_WHEN:
        raise ConfigError(f"tier {tier!r}: option 'admit': 'when' expects 'stored' or 'evicted', got {when!r}")
    return n, when
