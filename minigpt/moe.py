"""A mixture-of-experts MLP: router, routed experts, shared experts, and the router's losses.

No distributed code lives here. Expert parallelism (parallel/expert/) replaces `Experts`, the one module that
computes the routed tokens, with one that sends each token to the rank holding its expert and back; the routing
around it stays the same, so every layout routes, drops and weights the very same tokens.

Routing, per token (GShard, Lepikhin et al. 2020; Switch, Fedus et al. 2021; DeepSeek-V3 2024):
  scores   softmax over the E router logits (fp32), or their sigmoid ("sigmoid", DeepSeek-V3);
  choice   the top_k scores, ties to the lower expert index (a stable sort: the same on every layout); with
           expert_bias the top_k of the scores plus a per-expert bias (DeepSeek-V3's auxiliary-loss-free
           balancing), which choose and weigh nothing else; `update_bias` moves it after a step;
  gates    the chosen scores, renormalised to sum to 1 when top_k > 1 or the router is a sigmoid (Mixtral,
           Qwen3, DeepSeek-V3); a top-1 softmax keeps its probability (Switch), and so does every choice
           without renormalize_gates (OLMoE, Qwen2-MoE, DeepSeek-V2);
  capacity with a capacity factor cf, each expert takes at most ceil(cf x s x top_k / E) tokens of each sequence
           (GShard's groups are the sequences, which every layout keeps whole): all first choices in token
           order, then the second choices, and so on; a choice past the capacity is dropped (that slot adds
           nothing; the token keeps its residual). Without a capacity factor nothing is dropped (dropless).
Losses, added to the training loss through the gradient (`AuxLoss`), not to the reported loss:
  balance  aux_loss_coef x E x sum_e f_e P_e per sequence, averaged over the sequences: f_e the share of the
           sequence's top_k choices that picked e (before any drop), P_e the mean over its tokens of e's score
           (a sigmoid's normalised over the experts first): Switch's loss, per sequence as DeepSeek-V3's;
  z-loss   z_loss_coef x the mean over tokens of logsumexp(logits)^2 (ST-MoE, Zoph et al. 2022).
The losses' weight in a training step (1 on one process; 1 / micro-batches times the loss scale under a
trainer) is `aux_loss_weight`, which the trainer sets.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from minigpt.config import GPTConfig, block_name
from minigpt.shape_checks import SWIGLU_ALPHA, SWIGLU_LIMIT

_AUX_WEIGHT = [1.0]


def aux_loss_weight(weight: float | None = None) -> float:
    """The factor the router's losses enter the gradient with (set it with `weight`); returns the current one."""
    if weight is not None:
        _AUX_WEIGHT[0] = float(weight)
    return _AUX_WEIGHT[0]


class AuxLoss(torch.autograd.Function):
    """Returns `out` unchanged; its backward also sends gradient `aux_loss_weight()` into `loss`, so the router's
    losses train it from whichever pipeline stage computes them (Megatron-core's MoEAuxLossAutoScaler)."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
        ctx.shape, ctx.dtype = loss.shape, loss.dtype
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, torch.full(ctx.shape, aux_loss_weight(), dtype=ctx.dtype, device=grad.device)


def activation(hidden: torch.Tensor, kind: str) -> torch.Tensor:
    """An MLP's activation (GPTConfig.mlp) of its first Linear's output: SwiGLU, silu(gate) * up of its two halves
    (Shazeer 2020), GPT-OSS's clamped SwiGLU (ClampedSwiGLU), GELU (tanh approximation, GPT-2's) or the squared
    ReLU, relu(x)^2 (So et al. 2021, Primer; Nemotron-4). minigpt/model.py's dense MLP, the experts and the shared
    experts use it."""
    if kind == "swiglu":
        gate, up = hidden.chunk(2, dim=-1)
        return F.silu(gate) * up
    if kind == "geglu":  # Gemma's: gelu(gate) * up, the GELU's tanh approximation (gelu_pytorch_tanh)
        gate, up = hidden.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up
    if kind == "clamped-swiglu":
        return ClampedSwiGLU.apply(hidden)
    if kind == "relu2":
        return torch.square(F.relu(hidden))
    return F.gelu(hidden, approximate="tanh")


def clamped_swiglu(hidden: torch.Tensor) -> torch.Tensor:
    """(clamp(up, -L, L) + 1) x g sigmoid(alpha g), g = min(gate, L), of the gate and up halves of `hidden`."""
    gate, up = hidden.chunk(2, dim=-1)
    gate, up = gate.clamp(max=SWIGLU_LIMIT), up.clamp(-SWIGLU_LIMIT, SWIGLU_LIMIT)
    return (up + 1) * gate * torch.sigmoid(SWIGLU_ALPHA * gate)


class ClampedSwiGLU(torch.autograd.Function):
    """clamped_swiglu keeping only its input for the backward, which computes it again (its element-wise steps
    would each save a tensor of the hidden width)."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(hidden)
        return clamped_swiglu(hidden)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        (hidden,) = ctx.saved_tensors
        with torch.enable_grad():
            again = hidden.detach().requires_grad_()
            return torch.autograd.grad(clamped_swiglu(again), again, grad)[0]


