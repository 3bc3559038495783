"""The ``kvtiers`` load format of vLLM: publish a model's weights to the tiers as it loads, or
start an engine from weights another engine published, without reading a checkpoint.

``--load-format kvtiers --model-loader-extra-config '{"mode": ..., "name": ..., "revision":
..., "tiers": [...]}'`` (``vllm serve``, ``kvtiers vllm serve``) or ``LLM(...,
load_format="kvtiers", model_loader_extra_config={...})``; the keys are checked by
:mod:`.loader_config`, and kvtiers' vLLM plugin registers the format in every vLLM process.

vLLM's loader allocates the model's parameters, fills them (``load_weights``), then packs them
for its kernels (``process_weights_after_loading``: on CPU, oneDNN or SGL-kernel copies the
parameters no longer show). :class:`KvtiersModelLoader` works between the first two steps and the
third, on vLLM's own parameter layout of each rank (fused ``qkv_proj`` / ``gate_up_proj``, split
per tensor-parallel rank), so whatever vLLM packs afterwards, and on whatever CPU, is built from
the same bytes:

- **publish**: vLLM's default loader reads the checkpoint, then each rank publishes its
  parameters and buffers with :class:`~kvtiers.engine.weights.ModelWeights` (chunks keyed by the
  content digest) and appends a head record (:mod:`.weights_heads`) naming that digest;
- **fork**: each rank reads the last head record of its identity and fills its parameters from
  the first tier holding each chunk (:meth:`ModelWeights.fork`: manifest checked tensor by tensor,
  the bytes' digest checked after). A miss, a damaged record or a mismatch falls back to the
  checkpoint when the model has one, else the engine stops with one line naming the identity.

Either way the model remembers the identity and each tensor's layout before packing
(:func:`.weights_sleep.remember_load`), so that :mod:`.weights_sleep` can free the running
engine's weights and bring them back in place, packed again by vLLM, on every CPU.

The identity: the configured ``name`` with vLLM's layout version (vLLM's major.minor and the
model class, e.g. ``my-model [vllm-0.32/LlamaForCausalLM]``), ``revision``, the rank in vLLM's
world group and its size, the chunk size, and the content digest.
"""

from __future__ import annotations

import glob
import os
import time
from typing import Any

from torch import nn
from vllm.config import ModelConfig
from vllm.config.load import LoadConfig
from vllm.logger import init_logger
from vllm.model_executor.model_loader.base_loader import BaseModelLoader
from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

from ...engine.weights import ModelWeights, WeightsIdentity
from .frontend import ERROR_FILE_ENV
from .kernels import linear_kernels
from .loader_config import LoaderConfig, parse_loader_config
from .weights_heads import Heads
from .weights_sleep import remember_load

__all__ = ["KvtiersModelLoader", "layout_version", "linear_kernels"]

#: under vLLM's logger, so its lines appear in the engine's log as vLLM's own do
log = init_logger("vllm.kvtiers.loader")

_CHECKPOINT_PATTERNS = ("*.safetensors", "*.bin", "*.pt")


def layout_version(model: nn.Module) -> str:
    """vLLM's parameter layout the weights are in: vLLM's major.minor and the model's class."""
    import vllm

    major_minor = ".".join(str(vllm.__version__).split("+")[0].split(".")[:2])
    return f"vllm-{major_minor}/{type(model).__name__}"


def _tell_frontend(line: str) -> None:
    """Leave the one line that stops this engine's start where vLLM's frontend reads it, to end
    with it (:mod:`.frontend`; outside such a frontend, nowhere)."""
    path = os.environ.get(ERROR_FILE_ENV)
    if path:
        try:
            with open(path, "w") as f:
                f.write(line + "\n")
        except OSError:
            pass


def _rank() -> tuple[int, int]:
    """This worker's rank in vLLM's world group, and the group's size (0 of 1 outside an
    engine, where no world group was made)."""
    from vllm.distributed import parallel_state

    if getattr(parallel_state, "_WORLD", None) is None:
        return 0, 1
    group = parallel_state.get_world_group()
    return group.rank_in_group, group.world_size


