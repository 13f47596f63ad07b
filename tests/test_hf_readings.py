"""What minigpt reads of others' models beside their layouts (test_hf.py): DeepSeek-V3's choice bias, YaRN (a model's
own, and --rope-yarn extending one), Llama 3.1's scaled rotation, block-wise fp8 weights, and a released config.json
given as --model to simulate and plan; each against transformers' own model where it has one."""

from __future__ import annotations

import json

import pytest
import torch

from hf_models import transformers, transformers_model
from hf_released import DEEPSEEK_V3_RELEASED, MISTRAL_7B_RELEASED
from minigpt.data import BatchLayout, Corpus, get_batch
from minigpt.errors import ConfigError
from minigpt.hf.files import check_hf_dir, read_hf_dir
from minigpt.hf.layouts import config_from_hf, from_hf, hf_config, to_hf
from minigpt.model import GPT
from test_hf import invoke, one_line_refusal


def test_rope_yarn_extends_an_imported_models_context(tmp_path):
    """`--init-from DIR --rope-yarn 2 --seq-len 64` trains a Qwen3 of context 32 at 64 tokens by YaRN, from the
    first loss transformers' own Qwen3 with that YaRN gives over the same weights; the export writes it."""
    model, hf_dir = transformers_model("qwen3", tmp_path)
    run = tmp_path / "run"
    result = invoke("train", "--init-from", str(hf_dir), "--rope-yarn", "2", "--seq-len", "64", "--steps", "2",
                    "--global-batch", "4", "--eval-every", "0", "--out", str(run), "--json")
    assert result.exit_code == 0, result.output
    losses = json.loads(result.stdout)["losses"]
    config = transformers.Qwen3Config(**{**model.config.to_dict(), "max_position_embeddings": 64, "rope_parameters": {
        "rope_type": "yarn", "rope_theta": 1e6, "factor": 2.0, "original_max_position_embeddings": 32}})
    theirs = transformers.AutoModelForCausalLM.from_config(config).eval()
    theirs.load_state_dict(model.state_dict())
    inputs, targets = get_batch(Corpus.load(None, 64).train, 64, BatchLayout(4, 1, 1), 0, 0, 0, 0)  # step 0's batch
    with torch.no_grad():
        targets = targets.contiguous()
        loss = theirs(input_ids=inputs, labels=targets, shift_labels=targets).loss.item()
    assert abs(losses[0] - loss) <= 1e-5, (losses[0], loss)
    result = invoke("export", str(run), "--hf", str(tmp_path / "hf-64"))
    assert result.exit_code == 0, result.output
    written = json.loads((tmp_path / "hf-64" / "config.json").read_text())
    assert written["max_position_embeddings"] == 64 and written["rope_parameters"]["rope_type"] == "yarn"
    assert (written["rope_parameters"]["factor"], written["rope_parameters"]["original_max_position_embeddings"]) == (
        2.0, 32)
    for args, words in ((["--seq-len", "128"], "beyond YaRN's reach"), (["--layers", "1"], "--layers")):
        one_line_refusal(invoke("train", "--init-from", str(hf_dir), "--rope-yarn", "2", *args, "--out",
                                str(tmp_path / "refused")), *words.split(" ", 1)[:1])
    assert not (tmp_path / "refused").exists()


def test_deepseeks_router_bias_chooses_as_transformers(tmp_path):
    """A DeepSeek-V3 model's e_score_correction_bias (transformers_model sets it far from zero) is read as our choice
    bias: the same logits as transformers; read as zeros, other experts are chosen and the logits move."""
    theirs, hf_dir = transformers_model("deepseek_v3", tmp_path)
    config = check_hf_dir(hf_dir)
    assert config.expert_bias and config.expert_bias_rate == 0.0  # read frozen
    state = read_hf_dir(hf_dir, config)
    assert state["blocks.1.mlp.expert_bias"].abs().min() > 0
    ours = GPT(config)
    ours.load_state_dict(state)
    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = theirs(tokens).logits
        gap = (ours(tokens) - expected).abs().max().item()
        ours.blocks[1].mlp.expert_bias.zero_()
        unbiased = (ours(tokens) - expected).abs().max().item()
    assert gap <= 1e-5 < 1e-2 < unbiased, (gap, unbiased)
    assert to_hf(ours.state_dict(), config)["model.layers.1.mlp.gate.e_score_correction_bias"].abs().max() == 0


