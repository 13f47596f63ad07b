"""What every action of a schedule costs on one pipeline rank, computed once before the replay. Torch-free.

Compute comes from simulator/costs/compute.py's `chunk_times` (per unit: the embedding, one block,
the head: the sum of simulator/costs/ops.py's ops), or on a measured CPU host from its measured units
and core sharing (simulator/engine/host.py), tensor-parallel collectives from its byte counts
timed on the tp group's links. What overlaps what is simulator/engine/overlap.py's `Overlap`; its
default, "executor", is our code (parallel/pipeline/executor.py, parallel/data/zero.py, parallel/data/zero3.py):

  tp      Megatron's collectives sit between the layer's matmuls: never hidden (Overlap.tp:
          hidden behind the same pass's Linear GEMMs as far as they last, the GEMMs slowed by
          Overlap.tp_slowdown meanwhile: overlap.py's `exposed`, charged to tp).
  cp      context parallelism's key/value exchange inside each block (job/exchange/context.py's calls), priced by
          simulator/engine/context.py: the ring's passes behind the attention blocks as the trainer
          overlaps them, the rest exposed.
  ep      expert parallelism's all-to-alls inside each MoE block (job/exchange/experts.py's calls), priced by
          simulator/engine/experts.py: exposed, or under Overlap.ep behind the block's shared experts as far as
          they last (the seconds hidden kept apart: ActionCost.ep_hidden, the breakdown's hidden row); the
          experts' own data-parallel collectives are the pricer's.
  dp      no model of ZeRO here: the data-parallel collectives are the schedule's own actions
          (job/data_parallel.py: per bucket or unit, per micro-batch where the stage issues
          them), priced from their place in the list by simulator/engine/data_parallel.py.
  optimizer  the step itself and the squared gradient norm's all-reduce over tp and pp (over
          dp it is OptimizerStep's own collective), and the once-a-step compute of the rank's units
          (fp8 weight casts kept across micro-batches: chunk_times' per_step_s).

Zero-bubble halves: BackwardInput gets everything but the weight gradients (the input-gradient
GEMMs, the element-wise backward, the recomputation and all backward tp collectives);
BackwardWeight the weight-gradient GEMMs, their accumulation and bias sums (the op list says
which; half of a measured unit's backward); the reductions armed after it overlap it. The
context-parallel exchange and the experts' all-to-alls belong to the input gradients: BackwardInput's.
"""

from __future__ import annotations

from dataclasses import dataclass

from minigpt.config import GPTConfig
from job.schedule import ScheduleConfig
from job.train_config import TrainConfig, bucket_numel
from precision.policy import FORMAT_BYTES, policy as precision_policy
from simulator.costs.compute import EfficiencyProfile, chunk_times, hbm_speed, kernel_overhead
from simulator.engine.context import layer_exchange, te_layer_exchange, torch_layer_exchange
from simulator.engine.experts import SharedExperts, layer_exchange as expert_exchange, routing_seconds
from job.exchange.experts import expert_gradient_reduction
from simulator.engine.host import HostCompute
from simulator.engine.links import LinkCosts
from simulator.engine.muon import hbm_seconds, muon_seconds
from simulator.engine.data_parallel import ActionCost, DataParallelPricer, UnitCopies
from simulator.costs.hardware import GPUSpec
from job.layout import Layout, buckets, stage_units
from job.schedule import Backward, BackwardInput, BackwardWeight, Forward
from simulator.memory import MemoryEstimate, fp8_experts_kept, fp8_params_mode
from simulator.costs.implementation import Implementation
from simulator.costs.op_types import cp_merge
from simulator.engine.overlap import Overlap, exposed


NORM_BYTES = FORMAT_BYTES["fp32"]
AMAX_BYTES = FORMAT_BYTES["fp32"]
AMAXES_PER_GEMM = (3, 2)  # Transformer Engine's fp8 tensors per GEMM: forward (input, weight, output), backward (two)


