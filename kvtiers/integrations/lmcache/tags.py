"""What a kvtiers tier is, as LMCache 0.5.7's ``MemoryTags`` say it (no LMCache here).

LMCache 0.5.7 asks every L2 adapter ``get_memory_tags()``: the kind of medium (``segment``)
and whether its bytes are on this host (``residency``: ``REMOTE`` when they live elsewhere
or in a domain other hosts share). It uses them to pick prefetch targets and L1-L2
affinity, so a tier must never claim LOCAL for bytes another host can change. Here:

- ``memory``: host DRAM, local;
- ``fs``: storage, local, unless its root is on a network or cluster file system (NFS, SMB,
  Lustre, CephFS, GPFS, a FUSE mount, ...; found in ``/proc/self/mountinfo``): then remote;
- ``obj``, ``p2p``, ``mooncake``, ``nixl``: remote (another host's memory or a store);
- any other tier (third-party): storage, remote, unless the adapter's ``residency``
  parameter says otherwise.

``adapter_params.residency`` (``"local"`` / ``"remote"``) overrides the residency found.
"""

from __future__ import annotations

import os
from typing import Any

#: file system types whose files other hosts may share
SHARED_FS = ("nfs", "nfs4", "cifs", "smb3", "smbfs", "lustre", "ceph", "gpfs", "glusterfs", "beegfs", "9p",
             "afs", "ocfs2", "gfs2", "virtiofs", "orangefs", "weka", "wekafs", "juicefs")
_REMOTE_TIERS = {"obj", "p2p", "mooncake", "nixl"}


def fs_type(path: str) -> str | None:
    """The file system type of the mount holding ``path`` (longest mount point that is a
    prefix of it), from ``/proc/self/mountinfo``; None where that cannot be read."""
    path = os.path.realpath(path)
    while not os.path.exists(path) and path != os.path.dirname(path):  # a root not made yet: its parent
        path = os.path.dirname(path)
    best, best_type = "", None
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                left, _, right = line.partition(" - ")
                fields = left.split()
                if len(fields) < 5 or not right:
                    continue
                mount = fields[4].replace("\\040", " ")
                inside = path == mount or path.startswith(mount.rstrip("/") + "/")
                if inside and len(mount) >= len(best):
                    best, best_type = mount, right.split()[0]
    except OSError:
        return None
    return best_type


def is_shared_fs(fstype: str | None) -> bool:
    """Whether files on a file system of ``fstype`` may be shared with other hosts."""
    if fstype is None:
        return False
    return fstype in SHARED_FS or fstype.startswith("fuse") or fstype.split(".")[0] in SHARED_FS


def memory_tags(tier_type: str, tier_options: dict[str, Any], residency: str | None = None) -> tuple[str, str]:
    """``(segment, residency)`` of a kvtiers tier as LMCache's enum values (``"dram"`` /
    ``"storage"``, ``"local"`` / ``"remote"``)."""
    if tier_type == "memory":
        segment, where = "dram", "local"
    elif tier_type == "fs":
        root = str(tier_options.get("root_dir") or ".")
        segment, where = "storage", "remote" if is_shared_fs(fs_type(root)) else "local"
    elif tier_type in _REMOTE_TIERS:
        segment, where = ("dram" if tier_type in ("p2p", "mooncake") else "storage"), "remote"
    else:
        segment, where = "storage", "remote"
    return segment, residency or where
