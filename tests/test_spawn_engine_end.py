"""``kvtiers.commands.vllm_engine.spawn`` ends an engine's process group once its result is
written, rather than waiting out vLLM's shutdown (5-8 s an engine), and removes the
``/dev/shm`` segments the group held, as vLLM's own shutdown would have.

A stand-in engine (``python=`` a script, no vLLM) writes its result as the engine does (a
whole file, renamed into place), with a child in its group holding a ``/dev/shm`` segment
mapped, then sleeps far past ``spawn``'s timeout.
"""

from __future__ import annotations

import os
import sys
import uuid
from pathlib import Path

from kvtiers.commands.vllm_engine import spawn

ENGINE = """\
import json, mmap, os, sys, time
out, shm = sys.argv[4], sys.argv[5]
with open(shm, "w+b") as f:
    f.truncate(4096)
    seg = mmap.mmap(f.fileno(), 4096)
if os.fork() == 0:  # a worker, mapping the segment, as vLLM's message queues are
    time.sleep(600)
    os._exit(0)
with open(out + ".tmp", "w") as f:
    json.dump({"requests": [], "pid": os.getpid(), "nice": os.nice(0)}, f)
os.replace(out + ".tmp", out)
time.sleep(600)  # vLLM's shutdown, far longer
"""


def _stand_in(tmp_path: Path, shm: str) -> str:
    script = tmp_path / "engine.py"
    script.write_text(ENGINE)
    fake_python = tmp_path / "python"  # spawn runs PYTHON -m kvtiers.commands.vllm_engine JOB OUT
    fake_python.write_text(f'#!/bin/sh\nexec {sys.executable} {script} "$@" {shm}\n')
    fake_python.chmod(0o755)
    return str(fake_python)


def test_spawn_returns_once_the_result_is_written_and_the_group_and_its_shm_are_gone(tmp_path: Path) -> None:
    shm = f"/dev/shm/kvtiers-test-spawn-{uuid.uuid4().hex[:12]}"
    try:
        res = spawn({"prompts": []}, tmp_path, "stand-in", python=_stand_in(tmp_path, shm), timeout=60)
        assert res["requests"] == []
        pgid = res["pid"]
        members = []
        for pid in (p for p in os.listdir("/proc") if p.isdigit()):
            try:
                with open(f"/proc/{pid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == pgid and fields[0] not in "ZX":
                members.append(pid)
        assert members == [], f"the engine's group lives on: {members}"
        assert not os.path.exists(shm), "the segment its processes held is left in /dev/shm"
    finally:
        if os.path.exists(shm):
            os.unlink(shm)


def test_spawn_adds_nice_to_the_engines_niceness(tmp_path: Path) -> None:
    shm = f"/dev/shm/kvtiers-test-spawn-{uuid.uuid4().hex[:12]}"
    try:
        res = spawn({"prompts": []}, tmp_path, "stand-in", python=_stand_in(tmp_path, shm), timeout=60, nice=3)
    finally:
        if os.path.exists(shm):
            os.unlink(shm)
    assert res["nice"] == min(os.nice(0) + 3, 19)
