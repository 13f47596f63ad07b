"""Recording a unit's ops (simulator/costs/ops.py's rule): the tensors each op makes, reads and saves, the recompute
regions they are made in, and what a recomputation keeps and runs again (Recorder.finish); `gemm`, the GEMM op of
an operand shape and format."""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import replace
from typing import Iterator

from simulator.costs.implementation import RECOMPUTE_MODULES
from simulator.costs.op_types import (BACKWARD, BLOCK, CORE, FORWARD, GEMM_INPUT_BYTES, RECOMPUTE, RECOMPUTED_REGIONS,
                                      STEP, Gemm, MemoryOp, Op, OpList, Saved, UnitShape)

# Megatron-core's recompute_modules the simulator describes: the block's two norms, a mixture of experts' activation,
# multi-head latent attention's up projections (with the rotation), and core_attn (the attention core: --recompute
# selective's region). The first three run as its CheckpointWithoutOutput: their outputs are freed once the op after
# them has read them, and computed again from their inputs before that op's backward.
MODULES = {name: CORE if name == "core_attn" else f"module.{name}" for name in RECOMPUTE_MODULES}


class Recorder:
    """Tensors by name (bytes on this rank, where they are made) and the ops that read, write and save them."""

    def __init__(self, shape: UnitShape) -> None:
        self.shape = shape
        self.size: dict[str, int] = {}
        self.small: set[str] = set()
        self.made_in: dict[str, str] = {}
        self.forward: list[tuple[Op, str, tuple[str, ...]]] = []
        self.backward: list[Op] = []
        self.region = BLOCK
        self.region_inputs: dict[str, list[str]] = {}
        self.per_step: list[Op] = []
        self.workspace: list[Saved] = []

    @contextmanager
    def shaped(self, shape: UnitShape) -> Iterator[None]:
        """Record the ops inside on `shape` (a MoE's on UnitShape.moe), the unit's own again after."""
        outer, self.shape = self.shape, shape
        try:
            yield
        finally:
            self.shape = outer

    @contextmanager
    def module(self, name: str) -> Iterator[None]:
        """Record the ops inside in module `name`'s region (MODULES), the region before after."""
        outer, self.region = self.region, MODULES[name]
        try:
            yield
        finally:
            self.region = outer

    def enter(self, region: str, inputs: tuple[str, ...] = ()) -> None:
        """Record the ops that follow in `region`; `inputs`: what it reads from before it, which a recompute of
        the region keeps (parallel/recompute.py saves the attention core's input, the fused qkv output)."""
        self.region = region
        self.region_inputs.setdefault(region, []).extend(inputs)

    def tensor(self, name: str, nbytes: int, region: str | None = None, small: bool = False) -> str:
        self.size[name] = nbytes
        self.made_in[name] = region or self.region
        if small:
            self.small.add(name)
        return name

    def bytes_of(self, *names: str) -> int:
        return sum(self.size[n] for n in names)

    def mem(self, name: str, reads: tuple[str, ...], writes: tuple[str, ...], saves: tuple[str, ...] = ()) -> None:
        self.forward.append((MemoryOp(name, self.bytes_of(*reads), self.bytes_of(*writes)), self.region, saves))

    def gemm(self, name: str, m: int, n: int, k: int, dtype: str, saves: tuple[str, ...] = (), batch: int = 1,
             linear: bool = True, chunks: int = 1, margin: int = 0, streams: int = 0) -> None:
        self.forward.append((gemm(name, m, n, k, dtype, self.shape.e, batch, FORWARD, linear, chunks, margin,
                                  streams), self.region, saves))

    def op(self, op: Op, saves: tuple[str, ...] = ()) -> None:
        """Any op built by hand (FlashAttention, a lookup whose bytes are no tensor of ours)."""
        self.forward.append((op, self.region, saves))

    def kernels(self, name: str, kernels: list[tuple[str, int, int]], saves: tuple[str, ...] = ()) -> None:
        """Several forward kernels of one op (`name`.kernel), what the op saves held from the first."""
        for i, (kernel, read, written) in enumerate(kernels):
            self.forward.append((MemoryOp(f"{name}.{kernel}", read, written), self.region, saves if i == 0 else ()))

    def back_kernels(self, name: str, kernels: list[tuple[str, int, int]]) -> None:
        for kernel, read, written in kernels:
            self.backward.append(MemoryOp(f"{name}.{kernel}", read, written, BACKWARD))

    def back_mem(self, name: str, read: int, written: int) -> None:
        self.backward.append(MemoryOp(name, read, written, BACKWARD))

    def step_mem(self, name: str, read: int, written: int, keeps: tuple[str, ...] = ()) -> None:
        """A kernel run once per step (not per micro-batch); `keeps`: what it writes and the step's micro-batches
        all use, held once (the unit's workspace)."""
        self.per_step.append(MemoryOp(name, read, written, STEP))
        self.workspace.extend(Saved(n, self.size[n]) for n in keeps)

    def back_gemm(self, name: str, m: int, n: int, k: int, dtype: str, batch: int = 1, linear: bool = True,
                  out_bytes: int | None = None, chunks: int = 1, margin: int = 0, streams: int = 0) -> None:
        """`out_bytes` per result element (default the compute format's): 2 x 4 when it accumulates into fp32."""
        out = self.shape.e if out_bytes is None else out_bytes
        self.backward.append(gemm(name, m, n, k, dtype, out, batch, BACKWARD, linear, chunks, margin, streams))

    def finish(self, recompute: str, modules: tuple[str, ...] = ()) -> OpList:
        """The unit, with recompute's rule (simulator/costs/ops.py): a saved tensor is dropped when the op that makes it
        and every op that saves it are recomputed, and a recomputed region's inputs are kept; the recomputed ops
        open the backward. `modules` (MODULES' names): what a module recomputed without its output makes is dropped
        whoever saves it (core_attn: the core, as selective recomputation); a block recomputed whole reruns them too."""
        regions_of = {region for _, region, _ in self.forward}
        discarded = tuple(MODULES[m] for m in modules if MODULES[m] != CORE)
        again = tuple(dict.fromkeys(RECOMPUTED_REGIONS[recompute] + (CORE,) * ("core_attn" in modules) + discarded))
        if BLOCK in again:  # the modules' ops are the block's
            again += tuple(r for r in regions_of if r.startswith("module.") and r not in again)
            discarded = ()
        savers: dict[str, list[str]] = {}
        for _, region, saves in self.forward:
            for name in saves:
                savers.setdefault(name, []).append(region)
        kept, dropped = [], []
        for name, regions in savers.items():
            made = self.made_in[name]
            gone = made in again and (made in discarded or all(r in again for r in regions))
            (dropped if gone else kept).append(Saved(name, self.size[name], name in self.small))
        for region in again:  # a recomputed region keeps its input, unless that is recomputed too or kept anyway
            for name in self.region_inputs.get(region, ()):
                if self.made_in[name] not in again and name not in savers:
                    kept.append(Saved(name, self.size[name], name in self.small))
        rerun = tuple(replace(op, phase=RECOMPUTE) for op, region, _ in self.forward if region in again)
        return OpList(forward=tuple(op for op, _, _ in self.forward), backward=rerun + tuple(self.backward),
                      saved=tuple(kept), recomputed=tuple(dropped), per_step=tuple(self.per_step),
                      workspace=tuple(self.workspace))


def gemm(name: str, m: int, n: int, k: int, dtype: str, out_bytes: int, batch: int = 1, phase: str = FORWARD,
         linear: bool = True, chunks: int = 1, margin: int = 0, streams: int = 0) -> Gemm:
    """A Gemm whose bytes are its operands in `dtype` and its result in `out_bytes` per element; run in `chunks` of
    its rows, it reads the k x n operand once per chunk; `margin`: SMs it leaves to a collective; `streams`: its batch
    entries each a kernel of its own, that many at a time (0: one kernel)."""
    nbytes = batch * ((m * k + chunks * k * n) * GEMM_INPUT_BYTES[dtype] + m * n * out_bytes)
    return Gemm(name, m, n, k, dtype, batch, nbytes, phase, linear, chunks, margin, streams)


WEIGHT_GRADIENT_OPS = (".weight_grad", ".grad_accumulate", ".bias_grad", ".position_grad", ".lookup_grad")


def is_weight_gradient(op: Op) -> bool:
    """Whether a backward op belongs to the weight gradients (zero-bubble schedules run them apart)."""
    return op.phase == BACKWARD and op.name.endswith(WEIGHT_GRADIENT_OPS)
