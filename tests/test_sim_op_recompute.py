"""torchtitan's selective op checkpointing (`--recompute op`, simulator/costs/torchtitan/selective_op.py): what a
block keeps, what its backward runs again, the refusals, and the rule itself checked against torch.utils.checkpoint
running it."""

import json
from collections import defaultdict
from dataclasses import replace

import click
import pytest
import torch
import torch.nn.functional as F
from click.testing import CliRunner
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from cli.main import Group
from cli.commands.simulate import simulate
from job.layout import Layout
from dispatched_kernels import Kernels
from minigpt.config import GPTConfig
from minigpt.errors import ConfigError
from precision.policy import policy
from simulator.costs.op_types import RECOMPUTE, Gemm, Implementation
from simulator.costs.ops import block_ops
from simulator.memory import check_activations_against_config

LLAMA = GPTConfig(vocab_size=256, seq_len=64, n_layers=2, n_heads=4, n_kv_heads=2, d_model=64, d_ff=96,
                  mlp="swiglu", norm="rmsnorm", positions="rope", bias=False, tied_head=False)
OP = Implementation(recompute="op")


def _ops(model=LLAMA, micro_batch=1, layout=Layout(), precision="bf16", implementation=OP):
    return block_ops(model, micro_batch, layout, policy(precision), implementation)


def test_kept_bytes_are_the_block_input_q_v_attention_gate_and_down_projection():
    d, hd, heads, kv, f, s = 64, 16, 4, 2, 96, 64
    kept = 2 * (d + (heads + kv) * hd + heads * hd + f + d) + 4 * heads  # bf16, the log-sum-exp in fp32
    ops = _ops()
    assert ops.saved_bytes == kept * s
    assert LLAMA.activation_bytes_per_token_per_layer(2, "op") == kept
    assert {t.name for t in ops.saved} == {"x", "qkv.q_v", "attention.output", "attention.logsumexp", "fc1.gate",
                                          "mlp.residual"}
    gelu = replace(LLAMA, mlp="gelu", norm="layernorm", positions="learned")
    assert gelu.activation_bytes_per_token_per_layer(2, "op") == 2 * (d + (heads + kv) * hd + heads * hd + f) + 4 * heads
    assert _ops(gelu).saved_bytes == gelu.activation_bytes_per_token_per_layer(2, "op") * s
    check_activations_against_config(LLAMA, policy("bf16"))  # the check every prediction runs, "op" included


def test_the_backward_runs_k_o_and_up_projections_and_the_memory_bound_ops_again_not_the_attention():
    ops = _ops()
    again = [op for op in ops.backward if op.phase == RECOMPUTE]
    assert [op.name for op in again] == ["ln1", "qkv.k", "rope", "proj", "attention.residual_add", "ln2", "fc1.up",
                                         "swiglu"]
    gemms = {op.name: (op.m, op.n, op.k) for op in again if isinstance(op, Gemm)}
    assert gemms == {"qkv.k": (64, 32, 64), "proj": (64, 64, 64), "fc1.up": (64, 96, 64)}
    flops = sum(op.flops for op in again if isinstance(op, Gemm))
    assert flops == LLAMA.op_recomputed_flops_per_token() * LLAMA.seq_len
    assert (LLAMA.train_flops_per_token("op") - LLAMA.train_flops_per_token("none")
            == LLAMA.n_layers * LLAMA.op_recomputed_flops_per_token())
    plain = _ops(implementation=Implementation())
    assert ops.forward == plain.forward and ops.backward[len(again):] == plain.backward
    # what the backward reads and the block did not keep is alive again while it runs: the up projection made
    # again, the rotated q and k (the attention's inputs), not the gate, q or v twice
    names = {t.name for t in ops.recomputed}
    assert {"fc1.up", "rope.output", "swiglu.silu", "swiglu.output", "ln2.input"} <= names
    assert not names & {"q_k_v", "fc1.output", "x", "attention.output"}
    learned = _ops(replace(LLAMA, positions="learned"))  # the attention reads the projections' own output: k again
    assert "q_k_v.k" in {t.name for t in learned.recomputed}


