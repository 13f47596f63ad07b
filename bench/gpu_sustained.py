"""A training-shaped GEMM's rate in a short burst against back to back for a minute, with the GPU's clocks.

    python bench/gpu_sustained.py --out sustained.json [--seconds 60] [--formats bf16,fp8] [--dry-run]

Why: the GEMM model (simulator/costs/rates/gemm_model.py) rests on microbenchmarks that time a few runs per shape
(OpenXLA's table: a warm-up and five traced runs; Bekman's MAMF: 150), while a training run keeps the tensor cores
busy for hours under the board's power limit. docs/results.md ("what the rest of the gap looks like") finds every
published H100 run slower than predicted by one factor on the tensor-core rate (0.70-0.81) and the A100 runs not;
the clock is the leading candidate. This measures it on the lent GPU instead of taking it from a training table.

What it does, on one GPU (a bare machine: torch and the repository root on PYTHONPATH, nothing else), for each
format of `--formats` in turn (default bf16 then fp8, the DGX-Cloud rows' two):
1. idle `--cool-s` seconds (default 10), then the burst: a warm-up call and 20 calls timed one by one with CUDA
   events, as a microbenchmark times them; their median rate;
2. the sustained run: the same GEMM back to back for `--seconds`, an event every window of calls (about
   0.25 s at the burst's rate), the rate of every window;
3. throughout, `nvidia-smi` sampled every 0.5 s for the SM clock, the board power and the temperature, reported
   for the idle seconds, the sustained run's first second and its last 10 s (null without nvidia-smi; the burst
   itself is too short to sample: its clock is the first second's at best). The GPU is torch's current device,
   given to nvidia-smi by its index: run it without CUDA_VISIBLE_DEVICES reordering.
Then the same for training-shaped work (`--layer-seconds`, 0 to skip): one whole block of GPT-3 175B (minigpt's
Block: LayerNorm, attention through torch's SDPA, GELU MLP, biases; tp 1, one 2048-token sequence, bf16 weights and
activations), forward and backward back to back (the weights' gradients set to None before each, so no accumulation
kernel runs), its burst and its last 10 s in seconds an iteration, beside what the simulator prices for the same ops on
the preset matching the GPU's name (simulator/costs/ops.py's block_ops for our executor, without the gradient
accumulation, priced by simulator/costs/compute.py's op_time: with the preset's tensor_sustained, and without it for
the burst). Why: the presets' GEMM model agrees with this GPU's GEMMs alone, back to back, within 2%, yet published
runs on H100s come out about 9% slower than predicted; a block mixes GEMMs with memory-bound kernels, attention and the
launch gaps between them, and this says whether the presets price that mix as it runs. Then, held, PROFILED
iterations under torch.profiler: the GPU's kernels by class (GEMMs, attention, the memory-bound rest, and the gaps
between kernels), beside the simulator's seconds for its ops of each class and its per-kernel overhead ("classes"):
where a gap between the block's measured and predicted time comes from; and the same for a block of short kernels,
gpt2-124m's over 8 sequences (`minigpt compare`'s model, where the roofline's compute came out at about half the
measured: docs/results.md), "small". On the CPU dry run the classes are torch's ops' own CPU time (the code path
only).
The GEMM's shape is GPT-3 175B's fc1 at tensor parallelism 4, as the DGX-Cloud rows run it: 2048 x 12288 x 12288
(m x n x k, random normal operands). Out: JSON with, per format, the burst's rate, each window's, the mean of the last
10 s and its ratio to the burst, and the clock, power and temperature of each phase, and the block's ("layer"); one
line printed per format and one for the block (about 150 s for the two formats, 40 s for the block at 25 s). Without
CUDA, or with --dry-run, the same code runs on the CPU at 64 x 128 x 128 in fp32 for `--seconds` (default 1 there)
with no cool-down, and the block at width 64 (2 heads, sequence 64, fp32) priced on the h200 preset (not comparable:
the code path only): CI runs it.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from parallel.calibrate.kernels import gemm_call, matmul_mode  # noqa: E402
from minigpt.config import GPTConfig  # noqa: E402
from minigpt.model import Block  # noqa: E402
from minigpt.presets import preset  # noqa: E402

SHAPE = (2048, 12288, 12288)  # GPT-3 175B's fc1 at tp 4: 2048 tokens x (49152 / 4) outputs x 12288 inputs
DRY_SHAPE = (64, 128, 128)
BURST_CALLS = 20
WINDOW_S = 0.25
LAST_S = 10.0
QUERY = "clocks.sm,power.draw,temperature.gpu"
FORMATS = ("bf16", "fp16", "fp8", "fp8_fast", "tf32", "fp32")  # tf32 and fp32 on CUDA only (the CPU dry run: fp32)
LAYER_MODEL = "gpt3-175b"  # one of its blocks, whole: 1.8e9 weights, about 24 TFLOP forward and backward a sequence
DRY_LAYER = GPTConfig(vocab_size=256, seq_len=64, n_layers=1, n_heads=2, d_model=64, d_ff=256)
PROFILED = 5  # block iterations under torch.profiler, after the back-to-back run
SMALL_MODEL, SMALL_BATCH = "gpt2-124m", 8  # a block of short kernels, profiled too: minigpt compare's gpt2 step
ATTENTION_KERNEL = re.compile(r"flash|fmha|attention|sdpa", re.IGNORECASE)  # FlashAttention's, cuDNN's, torch's SDPA
GEMM_KERNEL = re.compile(r"gemm|nvjet|xmma|cutlass|cublas|s16816|splitk", re.IGNORECASE)  # cuBLAS(Lt), CUTLASS
CPU_GEMMS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_addmm_activation"}
CLASSES = ("gemm", "attention", "memory")


class Sampler:
    """nvidia-smi's SM clock (MHz), power (W) and temperature (C) every `period` seconds, in a thread."""

    def __init__(self, index: int | None, period: float = 0.5):
        self.index, self.period, self.samples = index, period, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.available = index is not None and shutil.which("nvidia-smi") is not None

    def _run(self) -> None:
        command = ["nvidia-smi", f"--query-gpu={QUERY}", "--format=csv,noheader,nounits", "-i", str(self.index)]
        while not self._stop.is_set():
            try:
                text = subprocess.run(command, capture_output=True, text=True, timeout=5).stdout.strip()
                values = [float(x) for x in text.split(",")]
                self.samples.append((time.perf_counter(), *values))
            except (OSError, ValueError, subprocess.SubprocessError):
                pass
            self._stop.wait(self.period)

    def __enter__(self) -> "Sampler":
        if self.available:
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self.available:
            self._thread.join()

    def between(self, start: float, end: float) -> dict:
        """Mean, min and max of each quantity sampled in [start, end] (null without samples)."""
        rows = [s[1:] for s in self.samples if start <= s[0] <= end]
        stats = {}
        for i, name in enumerate(("sm_clock_mhz", "power_w", "temperature_c")):
            values = [r[i] for r in rows]
            stats[name] = ({"mean": statistics.fmean(values), "min": min(values), "max": max(values)}
                           if values else None)
        return stats | {"samples": len(rows)}


