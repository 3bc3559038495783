"""``kvtiers bench obj``: the obj tier against plain aiobotocore on the same server, through
the one tier-bench harness (:mod:`kvtiers.commands.bench.harness`) with the tier fixed."""

from __future__ import annotations

from .bench import bench_obj

__all__ = ["bench_obj"]
