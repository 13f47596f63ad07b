"""ZeRO's memory and communication: memory per GPU from the simulator's memory model (simulator/memory.py,
through simulate_step), communication counted from the schedule the executor runs (job/schedule.py with
job/data_parallel.py's real buckets and units: the collectives and bytes of its action lists, which
tests/test_schedule_collectives.py proves equal to what training moves). Torch-free."""

from __future__ import annotations

from functools import partial

from cli.claims.claim import CAVEAT, HOLDS, UNCHECKABLE, WRONG, Claim, Finding, ratio_text
from cli.claims.sim import GIB, SimCase
from job.data_parallel import NORM_BYTES, collectives, schedule_config
from job.layout import Layout
from job.schedule import build_schedule
from minigpt.presets import preset
from precision.policy import TEXTBOOK_MIXED_ADAM
from job.train_config import TrainConfig

MEMORY_MODEL, REPLICAS = "gpt2-124m", 64  # the ZeRO paper's figure 1 has N = 64 too
COMM_MODEL, COMM_REPLICAS, MICRO_BATCHES = "tiny", 2, (1, 4)  # what `train_command` runs on a CPU
PRECISION = "bf16"
PAPER_ZERO3_VOLUME = 3 / 2  # the ZeRO paper's 3 passes of the weights against DDP's 2 (section 7.2.2)
FORMULA_TOLERANCE = 0.03  # our buckets pad every tensor group to a multiple of N
SAME_VOLUME = 1e-3  # sharded stages all-reduce the gradient norm (NORM_BYTES), which DDP does not need


def same_volume(ratio: float) -> bool:
    return abs(ratio - 1) < SAME_VOLUME


def paper_state_bytes(stage: int, params: int, replicas: int) -> float:
    """The ZeRO paper's model states per GPU (section 3): 16-bit weights w and gradients g, K bytes of fp32
    optimizer state (masters, m, v) per parameter, each sharded from its stage on."""
    w, g = TEXTBOOK_MIXED_ADAM["compute"], TEXTBOOK_MIXED_ADAM["grad"]
    k = sum(TEXTBOOK_MIXED_ADAM.values()) - w - g
    sharded = {0: 0, 1: k, 2: k + g, 3: k + g + w}[stage]
    return params * (w + g + k - sharded) + params * sharded / replicas


def paper_limit(stage: int) -> float | None:
    """The saving as the replicas grow without bound (None for stage 3: it grows with N, without a limit)."""
    return paper_state_bytes(0, 1, 1) / paper_state_bytes(stage, 1, 10**30) if stage < 3 else None


def train_command(stage: int, micro_batches: int) -> str:
    return (f"minigpt train --model {COMM_MODEL} --dp {COMM_REPLICAS} --zero {stage} --micro-batches {micro_batches} "
            f"--global-batch {COMM_REPLICAS * micro_batches} --steps 1 --precision {PRECISION} --eval-every 0 "
            f"--eval-batches 1 --device cpu --json")


def step_volume(stage: int, micro_batches: int) -> dict[str, int]:
    """ZeRO volume per rank per step by collective (2S for an all-reduce, S otherwise: parallel/comm.py's), from
    the schedule of `train_command(stage, micro_batches)`."""
    config = schedule_config(preset(COMM_MODEL), Layout(dp=COMM_REPLICAS, zero=stage), micro_batches, "1f1b",
                             TrainConfig.bucket_mb, PRECISION)
    volume: dict[str, int] = {}
    for action in build_schedule(config).actions[0]:
        for kind, size, _ in collectives(action, config.plan):
            volume[kind] = volume.get(kind, 0) + (2 * size if kind == "all_reduce" else size)
    return volume


