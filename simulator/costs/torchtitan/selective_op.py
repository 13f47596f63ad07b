"""torchtitan's selective op checkpointing (`--recompute op`): what a block keeps and what its backward runs again.

torchtitan wraps each transformer block in torch.utils.checkpoint with a policy over the aten ops it runs
(torchtitan's `_apply_ac_to_transformer_block`, `activation_checkpoint.mode = "selective"` with
`selective_ac_option = "op"`, the default of its Llama 3 configs; pytorch/torchtitan at 9dec370, 2024-12-26, the
commit its published Llama 3.1 benchmarks name, benchmarks/llama3_h100_202412_torchtitan.md): the outputs of `aten.mm` and of the flash attention
are kept (MUST_SAVE), except every second mm of the block's forward; everything else is recomputed
(PREFER_RECOMPUTE). torchtitan's Llama block runs its projections as separate Linears, in this order:

    mm 1 wq (kept), 2 wk (recomputed), 3 wv (kept), 4 wo (recomputed),
    SwiGLU: 5 w1, the gate (kept), 6 w3, the up projection (recomputed), 7 w2 (kept);  GELU: 5 fc1 (kept), 6 fc2

and our op lists fuse q, k, v into one GEMM and gate and up into another: the recompute runs the k and up slices
of them again. The backward's recompute stops once every tensor the backward needs exists again
(torch.utils.checkpoint's early stop, on by default): the last residual add, and a GELU MLP's fc2 (its output
feeds only that add), are not run again. Kept per block: its input (the checkpoint's), q and v, the attention's
output and log-sum-exp, and the kept mm outputs of the MLP (w2's too: MUST_SAVE keeps it though nothing reads it);
minigpt/config.py's op_activation_bytes_per_token_per_layer counts the same (simulator/memory.py checks it).
Every other tensor the backward reads (the norms' outputs and statistics, k, the rotated q and k, the up
projection, silu and the product) is made again by the recompute and alive while the block's backward runs.

Described for what the policy was written for (GPTConfig.op_recompute_refusal, check_op_layout): dense blocks of
bias-free Linears without dropout, flash attention, 16-bit Linears (torchao's fp8 ones run `_scaled_mm`, which the
policy of that commit does not keep), no tensor or context parallelism (their collectives' outputs are kept or
rerun by rules of their own)."""

from __future__ import annotations

from dataclasses import replace

from minigpt.config import OP_RECOMPUTE
from minigpt.errors import ConfigError
from simulator.costs.op_types import FP32, RECOMPUTE, FusedAttention, Gemm, OpList, Saved
from simulator.costs.recorder import Recorder, gemm

NOT_RUN_AGAIN = ("mlp.residual_add",)  # after the last tensor the backward needs (early stop)


def check_op_layout(shape, attention: str) -> None:
    """One line for what the op policy is not described for beyond the model's shape (op_recompute_refusal)."""
    reasons = [why for why, refused in (
        ("tensor parallelism", shape.t > 1), ("context parallelism", shape.cp > 1),
        ("fp8 Linears (torchao's _scaled_mm, which the policy does not keep)", shape.fp8),
        ("unfused attention (torchtitan runs scaled_dot_product_attention's flash kernel)", attention != "flash"))
        if refused]
    if reasons:
        raise ConfigError(f"--recompute {OP_RECOMPUTE} (torchtitan's selective op policy) is described without "
                          f"{' and '.join(reasons)}")


def _again(op, sh) -> list:
    """What the recompute runs of one forward op (nothing for a kept mm, the attention, or after early stop)."""
    if isinstance(op, FusedAttention) or op.name in NOT_RUN_AGAIN:
        return []
    if not isinstance(op, Gemm):
        return [replace(op, phase=RECOMPUTE)]
    slices = {"qkv": ("qkv.k", sh.kv_heads * sh.head_dim), "proj": ("proj", op.n)}  # mm 2 and 4
    if sh.swiglu:
        slices["fc1"] = ("fc1.up", sh.f)  # mm 6, w3; w1 and w2 (or GELU's fc1) kept, GELU's fc2 never needed
    if op.name not in slices:
        return []
    name, n = slices[op.name]
    return [gemm(name, op.m, n, op.k, op.dtype, sh.e, op.batch, RECOMPUTE)]


def op_recompute(rec: Recorder) -> OpList:
    """The block under torchtitan's op policy: the same forward and gradients as without recompute, the
    recomputed ops opening the backward, and what is kept and what is made again (the module's docstring)."""
    sh = rec.shape
    plain = rec.finish("none")
    rows, e = sh.rows, sh.e
    kept = [Saved("x", rec.size["x"]), Saved("qkv.q_v", rows * (sh.heads + sh.kv_heads) * sh.head_dim * e),
            Saved("attention.output", rec.size["attention.output"]),
            Saved("attention.logsumexp", rows * sh.heads * FP32, True)]
    if sh.swiglu:
        kept += [Saved("fc1.gate", rows * sh.f * e), Saved("mlp.residual", rec.size["mlp.residual"])]
    else:
        kept.append(Saved("fc1.output", rec.size["fc1.output"]))
    made_again = {"q_k_v": Saved("q_k_v.k", rows * sh.kv_heads * sh.head_dim * e),  # q and v are kept
                  "fc1.output": Saved("fc1.up", rows * sh.f * e)}  # SwiGLU's: the gate is kept
    names = {t.name for t in kept}
    recomputed = tuple(made_again.get(t.name, t) for t in plain.saved if t.name not in names)
    rerun = tuple(again for op in plain.forward for again in _again(op, sh))
    return replace(plain, backward=rerun + plain.backward, saved=tuple(kept), recomputed=recomputed)