@dataclass
class RankCosts:
    """A rank's prices: `actions[(type, chunk)]` a compute with nothing armed around it;
    `pricer` (simulator/engine/data_parallel.py) a compute with the data-parallel actions armed around it and
    a data-parallel action on its own; `optimizer` the step, norm reductions included."""

    actions: dict[tuple[type, int], ActionCost]
    optimizer: float = 0.0
    pricer: object = None

    @classmethod
    def uniform(cls, chunks: list[int], forward: float, backward: float, optimizer: float = 0.0) -> "RankCosts":
        """Every chunk alike and no communication: for checking the schedule's closed forms."""
        actions = {}
        for chunk in chunks:
            for kind, seconds in ((Forward, forward), (Backward, backward), (BackwardInput, backward / 2),
                                  (BackwardWeight, backward / 2)):
                actions[(kind, chunk)] = ActionCost(seconds, compute=seconds)
        return cls(actions, optimizer=optimizer)


@dataclass(frozen=True)
class Unit:
    tensors: list
    forward: float  # compute seconds
    backward: float  # recompute included
    forward_tp: float  # tensor-parallel seconds left exposed (simulator/engine/overlap.py's tp setting)
    backward_tp: float
    numel: int  # padded to the dp size (ZeRO-3's flat unit)
    recompute: float = 0.0  # the part of `backward` that recomputes the forward
    weight: float = 0.0  # the weight-gradient part of `backward` (zero-bubble schedules' W)
    forward_cp: float = 0.0  # context-parallel exchange seconds left exposed (simulator/engine/context.py)
    backward_cp: float = 0.0
    forward_ep: float = 0.0  # expert parallelism's all-to-alls left exposed (simulator/engine/experts.py)
    backward_ep: float = 0.0
    forward_ep_hidden: float = 0.0  # their seconds hidden behind the shared experts (Overlap.ep)
    backward_ep_hidden: float = 0.0
    input_half: float | None = None  # a zero-bubble input half measured apart (None: the backward but `weight`)

    @property
    def forward_total(self) -> float:
        """The forward as its action holds the rank: compute and what is exposed inside it."""
        return self.forward + self.forward_tp + self.forward_cp + self.forward_ep

    @property
    def backward_total(self) -> float:
        return self.backward + self.backward_tp + self.backward_cp + self.backward_ep

    @property
    def backward_input(self) -> float:
        """The compute of a zero-bubble schedule's input half (BackwardInput): as measured, or the backward but its
        weights'."""
        return self.backward - self.weight if self.input_half is None else self.input_half


def tp_seconds(links: LinkCosts, collectives) -> float:
    return sum(c.calls * links.tp_collective(c.kind, c.bytes) for c in collectives)


@dataclass
class _Job:
    """What every rank's costs are made of."""

    model: GPTConfig
    layout: Layout
    links: LinkCosts
    zero: int
    dp: int
    bucket_numel: int
    compute_bytes: int
    serial: bool  # gloo on a CPU host: communication does not overlap compute
    overlap: Overlap


