"""The demo's simulated engine: no server, no model. The "engine" keeps a small KV cache
(CPU tensors, or the accelerator
when ``torch.accelerator`` has one) and serves conversations whose prompts share prefixes
(a common system prompt, then each conversation's growing history). Chunk keys are chained
hashes of the prompt's token chunks, as prefix caches compute them. The bytes of every KV
block are derived from its chunk key, so every loaded chunk is checked byte for byte; a
mismatch makes the demo exit 1. Every scenario (chat, hybrid, PD) builds on it. Torch is
imported inside functions only.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

TOKENS_PER_BLOCK = 16
BLOCKS_PER_CHUNK = 4
NUM_LAYERS = 8
HEADS, HEAD_DIM = 8, 64  # fp16: 16 tokens x 8 x 64 x 2 bytes = 16 KiB per block per tensor
SYSTEM_TOKENS = 256
USER_TOKENS = (64, 192)
ASSISTANT_TOKENS = (64, 192)
HOST_CHUNKS = 24
LOOKUP_DEADLINE = 10.0


def chunk_keys(tokens: list[int], tokens_per_chunk: int, seed: int) -> list[bytes]:
    """Chained hashes of the full token chunks: key i depends on every token before it."""
    keys, prev = [], seed.to_bytes(8, "little")
    for i in range(len(tokens) // tokens_per_chunk):
        chunk = tokens[i * tokens_per_chunk : (i + 1) * tokens_per_chunk]
        prev = hashlib.blake2b(prev + b"".join(t.to_bytes(4, "little") for t in chunk), digest_size=16).digest()
        keys.append(prev)
    return keys


@dataclass
class Conversation:
    history: list[int]
    turn: int = 0


@dataclass
class Tally:
    """What the demo measures besides the manager's own stats."""

    requests: int = 0
    prompt_tokens: int = 0
    loaded_tokens: int = 0
    computed_tokens: int = 0
    verified_chunks: int = 0
    verified_bytes: int = 0
    mismatches: int = 0
    failed_loads: int = 0
    retries: int = 0
    first_mismatch: str | None = None
    sources: dict[str, int] = field(default_factory=dict)
    device_bytes: int = 0  # bytes loads copied to the device (hybrids: window and last state only)
    full_bytes: int = 0  # what copying whole chunks would have moved


class SimEngine:
    """A KV cache of ``num_blocks`` blocks per layer and tensor, with block contents
    derived from chunk keys, and a free list of blocks (the dense model; hybrids are
    :class:`kvtiers.commands.demo.hybrid.HybridSimEngine`)."""

    def __init__(self, device: Any, num_blocks: int, seed: int) -> None:
        import torch

        self.torch = torch
        self.device = device
        self.num_blocks = num_blocks
        shape = (num_blocks, TOKENS_PER_BLOCK, HEADS, HEAD_DIM)
        self.kv = {"kv": [[torch.zeros(shape, dtype=torch.float16, device=device) for _ in range(2)]
                          for _ in range(NUM_LAYERS)]}
        self.words = [t.view(num_blocks, -1).view(torch.int64) for layer in self.kv["kv"] for t in layer]
        g = torch.Generator().manual_seed(seed)
        n = self.words[0].shape[1]
        self.base = [torch.randint(-(2**62), 2**62, (n,), generator=g, dtype=torch.int64).to(device)
                     for _ in self.words]
        self.free = list(range(num_blocks - 1, -1, -1))
        self.block_bytes = self.words[0].shape[1] * 8
        from ...engine.layout import KVLayout

        self.layout = KVLayout.from_tensors(self.kv)

    def store_kwargs(self, keys: list[bytes]) -> tuple[dict[str, Any], list[int]]:
        return {}, []

    def load_kwargs(self) -> tuple[dict[str, Any], list[int]]:
        return {}, []

    def release_states(self, slots: list[int]) -> None:
        pass

    def verify_load(self, keys: list[bytes], blocks: list[int], loaded: int, kwargs: dict[str, Any]) -> list[bytes]:
        return self.verify(keys, blocks)

    def load_bytes(self, keys: list[bytes], blocks: list[int], kwargs: dict[str, Any]) -> tuple[int, int]:
        n = len(keys) * self.layout.chunk_bytes(BLOCKS_PER_CHUNK)
        return n, n

    def alloc(self, n: int) -> list[int] | None:
        if len(self.free) < n:
            return None
        return [self.free.pop() for _ in range(n)]

    def release(self, blocks: list[int]) -> None:
        self.free.extend(blocks)

    def _salts(self, keys: list[bytes], positions: int = BLOCKS_PER_CHUNK, tag: bytes = b"") -> Any:
        """One int64 per position of each key (its blocks; the hybrid engine's state too)."""
        vals = [int.from_bytes(hashlib.blake2b(k + tag + bytes([j]), digest_size=8).digest(), "little", signed=True)
                for k in keys for j in range(positions)]
        return self.torch.tensor(vals, dtype=self.torch.int64, device=self.device)

    def compute(self, keys: list[bytes], blocks: list[int]) -> None:
        """'Prefill': write the KV bytes of chunks ``keys`` into their blocks."""
        if not keys:
            return
        idx = self.torch.tensor(blocks, device=self.device)
        salts = self._salts(keys)[:, None]
        for words, base in zip(self.words, self.base, strict=True):
            words[idx] = base[None, :] ^ salts

    def verify(self, keys: list[bytes], blocks: list[int]) -> list[bytes]:
        """The keys among ``keys`` whose blocks do not hold their bytes."""
        if not keys:
            return []
        torch = self.torch
        idx = torch.tensor(blocks, device=self.device)
        salts = self._salts(keys)[:, None]
        bad = torch.zeros(len(blocks), dtype=torch.bool, device=self.device)
        for words, base in zip(self.words, self.base, strict=True):
            bad |= (words[idx] != (base[None, :] ^ salts)).any(dim=1)
        bad_chunks = bad.view(len(keys), BLOCKS_PER_CHUNK).any(dim=1).tolist()
        return [k for k, b in zip(keys, bad_chunks, strict=True) if b]


def pick_device(name: str | None) -> Any:
    import torch

    if name:
        return torch.device(name)
    acc = getattr(torch, "accelerator", None)
    if acc is not None and acc.is_available():
        return acc.current_accelerator()
    return torch.device("cpu")
