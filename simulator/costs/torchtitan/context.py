"""torch's context parallelism as torchtitan runs it: the element-wise kernels around each step's attention call.

torchtitan (9dec370, the commit of its published long-context table) shards the sequence with
torch.distributed.tensor.experimental.context_parallel, whose attention (_templated_ring_attention and
_templated_ring_attention_backward in torch/distributed/tensor/experimental/_attention.py) calls the SDPA kernel
once per step, a block of the rank's queries against one rank's keys, and merges the blocks in separate eager
kernels, in fp32 (_ContextParallelOptions.convert_to_f32, True). Per attention layer and micro-batch, forward:

  k, v made contiguous (torchtitan hands them over as transposed views), then at each of the cp steps but the
  last the pair concatenated into the buffer the rotater sends (torch.cat, even when all-gathered once); each
  step's output cast to fp32 (_SDPAMerger.step); from the second step on, the merge (_merge_one): the
  log-sum-exps' difference and its sigmoid, out - block_out, its product with the sigmoid, out minus that,
  and the new log-sum-exp (difference, logsigmoid, subtraction); at the end the output cast back.
Backward: fp32 zeros for dq, dk, dv (zeros_like keeps k's transposed layout); k, v made contiguous and concatenated
as in the forward; at each step dk and dv (and dq) accumulated in fp32 from the kernel's 16-bit gradients, where the
step covers half of the chunk through _partial_update (the half added, then the whole concatenated again), and the
pair concatenated (torch.cat) into the buffer the all-to-all rotater sends on (after the first step each flattened,
a copy while they keep k's layout); at the end dq and the returned dk, dv cast back.

Priced for the group's last rank (cp - 1): every one of its steps after the first meets the first half of
another rank's chunk with all its queries, so its forward merges are whole and its backward updates halves;
the other ranks merge halves (partial) and run no slower, and each layer's all-gather waits for the slowest.
The heads are the query heads: torchtitan's Llama copies k and v to every query head before the attention
(repeat_kv). Each kernel is (name, bytes read, bytes written), every tensor read or written once.
"""

from __future__ import annotations

from job.exchange.context import Exchange
from simulator.costs.torchtitan.eager import FP32, Kernels


def _merge(out: int, lse: int) -> Kernels:
    """_merge_one of a whole block: `out` elements of the output, `lse` of the log-sum-exp (fp32 both)."""
    o, s = out * FP32, lse * FP32
    return [("lse_difference", 2 * s, s), ("lse_sigmoid", s, s), ("out_difference", 2 * o, o),
            ("out_scale", o + s, o), ("out_update", 2 * o, o), ("lse_difference_back", 2 * s, s),
            ("lse_logsigmoid", s, s), ("lse_update", 2 * s, s)]


def forward_kernels(cp: int, rows: int, heads: int, head_dim: int, e: int) -> Kernels:
    """One layer's forward on the cp group's last rank: `rows` its tokens (micro-batch x s / cp), `e` the
    compute format's bytes."""
    n, lse = rows * heads * head_dim, rows * heads
    out: Kernels = [("k_contiguous", n * e, n * e), ("v_contiguous", n * e, n * e)]
    for step in range(cp):
        if step < cp - 1:
            out.append(("kv_concat", 2 * n * e, 2 * n * e))
        out.append(("out_to_fp32", n * e, n * FP32))
        if step > 0:
            out += _merge(n, lse)
    return out + [("out_to_input_format", n * FP32, n * e)]


def backward_kernels(cp: int, rows: int, heads: int, head_dim: int, e: int) -> Kernels:
    """One layer's backward on the cp group's last rank (forward_kernels' arguments)."""
    n = rows * heads * head_dim
    out: Kernels = [("grad_q_zeros", 0, n * FP32), ("grad_k_zeros", 0, n * FP32), ("grad_v_zeros", 0, n * FP32),
                    ("k_contiguous", n * e, n * e), ("v_contiguous", n * e, n * e)]
    for step in range(cp):
        if step < cp - 1:
            out.append(("kv_concat", 2 * n * e, 2 * n * e))
        if step == 0:  # dk, dv zero-filled in k's layout (a transposed view): flattened for the send, copied
            out += [(f"grad_{x}_accumulate", n * (FP32 + e), n * FP32) for x in "kv"]
            out += [(f"grad_{x}_flatten", n * FP32, n * FP32) for x in "kv"]
        else:  # the first half of the chunk added, then the whole concatenated (_partial_update)
            out += [(f"grad_{x}_accumulate", n * (FP32 + e) // 2, n * FP32 // 2) for x in "kv"]
            out += [(f"grad_{x}_concat", n * FP32, n * FP32) for x in "kv"]
        out += [("grad_kv_concat", 2 * n * FP32, 2 * n * FP32), ("grad_q_accumulate", n * (FP32 + e), n * FP32)]
    return out + [("grad_q_to_input_format", n * FP32, n * e), ("grad_kv_to_input_format", 2 * n * FP32, 2 * n * e)]


def exchanges(cp: int, elements: int, e: int, recompute: str = "none") -> tuple[list[Exchange], list[Exchange]]:
    """(forward, backward) collectives of one layer on one rank, as torch's ring attention issues them with the
    all-gather rotater (torchtitan's default): `elements` of the rank's k (or v) over every query head.

      forward   one all-gather of k and v concatenated (each rank gives 2 elements x e bytes), issued before the first
                step and waited for at the second;
      backward  the same all-gather again, and at each of the cp steps the fp32 dk and dv concatenated sent on to the
                next rank (an all-to-all that moves the whole buffer to one peer: a ring pass), each waited for after
                the next step's kernel, the last after the loop; recomputation runs the forward's again first."""
    gather = Exchange("all_gather", 1, 2 * elements * e)
    again = [gather] if recompute != "none" else []
    return [gather], again + [gather, Exchange("p2p", cp, 2 * elements * FP32)]
