"""`minigpt calibrate`'s measurements: this machine's matmuls per format, memory copy, one block, and collectives.

The ranks (started through parallel.launch.elastic.launch) measure on the device parallel.launch.elastic.init_worker
gives them: one CUDA GPU per rank with NCCL when --device is auto (or cuda) and there is a GPU for
every local rank, else the CPU with gloo; --device cuda without a GPU for every rank is bad input
before any rank starts. Each rank reports the device it used (device.describe) and the
profile records that, not what was asked for. Rank 0 measures the matmuls, the copy and the block
alone (parallel/calibrate/device.py, timed by parallel/calibrate/kernels.py; on a CPU on one thread)
while the others wait: one device's own numbers, which the simulator slows by the measured cost of
sharing cores for a job with more ranks. Then parallel/calibrate/host.py measures the "measured"
field (the model's pieces alone, in fp32, the cost of sharing cores, and collectives by group size
and load), which also gives the whole-world collectives below.

- matmuls, per number format: every format of the profile (FORMATS) on a GPU; fp32 alone on a CPU
  unless plan.formats asks for more (a CPU has no TF32, and 16-bit training on a CPU emulates its
  matmuls with fp32 ones: precision/compute.py). peak_flops[format] is the best rate measured in
  that format: a measurement, not a datasheet figure; on a CPU tf32 = fp32.
- matmul efficiency per format: at smallest side n, the mean of the square and GPT-shaped rates
  over that format's peak (1.0 at the best point, by construction).
- collectives (ranks >= 2): all-reduce, all-gather, reduce-scatter (through parallel/comm.py's
  Collectives) among all ranks and p2p (ping-pong inside rank pairs, every pair at once, half
  the round trip) by message size S (the full buffer, comm.py's convention): host.py's
  points with every rank busy; each is the slowest rank's median. A least-squares line
  t = alpha + beta * S per collective is fitted in parallel/calibrate/links.py's `fit_alpha_beta`.
- links with one rank (no collectives): the caller may pass a preset's link figures
  (`links_from`: cli/commands/calibrate.py takes them from simulator/costs/hardware.json's preset whose GPU
  matches the device's name); else half the copy bandwidth with no latency, a placeholder the
  profile and calibrate's output say is one.
- reliability: rank 0's CPU share and the spread of its repeated runs while it measures alone
  (parallel/calibrate/noise.py's Noise), with the caller's probes before and after the ranks
  (`shares`), judged into measured["reliability"].
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

from minigpt.errors import ConfigError, TrainingError, check_positive_int, check_threads_per_rank
from parallel.calibrate.device import (
    CONTEXT_PARALLEL, copy_bytes, describe, measure_block, measure_copy, measure_matmuls, stamp,
)
from parallel.calibrate.host import build_measured, collective_points, measure_host
from parallel.calibrate.kernels import attention_table, measure_attention_rates, preset_attention
from parallel.calibrate.links import fit_alpha_beta, node_and_nic, profile_links
from parallel.calibrate.noise import Noise, reliability
from parallel.calibrate.storage import build_failure_costs, measure_checkpoint
from parallel.launch.elastic import finish_worker, init_worker, launch
from precision.compute import EMULATED_FORMATS
from precision.policy import FLOP_FORMATS

COLLECTIVE_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "p2p")


@dataclass(frozen=True)
class CalibrationPlan:
    ranks: int = 8
    threads_per_rank: int = 1
    matmul_sizes: tuple[int, ...] = (64, 128, 256, 512, 1024)  # on a CPU
    repeats: int = 5
    min_run_s: float = 0.02  # each timed run repeats the operation until it lasts about this long
    copy_bytes: int = 256 * 2**20
    message_bytes: tuple[int, ...] = (4 * 2**10, 32 * 2**10, 256 * 2**10, 2 * 2**20, 8 * 2**20)
    comm_repeats: int = 5
    model: str = "tiny"  # the reference block, sharing and collectives are timed on its shape
    micro_batch: int = 8
    micro_batches: tuple[int, ...] = (1, 2, 4, 8, 16)  # the host units' micro-batch sizes
    sharing_micro_batch: int = 8
    variation_s: float = 1.5  # each busy rank's runs of the sharing block last about this long (parallel/calibrate/host.py)
    device: str = "auto"  # "auto": CUDA when every local rank has a GPU, else the CPU; "cpu"
    cuda_matmul_sizes: tuple[int, ...] = (64, 128, 256, 512, 1024, 2048, 4096, 8192)  # on a GPU
    formats: tuple[str, ...] | None = None  # None: FORMATS on a GPU, fp32 alone on a CPU (default_formats)
    unit_models: tuple[str, ...] = ("tiny",)  # presets whose units are measured (model first)
    context_parallel: tuple[int, ...] = CONTEXT_PARALLEL  # cp sizes whose units are measured (those up to ranks)
    # checkpoint writes and reads (parallel/calibrate/storage.py): bytes per rank, repeats, and where (None: not measured)
    checkpoint_bytes: tuple[int, ...] = (4 * 2**20, 32 * 2**20)
    checkpoint_repeats: int = 3
    storage_dir: str | None = None


DEVICES = ("auto", "cpu", "cuda")
CPU_RANKS = 8  # the default on a CPU: the largest layout `minigpt compare --matrix` trains
FORMATS = FLOP_FORMATS  # the profile's formats: those a hardware file gives peaks and tables in


def default_ranks(device: str) -> int:
    """--ranks left out: one rank per GPU when --device auto or cuda finds CUDA, else CPU_RANKS."""
    gpus = torch.cuda.device_count() if device != "cpu" and torch.cuda.is_available() else 0
    return gpus or CPU_RANKS


def on_cuda(device: str, ranks: int) -> bool:
    """Whether the ranks will measure GPUs (parallel.launch.elastic.init_worker's rule: a GPU for every local rank)."""
    return device != "cpu" and torch.cuda.is_available() and torch.cuda.device_count() >= ranks


def default_formats(device: torch.device) -> tuple[str, ...]:
    """Every format on a GPU; fp32 alone on a CPU (where 16-bit training runs fp32 matmuls)."""
    return FORMATS if device.type == "cuda" else ("fp32",)


def check_formats(formats: tuple[str, ...] | None, cuda: bool) -> tuple[str, ...] | None:
    """The formats asked for, in FORMATS' order; ConfigError on anything a profile cannot hold."""
    if formats is None:
        return None
    text = ",".join(formats)
    unknown = [f for f in formats if f not in FORMATS]
    if unknown or not formats or len(set(formats)) != len(formats):
        raise ConfigError(f"--formats must be distinct formats among {','.join(FORMATS)}, got {text!r}")
    if "fp32" not in formats:
        raise ConfigError(f"--formats must include fp32 (every profile has an fp32 peak), got {text!r}: add fp32")
    if "tf32" in formats and not cuda:
        raise ConfigError("--formats tf32 needs CUDA GPUs: a CPU has no TF32 (its profile sets tf32 = fp32): "
                          "leave tf32 out")
    return tuple(f for f in FORMATS if f in formats)


def make_plan(ranks: int | None, quick: bool = False, threads_per_rank: int | None = None, model: str = "tiny",
              micro_batch: int = 8, device: str = "auto", micro_batches: tuple[int, ...] | None = None,
              formats: tuple[str, ...] | None = None, cp: tuple[int, ...] | None = None) -> CalibrationPlan:
    """The measurements of one calibration; ConfigError on bad input (before any rank starts)."""
    if device not in DEVICES:
        raise ConfigError(f"--device must be one of {', '.join(DEVICES)}, got {device!r}")
    ranks = default_ranks(device) if ranks is None else ranks
    for name, value in (("--ranks", ranks), ("--micro-batch", micro_batch)):
        check_positive_int(name, value)
    if threads_per_rank is not None:
        check_threads_per_rank("--threads-per-rank", threads_per_rank)
    if micro_batches is not None and (not micro_batches or any(
            isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in micro_batches)
            or list(micro_batches) != sorted(set(micro_batches))):
        raise ConfigError(f"--micro-batches must be increasing positive integers such as 1,2,4,8, "
                          f"got {','.join(map(str, micro_batches)) if micro_batches else 'none'}")
    if device == "cuda":
        from parallel.device import check_device

        check_device("cuda", ranks)  # a GPU for every rank, or one ConfigError line
    formats = check_formats(formats, on_cuda(device, ranks))
    from minigpt.presets import preset

    models = tuple(name.strip() for name in model.split(","))
    for name in models:
        preset(name)  # ConfigError for an unknown preset
    if len(set(models)) != len(models):
        raise ConfigError(f"--model names a preset twice: {model!r}")
    model = models[0]
    threads = threads_per_rank or (1 if ranks > 1 else torch.get_num_threads())
    context_parallel = check_context_sizes(cp, ranks)
    if quick:
        return CalibrationPlan(ranks, threads, (64, 256, 512), 3, 0.005, 16 * 2**20,
                               (4 * 2**10, 256 * 2**10, 8 * 2**20), 3, model, micro_batch,
                               tuple(micro_batches or (1, 4, 16)), device=device, cuda_matmul_sizes=(256, 1024, 4096),
                               formats=formats, unit_models=models, context_parallel=context_parallel,
                               checkpoint_bytes=(2**20, 8 * 2**20), checkpoint_repeats=1, variation_s=0.3)
    return CalibrationPlan(ranks, threads, model=model, unit_models=models, micro_batch=micro_batch, device=device,
                           micro_batches=tuple(micro_batches or CalibrationPlan.micro_batches), formats=formats,
                           context_parallel=context_parallel)


def check_context_sizes(cp: tuple[int, ...] | None, ranks: int) -> tuple[int, ...]:
    """--cp's sizes (None: CONTEXT_PARALLEL), each > 1 and at most the ranks; (1,): none."""
    if cp is None:
        return CONTEXT_PARALLEL
    if cp == (1,):
        return ()
    if not cp or any(isinstance(c, bool) or not isinstance(c, int) or not 1 < c <= ranks for c in cp):
        raise ConfigError(f"--cp must list context-parallel sizes from 2 to --ranks ({ranks}) such as 2,4, or 1 for "
                          f"none, got {','.join(map(str, cp)) if cp else 'none'}")
    return tuple(sorted(set(cp)))


def calibrate(plan: CalibrationPlan) -> list[dict]:
    """Run the measurements on plan.ranks local ranks; every rank's raw measurements, by rank."""
    return launch(measure_rank, plan, plan.ranks, threads_per_rank=plan.threads_per_rank)


# ---------------------------------------------------------------- one rank


def measure_rank(plan: CalibrationPlan) -> list[dict] | None:
    """One rank's part: every measurement; rank 0 returns every rank's, the others None."""
    device = init_worker(None if plan.device == "auto" else plan.device)  # CUDA + NCCL or the CPU + gloo
    try:
        if plan.ranks == 1:
            saved = torch.get_num_threads()
            torch.set_num_threads(plan.threads_per_rank)
        try:
            # Rank 0 alone measures the matmuls, the copy and the block (the others wait in a barrier,
            # which takes no CPU): a device's own numbers. What sharing costs is measured apart
            # (host.py's "sharing"), and the simulator applies it to the job's ranks.
            start = stamp(device)
            result, noise = {}, Noise()  # noise: rank 0's CPU share and spreads while it measures alone
            if not dist.is_initialized() or dist.get_rank() == 0:
                threads = torch.get_num_threads()
                torch.set_num_threads(1)
                try:
                    formats = plan.formats or default_formats(device)
                    with noise.timed():
                        result = {"matmuls": measure_matmuls(plan, device, formats),
                                  "copy_bandwidth": measure_copy(plan, device),
                                  "block": measure_block(plan, device)}
                        if device.type == "cuda":  # the fused attention kernel the executor runs
                            result["attention"] = measure_attention_rates(device, plan.min_run_s, plan.repeats)
                finally:
                    torch.set_num_threads(threads)
            if dist.is_initialized():
                dist.barrier()
            compute_s = stamp(device) - start
            result["device"] = describe(device)  # what this rank measured on
            result["host"] = measure_host(plan, device, noise)  # starts with a barrier
            result["host"]["seconds"] = {"matmuls_copy_block": compute_s, **result["host"]["seconds"]}
            result["noise"] = noise.as_dict(on_cpu=device.type == "cpu")
            result["checkpoint"] = measure_checkpoint(plan, device)
        finally:
            if plan.ranks == 1:
                torch.set_num_threads(saved)
        if not dist.is_initialized():
            return [result]
        gathered: list | None = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
        dist.gather_object(result, gathered, dst=0)
        return gathered
    finally:
        finish_worker()


# ---------------------------------------------------------------- from measurements to a profile


def _load_average() -> float | None:
    try:
        return round(os.getloadavg()[0], 2)
    except (AttributeError, OSError):
        return None


def measured_device(measured: list[dict]) -> dict:
    """The device every rank measured on (device.describe); TrainingError if they differ."""
    kinds = {(r["device"]["type"], r["device"]["backend"]) for r in measured}
    if len(kinds) != 1:
        raise TrainingError(f"the ranks measured on different devices: {sorted(kinds)}")
    return measured[0]["device"]


def format_tables(matmuls: dict) -> tuple[dict, dict, dict]:
    """(peak_flops, matmul_efficiency tables, a note per format) from rank 0's measure_matmuls.

    A format's peak is the best rate measured in it (square or GPT-shaped); its efficiency at
    smallest side n is the mean of the two shapes' rates over that peak."""
    peaks, tables, notes = {}, {}, {}
    for fmt in FORMATS:
        if fmt not in matmuls["rates"]:
            reason = matmuls.get("refused", {}).get(fmt)
            notes[fmt] = {"status": f"refused by the device: {reason}" if reason else "not measured"}
            continue
        square, gpt = matmuls["rates"][fmt]["square"], matmuls["rates"][fmt]["gpt"]
        sizes = sorted(square)
        peak = max(max(square.values()), max(gpt.values()))
        peaks[fmt] = peak
        tables[fmt] = [[n, round(min(1.0, max((square[n] + gpt[n]) / 2 / peak, 1e-6)), 6)] for n in sizes]
        notes[fmt] = {"status": "measured", "peak_flops": peak, "spread": matmuls.get("spread", {}).get(fmt),
                      "rates": {"square": {str(n): square[n] for n in sizes}, "gpt": {str(n): gpt[n] for n in sizes}}}
    return peaks, tables, notes


def measured_collectives(measured: list[dict], plan: CalibrationPlan) -> dict:
    """{kind: {"ranks", "alpha", "beta", "points"}} among all ranks (p2p: in pairs); {} with one rank."""
    collectives: dict = {}
    if plan.ranks == 1:
        return collectives
    series = collective_points([r["host"] for r in measured])
    for kind in COLLECTIVE_KINDS:
        # all ranks in one group; p2p: the most pairs busy at once (every rank when the ranks are even)
        busy = max(key[2] for key in series if key[:2] == ("p2p", 2)) if kind == "p2p" else plan.ranks
        points = series[(kind, 2 if kind == "p2p" else plan.ranks, busy)]
        alpha, beta = fit_alpha_beta(points)
        collectives[kind] = {"ranks": plan.ranks if kind != "p2p" else 2, "alpha": alpha, "beta": beta,
                             "points": points}
    return collectives


def describe_measurement(device: dict, plan: CalibrationPlan, cores: int, formats: list[str]) -> tuple[str, str, str]:
    """(what was measured, for the source; the calibration note; the peak note); formats: those measured."""
    missing = [f for f in FORMATS if f not in formats and not (f == "tf32" and device["type"] != "cuda")]
    unmeasured = f"; not measured: {', '.join(missing)} (calibration.formats says why)" if missing else ""
    backend = device["backend"]
    if device["type"] == "cuda":
        about = (f"{', '.join(formats)} matmuls on {plan.ranks} CUDA GPU(s) {device['name']}, one rank per GPU, "
                 f"{backend} between them; peak_flops per format is the best matmul rate measured in that format "
                 f"(fp32 with TF32 off, tf32 with it on, fp8 = torch._scaled_mm e4m3 without fast accumulation), not "
                 f"the datasheet's{unmeasured}")
        note = (f"{plan.ranks} rank(s), one CUDA GPU each ({device['name']}), {backend}: rank 0 measured the matmuls, "
                f"the copy and the block alone; the collectives ran with every rank busy; 'measured' holds the units "
                f"(fp32), the sharing (a GPU per rank: about 1) and the collectives by group size and load")
        peak_note = ("peak_flops[format] = the best measured rate in that format, not a datasheet figure; efficiency = "
                     "measured rate / that peak; fp32 with TF32 off (torch.backends.cuda.matmul.allow_tf32 = False "
                     "while the matmuls ran), tf32 with it on")
        return about, note, peak_note
    others = [f for f in formats if f != "fp32"]
    about = (f"{', '.join(formats)} matmuls on the CPU, one rank on one of {cores} core(s) (up to {plan.ranks} ranks "
             f"for the collectives and the sharing), {backend} between them; peak_flops per format is the best "
             f"measured matmul rate (a CPU has no datasheet peak here), tf32 = fp32 (no TF32 on a CPU); "
             + (f"{', '.join(others)} measured with torch's native CPU kernels, of which 16-bit training on a CPU uses "
                f"none (precision/compute.py emulates 16-bit matmuls with fp32 ones)" if others
                else "16-bit training on a CPU emulates its matmuls with fp32 ones (precision/compute.py)")
             + unmeasured)
    note = (f"{plan.ranks} rank(s) on {cores} core(s): rank 0 measured the matmuls, the copy and the block "
            f"alone on one thread; the collectives ran on {plan.threads_per_rank} thread(s) per rank with "
            f"every rank busy; 'measured' holds the units (fp32), the sharing and the collectives by group size "
            f"and load")
    peak_note = ("peak_flops[format] = the best measured rate in that format (the peak of a CPU profile); "
                 "efficiency = measured rate / that peak")
    return about, note, peak_note


def cpu_formats(peaks: dict, tables: dict, notes: dict) -> None:
    """On a CPU, in place: tf32 = fp32 (no TF32), and each 16-bit format not measured natively takes fp32's
    numbers, as a 16-bit training run on a CPU computes with fp32 matmuls (precision/compute.py)."""
    peaks["tf32"] = peaks["fp32"]  # no TF32 on a CPU: its fp32 matmul is the tf32 format too
    notes["tf32"] = {"status": "tf32 = fp32 on a CPU (no TF32)", "peak_flops": peaks["fp32"]}
    for fmt in EMULATED_FORMATS:  # what a 16-bit run on this CPU computes with, unless measured natively
        if peaks.get(fmt) is None:
            peaks[fmt], tables[fmt] = peaks["fp32"], tables["fp32"]
            notes[fmt] = {"status": f"emulated: {fmt} training on a CPU runs fp32 matmuls (precision/compute.py), "
                                    f"so fp32's rates", "peak_flops": peaks["fp32"]}


def build_profile(measured: list[dict], plan: CalibrationPlan, name: str, cores: int, date: str,
                  links_from: dict | None = None, shares: dict | None = None, start_s: float | None = None) -> dict:
    """The hardware profile (hardware.json's schema, one GPU) from every rank's measurements.
    cores: this machine's CPU cores; on CUDA the GPUs used (one per rank) take their place.
    links_from: a preset's link figures (simulator.costs.hardware.preset_links), used when no collective was measured.
    shares: {"before", "after": the CPU share noise.cpu_share found, "allowed_busy": bool}; with it the
    measured object gets its "reliability" (noise.reliability). start_s: the ranks' start (storage.measure_start);
    with it and rank 0's checkpoint points the measured object gets its "failure_costs" (parallel/calibrate/storage.py)."""
    device = measured_device(measured)
    on_gpu = device["type"] == "cuda"
    cores = plan.ranks if on_gpu else cores
    alone = measured[0]  # rank 0 measured the matmuls, the copy and the block alone
    peaks, tables, format_notes = format_tables(alone["matmuls"])
    if not on_gpu:
        cpu_formats(peaks, tables, format_notes)
    if links_from is not None:
        for fmt, note in format_notes.items():
            datasheet = links_from.get("peak_flops", {}).get(fmt)
            if datasheet and note.get("peak_flops"):
                note["of_datasheet"] = round(note["peak_flops"] / datasheet, 4)  # against preset links_from["preset"]
    collectives = measured_collectives(measured, plan)
    links = profile_links(collectives, alone["copy_bandwidth"], links_from)
    try:
        memory = device["memory_bytes"] or os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        memory = 2**34
    source = f"measured by minigpt calibrate on {date}"
    about, note, peak_note = describe_measurement(device, plan, cores, list(alone["matmuls"]["rates"]))
    network = node_and_nic(name, source, plan.ranks, links)
    sizes = sorted(alone["matmuls"]["rates"]["fp32"]["square"])
    gpu = {
        "source": f"{source}: {about}",
        "node": next(iter(network["nodes"])),
        "peak_flops": {fmt: peaks.get(fmt) for fmt in FORMATS},
        "hbm_bytes": int(memory),
        "hbm_bandwidth": alone["copy_bandwidth"],
        "nvlink_bandwidth": links["bandwidth"],
        "nvlink_latency": links["latency"],
        "matmul_efficiency": {"launch_latency": alone["matmuls"]["launch_latency"], **tables},
        "calibration": {
            "date": date, "backend": device["backend"], "device": "cuda" if on_gpu else "cpu",
            "device_name": device["name"], "device_requested": plan.device, "ranks": plan.ranks, "cores": cores,
            "threads_per_rank": plan.threads_per_rank, "ranks_per_core": plan.ranks / cores,
            "oversubscribed": plan.ranks * plan.threads_per_rank > cores,
            "load_average_1min": _load_average(),  # other work on the machine skews every number
            "note": note, "peak_note": peak_note, "links": links["note"],
            "links_preset": None if links["preset"] is None else links["preset"]["preset"],
            "datasheet_preset": None if links_from is None else links_from["preset"],  # of_datasheet's reference
            "formats": format_notes,
            "block": dict(alone["block"]),
            "copy_bytes": copy_bytes(plan, torch.device(device["type"])),
            "plan": {**{k: v for k, v in asdict(plan).items()
                        if k not in ("ranks", "threads_per_rank", "cuda_matmul_sizes", "formats")},
                     "matmul_sizes": sizes, "formats": list(alone["matmuls"]["rates"])},
            "phase_seconds": {k: round(v, 2) for k, v in measured[0]["host"]["seconds"].items()},
        },
        "measured": build_measured([r["host"] for r in measured], plan, fit_alpha_beta),
    }
    attention = (attention_table(alone.get("attention"), peaks.get("bf16"))
                 or preset_attention(links_from, peaks.get("bf16"))) if on_gpu else None
    if attention is not None:
        gpu["attention_efficiency"] = attention
    if shares is not None:
        gpu["measured"]["reliability"] = reliability(shares["before"], shares["after"], alone.get("noise"),
                                                     alone["block"].get("spread"), alone["matmuls"].get("spread"),
                                                     shares.get("allowed_busy", False),
                                                     alone["host"]["sharing"].get("threads_ratio"))
    if alone.get("checkpoint") and start_s is not None:  # what a failure costs on this machine
        from parallel.launch.elastic import MONITOR_INTERVAL_S

        gpu["measured"]["failure_costs"] = build_failure_costs(alone["checkpoint"], start_s, MONITOR_INTERVAL_S,
                                                               fit_alpha_beta)
    if collectives:
        gpu["collectives"] = collectives
    return {"about": f"hardware profile {name}: {source}", "gpus": {name: gpu}, **network}
