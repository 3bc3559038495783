"""``kvtiers bench serve --soak DURATION``: hours of serving, sampled every interval.

One ``kvtiers vllm serve`` (``--servers 2``: two, on one fs root, sharing its bound) with
``KvtiersOffloadingSpec``: a host arena (``--tier-cpu-bytes``) in front of kvtiers' fs tier
bounded by ``max_bytes`` (``--fs-max-bytes``), so the tier evicts throughout. Each server gets
vLLM's own client (``vllm bench serve``, prefix repetition, Poisson arrivals at ``--rate``
requests/s, at most ``--max-concurrency`` in flight) for the whole duration, over a working
set (``--prefixes`` prefixes of ``--prefix-len`` tokens) larger than the arena and the bound.

Every ``--interval`` this samples, per server: requests finished per second and TTFT p50/p99
of the interval (the server's ``vllm:request_success`` and ``vllm:time_to_first_token_seconds``
histogram, quantiles interpolated within its buckets), the tier hit rate (chunk hits /
queries of each tier, vLLM's tiering counters), RSS, open fds and threads of the API process,
the engine core and its workers (``/proc``), and once: the bytes of the fs root's namespace
directories against the bound, and ``/dev/shm``. And each interval each server answers two
fixed greedy prompts, whose tokens and top-k logprobs must be those of a server without
offloading (the reference: started with the soak's servers, it answers the prompts twice,
computed and then cached, in three runs told apart by a ``cache_salt``, the third beside other
requests, and stops; the largest top-k difference among its answers to a prompt is the
tolerance, :func:`tolerance`, :mod:`.serve_identity`; an answer may part from the reference's
tokens only where two tokens were within it of a tie); the soak's answers come through the
device cache, the arena or the tier.

At the end: each client's own figures (completed, failed, TTFT), the ratios of the last
interval's rates to the first full one's, how RSS, fds and threads grew, and the verdict:
no failed request, every greedy answer the reference, no server died, nothing left in
``/dev/shm``. Flat lines are the goal; ``--plot`` draws them (:mod:`.serve_soak_plot`).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import subprocess
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ...launcher import die_with_parent
from ..vllm_engine import offload_config, prompt_family
from . import serve_identity
from . import serve_metrics as sm
from . import serve_run as sr
from .serve_soak_probes import histogram_quantile, process_tree, shm_usage
from .soak import terminated_is_interrupt
from .soak_probes import fs_usage

__all__ = ["SoakSettings", "run_serve_soak"]

TTFT = "vllm:time_to_first_token_seconds"
SUCCESS = "vllm:request_success_total"
#: the greedy prompts checked every interval: two prompts sharing one 512-token prefix
PROBE_PREFIX = 512


@dataclass
class SoakSettings:
    """What a serving soak runs (see the module)."""

    duration_s: float
    interval_s: float = 60.0
    rate: float = 1.0  # requests/s per server
    max_concurrency: int = 16
    prefixes: int = 48
    servers: int = 1
    fs_max_bytes: int = 256 << 20


def _client(base_url: str, settings: sr.ServeSettings, soak: SoakSettings, seed: int, result: Path,
            log: Path) -> subprocess.Popen:
    """vLLM's client for the whole soak, at the steady rate; its results go to ``result``."""
    per = max(1, math.ceil(soak.rate * soak.duration_s / soak.prefixes))
    argv = [*sr.VLLM, "bench", "serve", "--base-url", base_url, "--model", settings.model,
            "--dataset-name", "prefix_repetition",
            "--prefix-repetition-prefix-len", str(settings.prefix_len),
            "--prefix-repetition-suffix-len", str(settings.suffix_len),
            "--prefix-repetition-num-prefixes", str(soak.prefixes),
            "--prefix-repetition-output-len", str(settings.output_len),
            "--num-prompts", str(per * soak.prefixes), "--request-rate", f"{soak.rate:g}",
            "--max-concurrency", str(soak.max_concurrency), "--ignore-eos", "--seed", str(seed), "--disable-tqdm",
            "--percentile-metrics", "ttft,e2el", "--metric-percentiles", "50,99",
            "--save-result", "--result-dir", str(result.parent), "--result-filename", result.name]
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false")
    with open(log, "ab") as f:
        # its own session (stopped by process group), but never left running if this process dies
        main = threading.current_thread() is threading.main_thread()
        return subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=f, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True, preexec_fn=die_with_parent if main else None)


