"""Readable rows for simulation results and the scaling plot. Torch-free; matplotlib only when plotting.

Units: seconds; per-GPU memory in GiB (2^30 bytes, the unit of HBM capacities); the
training state of the whole job in decimal GB (1 GB = 1e9 bytes), as model sizes are quoted.
"""

from __future__ import annotations

from pathlib import Path

from minigpt.errors import ConfigError
from precision.policy import policy as precision_policy
from simulator.engine.simulate import DECIMAL_GB, SimResult
from simulator.provenance import summary_rows
from simulator.search.sweep import ScalingSweep

GIB = 2**30
BREAKDOWN_LABELS = {"compute": "compute", "pipeline_bubble": "pipeline bubble", "tp_comm": "exposed tp comm",
                    "cp_comm": "context-parallel exchange (exposed)", "ep_comm": "expert all-to-all (exposed)",
                    "amax_comm": "fp8 amax all-reduces (exposed)", "pp_comm": "exposed pp comm", "dp_comm": "exposed dp comm", "optimizer": "optimizer step"}
MEMORY_LABELS = {"parameters": "parameters", "gradients": "gradients", "master_weights": "master weights",
                 "optimizer_states": "optimizer states (Adam m, v)", "activations": "activations",
                 "comm_buffers": "communication buffers", "total": "total"}


def seconds(value: float) -> str:
    if value == 0:
        return "0"
    if value >= 1:
        return f"{value:.3f} s"
    if value >= 1e-3:
        return f"{value * 1e3:.3f} ms"
    return f"{value * 1e6:.1f} us"


def headline(result: SimResult) -> str:
    lay = result.layout
    chunks = f" x {lay.virtual_chunks} chunks" if lay.virtual_chunks > 1 else ""
    chunks += f" (blocks per chunk {lay.placement})" if lay.stage_layers else ""
    cp = f" x cp {lay.cp} ({lay.cp_kind})" if lay.cp > 1 else ""
    return (f"{result.n_gpus} x {result.gpu}: tp {lay.tp}{cp} x pp {lay.pp} x dp {lay.dp}, {lay.zero_description()}"
            f"{', sequence parallel' if lay.sequence_parallel else ''}, {result.precision}, {result.schedule}{chunks}, "
            f"{result.attention} attention, recompute {result.recompute}, overlap {result.overlap.name}; global batch {result.global_batch} = {result.micro_batches} micro-batches "
            f"of {result.micro_batch} per replica")


def step_rows(result: SimResult) -> list[list[str]]:
    step = result.step_time_s
    rows = [["step time", seconds(step), "100.0%"]]
    shown = {"cp_comm": result.layout.cp > 1, "ep_comm": result.layout.ep > 1,  # no such parallelism, no row
             "amax_comm": result.breakdown.get("amax_comm", 0.0) > 0}  # nor without fp8 amax reductions
    for key, value in result.breakdown.items():
        if shown.get(key, True):
            rows.append([f"  {BREAKDOWN_LABELS[key]}", seconds(value), f"{value / step:.1%}"])
        if key == "ep_comm" and shown["ep_comm"]:  # beside it, what the shared experts hid (not part of the step)
            hidden = result.hidden.get(key, 0.0)
            rows.append(["  expert all-to-all (hidden)", seconds(hidden), "not in the step: " + (
                "not overlapped (--ep-overlap)" if not result.overlap.ep else
                "behind the shared experts" if hidden else "no shared experts to hide behind")])
    per_gpu = (f"{result.tflops_per_gpu:.1f}" if result.tflops_per_gpu >= 1 else f"{result.tflops_per_gpu * 1e3:.1f}")
    active = " (active parameters)" if result.moe else ""
    rows += [["TFLOP/s per GPU" if result.tflops_per_gpu >= 1 else "GFLOP/s per GPU", per_gpu, f"model FLOPs{active}"],
             [f"MFU{', active' if active else ''}", f"{result.mfu:.1%}", f"of the {precision_policy(result.precision).compute} peak"],
             ["throughput", f"{result.samples_per_s:.4g} samples/s", f"{result.tokens_per_s:.4g} tokens/s"]]
    return rows


COLLECTIVE_HEADERS = ["collective", "group", "ranks (servers)", "message", "algorithm", "time", "ring alone"]


