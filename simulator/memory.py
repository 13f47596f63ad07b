"""Predicted bytes per GPU, by category, for a layout: what OUR implementation holds.

Torch-free. It models parallel/tensor.py, parallel/zero.py, parallel/zero3.py and
precision/flat.py, not the ZeRO paper, so a run's `memory_per_rank` can be
checked against it:

- Parameters per rank and pipeline stages: simulator/layout.py.
- Flat layout: parameters in model order, cut into buckets that close once they reach
  bucket_numel = int(bucket_mb * 2**20) // compute bytes, each padded to a multiple of
  the data-parallel size N; ZeRO-3 pads one flat per unit (embeddings, each block,
  final norm + head). A bucket never spans two pipeline chunks. With N == 1 every stage
  is stage 0 (make_data_parallel).
- Stages: 0 all weights, grads, masters, m, v; 1 masters/m/v for 1/N; 2 grads 1/N too;
  3 weights 1/N too. Masters exist only when the policy has them (fp32: none).
- Activations: see `layer_activation_parts`; comm buffers: `data_parallel_buffers`, `zero3_buffers`.
  A run's measured activations are one micro-batch's forward (parallel/memory.py):
  compare them with micro_batches_in_flight=1.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Sequence

from minigpt.config import GPTConfig, check_recompute
from minigpt.errors import ConfigError
from precision.policy import FORMAT_BYTES, PrecisionPolicy, policy as precision_policy
from simulator.hardware import GPUSpec
from simulator.layout import Bucket, Layout, block_tensors, buckets, check_against_config, padded_vocab, stage_units

MAX_IN_FLIGHT = 2  # parallel/zero.py's bound on overlapped reduce-scatters (it imports torch; a test checks)
FP32 = FORMAT_BYTES["fp32"]
REPLICATED, SPLIT_TP, SPLIT_SP = "replicated", "tp", "sp"  # how tensor parallelism divides an activation


# ---------------------------------------------------------------- activations per rank


@dataclass(frozen=True)
class ActivationPart:
    name: str
    bytes_per_token: int  # on one rank without tensor parallelism
    split: str  # REPLICATED, SPLIT_TP (always divided by tp) or SPLIT_SP (divided only with sequence parallelism)


def layer_activation_parts(
    model: GPTConfig, dtype_bytes: int, recompute: str = "none", fp8: bool = False
) -> list[ActivationPart]:
    """config.activation_bytes_per_token_per_layer, term by term, with how tensor parallelism divides each.

    q, k, v, the attention output, the GELU input and output and the attention
    log-sum-exp live between a column- and a row-parallel Linear: divided by tp.
    LayerNorm inputs, their statistics and the residual dropout masks: replicated,
    divided by tp with sequence parallelism. The LayerNorm outputs are saved by the
    column-parallel qkv/fc1 as their input, which our code all-gathers before the
    matmul: full size even with sequence parallelism (Megatron keeps the shard and
    gathers again in the backward; we do not). fp8 Linears save their inputs as
    e4m3 (1 byte) and the attention output once more in fp8 beside its 16-bit copy.
    """
    check_recompute(recompute)
    d, f, b = model.d_model, model.d_ff, dtype_bytes
    if recompute == "full":
        return [ActivationPart("block_input", d * b, SPLIT_SP)]
    linear_input = FORMAT_BYTES["fp8_e4m3"] if fp8 else b
    parts = [
        ActivationPart("layernorm_inputs", 2 * d * b, SPLIT_SP),
        ActivationPart("qkv_fc1_inputs", 2 * d * linear_input, REPLICATED),
        ActivationPart("q_k_v", 3 * d * b, SPLIT_TP),
        ActivationPart("attention_output", d * b, SPLIT_TP),
        ActivationPart("gelu_input", f * b, SPLIT_TP),
        ActivationPart("gelu_output", f * linear_input, SPLIT_TP),
        ActivationPart("layernorm_statistics", 4 * FP32, SPLIT_SP),
        ActivationPart("attention_logsumexp", model.n_heads * FP32, SPLIT_TP),
    ]
    if fp8:
        parts.append(ActivationPart("attention_output_fp8", d * FORMAT_BYTES["fp8_e4m3"], SPLIT_TP))
    if model.dropout > 0:
        parts.append(ActivationPart("dropout_masks", 2 * d, SPLIT_SP))
    return parts


def head_activation_parts(model: GPTConfig, dtype_bytes: int, tp: int) -> list[ActivationPart]:
    """config.head_activation_bytes_per_token, term by term; the log-probabilities cover the padded vocabulary."""
    d = model.d_model
    return [
        ActivationPart("final_layernorm_input", d * dtype_bytes, SPLIT_SP),
        ActivationPart("head_input", d * dtype_bytes, REPLICATED),  # gathered under sequence parallelism
        ActivationPart("log_probabilities", padded_vocab(model, tp) * FP32, SPLIT_TP),
        ActivationPart("loss_statistics", 2 * FP32, REPLICATED),
    ]


def check_activations_against_config(model: GPTConfig, dtype_bytes: int) -> None:
    for recompute in ("none", "full"):
        counted = sum(p.bytes_per_token for p in layer_activation_parts(model, dtype_bytes, recompute))
        if counted != model.activation_bytes_per_token_per_layer(dtype_bytes, recompute):
            raise RuntimeError("simulator/memory.py's activation breakdown disagrees with minigpt/config.py")
    head = sum(p.bytes_per_token for p in head_activation_parts(model, dtype_bytes, 1))
    if head != model.head_activation_bytes_per_token(dtype_bytes):
        raise RuntimeError("simulator/memory.py's head activation breakdown disagrees with minigpt/config.py")


def parts_bytes(parts: list[ActivationPart], tokens: int, layout: Layout) -> int:
    """Bytes of `parts` for `tokens` tokens on one rank of `layout`."""
    total = 0
    for part in parts:
        divided = part.split == SPLIT_TP or (part.split == SPLIT_SP and layout.sequence_parallel)
        total += part.bytes_per_token * tokens // (layout.tp if divided else 1)
    return total


def layer_activation_bytes(model: GPTConfig, layout: Layout, policy: PrecisionPolicy, micro_batch_size: int,
                           recompute: str = "none") -> int:
    """Bytes one block keeps for its backward, for one micro-batch, on one rank."""
    tokens = micro_batch_size * model.seq_len
    parts = layer_activation_parts(model, FORMAT_BYTES[policy.compute], recompute, policy.fp8_linears)
    total = parts_bytes(parts, tokens, layout)
    if policy.fp8_linears and recompute == "none":  # the e4m3 weight copies each fp8 Linear saves
        matrices = [t for t in block_tensors(model, layout.tp) if t.name.endswith("weight") and not t.name.startswith("ln")]
        total += sum(t.numel for t in matrices) * FORMAT_BYTES["fp8_e4m3"]
    return total


# ---------------------------------------------------------------- the estimate


@dataclass(frozen=True)
class MemoryBytes:
    parameters: int
    gradients: int
    master_weights: int
    adam_m: int
    adam_v: int
    activations: int
    comm_buffers: int

    @property
    def model_states(self) -> int:
        return self.parameters + self.gradients + self.master_weights + self.adam_m + self.adam_v

    @property
    def total(self) -> int:
        return self.model_states + self.activations + self.comm_buffers


@dataclass(frozen=True)
class StageMemory(MemoryBytes):
    stage: int = 0
    layers: int = 0
    numel: int = 0  # parameters on one rank of this stage, before padding


@dataclass(frozen=True)
class MemoryEstimate(MemoryBytes):
    """Bytes per GPU on the most loaded pipeline stage (`stage`); `per_stage` has every stage."""

    stage: int = 0
    per_stage: tuple[StageMemory, ...] = ()
    capacity: int | None = None  # the GPU's HBM when a gpu was given
    notes: tuple[str, ...] = field(default=())

    @property
    def fits(self) -> bool | None:
        """Whether `total` fits the GPU's HBM (no allowance for the CUDA context or fragmentation)."""
        return None if self.capacity is None else self.total <= self.capacity

    def as_dict(self) -> dict:
        data = asdict(self)
        data.update(total=self.total, fits=self.fits, per_stage=[{**asdict(s), "total": s.total} for s in self.per_stage])
        return data


