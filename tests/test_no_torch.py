"""Without torch: the core, the registry, the tiers and the CLI work where torch is absent.

Each test runs a fresh interpreter in which a meta-path finder makes ``torch`` (and every
``torch.*``) unimportable, as on a machine where it is not installed.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

BLOCKER = textwrap.dedent('''
    import sys

    class NoTorch:
        """Behave as if torch were not installed."""
        attempts = []

        def find_spec(self, name, path=None, target=None):
            if name == "torch" or name.startswith("torch."):
                NoTorch.attempts.append(name)
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None

    sys.meta_path.insert(0, NoTorch())
    for mod in [m for m in sys.modules if m == "torch" or m.startswith("torch.")]:
        del sys.modules[mod]
''')


def run_without_torch(code: str) -> subprocess.CompletedProcess:
    script = BLOCKER + textwrap.dedent(code)
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)


def test_blocker_really_blocks_torch() -> None:
    r = run_without_torch("""
        try:
            import torch  # noqa: F401
        except ModuleNotFoundError as e:
            print("blocked", e.name)
    """)
    assert r.returncode == 0, r.stderr
    assert r.stdout == "blocked torch\n"


def test_core_registry_and_memory_tier_without_torch() -> None:
    r = run_without_torch("""
        import time
        import kvtiers
        from kvtiers import Arena, AsyncTier, Job, Lookup, Namespace, TierContext, get_registry, open_tier
        from kvtiers.config import parse_config

        reg = get_registry()
        assert reg.tier_info("memory").levels == {"core", "bounded"}, reg.tiers()
        assert reg.errors == {} or all("torch" not in v for v in reg.errors.values()), reg.errors

        removed = []
        ctx = TierContext(Arena.allocate(4, 4096), Namespace({"model": "m"}),
                          removed=lambda k, r: removed.append((k, r)))
        h = open_tier("memory", {"max_bytes": 4096}, ctx)
        ctx.arena[0][:] = b"\\x11" * 4096
        ctx.arena[1][:] = b"\\x22" * 4096
        h.submit_store(Job(1, (b"a", b"b"), (0, 1)))
        h.submit_load(Job(2, (b"b",), (3,)))
        results, deadline = [], time.monotonic() + 20  # the memory tier copies on its worker thread
        while len(results) < 2 and time.monotonic() < deadline:
            results += h.get_finished_jobs()
            time.sleep(0.001)
        assert [(r.job_id, r.ok) for r in results] == [(1, True), (2, True)], results
        assert bytes(ctx.arena[3]) == b"\\x22" * 4096
        assert h.lookup([b"a", b"b"]) == [Lookup.MISS, Lookup.HIT]
        assert removed == [((b"a",), "evicted")]
        h.close()

        class Dict(AsyncTier):  # the I/O loop works too
            def __init__(self, ctx):
                super().__init__(ctx)
                self.d = {}
            async def exists(self, key):
                return key in self.d
            async def put(self, key, data):
                self.d[key] = bytes(data)
            async def get_into(self, key, out):
                out[:] = self.d[key]
                return True

        t = open_tier(Dict, {}, ctx)
        t.submit_store(Job(3, (b"x",), (0,)))
        deadline = time.monotonic() + 20
        got = []
        while not got:
            got = t.get_finished_jobs()
            assert time.monotonic() < deadline
            time.sleep(0.005)
        assert got[0].ok and t.lookup([b"x"]) == [Lookup.HIT]
        t.close()

        parse_config({"cpu_bytes_to_use": 1 << 20, "secondary_tiers": [{"type": "memory"}]})
        assert "torch" not in sys.modules
        print("ok", kvtiers.__version__, "torch import attempts:", NoTorch.attempts)
    """)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("ok "), r.stdout


def test_cli_without_torch() -> None:
    r = run_without_torch("""
        import contextlib, io
        from kvtiers.commands.cli import main

        for argv in (["--help"], ["tiers"], ["tiers", "--help"], ["bench", "--help"], ["conformance", "--help"]):
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                rc = main(argv)
            assert rc == 0, (argv, rc)
            print("===", " ".join(argv))
            print(out.getvalue(), end="")
        assert "torch" not in sys.modules
    """)
    assert r.returncode == 0, r.stderr
    sections = dict(s.split("\n", 1) for s in r.stdout.split("=== ")[1:])
    assert "tiers " in sections["--help"] and "conformance " in sections["--help"]
    assert any(line.startswith("memory\tkvtiers\t") for line in sections["tiers"].splitlines())
    assert "Usage: kvtiers tiers" in sections["tiers --help"]
    assert "arena" in sections["bench --help"]
    assert "Usage: kvtiers conformance" in sections["conformance --help"]