def zero_numbers(stage: int) -> dict:
    params = preset(MEMORY_MODEL).n_params()
    base = SimCase(MEMORY_MODEL, dp=REPLICAS).result.memory.model_states
    ours = SimCase(MEMORY_MODEL, dp=REPLICAS, zero=stage).result.memory.model_states
    formula = paper_state_bytes(0, params, REPLICAS) / paper_state_bytes(stage, params, REPLICAS)
    comm = {m: sum(step_volume(stage, m).values()) / sum(step_volume(0, m).values()) for m in MICRO_BATCHES}
    return {"stage": stage, "replicas": REPLICAS, "saving": base / ours, "paper_saving": formula,
            "paper_limit": paper_limit(stage), "states_gib": ours / GIB, "ddp_states_gib": base / GIB,
            "buffers_gib": SimCase(MEMORY_MODEL, dp=REPLICAS, zero=stage).result.memory.comm_buffers / GIB,
            "volume_over_ddp": comm, "volume": {m: step_volume(stage, m) for m in MICRO_BATCHES}}


def _memory_matches(n: dict) -> bool:
    return abs(n["saving"] - n["paper_saving"]) <= FORMULA_TOLERANCE * n["paper_saving"]


def _ours(n: dict) -> str:
    comm = ", ".join(f"{ratio_text(r)} ({m} micro-batch{'es' if m > 1 else ''})"
                     for m, r in n["volume_over_ddp"].items())
    limit = "N" if n["paper_limit"] is None else ratio_text(n["paper_limit"])
    return (f"states ÷{n['saving']:.2f} at N={n['replicas']} (paper {n['paper_saving']:.2f}, limit {limit}); "
            f"volume vs DDP {comm}")


def _zero1(n: dict, one: float, many: float) -> tuple[str, str, str]:
    same = same_volume(one) and same_volume(many)
    why = (f"{ratio_text(n['paper_limit'])} is the limit as N grows; at N={n['replicas']} the states shrink "
           f"{n['saving']:.2f}x; the traffic is DDP's but for the {NORM_BYTES}-byte gradient norm (a reduce-scatter "
           f"and an all-gather of the weights make one all-reduce)")
    discussion = (
        f"{MEMORY_MODEL} on {n['replicas']} A100s: ZeRO-1 shards the fp32 masters and AdamW moments, so the model "
        f"states per GPU fall from {n['ddp_states_gib']:.2f} to {n['states_gib']:.2f} GiB ({n['saving']:.2f}x, the "
        f"paper's formula {n['paper_saving']:.2f}x; {ratio_text(n['paper_limit'])} only in the limit, as every GPU "
        f"still holds the 16-bit weights and gradients). Counted in the executor's schedule for {COMM_MODEL} over "
        f"{COMM_REPLICAS} ranks, the volume per step is DDP's ({ratio_text(one)}, {ratio_text(many)}): the gradients "
        f"are reduce-scattered once per step and the updated weights all-gathered."
    )
    return CAVEAT if _memory_matches(n) and same else WRONG, why, discussion


def _zero2(n: dict, one: float, many: float) -> tuple[str, str, str]:
    why = (f"{ratio_text(n['paper_limit'])} is the limit; with one micro-batch the traffic is DDP's, not more; with "
           f"{MICRO_BATCHES[-1]} it is {ratio_text(many)} DDP's: sharded gradients cannot accumulate, so every "
           f"micro-batch is reduce-scattered")
    discussion = (
        f"Sharding the gradients too brings the states to {n['states_gib']:.2f} GiB per GPU ({n['saving']:.2f}x; "
        f"formula {n['paper_saving']:.2f}x). Communication: with one micro-batch ZeRO-2 moves what DDP moves "
        f"({ratio_text(one)}), as the ZeRO paper says; gradient accumulation makes it more: {ratio_text(many)} DDP's "
        f"with {MICRO_BATCHES[-1]} micro-batches, (m + 1)/2, since each micro-batch's gradients are reduce-scattered "
        f"as they are made while DDP all-reduces their sum once."
    )
    return CAVEAT if _memory_matches(n) and same_volume(one) and many > 1 else WRONG, why, discussion


