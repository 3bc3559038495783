"""The namespace kvtiers gives a vLLM secondary tier: chunks of different byte layouts never
share one, the same model by another path does.

On vLLM 0.33's own classes (``TieringOffloadingSpec``, its manager and CPU primary tier, the
adapter loaded by ``module_path``), configs built as ``build_offloading_config`` builds them
for the cases that matter: vLLM marks the plain TP=2 layout parallelism-agnostic (a single
full-attention group with head-sharded pages), though its rows hold each worker's shard side
by side, so they are not a TP=1 row's bytes.
"""

from __future__ import annotations

import json
import shutil
import struct
import time
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("vllm.v1.kv_offload.tiering.spec", reason="vLLM 0.33.0 is installed by `make test`")

from vllm.v1.kv_offload.base import LookupResult, ReqContext, ScheduleEndContext, make_offload_key  # noqa: E402
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec  # noqa: E402
from vllm_engines import offloading_config  # noqa: E402

from kvtiers.errors import ConfigError  # noqa: E402
from kvtiers.integrations.vllm.model_identity import model_identity  # noqa: E402

ROW = 8192  # one chunk row, all workers together
MODULE = "kvtiers.integrations.vllm"
STEP = ScheduleEndContext((), ())


@pytest.fixture(autouse=True)
def own_digest_cache(tmp_path, monkeypatch):
    """The weight digest cache (model identity) in this test's directory, not the user's."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg-cache"))


def config(tier: dict | None, *, tp: int = 1, canonical: bool = False, model: str = "org/tiny-model", **extra):
    """What vLLM builds for a one-group full-attention model at TP=``tp`` (one node): each worker
    holds ROW/tp bytes of a block, and vLLM calls the layout parallelism-agnostic."""
    return offloading_config({"secondary_tiers": [tier] if tier else [], **extra}, row=ROW, tp=tp,
                             canonical=canonical, model=model)


class Engine:
    """vLLM's scheduler side with one kvtiers tier: the real spec, manager and primary region."""

    def __init__(self, tier: dict, spec: type = TieringOffloadingSpec, **kw) -> None:
        self.m = spec(config(tier, **kw)).get_manager()
        self.rows = np.frombuffer(self.m.primary_tier.get_kv_memoryview(), dtype=np.uint8).reshape(-1, ROW)
        self.tier = self.m.secondary_tiers[0] if self.m.secondary_tiers else None

    def settle(self) -> None:
        """Step until no job is in flight: bounded by time (a loaded machine's fs writes take
        longer than any fixed number of steps), not by a count of steps."""
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            self.m.on_schedule_end(STEP)
            if not self.m.has_pending_work():
                return
            time.sleep(0.001)
        raise AssertionError("jobs still in flight after 60 s")

    def store(self, chunks: dict[bytes, bytes], ctx: ReqContext | None = None) -> None:
        """Store ``chunks`` as one request (``ctx``: its context, else a plain one)."""
        ctx = ctx or ReqContext(req_id="store")
        self.m.on_new_request(ctx)
        out = self.m.prepare_store(list(chunks), ctx)
        for key, row in zip(out.keys_to_store, out.store_spec.block_ids, strict=True):
            self.rows[row] = np.frombuffer(chunks[key], dtype=np.uint8)
        self.m.complete_store(list(chunks), ctx)
        self.m.on_request_finished(ctx)
        self.settle()

    def answers(self, keys: list[bytes]) -> set[LookupResult]:
        """What the tier answers for ``keys``, once no answer is RETRY."""
        ctx = ReqContext(req_id="look")
        deadline = time.monotonic() + 30  # by time: the fs probe thread answers when the machine lets it
        while time.monotonic() < deadline:
            seen = {self.tier.lookup(k, ctx) for k in keys}
            if LookupResult.RETRY not in seen:
                return seen
            time.sleep(0.001)
        raise AssertionError("lookups did not resolve in 30 s")

    def close(self) -> None:
        self.rows = None
        self.m.shutdown()


def digest(tier_root: Path, **kw) -> str:
    e = Engine({"type": "kvtiers_fs", "module_path": MODULE, "root_dir": str(tier_root)}, **kw)
    try:
        return e.tier.namespace.digest
    finally:
        e.close()


