"""A mixture of experts' ops, forward and backward, as minigpt/moe.py runs them, per rank. Torch-free.

simulator/costs/ops.py's block_ops calls `routed_forward` and `routed_backward` for a MoE block in place of the
dense MLP's fc1, activation and fc2 (the ln2 before, the shared experts -- a dense MLP of width n_shared x
expert width, ops.py's own Linears -- and the residual after are ops.py's). Every kernel below is one torch op of
MoE.forward (route, the dispatch's indices, the experts, the gate multiply, Combine) or of its autograd backward,
with the bytes it reads and writes; int64 indices are 8 bytes, the router's scores fp32 (the model casts the
logits). Per rank, for T = b x s tokens (b x s / cp under context parallelism, whose capacity ranking runs over the
whole sequences' gathered ids, parallel/context/moe.py; tensor parallelism keeps the MoE whole on every rank: each
computes it for all T rows, parallel/tensor/parallelize.py), E experts of width w (in = w, or 2w for SwiGLU),
top_k = k:

  router      one GEMM T x E x d in the compute format (an nn.Linear without bias; never fp8: precision/compute.py
              swaps only qkv, proj, fc1 and fc2), the cast of its logits to fp32, softmax or sigmoid;
  choice      a stable sort of the T x E scores (values and int64 indices), its first k columns copied, the
              chosen scores gathered, renormalised when k > 1 or the router is a sigmoid (a sum and a division)
              unless the model keeps them as they are (GPTConfig.gates_renormalised);
              with a capacity factor, kept_choices' ranking copy, one-hot (T k E int64), cumulative sum, masked
              sum and comparison; dropless: one tensor of ones;
  losses      the balance loss: a one-hot of the choices (T k E int64) summed per sequence, the fp32 shares, the
              mean scores (a sigmoid's normalised first: a sum and a division), and their product; the z-loss: the
              log-sum-exp of the fp32 logits, squared and averaged (the scalar tails of both as one kernel each);
  dispatch    nonzero of the kept slots, the chosen experts gathered, a stable sort of them, the order gathered,
              the per-expert counts (bincount), token = order // k, and the rows gathered (R x d);
  experts     R routed rows (job/exchange/experts.py's routed_rows: T x k dropless, balanced) on E/ep local
              experts as a grouped GEMM: batch E/ep, m = ceil(R / (E/ep)) rows per expert (balanced: each rank
              receives as many rows as it sends), priced by the GEMM model with every expert's tiles in one set of
              waves (simulator/costs/rates/gemm_model.py; docs/efficiency.md "Mixture of experts" says what that rests
              on), or under Implementation.expert_gemms "te-streams" a GEMM per expert, 4 at a time (Gemm.rounds);
              biases inside the GEMM (torch.addmm); GELU, or SwiGLU as one kernel (ops.py's convention); the
              experts' outputs concatenated (torch.cat: a copy); with fp8 experts (Implementation.fp8_experts:
              Transformer Engine's GroupedLinear) the grouped GEMMs run in fp8, their inputs, weights and output
              gradients cast by simulator/costs/layers/fp8.py's kernels, their e4m3 copies saved; under a routing imbalance (Implementation's
              expert_load) the busiest rank of the expert group receives more rows than it sends: its experts run
              on received_rows (their m and element-wise kernels grow), the rows it sent and gets back do not;
  combine     the gates gathered in the rows' order and cast, the gate multiply (saving the rows and their
              gates), a zero T x d buffer and the index_add of the rows into it.

Backward, last op first: Combine's index_select, the gate multiply's two gradients (the rows' and the gate's, a
product and its row sum), the gates' scatter back, each expert's Linears (bias sums, input- and weight-gradient
GEMMs grouped as in the forward, each stacked weight's gradient written once: a grouped GEMM's weight gradient,
as the executor's unbound stacks also give it), the rows' scatter-add into a zero T x d
buffer, the losses' and the choice's gradients into the scores, softmax's or sigmoid's backward, the router's
GEMMs, and the sums of the gradients that meet at the MoE's input (the router's, the gathered rows', the shared
experts'). Expert parallelism's all-to-alls are no ops here: simulator/engine/experts.py prices them.

Saved (what minigpt/moe.py keeps; config.moe_activation_bytes_per_token counts the same): per routed row its
input and output rows, its hidden tensors, its gate, and three int64 indices (its expert, token, place in the
sorted order); per token the fp32 scores, the chosen scores and their sum when renormalised, a sigmoid's sum for
the balance loss, the z-loss's fp32 logits and log-sum-exp; per sequence the balance loss's shares.
"""

