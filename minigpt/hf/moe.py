"""A mixture of experts in Hugging Face transformers' layouts: Mixtral (MixtralForCausalLM), Qwen3-MoE
(Qwen3MoeForCausalLM), Qwen2-MoE (Qwen2MoeForCausalLM) and OLMoE (OlmoeForCausalLM), as their checkpoints store them
(one tensor per expert and projection; transformers 5 fuses them when it loads and splits them again when it saves).

All route as minigpt/moe.py does: a softmax over every expert's logit (fp32), the top_k, SwiGLU experts without
biases. Mixtral renormalises the chosen scores to sum to 1 always; the others when norm_topk_prob (minigpt's
renormalize_gates; a top-1 router keeps its probability, and so do theirs without it). Qwen2-MoE is Qwen2's attention
(q/k/v biases where qkv_bias) beside a shared expert of width shared_expert_intermediate_size (minigpt's
n_shared_experts x the experts' width) whose output a learned sigmoid gates (shared_expert_gate); the Qwens' mixture
in every decoder_sparse_step-th block is minigpt's moe_every.
They keep every token (dropless): a capacity factor is a choice of training, like dropout, not written (a run may set
one from an imported model, and its export routes dropless). Mixtral is Llama's attention with every block a mixture
of experts of width intermediate_size; Qwen3-MoE is Qwen3's attention (per-head q/k norms) with the blocks listed in
mlp_only_layers dense MLPs of width intermediate_size (minigpt: the first `dense_layers`), the others mixtures of
experts of width moe_intermediate_size; OLMoE is Llama's block with q and k each RMS-normalised over all their heads
(OLMo 2's q/k norms: qk_norm_whole) and every block a mixture of experts of width intermediate_size. The router's
balance coefficient is router_aux_loss_coef both ways (minigpt adds the loss to the gradient, never to the reported
loss, as transformers without output_router_logits). Anything else (a sigmoid router, shared experts, dense blocks
other than the first ones, router jitter, OLMoE's clipped q/k/v) is refused: transformers would compute another
model.
Torch-free except `experts_to_hf` and `experts_from_hf`, which move tensors.
"""

from __future__ import annotations

from minigpt.config import GPTConfig, block_name
from minigpt.errors import ConfigError

# transformers' names of one expert's three projections: (gate, up, down), and where a block's experts and router are
PROJECTIONS = {"mixtral": ("w1", "w3", "w2"), "qwen3_moe": ("gate_proj", "up_proj", "down_proj"),
               "deepseek_v3": ("gate_proj", "up_proj", "down_proj"),  # DeepSeek-V3's: minigpt/hf/deepseek.py
               "deepseek_v2": ("gate_proj", "up_proj", "down_proj"),
               "glm4_moe": ("gate_proj", "up_proj", "down_proj"),  # GLM-4.5's: minigpt/hf/glm.py
               "minimax_m2": ("w1", "w3", "w2"),  # MiniMax-M2's (Mixtral's names): minigpt/hf/minimax.py
               "olmoe": ("gate_proj", "up_proj", "down_proj"), "qwen2_moe": ("gate_proj", "up_proj", "down_proj")}
MLP_NAME = {"mixtral": "block_sparse_moe", "qwen3_moe": "mlp", "deepseek_v3": "mlp", "deepseek_v2": "mlp",
            "glm4_moe": "mlp", "minimax_m2": "block_sparse_moe", "olmoe": "mlp", "qwen2_moe": "mlp"}
ARCHITECTURES = {"mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM", "olmoe": "OlmoeForCausalLM",
                 "qwen2_moe": "Qwen2MoeForCausalLM"}


