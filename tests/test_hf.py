"""Weights that travel: `minigpt export RUN --hf DIR` writes a run of any layout as a Hugging Face model (GPT-2,
Llama, Mistral, Qwen2, Qwen3, Mixtral, Qwen3-MoE or DeepSeek-V3) that transformers opens with the same logits, and
`minigpt train --init-from DIR` starts from one (Phi-3's too), in any layout, with transformers' own loss on the same
batch. Nothing is downloaded: the transformers models are built from configs (tests/hf_models.py; minigpt/hf/layouts.py
maps the layouts). What is read beside the layouts (YaRN, fp8 weights, the choice bias): test_hf_readings.py."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from cli.main import main
from hf_models import transformers, transformers_model  # transformers: a test extra, skipped without
from minigpt.config import GPTConfig
from minigpt.data import BatchLayout, Corpus, get_batch
from minigpt.errors import ConfigError
from minigpt.hf.layouts import FUSED, config_from_hf, hf_config, layout_of, lookup, to_hf, unfused
from minigpt.hf.files import check_hf_dir, read_hf_dir
from minigpt.hf.moe import MLP_NAME, PROJECTIONS
from minigpt.model import GPT
from minigpt.presets import preset
from parallel.run.sample import load_model


MOE = ["--model", "tiny-moe", "--experts", "4", "--mlp", "swiglu", "--norm", "rmsnorm", "--positions", "rope",
       "--no-bias", "--kv-heads", "2"]
SHAPES = {"gpt2": ["--layers", "2", "--seq-len", "32"],
          "llama": ["--model", "tiny-llama", "--layers", "2", "--seq-len", "32"],  # GQA (4 heads, 2 kv), RoPE
          "qwen2": ["--model", "tiny-llama", "--layers", "2", "--seq-len", "32", "--no-bias", "--qkv-bias", "--tied"],
          "qwen3": ["--model", "tiny-llama", "--layers", "2", "--seq-len", "32", "--qk-norm", "--head-dim", "24"],
          # mixtures of experts (4 SwiGLU experts, top 2): Mixtral's every block, Qwen3-MoE's after a dense first one
          "mixtral": [*MOE, "--layers", "2", "--seq-len", "32"],
          "qwen3_moe": [*MOE, "--layers", "2", "--seq-len", "32", "--qk-norm", "--dense-layers", "1"],
          # Llama's block through a sliding window of 12 tokens: Mistral's layout
          "mistral": ["--model", "tiny-llama", "--layers", "2", "--seq-len", "32", "--window", "12"],
          # multi-head latent attention, a dense first block, then shared and routed experts (sigmoid router)
          "deepseek_v3": ["--model", "tiny-deepseek", "--layers", "2", "--seq-len", "32"],
          # grouped-query attention with q, k and v biases, q/k norms and half of each head turned, then DeepSeek's
          # experts after a dense block (sigmoid router with its choice bias, groups, a shared expert), and a
          # multi-token prediction module: GLM-4.5's layout
          "glm4_moe": [*MOE, "--layers", "2", "--seq-len", "32", "--qk-norm", "--qkv-bias", "--head-dim", "24",
                       "--rotary-fraction", "0.5", "--router", "sigmoid", "--shared-experts", "1", "--dense-layers",
                       "1", "--expert-bias", "--routed-scale", "2.5", "--expert-groups", "2", "--groups-per-token",
                       "1", "--mtp-depth", "1"],
          # OLMo 2's block: norms after the branches alone, q and k normalised over all their heads
          "olmo2": ["--model", "tiny-llama", "--layers", "2", "--seq-len", "32", "--qk-norm", "--qk-norm-whole",
                    "--norm-placement", "post"],
          # those q/k norms before pre norms, half of each head turned, experts chosen by sigmoid scores with a bias
          "minimax_m2": [*MOE, "--layers", "2", "--seq-len", "32", "--qk-norm", "--qk-norm-whole", "--head-dim", "24",
                         "--rotary-fraction", "0.5", "--router", "sigmoid", "--expert-bias"],
          # q, k and v biases, a dense first block, the gates as chosen and a gated shared expert: Qwen2-MoE's
          "qwen2_moe": [*MOE, "--layers", "2", "--seq-len", "32", "--qkv-bias", "--dense-layers", "1",
                        "--shared-experts", "1", "--shared-expert-gate", "--no-renormalize-gates"]}
CLASSES = {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
           "qwen3": "Qwen3ForCausalLM", "mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
           "deepseek_v3": "DeepseekV3ForCausalLM", "mistral": "MistralForCausalLM", "glm4_moe": "Glm4MoeForCausalLM",
           "olmo2": "Olmo2ForCausalLM", "minimax_m2": "MiniMaxM2ForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM"}
MOE_SHAPES = ("mixtral", "qwen3_moe", "deepseek_v3", "glm4_moe", "minimax_m2", "qwen2_moe")


def invoke(*args: str):
    return CliRunner().invoke(main, list(args))


def one_line_refusal(result, *words: str) -> None:
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("minigpt: error:"), result.output
    for word in words:
        assert word in lines[0], lines[0]


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """{shape: (checkpoint, hf dir)}: a tp2 x pp2 run of each shape, exported."""
    found = {}
    for name, shape in SHAPES.items():
        root = tmp_path_factory.mktemp(name)
        result = invoke("train", *shape, "--tp", "2", "--pp", "2", "--dp", "1", "--steps", "3", "--global-batch", "4",
                        "--micro-batches", "2", "--eval-every", "0", "--out", str(root / "run"), "--json")
        assert result.exit_code == 0, result.output
        result = invoke("export", str(root / "run"), "--hf", str(root / "hf"), "--json")
        assert result.exit_code == 0, result.output
        found[name] = (json.loads(result.stdout)["checkpoint"], root / "hf")
    return found


@pytest.mark.slow
@pytest.mark.parametrize("shape", SHAPES)
def test_a_tp2_pp2_run_exported_gives_minigpts_logits_in_transformers(exported, shape):
    checkpoint, hf_dir = exported[shape]
    ours, state = load_model(checkpoint)
    assert state["layout"]["tp"] == 2 and state["layout"]["pp"] == 2
    theirs = transformers.AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    assert type(theirs).__name__ == CLASSES[shape]
    if shape not in ("gpt2", "deepseek_v3"):  # grouped-query attention and rotary positions, as the run trained them
        assert theirs.config.num_key_value_heads == 2 < theirs.config.num_attention_heads == 4
    tokens = torch.randint(0, 256, (3, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        gap = (ours(tokens) - theirs(tokens).logits).abs().max().item()
    print(f"{shape}: largest logit gap {gap:.1e}")
    assert gap <= 1e-5, gap


@pytest.mark.slow
@pytest.mark.parametrize("shape", SHAPES)
def test_init_from_trains_in_tp2_from_transformers_own_first_loss(shape, tmp_path):
    model, hf_dir = transformers_model(shape, tmp_path)
    data = ["--dp", "2", "--ep", "2"] if shape in MOE_SHAPES else ["--dp", "1"]  # experts over 2 ranks
    result = invoke("train", "--init-from", str(hf_dir), "--tp", "2", *data, "--steps", "6",
                    "--global-batch", "4", "--eval-every", "0", "--no-save", "--out", str(tmp_path / "run"), "--json")
    assert result.exit_code == 0, result.output
    losses = json.loads(result.stdout)["losses"]
    inputs, targets = get_batch(Corpus.load(None, 32).train, 32, BatchLayout(4, 1, 1), 0, 0, 0, 0)  # step 0's batch
    with torch.no_grad():  # transformers' loss, told the targets are already shifted
        targets = targets.contiguous()
        loss = model(input_ids=inputs, labels=targets, shift_labels=targets).loss.item()
    assert abs(losses[0] - loss) <= 1e-5 and loss > 6.0, (losses[0], loss)
    assert losses[-1] < losses[0]  # and it trains (a few steps: weights 10x GPT-2's may rise at first)


def hub_named(grads: dict, layout: str) -> dict:
    """transformers' gradients under its checkpoints' names: transformers 5 holds a mixture's experts fused
    (experts.gate_up_proj (E, 2 x width, d), experts.down_proj (E, d, width)) and Mixtral's router under mlp.;
    its checkpoints (and transformers 4) one tensor per expert and projection, Mixtral's under block_sparse_moe.
    GPT-OSS's checkpoints hold them fused as transformers does."""
    if layout == "gpt_oss":
        return grads
    out = {}
    for name, grad in grads.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            layer = name.rsplit("mlp.experts.", 1)[0]
            gate, up, down = PROJECTIONS[layout]
            for expert, matrix in enumerate(grad):
                base = f"{layer}{MLP_NAME[layout]}.experts.{expert}."
                pieces = zip((gate, up), matrix.chunk(2)) if name.endswith("gate_up_proj") else [(down, matrix)]
                out |= {f"{base}{projection}.weight": piece for projection, piece in pieces}
        else:
            mixtral_names = MLP_NAME.get(layout) == "block_sparse_moe"  # Mixtral's, MiniMax-M2's
            out[name.replace("mlp.gate.", "block_sparse_moe.gate.") if mixtral_names else name] = grad
    return out


