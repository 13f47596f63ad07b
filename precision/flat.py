"""Flat parameter buffers: every parameter of a module as a view into one buffer.

The flat space is cut into buckets of whole parameters, each padded to a
multiple of `pad_to` (the data-parallel size under ZeRO), so that a bucket can
be reduce-scattered or all-gathered in equal pieces. Rank r of N owns piece r
of every bucket: `shard_ranges(r, N)`.

With `grads=True` the parameters' `.grad` are views into one flat gradient
buffer too, so autograd accumulates into it in place (ZeRO 0 and 1, and one
process). ZeRO 2 and 3 keep no full gradient buffer and leave `.grad` alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class Segment:
    """Where one parameter lives in the flat buffer."""

    name: str
    start: int
    end: int
    decay: bool  # matrices and embeddings take weight decay; LayerNorms and biases do not


@dataclass(frozen=True)
class Bucket:
    """A run of whole parameters [start, end) padded to `end`, and their indices."""

    index: int
    start: int
    end: int
    params: tuple[int, ...]
    group: int = 0  # which of the parameter groups it cuts (a pipeline rank's chunks, in order)

    @property
    def numel(self) -> int:
        return self.end - self.start


class FlatParameters:
    """The parameters `named` as views into one flat buffer of their (common) dtype."""

    def __init__(
        self,
        named: list[tuple[str, nn.Parameter]] | nn.Module,
        bucket_numel: int | None = None,
        pad_to: int = 1,
        grads: bool = True,
        groups: list[list[tuple[str, nn.Parameter]]] | None = None,
    ):
        """`groups`: parameters in groups that a bucket never spans (a pipeline rank's chunks,
        whose backwards interleave); default: one group, the module's parameters."""
        if groups is None:
            groups = [list(named.named_parameters()) if isinstance(named, nn.Module) else named]
        groups = [group for group in groups if group]
        if not groups:
            raise ValueError("no parameters to flatten")
        named = [item for group in groups for item in group]
        ends = [sum(len(g) for g in groups[: i + 1]) - 1 for i in range(len(groups))]
        self.params = [param for _, param in named]
        first = self.params[0]
        self.dtype, self.device = first.dtype, first.device
        self.segments: list[Segment] = []
        self.buckets: list[Bucket] = []
        offset, bucket_start, members = 0, 0, []
        for index, (name, param) in enumerate(named):
            self.segments.append(Segment(name, offset, offset + param.numel(), param.dim() >= 2))
            offset += param.numel()
            members.append(index)
            if index in ends or (bucket_numel is not None and offset - bucket_start >= bucket_numel):
                end = -(-offset // pad_to) * pad_to
                group = sum(1 for last in ends if last < index)
                self.buckets.append(Bucket(len(self.buckets), bucket_start, end, tuple(members), group))
                offset = bucket_start = end
                members = []
        self.numel = sum(p.numel() for p in self.params)
        self.padded_numel = offset
        self.bucket_of = {i: b for b in self.buckets for i in b.params}
        self.data = torch.zeros(self.padded_numel, dtype=self.dtype, device=self.device)
        self.grad = torch.zeros_like(self.data) if grads else None
        for segment, param in zip(self.segments, self.params):
            view = self.view(self.data, segment, param)
            view.copy_(param.detach())
            param.data = view
            if self.grad is not None:
                param.grad = self.view(self.grad, segment, param)

    @staticmethod
    def view(buffer: torch.Tensor, segment: Segment, param: torch.Tensor) -> torch.Tensor:
        return buffer[segment.start : segment.end].view_as(param)

    def zero_grad(self) -> None:
        if self.grad is not None:
            self.grad.zero_()

    def shard_ranges(self, rank: int, world: int) -> list[tuple[int, int]]:
        """The flat ranges rank `rank` of `world` owns: piece `rank` of every bucket."""
        ranges = []
        for bucket in self.buckets:
            piece = bucket.numel // world
            ranges.append((bucket.start + rank * piece, bucket.start + (rank + 1) * piece))
        return ranges

    def decay_ranges(self, ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """Where weight decay applies, in the coordinates of `ranges` laid end to end."""
        return self.local_ranges(ranges, lambda index: self.segments[index].decay)

    def local_ranges(self, ranges: list[tuple[int, int]], select) -> list[tuple[int, int]]:
        """The parts of the parameters `select(index)` picks, in the coordinates of `ranges` laid end to end."""
        local, base = [], 0
        for start, end in ranges:
            for index, segment in enumerate(self.segments):
                lo, hi = max(segment.start, start), min(segment.end, end)
                if lo < hi and select(index):
                    local.append((base + lo - start, base + hi - start))
            base += end - start
        return local


def gather_ranges(buffer: torch.Tensor, ranges: list[tuple[int, int]]) -> torch.Tensor:
    """The pieces `ranges` of a flat buffer, laid end to end in a new tensor."""
    if len(ranges) == 1:
        start, end = ranges[0]
        return buffer[start:end].clone()
    return torch.cat([buffer[start:end] for start, end in ranges])
