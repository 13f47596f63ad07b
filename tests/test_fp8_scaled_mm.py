"""The arguments Fp8Linear gives torch._scaled_mm (what CUDA needs), checked on CPU by a spy.

On CPU `_scaled_mm` is looser than cuBLASLt (any shape, any layout, any bias dtype), so a
call that CUDA would refuse still works here; these tests look at the arguments instead.
The CUDA rules they check: a row-major, b column-major, dimensions multiples of 16 (the
pad multiple of "cuda"), scales 0-dim float32 on the operands' device, the bias only
with bf16/fp16 output and in the output dtype, fast accumulation only in the forward.

Tolerance of the numerics test (new path against the old fp32-output-then-cast path): one
unit in the last place of the output dtype, rtol = finfo(dtype).eps (2**-7 for bf16,
2**-23 for fp32), atol 0. Both paths accumulate the same fp8 products in fp32 and round
once to the output dtype; only where the bias enters the fp32 sum may differ (inside
`_scaled_mm` versus after it), which can move the single rounding by at most one ulp,
and an ulp of v is at most eps * |v|. Measured on CPU: bit-identical (fast accumulation
has no effect on CPU). A dropped, doubled or twice-rounded bias, or a wrong output dtype,
is far outside one ulp.
"""

import warnings

import pytest
import torch
from torch import nn

from precision import fp8
from precision.compute import EMULATED, NATIVE, NATIVE_FP8, compute_path
from precision.fp8 import E4M3, E5M2, Fp8Linear, fallbacks, fp8_matmul
from precision.policy import policy

REAL_SCALED_MM = torch._scaled_mm
CPU, CUDA = torch.device("cpu"), torch.device("cuda")
IN, OUT, BATCH, SEQ = 24, 40, 2, 5  # tokens = 10: no dimension is a multiple of 16
TOKENS = BATCH * SEQ
# (a shape, b shape) of each GEMM in call order: forward, dgrad, wgrad.
SHAPES = [((TOKENS, IN), (IN, OUT)), ((TOKENS, OUT), (OUT, IN)), ((OUT, TOKENS), (TOKENS, IN))]
PADDED = [((16, 32), (32, 48)), ((16, 48), (48, 32)), ((48, 16), (16, 32))]


@pytest.fixture(autouse=True)
def clean_registry(monkeypatch):
    """No recorded fallback, and the CPU's GEMMs through _scaled_mm (not emulated): what this module checks."""
    monkeypatch.setattr(fp8, "EMULATED_DEVICES", set())
    fp8.reset_fallbacks()
    yield
    fp8.reset_fallbacks()


@pytest.fixture
def spy(monkeypatch):
    """Record every _scaled_mm call (operands and keyword arguments), then run the real one."""
    calls = []

    def recording(a, b, **kwargs):
        calls.append((a, b, kwargs))
        return REAL_SCALED_MM(a, b, **kwargs)

    monkeypatch.setattr(torch, "_scaled_mm", recording)
    return calls


def old_path(a, b, *, scale_a, scale_b, bias=None, out_dtype=torch.float32, use_fast_accum=False):
    """The previous arithmetic: fp32 output, the bias added in fp32, then one cast."""
    out = REAL_SCALED_MM(a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=torch.float32)
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype)


def run_layer(dtype, bias, seed=0):
    """Forward and backward of an Fp8Linear built like the policy does (model.to(dtype))."""
    torch.manual_seed(seed)
    layer = Fp8Linear.from_linear(nn.Linear(IN, OUT, bias=bias).to(dtype))
    x = torch.randn(BATCH, SEQ, IN, dtype=dtype, requires_grad=True)
    y = layer(x)
    y.backward(torch.randn_like(y))
    return layer, [y.detach(), x.grad, layer.weight.grad] + ([layer.bias.grad] if bias else [])


def is_row_major(t):
    return t.stride() == (t.shape[1], 1)


