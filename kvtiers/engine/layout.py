"""KV layout descriptors: what one chunk of KV cache is made of, and where it sits in a slot.

A *chunk* is ``blocks_per_chunk`` device blocks across every layer of every KV group. A
*group* is a set of layers sharing one block shape and one *kind* (see :data:`GROUP_KINDS`):
full attention (the target model, a draft model), sliding-window attention, an MLA latent
cache, the indexer cache of sparse MLA, or SSM state. Device tensors are given per group, per
layer, as a list of ``tensors_per_layer`` tensors (2 for K/V, 1 for an MLA latent or one
state tensor), each of shape ``[num_blocks, *block_shape]`` (SSM groups: ``[num_state_slots,
*state_shape]``) and contiguous, so one block (one state) of one tensor is ``block_bytes``
contiguous bytes. Bytes are bytes: any dtype (fp8 e4m3/e5m2, bf16, int8, ...) moves as is.

Slot layout (fixed, part of the namespace): for each group, each layer, each tensor in order,
the group's *positions* back to back: the chunk's ``blocks_per_chunk`` blocks for attention
groups, one state (the state after the chunk's last token) for SSM groups. A partial chunk
(fewer blocks) fills the first positions of each region; the rest of the slot is unspecified.
Every chunk has the same byte size whatever the group kinds.

A Mamba layer's conv and recurrent states differ in size: they are two SSM groups (as sparse
MLA's latent and indexer caches are two groups), so every group keeps one size per block.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


#: Group kinds. ``full``: full attention (every block of a prefix is needed). ``sliding``:
#: sliding-window attention of ``window`` tokens (a load needs only the blocks in the window
#: that ends at its last chunk). ``mla``: a multi-head latent attention cache. ``mla_indexer``:
#: the indexer key cache of sparse MLA (DeepSeek V3.2), loaded like ``mla``. ``ssm``:
#: Mamba/SSM state, one state per chunk (after its last token) in engine state slots.
GROUP_KINDS = ("full", "sliding", "mla", "mla_indexer", "ssm")


@dataclass(frozen=True, eq=False)
class KVGroup:
    """One set of layers with one block shape and one kind (e.g. the target model, a draft
    model, the sliding-window layers of a hybrid, the conv state of its Mamba layers).

    ``window``: the attention window in tokens, for ``kind="sliding"`` only. ``dtype`` and
    ``shape`` (of one block of one tensor) describe the bytes: they go into the namespace
    (:meth:`describe`). Equality is about what is copied: dtype, shape and the difference
    between ``full``, ``mla`` and ``mla_indexer`` (copied alike) take no part in it.
    """

    name: str
    num_layers: int
    tensors_per_layer: int  # 2 = K/V, 1 = MLA latent, indexer keys or one SSM state tensor
    block_bytes: int  # bytes of one block (SSM: one state) of one tensor of one layer
    kind: str = "full"
    window: int | None = None  # tokens, sliding only
    dtype: str | None = None
    shape: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"KV group name must be a non-empty string, got {self.name!r}")
        if self.kind not in GROUP_KINDS:
            raise ValueError(f"KV group {self.name!r}: kind must be one of {', '.join(GROUP_KINDS)}, "
                             f"got {self.kind!r}")
        if self.kind == "sliding":
            try:
                w = operator.index(self.window)  # type: ignore[arg-type]
            except TypeError:
                raise TypeError(f"KV group {self.name!r}: a sliding group needs window (tokens) as an int, "
                                f"got {self.window!r}") from None
            if w <= 0:
                raise ValueError(f"KV group {self.name!r}: window must be positive, got {w}")
            object.__setattr__(self, "window", w)
        elif self.window is not None:
            raise ValueError(f"KV group {self.name!r}: window applies to kind 'sliding' only, not {self.kind!r}")
        if self.dtype is not None and not isinstance(self.dtype, str):
            raise TypeError(f"KV group {self.name!r}: dtype must be a string such as 'float8_e4m3fn'")
        if self.shape is not None:
            object.__setattr__(self, "shape", tuple(operator.index(d) for d in self.shape))
        for attr in ("num_layers", "tensors_per_layer", "block_bytes"):
            v = getattr(self, attr)
            try:
                v = operator.index(v)
            except TypeError:
                raise TypeError(f"KV group {self.name!r}: {attr} must be an int, got {type(v).__name__}") from None
            if v <= 0:
                raise ValueError(f"KV group {self.name!r}: {attr} must be positive, got {v}")
            object.__setattr__(self, attr, v)

    @property
    def num_tensors(self) -> int:
        """Tensors in the group: ``num_layers * tensors_per_layer``."""
        return self.num_layers * self.tensors_per_layer

    def _copied(self) -> tuple[Any, ...]:
        kind = self.kind if self.kind in ("sliding", "ssm") else "full"
        return (self.name, self.num_layers, self.tensors_per_layer, self.block_bytes, kind, self.window)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, KVGroup) and other._copied() == self._copied()

    def __hash__(self) -> int:
        return hash(self._copied())

    @property
    def is_state(self) -> bool:
        """SSM state: one state per chunk, addressed by state slot, not by block."""
        return self.kind == "ssm"

    def positions(self, blocks_per_chunk: int) -> int:
        """Pieces per tensor in one chunk: its blocks, or one state for an SSM group."""
        return 1 if self.is_state else blocks_per_chunk

    def chunk_bytes(self, blocks_per_chunk: int) -> int:
        """Bytes this group contributes to one chunk."""
        return self.num_tensors * self.positions(blocks_per_chunk) * self.block_bytes

    def describe(self) -> dict[str, Any]:
        """JSON-able description (kind, window and dtype only where they say something)."""
        d: dict[str, Any] = {
            "name": self.name,
            "num_layers": self.num_layers,
            "tensors_per_layer": self.tensors_per_layer,
            "block_bytes": self.block_bytes,
        }
        if self.kind != "full":
            d["kind"] = self.kind
        if self.window is not None:
            d["window"] = self.window
        if self.dtype is not None:
            d["dtype"] = self.dtype
        if self.shape is not None:
            d["shape"] = list(self.shape)
        return d


@dataclass(frozen=True)
class Segment:
    """Where one tensor's part of a chunk sits in the slot: ``offset`` and piece size."""

    group: int  # index into KVLayout.groups
    layer: int
    tensor: int  # 0..tensors_per_layer-1
    offset: int  # byte offset of the tensor's first block in the slot
    block_bytes: int
    positions: int = 0  # blocks (or 1 state) of this tensor in the chunk


