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
launch gaps between them, and this says whether the presets price that mix as it runs.
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


def layer_call(config: GPTConfig, device: torch.device):
    """One forward and backward of a block over one sequence, bf16 on a GPU (fp32 on the CPU dry run)."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    with device:  # built where it runs: GPT-3's 1.8e9 weights initialised on a CPU would take longer than the run
        block = Block(config).to(dtype=dtype)
    x = torch.randn(1, config.seq_len, config.d_model, device=device, dtype=dtype, requires_grad=True)
    grad = torch.randn(1, config.seq_len, config.d_model, device=device, dtype=dtype)
    params = list(block.parameters())

    def call() -> None:
        for param in params:
            param.grad = None
        x.grad = None
        block(x).backward(grad)
    return call


def predicted_layer(config: GPTConfig, preset_name: str | None, dtype: str) -> dict | None:
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
    ops = block_ops(config, 1, Layout(), policy(dtype), Implementation())
    kept = [op for op in (*ops.forward, *ops.backward) if not op.name.endswith(".grad_accumulate")]
    burst_gpu = replace(gpu, achieved=replace(gpu.reached, tensor_sustained=()))
    return {"preset": preset_name, "ops": len(kept),
            "held_s": sum(op_time(op, gpu, gpu.matmul_efficiency) for op in kept),
            "burst_s": sum(op_time(op, burst_gpu, burst_gpu.matmul_efficiency) for op in kept)}


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
    if predicted is not None:
        out["measured_over_predicted"] = {"burst": out["burst_s"] / predicted["burst_s"],
                                          "held": held / predicted["held_s"]}
    return out | {"first_second_gpu": sampler.between(t1, t1 + 1.0)}


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
    return (line + f"; {predicted['preset']} predicts {predicted['burst_s'] * 1e3:.2f} and "
            f"{predicted['held_s'] * 1e3:.2f} ms (measured / predicted: burst {ratio['burst']:.3f}, "
            f"held {ratio['held']:.3f})")


if __name__ == "__main__":
    sys.exit(main())
