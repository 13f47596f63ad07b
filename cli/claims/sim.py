"""One simulated training step, as `minigpt simulate` runs it, and the command line that prints it. Torch-free.

A `SimCase` is a job on a cluster built as `minigpt simulate` builds it without --nodes (the layout's
GPUs in whole servers, or one partly filled server): its `result` is simulator/search/sweep.py's Job.simulate
(simulate_step with the command's defaults: flash attention, our executor's overlap, 25 MiB buckets),
and its `command` is the `minigpt simulate` line that prints the same numbers.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from cli.options.cluster import DEFAULT_GPU
from job.layout import Layout
from minigpt.config import GPTConfig
from minigpt.presets import preset
from simulator.engine.simulate import SimResult
from simulator.search.sweep import ClusterSpec, Job

GIB = 2**30


@dataclass(frozen=True)
class SimCase:
    model: str
    precision: str = "bf16"
    tp: int = 1
    pp: int = 1
    dp: int = 1
    zero: int = 0
    micro_batch: int = 1
    global_batch: int | None = None  # None: micro_batch x dp x pp, as the command's default
    gpu: str = DEFAULT_GPU
    schedule: str = "1f1b"

    @property
    def config(self) -> GPTConfig:
        return preset(self.model)

    @property
    def layout(self) -> Layout:
        return Layout(tp=self.tp, pp=self.pp, dp=self.dp, zero=self.zero)

    @property
    def batch(self) -> int:
        return self.global_batch or self.micro_batch * self.dp * self.pp

    @property
    def job(self) -> Job:
        return Job(self.config, self.precision, self.batch, self.micro_batch, self.zero, self.schedule)

    @property
    def result(self) -> SimResult:
        return _simulate(self)

    def command(self) -> str:
        flags = [f"--model {self.model}"]
        if self.precision != "bf16":
            flags.append(f"--precision {self.precision}")
        flags += [f"--{name} {value}" for name, value in (("tp", self.tp), ("pp", self.pp), ("dp", self.dp))
                  if value != 1]
        if self.zero:
            flags.append(f"--zero {self.zero}")
        if self.micro_batch != 1:
            flags.append(f"--micro-batch-size {self.micro_batch}")
        if self.global_batch:
            flags.append(f"--global-batch {self.global_batch}")
        if self.schedule != "1f1b":
            flags.append(f"--schedule {self.schedule}")
        return f"minigpt simulate {' '.join(flags)} --gpu {self.gpu}"

    def label(self, precision: bool = True) -> str:
        """Short: 'gpt2-124m bf16 mb 8', 'gpt3-175b bf16 tp8 pp16 dp8 ZeRO-1' (without the precision if asked)."""
        parts = [self.model] + ([self.precision] if precision else [])
        parts += [f"{name}{value}" for name, value in (("tp", self.tp), ("pp", self.pp), ("dp", self.dp)) if value > 1]
        if self.zero and self.dp > 1:
            parts.append(f"ZeRO-{self.zero}")
        if self.micro_batch > 1:
            parts.append(f"mb {self.micro_batch}")
        return " ".join(parts)


@lru_cache(maxsize=None)
def _simulate(case: SimCase) -> SimResult:
    spec = ClusterSpec.of(case.gpu)
    return case.job.simulate(case.layout, spec.build(case.layout.world_size), spec.hardware)


def memory_shares(result: SimResult) -> dict[str, float]:
    """The article's five memory categories as shares of the GPU's total: parameters, gradients, optimizer
    (fp32 masters and AdamW m, v: the ZeRO paper's optimizer states), activations, other (buffers)."""
    memory = result.memory_per_gpu()
    total = memory["total"]
    return {"parameters": memory["parameters"] / total, "gradients": memory["gradients"] / total,
            "optimizer": (memory["master_weights"] + memory["optimizer_states"]) / total,
            "activations": memory["activations"] / total, "other": memory["comm_buffers"] / total}
