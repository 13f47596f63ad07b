"""The model arithmetic of minigpt/config.py against the torch model itself."""

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from minigpt.config import GPTConfig
from minigpt.presets import PRESETS, build_config, preset
from minigpt.errors import ConfigError
from minigpt.model import GPT

SHAPES = [
    GPTConfig(vocab_size=256, seq_len=16, n_layers=1, n_heads=1, d_model=8, d_ff=32, tied_head=True),
    GPTConfig(vocab_size=256, seq_len=16, n_layers=1, n_heads=1, d_model=8, d_ff=32, tied_head=False),
    GPTConfig(vocab_size=300, seq_len=32, n_layers=3, n_heads=4, d_model=64, d_ff=96, tied_head=True),
    GPTConfig(vocab_size=97, seq_len=24, n_layers=2, n_heads=2, d_model=48, d_ff=200, tied_head=False),
    PRESETS["tiny"],
    PRESETS["tiny"].with_(tied_head=False),
    PRESETS["tiny-llama"],
    # Llama-style pieces one at a time, and grouped-query attention with one key/value head
    GPTConfig(vocab_size=97, seq_len=24, n_layers=2, n_heads=4, n_kv_heads=1, d_model=48, d_ff=40, mlp="swiglu"),
    GPTConfig(vocab_size=97, seq_len=24, n_layers=2, n_heads=2, d_model=48, d_ff=64, norm="rmsnorm", bias=False),
    GPTConfig(vocab_size=97, seq_len=24, n_layers=2, n_heads=6, n_kv_heads=3, d_model=48, d_ff=64, positions="rope"),
    # Qwen3's attention: heads wider than the model's width / heads (d_head), RMS norms over each query and key head
    GPTConfig(vocab_size=97, seq_len=24, n_layers=2, n_heads=4, n_kv_heads=2, d_model=48, d_ff=64, d_head=16,
              qk_norm=True, mlp="swiglu", norm="rmsnorm", positions="rope", bias=False),
    GPTConfig(vocab_size=97, seq_len=24, n_layers=2, n_heads=4, d_model=48, d_ff=64, d_head=8, qk_norm=True),
    # Qwen2's attention: biases on the query, key and value projections only
    GPTConfig(vocab_size=97, seq_len=24, n_layers=2, n_heads=4, n_kv_heads=2, d_model=48, d_ff=64, qkv_bias=True,
              mlp="swiglu", norm="rmsnorm", positions="rope", bias=False),
    # Nemotron-4's block: LayerNorm, the squared ReLU, rotary positions, grouped-query attention, no bias
    GPTConfig(vocab_size=97, seq_len=24, n_layers=2, n_heads=4, n_kv_heads=2, d_model=48, d_ff=96, mlp="relu2",
              positions="rope", bias=False, tied_head=False),
    # DeepSeek-V2/V3's multi-head latent attention: a query latent, a key/value latent and a shared rotated key;
    # then without the query latent (DeepSeek-V2-Lite's), value heads narrower than the query and key heads
    GPTConfig(vocab_size=97, seq_len=24, n_layers=2, n_heads=4, d_model=48, d_ff=64, d_head=16, kv_lora_rank=24,
              q_lora_rank=32, rope_head_dim=8, mlp="swiglu", norm="rmsnorm", positions="rope", bias=False),
    GPTConfig(vocab_size=97, seq_len=24, n_layers=2, n_heads=3, d_model=48, d_ff=64, d_head=8, kv_lora_rank=16,
              rope_head_dim=4, d_value=6, positions="rope", bias=False),
]
LLAMA_SHAPES = SHAPES[6:]


def numel(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())  # parameters() yields a tied weight once


def shape_id(c: GPTConfig) -> str:
    qwen = f"hd{c.head_dim}{'qk' if c.qk_norm else ''}" if c.d_head else ""
    qwen += "qkvb" if c.qkv_bias else ""
    qwen += f"mla{c.q_lora_rank}-{c.kv_lora_rank}r{c.rope_head_dim}v{c.v_head_dim}" if c.is_mla else ""
    return f"L{c.n_layers}d{c.d_model}{'t' if c.tied_head else 'u'}h{c.n_heads}k{c.kv_heads}{c.mlp}{c.norm}{c.positions}{qwen}"


