"""Zero-bubble schedules' split backward: activation gradients now, parameter gradients later."""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from parallel.backward import backward_from, gradients_from
from parallel.recompute import SPLIT
from precision.fp8 import split_backward


class WeightGradients:
    """A chunk's backward split in two: activation gradients now, parameter gradients later.

    While a micro-batch runs forward through a chunk, forward hooks keep the output of
    every module that holds parameters of its own (Linear, LayerNorm, Embedding, the
    bias of a row-parallel Linear). `input_gradient` (BackwardInput) runs
    torch.autograd.grad from the chunk's output to its input and those outputs, keeping
    the graph: autograd computes only what those need, so every weight-gradient GEMM is
    skipped, while the tensor-parallel collectives on the activation path run. What it
    returns is the input gradient; the gradients of the kept outputs wait.
    `weight_gradients` (BackwardWeight) then starts, module by module in backward order,
    torch.autograd.backward from each kept output with its kept gradient to the module's
    own parameters only. Such a backward passes only the module's own operations (its
    input does not depend on its own parameters: every parameter belongs to one module,
    each module runs once a forward), and it accumulates into .grad as a whole backward
    does, so ZeRO's post-accumulate hooks, the tied embedding's hook and sequence
    parallelism's parameter all-reduces fire here, in the same order on every rank.

    A recomputed block or attention core (parallel/recompute.py) runs its forward without a graph, so nothing of it
    is kept then; its rerun comes inside `input_gradient`, which hands it `split_rerun` (recompute.SPLIT): the rerun
    keeps the outputs of its modules with parameters the same way, and their gradients wait with the chunk's.
    """

    def __init__(self, chunks: list[nn.Module]):
        self.params: dict[int, list[nn.Parameter]] = {}
        self.hooks = []  # the forward hooks, removed by `detach` (a calibration times the split on a unit's model)
        owner: dict[int, str] = {}
        for chunk in chunks:
            for name, module in chunk.named_modules():
                params = list(module.parameters(recurse=False))
                for param in params:
                    if id(param) in owner:
                        raise ValueError(f"chunk {chunk.index}: parameter of {name} is also one of "
                                         f"{owner[id(param)]}: a zero-bubble schedule needs unshared weights")
                    owner[id(param)] = name
                if params:
                    self.params[id(module)] = params
                    self.hooks.append(module.register_forward_hook(self.keep))
        self.capturing: list | None = None
        self.reruns: list[list] = []  # fully recomputed blocks' waiting gradients, in the order their reruns came
        self.kept: dict[tuple[int, int], list[tuple[nn.Module, torch.Tensor]]] = {}
        self.waiting: dict[tuple[int, int], list[tuple[list[nn.Parameter], torch.Tensor, torch.Tensor]]] = {}

    def keep(self, module: nn.Module, args, output) -> None:
        if self.capturing is not None and torch.is_grad_enabled():
            if not isinstance(output, torch.Tensor):
                raise TypeError(f"{type(module).__name__} returns {type(output).__name__}: the zero-bubble "
                                "split needs modules with parameters to return one tensor")
            self.capturing.append((module, output))

    def forward(self, chunk: nn.Module, x: torch.Tensor, key: tuple[int, int], targets=None):
        """chunk(x, targets), keeping the outputs of its modules with parameters for `key`'s backward."""
        out, self.kept[key] = self.captured(lambda: chunk(x) if targets is None else chunk(x, targets))
        return out

    def captured(self, run: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, list]:
        """run()'s output and the (module, output) pairs of its modules with parameters, in the order they ran."""
        self.capturing = []
        try:
            return run(), self.capturing
        finally:
            self.capturing = None

    def split(self, out: torch.Tensor, x: torch.Tensor, grad: torch.Tensor | None, kept: list) -> tuple:
        """The gradient of x, and the (params, output, gradient) each kept module's weights wait with; the graph
        kept for them."""
        outputs = [output for _, output in kept]
        with split_backward("input"):  # an fp8 Linear quantises its gradient here, once, for both halves
            grads = gradients_from(out, [x, *outputs], grad, retain_graph=True, allow_unused=True)
        waiting = [(self.params[id(module)], output, g)
                   for (module, output), g in zip(kept, grads[1:]) if g is not None]
        return grads[0], waiting

    def input_gradient(self, key, out: torch.Tensor, grad: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
        kept = self.kept.pop(key)
        modules = [module for module, _ in kept]
        if len(set(map(id, modules))) < len(modules):
            raise RuntimeError("a module with parameters ran twice in one forward: the zero-bubble split "
                               "would count its gradient twice")
        self.reruns, SPLIT[0] = [], self.split_rerun
        try:
            grad_x, waiting = self.split(out, x, grad, kept)
        finally:
            SPLIT[0] = None
        self.waiting[key] = waiting + [entry for rerun in reversed(self.reruns) for entry in rerun]  # blocks in order
        return grad_x

    def split_rerun(self, rerun: Callable[[], torch.Tensor], again: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        """A recomputed block's (or core's) backward in the first half (parallel/recompute.py's SPLIT): its forward
        again, captured as a chunk's is, its input's gradient returned, its weights' waiting with the chunk's."""
        out, kept = self.captured(rerun)
        grad_x, waiting = self.split(out, again, grad, kept)
        self.reruns.append(waiting)
        return grad_x

    def weight_gradients(self, key, before: Callable[[list[nn.Parameter]], None]) -> None:
        """The parameter gradients of `key`, module by module, last first; `before(params)` ahead of each."""
        for params, output, grad in reversed(self.waiting.pop(key)):
            before(params)
            with split_backward("weight"):
                backward_from(output, grad, inputs=params)

    def detach(self) -> None:
        """The chunks' modules as they were before: their forward hooks removed."""
        for hook in self.hooks:
            hook.remove()
        self.hooks.clear()

    def reset(self) -> None:
        self.kept.clear()
        self.waiting.clear()
