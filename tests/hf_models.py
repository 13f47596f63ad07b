"""Small transformers models for the tests that read them (test_hf.py, test_hf_readings.py): built from configs
here, nothing downloaded."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")  # a test extra: pip install -e '.[test]'


def transformers_model(shape: str, tmp_path):
    """A freshly initialised transformers model of a small GPT-2, Llama (GQA, RoPE), Mistral (a sliding window),
    Phi-3 (fused projections; also Phi-4-mini's partial rotation by LongRoPE), SmolLM3 (no rotation in some blocks),
    Gemma 3, Gemma 2 (soft caps), Granite (its scalings), Mixtral (also with a window), Qwen3-MoE (its gates renormalised or not; a mixture in every second
    block), Qwen2-MoE, OLMoE, DeepSeek-V3 (latent attention, a choice bias far from zero; its gates renormalised or
    not; also with YaRN, and as Kimi K2 ships it), DeepSeek-V2 (the same attention, softmax-routed experts; V2-Lite's,
    and with V2's device-limited groups and YaRN), GLM-4.5 (DeepSeek's experts after grouped-query attention, half of
    each head turned), OLMo 2 (norms after the branches, q/k norms over all heads; OLMo 3's windows), MiniMax-M2
    (those q/k norms, half of each head turned, sigmoid-routed experts), Qwen2 (GQA, RoPE, biases on q, k and v
    only) or Qwen3 (GQA, RoPE, heads wider than the width / heads, q/k norms; also with YaRN, or a window in its first
    block) shape, the Qwens' norms with epsilon 1e-6 as their checkpoints, saved in `tmp_path`: (the model, its
    directory)."""
    moe = dict(vocab_size=256, max_position_embeddings=32, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, num_experts_per_tok=2, tie_word_embeddings=False,
               initializer_range=0.2, router_aux_loss_coef=0.01)
    if shape == "phi3":  # qkv_proj and gate_up_proj fused, a window as long as the context
        config = transformers.Phi3Config(vocab_size=256, max_position_embeddings=32, hidden_size=64,
                                         intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                                         num_key_value_heads=2, sliding_window=32, tie_word_embeddings=False,
                                         initializer_range=0.2, pad_token_id=0, bos_token_id=0, eos_token_id=0)
    elif shape == "phi3_longrope":  # Phi-4-mini's rotation: the first 3/4 of each head turned (12 of 16 columns), by
        # LongRoPE: its long factors beyond the original context of 8 (the 32 here), cos and sin x sqrt(1 + ln 4 / ln 8)
        config = transformers.Phi3Config(vocab_size=256, max_position_embeddings=32, hidden_size=64,
                                         intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                                         num_key_value_heads=2, partial_rotary_factor=0.75, tie_word_embeddings=False,
                                         initializer_range=0.2, pad_token_id=0, bos_token_id=0, eos_token_id=0,
                                         original_max_position_embeddings=8,
                                         rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                                          "short_factor": [1.0, 1.1, 1.2, 1.3, 1.5, 2.0],
                                                          "long_factor": [1.0, 1.5, 2.0, 3.0, 5.0, 8.0],
                                                          "original_max_position_embeddings": 8,
                                                          "partial_rotary_factor": 0.75})
    elif shape == "smollm3":  # SmolLM3's: every second block (its interval 4 here 2) without rotary positions
        config = transformers.SmolLM3Config(vocab_size=256, max_position_embeddings=32, hidden_size=64,
                                            intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
                                            num_key_value_heads=2, no_rope_layer_interval=2, tie_word_embeddings=False,
                                            initializer_range=0.2, pad_token_id=None, bos_token_id=None,
                                            eos_token_id=None)
    elif shape == "gemma3":  # Gemma 3's: every second layer full (its 6th here 2nd), the others through a window of
        # 12 rotating by their own base, the full ones' positions halved (its linear 8 here 2), the softmax scaled by
        # 24 ** -0.5 (not the 16-wide heads'), post norms, GeGLU, the embeddings x 8, the head tied
        config = transformers.Gemma3TextConfig(
            vocab_size=256, max_position_embeddings=32, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=24, sliding_window=12,
            layer_types=["sliding_attention", "full_attention"] * 2, initializer_range=0.2, pad_token_id=None,
            bos_token_id=None, eos_token_id=None,
            rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
                             "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}})
    elif shape == "gemma2":  # Gemma 2's: Gemma 3's block without q/k norms, one rotary base, every second layer full,
        # the others through a window of 12; each score capped at 2 and each logit at 3 (its 50 and 30 here small
        # enough that the caps bend the random model's scores and logits)
        config = transformers.Gemma2Config(
            vocab_size=256, max_position_embeddings=32, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=24, sliding_window=12,
            layer_types=["sliding_attention", "full_attention"] * 2, initializer_range=0.2, pad_token_id=None,
            bos_token_id=None, eos_token_id=None, attn_logit_softcapping=2.0, final_logit_softcapping=3.0,
            rope_parameters={"rope_type": "default", "rope_theta": 100.0})
    elif shape == "granite":  # Granite's scalings (its 3.x checkpoints' 12, 0.22, 1/128 and 16 here bent to the tiny
        # shape): the embeddings x 4, each branch x 0.5, the softmax scale 0.3, the logits / 2
        config = transformers.GraniteConfig(
            vocab_size=256, max_position_embeddings=32, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True, initializer_range=0.2,
            embedding_multiplier=4.0, residual_multiplier=0.5, attention_multiplier=0.3, logits_scaling=2.0,
            pad_token_id=None, bos_token_id=None, eos_token_id=None)
    elif shape == "mistral":  # a sliding window of 12 over a context of 32: each token sees the 11 before it
        config = transformers.MistralConfig(vocab_size=256, max_position_embeddings=32, hidden_size=64,
                                            intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                                            num_key_value_heads=2, head_dim=24, sliding_window=12,
                                            tie_word_embeddings=False, initializer_range=0.2)
    elif shape == "mixtral_window":  # Mixtral's experts through a sliding window of 12
        config = transformers.MixtralConfig(**moe, num_local_experts=4, rms_norm_eps=1e-5, rope_theta=1e6,
                                            sliding_window=12)
    elif shape == "mixtral":
        config = transformers.MixtralConfig(**moe, num_local_experts=4, rms_norm_eps=1e-5, rope_theta=1e6)
    elif shape in ("qwen3_moe", "qwen3_moe_scores"):  # a dense first block, experts narrower than it, heads wider
        # than width / heads; the chosen scores renormalised (Qwen3's checkpoints) or the gates as they are
        config = transformers.Qwen3MoeConfig(**moe, num_experts=4, moe_intermediate_size=48, mlp_only_layers=[0],
                                             norm_topk_prob=shape == "qwen3_moe", head_dim=24, rms_norm_eps=1e-6)
    elif shape == "qwen3_moe_sparse":  # a dense first block, then a mixture in every second block (3 and 5; 1 too)
        config = transformers.Qwen3MoeConfig(**{**moe, "num_hidden_layers": 6}, num_experts=4, moe_intermediate_size=48,
                                             mlp_only_layers=[0], decoder_sparse_step=2, norm_topk_prob=True,
                                             head_dim=24, rms_norm_eps=1e-6)
    elif shape == "qwen2_moe":  # Qwen2-MoE's (Qwen1.5-MoE's): q, k and v biases, a dense first block, then 2 of 4
        # experts by their softmax scores as they are, beside a shared expert of two experts' width, gated
        config = transformers.Qwen2MoeConfig(**moe, num_experts=4, moe_intermediate_size=24,
                                             shared_expert_intermediate_size=48, mlp_only_layers=[0], rms_norm_eps=1e-6)
    elif shape == "olmoe":  # OLMoE's: Llama's block with q/k norms over all heads, every block 2 of 4 experts whose
        # softmax scores are the gates as they are (norm_topk_prob false, its default)
        config = transformers.OlmoeConfig(**moe, num_experts=4, rms_norm_eps=1e-5, pad_token_id=None,
                                          eos_token_id=None)
    elif shape in ("deepseek_v3", "deepseek_v3_scores"):  # values narrower than the query heads (12 for 16 + 8), a
        # query latent; each token's 2 experts from the better of 2 groups of 2, the gates scaled by 2.5 (DeepSeek-V3's
        # routing), renormalised first or not (norm_topk_prob)
        config = transformers.DeepseekV3Config(norm_topk_prob=shape == "deepseek_v3",
            vocab_size=256, max_position_embeddings=32, hidden_size=64, intermediate_size=96, moe_intermediate_size=48,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=4,
            num_experts_per_tok=2, first_k_dense_replace=1, routed_scaling_factor=2.5, n_group=2, topk_group=1,
            kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=12,
            rms_norm_eps=1e-6, tie_word_embeddings=False, initializer_range=0.2, num_mtp_layers=0)
    elif shape == "deepseek_v2":  # DeepSeek-V2-Lite's: no query latent, 2 shared experts, a dense first block, then
        # each token's 2 of 4 experts by their softmax scores as they are (greedy)
        config = transformers.DeepseekV2Config(
            vocab_size=256, max_position_embeddings=32, hidden_size=64, intermediate_size=96, moe_intermediate_size=48,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=2, n_routed_experts=4,
            num_experts_per_tok=2, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8,
            qk_nope_head_dim=16, v_head_dim=16, rms_norm_eps=1e-6, tie_word_embeddings=False, initializer_range=0.2)
    elif shape == "deepseek_v2_groups":  # DeepSeek-V2's device-limited routing: each token's 2 of 8 experts from its
        # best 2 of 4 groups, each scored by its best, the gates x 16; a query latent, YaRN as V2's (factor 4 over 8
        # here, mscale 0.707 both ways)
        config = transformers.DeepseekV2Config(
            vocab_size=256, max_position_embeddings=32, hidden_size=64, intermediate_size=96, moe_intermediate_size=48,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8,
            num_experts_per_tok=2, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8,
            qk_nope_head_dim=16, v_head_dim=12, rms_norm_eps=1e-6, tie_word_embeddings=False, initializer_range=0.2,
            topk_method="group_limited_greedy", n_group=4, topk_group=2, routed_scaling_factor=16.0,
            rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                             "original_max_position_embeddings": 8, "beta_fast": 32.0, "beta_slow": 1.0,
                             "mscale": 0.707, "mscale_all_dim": 0.707})
    elif shape == "deepseek_v3_yarn":  # DeepSeek-V3's YaRN (its factor 40 over 4K here 4 over 8), mscale 1 over 0.8
        config = transformers.DeepseekV3Config(
            vocab_size=256, max_position_embeddings=32, hidden_size=64, intermediate_size=96, moe_intermediate_size=48,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=4,
            num_experts_per_tok=2, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8,
            qk_nope_head_dim=16, v_head_dim=16, rms_norm_eps=1e-6, tie_word_embeddings=False, initializer_range=0.2,
            num_mtp_layers=0, n_group=1, topk_group=1,
            rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                             "original_max_position_embeddings": 8, "beta_fast": 32.0, "beta_slow": 1.0,
                             "mscale": 1.0, "mscale_all_dim": 0.8})
    elif shape == "glm4_moe":  # GLM-4.5's: q, k and v biases, per-head q/k norms, the first half of each 24-wide head
        # turned (its default), a dense first block, then DeepSeek's experts (2 of 4 from the better of 2 groups, one
        # shared, the gates scaled by 2.5)
        config = transformers.Glm4MoeConfig(
            vocab_size=256, max_position_embeddings=32, hidden_size=64, intermediate_size=96, moe_intermediate_size=48,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=24, attention_bias=True,
            use_qk_norm=True, n_shared_experts=1, n_routed_experts=4, num_experts_per_tok=2, first_k_dense_replace=1,
            routed_scaling_factor=2.5, n_group=2, topk_group=1, rms_norm_eps=1e-5, tie_word_embeddings=False,
            initializer_range=0.2, num_mtp_layers=0)
    elif shape == "olmo2":  # OLMo 2's: no norm before the branches, one after each, q and k normalised over all
        # their heads (24 wide here) at once
        config = transformers.Olmo2Config(vocab_size=256, max_position_embeddings=32, hidden_size=64,
                                          intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                                          num_key_value_heads=2, head_dim=24, rms_norm_eps=1e-6,
                                          tie_word_embeddings=False, rope_theta=500000.0, initializer_range=0.2,
                                          pad_token_id=None, bos_token_id=None, eos_token_id=None)
    elif shape == "olmo3":  # OLMo 3's: OLMo 2's block through a window of 12 in every other layer (its 3 in 4)
        config = transformers.Olmo3Config(vocab_size=256, max_position_embeddings=32, hidden_size=64,
                                          intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                                          num_key_value_heads=2, rms_norm_eps=1e-6, tie_word_embeddings=False,
                                          rope_theta=500000.0, initializer_range=0.2, sliding_window=12,
                                          layer_types=["sliding_attention", "full_attention"], pad_token_id=None,
                                          bos_token_id=None, eos_token_id=None)
    elif shape == "olmo3_yarn":  # OLMo 3's long-context rotation: YaRN (factor 4 over 8 here, its 8 over 8,192) on
        # the full layers alone, the windowed ones unscaled, one base
        config = transformers.Olmo3Config(
            vocab_size=256, max_position_embeddings=32, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6, tie_word_embeddings=False,
            initializer_range=0.2, sliding_window=12, layer_types=["sliding_attention", "full_attention"],
            pad_token_id=None, bos_token_id=None, eos_token_id=None,
            rope_parameters={"full_attention": {"rope_type": "yarn", "rope_theta": 500000.0, "factor": 4.0,
                                                "original_max_position_embeddings": 8, "beta_fast": 32.0,
                                                "beta_slow": 1.0},
                             "sliding_attention": {"rope_type": "default", "rope_theta": 500000.0}})
    elif shape == "minimax_m2":  # MiniMax-M2's: q/k norms over all heads, the first half of each 24-wide head
        # turned (rotary_dim), every block 2 of 4 Mixtral-named experts chosen by sigmoid scores with a bias
        config = transformers.MiniMaxM2Config(**{**moe, "intermediate_size": 48}, head_dim=24, num_local_experts=4,
                                              rotary_dim=12, rms_norm_eps=1e-6, pad_token_id=None, bos_token_id=None,
                                              eos_token_id=None)
    elif shape == "kimi_k2":  # Kimi K2's: DeepSeek-V3's architecture under model_type "kimi_k2" (set after saving),
        # ungrouped routing with gates scaled by 2.827, one dense block, and YaRN with beta_fast = beta_slow = 1 (its
        # ramp a step between two whole columns), mscale 1 over 1
        config = transformers.DeepseekV3Config(
            vocab_size=256, max_position_embeddings=32, hidden_size=64, intermediate_size=96, moe_intermediate_size=48,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=4,
            num_experts_per_tok=2, first_k_dense_replace=1, routed_scaling_factor=2.827, n_group=1, topk_group=1,
            kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
            rms_norm_eps=1e-6, tie_word_embeddings=False, initializer_range=0.2, num_mtp_layers=0,
            rope_parameters={"rope_type": "yarn", "rope_theta": 50000.0, "factor": 4.0,
                             "original_max_position_embeddings": 8, "beta_fast": 1.0, "beta_slow": 1.0,
                             "mscale": 1.0, "mscale_all_dim": 1.0})
    elif shape == "qwen3_yarn":  # Qwen3's long-context YaRN: cos and sin times 0.1 ln 4 + 1
        config = transformers.Qwen3Config(vocab_size=256, max_position_embeddings=32, hidden_size=64,
                                          intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                                          num_key_value_heads=2, head_dim=24, rms_norm_eps=1e-6,
                                          tie_word_embeddings=False, initializer_range=0.2,
                                          rope_parameters={"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0,
                                                           "original_max_position_embeddings": 8})
    elif shape == "qwen3_window":  # a window of 12 in the first block, the whole context in the second (GPT-OSS's)
        config = transformers.Qwen3Config(vocab_size=256, max_position_embeddings=32, hidden_size=64,
                                          intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                                          num_key_value_heads=2, head_dim=24, rms_norm_eps=1e-6,
                                          tie_word_embeddings=False, rope_theta=1e6, initializer_range=0.2,
                                          use_sliding_window=True, sliding_window=12,
                                          layer_types=["sliding_attention", "full_attention"])
    elif shape == "gpt_oss":  # sinks, biases, a window of 12 in every other block, clamped experts, YaRN unrounded
        # (its original context of 1,024 puts the ramp's ends between whole columns of the 16-wide heads)
        config = transformers.GptOssConfig(
            vocab_size=256, max_position_embeddings=32, hidden_size=64, intermediate_size=48, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
            sliding_window=12, tie_word_embeddings=False, initializer_range=0.2, router_aux_loss_coef=0.01,
            rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "beta_fast": 32.0,
                             "beta_slow": 1.0, "original_max_position_embeddings": 1024, "truncate": False})
    elif shape == "qwen2":
        config = transformers.Qwen2Config(vocab_size=256, max_position_embeddings=32, hidden_size=64,
                                          intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                                          num_key_value_heads=2, rms_norm_eps=1e-6, tie_word_embeddings=False,
                                          rope_theta=1e6, initializer_range=0.2)
    elif shape == "qwen3":
        config = transformers.Qwen3Config(vocab_size=256, max_position_embeddings=32, hidden_size=64,
                                          intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                                          num_key_value_heads=2, head_dim=24, rms_norm_eps=1e-6,
                                          tie_word_embeddings=False, rope_theta=1e6, initializer_range=0.2)
    elif shape == "gpt2":
        config = transformers.GPT2Config(vocab_size=256, n_positions=32, n_embd=64, n_layer=2, n_head=4,
                                         activation_function="gelu_new", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                         bos_token_id=0, eos_token_id=0, initializer_range=0.2)
    else:
        config = transformers.LlamaConfig(vocab_size=256, max_position_embeddings=32, hidden_size=64,
                                          intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                                          num_key_value_heads=2, rms_norm_eps=1e-5, tie_word_embeddings=False,
                                          rope_theta=500000.0, initializer_range=0.2)
    torch.manual_seed(3)  # weights 10x GPT-2's spread: a first loss far from a fresh minigpt model's ln 256
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # norms' gains (and Qwen2's zero-initialised q/k/v biases, a little) away from their
        for name, param in model.named_parameters():  # initial ones, so that a misplaced one shows
            scale = 0.3 if "norm" in name or "ln" in name or "sinks" in name else \
                0.05 if shape in ("qwen2", "gpt_oss", "glm4_moe", "qwen2_moe") and "bias" in name else 0
            param.add_(scale * torch.randn(param.shape, generator=torch.Generator().manual_seed(4)))
            if shape == "gpt_oss" and name.endswith("gate_up_proj"):  # its gates and ups past the clamp at 7
                param.mul_(4.0)
        for name, buffer in model.named_buffers():  # DeepSeek's choice bias, far enough from zero to choose others
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(0.3 * torch.randn(buffer.shape, generator=torch.Generator().manual_seed(5)))
    model.save_pretrained(tmp_path / "hf")
    if shape == "kimi_k2":  # as Moonshot AI ships it: transformers' DeepSeek-V3 under a model_type of its own
        saved = json.loads((tmp_path / "hf" / "config.json").read_text())
        (tmp_path / "hf" / "config.json").write_text(json.dumps({**saved, "model_type": "kimi_k2"}))
    return model, tmp_path / "hf"
