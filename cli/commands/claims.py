"""`minigpt claims`: every checkable claim of the seed article, run here, with a verdict.

Thin: it picks the claims (--only), runs their checks (cli/tools/claims*.py) and prints the table,
one JSON object (--json), or writes docs/claims.md (--markdown PATH).
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
from pathlib import Path

import click

from cli.output_file import check_output_file
from minigpt.errors import ConfigError


@contextlib.contextmanager
def _progress(total: int):
    """A progress bar on stderr while the claims run, when stderr is a terminal; a no-op otherwise."""
    if not sys.stderr.isatty():
        yield lambda claim: None
        return
    with click.progressbar(length=total, label="checking claims", file=sys.stderr,
                           item_show_func=lambda name: name) as bar:
        yield lambda claim: bar.update(1, claim.name)


@click.command()
@click.option("--only", "only", multiple=True, metavar="NAME",
              help="Run this claim only (repeat for several); the names are the table's first column.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@click.option("--markdown", "markdown_path", type=click.Path(dir_okay=False),
              help="Also write the table and a paragraph per claim to this file (docs/claims.md).")
def claims(only: tuple[str, ...], as_json: bool, markdown_path: str | None) -> None:
    """Run every checkable claim of the seed article (mixed precision, ZeRO, tensor and pipeline parallelism)
    in seconds on a CPU, simulated where it needs GPUs or a cluster, and print each one's number against ours
    with a verdict: holds, holds with a caveat, or wrong, and why."""
    from cli.claims.registry import run_claims, select
    from cli.claims.report import markdown, report_dict, text_table

    if markdown_path is not None and only:
        raise ConfigError("--markdown writes the whole table: drop --only")
    if markdown_path is not None:
        check_output_file("--markdown", markdown_path, "claims.md")
    chosen = select(only)
    start = time.perf_counter()
    with _progress(len(chosen)) as tick:
        results = run_claims(chosen, tick)
    seconds = time.perf_counter() - start
    if markdown_path:
        Path(markdown_path).write_text(markdown(results, seconds), encoding="utf-8")
    if as_json:
        click.echo(json.dumps(report_dict(results, seconds), allow_nan=False))  # strict JSON: no inf, no nan
        return
    click.echo(text_table(results))
    report = report_dict(results, seconds)
    click.echo(", ".join(f"{n} {verdict}" for verdict, n in report["verdicts"].items()) + f"; {seconds:.1f} s")
    if markdown_path:
        click.echo(f"wrote {markdown_path}")
