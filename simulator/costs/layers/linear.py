"""The Linears, norms, dropout and residual joins of a block, as ops (simulator/costs/ops.py explains the model and
assembles them; simulator/costs/layers/fp8.py adds an fp8 Linear's casts). Torch-free."""

from __future__ import annotations

from simulator.costs.op_types import FP32, MASK, OUTSIDE
from simulator.costs.recorder import Recorder
from simulator.costs.layers.fp8 import cast_kernels, fp8_input, fp8_recasts, fp8_weight
from simulator.costs.torchtitan import eager


def linear_forward(rec: Recorder, name: str, inp: str, shard: str | None, n: int, k: int, out: str,
                    normed: bool = False) -> str:
    """A Linear of `k` -> `n` columns on this rank over all rows, writing `out` (before any bias).

    `inp` is the input it multiplies (16-bit, or e4m3 when a fused norm wrote it: `normed`, it follows one); `shard`
    the sequence shard that "sharded" saves instead."""
    sh = rec.shape
    rec.tensor(f"{name}.weight", n * k * sh.e, OUTSIDE)
    saved_input = shard if shard is not None and sh.sharded else None
    if sh.fp8:
        saved = fp8_input(rec, name, inp, k, normed, saved_input is not None)
        saves = (saved_input or saved, *fp8_weight(rec, name, n, k))
    else:
        saves = (saved_input or inp,)
    rec.tensor(out, sh.rows * n * sh.e)
    chunks, margin = sh.split(name)
    rec.gemm(name, sh.rows, n, k, sh.linear, saves, chunks=chunks, margin=margin)
    return out


def linear_backward(rec: Recorder, name: str, n: int, k: int, normed: bool = False) -> None:
    """Input and weight gradients of the Linear above (its output gradient in HBM), and the accumulation.

    Under fp8 the output gradient is cast to e5m2 first; our executor's _scaled_mm then makes the transposed
    copies its layouts need (the weight for the input gradient, the gradient and the input for the weight
    gradient), Transformer Engine's casts wrote them already. `wgrad_fusion`: the weight-gradient GEMM reads and
    writes the fp32 main gradient itself, no accumulation kernel."""
    sh = rec.shape
    if sh.fp8:
        for kernel, read, written in cast_kernels(sh, f"{name}.cast_grad", sh.rows * n, 2):
            rec.back_mem(kernel, read, written)
    chunks, margin = sh.split(f"{name}.input_grad")
    rec.back_gemm(f"{name}.input_grad", sh.rows, k, n, sh.linear, chunks=chunks, margin=margin)
    if sh.fp8 and not sh.fp8_fused:
        rec.back_mem(f"{name}.transpose_weight", n * k, n * k)
    if sh.fp8_recast:  # torchao saved the 16-bit input and weight: both are cast again
        fp8_recasts(rec, name, sh.rows, n, k)
    elif sh.sharded and sh.fp8:  # the input shard, gathered again, is made e4m3 (transposed) again for the weight gradient
        if normed and sh.fused_norm:
            if not sh.fp8_block:
                rec.back_mem(f"{name}.transpose_input", sh.rows * k, sh.rows * k)
        else:
            for kernel, read, written in cast_kernels(sh, f"{name}.cast_input", sh.rows * k):
                rec.back_mem(kernel, read, written)
    if sh.fp8 and not sh.fp8_fused:
        rec.back_mem(f"{name}.transpose_grad", sh.rows * n, sh.rows * n)
        rec.back_mem(f"{name}.transpose_input", sh.rows * k, sh.rows * k)
    weight_gradient(rec, name, n, k, sh.linear)


def weight_gradient(rec: Recorder, name: str, n: int, k: int, dtype: str) -> None:
    """The weight-gradient GEMM and its accumulation into the gradient buffer (fused into it under wgrad_fusion)."""
    sh = rec.shape
    margin = sh.split(f"{name}.weight_grad")[1]  # a bulk overlap's: never in chunks
    if sh.wgrad_fusion:
        rec.back_gemm(f"{name}.weight_grad", n, k, sh.rows, dtype, out_bytes=2 * FP32, margin=margin)
        return
    rec.back_gemm(f"{name}.weight_grad", n, k, sh.rows, dtype, margin=margin)
    rec.back_mem(f"{name}.grad_accumulate", 2 * n * k * sh.grad, n * k * sh.grad)


def _bias_add(rec: Recorder, name: str, inp: str, out: str, rows: int, n: int) -> None:
    bias = rec.tensor(f"{name}.bias", n * rec.shape.e, OUTSIDE)
    rec.tensor(out, rows * n * rec.shape.e)
    rec.mem(f"{name}.bias_add", (inp, bias), (out,))


def _bias_in_gemm(sh, name: str) -> bool:
    """Whether a column-parallel Linear's bias is added and reduced by its GEMMs (Transformer Engine's cuBLASLt bias
    epilogues: bias_fusion "te"); fc1's is the activation's under any fusion (Megatron's bias_gelu, bias_swiglu)."""
    return sh.bias_fusion == "te" and not name.endswith("fc1")


def _column_bias(sh, name: str) -> bool:
    """Whether the column-parallel Linear `name` (qkv, or an MLP's fc1) has a bias."""
    return sh.qkv_bias if name == "qkv" else sh.bias


def column_linear(rec: Recorder, name: str, inp: str, shard: str | None, n: int, out: str, normed: bool = True) -> str:
    """A column-parallel Linear (qkv, fc1) from d to `n` columns on this rank, and its bias when the shape has one;
    `normed`: a norm wrote its input (a MoE's shared experts read the router's: not normed for them)."""
    sh = rec.shape
    fused = sh.bias_fusion != "none" and (name.endswith("fc1") or _bias_in_gemm(sh, name))
    if not _column_bias(sh, name) or fused:  # no bias kernel (fused: the GEMM's epilogue or the activation's kernel adds it)
        return linear_forward(rec, name, inp, shard, n, sh.d, out, normed)
    matmul = linear_forward(rec, name, inp, shard, n, sh.d, f"{name}.matmul", normed)
    _bias_add(rec, name, matmul, out, sh.rows, n)
    return out


