"""``kvtiers bench serve``'s report carries each tier's reuse ceiling (``kvtiers_reuse_ceiling``
as the server's /metrics has it after a cell) beside the tier's hits (docs/observability.md)."""

from __future__ import annotations

from kvtiers.commands.bench import serve_metrics as sm
from kvtiers.commands.bench.serve_report import _tiers_text

AFTER = """\
# TYPE kvtiers_reuse_ceiling gauge
kvtiers_reuse_ceiling{engine="0",model_name="m",tier="kvtiers_fs",window="15m"} 0.4375
kvtiers_reuse_ceiling{engine="0",model_name="m",tier="kvtiers_fs",window="1h"} 0.25
kvtiers_tier_chunk_hits_total{engine="0",model_name="m",tier="kvtiers_fs"} 12.0
kvtiers_tier_chunk_queries_total{engine="0",model_name="m",tier="kvtiers_fs"} 40.0
"""


def test_the_report_shows_the_reuse_ceiling_beside_the_hits() -> None:
    after = sm.parse(AFTER)
    s = sm.summarize(sm.delta({}, after), gauges=after)
    fs = s["tiers"]["kvtiers_fs"]
    assert fs["reuse_ceiling"] == {"15m": 0.4375, "1h": 0.25}
    assert fs["kvtiers"]["chunk_hits"] == 12.0
    text = _tiers_text({"kvtiers_fs": {"hits": 12.0, "queries": 40.0, **fs}})
    assert text.startswith("kvtiers_fs: 12/40 hits,") and text.endswith(", reuse ceiling 44% (15 min)")
    assert "reuse ceiling" not in _tiers_text({"kvtiers_fs": {"hits": 1.0, "queries": 2.0}})
