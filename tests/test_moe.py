"""The mixture-of-experts model (minigpt/moe.py) and its arithmetic (minigpt/config.py) against torch."""

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from minigpt.config import GPTConfig
from minigpt.presets import PRESETS
from minigpt.errors import ConfigError
from minigpt.model import GPT
from minigpt.moe import MoE, aux_loss_weight, capacity, choose, kept_choices
from job.exchange.experts import backward_exchanges, forward_exchanges, routed_rows
from job.layout import block_tensors, check_against_config

BASE = GPTConfig(vocab_size=97, seq_len=24, n_layers=2, n_heads=2, d_model=48, d_ff=64, n_experts=4, top_k=2,
                 d_expert=32)
SHAPES = [
    PRESETS["tiny-moe"],
    BASE,
    BASE.with_(top_k=1),
    BASE.with_(router="sigmoid", aux_loss_coef=0.1),
    BASE.with_(z_loss_coef=0.1, mlp="swiglu", bias=False, norm="rmsnorm", positions="rope", n_kv_heads=1),
    BASE.with_(n_shared_experts=2, aux_loss_coef=0.1, n_layers=3, dense_layers=1),
    BASE.with_(top_k=3, aux_loss_coef=0.01, tied_head=False),
    BASE.with_(renormalize_gates=False, aux_loss_coef=0.01),  # OLMoE's, Qwen2-MoE's gates
    BASE.with_(renormalize_gates=False, router="sigmoid", top_k=1),
    BASE.with_(n_layers=4, moe_every=2, dense_layers=1),  # GShard's: a mixture in every second block
    BASE.with_(n_shared_experts=1, shared_expert_gate=True, renormalize_gates=False, qkv_bias=True, bias=False,
               mlp="swiglu", norm="rmsnorm", positions="rope"),  # Qwen2-MoE's
    BASE.with_(d_head=16, qk_norm=True, mlp="swiglu", norm="rmsnorm", positions="rope", bias=False),  # Qwen3's
]


def shape_id(c: GPTConfig) -> str:
    return (f"E{c.n_experts}k{c.top_k}{c.router}{c.mlp}s{c.n_shared_experts}d{c.dense_layers}a{c.aux_loss_coef}"
            f"z{c.z_loss_coef}{'' if c.renormalize_gates else 'raw'}{'gated' if c.shared_expert_gate else ''}")


@pytest.mark.parametrize("cfg", SHAPES, ids=shape_id)
def test_parameter_counts_equal_numel(cfg):
    model = GPT(cfg)
    assert cfg.n_params() == sum(p.numel() for p in model.parameters())
    for layer, block in enumerate(model.blocks):
        assert cfg.block_params(cfg.is_moe_layer(layer)) == sum(p.numel() for p in block.parameters())
        names = [name for name, _ in block.named_parameters()]
        assert names == [t.name for t in block_tensors(cfg, 1, cfg.is_moe_layer(layer))]
    check_against_config(cfg)
    # active: a dense block's MLP whole; a MoE block's router, top_k experts and the shared ones
    experts = sum(1 for layer in range(cfg.n_layers) if cfg.is_moe_layer(layer))
    assert cfg.n_params() - cfg.active_params() == experts * (cfg.n_experts - cfg.top_k) * cfg.expert_params()