def block_fp8(weight: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`weight` quantized as DeepSeek-V3's releases are: e4m3 in blocks of block x block, each scaled by its largest
    magnitude over 448, the scale stored (weight_scale_inv: what dequantization multiplies by)."""
    rows, cols = weight.shape
    scales = torch.zeros(-(-rows // block), -(-cols // block))
    quantized = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    for i in range(scales.shape[0]):
        for j in range(scales.shape[1]):
            piece = weight[i * block:(i + 1) * block, j * block:(j + 1) * block].float()
            scales[i, j] = piece.abs().max() / 448
            quantized[i * block:(i + 1) * block, j * block:(j + 1) * block] = (piece / scales[i, j]).to(
                torch.float8_e4m3fn)
    return quantized, scales


def test_block_fp8_weights_are_read_multiplied_out(tmp_path):
    """A DeepSeek-V3 directory in its releases' block-wise fp8 (quant_method "fp8", weight_block_size; here blocks of
    16, partial at the edges): every quantized Linear read as its fp8 values times its block's scale (transformers
    5.25 on a CPU, with accelerate, dequantizes this directory to the very same values: checked when this was
    written), the model's loss within fp8's error of the full-precision one; scales of the wrong shape, or another
    quantization, refused in one line before any rank starts."""
    from safetensors.torch import load_file, save_file

    theirs, hf_dir = transformers_model("deepseek_v3", tmp_path)
    full = load_file(str(hf_dir / "model.safetensors"))
    stored, expected = {}, dict(full)
    for name, weight in full.items():
        if weight.dim() == 2 and name.endswith("proj.weight"):  # the Linears; embeddings, router and norms as they are
            stored[name], stored[name + "_scale_inv"] = block_fp8(weight, 16)
            expected[name] = torch.stack([torch.stack([stored[name][i, j].float() * stored[name + "_scale_inv"][
                i // 16, j // 16] for j in range(weight.shape[1])]) for i in range(weight.shape[0])])
        else:
            stored[name] = weight
    quantized = tmp_path / "fp8"
    quantized.mkdir()
    save_file(stored, str(quantized / "model.safetensors"), metadata={"format": "pt"})
    hf = json.loads((hf_dir / "config.json").read_text())
    fp8 = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [16, 16]}
    (quantized / "config.json").write_text(json.dumps({**hf, "quantization_config": fp8}))
    config = check_hf_dir(quantized)
    state = read_hf_dir(quantized, config)
    assert state.keys() == read_hf_dir(hf_dir, config).keys()
    assert all(torch.equal(tensor, from_hf(expected, config)[name]) for name, tensor in state.items())
    ours = GPT(config)
    ours.load_state_dict(state)
    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        loss = torch.nn.functional.cross_entropy(ours(tokens).flatten(0, 1), tokens.roll(-1, 1).flatten()).item()
        exact = theirs(input_ids=tokens, labels=tokens.roll(-1, 1), shift_labels=tokens.roll(-1, 1)).loss.item()
    assert 0 < abs(loss - exact) / exact < 0.05, (loss, exact)
    for change, words in (({**fp8, "weight_block_size": [32, 32]}, "block scales"),
                          ({"quant_method": "mxfp4"}, "'mxfp4'"), ({"quant_method": "fp8"}, "weight_block_size")):
        (quantized / "config.json").write_text(json.dumps({**hf, "quantization_config": change}))
        with pytest.raises(ConfigError, match=words):
            check_hf_dir(quantized)


def test_llama31_scaled_rotary_positions_are_transformers():
    """Llama 3.1's rope_type "llama3" (its long wavelengths divided by the factor, the middle ones interpolated):
    a transformers Llama with it gives minigpt's logits over a context 4 times the scaling's original one, which
    the unscaled rotation misses by far."""
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16}
    config = transformers.LlamaConfig(vocab_size=256, max_position_embeddings=64, hidden_size=64, intermediate_size=96,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      rms_norm_eps=1e-5, tie_word_embeddings=False, rope_theta=500000.0,
                                      rope_scaling=scaling, initializer_range=0.2)
    torch.manual_seed(3)
    theirs = transformers.AutoModelForCausalLM.from_config(config).eval()
    ours_config = config_from_hf(config.to_dict())
    assert ours_config.rope_scaling == (8.0, 1.0, 4.0, 16)
    tokens = torch.randint(0, 256, (3, 64), generator=torch.Generator().manual_seed(0))
    gaps = {}
    for name, shape in (("scaled", ours_config), ("unscaled", ours_config.with_(rope_scaling=None))):
        ours = GPT(shape).eval()
        ours.load_state_dict(from_hf(dict(theirs.state_dict()), shape))
        with torch.no_grad():
            gaps[name] = (ours(tokens) - theirs(tokens).logits).abs().max().item()
    assert gaps["scaled"] <= 5e-5 and gaps["unscaled"] > 0.1, gaps  # logits up to about 7: 1e-5 of them


def test_simulate_and_plan_take_a_transformers_config_as_the_model(tmp_path):
    """`--model` also takes a transformers config.json (or the directory holding it): the shape --init-from would
    read, without weights, the other model flags over it; simulate prices it as the preset of that shape."""
    from minigpt.presets import PRESETS

    (tmp_path / "qwen").mkdir()
    (tmp_path / "qwen" / "config.json").write_text(json.dumps(hf_config(PRESETS["qwen2.5-7b"].with_(seq_len=32768))))
    runs = {}
    for model in ("qwen2.5-7b", str(tmp_path / "qwen"), str(tmp_path / "qwen" / "config.json")):
        result = invoke("simulate", "--model", model, "--seq-len", "4096", "--dp", "8", "--zero", "1", "--gpu",
                        "h100-sxm", "--json")
        assert result.exit_code == 0, result.output
        runs[model] = json.loads(result.stdout)
    steps = {run["step_time_s"] for run in runs.values()}
    assert len(steps) == 1  # the same shape, the same prediction
    result = invoke("plan", "--model", str(tmp_path / "qwen"), "--seq-len", "4096", "--gpus", "16", "--gpu",
                    "h100-sxm", "--json")
    assert result.exit_code == 0, result.output
    # DeepSeek-V3's own config.json (deepseek-ai/DeepSeek-V3 on the Hub, its fields as released): YaRN to 160K
    # contexts, noaux_tc routing (e_score_correction_bias), block-fp8 weights, one multi-token prediction module:
    # the deepseek-v3 preset's shape and
    # price (its training's balance loss given, which a config.json does not hold)
    (tmp_path / "dsv3.json").write_text(json.dumps(DEEPSEEK_V3_RELEASED))
    layout = ["--gpus", "1024", "--gpu", "h100-sxm", "--pp", "16", "--dp", "64", "--ep", "64", "--global-batch",
              "8192", "--json"]
    read = invoke("simulate", "--model", str(tmp_path / "dsv3.json"), "--seq-len", "4096", "--aux-loss-coef", "0.0001",
                  *layout)
    preset_run = invoke("simulate", "--model", "deepseek-v3", *layout)
    assert read.exit_code == 0 and preset_run.exit_code == 0, read.output + preset_run.output
    read, preset_run = json.loads(read.stdout), json.loads(preset_run.stdout)
    # its num_nextn_predict_layers 1: the multi-token prediction module, 11.6B beside the published 671B
    assert read["parameters"]["total"] == preset_run["parameters"]["total"] == 671_026_404_352 + 11_610_067_968
    assert read["parameters"]["mtp"] == preset_run["parameters"]["mtp"] == 11_610_067_968
    assert read["step_time_s"] == preset_run["step_time_s"]
    # Kimi K2 ships DeepSeek-V3's architecture under model_type "kimi_k2": read as that layout, the same price
    (tmp_path / "kimi.json").write_text(json.dumps({**DEEPSEEK_V3_RELEASED, "model_type": "kimi_k2"}))
    kimi = invoke("simulate", "--model", str(tmp_path / "kimi.json"), "--seq-len", "4096", "--aux-loss-coef",
                  "0.0001", *layout)
    assert kimi.exit_code == 0, kimi.output
    assert json.loads(kimi.stdout)["step_time_s"] == read["step_time_s"]
    # Mistral 7B's own (mistralai/Mistral-7B-v0.1): its 7,241,732,096 parameters, every layer through its window of
    # 4,096 at its 32K context (attention priced as the band), none at 4K
    (tmp_path / "mistral.json").write_text(json.dumps(MISTRAL_7B_RELEASED))
    steps = {}
    for args in ([], ["--window", "0"], ["--seq-len", "4096"]):
        result = invoke("simulate", "--model", str(tmp_path / "mistral.json"), *args, "--gpus", "8", "--dp", "8",
                        "--zero", "3", "--gpu", "h100-sxm", "--recompute", "full", "--json")
        assert result.exit_code == 0, result.output
        run = json.loads(result.stdout)
        assert run["parameters"]["total"] == 7_241_732_096
        steps[" ".join(args)] = run["step_time_s"]
    assert steps[""] < 0.8 * steps["--window 0"], steps
    (tmp_path / "bad.json").write_text("[1, 2]")
    one_line_refusal(invoke("simulate", "--model", str(tmp_path / "bad.json")), "not a JSON object")
    one_line_refusal(invoke("simulate", "--model", str(tmp_path)), "no config.json")
    one_line_refusal(invoke("simulate", "--model", "llama-9"), "unknown model preset", "config.json")


@pytest.mark.parametrize("shape, written_as", [("phi3_longrope", "Phi3ForCausalLM"),
                                               ("smollm3", "SmolLM3ForCausalLM"), ("gemma3", "Gemma3ForCausalLM"),
                                               ("glm4_moe", "Glm4MoeForCausalLM"), ("olmo2", "Olmo2ForCausalLM"),
                                               ("minimax_m2", "MiniMaxM2ForCausalLM"), ("olmo3", "Olmo3ForCausalLM"),
                                               ("olmoe", "OlmoeForCausalLM"),
                                               ("deepseek_v2_groups", "DeepseekV2ForCausalLM"),
                                               ("qwen2_moe", "Qwen2MoeForCausalLM"), ("gemma2", "Gemma2ForCausalLM"),
                                               ("granite", "GraniteForCausalLM"), ("olmo3_yarn", "Olmo3ForCausalLM")])
def test_models_read_are_written_back_as_they_were(tmp_path, shape, written_as):
    """Phi-4-mini's rotation (the first 3/4 of each head, by LongRoPE's long factors), SmolLM3's (none in every
    second block here), Gemma 3's block, GLM-4.5's (half of each head turned, q/k norms and biases, DeepSeek's
    experts), OLMo 2's and MiniMax-M2's read into minigpt and written again: transformers' Phi-3, SmolLM3, Gemma 3,
    GLM-4.5, OLMo 2 or MiniMax-M2 layout (and OLMoE's: OLMo 2's q/k norms, experts whose gates are the chosen
    scores), every
    tensor the one read (the rotated columns and their gains moved back, Gemma's gains less 1), and the model
    transformers opens from it gives minigpt's logits."""
    from minigpt.hf.files import write_hf_dir

    theirs, hf_dir = transformers_model(shape, tmp_path)
    config = check_hf_dir(hf_dir)
    if shape == "phi3_longrope":
        assert (config.rotary_dim, config.longrope_factors) == (12, (1.0, 1.5, 2.0, 3.0, 5.0, 8.0))
    elif shape == "smollm3":
        assert [config.layer_rotates(layer) for layer in range(4)] == [True, False, True, False]
    elif shape == "minimax_m2":
        assert (config.rotary_dim, config.qk_norm_whole, config.router, config.expert_bias) == (12, True, "sigmoid", True)
    elif shape == "deepseek_v2_groups":
        assert (config.router, config.renormalize_gates, config.group_score_top, config.groups_per_token,
                config.routed_scale) == ("softmax", False, 1, 2, 16.0)
    elif shape == "qwen2_moe":
        assert (config.qkv_bias, config.n_shared_experts, config.shared_expert_gate, config.renormalize_gates) == (
            True, 2, True, False)
    elif shape == "olmoe":
        assert (config.qk_norm_whole, config.pre_norms, config.renormalize_gates, config.n_experts) == (True, True,
                                                                                                         False, 4)
    elif shape == "olmo3":
        assert (config.window, config.full_attention_every, config.pre_norms) == (12, 2, False)
    elif shape == "olmo3_yarn":
        assert (config.rope_yarn[:2], config.rope_local_theta, [config.layer_local(i) for i in range(2)]) == (
            (4.0, 8), 500000.0, [True, False])
    elif shape == "granite":
        assert (config.embed_multiplier, config.residual_multiplier, config.attention_multiplier,
                config.logit_divisor) == (4.0, 0.5, 0.3, 2.0)
    elif shape == "gemma2":
        assert (config.attention_softcap, config.logit_softcap, config.qk_norm, config.window,
                config.rope_local_theta, config.query_scale) == (2.0, 3.0, False, 12, None, 24.0)
    elif shape == "olmo2":
        assert (config.pre_norms, config.post_norms, config.qk_norm_whole) == (False, True, True)
    elif shape == "glm4_moe":
        assert (config.rotary_dim, config.qkv_bias, config.qk_norm, config.routed_scale, config.expert_groups,
                config.groups_per_token, config.n_shared_experts, config.dense_layers) == (12, True, True, 2.5, 2, 1, 1, 1)
    else:
        assert [config.layer_local(layer) for layer in range(4)] == [True, False, True, False]
        assert (config.rope_local_theta, config.rope_linear, config.query_scale) == (100.0, 2.0, 24.0)
    ours, state = GPT(config).eval(), read_hf_dir(hf_dir, config)
    ours.load_state_dict({**state, "head.weight": state["tok_emb.weight"]} if config.tied_head else state)
    written = write_hf_dir(ours.state_dict(), config, tmp_path / "again")
    again = transformers.AutoModelForCausalLM.from_pretrained(written).eval()
    assert type(again).__name__ == written_as
    original = dict(theirs.named_parameters())
    for name, param in again.named_parameters():  # Gemma's gains through 1 + weight and back: within fp32's step at 1
        gap = (param - original[name]).abs().max().item()
        assert gap <= (2 ** -23 if shape.startswith("gemma") and name.endswith("norm.weight") else 0.0), (name, gap)
    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        logits = again(tokens).logits
        gap = (ours(tokens) - logits).abs().max().item()
    assert gap <= 1e-5 * logits.abs().max().item(), gap  # fp32; its frequencies in fp32, ours in fp64 (2e-6 here)


def test_new_layouts_config_fields_of_any_type_are_refused_in_one_line():
    """A Phi-3's, SmolLM3's, Gemma 3's, GLM-4.5's, OLMo 2's, OLMo 3's or MiniMax-M2's config.json whose fields hold the wrong types (as random mutations of them
    found, each a TypeError, AttributeError or ZeroDivisionError before) gets ConfigError, as every other one."""
    from minigpt.presets import preset

    small = preset("tiny-llama").with_(seq_len=32)
    phi = hf_config(small.with_(rotary_fraction=0.5))
    smol = hf_config(small.with_(nope_every=2))
    glm = hf_config(small.with_(n_experts=4, top_k=2, router="sigmoid", rotary_fraction=0.5))
    olmo = hf_config(small.with_(qk_norm=True, qk_norm_whole=True, pre_norms=False, post_norms=True))
    minimax = hf_config(small.with_(qk_norm=True, qk_norm_whole=True, n_experts=4, top_k=2, router="sigmoid"))
    olmo3 = hf_config(small.with_(qk_norm=True, qk_norm_whole=True, pre_norms=False, post_norms=True, window=11,
                                  full_attention_every=2))
    gemma = hf_config(small.with_(mlp="geglu", qk_norm=True, post_norms=True, embed_scale=True, window=11,
                                  full_attention_every=2, rope_local_theta=100.0, tied_head=True))
    for broken in ({**phi, "rope_parameters": 3}, {**phi, "head_dim": {}}, {**smol, "no_rope_layer_interval": 0},
                   {**gemma, "num_hidden_layers": 0.5}, {**gemma, "rope_parameters": None, "rope_scaling": "x"},
                   {**gemma, "layer_types": None, "sliding_window_pattern": None},
                   {**glm, "attention_bias": "yes"}, {**glm, "partial_rotary_factor": "half"},
                   {**glm, "use_qk_norm": None}, {**glm, "norm_topk_prob": "no"}, {**glm, "n_group": "2"},
                   {**olmo, "attention_bias": True}, {**olmo, "attention_bias": "no"}, {**olmo, "head_dim": "x"},
                   {**minimax, "rotary_dim": 7.5}, {**minimax, "rotary_dim": 500}, {**minimax, "scoring_func": "softmax"},
                   {**minimax, "num_local_experts": None}, {**minimax, "qk_norm_type": "per_head"},
                   {**olmo3, "rope_parameters": {"full_attention": {"rope_type": "yarn", "factor": 2.0},
                                                 "sliding_attention": {"rope_type": "default"}}},
                   {**olmo3, "rope_parameters": {"full_attention": 3, "sliding_attention": None}},
                   {**olmo3, "rope_parameters": {"full_attention": {"rope_theta": 1.0}, "sliding_attention": {}}},
                   {**olmo3, "layer_types": ["full_attention", "sliding_attention"]}):
        with pytest.raises(ConfigError):
            config_from_hf(broken)


def test_published_moe_configs_count_the_published_parameters(tmp_path):
    """GLM-4.5's and GLM-4.5-Air's shapes (arXiv 2508.06471, Table 1: 92 and 46 layers, 3 and 1 of them dense, 160
    and 128 experts of 8 routed per token plus one shared, 96 query heads of 128 and 8 key/value heads, widths 5,120 and
    4,096, one multi-token prediction layer; their dense and expert widths and vocabulary as transformers'
    Glm4MoeConfig describes the Air) read as GLM-4.5's config.json: the report's 355B and 106B parameters (within 1%),
    32B and 12B active (within the half billion the report rounds to; without the embedding and head, as it counts).
    Our counts: 352.8B + 4.0B for the prediction layer, 32.1B active; 106.9B + 2.4B, 12.2B; MiniMax-M2 228.7B, 9.8B.
    OLMoE-1B-7B (arXiv 2409.02060, Table 1 and its config.json: 16 layers of width 2,048, 16 heads, 64 experts of
    1,024, 8 per token, a 50,304-token vocabulary untied): 6.9B parameters, 1.3B active counting the embedding and
    head as it does; ours 6.92B, 1.28B."""
    air = {"model_type": "glm4_moe", "vocab_size": 151552, "hidden_size": 4096, "intermediate_size": 10944,
           "moe_intermediate_size": 1408, "num_hidden_layers": 46, "first_k_dense_replace": 1,
           "num_attention_heads": 96, "num_key_value_heads": 8, "head_dim": 128, "n_routed_experts": 128,
           "n_shared_experts": 1, "num_experts_per_tok": 8, "num_nextn_predict_layers": 1, "attention_bias": True,
           "partial_rotary_factor": 0.5, "max_position_embeddings": 131072, "tie_word_embeddings": False}
    full = {**air, "hidden_size": 5120, "intermediate_size": 12288, "moe_intermediate_size": 1536,
            "num_hidden_layers": 92, "first_k_dense_replace": 3, "n_routed_experts": 160, "use_qk_norm": True,
            "routed_scaling_factor": 2.5}
    # MiniMax-M2's (its model card: 230B parameters, 10B active): transformers' MiniMaxM2Config describes it
    minimax = {**transformers.MiniMaxM2Config(rotary_dim=64).to_dict(), "model_type": "minimax_m2"}
    olmoe = {"model_type": "olmoe", "vocab_size": 50304, "hidden_size": 2048, "intermediate_size": 1024,
             "num_hidden_layers": 16, "num_attention_heads": 16, "num_experts": 64, "num_experts_per_tok": 8,
             "max_position_embeddings": 4096, "tie_word_embeddings": False, "norm_topk_prob": False}
    (tmp_path / "olmoe.json").write_text(json.dumps(olmoe))
    result = invoke("simulate", "--model", str(tmp_path / "olmoe.json"), "--gpus", "8", "--gpu", "h100-sxm", "--json")
    assert result.exit_code == 0, result.output
    counted = json.loads(result.stdout)["parameters"]
    assert (round(counted["total"] / 1e9, 2), round(counted["active"] / 1e9, 2)) == (6.92, 1.28), counted
    # DeepSeek-V2-Lite's and DeepSeek-V2's (arXiv 2405.04434, sections 3.1.2 and appendix B): 15.7B and 236B
    # parameters, 2.4B and 21B active, which count the head and not the embedding (ours 15.71B, 235.74B; 2.45B and
    # 20.85B)
    lite = {"model_type": "deepseek_v2", "vocab_size": 102400, "hidden_size": 2048, "intermediate_size": 10944,
            "moe_intermediate_size": 1408, "num_hidden_layers": 27, "num_attention_heads": 16, "kv_lora_rank": 512,
            "q_lora_rank": None, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128,
            "n_routed_experts": 64, "n_shared_experts": 2, "num_experts_per_tok": 6, "first_k_dense_replace": 1,
            "max_position_embeddings": 32768, "tie_word_embeddings": False, "topk_method": "greedy"}
    v2 = {**lite, "hidden_size": 5120, "intermediate_size": 12288, "moe_intermediate_size": 1536,
          "num_hidden_layers": 60, "num_attention_heads": 128, "q_lora_rank": 1536, "n_routed_experts": 160,
          "n_group": 8, "topk_group": 3, "routed_scaling_factor": 16.0, "topk_method": "group_limited_greedy"}
    # Qwen1.5-MoE-A2.7B (its card: 14.3B parameters, 2.7B active; transformers' Qwen2MoeConfig defaults are its
    # shape): ours 14.32B, 2.69B counting the embedding and the head
    qwen = {**transformers.Qwen2MoeConfig().to_dict(), "model_type": "qwen2_moe"}
    (tmp_path / "qwen.json").write_text(json.dumps(qwen))
    result = invoke("simulate", "--model", str(tmp_path / "qwen.json"), "--seq-len", "4096", "--gpus", "8", "--json")
    assert result.exit_code == 0, result.output
    counted = json.loads(result.stdout)["parameters"]
    assert (round(counted["total"] / 1e9, 2), round(counted["active"] / 1e9, 2)) == (14.32, 2.69), counted
    for shape, (total, active) in ((lite, (15.7e9, 2.4e9)), (v2, (236e9, 21e9))):
        (tmp_path / "v2.json").write_text(json.dumps(shape))
        result = invoke("simulate", "--model", str(tmp_path / "v2.json"), "--seq-len", "4096", "--gpus", "64",
                        "--gpu", "h100-sxm", "--ep", "8", "--json")
        assert result.exit_code == 0, result.output
        counted = json.loads(result.stdout)["parameters"]
        assert abs(counted["total"] - total) <= 0.01 * total and abs(
            counted["active"] - counted["embedding"] - active) <= 0.03 * active, counted
    for shape, (total, active) in ((air, (106e9, 12e9)), (full, (355e9, 32e9)), (minimax, (230e9, 10e9))):
        (tmp_path / "glm.json").write_text(json.dumps(shape))
        result = invoke("simulate", "--model", str(tmp_path / "glm.json"), "--seq-len", "4096", "--gpus", "64",
                        "--gpu", "h100-sxm", "--ep", "8", "--pp", "8", "--recompute", "full", "--json")
        assert result.exit_code == 0, result.output
        counted = json.loads(result.stdout)["parameters"]
        unembedded = counted["active"] - counted["embedding"] - counted["head"]
        assert abs(counted["total"] - counted.get("mtp", 0) - total) <= 0.01 * total, counted
        assert abs(unembedded - active) <= 0.5e9, counted
