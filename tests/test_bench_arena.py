"""`kvtiers bench arena --json`: the shape of the report and sane figures (not the ratio)."""

import json
import subprocess
import sys

from click.testing import CliRunner

from kvtiers.commands.bench.arena import arena


def test_bench_arena_json_shape_and_sanity():
    res = CliRunner().invoke(arena, ["--json", "--rounds", "3", "--chunks", "2", "--chunk-mib", "1"])
    assert res.exit_code == 0, res.output
    results = json.loads(res.output)["results"]
    assert {(r["op"], r["tensors"]) for r in results} == {
        ("store", "pooled"), ("load", "pooled"), ("store", "separate"), ("load", "separate")}
    for r in results:
        assert r["chunk_bytes"] == 1 << 20 and r["bytes"] == 2 << 20 and r["rounds"] == 3
        assert r["gbps"] > 0 and r["baseline_gbps"] > 0
        assert abs(r["ratio"] - r["gbps"] / r["baseline_gbps"]) < 0.01
        assert r["baseline"] == "np.copyto"


def test_bench_arena_through_the_kvtiers_command():
    out = subprocess.run(
        [sys.executable, "-c", "import sys; from kvtiers.commands.cli import main; sys.exit(main())",
         "bench", "arena", "--rounds", "3", "--chunks", "1", "--chunk-mib", "1", "--tensors", "pooled"],
        capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert "median of 3 rounds" in lines[0]
    assert [ln.split()[0] for ln in lines[2:]] == ["store", "load"]
    assert all(ln.rstrip().endswith("x") for ln in lines[2:])


def test_bench_arena_cpu_clock():
    """--clock cpu: the report says so, the engine ran on one thread, figures sane; on an
    accelerator device it is refused in one line."""
    from kvtiers.commands.bench.arena import MiB, make_setup, measure

    s = make_setup(MiB, 2, "pooled", cpu_threads=1)
    try:
        assert s.engine._cpu_threads == 1
        results = measure(s, 3, clock="cpu")
    finally:
        s.close()
    assert {r["op"] for r in results} == {"store", "load"}
    assert all(r["clock"] == "cpu" and r["gbps"] > 0 and r["baseline_gbps"] > 0 for r in results)
    res = CliRunner().invoke(arena, ["--clock", "cpu", "--rounds", "3", "--chunks", "1", "--chunk-mib", "1",
                                     "--tensors", "pooled"])
    assert res.exit_code == 0, res.output
    assert "CPU time of one thread" in res.output.splitlines()[0]
    res = CliRunner().invoke(arena, ["--clock", "cpu", "--device", "cuda"])
    assert res.exit_code == 2 and "--clock cpu times CPU copies only" in res.output
