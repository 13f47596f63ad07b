"""Predicted bytes per GPU, by category, for a layout: what OUR implementation holds.

Torch-free. It models parallel/tensor/parallelize.py, parallel/data/zero.py, parallel/data/zero3.py and
precision/flat.py, not the ZeRO paper, so a run's `memory_per_rank` can be
checked against it:

- Parameters per rank and pipeline stages: job/layout.py.
- Flat layout: parameters in model order, cut into buckets that close once they reach
  bucket_numel (job/train_config.py: bucket_mb MiB over the compute bytes), each padded to a multiple of
  the data-parallel size N; ZeRO-3 pads one flat per unit (embeddings, each block,
  final norm + head). A bucket never spans two pipeline chunks. With N == 1 every stage
  is stage 0 (make_data_parallel). Under hybrid sharding N is a shard group's ranks
  (Layout.shard_ranks): a rank's states are those of 1/N, whatever the number of replica groups.
- Stages: 0 all weights, grads, masters, m, v; 1 masters/m/v for 1/N; 2 grads 1/N too;
  3 weights 1/N too. Masters exist only when the policy has them (fp32: none).
- Activations: the tensors simulator/costs/ops.py's op list saves (by attention kind, recompute
  kind and what sequence parallelism saves), checked against config.py's counts for our
  executor's flash attention; while a block's backward recomputes, what it recomputes is
  alive too. A block's workspace (fp8 weight copies cast once a step, Implementation.fp8_weight_cache)
  is held once per layer on the rank, not per micro-batch in flight.
  Comm buffers: simulator/states.py's `data_parallel_buffers`, `zero3_buffers`.
  A run's measured activations are one micro-batch's forward (parallel/memory.py):
  compare them with micro_batches_in_flight=1.
- Context parallelism (Layout.cp): a rank's activations are those of its s/cp tokens (the op list's
  shapes), the data-parallel size N above is dp x cp (Layout.data_ranks), and while one block's
  attention backward runs the exchange holds its buffers too (`exchange_buffer_bytes`, beside what a
  recompute brings back): the ring's received keys and values and the fp32 dk/dv accumulators and their
  received copies, or the all-gather's whole-sequence gradients; the all-gather's gathered keys and values
  are saved tensors of every block (simulator/costs/layers/attention.py).
- The last stage's loss: beside the fp32 log-probabilities it saves, its backward holds the gradients it makes, one
  micro-batch at a time (`loss_gradient_bytes`, by Implementation.loss: two fp32 gradients a logit for torch's
  cross entropy, ours at tp 1 and torchtitan's; one for ours under tp (its backward works in place, the peak is its
  forward's fp32 logits beside the exponentials); Megatron's in place, only the gradient's
  16-bit copy), measured on CPU with torch's memory timeline (tests/test_loss_memory.py).
- Mixture of experts: each block's activations by its kind (GPTConfig.is_moe_layer); under expert parallelism
  a rank holds E/ep experts beside ZeRO, their optimizer states sharded over the ranks holding the same
  experts under ZeRO 1-3 (simulator/states.py's `experts_states`), and one MoE layer's all-to-all buffers
  (`dispatch_buffer_bytes`).
- A planner asks this of tens of thousands of layouts: the model's checks, each layout's model states
  and each block's activations are computed once per distinct input (lru_cache; all inputs are frozen).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from functools import lru_cache
from typing import Sequence

from minigpt.config import OP_RECOMPUTE, RECOMPUTE_MODES, GPTConfig
from job.exchange.context import GRAD_BYTES, kv_elements
from job.train_config import bucket_numel
from minigpt.errors import ConfigError
from precision.policy import FORMAT_BYTES, FP8_BYTES, PrecisionPolicy, policy as precision_policy
from simulator.costs.hardware import GPUSpec
from job.layout import Layout, check_against_config, is_expert_tensor, stage_units
from simulator.costs.implementation import Implementation
from simulator.costs.ops import block_ops, embedding_ops, head_ops, mtp_units
from simulator.costs.layers.moe import expert_rows, received_rows
from simulator.memory_notes import fp8_note, layout_notes
from simulator.states import (experts_muon_owned, experts_states, fp8_weights_held, muon_owned, zero3_gather_bytes,
                              zero3_hold, zero_states)



# ---------------------------------------------------------------- activations per rank


def _implementation(recompute: str, attention: str, sp_saved_input: str) -> Implementation:
    return Implementation(attention, recompute, sp_saved_input)


def check_activations_against_config(model: GPTConfig, policy: PrecisionPolicy) -> None:
    """simulator/costs/ops.py's saved tensors (flash attention, as our executor runs) must equal config.py's counts,
    for a dense block and a mixture of experts' (config.py counts the experts dropless, one sequence's per sequence
    more: minigpt/moe.py keeps nothing of its own under full recomputation)."""
    plain = replace(policy, fp8_linears=False)
    dtype_bytes = FORMAT_BYTES[plain.compute]
    dropless = replace(model, capacity_factor=None) if model.is_moe else model
    for moe in (False, True) if model.is_moe else (False,):
        op = (OP_RECOMPUTE,) if not moe and model.op_recompute_refusal() is None else ()
        for recompute in (*RECOMPUTE_MODES, *op):
            implementation = _implementation(recompute, "flash", "gathered")
            counted = block_ops(dropless, 1, Layout(), plain, implementation, moe).saved_bytes
            expected = model.activation_bytes_per_token_per_layer(dtype_bytes, recompute, moe) * model.seq_len
            expected += model.moe_activation_bytes_per_sequence() if moe and recompute != "full" else 0
            if counted != expected:
                raise RuntimeError(f"simulator/costs/ops.py's saved tensors disagree with minigpt/config.py's "
                                   f"activation bytes ({'MoE' if moe else 'dense'} block, recompute {recompute})")
    head = head_ops(model, 1, Layout(), plain).saved_bytes
    if head != model.head_activation_bytes_per_token(dtype_bytes) * model.seq_len:
        raise RuntimeError("simulator/costs/ops.py's head tensors disagree with minigpt/config.py's head activation bytes")


def layer_activation_bytes(model: GPTConfig, layout: Layout, policy: PrecisionPolicy, micro_batch_size: int,
                           recompute: str = "none", attention: str = "flash", sp_saved_input: str = "gathered") -> int:
    """Bytes one block keeps for its backward, for one micro-batch, on one rank (simulator/costs/ops.py's Saved)."""
    implementation = _implementation(recompute, attention, sp_saved_input)
    return block_ops(model, micro_batch_size, layout, policy, implementation).saved_bytes


def recomputed_bytes(model: GPTConfig, layout: Layout, policy: PrecisionPolicy, micro_batch_size: int,
                     recompute: str = "none", attention: str = "flash", sp_saved_input: str = "gathered") -> int:
    """Bytes one block's recompute brings back to life while that block's backward runs (0 without recompute)."""
    implementation = _implementation(recompute, attention, sp_saved_input)
    return block_ops(model, micro_batch_size, layout, policy, implementation).recomputed_bytes


def end_activation_bytes(model: GPTConfig, layout: Layout, policy: PrecisionPolicy, micro_batch_size: int,
                         first: bool, last: bool, sp_saved_input: str = "gathered") -> int:
    """What the embeddings (a dropout mask) and the final norm, head and loss keep, for the stages that hold them."""
    implementation = _implementation("none", "flash", sp_saved_input)
    total = embedding_ops(model, micro_batch_size, layout, policy, implementation).saved_bytes if first else 0
    if last:  # and the multi-token prediction modules' inputs, blocks and heads (compute.py's mtp_units)
        total += head_ops(model, micro_batch_size, layout, policy, implementation).saved_bytes
        total += sum(ops.saved_bytes * count for ops, count in mtp_units(model, micro_batch_size, layout, policy,
                                                                           implementation))
    return total


# ---------------------------------------------------------------- the estimate


@dataclass(frozen=True)
class MemoryBytes:
    parameters: int
    gradients: int
    master_weights: int
    adam_m: int
    adam_v: int
    activations: int
    comm_buffers: int

    @property
    def model_states(self) -> int:
        return self.parameters + self.gradients + self.master_weights + self.adam_m + self.adam_v

    @property
    def total(self) -> int:
        return self.model_states + self.activations + self.comm_buffers


@dataclass(frozen=True)
class StageMemory(MemoryBytes):
    stage: int = 0
    layers: int = 0
    numel: int = 0  # parameters on one rank of this stage, before padding


@dataclass(frozen=True)
class MemoryEstimate(MemoryBytes):
    """Bytes per GPU on the most loaded pipeline stage (`stage`); `per_stage` has every stage."""

    stage: int = 0
    per_stage: tuple[StageMemory, ...] = ()
    capacity: int | None = None  # the GPU's HBM when a gpu was given
    notes: tuple[str, ...] = field(default=())

    @property
    def fits(self) -> bool | None:
        """Whether `total` fits the GPU's HBM (no allowance for the CUDA context or fragmentation)."""
        return None if self.capacity is None else self.total <= self.capacity

    def as_dict(self) -> dict:
        data = asdict(self)
        data.update(total=self.total, fits=self.fits, per_stage=[{**asdict(s), "total": s.total} for s in self.per_stage])
        return data


# the loss's peak per logit beside its saved fp32 log-probability (or exponential), measured with torch's memory timeline
# on fp32 logits (tests/test_loss_memory.py): torch's F.cross_entropy, two fp32 gradients in its backward (nll_loss's,
# log_softmax's); ours under tp (VocabParallelCrossEntropy, its backward in place): the forward's fp32 logits
LOSS_GRADIENTS = {"torch": 2 * FORMAT_BYTES["fp32"], "ours-tp": FORMAT_BYTES["fp32"]}


def loss_gradient_bytes(model: GPTConfig, layout: Layout, policy: PrecisionPolicy, micro_batch_size: int,
                        implementation: Implementation | None = None) -> int:
    """What the loss holds at its peak beyond the saved fp32 log-probabilities, on the last stage, one micro-batch
    at a time (Implementation.loss): torch's cross entropy (ours at tp 1, torchtitan's) two fp32 gradients a logit in
    its backward; ours under tp one, its forward's fp32 logits beside the exponentials (its backward makes the
    gradient in place of them); Megatron's vocab-parallel cross entropy makes the gradient in place of its
    saved softmax (megatron/core/tensor_parallel/cross_entropy.py), so only its copy in the compute format (none in
    fp32, where the cast is the same tensor)."""
    implementation = implementation or Implementation()
    logits = _loss_logits(model, layout.tp, layout.sequence_parallel, layout.cp, policy, micro_batch_size)
    compute = FORMAT_BYTES[policy.compute]
    if implementation.loss == "fused":
        return logits * (compute if compute < FORMAT_BYTES["fp32"] else 0)
    return logits * LOSS_GRADIENTS["ours-tp" if implementation.loss == "ours" and layout.tp > 1 else "torch"]


@lru_cache(maxsize=256)
def _loss_logits(model: GPTConfig, tp: int, sequence_parallel: bool, cp: int, policy: PrecisionPolicy,
                 micro_batch_size: int) -> int:
    """The logits one micro-batch's loss has on a rank: its saved fp32 log-probabilities over 4 (head_ops)."""
    layout = Layout(tp=tp, sequence_parallel=sequence_parallel, cp=cp)
    saved = head_ops(model, micro_batch_size, layout, policy, Implementation()).saved
    return sum(t.bytes for t in saved if t.name == "loss.log_probabilities") // FORMAT_BYTES["fp32"]


def exchange_buffer_bytes(model: GPTConfig, layout: Layout, policy: PrecisionPolicy, micro_batch_size: int) -> int:
    """What a context-parallel exchange holds at its peak, one block's attention backward, beyond the saved
    tensors (kv: one rank's keys, or values, of a layer: job/exchange/context.py's kv_elements):

      ring (parallel/context/ring.py)  the received keys and values: the copy being computed with and the
            next one arriving (one copy when cp = 2), 2 kv each in the compute format; the dk and dv fp32
            accumulators of the block at hand, the previous block's still being sent on and the copy
            arriving from the rank before, 2 kv each in fp32 (the forward holds only the received keys and
            values: less);
      allgather (allgather.py)  the gradients of the gathered keys and values, fp32, and their copies in
            the compute format handed to the reduce-scatter: 2 cp kv each (the gathered keys and values
            themselves are saved tensors, simulator/costs/layers/attention.py)."""
    if layout.cp == 1:
        return 0
    kv, e = kv_elements(model, layout.tp, layout.cp, micro_batch_size), FORMAT_BYTES[policy.compute]
    if layout.cp_kind == "ring":
        return min(layout.cp - 1, 2) * 2 * kv * e + 3 * 2 * kv * GRAD_BYTES
    return 2 * layout.cp * kv * (GRAD_BYTES + e)


def dispatch_buffer_bytes(model: GPTConfig, layout: Layout, policy: PrecisionPolicy, micro_batch_size: int,
                          load: float = 1.0) -> int:
    """What expert parallelism's all-to-alls hold beyond the saved tensors, one MoE layer at a time: a send and a
    receive buffer of the routed rows (R x d each, balanced: a rank receives as many as it sends; the busiest rank
    of a routing imbalance `load` receives received_rows), as the combine's and the dispatch's gradients cross in
    the backward (job/exchange/experts.py)."""
    if layout.ep == 1 or not model.is_moe:
        return 0
    split = layout.sequence_ranks  # under sequence parallelism each tp rank routes its slice
    rows, _ = expert_rows(model, micro_batch_size * model.seq_len // split, micro_batch_size, layout.ep, split)
    return (rows + received_rows(rows, layout.ep, load)) * model.d_model * FORMAT_BYTES[policy.compute]


@dataclass(frozen=True)
class ActivationModel:
    """What one micro-batch's activations are, per block and at the ends (see layer_activation_bytes)."""

    per_layer: int  # kept by one block
    recomputing: int  # alive in addition while one block's backward recomputes
    implementation: Implementation
    exchanging: int = 0  # alive in addition while one block's attention backward exchanges (context parallelism)
    workspace: int = 0  # held once per block for the whole step, whatever the micro-batches (cached fp8 weights)
    fp8_weights: int = 0  # of per_layer: the e4m3 weight copies a micro-batch keeps (fp8 weights cast per forward)

    @classmethod
    def of(cls, model: GPTConfig, layout: Layout, policy: PrecisionPolicy, micro_batch_size: int,
           implementation: Implementation, moe: bool | None = None) -> "ActivationModel":
        """A block of the model's main kind, or a MoE (`moe` True) or dense one; `exchanging` counts context
        parallelism's key/value buffers, and a MoE block's dispatch buffers under expert parallelism."""
        ops = block_ops(model, micro_batch_size, layout, policy, implementation, moe)
        exchanging = exchange_buffer_bytes(model, layout, policy, micro_batch_size)
        if model.is_moe if moe is None else moe:
            exchanging += dispatch_buffer_bytes(model, layout, policy, micro_batch_size, implementation.expert_load)
        copies = sum(t.bytes for t in ops.saved if t.name.endswith(".weight_fp8"))
        return cls(ops.saved_bytes, ops.recomputed_bytes, implementation, exchanging, ops.workspace_bytes, copies)


@lru_cache(maxsize=8192)
def _activations(model: GPTConfig, tp: int, sequence_parallel: bool, cp: int, cp_kind: str, pol: PrecisionPolicy,
                 micro_batch_size: int, implementation: Implementation,
                 ep: int = 1) -> tuple[dict[bool, ActivationModel], int, int]:
    """(each kind of block's activations, by whether it is a MoE's, the first stage's ends, the last stage's ends):
    what the layout's shape decides."""
    layout = Layout(tp=tp, dp=ep, sequence_parallel=sequence_parallel, cp=cp, cp_kind=cp_kind, ep=ep)
    kinds = {moe for moe in (False, True) if any(model.is_moe_layer(i) == moe for i in range(model.n_layers))}
    blocks = {moe: ActivationModel.of(model, layout, pol, micro_batch_size, implementation, moe) for moe in kinds}
    saved = implementation.sp_saved_input
    return (blocks, end_activation_bytes(model, layout, pol, micro_batch_size, True, False, saved),
            end_activation_bytes(model, layout, pol, micro_batch_size, False, True, saved))


@lru_cache(maxsize=8192)
def _model_states(model: GPTConfig, tp: int, pp: int, virtual_chunks: int, shard_ranks: int, zero: int,
                  pol: PrecisionPolicy, bucket_elements: int, prefetch: int, hold: str,
                  ep: int = 1, expert_shards: int = 1, fp8_params: str = "none",
                  fp8_experts: bool = False, reduce_bytes: int | None = None,
                  stage_layers: tuple[int, ...] = (), optimizer: str = "adamw") -> tuple[StageMemory, ...]:
    """Every stage's model states and buffers (no activations): they depend on dp and cp only through the ranks
    ZeRO shards over (dp x cp, or a shard group of them), and on ep and the experts' state shards (experts_states)."""
    layout = Layout(tp, pp, shard_ranks, zero, virtual_chunks=virtual_chunks, stage_layers=stage_layers)
    return tuple(_stage(model, layout, pol, index, chunks, placed, bucket_elements, 0, prefetch, hold, ep,
                        expert_shards, fp8_params, fp8_experts, reduce_bytes, optimizer)
                 for index, (chunks, placed) in enumerate(zip(stage_units(model, layout), layout.rank_chunks(model))))


@lru_cache(maxsize=64)
def _check_model(model: GPTConfig, pol: PrecisionPolicy) -> None:
    check_against_config(model)
    check_activations_against_config(model, pol)


def _check_in_flight(micro_batches_in_flight, pp: int) -> list[int]:
    in_flight = micro_batches_in_flight
    in_flight = [in_flight] * pp if isinstance(in_flight, int) else list(in_flight)
    if len(in_flight) != pp or any(not isinstance(n, int) or n < 1 for n in in_flight):
        raise ConfigError(
            f"micro_batches_in_flight must be a positive integer or {pp} of them (one per pipeline stage), "
            f"got {micro_batches_in_flight!r}"
        )
    return in_flight


def _check_ends(ends_in_flight, in_flight: list[int]) -> list[tuple[int, int]]:
    if ends_in_flight is None:
        return [(n, n) for n in in_flight]
    ends = [tuple(pair) for pair in ends_in_flight]
    if len(ends) != len(in_flight) or any(
            len(pair) != 2 or any(isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= total for n in pair)
            for pair, total in zip(ends, in_flight)):
        raise ConfigError(f"ends_in_flight must give each of the {len(in_flight)} stages two whole numbers (first "
                          f"chunk, last chunk) from 0 to its micro-batches in flight {in_flight}, got {ends_in_flight!r}")
    return ends


def _stage(model: GPTConfig, layout: Layout, pol: PrecisionPolicy, index: int, chunks, placed, bucket_numel: int,
           activations: int, prefetch: int, hold: str = "forward", ep: int = 1, expert_shards: int = 1,
           fp8_params: str = "none", fp8_experts: bool = False, reduce_bytes: int | None = None,
           optimizer: str = "adamw") -> StageMemory:
    """Model states and buffers of one pipeline stage (its activations given); under expert parallelism the
    experts' part apart (experts_states). `fp8_params` (fp8_params_mode): the fp8 Linears' weights gathered in fp8
    ("gathered": ZeRO-3's gathered units hold them at a byte each) and kept in fp8 ("kept": the weights held too);
    `fp8_experts`: the routed experts' weights among them (fp8 grouped experts); `reduce_bytes`: a gradient
    element's bytes in the reductions' buffers (Implementation.grad_reduce_fp32; None: the compute format's);
    `optimizer` "muon": no second moment for the matrices the rank owns (their momentum is adam_m's)."""
    per_param = pol.bytes_per_param()
    e = per_param["compute"]
    zero, dp = layout.effective_zero, layout.data_ranks
    dense = chunks
    if ep > 1:
        dense = [[[t for t in unit if not is_expert_tensor(t)] for unit in chunk] for chunk in chunks]
        experts = [[[t._replace(numel=t.numel // ep) for t in unit] for unit in chunk] for chunk in chunks]
        parts = [zero_states(dense, zero, dp, bucket_numel, prefetch, hold), experts_states(experts, expert_shards)]
        held, owned, grads, buffers, numel = (sum(values) for values in zip(*parts))
        if optimizer == "muon":  # the fewest of each buffer's: a bound where the two fewest are not one rank's
            owned_matrices = muon_owned(dense, zero, dp, bucket_numel) + experts_muon_owned(experts, expert_shards)
    else:
        parts = [zero_states(chunks, zero, dp, bucket_numel, prefetch, hold)]
        held, owned, grads, buffers, numel = parts[0]
        if optimizer == "muon":
            owned_matrices = muon_owned(chunks, zero, dp, bucket_numel)
    second_moments = owned - owned_matrices if optimizer == "muon" else owned
    reduce_e = reduce_bytes or e  # ZeRO 1-2's buckets and the experts' piece are gradients; ZeRO-3's mixed below
    parameters, comm = held * e, buffers * reduce_e
    if fp8_params == "kept":  # and under expert parallelism the rank's own experts, whole (experts_states)
        routed = [[[t for t in unit if is_expert_tensor(t)] for unit in chunk] for chunk in experts] if ep > 1 else []
        kept = fp8_weights_held(dense, zero, dp, fp8_experts) + fp8_weights_held(routed, 0, 1, fp8_experts)
        parameters -= kept * (e - FP8_BYTES)
    if zero == 3 and (fp8_params != "none" or reduce_e != e):  # the dense units' gathers apart from their gradients
        fp8_bytes = FP8_BYTES if fp8_params != "none" else e  # fp8 weights a byte each where gathered in fp8
        comm += (zero3_gather_bytes(dense, dp, prefetch, hold, e, fp8_bytes, fp8_experts, reduce_e)
                 - parts[0][3] * reduce_e)
    return StageMemory(
        parameters=parameters, gradients=grads * per_param["grad"],
        master_weights=owned * per_param["master"], adam_m=owned * per_param["adam_m"],
        adam_v=second_moments * per_param["adam_v"],
        activations=activations, comm_buffers=comm,
        stage=index, layers=sum(len(r) for _, r in placed), numel=numel,
    )


def fp8_params_mode(pol: PrecisionPolicy, implementation: Implementation) -> str:
    """How a job's fp8 Linears' weights are held (Implementation.fp8_param_gather): "none" (in the compute format),
    "gathered" (gathered in fp8, sharded in the compute format: torchtitan's float8 all-gather) or "kept" (kept in
    fp8 and gathered so: Megatron-core's fp8 parameters, whose stack casts its weights once a step)."""
    if not (pol.fp8_linears and implementation.fp8_param_gather):
        return "none"
    return "kept" if implementation.fp8_weight_cache else "gathered"


def fp8_experts_kept(pol: PrecisionPolicy, implementation: Implementation) -> bool:
    """Whether the routed experts' weights are fp8 parameters too (fp8 grouped experts, fp8_params_mode not none)."""
    return fp8_params_mode(pol, implementation) != "none" and implementation.fp8_experts


def predict_memory(
    model: GPTConfig,
    layout: Layout,
    precision: str,
    micro_batch_size: int,
    recompute: str = "none",
    gpu: GPUSpec | None = None,
    bucket_mb: float = 25.0,
    micro_batches_in_flight: int | Sequence[int] = 1,
    attention: str = "flash",
    sp_saved_input: str = "gathered",
    prefetch: int = 1,
    micro_batches: int | None = None,
    implementation: Implementation | None = None,
    ends_in_flight: Sequence[tuple[int, int]] | None = None,
) -> MemoryEstimate:
    """Bytes per GPU by category, for the most loaded pipeline stage (every stage in `per_stage`).

    `micro_batches_in_flight`: forwards whose activations are alive at a stage's peak, one
    number for every stage or one per stage; the schedule decides (1 without a pipeline; 1F1B:
    pp - rank). With virtual chunks it counts chunk forwards, each charged the rank's largest
    chunk: an upper bound. `ends_in_flight` (job/schedule.py's peak_ends_in_flight): per stage, the most
    micro-batches alive in the first chunk and in the last, which hold the embedding's and the head's and loss's
    activations (None: micro_batches_in_flight's, the same without virtual chunks; with them an upper bound, the
    head's logits charged for every chunk in flight). Each is a peak of its own, so their sum bounds the stage's
    peak from above. `attention`,
    `recompute`, `sp_saved_input`: simulator/costs/ops.py's Implementation; `prefetch`: ZeRO-3 units
    gathered ahead (simulator/engine/overlap.py); `micro_batches` per step (None: several), which decide how
    long ZeRO-3 without resharding after the forward keeps its units under pipelining (zero3_hold); `implementation`
    (simulator/costs/op_types.py), when given, in place of attention, recompute and sp_saved_input. A block's
    workspace (fp8 weights cast once a step, fp8_weight_cache) is held once per layer on the rank."""
    layout.check(model)
    pol = precision_policy(precision)
    implementation = implementation or Implementation(attention, recompute, sp_saved_input)
    recompute = implementation.recompute
    if not isinstance(micro_batch_size, int) or micro_batch_size < 1:
        raise ConfigError(f"micro_batch_size must be a positive integer, got {micro_batch_size!r}")
    if isinstance(bucket_mb, bool) or not isinstance(bucket_mb, (int, float)) or not 0 < bucket_mb < math.inf:
        raise ConfigError(f"bucket_mb must be a finite number > 0, got {bucket_mb!r}")
    in_flight = _check_in_flight(micro_batches_in_flight, layout.pp)
    ends_alive = _check_ends(ends_in_flight, in_flight)
    if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0:
        raise ConfigError(f"the ZeRO-3 prefetch depth must be a whole number of units >= 0, got {prefetch!r}")
    _check_model(model, pol)
    bucket_elements = bucket_numel(bucket_mb, pol.bytes_per_param()["compute"])
    shape = (model, layout.tp, layout.sequence_parallel, layout.cp, layout.cp_kind, pol, micro_batch_size,
             implementation, layout.ep)
    blocks, embedding_ends, head_ends = _activations(*shape)
    states = _model_states(model, layout.tp, layout.pp, layout.virtual_chunks, layout.shard_ranks,
                           layout.effective_zero, pol, bucket_elements, prefetch, zero3_hold(layout, micro_batches),
                           layout.ep, layout.expert_state_shards, fp8_params_mode(pol, implementation),
                           fp8_experts_kept(pol, implementation), implementation.reduce_bytes, layout.stage_layers,
                           implementation.optimizer)
    loss = loss_gradient_bytes(model, layout, pol, micro_batch_size, implementation)  # one micro-batch's at a time
    stages = []
    placing = (layout.pp, layout.virtual_chunks, layout.stage_layers)
    for index, (first, last, chunk, extras) in enumerate(_stage_blocks(*shape, *placing)):
        alive_first, alive_last = ends_alive[index]
        ends = (alive_first * embedding_ends if first else 0) + (alive_last * head_ends + loss if last else 0)
        stages.append(replace(states[index], activations=in_flight[index] * chunk + ends + extras))
    peak = max(stages, key=lambda s: s.total)
    block = blocks[model.is_moe]
    return MemoryEstimate(
        **{name: getattr(peak, name) for name in MemoryBytes.__dataclass_fields__},
        stage=peak.stage, per_stage=tuple(stages), capacity=None if gpu is None else gpu.hbm_bytes,
        notes=layout_notes(layout, model, recompute, block.exchanging) + fp8_note(block, layout, model),
    )


@lru_cache(maxsize=8192)
def _stage_blocks(model: GPTConfig, tp: int, sequence_parallel: bool, cp: int, cp_kind: str, pol: PrecisionPolicy,
                  micro_batch_size: int, implementation: Implementation, ep: int, pp: int,
                  virtual_chunks: int, stage_layers: tuple[int, ...] = ()) -> tuple[tuple[bool, bool, int, int], ...]:
    """Per stage: (whether it holds the first chunk, the last, _chunk_bytes, _block_extras), what its blocks keep;
    the arguments before pp are _activations'."""
    blocks = _activations(model, tp, sequence_parallel, cp, cp_kind, pol, micro_batch_size, implementation, ep)[0]
    last_chunk = pp * virtual_chunks - 1
    return tuple((any(c == 0 for c, _ in placed), any(c == last_chunk for c, _ in placed),
                  _chunk_bytes(model, blocks, placed), _block_extras(model, blocks, placed))
                 for placed in Layout(pp=pp, virtual_chunks=virtual_chunks,
                                      stage_layers=stage_layers).rank_chunks(model))


def _chunk_bytes(model: GPTConfig, blocks: dict[bool, ActivationModel], placed) -> int:
    """What one micro-batch in flight keeps on a rank: its largest chunk's blocks (with virtual chunks a micro-batch
    in flight holds one chunk), each of its kind."""
    if len(blocks) == 1:
        (block,) = blocks.values()
        return max(len(r) for _, r in placed) * block.per_layer
    return max(sum(blocks[model.is_moe_layer(i)].per_layer for i in r) for _, r in placed)


def _block_extras(model: GPTConfig, blocks: dict[bool, ActivationModel], placed) -> int:
    """Alive once on the rank: one block's recomputed tensors and exchange buffers (the largest kind it holds), and
    every block's workspace (cached fp8 weights)."""
    layers = [i for _, r in placed for i in r]
    kinds = [blocks[kind] for kind in {model.is_moe_layer(i) for i in layers}] if len(blocks) > 1 else list(blocks.values())
    return max(b.recomputing for b in kinds) + max(b.exchanging for b in kinds) \
        + sum(blocks[model.is_moe_layer(i)].workspace for i in layers)
