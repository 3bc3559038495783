"""Plugin features that reach the engine through a config block they register
(``register_manager_blocks``), as ``kvtiers_p2p``'s ``serve`` does: the engine never imports
the plugin, and a third-party plugin can offer the same."""

from __future__ import annotations

import pytest
import torch
from test_registry import make_dist

import kvtiers.registry as registry_mod
from kvtiers import ConfigError, TieringManager
from kvtiers.config import parse_config
from kvtiers.registry import Registry, get_registry

BLOCK_PLUGIN = '''
"""A throwaway plugin that adds the config block "greeter" to the engine side."""
import kvtiers
from kvtiers.errors import ConfigError

EVENTS = []


class Greeter:
    def __init__(self, manager, block):
        self.manager, self.block = manager, block

    def poll(self):
        EVENTS.append("poll")

    def close(self):
        EVENTS.append(("close", len(self.manager.arena)))


def attach(manager, block):
    if "hello" not in block:
        raise ConfigError("config: greeter: needs 'hello'")
    EVENTS.append(("attach", block["hello"]))
    return Greeter(manager, block)


@kvtiers.hookimpl
def register_manager_blocks(register):
    register("greeter", attach)
'''


@pytest.fixture
def greeter(tmp_path, monkeypatch):
    make_dist(tmp_path, "kvtiers_greeter", src=BLOCK_PLUGIN, entry_points="[kvtiers]\ngreeter = kvtiers_greeter\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    get_registry(reload=True)
    import kvtiers_greeter

    kvtiers_greeter.EVENTS.clear()
    yield kvtiers_greeter
    monkeypatch.undo()
    get_registry(reload=True)


def kv():
    return {"kv": [[torch.zeros(8, 16, 8) for _ in range(2)]]}


def test_a_registered_block_is_attached_polled_and_closed(greeter) -> None:
    mgr = TieringManager.from_config({"host_bytes": 1 << 20, "greeter": {"hello": "world"}}, kv())
    try:
        assert isinstance(mgr.services["greeter"], greeter.Greeter)
        assert greeter.EVENTS == [("attach", "world")]
        mgr.poll()
        assert "poll" in greeter.EVENTS
        assert mgr.serve is None  # no serve block: the p2p service is not there
    finally:
        mgr.close()
    assert greeter.EVENTS[-1] == ("close", len(mgr.arena))  # closed by the manager, once
    assert sum(1 for e in greeter.EVENTS if e[0] == "close") == 1


def test_a_block_the_plugin_rejects_is_a_config_error_and_nothing_is_left_open(greeter) -> None:
    with pytest.raises(ConfigError, match="greeter: needs 'hello'"):
        TieringManager.from_config({"host_bytes": 1 << 20, "greeter": {}}, kv())
    with pytest.raises(ConfigError, match="'greeter' expects an object"):
        parse_config({"host_bytes": 1 << 20, "greeter": [1]})
    assert parse_config({"host_bytes": 1 << 20, "greeter": None}).blocks == {"greeter": None}


def test_unknown_keys_name_the_registered_blocks_and_a_missing_first_party_plugin(greeter, monkeypatch) -> None:
    with pytest.raises(ConfigError, match="unknown key 'gretter'.*greeter"):
        parse_config({"host_bytes": 1 << 20, "gretter": {}})
    monkeypatch.setattr(registry_mod, "_registry", Registry(group="kvtiers-no-such-group"))  # no plugin at all
    with pytest.raises(ConfigError, match=r"'serve' needs the p2p tier plugin: pip install 'kvtiers\[p2p\]'"):
        parse_config({"host_bytes": 1 << 20, "serve": {}})


def test_p2p_offers_the_serve_block_through_the_hook() -> None:
    reg = get_registry()
    assert reg.blocks["serve"][0] == "p2p", reg.blocks
    assert "serve" in reg.manager_blocks()


def test_a_block_registered_twice_is_an_error_at_start_up(tmp_path, monkeypatch) -> None:
    twice = "register(\"greeter\", attach)\n    register(\"greeter\", attach)"
    src = BLOCK_PLUGIN.replace("register(\"greeter\", attach)", twice)
    make_dist(tmp_path, "kvtiers_greeter2", src=src, entry_points="[kvtiers]\ngreeter2 = kvtiers_greeter2\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    reg = Registry()
    assert "registered twice" in reg.errors.get("greeter2", ""), reg.errors
