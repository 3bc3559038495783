"""``kvtiers demo --engine transformers``: a real transformers model (the project's locally made
Llama-shaped model, :mod:`kvtiers.commands.tinymodel`) behind a
:class:`~kvtiers.integrations.transformers.PrefixCache` over an ``fs`` tier, in an A/B run per
prompt length:

- a first engine instance prefills a prompt (a long shared prefix and a question) and stores it;
- a restarted instance (a new manager over the same ``fs`` directory) answers another question on
  the same prefix twice: A, a full prefill of the whole prompt; B, the prefix loaded from the tier
  (host arena empty: every chunk comes from ``fs``) and a prefill of the rest only;
- each timed as the median of ``rounds`` rounds, B with a new instance each round; the greedy
  tokens after A and after B are compared, and the demo exits 1 if they differ.
"""

from __future__ import annotations

import json
import random
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any

import click

PROMPT_LENGTHS = (512, 1024, 2048)  # tokens of the shared prefix
QUESTION_TOKENS = 24
NEW_TOKENS = 16
TOKENS_PER_CHUNK = 64
ROUNDS = 3


@dataclass
class Row:
    """One prompt length's figures."""

    prompt_tokens: int
    loaded_tokens: int
    full_prefill_s: float
    tier_hit_s: float  # load from the tier + prefill of the rest
    load_s: float
    identical: bool

    @property
    def speedup(self) -> float:
        return self.full_prefill_s / self.tier_hit_s if self.tier_hit_s else 0.0


def greedy(model: Any, ids: list[int], cache: Any, n: int = NEW_TOKENS) -> tuple[list[int], float, Any]:
    """``n`` greedy tokens after ``ids`` (those ``cache`` does not hold), the seconds of the prefill
    of ``ids``, and the cache after it."""
    import torch

    with torch.no_grad():
        t0 = time.perf_counter()
        out = model(input_ids=torch.tensor([ids]), past_key_values=cache, use_cache=True)
        seconds = time.perf_counter() - t0
        filled = out.past_key_values
        tokens = []
        for _ in range(n):
            tokens.append(int(out.logits[0, -1].argmax()))
            out = model(input_ids=torch.tensor([[tokens[-1]]]), past_key_values=out.past_key_values, use_cache=True)
    return tokens, seconds, filled


def run(tier_dir: str, *, seed: int = 0, rounds: int | None = None, device: str | None = None,
        override: dict[str, Any] | None = None, lengths: tuple[int, ...] | None = None,
        quiet: bool = False) -> list[Row]:
    """The A/B run per prompt length (default :data:`PROMPT_LENGTHS`), ``rounds`` rounds each
    (default :data:`ROUNDS`); see the module docstring."""
    import torch
    from transformers import AutoModelForCausalLM

    from ...integrations.transformers import PrefixCache
    from ..tinymodel import make_tiny_model

    path = make_tiny_model(arch="llama")
    dev = torch.device(device) if device else (torch.accelerator.current_accelerator() or torch.device("cpu"))
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32 if dev.type == "cpu" else torch.bfloat16)
    model = model.to(dev).eval()
    config = {"host_bytes": 64 << 20, "tiers": [{"type": "fs", "root_dir": tier_dir}], **(override or {})}
    rounds = ROUNDS if rounds is None else rounds
    rng = random.Random(seed)
    vocab = model.config.vocab_size
    greedy(model, [rng.randrange(3, vocab) for _ in range(32)], None, 1)  # warm-up
    rows = []
    for length in PROMPT_LENGTHS if lengths is None else lengths:
        prefix = [rng.randrange(3, vocab) for _ in range(length)]
        first = prefix + [rng.randrange(3, vocab) for _ in range(QUESTION_TOKENS)]
        second = prefix + [rng.randrange(3, vocab) for _ in range(QUESTION_TOKENS)]
        with PrefixCache.from_config(config, model, tokens_per_chunk=TOKENS_PER_CHUNK) as pc:
            _, _, filled = greedy(model, first, None, 0)
            pc.store(first, filled)
        full_s, hit_s, load_s = [], [], []
        same = True
        loaded = 0
        for _ in range(rounds):
            want, seconds, _ = greedy(model, second, None)
            full_s.append(seconds)
            with PrefixCache.from_config(config, model, tokens_per_chunk=TOKENS_PER_CHUNK) as pc:
                t0 = time.perf_counter()
                cache, loaded = pc.load(second)
                t1 = time.perf_counter()
                got, seconds, _ = greedy(model, second[loaded:], cache)
                if dev.type != "cpu":
                    torch.accelerator.synchronize()
                load_s.append(t1 - t0)
                hit_s.append(t1 - t0 + seconds)
            same = same and got == want
        rows.append(Row(len(second), loaded, statistics.median(full_s), statistics.median(hit_s),
                        statistics.median(load_s), same))
        if not quiet:
            click.echo(f"  {len(second)} tokens: loaded {loaded}, tokens {'identical' if same else 'DIFFER'}", err=True)
    return rows


def render(rows: list[Row], rounds: int) -> str:
    """The table the demo prints."""
    out = [f"transformers prefix cache over fs: prefill time, median of {rounds} rounds",
           f"{'prompt':>7} {'loaded':>7} {'full prefill':>13} {'tier hit':>10} {'(load)':>9} {'speedup':>8}  tokens"]
    for r in rows:
        out.append(f"{r.prompt_tokens:>7} {r.loaded_tokens:>7} {r.full_prefill_s * 1e3:>10.1f} ms "
                   f"{r.tier_hit_s * 1e3:>7.1f} ms {r.load_s * 1e3:>6.1f} ms {r.speedup:>7.2f}x  "
                   f"{'identical' if r.identical else 'DIFFER'}")
    return "\n".join(out)


def transformers_command(directory: str | None, *, keep: bool, seed: int, device: str | None,
                         config_text: str | None, as_json: bool, rounds: int | None = None) -> None:
    """What ``kvtiers demo --engine transformers`` runs: the table (or JSON) over the ``fs`` tier in
    ``directory`` (default: a temporary one, removed unless ``keep``); exit 1 if tokens differ."""
    import shutil
    import tempfile

    from ...config import parse_json_option

    override = parse_json_option(config_text, None)
    rounds = ROUNDS if rounds is None else rounds
    tmp = None
    if directory is None:
        tmp = directory = tempfile.mkdtemp(prefix="kvtiers-demo-transformers-")
    try:
        rows = run(directory, seed=seed, rounds=rounds, device=device, override=override, quiet=as_json)
    finally:
        if tmp is not None and not keep:
            shutil.rmtree(tmp, ignore_errors=True)
    if as_json:
        click.echo(json.dumps({"rounds": rounds, "results": [{**asdict(r), "speedup": r.speedup} for r in rows]}))
    else:
        click.echo(render(rows, rounds))
        if tmp is not None and keep:
            click.echo(f"tier directory kept: {tmp}")
    if not all(r.identical for r in rows):
        click.echo("kvtiers demo: tokens after the tier hit DIFFER from a full prefill", err=True)
        raise click.exceptions.Exit(1)
