"""`minigpt compare`: train a layout for K steps and simulate it with a calibrated profile; predicted against measured.

    minigpt calibrate --out profile.json --quick
    minigpt compare --hardware profile.json --dp 2 --steps 6 [--out DIR] [--json]

The profile, the layout and the job are checked (the world must fit the profile's one
node; the simulator must accept the job) before any worker starts. --out DIR holds the
training's trace.json and the simulated step's simulated.json, side by side for
chrome://tracing or Perfetto, and compare.png: the step's phases predicted against measured
(cli/tools/plots.py; the matrix's, a panel per layout, in its directory). Nothing is adjusted to make the two agree.
"""

from __future__ import annotations

import json

import dataclasses

import click

from cli.options import flag, typed
from cli.options.config_file import config_file_option
from cli.options.context import context_options
from cli.options.fsdp import fsdp_options, reshards
from cli.options.batch import batch_options, micro_batch_count, stage_layers_option
from cli.options.model import model_from_options, model_options
from cli.options.precision import AUTO, CPU_PRECISION, optimizer_option, precision_option, training_precision
from minigpt.errors import ConfigError
from job.layout import Layout
from job.train_config import TrainConfig
from parallel.launch.torchrun_env import check_torchrun_variables


def build_compare_config(options: dict) -> TrainConfig:
    """The flags as a checked TrainConfig (K steps, one evaluation batch at the end only). Torch-free."""
    check_torchrun_variables()
    model = model_from_options(options)
    cfg = TrainConfig(
        model=model, steps=options["steps"], global_batch=options["global_batch"],
        micro_batches=micro_batch_count(options["global_batch"], options["dp"], options.get("micro_batches"),
                                        options.get("micro_batch_size")),
        sequence_parallel=options.get("sequence_parallel", False), eval_every=0, eval_batches=1, out_dir=options["out"],
        device="cpu" if options["device"] == "cpu" else "auto",
        precision=CPU_PRECISION if options["precision"] == AUTO else options["precision"],  # auto: resolved below
        tp=options["tp"], pp=options["pp"], dp=options["dp"], cp=options.get("cp", 1), cp_kind=options.get("cp_kind", "ring"),
        ep=options.get("ep", 1), zero=options["zero"], schedule=options["schedule"],
        shard_group=options.get("shard_group", 0),
        reshard_after_forward=reshards(options),
        sync_grads_once=options.get("sync_grads_once", False),
        virtual_chunks=options["virtual_chunks"], stage_layers=options.get("stage_layers", ()),
        threads_per_rank=options["threads_per_rank"],
        tokenizer=options.get("tokenizer") or "bytes",  # the corpus in its ids (--tokenizer sets the vocabulary)
        log_every=max(1, options["steps"]), recompute=options.get("recompute", "none"),
        optimizer=options.get("optimizer") or "adamw",
    )
    if options["precision"] == AUTO:  # the format the training side will compute in, for both sides
        cfg = dataclasses.replace(cfg, precision=training_precision(AUTO, cfg.device, cfg.world_size))
    if cfg.out_dir is None:  # a directory of its own, named now so that it can be claimed before any work
        from parallel.run.files import default_run_dir

        cfg = dataclasses.replace(cfg, out_dir=str(default_run_dir(cfg)))
    return cfg


@config_file_option
@click.command()
@click.option("--hardware", required=True, help="A profile written by `minigpt calibrate --out FILE.json`.")
@click.option("--tp", default=1, show_default=True, type=int)
@click.option("--pp", default=1, show_default=True, type=int)
@click.option("--dp", default=1, show_default=True, type=int)
@context_options
@click.option("--ep", default=1, show_default=True, type=int,
              help="Expert-parallel size: a mixture of experts' experts split over ep ranks of the data-parallel group.")
@click.option("--zero", default=0, show_default=True, type=int)
@fsdp_options
@click.option("--schedule", default="1f1b", show_default=True, help="gpipe, 1f1b, interleaved or zb-h1.")
@click.option("--virtual-chunks", "virtual_chunks", default=1, show_default=True, type=int)
@stage_layers_option
@click.option("--sequence-parallel", "sequence_parallel", is_flag=True, help="Megatron sequence parallelism (tp > 1).")
@batch_options(16, "Global batch: sequences per step over every data-parallel replica.")
@model_options("tiny")
@click.option("--recompute", default="none", show_default=True,
              help="none, selective (the attention core) or full (every block).")