def _unit_times(job: _Job, gpu: GPUSpec, precision: str, micro_batch: int, implementation: Implementation,
                profile: EfficiencyProfile | None, host: HostCompute | None, memo: dict | None = None):
    """times(layers, first, last, stage, moe, kind) -> (forward, backward, exposed tp forward, exposed tp backward,
    recompute, weight, exposed cp forward, exposed cp backward, exposed ep forward, exposed ep backward, hidden ep
    forward, hidden ep backward); `moe`: the blocks are a mixture of experts'; `kind`: the blocks' kind
    (GPTConfig.layer_kind: their sliding window, 0 none, and whether they rotate; None: the model's own).
    `memo`: the units priced so far, keyed by what their price depends on, which a caller may share between layouts
    of one model, cluster, precision and implementation (minigpt plan's bound: a unit of one tp and micro-batch
    serves every dp, ZeRO stage and schedule, and every pp but the head's, whose replicated tensors depend on it)."""
    memo = {} if memo is None else memo
    layout = job.layout
    shape = (layout.tp, layout.sequence_parallel, layout.cp, layout.cp_kind, layout.ep, micro_batch, implementation)
    exchanges: dict = {}  # per stage too: the cp group's links are the stage's
    hide = job.overlap.tp and not job.serial

    def unit_key(layers: int, first: bool, last: bool, moe: bool, kind: tuple[int, bool] | None) -> tuple:
        return layers, first, last, moe, kind, shape, layout.pp if last else 0

    def times(layers: int, first: bool, last: bool, stage: int = 0, moe: bool = False,
              kind: tuple[int, bool] | None = None):
        key = unit_key(layers, first, last, moe, kind)
        if key not in memo:
            model = job.model if kind is None else job.model.uniform(*kind)  # itself unless a pattern
            ct = chunk_times(model, layers, micro_batch, job.layout, gpu, precision, implementation.recompute,
                             first, last, profile, implementation=implementation, moe_layers=layers if moe else 0)
            f, b, again, weight = ct.forward_s, ct.backward_s, ct.recompute_s, ct.backward_weight_s
            first_half = None
            if host is not None:
                f, b, again = host.chunk(layers, first, last, micro_batch, implementation.recompute, (f, b, again), moe)
                halves = host.split(layers, last, micro_batch, implementation.recompute, moe)
                weight = (b - again) / 2 if halves is None else halves[1]  # halved, unless the halves were measured
                first_half = None if halves is None else halves[0]
            ftp, btp = tp_seconds(job.links, ct.tp_collectives_forward), tp_seconds(job.links, ct.tp_collectives_backward)
            if hide:  # hidden behind the Linears' GEMMs of the same pass, as far as they last, slowing them
                ftp = exposed(ftp, ct.forward_linear_s, job.overlap.tp_slowdown)
                btp = exposed(btp, ct.backward_linear_s, job.overlap.tp_slowdown)
            memo[key] = (f, b, ftp, btp, again, weight, first_half), ct
        priced, ct = memo[key]
        blocks, moe_blocks = _exchanging_blocks(job.model, layers, last, moe)
        if (job.layout.cp == 1 and not (moe_blocks and job.layout.ep > 1)) or not blocks:
            return (*priced, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0)
        if (key, stage) not in exchanges:
            context = _exchange(job, ct, blocks, micro_batch, implementation, stage) \
                if job.layout.cp > 1 else (0.0, 0.0)
            if moe_blocks and job.layout.cp > 1:  # the MoE's routing counted over whole sequences: the cp group's too
                routing = routing_seconds(job.model, job.layout, micro_batch, implementation.recompute, job.links, stage)
                context = (context[0] + moe_blocks * routing[0], context[1] + moe_blocks * routing[1])
            experts = (0.0,) * 4
            if moe_blocks:
                forward, backward = expert_exchange(job.model, job.layout, micro_batch, job.compute_bytes,
                                                    implementation.recompute, job.links, stage,
                                                    implementation.expert_load, _shared_experts(job, ct, moe_blocks),
                                                    implementation.dispatcher)
                experts = tuple(moe_blocks * x for x in (forward.seconds, backward.seconds, forward.hidden,
                                                         backward.hidden))
            exchanges[(key, stage)] = (*context, *experts)
        return (*priced, *exchanges[(key, stage)])

    # the priced unit's ChunkTimes, read after times() priced it: its once-a-step compute (fp8 weight casts kept across
    # micro-batches) and its fp8 GEMMs' amax reductions, which the engine charges per step and per chunk
    times.unit = lambda layers, first, last, moe=False, kind=None: memo[unit_key(layers, first, last, moe, kind)][1]
    return times