@pytest.mark.parametrize("change, layout, precision, attention, words", [
    ({"bias": True}, Layout(), "bf16", "flash", "addmm"),
    ({"dropout": 0.1}, Layout(), "bf16", "flash", "dropout"),
    ({"n_experts": 4, "top_k": 2}, Layout(), "bf16", "flash", "mixture of experts"),
    ({}, Layout(tp=2), "bf16", "flash", "tensor parallelism"),
    ({}, Layout(cp=2), "bf16", "flash", "context parallelism"),
    ({}, Layout(), "fp8", "flash", "_scaled_mm"),
    ({}, Layout(), "bf16", "unfused", "unfused attention"),
])
def test_refused_where_the_policy_is_not_described(change, layout, precision, attention, words):
    with pytest.raises(ConfigError, match=words):
        _ops(replace(LLAMA, **change), layout=layout, precision=precision,
             implementation=Implementation(attention=attention, recompute="op"))


@click.group(cls=Group)
def group() -> None:
    """A throwaway group with the command registered as cli/main.py registers it."""


group.add_command(simulate)


def test_cli_refuses_in_one_line_and_the_torchtitan_run_fits():
    runner = CliRunner()
    result = runner.invoke(group, ["simulate", "--model", "gpt3-175b", "--recompute", "op"])
    assert result.exit_code == 2 and result.output.count("\n") == 1 and "--no-bias" in result.output
    row = ["simulate", "--model", "llama3-8b", "--gpu", "h100-96gb-500w", "--dp", "8", "--zero", "3", "--overlap",
           "torchtitan-fsdp2", "--micro-batch", "2", "--global-batch", "16", "--seq-len", "8192", "--json"]
    op, selective = (json.loads(runner.invoke(group, row + ["--recompute", mode]).output) for mode in ("op", "selective"))
    assert op["fits"] and not selective["fits"]
    assert op["memory_per_gpu"]["activations"] < 0.5 * selective["memory_per_gpu"]["activations"]
    assert op["step_time_s"] > selective["step_time_s"]  # three GEMMs and the norms again, against the attention


# ------------------------------------------------ the rule, against torch.utils.checkpoint running it


class _Block(nn.Module):
    """A Llama block as torchtitan writes one: separate bias-free projections (q, k, v, o; w1, w3, w2)."""

    def __init__(self, d=32, heads=4, kv=2, f=48):
        super().__init__()
        self.heads, self.kv, self.hd = heads, kv, d // heads
        self.wq, self.wk = nn.Linear(d, d, bias=False), nn.Linear(d, kv * self.hd, bias=False)
        self.wv, self.wo = nn.Linear(d, kv * self.hd, bias=False), nn.Linear(d, d, bias=False)
        self.w1, self.w3, self.w2 = nn.Linear(d, f, bias=False), nn.Linear(d, f, bias=False), nn.Linear(f, d, bias=False)
        self.n1, self.n2 = nn.RMSNorm(d), nn.RMSNorm(d)

    def forward(self, x):
        b, s, _ = x.shape
        h = self.n1(x)
        q = self.wq(h).view(b, s, self.heads, self.hd).transpose(1, 2)
        k = self.wk(h).view(b, s, self.kv, self.hd).transpose(1, 2)
        v = self.wv(h).view(b, s, self.kv, self.hd).transpose(1, 2)
        k, v = (t.repeat_interleave(self.heads // self.kv, dim=1) for t in (k, v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, -1)
        x = x + self.wo(out)
        h = self.n2(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


_KEEP = {torch.ops.aten.mm.default, torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default}


def _policy():
    count = defaultdict(int)  # per checkpointed call, as the policy's context is made per call

    def decide(ctx, func, *args, **kwargs):
        mode = "recompute" if ctx.is_recompute else "forward"
        if func == torch.ops.aten.mm.default:
            count[mode] += 1
        keep = func in _KEEP and not (func == torch.ops.aten.mm.default and count[mode] % 2 == 0)
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(decide)


def _backward_matmuls(block, x, checkpointed):
    y = checkpoint(block, x, use_reentrant=False, context_fn=_policy) if checkpointed else block(x)
    with Kernels() as seen:
        y.sum().backward()
    return [shapes[0] for name, shapes in seen.made if name == "mm"]


def test_torch_checkpoint_under_the_rule_runs_again_exactly_k_o_and_up():
    """The rule torchtitan/selective_op.py prices, run by torch itself on CPU (its flash attention there is the _for_cpu op):
    the backward's extra matmuls are wk's, wo's and w3's, and w2's (the last kept mm) is not run again."""
    torch.manual_seed(0)
    block, x = _Block(), torch.randn(2, 8, 32, requires_grad=True)
    plain = _backward_matmuls(block, x, False)
    again = _backward_matmuls(block, x, True)
    extra = list(again)
    for shape in plain:
        extra.remove(shape)
    assert sorted(extra) == [(16, 16), (16, 32), (16, 48)]  # rows x (kv width, d, f): wk, wo, w3