def timer(device: torch.device):
    """(record, seconds_between): CUDA events on a GPU, the wall clock after a sync on the CPU."""
    if device.type == "cuda":
        def record():
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return record, lambda a, b: a.elapsed_time(b) / 1e3
    return time.perf_counter, lambda a, b: b - a


def burst(call, device: torch.device, flops: int) -> float:
    """Median FLOP/s of BURST_CALLS calls timed one by one after a warm-up call."""
    record, seconds = timer(device)
    call()
    marks = []
    for _ in range(BURST_CALLS):
        start = record()
        call()
        marks.append((start, record()))
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return statistics.median(flops / seconds(a, b) for a, b in marks)


def sustained(call, device: torch.device, flops: int, seconds_wanted: float, rate_guess: float) -> list[list[float]]:
    """[[seconds since the start at the window's end, FLOP/s], ...] of the calls run back to back for about
    `seconds_wanted`, an event every window of about WINDOW_S."""
    record, seconds = timer(device)
    per_window = max(1, round(WINDOW_S * rate_guess / flops))
    windows = max(1, math.ceil(seconds_wanted / WINDOW_S))
    marks = [record()]
    for _ in range(windows):
        for _ in range(per_window):
            call()
        marks.append(record())
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    out, elapsed = [], 0.0
    for a, b in zip(marks, marks[1:]):
        took = seconds(a, b)
        elapsed += took
        out.append([elapsed, per_window * flops / took])
    return out


