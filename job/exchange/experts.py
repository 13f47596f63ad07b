"""What expert parallelism exchanges inside each compute action of the schedule. Torch-free.

With ep > 1 the experts of every MoE layer are split over ep ranks (E / ep each, in order), and every Forward
and Backward action of job/schedule.py also moves tokens between them, once per MoE layer of its chunk: the
all-to-alls below, issued by parallel/expert/ when the trainer runs the action and priced by the simulator when
it replays it. A test counts what real training sends and finds it equal to these, call for call and byte for
byte, with the routed rows it measured.

The expert group is ep consecutive ranks of those that route distinct tokens through one set of experts
(`expert_places`: the dp x cp data ranks at each tp place, or under sequence parallelism every rank of the stage,
tp x cp x dp, each routing its slice), as Megatron-core folds its expert groups over the dense ranks with expert
tensor parallelism 1; the ranks at the same place of every expert group hold the same experts and average
their gradients.

Per MoE layer and micro-batch, on one rank, with `sent` the routed token copies this rank sends (every kept
top_k choice of its tokens: tokens x top_k when dropless), `received` those its experts get from the group
(as many when the experts are balanced), d the width and b the compute format's bytes:
- forward: the counts (an all-to-all of E int64: how many rows for each expert), the dispatch (sent x d x b,
  split unevenly by destination) and the combine (its experts' outputs going home: received x d x b);
- backward: the combine's gradient (sent x d x b, with the dispatch's splits) and the dispatch's gradient
  (received x d x b, with the combine's);
- full recomputation runs the forward's three again in the backward.
Bytes per call are what this rank hands to all_to_all_single: its whole input, its own part included (that
part never leaves the GPU; the simulator prices the (ep - 1) / ep that does).
"""

from __future__ import annotations

import math

from job.exchange.context import Exchange
from job.layout import buckets, expert_tensors, is_fp8_weight
from minigpt.config import GPTConfig
from precision.policy import weight_bytes

COUNT_BYTES = 8  # int64 token counts

Place = tuple[int, int, int]  # (dp, cp, tp) of one pipeline stage


def expert_places(dp: int, cp: int, tp: int, sequence_parallel: bool, ep: int) -> tuple[list[list[Place]], list[list[Place]]]:
    """(the expert groups, the replica groups: the ranks holding the same experts) of one pipeline stage, as (dp, cp,
    tp) places in rank order (tp fastest, then cp, then dp: parallel/mesh.py's). The ranks that route distinct tokens
    through one set of experts are the stage's dp x cp data ranks at each tp place (their tp peers route the same
    tokens), or under sequence parallelism all of them; each such system is cut into groups of ep consecutive ranks,
    the j-th member of every group holding experts j x E / ep onwards."""
    places = [(d, c, t) for d in range(dp) for c in range(cp) for t in range(tp)]
    systems = [places] if sequence_parallel else [[p for p in places if p[2] == t] for t in range(tp)]
    groups = [system[i:i + ep] for system in systems for i in range(0, len(system), ep)]
    replicas = [system[j::ep] for system in systems for j in range(ep)] if len(systems[0]) > ep else []
    return groups, replicas


def routed_rows(model: GPTConfig, tokens: int, sequences: int, cp: int = 1) -> int:
    """Token copies `tokens` (of `sequences` sequences, 1/cp of each under context parallelism) route when the
    experts are balanced: tokens x top_k, or with a capacity factor at most the capacity of every expert in every
    sequence (a cp rank's share of it: 1/cp)."""
    rows = tokens * model.top_k
    if model.capacity_factor is None:
        return rows
    per_expert = math.ceil(model.capacity_factor * model.seq_len * model.top_k / model.n_experts)
    return min(rows, math.ceil(sequences * model.n_experts * per_expert / cp))


def token_share(model: GPTConfig, ep: int, members: int) -> float:
    """The share of a rank's tokens that need at least one of the experts `members` consecutive ranks of an expert
    group hold (E / ep each), when each token picks top_k distinct experts, every set of them alike (balanced
    routing): 1 - C(E - members E / ep, top_k) / C(E, top_k). Under group-limited routing (expert_groups,
    groups_per_token: DeepSeek-V3's node-limited routing) every set of groups alike, then every set of top_k experts
    among theirs: the chance that a token needs none of them summed over how many of the groups they fill (whole or in
    part) are among its groups. What a dispatcher that sends each token once per destination rank (members 1) or
    server (members on it) moves, against top_k / ep of a copy per routed row to each rank."""
    held, size = members * model.n_experts // ep, model.n_experts // model.expert_groups
    groups, chosen = model.expert_groups, model.groups_per_token or model.expert_groups
    whole, rest = divmod(held, size)  # the groups the held experts fill, and the experts of one more they part fill
    parts, reachable, k = int(rest > 0), chosen * size, model.top_k
    missed = 0.0
    for full in range(min(whole, chosen) + 1):
        for part in range(min(parts, chosen - full) + 1):
            ways = math.comb(whole, full) * math.comb(parts, part) * math.comb(groups - whole - parts,
                                                                                chosen - full - part)
            missed += ways * math.comb(reachable - full * size - part * rest, k) / math.comb(reachable, k)
    return 1.0 - missed / math.comb(groups, chosen)


