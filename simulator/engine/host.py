"""The engine on a measured CPU host (simulator/costs/host.py): measured compute and collectives. Torch-free.

`HostCompute` gives a chunk's forward and backward seconds from the measured units (a mixture
of experts' MoE blocks from its own MoE unit; the roofline's when this model was not measured,
which `missing` says), times the sharing slowdown of the job's ranks and threads on the host's
cores, and times what waiting for the slowest rank costs a synchronous step (the measured variation of a rank's
time, simulator/stragglers.py). `HostLinks` times p2p, collectives and expert parallelism's all-to-alls with the measured
gloo numbers for the group size and the job's number of ranks, falling back to the fluid link
model (engine/links.py's LinkCosts) for a kind or group size not measured.
"""

from __future__ import annotations

from dataclasses import dataclass

from minigpt.config import RECOMPUTE_MODES
from simulator.engine.links import LinkCosts
from simulator.costs.host import MeasuredHost, UnitTimes
from simulator.stragglers import straggler_factor
from job.layout import Layout
from simulator.network.topology import Cluster


@dataclass(frozen=True)
class HostCompute:
    units: UnitTimes | None  # None: the model (or this tp) was not measured; the roofline's times are used
    slowdown: float  # MeasuredHost.slowdown for the job's ranks and threads
    # Communication charged in line with compute: on a CPU host whose ranks each have their own
    # cores, gloo's copies and wake-ups take the rank's core from its compute. When ranks outnumber
    # the cores they take turns anyway, and a rank's asynchronous collectives progress while it
    # waits for its turn (checked on the 8-rank row of the compare matrix, docs/results.md); GPUs
    # move bytes with engines of their own.
    serial: bool = True
    # A mixture of experts: `units` are its MoE blocks' (and its embedding's and head's), `dense` those of its dense
    # first blocks (MeasuredHost.block_units; None: none measured, or no dense blocks); a dense model's are `units`.
    moe: bool = False
    dense: UnitTimes | None = None
    missing: str | None = None  # why the roofline prices this model's compute on a measured host (None: it does not)
    # Stragglers: a synchronous step waits for the slowest of the job's ranks, each varying by the measured
    # coefficient of variation (MeasuredHost.variation_cv): simulator/stragglers.py's straggler_factor, 1 for one rank
    straggler: float = 1.0
    straggler_cv: float = 0.0

    def _blocks(self, layers: int, recompute: str, moe: bool) -> UnitTimes | None:
        """The measured unit pricing a chunk of `layers` blocks (`moe`: MoE blocks; a chunk without blocks: the
        model's own), or None where the roofline prices it: no unit of these blocks, or a recomputation training does
        not run."""
        blocks = self.units if moe or not self.moe else self.dense
        if self.units is None or (layers and blocks is None) or recompute not in RECOMPUTE_MODES:
            return None
        return blocks if layers else self.units

    def chunk(self, layers: int, first: bool, last: bool, micro_batch: int, recompute: str,
              roofline: tuple[float, float, float], moe: bool = False) -> tuple[float, float, float]:
        """(forward, backward, recompute) seconds of a chunk of `layers` blocks (`moe`: MoE blocks); backward
        includes the recompute."""
        blocks = self._blocks(layers, recompute, moe)
        if blocks is None:
            forward, backward, again = roofline
        else:
            def unit(name: str, units: UnitTimes = self.units) -> float:
                return units.seconds(name, micro_batch)

            block_forward = layers * unit("block_forward", blocks) if layers else 0.0
            again = block_forward if recompute == "full" else 0.0
            forward = block_forward
            backward = (layers * unit("block_backward", blocks) if layers else 0.0) + again
            if first:
                forward, backward = forward + unit("embedding_forward"), backward + unit("embedding_backward")
            if last:
                forward, backward = forward + unit("head_forward"), backward + unit("head_backward")
        scale = self.slowdown * self.straggler
        return forward * scale, backward * scale, again * scale

    def split(self, layers: int, last: bool, micro_batch: int, recompute: str, moe: bool = False
              ) -> tuple[float, float] | None:
        """(input half, weight half) seconds of a chunk's backward split by a zero-bubble schedule, from its blocks'
        measured halves (each half a pass of its own: together more than the whole backward), a full recomputation's
        rerun in the input half and the head's backward halved (not timed apart); None where the blocks' halves were
        not measured (the engine then halves the backward)."""
        blocks = self._blocks(layers, recompute, moe)
        if blocks is None or not blocks.split:
            return None
        again = layers * blocks.seconds("block_forward", micro_batch) if recompute == "full" else 0.0
        first = layers * blocks.seconds("block_backward_input", micro_batch) + again
        second = layers * blocks.seconds("block_backward_weight", micro_batch)
        if last:
            head = self.units.seconds("head_backward", micro_batch) / 2
            first, second = first + head, second + head
        scale = self.slowdown * self.straggler
        return first * scale, second * scale