def amax_seconds(job: _Job, implementation: Implementation, pol, stage: int, fp8_gemms: int,
                 sp_amaxes: tuple[int, int]) -> tuple[float, float]:
    """(forward, backward) seconds of a chunk's fp8 amax reductions, exposed on the compute stream (all_reduce with
    async_op=False). Delayed scaling: Transformer Engine's fp8_autocast, which Megatron-core opens around each model
    chunk's blocks, all-reduces (max) the amaxes of the region's fp8 GEMMs when the forward leaves it and again when
    the backward of its first module ends (FP8GlobalStateManager.reduce_and_update_fp8_tensors): three fp32 amaxes
    per GEMM forward (input, weight, output), two backward (output and input gradients), over
    Implementation.fp8_amax_group. Current scaling: one fp32 amax over tp per sequence-parallel gathered tensor
    (`sp_amaxes`: simulator/costs/layers/fp8.py). MXFP8 keeps no amax: nothing; nor without fp8 Linears."""
    if not pol.fp8_linears:
        return 0.0, 0.0
    if implementation.fp8_scaling == "current":
        return tuple(calls * job.links.amax_all_reduce(stage, "tp", AMAX_BYTES) if calls else 0.0
                     for calls in sp_amaxes)
    group = implementation.fp8_amax_group
    if group == "none" or not fp8_gemms or implementation.fp8_scaling != "tensor":
        return 0.0, 0.0
    return tuple(job.links.amax_all_reduce(stage, group, per_gemm * AMAX_BYTES * fp8_gemms)
                 for per_gemm in AMAXES_PER_GEMM)


def _exchanging_blocks(model, layers: int, last: bool, moe: bool) -> tuple[int, int]:
    """(blocks, MoE blocks) whose context-parallel and expert exchanges a unit runs: its own `layers`, and on the
    last chunk's head unit the multi-token prediction modules' blocks (compute.py's mtp_units)."""
    mtp = model.mtp_depth if last else 0
    return layers + mtp, (layers if moe else 0) + (mtp if model.mtp_is_moe else 0)


def _shared_experts(job: _Job, ct, layers: int) -> SharedExperts | None:
    """What hides one MoE layer's all-to-alls under Overlap.ep: its shared experts (the chunk's `layers` blocks all
    a mixture of experts'); nothing without the setting, or on a CPU host, where gloo does not overlap compute."""
    if not job.overlap.ep or job.serial:
        return None
    per_layer = lambda halves: (halves[0] / layers, halves[1] / layers)  # noqa: E731
    return SharedExperts(per_layer(ct.shared_forward_s), per_layer(ct.shared_backward_s),
                         per_layer(ct.shared_recompute_s), job.overlap.dp_slowdown)


def _exchange(job: _Job, ct, layers: int, micro_batch: int, implementation: Implementation,
              stage: int) -> tuple[float, float]:
    """Exposed seconds of the context-parallel exchange of `layers` blocks (forward, backward)."""
    per_layer = (ct.attention_forward_s / layers, ct.attention_backward_s / layers, ct.attention_recompute_s / layers)
    if job.serial:  # gloo on a CPU host: a pass does not overlap the block (as for every other collective)
        per_layer = (0.0, 0.0, 0.0)
    merge = cp_merge(job.layout, implementation.cp_attention)  # one reading of which merge runs on this layout
    pricer = {"torch": torch_layer_exchange, "te": te_layer_exchange}.get(merge, layer_exchange)
    forward, backward = pricer(job.model, job.layout, micro_batch, job.compute_bytes, implementation.recompute,
                               job.links, stage, per_layer)
    return layers * forward.seconds, layers * backward.seconds


