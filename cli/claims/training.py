"""Claims checked on real training runs: the tiny model trained for a few steps by parallel/run/train.py, in
fp32 and bf16, on this machine's CPU, one thread; bytes from the live tensors, activations from the
saved-tensor hooks (parallel/memory.py), step times from the run's own clock.

These are the slow claims (a few seconds each run, once per process): `minigpt train` with the flags
of `train_command` prints the same summary.
"""

from __future__ import annotations

from functools import lru_cache

from cli.claims.claim import CAVEAT, HOLDS, WRONG, Claim, Finding, one_thread, percent, ratio_text

STEPS, GLOBAL_BATCH = 4, 8
ROLES = ("compute", "grad", "master", "adam_m", "adam_v")
MODEL_STATES = ("parameters", "gradients", "master_weights", "adam_m", "adam_v")
MATMUL_SIZE, MATMUL_REPEATS = 256, 3
ARTICLE_BYTES = {"master": 4, "compute": 2, "grad": 2, "adam_m": 4, "adam_v": 4, "fp8": 1}
ARTICLE_SPEEDUP = (2.0, 3.0)


def train_command(precision: str) -> str:
    return (f"minigpt train --model tiny --steps {STEPS} --global-batch {GLOBAL_BATCH} --precision {precision} "
            f"--eval-every 0 --eval-batches 1 --device cpu --json")


@lru_cache(maxsize=None)
def tiny_run(precision: str) -> dict:
    """The summary of a real run of `train_command(precision)` (its run directory is temporary)."""
    import tempfile

    from job.train_config import TrainConfig
    from minigpt.presets import preset
    from parallel.run.train import train

    one_thread()
    with tempfile.TemporaryDirectory(prefix="minigpt-claims-") as out:
        summary = train(TrainConfig(model=preset("tiny"), steps=STEPS, global_batch=GLOBAL_BATCH, precision=precision,
                                    eval_every=0, eval_batches=1, out_dir=out, device="cpu"))
    return {"n_params": summary["n_params"], "bytes_per_param": summary["bytes_per_param"]["measured"],
            "memory": summary["memory_per_rank"][0], "step_time_s": summary["step_time_s"],
            "compute_path": summary["compute_path"]}


def check_bytes_per_role() -> Finding:
    from precision.formats import format_facts
    from precision.policy import policy

    bf16, fp32 = tiny_run("bf16")["bytes_per_param"], tiny_run("fp32")["bytes_per_param"]
    fp8_element = format_facts("fp8_e4m3").bytes
    fp8_policy = policy("fp8").bytes_per_param()
    numbers = {"bf16_measured": bf16, "fp32_measured": fp32, "fp8_element_bytes": fp8_element,
               "fp8_policy_bytes": fp8_policy, "article": ARTICLE_BYTES,
               "totals": {"bf16": sum(bf16.values()), "fp32": sum(fp32.values()), "fp8": sum(fp8_policy.values())}}
    ours = ("bf16 run: " + " + ".join(f"{bf16[r]:g}" for r in ROLES) + f" = {sum(bf16.values()):g} B/param "
            f"(compute, grad, master, m, v); fp32 run: {sum(fp32.values()):g}; an fp8 element {fp8_element} B")
    roles_right = all(bf16[r] == ARTICLE_BYTES[r] for r in ROLES) and fp8_element == ARTICLE_BYTES["fp8"]
    why = (f"every role's bytes are right; FP8's {fp8_element} byte is per operand of the fp8 matmuls only: the fp8 "
           f"policy still stores {sum(fp8_policy.values())} B per parameter ({fp8_policy['compute']} B bf16 weights, "
           f"fp32 masters and moments)")
    discussion = (
        f"Measured from the live tensors of a real bf16 run of the tiny model ({tiny_run('bf16')['n_params']:,} "
        f"parameters): compute weights {bf16['compute']:g}, gradients {bf16['grad']:g}, fp32 masters "
        f"{bf16['master']:g}, AdamW m {bf16['adam_m']:g} and v {bf16['adam_v']:g} bytes per parameter, "
        f"{sum(bf16.values()):g} in all; the fp32 run holds {sum(fp32.values()):g} too ({fp32['compute']:g}-byte "
        f"weights that are their own masters). Mixed precision re-labels the {sum(bf16.values()):g} bytes rather "
        f"than removing any: its savings are in what is computed and kept for the backward (memory-halved, "
        f"memory-measured)."
    )
    return Finding(ours, CAVEAT if roles_right else WRONG, why, numbers, discussion)


