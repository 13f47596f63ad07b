"""What expert parallelism's all-to-alls add to a MoE block's forward and backward. Torch-free.

The exchanges are job/exchange/experts.py's, the very calls parallel/expert/ makes (a test counts the trainer's
bytes against the same functions); this module only prices them, per MoE layer and micro-batch on one rank, on the
expert group's links (simulator/engine/links.py's all_to_all: NVLink while the group's ranks share a server, the NICs
beyond), as the trainer runs them: one after another, each waited for before the computation that needs it (the
counts before the dispatch's splits are known, the dispatch before the experts, the combine before the gate
multiply), so every second of them is exposed. With Overlap.ep (Megatron-core's moe_shared_expert_overlap:
simulator/engine/overlap.py) a model's shared experts run beside them instead: the dispatch's all-to-all behind
their fc1 and activation, the combine's behind fc2; in the backward the combine's gradient behind fc2's input
gradient, the dispatch's behind fc1's and the activation's (a recomputed forward's as in the forward); each call
exposed by overlap.py's `exposed` (max(c - g, f x overlap): the shared experts slowed by the SMs NCCL holds, f the
overlap's dp_slowdown), hidden for the time it ran beside them; the counts' all-to-all stays exposed.

Rows: balanced by default (routed_rows: each rank receives as many as it sends). Under a routing imbalance
(Implementation.expert_load, `load`: the busiest expert's rows over the mean) the rank priced is the busiest of its
expert group, as a synchronous all-to-all makes every member wait for it: it receives received_rows
(simulator/costs/layers/moe.py: load times as many, at most ep times) in the dispatch and the combine's gradient, and
sends as many back in the combine and the dispatch's gradient. Each all-to-all of rows is priced as a balanced one
of the rows the busiest rank moves in its heavier direction (every member's buffer that large: its own links'
time, an upper bound where links beyond the server are shared); the counts do not change.

Dispatcher (Implementation.dispatcher): "alltoall" prices the rows as above, a copy of every routed row to its
expert's rank (links.all_to_all). "deepep" prices them as a hierarchical dispatcher that sends each token once per
destination (DeepEP's normal kernels, deepseek-ai/DeepEP README; Megatron-core's flex dispatcher): a row
exchange of b bytes (b / top_k for one row of each token) sends each other server of the group the tokens that
need one of its experts once over the NICs, and each member forwards over NVLink to each other member of its server
those that need it (job/exchange/experts.py's token_share, balanced routing; links.all_to_all_deduplicated). The
counts' all-to-all is priced as before (DeepEP's notify). Assumptions: every set of top_k experts alike (under
group-limited routing, DeepSeek-V3's top 4 of 8 groups, every set of groups alike, then every set of top_k of their
experts: token_share), NVLink forwarding fully overlapped with the NICs, and no kernel cost of DeepEP's own beyond
its bytes on the links.

Returns per layer: the forward's and the backward's Priced (exposed seconds, what was priced, hidden seconds).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from job.exchange.experts import backward_exchanges, forward_exchanges, routed_rows, routing_exchanges, token_share
from job.layout import Layout
from minigpt.config import GPTConfig
from minigpt.errors import ConfigError
from simulator.costs.implementation import Implementation
from simulator.costs.layers.moe import received_rows
from simulator.engine.context import Priced
from simulator.engine.overlap import exposed, overlapped

NOTHING = (0.0, 0.0)


@dataclass(frozen=True)
class SharedExperts:
    """One MoE layer's shared experts, seconds at full rate, each (fc1 and its activation, fc2) as
    simulator/costs/compute.py's shared_halves gives them: what hides the all-to-alls under Overlap.ep, and the share
    of the compute rate they lose meanwhile (`slowdown`)."""

    forward: tuple[float, float] = NOTHING
    backward: tuple[float, float] = NOTHING  # input gradients; the recomputed forward's apart
    recompute: tuple[float, float] = NOTHING
    slowdown: float = 0.0


def _price(exchanges, behind: list[float], links, stage: int, slowdown: float, rows=None,
           counts: tuple[int, ...] = ()) -> Priced:
    """Each exchange waited for, or hidden behind `behind`'s compute; `rows(bytes)`: the seconds of a row exchange
    under a deduplicating dispatcher (None: all-to-alls); those at `counts` (a forward's first: the counts) are
    all-to-alls whatever the dispatcher."""
    out = Priced()
    for index, (exchange, compute) in enumerate(zip(exchanges, behind, strict=True)):
        seconds = exchange.calls * (links.all_to_all(stage, exchange.bytes) if rows is None or index in counts
                                    else rows(exchange.bytes))
        out.seconds += exposed(seconds, compute, slowdown)
        out.hidden += overlapped(seconds, compute, slowdown)
        out.priced.append(exchange)
    return out


def _forward_behind(halves: tuple[float, float]) -> list[float]:
    """What hides a forward's (counts, dispatch, combine): nothing, fc1 and the activation, fc2."""
    return [0.0, halves[0], halves[1]]


def _deduplicated(model: GPTConfig, layout: Layout, links, stage: int):
    """seconds(bytes) of a row exchange under the "deepep" dispatcher (the module docstring)."""
    _, per_server = links.ep_servers(stage)
    rank, server = token_share(model, layout.ep, 1), token_share(model, layout.ep, per_server)
    return lambda nbytes: links.all_to_all_deduplicated(stage, nbytes / model.top_k, rank, server)


def layer_exchange(model: GPTConfig, layout: Layout, micro_batch: int, element_bytes: int, recompute: str,
                   links, stage: int, load: float = 1.0, shared: SharedExperts | None = None,
                   dispatcher: str = "alltoall") -> tuple[Priced, Priced]:
    """(forward, backward) all-to-alls of one MoE layer for one micro-batch on a rank of `stage`, the busiest of its
    expert group under a routing imbalance `load` (the module docstring): job/exchange/experts.py's calls of a rank
    that sends and receives the rows it moves in its heavier direction; behind `shared` when given (Overlap.ep);
    the rows moved as `dispatcher` moves them (Implementation.dispatcher)."""
    shared = shared or SharedExperts()
    split = layout.sequence_ranks  # under sequence parallelism each tp rank routes its slice
    heavier = received_rows(routed_rows(model, micro_batch * model.seq_len // split, micro_batch, split), layout.ep,
                            load)
    forward = forward_exchanges(model, layout.ep, heavier, element_bytes)
    backward = backward_exchanges(model, layout.ep, heavier, element_bytes, recompute=recompute)
    if not forward:
        return Priced(), Priced()
    rows = _deduplicated(model, layout, links, stage) if dispatcher == "deepep" else None
    again = _forward_behind(shared.recompute) if recompute == "full" else []
    # the backward runs the combine's gradient first (behind fc2's), then the dispatch's (behind fc1's)
    behind = again + [shared.backward[1], shared.backward[0]]
    return (_price(forward, _forward_behind(shared.forward), links, stage, shared.slowdown, rows, (0,)),
            _price(backward, behind, links, stage, shared.slowdown, rows, (0,) if again else ()))


def routing_seconds(model: GPTConfig, layout: Layout, micro_batch: int, recompute: str, links,
                    stage: int) -> tuple[float, float]:
    """(forward, backward) seconds of one MoE layer's routing exchange over the cp group for one micro-batch
    (job/exchange/experts.py's routing_exchanges: the expert ids all-gathered, the balance loss's counts
    all-reduced), each waited for (the capacity and the loss need them); a fully recomputed forward's again in the
    backward. Charged to the context-parallel row: it is the cp group's."""
    tokens = micro_batch * model.seq_len // layout.cp
    whole = {"all_gather": layout.cp, "all_reduce": 1}  # links.cp_collective takes the whole buffer
    forward = sum(e.calls * links.cp_collective(stage, e.kind, e.bytes * whole[e.kind])
                  for e in routing_exchanges(model, layout.cp, tokens, micro_batch))
    return forward, forward if recompute == "full" else 0.0


def check_dispatcher(model: GPTConfig, ep: int | None, dispatcher: str) -> str:
    """`dispatcher` if it names one (Implementation.dispatcher) and has rows to move: a mixture of experts with an
    expert group (`ep` None: searched, as plan does), else one line."""
    Implementation(dispatcher=dispatcher)
    if dispatcher != "alltoall" and (not model.is_moe or ep == 1):
        why = "this model is dense" if not model.is_moe else "--ep 1 has none"
        raise ConfigError(f"--ep-dispatcher {dispatcher} moves a mixture of experts' rows between the ranks of an "
                          f"expert group, and {why}: give --ep N, or drop --ep-dispatcher")
    return dispatcher


def check_expert_load(model: GPTConfig, load: float) -> float:
    """The routing imbalance priced for `model` when `load` is asked for: a finite number >= 1 (1.0 balanced), 1 for a
    dense model, at most E / top_k (the busiest expert takes each token once at the most); with a capacity factor
    an expert keeps about capacity_factor x the balanced rows at the most (job/exchange/experts.py's routed_rows),
    so the load priced is capped there (at 1 below a factor of 1, where every expert is full already)."""
    if isinstance(load, bool) or not isinstance(load, (int, float)) or not 1 <= load < math.inf:
        raise ConfigError(f"--expert-load must be a finite number >= 1 (the busiest expert's routed rows over the "
                          f"mean; 1: balanced), got {load!r}")
    if not model.is_moe:
        if load != 1:
            raise ConfigError(f"--expert-load {load:g} is a mixture of experts' routing imbalance, but this model is "
                              f"dense: drop --expert-load or give the model experts")
        return 1.0
    ceiling = model.n_experts / model.top_k
    if load > ceiling * (1 + 1e-9):
        raise ConfigError(f"--expert-load {load:g} is more than the {model.n_experts} experts over top_k "
                          f"{model.top_k} = {ceiling:g}: the busiest expert takes every token once at the most")
    if model.capacity_factor is not None:
        load = min(load, max(1.0, model.capacity_factor))
    return float(load)