def row_linear(rec: Recorder, name: str, inp: str, k: int, out: str) -> str:
    """A row-parallel Linear (proj, fc2) from `k` columns on this rank to d, summed over the group (all-reduced, or
    reduce-scattered to the sequence shard), and its bias, added after the sum, when the shape has one."""
    sh = rec.shape
    linear_forward(rec, name, inp, None, sh.d, k, f"{name}.matmul")
    added = sh.bias and sh.bias_fusion == "none"  # else the residual join adds it (Megatron's bias_dropout_add)
    total = rec.tensor(f"{name}.sum" if added else out, sh.residual_rows * sh.d * sh.e)
    if added:
        _bias_add(rec, name, total, out, sh.residual_rows, sh.d)
    return out


def column_backward(rec: Recorder, name: str, n: int, normed: bool = True) -> None:
    if _column_bias(rec.shape, name) and not _bias_in_gemm(rec.shape, name):
        _bias_backward(rec, name, rec.shape.rows, n)
    linear_backward(rec, name, n, rec.shape.d, normed)


def row_backward(rec: Recorder, name: str, k: int) -> None:
    if rec.shape.bias:
        _bias_backward(rec, name, rec.shape.residual_rows, rec.shape.d)
    linear_backward(rec, name, rec.shape.d, k)


def _bias_backward(rec: Recorder, name: str, rows: int, n: int) -> None:
    rec.back_mem(f"{name}.bias_grad", rows * n * rec.shape.e, n * rec.shape.grad)


def norm(rec: Recorder, name: str, inp: str, out: str, out_bytes: int | None = None) -> None:
    """A LayerNorm or RMSNorm over the residual rows: saves its input and its fp32 statistics. `out_bytes`: what it
    writes (default its output in the compute format; the next fp8 Linear's quantised input where it makes it)."""
    sh = rec.shape
    rows = sh.residual_rows
    rec.tensor(out, rows * sh.d * sh.e if out_bytes is None else out_bytes)
    stats = rec.tensor(f"{name}.statistics", rows * sh.norm_statistics * FP32, small=True)
    if _eager_rmsnorm(sh):  # torchtitan's RMSNorm in eager PyTorch (simulator/costs/torchtitan/eager.py): it saves
        # the fp32 copy of its input, the statistic (its rsqrt) and the 16-bit normalised output
        saved = (rec.tensor(f"{name}.input_fp32", rows * sh.d * FP32), stats,
                 rec.tensor(f"{name}.normalised", rows * sh.d * sh.e))
        rec.kernels(name, eager.rmsnorm_forward(rows, sh.d, sh.e), saves=saved)
        return
    rec.mem(name, (inp,), (out, stats), saves=(inp, stats))


def _eager_rmsnorm(sh) -> bool:
    return sh.eager and sh.norm_statistics == 1


def norm_backward(rec: Recorder, name: str) -> None:
    sh = rec.shape
    rows = sh.residual_rows
    if _eager_rmsnorm(sh):
        rec.back_kernels(f"{name}.backward", eager.rmsnorm_backward(rows, sh.d, sh.e))
        return
    rec.back_mem(f"{name}.backward", 2 * rows * sh.d * sh.e + rows * sh.norm_statistics * FP32, rows * sh.d * sh.e)


def _residual_dropout(rec: Recorder, name: str, inp: str) -> str:
    """Dropout on the residual branch (when dropout > 0): returns what is added to the stream."""
    sh = rec.shape
    if not sh.dropout:
        return inp
    rows = sh.residual_rows
    out, mask = rec.tensor(f"{name}.residual_dropped", rows * sh.d * sh.e), rec.tensor(f"{name}.residual_mask", rows * sh.d * MASK)
    rec.mem(f"{name}.residual_dropout", (inp,), (out, mask), saves=(mask,))
    return out


def residual_join(rec: Recorder, name: str, stream: str, branch: str, out: str, bias_of: str | None) -> None:
    """The branch's dropout and its sum with the stream into `out`; under bias_fusion one kernel with the row-parallel
    Linear `bias_of`'s bias (Megatron's bias_dropout_add_fused_train), saving the mask."""
    sh = rec.shape
    rows = sh.residual_rows
    rec.tensor(out, rows * sh.d * sh.e)
    if sh.bias_fusion == "none":
        rec.mem(f"{name}.residual_add", (stream, _residual_dropout(rec, name, branch)), (out,))
        return
    mask = (rec.tensor(f"{name}.residual_mask", rows * sh.d * MASK),) if sh.dropout else ()
    bias = (rec.tensor(f"{bias_of}.bias", sh.d * sh.e, OUTSIDE),) if sh.bias and bias_of else ()
    rec.mem(f"{name}.bias_dropout_add", (stream, branch, *bias), (out, *mask), saves=mask)


def dropout_backward(rec: Recorder, name: str, rows: int, width: int) -> None:
    """`name`: the dropout op's name."""
    e = rec.shape.e
    rec.back_mem(f"{name}_backward", rows * width * (e + MASK), rows * width * e)


def residual_backward(rec: Recorder, name: str) -> None:
    """The two gradients that meet at a residual join (the stream's and the branch's) are summed."""
    sh = rec.shape
    n = sh.residual_rows * sh.d * sh.e
    rec.back_mem(f"{name}.residual_grad_sum", 2 * n, n)
