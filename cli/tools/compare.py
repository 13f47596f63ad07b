"""Predicted against measured: run a layout for K steps, simulate the same layout with a calibrated profile.

`check_compare(cfg, hardware_path)` does every check (the profile loads, the layout fits its
node, the simulator accepts the job) before any worker starts; `run_compare` then trains,
simulates and pairs the numbers. Nothing here adjusts either side to make them agree.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path

from minigpt.errors import ConfigError
from job.train_config import TrainConfig

MEMORY_KINDS = ("parameters", "gradients", "optimizer", "activations")


@dataclass
class ComparePlan:
    cfg: TrainConfig
    hardware: object  # simulator.costs.hardware.Hardware
    cluster: object  # simulator.network.topology.Cluster
    layout: object  # job.layout.Layout
    micro_batch: int
    claim: object = None  # parallel.run.directory.RunClaim on cfg.out_dir, checked; run_compare takes and releases it
    units_missing: str | None = None  # the simulation's host: what of this shape the profile did not measure


def relative_error(predicted: float | None, measured: float | None) -> float | None:
    """(predicted - measured) / measured; None when either is missing or measured is 0."""
    if predicted is None or measured is None or measured == 0:
        return None
    return (predicted - measured) / measured


def check_compare(cfg: TrainConfig, hardware_path: str, warn: bool = True) -> ComparePlan:
    """Everything checkable before any rank starts; ConfigError on bad input. warn: say on stderr, before
    anything trains, when the profile is marked unreliable (calibrated on a busy machine)."""
    from simulator.costs.hardware import load_hardware
    from job.layout import Layout
    from simulator.network.topology import build_cluster

    if not hardware_path:
        raise ConfigError("--hardware needs a profile file: write one with `minigpt calibrate --out profile.json`")
    if str(hardware_path).endswith(".json") and not Path(hardware_path).is_file():
        raise ConfigError(f"--hardware {hardware_path!r} does not exist: write it with "
                          f"`minigpt calibrate --out {hardware_path}`")
    hardware = load_hardware(hardware_path)
    if warn:
        warn_unreliable(hardware, hardware_path)
    per_node = hardware.node.gpus_per_node
    if cfg.world_size > per_node:
        raise ConfigError(f"tp x cp x pp x dp = {cfg.world_size} ranks do not fit the profile's node of {per_node} "
                          f"devices: compare runs on one node, choose a smaller layout")
    layout = Layout.of(cfg)
    # One node of the profile's hardware, filled as far as the layout needs: the simulator
    # wants exactly tp x pp x dp devices (as `minigpt simulate` does for a partly filled server).
    cluster = build_cluster(hardware, cfg.world_size, 1)
    micro_batch = cfg.global_batch // (cfg.micro_batches * cfg.dp)
    plan = ComparePlan(cfg, hardware, cluster, layout, micro_batch)
    result = simulate(plan)  # the simulator must accept the job before any training starts
    plan.units_missing = (result.host or {}).get("units_missing")
    if warn and plan.units_missing:
        import click

        click.echo(f"minigpt: warning: --hardware {hardware_path}: {plan.units_missing}; "
                   f"{calibrate_hint([cfg.model], hardware)}", err=True)
    from parallel.run.directory import RunClaim

    plan.claim = RunClaim(cfg.out_dir, resume=False, overwrite=False)  # a fresh --out of its own, or refused
    return plan


def warn_unreliable(hardware, hardware_path: str) -> None:
    """On stderr, before anything trains: a profile marked unreliable (calibrated on a busy machine)."""
    reliability = profile_reliability(hardware)
    if reliability is not None and not reliability.get("reliable"):
        import click

        from parallel.calibrate.noise import summary

        click.echo(f"minigpt: warning: --hardware {hardware_path}: {summary(reliability, 'prediction')}", err=True)


def calibrate_hint(models, hardware) -> str:
    """How to measure the units of `models` (shapes the profile lacks): the presets of their shapes (a unit's shape,
    simulator/costs/host.py's unit_key) beside those the profile was calibrated with."""
    from minigpt.presets import PRESETS
    from simulator.costs.host import unit_key

    def preset_of(model) -> str | None:
        return next((name for name, preset in PRESETS.items() if unit_key(preset, 1) == unit_key(model, 1)), None)

    calibrated = list((hardware.gpu.calibration or {}).get("plan", {}).get("unit_models", []))
    wanted = [name for name in map(preset_of, models) if name]
    if not wanted:
        return "calibrate measures presets only, and no preset has this shape"
    names = list(dict.fromkeys([*calibrated, *wanted]))
    if names == calibrated:
        return "its calibration has the shape, not this layout's split or format"
    return f"`minigpt calibrate --model {','.join(names)}` measures {'it' if len(models) == 1 else 'them'}"


def simulate(plan: ComparePlan):
    from dataclasses import replace

    from simulator.engine.overlap import stack_default
    from simulator.engine.simulate import simulate_step

    cfg = plan.cfg
    implementation = replace(stack_default("executor", "flash", cfg.recompute), optimizer=cfg.optimizer)
    return simulate_step(cfg.model, plan.layout, plan.cluster, cfg.precision, cfg.global_batch, plan.micro_batch,
                         cfg.schedule, cfg.virtual_chunks, cfg.recompute, profile=plan.hardware.gpu.matmul_efficiency,
                         gpu=plan.hardware, bucket_mb=cfg.bucket_mb, threads_per_rank=cfg.threads_per_rank,
                         implementation=implementation)


def _memory_predicted(result, plan: "ComparePlan") -> dict[str, int]:
    """Rank 0 is pipeline stage 0. Activations are predicted for one micro-batch's forward,
    which is what training measures (the schedule may keep several in flight)."""
    from precision.policy import policy as policy_of
    from simulator.memory import exchange_buffer_bytes, loss_gradient_bytes, predict_memory, recomputed_bytes

    stages = result.memory.per_stage
    m = stages[0] if stages else result.memory
    cfg = plan.cfg
    one = predict_memory(cfg.model, plan.layout, cfg.precision, plan.micro_batch, cfg.recompute,
                         bucket_mb=cfg.bucket_mb, micro_batches_in_flight=1)
    one_stage = one.per_stage[0] if one.per_stage else one
    # training measures what the forward keeps; a recomputing block's tensors live only in its backward, and so do
    # the context-parallel exchange's buffers the prediction holds at their peak (one block's backward)
    policy = policy_of(cfg.precision)
    transient = recomputed_bytes(cfg.model, plan.layout, policy, plan.micro_batch, cfg.recompute)
    transient += exchange_buffer_bytes(cfg.model, plan.layout, policy, plan.micro_batch)
    if plan.layout.pp == 1:  # rank 0 runs the loss too: its gradients live only in its backward
        transient += loss_gradient_bytes(cfg.model, plan.layout, policy, plan.micro_batch)
    return {"parameters": m.parameters, "gradients": m.gradients,
            "optimizer": m.master_weights + m.adam_m + m.adam_v, "activations": one_stage.activations - transient}


def _memory_measured(memory: dict) -> dict[str, int]:
    return {"parameters": memory["parameters"], "gradients": memory["gradients"],
            "optimizer": memory["master_weights"] + memory["adam_m"] + memory["adam_v"],
            "activations": memory["activations"]}


def _row(name: str, unit: str, predicted, measured, note: str = "") -> dict:
    return {"name": name, "unit": unit, "predicted": predicted, "measured": measured,
            "relative_error": relative_error(predicted, measured), "note": note}


def pair(plan: ComparePlan, summary: dict, result) -> list[dict]:
    """The rows predicted against measured (seconds per step, bytes on rank 0)."""
    cfg = plan.cfg
    measured = summary["time_breakdown"]
    b = result.breakdown
    tp_measured, ep_measured = measured.get("tp_s", 0.0), measured.get("ep_s", 0.0)
    compute_measured = measured.get("compute_s")
    exchange = b.get("cp_comm", 0.0) if cfg.cp > 1 else 0.0  # the ring runs inside the compute actions
    # the exposed dp traffic after the last compute, as the measured row times it; the rest (ZeRO-3's gathers, the
    # reductions a backward waits for) inside the compute actions, as measured
    tail = result.tallies[result.critical_rank].dp_tail
    rows = [
        _row("step time", "s", result.step_time_s, summary["step_time_s"], "measured: median over the steps"),
        _row("compute", "s", b["compute"] + exchange + b["dp_comm"] - tail,
             None if compute_measured is None else compute_measured - tp_measured - ep_measured,
             "measured: the compute actions less their time inside tp collectives"
             + (" and the experts' all-to-alls" if cfg.ep > 1 else "")
             + ("; both with the context-parallel exchange, which runs inside them" if cfg.cp > 1 else "")
             + "; both with the data-parallel waits inside them (ZeRO-3's gathers, reductions a backward waits for)"
             + _units_note(result)),
    ]
    if cfg.ep > 1:
        rows.append(_row("expert all-to-all", "s", b.get("ep_comm", 0.0), ep_measured,
                         "measured: wall time inside the all-to-alls of the compute actions (waiting for the group "
                         "included)"))
    if cfg.cp > 1:
        rows.append(_row("context-parallel exchange", "s", exchange, None,
                         "not measured apart: inside the compute actions (predicted: its exposed part)"))
    if cfg.tp > 1:
        rows.append(_row("tp communication", "s", b["tp_comm"], tp_measured,
                         "measured: wall time inside blocking tp collectives (waiting for the group included)"))
    if cfg.pp > 1:
        rows.append(_row("pipeline p2p + bubble", "s", b["pp_comm"] + b["pipeline_bubble"], measured.get("p2p_s"),
                         "measured: time in the pipeline's sends and receives, waits included"))
        rows.append(_row("bubble", "s", b["pipeline_bubble"], None, "not measured apart: inside the p2p time"))
    rows.append(_row("dp communication + optimizer", "s", tail + b["optimizer"], measured.get("dp_s", 0.0),
                     "after the last backward (the reductions left, the optimizer); the dp waits before it are in "
                     "the compute row, both sides"))
    predicted_memory = _memory_predicted(result, plan)
    measured_memory = _memory_measured(summary["memory_per_rank"][0])
    for kind in MEMORY_KINDS:
        rows.append(_row(f"{kind} (rank 0)", "B", predicted_memory[kind], measured_memory[kind]))
    return rows


def _units_note(result) -> str:
    """What the compute's prediction rests on when the profile has no measured unit of this shape."""
    missing = (result.host or {}).get("units_missing")
    return f"; predicted: {missing}" if missing else ""


def machine_drift(hardware) -> dict | None:
    """How fast this machine runs the profile's reference block now against at calibration.

    `minigpt calibrate` times one block of its model (calibration.block: forward + backward,
    one thread, alone); the same is timed here, in this process, before training. A VM whose
    neighbours got busy, or a laptop that throttles, shows up as a change: a comparison is
    only as good as the calibration is current. And, when the profile has the sharing table's
    threads row, the same block on every core's thread: its time over one thread's, against the
    row's (`cores`): a host whose other work came or went on the cores beside this one moves it
    while one thread's time stays (CI here: 1.06 at calibration, a dp 2 step then predicted 63% too
    slow). Nothing is adjusted with it."""
    import torch

    from parallel.calibrate.measure import CalibrationPlan
    from parallel.calibrate.device import measure_block

    calibration = hardware.gpu.calibration or {}
    block_note = calibration.get("block")
    if not block_note or calibration.get("backend") != "gloo":
        return None
    measured = hardware.gpu.measured
    rows = {(r, t): slowdown for r, t, slowdown in (measured.sharing if measured else ())}
    cores = measured.cores if measured is not None and (1, measured.cores) in rows and measured.cores > 1 else None
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)  # as calibrate's rank 0 measured it
        block = measure_block(CalibrationPlan(model=block_note["model"], micro_batch=block_note["micro_batch"]),
                              torch.device("cpu"))
        ratio_now = None if cores is None else threads_ratio_now(calibration, cores)
    finally:
        torch.set_num_threads(threads)
    then = block_note["forward_s"] + block_note["backward_s"]
    now = block["forward_s"] + block["backward_s"]
    drift = {"reference": f"one {block_note['model']} block, micro-batch {block_note['micro_batch']}, forward + backward",
             "calibrated_s": then, "now_s": now, "change": (now - then) / then, "cores": None}
    if cores is not None:
        ratio_then = rows[(1, cores)]
        drift["cores"] = {"threads": cores, "calibrated_ratio": ratio_then, "now_ratio": ratio_now,
                          "change": ratio_now / ratio_then - 1}
    return drift


