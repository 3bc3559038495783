"""One real vLLM engine in this process, serving token prompts; what it did, as JSON.

Run in vLLM's environment (``make demo-vllm`` and the end-to-end tests use ``.venv-vllm``)::

    python -m kvtiers.commands.vllm_engine JOB.json OUT.json

``JOB.json``: ``{"model": dir, "prompts": [[token ids], ...], "max_tokens": N,
"kv_transfer_config": {...} or null, "max_model_len": N, "kvcache_gib": N, "runs": [...]}``;
``"dtype"`` (optional) is vLLM's, ``bfloat16`` by default.
``"tensor_parallel_size": N`` runs N workers (on CPU give each its cores: ``"env":
{"VLLM_CPU_OMP_THREADS_BIND": "0|1"}``; ``env`` is set before vLLM is imported).
With no ``model``, the tiny model of ``kvtiers.commands.tinymodel`` is made (once) and used,
with the options in ``"tiny_model"`` (e.g. ``{"layer_types": [...], "sliding_window": 256}``).
``runs`` (optional) lists rounds, each a list of prompt indices served in order, one request
at a time (default: every prompt once); ``"reset"`` between rounds drops vLLM's device prefix
cache, so the next round's prefixes must come from the offload tiers. ``cache_salts`` (optional):
``{"prompt index": salt}``, each such prompt's requests sent with that ``cache_salt``; ``kv_transfer_params``
(optional): ``{"prompt index": {...}}``, sent as that prompt's ``kv_transfer_params``; ``"logprobs": k``
(optional): each request's ``logprobs`` holds, per generated token, its top-``k`` ``[token, logprob]`` and the
sampled token's. ``load_format`` and
``model_loader_extra_config`` (optional) go to vLLM as given (e.g. ``"kvtiers"``); with ``"weights_sleep":
true`` (that load format only) the engine's weights are then put to sleep, a request is sent (``weights``'
``asleep_request``: the error it met), and the weights are woken in every worker
(:mod:`kvtiers.integrations.vllm.weights_sleep`; ``OUT.json``'s ``weights`` says what each did) and the
first round is served again, as round ``len(runs)``. ``"in_process": true`` runs vLLM's engine core in this
process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), and with one worker the worker too: vLLM is imported once
instead of three times, and the engine starts in seconds instead of half a minute (the tests' engines); the
default is vLLM's own processes, as a server runs them. One engine per process:
vLLM's CPU platform binds OpenMP threads at start-up, and a second engine in one process
does not get its own.

``OUT.json``: per request ``prompt``, ``tokens`` (the greedy output ids), ``ttft_s`` (vLLM's
first-token latency), ``prefill_s`` (engine time from first scheduling to the first token),
``cached_tokens``, ``offload`` (how vLLM's ``vllm:kv_offload_*`` counters moved while it
ran: chunks and bytes stored, read per tier; what finishes later counts for a later request);
and ``metrics``: vLLM's counters (``name`` or ``name{label=value,...}`` -> value), with the
kvtiers tiers' counters among them.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

SPEC = {"spec_name": "KvtiersOffloadingSpec", "spec_module_path": "kvtiers.integrations.vllm"}
MODULE_PATH = "kvtiers.integrations.vllm"

#: what every engine run sets: one core for vLLM's own threads whether or not a
#: ``kv_transfer_config`` is set, so the model's OpenMP thread count (and so bf16 greedy
#: tokens on a random model) is the same with and without offloading
ENGINE_ENV = {"VLLM_CPU_NUM_OF_RESERVED_CPU": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "TOKENIZERS_PARALLELISM": "false"}


def offload_config(tiers: list[dict[str, Any]], cpu_bytes: int = 64 << 20, *, module_path: bool = False,
                   **extra: Any) -> dict[str, Any]:
    """A ``kv_transfer_config`` for vLLM's ``OffloadingConnector`` with ``KvtiersOffloadingSpec``:
    ``tiers`` are the secondary tiers (``{"type": "kvtiers_fs", "root_dir": ...}``); with
    ``module_path`` each entry names ``kvtiers.integrations.vllm`` (the form for engines where
    kvtiers' vLLM plugin is not loaded), else vLLM finds them through the entry point."""
    entries = [dict(t, module_path=MODULE_PATH) if module_path else dict(t) for t in tiers]
    return {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {**SPEC, "cpu_bytes_to_use": int(cpu_bytes), "secondary_tiers": entries,
                                          **extra}}


def prompt_family(prefix_tokens: int, suffixes: int = 1, suffix_tokens: int = 64, seed: int = 0,
                  vocab: int = 2048) -> list[list[int]]:
    """``suffixes`` token prompts sharing one random ``prefix_tokens``-token prefix (fixed by ``seed``)."""
    rng = random.Random(seed)
    prefix = [rng.randrange(3, vocab) for _ in range(prefix_tokens)]
    return [prefix + [rng.randrange(3, vocab) for _ in range(suffix_tokens)] for _ in range(suffixes)]


def spawn(job: dict[str, Any], workdir: str | os.PathLike, name: str, *, python: str | None = None,
          timeout: float = 900.0, env: dict[str, str] | None = None, nice: int = 0) -> dict[str, Any]:
    """Run :func:`run` on ``job`` in a new process of ``python`` (default: this one), one engine
    in it (``nice`` added to its niceness); its log goes to ``workdir/name.log``. Raises
    ``RuntimeError`` with the log's tail if the engine fails or runs past ``timeout`` seconds
    (then its process group is killed).

    Once the result is written the engine has nothing left to do, and vLLM's own shutdown takes
    5-8 s (its engine core is force-killed after 5 s): the process group is ended then
    (:func:`end_group`), the ``/dev/shm`` segments its processes held removed with it."""
    wd = Path(workdir)
    wd.mkdir(parents=True, exist_ok=True)
    job_file, out_file, log_file = wd / f"{name}.job.json", wd / f"{name}.out.json", wd / f"{name}.log"
    job_file.write_text(json.dumps(job))
    out_file.unlink(missing_ok=True)
    child_env = dict(os.environ if env is None else env)
    for k, v in ENGINE_ENV.items():
        child_env.setdefault(k, v)
    with open(log_file, "wb") as log:
        argv = [python or sys.executable, "-m", "kvtiers.commands.vllm_engine", str(job_file), str(out_file)]
        proc = subprocess.Popen(["nice", "-n", str(nice), *argv] if nice else argv, stdin=subprocess.DEVNULL,
                                stdout=log, stderr=subprocess.STDOUT,
                                env=child_env, start_new_session=True)
        rc = None
        deadline = time.monotonic() + timeout
        try:
            while (rc := proc.poll()) is None and time.monotonic() < deadline:
                if out_file.exists():  # written whole (a rename): the rest is vLLM's shutdown
                    end_group(proc)
                    rc = 0
                    break
                time.sleep(0.1)
        finally:  # timed out, or the caller was interrupted: the engine and its children go
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    if rc != 0 or not out_file.exists():
        tail = log_file.read_text(errors="replace")[-4000:]
        what = f"ran past {timeout:g} s" if rc is None else f"exited with status {rc}"
        raise RuntimeError(f"vLLM engine {name!r} {what}; the end of {log_file}:\n{tail}")
    return json.loads(out_file.read_text())


def _group(pgid: int) -> dict[int, str]:
    """The live processes of group ``pgid``: pid -> command line."""
    out: dict[int, str] = {}
    for pid in (p for p in os.listdir("/proc") if p.isdigit()):
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            if int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    out[int(pid)] = f.read().replace(b"\0", b" ").decode(errors="replace")
        except (OSError, IndexError, ValueError):
            continue  # exited meanwhile
    return out


def _held_shm(pids: list[int]) -> set[str]:
    """The ``/dev/shm`` files (still named) that ``pids`` map or hold open."""
    paths: set[str] = set()
    for pid in pids:
        base = f"/proc/{pid}"
        try:
            with open(f"{base}/maps") as f:
                paths.update(line.split(None, 5)[5].strip() for line in f if " /dev/shm/" in line)
            for fd in os.listdir(f"{base}/fd"):
                target = os.readlink(f"{base}/fd/{fd}")
                if target.startswith("/dev/shm/"):
                    paths.add(target)
        except (OSError, IndexError):
            continue  # exited meanwhile
    return {p for p in paths if not p.endswith(" (deleted)")}


def end_group(proc: subprocess.Popen, tracker_s: float = 5.0) -> None:
    """End ``proc``'s process group (``proc`` leads it: ``start_new_session``) at once, leaving
    in ``/dev/shm`` nothing that a graceful exit would have removed: every process but
    multiprocessing's resource trackers is killed; a tracker then removes what was registered
    with it and not yet removed (vLLM's message queues, semaphores) and exits (given
    ``tracker_s``); what is left of the group is killed, and the ``/dev/shm`` files its
    processes held are removed (kvtiers' offload region has no name by then)."""
    members = _group(proc.pid)
    held = _held_shm(list(members))
    trackers = [pid for pid, cmd in members.items() if "resource_tracker" in cmd]
    for pid in members:
        if pid not in trackers:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    proc.wait()
    deadline = time.monotonic() + tracker_s
    while trackers and time.monotonic() < deadline and set(trackers) & set(_group(proc.pid)):
        time.sleep(0.05)
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    deadline = time.monotonic() + 10  # a killed process is gone once the kernel has run its exit
    while _group(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.02)
    for path in held:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def metric_values(metrics: list[Any]) -> dict[str, float]:
    """vLLM's ``LLM.get_metrics()`` as ``{name or name{labels}: value}`` (counters and gauges;
    histograms as their count and sum)."""
    out: dict[str, float] = {}
    for m in metrics:
        labels = {k: v for k, v in sorted(getattr(m, "labels", {}).items()) if k not in ("engine", "model_name")}
        key = m.name + ("{" + ",".join(f"{k}={v}" for k, v in labels.items()) + "}" if labels else "")
        if hasattr(m, "value"):
            out[key] = out.get(key, 0.0) + float(m.value)
        elif hasattr(m, "count") and hasattr(m, "sum"):
            out[key + ":count"] = out.get(key + ":count", 0.0) + float(m.count)
            out[key + ":sum"] = out.get(key + ":sum", 0.0) + float(m.sum)
    return out


def _offload_counters(llm: Any) -> dict[str, float]:
    """vLLM's offloading counters now (``vllm:kv_offload_*``, gauges left out)."""
    return {k: v for k, v in metric_values(llm.get_metrics()).items()
            if k.startswith("vllm:kv_offload") and "active" not in k and "usage" not in k}


def _settled(llm: Any, params: Any, timeout: float) -> dict[str, float]:
    """vLLM's metrics once no cascade to a secondary tier is in flight.

    Tiers finish cascades in the background, and vLLM reports what finished at its next step,
    so after the last request this serves tiny prompts (shorter than a block: nothing to store)
    to drive steps, until the tiering manager's active cascade jobs are 0 or ``timeout`` passes.
    """
    tick = {"prompt_token_ids": [5, 6, 7, 8]}
    deadline = time.monotonic() + timeout
    while True:
        time.sleep(0.5)
        llm.generate([tick], params, use_tqdm=False)
        time.sleep(0.5)  # the step's stats reach the frontend
        metrics = metric_values(llm.get_metrics())
        active = sum(v for k, v in metrics.items() if k.startswith("vllm:kv_offload_tiering_active_cascade_jobs"))
        if not active or time.monotonic() > deadline:
            return metrics


def run(job: dict[str, Any]) -> dict[str, Any]:
    """Start the engine, serve the job's rounds, return what happened."""
    for k, v in ENGINE_ENV.items():
        os.environ.setdefault(k, v)
    os.environ.update({str(k): str(v) for k, v in (job.get("env") or {}).items()})
    if job.get("kvcache_gib"):
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(job["kvcache_gib"])
    if job.get("in_process"):  # vLLM's CPU platform keeps its uni-process executor only with this off
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams

    if not job.get("model"):
        from .tinymodel import make_tiny_model

        job = dict(job, model=str(make_tiny_model(**(job.get("tiny_model") or {}))))
    prompts: list[list[int]] = job["prompts"]
    longest = max(len(p) for p in prompts)
    max_tokens = int(job.get("max_tokens", 8))
    max_len = int(job.get("max_model_len", longest + max_tokens + 16))
    t0 = time.perf_counter()
    llm = LLM(
        model=job["model"],
        dtype=job.get("dtype", "bfloat16"),
        max_model_len=max_len,
        max_num_batched_tokens=max(max_len, 2048),
        max_num_seqs=4,
        enforce_eager=True,
        disable_log_stats=False,
        seed=0,
        tensor_parallel_size=int(job.get("tensor_parallel_size", 1)),
        kv_transfer_config=job.get("kv_transfer_config"),
        **({"load_format": job["load_format"]} if job.get("load_format") else {}),
        **({"model_loader_extra_config": job["model_loader_extra_config"]}
           if job.get("model_loader_extra_config") else {}),
    )
    started = time.perf_counter() - t0
    top = {"logprobs": int(job["logprobs"])} if job.get("logprobs") else {}
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **top)
    rounds = job.get("runs") or [list(range(len(prompts)))]
    requests: list[dict[str, Any]] = []
    before = _offload_counters(llm)

    def serve(r: int, indices: list[int]) -> None:
        nonlocal before
        for i in indices:
            w0 = time.perf_counter()
            salt = (job.get("cache_salts") or {}).get(str(i))  # {"prompt index": salt}: vLLM's per-request cache_salt
            kvp = (job.get("kv_transfer_params") or {}).get(str(i))  # {"prompt index": kv_transfer_params}
            sp = params if kvp is None else SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                                                           extra_args={"kv_transfer_params": kvp}, **top)
            (out,) = llm.generate([{"prompt_token_ids": prompts[i], **({"cache_salt": salt} if salt else {})}], sp,
                                  use_tqdm=False)
            wall = time.perf_counter() - w0
            after = _offload_counters(llm)
            offload = {k: v - before.get(k, 0.0) for k, v in after.items() if v != before.get(k, 0.0)}
            before = after
            m = out.metrics
            ttft = getattr(m, "first_token_latency", None) if m is not None else None
            prefill = None
            if m is not None and getattr(m, "first_token_ts", 0) and getattr(m, "scheduled_ts", 0):
                prefill = m.first_token_ts - m.scheduled_ts
            requests.append({"round": r, "prompt": i, "prompt_tokens": len(prompts[i]),
                             "tokens": list(out.outputs[0].token_ids), "ttft_s": ttft, "prefill_s": prefill,
                             "wall_s": wall, "cached_tokens": out.num_cached_tokens, "offload": offload,
                             **({"logprobs": [sorted([[int(t), float(lp.logprob)] for t, lp in pos.items()],
                                                     key=lambda x: -x[1]) for pos in out.outputs[0].logprobs or []]}
                                if top else {})})

    for r, indices in enumerate(rounds):
        if r and job.get("reset", True):
            llm.reset_prefix_cache()
        serve(r, indices)
    weights: dict[str, Any] = {}
    if job.get("weights_sleep"):  # the kvtiers load format's sleep and wake, then the first round again
        from ..integrations.vllm.weights_sleep import sleep_weights, wake_weights

        weights = {"sleep": llm.collective_rpc(sleep_weights)}
        try:  # a request while asleep: refused with the documented error, the engine serving on
            llm.generate([{"prompt_token_ids": prompts[rounds[0][0]]}], params, use_tqdm=False)
            weights["asleep_request"] = {"served": True}
        except Exception as e:  # noqa: BLE001 - what the caller saw is the result
            weights["asleep_request"] = {"error": f"{type(e).__name__}: {e}"}
        weights["wake"] = llm.collective_rpc(wake_weights)
        llm.reset_prefix_cache()
        serve(len(rounds), rounds[0])
    metrics = _settled(llm, params, float(job.get("settle_s", 60.0)))
    out = {"engine_start_s": started, "requests": requests, "metrics": metrics}
    return {**out, "weights": weights} if weights else out


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print("usage: python -m kvtiers.commands.vllm_engine JOB.json OUT.json", file=sys.stderr)
        return 2
    job = json.loads(Path(args[0]).read_text())
    result = run(job)
    tmp = Path(args[1] + ".tmp")
    tmp.write_text(json.dumps(result))
    tmp.replace(args[1])
    return 0


if __name__ == "__main__":
    sys.exit(main())
