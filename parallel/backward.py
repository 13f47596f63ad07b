"""Backward passes from an output and its given gradient, with the same gradients as torch's own calls.

Given an explicit gradient (`out.backward(grad)`, `torch.autograd.grad(out, x, grad)`), torch's autograd
checks the gradient's shape through torch.fx.experimental.symbolic_shapes, which it imports at that first
call: sympy with it, 0.6 s of CPU here, paid by every rank of a pipeline (each stage's backward), of a
recomputed run and of a zero-bubble split, at its first step. The scalar sum(output * grad) has the same
gradients without it: its backward hands `output` ones * grad, which is `grad` exactly, and a scalar's
backward needs no explicit gradient. The product is one elementwise pass over the output, nothing next to
the backward it starts.
"""

from __future__ import annotations

from typing import Sequence

import torch


def weighted_sum(output: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """The scalar whose gradient with respect to `output` is `grad` (which has its shape)."""
    if grad.shape != output.shape:
        raise ValueError(f"a gradient of shape {tuple(grad.shape)} for an output of shape {tuple(output.shape)}")
    with torch.enable_grad():  # also inside an autograd.Function's backward (recomputation), where it is off
        return (output * grad).sum()


def backward_from(output: torch.Tensor, grad: torch.Tensor | None,
                  inputs: Sequence[torch.Tensor] | None = None) -> None:
    """output.backward(grad) (into `inputs` only, where given); grad None: output is a scalar (a loss)."""
    (output if grad is None else weighted_sum(output, grad)).backward(inputs=inputs)


def gradients_from(output: torch.Tensor, inputs: Sequence[torch.Tensor], grad: torch.Tensor | None,
              **options) -> tuple[torch.Tensor | None, ...]:
    """torch.autograd.grad(output, inputs, grad, **options); grad None: output is a scalar (a loss)."""
    return torch.autograd.grad(output if grad is None else weighted_sum(output, grad), inputs, **options)