def test_published_sizes():
    mixtral = PRESETS["mixtral-8x7b"]  # Mixtral 8x7B's released checkpoint: 46.7B parameters, 12.9B active
    assert mixtral.n_params() == 46_702_792_704
    assert mixtral.active_params() == 12_879_925_248
    qwen = PRESETS["qwen3-30b-a3b"]  # its released checkpoint: safetensors total_size 61,064,245,248 bytes in bf16
    assert qwen.n_params() == 61_064_245_248 // 2 == 30_532_122_624
    assert qwen.active_params() == 3_353_032_704  # "3.3B activated" (its card)
    deepseek = PRESETS["deepseek-v3"]  # 671B and 37B published (the multi-token prediction module left out)
    assert deepseek.main_params() == 671_026_404_352 and f"{deepseek.main_params() / 1e9:.0f}" == "671"
    # its one multi-token prediction module: 11.6B of its own, 13.5B with the checkpoint's embedding and head copies
    # (the published 14B)
    extra = deepseek.mtp_params() + 2 * deepseek.vocab_size * deepseek.d_model
    assert deepseek.n_params() == 671_026_404_352 + 11_610_067_968 and f"{extra / 1e9:.1f}" == "13.5"
    assert abs(deepseek.active_params() / 37e9 - 1) < 0.02
    # its multi-head latent attention, 187.1M parameters a layer: DeepSeek-V2's section 2.1 with V3's sizes
    assert deepseek.attention_params() == (7168 * (1536 + 512 + 64) + 1536 + 512 + 1536 * 128 * 192
                                           + 512 * 128 * (128 + 128) + 128 * 128 * 7168)
    moe_layers = deepseek.n_layers - deepseek.dense_layers
    assert moe_layers * deepseek.n_experts * deepseek.expert_params() == 58 * 256 * 3 * 7168 * 2048  # routed experts
    # DeepSeek-V2 and V2-Lite (arXiv 2405.04434: 236B / 21B and 15.7B / 2.4B active, counting the head and not the
    # embedding), OLMoE-1B-7B (arXiv 2409.02060: 6.9B / 1.3B), Qwen1.5-MoE-A2.7B (its card: 14.3B / 2.7B)
    for name, total, active, published in (("deepseek-v2", 235_741_434_880, 21_375_800_320, (236e9, 21e9)),
                                           ("deepseek-v2-lite", 15_706_484_224, 2_661_150_208, (15.7e9, 2.4e9)),
                                           ("olmoe-1b-7b", 6_919_161_856, 1_282_017_280, (6.9e9, 1.3e9)),
                                           ("qwen1.5-moe-a2.7b", 14_315_784_192, 2_689_173_504, (14.3e9, 2.7e9))):
        model = PRESETS[name]
        assert (model.n_params(), model.active_params()) == (total, active), name
        head_only = active - (model.vocab_size * model.d_model if model.is_mla else 0)  # DeepSeek counts no embedding
        assert abs(total / published[0] - 1) < 0.01 and abs(head_only / published[1] - 1) < 0.025, name
    from minigpt.hf.layouts import config_from_hf, hf_config, layout_of  # each written in its own layout, and read back
    for name, layout in (("deepseek-v2", "deepseek_v2"), ("olmoe-1b-7b", "olmoe"), ("qwen1.5-moe-a2.7b", "qwen2_moe")):
        model = PRESETS[name]
        assert layout_of(model) == layout and config_from_hf(hf_config(model)) == model.with_(aux_loss_coef=(
            model.aux_loss_coef if layout != "deepseek_v2" else 0.0), z_loss_coef=0.0), name
    tiny, tiny_moe = PRESETS["tiny"], PRESETS["tiny-moe"]  # equal active parameters but for the router and the
    extra = tiny.n_layers * tiny.d_model * (tiny_moe.n_experts + 1)  # second expert's output bias
    assert tiny_moe.active_params() - tiny.n_params() == extra


@pytest.mark.parametrize("cfg", SHAPES[1:], ids=shape_id)
def test_train_flops_match_counted_matmuls(cfg):
    model = GPT(cfg)
    idx = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len))
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model(idx, idx).backward()
    assert counter.get_total_flops() == cfg.train_flops_per_token() * idx.numel()  # dropless: top_k rows a token


