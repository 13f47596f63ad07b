"""torch's context parallelism as torchtitan runs it (simulator/costs/torchtitan/context.py): the kernels priced
around each step's attention call against those torch's own _templated_ring_attention (forward and backward) launches,
counted by a dispatch mode on a fake process group in this process (its collectives do nothing), on the group's last
rank, with the collectives those functions issue; and what they add to torchtitan's long-context rows."""

import json

import pytest
import torch
import torch.distributed as dist
from click.testing import CliRunner
from torch.distributed.tensor.experimental._context_parallel import _attention as ring
from torch.testing._internal.distributed.fake_pg import FakeStore

from cli.main import main
from dispatched_kernels import Kernels, same_kernels
from job.layout import Layout
from minigpt.presets import build_config
from precision.policy import policy
from simulator.costs.op_types import Implementation
from simulator.costs.ops import block_ops
from simulator.costs.torchtitan import context
from simulator.engine.context import torch_layer_exchange

B, HEADS, T, HD = 1, 2, 8, 4  # a rank's micro-batch, heads, tokens (s / cp) and head size
# what makes no kernel of its own: slices and allocations, the collectives (priced apart), their waits and wrappers
NOT_KERNELS = {"split", "slice", "empty", "empty_like", "wait_tensor", "_wrap_tensor_autograd",
               "all_gather_into_tensor", "all_to_all_single"}


def _attention_step(q, k, v, is_causal=False, **kwargs):
    """The SDPA kernel's place in the ring (its own cost is the fused op's): an output and an fp32 log-sum-exp."""
    return torch.empty_like(q), torch.empty(q.shape[:3], dtype=torch.float32)


def _attention_step_backward(query, key, value, out, logsumexp, is_causal=False, **kwargs):
    return torch.empty_like(query), torch.empty_like(key), torch.empty_like(value)