class Combine(torch.autograd.Function):
    """Sums routed rows back into their tokens: out[tokens[i]] += rows[i]. Saves only the token indices (torch's
    index_add keeps its source rows too)."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, tokens: torch.Tensor, n_tokens: int) -> torch.Tensor:
        ctx.save_for_backward(tokens)
        return rows.new_zeros(n_tokens, rows.shape[1]).index_add_(0, tokens, rows)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (tokens,) = ctx.saved_tensors
        return grad.index_select(0, tokens), None, None


class Experts(nn.Module):
    """E MLPs stored stacked, (E, d, in) and (E, width, d), so that expert parallelism can hand each rank a slice.

    `forward(x, counts)`: x holds the routed token copies grouped by expert, counts[e] (an int64 tensor of E) rows
    for expert e in order; returns each row through its expert."""

    def __init__(self, config: GPTConfig, n_experts: int | None = None):
        super().__init__()
        n = config.n_experts if n_experts is None else n_experts
        d, width, width_in = config.d_model, config.expert_width, config.expert_in_width
        self.kind = config.mlp
        self.w1 = nn.Parameter(torch.empty(n, d, width_in))
        self.w2 = nn.Parameter(torch.empty(n, width, d))
        self.b1 = nn.Parameter(torch.zeros(n, width_in)) if config.bias else None
        self.b2 = nn.Parameter(torch.zeros(n, d)) if config.bias else None

    def expert(self, weights: tuple, x: torch.Tensor) -> torch.Tensor:
        """Rows `x` through one expert, `weights` its (w1, w2, b1, b2) (biases None without them)."""
        w1, w2, b1, b2 = weights
        hidden = activation(x @ w1 if b1 is None else torch.addmm(b1, x, w1), self.kind)
        return hidden @ w2 if b2 is None else torch.addmm(b2, hidden, w2)

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        sizes = counts.tolist()
        # the stacks unbound once: their backward stacks the experts' gradients in one write (indexing each
        # expert out of a stack would write a zero gradient the stack's size for every expert)
        stacks = [t.unbind(0) if t is not None else [None] * len(sizes) for t in (self.w1, self.w2, self.b1, self.b2)]
        weights = list(zip(*stacks))
        # every expert runs, those no token chose on no rows: the graph, and so the order in which the backward
        # reaches each weight (and the hooks that sum gradients over a group there), is the same on every rank
        # whatever the routing; the output stays one of x's, so the backward reaches the exchange that brought them
        return torch.cat([self.expert(weights[e], rows) for e, rows in enumerate(x.split(sizes))])


class SharedExperts(nn.Module):
    """The experts every token goes through, as one MLP of width n_shared x expert_width (DeepSeek's); with
    shared_expert_gate its output times sigmoid(x . w) per token (Qwen2-MoE's shared_expert_gate)."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        width = config.n_shared_experts * config.expert_width
        width_in = config.n_shared_experts * config.expert_in_width
        self.kind = config.mlp
        self.fc1 = nn.Linear(config.d_model, width_in, bias=config.bias)
        self.fc2 = nn.Linear(width, config.d_model, bias=config.bias)
        self.gate = nn.Linear(config.d_model, 1, bias=False) if config.shared_expert_gate else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.fc2(activation(self.fc1(x), self.kind))
        return out if self.gate is None else out * torch.sigmoid(self.gate(x))


def capacity(config: GPTConfig, seq: int) -> int | None:
    """Routed slots each expert takes per sequence of `seq` tokens (None: dropless)."""
    if config.capacity_factor is None:
        return None
    return math.ceil(config.capacity_factor * seq * config.top_k / config.n_experts)


def choose(scores: torch.Tensor, top_k: int) -> torch.Tensor:
    """The top_k experts of each token, ties to the lower index (a stable sort of the scores)."""
    return torch.sort(scores.detach(), dim=-1, descending=True, stable=True).indices[..., :top_k].contiguous()


def in_chosen_groups(scores: torch.Tensor, config: GPTConfig) -> torch.Tensor:
    """The scores a token chooses its experts by: under group-limited routing (DeepSeek-V3's node-limited routing:
    expert_groups, groups_per_token; DeepSeek-V2's device-limited routing) those outside its groups_per_token best
    groups, each group scored by the sum of its group_score_top best (V3: two, V2: one), set to -inf (ties to the
    lower group); else the scores themselves."""
    if not config.group_limited:
        return scores
    groups, chosen = config.expert_groups, config.groups_per_token
    grouped = scores.detach().unflatten(-1, (groups, -1))
    best = choose(grouped.topk(config.group_score_top, dim=-1).values.sum(-1), chosen)  # (..., chosen) group ids
    keep = torch.zeros(grouped.shape[:-1], dtype=torch.bool, device=scores.device).scatter_(-1, best, True)
    return grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).flatten(-2)


def kept_choices(expert_ids: torch.Tensor, n_experts: int, limit: int | None) -> torch.Tensor:
    """(batch, seq, k) bools: which choices fit in their expert's capacity in their sequence, first choices of
    every token first, then second choices, each in token order."""
    if limit is None:
        return torch.ones_like(expert_ids, dtype=torch.bool)
    batch, seq, k = expert_ids.shape
    ranked = expert_ids.transpose(1, 2).reshape(batch, k * seq)  # choice-major, then token order
    one_hot = F.one_hot(ranked, n_experts)
    position = (one_hot.cumsum(dim=1) * one_hot).sum(-1) - 1  # place of each choice in its expert's queue
    return (position < limit).view(batch, k, seq).transpose(1, 2)


class WholeSequence:
    """Each sequence as a MoE layer routes and balances it: whole on this rank. Capacity and the balance loss count
    over a whole sequence; context and sequence parallelism, which give a rank part of every sequence, swap in their
    own views (parallel/context/moe.py, parallel/tensor/moe.py), so every layout drops and balances the same tokens."""

    def length(self, local: int) -> int:
        """The sequence's length, of which this rank holds `local` tokens."""
        return local

    def total(self, picks: torch.Tensor) -> torch.Tensor:
        """(batch, E) choices per expert of this rank's tokens of each sequence -> of the whole sequences."""
        return picks

    def kept(self, expert_ids: torch.Tensor, n_experts: int, limit: int | None) -> torch.Tensor:
        """kept_choices of this rank's tokens, counted over the whole sequences."""
        return kept_choices(expert_ids, n_experts, limit)

    @property
    def gradient_share(self) -> float:
        """The weight of this rank's token means in the router's losses: 1, or 1 / T where T ranks hold pieces of
        the sequence whose gradients are summed, not averaged (sequence parallelism, parallel/tensor/moe.py)."""
        return 1.0


class MoE(nn.Module):
    """The MLP of a MoE block: routed experts (and shared ones) in place of the dense MLP."""

    def __init__(self, config: GPTConfig, layer: int = 0):
        super().__init__()
        self.config, self.layer = config, layer  # `layer`: the block's index in the model (for its load's report)
        self.router = nn.Linear(config.d_model, config.n_experts, bias=config.router_bias)
        self.experts = Experts(config)
        self.shared = SharedExperts(config) if config.n_shared_experts else None
        self.dropout = nn.Dropout(config.dropout)
        self.register_buffer("load", torch.zeros(config.n_experts, dtype=torch.float64), persistent=False)
        if config.expert_bias:  # fp32 whatever the compute format, saved with the weights (transformers' too)
            self.register_buffer("expert_bias", torch.zeros(config.n_experts, dtype=torch.float32))
            self.register_buffer("step_load", torch.zeros(config.n_experts, dtype=torch.float64), persistent=False)
        self.whole = WholeSequence()

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(expert ids, gates, kept) each (batch, seq, k), and the router's losses (one number)."""
        cfg = self.config
        logits = self.router(x).float()
        scores = logits.softmax(-1) if cfg.router == "softmax" else logits.sigmoid()
        biased = scores + self.expert_bias if cfg.expert_bias else scores  # chooses; the gates are the scores'
        expert_ids = choose(in_chosen_groups(biased, cfg), cfg.top_k)
        gates = scores.gather(-1, expert_ids)
        if cfg.gates_renormalised:
            gates = gates / gates.sum(-1, keepdim=True)
        if cfg.routed_scale != 1.0:
            gates = gates * cfg.routed_scale
        kept = self.whole.kept(expert_ids, cfg.n_experts, capacity(cfg, self.whole.length(x.shape[1])))
        return expert_ids, gates, kept, self.router_losses(logits, scores, expert_ids)

    def router_losses(self, logits: torch.Tensor, scores: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor:
        cfg, batch = self.config, logits.shape[0]
        loss = logits.new_zeros(())
        if cfg.aux_loss_coef:
            picks = self.whole.total(F.one_hot(expert_ids.reshape(batch, -1), cfg.n_experts).sum(1).to(scores.dtype))
            share = picks / (self.whole.length(logits.shape[1]) * cfg.top_k)  # f_e of each (whole) sequence
            probs = scores if cfg.router == "softmax" else scores / scores.sum(-1, keepdim=True)
            balance = cfg.n_experts * (share * probs.mean(1)).sum(-1)
            loss = loss + cfg.aux_loss_coef * balance.mean()
        if cfg.z_loss_coef:
            loss = loss + cfg.z_loss_coef * logits.logsumexp(-1).square().mean()
        return loss * self.whole.gradient_share

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, d = x.shape
        expert_ids, gates, kept, losses = self.route(x)
        cfg = self.config
        k, n_experts = cfg.top_k, cfg.n_experts
        slots = kept.reshape(-1).nonzero().squeeze(1)  # kept (token, choice) slots, token-major
        chosen = expert_ids.reshape(-1)[slots]
        order = slots[torch.sort(chosen, stable=True).indices]  # grouped by expert, token order inside
        counts = torch.bincount(chosen, minlength=n_experts)
        if self.training and torch.is_grad_enabled():  # the load of training steps, not of evaluations
            self.load += counts.to(self.load.dtype)
            if cfg.expert_bias:
                self.step_load += counts.to(self.step_load.dtype)
        tokens = order // k
        routed = self.experts(x.reshape(-1, d)[tokens], counts)
        weighted = routed * gates.reshape(-1)[order].to(routed.dtype).unsqueeze(1)
        out = Combine.apply(weighted, tokens, batch * seq).view(batch, seq, d)
        if self.shared is not None:
            out = out + self.shared(x)
        if losses.requires_grad:
            out = AuxLoss.apply(out, losses)
        return self.dropout(out)


def bias_name(layer: int, n_layers: int) -> str:
    """The plain GPT's state name of block `layer`'s choice bias (checkpoints and transformers' layouts key it so)."""
    return f"{block_name(layer, n_layers)}mlp.expert_bias"


def biased_layers(module: nn.Module) -> list[MoE]:
    """The MoE layers under `module` (a model, or a stage of one) that choose with a bias, in the model's order."""
    return [layer for layer in module.modules() if isinstance(layer, MoE) and layer.config.expert_bias]


def update_bias(moe: MoE, step_load: torch.Tensor) -> None:
    """DeepSeek-V3's update of the choice bias after a step (arXiv 2412.19437, 2.1.2): each expert's bias moves by
    expert_bias_rate towards the experts the step's tokens chose less than the mean, b_e += rate x sign(mean - c_e),
    `step_load` the step's choices per expert over the whole batch (c_e: the sum over every rank routing other tokens,
    parallel/expert/balance.py); the step's count starts again from zero."""
    rate = moe.config.expert_bias_rate
    if rate:
        moe.expert_bias += (rate * torch.sign(step_load.mean() - step_load)).to(moe.expert_bias.dtype)
    moe.step_load.zero_()
