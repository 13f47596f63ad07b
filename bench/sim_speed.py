"""How fast the simulator answers what-ifs at scale: one step of a 1T-parameter model on 3,072, 16,384 and
~100,000 GPUs, and an 8-point scaling sweep from 1,024 to 16,384 GPUs. A benchmark, not a test.

    .venv/bin/python bench/sim_speed.py            # every case, a table
    .venv/bin/python bench/sim_speed.py --case 3k  # one case, one JSON line (what the table runs)

The model is Narayanan et al. 2021's 1T shape (128 layers, d_model 25600, 160 heads, sequence 2048,
vocabulary 51200), global batch 3072 in micro-batches of 1, tp 8 x pp 64 x dp (GPUs / 512), bf16, full
recomputation, A100 80GB servers of 8 on HDR InfiniBand. "100k" is 98,304 GPUs (dp 192: 100,000 is not
a multiple of tp x pp = 512); "100k-exact" is 100,000 GPUs as tp 8 x pp 50 x dp 250, global batch 3000. Each case runs in its own process, so its peak memory is its own: the
process's peak resident set (resource.getrusage; interpreter and imports included, ~60 MB). Wall time
(time.perf_counter) covers building the cluster and simulating, after the imports (timed apart: a command
pays them once); CPU time (time.process_time) the same on one core (the simulator is single-threaded),
which other load on the machine does not inflate.
Point PYTHONPATH at another checkout to time it (the "before" column of docs: the same script on HEAD).
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import platform
import resource
import subprocess
import sys
import time

CASES = {  # name: (GPUs, pipeline stages, global batch, target wall seconds, target peak MB or None)
    "3k": (3072, 64, 3072, 1.0, None),
    "16k": (16384, 64, 3072, 2.0, None),
    "100k": (98304, 64, 3072, 5.0, 1000),
    "100k-exact": (100_000, 50, 3000, 5.0, 1000),  # tp 8 x pp 50 (2 or 3 blocks a stage) x dp 250
    "sweep": (16384, 64, 3072, 30.0, None),
}
SWEEP_GPUS = [1024, 2048, 3072, 4096, 6144, 8192, 12288, 16384]


def one_trillion():
    from minigpt.presets import build_config

    return build_config("gpt3-175b", n_layers=128, d_model=25600, n_heads=160)


def progress_bar(done: int, total: int) -> None:
    filled = 30 * done // total
    sys.stderr.write(f"\r  sweep [{'#' * filled}{'.' * (30 - filled)}] {done}/{total} points")
    sys.stderr.write("\n" if done == total else "")
    sys.stderr.flush()


def run_step(gpus: int, pp: int, batch: int) -> dict:
    from simulator.engine.simulate import simulate_step
    from job.layout import Layout
    from simulator.network.topology import build_cluster

    model = one_trillion()
    start = time.perf_counter()
    cluster = build_cluster("a100-80gb", 8, gpus // 8, "hdr")
    built = time.perf_counter() - start
    result = simulate_step(model, Layout(tp=8, pp=pp, dp=gpus // (8 * pp), zero=1), cluster, "bf16", batch, 1,
                           recompute="full")
    return {"step_time_s": result.step_time_s, "mfu": result.mfu, "build_s": built, **result.timings}


def run_sweep() -> dict:
    from simulator.search.sweep import ClusterSpec, Job, scaling_sweep

    job = Job(one_trillion(), "bf16", global_batch=3072, micro_batch=1, zero=1, recompute="full")
    spec = ClusterSpec.of("a100-80gb", fabric="hdr")
    options = {"progress": progress_bar} if "progress" in inspect.signature(scaling_sweep).parameters else {}
    sweep = scaling_sweep(job, SWEEP_GPUS, spec, "strong", tp=8, pp=64, **options)
    return {"step_time_s": sweep.points[-1].result.step_time_s, "points": len(sweep.points)}


def measure(case: str) -> dict:
    """Run one case in this process: its result, wall and CPU seconds, peak resident memory."""
    clock = time.perf_counter()
    import simulator
    import simulator.engine.simulate
    import simulator.search.sweep  # noqa: F401  (imports timed apart: a CLI pays them once, a sweep once for all points)

    imports = time.perf_counter() - clock
    wall, cpu = time.perf_counter(), time.process_time()
    out = run_sweep() if case == "sweep" else run_step(*CASES[case][:3])
    out.update(case=case, wall_s=time.perf_counter() - wall, cpu_s=time.process_time() - cpu, import_s=imports,
               peak_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, simulator=os.path.dirname(simulator.__file__))
    return out


def machine() -> str:
    model = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
                 platform.processor()) if os.path.exists("/proc/cpuinfo") else platform.processor()
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30 if hasattr(os, "sysconf") else 0
    return (f"{platform.node()}: {model}, {os.cpu_count()} cores, {memory:.0f} GiB, {platform.system()} {platform.release()}, "
            f"Python {platform.python_version()}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", choices=sorted(CASES), help="run one case here and print its JSON")
    args = parser.parse_args()
    if args.case:
        print(json.dumps(measure(args.case)))
        return
    print(f"machine: {machine()}")
    print(f"date: {time.strftime('%Y-%m-%d %H:%M %Z')}; load average {os.getloadavg()[0]:.2f}; "
          f"command: {sys.executable} {' '.join(sys.argv)}")
    rows, where = [], "?"
    for case, (gpus, _, _, target_s, target_mb) in CASES.items():
        done = subprocess.run([sys.executable, __file__, "--case", case], stdout=subprocess.PIPE, text=True)
        if done.returncode:
            rows.append([case, gpus, "failed (see above)", "", "", "", "", ""])
            continue
        r = json.loads(done.stdout.splitlines()[-1])
        where = r["simulator"]
        ok = r["wall_s"] <= target_s and (target_mb is None or r["peak_mb"] <= target_mb)
        target = f"<= {target_s:g} s" + (f", {target_mb} MB" if target_mb else "")
        rows.append([case, f"{gpus:,}" + (" (8 pts)" if case == "sweep" else ""), f"{r['wall_s']:.2f}", f"{r['cpu_s']:.2f}",
                     f"{r['import_s']:.2f}",
                     f"{r['peak_mb']:.0f}", f"{r['step_time_s']:.2f}", f"{target} {'ok' if ok else 'MISSED'}"])
    print(f"simulator: {where}")
    headers = ["case", "GPUs", "wall s", "CPU s", "imports s", "peak MB", "step s", "target"]
    widths = [max(len(str(x)) for x in column) for column in zip(headers, *rows)]
    for row in [headers, ["-" * w for w in widths], *rows]:
        print("  ".join(str(x).ljust(w) for x, w in zip(row, widths)))


if __name__ == "__main__":
    main()
