"""``kvtiers demo --scenario weights``: a real model's weights put to sleep, woken and forked
through the host arena and the fs tier (:mod:`kvtiers.engine.weights`), each step timed against
its raw baseline on the same bytes in the same run:

- wake from the host arena against ``np.copyto`` of the same bytes out of the same arena into
  fresh memory, one array per storage (on an accelerator: ``copy_`` into fresh device tensors);
- fork from the fs tier against the safetensors load of the same checkpoint from the same disk
  (``safetensors.torch.load_file`` and ``load_state_dict`` into a model allocated the same way),
  the checkpoint evicted from the page cache first, as the fs tier reads with O_DIRECT.

The model is the project's locally made Llama-shaped model (:mod:`kvtiers.commands.tinymodel`),
about 190 MB of bfloat16 weights, loaded with transformers. Every tensor is compared byte for
byte with a copy taken before the first sleep after every wake and fork, and the logits of a
fixed prompt with the first ones; the demo exits 1 on any difference.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

import click

#: the demo model's shape: about 190 MB of bfloat16 weights in 77 storages
MODEL_SHAPE = {"hidden_size": 1024, "num_layers": 8, "intermediate_size": 2816}
PROMPT = "the system is the user of the assistant, and you"


@dataclass
class Row:
    """One step's figures."""

    step: str
    nbytes: int
    seconds: float
    baseline: str | None = None
    baseline_seconds: float | None = None
    rss_before: int | None = None
    rss_after: int | None = None
    runs: int = 1

    def gbps(self) -> float:
        return self.nbytes / self.seconds / 1e9 if self.seconds else 0.0

    def ratio(self) -> float | None:
        return self.baseline_seconds / self.seconds if self.baseline_seconds and self.seconds else None


@dataclass
class Result:
    """What the demo measured and checked."""

    model: str
    device: str
    total_bytes: int
    chunks: int
    storages: int
    tier: str
    rows: list[Row] = field(default_factory=list)
    mismatched: int = 0
    checked: int = 0
    logits_same: bool = True

    def as_dict(self) -> dict[str, Any]:
        d = {k: v for k, v in self.__dict__.items() if k != "rows"}
        d["steps"] = [{**r.__dict__, "gbps": r.gbps(), "ratio": r.ratio()} for r in self.rows]
        return d


def weights_command(*, directory: str | None, keep: bool, config_text: str | None, device: str | None,
                    as_json: bool, runs: int = 3, shape: dict[str, int] | None = None) -> None:
    """Run the weights scenario and print its table (or JSON); exit 1 on any mismatch."""
    from ...config import parse_json_option

    override = parse_json_option(config_text, None)
    tmp = None
    if directory is None:  # beside the checkpoint (build/): the same disk
        from ..tinymodel import build_dir

        (build_dir() / "demo").mkdir(parents=True, exist_ok=True)
        tmp = directory = tempfile.mkdtemp(prefix="kvtiers-weights-", dir=build_dir() / "demo")
    try:
        result = run_weights_demo(tier_dir=directory, override=override, device_name=device, runs=runs,
                                  shape=shape or MODEL_SHAPE, quiet=as_json)
    finally:
        if tmp is not None and not keep:
            shutil.rmtree(tmp, ignore_errors=True)
    click.echo(json.dumps(result.as_dict()) if as_json else render(result))
    if tmp is not None and keep and not as_json:
        click.echo(f"tier directory kept: {tmp}")
    if result.mismatched or not result.logits_same:
        click.echo(f"kvtiers demo: {result.mismatched} tensor(s) mismatched, logits "
                   f"{'same' if result.logits_same else 'DIFFERENT'}", err=True)
        raise click.exceptions.Exit(1)


