"""The attention core's ops: rotary positions, then flash or unfused attention, forward and backward. Torch-free.

simulator/costs/ops.py explains the op list and calls `core_forward` / `core_backward` between the qkv and
proj Linears. The core is minigpt/model.py's AttentionCore, the region selective recompute runs again.

Per rank: a/t query heads and K/t key/value heads of head_dim each (grouped-query attention when K < a;
tensor parallelism keeps whole heads of both kinds on a rank). The fused qkv tensor is
(a + 2K)/t x head_dim wide.

- Rotary positions (Su et al. 2021), as RotaryQK does: one memory-bound kernel reads the qkv tensor
  and the fp32 cos and sin tables (s x head_dim each) and writes a new qkv-sized tensor (q and k
  rotated, v copied); it saves nothing. Its backward rotates the gradient back the same way (one
  kernel, the same bytes). The attention then saves q, k, v as views of the rotated tensor.
- Flash (FlashAttention-2, Dao 2023): every query head scores the sequence against its group's key
  head, so the GEMMs are those of multi-head attention (batch b x a/t), over the causal half of the
  square: the op computes the s (s + 1) / 2 products the mask keeps (FusedAttention.flops), priced at
  the kernel's published causal throughput where the GPU has a table
  (simulator/costs/rates/attention_rates.py); the kernel reads
  q, k and v once each (a K/t-head k and v serve a/K query heads each, from on-chip memory) and
  writes the output and an fp32 log-sum-exp per query head and row. Backward: a pre-pass
  D = rowsum(dO * O), then one kernel recomputing the scores and running four gradient GEMMs,
  reading q, k, v, dO, the log-sum-exp and D and writing dq, dk and dv in their own shapes (what
  FlashAttention-3 and cuDNN write; FlashAttention-2's own GQA path writes dk and dv expanded to
  a/t heads and sums them in a separate kernel: a few more bytes, not counted here).
- Context parallelism (cp > 1, flash only: simulator/costs/op_types.py's check_cp_attention): the rank
  holds s/cp tokens of a sequence of s (two chunks of s/(2 cp), parallel/context/chunks.py) and its queries
  meet the whole sequence's keys, so its GEMMs span s/cp x s and the mask keeps exactly 1/cp of the whole
  causal attention's products (the load-balanced split gives every rank the same work). Both of our
  kinds (parallel/context/ring.py, allgather.py) compute it as blocks of one query chunk against one key
  chunk, s/(2 cp) tokens each, so the kernel table is read at that length (FusedAttention.kernel_seq:
  a causal table at the block length; the off-diagonal blocks are unmasked, which a causal table prices
  a little low). The kernel also reads the other ranks' keys and values, (cp - 1) x this rank's. The
  all-gather kind keeps the gathered keys and values of the whole sequence for the backward
  (GatheredAttention saves them): a tensor of the core, dropped and gathered again under recompute.
  What travels, and its time, is simulator/engine/context.py's. Under torch's context_parallel (torchtitan's:
  Implementation.cp_attention "torch") each step is a kernel call of its own, merged by eager fp32 kernels
  around it (simulator/costs/torchtitan/context.py); under Transformer Engine's ring (Megatron-core's: "te") by
  compiled bf16 kernels (simulator/costs/te_context.py); the fused op above still prices the steps' GEMMs.
- A sliding window w shorter than the sequence (Mistral's): the kernel skips the tiles outside the band as
  FlashAttention-2's window_size and cuDNN's sliding window do, keeping sum_i min(i + 1, w) products of the
  square (the busiest context-parallel rank's: the load-balanced split does not even a band out), at the causal
  table's rate read at 2 w at most (FusedAttention.efficiency_seq; no sliding-window table is published). Our
  executor's masked SDPA on a GPU computes the whole square (its fused kernels take the mask, not the band): not
  priced here.
- A document mask (Llama 3's; Implementation.document_length L, the documents' mean length): the kernel skips the
  tiles between documents, as FlashAttention-2's variable-length kernels and FlexAttention's block masks do, keeping
  the expected products within documents of geometric lengths (document_share: about L/s of the causal square's
  where L is short beside s), at the causal table's rate read at twice the keys a row meets on average. Our
  executor's masked SDPA computes the whole square here too.
- Unfused: scores = q @ k^T, softmax, dropout, probabilities @ v, heads merged back into rows,
  batch b x a/t matmuls each reading its group's key or value head.
"""

