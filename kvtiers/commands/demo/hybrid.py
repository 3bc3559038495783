"""The demo's hybrid models (``kvtiers demo --model hybrid-swa`` / ``hybrid-ssm``).

Scaled-down layouts shaped like today's hybrids, with KV bytes derived from chunk keys as in
the dense demo, so every byte a load copies is checked:

- ``hybrid-swa``: sliding-window and full-attention layers mixed half and half (as gpt-oss
  alternates them), a 128-token window. A load copies every full-attention block and only the
  window's sliding-window blocks.
- ``hybrid-ssm``: a few attention layers among Mamba layers (as Nemotron-H and Jamba), each
  Mamba layer with a conv state and a recurrent state in float32. Each stored chunk carries the
  state after its last token; a load restores only the last chunk's state, into a state slot.

Only chunks the engine computed are stored (as engines do): a loaded prefix lacks the blocks
outside the window and the states of all but its last chunk.
"""

from __future__ import annotations

from typing import Any

from ...engine.hybrid import chunk_specs, copied_bytes, window_first_block
from ...engine.layout import KVLayout
from .engine import SimEngine

WINDOW = 128  # tokens, hybrid-swa

# group -> (layers, tensors per layer, shape after dim 0, dtype name, kind)
MODELS: dict[str, dict[str, tuple[int, int, tuple[int, ...], str, Any]]] = {
    "hybrid-swa": {
        "full": (4, 2, (16, 8, 64), "bfloat16", "full"),
        "swa": (4, 2, (16, 8, 64), "bfloat16", {"kind": "sliding", "window": WINDOW}),
    },
    "hybrid-ssm": {
        "attn": (2, 2, (16, 8, 64), "bfloat16", "full"),
        "conv": (6, 1, (3, 256), "float32", "ssm"),
        "ssm": (6, 1, (8, 32, 16), "float32", "ssm"),
    },
}


