"""The named model shapes (presets) and building a shape from a preset with fields changed. Torch-free.

Each preset's comment cites where its shape comes from; tests/test_config.py and tests/test_moe.py check the
published parameter counts exactly where they are published.
"""

from __future__ import annotations

from dataclasses import replace

from minigpt.config import GPTConfig
from minigpt.errors import ConfigError


def llama(vocab_size: int, seq_len: int, n_layers: int, n_heads: int, n_kv_heads: int, d_model: int, d_ff: int,
          rope_theta: float) -> GPTConfig:
    """A Llama-style shape: RMSNorm, SwiGLU, RoPE, grouped-query attention, no biases, untied head."""
    return GPTConfig(vocab_size=vocab_size, seq_len=seq_len, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_kv_heads,
                     d_model=d_model, d_ff=d_ff, tied_head=False, mlp="swiglu", norm="rmsnorm", positions="rope",
                     rope_theta=rope_theta, bias=False)


LLAMA3_VOCAB = 128_256  # Llama 3's tokenizer (Dubey et al. 2024, "The Llama 3 Herd of Models", section 3.2)

def gemma2(n_layers: int, n_heads: int, n_kv_heads: int, d_model: int, d_ff: int, d_head: int,
           query_scale: float) -> GPTConfig:
    """Gemma 2 (Gemma Team 2024, arXiv 2408.00118, Table 1 and section 2): vocabulary 256,000, 8K context, GeGLU,
    RMSNorm before and after each branch, the embeddings x sqrt(width) and tied, every second block through a
    window of 4,096 (the first sliding), scores capped at 50 and logits at 30, RoPE base 10,000."""
    return GPTConfig(vocab_size=256000, seq_len=8192, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_kv_heads,
                     d_model=d_model, d_ff=d_ff, d_head=d_head, tied_head=True, mlp="geglu", norm="rmsnorm",
                     positions="rope", rope_theta=10000.0, bias=False, post_norms=True, embed_scale=True,
                     query_scale=query_scale, window=4096, full_attention_every=2, attention_softcap=50.0,
                     logit_softcap=30.0, norm_eps=1e-6)


GPT_OSS = GPTConfig(vocab_size=201088, seq_len=4096, n_layers=36, n_heads=64, n_kv_heads=8, d_model=2880, d_ff=2880,
                    d_head=64, tied_head=False, mlp="clamped-swiglu", norm="rmsnorm", positions="rope",
                    rope_theta=150000.0, rope_yarn=(32.0, 4096, 32.0, 1.0, 0.0, 0.0), rope_yarn_truncate=False,
                    bias=True, norm_eps=1e-5, window=128, full_attention_every=2, attention_sinks=True,
                    n_experts=128, top_k=4, router_bias=True)

