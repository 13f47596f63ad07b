"""torch's context parallelism as torchtitan runs it (simulator/costs/torchtitan/context.py): the kernels priced
around each step's attention call against those torch's own _templated_ring_attention (forward and backward) launches,
counted by a dispatch mode on a fake process group in this process (its collectives do nothing), on the group's last
rank; and what they add to torchtitan's long-context rows."""

import json

import pytest
import torch
from click.testing import CliRunner
import torch.distributed as dist
from torch.distributed.tensor.experimental._context_parallel import _attention as ring
from torch.testing._internal.distributed.fake_pg import FakeStore

from cli.main import main
from dispatched_kernels import Kernels
from job.layout import Layout
from minigpt.presets import build_config
from precision.policy import policy
from simulator.costs.op_types import Implementation
from simulator.costs.ops import block_ops
from simulator.costs.torchtitan import context

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
        out.append((name, 0 if name in ("zero_", "zeros_like") else read, written // 2 if name == "log_sigmoid_forward" else written))
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


def _same(priced, seen):
    assert len(priced) == len(seen), ([k for k, _, _ in priced], [k for k, _, _ in seen])
    assert sorted((r, w) for _, r, w in priced) == sorted((r, w) for _, r, w in seen)


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
    _same(context.forward_kernels(cp, B * T, HEADS, HD, e), _kernels(forward.seen))
    _same(context.backward_kernels(cp, B * T, HEADS, HD, e), _kernels(backward.seen))


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


def test_the_prediction_says_how_the_blocks_are_merged():
    """`minigpt simulate --json`'s provenance names torch's merges under the torchtitan stack, the fused kernel's
    online softmax under our executor's."""
    def merge(overlap):
        result = CliRunner().invoke(main, ["simulate", "--model", "llama3-8b", "--seq-len", "16384", "--cp", "2",
                                           "--gpu", "h100-sxm", "--overlap", overlap, "--json"])
        assert result.exit_code == 0, result.output
        return json.loads(result.output)["provenance"]["context"]["merge"]

    assert merge("torchtitan-fsdp2").startswith("by torch's context_parallel")
    assert merge("executor") == "inside the fused kernel's online softmax"
