"""``kvtiers conformance TYPE``: run the suite against an installed tier and print one line
per rule and level, then a summary; exit 1 on any FAIL."""

from __future__ import annotations

import logging
import os
import sys
import xml.etree.ElementTree as ET

import click

from kvtiers.commands.progress import bar_only
from kvtiers.config import parse_json_option
from kvtiers.errors import ConfigError

from .catalog import RULE_LEVELS, all_checks
from .limits import DEFAULT_LIMITS
from .runner import CheckResult, Report, run_conformance, stuck_checks


@click.command(name="conformance")
@click.argument("tier_type", metavar="TYPE")
@click.option("--config", "config_json", metavar="JSON", help="The tier's options as a JSON object.")
@click.option("--config-file", type=click.Path(exists=True, dir_okay=False), help="A file holding that JSON object.")
@click.option("--level", "levels", metavar="LEVELS",
              help="Comma-separated levels to run (core,durable,shared,bounded), claimed or not. "
                   "Default: the levels the tier claims.")
@click.option("--junit-xml", type=click.Path(dir_okay=False, writable=True), help="Also write a JUnit XML report.")
@click.option("--seed", type=int, help="Seed of the random choices and the stateful test (printed in the summary).")
@click.option("--examples", type=click.IntRange(1),
              help=f"Examples of the Hypothesis stateful test.  [default: {DEFAULT_LIMITS.examples}]")
@click.option("--check-timeout", type=click.FloatRange(min=1),
              help="Seconds one check may run before it FAILs as hung (the run goes on).  "
                   f"[default: {DEFAULT_LIMITS.check_s:g}]")
@click.option("--limits", "limits_json", metavar="JSON",
              help='Other bounds, as a JSON object of kvtiers_conformance.Limits fields, e.g. '
                   '\'{"submit_ms": 200}\' on a loaded machine; the report names each one changed.')
@click.option("--keep", is_flag=True,
              help="Keep what the suite stored in the location --config names (default: remove it).")
@click.option("--strict", is_flag=True,
              help="FAIL a check of a level run that could not run for want of something the tier could "
                   "provide (a hook such as conformance_corrupt, an option); without it the summary says "
                   "NOT CERTIFIED. For certification runs.")
@click.option("-v", "--verbose", is_flag=True,
              help="Also print one line per check, and the tier's warnings about the faults the suite injects.")
def conformance(tier_type: str, config_json: str | None, config_file: str | None, levels: str | None,
                junit_xml: str | None, seed: int | None, examples: int | None, check_timeout: float | None,
                limits_json: str | None, keep: bool, strict: bool, verbose: bool) -> None:
    """Run the conformance suite against tier TYPE (a registered name or pkg.module:Class).

    Without --config the tier's conformance_config(scratch) gives the options, in a scratch
    directory created and removed for each check (a tier without one and without required
    options runs with {}). With --config, what the suite stored there is removed afterwards
    unless --keep. Exit status 1 if any rule FAILs (with --strict, also if a check could
    not run for want of something the tier could provide).
    """
    try:
        limits = DEFAULT_LIMITS.with_overrides(parse_json_option(limits_json, None, "--limits"))
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if examples is not None:
        limits = limits.replace(examples=examples)
    if check_timeout is not None:
        limits = limits.replace(check_s=check_timeout)
    config = None
    if config_json is not None or config_file is not None:
        config = parse_json_option(config_json, config_file)
    root = logging.getLogger()
    if not verbose and root.level == logging.WARNING:
        # the suite corrupts, evicts and kills on purpose; the tier's warnings about that are
        # noise in a report (-v, or kvtiers -v conformance, shows them)
        root.setLevel(logging.ERROR)

    shown: list[tuple[int, str]] = []  # (rule, level) groups already printed
    current: list[Report] = []
    # a bar of checks done on a terminal (stderr); elsewhere the rule lines are the progress
    bar = bar_only(len(all_checks()), f"conformance {tier_type}")

    def start(report: Report) -> None:
        current.append(report)
        levels = ",".join(sorted(report.levels)) or "none"
        click.echo(f"kvtiers conformance {report.tier}: levels {levels}, seed {report.seed}")
        if limits_json:  # a run against bounds other than DESIGN.md's says so at its head
            changed = ", ".join(f"{k} {v} (default {d})" for k, (v, d) in limits.changed().items())
            click.echo(f"limits: {changed or 'the defaults'}")

    def flush(until: tuple[int, str] | None) -> None:
        """Print the lines of every group before ``until`` (all when ``None``)."""
        for rl in RULE_LEVELS:
            if rl == until:
                return
            if rl not in shown:
                shown.append(rl)
                bar.clear()
                click.echo(current[0].rule_result(*rl).line())

    def progress(r: CheckResult) -> None:
        flush((r.check.rule, r.check.level))
        if verbose:
            why = f" ({r.why})" if r.why else ""
            bar.clear()
            click.echo(f"  {r.check.test_name} [{r.check.level}]: {r.status}{why} {r.seconds:.2f}s", err=True)
        bar.advance(note=r.check.test_name)

    try:
        report = run_conformance(tier_type, config, levels=levels, seed=seed, limits=limits,
                                 on_start=start, on_result=progress, keep=keep, strict=strict)
    finally:
        bar.clear()
    flush(None)
    for note in report.notes:
        click.echo(note, err=True)
    click.echo(report.summary())
    if junit_xml:
        write_junit(report, junit_xml)
    if stuck_checks():  # a tier thread that never returns must not keep the process alive
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    if report.failed:
        sys.exit(1)


def write_junit(report: Report, path: str) -> None:
    """Write ``report`` as JUnit XML: one testcase per check, skipped ones included."""
    results = report.results
    n = report.check_counts()  # the same counts the summary's "checks:" prints
    suite = ET.Element("testsuite", {
        "name": f"kvtiers-conformance.{report.tier}",
        "tests": str(len(results)),
        "failures": str(n["FAIL"]),
        "skipped": str(n["SKIP"]),
        "errors": "0",
        "time": f"{report.seconds:.3f}",
    })
    props = ET.SubElement(suite, "properties")
    ET.SubElement(props, "property", {"name": "seed", "value": str(report.seed)})
    ET.SubElement(props, "property", {"name": "levels", "value": ",".join(sorted(report.levels))})
    for r in results:
        case = ET.SubElement(suite, "testcase", {
            "classname": f"conformance.{report.tier}.{r.check.level}",
            "name": r.check.test_name,
            "time": f"{r.seconds:.3f}",
        })
        if r.status == "FAIL":
            node = ET.SubElement(case, "failure", {"message": r.why})
            node.text = r.details or r.why
        elif r.status == "SKIP":
            ET.SubElement(case, "skipped", {"message": ("NOT CERTIFIED: " if r.uncertified else "") + r.why})
    ET.ElementTree(ET.Element("testsuites")).getroot().append(suite)
    tree = ET.ElementTree(suite)
    ET.indent(tree)
    tree.write(path, encoding="utf-8", xml_declaration=True)
