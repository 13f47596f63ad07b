"""torchtitan's element-wise code in eager PyTorch (simulator/costs/torchtitan/eager.py): the kernels priced for each op
against the kernels torch itself launches for the same calls, counted by a dispatch mode, and what eager pricing
does to a block and to torchtitan's published 8-GPU run."""

import json

import click
import pytest
import torch
import torch.nn.functional as F
from click.testing import CliRunner

from cli.commands.simulate import simulate
from cli.main import Group
from job.layout import Layout
from dispatched_kernels import Kernels, same_kernels
from minigpt.presets import build_config
from precision.policy import policy
from simulator.costs.torchtitan import eager
from simulator.costs.op_types import Implementation
from simulator.costs.ops import block_ops

B, S, HEADS, KV, HD, D, FF, VOCAB = 2, 16, 4, 2, 8, 32, 48, 40


def _run(fn, inputs):
    """(forward kernels, backward kernels) of fn(*inputs), every input differentiated (no accumulation kernels)."""
    with Kernels() as forward:
        outs = fn(*inputs)
    outs = outs if isinstance(outs, tuple) else (outs,)
    grads = [torch.ones_like(o) for o in outs]
    with Kernels() as backward:
        torch.autograd.grad(outs, inputs, grads)
    return forward.seen, backward.seen


def _leaf(*shape, dtype):
    return torch.randn(*shape, dtype=dtype, requires_grad=True)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rmsnorm_as_torchtitan_writes_it(dtype):
    e = torch.finfo(dtype).bits // 8
    weight = torch.ones(D, dtype=dtype, requires_grad=True)

    def rmsnorm(x, w):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).type_as(x) * w

    forward, backward = _run(rmsnorm, (_leaf(B, S, D, dtype=dtype), weight))
    same_kernels(eager.rmsnorm_forward(B * S, D, e), forward)
    same_kernels(eager.rmsnorm_backward(B * S, D, e), backward)


def test_rope_repeat_kv_swiglu_and_the_loss_as_torchtitan_writes_them():
    bf16 = torch.bfloat16
    freqs = torch.polar(torch.ones(S, HD // 2), torch.randn(S, HD // 2)).view(1, S, 1, HD // 2)

    def rope(q, k):
        rotated = [torch.view_as_real(torch.view_as_complex(t.float().reshape(*t.shape[:-1], -1, 2)) * freqs)
                   .flatten(3).type_as(t) for t in (q, k)]
        return tuple(rotated)

    q, k, v = _leaf(B, S, HEADS, HD, dtype=bf16), _leaf(B, S, KV, HD, dtype=bf16), _leaf(B, S, KV, HD, dtype=bf16)
    elements, table = (B * S * HEADS * HD, B * S * KV * HD), S * HD // 2 * 8
    forward, backward = _run(rope, (q, k))
    same_kernels(eager.rope_forward(elements, table, 2), forward)
    same_kernels(eager.rope_backward(elements, table, 2), backward)

    def repeat(k, v):
        return tuple(t.unsqueeze(3).expand(B, S, KV, HEADS // KV, HD).reshape(B, S, HEADS, HD) for t in (k, v))

    forward, backward = _run(repeat, (k, v))
    same_kernels(eager.repeat_kv_forward(B * S * KV * HD, B * S * HEADS * HD, 2), forward)
    same_kernels(eager.repeat_kv_backward(B * S * KV * HD, B * S * HEADS * HD, 2), backward)

    forward, backward = _run(lambda gate, up: F.silu(gate) * up, (_leaf(B, S, FF, dtype=bf16), _leaf(B, S, FF, dtype=bf16)))
    same_kernels(eager.swiglu_forward(B * S * FF, 2), forward)
    same_kernels(eager.swiglu_backward(B * S * FF, 2), backward)

    labels = torch.randint(0, VOCAB, (B * S,))
    _, backward = _run(lambda logits: F.cross_entropy(logits.flatten(0, 1).float(), labels),
                       (_leaf(B, S, VOCAB, dtype=bf16),))
    # nll_loss_backward is handed the log-probabilities for their shape only: it zero-fills its output and writes
    # one value per row (the kernel reads the target and the loss's gradient, a few bytes)
    backward = [(n, 0 if n == "nll_loss_backward" else r, w) for n, r, w in backward]
    same_kernels(eager.loss_backward(B * S, VOCAB, 2), backward)


def test_an_eager_llama_block_costs_more_kernels_and_bytes_and_keeps_the_fp32_norm_inputs():
    model = build_config("llama3-8b", seq_len=1024)
    plain, eager_block = (block_ops(model, 1, Layout(), policy("bf16"), Implementation(eager=flag))
                          for flag in (False, True))
    count = lambda ops: len(ops.forward) + len(ops.backward)  # noqa: E731
    assert count(eager_block) > 2 * count(plain)
    moved = lambda ops: sum(op.bytes for op in ops.forward + ops.backward if type(op).__name__ == "MemoryOp")  # noqa: E731
    assert moved(eager_block) > 1.5 * moved(plain)
    rows, d = 1024, model.d_model
    kv_copies = 2 * rows * (model.n_heads - model.kv_heads) * model.head_dim * 2
    # each norm keeps an fp32 copy and the 16-bit normalised output instead of its 16-bit input
    assert eager_block.saved_bytes - plain.saved_bytes == 2 * rows * d * 4 + kv_copies


@click.group(cls=Group)
def group() -> None:
    """A throwaway group with the command registered as cli/main.py registers it."""


group.add_command(simulate)


def test_torchtitan_is_eager_unless_fused_and_eager_is_refused_elsewhere():
    row = ["simulate", "--model", "llama3-8b", "--gpu", "h100-96gb-500w", "--dp", "8", "--zero", "3", "--overlap",
           "torchtitan-fsdp2", "--micro-batch", "2", "--global-batch", "16", "--seq-len", "8192", "--recompute", "op",
           "--json"]
    runner = CliRunner()
    default, compiled = (json.loads(runner.invoke(group, row + extra).output) for extra in ([], ["--elementwise", "fused"]))
    assert default["provenance"]["implementation"]["eager"] and not compiled["provenance"]["implementation"]["eager"]
    assert 1.1 < default["step_time_s"] / compiled["step_time_s"] < 1.4
    refused = runner.invoke(group, ["simulate", "--elementwise", "eager"])
    assert refused.exit_code == 2 and "torchtitan-fsdp2" in refused.output and refused.output.count("\n") == 1
    unfused = runner.invoke(group, ["simulate", "--model", "llama3-8b", "--overlap", "torchtitan-fsdp2", "--attention",
                                    "unfused"])
    assert unfused.exit_code == 2 and "--attention flash" in unfused.output and unfused.output.count("\n") == 1
