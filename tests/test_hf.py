"""Weights that travel: `minigpt export RUN --hf DIR` writes a run of any layout as a Hugging Face model (GPT-2,
Llama, Qwen2, Qwen3, Mixtral or Qwen3-MoE) that transformers opens with the same logits, and `minigpt train
--init-from DIR` starts from one (Mistral's too),
in any layout, with transformers' own loss on the same batch. Nothing is downloaded: the transformers models are
built from configs here (minigpt/hf/layouts.py maps the layouts)."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from cli.main import main
from minigpt.config import GPTConfig
from minigpt.data import BatchLayout, Corpus, get_batch
from minigpt.errors import ConfigError
from minigpt.hf.layouts import FUSED, config_from_hf, from_hf, hf_config, layout_of, lookup, to_hf, unfused
from minigpt.hf.files import check_hf_dir, read_hf_dir
from minigpt.hf.moe import MLP_NAME, PROJECTIONS
from minigpt.model import GPT
from minigpt.presets import preset
from parallel.run.sample import load_model
from hf_released import DEEPSEEK_V3_RELEASED, MISTRAL_7B_RELEASED

transformers = pytest.importorskip("transformers")  # a test extra: pip install -e '.[test]'

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
          "deepseek_v3": ["--model", "tiny-deepseek", "--layers", "2", "--seq-len", "32"]}
CLASSES = {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
           "qwen3": "Qwen3ForCausalLM", "mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
           "deepseek_v3": "DeepseekV3ForCausalLM", "mistral": "MistralForCausalLM"}
MOE_SHAPES = ("mixtral", "qwen3_moe", "deepseek_v3")


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


def transformers_model(shape: str, tmp_path):
    """A freshly initialised transformers model of a small GPT-2, Llama (GQA, RoPE), Mixtral, Qwen3-MoE, Qwen2 (GQA,
    RoPE, biases on q, k and v only) or Qwen3 (GQA, RoPE, heads wider than the width / heads, q/k
    norms) shape, the Qwens' norms with epsilon 1e-6 as their checkpoints, saved in `tmp_path`."""
    moe = dict(vocab_size=256, max_position_embeddings=32, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, num_experts_per_tok=2, tie_word_embeddings=False,
               initializer_range=0.2, router_aux_loss_coef=0.01)
    if shape == "phi3":  # qkv_proj and gate_up_proj fused, a window as long as the context
        config = transformers.Phi3Config(vocab_size=256, max_position_embeddings=32, hidden_size=64,
                                         intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                                         num_key_value_heads=2, sliding_window=32, tie_word_embeddings=False,
                                         initializer_range=0.2, pad_token_id=0, bos_token_id=0, eos_token_id=0)
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
    elif shape == "qwen3_moe":  # a dense first block, experts narrower than it, heads wider than width / heads
        config = transformers.Qwen3MoeConfig(**moe, num_experts=4, moe_intermediate_size=48, mlp_only_layers=[0],
                                             norm_topk_prob=True, head_dim=24, rms_norm_eps=1e-6)
    elif shape == "deepseek_v3":  # values narrower than the query heads (12 for 16 + 8), a query latent; each
        # token's 2 experts from the better of 2 groups of 2, the gates scaled by 2.5 (DeepSeek-V3's routing)
        config = transformers.DeepseekV3Config(
            vocab_size=256, max_position_embeddings=32, hidden_size=64, intermediate_size=96, moe_intermediate_size=48,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=4,
            num_experts_per_tok=2, first_k_dense_replace=1, routed_scaling_factor=2.5, n_group=2, topk_group=1,
            kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=12,
            rms_norm_eps=1e-6, tie_word_embeddings=False, initializer_range=0.2, num_mtp_layers=0)
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
    elif shape == "qwen3_yarn":  # Qwen3's long-context YaRN: cos and sin times 0.1 ln 4 + 1
        config = transformers.Qwen3Config(vocab_size=256, max_position_embeddings=32, hidden_size=64,
                                          intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                                          num_key_value_heads=2, head_dim=24, rms_norm_eps=1e-6,
                                          tie_word_embeddings=False, initializer_range=0.2,
                                          rope_parameters={"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0,
                                                           "original_max_position_embeddings": 8})
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
            scale = 0.3 if "norm" in name or "ln" in name else 0.05 if shape == "qwen2" and "bias" in name else 0
            param.add_(scale * torch.randn(param.shape, generator=torch.Generator().manual_seed(4)))
        for name, buffer in model.named_buffers():  # DeepSeek's choice bias, far enough from zero to choose others
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(0.3 * torch.randn(buffer.shape, generator=torch.Generator().manual_seed(5)))
    model.save_pretrained(tmp_path / "hf")
    return model, tmp_path / "hf"


