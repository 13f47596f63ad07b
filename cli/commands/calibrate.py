"""`minigpt calibrate`: measure this machine and write a hardware profile the simulator loads.

    minigpt calibrate --out profile.json [--ranks 8] [--device auto|cpu|cuda] [--formats fp32,bf16] [--quick]
    minigpt simulate --hardware profile.json ...

The flags are checked, and the output path probed for writing, before any rank starts;
the measurements are parallel/calibrate/measure.py's and parallel/calibrate/host.py's (the GPU
entry's "measured" field: the model's pieces, core sharing, collectives by group and load);
the profile is written atomically (a temporary file in the same directory, then a rename)
and read back with load_hardware. --device auto measures one CUDA GPU per rank with NCCL
when there is a GPU for every rank (the default ranks are then the GPUs), else the CPU with
gloo; the profile says which was used; --device cuda insists on a GPU per rank (one error line
when there is none, before any rank starts). On the CPU the default 8 ranks are the largest layout
`minigpt compare --matrix` trains.

Formats: on CUDA every format's matmuls are measured (fp32 with TF32 off, tf32, bf16, fp16, fp8),
giving per-format peak_flops (the best measured rate, not the datasheet's) and efficiency tables;
on a CPU fp32 alone (16-bit training on a CPU emulates its matmuls with fp32 ones), unless
--formats asks for more (e.g. fp32,bf16,fp8: the per-format path at CPU sizes, for dry runs).
With one rank nothing measures the links: on a GPU whose name matches a preset of
simulator/costs/hardware.json (e.g. "NVIDIA H200" -> h200) the profile takes that preset's link, node
and NIC figures, else half the copy bandwidth with no latency; the profile and the output say which.

A busy machine (parallel/calibrate/noise.py): the CPU share a measuring thread gets is taken before
the ranks start, while rank 0 measures alone and after the ranks end; under half a core at any of
them is refused in one line (exit 2, nothing written) unless --allow-busy. The profile's
measured["reliability"] records the shares and the spread of repeated runs and says whether the
profile is reliable; an unreliable one is written with a warning on stderr.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import shutil
import socket
import tempfile
from pathlib import Path

import click

from cli.options.config_file import config_file_option
from cli.output_file import check_output_file
from minigpt.errors import ConfigError
from parallel.launch.torchrun_env import check_torchrun_variables

DEFAULT_NAME = "cpu-calibrated"  # on CUDA: CUDA_NAME
CUDA_NAME = "cuda-calibrated"


def check_out_path(out: str) -> Path:
    """The profile's path; ConfigError when it cannot be written there."""
    path = check_output_file("--out", out, "profile.json")
    if path.suffix != ".json":
        raise ConfigError(f"--out {out!r} must end in .json (simulate --hardware reads profile files by that name)")
    return path