from __future__ import annotations

import math

from simulator.costs import te_context
from simulator.costs.torchtitan import context, eager
from simulator.costs.op_types import BACKWARD, BLOCK, CORE, FORWARD, FP32, MASK, FusedAttention, MemoryOp
from simulator.costs.recorder import Recorder, gemm


def rope_table_bytes(rec: Recorder) -> int:
    """The fp32 cos and sin tables a rotation reads: s x the rotated columns each (minigpt/attention.py's rope_tables)."""
    return 2 * rec.shape.s * rec.shape.rotary * FP32



def rope_forward(rec: Recorder, qkv: str) -> str:
    """q and k rotated: a new fused tensor (latent attention runs it after its up projections: layers/latent.py)."""
    rotated = rec.tensor("rope.output", rec.size[qkv])
    if rec.shape.eager:  # torchtitan's complex multiplies, q and k apart (simulator/costs/torchtitan/eager.py)
        rec.kernels("rope", eager.rope_forward(_rotated_elements(rec.shape), _eager_table(rec.shape), rec.shape.e))
        return rotated
    rec.op(MemoryOp("rope", rec.size[qkv] + rope_table_bytes(rec), rec.size[rotated]))
    return rotated


def _rotated_elements(sh) -> tuple[int, int]:
    """The q and k elements an eager rotation casts and multiplies (v is not touched)."""
    return sh.rows * sh.heads * sh.rotary, sh.rows * sh.kv_heads * sh.rotary


def _eager_table(sh) -> int:
    """torchtitan's frequencies: s x (rotated columns) / 2 complex64 numbers of two fp32 each."""
    return sh.s * sh.rotary * FP32


def _repeated_kv(sh) -> tuple[int, int]:
    """Grouped-query attention in eager torchtitan: k's and v's elements, and each one's copy over every query head
    (repeat_kv); (0, 0) without grouping or without eager."""
    if not sh.eager or sh.kv_heads == sh.heads:
        return 0, 0
    return sh.rows * sh.kv_heads * sh.head_dim, sh.rows * sh.heads * sh.head_dim


def other_kv_bytes(sh) -> int:
    """The keys and values of the other context-parallel ranks a rank's attention reads: (cp - 1) x its own."""
    return (sh.cp - 1) * sh.b * sh.kv_heads * sh.s * (sh.head_dim + sh.out_dim) * sh.e


def _kernel_seq(sh) -> int:
    """The block length the kernel works on under context parallelism: one chunk, s/(2 cp) of the sequence."""
    return sh.s // 2 if sh.cp > 1 else 0


def window_share(s: int, window: int, cp: int) -> float:
    """The share of a rank's (s/cp) x s square of scores a sliding window keeps (query i meets keys i - w < j <= i),
    the busiest rank's: the load-balanced split (parallel/context/chunks.py) evens the causal triangle out, not a
    band, whose first rows meet fewer keys."""
    def kept(first: int, rows: int) -> int:  # sum over queries first .. first + rows - 1 of min(i + 1, w)
        short = min(max(window - first, 0), rows)  # the rows that meet fewer than w keys
        return short * (2 * first + short + 1) // 2 + (rows - short) * window
    if cp == 1:
        return kept(0, s) / (s * s)
    c = s // (2 * cp)
    return max(kept(r * c, c) + kept((2 * cp - 1 - r) * c, c) for r in range(cp)) / (2 * c * s)


def document_share(s: int, length: int, cp: int) -> float:
    """The expected share of a rank's (s/cp) x s square of scores a document mask keeps (query i meets the keys
    j <= i of its document), the busiest rank's, where each token ends a document with probability 1/length, on its
    own: documents of independent geometric lengths, mean `length`, packed one after another, a sequence starting
    anywhere in one (the sampler's windows). Query i then meets sum_{d <= i} q^d = (1 - q^(i + 1)) / (1 - q) keys
    on average, q = 1 - 1/length: i + 1 while i is short beside the length (a causal mask), `length` past it."""
    log_q = math.log1p(-1 / length) if length > 1 else -math.inf  # documents of one token: each query meets itself

    def kept(first: int, rows: int) -> float:  # the sum over queries first .. first + rows - 1, in closed form
        return length * rows + length * length * math.exp((first + 1) * log_q) * math.expm1(rows * log_q)
    if cp == 1:
        return kept(0, s) / (s * s)
    c = s // (2 * cp)
    return max(kept(r * c, c) + kept((2 * cp - 1 - r) * c, c) for r in range(cp)) / (2 * c * s)