def message_size(nbytes: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= size:
            return f"{nbytes / size:.4g} {unit}"
    return f"{nbytes:.0f} B"


def collective_rows(result: SimResult) -> list[list[str]]:
    """Each distinct collective call of the step: the algorithm and protocol NCCL would run it with."""
    return [[c["kind"].replace("_", "-"), c["group"], f"{c['ranks']} ({c['servers']})", message_size(c["bytes"]),
             f"{c['algorithm']}/{c['protocol']}" + (" *" if c.get("note") else ""), seconds(c["seconds"]),
             seconds(c["ring_seconds"])] for c in result.collectives]


def collective_note(result: SimResult) -> str:
    forced = next((c["note"] for c in result.collectives if c.get("note")), None)
    return ("(one row per distinct call; the algorithm NCCL's tuner would pick by predicted time, "
            "simulator/network/nccl.py" + (f"; * {forced}" if forced else "") + ")")


def _labels(result: SimResult) -> dict[str, str]:
    """MEMORY_LABELS, the optimizer states named as the job's optimizer keeps them."""
    if result.provenance.get("implementation", {}).get("optimizer") != "muon":
        return MEMORY_LABELS
    return dict(MEMORY_LABELS, optimizer_states="optimizer states (Muon's momentum, Adam m, v)")


def memory_rows(result: SimResult) -> list[list[str]]:
    per_gpu = result.memory_per_gpu()
    rows = [[_labels(result)[k], f"{v / GIB:.2f} GiB", ""] for k, v in per_gpu.items()]
    capacity = result.memory.capacity or 0
    margin = result.memory_margin_bytes
    verdict = (f"fits, {margin / GIB:.2f} GiB to spare" if result.fits
               else f"does not fit: short by {-margin / GIB:.2f} GiB")
    rows.append([f"capacity ({result.gpu})", f"{capacity / GIB:.2f} GiB", verdict])
    return rows


def memory_why(result: SimResult) -> str | None:
    """Why a layout does not fit, in one line: its largest part and the flags that lower it."""
    if result.fits:
        return None
    parts = result.memory_per_gpu()
    states = sum(parts[k] for k in ("parameters", "gradients", "master_weights", "optimizer_states"))
    if parts["activations"] >= states:
        return (f"why: the activations ({parts['activations'] / GIB:.2f} GiB) are the largest part: the forwards a "
                f"stage keeps for its backward; --recompute, --sequence-parallel, a larger --cp or --pp lower them")
    return (f"why: the model states ({states / GIB:.2f} GiB) are the largest part: --zero shards them over dp x cp, "
            f"--tp and --pp split them")


def provenance_rows(result: SimResult) -> list[list[str]]:
    """What the prediction rests on: efficiency tables, achieved fractions, implementation, overlap."""
    return summary_rows(result.provenance)


def job_rows(result: SimResult) -> list[list[str]]:
    labels = dict(_labels(result), total="training state in all")
    return [[labels[k], f"{v / DECIMAL_GB:,.1f} GB"] for k, v in result.job_state_bytes.items()]


def job_verdict(result: SimResult, n_params: int) -> str:
    capacity = result.memory.capacity or 1
    per_param = result.job_state_bytes["total"] / n_params
    optimizer = "Muon" if result.provenance.get("implementation", {}).get("optimizer") == "muon" else "Adam"
    return (f"{per_param:.0f} bytes per parameter ({result.precision}, {optimizer}): the training state alone needs at least "
            f"{result.gpus_for_state} {result.gpu} GPUs ({capacity / GIB:.0f} GiB each), before any activation or buffer")


def sweep_rows(sweep: ScalingSweep) -> list[list[str]]:
    rows = []
    for p in sweep.points:
        lay = p.result.layout
        cp = f"x{lay.cp}cp" if lay.cp > 1 else ""
        ep = f" (ep {lay.ep})" if lay.ep > 1 else ""
        rows.append([p.gpus, p.global_batch, f"{lay.tp}{cp}x{lay.pp}x{lay.dp}{ep}", p.result.micro_batches,
                     seconds(p.result.step_time_s), f"{p.samples_per_s:.4g}", "-" if p.efficiency is None else f"{p.efficiency:.0%}",
                     "-" if p.marginal is None else f"{p.marginal:.0%}", f"{p.result.mfu:.1%}",
                     f"{p.result.breakdown['pipeline_bubble'] / p.result.step_time_s:.0%}",
                     f"{sum(p.result.breakdown[k] for k in ('dp_comm', 'tp_comm', 'cp_comm', 'ep_comm', 'amax_comm', 'pp_comm')) / p.result.step_time_s:.0%}",
                     "yes" if p.result.fits else "NO"])
    return rows


SWEEP_HEADERS = ["GPUs", "batch", "tp x pp x dp", "micro-batches", "step", "samples/s", "efficiency",
                 "marginal", "MFU", "bubble", "exposed comm", "fits"]


def zero_rows(results: dict[int, SimResult]) -> list[list[str]]:
    return [[f"ZeRO-{s}", seconds(r.step_time_s), seconds(r.breakdown["dp_comm"]), f"{r.memory.total / GIB:.2f} GiB",
             "yes" if r.fits else "NO"] for s, r in results.items()]


ZERO_HEADERS = ["stage", "step", "exposed dp comm", "memory per GPU", "fits"]


def plot_sweep(sweep: ScalingSweep, path: str | Path) -> Path:
    """Throughput against GPUs with linear scaling for reference, and the marginal efficiency against its threshold."""
    path = Path(path)
    if path.suffix.lower() != ".png":
        raise ConfigError(f"the plot is a PNG: give a file name ending in .png, not {path.name!r}")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    gpus = [p.gpus for p in sweep.points]
    throughput = [p.samples_per_s for p in sweep.points]
    first = next((p for p in sweep.points if p.result.fits), sweep.points[0])  # the baseline
    linear = [first.samples_per_s * n / first.gpus for n in gpus]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 7), sharex=True)
    top.plot(gpus, linear, "--", color="grey", label="linear scaling")
    top.plot(gpus, throughput, "o-", label=f"simulated ({sweep.scaling} scaling)")
    stop = sweep.stop
    if stop is not None:
        for axis in (top, bottom):
            axis.axvline(stop.gpus, color="red", alpha=0.4)
        top.annotate(f"stops paying at {stop.gpus}", (stop.gpus, stop.samples_per_s), color="red",
                     textcoords="offset points", xytext=(5, -15))
    top.set_ylabel("samples / s")
    top.set_xscale("log", base=2)
    top.legend()
    marginal = [(p.gpus, p.marginal) for p in sweep.points if p.marginal is not None]
    bottom.plot([g for g, _ in marginal], [m for _, m in marginal], "o-")
    bottom.axhline(sweep.threshold, color="red", linestyle=":", label=f"threshold {sweep.threshold:.0%}")
    bottom.set_ylabel("marginal efficiency\n(added GPU / GPU already there)")
    bottom.set_xlabel("GPUs")
    bottom.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
