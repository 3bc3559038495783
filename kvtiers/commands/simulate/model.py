"""The accelerator and workload model of ``kvtiers simulate`` (no I/O, no torch).

The defaults describe one named setup from public figures: **Llama-3.1-8B on one H100 SXM
80 GB** with an FP8 KV cache (vLLM ``--kv-cache-dtype fp8``):

- KV bytes per token: 32 layers x 8 KV heads x 128 head dim x 2 (K and V) x 1 byte =
  64 KiB (the model's ``config.json``).
- GPU KV capacity: 0.9 x 80 GB (vLLM's ``gpu_memory_utilization``) - 16.1 GB of BF16
  weights - ~4 GB of activations and graphs = ~52 GB = 48 GiB.
- Prefill: 2 x 8.03e9 FLOPs per token for the weights plus attention over a ~6k-token
  context (4 x 32 layers x 4096 x 6000 = 3.1 GFLOPs) = ~19 GFLOPs per token; at 40 % of the
  H100's 989 dense BF16 TFLOP/s: ~50 us per token (~20k tokens/s).
- Decode: one step reads the weights (16.1 GB at ~80 % of 3.35 TB/s HBM: ~6 ms, shared by
  the batch) and each sequence's KV (12k tokens x 64 KiB: ~300 us per sequence). The batch
  is every conversation the GPU holds, at most its capacity (64): ~25 ms per step of 64.
- Host memory for KV: 100 GiB; host <-> GPU: PCIe Gen5 x16 at 40 GB/s each way (64 GB/s
  theoretical).

Tier bandwidths are not modelled: they are measured from the tiers on this machine (or given).

The default workload is sized against those capacities: each conversation opens with a
9216-token context (a document, a system prompt) and then alternates 512-token user turns
with 256-token answers; after 4 turns its KV is 12288 tokens, so the GPU holds 64
conversations and host memory 133.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

GiB = 1 << 30


@dataclass
class Accelerator:
    """What the simulation assumes about the accelerator and its host."""

    name: str = "Llama-3.1-8B, FP8 KV cache, on 1x H100 SXM 80GB"
    kv_bytes_per_token: int = 64 << 10
    gpu_kv_bytes: int = 48 * GiB
    host_kv_bytes: int = 100 * GiB
    prefill_us_per_token: float = 50.0
    decode_us_per_token: float = 300.0  # per sequence per step: reading its KV
    decode_step_us: float = 6000.0  # per step, shared by the batch: reading the weights
    pcie_gbps: float = 40.0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Workload:
    """Multi-turn conversations; ``turns`` per conversation, the first one a warm-up (not
    timed: every policy computes the opening context alike)."""

    context_tokens: int = 9216
    user_tokens: int = 512
    answer_tokens: int = 256
    turns: int = 4
    tokens_per_chunk: int = 1024
    concurrency: tuple[int, ...] = (16, 32, 64, 96, 128, 192, 256)
    seed: int = 0

    def final_tokens(self) -> int:
        return self.context_tokens + self.turns * (self.user_tokens + self.answer_tokens)

    def chunks_per_conversation(self) -> int:
        return self.final_tokens() // self.tokens_per_chunk

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["concurrency"] = list(self.concurrency)
        return d


@dataclass
class Link:
    """Load and store bandwidth (GB/s) of one path, and where the figures come from."""

    load_gbps: float
    store_gbps: float
    source: str


@dataclass
class Tally:
    """What one (policy, concurrency) run did over its timed turns."""

    requests: int = 0
    prompt_tokens: int = 0
    gpu_hit_tokens: int = 0
    loaded_tokens: dict[str, int] = field(default_factory=dict)  # source -> tokens
    computed_tokens: int = 0
    output_tokens: int = 0
    decode_batch: int = 1  # sequences per decode step
    chunks_loaded: dict[str, int] = field(default_factory=dict)  # path medium -> chunks read from it
    chunks_stored: dict[str, int] = field(default_factory=dict)  # medium -> chunks written to it
    mismatches: int = 0


def modelled_seconds(t: Tally, acc: Accelerator, chunk_bytes: int, links: dict[str, Link]) -> dict[str, float]:
    """Busy seconds of each resource: the GPU (prefill + decode), PCIe each way, each tier's
    loads (``TIER``) and, apart, the stores cascaded to it (``TIER_store``). Transfers
    overlap with compute (offloading is asynchronous), so the run takes as long as its
    busiest resource among the GPU, PCIe and the tiers' loads. Stores to a tier are
    written behind, off the critical path: where they need longer than the run, the tier
    could not have kept every chunk (see :func:`store_lag`)."""
    per_token = acc.decode_us_per_token + acc.decode_step_us / max(1, t.decode_batch)
    out = {"gpu": (t.computed_tokens * acc.prefill_us_per_token + t.output_tokens * per_token) / 1e6}
    to_gpu = sum(t.loaded_tokens.values()) * acc.kv_bytes_per_token
    from_gpu = t.chunks_stored.get("host", 0) * chunk_bytes
    out["pcie_h2d"] = to_gpu / (acc.pcie_gbps * 1e9)
    out["pcie_d2h"] = from_gpu / (acc.pcie_gbps * 1e9)
    for name, link in links.items():
        nbytes_in = t.chunks_loaded.get(name, 0) * chunk_bytes
        nbytes_out = t.chunks_stored.get(name, 0) * chunk_bytes
        out[name] = nbytes_in / (link.load_gbps * 1e9)
        out[f"{name}_store"] = nbytes_out / (link.store_gbps * 1e9)
    return out


def critical(seconds: dict[str, float]) -> dict[str, float]:
    """The resources a run waits for (write-behind stores are not among them)."""
    return {k: v for k, v in seconds.items() if not k.endswith("_store")}


def store_lag(seconds: dict[str, float], total: float) -> dict[str, float]:
    """Per tier: its stores' busy time over the run's time; above 1 the tier cannot absorb
    the KV as fast as the GPU produces it, and a real engine would drop the excess."""
    return {k[: -len("_store")]: round(v / total, 3) for k, v in seconds.items()
            if k.endswith("_store") and total > 0}


def break_even_gbps(acc: Accelerator, factor: float = 2.0) -> float:
    """Load GB/s at which loading a token's KV is ``factor`` times faster than prefilling it."""
    return factor * acc.kv_bytes_per_token / (acc.prefill_us_per_token * 1e-6) / 1e9
