"""transformers config.json files as their models were released, for the tests that read them (test_hf.py) and
fuzz their reading (test_fuzz_parsers.py). Typed from the Hub's files, nothing derived here."""

from __future__ import annotations

# deepseek-ai/DeepSeek-V3's config.json: multi-head latent attention, 256 experts in 8 groups with the choice bias
# (noaux_tc), YaRN from 4K to 160K contexts, block-wise fp8 weights, one multi-token prediction layer
DEEPSEEK_V3_RELEASED = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": 129280,
    "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61,
    "num_nextn_predict_layers": 1, "num_attention_heads": 128, "num_key_value_heads": 128, "n_shared_experts": 1,
    "n_routed_experts": 256, "ep_size": 1, "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "q_lora_rank": 1536,
    "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128, "topk_method": "noaux_tc", "n_group": 8,
    "topk_group": 4, "num_experts_per_tok": 8, "moe_layer_freq": 1, "first_k_dense_replace": 3,
    "norm_topk_prob": True, "scoring_func": "sigmoid", "hidden_act": "silu", "max_position_embeddings": 163840,
    "initializer_range": 0.02, "rms_norm_eps": 1e-06, "use_cache": True, "rope_theta": 10000,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "attention_bias": False, "attention_dropout": 0.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                            "weight_block_size": [128, 128]}}

# mistralai/Mistral-7B-v0.1's config.json: Llama's block through a sliding window of 4,096 over 32K positions
MISTRAL_7B_RELEASED = {
    "architectures": ["MistralForCausalLM"], "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu",
    "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 14336, "max_position_embeddings": 32768,
    "model_type": "mistral", "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05, "rope_theta": 10000.0, "sliding_window": 4096, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "use_cache": True, "vocab_size": 32000}