def saved_bytes(fn, parameters: set[int]) -> int:
    """Bytes of the distinct storages autograd saves while fn runs, the parameters' storages left out (an expert's
    weight is a view of its stacked parameter)."""
    storages = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in parameters:
            storages[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(storages.values())


@pytest.mark.parametrize("cfg", SHAPES, ids=shape_id)
def test_activation_bytes_match_saved_tensors(cfg):
    model = GPT(cfg)
    layer = cfg.dense_layers  # the first MoE block
    batch = 3
    x = torch.randn(batch, cfg.seq_len, cfg.d_model, requires_grad=True)
    measured = saved_bytes(lambda: model.blocks[layer](x), {p.untyped_storage().data_ptr() for p in model.parameters()})
    per_token = cfg.activation_bytes_per_token_per_layer(moe=True)
    assert measured == per_token * batch * cfg.seq_len + cfg.moe_activation_bytes_per_sequence() * batch


def test_choice_breaks_ties_to_the_lower_expert():
    scores = torch.tensor([[0.2, 0.3, 0.3, 0.2], [0.25, 0.25, 0.25, 0.25]])
    assert choose(scores, 2).tolist() == [[1, 2], [0, 1]]


@pytest.mark.parametrize("router", ["softmax", "sigmoid"])
def test_gates_are_the_chosen_scores_renormalised_or_as_they_are(router):
    torch.manual_seed(0)
    x = torch.randn(2, BASE.seq_len, BASE.d_model)
    for renormalize in (True, False):
        moe = MoE(BASE.with_(router=router, renormalize_gates=renormalize, top_k=3))
        logits = moe.router(x).float()
        scores = logits.softmax(-1) if router == "softmax" else logits.sigmoid()
        expert_ids, gates, _, _ = moe.route(x)
        chosen = scores.gather(-1, expert_ids)
        torch.testing.assert_close(gates, chosen / chosen.sum(-1, keepdim=True) if renormalize else chosen,
                                   rtol=0, atol=0)
        assert ((gates.sum(-1) - 1).abs().max() < 1e-6) == renormalize  # as they are, they sum to no 1


def test_capacity_keeps_first_choices_then_token_order():
    cfg = BASE.with_(capacity_factor=0.5, seq_len=8, n_experts=2, top_k=2)
    assert capacity(cfg, 8) == 4  # ceil(0.5 x 8 tokens x 2 choices / 2 experts)
    # every token's first choice is expert 0, second expert 1: expert 0 takes tokens 0-3 only, expert 1 likewise
    ids = torch.tensor([[[0, 1]] * 8])
    kept = kept_choices(ids, 2, capacity(cfg, 8))
    assert kept[0, :, 0].tolist() == [True] * 4 + [False] * 4
    assert kept[0, :, 1].tolist() == [True] * 4 + [False] * 4
    # first choices take precedence over earlier tokens' second choices
    ids = torch.tensor([[[1, 0], [1, 0], [0, 1], [0, 1], [0, 1], [0, 1]]])
    kept = kept_choices(ids, 2, 4)
    assert kept[0, :, 0].all()  # 4 first choices of expert 0 and 2 of expert 1 fit
    # then the second choices: expert 0 is full (tokens 0, 1 dropped), expert 1 had 2 firsts: tokens 2, 3 fit
    assert kept[0, :, 1].tolist() == [False, False, True, True, False, False]


def test_dropped_choices_add_nothing_and_dropless_drops_none():
    torch.manual_seed(0)
    dropless = MoE(BASE.with_(aux_loss_coef=0.0))
    x = torch.randn(2, BASE.seq_len, BASE.d_model)
    dropless(x)
    assert dropless.load.sum() == x.shape[0] * x.shape[1] * BASE.top_k
    tight = MoE(BASE.with_(capacity_factor=0.25))
    tight.load_state_dict(dropless.state_dict())
    tight(x)
    assert tight.load.max() <= 2 * capacity(tight.config, BASE.seq_len)  # per expert, two sequences


def test_router_losses_reach_the_gradient_with_their_weight():
    """The AuxLoss path gives the gradient of loss + weight x (the layers' router losses), computed explicitly."""
    cfg = BASE.with_(aux_loss_coef=0.3, z_loss_coef=0.05, n_layers=2)
    torch.manual_seed(1)
    model = GPT(cfg)
    idx = torch.randint(0, cfg.vocab_size, (3, cfg.seq_len))
    weight = aux_loss_weight()
    try:
        aux_loss_weight(0.5)
        model(idx, idx).backward()
        through_hook = [p.grad.clone() for p in model.parameters()]
        model.zero_grad()
        aux_loss_weight(0.0)
        losses = []
        for block in model.blocks:
            original = block.mlp.router_losses
            block.mlp.router_losses = lambda *a, f=original: losses.append(f(*a)) or losses[-1]
        loss = model(idx, idx)
        (loss + 0.5 * sum(losses)).backward()
        explicit = [p.grad for p in model.parameters()]
    finally:
        aux_loss_weight(weight)
    assert len(losses) == cfg.n_layers and all(float(value.detach()) > 0 for value in losses)
    for a, b in zip(through_hook, explicit):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_exchanges_of_a_moe_layer():
    cfg = PRESETS["mixtral-8x7b"]
    assert forward_exchanges(cfg, 1, 100, 2) == [] and forward_exchanges(PRESETS["tiny"], 4, 100, 2) == []
    forward = forward_exchanges(cfg, 8, 8192, 2, received=4096)
    assert [e.bytes for e in forward] == [8 * 8, 8192 * 4096 * 2, 4096 * 4096 * 2]
    backward = backward_exchanges(cfg, 8, 8192, 2, received=4096, recompute="full")
    assert [e.bytes for e in backward] == [e.bytes for e in forward] + [8192 * 4096 * 2, 4096 * 4096 * 2]
    assert routed_rows(cfg, 4096, 1) == 8192
    assert routed_rows(cfg.with_(capacity_factor=0.5), 4096, 1) == 8 * 512  # 8 experts x ceil(0.5 x 4096 x 2 / 8)


@pytest.mark.parametrize("fields, message", [
    (dict(n_experts=4, top_k=5), "top_k=5 is above the 4 experts"),
    (dict(n_experts=-2), "n_experts must be a positive integer"),
    (dict(n_experts=4, capacity_factor=0.0), "capacity_factor must be a number above 0"),
    (dict(n_experts=4, capacity_factor=-1.0), "capacity_factor must be a number above 0"),
    (dict(n_experts=4, router="relu"), "router must be one of softmax, sigmoid"),
    (dict(n_experts=4, dense_layers=2), "dense_layers=2 leaves no MoE layer"),
    (dict(n_experts=4, aux_loss_coef=float("nan")), "aux_loss_coef must be a finite number"),
    (dict(n_experts=4, d_expert=0), "d_expert must be a positive integer"),
    (dict(n_experts=4, renormalize_gates="no"), "renormalize_gates must be true or false"),
    (dict(n_experts=4, shared_expert_gate=True), "true only with shared experts"),
    (dict(n_experts=4, moe_every=3), "leaving a MoE block among the 2"),
    (dict(n_experts=4, moe_every=0), "moe_every must be a positive integer"),
    (dict(n_experts=4, moe_every=2, mtp_depth=1), "multi-token prediction"),
])
def test_moe_options_are_checked(fields, message):
    with pytest.raises(ConfigError, match=message):
        GPTConfig(vocab_size=97, seq_len=24, n_layers=2, n_heads=2, d_model=48, d_ff=64, **fields)


def test_16_bit_compute_keeps_the_routers_counts_and_bias_in_their_formats():
    """apply_precision casts parameters only: a MoE's load counts stay fp64 (in bf16, 4096 + 1 is 4096: a long run's
    counts stopped growing) and its choice bias fp32 (DeepSeek-V3's steps of 0.001 are below bf16's resolution at
    its size)."""
    from precision.compute import apply_precision
    from precision.policy import policy

    config = PRESETS["tiny-moe"].with_(router="sigmoid", expert_bias=True, expert_bias_rate=0.001)
    model = apply_precision(GPT(config), policy("bf16"), torch.device("cpu"))
    moe = next(module for module in model.modules() if isinstance(module, MoE))
    assert moe.router.weight.dtype == torch.bfloat16
    assert (moe.load.dtype, moe.step_load.dtype, moe.expert_bias.dtype) == (torch.float64, torch.float64, torch.float32)
    moe.load.fill_(4096)
    moe.load += 1
    assert moe.load[0].item() == 4097