@pytest.mark.parametrize("cfg", SHAPES, ids=shape_id)
def test_parameter_count_equals_numel(cfg):
    model = GPT(cfg)
    assert cfg.n_params() == numel(model)
    assert cfg.block_params() == numel(model.blocks[0])
    positions = 0 if model.pos_emb is None else numel(model.pos_emb)
    assert cfg.embedding_params() == numel(model.tok_emb) + positions


def test_published_sizes():
    assert PRESETS["gpt2-124m"].n_params() == 124_439_808  # GPT-2 small, tied head
    assert 174e9 < PRESETS["gpt3-175b"].n_params() < 176e9
    assert 0.7e6 < PRESETS["tiny"].n_params() < 1.3e6
    # Llama 3 as its published checkpoints count it (Dubey et al. 2024)
    assert PRESETS["llama3-8b"].n_params() == 8_030_261_248
    assert PRESETS["llama3-70b"].n_params() == 70_553_706_496
    assert PRESETS["llama3-405b"].n_params() == 405_853_388_800
    assert abs(PRESETS["tiny-llama"].n_params() / PRESETS["tiny"].n_params() - 1) < 0.1
    # Qwen2.5-7B's card: 7.61B parameters, 6.53B without the embedding and the head (q/k/v biases counted)
    qwen = PRESETS["qwen2.5-7b"]
    assert qwen.n_params() == 7_615_616_512 and f"{(qwen.n_params() - 2 * 152064 * 3584) / 1e9:.2f}" == "6.53"
    # Gemma 2's released checkpoints: 2.61B, 9.24B and 27.2B (the tied head counted once)
    assert [f"{PRESETS[name].n_params() / 1e9:.3g}" for name in ("gemma2-2b", "gemma2-9b", "gemma2-27b")] == [
        "2.61", "9.24", "27.2"]
    # GPT-OSS's model card (arXiv 2508.10925, table 1): 116.83B and 20.91B in all, 5.13B and 3.61B active per token
    # without the embedding (its unembedding counted), sinks and biases included
    for name, total, active in (("gpt-oss-120b", "116.83", "5.13"), ("gpt-oss-20b", "20.91", "3.61")):
        model = PRESETS[name]
        assert f"{model.n_params() / 1e9:.2f}" == total
        assert f"{(model.active_params() - model.embedding_params()) / 1e9:.2f}" == active


@pytest.mark.parametrize("cfg", SHAPES[2:4] + LLAMA_SHAPES, ids=shape_id)
def test_train_flops_match_counted_matmuls(cfg):
    model = GPT(cfg)
    batch = 2
    idx = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len))
    # The math backend spells attention as matmuls, which the counter sees.
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model(idx, idx).backward()
    tokens = batch * cfg.seq_len
    # values narrower than queries are zero-padded for SDPA: p @ v and its two backward matmuls at the query's width
    padding = 3 * 2 * cfg.seq_len * cfg.n_heads * (cfg.qk_head_dim - cfg.v_head_dim) * cfg.n_layers
    assert counter.get_total_flops() == (cfg.train_flops_per_token() + padding) * tokens


def test_recompute_adds_one_block_forward():
    cfg = PRESETS["small"]
    extra = cfg.train_flops_per_token("full") - cfg.train_flops_per_token("none")
    assert extra == cfg.n_layers * cfg.block_forward_flops_per_token()
    with pytest.raises(ConfigError):
        cfg.train_flops_per_token("sometimes")


def saved_bytes(fn, exclude: set[int]) -> int:
    """Bytes of distinct storages autograd saves while fn runs (parameters excluded)."""
    storages = {}

    def pack(t):
        if t.data_ptr() not in exclude:
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(storages.values())


@pytest.mark.parametrize("cfg", SHAPES[2:], ids=shape_id)
def test_activation_bytes_match_saved_tensors(cfg):
    model = GPT(cfg)
    batch = 3
    x = torch.randn(batch, cfg.seq_len, cfg.d_model, requires_grad=True)
    params = {p.data_ptr() for p in model.parameters()}
    measured = saved_bytes(lambda: model.blocks[0](x), params)
    assert measured == cfg.activation_bytes_per_token_per_layer() * batch * cfg.seq_len


