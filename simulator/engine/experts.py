"""What expert parallelism's all-to-alls add to a MoE block's forward and backward. Torch-free.

The exchanges are job/exchange/experts.py's, the very calls parallel/expert/ makes (a test counts the trainer's
bytes against the same functions); this module only prices them, per MoE layer and micro-batch on one rank, on the
expert group's links (simulator/engine/links.py's all_to_all: NVLink while tp x cp x ep fits in a server, the NICs
beyond), as the trainer runs them: one after another, each waited for before the computation that needs it (the
counts before the dispatch's splits are known, the dispatch before the experts, the combine before the gate
multiply), so every second of them is exposed. Nothing overlaps them with the shared experts (Megatron-core's
moe_shared_expert_overlap): not modelled, and off there by default too.

Rows: balanced by default (routed_rows: each rank receives as many as it sends). Under a routing imbalance
(Implementation.expert_load, `load`: the busiest expert's rows over the mean) the rank priced is the busiest of its
expert group, as a synchronous all-to-all makes every member wait for it: it receives received_rows
(simulator/costs/ops_moe.py: load times as many, at most ep times) in the dispatch and the combine's gradient, and
sends as many back in the combine and the dispatch's gradient. Each all-to-all of rows is priced as a balanced one
of the rows the busiest rank moves in its heavier direction (every member's buffer that large: its own links'
time, an upper bound where links beyond the server are shared); the counts do not change.

Returns per layer: (forward exposed seconds, backward exposed seconds), and what was priced, for checking.
"""

from __future__ import annotations

import math

from job.exchange.experts import backward_exchanges, forward_exchanges, routed_rows
from job.layout import Layout
from minigpt.config import GPTConfig
from minigpt.errors import ConfigError
from simulator.costs.ops_moe import received_rows
from simulator.engine.context import Priced


def _price(exchanges, links, stage: int) -> Priced:
    out = Priced()
    for exchange in exchanges:
        out.seconds += exchange.calls * links.all_to_all(stage, exchange.bytes)
        out.priced.append(exchange)
    return out


def layer_exchange(model: GPTConfig, layout: Layout, micro_batch: int, element_bytes: int, recompute: str,
                   links, stage: int, load: float = 1.0) -> tuple[Priced, Priced]:
    """(forward, backward) exposed all-to-alls of one MoE layer for one micro-batch on a rank of `stage`, the busiest
    of its expert group under a routing imbalance `load` (the module docstring): job/exchange/experts.py's calls of a
    rank that sends and receives the rows it moves in its heavier direction."""
    tokens = micro_batch * model.seq_len // layout.cp
    heavier = received_rows(routed_rows(model, tokens, micro_batch), layout.ep, load)
    forward = forward_exchanges(model, layout.ep, heavier, element_bytes)
    backward = backward_exchanges(model, layout.ep, heavier, element_bytes, recompute=recompute)
    return _price(forward, links, stage), _price(backward, links, stage)


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
