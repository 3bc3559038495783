"""``kvtiers bench fs --scale N``: the options that turn ``kvtiers bench fs`` into the scale
bench of :mod:`kvtiers_fs.scale` (added to the command at registration)."""

from __future__ import annotations

import json
import os
import tempfile
from typing import Any

import click


def with_scale(cmd: click.Command) -> click.Command:
    """Add ``--scale``, ``--dir``, ``--instances``, ``--window`` and ``--rescan-seconds`` to
    ``cmd`` (``kvtiers bench fs``): with ``--scale`` it runs the scale bench instead."""
    if any(p.name == "scale" for p in cmd.params):
        return cmd
    cmd.params.extend([
        click.Option(["--scale"], type=click.IntRange(1), default=None, metavar="N",
                     help="Scale bench: a root of N chunk files of 4 KiB; open, snapshot, index and "
                          "steady-state listing figures (see docs/fs.md, At scale)."),
        click.Option(["--dir", "scale_dir"], type=click.Path(file_okay=False), default=None,
                     help="With --scale: where the root is built (kept for the next run; default: a "
                          "directory under the temporary directory, removed after)."),
        click.Option(["--instances"], type=click.IntRange(1, 64), multiple=True, default=(1, 4), show_default=True,
                     help="With --scale: instances (processes) in the steady-state runs; repeatable."),
        click.Option(["--window"], type=click.FloatRange(1), default=40.0, show_default=True,
                     help="With --scale: seconds of steady state measured per run."),
        click.Option(["--rescan-seconds"], type=click.FloatRange(0.01), default=30.0, show_default=True,
                     help="With --scale: the instances' rescan_seconds."),
    ])
    original = cmd.callback

    def callback(**kw: Any) -> Any:
        n = kw.pop("scale")
        where, instances = kw.pop("scale_dir"), kw.pop("instances")
        window, rescan = kw.pop("window"), kw.pop("rescan_seconds")
        if n is None:
            return original(**kw)
        from .scale import run_scale

        as_json = kw.get("as_json", False)
        echo = (lambda line: click.echo(line, err=True)) if as_json else click.echo
        if where is not None:
            report = run_scale(os.path.abspath(where), n, 4096, instances=list(instances), window=window,
                               pace=0.05, rescan_seconds=rescan, echo=echo)
        else:
            with tempfile.TemporaryDirectory(prefix="kvtiers-fs-scale-") as tmp:
                report = run_scale(tmp, n, 4096, instances=list(instances), window=window, pace=0.05,
                                   rescan_seconds=rescan, echo=echo)
        if as_json:
            click.echo(json.dumps(report, indent=1))
        return None

    cmd.callback = callback
    return cmd