PRESETS: dict[str, GPTConfig] = {
    # About 0.8M parameters: trains on 2 CPU cores at a few steps per second.
    "tiny": GPTConfig(vocab_size=256, seq_len=128, n_layers=4, n_heads=4, d_model=128, d_ff=512),
    # The tiny shape made Llama-style: 2 key/value heads for 4 query heads, SwiGLU at 8/3 of the width
    # rounded up to a multiple of 32 (Llama's rule), the same number of parameters within 10%.
    "tiny-llama": llama(256, 128, 4, 4, 2, 128, 352, 10000.0),
    # About 10.7M parameters: the classic character-level Shakespeare model.
    "small": GPTConfig(vocab_size=256, seq_len=256, n_layers=6, n_heads=6, d_model=384, d_ff=1536),
    # GPT-2 small: 124,439,808 parameters with its 50,257-token vocabulary.
    "gpt2-124m": GPTConfig(vocab_size=50257, seq_len=1024, n_layers=12, n_heads=12, d_model=768, d_ff=3072),
    # GPT-3 175B (Brown et al. 2020, table 2.1): 96 layers, width 12,288, 96 heads.
    "gpt3-175b": GPTConfig(
        vocab_size=50257, seq_len=2048, n_layers=96, n_heads=96, d_model=12288, d_ff=4 * 12288
    ),
    # Llama 3 (Dubey et al. 2024, table 3): layers, width, FFN width, heads, key/value heads, RoPE base
    # 500,000, pre-training sequence length 8,192. 8,030,261,248 / 70,553,706,496 / 405,853,388,800
    # parameters, as the published checkpoints count them.
    "llama3-8b": llama(LLAMA3_VOCAB, 8192, 32, 32, 8, 4096, 14336, 500000.0),
    "llama3-70b": llama(LLAMA3_VOCAB, 8192, 80, 64, 8, 8192, 28672, 500000.0),
    "llama3-405b": llama(LLAMA3_VOCAB, 8192, 126, 128, 8, 16384, 53248, 500000.0),
    # Qwen2.5-7B (Qwen team 2024, its model card and released config.json): 28 layers of width 3,584, 28 query
    # heads and 4 key/value heads, SwiGLU 18,944, biases on the query, key and value projections only, vocabulary
    # 152,064, RoPE base 1e6, untied head, every norm's epsilon 1e-6; 4K pre-training sequences (the Qwen2.5
    # report's first stage; the context is 128K). 7.61B parameters, 6.53B without the embedding and head, as the
    # card says (7,615,616,512 here).
    "qwen2.5-7b": llama(152064, 4096, 28, 28, 4, 3584, 18944, 1e6).with_(qkv_bias=True, norm_eps=1e-6),
    # Gemma 2 (Table 1: width, layers, GeGLU width, heads, key/value heads, head size; the 27B's queries scaled by
    # (width / heads) ** -0.5, the others' by the head size's): 2,614,341,888 / 9,241,705,984 / 27,227,128,320
    # parameters (the released checkpoints': 2.61B, 9.24B, 27.2B)
    "gemma2-2b": gemma2(26, 8, 4, 2304, 9216, 256, 256.0),
    "gemma2-9b": gemma2(42, 16, 8, 3584, 14336, 256, 256.0),
    "gemma2-27b": gemma2(46, 32, 16, 4608, 36864, 128, 144.0),
    # The tiny shape with a mixture of experts: 8 GELU experts of width 256, each token routed to 2, so a token
    # goes through as many MLP parameters as tiny's (width 512); dropless, Switch's load-balancing loss (0.01)
    # and ST-MoE's router z-loss (0.001).
    "tiny-moe": GPTConfig(vocab_size=256, seq_len=128, n_layers=4, n_heads=4, d_model=128, d_ff=512, n_experts=8,
                          top_k=2, d_expert=256, aux_loss_coef=0.01, z_loss_coef=0.001),
    # Mixtral 8x7B (Jiang et al. 2024, "Mixtral of Experts", table 1; the released config.json): Mistral 7B's
    # attention, 8 SwiGLU experts of width 14,336, top-2, RoPE base 1e6, vocabulary 32,000: 46,702,792,704
    # parameters, 12,879,925,248 active. Training length 4,096 here (the 32K context is what it supports:
    # pass --seq-len 32768); load-balancing coefficient 0.001, transformers' MixtralConfig default (Mistral
    # published none).
    "mixtral-8x7b": llama(32000, 4096, 32, 32, 8, 4096, 14336, 1e6).with_(
        n_experts=8, top_k=2, aux_loss_coef=0.001),
    # Qwen3-30B-A3B (Qwen team 2025, its model card and released config.json): 48 layers of width 2,048, 32 query
    # heads and 4 key/value heads of 128 (wider than the model: d_head), RMS norms over each query and key head,
    # 128 SwiGLU experts of width 768, 8 routed per token (softmax, normalised over the 8), no shared expert,
    # vocabulary 151,936, RoPE base 1e6, untied head; load-balancing coefficient 0.001; 4K pre-training sequences
    # (its first stage; the context is 32K); every norm's epsilon 1e-6 (rms_norm_eps). 30.5B parameters, 3.3B
    # active, as the card says.
    "qwen3-30b-a3b": llama(151936, 4096, 48, 32, 4, 2048, 6144, 1e6).with_(
        d_head=128, qk_norm=True, n_experts=128, top_k=8, d_expert=768, aux_loss_coef=0.001, norm_eps=1e-6),
    # GPT-OSS (OpenAI 2025, "gpt-oss-120b & gpt-oss-20b Model Card", arXiv 2508.10925, section 2; the released
    # config.json files): width 2,880, 64 query heads and 8 key/value heads of 64 with biases and a learned sink per
    # query head, a 128-token sliding window in every other block from the first, YaRN x32 over an original 4,096
    # tokens (base 150,000, its correction range unrounded: truncate false), then every block a mixture of clamped
    # SwiGLU experts of width 2,880 with biases, 4 per token from a router with a bias (softmax over the top 4),
    # vocabulary 201,088, untied head, RMS norms of epsilon 1e-5; 4K training sequences (initial_context_length).
    # 36 blocks of 128 experts: 116,829,156,672 parameters, 5.13B active without the embedding (the card's 116.83B
    # and 5.13B); 24 blocks of 32: 20,914,757,184 and 3.61B (the card's 20.91B and 3.61B). No balance-loss
    # coefficient is published: none here (--aux-loss-coef sets one).
    "gpt-oss-120b": GPT_OSS,
    "gpt-oss-20b": GPT_OSS.with_(n_layers=24, n_experts=32),
    # DeepSeek-V3's block in miniature, at tiny-llama's width: multi-head latent attention (4 heads of 32 + 16
    # rotated columns, values of 32, query latent 64, key/value latent 32), the first block dense (SwiGLU 352), then
    # 8 SwiGLU experts of 128 and 1 shared, 2 routed per token by sigmoid scores chosen with DeepSeek-V3's bias.
    "tiny-deepseek": llama(256, 128, 4, 4, 4, 128, 352, 10000.0).with_(
        n_kv_heads=None, d_head=32, kv_lora_rank=32, q_lora_rank=64, rope_head_dim=16, n_experts=8, top_k=2,
        d_expert=128, n_shared_experts=1, dense_layers=1, router="sigmoid", aux_loss_coef=0.001, expert_bias=True,
        expert_bias_rate=0.001),
    # DeepSeek-V3 (DeepSeek-AI 2024, arXiv 2412.19437, section 4.2; its released config.json): 61 layers of width
    # 7,168, multi-head latent attention with 128 heads (query latent 1,536, key/value latent 512, query and key
    # heads 128 + 64 rotated columns, values 128), the first 3 blocks dense (SwiGLU 18,432), then 256 routed experts
    # of width 2,048 and 1 shared, 8 routed per token, sigmoid scores normalised over the top 8, vocabulary 129,280,
    # 4K pre-training sequences, norms' epsilon 1e-6: 671,026,404,352 parameters without the multi-token prediction
    # module (the published 671B), 37.55B active (published 37B). Its routing: the 256 experts in 8 groups,
    # each token's 8 from its 4 best groups (node-limited routing: a group per server under its ep 64 over 8
    # servers), the gates scaled by 2.5; its auxiliary-loss-free balancing, a bias on the scores that choose, moved
    # by 0.001 a step (section 4.2's gamma for the first 14.3T tokens), beside a sequence-wise balance loss of alpha
    # 0.0001. Its multi-token prediction (2.2, 4.2): one module (D = 1: a MoE block after its projection, sharing the
    # embedding and head, 11,610,067,968 parameters of its own; the published 14B counts its checkpoint's copies of
    # the embedding and head), its loss weighted by lambda 0.3 (the first 10T tokens').
    "deepseek-v3": llama(129280, 4096, 61, 128, 128, 7168, 18432, 10000.0).with_(
        n_kv_heads=None, d_head=128, kv_lora_rank=512, q_lora_rank=1536, rope_head_dim=64, norm_eps=1e-6,
        n_experts=256, top_k=8, d_expert=2048, n_shared_experts=1, dense_layers=3, router="sigmoid",
        aux_loss_coef=0.0001, expert_groups=8, groups_per_token=4, routed_scale=2.5, expert_bias=True,
        expert_bias_rate=0.001, mtp_depth=1, mtp_weight=0.3),
    # DeepSeek-V2 (DeepSeek-AI 2024, arXiv 2405.04434, section 3.1.2): DeepSeek-V3's attention (60 layers of width
    # 5,120, 128 heads, query latent 1,536, key/value latent 512, heads 128 + 64 rotated, values 128), the first
    # block dense (SwiGLU 12,288), then 160 routed experts of 1,536 and 2 shared, 6 routed per token by their
    # softmax scores as they are (not renormalised), times 16; device-limited routing, each token's experts on at
    # most 3 of 8 devices (its groups, each scored by its best expert); the expert-level balance loss's alpha 0.003;
    # vocabulary 102,400, 4K pre-training sequences: 235.74B parameters (published 236B), 20.85B active counting the
    # head but not the embedding, as the paper's 21B.
    "deepseek-v2": llama(102400, 4096, 60, 128, 128, 5120, 12288, 10000.0).with_(
        n_kv_heads=None, d_head=128, kv_lora_rank=512, q_lora_rank=1536, rope_head_dim=64, norm_eps=1e-6,
        n_experts=160, top_k=6, d_expert=1536, n_shared_experts=2, dense_layers=1, renormalize_gates=False,
        expert_groups=8, groups_per_token=3, group_score_top=1, routed_scale=16.0, aux_loss_coef=0.003),
    # DeepSeek-V2-Lite (the same paper, appendix B): 27 layers of width 2,048, 16 heads without a query latent
    # (key/value latent 512), the first block dense (SwiGLU 10,944), then 64 routed experts of 1,408 and 2 shared, 6
    # per token, ungrouped, alpha 0.001: 15.71B parameters (published 15.7B), 2.45B active as the paper counts (2.4B).
    "deepseek-v2-lite": llama(102400, 4096, 27, 16, 16, 2048, 10944, 10000.0).with_(
        n_kv_heads=None, d_head=128, kv_lora_rank=512, q_lora_rank=0, rope_head_dim=64, norm_eps=1e-6,
        n_experts=64, top_k=6, d_expert=1408, n_shared_experts=2, dense_layers=1, renormalize_gates=False,
        aux_loss_coef=0.001),
    # OLMoE-1B-7B (Muennighoff et al. 2024, arXiv 2409.02060, Table 1 and section 2): 16 layers of width 2,048, 16
    # heads, q and k each RMS-normalised over all their heads, every block 64 SwiGLU experts of 1,024 of which 8 per
    # token by their softmax scores as they are, load-balancing weight 0.01 and router z-loss 0.001, vocabulary
    # 50,304, untied, 4K sequences: 6.92B parameters (published 6.9B), 1.28B active (1.3B).
    "olmoe-1b-7b": llama(50304, 4096, 16, 16, 16, 2048, 1024, 10000.0).with_(
        qk_norm=True, qk_norm_whole=True, n_experts=64, top_k=8, renormalize_gates=False, aux_loss_coef=0.01,
        z_loss_coef=0.001),
    # Qwen1.5-MoE-A2.7B (Qwen team 2024, its model card; transformers' Qwen2MoeConfig defaults are its shape): 24
    # layers of width 2,048, 16 heads with q/k/v biases, every block 60 SwiGLU experts of 1,408 of which 4 per token
    # (softmax scores as they are) beside a shared expert of 5,632 (four experts' width) whose output a learned
    # sigmoid gates; vocabulary 151,936, RoPE base 1e6, norms' epsilon 1e-6, balance coefficient 0.001, 8K context:
    # 14.32B parameters (published 14.3B), 2.69B active (2.7B).
    "qwen1.5-moe-a2.7b": llama(151936, 8192, 24, 16, 16, 2048, 5632, 1e6).with_(
        qkv_bias=True, norm_eps=1e-6, n_experts=60, top_k=4, d_expert=1408, n_shared_experts=4,
        shared_expert_gate=True, renormalize_gates=False, aux_loss_coef=0.001),
}


