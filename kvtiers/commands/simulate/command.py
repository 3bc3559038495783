"""The ``kvtiers simulate`` command (see :mod:`kvtiers.commands.simulate.run`)."""

from __future__ import annotations

import json
import re
from typing import Any

import click

from .model import Accelerator, GiB, Workload

_ACC = Accelerator()
_WL = Workload()


def _ints(text: str) -> tuple[int, ...]:
    try:
        vals = tuple(int(x) for x in re.split(r"[,\s]+", text.strip()) if x)
    except ValueError:
        raise click.BadParameter(f"{text!r}: expected integers separated by commas, e.g. 16,64,128") from None
    if not vals or min(vals) < 1:
        raise click.BadParameter(f"{text!r}: expected positive integers")
    return vals


def _gbps(items: tuple[str, ...]) -> dict[str, tuple[float, float]]:
    out = {}
    for item in items:
        m = re.fullmatch(r"\s*([\w.-]+)\s*=\s*([\d.]+)(?:\s*/\s*([\d.]+))?\s*", item)
        if not m or float(m.group(2)) <= 0:
            raise click.BadParameter(f"{item!r}: expected TIER=LOAD[/STORE] in GB/s, e.g. fs=6.5/4",
                                     param_hint="--gbps")
        load = float(m.group(2))
        out[m.group(1)] = (load, float(m.group(3)) if m.group(3) else load)
    return out


def _configs(items: tuple[str, ...]) -> dict[str, dict[str, Any]]:
    out = {}
    for item in items:
        name, sep, text = item.partition("=")
        try:
            obj = json.loads(text) if sep else None
        except json.JSONDecodeError as e:
            raise click.BadParameter(f"{item!r}: {e}", param_hint="--tier-config") from None
        if not isinstance(obj, dict):
            raise click.BadParameter(f"{item!r}: expected TIER=JSON object", param_hint="--tier-config")
        obj.pop("type", None)
        out[name.strip()] = obj
    return out


@click.command()
@click.option("--concurrency", default=",".join(map(str, _WL.concurrency)), show_default=True,
              help="Concurrent conversations to simulate, comma-separated.")
@click.option("--policy", "policies", multiple=True,
              type=click.Choice(["recompute", "host", "host+fs", "host+obj", "host+p2p"]),
              help="Policies to compare (repeatable; default: all, a tier's skipped where it cannot be opened).")
@click.option("--turns", type=click.IntRange(2), default=_WL.turns, show_default=True,
              help="Turns per conversation (the first one is warm-up, untimed).")
@click.option("--context-tokens", type=click.IntRange(0), default=_WL.context_tokens, show_default=True,
              help="Tokens each conversation opens with.")
@click.option("--user-tokens", type=click.IntRange(1), default=_WL.user_tokens, show_default=True,
              help="Tokens per user turn.")
@click.option("--answer-tokens", type=click.IntRange(1), default=_WL.answer_tokens, show_default=True,
              help="Tokens generated per turn.")
@click.option("--tokens-per-chunk", type=click.IntRange(1), default=_WL.tokens_per_chunk, show_default=True,
              help="Tokens per offloaded chunk.")
@click.option("--kv-bytes-per-token", type=click.IntRange(1), default=_ACC.kv_bytes_per_token, show_default=True,
              help="KV cache bytes per token (all layers).")
@click.option("--gpu-kv-gib", type=float, default=_ACC.gpu_kv_bytes / GiB, show_default=True,
              help="GPU memory for the KV cache, GiB.")
@click.option("--host-kv-gib", type=float, default=_ACC.host_kv_bytes / GiB, show_default=True,
              help="Host memory for offloaded KV, GiB.")
@click.option("--gpu-chunks", type=click.IntRange(1), default=None, help="GPU KV capacity in chunks (instead of GiB).")
@click.option("--host-chunks", type=click.IntRange(1), default=None,
              help="Host KV capacity in chunks (instead of GiB).")
@click.option("--prefill-us", type=float, default=_ACC.prefill_us_per_token, show_default=True,
              help="Prefill cost per token, microseconds.")
@click.option("--decode-us", type=float, default=_ACC.decode_us_per_token, show_default=True,
              help="Decode cost per generated token per sequence (reading its KV), microseconds.")