def test_activation_bytes_full_recompute_keeps_block_input():
    cfg = PRESETS["tiny"]
    assert cfg.activation_bytes_per_token_per_layer(2, "full") == 2 * cfg.d_model
    assert cfg.activation_bytes_per_token_per_layer(2) < cfg.activation_bytes_per_token_per_layer(4)


def test_build_config_overrides_and_checks():
    cfg = build_config("tiny", d_model=256, n_heads=8)
    assert (cfg.d_model, cfg.d_ff, cfg.n_heads) == (256, 1024, 8)
    with pytest.raises(ConfigError, match="unknown model preset"):
        preset("huge")
    with pytest.raises(ConfigError, match="does not divide"):
        build_config("tiny", n_heads=3)
    with pytest.raises(ConfigError, match="positive"):
        build_config("tiny", n_layers=0)


def test_selective_recompute_and_flash_attention_flops():
    cfg = PRESETS["small"]
    none, s, d = cfg.train_flops_per_token(), cfg.seq_len, cfg.d_model
    assert cfg.train_flops_per_token("selective") - none == cfg.n_layers * 2 * 2 * s * d  # q @ k^T and p @ v again
    assert cfg.train_flops_per_token("none", "flash") - none == cfg.n_layers * 2 * s * d  # FlashAttention-2's scores
    assert cfg.train_flops_per_token("full", "unfused") == cfg.train_flops_per_token("full")
    with pytest.raises(ConfigError, match="attention"):
        cfg.train_flops_per_token("none", "fused")
    # selective recompute drops what the attention core alone keeps: its fp32 log-sum-exp (one per head)
    assert cfg.activation_bytes_per_token_per_layer(2) - cfg.activation_bytes_per_token_per_layer(2, "selective") == \
        4 * cfg.n_heads


@pytest.mark.parametrize("fields, message", [
    (dict(n_heads=4, n_kv_heads=3), "n_kv_heads=3 does not divide n_heads=4"),
    (dict(n_heads=4, n_kv_heads=0), "n_kv_heads must be a positive integer"),
    (dict(n_heads=8, d_model=24, positions="rope"), "even head width"),
    (dict(mlp="relu"), "mlp must be one of gelu, swiglu, relu2"),
    (dict(norm="batchnorm"), "norm must be one of"),
    (dict(positions="alibi"), "positions must be one of"),
    (dict(positions="rope", rope_theta=0.5), "rope_theta"),
    (dict(bias="no"), "bias must be true or false"),
    (dict(window=-1), "window must be a whole number >= 0"),
    (dict(window=2.5), "window must be a whole number >= 0"),
    (dict(positions="rope", rope_yarn=(4.0, 8, 32.0)), "rope_yarn must be six"),
    (dict(positions="rope", rope_yarn=(0.5, 8, 32.0, 1.0, 0.0, 0.0)), "factor of 1 or more"),
    (dict(positions="rope", rope_yarn=(4.0, 8.5, 32.0, 1.0, 0.0, 0.0)), "whole original context"),
    (dict(positions="rope", rope_yarn=(4.0, 8, 1.0, 32.0, 0.0, 0.0)), "beta_fast at least beta_slow"),
    (dict(rope_yarn=(4.0, 8, 32.0, 1.0, 0.0, 0.0)), "positions rope"),
    (dict(positions="rope", nope_every=-1), "nope_every must be a whole number"),
    (dict(nope_every=2), "needs positions rope"),
    (dict(positions="rope", rotary_fraction=0.0), "rotary_fraction must be a number in"),
    (dict(positions="rope", rotary_fraction=1.5), "rotary_fraction must be a number in"),
    (dict(positions="rope", rotary_fraction=0.3), "even whole number"),  # 9.6 of 32 columns
    (dict(rotary_fraction=0.5), "needs positions rope"),
    (dict(positions="rope", rope_longrope=((1.0,) * 16, (2.0,) * 15, 8, 1.2)), "one per rotated pair"),
    (dict(positions="rope", rope_longrope=((1.0,) * 16, (2.0,) * 16, 8, 0.5)), "attention factor of 1 or more"),
    (dict(positions="rope", rope_longrope=((1.0,) * 16, (2.0,) * 16, 8, 1.2),
          rope_yarn=(4.0, 8, 32.0, 1.0, 0.0, 0.0)), "without rope_scaling or rope_yarn"),
    (dict(positions="rope", rope_scaling=(8.0, 1.0, 4.0, 8), rope_yarn=(4.0, 8, 32.0, 1.0, 0.0, 0.0)),
     "without Llama 3.1's rope_scaling"),
])
def test_llama_options_are_checked(fields, message):
    with pytest.raises(ConfigError, match=message):
        GPTConfig(**fields)


