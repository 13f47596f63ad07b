"""DeepSeek-V3's transformers layout (DeepseekV3ForCausalLM, model_type "deepseek_v3"), both ways: multi-head latent
attention and DeepSeek's experts; and DeepSeek-V2's (DeepseekV2ForCausalLM, "deepseek_v2": DeepSeek-V2, -V2-Lite,
-V2.5, -Coder-V2), the same attention and names with a softmax router (below).

Attention (minigpt/model.py's LatentAttention): our down projection's rows are q_a_proj's (the query latent) then
kv_a_proj_with_mqa's (the key/value latent, then the rotated key); q_norm and kv_norm are q_a_layernorm and
kv_a_layernorm; q_up is q_b_proj (q_proj without a query latent), kv_up is kv_b_proj (each head's key rows, then its
value rows, as ours), proj is o_proj. DeepSeek's checkpoints pair each rotated column with its neighbour
(rope_interleave, the layout's default), ours column i with column i + r/2 (rotate-half): the rotated rows of
q_b_proj (each head's last r) and of kv_a_proj_with_mqa (its last r) are permuted between the two (a config.json
with rope_interleave false is refused).
Experts: a sigmoid router (mlp.gate), the chosen scores renormalised where norm_topk_prob (ours renormalize_gates),
shared experts of width n_shared_experts x moe_intermediate_size (mlp.shared_experts), the first
first_k_dense_replace blocks dense (width intermediate_size), the routed experts one tensor per expert and projection
as the checkpoints store them (minigpt/hf/moe.py's). minigpt's router computes the layout's, its routed_scaling_factor
(routed_scale) and group-limited choice (n_group, topk_group: expert_groups, groups_per_token) and its choice bias
(e_score_correction_bias, DeepSeek's auxiliary-loss-free balancing: minigpt's expert_bias) included. A model read
from the layout chooses with its bias, frozen (expert_bias_rate 0, as DeepSeek-V3's last 500B tokens) unless the run
gives --expert-bias-rate; a model without a bias is written with zeros, which choose as none.
DeepSeek-V2's router (transformers' DeepseekV2TopkRouter) takes the top_k of the softmax scores, as they are (its
norm_topk_prob is not read by transformers: a config.json that sets it is refused), times routed_scaling_factor;
topk_method "greedy" is ungrouped, "group_limited_greedy" limits each token to its topk_group best of n_group groups,
each scored by its best expert (minigpt's group_score_top 1; V3's, 2). It has no choice bias and no multi-token
prediction; its rotated columns are always DeepSeek's neighbouring pairs.
Torch-free except the tensor functions.
"""

from __future__ import annotations

from minigpt.config import GPTConfig, block_name
from minigpt.errors import ConfigError
from minigpt.hf.moe import config_number, refuse_unless

ARCHITECTURES = {"deepseek_v3": "DeepseekV3ForCausalLM", "deepseek_v2": "DeepseekV2ForCausalLM"}
MLA_LAYOUTS = tuple(ARCHITECTURES)  # the layouts of multi-head latent attention
# the model_types read as these layouts: DeepSeek-V3's, DeepSeek-V2's, and Kimi K2's, whose checkpoints are
# DeepseekV3ForCausalLM's under a model_type of their own (Moonshot AI's deployment guide: set it to "deepseek_v3"
# where "kimi_k2" is unknown)
DEEPSEEK_TYPES = ("deepseek_v3", "deepseek_v2", "kimi_k2")
DEEPSEEK_EXPERTS = ("deepseek_v3", "deepseek_v2", "glm4_moe")  # the layouts with DeepSeek's (shared) experts
MTP_LAYOUTS = ("deepseek_v3", "glm4_moe")  # and with its multi-token prediction
ATTENTION = "self_attn."


def deepseek_layout(config: GPTConfig) -> str:
    """"deepseek_v3" or "deepseek_v2", the layout holding `config` (a shape with multi-head latent attention): V2's
    for experts chosen by softmax scores; ConfigError unless one holds it."""
    def refuse(why: str) -> None:
        raise ConfigError(f"multi-head latent attention is written in transformers' DeepSeek-V3 or DeepSeek-V2 "
                          f"layout, which cannot hold {why}")
    if (config.norm, config.mlp, config.positions) != ("rmsnorm", "swiglu", "rope") or config.bias:
        refuse("this block (it is a bias-free rmsnorm + swiglu + rope block)")
    if config.rope_scaling is not None:
        refuse("Llama 3.1's rotary scaling")
    if not config.is_moe or config.router == "sigmoid":
        if config.group_limited and config.group_score_top != 2:
            refuse("groups scored other than by their two best sigmoid scores (DeepSeek-V3's)")
        return "deepseek_v3"
    if config.expert_bias or config.gates_renormalised or config.mtp_depth or config.router_bias:
        refuse("a softmax router with a choice bias, renormalised gates, a router bias or multi-token prediction "
               "(DeepSeek-V2's router keeps the chosen scores, scaled, and has none of them)")
    if config.group_limited and config.group_score_top != 1:
        refuse("groups scored other than by their best softmax score (DeepSeek-V2's group_limited_greedy)")
    return "deepseek_v2"