def measure_format(fmt: str, device: torch.device, args: argparse.Namespace, sampler: Sampler) -> dict:
    """One format's burst and sustained run, after `args.cool_s` idle seconds."""
    m, n, k = SHAPE if device.type == "cuda" else DRY_SHAPE
    flops = 2 * m * n * k
    with matmul_mode(fmt, device):
        call = gemm_call(fmt, m, n, k, device)
        time.sleep(args.cool_s)
        t0 = time.perf_counter()
        rate = burst(call, device, flops)
        t1 = time.perf_counter()
        windows = sustained(call, device, flops, args.seconds, rate)
        t2 = time.perf_counter()
    del call
    last = [r for t, r in windows if t >= windows[-1][0] - LAST_S] or [windows[-1][1]]
    steady = statistics.fmean(last)
    return {"burst_flops_per_s": rate, "windows": windows, "first_window_flops_per_s": windows[0][1],
            "last_10s_flops_per_s": steady, "sustained_over_burst": steady / rate,
            "idle_gpu": sampler.between(t0 - args.cool_s, t0), "first_second_gpu": sampler.between(t1, t1 + 1.0),
            "last_10s_gpu": sampler.between(t2 - LAST_S, t2)}


def layer_call(config: GPTConfig, device: torch.device, batch: int = 1):
    """One forward and backward of a block over `batch` sequences, bf16 on a GPU (fp32 on the CPU dry run)."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    with device:  # built where it runs: GPT-3's 1.8e9 weights initialised on a CPU would take longer than the run
        block = Block(config).to(dtype=dtype)
    x = torch.randn(batch, config.seq_len, config.d_model, device=device, dtype=dtype, requires_grad=True)
    grad = torch.randn(batch, config.seq_len, config.d_model, device=device, dtype=dtype)
    params = list(block.parameters())

    def call() -> None:
        for param in params:
            param.grad = None
        x.grad = None
        block(x).backward(grad)
    return call


def predicted_layer(config: GPTConfig, preset_name: str | None, dtype: str, batch: int = 1) -> dict | None:
    """The simulator's seconds for layer_call's ops on `preset_name`: held (its tensor_sustained) and a burst's."""
    if preset_name is None:
        return None
    from dataclasses import replace  # the simulator only here: the GEMM runs above need torch alone

    from job.layout import Layout
    from precision.policy import policy
    from simulator.costs.compute import op_time
    from simulator.costs.hardware import load_hardware
    from simulator.costs.op_types import Implementation
    from simulator.costs.ops import block_ops
    gpu = load_hardware(preset_name).gpu
    ops = block_ops(config, batch, Layout(), policy(dtype), Implementation())
    kept = [op for op in (*ops.forward, *ops.backward) if not op.name.endswith(".grad_accumulate")]
    burst_gpu = replace(gpu, achieved=replace(gpu.reached, tensor_sustained=()))
    return {"preset": preset_name, "ops": len(kept),
            "held_s": sum(op_time(op, gpu, gpu.matmul_efficiency) for op in kept),
            "burst_s": sum(op_time(op, burst_gpu, burst_gpu.matmul_efficiency) for op in kept),
            "classes": predicted_classes(kept, gpu)}


def predicted_classes(ops, gpu) -> dict:
    """The held seconds of `ops` by class (GEMMs, fused attention, the memory-bound rest: each op's roofline) and
    "overhead", the per-kernel cost compute.py's op_time adds to each (the launch gaps the profile's "gaps" measure)."""
    from simulator.costs.compute import kernel_overhead, op_time
    from simulator.costs.op_types import FusedAttention, Gemm

    out = dict.fromkeys((*CLASSES, "overhead"), 0.0)
    for op in ops:
        launches = op.launches if isinstance(op, Gemm) else 1
        overhead = kernel_overhead(gpu, gpu.matmul_efficiency) * launches
        kind = "gemm" if isinstance(op, Gemm) else "attention" if isinstance(op, FusedAttention) else "memory"
        out[kind] += op_time(op, gpu, gpu.matmul_efficiency) - overhead
        out["overhead"] += overhead
    return out


def kernel_class(name: str, cuda: bool) -> str:
    """A profiled kernel's (on the CPU: a torch op's) class: attention, gemm or memory."""
    if ATTENTION_KERNEL.search(name):
        return "attention"
    return "gemm" if (GEMM_KERNEL.search(name) if cuda else name in CPU_GEMMS) else "memory"


