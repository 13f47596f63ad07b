"""Muon's optimizer step (`--optimizer muon`) priced as precision/muon.py and parallel/run/muon.py run it. Torch-free.

On a rank of pipeline stage s, whose group is the stage's dp x cp x tp ranks (n of them), beside AdamW's passes over
the weights that are not matrices (engine/costs.py's optimizer_seconds):

  element-wise   the matrices' Nesterov momentum, the update's packing into the all-to-all and back, the decay and
                 the step (muon_bytes per element of them the rank owns), at the achieved HBM speed;
  all-to-alls    the pieces each rank writes go, in fp32, to the rank each matrix is dealt to, and the orthogonalised
                 matrices come back to every rank holding a piece: each rank sends and receives at most the larger
                 of its own pieces and the matrices dealt to it (times the copies the stage holds of each element, on
                 the way back). Its peers on its own server get their share over NVLink, the others over its NIC, at
                 once: each priced as one flow of the cluster (LinkCosts.flows: its links' bandwidth as NCCL reaches
                 it, and their latency), the slower setting the time. The fabric past a GPU's own links is taken as
                 non-blocking (a rail-optimised fat tree's), as for the expert all-to-all's.
  Newton-Schulz  the busiest rank's matrices, dealt out as training deals them (job/muon.py's assign_matrices, each
                 expert of a stack apart): five steps of three GEMMs each (X X^T, its square, the product with X;
                 the matrices of one shape batched, as training stacks them),
                 priced by the GEMM model (compute.py's Matmul) in bf16 when the job computes in a 16-bit or fp8
                 format (parallel/run/muon.py's iteration_format on a GPU), in fp32 (TF32 off) otherwise.
"""

from __future__ import annotations

from collections import Counter
from functools import lru_cache

from job.layout import Layout
from job.muon import NEWTON_SCHULZ_STEPS, assign_matrices, newton_schulz_flops, stage_matrices
from minigpt.config import GPTConfig
from simulator.costs.compute import EfficiencyProfile, Matmul, hbm_speed
from precision.policy import FORMAT_BYTES
from simulator.costs.hardware import GPUSpec

EXCHANGED = FORMAT_BYTES["fp32"]  # the update's pieces travel in fp32 (parallel/run/muon.py)


def muon_bytes(pol, fused: bool) -> int:
    """Bytes one Muon step moves through memory per matrix element a rank owns, beside the Newton-Schulz GEMMs.

    Not fused (MasterMuon, kernel by kernel, fp32 state s): a 16-bit gradient copied to fp32 (g read, 4 written);
    the norm's squares (s read); the decay's mul_ (2 s); the update's zeros (s written); the gradient scaled (2 s);
    the momentum's mul_ (2 s) and add_ (3 s); the Nesterov add_ (3 s) and its copy into the update (2 s); the pieces
    packed for the all-to-all (2 s) and the returned ones copied into the update (2 s); the step's add_ (3 s); and the
    compute weights copied from the masters (s read, their bytes written) when they are not the masters. fused: the
    gradient read, the momentum and the masters read and written, the compute weights written, the packing beside."""
    per_param = pol.bytes_per_param()
    grad, compute, state = per_param["grad"], per_param["compute"], per_param["adam_m"]  # the momentum's format
    if fused:
        return grad + 2 * state + (2 * state + compute if pol.master else 2 * compute) + 4 * state
    cast = grad + state if grad != state else 0
    passes = 1 + 2 + 1 + 2 + (2 + 3) + (3 + 2) + (2 + 2) + 3
    return cast + passes * state + (state + compute if pol.master else 0)


def _stage_work(model: GPTConfig, layout: Layout, stage: int) -> tuple[int, tuple[tuple[int, int], ...]]:
    """(the stage's matrix elements, the shapes of the matrices dealt to its busiest rank)."""
    return _placed_work(model, layout.pp, layout.virtual_chunks, layout.stage_layers, stage,
                        layout.dp * layout.cp * layout.tp)


