"""``kvtiers bench weights`` (kvtiers.commands.bench.weights) without engines: a bad argument is one
line before anything starts, and the report's table (medians, ratios to the checkpoint's). The
engines themselves are those of tests/test_vllm_loader.py; the bench's figures are in docs/vllm-weights.md."""

from __future__ import annotations

from click.testing import CliRunner

from kvtiers.commands.bench.weights import render, summarize
from kvtiers.commands.cli import cli


def test_a_bad_source_is_one_line_before_any_engine():
    r = CliRunner().invoke(cli, ["bench", "weights", "--sources", "fs,disk"])
    assert r.exit_code == 2
    assert r.output.strip().splitlines()[-1] == (
        "Error: Invalid value for '--sources': 'disk' is not a source; give some of checkpoint, fs, obj, p2p")


def test_the_table_gives_medians_and_ratios_to_the_checkpoint():
    """Raw rounds as the engines report them, through the bench's own medians and ratios: the
    median is the middle round (not the mean, not the first), a round whose load line was not
    found is left out of the load median, and a source whose loads all went unfound has none."""
    def run(ttft, ready, load):
        return {"ttft": ttft, "ready": ready, "load": load}

    runs = {"checkpoint": [run(44.0, 43.0, 2.5), run(40.0, 39.0, 2.0), run(30.0, 29.5, 1.0)],
            "fs": [run(20.0, 19.0, 1.0), run(36.0, 35.0, None), run(10.0, 9.0, 3.0)],
            "p2p": [run(30.0, 29.0, None)]}
    rows = summarize(runs)
    assert [r["source"] for r in rows] == ["checkpoint", "fs", "p2p"]
    ckpt, fs, p2p = rows
    assert (ckpt["ttft_s"], ckpt["ready_s"], ckpt["load_s"]) == (40.0, 39.0, 2.0)
    assert (fs["ttft_s"], fs["ready_s"], fs["load_s"]) == (20.0, 19.0, 2.0)  # loads 1.0 and 3.0: their median
    assert (p2p["load_s"], p2p["load_ratio"]) == (None, None)
    assert (ckpt["ttft_ratio"], ckpt["load_ratio"]) == (1.0, 1.0)
    assert (fs["ttft_ratio"], fs["load_ratio"]) == (0.5, 1.0) and p2p["ttft_ratio"] == 0.75
    assert summarize({"fs": runs["fs"]})[0]["ttft_ratio"] is None  # no checkpoint row: no ratios
    lines = render({"model": "/m", "model_bytes": 4e8, "rounds": 3, "rows": rows}).splitlines()
    assert lines[0].startswith("model /m (0.40 GB), 3 round(s)")
    assert lines[2].split() == ["checkpoint", "40.0", "39.0", "2.00", "1.00", "1.00"]
    assert lines[3].split() == ["fs", "20.0", "19.0", "2.00", "0.50", "1.00"]
    assert lines[4].split() == ["p2p", "30.0", "29.0", "-", "0.75", "-"]
