"""``kvtiers demo --engine transformers``: the A/B run on the tiny Llama-shaped model over a real
fs tier, shortened to one prompt length and one round; the tokens after the tier hit are those of
a full prefill, and the CLI prints the table."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")

from click.testing import CliRunner  # noqa: E402

from kvtiers.commands.demo import transformers as tdemo  # noqa: E402


def test_the_ab_run_loads_the_prefix_and_gives_the_same_tokens(tmp_path) -> None:
    rows = tdemo.run(str(tmp_path), rounds=1, lengths=(192,), quiet=True)
    (row,) = rows
    assert row.prompt_tokens == 192 + tdemo.QUESTION_TOKENS and row.loaded_tokens == 192
    assert row.identical and row.full_prefill_s > 0 and row.tier_hit_s >= row.load_s > 0
    assert "identical" in tdemo.render(rows, 1)


def test_the_command_prints_the_table(tmp_path, monkeypatch) -> None:
    from kvtiers.commands.demo.command import demo

    monkeypatch.setattr(tdemo, "PROMPT_LENGTHS", (128,))
    monkeypatch.setattr(tdemo, "ROUNDS", 1)
    r = CliRunner().invoke(demo, ["--engine", "transformers", "--dir", str(tmp_path), "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["rounds"] == 1 and out["results"][0]["loaded_tokens"] == 128 and out["results"][0]["identical"]
