"""What the simulator's error on published runs looks like, as one number per run: the tensor-core rate it would need.

    python bench/implied_rate.py            # every row, a table
    python bench/implied_rate.py --json     # one JSON object

A diagnosis, not a fit: nothing here changes a simulator number. For each published run, the factor on the GPU
preset's tensor-core peaks (bf16, fp16, fp8; HBM, links, every other number as they are) at which `minigpt simulate`
meets the published step. The run is simulated twice, with the preset as it is and with its tensor-core peaks
times LOW (a profile written to a temporary file and given as --hardware); the step is taken as a + b / factor
through both (the tensor-core work scales with 1 / factor, the rest not), and solved for the published step. A
factor near 1 says the prediction's error is not the tensor cores' rate; a factor shared by runs of different stacks,
formats and scales says it is.

The runs (bench/published_runs.json, each with its source): Narayanan et al.'s ten A100 rows as
`bench/published.py` simulates them, NVIDIA's ten DGX-Cloud GPT-3 175B H100 rows as `--table dgxc` does, and
Meta's Llama 3 405B on 8,192 and 16,384 H100s ("llama3_405b_h100": its layout, the megatron-core preset as the
nearest description of its stack, interleaved over 7 chunks; the published step is the simulator's model FLOPs over
the published TFLOP/s per GPU, the row's "assumed" says why).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from simulator.costs.hardware import load_hardware, save_hardware  # noqa: E402

LOW = 0.75  # the second point of the two-point solve: any factor well away from 1 serves
TENSOR_FORMATS = ("bf16", "fp16", "fp8")
LLAMA3_CHUNKS = 7  # interleaved chunks per stage: 126 layers over 16 stages


def published_module():
    spec = importlib.util.spec_from_file_location("published", ROOT / "bench" / "published.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def scaled_profile(gpu: str, factor: float, folder: Path) -> Path:
    """A profile of preset `gpu` with its tensor-core peaks times `factor`."""
    hardware = load_hardware(gpu)
    peaks = {fmt: (peak * factor if peak and fmt in TENSOR_FORMATS else peak)
             for fmt, peak in hardware.gpu.peak_flops.items()}
    return save_hardware(replace(hardware, gpu=replace(hardware.gpu, peak_flops=peaks)), folder / f"{gpu}-{factor}.json")


def simulated(args: list[str], profile: Path) -> dict:
    """`minigpt simulate` of `args` (which name a --gpu) on `profile` instead."""
    args = list(args)
    at = args.index("--gpu")
    args[at : at + 2] = ["--hardware", str(profile)]
    result = subprocess.run(args, capture_output=True, text=True, cwd=ROOT)
    if result.returncode != 0:
        raise SystemExit(f"minigpt simulate failed: {result.stderr.strip()}")
    return json.loads(result.stdout)


def llama3_command(row: dict) -> list[str]:
    return [sys.executable, "-m", "cli", "simulate", "--model", row["model"], "--tp", str(row["tp"]),
            "--cp", str(row["cp"]), "--pp", str(row["pp"]), "--dp", str(row["dp"]), "--zero", "1",
            "--seq-len", str(row["s"]), "--global-batch", str(row["gb"]), "--micro-batch", "1",
            "--sequence-parallel", "--sp-saved-input", "sharded", "--schedule", "interleaved",
            "--virtual-chunks", str(LLAMA3_CHUNKS), "--gpu", "h100-sxm", "--overlap", "megatron-core", "--json"]


def runs() -> list[tuple[str, str, list[str], object]]:
    """(family, name, simulate's arguments, the published step: seconds, or a function of the simulation)."""
    published = published_module()
    data = json.loads((ROOT / "bench" / "published_runs.json").read_text())
    seq, vocab = data["common"]["sequence_length"], data["common"]["vocabulary"]
    out = [("Narayanan et al. 2021, A100", run["name"], published.command(run, seq, vocab, False),
            published.paper_flops(run, seq, vocab) / (run["achieved_tflops_per_gpu"] * 1e12 * run["gpus"]))
           for run in data["runs"]]
    out += [(f"DGX-Cloud GPT-3 175B, H100, {row['precision']}", row["id"], published.dgxc_command(row), row["pub_s"])
            for row in data["dgxc_gpt3_175b_h100"]["rows"]]
    out += [("Llama 3 405B, H100", row["id"], llama3_command(row),
             lambda sim, row=row: sim["step_time_s"] * sim["tflops_per_gpu"] / row["pub_tflops"])
            for row in data["llama3_405b_h100"]["rows"]]
    return out


def implied(family: str, name: str, args: list[str], published, folder: Path) -> dict:
    gpu = args[args.index("--gpu") + 1]
    full = simulated(args, scaled_profile(gpu, 1.0, folder))
    low = simulated(args, scaled_profile(gpu, LOW, folder))["step_time_s"]
    step = published(full) if callable(published) else published
    b = (low - full["step_time_s"]) / (1 / LOW - 1)  # the tensor-core part at factor 1
    a = full["step_time_s"] - b
    factor = b / (step - a) if step > a else None  # None: even infinitely fast tensor cores would not be slow enough
    return {"family": family, "name": name, "gpu": gpu, "published_step_s": step,
            "predicted_step_s": full["step_time_s"], "error": full["step_time_s"] / step - 1,
            "tensor_core_share": b / full["step_time_s"], "factor": factor}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as folder:
        rows = [implied(*run, Path(folder)) for run in runs()]
    families = {}
    for row in rows:
        families.setdefault(row["family"], []).append(row["factor"])
    summary = {family: {"mean": statistics.fmean(f), "min": min(f), "max": max(f)}
               for family, f in families.items() if None not in f}
    if args.json:
        print(json.dumps({"rows": rows, "by_family": summary}))
        return 0
    print("| run | GPU | published step s | predicted s | error | tensor-core share of the step | factor needed |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        factor = "-" if r["factor"] is None else f"{r['factor']:.3f}"
        print(f"| {r['name']} | {r['gpu']} | {r['published_step_s']:.2f} | {r['predicted_step_s']:.2f} | "
              f"{r['error']:+.1%} | {r['tensor_core_share']:.0%} | {factor} |")
    for family, s in summary.items():
        print(f"{family}: factor {s['mean']:.3f} on average ({s['min']:.3f}-{s['max']:.3f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
