"""`minigpt compare --matrix`: a built-in set of layouts, each trained and simulated, and the error.

Every layout is checked (profile, node size, the simulator's acceptance) before the first one
trains; the rows whose shape the profile has no measured unit of (its Llama or MoE shape not
calibrated: `minigpt calibrate --model tiny,tiny-llama,tiny-moe` measures all three) are named
once on stderr, their compute priced by the roofline. The step-time error is reported as the mean absolute percentage error (MAPE) over the
rows; model-state bytes (parameters, gradients, optimizer) as the worst relative error.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from cli.tools.compare import (
    calibrate_hint, check_compare, machine_drift, median_round, run_compare, warn_unreliable,
)
from cli.tools.plots import time_phases
from job.train_config import TrainConfig
from minigpt.config import GPTConfig
from minigpt.presets import PRESETS

# name -> the layout fields changed from the base configuration (tiny: 4 layers, 4 heads)
MATRIX: dict[str, dict] = {
    "1 rank": {},
    "dp2 zero0": {"dp": 2, "zero": 0},
    "dp2 zero1": {"dp": 2, "zero": 1},
    "dp2 zero2": {"dp": 2, "zero": 2},
    "dp2 zero3": {"dp": 2, "zero": 3},
    "dp4 zero2": {"dp": 4, "zero": 2},
    "tp2": {"tp": 2},
    "tp2 sequence-parallel": {"tp": 2, "sequence_parallel": True},
    "pp2 gpipe": {"pp": 2, "schedule": "gpipe", "micro_batches": 4},
    "pp2 1f1b": {"pp": 2, "schedule": "1f1b", "micro_batches": 4},
    "pp2 interleaved": {"pp": 2, "schedule": "interleaved", "virtual_chunks": 2, "micro_batches": 4},
    "tp2 x dp2 zero1": {"tp": 2, "dp": 2, "zero": 1},
    "tp2 x pp2 x dp2 zero3": {"tp": 2, "pp": 2, "dp": 2, "zero": 3, "micro_batches": 2},
    # the base shape made Llama-style (llama_of): GQA, SwiGLU, RMSNorm, RoPE, untied, no biases
    "llama 1 rank": {"model": "llama"},
    "llama tp2 x dp2 zero1": {"model": "llama", "tp": 2, "dp": 2, "zero": 1},
    # context parallelism: each rank two chunks of every sequence, keys and values around a ring or gathered
    "cp2 ring": {"cp": 2},
    "cp2 allgather": {"cp": 2, "cp_kind": "allgather"},
    "llama cp2 x dp2 zero1": {"model": "llama", "cp": 2, "dp": 2, "zero": 1},
    # the base shape with a mixture of experts (moe_of): its own measured unit, and the experts' all-to-alls over ep
    "moe 1 rank": {"model": "moe"},
    "moe ep2": {"model": "moe", "dp": 2, "ep": 2},
    "moe ep2 x dp4 zero1": {"model": "moe", "dp": 4, "ep": 2, "zero": 1},
}
STATE_ROWS = ("parameters (rank 0)", "gradients (rank 0)", "optimizer (rank 0)")


def warn_before_training(plans: dict, hardware_path: str) -> None:
    """Said once for the matrix, before anything trains: an unreliable profile, and the rows whose shape the profile
    has no measured unit of (the roofline prices their compute) with the calibration that would measure them."""
    import click

    first = next(iter(plans.values()))
    warn_unreliable(first.hardware, hardware_path)
    missing = [name for name, plan in plans.items() if plan.units_missing]
    if missing:
        hint = calibrate_hint([plans[name].cfg.model for name in missing], first.hardware)
        click.echo(f"minigpt: warning: --hardware {hardware_path} has no measured unit of the shape of "
                   f"{len(missing)} row(s) ({', '.join(missing)}): the roofline prices their compute; {hint}", err=True)


def llama_of(model: GPTConfig) -> GPTConfig:
    """`model`'s depth, width, heads, sequence and vocabulary, Llama-style: half as many key/value heads
    (at least one), SwiGLU at 8/3 of the width rounded up to a multiple of 32 (Llama's rule, tiny-llama's
    MLP), RMSNorm, RoPE, an untied head and no biases."""
    llama = PRESETS["tiny-llama"]
    d_ff = -(-8 * model.d_model // 3 // 32) * 32
    return llama.with_(vocab_size=model.vocab_size, seq_len=model.seq_len, n_layers=model.n_layers,
                       n_heads=model.n_heads, n_kv_heads=max(1, model.n_heads // 2), d_model=model.d_model, d_ff=d_ff)


def moe_of(model: GPTConfig) -> GPTConfig:
    """`model`'s depth, width, heads, sequence and vocabulary with a mixture of experts as tiny-moe is to tiny: 8
    experts of half the MLP width (GELU, or the model's MLP kind), each token routed to 2 (as many active MLP
    parameters), dropless, tiny-moe's balance and z losses."""
    moe = PRESETS["tiny-moe"]
    return model.with_(n_experts=moe.n_experts, top_k=moe.top_k, d_expert=max(1, model.d_ff // 2),
                       aux_loss_coef=moe.aux_loss_coef, z_loss_coef=moe.z_loss_coef)


SHAPES = {"llama": llama_of, "moe": moe_of}  # MATRIX's "model": the base shape made so


def matrix_plans(base: TrainConfig, hardware_path: str, out_dir: str, rounds: int) -> dict[str, list]:
    """{layout: one checked ComparePlan per round}, every one before anything trains (a round's run in
    <out>/<layout>/round-<k> when there are several rounds, else in <out>/<layout>)."""
    plans = {}
    for name, changes in MATRIX.items():
        if changes.get("model") in SHAPES:
            changes = {**changes, "model": SHAPES[changes["model"]](base.model)}
        where = Path(out_dir) / name.replace(" ", "-")
        plans[name] = [check_compare(dataclasses.replace(base, out_dir=str(where / f"round-{k + 1}" if rounds > 1
                                                                             else where), **changes),
                                     hardware_path, warn=False) for k in range(rounds)]
    return plans


def run_matrix(base: TrainConfig, hardware_path: str, out_dir: str, rounds: int = 1, retime: bool = True) -> dict:
    """Every layout of MATRIX trained and simulated `rounds` times, the rounds interleaved (round 1 in MATRIX's
    order, round 2 in reverse, ...), so that a machine drifting over minutes moves every layout alike. Each round
    predicts with the units timed beside its training (retime; parallel/calibrate/retime.py). A row reports the
    round of the median error (its predicted and measured steps), and the spread of the measured steps over the
    rounds ((slowest - fastest) / median)."""
    plans = matrix_plans(base, hardware_path, out_dir, rounds)
    warn_before_training({name: rows[0] for name, rows in plans.items()}, hardware_path)
    names = list(plans)
    reports: dict[str, list[dict]] = {name: [] for name in names}
    drift, confidence = [], None
    for k in range(rounds):
        for name in names if k % 2 == 0 else reversed(names):
            report = run_compare(plans[name][k], retime, reference=not drift)  # the reference block: before the first
            if not drift:
                drift.append(report["machine_drift"])
                confidence = report["prediction_confidence"]
            reports[name].append(report)
    drift.append(machine_drift(plans[names[-1]][0].hardware))  # and after the last
    rows = [matrix_row(name, reports[name]) for name in names]
    errors = [abs(row["step_time_error"]) for row in rows]
    return {
        "hardware": hardware_path,
        "rounds": rounds,
        "units_retimed": retime,
        "rows": rows,
        "step_time_mape": sum(errors) / len(errors),
        "worst_model_state_error": max(row["model_state_error"] for row in rows),
        "machine_drift": [d for d in drift if d is not None],
        "prediction_confidence": confidence,  # the profile's, and the CPU share before the first layout
    }


def matrix_row(name: str, reports: list[dict]) -> dict:
    """One layout's row from its rounds' reports: the round of the median step-time error (the lower of the two
    middle ones for an even count), the spread of the measured and predicted steps over the rounds."""
    from parallel.calibrate.noise import spread

    median = median_round(reports)
    by_name = {row["name"]: row for row in median["rows"]}
    measured = [r["measured_step_time_s"] for r in reports]
    predicted = [r["predicted_step_time_s"] for r in reports]
    return {
        "layout": name,
        "predicted_step_time_s": median["predicted_step_time_s"],
        "measured_step_time_s": median["measured_step_time_s"],
        "step_time_error": median["step_time_relative_error"],
        "measured_spread": spread(measured),  # None for one round
        "predicted_spread": spread(predicted),
        "rounds": [{"predicted_step_time_s": p, "measured_step_time_s": m, "step_time_error": r["step_time_relative_error"]}
                   for p, m, r in zip(predicted, measured, reports)],
        "model_state_error": max(abs(by_name[r]["relative_error"] or 0.0) for r in STATE_ROWS),
        "activations_error": by_name["activations (rank 0)"]["relative_error"],
        "traces": median["traces"],
        "phases": time_phases(median["rows"]),  # the median round's, predicted against measured (its picture's)
    }