def deepseek_hf_config(config: GPTConfig, common: dict, rope_fields) -> dict:
    """config.json of the DeepSeek-V3 or -V2 model holding `config` (`common`: the fields every layout writes;
    `rope_fields`: the layouts' writer of its rotation)."""
    layout = deepseek_layout(config)
    fields = _mla_fields(config, rope_fields) | experts_hf_fields(config)
    if layout == "deepseek_v3":
        return {"architectures": [ARCHITECTURES[layout]], "model_type": layout, **common, **fields,
                "rope_interleave": True}
    v2 = {key: value for key, value in fields.items() if key not in ("num_mtp_layers", "num_nextn_predict_layers")}
    return {"architectures": [ARCHITECTURES[layout]], "model_type": layout, **common, **v2,
            "topk_method": "group_limited_greedy" if config.group_limited else "greedy", "norm_topk_prob": False}


def _mla_fields(config: GPTConfig, rope_fields) -> dict:
    """The config.json fields of the latent attention's block (both layouts')."""
    return {
        "max_position_embeddings": config.seq_len, "hidden_size": config.d_model, "intermediate_size": config.d_ff,
        "num_hidden_layers": config.n_layers, "num_attention_heads": config.n_heads,
        "num_key_value_heads": config.n_heads, "hidden_act": "silu", "rms_norm_eps": config.norm_eps,
        "attention_bias": False, "attention_dropout": config.dropout, **rope_fields(config),
        "kv_lora_rank": config.kv_lora_rank, "q_lora_rank": config.q_lora_rank or None,
        "qk_rope_head_dim": config.rope_head_dim, "qk_nope_head_dim": config.head_dim,
        "v_head_dim": config.v_head_dim,
    }


def experts_hf_fields(config: GPTConfig) -> dict:
    """config.json's fields of DeepSeek's experts (DeepSeek-V3's and GLM-4.5's layouts) and multi-token prediction."""
    moe = config.is_moe
    return {  # a dense model: every block dense, one placeholder expert the blocks never build
        "n_routed_experts": config.n_experts if moe else 1, "num_experts_per_tok": config.top_k if moe else 1,
        "moe_intermediate_size": config.expert_width if moe else config.d_ff,
        "n_shared_experts": config.n_shared_experts if moe else 0,
        "first_k_dense_replace": config.dense_layers if moe else config.n_layers,
        "routed_scaling_factor": float(config.routed_scale), "n_group": config.expert_groups,
        "topk_group": config.groups_per_token or config.expert_groups, "norm_topk_prob": config.renormalize_gates,
        "num_mtp_layers": 0, "num_nextn_predict_layers": config.mtp_depth,
    }


def deepseek_config(hf: dict, tied: bool, seq_len: int | None, rope) -> GPTConfig:
    """The GPTConfig of a DeepSeek-V3 or -V2 config.json (`rope`: the caller's reader of its rotary base and
    scaling); ConfigError naming what minigpt would compute differently."""
    theta, scaling = rope(hf)
    refuse_unless("rope_scaling" not in scaling, "its rotary embedding is scaled as Llama 3.1's, not by YaRN")
    refuse_unless(hf.get("hidden_act", "silu") == "silu" and not hf.get("attention_bias"),
                  "its MLP activation is not silu, or its attention has biases")
    heads = config_number(hf, "num_attention_heads")
    refuse_unless(hf.get("num_key_value_heads") in (None, heads), "it has fewer key/value heads than query heads")
    refuse_unless(hf.get("rope_interleave", True) is True, "its rotated columns are not in DeepSeek's neighbouring "
                                                          "pairs (rope_interleave), the layout minigpt reads")
    longest = config_number(hf, "max_position_embeddings")
    if seq_len is not None and seq_len > longest:
        raise ConfigError(f"--seq-len {seq_len} is longer than the model's max_position_embeddings ({longest})")
    layers, values = config_number(hf, "num_hidden_layers"), config_number(hf, "v_head_dim")
    return GPTConfig(vocab_size=config_number(hf, "vocab_size"), seq_len=seq_len or longest, n_layers=layers,
                     n_heads=heads, d_model=config_number(hf, "hidden_size"),
                     d_ff=config_number(hf, "intermediate_size"), tied_head=tied, mlp="swiglu", norm="rmsnorm",
                     positions="rope", rope_theta=theta, **scaling, bias=False,
                     norm_eps=config_number(hf, "rms_norm_eps", 1e-6),
                     d_head=config_number(hf, "qk_nope_head_dim"), kv_lora_rank=config_number(hf, "kv_lora_rank"),
                     q_lora_rank=hf.get("q_lora_rank") or 0, rope_head_dim=config_number(hf, "qk_rope_head_dim"),
                     d_value=None if values == hf.get("qk_nope_head_dim") else values,
                     **(experts_fields(hf, layers) | _v2_routing(hf, layers)))


