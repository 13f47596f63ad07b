"""The op-level cost model: every kernel of one micro-batch through a block, per tensor-parallel rank. Torch-free.

`block_ops(model, micro_batch, layout, policy, implementation)` lists one transformer block's
forward and backward as plain dataclasses (print them: `for op in ops.forward: print(op)`):

  Gemm            a matmul (m x k) @ (k x n), `batch` times, in the format its tensor cores run
                  (the block's Linears in fp8 under the fp8 policy; attention and the head in the
                  compute format), with the HBM bytes of its operands and result;
  MemoryOp        a memory-bound kernel (LayerNorm or RMSNorm, bias add, GELU or SwiGLU, rotary
                  positions, softmax, dropout, residual add, casts, the loss) with the bytes it
                  reads and writes;
  FusedAttention  FlashAttention: the attention matmuls in one kernel, with no s x s tensor in HBM.

and `Saved`, the tensors the forward leaves for the backward. `embedding_ops` and `head_ops`
do the same for the embeddings and for the final norm, the head and the loss.
simulator/costs/compute.py prices the ops, simulator/memory.py sums what they save. The attention
core (rotary positions, flash or unfused attention) is simulator/costs/layers/attention.py's; a mixture of
experts' router, routed experts and combine (block_ops(moe=True)) simulator/costs/layers/moe.py's.

Per rank, for b sequences of s tokens (B = b*s rows), width h = d, MLP width f, a query heads,
K key/value heads, tp t: row counts of the element-wise work on the residual stream are B/t
under sequence parallelism, B otherwise; everything between a column- and a row-parallel
Linear is split over t (a/t and K/t heads, (a + 2K) head_dim/t qkv columns, f/t or 2f/t fc1
columns). Each op reads its inputs from HBM once and writes its
outputs once. Kernels fused: FlashAttention; the scale, causal mask and softmax of unfused
attention (one kernel, as Megatron's FusedScaleMaskSoftmax); by default nothing else: bias adds,
dropout and residual adds are kernels of their own (our executor's description: an upper bound on a
GPU, where cuBLASLt adds a Linear's bias in its epilogue). Implementation.bias_fusion describes
Megatron's: "megatron", fc1's bias inside the activation's kernel and proj's and fc2's bias, the
residual dropout and the residual add one kernel (bias_dropout_add, saving the same mask); "te", qkv's
bias added and reduced by its GEMMs' epilogues as well. Tensor-parallel collectives are not
ops: tp_collectives.py counts them. Backward, op by op in reverse: each Linear an
input-gradient GEMM (m=B, n=in, k=out) and a weight-gradient GEMM (m=out, n=in, k=B: the same
FLOPs), then its weight gradient accumulated into the gradient buffer (read old and new, write);
each attention matmul two GEMMs; each memory-bound op its own backward with its own bytes;
each residual join the sum of the two gradients that meet there. The attention matmuls cover
the full s x s square (no causal discount), as config.py counts them.

Attention (`Implementation.attention`):
  "flash"    FusedAttention forward (reads q, k, v; writes the output and an fp32 log-sum-exp
             per row and head), saving q, k, v, the output and the log-sum-exp. Its backward
             is FlashAttention-2's: a pre-pass D = rowsum(dO * O), then one kernel that
             recomputes the scores q @ k^T and runs the four gradient matmuls: 5 GEMMs where
             the forward had 2. Attention dropout, if any, is regenerated from the RNG state
             inside the kernel: no mask in HBM.
  "unfused"  scores = q @ k^T, softmax, dropout, dropout output @ v, heads merged back into
             rows: the scores, softmax output, mask and dropout output are s x s per head
             in HBM, and the softmax output, the mask and the dropout output are saved.

Recompute (`Implementation.recompute`): "none"; "full": only the block input is saved, and
the backward first runs the block's forward again; "selective" (Korthikanti et al. 2022): the
attention core (rotary positions, scores, softmax, dropout, attention x values, and the merge
of the heads) runs again in the backward and saves nothing: what it keeps is its input (the
fused q, k, v) and what the ops around it keep (its output). The rule, by construction: a
saved tensor is dropped when the op that makes it is recomputed and every op that saves it is
recomputed too, and a recomputed region keeps its input (Recorder.enter); `recomputed` lists
those dropped, alive again while the block's backward runs. "op": torchtitan's selective op
policy, kept and recomputed op by op (simulator/costs/torchtitan/selective_op.py).

Sequence parallelism (`Implementation.sp_saved_input`): the column-parallel Linears (qkv, fc1,
the head) multiply the all-gathered sequence. "gathered" (our executor, parallel/tensor/layers.py)
saves that gathered input; "sharded" (Megatron; Korthikanti et al.'s sequence parallelism) saves the
LayerNorm's own B/t rows and all-gathers them again in the backward (tp_collectives.py
counts that gather).

Korthikanti et al. 2022, section 4.1 ("Reducing Activation Recomputation in Large Transformer
Models"): 16-bit activations, dropout masks of 1 byte per element, LayerNorm statistics and
other buffers of O(s*b) elements left out (the paper counts only the main contributors). Our
saved tensors, for unfused attention and dropout > 0, in bytes with h = d and f = 4h:

  paper term                          here (Saved name, bytes)                   split
  LayerNorm inputs 2 x 2sbh           x, ln2.input          2 x 2sbh             sequence (t with sp)
  QKV input 2sbh                      qkv.input             2sbh                 replicated*
  QK^T: Q, K 4sbh + attention V 2sbh  q_k_v                 6sbh                 t
  softmax output 2as^2b               attention.probs       2as^2b               t
  softmax dropout mask as^2b          attention.mask        as^2b                t
  dropout output 2as^2b               attention.dropped     2as^2b               t
  output projection input 2sbh        attention.output      2sbh                 t
  attention dropout mask sbh          attention.residual_mask   sbh              sequence
  MLP input 2sbh                      fc1.input             2sbh                 replicated*
  GELU input 8sbh                     fc1.output (2fsb)     8sbh                 t
  fc2 input 8sbh                      gelu.output (2fsb)    8sbh                 t
  MLP dropout mask sbh                mlp.residual_mask     sbh                  sequence
  -> sbh(34 + 5as/h) with t = 1; sbh(10 + 24/t + 5as/(ht)) with t; 34sbh/t (+ 5as^2b/t without
     selective recompute) with sequence parallelism and "sharded" inputs (* sequence-split then).
  Left out by the paper, kept here as Saved(small=True): the LayerNorms' fp32 mean and 1/std
  (8 bytes per row each), and flash's fp32 log-sum-exp (4 bytes per row and head).
With fp8 Linears the Linears save e4m3 copies of their inputs and weights instead
(qkv.input_fp8, qkv.weight_fp8, ...), and flash still keeps the 16-bit output beside proj's copy.

fp8 Linears (the fp8 policy; docs/efficiency.md "fp8 Linears as they run"): Transformer Engine's
DelayedScaling recipe with Format.HYBRID, which precision/fp8.py follows: the four Linears' forward GEMM
e4m3 x e4m3, both backward GEMMs e5m2 (output gradient) x e4m3, per-tensor scales (from an amax history);
attention, the head and every element-wise kernel stay 16-bit. The casts, by Implementation, are
simulator/costs/layers/fp8.py's (our executor's torch ops, or Transformer Engine's fused kernels; delayed, current or
MXFP8 scaling; weights cast once a step or in every forward); our executor's _scaled_mm also transposes the weight,
the gradient and the input in the backward (1 + 1 bytes each), which Transformer Engine's casts wrote already.
wgrad_fusion: a weight-gradient GEMM reads and writes the fp32 main gradient (2 x 4 bytes per weight), no
grad_accumulate kernel after it (Megatron-core's gradient_accumulation_fusion).
userbuffers' chunks (ub_chunks, under sequence parallelism): Transformer Engine overlaps a Linear's collective by
running its GEMM on chunks of the rows (initialize_ub's default methods, transformer_engine/pytorch/module/base.py):
the ring exchange (qkv and fc1 forward, proj and fc2 input gradients) in t chunks, the pipelined reduce-scatter
(proj and fc2 forward) in UB_PIPELINE_SPLITS; the bulk overlaps (qkv and fc1 backward) leave their GEMMs whole.
A --tp-overlap-cfg file (Implementation.userbuffers, simulator/costs/userbuffers.py) sets each overlap's method and
splits, and the SMs a GEMM with set_sm_margin leaves to its collective (Gemm.sm_margin: priced on the rest).

The shape's options (minigpt/config.py), each as minigpt/model.py computes it:
  bias=False        no bias adds and no bias gradients: a Linear writes its output directly.
  norm="rmsnorm"    one fp32 statistic per row (1/rms) instead of LayerNorm's two; the same bytes
                    otherwise (its kernel reads the input, writes the output and the statistic).
  mlp="swiglu"      fc1 is 2f/t wide (gate and up, fused); one kernel reads it and writes silu(gate)
                    and the product silu(gate) * up (fc2's input), both f/t wide; saved: fc1's output,
                    silu(gate) and the product (the fp8 fc2 its e4m3 copy instead). Its backward reads the
                    product's gradient, fc1's output and silu(gate) and writes fc1's output gradient.
  positions="rope"  no position embedding (no add, no gradient); the rotation is part of the
                    attention core (layers/attention.py), saves nothing, and a selective recompute
                    keeps the core's input, the unrotated qkv output, as parallel/recompute.py does.
  n_kv_heads        grouped-query attention: qkv is (a + 2K) head_dim wide; the attention FLOPs are
                    those of a query heads (layers/attention.py).
These saved bytes equal config.activation_bytes_per_token_per_layer for every shape and
recompute mode (simulator/memory.py checks it before every prediction).
"""