def _zero3(n: dict, one: float, many: float) -> tuple[str, str, str]:
    why = (f"the saving is N, not ∞: {n['saving']:.0f}x at N={n['replicas']}, bounded by the replicas, and the "
           f"gathered units add {n['buffers_gib']:.2f} GiB of buffers back; traffic {ratio_text(one)} DDP's with one "
           f"micro-batch (the paper's {PAPER_ZERO3_VOLUME:g}x, less the units kept gathered), {ratio_text(many)} "
           f"with {MICRO_BATCHES[-1]}")
    discussion = (
        f"With the weights sharded too, the model states are {n['states_gib']:.3f} GiB per GPU: {n['saving']:.1f}x "
        f"less than DDP's at N={n['replicas']} (formula {n['paper_saving']:.0f}x = N), so the article's \"∞ in "
        f"theory\" is N in practice, and the gathered units cost {n['buffers_gib']:.2f} GiB of buffers on top. Each "
        f"step gathers every unit before its forward and again before its backward, and reduce-scatters its "
        f"gradients: {ratio_text(one)} DDP's volume with one micro-batch (the paper's {PAPER_ZERO3_VOLUME:g}x, less "
        f"for the first and last units, which stay gathered all step), and {ratio_text(many)} with "
        f"{MICRO_BATCHES[-1]} micro-batches, which gather again each time: the article's \"much more\" holds."
    )
    return WRONG if n["saving"] <= n["replicas"] else CAVEAT, why, discussion


STAGE_TEXTS = {1: _zero1, 2: _zero2, 3: _zero3}


def check_zero(stage: int) -> Finding:
    """ZeRO stage `stage` against the article's memory saving and communication."""
    n = zero_numbers(stage)
    one, many = n["volume_over_ddp"][MICRO_BATCHES[0]], n["volume_over_ddp"][MICRO_BATCHES[-1]]
    verdict, why, discussion = STAGE_TEXTS[stage](n, one, many)
    return Finding(_ours(n), verdict, why, n, discussion)


NOT_BEST_CASES = {"8 GPUs, one server": dict(dp=8, global_batch=64), "64 GPUs, 8 servers": dict(dp=64, global_batch=64)}
FITS_ONLY_SHARDED = dict(model="llama3-8b", dp=8, global_batch=8)


def _stage_steps(model: str, **layout) -> dict[int, dict]:
    return {z: {"step_s": (r := SimCase(model, zero=z, **layout).result).step_time_s, "fits": r.fits,
                "gib": r.memory.total / GIB} for z in range(4)}


