"""Collectives over one process group, counted: the bytes each kind moves per step.

Two counts per kind of collective:
  bytes   the size S of the buffer it works on (the convention of the
          simulator's closed forms): the whole tensor for all-reduce, the
          gathered (full) tensor for all-gather and reduce-scatter;
  volume  the ZeRO paper's communication volume per rank: 2S for an all-reduce
          (a reduce-scatter and an all-gather), S for the others. A ring moves
          (N-1)/N of it through each rank's link. A group of one rank (None) makes every call a local no-op,
so a 1-rank layout runs the same code without a process group.
"""

from __future__ import annotations

from collections import defaultdict

import time

import torch
import torch.distributed as dist


# torch 2.13 renamed the flat collectives; older releases know only the old names.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class Done:
    """The handle of a collective that had nothing to do."""

    def wait(self) -> None:
        return None


class Collectives:
    def __init__(self, group: dist.ProcessGroup | None, name: str):
        self.group = group
        self.name = name
        self.size = 1 if group is None else dist.get_world_size(group)
        self.rank = 0 if group is None else dist.get_rank(group)
        self.bytes: dict[str, int] = defaultdict(int)
        self.volume: dict[str, int] = defaultdict(int)
        self.calls: dict[str, int] = defaultdict(int)
        self.seconds = 0.0  # wall time inside blocking collectives since the last reset (async ones: not counted)

    def _count(self, kind: str, tensor: torch.Tensor) -> None:
        size = tensor.numel() * tensor.element_size()
        self.bytes[kind] += size
        self.volume[kind] += 2 * size if kind == "all_reduce" else size
        self.calls[kind] += 1

    def count(self, kind: str, tensor: torch.Tensor) -> None:
        """Count a point-to-point transfer made elsewhere (the pipeline's sends)."""
        self._count(kind, tensor)

    def reset_counters(self) -> None:
        self.bytes.clear()
        self.volume.clear()
        self.calls.clear()
        self.seconds = 0.0

    def _timed(self, collective, *args, **kwargs):
        """Run a collective; a blocking one adds its wall time (waiting for the group included) to `seconds`."""
        if kwargs["async_op"]:
            return collective(*args, **kwargs)
        start = time.perf_counter()
        collective(*args, **kwargs)
        self.seconds += time.perf_counter() - start
        return None

    def all_reduce(self, tensor: torch.Tensor, op=dist.ReduceOp.SUM, async_op: bool = False):
        if self.group is None:
            return Done() if async_op else None
        self._count("all_reduce", tensor)
        return self._timed(dist.all_reduce, tensor, op=op, group=self.group, async_op=async_op)

    def all_gather(self, output: torch.Tensor, shard: torch.Tensor, async_op: bool = False):
        """output (size x shard) <- every rank's shard, in rank order."""
        if self.group is None:
            output.copy_(shard)
            return Done() if async_op else None
        self._count("all_gather", output)
        return self._timed(_all_gather_flat, output, shard, group=self.group, async_op=async_op)

    def reduce_scatter(self, shard: torch.Tensor, full: torch.Tensor, async_op: bool = False):
        """shard <- this rank's piece of the sum over ranks of `full`."""
        if self.group is None:
            shard.copy_(full)
            return Done() if async_op else None
        self._count("reduce_scatter", full)
        return self._timed(_reduce_scatter_flat, shard, full, group=self.group, async_op=async_op)

    def max(self, value: torch.Tensor) -> torch.Tensor:
        """The maximum of a small tensor over the group (for overflow flags)."""
        self.all_reduce(value, op=dist.ReduceOp.MAX)
        return value

    def sum(self, value: torch.Tensor) -> torch.Tensor:
        self.all_reduce(value, op=dist.ReduceOp.SUM)
        return value

    def counters(self) -> dict:
        return {
            kind: {"bytes": self.bytes[kind], "volume": self.volume[kind], "calls": self.calls[kind]}
            for kind in sorted(self.bytes)
        }
