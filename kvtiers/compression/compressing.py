"""Opening a tier compressed: :class:`Compression`, what :func:`kvtiers.registry.open_tier`
needs when a tier's options hold ``"compress"``: the checked :class:`~kvtiers.compression.codecs.Codec`,
the tier's context on a staging arena of *pieces* (``"piece_bytes"``, page-rounded; default
:meth:`~kvtiers.compression.codecs.Codec.default_piece_bytes`) under a namespace that names
the encoding, and the :class:`~kvtiers.compression.compressed_tier.CompressedTier` put in
front of the opened tier.

The namespace: a compressed tier keeps its chunks under the caller's namespace fields plus
``"kvtiers_compress"`` (``"exact"`` or the lossy codec's label, and the piece size), so a
reader without compression, or with exact bytes where a lossy writer wrote, never loads
them: it finds another namespace. ``max_bytes`` stays as given, the bytes the tier may keep
on its medium (pieces), so a bound holds more chunks compressed than not.

Layer 1: no torch, no engine.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from ..encryption.sealing import MIN_STAGING_SLOTS, STAGING_BYTES
from ..errors import ConfigError
from ..types import PAGE, Arena, Namespace, TierContext
from .codecs import Codec
from .compressed_tier import CompressedTier, PieceBook

log = logging.getLogger("kvtiers")


def compressed_namespace(namespace: Namespace, codec: Codec, piece_bytes: int) -> Namespace:
    """The namespace a compressed tier keeps its chunks under (see the module docstring)."""
    kind = codec.label() if codec.lossy else "exact"
    return Namespace({**namespace.fields, "kvtiers_compress": {"encoding": kind, "piece_bytes": piece_bytes}})


def _plan(spec: Any, namespace: Namespace, slot: int) -> tuple[Codec, int, int]:
    """The codec, piece size and threads of the ``"compress"`` object ``spec`` for chunks of
    ``slot`` bytes; a one-line :class:`ConfigError` (``compress: ...``)."""
    codec = Codec.from_spec(spec, namespace.fields)
    piece = spec.get("piece_bytes", codec.default_piece_bytes(slot))
    most = -(-codec.max_encoded(slot) // PAGE) * PAGE
    if not isinstance(piece, int) or isinstance(piece, bool) or not PAGE <= piece <= most:
        raise ConfigError(f"compress: 'piece_bytes' expects an int {PAGE}..{most} (bytes), got {piece!r}")
    threads = spec.get("threads", 4)
    if not isinstance(threads, int) or isinstance(threads, bool) or not 1 <= threads <= 64:
        raise ConfigError(f"compress: 'threads' expects an int 1-64, got {threads!r}")
    return codec, -(-piece // PAGE) * PAGE, threads


def medium_namespace(options: Mapping[str, Any], namespace: Namespace, slot_bytes: int) -> Namespace:
    """The namespace a tier opened with ``options`` on ``namespace`` keeps its chunks under:
    :func:`compressed_namespace` with ``"compress"``, else ``namespace`` (for a tool that
    finds chunks on the medium, e.g. the conformance suite's ``conformance_corrupt``)."""
    spec = options.get("compress")
    if spec is None:
        return namespace
    codec, piece, _threads = _plan(spec, namespace, slot_bytes)
    return compressed_namespace(namespace, codec, piece)


class Compression:
    """What :func:`kvtiers.registry.open_tier` needs to open a tier compressed: the codec,
    the tier's context on the staging arena (``ctx``) and :meth:`wrap`. Built by :meth:`prepare`."""

    def __init__(self, codec: Codec, ctx: TierContext, outer: TierContext, threads: int, book: PieceBook) -> None:
        self.codec = codec
        self.book = book
        self.ctx = ctx
        self.outer = outer
        self.threads = threads

    @classmethod
    def prepare(cls, tier_name: str, spec: Any, ctx: TierContext) -> Compression:
        """Check the ``"compress"`` object ``spec`` and allocate the staging arena; a one-line
        :class:`ConfigError` starting ``tier 'NAME': compress: ...``."""
        try:
            codec, piece, threads = _plan(spec, ctx.namespace, ctx.arena.slot_bytes)
        except ConfigError as e:
            raise ConfigError(f"tier {tier_name!r}: {e}") from None
        slot = ctx.arena.slot_bytes
        per_chunk = -(-codec.max_encoded(slot) // piece)  # the most pieces one chunk takes
        n = max(MIN_STAGING_SLOTS, per_chunk, min(len(ctx.arena) * per_chunk, STAGING_BYTES // piece))
        staging = Arena.allocate(n, piece)
        book = PieceBook(ctx.removed)
        inner = TierContext(staging, compressed_namespace(ctx.namespace, codec, piece), removed=book.removed)
        log.info("kvtiers: tier %s compressed (%s%s; %d staging pieces of %d bytes for chunks of %d)", tier_name,
                 codec.label(), ", lossy" if codec.lossy else "", n, piece, slot)
        return cls(codec, inner, ctx, threads, book)

    def wrap(self, inner: Any) -> CompressedTier:
        """The hooks around ``inner``, the ``TierHandle`` of the tier opened on :attr:`ctx`."""
        return CompressedTier(inner, self.outer, self.codec, self.book, threads=self.threads)