def _plain_actions(chunk: int, units: list[Unit], actions: dict, amax: tuple[float, float] = (0.0, 0.0)) -> None:
    """A chunk's computes with nothing armed around them: compute, exposed tp, cp, ep and fp8 amax reductions only
    (the backward's with the input gradients: BackwardInput's)."""
    f_compute, f_tp = sum(u.forward for u in units), sum(u.forward_tp for u in units)
    b_compute, b_tp = sum(u.backward for u in units), sum(u.backward_tp for u in units)
    f_cp, b_cp = sum(u.forward_cp for u in units), sum(u.backward_cp for u in units)
    f_ep, b_ep = sum(u.forward_ep for u in units), sum(u.backward_ep for u in units)
    f_hid, b_hid = sum(u.forward_ep_hidden for u in units), sum(u.backward_ep_hidden for u in units)
    w_compute, i_compute = sum(u.weight for u in units), sum(u.backward_input for u in units)
    f_amax, b_amax = amax
    actions[(Forward, chunk)] = ActionCost(f_compute + f_tp + f_cp + f_ep + f_amax, f_compute, f_tp, cp=f_cp, ep=f_ep,
                                           ep_hidden=f_hid, amax=f_amax)
    actions[(Backward, chunk)] = ActionCost(b_compute + b_tp + b_cp + b_ep + b_amax, b_compute, b_tp, cp=b_cp, ep=b_ep,
                                            ep_hidden=b_hid, amax=b_amax)
    if chunk == 0:  # no input gradient to send: BackwardInput does nothing, BackwardWeight the whole backward
        actions[(BackwardInput, chunk)] = ActionCost(0.0)
        actions[(BackwardWeight, chunk)] = actions[(Backward, chunk)]
    else:
        actions[(BackwardInput, chunk)] = ActionCost(i_compute + b_tp + b_cp + b_ep + b_amax, i_compute, b_tp, cp=b_cp,
                                                     ep=b_ep, ep_hidden=b_hid, amax=b_amax)
        actions[(BackwardWeight, chunk)] = ActionCost(w_compute, w_compute)


def rank_costs(model: GPTConfig, layout: Layout, schedule: ScheduleConfig, links: LinkCosts, gpu: GPUSpec,
               precision: str, micro_batch: int, recompute: str, profile: EfficiencyProfile | None,
               memory: MemoryEstimate, bucket_mb: float, host: HostCompute | None = None,
               implementation: Implementation | None = None, overlap_settings: Overlap | None = None,
               unit_memo: dict | None = None) -> list[RankCosts]:
    """Every pipeline rank's prices: its actions' compute and exposed collectives, its data-parallel pricer, its
    optimizer step. `unit_memo`: a dict shared across calls for one model, cluster, precision, profile and overlap
    (plan's bound), so that a unit is priced once (_unit_times)."""
    pol = precision_policy(precision)
    implementation = implementation or Implementation(recompute=recompute)
    job = _job(model, layout, schedule.zero_stage, links, pol, bucket_mb, host, overlap_settings)
    times = _unit_times(job, gpu, precision, micro_batch, implementation, profile, host, unit_memo)
    # The optimizer's one reduction of the squared gradient norm (precision/optimizer.py, parallel/run/build.py's
    # reduce_sum): an fp32 scalar all-reduced over tp, then pp; over dp it is the OptimizerStep's own action
    # (job/data_parallel.py), priced by the pricer.
    norm_reduce = links.tp_collective("all_reduce", NORM_BYTES) + links.pp_collective("all_reduce", NORM_BYTES)
    if layout.ep > 1 and model.is_moe:  # the experts' share of the norm, summed over the expert group
        norm_reduce += links.ep_collective(0, "all_reduce", NORM_BYTES)
        if layout.expert_state_shards > 1:  # and over the ranks whose pieces of the experts' states it sums
            norm_reduce += links.expert_collective(0, "all_reduce", NORM_BYTES)
    ranks = []
    gathers = fp8_params_mode(pol, implementation) != "none"  # fp8 parameters: gathered at a byte each
    priced = _rank_actions(job, times, implementation, pol, sized=True)
    for rank, (placed, chunk_units, actions, per_step) in enumerate(priced):
        pricer, experts = None, _expert_reduction(job, placed, rank, pol, fp8_experts_kept(pol, implementation))
        per_step += _bias_counts(job, placed, rank)
        if job.dp > 1:
            pricer = DataParallelPricer(chunk_units, schedule.data_parallel, job.zero, job.bucket_numel,
                                        lambda kind, nbytes, group, stage=rank: links.sharded_collective(
                                            stage, kind, nbytes, group),
                                        job.overlap, job.serial, actions, experts, gathers,
                                        implementation.fp8_experts, implementation.reduce_bytes,
                                        _copies(job, gpu, profile, implementation, schedule.sums_grads))
        ranks.append(RankCosts(
            actions=actions,
            optimizer=(optimizer_seconds(memory.per_stage[rank], pol, gpu, implementation.fused_optimizer)
                       + _muon(model, layout, rank, memory.per_stage[rank], pol, links, gpu, profile, implementation))
            * (host.slowdown if host is not None else 1.0)
            + norm_reduce + per_step + (0.0 if pricer else experts),  # no pricer (one data rank): at the step itself
            pricer=pricer,
        ))
    return ranks


