"""The ``kvtiers`` load format's ``--model-loader-extra-config``: what it accepts, and one line
naming the key for anything else (kvtiers.integrations.vllm.loader_config; no engine)."""

from __future__ import annotations

import pytest

from kvtiers.integrations.vllm.loader_config import KEYS, parse_loader_config

TIERS = [{"type": "fs", "root_dir": "/tmp/w"}]


def test_the_four_keys_and_the_defaults():
    c = parse_loader_config({"mode": "fork", "name": "m", "revision": "v1", "tiers": TIERS})
    assert (c.mode, c.name, c.revision, c.revision_given) == ("fork", "m", "v1", True)
    assert c.tiers == ({"type": "fs", "root_dir": "/tmp/w"},)
    assert c.chunk_bytes == 4 << 20 and c.host_bytes == 64 << 20 and c.timeout == 600.0
    assert c.weights_config() == {"host_bytes": 64 << 20, "tiers": [{"type": "fs", "root_dir": "/tmp/w"}]}
    c = parse_loader_config({"mode": "publish", "name": "m", "tiers": TIERS, "chunk_bytes": 1 << 20,
                             "host_bytes": 4096, "timeout": 5})
    assert c.revision is None and not c.revision_given  # then vLLM's --revision names it
    assert c.weights_config()["host_bytes"] == 2 << 20  # at least two chunks


def test_a_kv_transfer_config_tier_entry_is_accepted():
    c = parse_loader_config({"mode": "fork", "name": "m", "tiers": [{"type": "kvtiers_obj", "bucket": "b"}]})
    assert c.tiers == ({"type": "obj", "bucket": "b"},)


@pytest.mark.parametrize("extra, key", [
    ({"mode": "sleep", "name": "m", "tiers": TIERS}, "'mode' expects 'publish' or 'fork', got str 'sleep'"),
    ({"name": "m", "tiers": TIERS}, "'mode' is missing"),
    ({"mode": "fork", "tiers": TIERS}, "'name' is missing"),
    ({"mode": "fork", "name": "", "tiers": TIERS}, "'name' expects a non-empty string"),
    ({"mode": "fork", "name": "m"}, "'tiers' is missing"),
    ({"mode": "fork", "name": "m", "tiers": []}, "'tiers' expects a non-empty list"),
    ({"mode": "fork", "name": "m", "tiers": [{"root_dir": "/x"}]}, "'tiers': tiers[0] needs a 'type'"),
    ({"mode": "fork", "name": "m", "tiers": ["fs"]}, "'tiers'[0] expects a tier object"),
    ({"mode": "fork", "name": "m", "revision": 3, "tiers": TIERS}, "'revision' expects a non-empty string or null"),
    ({"mode": "fork", "name": "m", "tiers": TIERS, "chunk_bytes": 1000}, "'chunk_bytes' expects a positive multiple"),
    ({"mode": "fork", "name": "m", "tiers": TIERS, "host_bytes": True}, "'host_bytes' expects a positive int"),
    ({"mode": "fork", "name": "m", "tiers": TIERS, "timeout": 0}, "'timeout' expects a positive number"),
    ({"mode": "fork", "name": "m", "tiers": TIERS, "tier": "fs"}, "unknown key 'tier' (known: mode, name, revision"),
    (["mode", "fork"], "expects a JSON object, got list"),
])
def test_bad_config_is_one_line_naming_the_key(extra, key):
    with pytest.raises(ValueError) as e:
        parse_loader_config(extra)
    msg = str(e.value)
    assert msg.startswith("kvtiers load format: --model-loader-extra-config") and key in msg, msg
    assert "\n" not in msg


def test_every_key_is_documented():
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[1] / "docs" / "vllm-weights.md").read_text()
    for key in KEYS:
        assert f"`{key}`" in doc, key