class HybridSimEngine:
    """A hybrid model's KV cache and SSM state slots, with contents derived from chunk keys.

    Same interface as the dense demo's engine, plus what a hybrid store and load need:
    :meth:`store_kwargs`, :meth:`load_kwargs`, :meth:`verify_load`, :meth:`release_states`.
    """

    def __init__(self, model: str, device: Any, num_blocks: int, num_states: int, blocks_per_chunk: int,
                 tokens_per_block: int, seed: int) -> None:
        import torch

        self.torch = torch
        self.device = device
        self.bpc = blocks_per_chunk
        self.tpb = tokens_per_block
        spec = MODELS[model]
        self.kv: dict[str, list[list[Any]]] = {}
        kinds: dict[str, Any] = {}
        for name, (layers, tpl, shape, dtype, kind) in spec.items():
            n = num_states if kind == "ssm" else num_blocks
            dt = getattr(torch, dtype)
            self.kv[name] = [[torch.zeros((n, *shape), dtype=dt, device=device) for _ in range(tpl)]
                             for _ in range(layers)]
            kinds[name] = kind
        self.layout = KVLayout.from_tensors(self.kv, kinds=kinds)
        g = torch.Generator().manual_seed(seed)
        self.words: dict[str, list[Any]] = {}
        self.base: dict[str, list[Any]] = {}
        for name, layers in self.kv.items():
            ws = [t.view(t.shape[0], -1).view(torch.int64) for layer in layers for t in layer]
            self.words[name] = ws
            self.base[name] = [torch.randint(-(2**62), 2**62, (w.shape[1],), generator=g, dtype=torch.int64)
                               .to(device) for w in ws]
        self.state_groups = [x.name for x in self.layout.groups if x.is_state]
        self.block_groups = [x.name for x in self.layout.groups if not x.is_state]
        self.free = list(range(num_blocks - 1, -1, -1))
        self.free_states = list(range(num_states - 1, -1, -1))

    # -- blocks (the dense engine's free list) and state slots -----------------------------
    alloc = SimEngine.alloc
    release = SimEngine.release
    _salts = SimEngine._salts

    def release_states(self, slots: list[int]) -> None:
        self.free_states.extend(slots)

    # -- what the demo calls ---------------------------------------------------------------
    def compute(self, keys: list[bytes], blocks: list[int]) -> None:
        """'Prefill': write the KV bytes of chunks ``keys`` into their blocks (every group)."""
        if not keys:
            return
        idx = self.torch.tensor(blocks, device=self.device)
        salts = self._salts(keys, self.bpc)[:, None]
        for name in self.block_groups:
            for words, base in zip(self.words[name], self.base[name], strict=True):
                words[idx] = base[None, :] ^ salts

    def store_kwargs(self, keys: list[bytes]) -> tuple[dict[str, Any], list[int]]:
        """The state after each of ``keys`` (computed chunks), each in its own state slot:
        the store's keyword arguments and the slots to release once the store is done."""
        if not self.state_groups or not keys:
            return {}, []
        if len(self.free_states) < len(keys):
            raise RuntimeError(f"demo engine: {len(keys)} state slots needed, {len(self.free_states)} free")
        slots = [self.free_states.pop() for _ in keys]
        self._write_states(keys, slots)
        return {"state_slots": slots}, slots

    def load_kwargs(self) -> tuple[dict[str, Any], list[int]]:
        """A state slot that receives the loaded prefix's last state."""
        if not self.state_groups:
            return {}, []
        slot = self.free_states.pop()
        return {"state_slot": slot}, [slot]

    def _write_states(self, keys: list[bytes], slots: list[int]) -> None:
        idx = self.torch.tensor(slots, device=self.device)
        salts = self._salts(keys, 1, b"state")[:, None]
        for name in self.state_groups:
            for words, base in zip(self.words[name], self.base[name], strict=True):
                words[idx] = base[None, :] ^ salts

    def verify_load(self, keys: list[bytes], blocks: list[int], loaded: int, kwargs: dict[str, Any]) -> list[bytes]:
        """The keys among ``keys`` (the leading chunks of a load of ``loaded`` chunks that did
        not fail) whose copied bytes are wrong: full-attention blocks, the sliding window's
        blocks, and the last chunk's state when every chunk of the load arrived."""
        torch = self.torch
        if not keys:
            return []
        n = len(keys)
        bad = torch.zeros(n * self.bpc, dtype=torch.bool, device=self.device)
        idx = torch.tensor(blocks, device=self.device)
        salts = self._salts(keys, self.bpc)[:, None]
        for g in self.layout.groups:
            if g.is_state:
                continue
            first = window_first_block(loaded * self.bpc, g.window, self.tpb) if g.kind == "sliding" else 0
            if first >= n * self.bpc:
                continue
            for words, base in zip(self.words[g.name], self.base[g.name], strict=True):
                bad[first:] |= (words[idx[first:]] != (base[None, :] ^ salts[first:])).any(dim=1)
        out = bad.view(n, self.bpc).any(dim=1).tolist()
        if self.state_groups and n == loaded:
            slot = kwargs["state_slot"]
            salt = self._salts(keys[-1:], 1, b"state")[0]
            for name in self.state_groups:
                for words, base in zip(self.words[name], self.base[name], strict=True):
                    if bool((words[slot] != (base ^ salt)).any()):
                        out[-1] = True
        return [k for k, b in zip(keys, out, strict=True) if b]

    def load_bytes(self, keys: list[bytes], blocks: list[int], kwargs: dict[str, Any]) -> tuple[int, int]:
        """Bytes a load of ``keys`` copies to the device, and what a full copy would."""
        specs = chunk_specs(self.layout, tuple(keys), blocks, self.bpc, load=True, tokens_per_block=self.tpb,
                            state_slot=kwargs.get("state_slot"))
        copied = sum(copied_bytes(self.layout, self.bpc, s) for s in specs)
        return copied, len(keys) * self.layout.chunk_bytes(self.bpc)