def run_weights_demo(*, tier_dir: str, override: dict[str, Any], device_name: str | None, runs: int,
                     shape: dict[str, int], quiet: bool = False) -> Result:
    """Sleep (levels 1 and 2), wake and fork the demo model; the figures and the checks."""
    import torch
    import transformers

    from ...engine.arena import accelerator
    from ...engine.weights import ModelWeights
    from ..tinymodel import make_tiny_model

    dev = torch.device(device_name) if device_name else (accelerator() or torch.device("cpu"))
    say = (lambda *a: None) if quiet else (lambda msg: click.echo(msg, err=True))
    say("making (or finding) the model ...")
    path = make_tiny_model(**shape)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to(dev)
    tok = transformers.AutoTokenizer.from_pretrained(path)
    ids = torch.tensor([tok(PROMPT)["input_ids"]], device=dev)
    ref = {n: t.detach().clone() for n, t in _tensors(model).items()}
    first = _logits(model, ids)
    config = {"host_blocks_factor": 1.0, "elastic": dev.type == "cpu", "elastic_reserve_bytes": 0,
              **override, "tiers": override.get("tiers") or [{"type": "fs", "root_dir": tier_dir}]}
    w = ModelWeights(model, config, name=path.name)
    fs = w.cfg.tiers[0]
    res = Result(path.name, str(dev), w.plan.total_bytes, w.plan.num_chunks, len(w.plan.storages), fs.type)

    def check(m: Any) -> None:
        got = _tensors(m)
        res.checked += len(ref)
        res.mismatched += sum(1 for n, t in ref.items() if not _same(got[n], t))
        res.logits_same = res.logits_same and torch.equal(_logits(m, ids), first)

    try:
        say(f"sleep / wake through the host arena, {runs} run(s) ...")
        sleeps, wakes, raws = [], [], []
        for _ in range(runs):
            s = w.sleep(1)
            sleeps.append(s)
            raws.append(_raw_wake(w, dev))
            wakes.append(w.wake())
            check(model)
        mid = sorted(sleeps, key=lambda s: s.seconds)[len(sleeps) // 2]
        res.rows.append(Row("sleep level 1 (host arena)", mid.nbytes, mid.seconds, rss_before=mid.rss_before,
                            rss_after=mid.rss_after, runs=runs))
        res.rows.append(Row("wake from the host arena", w.plan.total_bytes,
                            statistics.median(s.seconds for s in wakes),
                            "np.copyto" if dev.type == "cpu" else "copy_", statistics.median(raws), runs=runs))
        say("sleep level 2 through the fs tier, wake from it ...")
        s = w.sleep(2)
        res.rows.append(Row("sleep level 2 (to fs)", s.nbytes, s.seconds, rss_before=s.rss_before,
                            rss_after=s.rss_after))
        s = w.wake()
        res.rows.append(Row("wake from fs", s.nbytes, s.seconds))
        check(model)
        direct = getattr(w.manager.tiers[0].handle.tier, "direct", False)
        res.tier = f"{fs.type} ({'O_DIRECT' if direct else 'buffered'})"
        ident = w.identity
        say(f"fork from fs against the safetensors load, {runs} run(s) ...")
        forks, loads = [], []
        ckpt = os.path.join(path, "model.safetensors")
        for _ in range(runs):
            m2 = _empty_model(model.config, dev)
            with ModelWeights.fork(m2, config, ident) as w2:
                forks.append(w2.last_step.seconds)
            check(m2)
            del m2, w2
            m3 = _empty_model(model.config, dev)
            loads.append(_safetensors_load(m3, ckpt, dev))
            del m3
        res.rows.append(Row("fork from fs (new model)", w.plan.total_bytes, statistics.median(forks),
                            "safetensors load", statistics.median(loads), runs=runs))
    finally:
        w.close()
    return res


def render(res: Result) -> str:
    """The demo's table."""
    mib = 1 << 20
    lines = [f"kvtiers demo --scenario weights: {res.model}, {res.total_bytes / mib:.1f} MiB of weights in "
             f"{res.storages} storages, {res.chunks} chunks; device {res.device}; tier {res.tier}",
             "",
             f"{'step':<38}{'MiB':>8}{'s':>9}{'GB/s':>8}   {'baseline':<18}{'GB/s':>6}{'ratio':>8}   RSS MiB",
             "-" * 110]
    for r in res.rows:
        base = ratio = ""
        if r.baseline:
            base = f"{r.baseline:<18}{r.nbytes / r.baseline_seconds / 1e9:>6.2f}"
            ratio = f"{r.ratio():>7.2f}x"
        else:
            base = " " * 24
        rss = f"{r.rss_before / mib:.0f} -> {r.rss_after / mib:.0f}" if r.rss_before is not None else ""
        med = " (median)" if r.runs > 1 else ""
        lines.append(f"{r.step + med:<38}{r.nbytes / mib:>8.1f}{r.seconds:>9.3f}{r.gbps():>8.2f}   {base}"
                     f"{ratio:>8}   {rss}")
    lines.append("")
    lines.append(f"{res.mismatched} mismatched (of {res.checked} tensors compared byte for byte after every wake "
                 f"and fork); logits of the fixed prompt {'identical' if res.logits_same else 'DIFFERENT'}")
    return "\n".join(lines)


# -- helpers ------------------------------------------------------------------------------------
def _tensors(model: Any) -> dict[str, Any]:
    return dict(list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers()))


def _same(a: Any, b: Any) -> bool:
    import torch

    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.reshape(-1).view(torch.uint8),
                                                                     b.reshape(-1).view(torch.uint8))


def _logits(model: Any, ids: Any) -> Any:
    import torch

    with torch.no_grad():
        return model(ids).logits.float().cpu()


def _empty_model(config: Any, dev: Any) -> Any:
    import torch
    import transformers

    with torch.device("meta"):
        m = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    return m.to_empty(device=dev)


def _raw_wake(w: Any, dev: Any) -> float:
    """The raw baseline of a wake from host: the same bytes out of the same arena into fresh
    memory, one array (tensor) per storage, as wake allocates them."""
    import numpy as np
    import torch

    arena = w.host.ndarray().reshape(-1)
    t0 = time.perf_counter()
    out = []
    if dev.type == "cpu":
        for s in w.plan.storages:
            d = np.empty(s.nbytes, dtype=np.uint8)
            np.copyto(d, arena[s.start : s.start + s.nbytes])
            out.append(d)
    else:
        flat = w.host.tensor().reshape(-1)
        for s in w.plan.storages:
            d = torch.empty(s.nbytes, dtype=torch.uint8, device=dev)
            d.copy_(flat[s.start : s.start + s.nbytes], non_blocking=True)
            out.append(d)
        torch.accelerator.synchronize(dev)
    seconds = time.perf_counter() - t0
    del out
    return seconds


def _safetensors_load(model: Any, ckpt: str, dev: Any) -> float:
    """The safetensors load of the checkpoint into ``model`` (allocated like the fork's), the
    file evicted from the page cache first: the same disk the fs tier reads with O_DIRECT."""
    import torch
    from safetensors.torch import load_file

    fd = os.open(ckpt, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    t0 = time.perf_counter()
    model.load_state_dict(load_file(ckpt, device=str(dev)))
    if dev.type != "cpu":
        torch.accelerator.synchronize(dev)
    return time.perf_counter() - t0