def _muon(model, layout, stage: int, memory, pol, links, gpu, profile, implementation) -> float:
    """Muon's all-to-alls and Newton-Schulz GEMMs on a rank of `stage` (simulator/engine/muon.py); 0 under AdamW."""
    if implementation.optimizer != "muon":
        return 0.0
    owned_matrices = (memory.adam_m - memory.adam_v) // FORMAT_BYTES[pol.optimizer_state]
    return muon_seconds(model, layout, stage, owned_matrices, links, gpu, profile, pol)


def action_prices(model: GPTConfig, layout: Layout, links: LinkCosts, gpu: GPUSpec, precision: str, micro_batch: int,
                  profile: EfficiencyProfile | None, implementation: Implementation, overlap_settings: Overlap,
                  unit_memo: dict | None = None) -> list[dict[tuple[type, int], ActionCost]]:
    """Each pipeline rank's actions with nothing armed, priced exactly as rank_costs prices them, without the
    data-parallel pricer, the optimizer step or the buckets those need: what minigpt plan's bound reads for every
    layout it searches (simulator/search/bound.py)."""
    pol = precision_policy(precision)
    job = _job(model, layout, 0, links, pol, TrainConfig.bucket_mb, None, overlap_settings)  # no stage: no pricer
    times = _unit_times(job, gpu, precision, micro_batch, implementation, profile, None, unit_memo)
    return [actions for _, _, actions, _ in _rank_actions(job, times, implementation, pol, sized=False)]


def _job(model: GPTConfig, layout: Layout, zero: int, links: LinkCosts, pol, bucket_mb: float,
         host: HostCompute | None, overlap_settings: Overlap | None) -> _Job:
    compute_bytes = FORMAT_BYTES[pol.compute]
    return _Job(model, layout, links, zero, layout.shard_ranks, bucket_numel(bucket_mb, compute_bytes),
                compute_bytes, host is not None and host.serial, overlap_settings or Overlap())


