"""The tensor-parallel collectives of a pipeline chunk, forward and backward, for one micro-batch, as
parallel/tensor/ issues them (simulator/costs/compute.py's chunk_times carries them to the engine, which times them
on the links). Byte counts follow parallel/comm.py's convention (the full buffer S). Torch-free."""

from __future__ import annotations

from dataclasses import dataclass, replace

from job.exchange.experts import routing_exchanges
from job.layout import Layout, block_tensors, head_tensors, is_expert_tensor, mtp_tensors
from minigpt.config import GPTConfig
from precision.policy import FORMAT_BYTES, PrecisionPolicy

LOSS_ALL_REDUCES = 3  # the vocabulary-parallel loss all-reduces max, sum of exponentials, target logit
LOSS_VALUE_BYTES = FORMAT_BYTES["fp32"]  # one fp32 number per token each


@dataclass(frozen=True)
class TPCollective:
    """`calls` tensor-parallel collectives of `bytes` each (the full buffer S, as parallel/comm.py counts)."""

    kind: str  # all_reduce, all_gather, reduce_scatter
    bytes: int
    calls: int


def tp_collectives(model: GPTConfig, layers: int, micro_batch_size: int, layout: Layout, policy: PrecisionPolicy,
                   first: bool, last: bool, sharded: bool = False,
                   moe_layers: int = 0) -> tuple[list[TPCollective], list[TPCollective]]:
    """Forward and backward collectives of one chunk for one micro-batch, as parallel/tensor/layers.py issues them.

    Under context parallelism each rank's are those of its s/cp tokens.
    Per block: without sequence parallelism 2 all-reduces of b*s*h forward (after proj, fc2)
    and 2 backward (before qkv, fc1), one each way in a MoE block (`moe_layers` of the `layers`: its experts
    are whole on every rank, parallel/tensor/parallelize.py); with it 2 all-gathers + 2 reduce-scatters each way
    (the attention's only in a MoE block, which routes the rank's slice of the tokens: parallel/tensor/moe.py),
    plus a backward all-reduce of every replicated parameter's gradient (parallel/tensor/parallelize.py: the norms'
    gains, a LayerNorm's biases, proj/fc2 biases when the shape has them, a MoE's router, shared experts and, without
    expert parallelism, its routed experts; the final norm's on the last chunk) and a MoE block's routing exchange
    over the group (job/exchange/experts.py's routing_exchanges).
    `sharded` (ops.py's sp_saved_input "sharded", Megatron's way): the backward all-gathers the
    saved input shard of every column-parallel Linear (qkv, fc1, the head) once more.
    """
    if layout.tp == 1:
        return [], []
    tokens = micro_batch_size * model.seq_len // layout.cp  # this rank's tokens
    width = tokens * model.d_model * FORMAT_BYTES[policy.compute]
    sp = layout.sequence_parallel
    heads = 1 + model.mtp_depth  # the head runs once over every depth's hidden states (the executor's Chunk)
    forward, backward = [], []
    if first:  # the vocabulary-parallel embedding sums its pieces; SequenceSplit gathers back in the backward
        forward.append(TPCollective("all_reduce", width, 1))
        if sp:
            backward.append(TPCollective("all_gather", width, 1))
    # what the column-parallel Linears take in (qkv's and fc1's input, a MoE block's attention's only; MLA's normed
    # latent, and the block's input where its queries come straight from the width) and the row-parallel give out
    columns = _column_inputs(model, layers, moe_layers, tokens * FORMAT_BYTES[policy.compute])
    rows = [TPCollective("", width, 2 * layers - moe_layers)]
    sums = whole_norm_sums(model, layers, micro_batch_size, layout)  # OLMo 2's q/k norms: a sum each way
    forward, backward = forward + sums, backward + sums
    if sp:
        forward += _routing_collectives(model, moe_layers, layout, tokens, micro_batch_size)
        forward += _as("all_gather", columns) + _as("reduce_scatter", rows)
        backward += _as("all_gather", rows) + _as("reduce_scatter", columns)
        backward += _replicated_gradients(model, layers, moe_layers, layout, FORMAT_BYTES[policy.grad])
        if sharded:  # and the head's, every depth's at once
            backward += _as("all_gather", columns) + ([TPCollective("all_gather", width * heads, 1)] if last else [])
    else:  # and the per-head q/k norms' gains, shared by the heads a rank holds some of (always summed)
        forward += _as("all_reduce", rows)
        backward += _as("all_reduce", columns) + _head_norm_gradients(model, layers, FORMAT_BYTES[policy.grad])
    if last:  # the head is column-parallel; the loss all-reduces three fp32 numbers per token
        if sp:
            forward.append(TPCollective("all_gather", width * heads, 1))
        backward.append(TPCollective("reduce_scatter" if sp else "all_reduce", width * heads, 1))
        forward.append(TPCollective("all_reduce", tokens * LOSS_VALUE_BYTES, LOSS_ALL_REDUCES * heads))
        if sp:  # the final norm's gain (and a LayerNorm's bias): the head's replicated tensors; each module's own
            replicated = [t for t in head_tensors(model, layout.tp, layout.pp) if t.replicated]
            backward += [TPCollective("all_reduce", t.numel * FORMAT_BYTES[policy.grad], heads) for t in replicated]
        if model.mtp_depth:
            forward_mtp, backward_mtp = _mtp_collectives(model, micro_batch_size, layout, policy, sharded)
            forward, backward = forward + forward_mtp, backward + backward_mtp
    return forward, backward


