"""Weights a tier answers wrongly, on a real fs tier: a forged manifest of half a megabyte of
escaped quotes is refused as damaged at once (the depth check is one linear pass), and bytes a
tier returns wrong after its own checksum passed are caught by the digest check after a fork
and after a level-2 wake, which fail loudly naming the mismatch."""

from __future__ import annotations

import struct

import pytest

torch = pytest.importorskip("torch")

from kvtiers_fs.tier import FsTier  # noqa: E402
from test_weights_stale import publish_manifest  # noqa: E402

from kvtiers import JobResult, hookimpl  # noqa: E402
from kvtiers.engine.weights import ModelWeights  # noqa: E402
from kvtiers.engine.weights_chunks import MANIFEST_MAGIC, json_depth  # noqa: E402

CHUNK = 1 << 20


def model():
    g = torch.Generator().manual_seed(7)
    return {"emb": torch.randn(512, 256, generator=g), "w": torch.randn(256, 640, generator=g)}


def fs_config(root, tier=None):
    return {"host_blocks_factor": 1.0, "tiers": [{"type": tier or "fs", "root_dir": str(root)}]}


# -- a forged manifest ----------------------------------------------------------------------------
ESCAPED_QUOTES = b'{"tensors": "' + b'\\"' * (256 << 10)  # 512 KiB, a string that never ends


def test_json_depth_of_escaped_quotes_is_one_pass():
    assert json_depth(b'{"a": [1, {"b": "[[[\\"]]"}]}') == 3  # brackets in strings do not count
    assert json_depth(b'"\\\\"[[') == 2  # an escaped backslash ends no string: the quote does
    assert json_depth(b'"\\\\\\"[["') == 0  # an escaped quote inside: still one string
    assert json_depth(b"[" * 5000) == 5000
    assert json_depth(ESCAPED_QUOTES) == 1


@pytest.mark.timeout(60)  # the regex it replaced took about 40 minutes on this
def test_a_forged_manifest_of_escaped_quotes_is_damaged_at_once(tmp_path):
    m, root = model(), tmp_path / "fs"

    def forged(doc):
        return struct.pack("<8sQ", MANIFEST_MAGIC, len(ESCAPED_QUOTES)) + ESCAPED_QUOTES

    ident = publish_manifest(m, fs_config(root), "forged", forged, CHUNK)  # what a hostile publisher stores
    twin = {k: torch.empty_like(v) for k, v in m.items()}
    with pytest.raises(LookupError, match="manifest of model 'forged' revision 'v1'.* is damaged: Unterminated"):
        ModelWeights.fork(twin, fs_config(root), ident)


# -- wrong bytes past the tier's checksum ---------------------------------------------------------
class FlipAfterChecksumFs(FsTier):
    """The fs tier, whose loads of data chunks pass its checksum and then have one byte
    flipped in the slot before they are reported: wrong bytes the tier calls good (rule 3
    broken above the checksum, as a faulty DMA or a buggy third-party tier would)."""

    flipped = 0

    @hookimpl
    def submit_load(self, job):
        self.__dict__.setdefault("_loads", {})[job.job_id] = tuple(zip(job.keys, job.slots, strict=True))
        super().submit_load(job)

    @hookimpl
    def get_finished_jobs(self) -> list[JobResult]:
        done = super().get_finished_jobs()
        for r in done:
            for key, slot in self.__dict__.get("_loads", {}).pop(r.job_id, ()):
                if b"/weights/" in key and key not in r.failed_keys:
                    self.arena[slot][100] ^= 0x01
                    type(self).flipped += 1
        return done


FLIPPING = f"{__name__}:FlipAfterChecksumFs"


def test_wrong_bytes_past_the_tier_checksum_fail_the_fork_naming_the_digest(tmp_path):
    m, root = model(), tmp_path / "fs"
    with ModelWeights(m, fs_config(root), name="flip", revision="v1", chunk_bytes=CHUNK) as w:
        ident = w.publish()
    twin = {k: torch.empty_like(v) for k, v in m.items()}
    with ModelWeights.fork(twin, fs_config(root), ident):  # the plain tier: the same bytes
        pass
    assert all(torch.equal(twin[k], m[k]) for k in m)
    before = FlipAfterChecksumFs.flipped
    with pytest.raises(RuntimeError, match=f"fork filled bytes whose digest [0-9a-f]{{32}} is not that of model "
                                           f"'flip' revision 'v1' digest {ident.digest[:12]}.*a tier returned other"):
        ModelWeights.fork({k: torch.empty_like(v) for k, v in m.items()}, fs_config(root, FLIPPING), ident)
    assert FlipAfterChecksumFs.flipped > before  # the fault was injected, and caught


def test_wrong_bytes_past_the_tier_checksum_fail_the_wake_naming_the_digest(tmp_path):
    m = model()
    want = {k: v.clone() for k, v in m.items()}
    with ModelWeights(m, fs_config(tmp_path / "fs", FLIPPING), name="flip", revision="v1", chunk_bytes=CHUNK) as w:
        ident = w.identity
        w.sleep(2)  # through the arena to the tier; the host copies are dropped
        before = FlipAfterChecksumFs.flipped
        with pytest.raises(RuntimeError, match=f"wake filled bytes whose digest [0-9a-f]{{32}} is not that of "
                                               f"model 'flip' revision 'v1' digest {ident.digest[:12]}"):
            w.wake()
        assert FlipAfterChecksumFs.flipped > before
        assert w.asleep == 2  # not reported awake with wrong bytes
    assert any(not torch.equal(m[k], want[k]) for k in m)  # the wrong bytes did land: the check caught them