from __future__ import annotations

from dataclasses import replace

from minigpt.config import OP_RECOMPUTE, GPTConfig
from minigpt.errors import ConfigError
from precision.policy import PrecisionPolicy
from job.layout import Layout, padded_vocab
from simulator.costs.op_types import (
    BACKWARD, FORWARD, FP32, MASK, OUTSIDE, RECOMPUTE, SP_SAVED_INPUTS, UB_PIPELINE_SPLITS, FusedAttention, Gemm,
    Implementation, MemoryOp, Op, OpList, Saved, unit_shape,
)
from simulator.costs.recorder import Recorder
from simulator.costs.layers.attention import core_backward, core_forward
from simulator.costs.layers.fp8 import TORCH_QUANTIZE  # noqa: F401 (re-exported)
from simulator.costs.layers.latent import latent_backward, latent_forward
from simulator.costs.layers.linear import (column_backward, column_linear, dropout_backward, norm, norm_backward,
                                           residual_backward, residual_join, row_backward, row_linear, weight_gradient)
from simulator.costs.layers.moe import routed_backward, routed_forward, shared_gate_backward, shared_gate_forward
from simulator.costs.torchtitan import eager
from simulator.costs.torchtitan.selective_op import check_op_layout, op_recompute

__all__ = ["SP_SAVED_INPUTS", "UB_PIPELINE_SPLITS", "Implementation", "Gemm", "MemoryOp", "FusedAttention", "Saved",
           "OpList", "Op", "block_ops", "embedding_ops", "head_ops", "op_rows", "FORWARD", "RECOMPUTE", "BACKWARD"]


