"""The hook specifications of the ``kvtiers`` pluggy project: the tier contract v1.

A tier is a plain class whose methods are implementations of :class:`TierSpec`, marked
with :data:`hookimpl`. Plugin *modules* (found through the ``kvtiers`` entry-point group)
implement :class:`RegistrationSpec`. Hooks are called from one engine thread at a time;
a tier's own work runs on its threads or on ``ctx.loop``. The numbered rules are those of
docs/contract.md.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import pluggy

from .types import Job, JobResult, Lookup

PROJECT = "kvtiers"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


class TierSpec:
    """Hooks a tier implements. ``lookup``, ``submit_store``, ``submit_load`` and
    ``get_finished_jobs`` are required; ``close``, ``touch``, ``backlog``, ``pin`` and
    ``unpin`` optional."""

    @hookspec(firstresult=True)
    def lookup(self, keys: Sequence[bytes]) -> list[Lookup]:
        """Answer ``HIT``, ``MISS`` or ``RETRY`` for each key, in order.

        Rule 1: no I/O on the caller's thread; 1000 keys answer within 50 ms; ``RETRY``
        resolves to ``HIT`` or ``MISS`` within 5 s of repeated asking.
        Rule 2: after a store of K finished with K not failed, K answers ``HIT`` until it is
        evicted or removed. Rule 12: any byte values are valid keys; distinct keys never alias.
        """

    @hookspec(firstresult=True)
    def submit_store(self, job: Job) -> None:
        """Start keeping the bytes of ``ctx.arena[slot]`` under each key of ``job``.

        Rule 8: returns without waiting for I/O; raises only for caller errors
        (``ValueError``, ``IndexError``, ``TypeError``) with a message naming the fault, and
        a submit that raised did not accept its job. An argument that is not a
        :class:`~kvtiers.types.Job` (e.g. a tuple) is a ``TypeError``, never an
        ``AttributeError`` (:func:`kvtiers.accept_job` does these checks). Rule 7: storing an existing key
        succeeds; concurrent stores of one key leave one valid copy. Rule 10 (durable):
        a crash mid-store never leaves a key that answers ``HIT`` and loads wrong bytes.
        """

    @hookspec(firstresult=True)
    def submit_load(self, job: Job) -> None:
        """Start writing the stored bytes of each key of ``job`` into its arena slot.

        Rule 3: a key reported not failed got exactly the stored bytes. Rule 4: a missing,
        evicted, truncated or corrupt key is a failed key, never an exception out of a hook,
        and a result with failed keys says why in ``JobResult.error``.
        Rule 8 as for :meth:`submit_store`.
        """

    @hookspec(firstresult=True)
    def get_finished_jobs(self) -> list[JobResult]:
        """Return the results of jobs finished since the last call; never blocks.

        Rule 5: every accepted job appears exactly once, within 30 s. Rule 6: once its
        result is returned, the tier never touches that job's slots again. Rule 4: a
        result with failed keys carries a non-empty ``error`` saying why.
        """

    @hookspec(firstresult=True)
    def close(self) -> None:
        """Finish or fail every accepted job, then release everything.

        Rule 9: returns once all accepted jobs are done; one more ``get_finished_jobs``
        returns their results. No thread, socket, file descriptor or temporary file remains.
        """

    @hookspec(firstresult=True)
    def touch(self, keys: Sequence[bytes]) -> None:
        """Hint that ``keys`` were used, for the tier's eviction order. Never blocks."""

    @hookspec(firstresult=True)
    def backlog(self) -> int:
        """Number of accepted jobs not yet reported (for back-pressure)."""

    @hookspec(firstresult=True)
    def pin(self, keys: Sequence[bytes], seconds: float | None) -> str | None:
        """Optional: keep ``keys`` from eviction for ``seconds`` (``None``: until :meth:`unpin`).

        All or nothing: return ``None`` when every key is pinned (a key pinned already keeps
        the later end), or one line saying why none was (a key not stored here; the pinned
        total would pass the tier's share of its bound, so eviction could no longer keep the
        bound). Rule 13: a pinned key is never evicted before its time by this instance, and
        pins never make the tier exceed its bound. Pins live in the instance's memory: they
        end with ``close``. Never blocks on I/O. A tier without it is never pinned."""

    @hookspec(firstresult=True)
    def unpin(self, keys: Sequence[bytes]) -> None:
        """Optional (with :meth:`pin`): end the pins of ``keys`` now; unknown keys are ignored."""


