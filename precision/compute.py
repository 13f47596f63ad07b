"""Compute paths: put a plain model into a policy's compute format, from outside.

On CUDA 16-bit matmuls are native (tensor cores). On a CPU without native
16-bit matmul (about 100x slower than fp32 here) the Linear layers are
emulated: the weights and activations are stored in the 16-bit format, the
matmul upcasts them (exactly) to fp32, accumulates in fp32 and rounds the
result back to 16 bits -- what a tensor core does. Attention, LayerNorm and
GELU run natively in the 16-bit format on both (their CPU kernels already
accumulate in fp32). Under the fp8 policy the blocks' Linears multiply in fp8
(precision/fp8.py); the LM head stays in the 16-bit format, as in Transformer
Engine's recipes, because its logits feed the loss directly.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from precision import fp8
from precision.fp8 import Fp8Linear
from precision.policy import FP8_LINEARS, PrecisionPolicy

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def dtype_of(name: str) -> torch.dtype:
    return DTYPES[name]


class EmulatedMatmul(torch.autograd.Function):
    """y = x @ W^T + b with 16-bit inputs, fp32 accumulation, 16-bit output.

    Saves the 16-bit x and W (not fp32 copies), so activation memory is what a
    native 16-bit run would keep.
    """

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        out = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
        return out.to(x.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        grad32 = grad_out.float()
        grad_x = (grad32 @ weight.float()).to(x.dtype)
        flat_grad = grad32.reshape(-1, grad32.shape[-1])
        grad_w = (flat_grad.t() @ x.reshape(-1, x.shape[-1]).float()).to(weight.dtype)
        grad_b = flat_grad.sum(0).to(weight.dtype) if ctx.has_bias else None
        return grad_x, grad_w, grad_b


class EmulatedLinear(nn.Module):
    """A Linear whose matmul is emulated 16-bit (see EmulatedMatmul); shares the original's Parameters."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return F.linear(x, self.weight, self.bias)
        return EmulatedMatmul.apply(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, emulated 16-bit"


EMULATED_FORMATS = ("bf16", "fp16")  # on a CPU their matmuls run as fp32 matmuls of rounded inputs


def needs_emulation(policy: PrecisionPolicy, device: torch.device) -> bool:
    return device.type == "cpu" and policy.compute in EMULATED_FORMATS


EMULATED = "emulated on CPU (16-bit storage, fp32 accumulation)"
NATIVE = "native"
NATIVE_FP8 = "native fp8 (torch._scaled_mm)"
EMULATED_FP8 = "fp8 emulated on CPU (the fp8 values, dequantised, in fp32 matmuls)"


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def compute_path(policy: PrecisionPolicy, device: torch.device) -> str:
    """How `policy`'s matmuls run on `device`, for the training summary.

    Without fp8: EMULATED or NATIVE. Under fp8: NATIVE_FP8, or, once `_scaled_mm` has
    refused a pair on this device type (precision.fp8.fallbacks(), so call this after
    the steps ran), "fp8 with fallback to dequantised fp32 matmuls for <pairs>: <reason>";
    where the other Linears (the LM head) are emulated, "; other matmuls <EMULATED>" follows.
    """
    emulated = needs_emulation(policy, device)
    if not policy.fp8_linears:
        return EMULATED if emulated else NATIVE
    if device.type in fp8.EMULATED_DEVICES:
        return f"{EMULATED_FP8}; other matmuls {EMULATED}" if emulated else EMULATED_FP8
    refused = [(a, b, why) for (kind, a, b), why in fp8.fallbacks().items() if kind == device.type]
    if refused:
        path = "fp8 with fallback to dequantised fp32 matmuls for " + "; ".join(
            f"{_dtype_name(a)} x {_dtype_name(b)} on {device.type}: {why}" for a, b, why in refused)
    else:
        path = NATIVE_FP8
    return f"{path}; other matmuls {EMULATED}" if emulated else path


def apply_precision(model: nn.Module, policy: PrecisionPolicy, device: torch.device) -> nn.Module:
    """Cast `model`'s parameters to the policy's compute format and swap its Linears for the
    policy's compute path. Parameters are kept (shared), never re-initialised. Buffers keep their own
    format (a MoE's fp64 expert counts and fp32 choice bias: minigpt/moe.py)."""
    model.to(device=device)
    compute = dtype_of(policy.compute)
    for param in model.parameters():  # as nn.Module.to does, parameters only
        param.data = param.data.to(compute)
    emulate = needs_emulation(policy, device)
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if not isinstance(child, nn.Linear):
                continue
            if policy.fp8_linears and name in FP8_LINEARS:
                setattr(parent, name, Fp8Linear.from_linear(child))
            elif emulate:
                setattr(parent, name, EmulatedLinear(child))
    return model
