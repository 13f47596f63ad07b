"""The kernels that make a Linear's fp8 copies, by recipe and by who runs them. Torch-free.

simulator/costs/ops.py's Linears call these under the fp8 policy (docs/efficiency.md, "fp8 Linears as they run").
By Implementation:
  fp8_fused_casts false (our executor): each quantisation is precision/fp8.py's Fp8Meta.quantize as torch runs it,
        TORCH_QUANTIZE's six kernels through an fp32 copy (input, weight, output gradient);
  fp8_fused_casts true (Transformer Engine): one kernel per cast writing the row-wise and the transposed copy
        (Hopper's fp8 GEMMs take only K-major operands);
  fp8_scaling "tensor" (DelayedScaling): the scale comes from the amax history, so the cast takes the tensor's own
        amax in the same pass and the LayerNorm before qkv and fc1 writes their e4m3 input itself (LayerNormLinear);
  fp8_scaling "current" (Float8CurrentScaling): the scale comes from the tensor's own amax, which must be known
        before the cast: an amax kernel reads the tensor (nvte_compute_amax), then the cast kernel reads it again;
        the LayerNorm computes its output's amax as it writes it in 16 bits (normalization.cpp's
        FUSED_NORM_AMAX_FP8) and a cast kernel follows; under sequence parallelism a column-parallel Linear's input
        and a row-parallel Linear's output gradient have their amax all-reduced over tp before the cast (one scale
        for the gathered tensor: set_quantizer_amax_reduction_group in linear.py and layernorm_linear.py), which
        simulator/engine/costs.py prices;
  fp8_scaling "block" (MXFP8): one scale byte per 32 elements of every fp8 copy, both directions cast from the
        16-bit tensor in one kernel (by the LayerNorm itself before qkv and fc1);
  fp8_weight_cache: the weight casts run once a step (OpList.per_step) and their copies are the unit's workspace,
        held once, not saved by every micro-batch (false: our executor's per-forward casts);
  fp8_param_gather with the cache: the weights are fp8 parameters (Megatron-core's --fp8-param-gather), so the
        step only transposes them and the workspace keeps the transposed copy;
  fp8_recast (torchao's Float8Linear, current scaling): the forward casts the input and the weight (amax, then one
        row-wise copy each) and saves the 16-bit input; the backward casts the output gradient (both layouts) and the
        input and the weight again, to the layouts its GEMMs take (fp8_recasts); gathered fp8 weights
        (fp8_param_gather) are not cast, the backward transposes them;
  fp8_experts: a mixture of experts' routed experts run their grouped GEMMs in fp8 too (Transformer Engine's
        GroupedLinear under Megatron-core): their inputs, weights and output gradients cast as above, over the rows
        the rank's experts received (simulator/costs/layers/moe.py).
"""

from __future__ import annotations

from simulator.costs.op_types import FP32, OUTSIDE, MemoryOp, Saved
from simulator.costs.recorder import Recorder

# precision/fp8.py's Fp8Meta.quantize as torch runs it, one kernel each: an fp32 copy, |x|, its max, x * scale,
# the clamp to the format's range, the cast; (kernel, bytes read, bytes written) per element, None: the source's.
TORCH_QUANTIZE = (("to_fp32", None, FP32), ("abs", FP32, FP32), ("amax", FP32, 0), ("scale", FP32, FP32),
                  ("clamp", FP32, FP32), ("cast", FP32, 1))
SP_AMAX_INPUTS = ("qkv", "fc1")  # column-parallel: their sequence-parallel input is gathered
SP_AMAX_GRADIENTS = ("proj", "fc2")  # row-parallel: their output gradient is gathered in the backward


def amax_kernel(sh, name: str, elements: int) -> list[tuple[str, int, int]]:
    """Current scaling's amax kernel over `elements` 16-bit values before their cast (nvte_compute_amax: read once,
    nothing written but the amax), as (name, bytes read, bytes written); nothing under the other recipes."""
    return [(name, elements * sh.e, 0)] if sh.fp8_current else []


def cast_kernels(sh, prefix: str, elements: int, copies: int = 1) -> list[tuple[str, int, int]]:
    """(name, bytes read, bytes written) of the kernels that make `copies` fp8 copies of `elements` 16-bit values:
    Transformer Engine's one fused kernel (the copies row-wise and transposed, each with its scales under block
    scaling; current scaling's amax kernel before it), or our executor's torch ops (one copy: TORCH_QUANTIZE)."""
    if sh.fp8_fused:
        return [*amax_kernel(sh, f"{prefix}.amax", elements), (prefix, elements * sh.e, copies * sh.fp8_bytes(elements))]
    return [(f"{prefix}.{kernel}", elements * (sh.e if read is None else read), elements * written)
            for kernel, read, written in TORCH_QUANTIZE]


