"""What predict_memory says in words beside its figures (simulator/memory.py's MemoryEstimate.notes). Torch-free."""

from __future__ import annotations

from job.layout import Layout
from minigpt.config import OP_RECOMPUTE, GPTConfig
from simulator.states import zero3_hold


def layout_notes(layout: Layout, model: GPTConfig, recompute: str, exchanging: int = 0) -> tuple[str, ...]:
    """What the layout and the recompute put where: one line each (`exchanging`: the key/value exchange's bytes)."""
    notes = []
    if model.tied_head and layout.pp > 1:
        notes.append(
            "tied head on several pipeline stages: the last stage holds its own copy of the embedding matrix (Megatron-style)"
        )
    elif model.mtp_depth and layout.pp > 1:
        notes.append("multi-token prediction on several pipeline stages: the last stage holds its own copy of the "
                     "embedding matrix for the modules' lookups (Megatron-style)")
    if layout.data_ranks == 1 and layout.zero > 0:
        notes.append("one data-parallel rank: ZeRO runs as stage 0")
    if layout.shard_replicas > 1:
        notes.append(f"hybrid sharding: ZeRO shards over groups of {layout.shard_ranks} ranks, "
                     f"{layout.shard_replicas} copies of each shard")
    if layout.effective_zero == 3 and not layout.reshard_after_forward:
        held = " (all step, with their gradients summed over the micro-batches" + (
            ", under pipelining)" if layout.pp > 1 else ", --sync-grads-once)")
        notes.append("ZeRO-3 without resharding after the forward: comm buffers hold the units kept gathered "
                     "until their backward" + (held if zero3_hold(layout) == "step" else ""))
    if layout.cp > 1:
        notes.append(f"context parallelism {layout.cp} ({layout.cp_kind}): each rank holds the activations of "
                     f"{model.seq_len // layout.cp:,} of the sequence's {model.seq_len:,} tokens, and "
                     f"{exchanging / 2**30:.2f} GiB more for the key/value exchange during one block's backward")
    if layout.ep > 1:
        notes.append(f"expert parallelism {layout.ep}: a rank holds {model.n_experts // layout.ep} of every MoE layer's "
                     f"{model.n_experts} experts, their optimizer states "
                     + (f"sharded over the {layout.expert_state_shards} ranks holding the same experts"
                        if layout.expert_state_shards > 1 else "whole")
                     + " (parallel/expert/gradients.py); activations include the dispatch buffers of one layer")
    if recompute == "full":
        notes.append("recompute: activations include one block's full activations while it is recomputed")
    elif recompute == "selective":
        notes.append("selective recompute: activations include one block's attention core while it is recomputed")
    elif recompute == OP_RECOMPUTE:
        notes.append("op recompute (torchtitan's policy): activations include what one block's recompute makes "
                     "again while its backward runs")
    return tuple(notes)


def fp8_note(block, layout: Layout, model: GPTConfig) -> tuple[str, ...]:
    """Where fp8 Linears' weight copies sit in the activations (simulator/costs/ops.py's fp8 Linears); `block`: a
    block's simulator/memory.py ActivationModel."""
    layers = max(sum(len(blocks) for _, blocks in placed) for placed in layout.rank_chunks(model))  # the most a rank holds
    if block.workspace and block.implementation.fp8_param_gather:
        return (f"fp8 weights kept in fp8 (parameters at a byte each): activations include "
                f"{block.workspace / 2**20:,.0f} MiB of transposed e4m3 copies per layer, made once a step "
                f"({layers} layers on a rank)",)
    if block.workspace:
        return (f"fp8 weights cast once a step: activations include {block.workspace / 2**20:,.0f} MiB of e4m3 weight "
                f"copies per layer, held once ({layers} layers on a rank)",)
    if block.fp8_weights:
        return (f"fp8 weights cast in every forward: each micro-batch in flight keeps its own e4m3 copy of its "
                f"layers' weights ({block.fp8_weights / 2**20:,.0f} MiB per layer), as precision/fp8.py does; "
                f"Transformer Engine under Megatron-core casts once a step (Implementation.fp8_weight_cache)",)
    return ()