@pytest.mark.slow
@pytest.mark.parametrize("shape", SHAPES)
def test_init_from_trains_in_tp2_from_transformers_own_first_loss(shape, tmp_path):
    model, hf_dir = transformers_model(shape, tmp_path)
    data = ["--dp", "2", "--ep", "2"] if shape in MOE_SHAPES else ["--dp", "1"]  # experts over 2 ranks
    result = invoke("train", "--init-from", str(hf_dir), "--tp", "2", *data, "--steps", "2",
                    "--global-batch", "4", "--eval-every", "0", "--no-save", "--out", str(tmp_path / "run"), "--json")
    assert result.exit_code == 0, result.output
    losses = json.loads(result.stdout)["losses"]
    inputs, targets = get_batch(Corpus.load(None, 32).train, 32, BatchLayout(4, 1, 1), 0, 0, 0, 0)  # step 0's batch
    with torch.no_grad():  # transformers' loss, told the targets are already shifted
        targets = targets.contiguous()
        loss = model(input_ids=inputs, labels=targets, shift_labels=targets).loss.item()
    assert abs(losses[0] - loss) <= 1e-5 and loss > 6.0, (losses[0], loss)
    assert losses[1] < losses[0]  # and it trains


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


def hub_named(grads: dict, layout: str) -> dict:
    """transformers' gradients under its checkpoints' names: transformers 5 holds a mixture's experts fused
    (experts.gate_up_proj (E, 2 x width, d), experts.down_proj (E, d, width)) and Mixtral's router under mlp.;
    its checkpoints (and transformers 4) one tensor per expert and projection, Mixtral's under block_sparse_moe."""
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
            out[name.replace("mlp.gate.", "block_sparse_moe.gate.") if layout == "mixtral" else name] = grad
    return out


