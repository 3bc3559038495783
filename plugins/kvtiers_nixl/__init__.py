"""kvtiers_nixl: the NIXL runtime the tiers' NIXL paths share (not a tier).

NIXL's native code (UCX, the AWS SDK, RDMA userspace drivers) runs inside the engine
process, where a crash takes down every request it serves. So before a process first uses
NIXL (the p2p client and server, the ``serve`` block, the obj tier's NIXL path), a short
canary runs the same calls in a child process (:mod:`kvtiers_nixl.canary`); if it crashes,
hangs or fails, the caller takes its fallback (ZMQ, aiobotocore) with one warning, or
raises at open if strict (:func:`use_nixl`). Agents are made and torn down in one safe
order, in the process that made them (:mod:`kvtiers_nixl.agents`). See docs/p2p.md,
"NIXL and RDMA drivers".
"""

from __future__ import annotations

from .agents import SAFE_ENV, apply_safe_env, installed, live_agents, make_agent, teardown
from .canary import Verdict, probe
from .choice import PathGauge, data_paths, record, use_nixl

__all__ = [
    "SAFE_ENV", "PathGauge", "Verdict", "apply_safe_env", "data_paths", "installed", "live_agents", "make_agent",
    "probe", "record", "teardown", "use_nixl",
]