def _v2_routing(hf: dict, layers: int) -> dict:
    """DeepSeek-V2's routing fields over DeepSeek-V3's (none for a V3 config.json or a dense V2)."""
    if hf.get("model_type") != "deepseek_v2" or config_number(hf, "first_k_dense_replace", 0) >= layers:
        return {}
    method = hf.get("topk_method") or "greedy"
    refuse_unless(method in ("greedy", "group_limited_greedy"), f"its topk_method is {method!r}: minigpt reads "
                                                                 f"DeepSeek-V2's greedy and group_limited_greedy")
    refuse_unless(hf.get("norm_topk_prob") in (None, False), "its norm_topk_prob asks the chosen gates renormalised, "
                                                              "which transformers' DeepSeek-V2 does not do")
    refuse_unless(not hf.get("mlp_bias"), "its MLPs have biases")
    groups = {} if method == "group_limited_greedy" else {"expert_groups": 1, "groups_per_token": None}
    return {"router": "softmax", "expert_bias": False, "renormalize_gates": False, "group_score_top": 1, **groups}


def experts_fields(hf: dict, layers: int) -> dict:
    """GPTConfig's fields of DeepSeek's experts (DeepSeek-V3's and GLM-4.5's config.json) and multi-token prediction;
    ConfigError where minigpt's router would choose or weigh differently."""
    renormalised = hf.get("norm_topk_prob", True)
    refuse_unless(isinstance(renormalised, bool), f"its norm_topk_prob is {renormalised!r}, not true or false")
    dense = config_number(hf, "first_k_dense_replace", 0)
    mtp = {"mtp_depth": config_number(hf, "num_nextn_predict_layers", 0)}
    return mtp if dense >= layers else {**mtp,
        "n_experts": config_number(hf, "n_routed_experts"), "top_k": config_number(hf, "num_experts_per_tok"),
        "d_expert": config_number(hf, "moe_intermediate_size"),
        "n_shared_experts": config_number(hf, "n_shared_experts", 0), "dense_layers": dense, "router": "sigmoid",
        "routed_scale": float(config_number(hf, "routed_scaling_factor", 1.0)),
        "expert_groups": config_number(hf, "n_group", 1) if hf.get("n_group") is not None else 1,
        "groups_per_token": _groups_per_token(hf),
        "expert_bias": True, "renormalize_gates": renormalised}


def _groups_per_token(hf: dict) -> int | None:
    """topk_group, None where it is every group (minigpt's unlimited routing)."""
    groups, chosen = hf.get("n_group") or 1, hf.get("topk_group") or 1
    return None if chosen == groups else config_number(hf, "topk_group")


def attention_names(config: GPTConfig, ours: str, theirs: str) -> dict[str, tuple[str, ...]]:
    """Block's latent attention: ours -> transformers' names (two for the down projection with a query latent)."""
    at = theirs + ATTENTION
    down = ((at + "q_a_proj.weight",) if config.q_lora_rank else ()) + (at + "kv_a_proj_with_mqa.weight",)
    table = {ours + "attn.down.weight": down, ours + "attn.kv_norm.weight": (at + "kv_a_layernorm.weight",),
             ours + "attn.q_up.weight": (at + ("q_b_proj" if config.q_lora_rank else "q_proj") + ".weight",),
             ours + "attn.kv_up.weight": (at + "kv_b_proj.weight",), ours + "attn.proj.weight": (at + "o_proj.weight",)}
    if config.q_lora_rank:
        table[ours + "attn.q_norm.weight"] = (at + "q_a_layernorm.weight",)
    return table