# Mistral's and Phi-3's read as Llama's block (written as Llama); YaRN's rotation in Qwen3 and DeepSeek-V3
@pytest.mark.parametrize("shape", [*SHAPES, "phi3", "mixtral_window", "qwen3_yarn", "deepseek_v3_yarn"])
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
    theirs_by_name = {name: grad for name, grad in unfused(theirs_by_name, config).items()  # Phi-3's fused pieces
                      if not name.endswith(tuple(FUSED))}
    ours_by_name = {name: grad for name, grad in to_hf({name: param.grad for name, param in ours.named_parameters()},
                                                       config).items()
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
    for bad, word in ((mixtral.with_(router="sigmoid"), "sigmoid"), (mixtral.with_(n_shared_experts=1), "shared"),
                      (mixtral.with_(top_k=1), "top-1"), (mixtral.with_(router="softmax", expert_bias=True), "bias"),
                      (mixtral.with_(dense_layers=1), "dense first blocks"), (mixtral.with_(bias=True), "bias-free")):
        with pytest.raises(ConfigError, match=word):
            layout_of(bad)
    mistral = llama.with_(bias=False, window=12)  # a sliding window: Mistral's layout, Mixtral's with experts
    assert layout_of(mistral) == "mistral" and config_from_hf(hf_config(mistral)) == mistral
    assert config_from_hf(hf_config(mixtral.with_(window=12))) == mixtral.with_(window=12)
    assert layout_of(llama.with_(window=llama.seq_len)) == "llama"  # a window as long as the context: none
    for bad, word in ((qwen3.with_(window=12), "sliding window"), (mistral.with_(bias=True), "no biases"),
                      (GPTConfig(window=12), "sliding window")):
        with pytest.raises(ConfigError, match=word):
            layout_of(bad)
    yarn = (4.0, 8, 32.0, 1.0, 1.0, 0.8)  # YaRN's rotation, written as rope_type "yarn" and read back
    assert config_from_hf(hf_config(qwen3.with_(rope_yarn=yarn[:4] + (0.0, 0.0)))) == qwen3.with_(
        rope_yarn=yarn[:4] + (0.0, 0.0))
    deepseek = preset("tiny-deepseek")  # DeepSeek-V3's layout, its latent norms with their own epsilon
    assert layout_of(deepseek) == "deepseek_v3"
    assert config_from_hf(hf_config(deepseek.with_(rope_yarn=yarn))) == deepseek.with_(
        rope_yarn=yarn, aux_loss_coef=0.0, expert_bias_rate=0.0)
    # training's choices, not written: the balance loss, the bias's rate (read frozen)
    assert config_from_hf(hf_config(deepseek)) == deepseek.with_(aux_loss_coef=0.0, expert_bias_rate=0.0)
    dense_latent = deepseek.with_(n_experts=0, d_expert=None, n_shared_experts=0, dense_layers=0, router="softmax",
                                  expert_bias=False, expert_bias_rate=0.0)
    assert config_from_hf(hf_config(dense_latent)) == dense_latent.with_(aux_loss_coef=0.0)
    for bad, word in ((deepseek.with_(router="softmax"), "softmax"), (deepseek.with_(norm="layernorm"), "bias-free"),
                      (deepseek.with_(rope_scaling=(8.0, 1.0, 4.0, 64)), "scaling")):
        with pytest.raises(ConfigError, match=word):
            layout_of(bad)
    for bad, word in ((GPTConfig(n_experts=4), "mixture of experts"), (GPTConfig(qk_norm=True), "q/k norms"),
                      (qwen3.with_(bias=True), "bias-free"), (qwen3.with_(qkv_bias=True), "bias-free"),
                      (GPTConfig(positions="rope"), "neither"), (GPTConfig(n_kv_heads=2), "grouped-query")):
        with pytest.raises(ConfigError, match=word):
            layout_of(bad)


def test_transformers_models_minigpt_computes_differently_are_refused():
    llama = hf_config(GPTConfig(mlp="swiglu", norm="rmsnorm", positions="rope"))
    qwen3 = hf_config(GPTConfig(mlp="swiglu", norm="rmsnorm", positions="rope", bias=False, qk_norm=True))
    qwen2 = hf_config(GPTConfig(mlp="swiglu", norm="rmsnorm", positions="rope", bias=False, qkv_bias=True))
    for change, word in (({**qwen3, "use_sliding_window": True}, "sliding window"),
                         ({**qwen2, "use_sliding_window": True}, "sliding window"),
                         ({**qwen3, "layer_types": ["sliding_attention", "full_attention"]}, "sliding window"),
                         ({**qwen3, "attention_bias": True}, "biases")):
        with pytest.raises(ConfigError, match=word):
            config_from_hf(change)
    for change, word in (({"rms_norm_eps": 0}, "norm_eps"), ({"hidden_act": "gelu"}, "activation"),
                         ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5}}, "scaled"),
                         ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 5e5, "factor": 4.0}},
                          "original_max_position_embeddings"),
                         ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 5e5, "factor": 4.0, "truncate": False,
                                               "original_max_position_embeddings": 8}}, "truncate"),
                         ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "linear"),
                         ({"model_type": "bert"}, "model_type")):
        with pytest.raises(ConfigError, match=word):
            config_from_hf({**llama, **change})
    with pytest.raises(ConfigError, match="activation"):
        config_from_hf({**hf_config(GPTConfig()), "activation_function": "relu"})
    moe = GPTConfig(mlp="swiglu", norm="rmsnorm", positions="rope", bias=False, n_experts=4)
    mixtral, qwen3_moe = hf_config(moe), hf_config(moe.with_(qk_norm=True, dense_layers=1))
    mistral = {**llama, "model_type": "mistral", "sliding_window": 4096, "max_position_embeddings": 32768}
    phi = {**llama, "model_type": "phi3", "sliding_window": None}
    assert config_from_hf(phi) == config_from_hf({**llama, "attention_bias": False, "mlp_bias": False})
    with pytest.raises(ConfigError, match="partial_rotary_factor"):  # Phi-4-mini rotates 3/4 of each head
        config_from_hf({**phi, "partial_rotary_factor": 0.75})
    assert config_from_hf(mistral, seq_len=4096).window == 0  # the window holds the context: full attention
    assert config_from_hf(mistral).window == 4096  # shorter than the context: every layer's window
    assert config_from_hf({**mixtral, "sliding_window": 64, "max_position_embeddings": 128}).window == 64
    for change, word in (({**mixtral, "router_jitter_noise": 0.1}, "jitter"),
                         ({**mistral, "layer_types": ["sliding_attention", "full_attention"]}, "some of its layers"),
                         ({**mixtral, "num_experts_per_tok": 1}, "top-1"),
                         ({**qwen3_moe, "norm_topk_prob": False}, "norm_topk_prob"),
                         ({**qwen3_moe, "decoder_sparse_step": 2}, "decoder_sparse_step"),
                         ({**qwen3_moe, "mlp_only_layers": [1]}, "not its first")):
        with pytest.raises(ConfigError, match=word):
            config_from_hf(change)
    with pytest.raises(ConfigError, match="max_position_embeddings"):
        config_from_hf(llama, seq_len=4096)
    deepseek = hf_config(preset("tiny-deepseek"))  # read with its routing; refused where minigpt computes otherwise
    assert config_from_hf({**deepseek, "n_group": 4, "topk_group": 2, "routed_scaling_factor": 2.5}) == preset(
        "tiny-deepseek").with_(expert_groups=4, groups_per_token=2, routed_scale=2.5, aux_loss_coef=0.0,
                               expert_bias_rate=0.0)
    for change, word in (({"norm_topk_prob": False}, "renormalised"),
                         ({"rope_interleave": False}, "rope_interleave"), ({"num_key_value_heads": 2}, "fewer"),
                         ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 40.0}},
                          "original_max_position_embeddings"),
                         ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0,
                                               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                               "original_max_position_embeddings": 8}}, "Llama 3.1")):
        with pytest.raises(ConfigError, match=word):
            config_from_hf({**deepseek, **change})


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
    # contexts, noaux_tc routing (e_score_correction_bias), block-fp8 weights: the deepseek-v3 preset's shape and
    # price (its training's balance loss given, which a config.json does not hold)
    (tmp_path / "dsv3.json").write_text(json.dumps(DEEPSEEK_V3_RELEASED))
    layout = ["--gpus", "1024", "--gpu", "h100-sxm", "--pp", "16", "--dp", "64", "--ep", "64", "--global-batch",
              "8192", "--json"]
    read = invoke("simulate", "--model", str(tmp_path / "dsv3.json"), "--seq-len", "4096", "--aux-loss-coef", "0.0001",
                  *layout)
    preset_run = invoke("simulate", "--model", "deepseek-v3", *layout)
    assert read.exit_code == 0 and preset_run.exit_code == 0, read.output + preset_run.output
    read, preset_run = json.loads(read.stdout), json.loads(preset_run.stdout)
    assert read["parameters"]["total"] == preset_run["parameters"]["total"] == 671_026_404_352
    assert read["step_time_s"] == preset_run["step_time_s"]
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
