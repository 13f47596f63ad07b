"""A layout and what it puts on each rank: the parameters, tensor by tensor, in model order.

Torch-free. Models parallel/tensor/parallelize.py (tensor parallelism over T ranks: qkv/fc1 rows and
proj/fc2 columns split, qkv/fc1 biases split, proj/fc2 biases, LayerNorms and the
position embedding replicated, the vocabulary padded up to a multiple of T and split),
job/schedule.py's `chunk_layers` (pipeline stages: the embeddings on the first,
final norm + head on the last; a tied head on P > 1 stages keeps its own copy of the
embedding matrix on the last stage, Megatron-style), precision/flat.py (buckets) and
parallel/data/zero3.py (units: the embeddings, each block, final norm + head).
The tensor shapes are checked against minigpt/config.py's counts, the single home.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Sequence

from minigpt.config import GPTConfig
from minigpt.errors import ConfigError, check_positive_int
from precision.policy import FP8_LINEARS
from job.schedule import chunk_layers
from job.train_config import (CP_KINDS, check_context_parallel, check_expert_parallel, check_sharding,
                              check_tensor_parallel, routing_ranks)


@dataclass(frozen=True)
class Layout:
    """How the GPUs are arranged: tensor x context x pipeline x data parallel, ZeRO stage, sequence parallelism.

    Mesh order, outermost first: pp, dp, cp, tp (parallel/mesh.py's, cp between data and tensor parallelism).
    Context parallelism (job/train_config.py's check_context_parallel) cuts every sequence into 2 x cp chunks,
    two per rank; weight gradients are averaged, and ZeRO shards, over the dp x cp ranks of a stage
    (`data_ranks`). FSDP's settings: `shard_group` N (hybrid sharding: ZeRO over groups of N consecutive data ranks,
    `shard_replicas` copies of each shard; 0: over all of them), `reshard_after_forward` (ZeRO-3 only; False
    keeps a unit gathered from its forward to its backward) and `sync_grads_once` (with it, all step: job/
    schedule_actions.py's holds_all_step). New fields come last so that positional constructions stay valid."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    zero: int = 0
    sequence_parallel: bool = False
    virtual_chunks: int = 1  # pipeline chunks per rank (interleaved schedules)
    cp: int = 1  # context-parallel ranks per sequence
    cp_kind: str = "ring"  # how keys and values travel between them: "ring" or "allgather"
    reshard_after_forward: bool = True
    shard_group: int = 0  # 0: ZeRO shards over every data rank
    ep: int = 1  # expert parallelism: a MoE's experts split over ep ranks of the data-parallel group (job/experts.py)
    sync_grads_once: bool = False  # ZeRO-3 without resharding: units kept all step, gradients reduced once
    stage_layers: tuple[int, ...] = ()  # blocks of each pipeline chunk, in global chunk order (): the even split

    @classmethod
    def of(cls, cfg) -> "Layout":
        """The layout of a TrainConfig (job/train_config.py), every field of it."""
        return cls(cfg.tp, cfg.pp, cfg.dp, cfg.zero, cfg.sequence_parallel, cfg.virtual_chunks, cfg.cp, cfg.cp_kind,
                   cfg.reshard_after_forward, cfg.shard_group, cfg.ep, cfg.sync_grads_once, cfg.stage_layers)

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "dp", "virtual_chunks", "cp", "ep"):
            check_positive_int(name, getattr(self, name))
        if self.token_ranks % self.ep:
            raise ConfigError(f"ep {self.ep} does not divide the {self.token_ranks} ranks that route distinct tokens "
                              f"(dp x cp, x tp under sequence parallelism): the expert group is ep of them")
        if self.zero not in (0, 1, 2, 3):
            raise ConfigError(f"zero must be 0, 1, 2 or 3, got {self.zero!r}")
        if not isinstance(self.sequence_parallel, bool):
            raise ConfigError(f"sequence_parallel must be true or false, got {self.sequence_parallel!r}")
        if self.cp_kind not in CP_KINDS:
            raise ConfigError(f"cp_kind must be one of {', '.join(CP_KINDS)}, got {self.cp_kind!r}")
        check_sharding(self.zero, self.data_ranks, self.shard_group, self.reshard_after_forward, self.sync_grads_once)
        object.__setattr__(self, "stage_layers", tuple(self.stage_layers))  # hashable, whatever sequence was given

    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    @property
    def data_ranks(self) -> int:
        """The ranks a stage's weight gradients are averaged over, and ZeRO shards over: dp x cp."""
        return self.dp * self.cp

    @property
    def sequence_ranks(self) -> int:
        """The ranks among which a MoE layer splits each sequence it routes: cp, times tp under sequence
        parallelism (parallel/tensor/moe.py)."""
        return self.cp * (self.tp if self.sequence_parallel else 1)

    @property
    def token_ranks(self) -> int:
        """The ranks of a stage that route other tokens through a MoE (each expert's copies among them): the data
        ranks, times tp under sequence parallelism (parallel/tensor/moe.py)."""
        return routing_ranks(self.dp, self.cp, self.tp, self.sequence_parallel)

    def zero_description(self) -> str:
        """The ZeRO stage that runs with FSDP's settings, in words (simulate's headline, plan's candidates)."""
        three = self.effective_zero == 3
        return (f"ZeRO-{self.effective_zero}"
                + (f" in shard groups of {self.shard_ranks}" if self.shard_replicas > 1 else "")
                + (" without resharding after the forward" if three and not self.reshard_after_forward else "")
                + (", gradients synced once a step" if three and self.sync_grads_once else ""))

    def activation_rows(self, model: GPTConfig) -> int:
        """The tokens of a sequence one rank holds between the layers (what a pipeline stage sends on): its
        s / cp under context parallelism, cut by tp again under sequence parallelism."""
        return model.seq_len // self.sequence_ranks

    @property
    def expert_state_shards(self) -> int:
        """How many ranks the routed experts' masters and AdamW moments are sharded over under expert parallelism:
        the ranks holding the same experts (token_ranks / ep) under ZeRO 1-3, as Megatron-core's distributed
        optimizer shards them; 1 under ZeRO 0 or without expert parallelism (parallel/expert/gradients.py)."""
        return self.token_ranks // self.ep if self.ep > 1 and self.effective_zero else 1

    @property
    def effective_zero(self) -> int:
        """The stage that runs: one data-parallel rank (dp x cp = 1) is always stage 0."""
        return self.zero if self.data_ranks > 1 else 0

    @property
    def shard_ranks(self) -> int:
        """N, the ranks ZeRO shards over, pads every flat buffer to a multiple of, and reduce-scatters and gathers
        over: a shard group's, else every data rank's (and every data rank's when nothing is sharded)."""
        return (self.shard_group or self.data_ranks) if self.effective_zero else self.data_ranks

    @property
    def shard_replicas(self) -> int:
        """Copies of each shard (hybrid sharding): the size of a replica group, the ranks at the same place in every
        shard group, over which the reduce-scattered gradients are all-reduced."""
        return self.data_ranks // self.shard_ranks

    def check(self, model: GPTConfig) -> None:
        """Everything about this layout that the model's shape decides (the same checks as training)."""
        check_tensor_parallel(model, self.tp, self.sequence_parallel)
        check_context_parallel(model, self.cp, self.cp_kind, self.tp, self.sequence_parallel)
        check_expert_parallel(model, self.ep, self.dp, self.cp, self.tp, self.sequence_parallel)
        self.chunks(model)  # raises when a chunk would have no block, or the stage layout does not fit

    def chunks(self, model: GPTConfig) -> list[range]:
        """The blocks of each global pipeline chunk: the stage layout's, else the even split (chunk_layers)."""
        return chunk_layers(model.n_layers, self.pp * self.virtual_chunks, self.stage_layers)

    @property
    def placement(self) -> str:
        """The stage layout as --stage-layers takes it ('4,4*14,1': runs of equal chunks folded), '' for the even
        split."""
        runs: list[list[int]] = []
        for size in self.stage_layers:
            if runs and runs[-1][0] == size:
                runs[-1][1] += 1
            else:
                runs.append([size, 1])
        return ",".join(f"{size}*{count}" if count > 1 else str(size) for size, count in runs)

    def rank_chunks(self, model: GPTConfig) -> list[list[tuple[int, range]]]:
        """For each pipeline rank, its (global chunk index, blocks): rank r holds chunks r, r + pp, ..."""
        chunks = self.chunks(model)
        return [[(c, chunks[c]) for c in range(rank, len(chunks), self.pp)] for rank in range(self.pp)]


class Tensor(NamedTuple):
    """One parameter as one rank holds it."""

    name: str
    numel: int  # elements on this rank
    replicated: bool  # every rank of the tensor-parallel group holds the same copy


def padded_vocab(model: GPTConfig, tp: int) -> int:
    """The vocabulary padded up to a multiple of tp (parallel/tensor/parallelize.py)."""
    return -(-model.vocab_size // tp) * tp


def _norm(name: str, model: GPTConfig) -> list[Tensor]:
    """A LayerNorm's gain and bias, or an RMSNorm's gain: replicated on every tensor-parallel rank."""
    gain = [Tensor(f"{name}.weight", model.d_model, True)]
    return gain + [Tensor(f"{name}.bias", model.d_model, True)] if model.norm == "layernorm" else gain


def _linear(name: str, rows: int, columns: int, model: GPTConfig, tp: int, column_parallel: bool) -> list[Tensor]:
    """A Linear's weight split over tp (by rows: column-parallel; by columns: row-parallel) and its bias
    (split with the rows, or replicated and added after the sum)."""
    weight = Tensor(f"{name}.weight", rows * columns // tp, False)
    if not model.linear_bias(name):
        return [weight]
    if column_parallel:
        return [weight, Tensor(f"{name}.bias", rows // tp, False)]
    bias = Tensor(f"{name}.bias", rows, True)
    return [bias, weight] if tp > 1 else [weight, bias]  # a RowParallelLinear registers its bias first


def is_expert_tensor(tensor: Tensor) -> bool:
    """A routed expert's tensor (mlp.experts.*): split over the ep ranks under expert parallelism."""
    return tensor.name.startswith("mlp.experts.")


FP8_EXPERT_WEIGHTS = ("mlp.experts.w1", "mlp.experts.w2")  # the routed experts' stacked weights (_moe_tensors)


def is_fp8_weight(tensor: Tensor, experts: bool = False) -> bool:
    """The weight of a block Linear the fp8 policy multiplies in fp8 (precision/policy.py's FP8_LINEARS: qkv, proj,
    fc1, fc2, a shared expert's too), and with `experts` (fp8 grouped experts) the routed experts' weights; the
    embeddings, head, norms, biases and router are not."""
    parts = tensor.name.split(".")
    linear = parts[-1] == "weight" and len(parts) > 1 and parts[-2] in FP8_LINEARS
    return linear or (experts and tensor.name in FP8_EXPERT_WEIGHTS)


def expert_tensors(model: GPTConfig, ep: int) -> list[Tensor]:
    """A MoE block's routed-expert tensors as one rank of an expert group of `ep` holds them (E / ep experts)."""
    return [t._replace(numel=t.numel // ep) for t in _moe_tensors(model) if is_expert_tensor(t)]


def _moe_tensors(model: GPTConfig) -> list[Tensor]:
    """A MoE MLP's parameters (minigpt/moe.py), replicated on every tensor-parallel rank (no expert tensor
    parallelism): router, the stacked experts' weights and biases, the shared experts."""
    d, experts, bias = model.d_model, model.n_experts, model.bias
    tensors = [Tensor("mlp.router.weight", d * experts, True),
               *([Tensor("mlp.router.bias", experts, True)] if model.router_bias else []),
               Tensor("mlp.experts.w1", experts * d * model.expert_in_width, True),
               Tensor("mlp.experts.w2", experts * model.expert_width * d, True)]
    if bias:
        tensors += [Tensor("mlp.experts.b1", experts * model.expert_in_width, True),
                    Tensor("mlp.experts.b2", experts * d, True)]
    shared = model.n_shared_experts
    if shared:
        tensors.append(Tensor("mlp.shared.fc1.weight", shared * model.expert_in_width * d, True))
        tensors += [Tensor("mlp.shared.fc1.bias", shared * model.expert_in_width, True)] if bias else []
        tensors.append(Tensor("mlp.shared.fc2.weight", d * shared * model.expert_width, True))
        tensors += [Tensor("mlp.shared.fc2.bias", d, True)] if bias else []
        tensors += [Tensor("mlp.shared.gate.weight", d, True)] if model.shared_expert_gate else []
    return tensors


def block_tensors(model: GPTConfig, tp: int, moe: bool | None = None) -> list[Tensor]:
    """One block's parameters on one rank, in named_parameters() order: a MoE block when `moe` (None: the kind most
    of the model's blocks are, as GPTConfig.block_params)."""
    d, f = model.d_model, model.d_ff
    moe = model.is_moe if moe is None else moe
    mlp = _moe_tensors(model) if moe else [*_linear("mlp.fc1", model.mlp_in_width, d, model, tp, True),
                                           *_linear("mlp.fc2", d, f, model, tp, False)]
    post = [*_norm("post_attn_norm", model), *_norm("post_mlp_norm", model)] if model.post_norms else []  # Gemma's
    pre = [_norm("ln1", model), _norm("ln2", model)] if model.pre_norms else [[], []]  # none: OLMo 2's
    return [*pre[0], *_attention_tensors(model, tp), *pre[1], *mlp, *post]


def _attention_tensors(model: GPTConfig, tp: int) -> list[Tensor]:
    """The attention's parameters on one rank: the fused qkv (rows split), the head norms (replicated; over all heads
    split as the heads) and proj
    (columns split); under MLA (minigpt/model.py's LatentAttention) the down projection and the latent norms
    replicated, the up projections split by heads (rows), proj by columns."""
    d = model.d_model
    proj = _linear("attn.proj", d, model.attention_width, model, tp, False)
    if not model.is_mla:
        qk_norms = [Tensor(f"attn.core.{n}_norm.weight", model.head_dim, True) for n in "qk"] if model.qk_norm else []
        if model.qk_norm_whole:  # OLMo 2's, a gain per column: this rank's heads'
            qk_norms = [Tensor(f"attn.core.{n}_norm.weight", heads * model.head_dim // tp, False)
                        for n, heads in (("q", model.n_heads), ("k", model.kv_heads))]
        sinks = [Tensor("attn.core.sinks", model.n_heads // tp, False)] if model.attention_sinks else []
        return [*_linear("attn.qkv", model.qkv_width, d, model, tp, True), *qk_norms, *sinks, *proj]
    q_norm = [Tensor("attn.q_norm.weight", model.q_lora_rank, True)] if model.q_lora_rank else []
    heads = model.n_heads
    return [Tensor("attn.down.weight", model.latent_width * d, True), *q_norm,
            Tensor("attn.kv_norm.weight", model.kv_lora_rank, True),
            *_linear("attn.q_up", heads * model.qk_head_dim, model.q_up_in_width, model, tp, True),
            *_linear("attn.kv_up", heads * (model.head_dim + model.v_head_dim), model.kv_lora_rank, model, tp, True),
            *proj]


def embedding_tensors(model: GPTConfig, tp: int) -> list[Tensor]:
    tokens = [Tensor("tok_emb.weight", padded_vocab(model, tp) // tp * model.d_model, False)]
    if model.positions == "learned":
        tokens.append(Tensor("pos_emb.weight", model.seq_len * model.d_model, True))
    return tokens


def head_tensors(model: GPTConfig, tp: int, pp: int) -> list[Tensor]:
    """Final norm and head; a tied head is counted on the last stage only when it is not the first."""
    norm = _norm("norm_f", model)
    if model.tied_head and pp == 1:
        return norm  # shares the embedding's Parameter, counted once
    return norm + [Tensor("head.weight", padded_vocab(model, tp) // tp * model.d_model, False)]


def mtp_tensors(model: GPTConfig, tp: int) -> list[Tensor]:
    """The multi-token prediction modules' parameters (minigpt/model.py's MultiTokenPrediction), in order: each its
    two input norms, the 2d -> d projection (replicated: not split over tp), its block (of the model's last kind,
    named as a block's) and its final norm."""
    block = block_tensors(model, tp, model.mtp_is_moe)
    one = [*_norm("enorm", model), *_norm("hnorm", model), Tensor("eh_proj.weight", 2 * model.d_model**2, True),
           *block, *_norm("norm", model)]
    return one * model.mtp_depth


def embedding_copy(model: GPTConfig, pp: int) -> str | None:
    """The name of the last stage's own copy of the embedding matrix when the model is split over pp > 1 stages and
    the last one reads it, Megatron-style (its gradient summed with the first stage's): a tied head's weight, or an
    untied model's copy for its multi-token prediction modules' lookups; None otherwise."""
    if pp == 1 or not (model.tied_head or model.mtp_depth):
        return None
    return "head.weight" if model.tied_head else MTP_EMBEDDING


MTP_EMBEDDING = "mtp_embedding.weight"  # the last stage's copy of an untied model's embedding, for its modules


def last_unit(model: GPTConfig, tp: int, pp: int, ep: int = 1) -> list[Tensor]:
    """The last chunk's last ZeRO-3 unit (parallel/pipeline/executor.py's Chunk.units): the final norm, the
    multi-token prediction modules (their routed experts left out under expert parallelism), the head, and under
    pipelining an untied model's embedding copy for the modules."""
    head, norm = head_tensors(model, tp, pp), len(_norm("norm_f", model))
    mtp = [t for t in mtp_tensors(model, tp) if not (ep > 1 and is_expert_tensor(t))]
    copy = [Tensor(MTP_EMBEDDING, padded_vocab(model, tp) // tp * model.d_model, False)] \
        if embedding_copy(model, pp) == MTP_EMBEDDING else []
    return head[:norm] + mtp + head[norm:] + copy


def check_against_config(model: GPTConfig) -> None:
    """The shapes above, summed for one rank, must equal config.py's counts (the single home)."""
    counted = (sum(t.numel for t in block_tensors(model, 1, False)), sum(t.numel for t in block_tensors(model, 1, True)),
               sum(t.numel for t in embedding_tensors(model, 1)), sum(t.numel for t in head_tensors(model, 1, 1)),
               sum(t.numel for t in mtp_tensors(model, 1)))
    expected = (model.block_params(False), model.block_params(True) if model.is_moe else counted[1],
                model.embedding_params(), model.head_params(), model.mtp_params())
    if counted != expected:
        raise RuntimeError(f"job/layout.py's tensor shapes {counted} disagree with minigpt/config.py {expected}")


def stage_units(model: GPTConfig, layout: Layout) -> list[list[list[list[Tensor]]]]:
    """For each pipeline rank, for each of its chunks, the ZeRO-3 units in forward order (lists of tensors).

    A bucket never spans two chunks (parallel/pipeline/executor.py's parameter_groups). Every block's unit is the
    same list (read it, never change it): a planner asks this of thousands of layouts of a 96-layer model.
    Under expert parallelism a MoE block's experts are left out: they are reduced over their own group
    (job/exchange/experts.py's expert_gradient_reduction)."""
    last = layout.pp * layout.virtual_chunks - 1
    kinds = {moe: block_tensors(model, layout.tp, moe) for moe in (False, True)}
    if layout.ep > 1:
        kinds[True] = [t for t in kinds[True] if not is_expert_tensor(t)]
    stages = []
    for chunks in layout.rank_chunks(model):
        per_chunk = []
        for index, layers in chunks:
            units = [embedding_tensors(model, layout.tp)] if index == 0 else []
            units += [kinds[model.is_moe_layer(layer)] for layer in layers]
            if index == last:
                units.append(last_unit(model, layout.tp, layout.pp, layout.ep))
            per_chunk.append(units)
        stages.append(per_chunk)
    return stages


class Bucket(NamedTuple):
    """A run of whole parameters, padded; `first` and `last` name its border tensors."""

    size: int  # elements, padding included
    first: str
    last: str


def bucket_members(tensors: Sequence[Tensor], bucket_numel: int | None, pad_to: int) -> list[tuple[range, int]]:
    """(indices of its tensors, size padded) of each bucket precision/flat.py's FlatParameters cuts
    `tensors` into: whole tensors, cut once a bucket holds `bucket_numel` elements (one bucket when
    None), each padded to a multiple of `pad_to`."""
    cut, offset, start, first = [], 0, 0, 0
    for index, tensor in enumerate(tensors):
        offset += tensor.numel
        if index == len(tensors) - 1 or (bucket_numel is not None and offset - start >= bucket_numel):
            end = -(-offset // pad_to) * pad_to
            cut.append((range(first, index + 1), end - start))
            offset = start = end
            first = index + 1
    return cut


def buckets(tensors: Sequence[Tensor], bucket_numel: int | None, pad_to: int) -> list[Bucket]:
    """The buckets precision/flat.py's FlatParameters cuts `tensors` into (one when bucket_numel is None)."""
    return [Bucket(size, tensors[members[0]].name, tensors[members[-1]].name)
            for members, size in bucket_members(tensors, bucket_numel, pad_to)]
