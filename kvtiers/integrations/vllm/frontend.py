"""What kvtiers adds to vLLM's frontend process (``LLM(...)``, ``vllm serve``) for an engine that
loads with the ``kvtiers`` load format (:mod:`.loader`); other engines are left as they are.

- **Requests while the weights sleep.** :func:`~.weights_sleep.sleep_weights` frees the model in
  the workers; a request that reached them would fail in the first layer and vLLM would stop the
  engine. So the frontend notes, after each ``collective_rpc`` of ``sleep_weights`` or
  ``wake_weights``, whether some worker sleeps (it asks them: :func:`~.weights_sleep.weights_asleep`),
  and meanwhile refuses a request with :data:`~.weights_sleep.ASLEEP_ERROR` before it reaches the
  engine (``LLM.generate`` raises it; the engine serves on and can be woken).
- **A load that cannot start.** A fork with no record and no checkpoint stops the worker with one
  line (written where the frontend reads it); vLLM's frontend then ends with its own "Engine core
  initialization failed. See root cause above.", after the workers' tracebacks. The frontend
  raises the loader's line instead, so it is the last line printed.

:func:`install` (the plugin calls it in every vLLM process) wraps vLLM's
``EngineCoreClient.make_client`` and ``make_async_mp_client``, which ``LLMEngine`` and ``AsyncLLM``
call to start the engine.
"""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["ERROR_FILE_ENV", "install"]

#: the file a worker's loader writes its one-line error to (set by the frontend for the engine's
#: processes, which inherit it)
ERROR_FILE_ENV = "KVTIERS_LOAD_ERROR_FILE"
_ASLEEP = "_kvtiers_weights_asleep"
_WRAPPED = "_kvtiers_frontend"


def install() -> None:
    """Wrap vLLM's engine-client factories (once per process); see the module docstring."""
    from vllm.v1.engine.core_client import EngineCoreClient

    if getattr(EngineCoreClient, _WRAPPED, False):
        return
    for name in ("make_client", "make_async_mp_client"):
        setattr(EngineCoreClient, name, staticmethod(_starting(getattr(EngineCoreClient, name))))
    setattr(EngineCoreClient, _WRAPPED, True)


def _starting(make: Callable[..., Any]) -> Callable[..., Any]:
    def start(*args: Any, **kwargs: Any) -> Any:
        config = next((a for a in (*args, *kwargs.values()) if hasattr(a, "load_config")), None)
        if config is None or getattr(config.load_config, "load_format", None) != "kvtiers" \
                or os.environ.get(ERROR_FILE_ENV):  # another format, or make_client calling make_async_mp_client
            return make(*args, **kwargs)
        _guard_requests()
        fd, path = tempfile.mkstemp(prefix="kvtiers-load-error-")
        os.close(fd)
        os.environ[ERROR_FILE_ENV] = path
        try:
            return make(*args, **kwargs)
        except Exception:
            line = Path(path).read_text(errors="replace").strip()
            if line:
                raise RuntimeError(line) from None
            raise
        finally:
            os.environ.pop(ERROR_FILE_ENV, None)
            Path(path).unlink(missing_ok=True)

    return start


def _guard_requests() -> None:
    """Wrap ``add_request`` and ``collective_rpc`` of vLLM's frontend engines (those imported:
    the one starting now is)."""
    from .weights_sleep import ASLEEP_ERROR, sleep_weights, wake_weights, weights_asleep

    def asleep_after(query: Callable[[], list[bool]]) -> bool:
        try:
            return any(query())
        except Exception:  # noqa: BLE001 - workers that cannot answer serve nothing either
            return True

    llm_engine = sys.modules.get("vllm.v1.engine.llm_engine")
    cls = getattr(llm_engine, "LLMEngine", None)
    if cls is not None and not vars(cls).get(_WRAPPED):
        add, rpc = cls.add_request, cls.collective_rpc

        def add_request(self: Any, *args: Any, **kwargs: Any) -> Any:
            if getattr(self, _ASLEEP, False):
                raise RuntimeError(ASLEEP_ERROR)
            return add(self, *args, **kwargs)

        def collective_rpc(self: Any, method: Any, *args: Any, **kwargs: Any) -> Any:
            if method is not sleep_weights and method is not wake_weights:
                return rpc(self, method, *args, **kwargs)
            try:
                return rpc(self, method, *args, **kwargs)
            finally:
                setattr(self, _ASLEEP, asleep_after(lambda: rpc(self, weights_asleep)))

        cls.add_request, cls.collective_rpc = add_request, collective_rpc
        setattr(cls, _WRAPPED, True)

    async_llm = sys.modules.get("vllm.v1.engine.async_llm")
    acls = getattr(async_llm, "AsyncLLM", None)
    if acls is not None and not vars(acls).get(_WRAPPED):
        aadd, arpc = acls.add_request, acls.collective_rpc

        async def add_request_async(self: Any, *args: Any, **kwargs: Any) -> Any:
            if getattr(self, _ASLEEP, False):
                raise RuntimeError(ASLEEP_ERROR)
            return await aadd(self, *args, **kwargs)

        async def collective_rpc_async(self: Any, method: Any, *args: Any, **kwargs: Any) -> Any:
            if method is not sleep_weights and method is not wake_weights:
                return await arpc(self, method, *args, **kwargs)
            try:
                return await arpc(self, method, *args, **kwargs)
            finally:
                try:
                    asleep = any(await arpc(self, weights_asleep))
                except Exception:  # noqa: BLE001 - as asleep_after
                    asleep = True
                setattr(self, _ASLEEP, asleep)

        acls.add_request, acls.collective_rpc = add_request_async, collective_rpc_async
        setattr(acls, _WRAPPED, True)
