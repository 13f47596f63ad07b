"""What context parallelism's key/value exchange adds to a block's forward and backward. Torch-free.

The exchanges are job/exchange/context.py's, the very calls parallel/context/ring.py and allgather.py make (a test
counts the trainer's bytes against the same functions); this module only prices them, per attention layer
and micro-batch on one rank, on the cp group's links (simulator/engine/links.py's cp_pass and cp_collective),
as the trainer runs them:

  ring forward    cp steps, each computing one block of the rank's chunks against one rank's keys and
                  values (the attention kernel's time / cp: every step holds the same work); each of the
                  cp - 1 passes starts with its step and is waited for at the step's end, so a step lasts
                  max(block, pass): exposed = (cp - 1) x max(0, pass - block);
  ring backward   the keys and values sent ahead, and each block's dk/dv sent on once it is done, both behind
                  the next block: step 0 hides the first key/value pass, steps 1 .. cp-2 a key/value pass and
                  a gradient pass sharing the link (one pass of both sizes), step cp-1 the last but one
                  gradient pass; the last hop home is waited for, exposed whole;
  recompute       selective or full recomputation runs the core again in the backward, its forward ring
                  with it, behind the recomputed attention (job/exchange/context.py lists it first);
  all-gather      the all-gathers (forward) and reduce-scatters (backward) of the cp group, each a ring
                  collective of the whole sequence's keys or values, not overlapped (autograd waits).

Returns per layer: (forward exposed seconds, backward exposed seconds), and what was priced, for checking.
torch's context_parallel (torchtitan's, Implementation.cp_attention "torch") exchanges its own way:
torch_layer_exchange; Transformer Engine's ring (Megatron-core's, "te") its own: te_layer_exchange.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from job.exchange.context import Exchange, backward_exchanges, forward_exchanges, kv_elements
from job.layout import Layout
from minigpt.config import GPTConfig
from simulator.costs.op_types import cp_merge
from simulator.costs.te_context import exchanges as te_exchanges
from simulator.costs.torchtitan.context import exchanges as torch_exchanges


@dataclass
class Priced:
    """Exposed seconds of a list of exchanges, and the exchanges priced (kind, calls, bytes per call); `hidden`: the
    seconds they ran beside the compute that hid them (simulator/engine/experts.py's; not part of `seconds`)."""

    seconds: float = 0.0
    priced: list[Exchange] = field(default_factory=list)
    hidden: float = 0.0


def _price(exchanges: list[Exchange], hidden_by: list[float], links, stage: int, cp: int) -> Priced:
    """Each exchange with the compute its ring passes hide behind (0: a blocking pass); collectives never hide."""
    out = Priced()
    for exchange, compute in zip(exchanges, hidden_by, strict=True):
        if exchange.kind == "p2p":
            step = compute / cp  # the block computed while one pass moves
            out.seconds += exchange.calls * max(0.0, links.cp_pass(stage, exchange.bytes) - step)
        else:  # all_gather: each rank gives `bytes`; reduce_scatter: each keeps `bytes`: a buffer of cp x bytes
            out.seconds += exchange.calls * links.cp_collective(stage, exchange.kind, exchange.bytes * cp)
        out.priced.append(exchange)
    return out


def _ring_backward(keys: Exchange, grads: Exchange, block_s: float, links, stage: int, cp: int) -> Priced:
    """The ring backward's passes as parallel/context/ring.py runs them (the module docstring); `block_s`: one
    step's block of the attention backward. The gradient passes beyond the cp - 2 that share a message with the keys
    hide behind a block, but the last (ours: cp passes, one alone behind the last block; Transformer Engine's: cp - 1,
    none alone)."""
    kv, dkv = links.cp_pass(stage, keys.bytes), links.cp_pass(stage, grads.bytes)
    both = links.cp_pass(stage, keys.bytes + grads.bytes)
    hidden = lambda seconds: max(0.0, seconds - block_s)  # noqa: E731
    seconds = hidden(kv) + (cp - 2) * hidden(both) + (grads.calls - cp + 1) * hidden(dkv) + dkv
    return Priced(seconds, [keys, grads])


def _ring(forward: list[Exchange], backward: list[Exchange], recompute: str, links, stage: int, cp: int,
          attention: tuple[float, float, float]) -> tuple[Priced, Priced]:
    """A ring's exchanges priced: the forward's passes behind their blocks, the recomputed forward's (first in the
    backward's list under recompute) behind the recomputed blocks, then the backward's ring."""
    forward_s, backward_s, recompute_s = attention
    priced_forward = _price(forward, [forward_s] * len(forward), links, stage, cp)
    again = [recompute_s] * len(forward) if recompute != "none" else []
    recomputed = _price(backward[:len(again)], again, links, stage, cp)
    ring = _ring_backward(*backward[len(again):], backward_s / cp, links, stage, cp)
    return priced_forward, Priced(recomputed.seconds + ring.seconds, recomputed.priced + ring.priced)


def layer_exchange(model: GPTConfig, layout: Layout, micro_batch: int, element_bytes: int, recompute: str,
                   links, stage: int, attention: tuple[float, float, float]) -> tuple[Priced, Priced]:
    """(forward, backward) exposed exchange of one attention layer; `attention`: its attention kernel's
    seconds in the forward, the backward and the recomputed forward (simulator/costs/compute.py's ChunkTimes)."""
    cp, kind = layout.cp, layout.cp_kind
    forward = forward_exchanges(model, layout.tp, cp, kind, micro_batch, element_bytes)
    backward = backward_exchanges(model, layout.tp, cp, kind, micro_batch, element_bytes, recompute)
    if kind != "ring":  # all-gather: the recomputed forward's gathers and the reduce-scatters, none hidden
        return (_price(forward, [attention[0]] * len(forward), links, stage, cp),
                _price(backward, [0.0] * len(backward), links, stage, cp))
    return _ring(forward, backward, recompute, links, stage, cp, attention)


def torch_layer_exchange(model: GPTConfig, layout: Layout, micro_batch: int, element_bytes: int, recompute: str,
                         links, stage: int, attention: tuple[float, float, float]) -> tuple[Priced, Priced]:
    """layer_exchange for torch's context_parallel as torchtitan runs it (simulator/costs/torchtitan/context.py's
    exchanges): each all-gather hidden behind the first step's attention (1/cp of the pass), each dk/dv pass behind
    the next step's, the last one waited for whole."""
    cp = layout.cp
    forward_s, backward_s, recompute_s = (seconds / cp for seconds in attention)  # one step's attention
    elements = micro_batch * (model.n_heads // layout.tp) * (model.seq_len // cp) * model.qk_head_dim
    forward, backward = torch_exchanges(cp, elements, element_bytes, recompute)

    def gathered(exchange: Exchange, step_s: float) -> float:
        return max(0.0, links.cp_collective(stage, "all_gather", exchange.bytes * cp) - step_s)

    *again, gather, passes = backward  # the recomputed forward's gather (under recompute), the backward's, dk/dv
    one_pass = links.cp_pass(stage, passes.bytes)
    seconds = sum(gathered(g, recompute_s) for g in again) + gathered(gather, backward_s)
    seconds += (passes.calls - 1) * max(0.0, one_pass - backward_s) + one_pass
    return Priced(gathered(forward[0], forward_s), forward), Priced(seconds, backward)


def te_layer_exchange(model: GPTConfig, layout: Layout, micro_batch: int, element_bytes: int, recompute: str,
                      links, stage: int, attention: tuple[float, float, float]) -> tuple[Priced, Priced]:
    """layer_exchange for Transformer Engine's ring as Megatron-core runs it (simulator/costs/te_context.py's
    exchanges) on its ring: the forward's passes as ours; in the backward the first step hides the keys' pass, each
    middle step one message of keys and the dk, dv so far, and the last hop of dk, dv is waited for whole (cp - 1
    gradient passes in the compute format, where our ring sends cp in fp32), multi-head latent attention's values at
    their own width (ours pads them to the query's). Outside its ring, as ours (cp_merge)."""
    if cp_merge(layout, "te") != "te":
        return layer_exchange(model, layout, micro_batch, element_bytes, recompute, links, stage, attention)
    keys = kv_elements(model, layout.tp, layout.cp, micro_batch)  # values at their own width: MLA's narrower
    forward, backward = te_exchanges(layout.cp, keys + keys * model.v_head_dim // model.qk_head_dim, element_bytes,
                                     recompute)
    return _ring(forward, backward, recompute, links, stage, layout.cp, attention)