@click.option("--decode-step-us", type=float, default=_ACC.decode_step_us, show_default=True,
              help="Decode cost per step, shared by the batch (reading the weights), microseconds.")
@click.option("--pcie-gbps", type=float, default=_ACC.pcie_gbps, show_default=True,
              help="Host <-> GPU bandwidth each way, GB/s.")
@click.option("--gbps", "gbps_items", multiple=True, metavar="TIER=LOAD[/STORE]",
              help="A tier's bandwidth in GB/s instead of measuring it here (repeatable).")
@click.option("--measured", is_flag=True,
              help="The fs tier at this machine's measured GB/s, not the modelled NVMe drive.")
@click.option("--tier-config", "config_items", multiple=True, metavar="TIER=JSON",
              help="Options of a policy's tier, e.g. obj='{\"endpoint_url\": ..., \"bucket\": ...}' (repeatable).")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the conversations' tokens.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON (no progress).")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False), default=None, metavar="FILE.png",
              help="Write throughput against concurrency per policy as a PNG (needs matplotlib).")
def simulate(concurrency: str, policies: tuple[str, ...], turns: int, context_tokens: int, user_tokens: int,
             answer_tokens: int, tokens_per_chunk: int, kv_bytes_per_token: int, gpu_kv_gib: float,
             host_kv_gib: float, gpu_chunks: int | None, host_chunks: int | None, prefill_us: float, decode_us: float,
             decode_step_us: float, pcie_gbps: float, gbps_items: tuple[str, ...], measured: bool,
             config_items: tuple[str, ...], seed: int, as_json: bool, plot_path: str | None) -> None:
    """Multi-turn conversations at each concurrency against a model of an accelerator (by
    default Llama-3.1-8B on one H100, from public figures) and the real kvtiers data path at
    reduced scale (TieringManager, host arena, tiers). The fs tier is modelled on a named NVMe
    drive (datasheet GB/s times its efficiency measured here against raw I/O); obj and p2p
    at the GB/s measured here.
    Prints throughput and prefill tokens saved per offload policy and concurrency."""
    if plot_path:
        from ..plot import require_plot

        require_plot()  # before the run, not after it
    from ..progress import Progress
    from .run import POLICIES, format_table, steps
    from .run import simulate as run

    acc = Accelerator(kv_bytes_per_token=kv_bytes_per_token, gpu_kv_bytes=int(gpu_kv_gib * GiB),
                      host_kv_bytes=int(host_kv_gib * GiB), prefill_us_per_token=prefill_us,
                      decode_us_per_token=decode_us, decode_step_us=decode_step_us, pcie_gbps=pcie_gbps)
    if (kv_bytes_per_token, prefill_us, decode_us, decode_step_us) != (
            _ACC.kv_bytes_per_token, _ACC.prefill_us_per_token, _ACC.decode_us_per_token, _ACC.decode_step_us):
        acc.name = "custom model (calibrated by options)"
    wl = Workload(context_tokens=context_tokens, user_tokens=user_tokens, answer_tokens=answer_tokens, turns=turns,
                  tokens_per_chunk=tokens_per_chunk, concurrency=_ints(concurrency), seed=seed)
    pols = list(dict.fromkeys(policies)) or list(POLICIES)
    gbps = _gbps(gbps_items)
    configs = _configs(config_items)
    with Progress(steps(wl, len(pols)), "simulate", quiet=as_json) as bar:
        try:
            report = run(acc, wl, policies=pols, tier_configs=configs, gbps=gbps, gpu_chunks=gpu_chunks,
                         host_chunks=host_chunks, progress=bar, measured=measured)
        except ValueError as e:
            raise click.UsageError(str(e)) from None
    if plot_path:
        from ..plot import plot_simulation

        plot_simulation(report, plot_path)
    if as_json:
        click.echo(json.dumps(report, indent=1))
    else:
        click.echo(format_table(report))
        if plot_path:
            click.echo(f"plot written to {plot_path}")
    bad = sum(r["mismatches"] for r in report["results"])
    if bad:
        click.echo(f"kvtiers simulate: {bad} loaded chunk(s) did not hold their bytes", err=True)
        raise click.exceptions.Exit(1)