# Mistral's and Phi-3's read as Llama's block (written as Llama); YaRN's rotation in Qwen3 and DeepSeek-V3;
# Kimi K2's config.json (DeepSeek-V3's under model_type "kimi_k2", YaRN's betas equal)
@pytest.mark.parametrize("shape", [*SHAPES, "phi3", "mixtral_window", "qwen3_window", "qwen3_yarn",
                                   "deepseek_v3_yarn", "kimi_k2", "phi3_longrope", "smollm3", "gemma3", "gpt_oss",
                                   "glm4_moe", "olmo2", "olmo3", "minimax_m2", "olmoe", "qwen3_moe_scores",
                                   "deepseek_v3_scores", "deepseek_v2", "deepseek_v2_groups", "qwen3_moe_sparse",
                                   "gemma2", "granite", "olmo3_yarn"])
def test_every_gradient_is_transformers_own(shape, tmp_path):
    """One process, one batch, dropout off: minigpt's model read from a transformers one has its loss and every
    parameter's gradient (ours written as transformers' tensors: a fused one split, an expert stack unstacked). The
    router's balance loss off: transformers adds it only with output_router_logits (and then to its loss too)."""
    theirs, hf_dir = transformers_model(shape, tmp_path)
    config = check_hf_dir(hf_dir).with_(aux_loss_coef=0.0)  # every tensor there at its size, from the headers
    ours, state = GPT(config), read_hf_dir(hf_dir, config)
    ours.load_state_dict({**state, "head.weight": state["tok_emb.weight"]} if config.tied_head else state)
    inputs = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    targets = inputs.roll(-1, 1)
    loss = torch.nn.functional.cross_entropy(ours(inputs).flatten(0, 1), targets.flatten())
    loss.backward()
    their_loss = theirs(input_ids=inputs, labels=targets, shift_labels=targets).loss
    their_loss.backward()
    assert abs(loss.item() - their_loss.item()) <= 1e-5
    theirs_by_name = hub_named({name: param.grad for name, param in theirs.named_parameters()}, layout_of(config))
    if layout_of(config) != "phi3":  # a Phi-3 read as Llama's block: its fused tensors as the pieces we write
        theirs_by_name = {name: grad for name, grad in unfused(theirs_by_name, config).items()
                          if not name.endswith(tuple(FUSED))}
    ours_by_name = {name: grad for name, grad in to_hf({name: param.grad for name, param in ours.named_parameters()},
                                                       config, gradients=True).items()
                    if not name.endswith("e_score_correction_bias")}  # DeepSeek's router buffer: no gradient
    assert len(ours_by_name) == len(theirs_by_name)
    for name, grad in ours_by_name.items():
        expected = lookup(theirs_by_name, name)
        gap = (grad - expected).abs().max().item()
        assert gap <= 1e-5 * max(1.0, expected.abs().max().item()), (name, gap)


