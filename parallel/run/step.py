"""One training step of one rank, begin to end: the schedule's actions (ZeRO's collectives among
them), the optimizer at OptimizerStep, the update gathers landing, the step clock's stamps. Every
rank of the layout runs it, through `Rank.train_step` (parallel/run/build.py); the loop around it is
parallel/run/train.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from parallel.clock import StepClock, TimedEvent
from parallel.expert.balance import update_expert_bias
from parallel.memory import ActivationMeter
from job.train_config import TrainConfig
from precision.optimizer import StepResult


def mean_over(group, value: float, size: int, device: torch.device) -> float:
    """The mean of a Python number over a group (not counted as training traffic), reduced in a
    tensor on `device`, the rank's: NCCL reduces only CUDA tensors."""
    if group is None:
        return value
    tensor = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(tensor, group=group)
    return float(tensor[0]) / size


@dataclass
class StepOutcome:
    """What one training step did on this rank. Times: perf_counter seconds, device-side on CUDA
    (parallel/clock.py); `end` is after the device finished all of the step's work."""

    loss: float  # the micro-batches' mean loss, averaged over the data-parallel ranks
    result: StepResult
    start: float
    end: float
    events: list[TimedEvent]
    tp_seconds: float  # inside blocking tensor-parallel collectives (parallel/comm.py BlockedTime)
    comm: dict[str, dict]
    ep_seconds: float = 0.0  # inside expert parallelism's all-to-alls (blocking, inside the compute actions)

    @property
    def seconds(self) -> float:
        return self.end - self.start


def train_step(rank: "Rank", cfg: TrainConfig, step: int, inputs: list[torch.Tensor], targets: list[torch.Tensor],
               activations: ActivationMeter | None = None) -> StepOutcome:
    """One optimizer step on this rank: the schedule's actions, the gradient reduction and the update,
    each stamped by the step clock; every rank of the layout calls it."""
    data_parallel, mesh, scaler = rank.data_parallel, rank.mesh, rank.scaler
    for comm in rank.comms.values():
        comm.reset_counters()
    clock = StepClock(mesh.device)
    start = clock.start()
    data_parallel.begin_step()
    scale = scaler.scale_loss if scaler else _unscaled
    tp_blocked, ep_blocked = [], []

    def optimize():
        tp_blocked.append(rank.comms["tp"].blocked())  # inside the compute actions (Megatron's collectives block)
        if "ep" in rank.comms:  # the experts' all-to-alls, inside the compute actions too
            ep_blocked.append(rank.comms["ep"].blocked())
        grads = data_parallel.finish_grads()
        result = rank.optimizer.step(grads, cfg.learning_rate(step), grad_clip=cfg.grad_clip, scaler=scaler,
                                     reduce_sum=rank.reduce_sum)
        update_expert_bias(rank.stage, mesh, cfg.sequence_parallel)  # the step's load over the batch moves it
        return result

    record = rank.executor.run_step(inputs, targets, scale, activations, clock, optimize)
    dp_start = clock.stamp()
    data_parallel.end_step()  # the update gathers land
    dp_end = clock.stamp()
    end = clock.finish()
    result = record.result
    tp_seconds = tp_blocked[0].seconds()  # CUDA events resolve only now
    ep_seconds = ep_blocked[0].seconds() if ep_blocked else 0.0
    events = clock.resolve([*record.events, ("UpdateGathers", "dp", dp_start, dp_end)])
    comm_counts = {dim: comm.counters() for dim, comm in rank.comms.items()}
    loss = mean_over(mesh.group("pp"), record.loss_sum / cfg.micro_batches, 1, mesh.device)
    loss = mean_over(mesh.data_group(), loss, mesh.data_ranks, mesh.device)  # the mean over every token
    return StepOutcome(loss, result, start, end, events, tp_seconds, comm_counts, ep_seconds)


def _unscaled(loss: torch.Tensor) -> torch.Tensor:
    return loss
