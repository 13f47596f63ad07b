"""Muon's arithmetic both interpreters share (torch-free): which parameters it orthogonalises, what that costs,
and which rank of a pipeline stage orthogonalises each matrix (precision/muon.py trains it, parallel/run/muon.py
spreads it over a stage's ranks, the simulator prices the same split).

Which parameters: every matrix of a block (attention, MLP, router, MLA's projections, and each expert's own
matrices of a stacked expert tensor); the embeddings and the head (rows of the vocabulary or of positions),
norms, biases and sinks take AdamW, as in Jordan et al. 2024 and Liu et al. 2025.
"""

from __future__ import annotations

import heapq
import math

OPTIMIZERS = ("adamw", "muon")  # precision/optimizer.py; precision/muon.py (AdamW for what is not a hidden matrix)
NEWTON_SCHULZ = (3.4445, -4.7750, 2.0315)  # Jordan et al.'s quintic coefficients, five steps
NEWTON_SCHULZ_STEPS = 5
MOONLIGHT_SCALE = 0.2  # the orthogonal update times 0.2 sqrt(max(rows, cols)): AdamW's update RMS (Liu et al. 2025)
EMBEDDINGS = ("tok_emb", "pos_emb", "head", "mtp_embedding")  # rows of the vocabulary or of positions: AdamW's
EXPERT_MATRICES = ("w1", "w2")  # a MoE's stacked experts' weights (b1, b2: their biases)


def takes_muon(name: str) -> bool:
    """Whether a parameter is one of Muon's matrices (or a stack of them), by its name in the plain GPT
    ("blocks.0.attn.qkv.weight") or in a block ("attn.qkv.weight", the simulator's units): a Linear's weight, or a
    stacked expert weight; not an embedding, the head, a norm's gain, a bias or the sinks."""
    parts = name.split(".")
    if parts[0] in EMBEDDINGS:
        return False
    if len(parts) > 1 and parts[-2] == "experts":
        return parts[-1] in EXPERT_MATRICES
    return len(parts) > 1 and parts[-1] == "weight" and "norm" not in parts[-2] and not parts[-2].startswith("ln")


def newton_schulz_flops(shape: tuple[int, ...]) -> int:
    """Floating-point operations of orthogonalising a matrix of `shape` (or a stack: its leading dimension), side
    m the shorter and n the longer: each of the five steps X X^T (2 m^2 n), its square (2 m^3), the product with
    X (2 m^2 n)."""
    m, n = sorted(shape[-2:])
    return math.prod(shape[:-2]) * NEWTON_SCHULZ_STEPS * (4 * m * m * n + 2 * m**3)


Matrix = tuple[str, int]  # a parameter's name in the plain GPT, and the expert of a stacked one (-1: none)


def matrices(shapes: dict[str, tuple[int, ...]]) -> dict[Matrix, tuple[int, int]]:
    """Muon's matrices among the plain GPT's parameters `shapes`, each expert of a stack one of its own: the unit
    of work a rank orthogonalises (a stack of 256 experts is 256 of them, dealt out apart)."""
    found: dict[Matrix, tuple[int, int]] = {}
    for name, shape in shapes.items():
        if takes_muon(name):
            for expert in range(shape[0]) if len(shape) == 3 else (-1,):
                found[(name, expert)] = tuple(shape[-2:])
    return found


def assign_matrices(shapes: dict[Matrix, tuple[int, int]], ranks: int) -> list[list[Matrix]]:
    """The matrices each of a stage's `ranks` orthogonalises: the most work first, each to the rank with the least
    so far (the lowest on a tie), every rank deciding the same."""
    assigned: list[list[Matrix]] = [[] for _ in range(ranks)]
    loads = [(0, rank) for rank in range(ranks)]  # a heap: (work so far, rank)
    for key in sorted(shapes, key=lambda k: (-newton_schulz_flops(shapes[k]), k)):
        load, rank = heapq.heappop(loads)
        assigned[rank].append(key)
        heapq.heappush(loads, (load + newton_schulz_flops(shapes[key]), rank))
    return assigned


def block_matrices(model, moe: bool) -> list[tuple[str, int, int, int]]:
    """(name in a block, how many, rows, columns) of Muon's matrices in one block of `model` (a GPTConfig), torch-free
    for the simulator (tests/test_muon.py holds them to the model's own parameters)."""
    d = model.d_model
    if model.is_mla:
        attention = [("attn.down.weight", 1, model.latent_width, d),
                     ("attn.q_up.weight", 1, model.n_heads * model.qk_head_dim, model.q_up_in_width),
                     ("attn.kv_up.weight", 1, model.n_heads * (model.head_dim + model.v_head_dim), model.kv_lora_rank)]
    else:
        attention = [("attn.qkv.weight", 1, model.qkv_width, d)]
    attention.append(("attn.proj.weight", 1, d, model.attention_width))
    if not moe:
        return attention + [("mlp.fc1.weight", 1, model.mlp_in_width, d), ("mlp.fc2.weight", 1, d, model.d_ff)]
    experts, shared = model.n_experts, model.n_shared_experts
    mlp = [("mlp.router.weight", 1, experts, d), ("mlp.experts.w1", experts, d, model.expert_in_width),
           ("mlp.experts.w2", experts, model.expert_width, d)]
    if shared:
        mlp += [("mlp.shared.fc1.weight", 1, shared * model.expert_in_width, d),
                ("mlp.shared.fc2.weight", 1, d, shared * model.expert_width)]
        mlp += [("mlp.shared.gate.weight", 1, 1, d)] if model.shared_expert_gate else []
    return attention + mlp


def stage_matrices(model, layers, last: bool) -> dict[Matrix, tuple[int, int]]:
    """matrices() of a pipeline stage holding the blocks `layers` (and, when `last`, the multi-token prediction
    modules), from the config alone."""
    found: dict[Matrix, tuple[int, int]] = {}
    placed = [(f"blocks.{layer}.", model.is_moe_layer(layer)) for layer in layers]
    if last:
        placed += [(f"mtp.{k}.block.", model.mtp_is_moe) for k in range(model.mtp_depth)]
        found.update({(f"mtp.{k}.eh_proj.weight", -1): (model.d_model, 2 * model.d_model)
                      for k in range(model.mtp_depth)})
    for prefix, moe in placed:
        for name, count, rows, cols in block_matrices(model, moe):
            for expert in range(count) if ".experts." in f".{name}" else (-1,):
                found[(prefix + name, expert)] = (rows, cols)
    return found