# ---------------------------------------------------------------- the block


def _attention_forward(rec: Recorder, attention: str) -> None:
    sh = rec.shape
    x = rec.tensor("x", sh.residual_rows * sh.d * sh.e, OUTSIDE)
    if sh.latent:  # multi-head latent attention's projections (simulator/costs/layers/latent.py)
        qkv = latent_forward(rec, x)
    else:
        shard = _pre_norm(rec, "ln1", x, "ln1.output" if sh.sp else "qkv.input")
        if sh.sp:  # all-gathered along the sequence
            rec.tensor("qkv.input", sh.normed_bytes(sh.rows * sh.d) if sh.pre_norms else sh.rows * sh.d * sh.e)
        qkv = column_linear(rec, "qkv", "qkv.input" if sh.sp else shard, shard, sh.qkv_width, "q_k_v", sh.pre_norms)
    heads = core_forward(rec, attention, qkv)
    branch = row_linear(rec, "proj", heads, sh.heads * sh.value_dim, "attention.residual")
    residual_join(rec, "attention", x, _post_norm(rec, "post_attn_norm", branch), "ln2.input",
                  None if sh.post_norms else "proj")


def _pre_norm(rec: Recorder, name: str, inp: str, out: str, linear: bool = True) -> str:
    """A norm before a branch (ln1, ln2) from the residual stream `inp` into `out` (`linear`: for a Linear, which
    may take it as the norm writes it, UnitShape.normed_bytes): returns what the branch reads, `out`, or `inp`
    itself in a block without them (UnitShape.pre_norms off: OLMo 2's)."""
    sh = rec.shape
    if not sh.pre_norms:
        return inp
    with rec.module("layernorm"):
        norm(rec, name, inp, out, sh.normed_bytes(sh.residual_rows * sh.d) if linear else None)
    return out