class KVLayout:
    """The KV layout of one model instance (one worker): a tuple of :class:`KVGroup`."""

    __slots__ = ("groups",)

    def __init__(self, groups: Iterable[KVGroup]) -> None:
        groups = tuple(groups)
        if not groups:
            raise ValueError("a KV layout needs at least one group")
        for g in groups:
            if not isinstance(g, KVGroup):
                raise TypeError(f"KV layout groups must be KVGroup, got {type(g).__name__}")
        names = [g.name for g in groups]
        if len(set(names)) != len(names):
            raise ValueError(f"KV group names must be distinct, got {names}")
        self.groups: tuple[KVGroup, ...] = groups

    @classmethod
    def flat(cls, num_layers: int, block_bytes: int, name: str = "kv") -> KVLayout:
        """K and V tensors per layer (two tensors of ``block_bytes`` per block)."""
        return cls((KVGroup(name, num_layers, 2, block_bytes),))

    @classmethod
    def mla(cls, num_layers: int, block_bytes: int, name: str = "mla", *, indexer_bytes: int | None = None,
            indexer_name: str = "indexer") -> KVLayout:
        """One latent tensor per layer (multi-head latent attention); with ``indexer_bytes``,
        also sparse MLA's indexer key cache (one tensor per layer, its own block size), as
        the group ``indexer_name`` of kind ``mla_indexer``."""
        groups = [KVGroup(name, num_layers, 1, block_bytes, kind="mla")]
        if indexer_bytes is not None:
            groups.append(KVGroup(indexer_name, num_layers, 1, indexer_bytes, kind="mla_indexer"))
        return cls(groups)

    @classmethod
    def multi(cls, groups: Iterable[KVGroup]) -> KVLayout:
        """Several groups in one chunk (e.g. a target and a draft model of different widths)."""
        return cls(groups)

    @classmethod
    def from_tensors(cls, kv_caches: Mapping[str, Sequence[Sequence[torch.Tensor]]],
                     kinds: Mapping[str, str | Mapping[str, Any]] | None = None) -> KVLayout:
        """Infer the layout from device tensors: group name -> per layer -> tensors ``[num_blocks, ...]``.

        Every tensor of a group must be contiguous with the same block size in bytes and
        every layer of a group must have the same number of tensors. ``kinds``: group name ->
        its kind (``"ssm"``) or its kind and options (``{"kind": "sliding", "window": 4096}``);
        groups not named are full attention. Each group's dtype and block shape are taken from
        its first tensor.
        """
        if not isinstance(kv_caches, Mapping) or not kv_caches:
            raise ValueError("kv_caches must be a non-empty mapping: group name -> per layer -> tensors")
        kinds = dict(kinds or {})
        unknown = sorted(set(kinds) - set(kv_caches))
        if unknown:
            raise ValueError(f"kinds names groups {unknown} that kv_caches does not have ({sorted(kv_caches)})")
        groups = []
        for name, layers in kv_caches.items():
            if not layers:
                raise ValueError(f"KV group {name!r} has no layers")
            tpl = None
            bb = None
            for li, tensors in enumerate(layers):
                if isinstance(tensors, (str, bytes)) or not isinstance(tensors, Sequence):
                    raise TypeError(f"KV group {name!r} layer {li}: expected a list of tensors")
                if tpl is None:
                    tpl = len(tensors)
                elif len(tensors) != tpl:
                    raise ValueError(
                        f"KV group {name!r} layer {li}: {len(tensors)} tensors, layer 0 has {tpl}"
                    )
                for ti, t in enumerate(tensors):
                    b = tensor_block_bytes(t, f"KV group {name!r} layer {li} tensor {ti}")
                    if bb is None:
                        bb = b
                    elif b != bb:
                        raise ValueError(
                            f"KV group {name!r} layer {li} tensor {ti}: block of {b} bytes, expected {bb}"
                        )
            spec = kinds.get(name, "full")
            opts = dict(spec) if isinstance(spec, Mapping) else {"kind": spec}
            t0 = layers[0][0] if layers[0] else None
            if t0 is not None:
                opts.setdefault("dtype", str(t0.dtype).removeprefix("torch."))
                opts.setdefault("shape", tuple(t0.shape[1:]))
            groups.append(KVGroup(name, len(layers), tpl or 0, bb or 0, **opts))
        return cls(groups)

    def chunk_bytes(self, blocks_per_chunk: int) -> int:
        """Bytes of one full chunk of ``blocks_per_chunk`` blocks (the unpadded slot content)."""
        bpc = operator.index(blocks_per_chunk)
        if bpc <= 0:
            raise ValueError(f"blocks_per_chunk must be positive, got {bpc}")
        return sum(g.chunk_bytes(bpc) for g in self.groups)

    def group_offsets(self, blocks_per_chunk: int) -> list[int]:
        """Byte offset of each group's region in a slot."""
        offs, off = [], 0
        for g in self.groups:
            offs.append(off)
            off += g.chunk_bytes(blocks_per_chunk)
        return offs

    def segments(self, blocks_per_chunk: int) -> Iterator[Segment]:
        """Every (group, layer, tensor) piece of a chunk in slot order, with its offset."""
        off = 0
        for gi, g in enumerate(self.groups):
            npos = g.positions(blocks_per_chunk)
            for layer in range(g.num_layers):
                for t in range(g.tensors_per_layer):
                    yield Segment(gi, layer, t, off, g.block_bytes, npos)
                    off += npos * g.block_bytes

    @property
    def is_hybrid(self) -> bool:
        """Whether some group is not plain full attention / MLA (sliding window or SSM state):
        loads then copy part of a chunk, and SSM groups need state slots."""
        return any(g.kind in ("sliding", "ssm") for g in self.groups)

    def group(self, name: str) -> KVGroup:
        """The group called ``name``."""
        for g in self.groups:
            if g.name == name:
                return g
        raise KeyError(f"no KV group {name!r}; groups are {[g.name for g in self.groups]}")

    def describe(self) -> dict[str, Any]:
        """JSON-able description, for the namespace fields."""
        return {"groups": [g.describe() for g in self.groups]}

    def explain_chunk_bytes(self, blocks_per_chunk: int) -> str:
        """How :meth:`chunk_bytes` is made up, for error messages: per group layers x tensors x
        positions x block bytes (with the block shape and dtype where known)."""
        parts = []
        for g in self.groups:
            what = f"{g.num_layers} layers x {g.tensors_per_layer} tensors x {g.positions(blocks_per_chunk)} " \
                   f"{'state' if g.is_state else 'blocks'} x {g.block_bytes} bytes"
            if g.shape is not None:
                what += f" (block {list(g.shape)}{' ' + g.dtype if g.dtype else ''})"
            parts.append(f"group {g.name!r}: {what}")
        return f"{'; '.join(parts)} = {self.chunk_bytes(blocks_per_chunk)} bytes per chunk"

    def check_tokens_per_block(self, tokens_per_block: int) -> None:
        """Raise ``ValueError`` when an attention group's block shape (known from
        :meth:`from_tensors`) has no dimension of ``tokens_per_block`` tokens: the tensors are
        then not ``[num_blocks, *block_shape]`` with one block of ``tokens_per_block`` tokens
        (e.g. a ``[batch, heads, seq, head_dim]`` tensor taken as one block)."""
        tpb = operator.index(tokens_per_block)
        if tpb <= 0:
            raise ValueError(f"tokens_per_block must be positive, got {tpb}")
        for g in self.groups:
            if g.is_state or g.shape is None or tpb in g.shape:
                continue
            raise ValueError(
                f"KV group {g.name!r}: a block of shape {list(g.shape)} ({g.block_bytes} bytes; dim 0 of each tensor "
                f"is the block index) has no dimension of tokens_per_block={tpb} tokens; KV tensors must be "
                f"[num_blocks, *block_shape] with {tpb} tokens per block, e.g. [num_blocks, {tpb}, kv_heads, head_dim]"
            )

    def __eq__(self, other: object) -> bool:
        return isinstance(other, KVLayout) and other.groups == self.groups

    def __hash__(self) -> int:
        return hash(self.groups)

    def __repr__(self) -> str:
        return f"KVLayout({', '.join(repr(g) for g in self.groups)})"


def tensor_block_bytes(t: Any, where: str = "tensor") -> int:
    """Bytes of one block (``t[i]``) of a contiguous tensor ``[num_blocks, ...]``; raise if unusable."""
    if not hasattr(t, "is_contiguous") or not hasattr(t, "element_size"):
        raise TypeError(f"{where}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dim() < 1 or t.shape[0] < 1:
        raise ValueError(f"{where}: expected shape [num_blocks, ...] with num_blocks >= 1, got {tuple(t.shape)}")
    if not t.is_contiguous():
        raise ValueError(f"{where}: must be contiguous (one block = contiguous bytes)")
    return (t.numel() // t.shape[0]) * t.element_size()
