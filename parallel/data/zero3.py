"""ZeRO stage 3: parameters sharded too, gathered one unit at a time.

The model is cut into units -- the embeddings, each block, the final norm and
head -- and each unit's parameters are laid out flat (precision/flat.py),
padded to a multiple of the data-parallel size N. A rank stores only its 1/N
piece of every unit (`weights`, end to end). A unit's full weights exist only
while it computes:

  forward   a pre-hook all-gathers the unit (or waits for its prefetch) and
            starts gathering the next one; a post-hook frees a block again.
  backward  a backward pre-hook gathers the block once more (and prefetches
            the block before it); when the last gradient of a unit is in, its
            gradients are reduce-scattered into this rank's shard of gradients
            and its full weights freed. Under a zero-bubble schedule the weight
            gradients come later than the input gradients (parallel/pipeline/executor.py
            WeightGradients), and `before_weight_grads` gathers the unit for them.

The first and last units stay gathered from their first use until the step
ends: the embedding matrix is also the tied LM head, used at the very end of
the forward and the very start of the backward. Freeing is done by resizing a
unit's storage to zero, so the Parameters (views into it) come back valid when
it is gathered again; autograd's saved weights are those same views.

Without resharding after the forward (`reshard_after_forward` False, FSDP2's
reshard_after_forward=False) the post-forward hook frees nothing in a step: a
unit gathered for its forward is still there for its backward, which gathers
nothing, and it is freed after its reduction. `hold` (job/schedule_actions.py's
ScheduleConfig.zero3_hold) is 1 (reduced and freed after each backward; one gather
per unit and micro-batch) or, under pipelining, the step's micro-batches
(torchtitan's way: gathered once, its gradients summed unsharded in its staging
buffer over the micro-batches and reduce-scattered once, after the chunk's last
backward, when the schedule arms that reduction, then freed: torch's pipelining
turns FSDP2's gradient sync off for every backward but the last). Outside a
scheduled step (evaluation) the forward frees as usual. Resharding after the
forward, gradients are reduce-scattered per micro-batch. job/schedule_comm.py
lists exactly these gathers and reductions.

Hybrid sharding (HSDP): `comm` is a shard group of N ranks, which the units are
padded to and cut over; `replicas` the replica group, over which each unit's
reduce-scattered piece is all-reduced (parallel/data/zero.py).
"""

from __future__ import annotations

import torch
from torch import nn

from job.schedule_actions import GatherParams, ReduceScatterGrads
from parallel.expert import is_expert_shard
from parallel.comm import Collectives
from parallel.data.zero import MAX_IN_FLIGHT, add_to_shard
from precision.flat import FlatParameters


class Unit:
    def __init__(self, index: int, modules: list[nn.Module], named: list, comm: Collectives, keep: bool,
                 key: tuple[int, int]):
        self.index, self.modules, self.keep = index, modules, keep
        self.key = key  # (global chunk, unit within it): how the schedule names it
        self.flat = FlatParameters(named, pad_to=comm.size, grads=False)
        self.full_bytes = self.flat.data.untyped_storage().nbytes()
        self.piece = self.flat.padded_numel // comm.size
        self.gathered = True
        self.pending_gather = None
        self.grads_waiting = 0
        self.staging: torch.Tensor | None = None

    def storage_ptr(self) -> int:
        return self.flat.data.untyped_storage().data_ptr()


def nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def units_of(model: nn.Module) -> list[tuple[int, list[nn.Module]]]:
    """The GPT cut into units, in forward order, with the chunk each belongs to (one process: chunk 0)."""
    if hasattr(model, "units"):
        return model.units()
    return [(0, modules) for modules in
            [[m for m in (model.tok_emb, model.pos_emb) if m is not None], *[[block] for block in model.blocks],
             [model.norm_f, model.head]]]


