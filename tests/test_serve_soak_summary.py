"""The serving soak's summary (``kvtiers.commands.bench.serve_soak.summarize``) on reports written
here: the first full interval against the last full one, a last interval the soak's end cut
short left out of the ratio, and the verdict."""

from __future__ import annotations

import copy

import pytest

from kvtiers.commands.bench.serve_soak import summarize


def report(ends: list[float], rates: list[float], failed: int = 0) -> dict:
    proc = {"rss": 600 << 20, "fds": 30, "threads": 10}
    rows = [{"t": t, "fs": {"chunk_bytes": 1 << 20}, "servers": [{"req_s": r, "ttft_p50_s": 1.0, "api": proc,
                                                                 "engine_core": proc}]}
            for t, r in zip(ends, rates, strict=True)]
    return {"soak": {"interval_s": 60.0}, "intervals": rows, "errors": [], "shm_left": [], "greedy_mismatches": 0,
            "clients": [{"completed": 100, "failed": failed}]}


def test_a_last_interval_cut_short_is_not_the_last_rate():
    s = summarize(report([60, 120, 180, 240, 249], [0.2, 0.35, 0.3, 0.4, 0.0]))
    assert s["servers"][0]["req_s"] == [0.35, 0.4]
    assert s["servers"][0]["req_s_ratio"] == pytest.approx(0.4 / 0.35)
    assert s["ok"]


def test_a_last_interval_of_at_least_half_counts():
    s = summarize(report([60, 120, 180, 215], [0.2, 0.35, 0.3, 0.5]))
    assert s["servers"][0]["req_s"] == [0.35, 0.5]


def test_a_failed_request_fails_the_verdict():
    assert not summarize(report([60, 120, 180], [0.3, 0.3, 0.3], failed=1))["ok"]


def _plain(lp: float = -0.5) -> dict:
    """A plain run's answers to 2 probes, each twice (computed, then cached): tokens, top-2 logprobs."""
    greedy = [[7, 8], [9, 9], [7, 8], [9, 9]]
    tops = [[{7: lp, 3: -2.0}, {8: -0.1, 4: -3.0}], [{9: -0.2, 5: -2.5}, {9: -0.3, 6: -2.0}]] * 2
    return {"config": "none", "repeat": 0, "greedy": greedy, "greedy_logprobs": tops}


def test_probe_answers_against_the_plain_server_to_its_runs_noise():
    from kvtiers.commands.bench.serve_identity import plain_noise
    from kvtiers.commands.bench.serve_soak import check_answers

    ref = _plain()
    tol = plain_noise([ref, {**_plain(-0.52), "repeat": 1}])
    assert tol == pytest.approx(0.02)
    same = ref["greedy_logprobs"][:2]
    assert check_answers(ref, tol, ref["greedy"][:2], same) == (True, 0.0)
    moved = [[{7: -0.51, 3: -2.0}, same[0][1]], same[1]]  # within the two plain runs' difference
    assert check_answers(ref, tol, ref["greedy"][:2], moved)[0]
    wrong = [[{7: -0.9, 3: -1.2}, same[0][1]], same[1]]  # the same tokens from other KV: logprobs moved
    ok, worst = check_answers(ref, tol, ref["greedy"][:2], wrong)
    assert not ok and worst == pytest.approx(0.8)
    assert check_answers(ref, tol, [[7, 4], [9, 9]], same) == (False, None)  # a token differs


def _at_a_tie() -> dict:
    """:func:`_plain` whose first prompt's second token (8) was a near tie with 4 (0.002 nats)."""
    ref = copy.deepcopy(_plain())
    for j in (0, 2):
        ref["greedy_logprobs"][j][1] = {8: -1.000, 4: -1.002}
    return ref


def test_an_answer_parts_from_the_reference_only_where_a_rounding_swaps_a_near_tie():
    """The soak's probes run in batches with other requests, which round differently; on a model
    with nearly flat logits (the tests' random tiny model has top tokens 0 or 0.004 nats apart)
    that swaps tied tokens. A parting is accepted where the two swapped tokens both answers
    list, with every logprob up to there within the tolerance; never where the logprobs moved."""
    from kvtiers.commands.bench.serve_identity import answer_diff
    from kvtiers.commands.bench.serve_soak import check_answers

    ref, tol = _at_a_tie(), 0.004
    second = ref["greedy_logprobs"][1]
    swapped = [[{7: -0.5, 3: -2.0}, {4: -0.999, 8: -1.001}], second]
    ok, worst = check_answers(ref, tol, [[7, 4], [9, 9]], swapped)
    assert ok and worst == pytest.approx(0.003)
    far = [[{7: -0.5, 3: -2.0}, {4: -0.9, 8: -1.001}], second]  # 4 moved 0.1 nats: other KV
    assert check_answers(ref, tol, [[7, 4], [9, 9]], far) == (False, None)
    before = [[{7: -0.6, 3: -2.0}, {4: -0.999, 8: -1.001}], second]  # the first token's logprobs moved
    assert check_answers(ref, tol, [[7, 4], [9, 9]], before) == (False, None)
    unlisted = [[{7: -0.5, 3: -2.0}, {4: -0.999, 6: -1.001}], second]  # 8 not in its top-k: no swap seen
    assert check_answers(ref, tol, [[7, 4], [9, 9]], unlisted) == (False, None)
    assert answer_diff(ref, [7, 4], swapped[0], 0) == (False, float("inf"))  # without tie: exact tokens


def test_the_tolerance_is_measured_up_to_where_plain_answers_part():
    """The plain run beside other requests swapped the tie: the tolerance is their difference up
    to there (0.003), not infinite (answers that parted were once not comparable at all)."""
    from kvtiers.commands.bench.serve_soak import tolerance

    ref = _at_a_tie()
    loaded = {**_at_a_tie(), "repeat": 2}
    loaded["greedy"][0] = [7, 4]
    loaded["greedy_logprobs"][0] = [{7: -0.5, 3: -2.0}, {4: -0.999, 8: -1.001}]
    assert tolerance([ref, loaded]) == pytest.approx(0.003)


def test_the_tolerance_covers_the_plain_servers_computed_and_cached_answers():
    from kvtiers.commands.bench.serve_soak import tolerance

    a = _plain()
    a["greedy_logprobs"] = a["greedy_logprobs"][:2] + [[{7: -0.56, 3: -2.0}, {8: -0.1, 4: -3.0}],
                                                       a["greedy_logprobs"][3]]  # cached: 0.06 nats off
    assert tolerance([a, {**_plain(), "repeat": 1}]) == pytest.approx(0.06)
    assert tolerance([_plain(), {**_plain(), "repeat": 1}]) == 0.0  # the same bytes, the same answers


def test_the_soak_counts_its_own_servers_regions_in_dev_shm(tmp_path):
    """Another engine starting on the machine has its offload region for a moment: not the soak's."""
    import os
    import types
    import uuid

    from kvtiers.commands.bench.serve_soak import own_shm

    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm")
    mine, other = uuid.uuid4(), uuid.uuid4()
    paths = [f"/dev/shm/vllm_offload_{mine}.mmap", f"/dev/shm/vllm_offload_{other}.mmap"]
    log = tmp_path / "server0.log"
    log.write_text(f"(EngineCore pid=1) INFO Creating v1 connector: OffloadingConnector, engine_id: {mine}\n")
    try:
        for p in paths:
            open(p, "wb").close()
        shm = own_shm([types.SimpleNamespace(log=str(log))])
        assert shm["regions"] == 1 and shm["regions_all"] >= 2
    finally:
        for p in paths:
            os.unlink(p)