def profile_classes(call, device: torch.device, iterations: int = PROFILED) -> dict:
    """Seconds an iteration of `call` spends in each kernel class, and "gaps" (the span from the first kernel's
    start to the last one's end, less the time some kernel runs), measured under torch.profiler after a warm-up
    call. On the CPU: each torch op's self time by class, and the gaps the wall clock leaves (Python, dispatch)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    call()
    synchronize = torch.cuda.synchronize if cuda else (lambda *a: None)
    synchronize(device)
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        for _ in range(iterations):
            call()
        synchronize(device)
        wall = time.perf_counter() - start
    out = dict.fromkeys(CLASSES, 0.0)
    if cuda:
        kernels = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                         if e.device_type == torch.autograd.DeviceType.CUDA)
        busy, reach = 0.0, -math.inf
        for begin, end, name in kernels:
            out[kernel_class(name, True)] += (end - begin) / 1e6
            busy += max(0.0, end - max(begin, reach)) / 1e6
            reach = max(reach, end)
        span, count = ((kernels[-1][1] - kernels[0][0]) / 1e6 if kernels else 0.0), len(kernels)
    else:
        rows = [row for row in prof.key_averages() if row.self_cpu_time_total > 0]
        for row in rows:
            out[kernel_class(row.key, False)] += row.self_cpu_time_total / 1e6
        busy, span, count = sum(out.values()), wall, sum(row.count for row in rows)
    per = {name: seconds / iterations for name, seconds in out.items()}
    return per | {"gaps": max(0.0, span - busy) / iterations, "kernels": count / iterations,
                  "iterations": iterations}


def measure_layer(device: torch.device, args: argparse.Namespace, sampler: Sampler) -> dict:
    """The block's burst and back-to-back seconds an iteration, after the idle seconds, and the simulator's."""
    cuda = device.type == "cuda"
    config = preset(LAYER_MODEL) if cuda else DRY_LAYER
    call = layer_call(config, device)
    time.sleep(args.cool_s)
    t0 = time.perf_counter()
    rate = burst(call, device, 1)  # iterations a second
    t1 = time.perf_counter()
    windows = sustained(call, device, 1, args.layer_seconds, rate)
    t2 = time.perf_counter()
    measured_classes = profiled(call, device)  # held: right after the back-to-back run
    del call
    last = [r for t, r in windows if t >= windows[-1][0] - LAST_S] or [windows[-1][1]]
    held = 1 / statistics.fmean(last)
    from simulator.costs.hardware import preset_for_device  # the simulator only here, as predicted_layer
    preset_name = preset_for_device(torch.cuda.get_device_name(device)) if cuda else "h200"
    predicted = predicted_layer(config, preset_name, "bf16" if cuda else "fp32")
    out = {"model": f"{LAYER_MODEL} block" if cuda else "dry-run block", "d_model": config.d_model,
           "heads": config.n_heads, "d_ff": config.d_ff, "seq_len": config.seq_len, "burst_s": 1 / rate,
           "last_10s_s": held, "windows": windows, "held_over_burst": (1 / held) / rate, "predicted": predicted,
           "idle_gpu": sampler.between(t0 - args.cool_s, t0), "last_10s_gpu": sampler.between(t2 - LAST_S, t2)}
    out["classes"] = {"measured": measured_classes, "predicted": None if predicted is None else predicted["classes"]}
    if predicted is not None:
        out["measured_over_predicted"] = {"burst": out["burst_s"] / predicted["burst_s"],
                                          "held": held / predicted["held_s"]}
    return out | {"first_second_gpu": sampler.between(t1, t1 + 1.0), "small": small_block(device, preset_name)}


def profiled(call, device: torch.device) -> dict:
    """profile_classes of `call`, or {"error": why}: a profiler that fails costs this one field, not the run."""
    try:
        return profile_classes(call, device)
    except Exception as error:  # noqa: BLE001 (torch.profiler's failures are not one type)
        return {"error": f"{type(error).__name__}: {error}"}


def small_block(device: torch.device, preset_name: str | None) -> dict:
    """SMALL_MODEL's block over SMALL_BATCH sequences profiled by class beside the preset's price: the regime of
    short kernels (width 768), where launch gaps and memory-bound kernels weigh most (the dry run: DRY_LAYER, 2)."""
    cuda = device.type == "cuda"
    config, batch = (preset(SMALL_MODEL), SMALL_BATCH) if cuda else (DRY_LAYER, 2)
    call = layer_call(config, device, batch)
    measured = profiled(call, device)
    del call
    predicted = predicted_layer(config, preset_name, "bf16" if cuda else "fp32", batch)
    return {"model": f"{SMALL_MODEL} block" if cuda else "dry-run block", "batch": batch, "seq_len": config.seq_len,
            "classes": {"measured": measured, "predicted": None if predicted is None else predicted["classes"]}}


def measure(args: argparse.Namespace) -> dict:
    cuda = torch.cuda.is_available() and not args.dry_run
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    formats = args.formats if cuda else ["fp32"]
    if not cuda:
        args.cool_s = 0.0
    m, n, k = SHAPE if cuda else DRY_SHAPE
    with Sampler(device.index if cuda else None) as sampler:
        results = {fmt: measure_format(fmt, device, args, sampler) for fmt in formats}
        layer = measure_layer(device, args, sampler) if args.layer_seconds > 0 else None
    return {"device": torch.cuda.get_device_name(device) if cuda else "cpu (dry run)", "m": m, "n": n, "k": k,
            "nvidia_smi": sampler.available, "formats": results, "layer": layer}


def format_list(text: str) -> list[str]:
    formats = [part.strip() for part in text.split(",") if part.strip()]
    unknown = [fmt for fmt in formats if fmt not in FORMATS]
    if not formats or unknown:
        raise argparse.ArgumentTypeError(f"takes a comma-separated list of {', '.join(FORMATS)}, got {text!r}")
    return formats


def positive(text: str) -> float:
    value = float(text)
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text}")
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="JSON file to write (must not exist)")
    parser.add_argument("--seconds", type=positive, default=None, help="sustained run (default 60; 1 on the CPU)")
    parser.add_argument("--cool-s", type=positive, default=10.0, help="idle seconds before the burst (GPU only)")
    parser.add_argument("--formats", type=format_list, default=["bf16", "fp8"],
                        help=f"one run each, in turn ({', '.join(FORMATS)}; default bf16,fp8)")
    parser.add_argument("--layer-seconds", type=float, default=None,
                        help="the block's run back to back (default --seconds; 0: no block)")
    parser.add_argument("--dry-run", action="store_true", help="the CPU path at tiny sizes, even with CUDA")
    args = parser.parse_args(argv)
    out = Path(args.out)
    if out.exists():
        parser.exit(2, f"gpu_sustained.py: {out} exists; give a new path\n")
    if args.seconds is None:
        args.seconds = 60.0 if torch.cuda.is_available() and not args.dry_run else 1.0
    if args.layer_seconds is None:
        args.layer_seconds = args.seconds
    if not 0 <= args.layer_seconds < math.inf:
        parser.exit(2, f"gpu_sustained.py: --layer-seconds must be 0 or a positive number of seconds, "
                       f"got {args.layer_seconds}\n")
    result = measure(args)
    out.write_text(json.dumps(result, indent=1) + "\n")
    for fmt, one in result["formats"].items():
        clock = one["last_10s_gpu"]["sm_clock_mhz"]
        print(f"{result['device']}, {fmt} {result['m']} x {result['n']} x {result['k']}: burst "
              f"{one['burst_flops_per_s'] / 1e12:.1f} TFLOP/s, last 10 s {one['last_10s_flops_per_s'] / 1e12:.1f} "
              f"({one['sustained_over_burst']:.3f} of the burst)" + (f", SM clock {clock['mean']:.0f} MHz" if clock else ""))
    if result["layer"] is not None:
        print(layer_line(result["layer"]))
    return 0


def layer_line(layer: dict) -> str:
    """The block's measured and predicted milliseconds, in a line."""
    line = (f"{layer['model']} (width {layer['d_model']}, sequence {layer['seq_len']}) forward + backward: burst "
            f"{layer['burst_s'] * 1e3:.2f} ms, last 10 s {layer['last_10s_s'] * 1e3:.2f} ms")
    predicted = layer["predicted"]
    if predicted is None:
        return line + "; no preset matches this GPU"
    ratio = layer["measured_over_predicted"]
    line += (f"; {predicted['preset']} predicts {predicted['burst_s'] * 1e3:.2f} and "
             f"{predicted['held_s'] * 1e3:.2f} ms (measured / predicted: burst {ratio['burst']:.3f}, "
             f"held {ratio['held']:.3f})")
    line += "\n" + classes_line(layer["classes"])
    small = layer.get("small")
    if small and small["classes"]["predicted"] is not None:
        line += "\n" + classes_line(small["classes"]).replace("by kernel class", f"{small['model']} x {small['batch']}")
    return line


def classes_line(classes: dict) -> str:
    """The block's milliseconds an iteration by kernel class, measured (held, profiled) / predicted (held)."""
    measured, predicted = classes["measured"], classes["predicted"]
    if "error" in measured:
        return f"  by kernel class: not profiled ({measured['error']})"
    parts = [f"{name} {measured[name] * 1e3:.2f}/{predicted[name] * 1e3:.2f}" for name in CLASSES]
    parts.append(f"gaps {measured['gaps'] * 1e3:.2f}/{predicted['overhead'] * 1e3:.2f} (per-kernel overhead)")
    return (f"  by kernel class, ms an iteration, measured/predicted ({measured['kernels']:.0f} kernels measured): "
            + ", ".join(parts))


if __name__ == "__main__":
    sys.exit(main())
