"""What a pipeline stage holds of its weights, gradients and optimizer states under ZeRO 0-3, and the
communication buffers the data-parallel wrappers keep (parallel/data/zero.py, parallel/data/zero3.py), with the
routed experts' own buffer under expert parallelism (parallel/expert/gradients.py): in elements, for
simulator/memory.py to turn into bytes. Torch-free."""

from __future__ import annotations

from job.layout import Bucket, Layout, bucket_members, buckets, is_expert_tensor, is_fp8_weight
from job.muon import takes_muon
from job.schedule_actions import holds_all_step

MAX_IN_FLIGHT = 2  # parallel/data/zero.py's bound on ZeRO-2/3's overlapped reduce-scatters (it imports torch; a test checks)


def module_of(name: str) -> str:
    return name.rsplit(".", 1)[0]


def data_parallel_buffers(stage: int, cut: list[Bucket], dp: int) -> int:
    """Peak elements of ZeRO 1/2 buffers, walking the buckets in backward order as parallel/data/zero.py does.

    Buckets complete last to first. Stage 1 bounds nothing: each reduce-scatter's output (1/N of
    its bucket) stays until the optimizer waits for them all. Stage 2 measures right after
    launching one, with up to MAX_IN_FLIGHT + 1 reduce-scatters in the air (each an output of
    1/N of its bucket and the bucket's staging), and the staging of the bucket
    before it when that bucket is already open: counted when the border between them falls
    inside one module (a weight and its bias reach their gradients together, in either order).
    Stage 0 all-reduces in place: none.
    """
    if stage == 0:
        return 0
    if stage == 1:  # no bound: every bucket's piece stays in flight until the optimizer waits
        return sum(bucket.size // dp for bucket in cut)
    peak, in_flight = 0, []
    for k in reversed(range(len(cut))):
        size = cut[k].size
        in_flight = (in_flight + [size // dp + (size if stage == 2 else 0)])[-(MAX_IN_FLIGHT + 1) :]
        opened = stage == 2 and k > 0 and module_of(cut[k - 1].last) == module_of(cut[k].first)
        peak = max(peak, sum(in_flight) + (cut[k - 1].size if opened else 0))
        in_flight = in_flight[-MAX_IN_FLIGHT:]
    return peak


ZERO3_HOLDS = ("forward", "backward", "step")


def zero3_hold(layout: Layout, micro_batches: int | None = None) -> str:
    """How long ZeRO-3 keeps a unit gathered (job/schedule_comm.py's frees_after): "forward" (freed after each
    forward and backward), "backward" (not resharded after the forward: freed after each backward), "step"
    (not resharded, under pipelining or with sync_grads_once, over several micro-batches (None: several): gathered
    all step, its gradients summed: job/schedule_actions.py's ScheduleConfig.zero3_hold)."""
    if layout.reshard_after_forward:
        return "forward"
    return "step" if holds_all_step(False, layout.sync_grads_once, layout.pp, micro_batches) else "backward"


def zero3_buffers(units: list[int], dp: int, prefetch: int = 1, hold: str = "forward",
                  weights: list[int] | None = None) -> int:
    """Peak elements of ZeRO-3 buffers, walking the units in backward order as parallel/data/zero3.py does;
    `weights`: each unit's gathered weights where they are not its size (in bytes, with `units` in bytes: the
    fp8 weights gathered in fp8, zero3_gather_bytes).

    While unit i's gradients come in: the first and last units (kept gathered all step),
    unit i and the `prefetch` units before it (gathered ahead; our code prefetches one) when
    they are not kept, unit i's staging (full size), and the last MAX_IN_FLIGHT
    reduce-scatters (staging + 1/N output). Not resharded after the forward (`hold`, zero3_hold):
    every unit up to i, those after it freed after their reduction ("backward"). Held all step ("step"), a unit
    sums its gradients over the step's micro-batches in its staging until its one reduction after its last backward
    (job/schedule_actions.py's ScheduleConfig.zero3_hold): in the last micro-batch's backward, every unit up to i
    gathered and staged; before it, every unit gathered and staged, nothing in flight.
    """
    kept, held = {0, len(units) - 1}, units if weights is None else weights
    peak, in_flight = sum(held) + sum(units) if hold == "step" else 0, []
    for i in reversed(range(len(units))):
        gathered = sum(held[j] for j in kept)
        if hold in ("backward", "step"):
            gathered += sum(held[j] for j in range(i + 1) if j not in kept)
        elif i not in kept:
            gathered += held[i] + sum(held[j] for j in range(max(0, i - prefetch), i) if j not in kept)
        staged = sum(units[: i + 1]) if hold == "step" else units[i]  # gradients staged at full size
        peak = max(peak, gathered + staged + sum(in_flight))
        in_flight = (in_flight + [units[i] + units[i] // dp])[-MAX_IN_FLIGHT:]
    return peak


def _unit_sizes(units, dp: int) -> list[int]:
    """Each ZeRO-3 unit's elements padded to a multiple of `dp` (one bucket per unit)."""
    size_of: dict[int, int] = {}  # by id: every block's unit is one list (job/layout.py's stage_units)
    for unit in units:
        if id(unit) not in size_of:
            size_of[id(unit)] = buckets(unit, None, dp)[0].size if unit else 0
    return [size_of[id(unit)] for unit in units]


def zero_states(chunks, zero: int, dp: int, bucket_numel: int, prefetch: int, hold: str) -> tuple[int, ...]:
    """Elements of (weights held, states owned, gradients, communication buffers, parameters unpadded) of a stage's
    chunks of units (lists of tensors) under ZeRO `zero` over `dp` ranks."""
    units = [unit for chunk in chunks for unit in chunk]
    unit_sizes = _unit_sizes(units, dp)
    cut = [b for chunk in chunks for b in buckets([t for unit in chunk for t in unit], bucket_numel, dp)]
    padded = sum(b.size for b in cut)
    held = sum(unit_sizes) // dp if zero == 3 else padded
    owned = held if zero in (0, 3) else padded // dp
    grads = owned if zero >= 2 else held
    buffers = zero3_buffers(unit_sizes, dp, prefetch, hold) if zero == 3 else data_parallel_buffers(zero, cut, dp)
    return held, owned, grads, buffers, sum(t.numel for unit in units for t in unit)


def zero3_gather_bytes(chunks, dp: int, prefetch: int, hold: str, element_bytes: int, fp8_bytes: int,
                       experts: bool = False, reduce_bytes: int | None = None) -> int:
    """Peak bytes of ZeRO-3's buffers (zero3_buffers) when the fp8 Linears' weights are gathered in fp8 (`fp8_bytes`
    each, job/layout.py's is_fp8_weight, the routed experts' with `experts`; `element_bytes` to gather them all in the
    compute format) and everything else in `element_bytes`, the gradients' staging and reduce-scatters in
    `reduce_bytes` (None: `element_bytes`; 4 when a stack reduces in fp32)."""
    units = [unit for chunk in chunks for unit in chunk]
    sizes = _unit_sizes(units, dp)
    fp8 = [sum(t.numel for t in unit if is_fp8_weight(t, experts)) for unit in units]
    return zero3_buffers([size * (reduce_bytes or element_bytes) for size in sizes], dp, prefetch, hold,
                         [(size - f) * element_bytes + f * fp8_bytes for size, f in zip(sizes, fp8)])


def fp8_weights_held(chunks, zero: int, dp: int, experts: bool = False) -> int:
    """Of zero_states' weights held, the elements that are fp8 Linears' weights (job/layout.py's is_fp8_weight, the
    routed experts' with `experts`): all of them, or under ZeRO-3 the rank's 1/dp shard of them."""
    fp8 = sum(t.numel for chunk in chunks for unit in chunk for t in unit if is_fp8_weight(t, experts))
    return fp8 // dp if zero == 3 else fp8


def experts_states(chunks, shards: int = 1) -> tuple[int, ...]:
    """Elements of (weights held, states owned, gradients, communication buffers, parameters unpadded) of the routed
    experts of a stage under expert parallelism, as parallel/expert/gradients.py holds them: E/ep experts on each
    rank (job/layout.py's expert_tensors) in a flat buffer of their own beside ZeRO's, padded to a multiple of
    `shards` (Layout.expert_state_shards), weights and gradients whole, masters and Adam states for 1/shards of it
    (the rank's piece, under ZeRO 1-3; all of it under ZeRO 0). The reduce-scatter's piece is the only buffer."""
    experts = [t for chunk in chunks for unit in chunk for t in unit if is_expert_tensor(t)]
    held = buckets(experts, None, shards)[0].size if experts else 0  # one bucket, as gradients.py's buffer
    return held, held // shards, held, held // shards if shards > 1 else 0, sum(t.numel for t in experts)


def muon_owned(chunks, zero: int, dp: int, bucket_numel: int) -> int:
    """Of zero_states' states owned, the fewest elements of Muon's matrices (job/muon.py's takes_muon) any of the
    `dp` ranks owns: the rest take AdamW's second moment as well (precision/muon.py). ZeRO 0 owns every one; ZeRO
    1-2 piece r of every bucket, ZeRO 3 piece r of every unit, each cut at any element (precision/flat.py)."""
    units = [unit for chunk in chunks for unit in chunk]
    if zero == 0 or dp == 1:
        return sum(t.numel for unit in units for t in unit if takes_muon(t.name))
    if zero == 3:
        spaces = units
    else:
        spaces = []
        for chunk in chunks:
            tensors = [t for unit in chunk for t in unit]
            spaces += [[tensors[i] for i in members] for members, _ in bucket_members(tensors, bucket_numel, dp)]
    by_id: dict[int, list[int]] = {}  # every block's unit is one list (job/layout.py's stage_units): once each
    per_space = [by_id.setdefault(id(space), _piece_matrices(space, dp)) for space in spaces]
    return min(map(sum, zip(*per_space))) if per_space else 0


def experts_muon_owned(chunks, shards: int = 1) -> int:
    """muon_owned of the routed experts' own buffer (experts_states): whole, or piece r of `shards`."""
    experts = [t for chunk in chunks for unit in chunk for t in unit if is_expert_tensor(t)]
    if shards == 1:
        return sum(t.numel for t in experts if takes_muon(t.name))
    return min(_piece_matrices(experts, shards))


def _piece_matrices(tensors, parts: int) -> list[int]:
    """Elements of Muon's matrices in each of the `parts` pieces of `tensors` laid end to end, padded to a multiple
    of `parts`: one pass over the tensors, the pieces a matrix covers whole added through a difference array."""
    piece = -(-sum(t.numel for t in tensors) // parts) or 1
    found, whole, at = [0] * parts, [0] * (parts + 1), 0
    for tensor in tensors:
        lo, hi = at, at + tensor.numel
        at = hi
        if not takes_muon(tensor.name) or lo == hi:
            continue
        first, last = lo // piece, (hi - 1) // piece
        if first == last:
            found[first] += hi - lo
            continue
        found[first] += (first + 1) * piece - lo
        found[last] += hi - last * piece
        whole[first + 1] += piece
        whole[last] -= piece
    running = 0
    for rank in range(parts):
        running += whole[rank]
        found[rank] += running
    return found
