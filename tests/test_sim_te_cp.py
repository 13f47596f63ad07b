"""Transformer Engine's context parallelism as Megatron-core runs it (simulator/costs/te_context.py): the kernels
around each step's attention call and the ring's passes, as read in TE's AttnFuncWithCPAndKVP2P (v2.7: bf16 outputs,
fp32 log-sum-exps, dq and the travelling dk, dv in bf16, cp - 1 gradient hops), and what they add to a prediction.
Transformer Engine needs CUDA and is not installed here: these check the reading, not TE's run."""

import json

import pytest
from click.testing import CliRunner

from cli.main import main
from job.exchange.context import kv_elements
from job.layout import Layout
from minigpt.presets import build_config
from precision.policy import policy
from simulator.costs import te_context
from simulator.costs.op_types import Implementation
from simulator.costs.ops import block_ops
from simulator.engine.context import layer_exchange, te_layer_exchange


def test_two_ranks_last_rank_merges_as_te_reads():
    """cp 2, the last rank (rank 1): the diagonal step then a step against rank 0's first half (its whole queries);
    backward step 0 the lower step (dq and the half dk, dv copied), step 1 the diagonal (both added whole)."""
    rows, heads, kv_heads, hd, e = 8, 4, 2, 16, 2
    n, kv, lse = rows * heads * hd * e, rows * kv_heads * hd * e, rows * heads * 4  # bytes of out, of k, of a lse
    assert te_context.forward_kernels(2, rows, heads, kv_heads, hd, e) == [
        ("kv_concat", 2 * kv, 2 * kv), ("lse_clone", lse, lse), ("lse_correction", 2 * lse, lse),
        ("out_correction_init", n + 2 * lse, n), ("out_correction", 2 * n + 2 * lse, n)]
    assert te_context.backward_kernels(2, rows, heads, kv_heads, hd, e) == [
        ("kv_to_ring_buffer", 2 * kv, 2 * kv), ("grad_q_copy", n, n), ("grad_kv_half_copy", kv, kv),
        ("grad_q_add", 2 * n, n), ("grad_kv_add", 4 * kv, 2 * kv)]


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_every_later_step_adds_one_merge_of_each_kind(cp):
    forward = [name for name, _, _ in te_context.forward_kernels(cp, 64, 8, 1, 128, 2)]
    backward = [name for name, _, _ in te_context.backward_kernels(cp, 64, 8, 1, 128, 2)]
    assert forward.count("lse_correction") == forward.count("out_correction") == cp - 1
    assert backward.count("grad_q_add") == cp - 1 and backward.count("grad_kv_half_add") == cp - 2
    assert len(forward) == 3 + 2 * (cp - 1) and len(backward) == 3 + 2 * (cp - 1)


def test_only_tes_ring_adds_them_and_recomputation_runs_the_forwards_again():
    model = build_config("llama3-8b", seq_len=8192)
    ops = {(impl, kind): block_ops(model, 1, Layout(cp=4, cp_kind=kind), policy("bf16"),
                                   Implementation(recompute="full", cp_attention=impl))
           for impl in ("fused", "te") for kind in ("ring", "allgather")}
    merged = {key: [op for op in (*o.forward, *o.backward) if op.name.startswith("attention.cp.")]
              for key, o in ops.items()}
    assert not merged["fused", "ring"] and not merged["te", "allgather"]  # TE's all-gather class: not read, fused
    rows = 8192 // 4
    forward = te_context.forward_kernels(4, rows, 32, 8, 128, 2)
    backward = te_context.backward_kernels(4, rows, 32, 8, 128, 2)
    assert len(merged["te", "ring"]) == 2 * len(forward) + len(backward)
    extra = sum(op.bytes for op in merged["te", "ring"])
    assert extra == 2 * sum(r + w for _, r, w in forward) + sum(r + w for _, r, w in backward)
    n = rows * 32 * 128 * 2  # the rank's attention output, bf16; 3 passes of it a merge: 12 and the fp32
    assert 40 * n < extra < 40.5 * n  # log-sum-exps for each forward, 15.5 for the backward (k, v: 8 of 32 heads)