def _band(sh) -> dict:
    """FusedAttention's mask fields of this unit: none; the window and its band's share of the square; or the
    documents' mean length and the share they keep (a windowed block prices its band alone: the documents' further
    skipping inside it is not)."""
    if sh.window:
        return dict(window=sh.window, kept=window_share(sh.keys, sh.window, sh.cp))
    return dict(documents=sh.documents, kept=document_share(sh.keys, sh.documents, sh.cp)) if sh.documents else {}


def _padded_flops(sh) -> int:
    """The whole square's products of one value GEMM that fall on zero-padded columns (0 without padding)."""
    return 2 * sh.s * sh.keys * (sh.out_dim - sh.value_dim) * sh.b * sh.heads


def _flash_forward(rec: Recorder, qkv: str) -> None:
    sh = rec.shape
    a, s, keys, hd, vd = sh.heads, sh.s, sh.keys, sh.head_dim, sh.out_dim
    lse = rec.tensor("attention.logsumexp", sh.rows * a * FP32, small=True)
    out = rec.tensor("attention.padded_output" if sh.padded_values else "attention.output", sh.rows * a * vd * sh.e)
    saves, read = (qkv, out, lse), rec.bytes_of(qkv)
    if sh.padded_values:  # v zero-padded to the query's width, read and saved in place of the fused tensor's v
        values = sh.rows * sh.kv_heads * sh.value_dim * sh.e
        padded = rec.tensor("attention.padded_values", sh.rows * sh.kv_heads * hd * sh.e)
        rec.op(MemoryOp("attention.pad_values", values, rec.size[padded]), saves=(padded,))
        read += rec.size[padded] - values
    kv, repeated = _repeated_kv(sh)
    if repeated:  # k and v copied to every query head, which the attention saves beside q
        rec.kernels("attention", eager.repeat_kv_forward(kv, repeated, sh.e))
        saves += (rec.tensor("attention.kv_repeated", 2 * (repeated - kv) * sh.e),)
    if sh.sink_columns:  # q, k, v and the output padded for the sinks (minigpt/attention.py), saved beside them
        padded = _sink_padding(sh)
        rec.op(MemoryOp("attention.sink_pads", rec.bytes_of(qkv), rec.bytes_of(qkv) + padded[0]))
        saves += (rec.tensor("attention.sink_padded", sum(padded)),)
    if sh.cp > 1 and sh.cp_kind == "allgather":  # the whole sequence's keys and values, kept for the backward
        saves += (rec.tensor("attention.gathered_kv", sh.b * sh.kv_heads * keys * (hd + vd) * sh.e),)
    gemms = (gemm("attention.scores", s, keys, hd, sh.compute, sh.e, sh.b * a, FORWARD, False),
             gemm("attention.values", s, vd, keys, sh.compute, sh.e, sh.b * a, FORWARD, False))
    rec.op(FusedAttention("attention.flash", gemms, read + other_kv_bytes(sh), rec.bytes_of(out, lse),
                          causal_seq=keys, kernel_seq=_kernel_seq(sh), kernel=sh.attention_kernel,
                          padded_flops=_padded_flops(sh), **_band(sh)), saves=saves)
    if sh.cp_merge == "torch":  # torch's context_parallel: each step's output merged by eager fp32 kernels
        rec.kernels("attention.cp", context.forward_kernels(sh.cp, sh.rows, a, vd, sh.e))
    elif sh.cp_merge == "te":  # Transformer Engine's ring: the steps merged by compiled bf16 kernels
        rec.kernels("attention.cp", te_context.forward_kernels(sh.cp, sh.rows, a, sh.kv_heads, vd, sh.e))
    if sh.padded_values:  # the output cut back to the value heads' width: the copy the projection reads
        rec.tensor("attention.output", sh.rows * a * sh.value_dim * sh.e)
        rec.mem("attention.cut_output", (out,), ("attention.output",))
    if sh.sink_columns:  # the kernel's padded output, cut back to the heads' width
        rec.op(MemoryOp("attention.sink_cut_output", _sink_padding(sh)[1], rec.bytes_of(out)))