def test_tp1_and_plain_tp2_never_share_a_namespace_canonical_layouts_do(tmp_path) -> None:
    root = tmp_path / "kv"
    assert digest(root, tp=1) != digest(root, tp=2)  # same row size, other bytes: apart
    assert digest(root, tp=1) == digest(root, tp=1)
    assert digest(root, tp=1, canonical=True) == digest(root, tp=2, canonical=True)  # rank-independent bytes
    assert digest(root, tp=2, canonical=True) != digest(root, tp=2)


def test_a_tp1_engine_does_not_load_what_a_tp2_engine_stored_on_the_same_root(tmp_path) -> None:
    tier = {"type": "kvtiers_fs", "module_path": MODULE, "root_dir": str(tmp_path / "kv")}
    rng = np.random.default_rng(0)
    chunks = {make_offload_key(rng.bytes(32), 0): rng.bytes(ROW) for _ in range(4)}
    a = Engine(tier, tp=2)
    try:
        a.store(chunks)
        assert a.answers(list(chunks)) == {LookupResult.HIT}
        fields = a.tier.namespace.fields
        assert fields["parallel"] == {"tp": 2, "pp": 1, "pcp": 1, "dcp": 1}
    finally:
        a.close()
    b = Engine(tier, tp=1)
    try:
        assert b.answers(list(chunks)) == {LookupResult.MISS}  # before: HIT, and wrong tokens
    finally:
        b.close()
    c = Engine(tier, tp=2)  # the same layout again finds them
    try:
        assert c.answers(list(chunks)) == {LookupResult.HIT}
    finally:
        c.close()


def safetensors(path: Path, values: bytes) -> None:
    """A real safetensors file with two uint8 tensors, halves of ``values``."""
    h = len(values) // 2
    header = json.dumps({"a": {"dtype": "U8", "shape": [h], "data_offsets": [0, h]},
                         "b": {"dtype": "U8", "shape": [len(values) - h], "data_offsets": [h, len(values)]}}).encode()
    header += b" " * (-len(header) % 8)
    path.write_bytes(struct.pack("<Q", len(header)) + header + values)


def model_dir(where: Path, weights: bytes, **cfg) -> Path:
    where.mkdir(parents=True)
    (where / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "hidden_size": 64,
                                                   "_name_or_path": str(where), **cfg}))
    safetensors(where / "model.safetensors", weights)
    return where


def test_one_model_one_namespace_whatever_path_serves_it(tmp_path, monkeypatch) -> None:
    weights = np.random.default_rng(1).bytes(200_000)
    a = model_dir(tmp_path / "a" / "llama", weights)
    b = tmp_path / "elsewhere" / "llama-copy"
    shutil.copytree(a, b)
    (b / "config.json").write_text((b / "config.json").read_text().replace(str(a), str(b)))  # its own path
    (tmp_path / "link").symlink_to(a)
    # a fine-tune of one layer: same config, header and size; tensor "b" changed, "a" not
    other = weights[:100_000] + np.random.default_rng(2).bytes(100_000)
    c = model_dir(tmp_path / "c" / "llama", other)
    wider = model_dir(tmp_path / "d" / "llama", weights, hidden_size=128)

    ident = model_identity(str(a))
    assert ident is not None and ident.startswith("sha256:")
    assert model_identity(str(b)) == ident == model_identity(str(tmp_path / "link"))
    assert model_identity(str(c)) != ident and model_identity(str(wider)) != ident
    monkeypatch.chdir(tmp_path / "a")
    assert model_identity("./llama") == ident

    # a Hugging Face id resolves through the local cache's one snapshot
    hub = tmp_path / "hub"
    snap = hub / "models--org--llama" / "snapshots" / "0123abcd"
    shutil.copytree(a, snap)
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(hub))
    assert model_identity("org/llama") == ident
    assert model_identity("org/not-cached") is None  # the namespace keeps the name

    root = tmp_path / "kv"
    same = digest(root, model=str(a))
    assert digest(root, model=str(b)) == same == digest(root, model="org/llama")
    assert digest(root, model=str(c)) != same
    # deployments kept apart on purpose
    assert digest(root, model=str(a), deployment="blue") != same
    assert digest(root, model=str(b), deployment="blue") == digest(root, model=str(a), deployment="blue")
    e = Engine({"type": "kvtiers_fs", "module_path": MODULE, "root_dir": str(root)}, model=str(a))
    try:
        assert e.tier.namespace.fields["model"] == ident
    finally:
        e.close()
    with pytest.raises(ConfigError, match="'deployment' expects a non-empty string"):
        digest(root, model=str(a), deployment=7)
