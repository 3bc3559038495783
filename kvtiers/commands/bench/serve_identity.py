"""``kvtiers bench serve``'s correctness check: every configuration's greedy answers against a
run without offloading, by token ids and by the top-k logprobs of each generated token.

Token ids alone see little: a model whose answer hardly depends on its context answers the
same tokens from wrong KV. The logprobs of the ``k`` most likely tokens at each generated
position move with any change in the KV the answer was computed from. They are compared to a
tolerance measured on the plain configuration (``none``) itself: between its repeats, and
between each prompt's first answer (prefix computed) and its second (prefix from vLLM's own
device cache), so the numeric noise of taking a prefix from a cache is allowed and nothing more.
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


def _answers_diff(a: list[list[Top]], b: list[list[Top]]) -> float:
    if len(a) != len(b):
        return float("inf")
    return max((top_diff(x, y) for x, y in zip(a, b, strict=True)), default=0.0)


def plain_noise(runs: list[dict[str, Any]]) -> float | None:
    """The tolerance: the largest top-k difference between the plain configuration's runs and
    between each plain run's two answers to the same prompt (the prompts are sent twice). None
    when no plain run has logprobs."""
    plain = [r["greedy_logprobs"] for r in runs if r["config"] == PLAIN and r.get("greedy_logprobs")]
    if not plain:
        return None
    noise = 0.0
    for tops in plain:
        half = len(tops) // 2
        if len(tops) % 2 == 0 and half:
            noise = max(noise, _answers_diff(tops[:half], tops[half:]))
    for other in plain[1:]:
        noise = max(noise, _answers_diff(plain[0], other))
    return noise


def identity(report: dict[str, Any]) -> None:
    """Set ``report["identity"]``: each run's greedy token ids against the reference (the first
    plain run, else the first run that answered), and where the runs carry logprobs, the
    largest top-k difference of each run from the reference against the plain runs' noise."""
    runs = [r for r in report["runs"] if r.get("greedy") is not None]
    ref_run = next((r for r in runs if r["config"] == PLAIN), runs[0] if runs else None)
    ref = ref_run["greedy"] if ref_run else None
    differ = {f"{r['config']} r{r['repeat']}" for r in runs if r["greedy"] != ref}
    out: dict[str, Any] = {"reference": f"{ref_run['config']} r{ref_run['repeat']}" if ref_run else None,
                           "prompts": len(ref or [])}
    tol = plain_noise(runs)
    if ref_run is not None and ref_run.get("greedy_logprobs") and tol is not None:
        diffs = {}
        for r in runs:
            if r is ref_run or not r.get("greedy_logprobs"):
                continue
            name = f"{r['config']} r{r['repeat']}"
            diffs[name] = d = _answers_diff(ref_run["greedy_logprobs"], r["greedy_logprobs"])
            if d > tol:
                differ.add(name)
        out["logprobs"] = {"top_k": TOP_K, "tolerance": tol, "max_diff": diffs}
    out.update(identical=not differ, differ=sorted(differ))
    report["identity"] = out
