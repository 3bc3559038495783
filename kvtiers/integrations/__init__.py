"""Bridges that put any kvtiers tier inside an inference engine.

- :mod:`kvtiers.integrations.vllm`: a vLLM secondary tier (``SecondaryTierManager``) over a
  kvtiers tier, and the ``vllm.general_plugins`` entry point that names every installed
  kvtiers tier to vLLM (``kvtiers_fs``, ``kvtiers_memory``, ...). See docs/vllm.md.
- :mod:`kvtiers.integrations.sglang`: an SGLang HiCache storage backend (``HiCacheStorage``,
  interface v1, zero-copy through the host pool's pages). See docs/sglang.md.

Each subpackage imports its engine (and so torch); this package itself imports neither.
"""