def _post_norm(rec: Recorder, name: str, branch: str) -> str:
    """Gemma's norm of a branch before its residual add (UnitShape.post_norms), then Granite's residual multiplier
    (a kernel each way: minigpt/model.py's Block.scaled, by a Python number, saving nothing): returns what is added."""
    if rec.shape.post_norms:
        norm(rec, name, branch, f"{name}.output")
        branch = f"{name}.output"
    if not rec.shape.residual_scale:
        return branch
    scaled = rec.tensor(f"{name}.scaled", rec.size[branch])
    rec.mem(f"{name}.residual_scale", (branch,), (scaled,))
    rec.back_mem(f"{name}.residual_scale_backward", rec.size[branch], rec.size[branch])
    return scaled


def _activation(rec: Recorder, hidden: str, prefix: str, width: int) -> str:
    """GELU of fc1's output (or the squared ReLU: the same bytes, one fused kernel, its input's role in the backward
    taken by the ReLU's output, saved in its place), or SwiGLU of its gate and up halves, `width` columns on this
    rank: returns fc2's input."""
    sh = rec.shape
    if sh.clamped:  # GPT-OSS's clamped SwiGLU: one kernel, its input kept (the backward computes it again)
        out = rec.tensor(f"{prefix}clamped_swiglu.output", sh.rows * width * sh.e)
        rec.mem(f"{prefix}clamped_swiglu", (hidden,), (out,), saves=(hidden,))
        return out
    if not sh.swiglu:  # the op named for its kind: gelu or relu2
        rec.tensor(f"{prefix}{sh.mlp}.output", sh.rows * width * sh.e)
        rec.mem(f"{prefix}{sh.mlp}", (hidden,), (f"{prefix}{sh.mlp}.output",), saves=(hidden,))
        return f"{prefix}{sh.mlp}.output"
    silu = rec.tensor(f"{prefix}swiglu.silu", sh.rows * width * sh.e)
    out = rec.tensor(f"{prefix}swiglu.output", sh.rows * width * sh.e)
    if sh.eager:  # silu's kernel, then the product's: the same tensors saved
        rec.kernels(f"{prefix}swiglu", eager.swiglu_forward(sh.rows * width, sh.e), saves=(hidden, silu))
        return out
    rec.mem(f"{prefix}swiglu", (hidden,), (silu, out), saves=(hidden, silu))  # silu(gate) and silu(gate) * up
    return out