def moe_layout(config: GPTConfig) -> str:
    """"mixtral", "qwen3_moe", "qwen2_moe" or "olmoe": the layout holding the mixture of experts `config`; ConfigError
    saying why none."""
    def refuse(why: str) -> None:
        raise ConfigError(f"a mixture of experts is written in transformers' Mixtral, Qwen3-MoE or OLMoE layout, "
                          f"which cannot hold {why}")
    if (config.norm, config.mlp, config.positions) != ("rmsnorm", "swiglu", "rope") or config.bias:
        refuse("this block (they are bias-free rmsnorm + swiglu + rope blocks, Qwen2-MoE's q, k and v biases aside)")
    if config.router != "softmax":
        refuse("a sigmoid router (theirs: a softmax one)")
    if config.routed_scale != 1.0 or config.group_limited or config.expert_bias:
        refuse("scaled gates, group-limited routing or a choice bias (theirs: none of them)")
    if config.shared_expert_gate or config.qkv_bias or config.n_shared_experts:
        if not config.shared_expert_gate or config.qk_norm:
            refuse("shared experts without Qwen2-MoE's gate, or with per-head q/k norms (Qwen2-MoE's shared expert "
                   "is gated, its attention Qwen2's)")
        return "qwen2_moe"
    if config.qk_norm_whole:
        if config.dense_layers or not config.pre_norms or config.post_norms or config.head_dim * config.n_heads \
                != config.d_model:
            refuse("q/k norms over all heads beside dense blocks, norms after the branches or heads of another "
                   "width than d_model / n_heads (OLMoE's: every block a pre-norm mixture of experts)")
        return "olmoe"
    if config.qk_norm:
        return "qwen3_moe"
    if config.dense_layers:
        refuse("dense first blocks without q/k norms (Mixtral has none; Qwen3-MoE has per-head norms)")
    if not config.gates_renormalised:
        refuse("gates kept as the chosen scores, or a top-1 router's probability (Mixtral renormalises them to sum "
               "to 1; Qwen3-MoE and OLMoE keep them with q/k norms)")
    return "mixtral"


def moe_hf_config(config: GPTConfig, layout: str) -> dict:
    """The config.json fields of the mixture of experts (beside the Llama-style ones the caller writes)."""
    common = {"num_experts_per_tok": config.top_k, "router_aux_loss_coef": config.aux_loss_coef,
              "output_router_logits": False}
    if layout == "mixtral":
        return {**common, "num_local_experts": config.n_experts, "intermediate_size": config.expert_width,
                "router_jitter_noise": 0.0,
                "sliding_window": config.window_in_use or None}
    common |= {"num_experts": config.n_experts, "norm_topk_prob": config.gates_renormalised}
    if layout == "qwen2_moe":
        common |= {"shared_expert_intermediate_size": config.n_shared_experts * config.expert_width,
                   "qkv_bias": config.qkv_bias, "max_window_layers": config.n_layers}
    if layout == "olmoe":
        return {**common, "intermediate_size": config.expert_width, "clip_qkv": None, "pad_token_id": None}
    return {**common, "moe_intermediate_size": config.expert_width, "intermediate_size": config.d_ff,
            "decoder_sparse_step": config.moe_every, "mlp_only_layers": list(range(config.dense_layers)),
            "use_sliding_window": False, "sliding_window": None}


def config_number(hf: dict, key: str, default=None):
    """config.json's number `key` (`default` when absent); ConfigError when it is not a number."""
    value = hf.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"config.json's {key} is {value!r}, not a number")
    return value


def refuse_unless(condition: bool, why: str) -> None:
    """ConfigError saying why minigpt cannot train this transformers model, unless `condition`."""
    if not condition:
        raise ConfigError(f"this transformers model cannot be trained by minigpt: {why}")


