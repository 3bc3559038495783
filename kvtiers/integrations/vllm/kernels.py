"""Which of vLLM CPU's linear kernels a model's layers compute with (nothing here imports vLLM)."""

from __future__ import annotations

from typing import Any

__all__ = ["linear_kernels"]


def linear_kernels(model: Any) -> dict[str, int]:
    """How many of ``model``'s layers compute with each of vLLM CPU's linear kernels, by what
    their ``cpu_linear`` holds: ``onednn`` (a oneDNN handle), ``sgl`` (the SGL kernel's packed
    weight), ``zentorch``, ``torch`` (torch's own linear on the parameter)."""
    out: dict[str, int] = {}
    for mod in model.modules():
        fn = getattr(mod, "cpu_linear", None)
        if fn is None:
            continue
        held = set(getattr(getattr(fn, "__code__", None), "co_freevars", ()))
        kind = ("onednn" if "handler" in held else "sgl" if "packed_weight" in held
                else "zentorch" if "zen_weight" in held else "torch")
        out[kind] = out.get(kind, 0) + 1
    return dict(sorted(out.items()))
