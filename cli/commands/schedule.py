"""`minigpt schedule`: what every pipeline rank does in one step, drawn, counted and proven.

Torch-free: it only builds, validates and times the schedule (job/schedule.py),
the same lists the torch executor runs and the simulator replays.
"""

from __future__ import annotations

import json
from dataclasses import asdict

import click

from cli.output import format_table


def _rank_rows(schedule, timeline, peaks) -> list[dict]:
    from job.schedule import Compute, DataParallel, PointToPoint, batches, count_kinds

    rows = []
    for rank, actions in enumerate(schedule.actions):
        rows.append({
            "rank": rank,
            "chunks": schedule.config.chunks_of(rank),
            "compute": sum(isinstance(a, Compute) for a in actions),
            "sends_and_receives": sum(isinstance(a, PointToPoint) for a in actions),
            "p2p_batches": sum(isinstance(group[0], PointToPoint) for group in batches(actions)),
            "data_parallel": sum(isinstance(a, DataParallel) for a in actions),
            "peak_activations": peaks[rank],
            "idle_ticks": timeline.makespan - timeline.busy(rank),
            "by_kind": count_kinds(actions),
        })
    return rows


@click.command()
@click.option("--pp", type=int, default=4, show_default=True, help="Pipeline stages (ranks).")
@click.option("--micro-batches", "micro_batches", type=int, default=8, show_default=True,
              help="Micro-batches per step.")
@click.option("--schedule", "kind", default="1f1b", show_default=True,
              help="gpipe, 1f1b, interleaved or zb-h1.")
@click.option("--virtual-chunks", "virtual_chunks", type=int, default=1, show_default=True,
              help="Model chunks per rank (interleaved only).")
@click.option("--zero", "zero_stage", type=int, default=0, show_default=True,
              help="ZeRO stage 0-3: decides the gradient reduction and weight gathers.")
@click.option("--buckets", type=int, default=1, show_default=True, help="Gradient buckets per chunk.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def schedule(pp: int, micro_batches: int, kind: str, virtual_chunks: int, zero_stage: int, buckets: int,
             as_json: bool) -> None:
    """Draw one training step of a pipeline schedule (ticks: forward 1, backward 2), prove it
    complete and deadlock-free, and print its bubble against the textbook formula."""
    from job.schedule import (
        ScheduleConfig,
        build_schedule,
        closed_form_bubble,
        peak_in_flight,
        simulate_order,
    )
    from job.schedule_render import render_timeline

    config = ScheduleConfig(pp, micro_batches, kind, virtual_chunks, zero_stage, buckets)
    built = build_schedule(config)
    timeline = simulate_order(built)  # raises ConfigError if the schedule were wrong
    peaks = peak_in_flight(built)
    rows = _rank_rows(built, timeline, peaks)
    report = {
        "config": asdict(config),
        "valid": True,
        "makespan_ticks": timeline.makespan,
        "bubble_fraction": timeline.bubble_fraction(),
        "closed_form_bubble": closed_form_bubble(pp, micro_batches, kind, virtual_chunks),
        "peak_activations": peaks,
        "ranks": rows,
        "actions": {str(rank): [action.name for action in actions] for rank, actions in enumerate(built.actions)},
    }
    if as_json:
        click.echo(json.dumps(report))
        return
    click.echo(render_timeline(built, timeline))
    click.echo("")
    click.echo(f"schedule {kind}: pp {pp}, {micro_batches} micro-batches, {virtual_chunks} chunk(s) a rank, "
               f"ZeRO-{zero_stage}; valid (complete, matched, deadlock-free)")
    click.echo(f"bubble {report['bubble_fraction']:.4f} of {timeline.makespan} ticks "
               f"(textbook {report['closed_form_bubble']:.4f})")
    click.echo("")
    headers = ["rank", "chunks", "compute", "send/recv", "p2p batches", "dp actions", "peak activations", "idle ticks"]
    table = [[r["rank"], ",".join(map(str, r["chunks"])), r["compute"], r["sends_and_receives"], r["p2p_batches"],
              r["data_parallel"], r["peak_activations"], r["idle_ticks"]] for r in rows]
    click.echo(format_table(headers, table))