def _rank_actions(job: _Job, times, implementation: Implementation, pol, sized: bool):
    """Per pipeline rank, in order: (its chunks' placed layers, their units, their actions with nothing armed, its
    once-a-step compute). `sized`: each unit's numel padded to the dp size (its bucket: what the data-parallel
    pricer needs; 0 without)."""
    model, layout = job.model, job.layout
    last_chunk = layout.pp * layout.virtual_chunks - 1  # the head's (Layout.rank_chunks)
    for rank, (per_chunk, placed) in enumerate(zip(stage_units(model, layout), layout.rank_chunks(model))):
        chunk_units: dict[int, list[Unit]] = {}
        actions: dict[tuple[type, int], ActionCost] = {}
        per_step = 0.0  # the rank's once-a-step compute, charged with its optimizer step
        for (chunk, layers), unit_tensors in zip(placed, per_chunk):
            units, fp8_gemms, sp_amaxes = [], 0, (0, 0)
            for position, tensors in enumerate(unit_tensors):
                embedding = chunk == 0 and position == 0
                head = chunk == last_chunk and position == len(unit_tensors) - 1
                block = 0 if embedding or head else 1
                layer = layers[position - (1 if chunk == 0 else 0)] if block else None
                moe = bool(block) and model.is_moe_layer(layer)
                kind = model.layer_kind(layer) if block else None  # its (window, rotates)
                f, b, ftp, btp, again, weight, first_half, *exchanged = times(block, embedding, head, rank, moe, kind)
                priced = times.unit(block, embedding, head, moe, kind)
                per_step += priced.per_step_s
                fp8_gemms += priced.fp8_gemms
                sp_amaxes = (sp_amaxes[0] + priced.sp_amaxes[0], sp_amaxes[1] + priced.sp_amaxes[1])
                numel = buckets(tensors, None, job.dp)[0].size if sized else 0
                units.append(Unit(tensors, f, b, ftp, btp, numel, again, weight, *exchanged, input_half=first_half))
            chunk_units[chunk] = units
            _plain_actions(chunk, units, actions, amax_seconds(job, implementation, pol, rank, fp8_gemms, sp_amaxes))
        yield placed, chunk_units, actions, per_step


def _copies(job: _Job, gpu: GPUSpec, profile: EfficiencyProfile | None, implementation: Implementation,
            sums: bool = False) -> UnitCopies | None:
    """ZeRO-3's compute-stream copies around its gathers and reductions (Implementation.zero3_copies) at the GPU's
    element-wise bandwidth, an element's bytes each: FSDP2's out of the all-gather buffer (read and written in the
    compute format) and into the reduce-scatter's (read in the compute format, written in the reduction's); ours,
    at a reduction, the staging buffer zero-filled, each gradient copied in, the whole divided by the ranks, and the
    reduced piece (1/dp) added to the shard, all in the compute format. `sums`: the units are held all step
    (ScheduleConfig.zero3_hold), each backward's gradients summed until the one reduction: ours added into the
    staging (read both, write one; the first micro-batch's zero-fill and copy move as many bytes), FSDP2's accumulated
    in the reduction's format (torch's FSDPParam: the first micro-batch's gradient cast to it where the formats differ,
    to_accumulated_grad_if_needed, and kept where autograd wrote it where they do not; each later one read and added,
    accumulate_unsharded_grad_if_needed or autograd's accumulation, the last before the reduction too, which then
    copies the sum in, read and written in the reduction's format)."""
    if implementation.zero3_copies == "none" or job.zero != 3:
        return None
    speed, e, kernel = hbm_speed(gpu), job.compute_bytes, kernel_overhead(gpu, profile)
    if implementation.zero3_copies == "fsdp2":
        r = implementation.reduce_bytes or e
        if not sums:
            return UnitCopies(2 * e / speed, (e + r) / speed, kernel)
        return UnitCopies(2 * e / speed, (e + r) / speed, kernel, sum_s=(e + 2 * r) / speed,
                          first_s=(e + r) / speed if r != e else 0.0, summed_in_s=(e + 2 * r + 2 * r) / speed)
    staged = e + 2 * e + 2 * e + 3 * e / job.dp  # zeros; grad in; div_; the piece's add_ into the shard
    return UnitCopies(0.0, staged / speed, kernel, out_kernels=0, in_kernels=3, per_tensor=True,
                      sum_s=3 * e / speed if sums else 0.0)


def _bias_counts(job: _Job, placed, stage: int) -> float:
    """Seconds of DeepSeek-V3's choice-bias update on `stage` (parallel/expert/balance.py): its MoE layers' fp64 choice
    counts all-reduced once a step over the ranks routing other tokens (dp x cp, and tp under sequence parallelism),
    after the optimizer step."""
    if not (job.model.is_moe and job.model.expert_bias):
        return 0.0
    nbytes = 8 * job.model.n_experts * _moe_layers(job, placed)
    tp = job.links.tp_collective("all_reduce", nbytes) if job.layout.sequence_parallel else 0.0
    return job.links.dp_collective(stage, "all_reduce", nbytes) + tp


