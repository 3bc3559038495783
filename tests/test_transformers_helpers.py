"""Helpers of the transformers prefix-cache tests: a real small model made locally
(kvtiers.commands.tinymodel), greedy generation with a ``DynamicCache``, and a script entry so
that a prefix can be stored in one process and loaded in another:

    python tests/test_transformers_helpers.py store|load ARCH DTYPE CONFIG_JSON PROMPT_JSON

``store`` prefills the prompt and stores it; ``load`` loads the longest stored prefix, generates
from it and from a full prefill, and prints one JSON line ``{"n": ..., "cached": [...], "full":
[...], "max_logit_diff": ...}``.
"""

from __future__ import annotations

import json
import sys
from typing import Any

NEW_TOKENS = 12


def tiny_model(arch: str = "llama", dtype: str = "bfloat16", **kw: Any) -> Any:
    """The shared tiny model of ``arch``, loaded in ``dtype``, in eval mode."""
    import torch
    from transformers import AutoModelForCausalLM

    from kvtiers.commands.tinymodel import make_tiny_model

    path = make_tiny_model(arch=arch, **kw)
    return AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).eval()


def prompt(n: int, seed: int = 0, vocab: int = 2000) -> list[int]:
    """``n`` token ids, fixed by ``seed``."""
    import random

    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(n)]


def prefill(model: Any, ids: list[int]) -> Any:
    """The ``DynamicCache`` of a full prefill of ``ids``."""
    import torch

    with torch.no_grad():
        return model(input_ids=torch.tensor([ids]), use_cache=True).past_key_values


def greedy(model: Any, ids: list[int], cache: Any = None, n: int = NEW_TOKENS) -> tuple[list[int], Any]:
    """``n`` greedy tokens after ``ids`` (the tokens ``cache`` does not hold yet), and the logits of
    the first one."""
    import torch

    out = []
    with torch.no_grad():
        o = model(input_ids=torch.tensor([ids]), past_key_values=cache, use_cache=True)
        first = o.logits[0, -1].float().clone()
        for _ in range(n):
            nxt = o.logits[:, -1].argmax(-1, keepdim=True)
            out.append(int(nxt))
            o = model(input_ids=nxt, past_key_values=o.past_key_values, use_cache=True)
    return out, first


def cached_vs_full(pc: Any, model: Any, ids: list[int]) -> dict[str, Any]:
    """Load the longest stored prefix of ``ids`` through ``pc``, generate from it, and from a
    full prefill: ``{"n", "cached", "full", "max_logit_diff"}``."""
    cache, n = pc.load(ids)
    cached, lc = greedy(model, ids[n:], cache)
    full, lf = greedy(model, ids)
    return {"n": n, "cached": cached, "full": full, "max_logit_diff": float((lc - lf).abs().max())}


def main(argv: list[str]) -> None:
    from kvtiers.integrations.transformers import PrefixCache

    what, arch, dtype, config, ids = argv[0], argv[1], argv[2], json.loads(argv[3]), json.loads(argv[4])
    model = tiny_model(arch, dtype)
    with PrefixCache.from_config(config, model, tokens_per_chunk=16) as pc:
        if what == "store":
            print(json.dumps({"stored": pc.store(ids, prefill(model, ids))}))
        else:
            print(json.dumps(cached_vs_full(pc, model, ids)))


if __name__ == "__main__":
    main(sys.argv[1:])