def moe_fields(hf: dict, layout: str) -> dict:
    """GPTConfig's mixture-of-experts fields of a transformers Mixtral, Qwen3-MoE or OLMoE config.json (the block's
    other fields are Llama's, Qwen3's or OLMoE's); ConfigError naming what minigpt would compute differently."""
    top_k = config_number(hf, "num_experts_per_tok", 2)
    fields = {"top_k": top_k, "aux_loss_coef": config_number(hf, "router_aux_loss_coef", 0.0)}
    if layout == "mixtral":
        refuse_unless(not hf.get("router_jitter_noise"), "its router adds jitter noise")
        refuse_unless(top_k > 1, "a top-1 Mixtral renormalises its gate to 1, minigpt keeps the probability")
        return {**fields, "n_experts": config_number(hf, "num_local_experts", 8), "d_expert": None}
    renormalised = hf.get("norm_topk_prob", False)
    refuse_unless(isinstance(renormalised, bool), f"its norm_topk_prob is {renormalised!r}, not true or false")
    refuse_unless(top_k > 1 or not renormalised, "a top-1 router renormalising its gate to 1, where minigpt's keeps "
                                                 "the probability")
    fields |= {"renormalize_gates": renormalised} if top_k > 1 else {}
    experts = "num_experts" if "num_experts" in hf else "num_local_experts"  # the Hub's name, transformers 5's
    if layout == "olmoe":
        refuse_unless(hf.get("clip_qkv") is None, "its queries, keys and values are clipped (clip_qkv)")
        return {**fields, "n_experts": config_number(hf, experts), "d_expert": None}
    dense = sorted(hf.get("mlp_only_layers") or [])
    refuse_unless(dense == list(range(len(dense))), f"its dense blocks {dense} are not its first ones")
    width = config_number(hf, "moe_intermediate_size")
    fields |= {"n_experts": config_number(hf, experts), "d_expert": width, "dense_layers": len(dense),
               "moe_every": config_number(hf, "decoder_sparse_step", 1)}
    if layout != "qwen2_moe":
        return fields
    shared = config_number(hf, "shared_expert_intermediate_size")
    refuse_unless(shared > 0 and shared % width == 0, f"its shared expert's width {shared} is not a whole number of "
                                                      f"experts' {width} (minigpt's shared experts are)")
    bias = hf.get("qkv_bias", True)
    refuse_unless(isinstance(bias, bool), f"its qkv_bias is {bias!r}, not true or false")
    return {**fields, "n_shared_experts": shared // width, "shared_expert_gate": True, "qkv_bias": bias}


def router_names(ours: str, theirs: str, layout: str) -> dict:
    """A block's router (and Qwen2-MoE's gated shared expert): ours -> transformers' names (`ours`, `theirs`: the
    block's prefixes)."""
    table = {f"{ours}mlp.router.weight": (f"{theirs}{MLP_NAME[layout]}.gate.weight",)}
    if layout == "qwen2_moe":
        at = f"{theirs}mlp.shared_expert."
        table |= {f"{ours}mlp.shared.fc1.weight": (f"{at}gate_proj.weight", f"{at}up_proj.weight"),
                  f"{ours}mlp.shared.fc2.weight": (f"{at}down_proj.weight",),
                  f"{ours}mlp.shared.gate.weight": (f"{theirs}mlp.shared_expert_gate.weight",)}
    return table


def expert_names(config: GPTConfig, layer: int, theirs: str, layout: str) -> dict[str, list[str]]:
    """Our stacked expert tensors of block `layer` -> transformers' per-expert names: w1 (E, d, 2 x width) holds
    each expert's gate then up projection transposed; w2 (E, width, d) its down projection transposed."""
    gate, up, down = PROJECTIONS[layout]
    base = f"{theirs}{MLP_NAME[layout]}.experts."
    experts = range(config.n_experts)
    ours = block_name(layer, config.n_layers)
    return {f"{ours}mlp.experts.w1": [f"{base}{e}.{p}.weight" for e in experts for p in (gate, up)],
            f"{ours}mlp.experts.w2": [f"{base}{e}.{down}.weight" for e in experts]}


def experts_to_hf(state: dict, config: GPTConfig, layer: int, theirs: str, layout: str) -> dict:
    """Block `layer`'s experts as transformers' per-expert tensors (contiguous)."""
    out = {}
    for ours, names in expert_names(config, layer, theirs, layout).items():
        pieces = [half for matrix in state[ours].unbind(0) for half in matrix.t().chunk(2 if ours.endswith("w1")
                                                                                        else 1)]
        out |= {name: piece.contiguous() for name, piece in zip(names, pieces)}
    return out


def experts_from_hf(found, config: GPTConfig, layer: int, theirs: str, layout: str) -> dict:
    """Block `layer`'s stacked experts from transformers' tensors (`found(name)`: the fp32 tensor)."""
    import torch

    state = {}
    for ours, names in expert_names(config, layer, theirs, layout).items():
        per = 2 if ours.endswith("w1") else 1
        matrices = [torch.cat([found(name) for name in names[e * per:(e + 1) * per]]).t()
                    for e in range(config.n_experts)]
        state[ours] = torch.stack(matrices)
    return state
