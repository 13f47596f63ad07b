"""The mesh of ranks: pipeline x data x context x tensor parallel, tensor parallel innermost.

Global rank r sits at (pp_rank, dp_rank, cp_rank, tp_rank) with
r == ((pp_rank * dp + dp_rank) * cp + cp_rank) * tp + tp_rank.
Tensor parallelism talks the most (two all-reduces per layer, every micro-batch), so its group
is tp adjacent ranks: with launchers numbering a node's ranks consecutively, it stays inside one
node, on the fastest links, as in Megatron-LM. Context parallelism comes next (keys and values
every layer, overlapped with attention): tp x cp adjacent ranks, on a node's links while they fit
in it. Data parallelism talks once a step and pipeline parallelism only point to point, so they
can span nodes. Weight gradients are averaged over dp x cp (`data_group`): a context-parallel
rank is, for the weights, one more replica that saw other tokens. Hybrid sharding (`shard`, HSDP) cuts
those dp x cp data ranks, in order, into shard groups of N consecutive ones (`shard_group`: ZeRO shards,
reduce-scatters and gathers inside one) and replica groups, the ranks at the same place in every shard
group (`replica_group`: the reduce-scattered gradients are all-reduced across them).

The groups come from torch's DeviceMesh, the structure DTensor, FSDP2 and torch's own
tensor parallelism use, so those can be compared with ours on the very same groups.
A 1 x 1 x 1 layout has no process group at all: a single-process run needs no torch.distributed.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from minigpt.errors import ConfigError

# Outermost first: the order of DeviceMesh's dimensions and of the rank formula.
MESH_DIMS = ("pp", "dp", "cp", "tp")


@dataclass(frozen=True)
class Mesh:
    """This rank's place in the pp x dp x cp x tp layout, and its groups along each dimension."""

    pp: int
    dp: int
    tp: int
    rank: int
    pp_rank: int
    dp_rank: int
    tp_rank: int
    device: torch.device
    device_mesh: DeviceMesh | None = field(default=None, repr=False, compare=False)
    cp: int = 1
    cp_rank: int = 0
    data_group_: dist.ProcessGroup | None = field(default=None, repr=False, compare=False)
    shard: int = 0  # hybrid sharding: data ranks per shard group (0: all of them)
    shard_group_: dist.ProcessGroup | None = field(default=None, repr=False, compare=False)
    replica_group_: dist.ProcessGroup | None = field(default=None, repr=False, compare=False)

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.cp * self.tp

    @property
    def data_ranks(self) -> int:
        """Ranks that hold the same weights and average their gradients: dp x cp."""
        return self.dp * self.cp

    def data_group(self) -> dist.ProcessGroup | None:
        """The group over dp x cp (None for one rank): gradients are averaged and ZeRO shards over it."""
        if self.data_ranks == 1:
            return None
        if self.cp == 1:
            return self.group("dp")
        if self.dp == 1:
            return self.group("cp")
        return self.data_group_

    @property
    def shard_ranks(self) -> int:
        """Data ranks per shard group: `shard`, or all of them."""
        return self.shard or self.data_ranks

    def shard_group(self) -> dist.ProcessGroup | None:
        """This rank's shard group (the whole data group without hybrid sharding; None for one rank)."""
        if self.shard_ranks == self.data_ranks:
            return self.data_group()
        return self.shard_group_

    def replica_group(self) -> dist.ProcessGroup | None:
        """The ranks at this rank's place in every shard group (None without hybrid sharding)."""
        return None if self.shard_ranks == self.data_ranks else self.replica_group_

    def size(self, dim: str) -> int:
        check_dim(dim)
        return getattr(self, dim)

    def coordinate(self, dim: str) -> int:
        check_dim(dim)
        return getattr(self, f"{dim}_rank")

    def group(self, dim: str) -> dist.ProcessGroup | None:
        """The process group along dim; None when dim has size 1, so callers skip the collective."""
        if self.size(dim) == 1 or self.device_mesh is None:
            return None
        return self.device_mesh.get_group(dim)

    def ranks_of(self, dim: str) -> list[int]:
        """Global ranks of this rank's group along dim, in the order of their coordinate on dim."""
        coordinates = {name: self.coordinate(name) for name in MESH_DIMS}
        ranks = []
        for index in range(self.size(dim)):
            coordinates[dim] = index
            ranks.append(self.global_rank(**coordinates))
        return ranks

    def global_rank(self, pp: int, dp: int, cp: int, tp: int) -> int:
        """The global rank at these coordinates."""
        return global_rank(pp, dp, tp, self.dp, self.tp, cp, self.cp)

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1

    @property
    def prev_stage_rank(self) -> int | None:
        """Global rank of the pipeline stage that sends this one activations; None for the first."""
        return None if self.is_first_stage else self.ranks_of("pp")[self.pp_rank - 1]

    @property
    def next_stage_rank(self) -> int | None:
        """Global rank of the pipeline stage this one sends activations to; None for the last."""
        return None if self.is_last_stage else self.ranks_of("pp")[self.pp_rank + 1]


