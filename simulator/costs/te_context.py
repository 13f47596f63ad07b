"""Transformer Engine's context parallelism as Megatron-core runs it: the kernels around each step's attention call.

Megatron-core's attention under context parallelism is Transformer Engine's DotProductAttention with cp_comm_type
"p2p" (its default): AttnFuncWithCPAndKVP2P in transformer_engine/pytorch/attention/dot_product_attention/
context_parallel.py (read at v2.7, 2025-08; bf16 throughout from v2.4, which dropped the fp64 log-sum-exp, to the
later releases, which split the same bytes over more kernels). It calls the fused attention kernel once per step (the
fused op in layers/attention.py prices the steps' GEMMs) and merges the steps outside it; in bf16, with Megatron's sbhd
layout and the causal load balance (two chunks a rank), per attention layer and micro-batch:

  forward   k and v concatenated once into the buffer the ring sends (torch.cat); the first step's log-sum-exp
            cloned, each later one merged into it (flash_attn_fwd_softmax_lse_correction), beside the next step's
            attention on the other stream; after the last step, on the main stream, the first step's output scaled
            into a new bf16 output (flash_attn_fwd_out_correction_init) and each later step's added into it in place
            (flash_attn_fwd_out_correction): fp32 log-sum-exps, bf16 outputs. The merges are TE's @jit_fuser
            functions, which TE compiles with torch.compile by default (NVTE_TORCH_COMPILE=1): one kernel a call.
  backward  k and v copied once into the ring's buffer; at each step dq added into the bf16 dq (copied at the
            first), and dk, dv into the bf16 dkv that travels the ring with the next step's keys and values
            (exchanges); no fp32 accumulator and no final cast.

Priced for the group's last rank (cp - 1), whose every step takes all of its queries (the diagonal step and cp - 1
steps against the first half of another rank's chunk), so its merges are whole; the other ranks merge halves and
wait for it at each pass. Each kernel is (name, bytes read, bytes written), every tensor read or written once.
"""

from __future__ import annotations

from job.exchange.context import Exchange
from simulator.costs.torchtitan.eager import FP32, Kernels


def forward_kernels(cp: int, rows: int, heads: int, kv_heads: int, head_dim: int, e: int) -> Kernels:
    """One layer's forward on the cp group's last rank: `rows` its tokens (micro-batch x s / cp), `e` the compute
    format's bytes."""
    n, kv, lse = rows * heads * head_dim, rows * kv_heads * head_dim, rows * heads * FP32
    out: Kernels = [("kv_concat", 2 * kv * e, 2 * kv * e), ("lse_clone", lse, lse)]
    out += [("lse_correction", 2 * lse, lse)] * (cp - 1)
    out.append(("out_correction_init", n * e + 2 * lse, n * e))
    return out + [("out_correction", 2 * n * e + 2 * lse, n * e)] * (cp - 1)


def backward_kernels(cp: int, rows: int, heads: int, kv_heads: int, head_dim: int, e: int) -> Kernels:
    """One layer's backward on the cp group's last rank (forward_kernels' arguments): its first step meets another
    rank's first half (dk, dv of that half copied), its last the diagonal (dk, dv added whole)."""
    n, kv = rows * heads * head_dim, rows * kv_heads * head_dim
    out: Kernels = [("kv_to_ring_buffer", 2 * kv * e, 2 * kv * e), ("grad_q_copy", n * e, n * e),
                    ("grad_kv_half_copy", kv * e, kv * e)]
    out += [("grad_q_add", 2 * n * e, n * e), ("grad_kv_half_add", 2 * kv * e, kv * e)] * (cp - 2)
    return out + [("grad_q_add", 2 * n * e, n * e), ("grad_kv_add", 4 * kv * e, 2 * kv * e)]


def exchanges(cp: int, pair: int, e: int, recompute: str = "none") -> tuple[list[Exchange], list[Exchange]]:
    """(forward, backward) passes of one layer on one rank, `pair` the elements of the rank's k and v together (under
    multi-head latent attention v at its own width: TE passes k and v as they are, not padded as our ring pads them):

      forward   cp - 1 passes of k and v (pair x e bytes), each behind its step's attention;
      backward  the recomputed forward's under recompute; cp - 1 passes of k and v, and cp - 1 of the bf16 dk, dv
                accumulated so far, sent together with the next step's keys (one message) from the second step on,
                the last alone and waited for at the end (simulator/engine/context.py's te_layer_exchange)."""
    forward = [Exchange("p2p", cp - 1, pair * e)]
    again = list(forward) if recompute != "none" else []
    return forward, again + [Exchange("p2p", cp - 1, pair * e), Exchange("p2p", cp - 1, pair * e)]
