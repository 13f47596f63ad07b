"""The GEMM model by shape, fitted to one GPU's own measured GEMMs: what `minigpt calibrate` writes into a CUDA
profile. Torch-free.

A calibrated profile's matmul table is by smallest side (simulator/costs/rates/efficiency.py): calibrate times
square n x n x n GEMMs and GPT-shaped (2n x n) @ (n x 4n) ones for n = 64 to 8192 and keeps, per n, their mean
rate over the best. On a GPU the small sizes are host-bound: on the H200 lent on 2026-12-04 every GEMM up to n =
1024 took 10.5-11.2 us a call (docs/measurements/h200-2026-12-04/gpu-profile-after-fix.json), so the table's
bf16 efficiency at 768 is 0.42, and a GEMM whose smallest side is 768 but whose other sides are large (gpt2-124m's
head, 8192 x 50272 x 768: 972 us measured, 651 TFLOP/s) was priced at 2.2x its time. The table cannot tell a tiny
GEMM from a large one with one short side; the shape model can (simulator/costs/rates/gemm_model.py: output tiles
in waves over the SMs, a cost per tile along k, a fixed cost per kernel).

`fit_gemm` fits its three numbers per format to the same measurements calibrate already takes, as the simulator
will price them (simulator/costs/compute.py's op_time: the model's seconds plus the profile's launch_latency per
GEMM):

    measured seconds  ~  tile_work(m, n, k; k0) / (large x peak) + fixed + launch_latency

least squares in log of the time over every measured shape, with peak the profile's (the best rate measured in the
format), large in (0, 1], k0 on K0_GRID, fixed (what a call costs beyond the launch latency the profile adds
already) on FIXED_GRID_S, large by golden-section search for each pair. The grids are coarse on purpose: the fit's
error is the spread of the measurements, not the grid's step. The SM count is the device's own
(torch.cuda.get_device_properties().multi_processor_count, calibrate's device description).

Checked against our own measurements (tests/test_sim_gemm_fit.py): fitted to the H200 profile's 16 bf16 GEMMs it
prices the 80 GEMMs of gpt2-124m and Llama 3 8B/70B/405B at tp 1-8 that bench/gpu_kernels.py timed on the same GPU
the same day (docs/measurements/h200-2026-12-04/kernels.json, none of them in the fit) with a mean absolute error of
7.0% (fp8: 9.1%), where the smallest-side table is off by 206% (fp8: 306%) on average (docs/efficiency.md,
"Calibrated profiles: the GEMM model fitted to the GPU's own GEMMs").
"""

from __future__ import annotations

import math

from simulator.costs.rates.gemm_model import GemmFit, GemmModel

K0_GRID = (0, 8, 16, 32, 48, 64, 96, 128, 192, 256, 384, 512)  # elements of k
FIXED_GRID_S = tuple(us * 1e-6 for us in (0, 0.5, 1, 1.5, 2, 2.5, 3, 4, 5, 6, 8, 10, 12, 16, 20))
LARGE_RANGE = (0.05, 1.0)
GOLDEN_STEPS = 40
FITTED = "fitted"  # the one fit a candidate model holds (the format it is for does not change its seconds)
SHAPES = {"square": lambda n: (n, n, n), "gpt": lambda n: (2 * n, 4 * n, n)}  # (m, n, k) of calibrate's two shapes


def measured_points(rates: dict) -> list[tuple[int, int, int, float]]:
    """(m, n, k, seconds) of calibrate's measured GEMMs of one format: `rates` {"square": {n: FLOP/s}, "gpt": ...}
    as a profile's calibration.formats[format].rates holds them (parallel/calibrate/device.py's format_rates:
    square (n x n) @ (n x n), GPT-shaped (2n x n) @ (n x 4n))."""
    points = []
    for shape, by_size in rates.items():
        for size, rate in by_size.items():
            m, n, k = SHAPES[shape](int(size))
            points.append((m, n, k, 2 * m * n * k / rate))
    return sorted(points)


def model_seconds(m: int, n: int, k: int, fit: GemmFit, sms: int, peak: float, launch: float) -> float:
    """Seconds of one (m x k) @ (k x n) GEMM as the simulator prices it with this fit: the shape model's own seconds
    (GemmModel.seconds) plus the profile's launch latency."""
    return GemmModel(sms, ((FITTED, fit),)).seconds(m, n, k, FITTED, peak) + launch


def log_error(points: list[tuple[int, int, int, float]], fit: GemmFit, sms: int, peak: float, launch: float) -> float:
    """Root mean square of log(model / measured) over the points."""
    squares = [math.log(model_seconds(m, n, k, fit, sms, peak, launch) / seconds) ** 2 for m, n, k, seconds in points]
    return math.sqrt(sum(squares) / len(squares))


def _best_large(points, k0: float, fixed: float, sms: int, peak: float, launch: float) -> tuple[float, float]:
    """(large, error) minimising log_error over LARGE_RANGE for this k0 and fixed: golden-section search."""
    ratio = (math.sqrt(5) - 1) / 2

    def error(large: float) -> float:
        return log_error(points, GemmFit(large, k0, fixed), sms, peak, launch)

    low, high = LARGE_RANGE
    for _ in range(GOLDEN_STEPS):
        left, right = high - ratio * (high - low), low + ratio * (high - low)
        if error(left) < error(right):
            high = right
        else:
            low = left
    large = (low + high) / 2
    return large, error(large)


def fit_gemm(points: list[tuple[int, int, int, float]], sms: int, peak: float,
             launch: float) -> tuple[GemmFit, float]:
    """The fit (large, k0, fixed) with the least log_error over the points, and that error; `peak` FLOP/s the
    profile's peak in the format, `launch` its launch_latency (seconds the simulator adds to every GEMM)."""
    if not points:
        raise ValueError("fit_gemm needs measured GEMMs")
    best: tuple[float, GemmFit] | None = None
    for k0 in K0_GRID:
        for fixed in FIXED_GRID_S:
            large, error = _best_large(points, k0, fixed, sms, peak, launch)
            if best is None or error < best[0]:
                best = (error, GemmFit(round(large, 4), k0, fixed))
    error, fit = best
    return fit, log_error(points, fit, sms, peak, launch)


def add_gemm_model(gpu: dict, sms: int) -> dict:
    """A CUDA profile's GPU entry (parallel/calibrate/measure.py's build_profile) with matmul_efficiency.gemm_model
    fitted per measured format to its own GEMMs, each format's fit error and point count noted in its
    calibration.formats entry ("gemm_fit"). Returns the entry (changed in place)."""
    efficiency, formats = gpu["matmul_efficiency"], gpu["calibration"]["formats"]
    launch = efficiency.get("launch_latency", 0.0)
    model: dict = {"sms": sms, "source": (
        f"fitted by minigpt calibrate to this GPU's own GEMMs (its square and GPT-shaped ones, each format's "
        f"calibration.formats rates), {sms} SMs as the device reports them; simulator/costs/rates/gemm_fit.py")}
    for fmt, note in formats.items():
        peak = gpu["peak_flops"].get(fmt)
        if note.get("status") != "measured" or not peak or "rates" not in note:
            continue
        points = measured_points(note["rates"])
        fit, error = fit_gemm(points, sms, peak, launch)
        model[fmt] = {"large": fit.large, "k0": fit.k0, "fixed": fit.fixed}
        note["gemm_fit"] = {"rms_log_error": round(error, 4), "points": len(points)}
    if len(model) > 2:  # at least one format fitted
        efficiency["gemm_model"] = model
    return gpu
