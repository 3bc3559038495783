"""``kvtiers bench serve``'s correctness check: every configuration's greedy answers against a
run without offloading, by token ids and by the top-k logprobs of each generated token.

Token ids alone see little: a model whose answer hardly depends on its context answers the
same tokens from wrong KV. The logprobs of the ``k`` most likely tokens at each generated
position move with any change in the KV the answer was computed from.

Each prompt is sent twice: its first answer may compute the shared prefix, its second takes it
from vLLM's device cache, and the two may differ (bf16 rounds differently on the two paths: on
the SmolLM2-shape model by up to 0.17 nats at its weights' std 0.1; at 0.2 by 0.15-0.65 nats
from the first token, the tokens parting after about ten).
So an answer is compared with the plain run's answer to the same prompt that it matches by
tokens (computed, or cached), and its top-k logprobs must be within the noise measured between
the plain configuration's repeats (0 with one plain run: bit for bit, as a tier's bytes are the
device cache's bytes).
"""

from __future__ import annotations

from typing import Any

#: top-k logprobs asked for each generated token
TOP_K = 5
#: the plain configuration the others are compared with
PLAIN = "none"

Top = dict[int, float]  # token id -> logprob, one generated position


def top_diff(a: list[Top], b: list[Top]) -> float:
    """The largest logprob difference between two answers' top-k lists, position by position:
    for a token in both lists, the difference of its logprobs; for a token in one list only,
    how far above the other list's lowest logprob it is (0 where it could have ranked just
    below the other's k-th). ``inf`` where the answers have different lengths."""
    if len(a) != len(b):
        return float("inf")
    worst = 0.0
    for x, y in zip(a, b, strict=True):
        for one, other in ((x, y), (y, x)):
            floor = min(other.values()) if other else float("-inf")
            for tok, lp in one.items():
                d = abs(lp - other[tok]) if tok in other else lp - floor
                worst = max(worst, d)
    return worst


def _prompt_of(i: int, n: int) -> int:
    """The prompt an answer is to: the prompts are sent twice (``n`` answers, prompt ``i % n/2``)."""
    return i % (n // 2) if n % 2 == 0 and n else i


def answer_diff(ref: dict[str, Any], tokens: list[Any], tops: list[Top] | None, prompt: int) -> tuple[bool, float]:
    """Whether an answer to prompt ``prompt`` (``tokens``, ``tops``) equals, by tokens, one of
    the reference run's answers to that prompt (the reference answered its prompts twice: its
    first answer computed, its second with the prefix cached), and the smallest top-k difference
    among those that do (``inf`` if none; 0.0 where either side has no logprobs)."""
    n = len(ref["greedy"])
    same = [j for j in range(n) if _prompt_of(j, n) == prompt and ref["greedy"][j] == tokens]
    if not same:
        return False, float("inf")
    if tops is None or not ref.get("greedy_logprobs"):
        return True, 0.0
    return True, min(top_diff(ref["greedy_logprobs"][j], tops) for j in same)


def _match(ref: dict[str, Any], tokens: list[Any], tops: list[Top] | None, i: int, n: int
           ) -> tuple[bool, float]:
    """:func:`answer_diff` of answer ``i`` of a run of ``n`` answers (its prompts sent twice)."""
    return answer_diff(ref, tokens, tops, _prompt_of(i, n))


def _run_diff(ref: dict[str, Any], run: dict[str, Any]) -> tuple[bool, float]:
    """Whether every answer of ``run`` matches one of ``ref``'s to its prompt by tokens, and the
    largest top-k difference to the closest such answer."""
    g, tops = run["greedy"], run.get("greedy_logprobs")
    if len(g) != len(ref["greedy"]):
        return False, float("inf")
    ok, worst = True, 0.0
    for i, tokens in enumerate(g):
        m, d = _match(ref, tokens, tops[i] if tops else None, i, len(g))
        ok, worst = ok and m, max(worst, d)
    return ok, worst


def plain_noise(runs: list[dict[str, Any]]) -> float | None:
    """The tolerance: the largest top-k difference between the plain configuration's repeats
    (each answer against the first plain run's closest answer to the same prompt); 0.0 with
    one plain run (nothing measured: the answers must be exact). None when no plain run has
    logprobs."""
    plain = [r for r in runs if r["config"] == PLAIN and r.get("greedy_logprobs")]
    if not plain:
        return None
    return max((_run_diff(plain[0], other)[1] for other in plain[1:]), default=0.0)


def path_noise(run: dict[str, Any]) -> float:
    """The largest top-k difference between a run's computed and cached answer to each of its
    prompts (answers ``i`` and ``i + n/2``) where their tokens are the same: the rounding that a
    change of path (prefix computed, or taken from a cache) brings. 0.0 without logprobs."""
    g, tops = run["greedy"], run.get("greedy_logprobs")
    half = len(g) // 2
    if not tops or len(g) % 2:
        return 0.0
    return max((top_diff(tops[i], tops[i + half]) for i in range(half) if g[i] == g[i + half]), default=0.0)


def identity(report: dict[str, Any]) -> None:
    """Set ``report["identity"]``: the reference is the first plain run (else the first run that
    answered). Each answer of each run must have the tokens of one of the reference's answers
    to the same prompt (its first, computed, or its second, the prefix cached: the two may
    differ, as bf16 rounding differs between the two paths) and, where the runs carry
    logprobs, top-k logprobs within the plain repeats' noise of that answer's."""
    runs = [r for r in report["runs"] if r.get("greedy") is not None]
    ref_run = next((r for r in runs if r["config"] == PLAIN), runs[0] if runs else None)
    out: dict[str, Any] = {"reference": f"{ref_run['config']} r{ref_run['repeat']}" if ref_run else None,
                           "prompts": len(ref_run["greedy"]) if ref_run else 0}
    tol = plain_noise(runs)
    use_lp = ref_run is not None and bool(ref_run.get("greedy_logprobs")) and tol is not None
    differ, diffs = set(), {}
    for r in runs:
        if r is ref_run:
            continue
        name = f"{r['config']} r{r['repeat']}"
        ok, d = _run_diff(ref_run, r if use_lp else {**r, "greedy_logprobs": None})
        if use_lp and r.get("greedy_logprobs"):
            diffs[name] = d
        if not ok or (use_lp and r.get("greedy_logprobs") and d > tol):
            differ.add(name)
    if use_lp:
        out["logprobs"] = {"top_k": TOP_K, "tolerance": tol, "max_diff": diffs}
    out.update(identical=not differ, differ=sorted(differ))
    report["identity"] = out
