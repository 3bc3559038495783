"""kvtiers bench serve's correctness check by top-k logprobs (kvtiers/commands/bench/serve_identity.py).

Each prompt is sent twice: first computed, then with the prefix from vLLM's device cache, and on a
real model the two answers differ (bf16 rounding). A configuration's answer must match one of the
plain run's answers to the same prompt by tokens, and its top-k logprobs that answer's within the
noise between the plain configuration's repeats: logprobs moved beyond it are named even where the
tokens are the same; an answer that took the cached path where the plain run computed is not."""

from __future__ import annotations

import copy

import pytest

from kvtiers.commands.bench import serve_identity as si
from kvtiers.commands.bench import serve_report

# two prompts: their computed answers, then the answers with the prefix cached (0.3 apart, the
# second prompt's tokens parting at the second position, as on the SmolLM2-shape model)
COMPUTED = [[{5: -0.1, 7: -2.5, 9: -3.0}, {6: -0.2, 8: -1.9, 4: -4.0}], [{3: -0.3, 1: -1.0}, {2: -0.05, 3: -3.3}]]
CACHED = [[{t: lp - 0.3 for t, lp in pos.items()} for pos in a] for a in COMPUTED]
CACHED[1][1] = {3: -0.2, 2: -0.4}
TOKENS = [[5, 6], [3, 2], [5, 6], [3, 3]]


def _plain(repeat: int, wobble: float = 0.0) -> dict:
    tops = copy.deepcopy(COMPUTED + CACHED)
    tops[0][0][5] += wobble
    return {"config": "none", "repeat": repeat, "greedy": copy.deepcopy(TOKENS), "greedy_logprobs": tops}


def _report(host: dict) -> dict:
    return {"runs": [_plain(0), _plain(1, wobble=0.004), {"config": "host", "repeat": 0, **host}]}


def test_tolerance_is_the_noise_between_plain_repeats() -> None:
    assert si.plain_noise(_report({"greedy": TOKENS})["runs"]) == pytest.approx(0.004)
    assert si.plain_noise([_plain(0)]) == 0.0  # one plain run: exact


def test_same_tokens_logprobs_moved_beyond_the_plain_noise_differ() -> None:
    tops = copy.deepcopy(COMPUTED + CACHED)
    tops[1][0][3] += 0.1  # the second prompt's first token, 0.1 nats more likely
    rep = _report({"greedy": copy.deepcopy(TOKENS), "greedy_logprobs": tops})
    si.identity(rep)
    ident = rep["identity"]
    assert not ident["identical"] and ident["differ"] == ["host r0"]
    assert ident["logprobs"]["max_diff"]["host r0"] == pytest.approx(0.1)
    assert "DIFFER from none r0 in host r0" in "\n".join(serve_report.identity_lines(ident))


def test_an_answer_from_the_cached_path_matches_the_plain_cached_answer() -> None:
    # the host run's first answer to the second prompt took its prefix from a cache (a tier):
    # it equals the plain run's second answer to that prompt, tokens and logprobs
    tops = copy.deepcopy(COMPUTED + CACHED)
    tops[1] = copy.deepcopy(CACHED[1])
    tokens = copy.deepcopy(TOKENS)
    tokens[1] = [3, 3]
    rep = _report({"greedy": tokens, "greedy_logprobs": tops})
    si.identity(rep)
    assert rep["identity"]["identical"], rep["identity"]
    assert rep["identity"]["logprobs"]["max_diff"]["host r0"] == 0.0
    assert "tolerance 0.004" in "\n".join(serve_report.identity_lines(rep["identity"]))


def test_within_the_plain_noise_is_identical() -> None:
    tops = copy.deepcopy(COMPUTED + CACHED)
    tops[2][1][6] -= 0.003
    rep = _report({"greedy": copy.deepcopy(TOKENS), "greedy_logprobs": tops})
    si.identity(rep)
    assert rep["identity"]["identical"], rep["identity"]


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