@precision_option
@click.option("--threads-per-rank", "threads_per_rank", type=int, help="[default: 1 with several ranks]")
@click.option("--device", default="auto", show_default=True, type=click.Choice(["auto", "cpu"]))
@optimizer_option()
@click.option("--steps", default=6, show_default=True, type=int, help="Training steps measured (the first is warm-up).")
@click.option("--out", type=str, help="Directory for the run, trace.json, simulated.json and compare.png "
              "[default: runs/...].")
@click.option("--matrix", is_flag=True, help="Run the built-in set of layouts (each sets its own: no layout flag "
              "with it) and report the error.")
@click.option("--rounds", type=int, help="Train and predict each layout this many times, the rounds interleaved; "
              "report the round of the median error and the spread [default: 3 with --matrix, else 1].")
@click.option("--profile-units", "profile_units", is_flag=True,
              help="Price with the profile's units as calibrated, not timed again beside each training.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def compare(as_json: bool, hardware: str, matrix: bool, rounds: int | None, profile_units: bool, **options) -> None:
    """Train a layout for K steps, simulate it with a calibrated profile, print predicted against measured."""
    from cli.tools.compare import check_compare, format_error, format_value, median_round, run_compare
    from cli.tools.plots import NOT_DRAWN, draw_compare, if_drawable
    from minigpt.errors import check_positive_int

    rounds = check_positive_int("--rounds", rounds if rounds is not None else 3 if matrix else 1)
    if matrix:
        check_no_layout_flags()
    cfg = build_compare_config({**options})
    if matrix:
        return compare_matrix(cfg, hardware, options["out"], as_json, rounds, not profile_units)
    plans = [check_compare(dataclasses.replace(cfg, out_dir=f"{cfg.out_dir}/round-{k + 1}") if rounds > 1 else cfg,
                           hardware, warn=k == 0) for k in range(rounds)]
    reports = [run_compare(plan, not profile_units) for plan in plans]
    report = median_round(reports)
    if rounds > 1:
        report = {**report, "rounds": [{key: r[key] for key in ("predicted_step_time_s", "measured_step_time_s",
                                                               "step_time_relative_error", "run_dir", "machine_drift")}
                                       for r in reports]}  # each round's drift: the machine timed before it
    report["plot"] = if_drawable(draw_compare, report, f"{cfg.out_dir}/compare.png")  # beside the run (its rounds)
    if as_json:
        click.echo(json.dumps(report))
        return
    from cli.output import format_table

    lay = report["layout"]
    context = f" x cp {lay['cp']} ({lay['cp_kind']})" if lay.get("cp", 1) > 1 else ""
    context += f", ep {lay['ep']}" if lay.get("ep", 1) > 1 else ""
    click.echo(f"tp {lay['tp']}{context} x pp {lay['pp']} x dp {lay['dp']} (zero {lay['zero']}, {lay['schedule']}), "
               f"{cfg.steps} steps, batch {cfg.global_batch} in {cfg.micro_batches} micro-batch(es), "
               f"{cfg.precision}, profile {report['hardware']}")
    rows = [[r["name"], format_value(r["predicted"], r["unit"]), format_value(r["measured"], r["unit"]),
             format_error(r["relative_error"])] for r in report["rows"]]
    click.echo(format_table(["quantity", "predicted", "measured", "error"], rows))
    for r in report["rows"]:
        if r["note"]:
            click.echo(f"  {r['name']}: {r['note']}")
    click.echo(f"traces: {report['traces']['measured']} (measured), {report['traces']['simulated']} (simulated)")
    click.echo(f"picture: {report['plot'] or NOT_DRAWN} (predicted against measured, by phase)")
    if rounds > 1:
        echo_rounds(report["rounds"])
    echo_drift(report["machine_drift"])


def echo_rounds(rounds: list[dict]) -> None:
    from cli.tools.compare import drift_too_large, format_error, format_value
    from parallel.calibrate.noise import spread

    measured = [r["measured_step_time_s"] for r in rounds]
    moved = [k + 1 for k, r in enumerate(rounds) if drift_too_large(r.get("machine_drift"))]
    click.echo(f"{len(rounds)} rounds (the table is the round of the median error): step time measured "
               + ", ".join(format_value(m, "s") for m in measured) + f" (spread {spread(measured):.0%}), errors "
               + ", ".join(format_error(r["step_time_relative_error"]) for r in rounds)
               + (f"; the machine had moved from its calibration before round(s) {', '.join(map(str, moved))}: "
                  "recalibrate for a fair comparison" if moved else ""))


def echo_drift(drift: dict | None) -> None:
    from cli.tools.compare import drift_too_large

    if drift is not None:
        cores = drift.get("cores")
        click.echo(f"this machine against its calibration: {drift['reference']} takes {drift['now_s'] * 1e3:.2f} ms "
                   f"now, {drift['calibrated_s'] * 1e3:.2f} ms then ({drift['change']:+.1%})"
                   + ("" if cores is None else
                      f"; on {cores['threads']} threads {cores['now_ratio']:.2f}x of one thread's time now, "
                      f"{cores['calibrated_ratio']:.2f}x then ({cores['change']:+.1%})")
                   + ("; recalibrate for a fair comparison" if drift_too_large(drift) else ""))


MATRIX_SETS = (*(field.name for field in dataclasses.fields(Layout)), "schedule")  # a layout: what MATRIX's rows set


def check_no_layout_flags() -> None:
    """--matrix runs its own layouts, each from the base configuration: a layout flag given with it would leak into
    the rows that leave that field alone (its "1 rank" row at tp 2 under --tp 2), so it is refused."""
    for name in MATRIX_SETS:
        if typed(name):
            given = flag(name)
            raise ConfigError(f"{given} with --matrix: the matrix runs its own layouts; drop {given} "
                              "(or drop --matrix to compare that layout)")


def compare_matrix(cfg, hardware: str, out: str | None, as_json: bool, rounds: int, retime: bool) -> None:
    import time

    from cli.output import format_table
    from cli.tools.compare import format_error, format_value
    from cli.tools.compare_matrix import run_matrix
    from cli.tools.plots import NOT_DRAWN, draw_compare_matrix, if_drawable

    out_dir = out or f"runs/compare-matrix-{time.strftime('%Y%m%d-%H%M%S')}"
    report = run_matrix(cfg, hardware, out_dir, rounds, retime)
    report["plot"] = if_drawable(draw_compare_matrix, report, f"{out_dir}/compare.png")
    if as_json:
        click.echo(json.dumps(report))
        return
    rows = [[r["layout"], format_value(r["predicted_step_time_s"], "s"), format_value(r["measured_step_time_s"], "s"),
             format_error(r["step_time_error"]), format_spread(r["measured_spread"]), format_error(r["model_state_error"]),
             format_error(r["activations_error"])] for r in report["rows"]]
    click.echo(format_table(["layout", "predicted step", "measured step", "error", "measured spread", "model states",
                             "activations"], rows))
    how = (f"{rounds} interleaved rounds, each row the round of the median error" if rounds > 1 else "one round")
    units = "units timed beside each training" if retime else "the profile's units"
    click.echo(f"step-time MAPE {report['step_time_mape']:.1%} over {len(rows)} layouts ({how}; {units}); worst "
               f"model-state error {report['worst_model_state_error']:.2%}; traces under {out_dir}")
    click.echo(f"picture: {report['plot'] or NOT_DRAWN} (predicted against measured, by phase, a panel per layout)")
    for drift in report["machine_drift"]:
        echo_drift(drift)
    if report.get("prediction_confidence"):
        click.echo(report["prediction_confidence"]["line"])


def format_spread(value: float | None) -> str:
    """A spread over rounds, (slowest - fastest) / median: "-" for one round."""
    return "-" if value is None else f"{value:.0%}"
