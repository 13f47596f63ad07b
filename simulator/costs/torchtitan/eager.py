"""torchtitan's element-wise code run eagerly (torch.compile off, its default): one kernel per aten op.

With `Implementation.eager` the ops that torchtitan's Llama writes as several torch calls are priced as the
kernels eager PyTorch launches for them, forward and backward (autograd's derivative of each call), instead
of the one fused kernel simulator/costs/ops.py prices by default (what torch.compile, Transformer Engine or a
fused kernel run). Read in pytorch/torchtitan at 9dec370 (2024-12-26; torchtitan/models/norms.py,
torchtitan/models/llama/model.py, train.py), the commit its published Llama 3.1 benchmarks name:

  RMSNorm    `x.float()`, `pow(2)`, `mean(-1)`, `+ eps`, `rsqrt`, `x * rsqrt`, `type_as(x)`, `* weight`: 8 kernels
             (the casts only when the input is 16-bit); it saves the fp32 copy of its input, the rsqrt and the
             16-bit normalised output (for the weight's gradient). Backward: 16 kernels.
  RoPE       per q and k: `float()`, a complex multiply by the frequencies, `type_as`: 3 kernels each (v is not
             touched); nothing saved but the frequencies. Backward: the same three and the frequencies'
             conjugate made real (a small copy).
  repeat_kv  grouped-query attention: k and v copied to every query head (`expand` then `reshape`: 2 copies),
             which the attention then saves; backward: 2 sums over the copies.
  SwiGLU     `silu(w1 x) * w3 x`: 2 kernels; backward 3.
  the loss   `cross_entropy(logits.float(), labels)`: the cast, log_softmax, nll (as ops.py prices it); its
             backward nll_loss_backward (writes the fp32 gradient), log_softmax's backward, the cast back: 3.

Each kernel is (name, bytes read, bytes written), every tensor it reads or writes counted once (a broadcast
operand at its own size). tests/test_sim_eager.py runs the same calls under a torch dispatch mode and checks
these counts kernel by kernel. Residual adds, GELU and LayerNorm are one aten kernel each already."""

from __future__ import annotations

FP32 = 4

Kernels = list[tuple[str, int, int]]


def _cast(name: str, elements: int, source: int, target: int) -> Kernels:
    """A dtype conversion, absent when the dtypes agree (torch returns the tensor itself)."""
    return [] if source == target else [(name, elements * source, elements * target)]


def rmsnorm_forward(rows: int, width: int, e: int) -> Kernels:
    n, r = rows * width, rows * FP32
    return [*_cast("to_fp32", n, e, FP32), ("pow", 4 * n, 4 * n), ("mean", 4 * n, r), ("add_eps", r, r),
            ("rsqrt", r, r), ("mul_rsqrt", 4 * n + r, 4 * n), *_cast("to_input_format", n, FP32, e),
            ("mul_weight", (n + width) * e, n * e)]


def rmsnorm_backward(rows: int, width: int, e: int) -> Kernels:
    n, r = rows * width, rows * FP32
    return [("weight_grad_mul", 2 * n * e, n * e), ("input_grad_mul_weight", (n + width) * e, n * e),
            ("weight_grad_sum", n * e, width * e), *_cast("grad_to_fp32", n, e, FP32), ("mul_input", 8 * n, 4 * n),
            ("mul_rsqrt", 4 * n + r, 4 * n), ("sum_rows", 4 * n, r), ("rsqrt_backward_pow", r, r),
            ("rsqrt_backward_mul", r, r), ("rsqrt_backward_mul2", 2 * r, r), ("mean_backward", r, 4 * n),
            ("pow_backward_pow", 4 * n, 4 * n), ("pow_backward_mul", 4 * n, 4 * n), ("pow_backward_mul2", 8 * n, 4 * n),
            ("add_grads", 8 * n, 4 * n), *_cast("grad_to_input_format", n, FP32, e)]


def rope_forward(elements: tuple[int, ...], table: int, e: int) -> Kernels:
    """`elements`: q's and k's element counts; `table`: the frequencies' bytes (complex64)."""
    kernels = []
    for n in elements:
        kernels += [*_cast("to_fp32", n, e, FP32), ("rotate", 4 * n + table, 4 * n),
                    *_cast("to_input_format", n, FP32, e)]
    return kernels


def rope_backward(elements: tuple[int, ...], table: int, e: int) -> Kernels:
    kernels = []
    for n in elements:
        kernels += [*_cast("grad_to_fp32", n, e, FP32), ("conj_table", table, table),
                    ("rotate_back", 4 * n + table, 4 * n), *_cast("grad_to_input_format", n, FP32, e)]
    return kernels


def repeat_kv_forward(kv_elements: int, repeated: int, e: int) -> Kernels:
    """k and v (each `kv_elements`) copied to every query head (`repeated` elements each)."""
    return [("repeat_k", kv_elements * e, repeated * e), ("repeat_v", kv_elements * e, repeated * e)]


def repeat_kv_backward(kv_elements: int, repeated: int, e: int) -> Kernels:
    return [("sum_k", repeated * e, kv_elements * e), ("sum_v", repeated * e, kv_elements * e)]


def swiglu_forward(elements: int, e: int) -> Kernels:
    return [("silu", elements * e, elements * e), ("mul", 2 * elements * e, elements * e)]


def swiglu_backward(elements: int, e: int) -> Kernels:
    n = elements * e
    return [("mul_gate_grad", 2 * n, n), ("mul_up_grad", 2 * n, n), ("silu_backward", 2 * n, n)]


def loss_backward(rows: int, vocab: int, e: int) -> Kernels:
    n = rows * vocab
    return [("nll_backward", 0, 4 * n), ("log_softmax_backward", 8 * n, 4 * n), *_cast("to_input_format", n, FP32, e)]
