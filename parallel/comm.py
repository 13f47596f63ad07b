"""Collectives over one process group, counted: the bytes each kind moves per step.

Two counts per kind of collective:
  bytes   the size S of the buffer it works on (the convention of the
          simulator's closed forms): the whole tensor for all-reduce, the
          gathered (full) tensor for all-gather and reduce-scatter;
  volume  the ZeRO paper's communication volume per rank: 2S for an all-reduce
          (a reduce-scatter and an all-gather), S for the others. A ring moves
          (N-1)/N of it through each rank's link. A group of one rank (None) makes every call a local no-op,
so a 1-rank layout runs the same code without a process group.

Every tensor handed in must live on the rank's device: NCCL takes CUDA tensors only
(tests/test_cuda_paths.py checks every collective of a training step on CPU).
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from parallel.clock import cuda_timing_event


def all_gather_flat(*args, **kwargs):
    """torch 2.13 renamed the flat collectives; older releases know only the old names.
    Looked up at each call, so that a wrapper installed on torch.distributed sees every call."""
    return (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(*args, **kwargs)


def reduce_scatter_flat(*args, **kwargs):
    return (getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor)(*args, **kwargs)


@dataclass(frozen=True)
class BlockedTime:
    """Time inside blocking collectives up to some point of a step, waiting for the group included.

    On the CPU: host wall time around each call (`host_seconds`). On CUDA the host returns from
    a blocking NCCL call as soon as the current stream is made to wait for it, so each call is
    bracketed by two CUDA events on the current stream (`spans`): from when the stream reaches
    the call to when it may go on, which holds the transfer and the wait for the slowest peer.
    `seconds()` resolves them, and may be called only once the device has synchronised.
    """

    host_seconds: float = 0.0
    spans: tuple[tuple[Any, Any], ...] = ()

    def seconds(self) -> float:
        return self.host_seconds + sum(start.elapsed_time(end) for start, end in self.spans) / 1000.0


class Done:
    """The handle of a collective that had nothing to do."""

    def wait(self) -> None:
        return None


class Collectives:
    def __init__(self, group: dist.ProcessGroup | None, name: str, device: torch.device | None = None):
        """`device`: the rank's; on CUDA blocking collectives are timed with CUDA events."""
        self.group = group
        self.name = name
        self.timed_on_device = device is not None and device.type == "cuda"
        self.size = 1 if group is None else dist.get_world_size(group)
        self.rank = 0 if group is None else dist.get_rank(group)
        self.bytes: dict[str, int] = defaultdict(int)
        self.volume: dict[str, int] = defaultdict(int)
        self.calls: dict[str, int] = defaultdict(int)
        self.log: list[tuple[str, int]] = []  # (kind, bytes) of every call since the last reset, in order
        self._host_seconds = 0.0  # inside blocking collectives since the last reset (async ones: not counted)
        self._spans: list[tuple[Any, Any]] = []  # on CUDA: (start, end) events around each blocking call

    def _count(self, kind: str, tensor: torch.Tensor) -> None:
        size = tensor.numel() * tensor.element_size()
        self.bytes[kind] += size
        self.volume[kind] += 2 * size if kind == "all_reduce" else size
        self.calls[kind] += 1
        self.log.append((kind, size))

    def count(self, kind: str, tensor: torch.Tensor) -> None:
        """Count a point-to-point transfer made elsewhere (the pipeline's sends)."""
        self._count(kind, tensor)

    def reset_counters(self) -> None:
        self.bytes.clear()
        self.volume.clear()
        self.calls.clear()
        self.log = []
        self._host_seconds = 0.0
        self._spans = []

    def blocked(self) -> BlockedTime:
        """Time inside blocking collectives since the last reset, as of now (resolve it after synchronising)."""
        return BlockedTime(self._host_seconds, tuple(self._spans))

    @property
    def seconds(self) -> float:
        """blocked().seconds(): on CUDA only once the device has synchronised."""
        return self.blocked().seconds()

    def _timed(self, collective, *args, **kwargs):
        """Run a collective; a blocking one adds its time (waiting for the group included) to `blocked()`."""
        if kwargs["async_op"]:
            return collective(*args, **kwargs)
        if self.timed_on_device:
            start = cuda_timing_event()
            start.record()
            collective(*args, **kwargs)
            end = cuda_timing_event()
            end.record()
            self._spans.append((start, end))
            return None
        start_s = time.perf_counter()
        collective(*args, **kwargs)
        self._host_seconds += time.perf_counter() - start_s
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
        return self._timed(all_gather_flat, output, shard, group=self.group, async_op=async_op)

    def reduce_scatter(self, shard: torch.Tensor, full: torch.Tensor, async_op: bool = False):
        """shard <- this rank's piece of the sum over ranks of `full`."""
        if self.group is None:
            shard.copy_(full)
            return Done() if async_op else None
        self._count("reduce_scatter", full)
        return self._timed(reduce_scatter_flat, shard, full, group=self.group, async_op=async_op)

    def all_to_all(self, output: torch.Tensor, tensor: torch.Tensor, output_splits: list[int],
                   input_splits: list[int]):
        """output <- from each rank its rows for this one (output_splits[r] rows from rank r), tensor's rows
        input_splits[r] going to rank r; counted as the whole input handed in (its own rows included)."""
        if self.group is None:
            output.copy_(tensor)
            return None
        self._count("all_to_all", tensor)
        return self._timed(dist.all_to_all_single, output, tensor, output_splits, input_splits, group=self.group,
                           async_op=False)

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
