"""ZeRO-3's copies on the compute stream (Implementation.zero3_copies): every gather and reduction the schedule issues
pays the copies its implementation makes, at the GPU's element-wise bandwidth and a kernel launch each, and nothing
else does. FSDP2 (the torchtitan-fsdp2 stack): a copy of the unit out of the all-gather buffer after each gather, and
of its gradients into the reduce-scatter's buffer (in fp32) before each reduction. Our executor (parallel/data/zero3.py):
nothing at a gather (it gathers into the parameters' storage); at a reduction the staging buffer zero-filled, each
gradient copied in, the whole divided, and the reduced piece added to the shard. Megatron-core's buffers: none."""

from __future__ import annotations

from dataclasses import replace

import pytest

from job.layout import Layout, buckets, stage_units
from job.schedule import Backward, Forward, GatherParams, ReduceScatterGrads
from minigpt.presets import build_config
from simulator.costs.compute import hbm_speed, kernel_overhead
from simulator.engine.data_parallel import UnitCopies
from simulator.engine.overlap import stack_default
from simulator.engine.simulate import simulate_step, step_schedule
from simulator.search.sweep import ClusterSpec

MODEL = build_config("llama3-8b", n_layers=4, seq_len=2048)
SPEC = ClusterSpec.of("h100-sxm")
STACKS = {name: stack_default(name, "flash", "none") for name in ("torchtitan-fsdp2", "executor", "megatron-core")}


def test_a_units_copies_are_its_elements_at_the_bandwidth_and_a_kernel_each():
    fsdp2 = UnitCopies(out_s=4e-12, in_s=6e-12, kernel_s=3e-6)
    assert fsdp2.seconds(10**9, 7, False, False) == 0.0
    assert fsdp2.seconds(10**9, 7, True, False) == pytest.approx(4e-3 + 3e-6)
    assert fsdp2.seconds(10**9, 7, False, True) == pytest.approx(6e-3 + 3e-6)
    staging = UnitCopies(out_s=0.0, in_s=10e-12, kernel_s=3e-6, out_kernels=0, in_kernels=3, per_tensor=True)
    assert staging.seconds(10**9, 7, True, False) == 0.0  # gathered in place
    assert staging.seconds(10**9, 7, False, True) == pytest.approx(10e-3 + (3 + 7) * 3e-6)  # a copy per tensor


def _compute(stack: str, layout: Layout, copies: bool = True, micro_batches: int = 1) -> float:
    implementation = STACKS[stack] if copies else replace(STACKS[stack], zero3_copies="none")
    result = simulate_step(MODEL, layout, SPEC.build(8), "bf16", 8 * micro_batches, 1, gpu=SPEC.hardware,
                           overlap=stack, implementation=implementation)
    return result.breakdown["compute"]


def _expected(stack: str, layout: Layout, micro_batches: int) -> float:
    """The copies of every gather and reduction rank 0's schedule issues, counted from the schedule itself."""
    gpu = SPEC.hardware.gpu
    units = stage_units(MODEL, layout)[0][0]
    numel = [buckets(tensors, None, layout.dp)[0].size for tensors in units]
    speed, kernel = hbm_speed(gpu), kernel_overhead(gpu)
    seconds = 0.0
    schedule = step_schedule(MODEL, layout, micro_batches, "1f1b", 25.0, "bf16")
    actions = schedule.actions[0]
    summing, compute = schedule.config.zero3_hold > 1, None
    for index, action in enumerate(actions):
        after = next((actions[index + 1 : index + 1 + k] for k in range(len(actions) - index)
                      if index + 1 + k == len(actions) or type(actions[index + 1 + k]) in (Forward, Backward)), ())
        if type(action) in (Forward, Backward):
            compute = action
        if summing and type(action) is Backward and not any(
                type(a) is ReduceScatterGrads for a in after):  # summed, not reduced
            # ours: added into the staging (the first: zero-filled and copied in, as many bytes); FSDP2: accumulated
            # in fp32 (the first micro-batch's gradient cast to it: bf16 read, fp32 written)
            per = 3 * 2 if stack == "executor" else 2 + 4 if action.micro_batch == 0 else 2 + 2 * 4
            for n, tensors in zip(numel, units):
                seconds += n * per / speed + len(tensors) * kernel
        if type(action) not in (GatherParams, ReduceScatterGrads):
            continue
        n = numel[action.bucket]
        if stack == "torchtitan-fsdp2" and type(action) is GatherParams:  # out of the buffer, read and written in bf16
            seconds += n * 2 * 2 / speed + kernel
        elif stack == "torchtitan-fsdp2" and summing and compute.micro_batch > 0:  # the last gradient summed too, then
            seconds += n * (2 + 2 * 4 + 2 * 4) / speed + (1 + len(units[action.bucket])) * kernel  # the fp32 sum in
        elif stack == "torchtitan-fsdp2":  # into the reduce-scatter's buffer: bf16 read, fp32 written
            seconds += n * (2 + 4) / speed + kernel
        elif type(action) is ReduceScatterGrads:  # ours: zeros, copy in, divide; the piece added to the shard
            seconds += n * 2 * (1 + 2 + 2 + 3 / layout.dp) / speed + (3 + len(units[action.bucket])) * kernel
    return seconds


@pytest.mark.parametrize("stack", ["torchtitan-fsdp2", "executor"])
@pytest.mark.parametrize("reshard,micro_batches,once", [(True, 1, False), (False, 1, False), (True, 2, False),
                                                         (False, 3, True)])
def test_every_gather_and_reduction_pays_its_copies(stack, reshard, micro_batches, once):
    """And, held all step (--sync-grads-once), every backward that sums its gradients without a reduction."""
    layout = Layout(dp=8, zero=3, reshard_after_forward=reshard, sync_grads_once=once)
    extra = _compute(stack, layout, True, micro_batches) - _compute(stack, layout, False, micro_batches)
    assert extra == pytest.approx(_expected(stack, layout, micro_batches), rel=1e-9)
    assert extra > 0


def test_fsdp2_copies_kept_gathered_units_out_once():
    """Without resharding after the forward the backward gathers nothing again: fewer copies out."""
    kept, resharded = Layout(dp=8, zero=3, reshard_after_forward=False), Layout(dp=8, zero=3)
    stack = "torchtitan-fsdp2"
    assert _compute(stack, kept) - _compute(stack, kept, False) < _compute(stack, resharded) - _compute(
        stack, resharded, False)


def test_which_stack_copies_what():
    assert [STACKS[name].zero3_copies for name in STACKS] == ["fsdp2", "staging", "none"]
    assert _compute("megatron-core", Layout(dp=8, zero=3)) == _compute("megatron-core", Layout(dp=8, zero=3), False)
    zero2 = Layout(dp=8, zero=2)  # the copies are ZeRO-3's
    assert _compute("executor", zero2) == _compute("executor", zero2, False)