def _moe_layers(job: _Job, placed) -> int:
    """The MoE layers of a rank's placed chunks, a multi-token prediction module's on the last chunk's rank."""
    model, last = job.model, job.layout.pp * job.layout.virtual_chunks - 1
    mtp = model.mtp_depth if model.mtp_is_moe and any(c == last for c, _ in placed) else 0
    return mtp + sum(model.is_moe_layer(i) for _, layers in placed for i in layers)


def _expert_reduction(job: _Job, placed, stage: int, pol, fp8_experts_kept: bool = False) -> float:
    """Seconds of the routed experts' gradient reduction of a rank under expert parallelism, once a step at its
    optimizer step over the ranks holding the same experts: an all-reduce, or with their states sharded a
    reduce-scatter and the updated weights' all-gather (job/exchange/experts.py's expert_gradient_reduction), in fp8
    for the weights when the stack keeps its experts' weights in fp8 (`fp8_experts_kept`)."""
    layout = job.layout
    calls = expert_gradient_reduction(job.model, layout.ep, layout.token_ranks, _moe_layers(job, placed),
                                      FORMAT_BYTES[pol.compute], layout.expert_state_shards, fp8_experts_kept)
    return sum(call.calls * job.links.expert_collective(stage, call.kind, call.bytes) for call in calls)


def optimizer_bytes(pol, fused: bool) -> int:
    """Bytes one AdamW step moves through memory per parameter it owns.

    fused (apex's FusedAdam in Megatron, torch's AdamW(fused=True) in torchtitan): one pass, the gradient read, the
    moments and the masters read and written, the compute weights written.
    Not fused (our executor's MasterAdamW.step, precision/optimizer.py, kernel by kernel, fp32 state s = 4): a 16-bit
    gradient copied to fp32 (g read, 4 written); the norm's squares (4 read); m: mul_ (2 s), add_ of the gradient
    (3 s); v: mul_ (2 s), addcmul_ of the gradient (3 s); the denominator: sqrt, div_, add_ (2 s each); the weight
    decay's mul_ on the masters (2 s; the few norm and bias weights it skips counted too); addcdiv_ (4 s); and the
    compute weights copied from the masters (s read, their bytes written) when they are not the masters."""
    per_param = pol.bytes_per_param()
    grad, master, compute = per_param["grad"], per_param["master"], per_param["compute"]
    weights = 2 * master + compute if pol.master else 2 * compute
    if fused:
        return grad + 2 * (per_param["adam_m"] + per_param["adam_v"]) + weights
    state = per_param["adam_m"]  # 4: MasterAdamW keeps every tensor of the update in fp32
    cast = grad + state if grad != state else 0
    passes = 1 + (2 + 3) + (2 + 3) + 3 * 2 + 2 + 4  # norm, m, v, denominator, decay, addcdiv: in state-size reads/writes
    return cast + passes * state + (state + compute if pol.master else 0)


def optimizer_seconds(stage: MemoryEstimate, pol, gpu: GPUSpec, fused: bool = False) -> float:
    """AdamW on this rank's share: optimizer_bytes per owned parameter at the achieved HBM speed; under Muon the
    owned parameters without a second moment are its matrices, muon_bytes each (simulator/engine/muon.py)."""
    owned = stage.adam_m // FORMAT_BYTES[pol.optimizer_state]
    adamw = stage.adam_v // FORMAT_BYTES[pol.optimizer_state]
    return adamw * optimizer_bytes(pol, fused) / hbm_speed(gpu) + hbm_seconds(owned - adamw, pol, gpu, fused)