def preset(name: str) -> GPTConfig:
    try:
        return PRESETS[name]
    except KeyError:
        raise ConfigError(f"unknown model preset {name!r}: choose one of {', '.join(PRESETS)}") from None


MODEL_FIELDS = ("vocab_size", "seq_len", "n_layers", "n_heads", "n_kv_heads", "d_model", "d_ff", "tied_head",
                "dropout", "mlp", "norm", "positions", "rope_theta", "bias", "n_experts", "top_k", "d_expert",
                "n_shared_experts", "dense_layers", "router", "capacity_factor", "aux_loss_coef", "z_loss_coef",
                "d_head", "qk_norm", "qkv_bias", "kv_lora_rank", "q_lora_rank", "rope_head_dim", "d_value",
                "expert_groups", "groups_per_token", "routed_scale", "expert_bias", "expert_bias_rate",
                "rope_scaling", "rope_yarn", "rope_yarn_truncate", "window", "full_attention_every", "attention_sinks",
                "mtp_depth", "mtp_weight", "router_bias", "rotary_fraction", "rope_longrope", "nope_every",
                "qk_norm_whole", "pre_norms", "post_norms", "renormalize_gates", "group_score_top",
                "shared_expert_gate", "moe_every", "attention_softcap", "logit_softcap",
                "embed_multiplier", "residual_multiplier", "attention_multiplier", "logit_divisor")


def build_config(name: str | GPTConfig = "tiny", **overrides) -> GPTConfig:
    """A preset (or a shape given whole) with any explicit fields (MODEL_FIELDS) overriding it; None leaves the
    preset's value.

    Changing d_model without d_ff keeps the preset's ratio of MLP width to model width.
    """
    unknown = set(overrides) - set(MODEL_FIELDS)
    if unknown:
        raise TypeError(f"build_config() got unknown fields {sorted(unknown)}")
    base = name if isinstance(name, GPTConfig) else preset(name)
    changes = {key: value for key, value in overrides.items() if value is not None}
    if "d_model" in changes and "d_ff" not in changes:
        if isinstance(changes["d_model"], int):
            changes["d_ff"] = changes["d_model"] * base.d_ff // base.d_model
    return replace(base, **changes)
