"""kvtiers bench serve's correctness check by top-k logprobs (kvtiers/commands/bench/serve_identity.py):
a configuration whose tokens match the plain run's but whose logprobs moved beyond the plain runs'
own noise is named; one within that noise is not; a token in one top-k list only counts by how far
above the other list's lowest entry it is; the report says so."""

from __future__ import annotations

import pytest

from kvtiers.commands.bench import serve_identity as si
from kvtiers.commands.bench import serve_report


def _tops(shift: float = 0.0, noise: float = 0.0) -> list[list[dict[int, float]]]:
    # two prompts, each sent twice (computed, then cached): four answers of two positions
    one = [{5: -0.1 + shift, 7: -2.5, 9: -3.0}, {6: -0.2, 8: -1.9 + shift, 4: -4.0}]
    other = [{3: -0.3, 1: -1.0}, {2: -0.05 + shift, 3: -3.3}]
    cached = [[{t: lp + noise for t, lp in pos.items()} for pos in a] for a in (one, other)]
    return [one, other, *cached]


def _runs(host_shift: float, plain_noise: float = 0.01) -> dict:
    tokens = [[5, 6], [3, 2], [5, 6], [3, 2]]
    runs = [{"config": "none", "repeat": 0, "greedy": tokens, "greedy_logprobs": _tops(noise=plain_noise)},
            {"config": "none", "repeat": 1, "greedy": tokens, "greedy_logprobs": _tops(shift=0.004)},
            {"config": "host", "repeat": 0, "greedy": tokens, "greedy_logprobs": _tops(shift=host_shift)}]
    return {"runs": runs}


def test_plain_noise_is_the_larger_of_repeats_and_computed_vs_cached() -> None:
    assert si.plain_noise(_runs(0.0)["runs"]) == pytest.approx(0.01)
    assert si.plain_noise(_runs(0.0, plain_noise=0.0)["runs"]) == pytest.approx(0.004)


def test_same_tokens_logprobs_moved_beyond_the_plain_noise_differ() -> None:
    rep = _runs(host_shift=0.5)
    si.identity(rep)
    ident = rep["identity"]
    assert not ident["identical"] and ident["differ"] == ["host r0"]
    assert ident["logprobs"]["max_diff"]["host r0"] > ident["logprobs"]["tolerance"]
    assert "DIFFER from none r0 in host r0" in _identity_lines(rep)


def test_within_the_plain_noise_is_identical() -> None:
    rep = _runs(host_shift=0.008)
    si.identity(rep)
    assert rep["identity"]["identical"], rep["identity"]
    assert "top-5 logprobs: largest difference" in _identity_lines(rep)


def test_a_token_only_in_one_top_k_counts_by_its_distance_above_the_others_lowest() -> None:
    a = [{1: -0.1, 2: -1.0}]
    assert si.top_diff(a, [{1: -0.1, 3: -0.9}]) == pytest.approx(0.1)  # 3: -0.9 vs a's lowest -1.0
    assert si.top_diff(a, [{1: -0.1, 2: -1.0}]) == 0.0
    # 2 (-1.0 in a) is missing from b, whose lowest is -1.2: b has it at -1.2 or below
    assert si.top_diff(a, [{1: -0.1, 3: -1.2}]) == pytest.approx(0.2)
    assert si.top_diff(a, a + a) == float("inf")


def test_token_ids_still_decide_without_logprobs() -> None:
    rep = {"runs": [{"config": "none", "repeat": 0, "greedy": [[1, 2]]},
                    {"config": "host", "repeat": 0, "greedy": [[1, 3]]}]}
    si.identity(rep)
    assert rep["identity"] == {"reference": "none r0", "prompts": 1, "identical": False, "differ": ["host r0"]}


def _identity_lines(rep: dict) -> str:
    return "\n".join(serve_report.identity_lines(rep["identity"]))
