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