from __future__ import annotations

import math

from job.exchange.experts import routed_rows
from minigpt.config import GPTConfig
from simulator.costs.op_types import FP32, MASK, MemoryOp
from simulator.costs.recorder import Recorder
from simulator.costs.layers.fp8 import cast_kernels, fp8_input, fp8_weight

INDEX = 8  # int64 indices (torch's sort, nonzero, gather indices)


def local_experts(model: GPTConfig, ep: int) -> int:
    """Experts on one rank: E / ep (job/train_config.py checks that ep divides E)."""
    return model.n_experts // ep


def received_rows(rows: int, ep: int, load: float = 1.0) -> int:
    """Routed rows the busiest rank of an expert group of `ep` receives for its experts when every rank sends `rows`:
    as many when balanced; under a routing imbalance `load` (the busiest expert's rows over the mean) that many times
    more, at most ep times (all its group's rows). An upper bound: a rank's rows over the mean are at most its
    busiest expert's, its other experts taken as busy. With ep 1 one rank holds every expert and gets its own rows
    whatever their spread (a grouped GEMM runs all experts' tiles in one set of waves): nothing changes."""
    share = min(load, ep)
    return rows if share == 1 else math.ceil(rows * share)


def expert_rows(model: GPTConfig, tokens: int, sequences: int, ep: int, cp: int = 1) -> tuple[int, int]:
    """(routed rows this rank sends, and receives balanced; rows of its busiest local expert); `tokens`: this rank's
    1/cp of each of `sequences` sequences."""
    rows = routed_rows(model, tokens, sequences, cp)
    return rows, math.ceil(rows / local_experts(model, ep))


def _router_forward(rec: Recorder, model: GPTConfig, inp: str) -> tuple[str, str, str]:
    """The router's GEMM, scores, top-k choice and gates: returns (fp32 logits, scores, expert ids)."""
    sh = rec.shape
    tokens, experts, k = sh.rows, model.n_experts, model.top_k
    logits = rec.tensor("router.logits", tokens * experts * sh.e)
    rec.gemm("router", tokens, experts, sh.d, sh.compute, (inp,))
    logits32 = logits
    if sh.e != FP32:  # logits.float(): a copy unless they are fp32 already
        logits32 = rec.tensor("router.logits_fp32", tokens * experts * FP32)
        rec.mem("router.to_fp32", (logits,), (logits32,))
    scores = rec.tensor("router.scores", tokens * experts * FP32)
    rec.mem(f"router.{model.router}", (logits32,), (scores,), saves=(scores,))
    rec.op(MemoryOp("router.sort", tokens * experts * FP32, tokens * experts * (FP32 + INDEX)))
    ids = rec.tensor("router.expert_ids", tokens * k * INDEX)
    rec.op(MemoryOp("router.top_k", tokens * k * INDEX, tokens * k * INDEX))
    chosen = rec.tensor("router.chosen", tokens * k * FP32)
    rec.op(MemoryOp("router.gather", tokens * k * (INDEX + FP32), tokens * k * FP32), saves=(ids,))
    if model.gates_renormalised:
        total = rec.tensor("router.chosen_sum", tokens * FP32)
        rec.mem("router.chosen_sum", (chosen,), (total,))
        rec.tensor("router.gates", tokens * k * FP32)
        rec.mem("router.normalise", (chosen, total), ("router.gates",), saves=(chosen, total))
    if model.capacity_factor is None:
        rec.op(MemoryOp("router.kept", 0, tokens * k * MASK))
    else:  # kept_choices: rank the choices, one-hot them, count each expert's queue, compare with the capacity
        whole = tokens * sh.cp  # under cp over the whole sequences: every rank's ids gathered (parallel/context/moe.py)
        if sh.cp > 1:  # the gathered ids put in token order, and this rank's part of the verdict taken
            rec.op(MemoryOp("router.capacity_order", whole * k * INDEX, whole * k * INDEX))
            rec.op(MemoryOp("router.capacity_local", tokens * k * MASK, tokens * k * MASK))
        one_hot = whole * k * experts * INDEX
        for name, read, written in (("rank", whole * k * INDEX, whole * k * INDEX), ("one_hot", 0, one_hot),
                                    ("cumsum", one_hot, one_hot), ("place", 2 * one_hot, whole * k * INDEX),
                                    ("keep", whole * k * INDEX, whole * k * MASK)):
            rec.op(MemoryOp(f"router.capacity_{name}", read, written))
    return logits32, scores, ids


