"""Multi-head latent attention's projections (DeepSeek-V2, arXiv 2405.04434, section 2.1), as minigpt/model.py's
LatentAttention runs them, from the block's input to the fused q, k, v tensor the attention core reads, and back.
Torch-free; simulator/costs/ops.py calls these in place of the qkv Linear.

Per rank, with query latent q, key/value latent c, rotated key r (L = q + c + r), a/t heads of query and key width
hd (the last r columns rotated: hd - r unrotated) and value width v, B rows (b s) and, under sequence parallelism,
B/t residual rows:
- ln1 writes the block's normed input (residual rows; saved by the down projection, and by the query projection
  where there is no query latent);
- the down projection (d -> L) runs whole on every rank over its residual rows (not split: Megatron-core's
  linear_q_down_proj and linear_kv_down_proj are duplicated too); its output is saved by the latent norms;
- the two RMSNorms (one kernel each; two fp32 1/rms per row, one without a query latent) and the concatenation of
  the normed latents with the rotated key (one kernel), saved by the up projections: under sequence parallelism
  all-gathered over the group first (tp_collectives.py counts it: L per row where qkv's input was d), else
  the same on every rank (its gradient all-reduced);
- the up projections, column-parallel over the heads: q -> a/t hd (from the block's input when there is no query
  latent: a column-parallel Linear of d), c -> a/t (hd - r + v);
- the heads assembled: each key's unrotated columns with the rotated key repeated per head (one kernel), then q, k
  and v side by side (another): the fused tensor of (a/t)(2 hd + v) columns the core reads.
Backward, in reverse: the fused gradient's pieces are views (no kernel) but kv_up's output gradient is made
contiguous (one copy) and the rotated key's summed over the heads (one reduction); the up projections' input and
weight gradients; the latent's gradient concatenated from its three pieces (one kernel) before the group's
collective; the norms' backward (reading their input, 1/rms and the output gradient) and the down output's
gradient concatenated again; the down projection's gradients; where the queries come from the block's input, its
two gradients summed (one kernel).
Not modelled: Transformer Engine's fusion of a latent norm with the up projection after it (its
LayerNormColumnParallelLinear: the norm writes e4m3 under fp8); here the norms write the compute format and an fp8
up projection casts it.
"""

from __future__ import annotations

from dataclasses import replace

from simulator.costs.layers.linear import column_backward, column_linear, linear_backward, linear_forward, norm
from simulator.costs.op_types import FP32, MemoryOp, UnitShape
from simulator.costs.layers.attention import rope_forward
from simulator.costs.recorder import Recorder


def _local(sh: UnitShape) -> UnitShape:
    """The shape the down projection and latent norms run on: this rank's residual rows, no collective around."""
    return replace(sh, rows=sh.residual_rows, sp=False, sharded=False, ub_chunks=False)


def latent_forward(rec: Recorder, x: str) -> str:
    """From the block's input `x` to the fused q, k, v tensor: returns its name."""
    sh = rec.shape
    q_lora, kv_lora, rope = sh.latent
    width, e = sum(sh.latent), sh.e
    with rec.module("layernorm"):
        norm(rec, "ln1", x, "down.input")
    with rec.shaped(_local(sh)):
        linear_forward(rec, "down", "down.input", None, width, sh.d, "down.output")
    rows = sh.residual_rows
    stats = rec.tensor("latent_norm.statistics", rows * (2 if q_lora else 1) * FP32, small=True)
    normed = (q_lora + kv_lora) * rows * e
    rec.op(MemoryOp("latent_norm", normed, normed + rec.size[stats]), saves=("down.output", stats))
    rec.tensor("latent.normed", rows * width * e)
    rec.op(MemoryOp("latent.concat", rows * width * e, rows * width * e))
    up_input, shard = ("latent.gathered", "latent.normed") if sh.sp else ("latent.normed", None)
    if sh.sp:
        rec.tensor("latent.gathered", sh.rows * width * e)  # all-gathered along the sequence
    if not q_lora and sh.sp:
        rec.tensor("q_up.input", sh.rows * sh.d * e)
    with rec.module("mla_up_proj"):  # what Megatron-core's recompute_modules mla_up_proj runs again
        return _up_projections(rec, up_input, shard)


def _up_projections(rec: Recorder, up_input: str, shard: str | None) -> str:
    """The query and key/value up projections, the fused q, k, v they make and its rotation: returns that."""
    sh, e = rec.shape, rec.shape.e
    q_lora, kv_lora, rope = sh.latent
    heads, hd, vd = sh.heads, sh.head_dim, sh.value_dim
    if q_lora:
        linear_forward(rec, "q_up", up_input, shard, heads * hd, q_lora, "q_up.output")
    else:  # a column-parallel Linear over the block's normed input (gathered under sequence parallelism)
        column_linear(rec, "q_up", "q_up.input" if sh.sp else "down.input", "down.input" if sh.sp else None,
                      heads * hd, "q_up.output", normed=False)
    linear_forward(rec, "kv_up", up_input, shard, heads * (hd - rope + vd), kv_lora, "kv_up.output")
    keys = rec.tensor("attention.keys", sh.rows * heads * hd * e)
    rec.op(MemoryOp("attention.assemble_keys", sh.rows * (heads * (hd - rope) + rope) * e, rec.size[keys]))
    qkv = rec.tensor("q_k_v", sh.rows * sh.qkv_width * e)
    values = sh.rows * heads * vd * e  # kv_up's value columns
    rec.op(MemoryOp("attention.assemble", rec.bytes_of("q_up.output", keys) + values, rec.size[qkv]))
    return rope_forward(rec, qkv)


def latent_backward(rec: Recorder) -> None:
    """The gradients of latent_forward's ops, last first, down to the normed input's (ln1's backward is the
    caller's)."""
    sh = rec.shape
    q_lora, kv_lora, rope = sh.latent
    width, e, heads, hd, vd = sum(sh.latent), sh.e, sh.heads, sh.head_dim, sh.value_dim
    key_value = sh.rows * heads * (hd - rope + vd) * e
    rec.back_mem("attention.assemble_backward", key_value, key_value)  # dk's unrotated columns and dv, contiguous
    rec.back_mem("attention.rotated_key_grad", sh.rows * heads * rope * e, sh.rows * rope * e)  # summed over heads
    linear_backward(rec, "kv_up", heads * (hd - rope + vd), kv_lora)
    if q_lora:
        linear_backward(rec, "q_up", heads * hd, q_lora)
    else:
        column_backward(rec, "q_up", heads * hd, normed=False)
    rec.back_mem("latent.concat_backward", sh.rows * width * e, sh.rows * width * e)
    rows = sh.residual_rows
    normed = (q_lora + kv_lora) * rows * e
    rec.back_mem("latent_norm_backward", 2 * normed + rows * (2 if q_lora else 1) * FP32, normed)
    rec.back_mem("latent_norm.concat_backward", rows * width * e, rows * width * e)
    with rec.shaped(_local(sh)):
        linear_backward(rec, "down", width, sh.d)
    if not q_lora:  # the normed input's gradients from the down and the query projections, summed
        rec.back_mem("ln1.output_grad_sum", 2 * rows * sh.d * e, rows * sh.d * e)
