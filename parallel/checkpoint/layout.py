"""Where each element a rank's optimizer holds sits in the plain model's global tensors.

A checkpoint stores the parameters of minigpt.model.GPT under their own names and
full, unpadded shapes ("blocks.3.attn.qkv.weight", ((H + 2K) hd, d)), whatever the layout that
saved them. A rank's optimizer holds `weights` (masters, moments) laid end to end:
pieces of a flat buffer (ZeRO 0-2) or its piece of each unit (ZeRO 3), cut at any
element. A piece of one parameter is a contiguous run of its flattened tensor parallel
shard, which is at most 2 x ndim - 1 rectangular boxes of that shard (`decompose`:
a partial first row, whole rows, a partial last row, recursively). Each box maps to a
box of the global tensor by the tensor-parallel cut of parallel/tensor/parallelize.py:

  sections  qkv, fc1 (weight, bias)   rows in sections laid end to end (qkv: query heads |
            MLA's q_up, kv_up,        key heads | value heads, H hd, K hd, K hd; a SwiGLU
            the sinks, OLMo 2's       fc1: gate | up, d_ff each; a GELU fc1, MLA's up
            q/k norms                 projections, the sinks (one per query head) and the
                                      norms over all heads: one section);
                                      a shard holds rows [r n/T, (r + 1) n/T) of each
                                      section n, in order (`fused_sections`)
  columns   proj, fc2 weights         columns [r n, (r + 1) n)
  vocab     tok_emb, untied head      rows [r P, r P + P) of the vocabulary padded to a
                                      multiple of T; rows >= V are padding and dropped
  replicated, whole                   the same coordinates
  experts   a MoE's stacked experts   under expert parallelism (parallel/expert/): experts [e E/ep, (e + 1) E/ep)
            (mlp.experts.w1, ...)     of the ep group's rank e, dim 0 at e E/ep ("blocks.1.mlp.experts.local.w1"
                                      is "blocks.1.mlp.experts.w1"); in the experts' own buffer, after ZeRO's
                                      pieces in `weights`, whole on every tensor-parallel rank

No gathering is needed to save or load: each rank reads and writes its own boxes.
Boxes held by several ranks (LayerNorms on every tensor-parallel rank, everything on
every ZeRO-0 data-parallel rank, an expert shard on the ranks holding the same experts and on every
tensor-parallel rank) are written by one of them (`writes`). A tied head's
copy on the last pipeline stage is never written: it is read from tok_emb.weight.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch.overrides import TorchFunctionMode

from minigpt.model import GPT
from minigpt.moe import bias_name, biased_layers
from job.layout import MTP_EMBEDDING
from job.schedule import chunk_layers

Box = tuple[int, tuple[int, ...], tuple[int, ...]]  # (first flat element, offsets, sizes)


def decompose(shape: tuple[int, ...], start: int, end: int) -> list[Box]:
    """Boxes covering elements [start, end) of a row-major tensor of `shape`, in order.

    Each box is itself a contiguous run of elements, starting at its first flat element.
    """
    if start >= end:
        return []
    if len(shape) == 1:
        return [(start, (start,), (end - start,))]
    inner = math.prod(shape[1:])
    first, last = start // inner, (end - 1) // inner
    head, tail = start - first * inner, end - last * inner  # head in [0, inner), tail in (0, inner]

    def within(row: int, lo: int, hi: int) -> list[Box]:
        return [(row * inner + s, (row, *o), (1, *z)) for s, o, z in decompose(shape[1:], lo, hi)]

    if first == last and not (head == 0 and tail == inner):
        return within(first, head, tail)
    boxes = []
    if head:
        boxes += within(first, head, inner)
        first += 1
    stop = last + 1 if tail == inner else last
    if first < stop:
        boxes.append((first * inner, (first,) + (0,) * (len(shape) - 1), (stop - first, *shape[1:])))
    if tail < inner:
        boxes += within(last, 0, tail)
    return boxes


def tensor_parallel_kind(name: str, tp: int, model=None) -> str:
    """How parallel/tensor/parallelize.py cuts the parameter `name` over `tp` ranks (`model`: the GPTConfig, whose
    q/k norms over all heads, qk_norm_whole, are cut by heads)."""
    if tp == 1:
        return "whole"
    if model is not None and model.qk_norm_whole and name.endswith(("attn.core.q_norm.weight",
                                                                     "attn.core.k_norm.weight")):
        return "sections"
    if name in ("tok_emb.weight", "head.weight"):
        return "vocab"
    if name.endswith(("attn.qkv.weight", "attn.qkv.bias", "mlp.fc1.weight", "mlp.fc1.bias", "attn.q_up.weight",
                      "attn.kv_up.weight", "attn.core.sinks")):  # MLA's up projections, the sinks: one section
        return "sections"
    if name.endswith(("attn.proj.weight", "mlp.fc2.weight")):
        return "columns"
    return "replicated"


def fused_sections(name: str, model_config) -> list[int]:
    """The row counts of the sections of a fused weight or bias, as parallel/tensor/parallelize.py cuts them: qkv's
    query, key and value heads (unequal under grouped-query attention); a SwiGLU fc1's gate and up rows;
    [] for the rest (a GELU fc1 is one section: its rows)."""
    if name.endswith(("attn.qkv.weight", "attn.qkv.bias")):
        hd = model_config.head_dim
        return [model_config.n_heads * hd, model_config.kv_heads * hd, model_config.kv_heads * hd]
    if name.endswith(("mlp.fc1.weight", "mlp.fc1.bias")) and model_config.gated_mlp:
        return [model_config.d_ff, model_config.d_ff]
    return []


def shard_shape(kind: str, shape: tuple[int, ...], parts: int) -> tuple[int, ...]:
    """A shard's shape, of a tensor cut into `parts` (tp; ep for "experts")."""
    if kind in ("vocab", "sections"):
        return (-(-shape[0] // parts), *shape[1:])
    if kind == "columns":
        return (shape[0], shape[1] // parts)
    if kind == "experts":
        return (shape[0] // parts, *shape[1:])
    return shape


def _section_rows(first: int, offsets: list[int], sizes: list[int], inner: int, sections: list[int],
                  tp: int, tp_rank: int) -> list[Box]:
    """A box of local rows [o, o + n) of a sections shard, cut where a section ends, each piece moved to
    its global rows: local row `o` of section i lands at global (section i's start) + r n_i/T + (o - its
    local start)."""
    found, local_start, global_start = [], 0, 0
    for section in sections:
        local_rows = section // tp
        lo, hi = max(offsets[0], local_start), min(offsets[0] + sizes[0], local_start + local_rows)
        if lo < hi:
            row = global_start + tp_rank * local_rows + lo - local_start
            found.append((first + (lo - offsets[0]) * inner, (row, *offsets[1:]), (hi - lo, *sizes[1:])))
        local_start, global_start = local_start + local_rows, global_start + section
    return found


def global_boxes(kind: str, local: tuple[int, ...], shape: tuple[int, ...], tp_rank: int, start: int, end: int,
                 sections: list[int] | None = None) -> list[Box]:
    """Boxes of the global tensor (of `shape`) holding elements [start, end) of this rank's shard (of `local`).

    `tp_rank`: the shard's index (the ep rank for "experts"). `sections`: the fused sections' row counts of a
    "sections" kind (none given: one section)."""
    found = []
    for first, offsets, sizes in decompose(local, start, end):
        offsets, sizes = list(offsets), list(sizes)
        if kind == "vocab":
            valid = max(0, min(local[0], shape[0] - tp_rank * local[0]))  # rows past the vocabulary: padding
            sizes[0] = min(offsets[0] + sizes[0], valid) - offsets[0]
            if sizes[0] <= 0:
                continue
            offsets[0] += tp_rank * local[0]
        elif kind == "columns":
            offsets[1] += tp_rank * local[1]
        elif kind == "experts":
            offsets[0] += tp_rank * local[0]
        elif kind == "sections":
            tp = shape[0] // local[0]  # exact: tp divides every section (job/train_config.py checks)
            found += _section_rows(first, offsets, sizes, math.prod(local[1:]), sections or [shape[0]], tp, tp_rank)
            continue
        found.append((first, tuple(offsets), tuple(sizes)))
    return found


@dataclass
class Placement:
    """This rank's boxes of one global tensor."""

    name: str
    shape: tuple[int, ...]
    boxes: list[tuple[tuple[int, ...], tuple[int, ...], int]] = field(default_factory=list)  # offsets, sizes, position
    writes: bool = True  # this rank saves them (one rank of those holding the same boxes)
    tied_copy: bool = False  # the last stage's copy of a tied embedding: loaded, never saved


def global_shapes(model_config) -> dict[str, tuple[int, ...]]:
    """The plain GPT's parameters (a tied head counted once, as tok_emb.weight) and their shapes."""
    with torch.device("meta"), NoNormalOnMeta():
        model = GPT(model_config)
    return {name: tuple(param.shape) for name, param in model.named_parameters()}


BUFFER = "buffer."  # a checkpoint's key of a saved buffer: BUFFER + its name in the plain GPT


def saved_buffers(model_config) -> dict[str, tuple[int, ...]]:
    """The plain GPT's buffers a checkpoint keeps beside its parameters, and their shapes: each MoE layer's choice
    bias (minigpt/moe.py's expert_bias, fp32, the same on every rank of its stage)."""
    if not (model_config.is_moe and model_config.expert_bias):
        return {}
    layers = model_config.n_layers
    return {bias_name(layer, layers): (model_config.n_experts,) for layer in range(layers + model_config.mtp_depth)
            if model_config.is_moe_layer(layer)}


def stage_buffers(stage) -> dict[str, torch.Tensor]:
    """This rank's saved_buffers, by their names in the plain GPT (its stage's MoE layers only)."""
    return {bias_name(module.layer, module.config.n_layers): module.expert_bias for module in biased_layers(stage)}


class NoNormalOnMeta(TorchFunctionMode):
    """normal_ on a meta tensor does nothing (there is nothing to fill), but torch's meta kernel for it
    (torch._refs) imports torch._dynamo first: 1.7 s of CPU in every rank that reads a checkpoint's layout,
    for shapes only. Skipped; every other call runs as it would."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensor = args[0] if args else kwargs.get("tensor")  # torch.nn.init.normal_ passes it by name
        if getattr(func, "__name__", None) == "normal_" and getattr(tensor, "is_meta", False):
            return tensor
        return func(*args, **kwargs)


def parameter_names(rank, cfg) -> dict[int, str]:
    """id(parameter) -> its name in the plain GPT, for every parameter of this rank's stage."""
    layers = chunk_layers(cfg.model.n_layers, cfg.pp * cfg.virtual_chunks, cfg.stage_layers)
    names: dict[int, str] = {}
    for chunk in rank.stage.chunks:
        for local_name, param in chunk.named_parameters():
            parts = local_name.split(".")  # less tensor parallelism's wrappers and expert parallelism's `local`
            parts = [part for i, part in enumerate(parts)
                     if part != "inner" and not (part == "local" and i and parts[i - 1] == "experts")]
            if parts[0] == "blocks":
                parts[1] = str(layers[chunk.index][int(parts[1])])
            names.setdefault(id(param), ".".join(parts))
    return names


def flat_spaces(data_parallel) -> list[tuple[object, int, int, int]]:
    """(FlatParameters, start, end, position in `weights` end to end) of every range this rank's optimizer owns.

    Under expert parallelism (parallel/expert/gradients.py's WithExperts): the ZeRO stage's, then the part of the
    experts' own buffer this rank's optimizer owns (whole, or its piece when their states are sharded)."""
    experts = getattr(data_parallel, "expert_flat", None)
    if experts is not None:
        start, end = data_parallel.expert_range
        return flat_spaces(data_parallel.inner) + [(experts, start, end, data_parallel.dense_numel)]
    if hasattr(data_parallel, "units"):  # ZeRO 3: piece r of every unit
        rank = data_parallel.comm.rank
        return [
            (unit.flat, rank * unit.piece, (rank + 1) * unit.piece, offset)
            for unit, offset in zip(data_parallel.units, data_parallel.offsets)
        ]
    spaces, position = [], 0
    for start, end in data_parallel.ranges:
        spaces.append((data_parallel.flat, start, end, position))
        position += end - start
    return spaces


def rank_placements(rank, cfg) -> list[Placement]:
    """Every global tensor this rank holds a part of, with its boxes, in a fixed order."""
    shapes = global_shapes(cfg.model)
    names = parameter_names(rank, cfg)
    mesh, data_parallel = rank.mesh, rank.data_parallel
    experts = getattr(data_parallel, "expert_flat", None)  # expert parallelism's buffer beside ZeRO's
    dense_writes = data_parallel.replicas.rank == 0  # hybrid sharding: the first shard group's copy
    dense_writes = dense_writes and not (data_parallel.stage == 0 and data_parallel.comm.size > 1
                                         and data_parallel.comm.rank != 0)  # over dp x cp
    placements: dict[str, Placement] = {}
    for flat, start, end, position in flat_spaces(data_parallel):
        for segment, param in zip(flat.segments, flat.params):
            lo, hi = max(segment.start, start), min(segment.end, end)
            if lo >= hi:
                continue
            name = names[id(param)]
            tied_copy = (name == "head.weight" and cfg.model.tied_head) or name == MTP_EMBEDDING
            name = "tok_emb.weight" if tied_copy else name
            if name not in shapes:
                raise AssertionError(f"parameter {segment.name} is taken for {name}, which GPT does not have")
            if flat is experts:  # whole on every tp rank; one of the ranks holding the same experts writes (at tp
                # rank 0 unless sequence parallelism folds the tp ranks into the expert groups), or each its piece
                kind, index, parts = "experts", data_parallel.experts_comm.rank, data_parallel.experts_comm.size
                writes = (data_parallel.sharded or data_parallel.expert_replicas.rank == 0) \
                    and (mesh.tp_rank == 0 or cfg.sequence_parallel)
            else:
                kind, index, parts = tensor_parallel_kind(name, mesh.tp, cfg.model), mesh.tp_rank, mesh.tp
                writes = dense_writes and not tied_copy and not (kind == "replicated" and mesh.tp_rank != 0)
            local = tuple(param.shape)
            if local != shard_shape(kind, shapes[name], parts):
                raise AssertionError(f"{name}: shard {local} does not match the {kind} cut of {shapes[name]}")
            placement = placements.setdefault(name, Placement(name, shapes[name], writes=writes, tied_copy=tied_copy))
            base = position + segment.start - start  # where the parameter's element 0 would sit
            sections = fused_sections(name, cfg.model)
            for first, offsets, sizes in global_boxes(kind, local, shapes[name], index,
                                                      lo - segment.start, hi - segment.start, sections):
                placement.boxes.append((offsets, sizes, base + first))
    for placement in placements.values():
        if len({offsets for offsets, _, _ in placement.boxes}) != len(placement.boxes):
            raise AssertionError(f"{placement.name}: two boxes start at the same element")
    return [placement for placement in placements.values() if placement.boxes]