def _losses_forward(rec: Recorder, model: GPTConfig, logits32: str, scores: str) -> None:
    """The balance loss (per sequence) and the z-loss, as MoE.router_losses computes them."""
    sh = rec.shape
    tokens, experts, k, per_sequence = sh.rows, model.n_experts, model.top_k, sh.b * model.n_experts
    if model.aux_loss_coef:
        one_hot = tokens * k * experts * INDEX
        rec.op(MemoryOp("router.balance_one_hot", tokens * k * INDEX, one_hot))
        rec.op(MemoryOp("router.balance_picks", one_hot, per_sequence * INDEX))
        share = rec.tensor("router.balance_share", per_sequence * FP32)
        rec.op(MemoryOp("router.balance_share", per_sequence * INDEX, per_sequence * FP32))
        probs = scores
        if model.router == "sigmoid":  # normalised over the experts first
            total = rec.tensor("router.score_sum", tokens * FP32)
            rec.mem("router.score_sum", (scores,), (total,))
            probs = rec.tensor("router.probabilities", tokens * experts * FP32)
            rec.mem("router.probabilities", (scores, total), (probs,), saves=(scores, total))
        rec.tensor("router.mean_probabilities", per_sequence * FP32)
        rec.mem("router.balance_mean", (probs,), ("router.mean_probabilities",))
        rec.op(MemoryOp("router.balance_loss", 2 * per_sequence * FP32, FP32), saves=(share,))
    if model.z_loss_coef:
        lse = rec.tensor("router.logsumexp", tokens * FP32)
        rec.mem("router.logsumexp", (logits32,), (lse,), saves=(logits32, lse))
        rec.op(MemoryOp("router.z_loss", tokens * FP32, FP32))


def _dispatch_forward(rec: Recorder, model: GPTConfig, rows: int) -> tuple[str, str, str]:
    """The routed rows' order, their tokens, the rows gathered: returns (order, tokens, gathered rows)."""
    sh = rec.shape
    rec.op(MemoryOp("dispatch.nonzero", sh.rows * model.top_k * MASK, rows * INDEX))
    rec.op(MemoryOp("dispatch.chosen", 2 * rows * INDEX, rows * INDEX))
    rec.op(MemoryOp("dispatch.sort", rows * INDEX, 2 * rows * INDEX))
    order = rec.tensor("dispatch.order", rows * INDEX)
    rec.op(MemoryOp("dispatch.order", 2 * rows * INDEX, rows * INDEX))
    rec.op(MemoryOp("dispatch.bincount", rows * INDEX, model.n_experts * INDEX))
    tokens = rec.tensor("dispatch.tokens", rows * INDEX)
    rec.mem("dispatch.tokens", (order,), (tokens,))
    gathered = rec.tensor("experts.input", rows * sh.d * sh.e)
    rec.op(MemoryOp("dispatch.gather", rows * INDEX + rec.size[gathered], rec.size[gathered]), saves=(tokens,))
    return order, tokens, gathered


def _format(sh) -> str:
    """The experts' GEMM format: fp8 with fp8 experts (Implementation.fp8_experts), else the compute format."""
    return sh.linear if sh.fp8_experts else sh.compute


