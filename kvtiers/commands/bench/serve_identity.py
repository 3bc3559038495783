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


def parting(a_tokens: Any, a_tops: list[Top], b_tokens: Any, b_tops: list[Top]) -> tuple[int | None, float]:
    """Where two answers to one prompt part (the first position whose tokens differ; None where
    they do not) and their largest top-k difference up to and including that position: until
    there both were computed from the same context, so their logprobs are comparable; after it
    they are not. ``inf`` where differing answers are of different lengths or text, not ids."""
    if a_tokens == b_tokens:
        return None, top_diff(a_tops, b_tops)
    if not isinstance(a_tokens, list) or not isinstance(b_tokens, list) or len(a_tokens) != len(b_tokens):
        return None, float("inf")
    at = next(i for i, (x, y) in enumerate(zip(a_tokens, b_tokens, strict=True)) if x != y)
    return at, top_diff(a_tops[:at + 1], b_tops[:at + 1])


def swapped(a_top: Top, b_top: Top, a_tok: int, b_tok: int) -> bool:
    """Whether two answers that part at one position (``a_tok`` in one, ``b_tok`` in the other)
    swapped two tokens they both list there, each answer taking the one its own list ranks
    first (as a greedy answer does): the two were a tie apart by however far the lists differ."""
    both = {a_tok, b_tok}
    return both <= a_top.keys() and both <= b_top.keys() and \
        a_top[a_tok] >= a_top[b_tok] and b_top[b_tok] >= b_top[a_tok]


def answer_diff(ref: dict[str, Any], tokens: list[Any], tops: list[Top] | None, prompt: int,
                tie: float | None = None) -> tuple[bool, float]:
    """Whether an answer to prompt ``prompt`` (``tokens``, ``tops``) equals, by tokens, one of
    the reference run's answers to that prompt (the reference answered its prompts twice: its
    first answer computed, its second with the prefix cached), and the smallest top-k difference
    among those that do (``inf`` if none; 0.0 where either side has no logprobs).

    With ``tie`` (a tolerance in nats) an answer also matches one it parts from where the two
    swapped two tokens (:func:`swapped`) and their top-k logprobs up to and including there
    (:func:`parting`) are within ``tie``: then the two tokens were within ``2 * tie`` of each
    other, a rounding apart. A model with nearly flat logits (random weights) has top tokens
    that close, and a batch of other requests beside an answer rounds differently."""
    n = len(ref["greedy"])
    mine = [j for j in range(n) if _prompt_of(j, n) == prompt]
    same = [j for j in mine if ref["greedy"][j] == tokens]
    has_lp = tops is not None and bool(ref.get("greedy_logprobs"))
    if same and not has_lp:
        return True, 0.0
    if not has_lp:
        return False, float("inf")
    lps = ref["greedy_logprobs"]
    diffs = [top_diff(lps[j], tops) for j in same]
    if tie is not None:
        for j in (j for j in mine if j not in same):  # (the same tokens: compared above)
            at, d = parting(ref["greedy"][j], lps[j], tokens, tops)
            if at is not None and d <= tie and swapped(lps[j][at], tops[at], ref["greedy"][j][at], tokens[at]):
                diffs.append(d)
    return (True, min(diffs)) if diffs else (False, float("inf"))


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
    return max((_noise(plain[0], other) for other in plain[1:]), default=0.0)


def _noise(ref: dict[str, Any], run: dict[str, Any]) -> float:
    """The largest top-k difference between each answer of ``run`` and ``ref``'s closest answer
    to the same prompt, up to where they part (:func:`parting`; ``inf`` where the runs differ in
    length)."""
    g, tops, n = run["greedy"], run["greedy_logprobs"], len(ref["greedy"])
    if len(g) != n:
        return float("inf")
    return max((min(parting(ref["greedy"][j], ref["greedy_logprobs"][j], tokens, tops[i])[1]
                    for j in range(n) if _prompt_of(j, n) == _prompt_of(i, n))
                for i, tokens in enumerate(g)), default=0.0)


def path_noise(run: dict[str, Any]) -> float:
    """The largest top-k difference between a run's computed and cached answer to each of its
    prompts (answers ``i`` and ``i + n/2``), up to where their tokens part (:func:`parting`):
    the rounding that a change of path (prefix computed, or taken from a cache) brings. 0.0
    without logprobs."""
    g, tops = run["greedy"], run.get("greedy_logprobs")
    half = len(g) // 2
    if not tops or len(g) % 2:
        return 0.0
    diffs = (parting(g[i], tops[i], g[i + half], tops[i + half])[1] for i in range(half))
    return max((d for d in diffs if d != float("inf")), default=0.0)  # inf: not comparable (text answers)


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