def module_of(name: str) -> str:
    return name.rsplit(".", 1)[0]


def data_parallel_buffers(stage: int, cut: list[Bucket], dp: int) -> int:
    """Peak elements of ZeRO 1/2 buffers, walking the buckets in backward order as parallel/zero.py does.

    Buckets complete last to first. zero.py measures right after launching one, with up to
    MAX_IN_FLIGHT + 1 reduce-scatters in the air (each an output of 1/N of its bucket, and
    under stage 2 the bucket's staging too), and, under stage 2, the staging of the bucket
    before it when that bucket is already open: counted when the border between them falls
    inside one module (a weight and its bias reach their gradients together, in either order).
    Stage 0 all-reduces in place: none.
    """
    if stage == 0:
        return 0
    peak, in_flight = 0, []
    for k in reversed(range(len(cut))):
        size = cut[k].size
        in_flight = (in_flight + [size // dp + (size if stage == 2 else 0)])[-(MAX_IN_FLIGHT + 1) :]
        opened = stage == 2 and k > 0 and module_of(cut[k - 1].last) == module_of(cut[k].first)
        peak = max(peak, sum(in_flight) + (cut[k - 1].size if opened else 0))
        in_flight = in_flight[-MAX_IN_FLIGHT:]
    return peak


def zero3_buffers(units: list[int], dp: int) -> int:
    """Peak elements of ZeRO-3 buffers, walking the units in backward order as parallel/zero3.py does.

    While unit i's gradients come in: the first and last units (kept gathered all step),
    unit i and the unit before it (prefetched) when they are not kept, unit i's staging
    (full size), and the last MAX_IN_FLIGHT reduce-scatters (staging + 1/N output).
    """
    kept = {0, len(units) - 1}
    peak, in_flight = 0, []
    for i in reversed(range(len(units))):
        gathered = sum(units[j] for j in kept)
        if i not in kept:
            gathered += units[i] + (units[i - 1] if i - 1 not in kept else 0)
        peak = max(peak, gathered + units[i] + sum(in_flight))
        in_flight = (in_flight + [units[i] + units[i] // dp])[-MAX_IN_FLIGHT:]
    return peak


def predict_memory(
    model: GPTConfig,
    layout: Layout,
    precision: str,
    micro_batch_size: int,
    recompute: str = "none",
    gpu: GPUSpec | None = None,
    bucket_mb: float = 25.0,
    micro_batches_in_flight: int | Sequence[int] = 1,
) -> MemoryEstimate:
    """Bytes per GPU by category, for the most loaded pipeline stage (every stage in `per_stage`).

    `micro_batches_in_flight`: forwards whose activations are alive at a stage's peak, one
    number for every stage or one per stage; the schedule decides (1 without a pipeline; 1F1B:
    pp - rank). With virtual chunks it counts chunk forwards, each charged the rank's largest
    chunk (and the head's activations on the last rank): an upper bound."""
    layout.check(model)
    pol = precision_policy(precision)
    check_recompute(recompute)
    if not isinstance(micro_batch_size, int) or micro_batch_size < 1:
        raise ConfigError(f"micro_batch_size must be a positive integer, got {micro_batch_size!r}")
    if isinstance(bucket_mb, bool) or not isinstance(bucket_mb, (int, float)) or not 0 < bucket_mb < math.inf:
        raise ConfigError(f"bucket_mb must be a finite number > 0, got {bucket_mb!r}")
    in_flight = micro_batches_in_flight
    in_flight = [in_flight] * layout.pp if isinstance(in_flight, int) else list(in_flight)
    if len(in_flight) != layout.pp or any(not isinstance(n, int) or n < 1 for n in in_flight):
        raise ConfigError(
            f"micro_batches_in_flight must be a positive integer or {layout.pp} of them (one per pipeline stage), "
            f"got {micro_batches_in_flight!r}"
        )
    per_param = pol.bytes_per_param()
    compute_bytes = per_param["compute"]
    check_against_config(model)
    check_activations_against_config(model, compute_bytes)
    bucket_numel = max(1, int(bucket_mb * 2**20) // compute_bytes)
    zero, dp = layout.effective_zero, layout.dp
    tokens = micro_batch_size * model.seq_len
    tied_copy = model.tied_head and layout.pp > 1
    stages = []
    for index, (chunks, placed) in enumerate(zip(stage_units(model, layout), layout.rank_chunks(model))):
        units = [unit for chunk in chunks for unit in chunk]
        tensors = [t for unit in units for t in unit]
        unit_sizes = [buckets(unit, None, dp)[0].size for unit in units]
        cut = [b for chunk in chunks for b in buckets([t for unit in chunk for t in unit], bucket_numel, dp)]
        padded = sum(b.size for b in cut)
        held = sum(unit_sizes) // dp if zero == 3 else padded
        owned = held if zero in (0, 3) else padded // dp
        grads = owned if zero >= 2 else held
        last = any(c == layout.pp * layout.virtual_chunks - 1 for c, _ in placed)
        layers = max(len(r) for _, r in placed)  # with virtual chunks: a micro-batch in flight holds one chunk
        per_layer = layer_activation_bytes(model, layout, pol, micro_batch_size, recompute)
        activations = in_flight[index] * layers * per_layer
        if recompute == "full":  # the block being recomputed holds its full activations during its backward
            activations += layer_activation_bytes(model, layout, pol, micro_batch_size, "none")
        if last:
            head = parts_bytes(head_activation_parts(model, compute_bytes, layout.tp), tokens, layout)
            activations += in_flight[index] * head
        buffers = zero3_buffers(unit_sizes, dp) if zero == 3 else data_parallel_buffers(zero, cut, dp)
        stages.append(StageMemory(
            parameters=held * compute_bytes, gradients=grads * per_param["grad"],
            master_weights=owned * per_param["master"], adam_m=owned * per_param["adam_m"], adam_v=owned * per_param["adam_v"],
            activations=activations, comm_buffers=buffers * compute_bytes,
            stage=index, layers=sum(len(r) for _, r in placed), numel=sum(t.numel for t in tensors),
        ))
    peak = max(stages, key=lambda s: s.total)
    notes = []
    if tied_copy:
        notes.append(
            "tied head on several pipeline stages: the last stage holds its own copy of the embedding matrix (Megatron-style)"
        )
    if layout.dp == 1 and layout.zero > 0:
        notes.append("one data-parallel rank: ZeRO runs as stage 0")
    if recompute == "full":
        notes.append("recompute: activations include one block's full activations while it is recomputed")
    return MemoryEstimate(
        **{name: getattr(peak, name) for name in MemoryBytes.__dataclass_fields__},
        stage=peak.stage, per_stage=tuple(stages), capacity=None if gpu is None else gpu.hbm_bytes, notes=tuple(notes),
    )
