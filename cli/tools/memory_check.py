"""Will the run fit in this machine's memory? The simulator's memory model, asked before any worker starts.

On a CPU every rank lives in the same RAM: the run needs, summed over its ranks, the model states,
buffers and activations the simulator predicts for each (simulator/memory.py, the model that
`minigpt compare` checks against training within a few percent) plus what each process costs
before it holds anything (torch and the interpreter, PROCESS_BYTES). A run that would not fit in
the memory available now is refused in one line instead of being killed by the kernel's OOM
killer halfway. Each rank also builds the whole fp32 model before it keeps its share
(parallel/run/build.py), which is counted: on this 24 GiB machine a 1.27B-parameter run fitted the
steady-state estimate and was killed while it built. On CUDA each rank has its GPU: the most loaded rank's prediction against the
smallest GPU's free memory.
"""

from __future__ import annotations

from job.layout import Layout
from job.schedule_check import peak_ends_in_flight, peak_in_flight
from job.train_config import TrainConfig
from minigpt.errors import ConfigError

GIB = 2**30
BUILD_BYTES_PER_PARAM = 4  # parallel/run/build.py builds the whole fp32 GPT on every rank, then cuts its share out
PROCESS_BYTES = 220 * 2**20  # a rank before its tensors: RSS after importing torch and torch.distributed, 218 MiB (torch 2.13 CPU, measured here)


def predicted_rank_bytes(cfg: TrainConfig) -> list[int]:
    """Bytes of every pipeline stage's rank at its peak (model states, buffers, activations)."""
    from job.data_parallel import schedule_config
    from job.schedule import build_schedule
    from simulator.costs.implementation import Implementation
    from simulator.memory import predict_memory

    layout = Layout.of(cfg)
    # the schedule the simulator replays (simulator.engine.simulate.step_schedule), without importing the engine
    schedule = build_schedule(schedule_config(cfg.model, layout, cfg.micro_batches, cfg.schedule, cfg.bucket_mb,
                                              cfg.precision))
    micro_batch = cfg.global_batch // (cfg.micro_batches * cfg.dp)
    estimate = predict_memory(cfg.model, layout, cfg.precision, micro_batch, bucket_mb=cfg.bucket_mb,
                              micro_batches_in_flight=peak_in_flight(schedule), micro_batches=cfg.micro_batches,
                              ends_in_flight=peak_ends_in_flight(schedule),
                              implementation=Implementation(recompute=cfg.recompute, optimizer=cfg.optimizer))
    return [stage.total for stage in estimate.per_stage] if estimate.per_stage else [estimate.total]


def available_ram() -> int | None:
    """MemAvailable of /proc/meminfo in bytes (None where there is none)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        return None
    return None


def check_cpu_memory(cfg: TrainConfig, available: int | None = None) -> int:
    """The bytes the run needs in RAM; ConfigError when more than `available` (default: MemAvailable now)."""
    per_stage = predicted_rank_bytes(cfg)
    ranks_per_stage = cfg.tp * cfg.cp * cfg.dp
    built = BUILD_BYTES_PER_PARAM * cfg.model.n_params()  # every rank builds the whole model before cutting it
    needed = sum(per_stage) * ranks_per_stage + cfg.world_size * (PROCESS_BYTES + built)
    available = available_ram() if available is None else available
    if available is not None and needed > available:
        raise ConfigError(
            f"this run needs about {needed / GIB:.1f} GiB of RAM ({cfg.world_size} rank(s), the largest "
            f"{max(per_stage) / GIB:.2f} GiB of tensors, {built / GIB:.2f} GiB while it builds the model and "
            f"{PROCESS_BYTES / 2**20:.0f} MiB of process each) and "
            f"{available / GIB:.1f} GiB is available: make the model, the batch or the layout smaller "
            f"(`minigpt simulate` with the same model and layout shows the memory by category)"
        )
    return needed


def check_gpu_memory(cfg: TrainConfig, free_bytes: int) -> int:
    """The most loaded rank's bytes; ConfigError when more than the smallest GPU's `free_bytes`."""
    needed = max(predicted_rank_bytes(cfg))
    if needed > free_bytes:
        raise ConfigError(
            f"the most loaded rank needs about {needed / GIB:.1f} GiB and the GPU has {free_bytes / GIB:.1f} GiB "
            f"free: use ZeRO (--zero 1-3), more tensor or pipeline parallelism, or a smaller micro-batch"
        )
    return needed
