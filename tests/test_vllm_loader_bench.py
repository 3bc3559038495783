"""``kvtiers bench weights`` (kvtiers.commands.bench.weights) without engines: a bad argument is one
line before anything starts, and the report's table (medians, ratios to the checkpoint's). The
engines themselves are those of tests/test_vllm_loader.py; the bench's figures are in docs/vllm.md."""

from __future__ import annotations

from click.testing import CliRunner

from kvtiers.commands.bench.weights import render
from kvtiers.commands.cli import cli


def test_a_bad_source_is_one_line_before_any_engine():
    r = CliRunner().invoke(cli, ["bench", "weights", "--sources", "fs,disk"])
    assert r.exit_code == 2
    assert r.output.strip().splitlines()[-1] == (
        "Error: Invalid value for '--sources': 'disk' is not a source; give some of checkpoint, fs, obj, p2p")


def test_the_table_gives_medians_and_ratios_to_the_checkpoint():
    rows = [{"source": "checkpoint", "ttft_s": 40.0, "ready_s": 39.0, "load_s": 2.0, "ttft_ratio": 1.0,
             "load_ratio": 1.0},
            {"source": "p2p", "ttft_s": 30.0, "ready_s": 29.0, "load_s": None, "ttft_ratio": 0.75,
             "load_ratio": None}]
    text = render({"model": "/m", "model_bytes": 4e8, "rounds": 3, "rows": rows})
    lines = text.splitlines()
    assert lines[0].startswith("model /m (0.40 GB), 3 round(s)")
    assert lines[2].split() == ["checkpoint", "40.0", "39.0", "2.00", "1.00", "1.00"]
    assert lines[3].split() == ["p2p", "30.0", "29.0", "-", "0.75", "-"]