def threads_ratio_now(calibration: dict, cores: int) -> float:
    """The sharing table's threads row timed now as parallel/calibrate/host.py's measure_sharing timed it (its
    model's block at its sharing micro-batch, tp 1, pairs of runs in turn)."""
    from minigpt.presets import preset
    from parallel.calibrate.measure import CalibrationPlan
    from parallel.calibrate.device import piece_step, threads_ratio

    plan, block_note = calibration.get("plan", {}), calibration["block"]
    step = piece_step("block", preset(block_note["model"]), 1, plan.get("sharing_micro_batch", block_note["micro_batch"]))
    return threads_ratio(step, cores, 2 * plan.get("repeats", CalibrationPlan.repeats) - 1)


def drift_too_large(drift: dict | None) -> bool:
    """Whether the machine moved past what a fair comparison allows since its calibration: one thread's block by
    more than parallel/calibrate/noise.py's TOLERANCE, or the threads row's ratio by more than RELIABLE_SPREAD (as timed, runs
    taken in turn, its median moved by 0.61-0.70 over eight tries on this project's quiet 2-core VM: 15% at most;
    with the host's other work on the cores beside this one it moved from about 0.6 to 1.06)."""
    from parallel.calibrate.noise import RELIABLE_SPREAD, TOLERANCE

    if drift is None:
        return False
    cores = drift.get("cores")
    return abs(drift["change"]) > TOLERANCE or (cores is not None and abs(cores["change"]) > RELIABLE_SPREAD)