def write_atomically(data: dict, path: Path) -> None:
    """Write JSON to a temporary file beside `path`, then rename it over `path`."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent if str(path.parent) else ".")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as file:
            file.write(json.dumps(data, indent=2) + "\n")
            file.flush()
            os.fsync(file.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def parse_sizes(text: str | None, flag: str = "--micro-batches") -> tuple[int, ...] | None:
    """"1,2,4,8" -> (1, 2, 4, 8); None stays None; ConfigError on anything else."""
    if text is None:
        return None
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise ConfigError(f"{flag} must be comma-separated integers such as 1,2,4,8, got {text!r}") from None


def parse_formats(text: str | None) -> tuple[str, ...] | None:
    """"fp32,bf16" -> ("fp32", "bf16"); None stays None (make_plan checks the names)."""
    if text is None:
        return None
    return tuple(part.strip() for part in text.split(","))


def run_calibration(out: str, ranks: int | None, quick: bool, threads_per_rank: int | None = None,
                    name: str | None = None, model: str = "tiny", micro_batch: int = 8, device: str = "auto",
                    micro_batches: tuple[int, ...] | None = None, formats: tuple[str, ...] | None = None,
                    allow_busy: bool = False, cp: tuple[int, ...] | None = None) -> dict:
    """Check, measure, write, read back: the profile as written, with the seconds it took.
    ranks None: one per GPU when --device auto finds CUDA, else 8. A machine too busy to measure
    (parallel/calibrate/noise.py: before the ranks start, while rank 0 measures alone, after) is a
    ConfigError before anything is written, unless allow_busy (the profile is then marked unreliable)."""
    import time

    path = check_out_path(out)
    check_torchrun_variables()
    if name is not None and not name.replace("-", "").replace("_", "").replace(".", "").isalnum():
        raise ConfigError(f"--name {name!r} must be letters, digits, dashes, dots or underscores")
    from parallel.calibrate.measure import build_profile, calibrate, make_plan, measured_device
    from parallel.calibrate.host import host_cores
    from parallel.calibrate.storage import measure_start
    from parallel.calibrate.noise import check_quiet, cpu_share
    from simulator.costs.hardware import preset_links

    plan = make_plan(ranks, quick, threads_per_rank, model, micro_batch, device, micro_batches, formats, cp)
    start = time.perf_counter()
    before = check_quiet(cpu_share(), "before", allow_busy)
    storage = tempfile.mkdtemp(prefix=".calibrate-storage-", dir=path.parent)  # checkpoints beside the profile
    try:
        measured = calibrate(dataclasses.replace(plan, storage_dir=storage))
    finally:
        shutil.rmtree(storage, ignore_errors=True)
    start_s = measure_start(plan.ranks, None if plan.device == "auto" else plan.device)
    after = check_quiet(cpu_share(), "after", allow_busy)
    check_quiet(measured[0].get("noise", {}).get("cpu_share_alone"), "alone", allow_busy)
    date = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    used = measured_device(measured)
    name = name or (CUDA_NAME if used["type"] == "cuda" else DEFAULT_NAME)
    links_from = preset_links(used["name"]) if used["type"] == "cuda" else None
    shares = {"before": before, "after": after, "allowed_busy": allow_busy}
    profile = build_profile(measured, plan, name, host_cores(), date, links_from, shares, start_s)
    if used.get("sms"):  # a GPU: GEMMs priced by shape, fitted to the ones it just timed
        from simulator.costs.rates.gemm_fit import add_gemm_model

        add_gemm_model(profile["gpus"][name], used["sms"])
    profile["gpus"][name]["calibration"]["host"] = socket.gethostname()
    profile["gpus"][name]["calibration"]["seconds"] = round(time.perf_counter() - start, 2)
    write_atomically(profile, path)
    from simulator.costs.hardware import load_hardware

    load_hardware(str(path))  # what was written must load
    return profile


@config_file_option
@click.command()
@click.option("--out", required=True, type=str, help="The profile file to write (.json).")
@click.option("--ranks", type=int,
              help="Local ranks, sharing and collectives measured up to this many [default: one per GPU on CUDA, "
                   "else 8]; more ranks than GPUs measure the CPU.")
@click.option("--device", default="auto", show_default=True, type=click.Choice(["auto", "cpu", "cuda"]),
              help="auto: CUDA with NCCL when every rank has a GPU, else the CPU with gloo; cuda: GPUs or an error.")
@click.option("--formats",
              help="Matmul formats to measure, among fp32,tf32,bf16,fp16,fp8 (fp32 always) [default: all on CUDA, "
                   "fp32 on a CPU].")
@click.option("--threads-per-rank", "threads_per_rank", type=int,
              help="Torch threads per rank (default: 1 with several ranks, torch's default with one).")
@click.option("--model", default="tiny", show_default=True,
              help="Model preset whose pieces are timed; a list (tiny,tiny-llama,tiny-moe) times the units of each "
                   "(a mixture of experts' MoE blocks are its own unit), the reference block, sharing and collectives "
                   "on the first.")
@click.option("--micro-batch", "micro_batch", type=int, default=8, show_default=True)
@click.option("--micro-batches", "micro_batches",
              help="The units' micro-batch sizes [default: 1,2,4,8,16; --quick 1,4,16].")
@click.option("--cp", "cp", help="Context-parallel sizes whose units (one rank's two chunks, its ring's blocks timed "
              "alone) are measured, e.g. 2,4; 1: none [default: 2,4,8 up to --ranks].")
@click.option("--name", help=f"The profile's hardware name (default: {DEFAULT_NAME}, on CUDA {CUDA_NAME}).")
@click.option("--quick", is_flag=True,
              help="A few sizes and repeats, for tests: about a minute with 8 ranks on 2 cores (64-66 s measured on a "
                   "shared machine), about 6 s with one rank.")
@click.option("--allow-busy", "allow_busy", is_flag=True,
              help="On a machine too busy to measure (a thread gets under half a core), write the profile marked "
                   "unreliable instead of refusing.")
@click.option("--json", "as_json", is_flag=True, help="Print the profile as JSON.")
def calibrate(out, ranks, device, formats, threads_per_rank, model, micro_batch, micro_batches, cp, name, quick,
              allow_busy, as_json) -> None:
    """Measure this machine (matmuls per format, memory copy, the model's pieces, sharing, collectives) into a
    profile: with gloo on the CPU, or with NCCL on CUDA GPUs."""
    from parallel.calibrate.kernels import SDPA_KERNEL
    from parallel.calibrate.noise import details, summary

    profile = run_calibration(out, ranks, quick, threads_per_rank, name, model, micro_batch, device,
                              parse_sizes(micro_batches), parse_formats(formats), allow_busy, parse_sizes(cp, "--cp"))
    (gpu_name, gpu), = profile["gpus"].items()
    reliability = gpu["measured"].get("reliability")
    if not reliability["reliable"]:
        click.echo(f"minigpt: warning: {out}: {summary(reliability)}", err=True)
    if as_json:
        click.echo(json.dumps(profile, indent=2))
        return
    note = gpu["calibration"]
    if note["device"] == "cuda":
        click.echo(f"wrote {out}: hardware {gpu_name}, {note['ranks']} rank(s) on {note['cores']} CUDA GPU(s) "
                   f"{note['device_name']} ({note['backend']}), {note['seconds']:.1f} s")
    else:
        click.echo(f"wrote {out}: hardware {gpu_name}, {note['ranks']} rank(s) x {note['threads_per_rank']} thread(s) "
                   f"on {note['cores']} core(s) ({note['ranks_per_core']:.2f} ranks per core, {note['backend']}), "
                   f"{note['seconds']:.1f} s")
    click.echo(f"  memory copy {gpu['hbm_bandwidth'] / 1e9:.2f} GB/s, "
               f"matmul launch {gpu['matmul_efficiency']['launch_latency'] * 1e6:.1f} us")
    echo_formats(gpu, note)
    attention = gpu.get("attention_efficiency")
    if attention is not None:
        shares = "; ".join(f"head {size}: " + ", ".join(f"{seq}: {share:.2f}" for seq, share in points)
                           for size, points in attention["causal"].items())
        click.echo(f"  attention ({attention['kernel']}, share of the bf16 peak by sequence): {shares}"
                   + ("" if attention["kernel"] == SDPA_KERNEL else " (the preset's table: not measured here)"))
    click.echo(f"  links: {note['links']}")
    block = note["block"]
    click.echo(f"  one {block['model']} block (micro-batch {block['micro_batch']}): forward {block['forward_s'] * 1e3:.2f} ms, "
               f"backward {block['backward_s'] * 1e3:.2f} ms")
    for kind, fit in gpu.get("collectives", {}).items():
        click.echo(f"  {kind:<15} alpha {fit['alpha'] * 1e6:8.1f} us   beta {fit['beta'] * 1e9:.3f} ns/B "
                   f"({1 / fit['beta'] / 1e9:.2f} GB/s)")
    echo_measured(gpu.get("measured"))
    click.echo(f"  noise: {details(reliability)}")
    click.echo(f"  {summary(reliability)}")
    click.echo(f"  use it: minigpt simulate --hardware {out} --model {block['model']} --precision fp32")


def echo_formats(gpu: dict, note: dict) -> None:
    """One line per format: its measured peak (or why there is none) and its efficiency by smallest side."""
    for fmt, about in note.get("formats", {}).items():
        peak = gpu["peak_flops"].get(fmt)
        if about.get("status") != "measured":
            click.echo(f"  {fmt:<5} {about.get('status')}" + (f": {peak / 1e9:.1f} GFLOP/s" if peak else ""))
            continue
        table = ", ".join(f"{n}: {e:.2f}" for n, e in gpu["matmul_efficiency"][fmt])
        spread = about.get("spread")
        extra = f", runs spread {spread:.0%}" if spread is not None else ""
        if "of_datasheet" in about:
            extra += f", {about['of_datasheet']:.0%} of preset {note.get('datasheet_preset')}'s datasheet"
        click.echo(f"  {fmt:<5} peak (best measured) {peak / 1e12:.3g} TFLOP/s{extra}; efficiency by smallest side: "
                   f"{table}")
        fit = gpu["matmul_efficiency"].get("gemm_model", {}).get(fmt)
        if fit is not None:
            click.echo(f"        GEMM model by shape (fitted to its {about['gemm_fit']['points']} GEMMs, off by "
                       f"{about['gemm_fit']['rms_log_error']:.0%} rms): large {fit['large']:.3f}, k0 {fit['k0']}, "
                       f"fixed {fit['fixed'] * 1e6:.1f} us")


def echo_measured(measured: dict | None) -> None:
    """A few lines on the "measured" field: block times by tp, sharing, and the collectives' fits."""
    if not measured:
        return
    for unit in measured["units"]:
        times = ", ".join(f"{b}: {f * 1e3:.2f}/{w * 1e3:.2f}" for b, f, w in
                          zip(unit["micro_batches"], unit["block_forward"], unit["block_backward"]))
        sp = " sequence-parallel" if unit.get("sequence_parallel") else ""
        cp = f" cp {unit['cp']}" if unit.get("cp", 1) > 1 else ""
        kind = f"MoE block ({unit['experts']['n_experts']} experts)" if unit.get("experts") else "block"
        click.echo(f"  {kind} tp {unit['tp']}{sp}{cp}, {unit.get('dtype', 'fp32')}, forward/backward ms by micro-batch "
                   f"(alone): {times}")
    click.echo("  sharing (ranks x threads: slowdown): "
               + ", ".join(f"{r}x{t}: {s:.2f}" for r, t, s in measured["sharing"]))
    if measured.get("stragglers"):
        click.echo("  the slowest rank of runs taken in step, over their mean (ranks busy: factor): "
                   + ", ".join(f"{r}: {factor:.3f}" for r, t, factor in measured["stragglers"]))
    for fit in measured["collectives"]:
        if fit["group"] == fit["active"] or fit["kind"] == "p2p":
            share = f", {fit['cpu_share']:.0%} of a core computing" if "cpu_share" in fit else ""
            click.echo(f"  {fit['kind']:<15} group {fit['group']} of {fit['active']} busy: alpha "
                       f"{fit['alpha'] * 1e3:.3f} ms, {1 / fit['beta'] / 1e9:.2f} GB/s{share}")
