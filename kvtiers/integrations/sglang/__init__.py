"""Any kvtiers tier as an SGLang HiCache storage backend; see docs/sglang.md.

Launch SGLang with ``--hicache-storage-backend dynamic`` and
``--hicache-storage-backend-extra-config '{"backend_name": "kvtiers", "module_path":
"kvtiers.integrations.sglang", "class_name": "KvtiersStorage", "interface_v1": 1, "tier": "fs",
"root_dir": "/mnt/kv"}'``.
"""

from __future__ import annotations

from .backend import KvtiersStorage
from .pages import PageLayout, probe

__all__ = ["KvtiersStorage", "PageLayout", "probe"]
