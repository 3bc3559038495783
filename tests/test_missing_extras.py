"""Every command that needs an optional package, run where that package is missing: one
line naming the extra (or the package) to install, exit status 2, no traceback.

Each case runs the real ``kvtiers`` command in a fresh interpreter whose ``sitecustomize``
(on ``PYTHONPATH``, so the servers a command starts inherit it) puts a meta-path finder in
front that makes the named packages unimportable, as on a machine where they are not
installed: fault injection, the only stand-in here.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kvtiers.commands.requires import PACKAGES, install_hint, missing_hint

BLOCKER = textwrap.dedent('''
    import os
    import sys

    _BLOCKED = tuple(n for n in os.environ.get("KVTIERS_TEST_BLOCK", "").split(",") if n)


    class _NotInstalled:
        """Behave as if the packages named in KVTIERS_TEST_BLOCK were not installed."""

        def find_spec(self, name, path=None, target=None):
            if any(name == b or name.startswith(b + ".") for b in _BLOCKED):
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None


    sys.meta_path.insert(0, _NotInstalled())
''')

TORCH = "pip install 'torch==2.13.0'"
OBJ_CONFIG = '{"bucket": "kvtiers-absent", "endpoint_url": "http://127.0.0.1:9"}'

#: (command line, package made unimportable, what the error line must name)
CASES = [
    (["demo", "--scenario", "weights"], "transformers", "pip install 'kvtiers[transformers]'"),
    (["demo", "--scenario", "weights"], "safetensors", "pip install 'kvtiers[transformers]'"),
    (["demo", "--scenario", "weights"], "torch", TORCH),
    (["demo", "--engine", "transformers"], "transformers", "pip install 'kvtiers[transformers]'"),
    (["demo", "--engine", "transformers"], "torch", TORCH),
    (["demo"], "torch", TORCH),
    (["demo", "--model", "hybrid-swa"], "torch", TORCH),
    (["demo", "--events", "tcp://127.0.0.1:9"], "msgspec", "pip install 'kvtiers[observe]'"),
    (["demo", "--metrics-port", "0"], "prometheus_client", "pip install 'kvtiers[observe]'"),
    (["demo", "--scenario", "pd"], "zmq", "pip install 'kvtiers[p2p]'"),
    (["demo", "--scenario", "pd", "--p2p-backend", "nixl"], "nixl_cu12", "pip install 'kvtiers[nixl]'"),
    (["demo", "--scenario", "pd", "--tier", "mooncake"], "mooncake", "pip install 'kvtiers[mooncake]'"),
    (["demo", "--engine", "vllm"], "vllm", "make demo-vllm"),
    (["bench", "arena"], "torch", TORCH),
    (["bench", "p2p"], "zmq", "pip install 'kvtiers[p2p]'"),
    (["bench", "tier", "p2p"], "msgpack", "pip install 'kvtiers[p2p]'"),
    (["bench", "tier", "mooncake"], "mooncake", "pip install 'kvtiers[mooncake]'"),
    (["bench", "tier", "obj", "--config", OBJ_CONFIG], "aiobotocore", "pip install 'kvtiers[obj]'"),
    (["bench", "obj", "--config", OBJ_CONFIG], "aiobotocore", "pip install 'kvtiers[obj]'"),
    (["simulate", "--plot", "sim.png"], "matplotlib", "pip install 'kvtiers[plot]'"),
    (["bench", "tier", "memory", "--plot", "bench.png"], "matplotlib", "pip install 'kvtiers[plot]'"),  # before the run
    (["events", "tail", "--endpoint", "tcp://127.0.0.1:9"], "zmq", "pip install 'kvtiers[observe]'"),
    (["events", "tail", "--endpoint", "tcp://127.0.0.1:9"], "msgspec", "pip install 'kvtiers[observe]'"),
    (["conformance", "p2p"], "zmq", "pip install 'kvtiers[p2p]'"),
    (["conformance", "mooncake"], "mooncake", "pip install 'kvtiers[mooncake]'"),
    (["conformance", "obj", "--config", OBJ_CONFIG], "aiobotocore", "pip install 'kvtiers[obj]'"),
    (["p2p", "serve", "--bind", "tcp://127.0.0.1:0"], "zmq", "pip install 'kvtiers[p2p]'"),
    (["p2p", "serve", "--bind", "tcp://127.0.0.1:0"], "msgpack", "pip install 'kvtiers[p2p]'"),
    (["p2p", "serve", "--bind", "tcp://127.0.0.1:0", "--nixl", "--nixl-strict"], "nixl_cu12",
     "pip install 'kvtiers[nixl]'"),
    (["p2p", "keygen", "keys"], "zmq", "pip install 'kvtiers[p2p]'"),
    (["mooncake", "serve", "--master", "127.0.0.1:9"], "mooncake", "pip install 'kvtiers[mooncake]'"),
    (["mooncake", "master"], "mooncake", "pip install 'kvtiers[mooncake]'"),
    (["encrypt", "scan", "fs", "--config", '{"root_dir": "kv", "encrypt": {"key_env": "KVTIERS_TEST_KEY"}}'],
     "cryptography", "pip install 'kvtiers[encrypt]'"),
    (["bench", "serve"], "vllm", "make demo-vllm"),
    (["vllm", "serve"], "vllm", "pip install vllm"),
]


def run_without(blocked: str, args: list[str], cwd, timeout: float = 180) -> subprocess.CompletedProcess:
    """``kvtiers ARGS`` in a fresh interpreter (and its children) where ``blocked`` is not installed."""
    (cwd / "sitecustomize.py").write_text(BLOCKER)
    env = {**os.environ, "KVTIERS_TEST_BLOCK": blocked, "KVTIERS_TEST_KEY": "00" * 32,
           "PYTHONPATH": os.pathsep.join([str(cwd), *filter(None, [os.environ.get("PYTHONPATH")])])}
    return subprocess.run([sys.executable, "-m", "kvtiers.commands", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)


def one_line_error(r: subprocess.CompletedProcess) -> str:
    assert "Traceback" not in r.stderr + r.stdout, r.stderr
    assert r.returncode == 2, (r.returncode, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvtiers: error: "), r.stderr
    return lines[0]


@pytest.mark.parametrize(("args", "blocked", "names"), CASES, ids=[f"{' '.join(a[:3])}-no-{b}" for a, b, _ in CASES])
def test_a_command_without_its_optional_package_says_what_to_install(tmp_path, args, blocked, names):
    line = one_line_error(run_without(blocked, args, tmp_path))
    assert names in line, line


def test_the_blocker_blocks_only_what_it_names(tmp_path):
    (tmp_path / "sitecustomize.py").write_text(BLOCKER)
    code = "import importlib.util as u; print(u.find_spec('json') is not None); import transformers"
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                       env={**os.environ, "KVTIERS_TEST_BLOCK": "transformers", "PYTHONPATH": str(tmp_path)})
    assert r.stdout == "True\n" and "No module named 'transformers'" in r.stderr


def test_each_extra_the_table_names_installs_that_package():
    import tomllib

    extras = tomllib.loads((Path(__file__).parent.parent / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    for module, (dist, extra) in PACKAGES.items():
        if extra is not None:  # torch and vllm: installed apart (see INSTALL)
            assert extra in extras, (module, extra)
            assert any(req.lower().startswith(dist.lower()) for req in extras[extra]), (module, dist, extras[extra])


def test_every_optional_package_has_a_way_to_install_it():
    for module in PACKAGES:
        hint = install_hint(module)
        assert hint.startswith("pip install") or "make demo-vllm" in hint, (module, hint)
        assert missing_hint(f"{module}.sub") == missing_hint(module) is not None
    assert missing_hint("no_such_module_for_kvtiers") is None  # not optional: a bug keeps its traceback