def check_zero3_not_best() -> Finding:
    cases = {label: _stage_steps(MEMORY_MODEL, **layout) for label, layout in NOT_BEST_CASES.items()}
    slower = {label: s[3]["step_s"] / min(s[0]["step_s"], s[1]["step_s"]) for label, s in cases.items()}
    big = _stage_steps(**FITS_ONLY_SHARDED)
    fitting = {z: s for z, s in big.items() if s["fits"]}
    fastest = min(fitting, key=lambda z: fitting[z]["step_s"]) if fitting else None
    numbers = {"cases": cases, "zero3_over_best_of_0_1": slower, "llama3_8b": big, "llama3_8b_fastest_fitting": fastest}
    ours = ("; ".join(f"{label}: ZeRO-3 {ratio_text(r)} the step of DDP/ZeRO-1" for label, r in slower.items())
            + f"; {FITS_ONLY_SHARDED['model']} on {FITS_ONLY_SHARDED['dp']} (only ZeRO-"
            f"{', '.join(map(str, fitting))} fit): fastest ZeRO-{fastest}")
    both = all(r > 1 for r in slower.values())
    verdict = HOLDS if both else CAVEAT if any(r > 1 for r in slower.values()) else WRONG
    within = min(slower, key=slower.get)
    why = (f"ZeRO-3 is slower whenever DDP or ZeRO-1 fits, by less inside one server ({within}: "
           f"{ratio_text(slower[within])}) and by much across servers; when only sharding fits it can be the fastest")
    commands = [SimCase(MEMORY_MODEL, zero=3, **layout).command() for layout in NOT_BEST_CASES.values()]
    discussion = (
        f"{MEMORY_MODEL} fits one GPU, so every stage fits; simulated with each ZeRO stage: " + "; ".join(
            f"{label}: " + ", ".join(f"ZeRO-{z} {s['step_s'] * 1e3:.1f} ms" for z, s in st.items())
            for label, st in cases.items()) + f". On NVLink the extra gathers hide almost entirely under compute, "
        f"and what ZeRO-3 adds there is mostly our ZeRO-3's copies of each micro-batch's gradients into its staging "
        f"buffers (simulator/engine/data_parallel.py's UnitCopies); across servers the gathers do not hide. "
        f"{FITS_ONLY_SHARDED['model']} on {FITS_ONLY_SHARDED['dp']} A100s is the opposite "
        f"case: " + ", ".join(
            f"ZeRO-{z} {s['gib']:.0f} GiB ({'fits' if s['fits'] else 'does not fit'})" for z, s in big.items())
        + f", and of the stages that fit ZeRO-{fastest} is the fastest. Commands: "
        + "; ".join(f"`{c}`" for c in commands)
        + " (and --zero 0, 1, 2)."
    )
    return Finding(ours, verdict, why, numbers, discussion)


def check_fsdp_offload() -> Finding:
    why = ("neither side models it: the executor keeps every shard in device memory and the simulator has no "
           "host-device link or host memory to price an offload on")
    discussion = (
        "The article lists CPU offload among FSDP's engineering. minigpt's ZeRO-3 (parallel/data/zero3.py) keeps its "
        "shards, masters and moments on the rank's device, and the simulator's cost model has no PCIe link or host "
        "memory, so neither the memory an offload frees nor the transfers it adds can be computed here. The other "
        "two features it names are here: sharding by unit (job/data_parallel.py) and gathers overlapped with compute "
        "(zero3-not-best prices them)."
    )
    return Finding("not computed", UNCHECKABLE, why, {}, discussion)


def _commands(stage: int) -> str:
    return f"{SimCase(MEMORY_MODEL, dp=REPLICAS, zero=stage).command()}; {train_command(stage, MICRO_BATCHES[-1])}"


CLAIMS = [
    Claim("zero1", "ZeRO-1 (optimizer states sharded) saves 4x memory at DDP's communication",
          "1.3, ZeRO table, Stage 1", "4x; the same as DDP", _commands(1), partial(check_zero, 1), needs_torch=False),
    Claim("zero2", "ZeRO-2 (+ gradients) saves 8x memory for slightly more communication",
          "1.3, ZeRO table, Stage 2", "8x; slightly more", _commands(2), partial(check_zero, 2), needs_torch=False),
    Claim("zero3", "ZeRO-3 (+ parameters) saves without bound (∞ in theory) for much more communication",
          "1.3, ZeRO table, Stage 3", "∞ (in theory); much more", _commands(3), partial(check_zero, 3),
          needs_torch=False),
    Claim("zero3-not-best", "ZeRO-3 is not always best: for a model that fits one machine DDP or ZeRO-1 can be faster",
          'misconception 3, "ZeRO Stage 3总是最好的"', "DDP or ZeRO-1 can be faster",
          "for z in 0 1 2 3; do " + SimCase(MEMORY_MODEL, dp=64, global_batch=64).command() + " --zero $z; done",
          check_zero3_not_best, needs_torch=False),
    Claim("fsdp-offload", "FSDP, PyTorch's ZeRO-3, adds automatic sharding, compute-communication overlap and CPU "
          "offload", '1.3 FSDP, "支持CPU offload"', "supports CPU offload", "minigpt claims --only fsdp-offload",
          check_fsdp_offload, needs_torch=False),
]