def unit_format(host: MeasuredHost, compute_format: str) -> str:
    """The format a host's units must have been measured in to price a run computing in `compute_format`:
    on a CPU host 16-bit and fp8 compute is emulated with fp32 matmuls (precision/compute.py), so fp32
    units hold; on GPUs the compute format itself (no unit of another format: the roofline prices it)."""
    return "fp32" if host.device == "cpu" else compute_format


def host_threads(host: MeasuredHost, world_size: int, threads_per_rank: int | None) -> int:
    """Torch threads a rank runs on, as parallel/run/train.py runs it: the given count, else one with several
    ranks and every core with one."""
    return threads_per_rank or (1 if world_size > 1 else host.cores)


def host_compute(host: MeasuredHost, model, layout: Layout, threads_per_rank: int,
                 compute_format: str = "fp32") -> HostCompute:
    """The measured compute of `model` in `layout` on `host`. A model (a mixture of experts, or its dense first
    blocks) whose unit was not measured is priced by the roofline, and `missing` says so: never by another shape's
    unit (a MoE block is not a dense block of its sizes)."""
    fmt = unit_format(host, compute_format)
    units, dense = host.block_units(model, layout.tp, layout.sequence_parallel, fmt, layout.cp)
    shape = "mixture of experts' blocks" if model.is_moe else "blocks"
    where = f"tp {layout.tp}" + (f", cp {layout.cp}" if layout.cp > 1 else "") + f", {fmt}"
    missing = None
    if (model.window_in_use and model.full_attention_every) or model.nope_every:  # a unit is one block's kind:
        units, dense = None, None  # the pattern has two
        missing = ("a unit measured per model, not per block: the roofline prices a pattern of windowed and full "
                   "blocks, or of rotating and unrotated ones")
    elif model.attention_sinks or model.router_bias or model.post_norms or model.embed_scale \
            or model.qk_norm_whole or not model.pre_norms or model.shared_expert_gate or not model.renormalize_gates \
            or model.group_score_top != 2:  # a measured unit's key does not tell these apart
        units, dense = None, None
        missing = ("measured units are not told apart by attention sinks, a router bias, Gemma's post norms, OLMo "
                   "2's norms or a router's gates and groups other than the usual: the roofline prices them")
    elif units is None:
        missing = f"no measured unit of this model's {shape} ({where}): the roofline prices its compute"
    elif model.is_moe and model.dense_layers and dense is None:
        missing = (f"no measured unit of this model's dense first blocks ({where}): the roofline prices those "
                   f"{model.dense_layers} blocks")
    cv = host.variation_cv(layout.world_size, threads_per_rank) if layout.world_size > 1 else 0.0
    return HostCompute(units,
                       host.slowdown(layout.world_size, threads_per_rank),
                       serial=host.device == "cpu" and layout.world_size * threads_per_rank <= host.cores,
                       moe=model.is_moe, dense=dense, missing=missing,
                       straggler=straggler_factor(cv, layout.world_size), straggler_cv=cv)


class HostLinks(LinkCosts):
    """LinkCosts whose transfers take the measured times of the host's gloo collectives."""

    def __init__(self, cluster: Cluster, layout: Layout, host: MeasuredHost) -> None:
        super().__init__(cluster, layout)
        self.host = host
        self.active: float = layout.world_size  # ranks busy at once (engine.share_idle_cores lowers it)

    def measured(self, kind: str, group: int, nbytes: float) -> float | None:
        return self.host.collective_seconds(kind, group, self.active, nbytes)

    def p2p(self, src_stage: int, dst_stage: int, nbytes: float) -> float:
        if nbytes <= 0 or src_stage == dst_stage:
            return 0.0
        seconds = self.measured("p2p", 2, nbytes)
        return super().p2p(src_stage, dst_stage, nbytes) if seconds is None else seconds

    def all_to_all(self, stage: int, nbytes: float) -> float:
        """Expert parallelism's all-to-all over its group of ep: the measured gloo all_to_all_single for ep
        (calibrate measures it by each rank's input, as it is counted here), else the fabric's flows."""
        if self.layout.ep == 1 or nbytes <= 0:
            return 0.0
        seconds = self.measured("all_to_all", self.layout.ep, nbytes)
        return super().all_to_all(stage, nbytes) if seconds is None else seconds

    def cp_pass(self, stage: int, nbytes: float) -> float:
        """A context-parallel ring pass: every rank sends to its neighbour at once, as the measured p2p does."""
        if self.layout.cp == 1 or nbytes <= 0:
            return 0.0
        seconds = self.measured("p2p", 2, nbytes)
        return super().cp_pass(stage, nbytes) if seconds is None else seconds

    def ring(self, kind: str, groups, nbytes: float) -> float:
        """Every group collective (tp, dp, pp, the embedding sync) of a group of n: the measured one for n."""
        n = len(groups[0][0])
        if n == 1 or nbytes <= 0:
            return 0.0
        seconds = self.measured(kind, n, nbytes)
        return super().ring(kind, groups, nbytes) if seconds is None else seconds
