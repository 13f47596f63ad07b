"""OLMo 2's block trained in every layout, against one process on the same global batch (losses and gradient norms,
20 steps): no norm before the branches, one after each branch's output (pre_norms off, post_norms), q and k each
RMS-normalised over all their heads at once (qk_norm_whole: under tensor parallelism each rank's sums of squares
summed over the group). Each rank's model states are the simulator's, byte for byte; its tensor-parallel calls
are simulator/costs/tp_collectives.py's, call for call (a per-head norm's gains summed there too); a block's saved
tensors are the activation arithmetic. Against transformers' Olmo2ForCausalLM: test_hf.py."""

from __future__ import annotations


import pytest
import torch

from distributed import every_layout, named_parity
from job.layout import Layout
from job.train_config import TrainConfig
from minigpt.model import GPT
from minigpt.presets import preset
from model_states import predicted_states, trained_with_states
from parity import assert_runs_match
from precision.policy import policy as precision_policy
from simulator.costs.tp_collectives import tp_collectives, whole_norm_sums
from test_config import saved_bytes

# tiny-llama's sizes in OLMo 2's block over 32 tokens; "heads": Qwen3's per-head norms, for their gains' sums
MODELS = {"olmo2": preset("tiny-llama").with_(seq_len=32, qk_norm=True, qk_norm_whole=True, pre_norms=False,
                                              post_norms=True),
          "heads": preset("tiny-llama").with_(seq_len=32, qk_norm=True)}
TOLERANCE = 1e-5  # relative, every step, losses and gradient norms (fp32)
LAYOUTS = {
    2: {"tp2": ("olmo2", dict(tp=2, micro_batches=2)), "tp2-sp": ("olmo2", dict(tp=2, sequence_parallel=True)),
        "tp2-selective": ("olmo2", dict(tp=2, recompute="selective")), "cp2": ("olmo2", dict(cp=2)),
        "pp2": ("olmo2", dict(pp=2, micro_batches=2)), "dp2-zero3": ("olmo2", dict(dp=2, zero=3)),
        "heads-tp2": ("heads", dict(tp=2))},
    4: {"tp2-pp2": ("olmo2", dict(tp=2, pp=2, micro_batches=2)),
        "cp2-tp2-sp": ("olmo2", dict(cp=2, tp=2, sequence_parallel=True))},
}


def config(model: str, **layout) -> TrainConfig:
    return TrainConfig(model=MODELS[model], steps=20, global_batch=8, eval_every=0, eval_batches=1, device="cpu",
                       lr=1e-3, min_lr=1e-4, **layout)


def trained(cfg: TrainConfig) -> dict:
    return trained_with_states(cfg, logs=("tp",))


spawned, references = named_parity(trained, config, MODELS, LAYOUTS)


ALL = every_layout(LAYOUTS)


@pytest.mark.parametrize("world, name", ALL, ids=[name for _, name in ALL])
def test_every_layout_matches_one_process(spawned, references, world, name):
    assert_runs_match(spawned[name], references[LAYOUTS[world][name][0]], f"olmo2 {name}", TOLERANCE)


@pytest.mark.parametrize("world, name", ALL, ids=[name for _, name in ALL])
def test_model_states_per_rank_are_the_simulators(spawned, world, name):
    """Weights, gradients and AdamW moments each rank holds, as simulator/memory.py predicts them: the post norms
    alone, replicated over tp, the q/k norms' gains cut by heads with the qkv rows."""
    model, layout = LAYOUTS[world][name]
    cfg = config(model, **layout)
    for run in spawned[name]:
        assert run["states"] == predicted_states(cfg, run["stage"]), name


TP = [(world, name) for world, name in ALL if LAYOUTS[world][name][1].get("tp", 1) > 1]


@pytest.mark.parametrize("world, name", TP, ids=[name for _, name in TP])
def test_tensor_parallel_calls_are_the_simulators(spawned, world, name):
    """The last step's tp-group calls, byte for byte, are tp_collectives' for the stage, every micro-batch (and the
    step's gradient-norm sum): OLMo 2's norms' sums of squares once each way per block (and once more where the
    attention core is recomputed); a per-head norm's gains' gradients summed over the group."""
    model, layout = LAYOUTS[world][name]
    cfg = config(model, **layout)
    micro, shape = cfg.global_batch // (cfg.micro_batches * cfg.dp), Layout.of(cfg)
    layers = cfg.model.n_layers // cfg.pp
    for run in spawned[name]:
        first, last = run["stage"] == 0, run["stage"] == cfg.pp - 1
        forward, backward = tp_collectives(cfg.model, layers, micro, shape, precision_policy(cfg.precision), first,
                                           last)
        again = whole_norm_sums(cfg.model, layers, micro, shape) if cfg.recompute == "selective" else []
        expected = sorted((c.kind, c.bytes) for c in forward + backward + again
                          for _ in range(c.calls * cfg.micro_batches))
        assert sorted(run["tp_log"][:-1]) == expected, name
        assert run["tp_log"][-1][0] == "all_reduce"
    sums = [c for c in whole_norm_sums(cfg.model, layers, micro, shape)]
    assert bool(sums) == (model == "olmo2")


def test_a_blocks_saved_tensors_are_the_activation_arithmetic():
    """What autograd keeps for one OLMo 2 block against GPTConfig's bytes per token: the residual stream as qkv's
    and fc1's inputs (no pre norm's), the post norms' inputs and statistics, the q/k norms' input and two 1/rms per
    token; and with each recompute mode the simulator's count equals it (simulator/memory.py checks them)."""
    cfg = MODELS["olmo2"]
    model, batch, seq = GPT(cfg), 3, cfg.seq_len
    x = torch.randn(batch, seq, cfg.d_model, requires_grad=True)
    measured = saved_bytes(lambda: model.blocks[0](x), {p.data_ptr() for p in model.parameters()})
    assert measured == cfg.activation_bytes_per_token_per_layer() * batch * seq
    pre = cfg.with_(pre_norms=True, qk_norm_whole=False)  # the same block with Qwen3's norms and pre norms
    stats = 4 * (cfg.n_heads + cfg.kv_heads - 2)
    assert pre.activation_bytes_per_token_per_layer() - cfg.activation_bytes_per_token_per_layer() == \
        4 * 2 * cfg.d_model + 4 * 2 + stats  # the pre norms' outputs and statistics; per-head 1/rms