class Links:
    """A cp group whose ring pass costs 1 ms per MB."""

    def cp_pass(self, stage, nbytes):
        return nbytes / 1e9

    def cp_collective(self, stage, kind, nbytes):
        return nbytes / 1e9


def test_tes_ring_sends_bf16_gradients_one_hop_fewer_than_ours():
    model, layout = build_config("llama3-8b", seq_len=65536), Layout(tp=1, cp=4)
    elements = kv_elements(model, 1, 4, 1)
    kv = 2 * elements * 2  # k and v, bf16
    forward, backward = te_layer_exchange(model, layout, 1, 2, "none", Links(), 0, (0.0, 0.0, 0.0))
    assert [(x.calls, x.bytes) for x in backward.priced] == [(3, kv), (3, kv)]  # dk, dv in bf16, cp - 1 hops
    assert forward.seconds == pytest.approx(3 * kv / 1e9)  # nothing hides: every pass shows
    assert backward.seconds == pytest.approx(kv / 1e9 + 2 * 2 * kv / 1e9 + kv / 1e9)  # kv, 2 x (kv + dkv), last dkv
    ours = layer_exchange(model, layout, 1, 2, "none", Links(), 0, (0.0, 0.0, 0.0))
    assert ours[0].seconds == forward.seconds and ours[1].seconds > backward.seconds  # ours: 4 hops of fp32
    hidden = te_layer_exchange(model, layout, 1, 2, "none", Links(), 0, (1.0, 1.0, 1.0))
    assert hidden[0].seconds == 0 and hidden[1].seconds == pytest.approx(kv / 1e9)  # only the last hop waits
    gathered = te_layer_exchange(model, Layout(cp=4, cp_kind="allgather"), 1, 2, "none", Links(), 0, (1.0,) * 3)
    mine = layer_exchange(model, Layout(cp=4, cp_kind="allgather"), 1, 2, "none", Links(), 0, (1.0,) * 3)
    assert [p.seconds for p in gathered] == [p.seconds for p in mine]


def test_the_megatron_core_stack_prices_tes_ring_and_says_so():
    def simulate(overlap):
        result = CliRunner().invoke(main, ["simulate", "--model", "llama3-70b", "--seq-len", "32768", "--cp", "4",
                                           "--tp", "8", "--dp", "2", "--sequence-parallel", "--gpu", "h100-sxm",
                                           "--overlap", overlap, "--json"])
        assert result.exit_code == 0, result.output
        return json.loads(result.output)

    core = simulate("megatron-core")
    context = core["provenance"]["context"]
    assert context["merge"].startswith("by Transformer Engine's ring") and "compute format" in context["exchange"]
    assert core["provenance"]["implementation"]["cp_attention"] == "te"


def test_tes_ring_passes_latent_attentions_values_at_their_own_width():
    """Under multi-head latent attention (DeepSeek-V3: keys 128 + 64 wide, values 128) TE's ring passes k and v as
    they are, (192 + 128) x 2 bytes a token and head in bf16, where our ring pads v to 192 first."""
    model, layout = build_config("deepseek-v3", seq_len=32768), Layout(tp=1, cp=4)
    keys = kv_elements(model, 1, 4, 1)  # at the query heads' width, 192
    forward, backward = te_layer_exchange(model, layout, 1, 2, "none", Links(), 0, (0.0, 0.0, 0.0))
    pair = (keys + keys * 128 // 192) * 2
    assert [(x.calls, x.bytes) for x in forward.priced] == [(3, pair)]
    assert [(x.calls, x.bytes) for x in backward.priced] == [(3, pair), (3, pair)]
    ours = layer_exchange(model, layout, 1, 2, "none", Links(), 0, (0.0, 0.0, 0.0))
    assert ours[0].priced[0].bytes == 2 * keys * 2 > pair  # ours: v padded to 192
