"""KV layout descriptors: what one chunk of KV cache is made of, and where it sits in a slot.

A *chunk* is ``blocks_per_chunk`` device blocks across every layer of every KV group. A
*group* is a set of layers sharing one block shape (the target model, a draft model, an MLA
model's latent cache). Device tensors are given per group, per layer, as a list of
``tensors_per_layer`` tensors (2 for flat K/V, 1 for an MLA latent), each of shape
``[num_blocks, *block_shape]`` and contiguous, so one block of one tensor is ``block_bytes``
contiguous bytes.

Slot layout (fixed, part of the namespace): for each group, each layer, each tensor in order,
the chunk's ``blocks_per_chunk`` blocks back to back. A partial chunk (fewer blocks) fills
the first blocks of each such region; the rest of the slot is unspecified.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class KVGroup:
    """One set of layers with one block shape (e.g. the target model, or a draft model)."""

    name: str
    num_layers: int
    tensors_per_layer: int  # 2 = flat K/V, 1 = MLA latent
    block_bytes: int  # bytes of one block of one tensor of one layer

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"KV group name must be a non-empty string, got {self.name!r}")
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

    def chunk_bytes(self, blocks_per_chunk: int) -> int:
        """Bytes this group contributes to one chunk."""
        return self.num_tensors * blocks_per_chunk * self.block_bytes

    def describe(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "num_layers": self.num_layers,
            "tensors_per_layer": self.tensors_per_layer,
            "block_bytes": self.block_bytes,
        }


@dataclass(frozen=True)
class Segment:
    """Where one tensor's part of a chunk sits in the slot: ``offset`` and piece size."""

    group: int  # index into KVLayout.groups
    layer: int
    tensor: int  # 0..tensors_per_layer-1
    offset: int  # byte offset of the tensor's first block in the slot
    block_bytes: int


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
    def mla(cls, num_layers: int, block_bytes: int, name: str = "mla") -> KVLayout:
        """One latent tensor per layer (multi-head latent attention)."""
        return cls((KVGroup(name, num_layers, 1, block_bytes),))

    @classmethod
    def multi(cls, groups: Iterable[KVGroup]) -> KVLayout:
        """Several groups in one chunk (e.g. a target and a draft model of different widths)."""
        return cls(groups)

    @classmethod
    def from_tensors(cls, kv_caches: Mapping[str, Sequence[Sequence[torch.Tensor]]]) -> KVLayout:
        """Infer the layout from device tensors: group name -> per layer -> tensors ``[num_blocks, ...]``.

        Every tensor of a group must be contiguous with the same block size in bytes and
        every layer of a group must have the same number of tensors.
        """
        if not isinstance(kv_caches, Mapping) or not kv_caches:
            raise ValueError("kv_caches must be a non-empty mapping: group name -> per layer -> tensors")
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
            groups.append(KVGroup(name, len(layers), tpl or 0, bb or 0))
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
            piece = blocks_per_chunk * g.block_bytes
            for layer in range(g.num_layers):
                for t in range(g.tensors_per_layer):
                    yield Segment(gi, layer, t, off, g.block_bytes)
                    off += piece

    def describe(self) -> dict[str, Any]:
        """JSON-able description, for the namespace fields."""
        return {"groups": [g.describe() for g in self.groups]}

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