def _expert_saves(rec: Recorder, name: str, inp: str, rows: int, n: int, k: int) -> tuple[str, ...]:
    """What a grouped expert GEMM of `rows` x `k` inputs to `n` outputs (all local experts' together) keeps for its
    backward: its 16-bit input, or with fp8 experts the e4m3 copies of its input and weights (cast here:
    simulator/costs/layers/fp8.py)."""
    if not rec.shape.fp8_experts:
        return (inp,)
    return (fp8_input(rec, name, inp, k, normed=False, sharded=False, rows=rows), *fp8_weight(rec, name, n, k))


def _experts_forward(rec: Recorder, model: GPTConfig, ep: int, rows: int, gathered: str) -> str:
    """Each local expert's MLP over the `rows` it received, as one grouped GEMM per Linear: returns the concatenated
    outputs."""
    sh = rec.shape
    experts = local_experts(model, ep)
    per_expert = math.ceil(rows / experts)
    width, width_in = model.expert_width, model.expert_in_width
    hidden = rec.tensor("experts.hidden", rows * width_in * sh.e)
    rec.gemm("experts.fc1", per_expert, width_in, sh.d, _format(sh), _expert_saves(rec, "experts.fc1", gathered, rows,
                                                                                  width_in * experts, sh.d), experts,
             streams=sh.expert_streams)
    with rec.module("moe_act"):  # what Megatron-core's recompute_modules moe_act runs again
        if sh.clamped:  # GPT-OSS's: one kernel, its input kept (the backward computes it again)
            act = rec.tensor("experts.clamped_swiglu.output", rows * width * sh.e)
            rec.mem("experts.clamped_swiglu", (hidden,), (act,), saves=(hidden,))
        elif sh.swiglu:
            silu = rec.tensor("experts.swiglu.silu", rows * width * sh.e)
            act = rec.tensor("experts.swiglu.output", rows * width * sh.e)
            rec.mem("experts.swiglu", (hidden,), (silu, act), saves=(hidden, silu))
        else:  # GELU, or the squared ReLU: the same bytes, the op named for its kind
            act = rec.tensor(f"experts.{sh.mlp}.output", rows * width * sh.e)
            rec.mem(f"experts.{sh.mlp}", (hidden,), (act,), saves=(hidden,))
    rec.tensor("experts.pieces", rows * sh.d * sh.e)
    rec.gemm("experts.fc2", per_expert, sh.d, width, _format(sh), _expert_saves(rec, "experts.fc2", act, rows,
                                                                                sh.d * experts, width), experts,
             streams=sh.expert_streams)
    out = rec.tensor("experts.output", rows * sh.d * sh.e)
    rec.mem("experts.concat", ("experts.pieces",), (out,))
    return out


def _combine_forward(rec: Recorder, rows: int, out: str, order: str, tokens: str) -> str:
    """Each row times its gate, summed into its token: returns the T x d result."""
    sh = rec.shape
    gates = rec.tensor("combine.gates", rows * FP32)
    rec.op(MemoryOp("combine.gate_gather", rows * (INDEX + FP32), rows * FP32), saves=(order,))
    if sh.e != FP32:
        gates = rec.tensor("combine.gates_cast", rows * sh.e)
        rec.mem("combine.gate_cast", ("combine.gates",), (gates,))
    weighted = rec.tensor("combine.weighted", rows * sh.d * sh.e)
    rec.mem("combine.gate_multiply", (out, gates), (weighted,), saves=(out, gates))
    combined = rec.tensor("combine.output", sh.rows * sh.d * sh.e)
    rec.op(MemoryOp("combine.zeros", 0, rec.size[combined]))
    rec.op(MemoryOp("combine.index_add", rows * INDEX + rec.size[weighted] + rec.size[combined], rec.size[combined]),
           saves=(tokens,))
    return combined