def _kernels(seen):
    """(name, read, written) of the kernels a GPU runs: zero-fills read nothing, and log_sigmoid_forward's buffer is
    empty on CUDA (the CPU kernel fills one the size of its output)."""
    out = []
    for name, read, written in seen:
        if name in NOT_KERNELS:
            continue
        read = 0 if name in ("zero_", "zeros_like") else read
        out.append((name, read, written // 2 if name == "log_sigmoid_forward" else written))
    return out


@pytest.fixture
def last_rank_of(request):
    cp = request.param
    dist.init_process_group("fake", store=FakeStore(), rank=cp - 1, world_size=cp)
    method = ring._cp_options.rotate_method
    ring._cp_options.rotate_method = ring._RotateMethod.ALL_GATHER  # torchtitan's default rotate method
    try:
        yield cp
    finally:
        ring._cp_options.rotate_method = method
        dist.destroy_process_group()


@pytest.mark.parametrize("last_rank_of", [2, 4], indirect=True)
def test_the_kernels_around_torchs_ring_attention_steps(last_rank_of):
    cp, e = last_rank_of, 2
    q, k, v = (torch.randn(B, T, HEADS, HD, dtype=torch.bfloat16).transpose(1, 2) for _ in range(3))
    with Kernels() as forward:
        out, lse = ring._templated_ring_attention(dist.group.WORLD, 2, _attention_step, q, k, v, is_causal=True)
    grad_out = torch.ones_like(out)
    with Kernels() as backward:
        ring._templated_ring_attention_backward(dist.group.WORLD, 2, _attention_step_backward, grad_out, "grad_out",
                                                q, k, v, out, lse, True)
    same_kernels(context.forward_kernels(cp, B * T, HEADS, HD, e), _kernels(forward.seen))
    same_kernels(context.backward_kernels(cp, B * T, HEADS, HD, e), _kernels(backward.seen))
    # and the collectives they issue: each all-gather's input, each all-to-all's buffer (one peer gets it all)
    gathers, passes = context.exchanges(cp, B * T * HEADS * HD, e)
    assert _collectives(forward.seen) == [(x.kind, x.bytes) for x in gathers for _ in range(x.calls)]
    assert _collectives(backward.seen) == [(x.kind, x.bytes) for x in passes for _ in range(x.calls)]


def _collectives(seen):
    kinds = {"all_gather_into_tensor": "all_gather", "all_to_all_single": "p2p"}
    return [(kinds[name], read) for name, read, _ in seen if name in kinds]


def test_only_torchs_context_parallelism_adds_them_and_the_recompute_runs_them_again():
    model = build_config("llama3-8b", seq_len=4096)
    ops = {(impl, cp): block_ops(model, 1, Layout(cp=cp, cp_kind="allgather"), policy("bf16"),
                                 Implementation(recompute="full", cp_attention=impl))
           for impl in ("fused", "torch") for cp in (1, 4)}
    names = {key: [op.name for op in (*o.forward, *o.backward)] for key, o in ops.items()}
    merged = [n for n in names["torch", 4] if n.startswith("attention.cp.")]
    assert not any(n.startswith("attention.cp.") for key in (("fused", 1), ("fused", 4), ("torch", 1))
                   for n in names[key])
    forward, backward = context.forward_kernels(4, 1024, 32, 128, 2), context.backward_kernels(4, 1024, 32, 128, 2)
    assert len(merged) == 2 * len(forward) + len(backward)  # the forward's twice: full recomputation runs it again
    extra = sum(op.bytes for op in (*ops["torch", 4].forward, *ops["torch", 4].backward)) - sum(
        op.bytes for op in (*ops["fused", 4].forward, *ops["fused", 4].backward))
    assert extra == sum(r + w for _, r, w in forward) * 2 + sum(r + w for _, r, w in backward)  # nothing else moves
    n = 1024 * 32 * 128  # a rank's output elements: its 1,024 tokens x 32 heads x 128
    assert 100 * n * 4 < extra < 200 * n * 4  # some 150 fp32 passes over the output a layer


def test_the_prediction_says_how_the_blocks_are_merged_and_exchanged():
    """`minigpt simulate --json`'s provenance names torch's merges and exchange under the torchtitan stack, the fused
    kernel's online softmax and our ring under our executor's."""
    def context_of(overlap):
        result = CliRunner().invoke(main, ["simulate", "--model", "llama3-8b", "--seq-len", "16384", "--cp", "2",
                                           "--gpu", "h100-sxm", "--overlap", overlap, "--json"])
        assert result.exit_code == 0, result.output
        return json.loads(result.output)["provenance"]["context"]

    torchs, ours = context_of("torchtitan-fsdp2"), context_of("executor")
    assert torchs["merge"].startswith("by torch's context_parallel") and torchs["exchange"].startswith("torch's")
    assert ours["merge"] == "inside the fused kernel's online softmax" and ours["exchange"].startswith("passes hidden")


class FlatLinks:
    """A cp group's links at fixed prices: 1 ms an all-gather, 2 ms a ring pass, whatever the bytes."""

    def cp_collective(self, stage, kind, nbytes):
        return 1e-3

    def cp_pass(self, stage, nbytes):
        return 2e-3


def test_torchs_exchange_hides_behind_the_steps_but_the_last_pass():
    model, layout = build_config("llama3-8b", seq_len=4096), Layout(cp=4, cp_kind="allgather")
    hidden = torch_layer_exchange(model, layout, 1, 2, "full", FlatLinks(), 0, (1.0, 1.0, 1.0))
    assert hidden[0].seconds == 0 and hidden[1].seconds == pytest.approx(2e-3)  # only the last dk/dv pass waits
    exposed = torch_layer_exchange(model, layout, 1, 2, "full", FlatLinks(), 0, (0.0, 0.0, 0.0))  # gloo: nothing hides
    assert exposed[0].seconds == pytest.approx(1e-3)
    assert exposed[1].seconds == pytest.approx(2 * 1e-3 + 4 * 2e-3)  # the recomputed and backward's gathers, 4 passes
    elements = 4096 // 4 * 32 * 128  # the rank's keys over every query head
    assert [(x.kind, x.calls, x.bytes) for x in exposed[1].priced] == [
        ("all_gather", 1, 2 * elements * 2), ("all_gather", 1, 2 * elements * 2), ("p2p", 4, 2 * elements * 4)]