def test_every_shape_is_written_in_the_layout_that_holds_it_or_refused():
    assert layout_of(GPTConfig()) == "gpt2"
    llama = GPTConfig(n_kv_heads=2, mlp="swiglu", norm="rmsnorm", positions="rope", bias=False, d_head=64)
    assert layout_of(llama) == "llama" and config_from_hf(hf_config(llama)) == llama
    assert config_from_hf(hf_config(GPTConfig(tied_head=False))) == GPTConfig(tied_head=False)
    llama31 = llama.with_(rope_scaling=(8.0, 1.0, 4.0, 8192), rope_theta=500000.0)  # Llama 3.1's context scaling
    assert config_from_hf(hf_config(llama31)) == llama31
    qwen3 = llama.with_(qk_norm=True, norm_eps=1e-6)
    assert layout_of(qwen3) == "qwen3" and config_from_hf(hf_config(qwen3)) == qwen3
    qwen2 = llama.with_(qkv_bias=True, norm_eps=1e-6, tied_head=True, rope_theta=1e6)
    assert layout_of(qwen2) == "qwen2" and config_from_hf(hf_config(qwen2)) == qwen2
    assert layout_of(llama.with_(bias=True, qkv_bias=True)) == "llama"  # every Linear's bias: Llama's attention_bias
    assert layout_of(GPTConfig(bias=False, qkv_bias=True)) == "gpt2"  # zero biases elsewhere compute the same
    assert config_from_hf(hf_config(GPTConfig(norm_eps=1e-6))).norm_eps == 1e-6
    mixtral = llama.with_(n_experts=8, top_k=2, d_expert=None, aux_loss_coef=0.01)
    assert layout_of(mixtral) == "mixtral" and config_from_hf(hf_config(mixtral)) == mixtral
    assert config_from_hf(hf_config(mixtral.with_(capacity_factor=1.25))) == mixtral  # training's choice, as dropout
    qwen3_moe = qwen3.with_(n_experts=8, top_k=2, d_expert=32, dense_layers=1, aux_loss_coef=0.001)
    assert layout_of(qwen3_moe) == "qwen3_moe" and config_from_hf(hf_config(qwen3_moe)) == qwen3_moe
    sparse = qwen3_moe.with_(n_layers=6, moe_every=2)  # a mixture in blocks 1, 3 and 5 (decoder_sparse_step 2)
    assert hf_config(sparse)["decoder_sparse_step"] == 2 and config_from_hf(hf_config(sparse)) == sparse
    with pytest.raises(ConfigError, match="decoder_sparse_step"):
        layout_of(mixtral.with_(moe_every=2))
    for scores in (qwen3_moe.with_(renormalize_gates=False), qwen3_moe.with_(top_k=1)):  # the gates as chosen
        assert hf_config(scores)["norm_topk_prob"] is False and config_from_hf(hf_config(scores)) == scores
    # q, k and v biases and a gated shared expert beside softmax-routed ones: Qwen2-MoE's layout
    qwen2_moe = qwen2.with_(n_experts=8, top_k=2, d_expert=32, n_shared_experts=2, shared_expert_gate=True,
                            dense_layers=1, renormalize_gates=False)
    for shape in (qwen2_moe, qwen2_moe.with_(qkv_bias=False, renormalize_gates=True, dense_layers=0)):
        assert layout_of(shape) == "qwen2_moe" and config_from_hf(hf_config(shape)) == shape
    assert hf_config(qwen2_moe)["shared_expert_intermediate_size"] == 64
    for bad, word in ((qwen2_moe.with_(shared_expert_gate=False), "without Qwen2-MoE's gate"),
                      (qwen2_moe.with_(n_shared_experts=0, shared_expert_gate=False), "without Qwen2-MoE's gate"),
                      (qwen2_moe.with_(qkv_bias=False, qk_norm=True), "per-head q/k norms")):
        with pytest.raises(ConfigError, match=word):
            layout_of(bad)
    # q and k normalised over all heads, softmax-routed experts in every block: OLMoE's layout
    olmoe = llama.with_(d_head=None, qk_norm=True, qk_norm_whole=True, n_experts=8, top_k=2, renormalize_gates=False)
    assert layout_of(olmoe) == "olmoe" and config_from_hf(hf_config(olmoe)) == olmoe
    assert config_from_hf(hf_config(olmoe.with_(renormalize_gates=True))) == olmoe.with_(renormalize_gates=True)
    for bad in (olmoe.with_(dense_layers=1), olmoe.with_(d_head=16), olmoe.with_(pre_norms=False, post_norms=True)):
        with pytest.raises(ConfigError, match="OLMoE's"):
            layout_of(bad)
    # DeepSeek's experts (a sigmoid router) after grouped-query attention: GLM-4.5's layout, half of each head turned
    glm = qwen3_moe.with_(router="sigmoid", n_shared_experts=1, expert_bias=True, routed_scale=2.5, expert_groups=2,
                          groups_per_token=1, qkv_bias=True, rotary_fraction=0.5, mtp_depth=1, aux_loss_coef=0.0)
    for sigmoid in (glm, glm.with_(qk_norm=False, qkv_bias=False, rotary_fraction=1.0, mtp_depth=0),
                    mixtral.with_(router="sigmoid", aux_loss_coef=0.0)):  # (the rotation written where whole too)
        assert layout_of(sigmoid) == "glm4_moe"  # read back with its choice bias (zeros where none) frozen
        assert config_from_hf(hf_config(sigmoid)) == sigmoid.with_(expert_bias=True, expert_bias_rate=0.0,
                                                                   d_expert=sigmoid.expert_width)
    assert hf_config(glm)["rope_parameters"]["partial_rotary_factor"] == 0.5
    olmo = qwen3.with_(qk_norm_whole=True, pre_norms=False, post_norms=True)  # OLMo 2's block
    assert layout_of(olmo) == "olmo2" and config_from_hf(hf_config(olmo)) == olmo
    olmo3 = olmo.with_(window=12, full_attention_every=4, n_layers=8)  # OLMo 3's: three layers in four slide
    assert layout_of(olmo3) == "olmo3" and config_from_hf(hf_config(olmo3)) == olmo3
    for bad in (olmo.with_(pre_norms=True), olmo.with_(qk_norm_whole=False), olmo.with_(qkv_bias=True)):
        with pytest.raises(ConfigError, match="OLMo 2"):
            layout_of(bad)
    # those norms before pre norms in a sigmoid-routed mixture of experts: MiniMax-M2's layout
    minimax = qwen3.with_(qk_norm_whole=True, rotary_fraction=0.5, n_experts=8, top_k=2, router="sigmoid",
                          expert_bias=True, expert_bias_rate=0.0)
    assert layout_of(minimax) == "minimax_m2" and config_from_hf(hf_config(minimax)) == minimax
    for bad in (glm.with_(qk_norm_whole=True), minimax.with_(n_shared_experts=1), minimax.with_(dense_layers=1),
                minimax.with_(renormalize_gates=False)):
        with pytest.raises(ConfigError, match="MiniMax-M2"):
            layout_of(bad)
    for bad, word in ((olmo.with_(n_experts=4, top_k=2), "OLMoE's"),  # a softmax router: OLMoE's, pre norms and all
                      (minimax.with_(router="softmax", expert_bias=False), "OLMoE's"),  # heads not d_model / n_heads
                      (minimax.with_(router="softmax", expert_bias=False, d_head=None), "olmoe layout turns every")):
        with pytest.raises(ConfigError, match=word):
            layout_of(bad)
    for bad, word in ((glm.with_(bias=True), "bias-free"), (glm.with_(window=12), "sliding window"),
                      (glm.with_(nope_every=2), "SmolLM3")):
        with pytest.raises(ConfigError, match=word):
            layout_of(bad)
    for bad, word in ((mixtral.with_(n_shared_experts=1), "shared experts without Qwen2-MoE's gate"),
                      (mixtral.with_(top_k=1), "top-1"), (mixtral.with_(renormalize_gates=False), "chosen scores"),
                      (mixtral.with_(router="softmax", expert_bias=True), "bias"),
                      (mixtral.with_(dense_layers=1), "dense first blocks"), (mixtral.with_(bias=True), "bias-free")):
        with pytest.raises(ConfigError, match=word):
            layout_of(bad)
    mistral = llama.with_(bias=False, window=12)  # a sliding window: Mistral's layout, Mixtral's with experts
    assert layout_of(mistral) == "mistral" and config_from_hf(hf_config(mistral)) == mistral
    assert config_from_hf(hf_config(mixtral.with_(window=12))) == mixtral.with_(window=12)
    assert layout_of(llama.with_(window=llama.seq_len)) == "llama"  # a window as long as the context: none
    for windowed in (qwen3.with_(window=12), qwen3.with_(window=12, full_attention_every=2),  # in layer_types
                     qwen2.with_(window=12, full_attention_every=3), qwen2.with_(window=12, n_layers=6)):
        assert layout_of(windowed) in ("qwen2", "qwen3") and config_from_hf(hf_config(windowed)) == windowed
    assert hf_config(qwen3.with_(window=12, full_attention_every=2))["layer_types"] == [
        "sliding_attention", "full_attention"] * (qwen3.n_layers // 2)
    for bad, word in ((mistral.with_(bias=True), "no biases"), (GPTConfig(window=12), "sliding window"),
                      (mistral.with_(full_attention_every=2), "layer_types"),
                      (mixtral.with_(window=12, full_attention_every=2), "layer_types")):
        with pytest.raises(ConfigError, match=word):
            layout_of(bad)
    yarn = (4.0, 8, 32.0, 1.0, 1.0, 0.8)  # YaRN's rotation, written as rope_type "yarn" and read back
    assert config_from_hf(hf_config(qwen3.with_(rope_yarn=yarn[:4] + (0.0, 0.0)))) == qwen3.with_(
        rope_yarn=yarn[:4] + (0.0, 0.0))
    unrounded = qwen3.with_(rope_yarn=yarn[:4] + (0.0, 0.0), rope_yarn_truncate=False)  # GPT-OSS's YaRN
    assert hf_config(unrounded)["rope_parameters"]["truncate"] is False and config_from_hf(
        hf_config(unrounded)) == unrounded
    deepseek = preset("tiny-deepseek")  # DeepSeek-V3's layout, its latent norms with their own epsilon
    assert layout_of(deepseek) == "deepseek_v3"
    assert config_from_hf(hf_config(deepseek.with_(rope_yarn=yarn))) == deepseek.with_(
        rope_yarn=yarn, aux_loss_coef=0.0, expert_bias_rate=0.0)
    # training's choices, not written: the balance loss, the bias's rate (read frozen)
    assert config_from_hf(hf_config(deepseek)) == deepseek.with_(aux_loss_coef=0.0, expert_bias_rate=0.0)
    dense_latent = deepseek.with_(n_experts=0, d_expert=None, n_shared_experts=0, dense_layers=0, router="softmax",
                                  expert_bias=False, expert_bias_rate=0.0)
    assert config_from_hf(hf_config(dense_latent)) == dense_latent.with_(aux_loss_coef=0.0)
    # DeepSeek-V2's router (softmax scores as they are, scaled; groups scored by their best) over the same attention
    v2 = deepseek.with_(router="softmax", expert_bias=False, expert_bias_rate=0.0, renormalize_gates=False,
                        expert_groups=4, groups_per_token=2, group_score_top=1, routed_scale=16.0)
    for shape in (v2, v2.with_(expert_groups=1, groups_per_token=None, q_lora_rank=0)):
        assert layout_of(shape) == "deepseek_v2" and config_from_hf(hf_config(shape)) == shape.with_(aux_loss_coef=0.0)
    assert hf_config(v2)["topk_method"] == "group_limited_greedy" and "rope_interleave" not in hf_config(v2)
    for bad, word in ((v2.with_(renormalize_gates=True), "renormalised gates"), (v2.with_(group_score_top=2), "best"),
                      (deepseek.with_(group_score_top=1, expert_groups=4, groups_per_token=2), "two best"),
                      (v2.with_(mtp_depth=1), "multi-token")):
        with pytest.raises(ConfigError, match=word):
            layout_of(bad)
    for bad, word in ((deepseek.with_(router="softmax"), "softmax"), (deepseek.with_(norm="layernorm"), "bias-free"),
                      (deepseek.with_(rope_scaling=(8.0, 1.0, 4.0, 64)), "scaling")):
        with pytest.raises(ConfigError, match=word):
            layout_of(bad)
    for bad, word in ((GPTConfig(n_experts=4), "mixture of experts"), (GPTConfig(qk_norm=True), "q/k norms"),
                      (qwen3.with_(bias=True), "bias-free"), (qwen3.with_(qkv_bias=True), "bias-free"),
                      (GPTConfig(positions="rope"), "neither"), (GPTConfig(n_kv_heads=2), "grouped-query"),
                      # rotations a layout would write as whole ones: refused, not written as another model
                      (mixtral.with_(rotary_fraction=0.5), "mixtral layout turns every block's whole heads"),
                      (qwen3_moe.with_(nope_every=2), "SmolLM3"),
                      (qwen3.with_(rope_longrope=((1.0,) * 32, (2.0,) * 32, 64, 1.1)), "LongRoPE")):
        with pytest.raises(ConfigError, match=word):
            layout_of(bad)


def test_transformers_models_minigpt_computes_differently_are_refused():
    llama = hf_config(GPTConfig(mlp="swiglu", norm="rmsnorm", positions="rope"))
    qwen3 = hf_config(GPTConfig(mlp="swiglu", norm="rmsnorm", positions="rope", bias=False, qk_norm=True))
    qwen2 = hf_config(GPTConfig(mlp="swiglu", norm="rmsnorm", positions="rope", bias=False, qkv_bias=True))
    windowed = {**qwen2, "use_sliding_window": True, "sliding_window": 12, "num_hidden_layers": 4}
    assert config_from_hf({**windowed, "max_window_layers": 0}).window == 12  # every layer from the first
    assert config_from_hf(windowed).window == 0  # max_window_layers 4 (as written): no layer through it
    assert config_from_hf({**windowed, "layer_types": ["sliding_attention", "full_attention"] * 2}).with_(
        n_layers=4).full_attention_every == 2  # GPT-OSS's alternation, read from layer_types
    for change, word in (({**qwen3, "use_sliding_window": True}, "sliding_window"),  # in use, no length
                         ({**windowed, "max_window_layers": 1}, "pattern"),  # the full layers first
                         ({**windowed, "layer_types": ["sliding_attention", "global"] * 2}, "per layer"),
                         ({**windowed, "layer_types": ["sliding_attention"]}, "per layer"),
                         ({**qwen3, "attention_bias": True}, "biases")):
        with pytest.raises(ConfigError, match=word):
            config_from_hf(change)
    for change, word in (({"rms_norm_eps": 0}, "norm_eps"), ({"hidden_act": "gelu"}, "activation"),
                         ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5}}, "scaled"),
                         ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 5e5, "factor": 4.0}},
                          "original_max_position_embeddings"),
                         ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 5e5, "factor": 4.0, "truncate": "no",
                                               "original_max_position_embeddings": 8}}, "truncate"),
                         ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "linear"),
                         ({"model_type": "bert"}, "model_type")):
        with pytest.raises(ConfigError, match=word):
            config_from_hf({**llama, **change})
    with pytest.raises(ConfigError, match="activation"):
        config_from_hf({**hf_config(GPTConfig()), "activation_function": "relu"})
    moe = GPTConfig(mlp="swiglu", norm="rmsnorm", positions="rope", bias=False, n_experts=4)
    mixtral, qwen3_moe = hf_config(moe), hf_config(moe.with_(qk_norm=True, dense_layers=1))
    qwen2_moe = hf_config(moe.with_(d_expert=16, n_shared_experts=2, shared_expert_gate=True, qkv_bias=True))
    mistral = {**llama, "model_type": "mistral", "sliding_window": 4096, "max_position_embeddings": 32768}
    phi = {**llama, "model_type": "phi3", "sliding_window": None}
    assert config_from_hf(phi) == config_from_hf({**llama, "attention_bias": False, "mlp_bias": False})
    assert config_from_hf({**phi, "partial_rotary_factor": 0.75}).rotary_dim == 24  # Phi-4-mini's: 3/4 of each head
    with pytest.raises(ConfigError, match="even whole number"):  # 9.6 of the 32 columns
        config_from_hf({**phi, "partial_rotary_factor": 0.3})
    with pytest.raises(ConfigError, match="short_factor"):  # LongRoPE without its factors
        config_from_hf({**phi, "rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4,
                                                   "original_max_position_embeddings": 8}})
    assert config_from_hf(mistral, seq_len=4096).window == 0  # the window holds the context: full attention
    assert config_from_hf(mistral).window == 4096  # shorter than the context: every layer's window
    assert config_from_hf({**mixtral, "sliding_window": 64, "max_position_embeddings": 128}).window == 64
    for change, word in (({**mixtral, "router_jitter_noise": 0.1}, "jitter"),
                         ({**mistral, "layer_types": ["sliding_attention", "full_attention"]}, "some of its layers"),
                         ({**mixtral, "num_experts_per_tok": 1}, "top-1"),
                         ({**qwen3_moe, "norm_topk_prob": "no"}, "norm_topk_prob"),
                         ({**qwen2_moe, "shared_expert_intermediate_size": 40}, "whole number of experts"),
                         ({**qwen2_moe, "shared_expert_intermediate_size": 0}, "whole number of experts"),
                         ({**qwen2_moe, "qkv_bias": "yes"}, "qkv_bias"),
                         ({**qwen3_moe, "num_experts_per_tok": 1, "norm_topk_prob": True}, "top-1"),
                         ({**hf_config(moe.with_(qk_norm=True, qk_norm_whole=True)), "clip_qkv": 8.0}, "clip_qkv"),
                         ({**qwen3_moe, "decoder_sparse_step": "2"}, "decoder_sparse_step"),
                         ({**qwen3_moe, "decoder_sparse_step": 3, "num_hidden_layers": 2}, "moe_every"),
                         ({**qwen3_moe, "mlp_only_layers": [1]}, "not its first")):
        with pytest.raises(ConfigError, match=word):
            config_from_hf(change)
    with pytest.raises(ConfigError, match="max_position_embeddings"):
        config_from_hf(llama, seq_len=4096)
    deepseek = hf_config(preset("tiny-deepseek"))  # read with its routing; refused where minigpt computes otherwise
    assert config_from_hf({**deepseek, "n_group": 4, "topk_group": 2, "routed_scaling_factor": 2.5}) == preset(
        "tiny-deepseek").with_(expert_groups=4, groups_per_token=2, routed_scale=2.5, aux_loss_coef=0.0,
                               expert_bias_rate=0.0)
    assert config_from_hf({**deepseek, "norm_topk_prob": False}).renormalize_gates is False
    v2 = {**deepseek, "model_type": "deepseek_v2", "topk_method": "group_limited_greedy", "n_group": 4,
          "topk_group": 2, "norm_topk_prob": False}
    assert config_from_hf(v2).group_score_top == 1 and config_from_hf(v2).router == "softmax"
    for change, word in (({"topk_method": "noaux_tc"}, "topk_method"), ({"norm_topk_prob": True}, "norm_topk_prob"),
                         ({"mlp_bias": True}, "biases")):
        with pytest.raises(ConfigError, match=word):
            config_from_hf({**v2, **change})
    for change, word in (({"norm_topk_prob": 0}, "norm_topk_prob"),
                         ({"rope_interleave": False}, "rope_interleave"), ({"num_key_value_heads": 2}, "fewer"),
                         ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 40.0}},
                          "original_max_position_embeddings"),
                         ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0,
                                               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                               "original_max_position_embeddings": 8}}, "Llama 3.1")):
        with pytest.raises(ConfigError, match=word):
            config_from_hf({**deepseek, **change})