def routed_forward(rec: Recorder, model: GPTConfig, ep: int, inp: str) -> str:
    """Router, losses, dispatch, the local experts and the combine over `inp` (the ln2 output): returns the routed
    experts' T x d output."""
    sh = rec.shape
    rows, _ = expert_rows(model, sh.rows, sh.b, ep, sh.cp)
    received = received_rows(rows, ep, sh.expert_load)
    logits32, scores, _ = _router_forward(rec, model, inp)
    _losses_forward(rec, model, logits32, scores)
    order, tokens, gathered = _dispatch_forward(rec, model, rows)
    if received != rows:  # the dispatch's all-to-all (no op here) hands the busiest rank more rows than it sent
        gathered = rec.tensor("experts.received", received * sh.d * sh.e)
    out = _experts_forward(rec, model, ep, received, gathered)
    if received != rows:  # and the combine's brings its own rows home
        out = rec.tensor("combine.received", rows * sh.d * sh.e)
    return _combine_forward(rec, rows, out, order, tokens)


# ---------------------------------------------------------------- backward


def weight_gradient(rec: Recorder, name: str, n: int, k: int, m: int, batch: int = 1, dtype: str | None = None,
                    streams: int = 0) -> None:
    """`batch` weight-gradient GEMMs (n x k, over m rows) in `dtype` (default: the compute format) and their
    accumulation into the gradient buffer (fused into the GEMM under wgrad_fusion, as ops.py's Linears); `streams`:
    a GEMM per expert, that many at a time (0: one grouped kernel)."""
    sh = rec.shape
    dtype = dtype or sh.compute
    if sh.wgrad_fusion:
        rec.back_gemm(f"{name}.weight_grad", n, k, m, dtype, batch, out_bytes=2 * FP32, streams=streams)
        return
    rec.back_gemm(f"{name}.weight_grad", n, k, m, dtype, batch, streams=streams)
    rec.back_mem(f"{name}.grad_accumulate", 2 * batch * n * k * sh.grad, batch * n * k * sh.grad)


def _experts_backward(rec: Recorder, model: GPTConfig, ep: int, rows: int, received: int) -> None:
    """Combine, the gate multiply, the gates' scatter, the grouped experts (over the `received` rows), the rows'
    scatter-add (over the `rows` sent)."""
    sh = rec.shape
    experts = local_experts(model, ep)
    per_expert = math.ceil(received / experts)
    width, width_in, row = model.expert_width, model.expert_in_width, rows * sh.d * sh.e
    rec.back_mem("combine.backward", rows * INDEX + row, row)  # index_select of the tokens' gradients
    rec.back_mem("combine.gate_multiply_backward", row + rows * sh.e, row)
    rec.back_mem("combine.gate_grad", 2 * row, row)
    rec.back_mem("combine.gate_grad_sum", row, rows * sh.e)
    if sh.e != FP32:
        rec.back_mem("combine.gate_cast_backward", rows * sh.e, rows * FP32)
    rec.back_mem("combine.gate_scatter", rows * (INDEX + FP32), sh.rows * model.top_k * FP32)
    for name, n, k in (("experts.fc2", sh.d, width), ("experts.fc1", width_in, sh.d)):  # n outputs of k inputs
        if sh.bias:
            rec.back_mem(f"{name}.bias_grad", received * n * sh.e, experts * n * sh.grad)
        if sh.fp8_experts:  # the output gradient cast to e5m2, both layouts (input and weight gradients)
            for kernel, read, written in cast_kernels(sh, f"{name}.cast_grad", received * n, 2):
                rec.back_mem(kernel, read, written)
        rec.back_gemm(f"{name}.input_grad", per_expert, k, n, _format(sh), experts, streams=sh.expert_streams)
        weight_gradient(rec, name, k, n, per_expert, experts, _format(sh), sh.expert_streams)
        if name == "experts.fc2":  # the activation's backward, between the two Linears
            hidden = received * width * sh.e  # one width-wide tensor
            if sh.clamped:  # its input and the product's gradient read; the gate's and up's written
                rec.back_mem("experts.clamped_swiglu_backward", 3 * hidden, 2 * hidden)
            elif sh.swiglu:
                rec.back_mem("experts.swiglu_backward", 4 * hidden, 2 * hidden)
            else:
                rec.back_mem(f"experts.{sh.mlp}_backward", 2 * hidden, hidden)
    tokens = sh.rows * sh.d * sh.e
    rec.back_mem("dispatch.gather_zeros", 0, tokens)
    rec.back_mem("dispatch.gather_backward", row + rows * INDEX + tokens, tokens)  # index_put with accumulate