def _activation_backward(rec: Recorder, name: str, elements: int) -> None:
    """The backward of `name` (gelu, relu2, swiglu or clamped-swiglu) over `elements` values of one `width`-wide tensor."""
    width = elements * rec.shape.e
    if rec.shape.clamped:  # its input and the product's gradient read; the gate's and up's gradients written
        rec.back_mem(f"{name}clamped_swiglu_backward", 3 * width, 2 * width)
    elif rec.shape.swiglu and rec.shape.eager:
        rec.back_kernels(f"{name}swiglu_backward", eager.swiglu_backward(elements, rec.shape.e))
    elif rec.shape.swiglu:  # reads the product's gradient, gate and up, silu(gate); writes the gate's and up's gradients
        rec.back_mem(f"{name}swiglu_backward", 4 * width, 2 * width)
    else:
        rec.back_mem(f"{name}{rec.shape.mlp}_backward", 2 * width, width)


def _mlp(rec: Recorder, prefix: str, inp: str, shard: str | None, width: int, out: str, normed: bool = True) -> str:
    """fc1, its activation and fc2, `width` wide on this rank (the dense MLP's f/t, a MoE's shared experts' whole
    n_shared x expert width): returns fc2's output, `out`."""
    sh = rec.shape
    hidden = column_linear(rec, f"{prefix}fc1", inp, shard, (2 if sh.swiglu else 1) * width, f"{prefix}fc1.output",
                            normed)
    return row_linear(rec, f"{prefix}fc2", _activation(rec, hidden, prefix, width), width, out)


def _mlp_backward(rec: Recorder, prefix: str, width: int, normed: bool = True) -> None:
    row_backward(rec, f"{prefix}fc2", width)
    _activation_backward(rec, prefix, rec.shape.rows * width)
    column_backward(rec, f"{prefix}fc1", (2 if rec.shape.swiglu else 1) * width, normed)