@pytest.mark.slow
def test_bad_model_directories_get_one_line_before_any_rank_starts(tmp_path):
    model, hf_dir = transformers_model("llama", tmp_path)
    one_line_refusal(invoke("train", "--init-from", str(tmp_path / "nowhere")), "not a directory")
    (tmp_path / "empty").mkdir()
    one_line_refusal(invoke("train", "--init-from", str(tmp_path / "empty")), "no config.json")
    one_line_refusal(invoke("train", "--init-from", str(hf_dir), "--layers", "3"), "--layers", "init-from")
    one_line_refusal(invoke("train", "--init-from", str(hf_dir), "--model", "tiny"), "--model")
    config = json.loads((hf_dir / "config.json").read_text())
    (hf_dir / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 3}))
    one_line_refusal(invoke("train", "--init-from", str(hf_dir)), "layers.2")  # the weights hold two layers
    (hf_dir / "config.json").write_text("{not json")
    one_line_refusal(invoke("train", "--init-from", str(hf_dir)), "JSON")
    (hf_dir / "config.json").write_text(json.dumps(config))
    (hf_dir / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{broken}")
    one_line_refusal(invoke("train", "--init-from", str(hf_dir)), "safetensors")


@pytest.mark.slow
def test_export_refuses_in_one_line_and_overwrites_nothing(exported, tmp_path):
    checkpoint, hf_dir = exported["gpt2"]
    before = {path.name: path.stat().st_mtime_ns for path in hf_dir.iterdir()}
    one_line_refusal(invoke("export", checkpoint, "--hf", str(hf_dir)), "not an empty directory")
    assert {path.name: path.stat().st_mtime_ns for path in hf_dir.iterdir()} == before
    one_line_refusal(invoke("export", str(tmp_path / "nowhere"), "--hf", str(tmp_path / "out")), "does not exist")
    (tmp_path / "run").mkdir()
    one_line_refusal(invoke("export", str(tmp_path / "run"), "--hf", str(tmp_path / "out")), "no checkpoint")
    assert not (tmp_path / "out").exists()
    result = invoke("train", "--layers", "1", "--seq-len", "16", "--steps", "1", "--global-batch", "2", "--qk-norm",
                    "--eval-every", "0", "--out", str(tmp_path / "qk"))
    assert result.exit_code == 0, result.output
    one_line_refusal(invoke("export", str(tmp_path / "qk"), "--hf", str(tmp_path / "out")), "q/k norms")
    assert not (tmp_path / "out").exists()
    result = invoke("export", checkpoint, "--hf", str(tmp_path / "again"))  # one checkpoint, named directly
    assert result.exit_code == 0 and sorted(p.name for p in (tmp_path / "again").iterdir()) == \
        ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]


