"""What expert parallelism's all-to-alls add to a MoE block's forward and backward. Torch-free.

The exchanges are job/exchange/experts.py's, the very calls parallel/expert/ makes (a test counts the trainer's
bytes against the same functions); this module only prices them, per MoE layer and micro-batch on one rank, on the
expert group's links (simulator/engine/links.py's all_to_all: NVLink while tp x cp x ep fits in a server, the NICs
beyond), as the trainer runs them: one after another, each waited for before the computation that needs it (the
counts before the dispatch's splits are known, the dispatch before the experts, the combine before the gate
multiply), so every second of them is exposed. Rows are the balanced ones (routed_rows: each rank receives as
many as it sends). Nothing overlaps them with the shared experts (Megatron-core's moe_shared_expert_overlap): not
modelled, and off there by default too.

Returns per layer: (forward exposed seconds, backward exposed seconds), and what was priced, for checking.
"""

from __future__ import annotations

from job.exchange.experts import backward_exchanges, forward_exchanges, routed_rows
from job.layout import Layout
from minigpt.config import GPTConfig
from simulator.engine.context import Priced


def _price(exchanges, links, stage: int) -> Priced:
    out = Priced()
    for exchange in exchanges:
        out.seconds += exchange.calls * links.all_to_all(stage, exchange.bytes)
        out.priced.append(exchange)
    return out


def layer_exchange(model: GPTConfig, layout: Layout, micro_batch: int, element_bytes: int, recompute: str,
                   links, stage: int) -> tuple[Priced, Priced]:
    """(forward, backward) exposed all-to-alls of one MoE layer for one micro-batch on a rank of `stage`."""
    tokens = micro_batch * model.seq_len // layout.cp
    sent = routed_rows(model, tokens, micro_batch)
    forward = forward_exchanges(model, layout.ep, sent, element_bytes)
    backward = backward_exchanges(model, layout.ep, sent, element_bytes, recompute=recompute)
    return _price(forward, links, stage), _price(backward, links, stage)