def _stop(proc: subprocess.Popen, grace: float = 10.0) -> None:
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGINT)
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _probes(settings: sr.ServeSettings) -> list[list[int]]:
    return prompt_family(PROBE_PREFIX, 2, settings.suffix_len, seed=7331)


def plain_reference(base_url: str, settings: sr.ServeSettings, probes: list[list[int]]) -> list[dict[str, Any]]:
    """Three plain runs of the probes on a server without offloading, each answering them twice
    (computed, then cached), told apart by a ``cache_salt`` (so each computes them again):
    :mod:`.serve_identity`'s runs of configuration ``none``. The third runs beside other
    requests (:func:`_beside_load`), as the soak's probes do: a batch of other requests rounds
    differently, and that noise belongs in the tolerance."""
    runs = []
    for r in range(3):
        with _beside_load(base_url, settings) if r == 2 else contextlib.nullcontext():
            got, tops = sr.greedy_answers(base_url, settings.model, probes + probes, settings.output_len,
                                          top_k=serve_identity.TOP_K, extra={"cache_salt": f"kvtiers-plain-{r}"})
        runs.append({"config": serve_identity.PLAIN, "repeat": r, "greedy": got, "greedy_logprobs": tops})
    return runs


@contextlib.contextmanager
def _beside_load(base_url: str, settings: sr.ServeSettings, streams: int = 3) -> Any:
    """``streams`` threads sending other prompts (of the soak's prefix length) to the server one
    after another, from before the body runs until it ends, so the body's requests are batched
    with theirs."""
    stop = threading.Event()
    started = threading.Barrier(streams + 1)
    fillers = prompt_family(settings.prefix_len, streams, settings.suffix_len, seed=4242)

    def send(prompt: list[int]) -> None:
        started.wait()
        while not stop.is_set():
            sr.greedy_outputs(base_url, settings.model, [prompt], settings.output_len)

    with ThreadPoolExecutor(streams, thread_name_prefix="kvtiers-soak-load") as pool:
        sent = [pool.submit(send, p) for p in fillers]
        started.wait()
        time.sleep(0.2)  # their first requests reach the server before the body's
        try:
            yield
        finally:
            stop.set()
        for f in sent:
            f.result()  # a failed request fails the reference


def tolerance(plain_runs: list[dict[str, Any]]) -> float:
    """The largest top-k difference among the plain server's answers to a probe: between its
    runs (one beside other requests), and between its computed and cached answers, each up to
    where the two answers part (:func:`.serve_identity.parting`). Under load a probe's prefix
    may come part from a cache and part computed (a device cache drops a prefix's last blocks
    first), a path between the two the plain server took, and its batch holds other requests:
    its rounding is of that order. Wrong KV moves the logprobs far more (a prefix of another
    prompt: nats)."""
    return max([serve_identity.plain_noise(plain_runs) or 0.0, *map(serve_identity.path_noise, plain_runs)])


def check_answers(ref: dict[str, Any], tol: float, got: list[Any], tops: list[Any]) -> tuple[bool, float | None]:
    """Whether each probe's answer has the tokens of one of the reference's answers to it, or
    parts from one at a near tie (within the tolerance: :func:`.serve_identity.answer_diff`), and
    top-k logprobs within ``tol`` of that one's; and the largest such difference (None: an
    answer's tokens differ beyond a tie)."""
    diffs = [serve_identity.answer_diff(ref, g, t, i, tie=tol) for i, (g, t) in enumerate(zip(got, tops, strict=True))]
    ok = all(same for same, _ in diffs)
    worst = max(d for _, d in diffs) if ok else None
    return ok and worst is not None and worst <= tol, worst


def _wait_for_requests(servers: list[Any], clients: list[Any], timeout: float) -> float:
    """Wait until every server has requests from its client (a client takes tens of seconds to
    start and make its prompts), so the soak's clock starts with the load; the seconds waited."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        flowing = 0
        for srv in servers:
            m = sm.scrape(srv.base_url)
            flowing += any(v > 0 for k, v in m.items() if k.startswith(("vllm:num_requests_running",
                                                                         "vllm:num_requests_waiting")))
        if flowing == len(servers) or any(p.poll() is not None for p, _ in clients):
            break
        time.sleep(0.5)
    return round(time.monotonic() - t0, 1)


def _server_row(before: dict[str, float], after: dict[str, float], dt: float, tree: dict[str, Any],
                probes: int = 0) -> dict[str, Any]:
    """One server's sample; ``probes``: the greedy requests counted in this interval (left out)."""
    d = sm.delta(before, after)
    s = sm.summarize(d)
    done = max(0.0, sum(v for k, v in d.items() if k.startswith(SUCCESS)) - probes)
    hits = {t: (v.get("hits", 0.0) / v["queries"]) if v.get("queries") else None for t, v in s["tiers"].items()}
    prompt = s["prompt_tokens"]
    total = sum(prompt.values())
    return {
        "req_s": done / dt if dt > 0 else 0.0,
        "ttft_p50_s": histogram_quantile(before, after, TTFT, 0.5),
        "ttft_p99_s": histogram_quantile(before, after, TTFT, 0.99),
        "hit_rate": hits,
        "external_token_share": (prompt.get("external_kv_transfer", 0.0) / total) if total else None,
        "api": tree["api"], "engine_core": tree["engine_core"], "workers": tree["workers"],
    }


