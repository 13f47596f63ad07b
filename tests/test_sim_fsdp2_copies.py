"""FSDP2's copies on the compute stream (Implementation.fsdp2_copies, the torchtitan-fsdp2 stack's): every ZeRO-3
gather the schedule issues pays one copy of its unit out of the all-gather buffer, every reduction one copy of its
gradients into the reduce-scatter's buffer, at the GPU's element-wise bandwidth; nothing else pays, and no other
stack or ZeRO stage does."""

from __future__ import annotations

from dataclasses import replace

import pytest

from job.layout import Layout, buckets, stage_units
from job.schedule import GatherParams, ReduceScatterGrads
from minigpt.presets import build_config
from simulator.costs.compute import hbm_speed, kernel_overhead
from simulator.engine.data_parallel import UnitCopies
from simulator.engine.overlap import stack_default
from simulator.engine.simulate import simulate_step, step_schedule
from simulator.search.sweep import ClusterSpec

MODEL = build_config("llama3-8b", n_layers=4, seq_len=2048)
SPEC = ClusterSpec.of("h100-sxm")
TITAN = stack_default("torchtitan-fsdp2", "flash", "none")


def test_a_units_copies_are_its_elements_at_the_bandwidth_and_a_kernel_each():
    copies = UnitCopies(out_s=4e-12, in_s=6e-12, kernel_s=3e-6)
    assert copies.seconds(10**9, False, False) == 0.0
    assert copies.seconds(10**9, True, False) == pytest.approx(4e-3 + 3e-6)
    assert copies.seconds(10**9, False, True) == pytest.approx(6e-3 + 3e-6)
    assert copies.seconds(10**9, True, True) == pytest.approx(10e-3 + 6e-6)


def _compute(layout: Layout, implementation, micro_batches: int = 1) -> float:
    result = simulate_step(MODEL, layout, SPEC.build(8), "bf16", 8 * micro_batches, 1, gpu=SPEC.hardware,
                           overlap="torchtitan-fsdp2", implementation=implementation)
    return result.breakdown["compute"]


def _expected(layout: Layout, micro_batches: int) -> float:
    """The copies of every gather and reduction rank 0's schedule issues, counted from the schedule itself."""
    gpu = SPEC.hardware.gpu
    numel = [buckets(tensors, None, layout.dp)[0].size for tensors in stage_units(MODEL, layout)[0][0]]
    speed, kernel = hbm_speed(gpu), kernel_overhead(gpu)
    seconds = 0.0
    for action in step_schedule(MODEL, layout, micro_batches, "1f1b", 25.0, "bf16").actions[0]:
        if type(action) is GatherParams:  # out of the buffer: read and written in bf16
            seconds += numel[action.bucket] * 2 * 2 / speed + kernel
        elif type(action) is ReduceScatterGrads:  # into the buffer: read in bf16, written in fp32 (FSDP2's reduce)
            seconds += numel[action.bucket] * (2 + 4) / speed + kernel
    return seconds


@pytest.mark.parametrize("reshard,micro_batches", [(True, 1), (False, 1), (True, 2)])
def test_every_gather_and_reduction_pays_its_copy(reshard, micro_batches):
    layout = Layout(dp=8, zero=3, reshard_after_forward=reshard)
    extra = _compute(layout, TITAN, micro_batches) - _compute(layout, replace(TITAN, fsdp2_copies=False),
                                                              micro_batches)
    assert extra == pytest.approx(_expected(layout, micro_batches), rel=1e-9)
    assert extra > 0


def test_kept_gathered_units_copy_out_once():
    """Without resharding after the forward the backward gathers nothing again: fewer copies."""
    resharded = _compute(Layout(dp=8, zero=3), TITAN) - _compute(Layout(dp=8, zero=3), replace(TITAN, fsdp2_copies=False))
    kept = Layout(dp=8, zero=3, reshard_after_forward=False)
    assert _compute(kept, TITAN) - _compute(kept, replace(TITAN, fsdp2_copies=False)) < resharded


def test_only_fsdp2_under_zero3_copies():
    assert TITAN.fsdp2_copies and not stack_default("megatron-core", "flash", "none").fsdp2_copies
    assert not stack_default("executor", "flash", "none").fsdp2_copies  # ours gathers into the parameters' storage
    zero2 = Layout(dp=8, zero=2)
    assert _compute(zero2, TITAN) == _compute(zero2, replace(TITAN, fsdp2_copies=False))