def forward_exchanges(model: GPTConfig, ep: int, sent: int, element_bytes: int,
                      received: int | None = None) -> list[Exchange]:
    """One MoE layer's forward exchange on one rank that sends `sent` routed rows and receives `received` (None:
    as many) for its experts (empty without ep), in the order they are issued."""
    if ep == 1 or not model.is_moe:
        return []
    row = model.d_model * element_bytes
    received = sent if received is None else received
    return [Exchange("all_to_all", 1, model.n_experts * COUNT_BYTES), Exchange("all_to_all", 1, sent * row),
            Exchange("all_to_all", 1, received * row)]


def backward_exchanges(model: GPTConfig, ep: int, sent: int, element_bytes: int, received: int | None = None,
                       recompute: str = "none") -> list[Exchange]:
    """One MoE layer's backward exchange on one rank, a fully recomputed forward's first."""
    if ep == 1 or not model.is_moe:
        return []
    again = forward_exchanges(model, ep, sent, element_bytes, received) if recompute == "full" else []
    row = model.d_model * element_bytes
    received = sent if received is None else received
    return again + [Exchange("all_to_all", 1, sent * row), Exchange("all_to_all", 1, received * row)]


SCORE_BYTES = 4  # the balance loss's fp32 choice counts


def routing_exchanges(model: GPTConfig, ranks: int, tokens: int, sequences: int) -> list[Exchange]:
    """One MoE layer's forward exchange over a group of `ranks` that each hold part of every sequence (the cp group,
    parallel/context/moe.py; the tp group under sequence parallelism, parallel/tensor/moe.py), in the order it is
    issued: with a capacity factor the `tokens` x top_k int64 expert ids of this rank all-gathered (bytes: its part),
    so every rank ranks the whole sequences' choices; with a balance loss the `sequences` x E fp32 choice counts
    all-reduced (bytes: the whole buffer). None for one rank. A fully recomputed forward issues them again."""
    if ranks == 1 or not model.is_moe:
        return []
    exchanges = []
    if model.capacity_factor is not None:
        exchanges.append(Exchange("all_gather", 1, tokens * model.top_k * COUNT_BYTES))
    if model.aux_loss_coef:
        exchanges.append(Exchange("all_reduce", 1, sequences * model.n_experts * SCORE_BYTES))
    return exchanges


def expert_gradient_reduction(model: GPTConfig, ep: int, dp: int, moe_layers: int, grad_bytes: int,
                              shards: int = 1, fp8_weights: bool = False) -> list[Exchange]:
    """How the routed experts' gradients of a rank holding `moe_layers` MoE blocks are averaged under expert
    parallelism over the `dp` / ep ranks holding the same experts, all of them at once, issued at the optimizer
    step (none without ep, or with one such rank). `dp`: the ranks that route other tokens through the experts,
    the data ranks (dp x cp) and, under sequence parallelism, times tp (Layout.token_ranks).
    `shards` (Layout.expert_state_shards): 1, one all-reduce, every rank updating all its experts; otherwise those
    ranks shard the experts' optimizer states (ZeRO 1-3, Megatron-core's distributed optimizer): the buffer padded
    to a multiple of them is reduce-scattered, and after the update all-gathered (parallel/expert/gradients.py).
    `fp8_weights`: the experts' weights are kept in fp8 (fp8 parameters with fp8 grouped experts, a stack we do not
    run): the all-gather moves them at a byte each."""
    if ep == 1 or not model.is_moe or dp == ep or moe_layers == 0:
        return []
    tensors = expert_tensors(model, ep) * moe_layers
    numel = buckets(tensors, None, shards)[0].size  # padded as FlatParameters pads
    if shards == 1:
        return [Exchange("all_reduce", 1, numel * grad_bytes)]
    fp8 = sum(t.numel for t in tensors if is_fp8_weight(t, experts=True)) if fp8_weights else 0
    return [Exchange("reduce_scatter", 1, numel * grad_bytes),
            Exchange("all_gather", 1, weight_bytes(numel, fp8, grad_bytes))]