class TierClassSpec:
    """Optional class attributes of a tier: not hooks, read by the registry, by the
    conformance suite (``kvtiers_conformance``) and by ``kvtiers bench tier``.
    Documentation only; nothing registers it.
    """

    #: the conformance levels the tier claims; default ``{"core"}``
    levels: frozenset[str] = frozenset({"core"})

    @classmethod
    def conformance_config(cls, scratch: Any) -> dict:
        """Options for a test instance whose data lives under ``scratch`` (a fresh
        ``pathlib.Path`` per check, removed afterwards). ``kvtiers conformance TYPE`` calls
        it when no ``--config`` is given."""

    @classmethod
    def conformance_corrupt(cls, config: dict, namespace: Any, key: bytes) -> None:
        """Damage the stored copy of ``key`` in place, keeping its length, as a disk fault
        would (rule 4). ``config`` is the options of an open instance and ``namespace`` its
        :class:`~kvtiers.types.Namespace`; ``key`` was stored by it. The suite calls this
        while that instance is open, then requires a load to fail the key, never to return
        wrong bytes. Without it the suite damages chunk files, for tiers that keep one file
        per chunk under a directory their options name. A backend that refuses fault
        injection (a production server) raises ``NotImplementedError`` (or a subclass):
        the suite reports the check not certified, naming the refusal, instead of FAIL
        (``--strict`` fails it)."""

    @classmethod
    def conformance_cleanup(cls, config: dict) -> str | None:
        """Remove what the conformance suite stored with the options ``config``: every
        chunk (and record) of the suite's namespaces, those whose ``Namespace.fields`` hold
        the key ``"kvtiers_conformance"``; nothing else. The suite calls it at the end of
        every run, unless ``--keep``: after each check with that check's options when they
        came from :meth:`conformance_config` (before its scratch directory is removed), and
        once with the options ``--config`` gave. Its instances are closed by then. Return
        ``None``, or one line saying what could not be removed (printed with the report).
        Without it the suite removes new files under the paths the options name and, for an
        ``AsyncTier`` with ``delete``, the keys it stored."""

    @classmethod
    def bench_baseline(cls, tier: Any, chunk_bytes: int) -> Any:
        """A raw baseline for ``kvtiers bench tier TYPE``: a :class:`kvtiers.Baseline`
        (or None) holding plain ``put(key, data)`` / ``get(key, out)`` callables (functions or
        coroutine functions) on the same medium as the open instance ``tier`` (same
        directory, server, client settings), and how many calls the tier itself keeps in
        flight. The bench runs the baseline interleaved with the tier on the same bytes of
        ``chunk_bytes`` per chunk and prints the ratio. ``tier`` is the tier object itself
        (the class's instance, not its ``TierHandle``). ``Baseline.close(keys)``, called once
        at the end with every key the baseline's ``put`` was given, removes what it wrote:
        a plain function runs on the bench's thread, a coroutine function on the SDK's I/O
        loop (as ``put``/``get`` do). See docs/bench.md."""


RegisterTier = Callable[[str, type], None]
RegisterPolicy = Callable[[str, Any], None]
#: ``register(name, attach)``: ``attach(manager, block) -> service`` for a top-level config key
RegisterBlock = Callable[[str, Callable[[Any, dict], Any]], None]
#: ``register(name, provider)``: ``provider(fields: dict) -> bytes`` (32 bytes: an AES-256 key)
RegisterKeyProvider = Callable[[str, Callable[[dict], bytes]], None]


class RegistrationSpec:
    """Hooks a plugin module implements to add tiers, CLI commands, policies, config blocks
    and encryption key providers."""

    @hookspec
    def register_tiers(self, register: RegisterTier) -> None:
        """Call ``register(name, tier_class)`` for each tier the plugin provides."""

    @hookspec
    def register_commands(self, cli: Any) -> None:
        """Add subcommands to the ``kvtiers`` click group ``cli`` (e.g. ``kvtiers fs``)."""

    @hookspec
    def register_eviction_policies(self, register: RegisterPolicy) -> None:
        """Call ``register(name, policy_class)`` for each host-cache eviction policy."""

    @hookspec
    def register_manager_blocks(self, register: RegisterBlock) -> None:
        """Call ``register(name, attach)`` for each top-level config block the plugin adds to
        the engine side (e.g. ``kvtiers_p2p``'s ``"serve"``: peers read the host cache).

        A config that has the key ``name`` with an object passes it to ``attach(manager,
        block)`` once the ``TieringManager`` and its tiers are built; ``attach`` checks the
        block (a :class:`~kvtiers.errors.ConfigError` naming what is wrong) and returns a
        service with ``poll()`` (called at each manager step) and ``close()`` (called by the
        manager's ``close``, before the host arena is freed). The manager keeps it in
        ``manager.services[name]``. This is how plugin features reach the engine without the
        engine importing any plugin.
        """


    @hookspec
    def register_key_providers(self, register: RegisterKeyProvider) -> None:
        """Call ``register(name, provider)`` for each source of encryption keys the plugin
        offers (a KMS, a secrets manager). A tier's ``"encrypt"`` option names it as
        ``{"provider": name, ...}``; ``provider(fields)`` gets the other fields of that key
        object (without ``provider`` and ``key_id``) and returns the 32 bytes of an
        AES-256 key. It runs once when the tier is opened. Whatever it raises becomes a
        one-line :class:`~kvtiers.errors.ConfigError`; it must never put key material in
        an exception, a log line or a metric (docs/security.md).
        """


TIER_HOOKS = ("lookup", "submit_store", "submit_load", "get_finished_jobs", "close", "touch", "backlog", "pin",
              "unpin")
REQUIRED_TIER_HOOKS = ("lookup", "submit_store", "submit_load", "get_finished_jobs")