def own_shm(servers: list[Any]) -> dict[str, int]:
    """:func:`shm_usage`, with ``regions`` counting this soak's servers' offload regions only (by
    the engine ids in their logs: another engine starting on the machine has its region for a
    moment too) and ``regions_all`` every one."""
    shm = shm_usage()
    own = set().union(*(sr.shm_regions(str(s.log)) for s in servers))
    return {**shm, "regions_all": shm["regions"], "regions": len(own)}


def _ns_usage(root: Path) -> dict[str, Any]:
    total = {"chunk_bytes": 0, "temp_bytes": 0, "disk_bytes": 0, "files": 0}
    if root.is_dir():
        u = fs_usage(str(root))
        total = {k: u[k] for k in total}
    return total


def run_serve_soak(settings: sr.ServeSettings, soak: SoakSettings, *, workdir: str | None = None,
                   say: Any = None) -> dict[str, Any]:
    """Run the soak; the report (``intervals``: one row per interval; ``summary``; ``verdict``)."""
    from ...integrations.vllm.shm_region import sweep_stale_regions

    say = say or (lambda _msg: None)
    own = workdir is None
    wd = Path(tempfile.mkdtemp(prefix="kvtiers-serve-soak-") if own else workdir)
    wd.mkdir(parents=True, exist_ok=True)
    root = wd / "fs"
    entry = {"type": "kvtiers_fs", "root_dir": str(root), "max_bytes": int(soak.fs_max_bytes)}
    ktc = offload_config([entry], settings.tier_cpu_bytes)
    report: dict[str, Any] = {"kind": "serve-soak", "model": settings.model, "soak": asdict(soak),
                              "settings": {"prefix_len": settings.prefix_len, "suffix_len": settings.suffix_len,
                                           "output_len": settings.output_len, "gpu_blocks": settings.gpu_blocks,
                                           "cpu_bytes": settings.tier_cpu_bytes},
                              "kv_transfer_config": ktc, "intervals": [], "errors": []}
    probes = _probes(settings)
    with terminated_is_interrupt(), contextlib.ExitStack() as stack:
        servers = []
        for i in range(soak.servers):
            srv = sr.VllmServer(settings, ktc, str(wd / f"server{i}.log"))
            servers.append(srv)
        plain = sr.VllmServer(settings, None, str(wd / "plain.log"))  # no offloading: the reference
        t_start = time.monotonic()
        for srv in [*servers, plain]:  # started at once: a start is mostly importing vLLM
            sr.launch(srv)
            stack.callback(srv.stop)
        for srv in [*servers, plain]:
            srv.wait_ready(timeout=settings.start_timeout)
            sr.warm_up(srv.base_url, settings.model)
        report["start_s"] = time.monotonic() - t_start
        say(f"{len(servers)} server(s) and the plain one up in {report['start_s']:.0f} s")
        plain_runs = plain_reference(plain.base_url, settings, probes)
        plain.stop()
        ref = plain_runs[0]
        tol = tolerance(plain_runs)
        report["reference"] = ref["greedy"][:len(probes)]
        report["reference_answers"] = {"tokens": ref["greedy"], "top_logprobs": ref["greedy_logprobs"]}
        report["logprobs"] = {"top_k": serve_identity.TOP_K, "tolerance": tol, "max_diff": 0.0}
        clients = []
        for i, srv in enumerate(servers):
            res = wd / f"client{i}.json"
            res.unlink(missing_ok=True)
            clients.append((_client(srv.base_url, settings, soak, 2024, res, wd / f"client{i}.log"), res))
            stack.callback(_stop, clients[-1][0])
        report["client_start_s"] = _wait_for_requests(servers, clients, settings.start_timeout)
        t0 = time.monotonic()
        prev = [sm.scrape(s.base_url) for s in servers]
        prev_t = t0
        mismatches = 0
        ended_early = None
        try:
            while True:
                # until a sample is taken at the soak's end: one that overran it (probes queued
                # behind a loaded server's requests) is followed by one more at once, so the
                # soak's last stretch is sampled too
                if prev_t - t0 >= soak.duration_s:
                    break
                left = t0 + soak.duration_s - time.monotonic()
                time.sleep(max(0.0, min(soak.interval_s, left)))
                t = time.monotonic()
                row: dict[str, Any] = {"t": round(t - t0, 1), "servers": []}
                for i, srv in enumerate(servers):
                    if not srv.alive():
                        report["errors"].append(f"server {i} died: {sr.engine_error(srv.log) or 'see its log'}")
                        row["servers"].append(None)
                        continue
                    try:
                        cur = sm.scrape(srv.base_url)
                        r = _server_row(prev[i], cur, t - prev_t, process_tree(srv.pid),
                                        len(probes) if report["intervals"] else 0)
                        got, tops = sr.greedy_answers(srv.base_url, settings.model, probes, settings.output_len,
                                                      top_k=serve_identity.TOP_K)
                        r["greedy_ok"], r["logprob_diff"] = check_answers(ref, tol, got, tops)
                        if not r["greedy_ok"]:  # what differed, for the report
                            r["answers"] = {"tokens": got, "top_logprobs": tops}
                        if r["logprob_diff"] is not None:
                            report["logprobs"]["max_diff"] = max(report["logprobs"]["max_diff"], r["logprob_diff"])
                        mismatches += not r["greedy_ok"]
                        prev[i] = cur
                    except OSError as e:
                        report["errors"].append(f"server {i} at {t - t0:.0f} s: {type(e).__name__}: {e}")
                        row["servers"].append(None)
                        continue
                    row["servers"].append(r)
                row["fs"] = _ns_usage(root)
                row["shm"] = own_shm(servers)
                row["clients_running"] = sum(p.poll() is None for p, _ in clients)
                prev_t = t
                report["intervals"].append(row)
                say(_line(row, soak))
                if report["errors"] and not any(s.alive() for s in servers):
                    break
        except KeyboardInterrupt:  # Ctrl-C or SIGTERM: stop now, keep what was sampled, say so
            ended_early = round(time.monotonic() - t0, 1)
            report["errors"].append(f"ended early by a signal {ended_early:.0f} s into the soak")
        for i, (p, _) in enumerate(clients):  # sized for the duration: they end about now if the server keeps up
            if ended_early is not None:
                _stop(p)
                continue
            try:
                p.wait(max(60.0, soak.interval_s))
            except subprocess.TimeoutExpired:
                report["errors"].append(f"client {i} still had requests to send or answers to wait for "
                                        f"{max(60.0, soak.interval_s):.0f} s after the soak: the server fell behind "
                                        f"{soak.rate:g} req/s")
                _stop(p)
        report["clients"] = []
        for p, res in clients:
            data = json.loads(res.read_text()) if res.exists() else {}
            report["clients"].append({k: data.get(k) for k in ("completed", "failed", "request_throughput",
                                                              "median_ttft_ms", "p99_ttft_ms", "duration")}
                                     | {"exit": p.returncode})
        logs = [s.log for s in [*servers, plain]]
    left = set().union(*(sr.wait_gone(sr.shm_regions(str(lg))) for lg in logs))
    report["shm_left"] = sorted(left)
    for p in left:
        sweep_stale_regions(pattern=p)
    report["greedy_mismatches"] = mismatches
    report["summary"] = summarize(report)
    return report