def _sink_padding(sh) -> tuple[int, int]:
    """Bytes our executor's sinks add to the core's saved tensors (GPTConfig.sink_padding_width on this rank): q, k
    and v each sink_columns wider, and the kernel's padded output."""
    c = sh.sink_columns
    return (sh.rows * (sh.heads + 2 * sh.kv_heads) * c * sh.e, sh.rows * sh.heads * (sh.out_dim + c) * sh.e)


def _flash_backward(rec: Recorder) -> None:
    """FlashAttention-2: D = rowsum(dO * O), then one kernel recomputing the scores and running four gradient GEMMs."""
    sh = rec.shape
    a, s, keys, hd, vd, batch, e = sh.heads, sh.s, sh.keys, sh.head_dim, sh.out_dim, sh.b * sh.heads, sh.e
    width = sh.rows * a * vd * e  # one of O, dO
    cut = sh.rows * a * sh.value_dim * e
    if sh.padded_values:  # the output's gradient padded with zeros
        rec.back_mem("attention.cut_output_backward", cut, width)
    qkv = sh.rows * ((a + sh.kv_heads) * hd + sh.kv_heads * vd) * e  # q, k and v (or dq, dk and dv)
    rec.back_mem("attention.flash_backward_preprocess", 2 * width, sh.rows * a * FP32)
    shapes = (("attention.scores_recomputed", s, keys, hd), ("attention.grad_v", keys, vd, s),
              ("attention.grad_probs", s, keys, vd), ("attention.grad_q", s, hd, keys),
              ("attention.grad_k", keys, hd, s))
    gemms = tuple(gemm(name, m, n, k, sh.compute, e, batch, BACKWARD, False) for name, m, n, k in shapes)
    read = qkv + width + 2 * sh.rows * a * FP32 + other_kv_bytes(sh)  # q, k, v, dO; the log-sum-exp and D
    rec.backward.append(FusedAttention("attention.flash_backward", gemms, read, qkv, BACKWARD, causal_seq=keys,
                                       kernel_seq=_kernel_seq(sh), kernel=sh.attention_kernel,
                                       padded_flops=2 * _padded_flops(sh), **_band(sh)))  # dP = dO v^T, dv = P^T dO
    if sh.cp_merge == "torch":
        rec.back_kernels("attention.cp", context.backward_kernels(sh.cp, sh.rows, a, vd, e))
    elif sh.cp_merge == "te":
        rec.back_kernels("attention.cp", te_context.backward_kernels(sh.cp, sh.rows, a, sh.kv_heads, vd, e))
    kv, repeated = _repeated_kv(sh)
    if repeated:
        rec.back_kernels("attention", eager.repeat_kv_backward(kv, repeated, sh.e))
    if sh.sink_columns:  # the padded output's gradient, and q, k and v's cut back from their padded ones
        padded, output = _sink_padding(sh)
        rec.back_mem("attention.sink_pads_backward", output + qkv + padded, output + qkv)
    if sh.padded_values:  # dv cut back to the value heads' width
        rows = sh.rows * sh.kv_heads
        rec.back_mem("attention.pad_values_backward", rows * hd * e, rows * sh.value_dim * e)


def _unfused_forward(rec: Recorder, qkv: str) -> None:
    sh = rec.shape
    a, s, hd, vd, batch = sh.heads, sh.s, sh.head_dim, sh.value_dim, sh.b * sh.heads
    square = batch * s * s  # elements of the s x s scores of this rank's heads
    rec.tensor("attention.scores", square * sh.e)
    rec.gemm("attention.scores", s, s, hd, sh.compute, (qkv,), batch, linear=False)
    probs = rec.tensor("attention.probs", square * sh.e)
    rec.mem("attention.softmax", ("attention.scores",), (probs,), saves=(probs,))  # scale, causal mask, softmax
    if sh.dropout:
        dropped, mask = rec.tensor("attention.dropped", square * sh.e), rec.tensor("attention.mask", square * MASK)
        rec.mem("attention.dropout", (probs,), (dropped, mask), saves=(mask,))
        probs = dropped
    heads = rec.tensor("attention.heads", sh.rows * a * vd * sh.e)
    rec.gemm("attention.values", s, vd, s, sh.compute, (probs, qkv), batch, linear=False)
    rec.tensor("attention.output", sh.rows * a * vd * sh.e)
    rec.mem("attention.merge_heads", (heads,), ("attention.output",))  # (b*a, s, hd) -> (b*s, a*hd)