def _mlp_forward(rec: Recorder, model: GPTConfig, moe: bool, ep: int) -> None:
    """ln2, the dense MLP or a mixture of experts (simulator/costs/layers/moe.py: router, routed experts, and the
    shared experts as a dense MLP), dropout, the residual add."""
    sh = rec.shape
    if moe:  # under sequence parallelism on this rank's slice of the tokens (UnitShape.moe)
        moe_input = _pre_norm(rec, "ln2", "ln2.input", "moe.input", linear=False)
        with rec.shaped(sh.moe):
            branch = routed_forward(rec, model, ep, moe_input)
            if model.n_shared_experts:
                shared = _mlp(rec, "shared.", moe_input, None, model.n_shared_experts * model.expert_width,
                              "shared.output", normed=False)
                shared = shared_gate_forward(rec, moe_input, shared) if model.shared_expert_gate else shared
                rec.tensor("moe.output", sh.residual_rows * sh.d * sh.e)
                rec.mem("moe.shared_add", (branch, shared), ("moe.output",))
                branch = "moe.output"
    else:
        shard = _pre_norm(rec, "ln2", "ln2.input", "ln2.output" if sh.sp else "fc1.input")
        if sh.sp:
            rec.tensor("fc1.input", sh.normed_bytes(sh.rows * sh.d) if sh.pre_norms else sh.rows * sh.d * sh.e)
        branch = _mlp(rec, "", "fc1.input" if sh.sp else shard, shard, sh.f // sh.t, "mlp.residual", sh.pre_norms)
    residual_join(rec, "mlp", "ln2.input", _post_norm(rec, "post_mlp_norm", branch), "y",
                  None if moe or sh.post_norms else "fc2")


def _block_backward(rec: Recorder, attention: str, model: GPTConfig, moe: bool, ep: int) -> None:
    sh = rec.shape
    if sh.dropout:
        dropout_backward(rec, "mlp.residual_dropout", sh.residual_rows, sh.d)
    if sh.post_norms:
        norm_backward(rec, "post_mlp_norm")
    if moe:
        with rec.shaped(sh.moe):
            if model.shared_expert_gate:
                shared_gate_backward(rec)
            if model.n_shared_experts:
                _mlp_backward(rec, "shared.", model.n_shared_experts * model.expert_width, normed=False)
            # the MoE input's readers: the router, the gathered rows, the shared experts and their gate
            routed_backward(rec, model, ep, 2 + bool(model.n_shared_experts) + model.shared_expert_gate)
    else:
        _mlp_backward(rec, "", sh.f // sh.t, sh.pre_norms)
    if sh.pre_norms:
        norm_backward(rec, "ln2")
    residual_backward(rec, "mlp")
    if sh.dropout:
        dropout_backward(rec, "attention.residual_dropout", sh.residual_rows, sh.d)
    if sh.post_norms:
        norm_backward(rec, "post_attn_norm")
    row_backward(rec, "proj", sh.heads * sh.value_dim)
    core_backward(rec, attention)
    if sh.latent:
        latent_backward(rec)
    else:
        column_backward(rec, "qkv", sh.qkv_width, sh.pre_norms)
    if sh.pre_norms:
        norm_backward(rec, "ln1")
    residual_backward(rec, "attention")


def block_ops(model: GPTConfig, micro_batch: int, layout: Layout, policy: PrecisionPolicy,
              implementation: Implementation = Implementation(), moe: bool | None = None) -> OpList:
    """One transformer block, forward and backward, for one micro-batch on one tensor-parallel rank: a mixture of
    experts' block when `moe` (None: the kind most of the model's blocks are, as GPTConfig.block_params)."""
    moe = model.is_moe if moe is None else moe and model.is_moe
    for module, has in (("mla_up_proj", model.is_mla), ("moe_act", model.is_moe)):
        if module in implementation.recompute_modules and not has:
            raise ConfigError(f"--recompute-modules {module} recomputes part of "
                              f"{'multi-head latent attention' if module == 'mla_up_proj' else 'a mixture of experts'}"
                              f", which this model has not")
    rec = Recorder(unit_shape(model, micro_batch, layout, policy, implementation))
    if implementation.recompute == OP_RECOMPUTE:
        model.check_op_recompute()
        check_op_layout(rec.shape, implementation.attention)
    _attention_forward(rec, implementation.attention)
    _mlp_forward(rec, model, moe, layout.ep)
    _block_backward(rec, implementation.attention, model, moe, layout.ep)
    if implementation.recompute == OP_RECOMPUTE:
        return op_recompute(rec)
    return rec.finish(implementation.recompute, implementation.recompute_modules)


# ---------------------------------------------------------------- the ends


def embedding_ops(model: GPTConfig, micro_batch: int, layout: Layout, policy: PrecisionPolicy,
                  implementation: Implementation = Implementation()) -> OpList:
    """Token lookup (this rank's share of the vocabulary), the learned positions' add, Gemma's scale, dropout; their
    backward. Rotary positions enter in the attention instead: no add, no position gradient."""
    sh = unit_shape(model, micro_batch, layout, policy, implementation)
    rec = Recorder(sh)
    rows = sh.rows * sh.d * sh.e
    rec.op(MemoryOp("embedding.lookup", rows, rows))  # the rows of the table read, written out
    rec.tensor("embedding.output", rows)
    learned = model.positions == "learned"  # (rotary positions: none here, whichever blocks rotate)
    if learned:
        rec.op(MemoryOp("embedding.position_add", rows + sh.s * sh.d * sh.e, rows))
    scaled = model.embed_scale or model.embed_multiplier != 1  # Gemma's sqrt(d_model) or Granite's multiplier
    if scaled:  # a kernel of its own each way (minigpt/model.py's embedded)
        rec.op(MemoryOp("embedding.scale", rows, rows))
    if sh.dropout:
        mask = rec.tensor("embedding.mask", sh.rows * sh.d * MASK)
        rec.mem("embedding.dropout", ("embedding.output",), ("embedding.output", mask), saves=(mask,))
        dropout_backward(rec, "embedding.dropout", sh.rows, sh.d)
    if learned:
        rec.back_mem("embedding.position_grad", rows, sh.s * sh.d * sh.grad)
    if scaled:
        rec.back_mem("embedding.scale_backward", rows, rows)
    rec.back_mem("embedding.lookup_grad", rows, sh.rows * sh.d * sh.grad)  # into the rows the tokens touched
    return rec.finish("none")


def head_ops(model: GPTConfig, micro_batch: int, layout: Layout, policy: PrecisionPolicy,
             implementation: Implementation = Implementation()) -> OpList:
    """Final norm, the head over this rank's share of the padded vocabulary (16-bit under fp8), the loss."""
    sh = unit_shape(model, micro_batch, layout, policy, implementation)
    rec = Recorder(sh)
    vocab = padded_vocab(model, sh.t) // sh.t
    final = rec.tensor("final_norm.input", sh.residual_rows * sh.d * sh.e, OUTSIDE)
    norm(rec, "final_norm", final, "final_norm.output" if sh.sp else "head.input")
    if sh.sp:
        rec.tensor("head.input", sh.rows * sh.d * sh.e)
    logits = rec.tensor("head.logits", sh.rows * vocab * sh.e)
    rec.gemm("head", sh.rows, vocab, sh.d, sh.compute, ("final_norm.output" if sh.sharded else "head.input",))
    if model.logit_divisor != 1:  # Granite's logits_scaling, a kernel each way (minigpt/model.py's output_logits)
        divided = rec.tensor("head.divided", rec.size[logits])
        rec.mem("head.divide", (logits,), (divided,))
        rec.back_mem("head.divide_backward", rec.size[logits], rec.size[logits])
        logits = divided
    if model.logit_softcap:
        logits = _soft_cap(rec, logits)
    logits32 = rec.tensor("loss.logits_fp32", sh.rows * vocab * FP32)
    rec.mem("loss.to_fp32", (logits,), (logits32,))
    log_probs = rec.tensor("loss.log_probabilities", sh.rows * vocab * FP32)
    rec.mem("loss.softmax", (logits32,), (log_probs,), saves=(log_probs,))  # max, exponentials, their sum: one pass
    if sh.eager:  # nll_loss's backward, log_softmax's, the cast back
        rec.back_kernels("loss.backward", eager.loss_backward(sh.rows, vocab, sh.e))
    else:
        rec.back_mem("loss.backward", sh.rows * vocab * FP32, sh.rows * vocab * sh.e)  # softmax - one-hot, scaled
    rec.back_gemm("head.input_grad", sh.rows, sh.d, vocab, sh.compute)
    weight_gradient(rec, "head", vocab, sh.d, sh.compute)
    norm_backward(rec, "final_norm")
    return rec.finish("none")


def _soft_cap(rec: Recorder, logits: str) -> str:
    """Gemma 2's cap on the logits as minigpt/model.py's output_logits runs it in eager torch: divided, tanh (which
    saves its output for its backward), multiplied, a kernel each; the backward's three the same way (the tanh's
    reads the gradient and the saved output)."""
    size = rec.size[logits]
    scaled, turned = rec.tensor("head.cap_scaled", size), rec.tensor("head.cap_tanh", size)
    rec.mem("head.cap_divide", (logits,), (scaled,))
    rec.mem("head.cap_tanh", (scaled,), (turned,), saves=(turned,))
    capped = rec.tensor("head.capped", size)
    rec.mem("head.cap_multiply", (turned,), (capped,))
    for kernel, read in (("multiply", size), ("tanh", 2 * size), ("divide", size)):
        rec.back_mem(f"head.cap_{kernel}_backward", read, size)
    return capped


def mtp_input_ops(model: GPTConfig, micro_batch: int, layout: Layout, policy: PrecisionPolicy,
                  implementation: Implementation = Implementation()) -> OpList:
    """What one multi-token prediction module runs before its block (minigpt/model.py's MultiTokenPrediction): the
    lookup of the tokens one place on, the two input norms, their concatenation and the 2d -> d projection, over
    the rank's residual rows (the projection whole on every tensor-parallel rank); its block and the head it
    shares are block_ops' and head_ops'."""
    sh = unit_shape(model, micro_batch, layout, policy, implementation)
    rec = Recorder(sh)
    rows = sh.residual_rows * sh.d * sh.e
    rec.op(MemoryOp("mtp.lookup", rows, rows))  # the rows of the table read, written out
    embedded = rec.tensor("mtp.embedded", rows)
    hidden = rec.tensor("mtp.hidden", rows, OUTSIDE)  # the model's normed hidden state, the head's input
    norm(rec, "mtp.enorm", embedded, "mtp.enorm.output")
    norm(rec, "mtp.hnorm", hidden, "mtp.hnorm.output")
    joined = rec.tensor("mtp.joined", 2 * rows)
    rec.mem("mtp.concat", ("mtp.enorm.output", "mtp.hnorm.output"), (joined,))
    rec.tensor("mtp.projected", rows)
    rec.gemm("mtp.eh_proj", sh.residual_rows, sh.d, 2 * sh.d, sh.compute, (joined,))
    rec.back_gemm("mtp.eh_proj.input_grad", sh.residual_rows, 2 * sh.d, sh.d, sh.compute)
    rec.back_gemm("mtp.eh_proj.weight_grad", sh.d, 2 * sh.d, sh.residual_rows, sh.compute)
    rec.back_mem("mtp.eh_proj.accumulate", 2 * 2 * sh.d * sh.d * sh.grad, 2 * sh.d * sh.d * sh.grad)
    rec.back_mem("mtp.concat_grad", 2 * rows, 2 * rows)
    norm_backward(rec, "mtp.hnorm")
    norm_backward(rec, "mtp.enorm")
    rec.back_mem("mtp.lookup_grad", rows, sh.residual_rows * sh.d * sh.grad)  # into the embedding's rows
    return rec.finish("none")


def mtp_units(model: GPTConfig, micro_batch_size: int, layout: Layout, policy: PrecisionPolicy,
              implementation: Implementation) -> list[tuple[OpList, int]]:
    """The multi-token prediction modules on the last chunk, each: its inputs (mtp_input_ops), a block of the
    model's last kind, not recomputed (parallel/recompute.py wraps the model's own blocks), and the shared head once
    more."""
    depth = model.mtp_depth
    if not depth:
        return []
    kept = replace(implementation, recompute="none", recompute_modules=())
    return [(mtp_input_ops(model, micro_batch_size, layout, policy, kept), depth),
            (block_ops(model, micro_batch_size, layout, policy, kept, model.mtp_is_moe), depth),
            (head_ops(model, micro_batch_size, layout, policy, kept), depth)]


def op_rows(ops: OpList) -> list[list]:
    """One row per op: phase, name, GEMM shape (or "-"), HBM bytes, FLOPs: for printing the list."""
    rows = []
    for op in ops.forward + ops.backward + ops.per_step:
        if isinstance(op, Gemm):
            shape = (f"{op.m} x {op.n} x {op.k}" + (f" x{op.batch}" if op.batch > 1 else "") + f" {op.dtype}"
                     + (f" in {op.chunks} chunks" if op.chunks > 1 else "")
                     + (f" on {op.streams} streams" if op.streams else ""))
        elif isinstance(op, FusedAttention):
            shape = " + ".join(f"{g.m}x{g.n}x{g.k}" for g in op.gemms) + f" x{op.gemms[0].batch}"
        else:
            shape = "-"
        rows.append([op.phase, op.name, shape, op.bytes, op.flops])
    return rows