def profile_reliability(hardware) -> dict | None:
    """The profile's measured["reliability"] (parallel/calibrate/noise.py), or None: a preset, or a profile
    calibrated before calibrate recorded its noise."""
    measured = hardware.gpu.measured
    return None if measured is None else measured.reliability


def prediction_confidence(hardware) -> dict:
    """How far the calibration's own noise lets a prediction be trusted: the profile's reliability, its confidence
    (a relative bound, parallel/calibrate/noise.py's), and the CPU share a thread gets now (the measured side's conditions)."""
    from parallel.calibrate.noise import RELIABLE_SHARE, cpu_share, summary

    data = profile_reliability(hardware)
    now = cpu_share()
    line = summary(data, "prediction")
    if now < RELIABLE_SHARE:
        line += f"; this machine is busy now (a thread gets {now:.0%} of a core): the measured side is stretched too"
    return {"known": data is not None, "reliable": None if data is None else data.get("reliable"),
            "confidence": None if data is None else data.get("confidence"),
            "why": None if data is None else data.get("why"), "cpu_share_now": round(now, 4), "line": line}


def run_compare(plan: ComparePlan, retime: bool = True, reference: bool = True) -> dict:
    """Train for cfg.steps, simulate, write simulated.json beside the training's trace.json. retime: on a CPU
    profile, price the step with its units timed again before and after the training (parallel/calibrate/retime.py),
    not as the profile holds them. reference: time the profile's reference block first (machine_drift)."""
    from parallel.run.train import train

    cfg = plan.cfg
    drift = machine_drift(plan.hardware) if reference else None
    confidence = prediction_confidence(plan.hardware)  # before training, as the drift
    retimed = units_retimer(plan) if retime else None
    if retimed is not None:
        retimed.time(plan.hardware.gpu.measured, plan.layout)
    if plan.claim is not None:
        plan.claim.take()
    try:
        summary = train(cfg)
    finally:
        if plan.claim is not None:
            plan.claim.release()
    units_now = []
    if retimed is not None:
        retimed.time(plan.hardware.gpu.measured, plan.layout)
        hardware, units_now = retimed.apply(plan.hardware, plan.layout)
        plan = dataclasses.replace(plan, hardware=hardware, claim=None)
    result = simulate(plan)
    run_dir = Path(summary["run_dir"])
    simulated = result.write_chrome_trace(run_dir / "simulated.json")
    rows = pair(plan, summary, result)
    step = rows[0]
    step["note"] += f"; {confidence['line']}"
    if units_now:
        step["note"] += "; priced with its units timed beside the training: " + ", ".join(
            f"{u['unit']} {_measure(u['now'], u['measure'])} now, {_measure(u['profile'], u['measure'])} in the profile"
            for u in units_now)
    return {
        "layout": summary["layout"],
        "hardware": plan.hardware.name,
        "steps": cfg.steps,
        "global_batch": cfg.global_batch,
        "micro_batches": cfg.micro_batches,
        "precision": cfg.precision,
        "predicted_step_time_s": step["predicted"],
        "measured_step_time_s": step["measured"],
        "step_time_relative_error": step["relative_error"],
        "rows": rows,
        "predicted_breakdown": result.breakdown,
        "measured_breakdown": summary["time_breakdown"],
        "traces": {"measured": str(summary["trace"]), "simulated": str(simulated)},
        "machine_drift": drift,
        "prediction_confidence": confidence,
        "simulated_host": result.host,
        "units_now": units_now,  # the units re-timed beside the training (empty: the profile's as they are)
        "run_dir": str(run_dir),
    }


def median_round(reports: list[dict]) -> dict:
    """Of one layout's rounds, the report of the median step-time error (the lower middle one for an even count)."""
    return sorted(reports, key=lambda r: r["step_time_relative_error"])[(len(reports) - 1) // 2]


def _measure(value: float, measure: str) -> str:
    return f"{value * 1e3:.2f} ms" if measure == "s" else f"{value:.2f}x"


def units_retimer(plan: ComparePlan):
    """A Retimed for the plan's units on a CPU profile (a host of measured units, trained on this CPU); else None."""
    host = plan.hardware.gpu.measured
    if host is None or host.device != "cpu" or not host.units:
        return None
    from parallel.calibrate.retime import Retimed
    from simulator.engine.host import host_threads

    return Retimed(plan.cfg.model, plan.micro_batch, threads=host_threads(host, plan.cfg.world_size,
                                                                          plan.cfg.threads_per_rank))


def format_value(value, unit: str) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    if unit == "s":
        return f"{value * 1e3:.2f} ms"
    return f"{value / 2**20:.3f} MiB" if value >= 2**16 else f"{value} B"


def format_error(error) -> str:
    return "-" if error is None else f"{error:+.1%}"