def test_rope_model_has_no_position_embedding_and_rotates_relative_positions():
    """RoPE's scores depend on relative positions only: shifting every position leaves q . k alone."""
    from minigpt.attention import _rotate, rope_tables

    cos, sin = rope_tables(12, 8, 10000.0, torch.device("cpu"))
    q, k = torch.randn(1, 1, 1, 8, dtype=torch.float64), torch.randn(1, 1, 1, 8, dtype=torch.float64)
    at = lambda t, pos: _rotate(t, cos[pos:pos + 1], sin[pos:pos + 1], 1.0)  # noqa: E731
    assert torch.allclose((at(q, 7) * at(k, 3)).sum(), (at(q, 5) * at(k, 1)).sum())
    assert not torch.allclose((at(q, 7) * at(k, 3)).sum(), (at(q, 7) * at(k, 4)).sum())
    assert GPT(PRESETS["tiny-llama"]).pos_emb is None


def test_rms_norm_matches_torch_and_its_gradients_check():
    from minigpt.model import RMSNorm, RMSNormFunction

    x = torch.randn(3, 5, 16, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(16, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b: RMSNormFunction.apply(a, b, 1e-5), (x, weight))
    ours, theirs = RMSNorm(16), torch.nn.RMSNorm(16, eps=1e-5)
    x32 = torch.randn(4, 16)
    assert torch.allclose(ours(x32), theirs(x32), atol=1e-6)


def test_grouped_query_attention_equals_repeated_key_value_heads():
    """GQA is multi-head attention whose key/value heads are each shared by `group` query heads."""
    cfg = GPTConfig(vocab_size=97, seq_len=8, n_layers=1, n_heads=4, n_kv_heads=2, d_model=32, d_ff=64)
    attn = GPT(cfg).blocks[0].attn
    qkv = attn.qkv(torch.randn(2, 8, 32))
    q, k, v = qkv.split([32, 16, 16], dim=-1)
    repeat = lambda t: t.view(2, 8, 2, 1, 8).expand(2, 8, 2, 2, 8).reshape(2, 8, 32)  # noqa: E731
    mha = GPTConfig(vocab_size=97, seq_len=8, n_layers=1, n_heads=4, d_model=32, d_ff=64)
    full = GPT(mha).blocks[0].attn.core(torch.cat([q, repeat(k), repeat(v)], dim=-1))
    assert torch.allclose(attn.core(qkv), full, atol=1e-6)


def test_the_squared_relu_is_relu_squared_with_its_gradient():
    """Nemotron-4's MLP activation (mlp "relu2"): relu(x)^2, gradient 2 relu(x); a model built with it trains."""
    from minigpt.moe import activation

    x = torch.tensor([-2.0, -0.5, 0.0, 0.5, 3.0], dtype=torch.float64, requires_grad=True)
    y = activation(x, "relu2")
    assert torch.equal(y, torch.tensor([0.0, 0.0, 0.0, 0.25, 9.0], dtype=torch.float64))
    y.sum().backward()
    assert torch.equal(x.grad, torch.tensor([0.0, 0.0, 0.0, 1.0, 6.0], dtype=torch.float64))
    torch.manual_seed(0)
    model = GPT(SHAPES[-1])
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    batch = torch.randint(0, SHAPES[-1].vocab_size, (4, SHAPES[-1].seq_len))
    losses = []
    for _ in range(20):
        loss = model(batch, batch)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]