def _line(row: dict[str, Any], soak: SoakSettings) -> str:
    parts = [f"t={row['t']:.0f}s"]
    for i, s in enumerate(row["servers"]):
        if s is None:
            parts.append(f"s{i}: down")
            continue
        hit = next(iter(v for v in s["hit_rate"].values() if v is not None), None)
        parts.append(f"s{i}: {s['req_s']:.2f} req/s, TTFT p50 {_ms(s['ttft_p50_s'])} p99 {_ms(s['ttft_p99_s'])}, "
                     f"hit {'-' if hit is None else f'{hit:.2f}'}, RSS api {_mib(s['api'])} "
                     f"core {_mib(s['engine_core'])}, greedy {'ok' if s['greedy_ok'] else 'DIFFERS'}")
    parts.append(f"fs {row['fs']['chunk_bytes'] / (1 << 20):.0f}/{soak.fs_max_bytes / (1 << 20):.0f} MiB")
    return "; ".join(parts)


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:.0f} ms"


def _mib(p: dict[str, Any] | None) -> str:
    return "-" if not p else f"{p['rss'] / (1 << 20):.0f} MiB"


def full_intervals(report: dict[str, Any]) -> list[dict[str, Any]]:
    """The sampled intervals, less a last one the soak's end cut to under half an interval
    (a few seconds of tail: its rates say nothing)."""
    rows = list(report["intervals"])
    if len(rows) > 2 and rows[-1]["t"] - rows[-2]["t"] < report["soak"]["interval_s"] / 2:
        rows.pop()
    return rows


