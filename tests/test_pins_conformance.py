"""Rule 13 of the conformance suite (pins hold within the bound, docs/contract.md): the real fs
tier passes it; an fs tier whose pin hook accepts but protects nothing fails it, and so does one
that accepts a pin of its whole bound; a tier without the optional hook is skipped with the
reason, never passed."""

from __future__ import annotations

from kvtiers_conformance import Limits, run_conformance
from kvtiers_fs.tier import FsTier

from kvtiers import hookimpl

FAST = Limits(finish_s=5.0, retry_s=3.0, examples=10, crash_rounds=1, shrink=False)


class ForgetfulPins(FsTier):
    """Says yes to every pin of keys it holds, keeps none (the broken tier rule 13 must catch)."""

    @hookimpl
    def pin(self, keys, seconds):
        return None if all(k in self.index for k in keys) else "not stored here"


class GreedyPins(FsTier):
    """Protects what it pins but never refuses a pin for the bound's sake (no cap on pins): a pin
    of every chunk of a full bound is accepted (rule 13 must catch it)."""

    @hookimpl
    def pin(self, keys, seconds):
        self.pins.cap = None
        return super().pin(keys, seconds)


def fs_config(scratch):
    return {"root_dir": str(scratch), "rescan_seconds": None}


def rule13(cls, config):
    report = run_conformance(cls, config, levels={"bounded"}, rules={13}, limits=FAST, seed=13)
    return next(r for r in report.rules() if (r.rule, r.level) == (13, "bounded"))


def test_the_fs_tier_keeps_its_pins_within_its_bound():
    line = rule13(FsTier, fs_config)
    assert line.status == "PASS", line.line()


def test_a_tier_that_accepts_a_pin_of_its_whole_bound_fails():
    line = rule13(GreedyPins, fs_config)
    assert line.status == "FAIL", line.line()
    assert "chunks of the full tier (nothing left to evict) was accepted" in line.line()


def test_a_tier_that_accepts_pins_and_evicts_them_fails():
    line = rule13(ForgetfulPins, fs_config)
    assert line.status == "FAIL", line.line()
    assert "pinned key(s) were evicted before their time" in line.line()


def test_a_tier_without_the_pin_hook_is_skipped_with_the_reason():
    from kvtiers.memory import MemoryTier

    line = rule13(MemoryTier, {})
    assert line.status == "SKIP", line.line()
    assert "does not implement the optional pin hook" in line.line()


def test_the_fs_tier_keeps_its_pins_compressed_and_encrypted(tmp_path):
    """Rule 13 with "compress" (pins reach every piece) and with "encrypt" (through the sealing
    wrapper) on the fs tier."""
    import os

    keyfile = tmp_path / "k.key"
    keyfile.write_bytes(os.urandom(32))
    keyfile.chmod(0o600)
    for extra in ({"compress": {"codec": "zstd"}}, {"encrypt": {"key_file": str(keyfile), "key_id": "k1"}}):
        line = rule13("fs", lambda scratch, extra=extra: {**fs_config(scratch), **extra})
        assert line.status == "PASS", (extra, line.line())
