"""The closing table of bench/gpu.sh: one row per step, its status, its time and its headline figures.

    python bench/gpu_summary.py STATUS_TSV OUT_DIR

STATUS_TSV has one line per step: name, exit code, milliseconds, result file ("-": none). The
headline figures are read from the step's result file in OUT_DIR; a file that is missing or
unreadable says so in its row instead of stopping the table. Standard library only: it must run
wherever gpu.sh runs.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

FILES = {"kernels": "kernels.json", "calibrate": "gpu-profile.json", "compare": "compare.json",
         "precision": "precision.json", "train": "train.json", "sustained": "sustained.json"}


def load(path: Path) -> dict | None:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def kernels(data: dict) -> str:
    best = data.get("best_tflops", {})
    rates = ", ".join(f"{fmt} {value:.1f}" for fmt, value in best.items() if isinstance(value, (int, float)))
    copy = data.get("elementwise", {}).get("best_bytes_per_s")
    launch = data.get("launch", {}).get("per_launch_s")
    parts = [f"best TFLOP/s: {rates}" if rates else ""]
    if isinstance(copy, (int, float)):
        parts.append(f"element-wise {copy / 1e9:.0f} GB/s")
    if isinstance(launch, (int, float)):
        parts.append(f"launch {launch * 1e6:.1f} us")
    return "; ".join(p for p in parts if p) or "no figures"


def calibrate(data: dict) -> str:
    (name, gpu), = data["gpus"].items()
    peaks = ", ".join(f"{fmt} {value / 1e12:.3g}" for fmt, value in gpu["peak_flops"].items() if value)
    efficiency = gpu.get("matmul_efficiency", {})
    tables = ", ".join(k for k in efficiency if k not in ("launch_latency", "gemm_model"))
    fits = {fmt: note["gemm_fit"] for fmt, note in gpu.get("calibration", {}).get("formats", {}).items()
            if "gemm_fit" in note}  # the GEMM model by shape fitted to its GEMMs (simulator/costs/rates/gemm_fit.py)
    model = ("; GEMM model fitted (rms): " + ", ".join(f"{fmt} {fit['rms_log_error']:.0%}" for fmt, fit in fits.items())
             if fits else "")
    return (f"{name}: peak TFLOP/s {peaks}; efficiency tables: {tables}{model}; "
            f"copy {gpu['hbm_bandwidth'] / 1e9:.1f} GB/s")


def compare(data: dict) -> str:
    error = data.get("step_time_relative_error")
    return (f"step predicted {data['predicted_step_time_s'] * 1e3:.2f} ms, measured "
            f"{data['measured_step_time_s'] * 1e3:.2f} ms ({'-' if error is None else f'{100 * error:+.1f}%'})")


def precision(data: dict) -> str:
    rows = data.get("rows", [])
    return "; ".join(f"{row['run']} {row['tokens_per_s']:,.0f} tok/s MFU {row['mfu']:.1%}" for row in rows)


def train(data: dict) -> str:
    return (f"loss {data['losses'][0]:.3f} -> {data['final_loss']:.3f}, val {data['val_loss']:.3f}, "
            f"{data['tokens_per_s']:,.0f} tok/s, MFU {data['mfu']:.1%} ({data.get('compute_path', '?')})")


def sustained(data: dict) -> str:
    def one(fmt: str, run: dict) -> str:
        clock = (run.get("last_10s_gpu") or {}).get("sm_clock_mhz")
        return (f"{fmt} {run['last_10s_flops_per_s'] / 1e12:.4g} of {run['burst_flops_per_s'] / 1e12:.4g} TFLOP/s "
                f"({run['sustained_over_burst']:.3f})" + (f" at {clock['mean']:.0f} MHz" if clock else ""))
    line = "held back to back / burst: " + "; ".join(one(fmt, run) for fmt, run in data["formats"].items())
    layer = data.get("layer")
    if layer and layer.get("predicted"):
        ratio = layer["measured_over_predicted"]
        line += (f"; a {layer['model']} {layer['last_10s_s'] * 1e3:.1f} ms held, measured / {layer['predicted']['preset']}"
                 f" predicted {ratio['held']:.3f} (burst {ratio['burst']:.3f})")
        for block in (layer, layer.get("small") or {}):
            line += by_class(block)
    return line


def by_class(block: dict) -> str:
    """A profiled block's milliseconds by kernel class, measured / predicted (nothing when it was not profiled)."""
    measured = (block.get("classes") or {}).get("measured") or {}
    priced = (block.get("classes") or {}).get("predicted")
    if "gemm" not in measured or priced is None:
        return ""
    size = f" x {block['batch']}" if "batch" in block else ""
    return (f"; {block['model']}{size} ms by class " + ", ".join(
        f"{name} {measured[name] * 1e3:.2f}/{priced[name] * 1e3:.2f}" for name in ("gemm", "attention", "memory"))
        + f", gaps {measured['gaps'] * 1e3:.2f}/{priced['overhead'] * 1e3:.2f}")


HEADLINES = {"kernels": kernels, "calibrate": calibrate, "compare": compare, "precision": precision, "train": train,
             "sustained": sustained}


def row(name: str, code: str, millis: str, out: Path) -> str:
    status = "ok" if code == "0" else ("over its time limit" if code == "124" else f"FAILED (exit {code})")
    data = load(out / FILES[name]) if name in FILES else None
    if data is None:
        figures = "no result file"
    else:
        try:
            figures = HEADLINES[name](data)
        except (KeyError, TypeError, ValueError, ZeroDivisionError) as error:
            figures = f"result file without the expected fields ({type(error).__name__}: {error})"
    return f"| {name} | {status} | {int(millis) / 1000:.1f} | {figures} |"


def main(status_path: str, out_dir: str) -> None:
    out = Path(out_dir)
    lines = ["| step | status | seconds | figures |", "|---|---|---|---|"]
    try:
        entries = [line.split("\t") for line in Path(status_path).read_text().splitlines() if line]
    except OSError:
        entries = []
    for name, code, millis, _result in entries:
        lines.append(row(name, code, millis, out))
    print("\n".join(lines))


if __name__ == "__main__":
    main(*sys.argv[1:3])