def fp8_input(rec: Recorder, name: str, inp: str, k: int, normed: bool, sharded: bool, rows: int | None = None) -> str:
    """The e4m3 copy of a Linear's input its backward keeps (returned), and the kernels that make it; `rows`: the
    input's rows (default: the unit's; a grouped expert GEMM's: the rows its experts received)."""
    sh = rec.shape
    elements = (sh.rows if rows is None else rows) * k
    if sh.fp8_recast:  # torchao: a row-wise copy for this GEMM, the 16-bit input saved (cast again in the backward)
        for kernel, read, written in cast_kernels(sh, f"{name}.cast_input", elements):
            rec.op(MemoryOp(kernel, read, written))
        return inp
    saved = rec.tensor(f"{name}.input_fp8", sh.fp8_bytes(elements))
    if normed and sh.fused_norm:  # LayerNormLinear: the norm wrote the quantised input; per tensor the weight
        if not sharded and not sh.fp8_block:  # gradient's transposed copy is made for the backward (the gathered
            rec.mem(f"{name}.transpose_input", (inp,), (saved,))  # shard's in the backward); MXFP8 wrote both
        return saved
    if sh.fp8_fused:  # cast + transpose: the row-wise copy for this GEMM, the transposed one kept
        for kernel, read, written in ([] if normed else amax_kernel(sh, f"{name}.amax_input", elements)):
            rec.op(MemoryOp(kernel, read, written))  # the amax first (a norm before it took it as it wrote it)
        rowwise = rec.tensor(f"{name}.input_rowwise", sh.fp8_bytes(elements))
        rec.mem(f"{name}.cast_input", (inp,), (rowwise, saved))
        return saved
    for kernel, read, written in cast_kernels(sh, f"{name}.cast_input", elements):
        rec.op(MemoryOp(kernel, read, written))
    return saved


def fp8_weight(rec: Recorder, name: str, n: int, k: int) -> tuple[str, ...]:
    """The weight's e4m3 copy: cast in this forward and kept by this micro-batch (returned), or once per step and
    kept for all of them (fp8_weight_cache: the unit's workspace). Transformer Engine keeps it and its transpose;
    with the weights kept in fp8 (fp8_params) the parameter is the row-wise copy and the step makes the transpose
    (Float8Tensor's cached transpose). torchao (fp8_recast) casts the weight in each forward and keeps nothing, or
    with weights gathered in fp8 uses them as they are. Elsewhere, without the cache, fp8 parameters change no cast."""
    sh = rec.shape
    if sh.fp8_recast:  # torchao: the weight's row-wise copy for this GEMM, nothing saved (the 16-bit parameter stays)
        for kernel, read, written in ([] if sh.fp8_params else cast_kernels(sh, f"{name}.cast_weight", n * k)):
            rec.op(MemoryOp(kernel, read, written))  # a gathered fp8 weight is used as it is
        return ()
    if sh.fp8_params and sh.fp8_cache:  # the weight is fp8 already (its parameter): the step makes its transpose
        kept = rec.tensor(f"{name}.weight_fp8_transposed", n * k, OUTSIDE)
        rec.step_mem(f"{name}.transpose_weight", n * k, n * k)
        rec.workspace.append(Saved(kept, rec.size[kept]))
        return ()
    copies = 2 if sh.fp8_fused else 1
    kept = rec.tensor(f"{name}.weight_fp8", copies * sh.fp8_bytes(n * k), OUTSIDE if sh.fp8_cache else None)
    kernels = cast_kernels(sh, f"{name}.cast_weight", n * k, copies)
    if sh.fp8_cache:
        for kernel, read, written in kernels:
            rec.step_mem(kernel, read, written)
        rec.workspace.append(Saved(kept, rec.size[kept]))
        return ()
    for kernel, read, written in kernels:
        rec.op(MemoryOp(kernel, read, written))
    return (kept,)


def fp8_recasts(rec: Recorder, name: str, rows: int, n: int, k: int) -> None:
    """torchao's backward of an fp8 Linear (fp8_recast): the saved 16-bit input cast again to the layout of the weight
    gradient's GEMM, and the weight to the input gradient's (amax, then the cast), or a gathered fp8 weight
    (fp8_param_gather) transposed; `rows` x `k` the input, `n` x `k` the weight."""
    sh = rec.shape
    for kernel, read, written in cast_kernels(sh, f"{name}.recast_input", rows * k):
        rec.back_mem(kernel, read, written)
    if sh.fp8_params:
        rec.back_mem(f"{name}.transpose_weight", n * k, n * k)
        return
    for kernel, read, written in cast_kernels(sh, f"{name}.recast_weight", n * k):
        rec.back_mem(kernel, read, written)


def sp_amax_reductions(forward_ops, sequence_parallel: bool) -> tuple[int, int]:
    """(forward, backward) amax all-reduces over tp that a unit's fp8 Linears (`forward_ops`, its forward op list)
    make under current scaling with sequence parallelism (`sequence_parallel`: with tp > 1): one per gathered input
    of a column-parallel Linear (qkv, fc1, a shared expert's fc1), one per gathered output gradient of a row-parallel
    one (proj, fc2). The routed experts' Linears are whole on every rank: no gather, no reduction."""
    if not sequence_parallel:
        return 0, 0
    names = [op.name.removeprefix("shared.") for op in forward_ops
             if getattr(op, "linear", False) and getattr(op, "dtype", None) == "fp8"]
    return sum(name in SP_AMAX_INPUTS for name in names), sum(name in SP_AMAX_GRADIENTS for name in names)
