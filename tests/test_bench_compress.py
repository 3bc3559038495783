"""``kvtiers bench compress`` (docs/compression.md): the fs tier with and without compression
on bf16 KV-like bytes in one command; a short run, as `make test` can afford."""

from __future__ import annotations

import json

import pytest

from kvtiers.commands.cli import main

pytest.importorskip("zstandard")
pytest.importorskip("lz4")


def test_bench_compress_reports_ratio_and_gbps_against_plain(tmp_path, capsys):
    rc = main(["bench", "compress", "fs", "--config", json.dumps({"root_dir": str(tmp_path)}),
               "--chunk-bytes", "256KiB", "--chunks", "8", "--rounds", "1", "--json",
               "--codec", '{"codec": "zstd"}', "--codec", '{"codec": "fp8", "lossy": true}'])
    out = capsys.readouterr().out
    assert rc == 0, out
    rows = {r["run"]: r for r in json.loads(out)["results"]}
    assert set(rows) == {"plain", "zstd", "fp8"}
    assert rows["plain"]["ratio"] == 1.0 and rows["plain"]["store_vs_plain"] == 1.0
    assert rows["zstd"]["exact"] and rows["zstd"]["ratio"] >= 1.25
    assert rows["fp8"]["ratio"] > 1.85 and rows["fp8"]["max_err_over_bound"] <= 1.0
    for r in rows.values():
        assert r["store_gbps"] > 0 and r["load_gbps"] > 0


def test_bench_compress_bad_codec_is_one_line(tmp_path, capsys):
    rc = main(["bench", "compress", "fs", "--config", json.dumps({"root_dir": str(tmp_path)}),
               "--chunks", "2", "--rounds", "1", "--codec", '{"codec": "gzip"}'])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "\n" not in err and "unknown codec 'gzip'" in err, err


def test_bench_compress_from_an_fs_root(tmp_path, capsys):
    """``--from-fs ROOT``: the chunks an fs tier keeps (as a vLLM engine's offload leaves
    them), at their own size; made here by a plain fs tier from bf16 KV-like bytes."""
    import time

    from kvtiers import Arena, Job, Namespace, TierContext
    from kvtiers.commands.bench.compress import kv_bf16
    from kvtiers.registry import open_tier

    ctx = TierContext(Arena.allocate(4, 65536), Namespace({"chunk_bytes": 65536, "dtype": "bfloat16"}))
    src = kv_bf16(4 * 65536, 3)
    for i in range(4):
        ctx.arena[i][:] = src[i * 65536:(i + 1) * 65536].tobytes()
    h = open_tier("fs", {"root_dir": str(tmp_path / "kv")}, ctx)
    h.submit_store(Job(1, tuple(b"c%d" % i for i in range(4)), (0, 1, 2, 3)))
    while not (done := h.get_finished_jobs()):
        time.sleep(0.001)
    assert done[0].ok
    h.close()
    rc = main(["bench", "compress", "memory", "--from-fs", str(tmp_path / "kv"), "--rounds", "1", "--json",
               "--codec", '{"codec": "zstd"}'])
    out = capsys.readouterr().out
    assert rc == 0, out
    report = json.loads(out)
    assert report["chunks"] == 4 and report["chunk_bytes"] == 65536
    rows = {r["run"]: r for r in report["results"]}
    assert rows["zstd"]["exact"] and rows["zstd"]["ratio"] >= 1.25