def _router_backward(rec: Recorder, model: GPTConfig) -> None:
    """The losses' and the gates' gradients into the scores, the scores' backward, the router's GEMMs."""
    sh = rec.shape
    tokens, experts, k = sh.rows, model.n_experts, model.top_k
    scores, per_token, chosen = tokens * experts * FP32, tokens * FP32, tokens * k * FP32
    if model.gates_renormalised:  # gates = chosen / their sum
        rec.back_mem("router.normalise_backward", 2 * chosen + per_token, chosen + per_token)
        rec.back_mem("router.chosen_sum_backward", chosen + per_token, chosen)
    rec.back_mem("router.gather_zeros", 0, scores)
    rec.back_mem("router.gather_backward", chosen + tokens * k * INDEX, scores)
    if model.aux_loss_coef:
        rec.back_mem("router.balance_backward", sh.b * experts * FP32, scores)  # the mean's gradient, expanded
        if model.router == "sigmoid":
            rec.back_mem("router.probabilities_backward", 2 * scores + per_token, scores + per_token)
            rec.back_mem("router.score_sum_backward", scores + per_token, scores)
        rec.back_mem("router.scores_grad_sum", 2 * scores, scores)
    rec.back_mem(f"router.{model.router}_backward", 2 * scores, scores)
    if model.z_loss_coef:
        rec.back_mem("router.z_loss_backward", scores + 2 * per_token, scores)
        rec.back_mem("router.logits_grad_sum", 2 * scores, scores)
    if sh.e != FP32:
        rec.back_mem("router.to_fp32_backward", scores, tokens * experts * sh.e)
    rec.back_gemm("router.input_grad", tokens, sh.d, experts, sh.compute)
    weight_gradient(rec, "router", experts, sh.d, tokens)


def shared_gate_forward(rec: Recorder, inp: str, shared: str) -> str:
    """Qwen2-MoE's gate on the shared experts' output: the GEMM T x 1 x d of the MoE's input, its sigmoid (saved)
    and the product (the shared output saved for the gate's gradient); returns the gated output."""
    sh = rec.shape
    logit = rec.tensor("shared.gate.logit", sh.rows * sh.e)
    rec.gemm("shared.gate", sh.rows, 1, sh.d, sh.compute, (inp,))
    value = rec.tensor("shared.gate.value", sh.rows * sh.e)
    rec.mem("shared.gate.sigmoid", (logit,), (value,), saves=(value,))
    gated = rec.tensor("shared.gated", sh.rows * sh.d * sh.e)
    rec.mem("shared.gate.multiply", (shared, value), (gated,), saves=(shared,))
    return gated


def shared_gate_backward(rec: Recorder) -> None:
    """The product's gradients (the shared output's: grad x gate; the gate's: grad x output, summed over the
    width), the sigmoid's backward, the gate GEMM's input and weight gradients."""
    sh = rec.shape
    rows, wide = sh.rows * sh.e, sh.rows * sh.d * sh.e
    rec.back_mem("shared.gate.multiply_backward", 2 * wide + rows, 2 * wide)
    rec.back_mem("shared.gate.value_grad_sum", wide, rows)
    rec.back_mem("shared.gate.sigmoid_backward", 2 * rows, rows)
    rec.back_gemm("shared.gate.input_grad", sh.rows, sh.d, 1, sh.compute)
    weight_gradient(rec, "shared.gate", 1, sh.d, sh.rows)


def routed_backward(rec: Recorder, model: GPTConfig, ep: int, consumers: int) -> None:
    """The backward of routed_forward; `consumers`: the tensors that read the MoE's input (router, gathered rows, and
    the shared experts when there are some), whose gradients are summed."""
    rows, _ = expert_rows(model, rec.shape.rows, rec.shape.b, ep, rec.shape.cp)
    _experts_backward(rec, model, ep, rows, received_rows(rows, ep, rec.shape.expert_load))
    _router_backward(rec, model)
    grad = rec.shape.rows * rec.shape.d * rec.shape.e
    for _ in range(consumers - 1):
        rec.back_mem("moe.input_grad_sum", 2 * grad, grad)