@pytest.mark.slow
def test_a_bpe_run_exports_with_its_tokenizer_and_comes_back_with_it(tmp_path):
    """A byte-level BPE trained on the corpus: the run trained with it exports its tokenizer.json, which
    transformers' AutoTokenizer reads to the same ids, and --init-from takes it back without being told."""
    from minigpt.data import embedded_corpus
    from minigpt.tokenizer import load_tokenizer, train_bpe

    text = embedded_corpus()[:200_000].decode("utf-8", errors="ignore")
    train_bpe(text, 300).save(tmp_path / "bpe")
    result = invoke("train", "--layers", "2", "--seq-len", "32", "--steps", "2", "--global-batch", "4",
                    "--tokenizer", str(tmp_path / "bpe"), "--eval-every", "0", "--out", str(tmp_path / "run"))
    assert result.exit_code == 0, result.output
    result = invoke("export", str(tmp_path / "run"), "--hf", str(tmp_path / "hf"), "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["tokenizer"].endswith("tokenizer.json")
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    sample = "ROMEO: But soft, what light through yonder window breaks?"
    ours = load_tokenizer(str(tmp_path / "bpe"))
    assert theirs(sample)["input_ids"] == ours.encode(sample).tolist() and theirs.decode(ours.encode(sample)) == sample
    result = invoke("train", "--init-from", str(tmp_path / "hf"), "--steps", "1", "--global-batch", "2", "--no-save",
                    "--eval-every", "0", "--out", str(tmp_path / "again"), "--json")
    assert result.exit_code == 0, result.output
    config = json.loads(result.stdout)["config"]
    assert config["tokenizer"] == str(tmp_path / "hf" / "tokenizer.json") and config["model"]["vocab_size"] == 300


@pytest.mark.slow
def test_a_byte_run_exports_the_byte_tokenizer_that_transformers_reads(exported, tmp_path):
    _, hf_dir = exported["llama"]
    theirs = transformers.AutoTokenizer.from_pretrained(hf_dir)
    sample = "Héllo, wörld: ROMEO!\n"
    assert theirs(sample)["input_ids"] == list(sample.encode("utf-8"))  # the byte tokenizer's ids
    assert theirs.decode(list(sample.encode("utf-8"))) == sample
    result = invoke("train", "--init-from", str(hf_dir), "--steps", "1", "--global-batch", "2", "--no-save",
                    "--eval-every", "0", "--out", str(tmp_path / "again"), "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["config"]["tokenizer"] == "bytes"  # recognised, not re-encoded by a BPE

