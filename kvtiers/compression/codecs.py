"""The encodings of one chunk: :class:`Codec` from a ``"compress"`` object, and the encoded
format (a header, then the payload).

Lossless (``"codec": "zstd"`` or ``"lz4"``): the chunk's bytes are split into byte planes
(``"shuffle": 2``, the default: the low and the high byte of each 16-bit value; bf16 and fp16
KV keep their sign and exponent in the high byte, which compresses, and their low mantissa
byte, which hardly does), each plane compressed on its own and kept raw where that is no
smaller. The header holds the xxh3-64 of the chunk, checked on decode: every byte comes back
exactly, or the load fails.

Lossy, opt-in only (``"codec": "fp8", "lossy": true``): each block of ``"block"`` bf16 or
fp16 values (default 128) is scaled by its largest magnitude over 448 and rounded to fp8
e4m3 (3 mantissa bits, round to nearest even), then decoded to the original dtype. The error
of each value x of a block whose largest magnitude is m is at most ``|x|/16 + m/2**18``
(rounding to 3 mantissa bits, then the e4m3 subnormal step), plus the rounding back to the
16-bit dtype (bf16: ``|x|/256``); tests/test_compression.py measures it. A block holding a
non-finite value is not encoded: that chunk is not stored.

Layer 1: no torch, no engine. numpy, ``zstandard`` and ``lz4`` are imported when a codec
first needs them (``zstandard`` and ``lz4`` are the ``compress`` extra).
"""

from __future__ import annotations

import struct
from collections.abc import Mapping
from typing import Any

import xxhash

from ..errors import ConfigError
from ..types import PAGE

EXTRA_HINT = "pip install 'kvtiers[compress]'"
#: codec name -> id in the header
CODEC_IDS = {"zstd": 1, "lz4": 2, "fp8": 3}
LOSSLESS = ("zstd", "lz4")
LEVELS = {"zstd": (-7, 22, 1), "lz4": (0, 16, 0)}  # (min, max, default)
DTYPES = ("bfloat16", "float16")
#: magic, codec id, shuffle width, pieces, block, chunk length, xxh3-64 of the chunk (lossless)
#: or of the payload (fp8), payload length
HEADER = struct.Struct("<4sBBHIQQQ")
MAGIC = b"KVZ1"
#: where the header's piece count is (set by the wrapper once it knows the piece size)
PIECES_AT = 6
#: each plane of a lossless payload: its stored length, the top bit set when kept raw
PLANE = struct.Struct("<I")
RAW = 1 << 31
FP8_MAX = 448.0


class DecodeFailed(Exception):
    """A stored chunk that does not decode to what was encoded (damaged, or not ours)."""


def _int(spec: Mapping[str, Any], name: str, default: int, lo: int, hi: int) -> int:
    v = spec.get(name, default)
    if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
        raise ConfigError(f"compress: {name!r} expects an int {lo}..{hi}, got {v!r}")
    return v