@lru_cache(maxsize=1024)
def _placed_work(model: GPTConfig, pp: int, virtual_chunks: int, stage_layers: tuple[int, ...], stage: int,
                 ranks: int) -> tuple[int, tuple[tuple[int, int], ...]]:
    """_stage_work by what it depends on alone (the blocks' placement and the stage's ranks), so that a layout
    search deals each stage's matrices out once for every layout placing them alike."""
    last = pp * virtual_chunks - 1
    placed = Layout(pp=pp, virtual_chunks=virtual_chunks, stage_layers=stage_layers).rank_chunks(model)[stage]
    shapes = stage_matrices(model, [layer for _, layers in placed for layer in layers],
                            any(chunk == last for chunk, _ in placed))
    if not shapes:
        return 0, ()
    dealt = assign_matrices(shapes, ranks)
    busiest = max(dealt, key=lambda keys: sum(newton_schulz_flops(shapes[k]) for k in keys))
    return sum(rows * cols for rows, cols in shapes.values()), tuple(shapes[k] for k in busiest)


def newton_schulz_seconds(shapes, gpu: GPUSpec, profile: EfficiencyProfile | None, dtype: str) -> float:
    """The GEMMs of orthogonalising matrices of `shapes` in `dtype`, those of one shape as one batch (m the shorter
    side, n the longer), one batch after another."""
    seconds = 0.0
    for (rows, cols), count in Counter(tuple(shape) for shape in shapes).items():
        m, n = sorted((rows, cols))
        step = (Matmul("gram", m, m, n, dtype, count).time(gpu, profile)
                + Matmul("square", m, m, m, dtype, count).time(gpu, profile)
                + Matmul("apply", m, n, m, dtype, count).time(gpu, profile))
        seconds += NEWTON_SCHULZ_STEPS * step
    return seconds


def stage_all_to_all(links, stage: int, nbytes: float) -> float:
    """One all-to-all over the stage's ranks in which every rank sends and receives `nbytes`, spread evenly over its
    peers: the share for its own server over NVLink, the rest over its NIC, at once (one flow each, LinkCosts.flows)."""
    group = links.groups("amax_data", stage)[0][0]  # the stage's dp x cp x tp members (GPU ids on the graph path)
    n = len(group)
    if n == 1 or nbytes <= 0:
        return 0.0
    cluster = links.cluster
    server = cluster.node_of(cluster.gpu_id(group[0]))
    local = [r for r in group if cluster.node_of(cluster.gpu_id(r)) == server]
    remote = [r for r in group if cluster.node_of(cluster.gpu_id(r)) != server]
    seconds = 0.0
    if len(local) > 1:
        seconds = links.flows(("muon_local", stage), [(local[0], local[1])], nbytes * (len(local) - 1) / n)
    if remote:
        seconds = max(seconds, links.flows(("muon_remote", stage), [(group[0], remote[0])], nbytes * len(remote) / n))
    return seconds


def muon_seconds(model: GPTConfig, layout: Layout, stage: int, owned_matrices: int, links, gpu: GPUSpec,
                 profile: EfficiencyProfile | None, pol) -> float:
    """The all-to-alls and the Newton-Schulz GEMMs of a rank of `stage` owning `owned_matrices` elements of its
    matrices (the element-wise passes are optimizer_seconds')."""
    total, busiest = _stage_work(model, layout, stage)
    if not total:
        return 0.0
    dealt = sum(rows * cols for rows, cols in busiest)
    copies = layout.dp * layout.cp * layout.tp * owned_matrices / total  # how many ranks hold each element
    there = stage_all_to_all(links, stage, EXCHANGED * max(owned_matrices, dealt))
    back = stage_all_to_all(links, stage, EXCHANGED * max(owned_matrices, dealt * copies))
    return there + back + iteration_seconds(model, layout, stage, gpu, profile, pol)


def iteration_seconds(model: GPTConfig, layout: Layout, stage: int, gpu: GPUSpec, profile: EfficiencyProfile | None,
                      pol) -> float:
    """The Newton-Schulz GEMMs of the busiest rank of `stage`: part of muon_seconds, and on its own a lower bound
    of it (simulator/search/bound.py's)."""
    busiest = _stage_work(model, layout, stage)[1]
    return newton_schulz_seconds(busiest, gpu, profile, "fp32" if pol.compute == "fp32" else "bf16")


def hbm_seconds(elements: int, pol, gpu: GPUSpec, fused: bool) -> float:
    """muon_bytes over `elements` at the achieved HBM speed."""
    return elements * muon_bytes(pol, fused) / hbm_speed(gpu)
