"""Compression before the medium for any tier: the ``"compress"`` option.

Any tier's options accept ``"compress": {...}`` (docs/compression.md).
:func:`kvtiers.registry.open_tier` takes the option out, so the tier never sees it, and with
a :class:`Compression` opens the tier on a staging arena of *pieces* under a namespace that
names the encoding, with a :class:`CompressedTier` in front of it. With ``"encrypt"`` too,
chunks are compressed, then sealed, then stored (DESIGN.md's order). The caller's slots and
arena never hold encoded bytes.

The modules, by what they hold:

- :mod:`~kvtiers.compression.codecs`: the codecs (zstd, lz4 with a byte shuffle; fp8 e4m3,
  lossy, opt-in) and the encoded format of one chunk;
- :mod:`~kvtiers.compression.compressed_tier`: :class:`CompressedTier`, the wrapper's hooks;
- :mod:`~kvtiers.compression.compressing`: :class:`Compression`, opening a tier compressed.

Layer 1: no torch, no engine. ``zstandard`` and ``lz4`` are the ``compress`` extra (numpy a core dependency).
"""

from __future__ import annotations

from .codecs import CODEC_IDS, EXTRA_HINT, HEADER, Codec, DecodeFailed, decode_into, read_header
from .compressed_tier import CompressedTier, piece_key
from .compressing import Compression, compressed_namespace, medium_namespace

__all__ = [
    "CODEC_IDS", "EXTRA_HINT", "HEADER", "Codec", "CompressedTier", "Compression", "DecodeFailed",
    "compressed_namespace", "decode_into", "medium_namespace", "piece_key", "read_header",
]