class ShardedParameters:
    stage = 3

    def __init__(self, model: nn.Module, comm: Collectives, replicas: Collectives | None = None,
                 reshard_after_forward: bool = True, hold: int = 1):
        self.comm = comm
        self.replicas = replicas or Collectives(None, "dp_replicas")
        self.reshard_after_forward, self.hold = reshard_after_forward, hold  # module docstring
        self.units: list[Unit] = []
        seen: set[int] = set()
        groups = units_of(model)
        for index, (chunk, modules) in enumerate(groups):
            named = []
            for module in modules:
                for name, param in module.named_parameters():
                    if id(param) not in seen and not is_expert_shard(param):  # a tied weight: its first unit's
                        seen.add(id(param))
                        named.append((name, param))
            if named:
                keep = index in (0, len(groups) - 1)
                within = sum(1 for unit in self.units if unit.key[0] == chunk)
                self.units.append(Unit(len(self.units), modules, named, comm, keep, (chunk, within)))
        offsets, total = [], 0
        for unit in self.units:
            offsets.append(total)
            total += unit.piece
        self.offsets = offsets
        unit0 = self.units[0].flat
        self.weights = torch.empty(total, dtype=unit0.dtype, device=unit0.device)
        for unit, offset in zip(self.units, offsets):
            start = comm.rank * unit.piece
            self.weights[offset : offset + unit.piece].copy_(unit.flat.data[start : start + unit.piece])
            self.free(unit)
        self.shard_grad = torch.zeros_like(self.weights)
        self.decay_ranges = self.local_ranges(lambda flat, index: flat.segments[index].decay)
        self.unit_of = {id(param): unit for unit in self.units for param in unit.flat.params}
        self.unit_at = {unit.key: unit for unit in self.units}
        self.armed: dict[tuple, object] = {}  # ("gather" | "reduce", chunk, unit) -> the action
        self.issued: set = set()
        self.scheduled = False  # inside a scheduled step: only armed actions may gather or reduce
        self.in_flight: list[tuple] = []
        self.comm_buffer_peak = 0
        self.install_hooks()

    def local_ranges(self, select) -> list[tuple[int, int]]:
        """The parts of the parameters `select(flat, index)` picks, in `weights` coordinates."""
        found = []
        for unit, offset in zip(self.units, self.offsets):
            start = self.comm.rank * unit.piece
            ranges = unit.flat.local_ranges([(start, start + unit.piece)], lambda i, f=unit.flat: select(f, i))
            found += [(offset + lo, offset + hi) for lo, hi in ranges]
        return found

    def ranges_of(self, param_ids: set[int]) -> list[tuple[int, int]]:
        return self.local_ranges(lambda flat, index: id(flat.params[index]) in param_ids)

    def add_grad(self, param: torch.Tensor, grad: torch.Tensor) -> None:
        """Average a gradient computed outside the hooks (a tied copy's) over the group; add this rank's piece."""
        for unit, offset in zip(self.units, self.offsets):
            for segment, owned in zip(unit.flat.segments, unit.flat.params):
                if owned is param:
                    start = self.comm.rank * unit.piece
                    add_to_shard(self.comm, self.shard_grad, grad, segment, [((start, start + unit.piece), offset)],
                                 self.replicas)
                    return

    # ---------------------------------------------------------------- gather and free

    def shard_of(self, unit: Unit) -> torch.Tensor:
        offset = self.offsets[unit.index]
        return self.weights[offset : offset + unit.piece]

    def start_gather(self, unit: Unit, needed: bool = True) -> None:
        """Start gathering `unit` unless it is here or on its way. In a scheduled step only the
        gather the schedule armed for this compute may run: one `needed` and not armed is an error,
        a prefetch (not `needed`) that is not armed is left for the unit's own turn."""
        if unit.gathered or unit.pending_gather is not None:
            return
        if self.scheduled:
            action = self.armed.get(("gather", *unit.key))
            if action is None:
                if not needed:
                    return
                raise RuntimeError(f"ZeRO-3: unit {unit.key} is needed but the schedule gathers no such unit "
                                   "before this compute")
            self.issued.add(action)
        unit.flat.data.untyped_storage().resize_(unit.full_bytes)
        unit.pending_gather = self.comm.all_gather(unit.flat.data, self.shard_of(unit), async_op=True)
        self.note_buffers()

    def ensure_gathered(self, unit: Unit) -> None:
        self.start_gather(unit)
        if unit.pending_gather is not None:
            unit.pending_gather.wait()
            unit.pending_gather = None
            unit.gathered = True

    def free(self, unit: Unit) -> None:
        if unit.pending_gather is not None:
            unit.pending_gather.wait()
            unit.pending_gather = None
        unit.flat.data.untyped_storage().resize_(0)
        unit.gathered = False

    def note_buffers(self) -> None:
        gathered = sum(u.full_bytes for u in self.units if u.gathered or u.pending_gather is not None)
        staged = sum(nbytes(u.staging) for u in self.units if u.staging is not None)
        in_flight = sum(nbytes(out) + nbytes(staging) for _, out, _, staging in self.in_flight)
        self.comm_buffer_peak = max(self.comm_buffer_peak, gathered + staged + in_flight)

    # ---------------------------------------------------------------- hooks

    def install_hooks(self) -> None:
        for unit in self.units:
            unit.modules[0].register_forward_pre_hook(lambda module, args, u=unit: self.before_forward(u))
            if not unit.keep:
                unit.modules[-1].register_forward_hook(lambda module, args, out, u=unit: self.after_forward(u))
                unit.modules[0].register_full_backward_pre_hook(lambda module, grad, u=unit: self.before_backward(u))
            for index, param in enumerate(unit.flat.params):
                param.register_post_accumulate_grad_hook(lambda p, u=unit, i=index: self.on_grad(u, i, p))

    def neighbour(self, unit: Unit, step: int) -> Unit | None:
        """The unit `step` places on in the same chunk (prefetch stays inside the running compute)."""
        index = unit.index + step
        if 0 <= index < len(self.units) and self.units[index].key[0] == unit.key[0]:
            return self.units[index]
        return None

    def before_forward(self, unit: Unit) -> None:
        self.ensure_gathered(unit)
        following = self.neighbour(unit, 1)
        if following is not None:
            self.start_gather(following, needed=False)  # prefetch while this unit computes

    def after_forward(self, unit: Unit) -> None:
        if self.reshard_after_forward or not self.scheduled:
            self.free(unit)

    def after_reduction(self, unit: Unit) -> None:
        """Free `unit` after its reduction (held all step, its one reduction comes after its last backward), unless
        it is kept."""
        if not unit.keep:
            self.free(unit)

    def before_backward(self, unit: Unit) -> None:
        self.ensure_gathered(unit)
        preceding = self.neighbour(unit, -1)
        if preceding is not None:
            self.start_gather(preceding, needed=False)

    def before_weight_grads(self, params: list[torch.Tensor]) -> None:
        """A zero-bubble weight gradient runs after a later forward may have freed its unit again:
        gather it (a custom autograd Function may read the weight while computing the weight
        gradient); the unit is freed as usual once its last gradient is in."""
        for param in params:
            self.ensure_gathered(self.unit_of[id(param)])

    def on_grad(self, unit: Unit, index: int, param: torch.Tensor) -> None:
        if unit.staging is None:
            unit.staging = torch.zeros(unit.flat.padded_numel, dtype=unit.flat.dtype, device=unit.flat.device)
        segment = unit.flat.segments[index]
        staged = unit.staging[segment.start : segment.end]
        if self.hold > 1:  # summed over the step's micro-batches (module docstring)
            staged.add_(param.grad.reshape(-1))
        else:
            staged.copy_(param.grad.reshape(-1))
        param.grad = None
        unit.grads_waiting -= 1
        self.note_buffers()
        if unit.grads_waiting == 0:
            if self.hold > 1 and self.scheduled and ("reduce", *unit.key) not in self.armed:
                return  # not the chunk's last backward of the step: the gradients stay summed, the unit gathered
            self.reduce_unit(unit)
            self.after_reduction(unit)

    def reduce_unit(self, unit: Unit) -> None:
        """Every gradient of `unit` is in: its reduction armed for this compute runs now."""
        action = self.armed.get(("reduce", *unit.key)) if self.scheduled else None
        if self.scheduled and action is None:
            raise RuntimeError(f"ZeRO-3: unit {unit.key} has its gradients but the schedule reduces no such unit "
                               "after this compute")
        if action is not None:
            self.issued.add(action)
        self.reduce_scatter(unit)

    def reduce_scatter(self, unit: Unit) -> None:
        staging = unit.staging if unit.staging is not None else torch.zeros(
            unit.flat.padded_numel, dtype=unit.flat.dtype, device=unit.flat.device
        )
        unit.staging = None
        if self.comm.size * self.replicas.size > 1:
            staging.div_(self.comm.size * self.replicas.size)
        out = torch.empty(unit.piece, dtype=staging.dtype, device=staging.device)
        handle = self.comm.reduce_scatter(out, staging, async_op=True)
        self.in_flight.append((handle, out, unit.index, staging))
        self.wait_in_flight(keep=MAX_IN_FLIGHT)

    def wait_in_flight(self, keep: int = 0) -> None:
        """Finish reduce-scatters, oldest first, until at most `keep` are in flight."""
        while len(self.in_flight) > keep:
            handle, out, index, _ = self.in_flight.pop(0)
            handle.wait()
            self.replicas.all_reduce(out)  # hybrid sharding: the piece summed over the replicas
            offset = self.offsets[index]
            self.shard_grad[offset : offset + out.numel()].add_(out)

    # ---------------------------------------------------------------- the step, action by action

    def layout(self) -> dict[int, tuple[int, ...]]:
        """Each chunk's unit sizes (padding included), to check against the schedule's plan."""
        sizes: dict[int, list[int]] = {}
        for unit in self.units:
            sizes.setdefault(unit.key[0], []).append(unit.flat.padded_numel)
        return {chunk: tuple(s) for chunk, s in sizes.items()}

    def kept(self) -> dict[int, tuple[bool, ...]]:
        flags: dict[int, list[bool]] = {}
        for unit in self.units:
            flags.setdefault(unit.key[0], []).append(unit.keep)
        return {chunk: tuple(f) for chunk, f in flags.items()}

    def sharding(self) -> tuple[int, int, bool]:
        return self.comm.size, self.replicas.size, self.reshard_after_forward

    def begin_step(self) -> None:
        self.shard_grad.zero_()
        self.issued = set()
        self.scheduled = True

    def begin_compute(self, chunk: int, armed: list) -> None:
        """A compute of `chunk` starts; `armed`: the gathers listed right before it, the reductions right after."""
        self.armed = {}
        for action in armed:
            if isinstance(action, GatherParams):
                self.armed[("gather", action.chunk, action.bucket)] = action
            elif isinstance(action, ReduceScatterGrads):
                self.armed[("reduce", action.chunk, action.bucket)] = action
        for unit in self.units:
            if unit.key[0] == chunk:
                unit.grads_waiting = len(unit.flat.params)

    def end_compute(self) -> None:
        unused = [a for a in self.armed.values() if isinstance(a, GatherParams) and a not in self.issued]
        self.armed = {}
        if unused:
            raise RuntimeError(f"ZeRO-3: the schedule gathers {', '.join(map(str, unused))} for a compute that "
                               "did not use it")

    def issue(self, action) -> None:
        """A gather's turn comes before its compute, which issues it when the unit is needed; a
        reduction's after it: one no gradient reached (all its grads were None) is reduced now."""
        if action in self.issued or isinstance(action, GatherParams):
            return
        if not isinstance(action, ReduceScatterGrads):
            raise ValueError(f"ZeRO-3 cannot run {action}")
        self.issued.add(action)
        unit = self.unit_at[(action.chunk, action.bucket)]
        unit.grads_waiting = 0
        self.reduce_scatter(unit)
        self.after_reduction(unit)

    def end_reductions(self) -> None:
        self.wait_in_flight()

    def finish_grads(self) -> torch.Tensor:
        return self.shard_grad

    def after_update(self) -> None:
        """Nothing to gather now: each unit is gathered when it is next used."""

    def end_step(self) -> None:
        self.scheduled = False  # evaluation and checkpoints gather as their hooks need
        for unit in self.units:
            if unit.gathered or unit.pending_gather is not None:
                self.free(unit)

    def reduce_sum(self, value: torch.Tensor) -> torch.Tensor:
        return self.comm.sum(value)

    # ---------------------------------------------------------------- accounting

    def parameter_storages(self) -> set[int]:
        return {self.weights.untyped_storage().data_ptr()} | {u.storage_ptr() for u in self.units if u.gathered}

    def memory(self) -> dict[str, int]:
        return {
            "parameters": nbytes(self.weights),
            "gradients": nbytes(self.shard_grad),
            "comm_buffers": self.comm_buffer_peak,
        }