def check_dim(dim: str) -> None:
    if dim not in MESH_DIMS:
        raise ConfigError(f"mesh dimension must be one of {', '.join(MESH_DIMS)}, got {dim!r}")


def global_rank(pp_rank: int, dp_rank: int, tp_rank: int, dp: int, tp: int, cp_rank: int = 0, cp: int = 1) -> int:
    return ((pp_rank * dp + dp_rank) * cp + cp_rank) * tp + tp_rank


def build_mesh(pp: int, dp: int, tp: int, device: torch.device, cp: int = 1, shard: int = 0) -> Mesh:
    """This rank's Mesh for a pp x dp x cp x tp layout; every rank must call it, with the same sizes.
    `shard`: data ranks per shard group under hybrid sharding (0: none; it must divide dp x cp).

    Call it after init_worker(): the sizes must multiply to the process group's world size.
    """
    sizes = {"pp": pp, "dp": dp, "cp": cp, "tp": tp}
    for name, value in sizes.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{name} size must be a positive integer, got {value!r}")
    needed = pp * dp * cp * tp
    running = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if needed != running:
        hint = "start it through parallel.launch.elastic.launch()" if running == 1 else "change the layout or the launch"
        cp_part = f" x cp {cp}" if cp > 1 else ""
        raise ConfigError(
            f"the layout pp {pp} x dp {dp}{cp_part} x tp {tp} needs {needed} ranks but {running} are running: {hint}"
        )
    if needed == 1:
        return Mesh(1, 1, 1, rank=0, pp_rank=0, dp_rank=0, tp_rank=0, device=device)
    device_mesh = init_device_mesh(device.type, (pp, dp, cp, tp), mesh_dim_names=MESH_DIMS)
    coordinate = device_mesh.get_coordinate()
    if coordinate is None:
        raise AssertionError("this rank is missing from a mesh that spans the whole world")
    pp_rank, dp_rank, cp_rank, tp_rank = coordinate
    mesh = Mesh(pp, dp, tp, rank=dist.get_rank(), pp_rank=pp_rank, dp_rank=dp_rank, tp_rank=tp_rank, device=device,
                device_mesh=device_mesh, cp=cp, cp_rank=cp_rank)
    if dp > 1 and cp > 1:
        mesh = replace(mesh, data_group_=_data_group(mesh))
    if 0 < shard < mesh.data_ranks:
        if mesh.data_ranks % shard:
            raise ConfigError(f"a shard group of {shard} ranks does not divide dp x cp = {mesh.data_ranks}")
        mesh = replace(mesh, shard=shard, shard_group_=_sub_group(mesh, shard, True),
                       replica_group_=_sub_group(mesh, shard, False))
    return mesh


def stage_group(mesh: Mesh) -> dist.ProcessGroup | None:
    """The ranks of this rank's pipeline stage, dp x cp x tp of them (None for one rank; the world without
    pipelining): Muon's matrices are dealt out over it (parallel/run/muon.py). Built on demand, not by build_mesh;
    collective: every rank builds every stage's group, in one order."""
    if mesh.world_size == 1:
        return None
    if mesh.pp == 1:
        return dist.group.WORLD
    return _own_group(mesh, [[mesh.global_rank(pp_rank, dp, cp, tp) for dp in range(mesh.dp)
                              for cp in range(mesh.cp) for tp in range(mesh.tp)] for pp_rank in range(mesh.pp)])


def _own_group(mesh: Mesh, groups: list[list[int]]) -> dist.ProcessGroup | None:
    """Every group of `groups` built (new_group is collective: every rank builds each, in one order); this rank's."""
    mine = None
    for ranks in groups:
        group = dist.new_group(ranks)
        if mesh.rank in ranks:
            mine = group
    return mine


def _data_group(mesh: Mesh) -> dist.ProcessGroup:
    """This rank's dp x cp group; every rank builds every one (new_group is collective), in one order."""
    return _own_group(mesh, [[mesh.global_rank(pp_rank, dp_rank, cp_rank, tp_rank)
                              for dp_rank in range(mesh.dp) for cp_rank in range(mesh.cp)]
                             for pp_rank in range(mesh.pp) for tp_rank in range(mesh.tp)])


def _sub_group(mesh: Mesh, shard: int, shards: bool) -> dist.ProcessGroup:
    """This rank's shard group (`shards`: `shard` consecutive data ranks) or replica group (the data ranks
    `shard` apart); every rank builds every one of them, in one order (new_group is collective)."""
    groups = []
    for pp_rank in range(mesh.pp):
        for tp_rank in range(mesh.tp):
            data = [mesh.global_rank(pp_rank, dp_rank, cp_rank, tp_rank)
                    for dp_rank in range(mesh.dp) for cp_rank in range(mesh.cp)]
            groups += [data[g : g + shard] for g in range(0, len(data), shard)] if shards else \
                [data[j::shard] for j in range(shard)]
    return _own_group(mesh, groups)