def shared_names(config: GPTConfig, layer: int, theirs: str) -> dict[str, tuple[str, ...]]:
    """Block `layer`'s shared experts (one MLP, its gate and up rows fused in fc1 as ours), when it has them."""
    if not config.n_shared_experts:
        return {}
    at, ours = f"{theirs}mlp.shared_experts.", block_name(layer, config.n_layers)
    return {f"{ours}mlp.shared.fc1.weight": (at + "gate_proj.weight", at + "up_proj.weight"),
            f"{ours}mlp.shared.fc2.weight": (at + "down_proj.weight",)}


def split_sizes(config: GPTConfig, ours: str) -> list[int] | None:
    """Rows of each transformers piece of our down projection or shared experts' fc1; None for another tensor."""
    if ours.endswith("attn.down.weight"):
        return [config.q_lora_rank, config.kv_lora_rank + config.rope_head_dim]
    if ours.endswith("mlp.shared.fc1.weight"):
        return [config.n_shared_experts * config.expert_width] * 2
    return None


def _rotated_rows(config: GPTConfig, ours: str) -> list[tuple[int, int]]:
    """(first row, rows) of each run of rotated rows of our tensor `ours`: q_up's last rope_head_dim of each head,
    the down projection's last rope_head_dim (the rotated key); none in the others."""
    r = config.rope_head_dim
    if ours.endswith("attn.q_up.weight"):
        width = config.qk_head_dim
        return [(head * width + config.head_dim, r) for head in range(config.n_heads)]
    if ours.endswith("attn.down.weight"):
        return [(config.latent_width - r, r)]
    return []


def interleaved(tensor, config: GPTConfig, ours: str, to_hf: bool):
    """`tensor` (our `ours`) with its rotated rows moved from our rotate-half pairing to DeepSeek's neighbours
    (to_hf), or back: row i and row i + r/2 of ours are rows 2i and 2i + 1 of theirs."""
    import torch

    runs = _rotated_rows(config, ours)
    if not runs:
        return tensor
    r = config.rope_head_dim
    neighbours = torch.stack([torch.arange(r // 2), torch.arange(r // 2) + r // 2], dim=1).flatten()
    order = neighbours if to_hf else torch.argsort(neighbours)
    out = tensor.clone()
    for first, rows in runs:
        out[first:first + rows] = tensor[first:first + rows][order]
    return out


def router_extras(state: dict, config: GPTConfig, layer: int, theirs: str, at: str = "mlp.gate.") -> dict:
    """The router's e_score_correction_bias of block `layer` (`at`: where its layout keeps it, DeepSeek's under the
    router): our choice bias, or zeros (a router without one)."""
    import torch

    from minigpt.moe import bias_name

    bias = state.get(bias_name(layer, config.n_layers))
    return {f"{theirs}{at}e_score_correction_bias":
            torch.zeros(config.n_experts) if bias is None else bias.detach().float().clone()}


def router_extras_from_hf(found, config: GPTConfig, layer: int, theirs: str, at: str = "mlp.gate.") -> dict:
    """Our state's choice bias of block `layer` from its e_score_correction_bias (`found(name)`: the tensor, fp32;
    ConfigError when the checkpoint has none)."""
    from minigpt.moe import bias_name

    if not config.expert_bias:
        return {}
    return {bias_name(layer, config.n_layers): found(f"{theirs}{at}e_score_correction_bias")}


def mtp_names(config: GPTConfig) -> dict[str, tuple[str, ...]]:
    """The multi-token prediction modules' own tensors (their blocks are named as blocks, layouts.names): module k is
    DeepSeek-V3's layer n_layers + k, its enorm, hnorm, eh_proj and shared_head.norm (our final norm)."""
    table = {}
    for k in range(config.mtp_depth):
        ours, theirs = f"mtp.{k}.", f"model.layers.{config.n_layers + k}."
        table |= {f"{ours}{name}.weight": (f"{theirs}{name}.weight",) for name in ("enorm", "hnorm", "eh_proj")}
        table[f"{ours}norm.weight"] = (f"{theirs}shared_head.norm.weight",)
    return table


def mtp_copies(state: dict, config: GPTConfig) -> dict:
    """What DeepSeek-V3's checkpoints hold in each multi-token prediction layer beside its own tensors: copies of the
    embedding (embed_tokens) and of the head (shared_head.head), which the modules share with the model (read back,
    they are not needed: the model's own are)."""
    head = state["tok_emb.weight"] if config.tied_head else state["head.weight"]
    out = {}
    for k in range(config.mtp_depth):
        theirs = f"model.layers.{config.n_layers + k}."
        out[f"{theirs}embed_tokens.weight"] = state["tok_emb.weight"].contiguous().clone()
        out[f"{theirs}shared_head.head.weight"] = head.contiguous().clone()
    return out
