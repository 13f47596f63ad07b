"""What the executor and the training step ask of a data-parallel wrapper (ZeRO stages 0-3).

parallel/data/zero.py's Replicated, ShardedOptimizer, ShardedGradients and parallel/data/zero3.py's
ShardedParameters all provide it; parallel/run/build.py picks one per run. A step is:

    begin_step()
    for each action of the schedule (parallel/pipeline/executor.py):
        a compute:            begin_compute(chunk, armed) ... end_compute()
                              (the hooks issue the armed gathers and reductions while it runs)
        a data-parallel one:  issue(action); after a compute's last reduction: end_reductions()
        OptimizerStep:        finish_grads() -> the optimizer's gradients (reduce_sum inside it)
    end_step()                (the update gathers land)
"""

from __future__ import annotations

from typing import Protocol

import torch


class DataParallel(Protocol):
    stage: int  # the ZeRO stage that runs (0 with one replica)

    @property
    def decay_ranges(self) -> list[tuple[int, int]]: ...

    def ranges_of(self, param_ids: set[int]) -> list[tuple[int, int]]: ...

    def layout(self) -> dict[int, tuple[int, ...]]:
        """Each chunk's bucket (ZeRO-3: unit) sizes, checked against the schedule's plan."""

    def sharding(self) -> tuple[int, int, bool]:
        """(ranks a reduction spans, copies of each shard, whether ZeRO-3 reshards after the forward): the plan's."""

    def begin_step(self) -> None: ...

    def begin_compute(self, chunk: int, armed: tuple) -> None: ...

    def end_compute(self) -> None: ...

    def issue(self, action) -> None: ...

    def end_reductions(self) -> None: ...

    def before_weight_grads(self, params: list[torch.Tensor]) -> None: ...

    def add_grad(self, param: torch.Tensor, grad: torch.Tensor) -> None: ...

    def finish_grads(self) -> torch.Tensor: ...

    def reduce_sum(self, value: torch.Tensor) -> torch.Tensor: ...

    def after_update(self) -> None: ...

    def end_step(self) -> None: ...

    def parameter_storages(self) -> set[int]: ...

    def memory(self) -> dict[str, int]: ...