def _unfused_backward(rec: Recorder) -> None:
    sh = rec.shape
    a, s, hd, vd, batch, e = sh.heads, sh.s, sh.head_dim, sh.value_dim, sh.b * sh.heads, sh.e
    square, width = batch * s * s, sh.rows * a * vd * e
    rec.back_mem("attention.merge_heads_backward", width, width)
    rec.back_gemm("attention.grad_probs", s, s, vd, sh.compute, batch, linear=False)  # dP = dO v^T
    rec.back_gemm("attention.grad_v", s, vd, s, sh.compute, batch, linear=False)  # dv = P^T dO
    if sh.dropout:
        rec.back_mem("attention.dropout_backward", square * (e + MASK), square * e)
    rec.back_mem("attention.softmax_backward", 2 * square * e, square * e)
    rec.back_gemm("attention.grad_q", s, hd, s, sh.compute, batch, linear=False)  # dq = dS k
    rec.back_gemm("attention.grad_k", s, hd, s, sh.compute, batch, linear=False)  # dk = dS^T q


def _qk_norm_forward(rec: Recorder, qkv: str) -> str:
    """Qwen3's query and key norms, as AttentionCore.normed runs them: an RMSNorm kernel over the query heads and
    one over the key heads (each keeping its input, the qkv output, and one fp32 1/rms per head and row; OLMo 2's
    over all heads one per row each: the same bytes moved), then the
    normalised q and k and the untouched v copied into a new fused tensor."""
    sh = rec.shape
    qk = sh.rows * (sh.heads + sh.kv_heads) * sh.head_dim * sh.e
    stats = rec.tensor("qk_norm.inv_rms", sh.rows * _qk_statistics(sh) * FP32, small=True)
    normed = rec.tensor("qk_norm.output", qk)
    rec.op(MemoryOp("qk_norm", qk, qk + rec.size[stats]), saves=(qkv, stats))
    fused = rec.tensor("qk_norm.fused", rec.size[qkv])
    rec.op(MemoryOp("qk_norm.concat", rec.size[qkv], rec.size[fused]))  # q and k normalised, v as it was
    return fused


def _qk_norm_backward(rec: Recorder) -> None:
    sh = rec.shape
    qk = sh.rows * (sh.heads + sh.kv_heads) * sh.head_dim * sh.e
    stats = sh.rows * _qk_statistics(sh) * FP32
    rec.back_mem("qk_norm_backward", 2 * qk + stats, qk)  # the input and the output's gradient, 1/rms


def _qk_statistics(sh) -> int:
    """The 1/rms the q and k norms keep per row: one per head on this rank, or q's and k's over all heads (OLMo 2's,
    the sums of squares summed over the tensor-parallel group: simulator/costs/tp_collectives.py's tp_collectives)."""
    return 2 if sh.qk_norm_whole else sh.heads + sh.kv_heads


def core_forward(rec: Recorder, attention: str, qkv: str) -> str:
    """From the fused qkv tensor `qkv` to the heads' output, in the recompute region CORE (the rotation in it, but
    latent attention's, which Megatron-core's mla_up_proj recomputes with the up projections): returns the output."""
    rec.enter(CORE, inputs=(qkv,))
    if rec.shape.qk_norm:
        qkv = _qk_norm_forward(rec, qkv)
    if rec.shape.rope and not rec.shape.latent:  # latent attention's rotation is its up projections' (latent.py)
        qkv = rope_forward(rec, qkv)
    (_flash_forward if attention == "flash" else _unfused_forward)(rec, qkv)
    rec.enter(BLOCK)
    return "attention.output"


def core_backward(rec: Recorder, attention: str) -> None:
    """The core's gradients, last op first: the attention's, then the rotation's."""
    (_flash_backward if attention == "flash" else _unfused_backward)(rec)
    if rec.shape.rope and rec.shape.eager:
        rec.back_kernels("rope_backward", eager.rope_backward(_rotated_elements(rec.shape), _eager_table(rec.shape),
                                                             rec.shape.e))
    elif rec.shape.rope:
        qkv = rec.shape.rows * rec.shape.qkv_width * rec.shape.e
        rec.back_mem("rope_backward", qkv + rope_table_bytes(rec), qkv)
    if rec.shape.qk_norm:
        _qk_norm_backward(rec)
