"""Under vLLM's own tiering (the vLLM adapter, docs/vllm.md) vLLM cascades every store to
each secondary tier itself, so the manager's admission (docs/admission.md) is not in the path:
a secondary tier entry with ``"admit"`` is refused with a one-line error, never ignored."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("vllm.v1.kv_offload.tiering.spec", reason="vLLM 0.33.0 is installed by `make test`")

from kvtiers.errors import ConfigError  # noqa: E402

_spec = importlib.util.spec_from_file_location("lookup_wait", Path(__file__).parents[1] / "scripts" / "lookup_wait.py")
lookup_wait = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(lookup_wait)


def test_admit_on_a_vllm_secondary_tier_is_a_one_line_error(tmp_path) -> None:
    with pytest.raises(ConfigError) as e:
        lookup_wait.make_manager(str(tmp_path), 16, {"admit": {"min_offers": 2}})
    assert "option 'admit' is not applied under vLLM's tiering" in str(e.value) and "\n" not in str(e.value)


def test_the_reuse_ceiling_reaches_vllms_metrics(tmp_path) -> None:
    """The vLLM adapter counts the chunks vLLM stores (its cascade) and loads (from the primary
    tier, ``refresh``; promotions) and reports ``kvtiers_reuse_ceiling`` per window in its
    stats, which vLLM's Prometheus logger exports on /metrics beside the tier's hit counts
    (docs/observability.md#the-reuse-ceiling)."""
    from test_vllm_namespace import ROW
    from test_vllm_stats_series import rendered, stored_on_fs

    with stored_on_fs(tmp_path) as (e, tier_cfg, chunks):
        (tier,) = e.m.secondary_tiers
        tier.refresh(list(chunks)[:2], None)  # two of them loaded again from the primary tier
        stats = [e.m.get_stats()]
    assert tier.reuse.offers == 7
    m = rendered(stats, [tier_cfg])
    for window in ("15m", "1h", "1d"):
        assert m[f'kvtiers_reuse_ceiling{{tier="kvtiers_fs",window="{window}"}}'] == pytest.approx(2 / 7, abs=0.01)
    assert m['kvtiers_tier_write_bytes_total{tier="kvtiers_fs"}'] == 5 * ROW