def is_column_major(t):
    return t.stride() == (1, t.shape[0])


@pytest.mark.parametrize("padded", [False, True], ids=["cpu-pad", "cuda-pad"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_scaled_mm_arguments(spy, monkeypatch, dtype, bias, padded):
    if padded:  # apply CUDA's pad multiple on this CPU
        monkeypatch.setitem(fp8.PAD_MULTIPLE, "cpu", fp8.PAD_MULTIPLE["cuda"])
    layer, results = run_layer(dtype, bias)
    assert len(spy) == 3  # forward, dgrad, wgrad
    for i, (a, b, kw) in enumerate(spy):
        forward = i == 0
        assert (a.dtype, b.dtype) == ((E4M3, E4M3) if forward else (E5M2, E4M3))
        assert is_row_major(a) and is_column_major(b)
        assert (tuple(a.shape), tuple(b.shape)) == (PADDED if padded else SHAPES)[i]
        if padded:
            assert all(d % 16 == 0 for d in (*a.shape, *b.shape))
        for scale in (kw["scale_a"], kw["scale_b"]):
            assert scale.dim() == 0 and scale.dtype == torch.float32 and scale.device == a.device
        assert kw["out_dtype"] == dtype  # activations and weights both have `dtype` here
        assert kw["use_fast_accum"] is forward
        mm_bias = kw.get("bias")
        if forward and bias and dtype == torch.bfloat16:
            assert mm_bias.dtype == torch.bfloat16 and mm_bias.shape == (b.shape[1],)
            assert torch.equal(mm_bias[:OUT], layer.bias.detach())
            assert not mm_bias[OUT:].any()  # padding is zeros
        else:  # no bias, or fp32 output, which CUDA refuses a bias with
            assert mm_bias is None
    assert all(t.dtype == dtype for t in results)
    assert results[0].shape == (BATCH, SEQ, OUT)


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
def test_padding_for_cuda_changes_nothing(monkeypatch, bias):
    _, plain = run_layer(torch.bfloat16, bias)
    monkeypatch.setitem(fp8.PAD_MULTIPLE, "cpu", fp8.PAD_MULTIPLE["cuda"])
    _, padded = run_layer(torch.bfloat16, bias)
    for got, ref in zip(padded, plain):
        assert torch.equal(got, ref)  # zeros add nothing to a dot product


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_new_path_matches_old_fp32_output_path(monkeypatch, dtype, bias):
    _, new = run_layer(dtype, bias)
    monkeypatch.setattr(torch, "_scaled_mm", old_path)
    _, old = run_layer(dtype, bias)
    eps = torch.finfo(dtype).eps
    for got, ref in zip(new, old):
        assert got.dtype == ref.dtype == dtype
        torch.testing.assert_close(got, ref, rtol=eps, atol=0.0)


def refuse_with(error):
    calls = []

    def refusing(a, b, **kwargs):
        calls.append((a.dtype, b.dtype))
        raise error

    return refusing, calls


@pytest.mark.parametrize("error", [ValueError("Invalid scaling configuration."),
                                   RuntimeError("Multiplication of two Float8_e5m2 matrices"),
                                   NotImplementedError("no fp8 kernel")],
                         ids=lambda e: type(e).__name__)
def test_fallback_equals_dequantised_matmul(monkeypatch, error):
    torch.manual_seed(0)
    a, b = torch.randn(7, 9).to(E5M2), torch.randn(9, 5).to(E4M3)
    inv_a, inv_b = torch.tensor(0.5), torch.tensor(0.25)
    bias = torch.randn(5, dtype=torch.bfloat16)
    refusing, calls = refuse_with(error)
    monkeypatch.setattr(torch, "_scaled_mm", refusing)
    with pytest.warns(UserWarning, match="refused"):
        got = fp8_matmul(a, b, inv_a, inv_b, out_dtype=torch.bfloat16, bias=bias)
    expected = ((a.float() * 0.5) @ (b.float() * 0.25) + bias.float()).to(torch.bfloat16)
    assert got.dtype == torch.bfloat16 and torch.equal(got, expected)
    reason = fallbacks()[("cpu", E5M2, E4M3)]
    assert type(error).__name__ in reason and str(error) in reason
    assert list(fallbacks()) == [("cpu", E5M2, E4M3)]
    assert len(calls) == 1


def test_layer_fallback_warns_once_per_pair_and_is_reported(monkeypatch):
    _, native = run_layer(torch.bfloat16, bias=True)
    refusing, calls = refuse_with(ValueError("Invalid scaling configuration."))
    monkeypatch.setattr(torch, "_scaled_mm", refusing)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        layer, fallen_back = run_layer(torch.bfloat16, bias=True)
        layer(torch.randn(BATCH, SEQ, IN, dtype=torch.bfloat16))  # known pair: not retried
    assert sum("refused" in str(w.message) for w in caught) == 2  # one per pair
    assert calls == [(E4M3, E4M3), (E5M2, E4M3)]  # wgrad shares dgrad's pair
    # CPU's _scaled_mm is the dequantised fp32 matmul (measured): same numbers.
    for got, ref in zip(fallen_back, native):
        torch.testing.assert_close(got, ref, rtol=torch.finfo(torch.bfloat16).eps, atol=0.0)
    assert set(fallbacks()) == {("cpu", E4M3, E4M3), ("cpu", E5M2, E4M3)}
    path = compute_path(policy("fp8"), CPU)
    assert path.startswith("fp8 with fallback to dequantised fp32 matmuls for "
                           "float8_e4m3fn x float8_e4m3fn on cpu: ValueError: Invalid scaling")
    assert "float8_e5m2 x float8_e4m3fn on cpu" in path
    assert path.endswith(f"; other matmuls {EMULATED}")  # the LM head stays 16-bit
    assert compute_path(policy("fp8"), CUDA) == NATIVE_FP8  # another device type
    fp8.reset_fallbacks()
    assert fallbacks() == {} and compute_path(policy("fp8"), CPU).startswith(NATIVE_FP8)


def test_out_of_memory_is_not_a_fallback(monkeypatch):
    refusing, _ = refuse_with(torch.OutOfMemoryError("CUDA out of memory"))
    monkeypatch.setattr(torch, "_scaled_mm", refusing)
    with pytest.raises(torch.OutOfMemoryError):
        run_layer(torch.bfloat16, bias=True)
    assert fallbacks() == {}


def test_compute_path_without_fp8():
    assert compute_path(policy("fp32"), CPU) == NATIVE
    assert compute_path(policy("bf16"), CPU) == EMULATED
    assert compute_path(policy("fp16"), CUDA) == NATIVE
    assert compute_path(policy("fp8"), CUDA) == NATIVE_FP8
    assert compute_path(policy("fp8"), CPU) == f"{NATIVE_FP8}; other matmuls {EMULATED}"
    assert EMULATED == "emulated on CPU (16-bit storage, fp32 accumulation)"


def test_mixed_dtypes_each_gemm_writes_its_result_dtype(spy):
    """bf16 activations into an fp32 Linear: y and dx in bf16, dW in fp32, bias cast to bf16."""
    torch.manual_seed(0)
    layer = Fp8Linear.from_linear(nn.Linear(IN, OUT))
    x = torch.randn(BATCH, SEQ, IN, dtype=torch.bfloat16, requires_grad=True)
    y = layer(x)
    y.backward(torch.randn_like(y))
    assert [kw["out_dtype"] for _, _, kw in spy] == [torch.bfloat16, torch.bfloat16, torch.float32]
    assert spy[0][2]["bias"].dtype == torch.bfloat16
    assert (y.dtype, x.grad.dtype) == (torch.bfloat16, torch.bfloat16)
    assert (layer.weight.grad.dtype, layer.bias.grad.dtype) == (torch.float32, torch.float32)
