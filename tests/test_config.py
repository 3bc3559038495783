"""The JSON configuration: ours, vLLM's kv_connector_extra_config, and the whole
--kv-transfer-config object; aliases, ignored keys, errors."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from kvtiers import ConfigError
from kvtiers.config import Config, TierConfig, load_config, parse_config, parse_json_option

OURS = {
    "host_bytes": 1 << 30,
    "blocks_per_chunk": 16,
    "eviction_policy": "arc",
    "tiers": [{"type": "fs", "root_dir": "/mnt/kv"}, {"type": "obj", "bucket": "kv", "endpoint_url": "http://s3"}],
}


def test_our_config() -> None:
    cfg = parse_config(OURS)
    assert cfg.host_bytes == 1 << 30
    assert cfg.blocks_per_chunk == 16
    assert cfg.eviction_policy == "arc"
    assert cfg.tiers == (
        TierConfig("fs", {"root_dir": "/mnt/kv"}),
        TierConfig("obj", {"bucket": "kv", "endpoint_url": "http://s3"}),
    )
    assert cfg.tier_entries == OURS["tiers"]
    assert cfg.ignored == ()


def test_defaults() -> None:
    cfg = parse_config({"host_bytes": 4096})
    assert cfg == Config(host_bytes=4096)
    assert (cfg.blocks_per_chunk, cfg.eviction_policy, cfg.tiers, cfg.store_threshold) == (1, "lru", (), 1)


def test_config_does_not_modify_its_input() -> None:
    raw = json.loads(json.dumps(OURS))
    parse_config(raw)
    assert raw == OURS


VLLM_EXTRA = {
    "cpu_bytes_to_use": 8 << 30,
    "block_size": 256,
    "eviction_policy": "lru",
    "spec_name": "TieringOffloadingSpec",
    "enable_kv_events": True,
    "secondary_tiers": [
        {"type": "fs", "root_dir": "/mnt/kv", "enable_kv_events": True},
        {"type": "obj", "bucket": "b", "endpoint_override": "http://127.0.0.1:8333"},
        {"module_path": "acme.kv", "class_name": "AcmeTier", "zone": "a"},
    ],
}


def test_vllm_extra_config_is_translated(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="kvtiers"):
        cfg = parse_config(VLLM_EXTRA)
    assert cfg.host_bytes == 8 << 30
    assert cfg.block_size == 256
    assert cfg.tiers == (
        TierConfig("fs", {"root_dir": "/mnt/kv"}),
        TierConfig("obj", {"bucket": "b", "endpoint_url": "http://127.0.0.1:8333"}),
        TierConfig("acme.kv:AcmeTier", {"zone": "a"}),
    )
    assert cfg.ignored == ("enable_kv_events", "spec_name")
    top = [r.getMessage() for r in caplog.records if "ignored:" in r.getMessage()]
    assert top == ["kvtiers config: vLLM keys with no meaning here, ignored: enable_kv_events, spec_name"]


def test_whole_kv_transfer_config_is_accepted() -> None:
    whole = {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": VLLM_EXTRA,
    }
    assert parse_config(whole) == parse_config(VLLM_EXTRA)


def test_unknown_key_beside_the_extra_config() -> None:
    with pytest.raises(ConfigError, match="unknown key 'kv_conector' beside 'kv_connector_extra_config'"):
        parse_config({"kv_conector": "x", "kv_connector_extra_config": VLLM_EXTRA})
    with pytest.raises(ConfigError, match="'kv_connector_extra_config' expects an object"):
        parse_config({"kv_connector_extra_config": "{}"})


def test_module_path_with_type_as_the_class_name() -> None:
    cfg = parse_config({"host_bytes": 4096, "tiers": [{"module_path": "acme.kv", "type": "AcmeTier"}]})
    assert cfg.tiers == (TierConfig("acme.kv:AcmeTier"),)
    with pytest.raises(ConfigError, match=r"tiers\[0\]: 'module_path' needs a 'class_name'"):
        parse_config({"host_bytes": 4096, "tiers": [{"module_path": "acme.kv"}]})


@pytest.mark.parametrize(
    "obj,match",
    [
        ({"host_bytes": 1, "host_byte": 2}, r"unknown key 'host_byte' \(known: "),
        ({"host_bytes": "1G"}, r"'host_bytes' expects a positive int \(bytes\), got str '1G'"),
        ({"host_bytes": True}, r"'host_bytes' expects a positive int \(bytes\), got bool True"),
        ({"host_bytes": 0}, r"'host_bytes' expects a positive int"),
        ({"cpu_bytes_to_use": -1}, r"'cpu_bytes_to_use' expects a positive int"),  # names the key the user wrote
        ({"host_bytes": 1, "blocks_per_chunk": 0}, r"'blocks_per_chunk' expects a positive int, got int 0"),
        ({"host_bytes": 1, "blocks_per_chunk": 2.0}, r"'blocks_per_chunk' expects a positive int, got float"),
        ({"host_bytes": 1, "eviction_policy": ""}, r"'eviction_policy' expects a policy name"),
        ({"host_bytes": 1, "offload_prompt_only": "yes"}, r"'offload_prompt_only' expects true or false"),
        ({"host_bytes": 1, "tiers": {"type": "fs"}}, r"'tiers' expects a list of tier objects, got dict"),
        ({"host_bytes": 1, "secondary_tiers": "fs"}, r"'secondary_tiers' expects a list of tier objects"),
        ({"host_bytes": 1, "tiers": ["fs"]}, r"tiers\[0\] expects an object with a 'type', got str"),
        ({"host_bytes": 1, "tiers": [{"root_dir": "/x"}]}, r"tiers\[0\] needs a 'type'"),
        ({"host_bytes": 1, "tiers": [{"type": ""}]}, r"tiers\[0\] needs a 'type'"),
        ({"blocks_per_chunk": 2}, r"give 'host_bytes' \(alias 'cpu_bytes_to_use'\) or 'host_blocks_factor'"),
        ({"host_bytes": 1, "host_blocks_factor": 2.0}, r"either 'host_bytes' or 'host_blocks_factor', not both"),
        ({"host_bytes": 1, "block_size": 16, "blocks_per_chunk": 2}, r"'block_size' and 'blocks_per_chunk' are excl"),
        ([1, 2], r"expected a JSON object, got list"),
    ],
)
def test_config_errors_name_the_key(obj, match: str) -> None:
    with pytest.raises(ConfigError, match=match) as e:
        parse_config(obj)
    assert str(e.value).startswith("config: ")
    assert "\n" not in str(e.value)


def test_both_alias_and_name_is_a_conflict() -> None:
    with pytest.raises(ConfigError, match="both 'cpu_bytes_to_use' and 'host_bytes' given; use one"):
        parse_config({"host_bytes": 1, "cpu_bytes_to_use": 2})
    with pytest.raises(ConfigError, match="both 'secondary_tiers' and 'tiers' given; use one"):
        parse_config({"host_bytes": 1, "tiers": [], "secondary_tiers": []})
    with pytest.raises(ConfigError, match=r"tiers\[0\]: both 'endpoint_override' and its alias target 'endpoint_url'"):
        parse_config({"host_bytes": 1, "tiers": [{"type": "obj", "endpoint_override": "a", "endpoint_url": "b"}]})


def test_alias_conflict_names_both_keys_in_either_order() -> None:
    with pytest.raises(ConfigError, match="both 'cpu_bytes_to_use' and 'host_bytes' given; use one"):
        parse_config({"cpu_bytes_to_use": 2, "host_bytes": 1})
    with pytest.raises(ConfigError, match="both 'secondary_tiers' and 'tiers' given; use one"):
        parse_config({"secondary_tiers": [], "tiers": [], "host_bytes": 1})


def test_host_blocks_factor_instead_of_bytes() -> None:
    cfg = parse_config({"host_blocks_factor": 2.5})
    assert (cfg.host_bytes, cfg.host_blocks_factor) == (None, 2.5)


def test_tier_options_are_passed_through_unchecked_here() -> None:
    # tier options are the tier's business (checked by open_tier against its signature)
    cfg = parse_config({"host_bytes": 1, "tiers": [{"type": "fs", "whatever": [1, {"x": None}]}]})
    assert cfg.tiers[0].options == {"whatever": [1, {"x": None}]}


# -- load_config / parse_json_option ------------------------------------------------------


def test_load_config_from_mapping_text_and_file(tmp_path: Path) -> None:
    f = tmp_path / "kv.json"
    f.write_text(json.dumps(OURS))
    expected = parse_config(OURS)
    assert load_config(OURS) == expected
    assert load_config(json.dumps(OURS)) == expected
    assert load_config(f) == expected
    assert load_config(str(f)) == expected


def test_load_config_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="config: cannot read"):
        load_config(tmp_path / "missing.json")
    with pytest.raises(ConfigError, match="config: not valid JSON"):
        load_config('{"host_bytes": }')
    bad = tmp_path / "bad.json"
    bad.write_text("{\n  'single': 'quotes'\n}")
    with pytest.raises(ConfigError, match="config: not valid JSON"):
        load_config(bad)


def test_parse_json_option(tmp_path: Path) -> None:
    f = tmp_path / "o.json"
    f.write_text('{"root_dir": "/x"}')
    assert parse_json_option('{"a": 1}', None) == {"a": 1}
    assert parse_json_option(None, str(f)) == {"root_dir": "/x"}
    assert parse_json_option(None, None) == {}
    with pytest.raises(ConfigError, match="--config: give --config or --config-file, not both"):
        parse_json_option("{}", str(f))
    with pytest.raises(ConfigError, match="--config: expected a JSON object, got list"):
        parse_json_option("[1]", None)
    with pytest.raises(ConfigError, match="--config: not valid JSON"):
        parse_json_option("{", None)
    with pytest.raises(ConfigError, match="--config: cannot read"):
        parse_json_option(None, str(tmp_path / "nope.json"))