def _mtp_collectives(model: GPTConfig, micro_batch_size: int, layout: Layout, policy: PrecisionPolicy,
                     sharded: bool) -> tuple[list[TPCollective], list[TPCollective]]:
    """The multi-token prediction modules' (mtp_units), the head and loss apart (tp_collectives counts them with
    the model's): one lookup for every depth's tokens (one all-reduce of them all) and each module's block; under
    sequence parallelism each module's embedded tokens cut to the rank's slice (gathered back in the backward) and
    its input norms and projection, which see that slice, their gradients summed over the group."""
    depth = model.mtp_depth
    forward, backward = tp_collectives(model.with_(mtp_depth=0), 1, micro_batch_size, layout, policy, True, False,
                                       sharded, int(model.mtp_is_moe))
    lookup, *forward = forward  # the vocabulary-parallel embedding's sum comes first
    if layout.sequence_parallel:
        inputs = [t for t in mtp_tensors(model.with_(mtp_depth=1), layout.tp) if t.name.split(".")[0] in MTP_INPUTS]
        backward += [TPCollective("all_reduce", t.numel * FORMAT_BYTES[policy.grad], 1) for t in inputs]
    return ([replace(lookup, bytes=lookup.bytes * depth)] + [replace(c, calls=c.calls * depth) for c in forward],
            [replace(c, calls=c.calls * depth) for c in backward])


MTP_INPUTS = ("enorm", "hnorm", "eh_proj")  # a module's parameters before its block


def _column_inputs(model: GPTConfig, layers: int, moe_layers: int, token_bytes: int) -> list[TPCollective]:
    """The column-parallel Linears' inputs of a chunk's blocks, by width (kind left blank), the model's width last:
    qkv's and the dense MLPs' fc1's; under MLA its normed latent in place of qkv's, and the block's input still
    where the queries have no latent (their up projection column-parallel over it)."""
    width = [TPCollective("", token_bytes * model.d_model, layers - moe_layers)]
    if not model.is_mla:
        return [replace(width[0], calls=width[0].calls + layers)]
    latent = TPCollective("", token_bytes * model.latent_width, layers)
    return [latent, replace(width[0], calls=width[0].calls + (0 if model.q_lora_rank else layers))]


def _as(kind: str, collectives: list[TPCollective]) -> list[TPCollective]:
    """The collectives as `kind`, those of no call left out."""
    return [replace(c, kind=kind) for c in collectives if c.calls]


def _routing_collectives(model: GPTConfig, moe_layers: int, layout: Layout, tokens: int,
                         sequences: int) -> list[TPCollective]:
    """The MoE blocks' routing exchanges over the tp group under sequence parallelism (an all-gather counted at its
    gathered size)."""
    routing = routing_exchanges(model, layout.tp, tokens // layout.tp, sequences) if moe_layers else []
    gathered = {"all_gather": layout.tp, "all_reduce": 1}
    return [TPCollective(e.kind, e.bytes * gathered[e.kind], e.calls * moe_layers) for e in routing]


def whole_norm_sums(model: GPTConfig, layers: int, micro_batch_size: int, layout: Layout) -> list[TPCollective]:
    """Per block, q's and k's sums of squares over the tensor-parallel group of OLMo 2's norms over all heads
    (minigpt/model.py's WholeQKNormFunction: one fp32 all-reduce of two values per token; once more in the backward,
    and again where a recompute runs the attention core again)."""
    if layout.tp == 1 or not model.qk_norm_whole:
        return []
    return [TPCollective("all_reduce", micro_batch_size * model.seq_len // layout.cp * 2 * 4, layers)]


def _head_norm_gradients(model: GPTConfig, layers: int, grad_bytes: int) -> list[TPCollective]:
    """Without sequence parallelism (under it _replicated_gradients has them), the all-reduces of the per-head q/k
    norms' gains' gradients (parallel/tensor/parallelize.py: one head's gains, shared by every head)."""
    if not model.qk_norm or model.qk_norm_whole or model.is_mla:
        return []
    return [TPCollective("all_reduce", model.head_dim * grad_bytes, 2 * layers)]


def _replicated_gradients(model: GPTConfig, layers: int, moe_layers: int, layout: Layout,
                          grad_bytes: int) -> list[TPCollective]:
    """Under sequence parallelism, the all-reduces of the replicated parameters' gradients of a chunk's blocks, each
    kind of block its own (a MoE's routed experts under expert parallelism go to their replicas instead)."""
    out = []
    for moe, count in ((False, layers - moe_layers), (True, moe_layers)):
        tensors = [t for t in block_tensors(model, layout.tp, moe) if t.replicated
                   and not (layout.ep > 1 and is_expert_tensor(t))] if count else []
        out += [TPCollective("all_reduce", t.numel * grad_bytes, count) for t in tensors]
    return out


def total_bytes(collectives: list[TPCollective]) -> int:
    return sum(c.bytes * c.calls for c in collectives)