def check_memory_measured() -> Finding:
    fp32, bf16 = tiny_run("fp32")["memory"], tiny_run("bf16")["memory"]
    states = {name: sum(run[k] for k in MODEL_STATES) for name, run in (("fp32", fp32), ("bf16", bf16))}
    total = {name: states[name] + run["activations"] + run["comm_buffers"]
             for name, run in (("fp32", fp32), ("bf16", bf16))}
    activation_ratio = bf16["activations"] / fp32["activations"]
    saving = 1 - total["bf16"] / total["fp32"]
    numbers = {"fp32": fp32, "bf16": bf16, "model_states": states, "total": total,
               "activation_ratio": activation_ratio, "saving": saving}
    ours = (f"tiny, batch {GLOBAL_BATCH}: model states {states['fp32']:,} -> {states['bf16']:,} B, activations "
            f"x{activation_ratio:.2f}, total -{percent(saving)}")
    verdict = HOLDS if 0.4 <= saving <= 0.6 else CAVEAT if activation_ratio <= 0.6 else WRONG
    per_param = states["bf16"] / tiny_run("bf16")["n_params"]
    why = (f"the model states do not shrink ({per_param:g} B/param both); the activations do "
           f"(x{activation_ratio:.2f}), so the total falls by {percent(saving)}, not 50%")
    discussion = (
        f"One real run of each precision, same model, batch and seed: the weights, gradients, masters and AdamW "
        f"states take {states['fp32']:,} bytes in fp32 and {states['bf16']:,} in bf16, while the activations "
        f"autograd saved for the backward fall from {fp32['activations']:,} to {bf16['activations']:,} bytes "
        f"(x{activation_ratio:.2f}: a few tensors, such as the loss's fp32 logits, stay fp32). The run's total falls "
        f"by {percent(saving)}."
    )
    return Finding(ours, verdict, why, numbers, discussion)


def matmul_seconds(dtype) -> float:
    """Best of MATMUL_REPEATS timed square matmuls of MATMUL_SIZE in `dtype`, native torch, one thread."""
    import time

    import torch

    one_thread()
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(MATMUL_SIZE, MATMUL_SIZE, generator=generator).to(dtype)
    b = torch.randn(MATMUL_SIZE, MATMUL_SIZE, generator=generator).to(dtype)
    a @ b  # warm-up
    best = float("inf")
    for _ in range(MATMUL_REPEATS):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return best


def check_cpu_speed() -> Finding:
    import torch

    fp32, bf16 = tiny_run("fp32"), tiny_run("bf16")
    speedup = fp32["step_time_s"] / bf16["step_time_s"]
    native = {"fp32": matmul_seconds(torch.float32), "bf16": matmul_seconds(torch.bfloat16)}
    numbers = {"fp32_step_s": fp32["step_time_s"], "bf16_step_s": bf16["step_time_s"], "speedup": speedup,
               "bf16_compute_path": bf16["compute_path"], "matmul_size": MATMUL_SIZE, "native_matmul_s": native,
               "native_bf16_slowdown": native["bf16"] / native["fp32"]}
    ours = (f"this CPU, one thread: bf16 training step x{speedup:.2f} the speed of fp32 (emulated 16-bit); a native "
            f"bf16 {MATMUL_SIZE}^3 matmul {ratio_text(numbers['native_bf16_slowdown'])} slower than fp32")
    lo, hi = ARTICLE_SPEEDUP
    verdict = HOLDS if lo <= round(speedup, 1) <= hi else CAVEAT
    why = (f"the article says A100/H100, rightly: a CPU has no 16-bit tensor cores, so 16-bit is x{speedup:.2f} as "
           f"fast here" if verdict == CAVEAT else f"x{speedup:.2f} even on this CPU")
    discussion = (
        f"On this machine's CPU the tiny model's median training step takes {fp32['step_time_s'] * 1e3:.0f} ms in "
        f"fp32 and {bf16['step_time_s'] * 1e3:.0f} ms in bf16 ({bf16['compute_path']}): x{speedup:.2f} the speed. "
        f"Native 16-bit CPU kernels are worse: a {MATMUL_SIZE}^3 bf16 matmul takes {native['bf16'] * 1e3:.2f} ms "
        f"against fp32's {native['fp32'] * 1e3:.2f} ms, which is why precision/compute.py emulates 16-bit matmuls "
        f"with fp32 accumulation on a CPU. Timings of a shared machine: they move from run to run."
    )
    return Finding(ours, verdict, why, numbers, discussion)


CLAIMS = [
    Claim("bytes-per-role", "Each precision has its job: FP32 master 4 B/param, 16-bit compute copy 2 B, 16-bit "
          "gradients 2 B, AdamW m and v 4 B each, FP8 1 B", 'preface, "各司其职" list',
          "4 + 2 + 2 + 4 + 4 B; FP8 1 B", train_command("bf16"), check_bytes_per_role, slow=True),
    Claim("memory-measured", "Mixed precision cuts training memory by about 50% (measured on a real run)",
          'preface, "显存占用减少约50%"', "about 50%", f"{train_command('fp32')}; {train_command('bf16')}",
          check_memory_measured, slow=True),
    Claim("cpu-speed", "Mixed precision is 2-3x faster (on a CPU instead of an A100/H100)",
          'preface, "在现代GPU（A100/H100）上获得2-3倍加速"', "2-3x (on A100/H100)",
          f"{train_command('fp32')}; {train_command('bf16')}", check_cpu_speed, slow=True, timed=True),
]