class Codec:
    """One ``"compress"`` object, checked: :meth:`encode` and :meth:`decode` of a chunk of
    ``slot_bytes`` bytes. Build it with :meth:`from_spec`."""

    KEYS = frozenset({"codec", "level", "shuffle", "lossy", "dtype", "block", "piece_bytes", "threads"})

    def __init__(self, name: str, *, level: int = 0, shuffle: int = 2, dtype: str | None = None,
                 block: int = 128) -> None:
        self.name = name
        self.lossy = name == "fp8"
        self.level = level
        self.shuffle = shuffle
        self.dtype = dtype
        self.block = block
        self._z: Any = None

    @classmethod
    def from_spec(cls, spec: Any, namespace_fields: Mapping[str, Any] | None = None) -> Codec:
        """Check the ``"compress"`` object; a one-line :class:`ConfigError` (``compress: ...``)
        naming what is wrong: an unknown key or codec, a bad level, a lossy codec without
        ``"lossy": true``, a missing library (naming the extra to install)."""
        if not isinstance(spec, Mapping):
            raise ConfigError(f"compress: expects an object such as {{\"codec\": \"zstd\"}}, got {spec!r}")
        unknown = sorted(set(spec) - cls.KEYS)
        if unknown:
            raise ConfigError(f"compress: unknown key(s) {unknown}; known: {sorted(cls.KEYS)}")
        name = spec.get("codec", "zstd")
        if name not in CODEC_IDS:
            raise ConfigError(f"compress: unknown codec {name!r}; known: {sorted(CODEC_IDS)}")
        lossy = spec.get("lossy", False)
        if not isinstance(lossy, bool):
            raise ConfigError(f"compress: 'lossy' expects true or false, got {lossy!r}")
        if name == "fp8":
            if not lossy:
                raise ConfigError("compress: codec 'fp8' changes the bytes (lossy): say \"lossy\": true to store "
                                  "it (its chunks get their own namespace), or use 'zstd' or 'lz4'")
            dtype = spec.get("dtype", (namespace_fields or {}).get("dtype"))
            dtype = str(dtype).removeprefix("torch.") if dtype is not None else None
            if dtype not in DTYPES:
                raise ConfigError(f"compress: codec 'fp8' needs 'dtype' one of {list(DTYPES)} (the KV's), "
                                  f"got {dtype!r}")
            if "level" in spec or "shuffle" in spec:
                raise ConfigError("compress: codec 'fp8' takes no 'level' or 'shuffle'")
            block = _int(spec, "block", 128, 16, 1 << 20)
            _numpy()
            return cls(name, dtype=dtype, block=block)
        if lossy:
            raise ConfigError(f"compress: codec {name!r} is lossless: 'lossy' must be false or absent")
        for k in ("dtype", "block"):
            if k in spec:
                raise ConfigError(f"compress: {k!r} is for codec 'fp8' only")
        lo, hi, default = LEVELS[name]
        level = _int(spec, "level", default, lo, hi)
        shuffle = _int(spec, "shuffle", 2, 0, 8)
        codec = cls(name, level=level, shuffle=max(1, shuffle))
        codec._lib()
        if codec.shuffle > 1:
            _numpy()
        return codec

    # -- what it is -------------------------------------------------------------------------
    def label(self) -> str:
        """A short description for logs and the namespace."""
        if self.lossy:
            return f"fp8_e4m3/{self.dtype}/block{self.block}"
        return f"{self.name}{self.level}/shuffle{self.shuffle}"

    def max_encoded(self, slot_bytes: int) -> int:
        """The most bytes :meth:`encode` gives for a chunk of ``slot_bytes``."""
        if self.lossy:
            n = slot_bytes // 2
            return HEADER.size + 4 * -(-n // self.block) + n
        return HEADER.size + self.shuffle * PLANE.size + slot_bytes

    def default_piece_bytes(self, slot_bytes: int) -> int:
        """The staging slot size when ``"piece_bytes"`` is not given: the whole fp8 chunk;
        for zstd three quarters of the slot (bf16 KV: about 0.7), for lz4 fifteen sixteenths
        (bf16 KV: about 0.88); a chunk that does not fit takes two pieces or more."""
        want = self.max_encoded(slot_bytes) if self.lossy else slot_bytes * (12 if self.name == "zstd" else 15) // 16
        return max(PAGE, -(-want // PAGE) * PAGE)

    # -- lossless ---------------------------------------------------------------------------
    def _lib(self) -> Any:
        if self._z is None:
            try:
                if self.name == "zstd":
                    import zstandard

                    self._z = (zstandard.ZstdCompressor(level=self.level), zstandard.ZstdDecompressor())
                else:
                    import lz4.block

                    self._z = lz4.block
            except ImportError as e:
                raise ConfigError(f"compress: codec {self.name!r} needs {e.name}: {EXTRA_HINT}") from None
        return self._z

    def _compress(self, data: Any) -> bytes:
        if self.name == "zstd":
            import zstandard

            return zstandard.ZstdCompressor(level=self.level).compress(data)  # one per call: thread-safe
        return self._lib().compress(data, mode="default" if self.level == 0 else "high_compression",
                                    compression=self.level, store_size=False)

    def _decompress(self, data: Any, size: int) -> bytes:
        if self.name == "zstd":
            import zstandard

            return zstandard.ZstdDecompressor().decompress(data, max_output_size=size)
        return self._lib().decompress(data, uncompressed_size=size)

    # -- encode / decode --------------------------------------------------------------------
    def encode(self, chunk: memoryview) -> bytes:
        """The encoded form of ``chunk`` (header, payload); ValueError where it cannot be
        (fp8: a non-finite value)."""
        if self.lossy:
            payload = _fp8_encode(chunk, self.dtype, self.block)
            digest = xxhash.xxh3_64_intdigest(payload)
            return HEADER.pack(MAGIC, CODEC_IDS["fp8"], 0, 1, self.block, len(chunk), digest,
                               len(payload)) + payload
        n = len(chunk)
        w = self.shuffle if n % self.shuffle == 0 else 1
        planes = [chunk] if w == 1 else _planes(chunk, w)
        parts = []
        for p in planes:
            c = self._compress(p)
            if len(c) < len(p):
                parts += [PLANE.pack(len(c)), c]
            else:
                parts += [PLANE.pack(len(p) | RAW), bytes(p)]
        payload = b"".join(parts)
        return HEADER.pack(MAGIC, CODEC_IDS[self.name], w, 1, 0, n, xxhash.xxh3_64_intdigest(chunk),
                           len(payload)) + payload


def read_header(data: Any) -> tuple[int, int, int, int, int, int, int]:
    """``(codec id, shuffle, pieces, block, chunk length, digest, payload length)`` of an
    encoded chunk's first :data:`HEADER` bytes; :class:`DecodeFailed` if they are not one."""
    if len(data) < HEADER.size:
        raise DecodeFailed("shorter than a header")
    magic, cid, w, pieces, block, n, digest, plen = HEADER.unpack_from(data)
    if magic != MAGIC or cid not in CODEC_IDS.values():
        raise DecodeFailed("not an encoded chunk (bad magic or codec)")
    return cid, w, pieces, block, n, digest, plen


def decode_into(data: Any, out: memoryview, dtype: str | None = None) -> None:
    """Decode the encoded chunk ``data`` (header and payload) into ``out``, checking its
    digest; :class:`DecodeFailed` when it is damaged, of another length, or of a codec this
    reader may not take (fp8 needs ``dtype``: a lossless reader passes None)."""
    cid, w, _pieces, block, n, digest, plen = read_header(data)
    if n != len(out):
        raise DecodeFailed(f"encodes {n} bytes, the slot holds {len(out)}")
    body = memoryview(data)[HEADER.size:HEADER.size + plen]
    if len(body) != plen:
        raise DecodeFailed("payload cut short")
    if cid == CODEC_IDS["fp8"]:
        if dtype is None:
            raise DecodeFailed("an fp8 (lossy) chunk where exact bytes are wanted")
        if xxhash.xxh3_64_intdigest(body) != digest:
            raise DecodeFailed("payload checksum mismatch")
        _fp8_decode(body, out, dtype, block)
        return
    name = "zstd" if cid == CODEC_IDS["zstd"] else "lz4"
    codec = Codec(name)
    size = n // w
    planes, pos = [], 0
    try:
        for _ in range(w):
            (ln,) = PLANE.unpack_from(body, pos)
            pos += PLANE.size
            raw, ln = bool(ln & RAW), ln & ~RAW
            part = body[pos:pos + ln]
            pos += ln
            planes.append(part if raw else codec._decompress(part, size))
    except DecodeFailed:
        raise
    except Exception as e:
        raise DecodeFailed(f"{name} payload does not decode: {type(e).__name__}: {e}") from None
    if any(len(p) != size for p in planes):
        raise DecodeFailed("a plane decodes to the wrong length")
    if w == 1:
        out[:] = planes[0]
    else:
        np = _numpy()
        view = np.frombuffer(out, np.uint8).reshape(-1, w)
        for i, p in enumerate(planes):
            view[:, i] = np.frombuffer(p, np.uint8)
    if xxhash.xxh3_64_intdigest(out) != digest:
        raise DecodeFailed("checksum mismatch: the decoded bytes are not the stored chunk's")


def _numpy() -> Any:
    try:
        import numpy
    except ImportError:
        raise ConfigError(f"compress: byte shuffle and fp8 need numpy: {EXTRA_HINT}") from None
    return numpy


def _planes(chunk: memoryview, w: int) -> list[Any]:
    np = _numpy()
    a = np.frombuffer(chunk, np.uint8).reshape(-1, w)
    return [np.ascontiguousarray(a[:, i]) for i in range(w)]


# -- fp8 e4m3 ---------------------------------------------------------------------------------
_FP8_TABLE: Any = None


def _fp8_table() -> Any:
    """The float32 value of each of the 128 non-negative e4m3fn codes (0x7F, NaN, never made)."""
    global _FP8_TABLE
    if _FP8_TABLE is None:
        np = _numpy()
        t = np.zeros(128, np.float32)
        for code in range(128):
            e, m = code >> 3, code & 7
            t[code] = m * 2.0 ** -9 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7)
        _FP8_TABLE = t
    return _FP8_TABLE


def _to_f32(chunk: Any, dtype: str) -> Any:
    np = _numpy()
    if dtype == "float16":
        return np.frombuffer(chunk, np.float16).astype(np.float32)
    return (np.frombuffer(chunk, np.uint16).astype(np.uint32) << 16).view(np.float32)


def _fp8_encode(chunk: memoryview, dtype: str, block: int) -> bytes:
    np = _numpy()
    x = _to_f32(chunk, dtype)
    n = len(x)
    nb = -(-n // block)
    pad = nb * block - n
    xb = np.concatenate([x, np.zeros(pad, np.float32)]) if pad else x
    xb = xb.reshape(nb, block)
    amax = np.abs(xb).max(axis=1)
    if not np.isfinite(amax).all():
        raise ValueError("a block holds a non-finite value: not encoded to fp8")
    scale = (amax / np.float32(FP8_MAX)).astype(np.float32)
    safe = np.where(scale > 0, scale, np.float32(1))
    y = np.abs(xb / safe[:, None]).astype(np.float32).ravel()
    bits = y.view(np.uint32)
    # normals: round the float32 mantissa to 3 bits (nearest, ties to even)
    r = (bits + np.uint32(0x7FFFF) + ((bits >> 20) & 1)) & np.uint32(0xFFF00000)
    e = (r >> 23).astype(np.int32) - 127 + 7
    code = np.where(e >= 1, (e << 3) | ((r >> 20) & 7).astype(np.int32), 0)
    # subnormals (below 2**-6): steps of 2**-9; 8 steps is the smallest normal, code 8
    code = np.where(y < 2.0 ** -6, np.rint(y * 512).astype(np.int32), code)
    code = np.minimum(code, 0x7E).astype(np.uint8)
    code |= (np.signbit(xb.ravel()).astype(np.uint8) << 7)
    return scale.tobytes() + code[:n].tobytes()


def _fp8_decode(body: memoryview, out: memoryview, dtype: str, block: int) -> None:
    np = _numpy()
    n = len(out) // 2
    nb = -(-n // block)
    if len(body) != 4 * nb + n:
        raise DecodeFailed("fp8 payload of the wrong length")
    scale = np.frombuffer(body[:4 * nb], np.float32)
    code = np.frombuffer(body[4 * nb:], np.uint8)
    v = _fp8_table()[code & 0x7F]
    v = np.where(code & 0x80, -v, v)
    pad = nb * block - n
    v = (np.concatenate([v, np.zeros(pad, np.float32)]) if pad else v).reshape(nb, block) * scale[:, None]
    v = v.ravel()[:n].astype(np.float32)
    if dtype == "float16":
        np.frombuffer(out, np.float16)[:] = v.astype(np.float16)
        return
    bits = v.view(np.uint32)
    np.frombuffer(out, np.uint16)[:] = ((bits + np.uint32(0x7FFF) + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