class KvtiersModelLoader(BaseModelLoader):
    """vLLM's model loader for ``load_format="kvtiers"`` (see the module docstring)."""

    def __init__(self, load_config: LoadConfig) -> None:
        super().__init__(load_config)
        self.config: LoaderConfig = parse_loader_config(load_config.model_loader_extra_config)
        # vLLM's own loader for the checkpoint, under a load format it knows
        inner = LoadConfig(**{f: getattr(load_config, f) for f in ("download_dir", "ignore_patterns",
                                                                   "use_tqdm_on_load", "device")
                              if hasattr(load_config, f)})
        self._checkpoint = DefaultModelLoader(inner)
        self.last: dict[str, Any] = {}  # what the last load did (for the log and tests)

    # -- BaseModelLoader ----------------------------------------------------------------------
    def load_model(self, vllm_config: Any, model_config: ModelConfig, prefix: str = "") -> nn.Module:
        """vLLM's load (allocate, :meth:`load_weights`, pack), then one log line of the kernels
        each linear layer computes with now that vLLM packed them."""
        model = super().load_model(vllm_config, model_config, prefix)
        import torch

        self.last["kernels"] = linear_kernels(model)
        self.last["amx"] = bool(torch.cpu._is_amx_tile_supported())
        log.info("kvtiers: %s load done; linear layers per kernel %s (AMX %s)", self.config.mode,
                 self.last["kernels"], "yes" if self.last["amx"] else "no")
        return model

    def download_model(self, model_config: ModelConfig) -> None:
        """Publish: the checkpoint, as vLLM's default loader gets it. Fork: nothing."""
        if self.config.mode == "publish":
            self._checkpoint.download_model(model_config)

    def load_weights(self, model: nn.Module, model_config: ModelConfig) -> None:
        """Fill ``model``'s (allocated, not yet packed) parameters: from the checkpoint and
        publish them, or from the tiers."""
        rank, world = _rank()
        if self.config.mode == "publish":
            self._checkpoint.load_weights(model, model_config)
            self._publish(model, model_config, rank, world)
        else:
            self._fork(model, model_config, rank, world)

    # -- internals ----------------------------------------------------------------------------
    def _names(self, model: nn.Module, model_config: ModelConfig) -> tuple[str, str | None, str]:
        layout = layout_version(model)
        revision = self.config.revision if self.config.revision_given else model_config.revision
        return f"{self.config.name} [{layout}]", revision, layout

    def _publish(self, model: nn.Module, model_config: ModelConfig, rank: int, world: int) -> None:
        """Publish this rank's parameters; a tier that fails is logged, the engine serves on."""
        name, revision, layout = self._names(model, model_config)
        cfg, t0 = self.config.weights_config(), time.perf_counter()
        try:
            with ModelWeights(model, cfg, name=name, revision=revision, rank=rank, world_size=world,
                              chunk_bytes=self.config.chunk_bytes, timeout=self.config.timeout) as w:
                ident = w.publish()
                nbytes, tensors = w.plan.total_bytes, w.plan.tensors
            with Heads(cfg, name=name, revision=revision, rank=rank, world_size=world,
                       timeout=self.config.timeout) as heads:
                heads.append(ident, nbytes, layout)
        except Exception as e:  # noqa: BLE001 - the engine has its weights: it serves, unpublished
            log.warning("kvtiers: publishing the weights of model %r %s rank %d/%d failed, the engine serves "
                        "without: %s", name, revision, rank, world, e)
            self.last = {"mode": "publish", "error": str(e)}
            return
        remember_load(model, ident, cfg, tensors, self.config.timeout)
        seconds = time.perf_counter() - t0
        self.last = {"mode": "publish", "identity": ident.to_dict(), "nbytes": nbytes, "seconds": seconds}
        log.info("kvtiers: published %s (%d bytes) in %.2f s", ident, nbytes, seconds)

    def _fork(self, model: nn.Module, model_config: ModelConfig, rank: int, world: int) -> None:
        """Fill this rank's parameters from the tiers, or from the checkpoint when they fail."""
        name, revision, layout = self._names(model, model_config)
        cfg, t0 = self.config.weights_config(), time.perf_counter()
        ident: WeightsIdentity | str = WeightsIdentity(name, revision, rank, world)
        try:
            with Heads(cfg, name=name, revision=revision, rank=rank, world_size=world,
                       timeout=self.config.timeout) as heads:
                head = heads.latest()
            ident = head.identity
            with ModelWeights.fork(model, cfg, ident, timeout=self.config.timeout) as w:
                step, tensors = w.last_step, w.plan.tensors
        except (LookupError, ValueError, RuntimeError, TimeoutError, OSError) as e:
            reason = " ".join(str(e).split())  # one line
            if not self._has_checkpoint(model_config):
                line = (f"kvtiers load format: cannot fork {ident}: {reason}; and {model_config.model} has no "
                        f"checkpoint to fall back to: publish the model first (an engine with mode 'publish', "
                        f"the same name, revision and tensor-parallel size, on these tiers), or start from a "
                        f"model directory with its weight files")
                _tell_frontend(line)
                raise RuntimeError(line) from None
            log.warning("kvtiers: forking %s failed (%s); loading the checkpoint of %s instead", ident, reason,
                        model_config.model)
            self._checkpoint.load_weights(model, model_config)
            self.last = {"mode": "fork", "fallback": reason}
            return
        remember_load(model, ident, cfg, tensors, self.config.timeout)
        seconds = time.perf_counter() - t0
        self.last = {"mode": "fork", "identity": ident.to_dict(), "nbytes": step.nbytes, "sources": step.sources,
                     "seconds": seconds}
        log.info("kvtiers: forked %s (%d bytes, chunks per tier %s) in %.2f s", ident, step.nbytes,
                    step.sources, seconds)

    def _has_checkpoint(self, model_config: ModelConfig) -> bool:
        """Whether the model has weight files to fall back to: a local directory holding some, or
        a hub model vLLM's default loader can get."""
        path = str(model_config.model)
        if os.path.isdir(path):
            return any(glob.glob(os.path.join(path, p)) for p in _CHECKPOINT_PATTERNS)
        try:
            self._checkpoint.download_model(model_config)
        except Exception:  # noqa: BLE001 - unreachable hub, no such model, no weight files
            return False
        return True