def summarize(report: dict[str, Any]) -> dict[str, Any]:
    """First and last full interval (the server's first interval includes the cache filling,
    and a last one the soak's end cut to under half an interval is left out), growth of RSS,
    fds and threads per process, totals, and the verdict."""
    rows = [r for r in full_intervals(report) if all(s is not None for s in r["servers"])]
    out: dict[str, Any] = {"intervals": len(report["intervals"])}
    if len(rows) >= 2:
        first, last = rows[1] if len(rows) > 2 else rows[0], rows[-1]
        per = []
        for i, (a, b) in enumerate(zip(first["servers"], last["servers"], strict=True)):
            grow = {}
            for proc in ("api", "engine_core"):
                if a.get(proc) and b.get(proc):
                    grow[proc] = {k: [a[proc][k], b[proc][k]] for k in ("rss", "fds", "threads")}
            per.append({"server": i, "req_s": [a["req_s"], b["req_s"]],
                        "req_s_ratio": (b["req_s"] / a["req_s"]) if a["req_s"] else None,
                        "ttft_p50_s": [a["ttft_p50_s"], b["ttft_p50_s"]], "processes": grow})
        out["servers"] = per
    if report["intervals"]:
        out["fs_max_chunk_bytes"] = max(r["fs"]["chunk_bytes"] for r in report["intervals"])
    failed = sum((c.get("failed") or 0) for c in report.get("clients", []))
    completed = sum((c.get("completed") or 0) for c in report.get("clients", []))
    out["logprobs"] = report.get("logprobs")
    out.update(failed=failed, completed=completed, greedy_mismatches=report.get("greedy_mismatches", 0),
               errors=len(report["errors"]), shm_left=len(report.get("shm_left", [])))
    out["ok"] = (not failed and completed > 0 and not out["greedy_mismatches"] and not report["errors"]
                 and not report.get("shm_left"))
    return out


def render(report: dict[str, Any]) -> str:
    """The soak as a table, one line per interval, and its summary."""
    soak = SoakSettings(**report["soak"])
    lines = [f"serve soak: {soak.servers} server(s), {soak.duration_s:g} s, {soak.rate:g} req/s each, "
             f"{soak.prefixes} prefixes of {report['settings']['prefix_len']} tokens, arena "
             f"{report['settings']['cpu_bytes'] >> 20} MiB, fs bound {soak.fs_max_bytes >> 20} MiB"]
    lines += [_line(r, soak) for r in report["intervals"]]
    s = report["summary"]
    lp = s.get("logprobs")
    if lp:
        lines.append(f"greedy answers against a server without offloading: tokens, and top-{lp['top_k']} logprobs "
                     f"within {lp['tolerance']:.3g} nats (its two runs' difference); largest seen {lp['max_diff']:.3g}")
    lines.append(f"completed {s['completed']}, failed {s['failed']}, greedy mismatches {s['greedy_mismatches']}, "
                 f"errors {s['errors']}, /dev/shm regions left {s['shm_left']}: {'OK' if s['ok'] else 'NOT OK'}")
    for e in report["errors"]:
        lines.append(f"  error: {e}")
    for p in s.get("servers", []):
        ratio = p["req_s_ratio"]
        growth = ", ".join(f"{proc} RSS {v['rss'][0] >> 20}->{v['rss'][1] >> 20} MiB fds {v['fds'][0]}->"
                           f"{v['fds'][1]} threads {v['threads'][0]}->{v['threads'][1]}"
                           for proc, v in p["processes"].items())
        lines.append(f"  server {p['server']}: req/s last/first {'-' if ratio is None else f'{ratio:.2f}'}; {growth}")
    return "\n".join(lines)
