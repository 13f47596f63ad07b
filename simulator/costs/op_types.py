"""The op-level cost model's vocabulary: ops, saved tensors, and the recorder that builds a unit. Torch-free.

simulator/costs/ops.py explains the model and builds the units with these.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Union

from minigpt.config import GATED_MLPS, SINK_COLUMNS, GPTConfig
from minigpt.errors import ConfigError
from precision.policy import FORMAT_BYTES, PrecisionPolicy
from simulator.costs.implementation import (ATTENTION_KERNELS, DISPATCHERS, FP8_AMAX_GROUPS, FP8_RECIPES,  # noqa: F401
                                             FP8_SCALINGS, SP_SAVED_INPUTS, EXPERT_STREAMS,
                                             Implementation)  # (re-exported: the model's vocabulary)
from simulator.costs.userbuffers import TE_1X, UB_PIPELINE_SPLITS, Userbuffers  # noqa: F401 (re-exported)

if TYPE_CHECKING:  # kept out of the import: `minigpt --help` reads SP_SAVED_INPUTS from here
    from job.layout import Layout

FORWARD, RECOMPUTE, BACKWARD, STEP = "forward", "recompute", "backward", "step"
FP32 = FORMAT_BYTES["fp32"]
MASK = 1  # a dropout mask: one byte (torch.bool) per element
OUTSIDE, BLOCK, CORE = "outside", "block", "attention_core"  # where a tensor is made (recompute regions)
RECOMPUTED_REGIONS = {"none": (), "selective": (CORE,), "full": (CORE, BLOCK)}
GEMM_INPUT_BYTES = {"fp8": 1, "tf32": 4, "fp32": 4, "bf16": 2, "fp16": 2}
MX_BLOCK = 32  # MXFP8: one 8-bit (E8M0) scale per 32 elements along the reduction (OCP Microscaling Formats v1.0)


@dataclass(frozen=True)
class Gemm:
    name: str
    m: int
    n: int
    k: int
    dtype: str  # the tensor-core format it runs in
    batch: int = 1
    bytes: int = 0  # HBM: both operands read once, the result written once
    phase: str = FORWARD
    linear: bool = True  # a Linear layer's matmul (these can hide tensor-parallel collectives)
    chunks: int = 1  # run as this many GEMMs of m / chunks rows, one after another (Implementation.ub_chunks)
    sm_margin: int = 0  # SMs left to a userbuffers collective for the whole GEMM (simulator/costs/userbuffers.py)
    streams: int = 0  # 0: the batch one kernel; S: a kernel per batch entry, S at a time (Implementation.expert_gemms)

    @property
    def flops(self) -> int:
        return 2 * self.m * self.n * self.k * self.batch

    @property
    def rounds(self) -> list[int]:
        """The batch entries that run together, round by round: all at once, or `streams` at a time."""
        if not self.streams or self.batch <= self.streams:
            return [self.batch]
        full, rest = divmod(self.batch, self.streams)
        return [self.streams] * full + ([rest] if rest else [])

    @property
    def launches(self) -> int:
        """Kernels whose overhead shows one after another: a chunk each, a round each on parallel streams."""
        return self.chunks * len(self.rounds)


@dataclass(frozen=True)
class MemoryOp:
    name: str
    read: int  # bytes
    written: int
    phase: str = FORWARD

    @property
    def bytes(self) -> int:
        return self.read + self.written

    @property
    def flops(self) -> int:
        return 0


@dataclass(frozen=True)
class FusedAttention:
    """The attention matmuls in one kernel. Its GEMMs span the s x s square of scores; under a causal mask
    (causal_seq = s) query i meets keys 0..i only, and the kernel skips the tiles above the diagonal."""

    name: str
    gemms: tuple[Gemm, ...]
    read: int
    written: int
    phase: str = FORWARD
    causal_seq: int = 0  # s of a causal mask (the whole sequence's, under context parallelism too); 0: the whole square
    kernel_seq: int = 0  # the sequence length the kernel works on when it is not causal_seq (a ring's chunk)
    kernel: str = "flash-attn-2"  # which fused kernel runs it (Implementation.attention_kernel): whose table prices it
    padded_flops: int = 0  # of the square's, the products of zero-padded value columns: not the model's
    window: int = 0  # a sliding window shorter than causal_seq (0: none)
    documents: int = 0  # the documents' mean length under a document mask (0: none)
    kept: float = 0.0  # under either, the share of the square the mask keeps (the busiest context-parallel rank's)

    @property
    def bytes(self) -> int:
        return self.read + self.written

    @property
    def efficiency_seq(self) -> int:
        """The length a published causal-kernel table is read at (simulator/costs/rates/attention_rates.py); under a
        sliding window w at most 2 w, the causal length whose rows meet w keys on average as the band's rows do (no
        sliding-window kernel table is published); under a document mask, the same: twice the keys its rows meet on
        average (each document is a causal attention of its own)."""
        seq = self.kernel_seq or self.causal_seq
        if self.documents:
            return max(1, min(seq, round(2 * self.kept * self.causal_seq)))
        return min(seq, 2 * self.window) if self.window else seq

    @property
    def square_flops(self) -> int:
        return sum(g.flops for g in self.gemms)

    @property
    def flops(self) -> int:
        """The products the mask keeps, exactly: s (s + 1) / 2 of the square's s^2 under a causal mask (a
        context-parallel rank's GEMMs span s/cp queries x s keys, and it keeps exactly 1/cp of them:
        the load-balanced split, parallel/context/chunks.py); under a sliding window its band, under a document mask
        the expected products within documents (`kept`)."""
        s = self.causal_seq
        if self.window or self.documents:
            return int(self.square_flops * self.kept)
        return self.square_flops * (s + 1) // (2 * s) if s else self.square_flops

    @property
    def benchmark_flops(self) -> int:
        """FLOPs as attention kernels' benchmarks count them: half the square under a causal mask
        (simulator/costs/rates/attention_rates.py); a band's or the documents' own products."""
        if self.window or self.documents:
            return self.flops
        return self.square_flops // 2 if self.causal_seq else self.square_flops

    @property
    def model_square(self) -> int:
        """The square as config.py counts the model's FLOPs: s x s, or s x w under a sliding window."""
        return self.square_flops * self.window // self.causal_seq if self.window else self.square_flops


Op = Union[Gemm, MemoryOp, FusedAttention]


def model_flops(op: Op) -> int:
    """An op's FLOPs as config.py counts them: a fused attention's whole square (its padded values' left out), every
    other op's own."""
    return op.model_square - op.padded_flops if isinstance(op, FusedAttention) else op.flops


@dataclass(frozen=True)
class Saved:
    name: str
    bytes: int
    small: bool = False  # O(rows) statistics: what Korthikanti et al. leave out


@dataclass(frozen=True)
class OpList:
    """One unit (a block, the embeddings, or the head and loss) for one micro-batch on one rank."""

    forward: tuple[Op, ...]
    backward: tuple[Op, ...]  # the recomputed forward ops first (phase "recompute"), then the gradients
    saved: tuple[Saved, ...]  # kept from the forward for the backward
    recomputed: tuple[Saved, ...] = ()  # rebuilt by the backward's recompute, alive while it runs
    per_step: tuple[Op, ...] = ()  # run once per step, not per micro-batch (fp8 weight casts kept across them)
    workspace: tuple[Saved, ...] = ()  # held once per unit across the step's micro-batches (the cached fp8 weights)

    @property
    def workspace_bytes(self) -> int:
        return sum(t.bytes for t in self.workspace)

    @property
    def saved_bytes(self) -> int:
        return sum(t.bytes for t in self.saved)

    @property
    def recomputed_bytes(self) -> int:
        return sum(t.bytes for t in self.recomputed)

    @property
    def flops(self) -> int:
        """The products the kernels compute (a causal attention kernel's half of the square)."""
        return sum(op.flops for op in self.forward + self.backward)

    @property
    def model_flops(self) -> int:
        """FLOPs as minigpt/config.py counts them for MFU: attention over the whole s x s square."""
        return sum(model_flops(op) for op in self.forward + self.backward)


# ---------------------------------------------------------------- recording a unit


@dataclass(frozen=True)
class UnitShape:
    """One micro-batch on one tensor-parallel rank."""

    b: int
    s: int
    d: int
    f: int
    heads: int  # query heads on this rank
    kv_heads: int  # key/value heads on this rank (as many as `heads` without grouped-query attention)
    head_dim: int  # each query and key head's width (under MLA with its rotated columns)
    t: int
    rows: int  # b*s: the rows the Linears multiply
    residual_rows: int  # rows of the residual stream: b*s/t under sequence parallelism
    e: int  # bytes of the compute format
    grad: int  # bytes of a weight gradient
    compute: str
    linear: str  # the Linears' GEMM format (fp8 under the fp8 policy)
    fp8: bool
    dropout: bool
    sp: bool
    sharded: bool  # sequence parallelism saves the Linears' input shards (Megatron)
    bias: bool = True  # the Linears have biases (GPT-2) or not (Llama)
    qkv_bias: bool = True  # the qkv projection has a bias (GPTConfig.linear_bias: every Linear's, or Qwen2's alone)
    norm_statistics: int = 2  # fp32 numbers a norm keeps per row: a LayerNorm's mean and 1/std, an RMSNorm's 1/rms
    mlp: str = "gelu"  # GPTConfig.mlp: gelu, relu2 (one kernel each) or swiglu (fc1 holds the gate and up projections)
    rope: bool = False  # rotary positions rotate q and k inside the attention core (no position embedding)
    cp: int = 1  # context parallelism: `s` is this rank's s/cp tokens of a sequence of s x cp
    cp_kind: str = "ring"  # how the keys and values of the other cp ranks arrive (job/exchange/context.py)
    fp8_cache: bool = False  # Implementation.fp8_weight_cache (with fp8 Linears only)
    fp8_fused: bool = False  # Implementation.fp8_fused_casts
    fp8_block: bool = False  # Implementation.fp8_scaling == "block"
    fp8_current: bool = False  # Implementation.fp8_scaling == "current"
    fp8_experts: bool = False  # Implementation.fp8_experts, with fp8 Linears
    fp8_params: bool = False  # Implementation.fp8_param_gather, with fp8 Linears: the weights are kept in fp8
    fp8_recast: bool = False  # Implementation.fp8_recast under current scaling: 16-bit saves, the backward casts again
    wgrad_fusion: bool = False
    expert_load: float = 1.0  # Implementation.expert_load
    expert_streams: int = 0  # Implementation.expert_gemms: 0 one grouped GEMM, else a GEMM per expert on this many
    bias_fusion: str = "none"  # Implementation.bias_fusion
    qk_norm: bool = False  # an RMSNorm over each query and key head inside the core (Qwen3)
    qk_norm_whole: bool = False  # over all of q's or k's heads at once instead (OLMo 2's)
    post_norms: bool = False  # a norm of each branch before its residual add (Gemma's)
    residual_scale: bool = False  # each branch times Granite's residual_multiplier before its residual add
    pre_norms: bool = True  # a norm before each branch (ln1, ln2); none in OLMo 2's block
    ub_chunks: bool = False  # Implementation.ub_chunks, under sequence parallelism only
    userbuffers: Userbuffers | None = None  # Implementation.userbuffers
    eager: bool = False  # Implementation.eager: torchtitan's element-wise code, one kernel per aten op
    attention_kernel: str = "flash-attn-2"  # Implementation.attention_kernel: the fused attention's kernel
    cp_merge: str = "fused"  # Implementation.cp_attention under context parallelism ("fused" without it)
    v_dim: int = 0  # each value head's width (0: head_dim)
    rotary: int = 0  # the columns of each query and key head rotary positions turn (GPTConfig.rotary_dim)
    latent: tuple[int, ...] = ()  # multi-head latent attention's (query latent, key/value latent, rotated key) widths
    window: int = 0  # a sliding window shorter than the whole sequence (GPTConfig.window; 0: none)
    documents: int = 0  # Implementation.document_length: the mean length of the documents a mask keeps apart (0: none)
    sinks: bool = False  # GPT-OSS's attention sinks (GPTConfig.attention_sinks)

    @property
    def sink_columns(self) -> int:
        """The columns q, k, v and the output gain for the sinks: our executor's (minigpt/attention.py, SDPA under
        flash-attn-2's name) SINK_COLUMNS; cuDNN's fused attention takes the sinks as they are (Transformer
        Engine's learnable softmax offset), and so does our context-parallel attention (parallel/context/): none."""
        return SINK_COLUMNS if self.sinks and self.attention_kernel == "flash-attn-2" and self.cp == 1 else 0

    @property
    def value_dim(self) -> int:
        return self.v_dim or self.head_dim

    @property
    def padded_values(self) -> bool:
        """Value heads narrower than query heads, zero-padded to their width for the fused kernel (minigpt/model.py's
        AttentionCore under SDPA, torchtitan's DeepSeek-V3): FlashAttention-2 takes one head width; cuDNN's
        fused attention takes a value width of its own, as Transformer Engine runs MLA ("te" on Hopper)."""
        return self.value_dim < self.head_dim and self.attention_kernel == "flash-attn-2"

    @property
    def out_dim(self) -> int:
        """The width of each head the attention kernel reads v at and writes its output at."""
        return self.head_dim if self.padded_values else self.value_dim

    @property
    def moe(self) -> UnitShape:
        """What a MoE block's MLP runs on: under sequence parallelism this rank's slice of the tokens with its
        Linears whole, no collective around them (parallel/tensor/moe.py), each sequence split over cp x t ranks."""
        if not self.sp:
            return self
        return replace(self, rows=self.residual_rows, cp=self.cp * self.t, sp=False, sharded=False, ub_chunks=False)

    def split(self, gemm: str) -> tuple[int, int]:
        """How a Linear's GEMM (an op name) runs beside its userbuffers collective: (GEMMs it runs as, SMs it leaves to
        the collective); (1, 0) without userbuffers' chunks."""
        if not self.ub_chunks:
            return 1, 0
        config = self.userbuffers or TE_1X
        return config.chunks(gemm, self.t), config.margin(gemm)

    def fp8_bytes(self, elements: int) -> int:
        """Bytes of one fp8 copy of `elements` values with its scales: one byte each, and under block scaling one
        more byte per MX_BLOCK of them."""
        return elements + (elements // MX_BLOCK if self.fp8_block else 0)

    @property
    def swiglu(self) -> bool:
        """The MLP is gated (SwiGLU, or GPT-OSS's clamped one): fc1 holds the gate and up projections."""
        return self.mlp in GATED_MLPS

    @property
    def clamped(self) -> bool:
        """GPT-OSS's clamped SwiGLU: one kernel whose backward reads only its input (minigpt/moe.py's ClampedSwiGLU;
        the stacks' fused kernels keep no more)."""
        return self.mlp == "clamped-swiglu"

    @property
    def fused_norm(self) -> bool:
        """The LayerNorm before an fp8 Linear writes its quantised input itself (Transformer Engine's
        LayerNormLinear): per-tensor delayed scaling the e4m3 row-wise copy, MXFP8 both directions. Under current
        scaling it writes 16 bits and their amax, and a cast follows (simulator/costs/layers/fp8.py)."""
        return self.fp8 and self.fp8_fused and not self.fp8_current

    def normed_bytes(self, elements: int) -> int:
        """Bytes of what a LayerNorm hands the Linear after it, `elements` values: its fp8 copies when it writes them
        (fused_norm), else the compute format."""
        if not self.fused_norm:
            return elements * self.e
        return 2 * self.fp8_bytes(elements) if self.fp8_block else elements

    @property
    def qkv_width(self) -> int:
        """Columns of the fused q, k, v output on this rank: the query heads', then the key and value heads'."""
        return (self.heads + self.kv_heads) * self.head_dim + self.kv_heads * self.value_dim

    @property
    def keys(self) -> int:
        """The keys every query may attend to: the whole sequence (s x cp)."""
        return self.s * self.cp

    @property
    def fc1_width(self) -> int:
        """Columns of fc1's output on this rank: f/t, or 2f/t for SwiGLU (gate and up)."""
        return (2 if self.swiglu else 1) * self.f // self.t


def check_cp_attention(cp: int, attention: str) -> None:
    """Context parallelism needs a fused attention: the ring merges its blocks by their log-sum-exp."""
    if cp > 1 and attention != "flash":
        raise ConfigError(f"--cp {cp} needs --attention flash: the ring merges blocks by their log-sum-exp, which "
                          f"only a fused (flash) attention keeps")


def unit_shape(model: GPTConfig, micro_batch: int, layout: Layout, policy: PrecisionPolicy, impl: Implementation) -> UnitShape:
    """One micro-batch on one rank: under context parallelism the rank's s/cp tokens of each sequence."""
    check_cp_attention(layout.cp, impl.attention)
    if model.window_in_use and impl.attention != "flash":
        raise ConfigError("a sliding window is priced in a fused attention kernel that skips the band's outside "
                          "(--attention flash), not in unfused attention's whole square")
    if model.attention_softcap and impl.attention != "flash":
        raise ConfigError("capped attention scores (Gemma 2's) are priced in a fused kernel that caps them in its "
                          "tiles (FlashAttention-2's softcap: --attention flash), not in unfused attention")
    if impl.document_length and impl.attention != "flash":
        raise ConfigError("a document mask is priced in a fused attention kernel that skips the tiles between "
                          "documents (--attention flash), not in unfused attention's whole square")
    ours_only = [what for what, has in (("a sliding window", model.window_in_use), ("attention sinks",
                                                                                   model.attention_sinks)) if has]
    if ours_only and cp_merge(layout, impl.cp_attention) != "fused":
        raise ConfigError(f"{' and '.join(ours_only)} under --cp {layout.cp}: described with our ring and "
                          f"all-gather only; this stack's context parallelism ({impl.cp_attention}: torch's "
                          f"context_parallel or Transformer Engine's ring) takes none")
    t, s = layout.tp, model.seq_len // layout.cp
    rows = micro_batch * s
    sp = layout.sequence_parallel and t > 1
    return UnitShape(b=micro_batch, s=s, d=model.d_model, f=model.d_ff, heads=model.n_heads // t,
                     kv_heads=model.kv_heads // t, head_dim=model.qk_head_dim, t=t, rows=rows,
                     residual_rows=rows // t if sp else rows, e=FORMAT_BYTES[policy.compute],
                     grad=FORMAT_BYTES[policy.grad], compute=policy.compute,
                     linear="fp8" if policy.fp8_linears else policy.compute, fp8=policy.fp8_linears,
                     dropout=model.dropout > 0, sp=sp, sharded=sp and impl.sp_saved_input == "sharded",
                     bias=model.bias, qkv_bias=model.linear_bias("attn.qkv"),
                     norm_statistics=2 if model.norm == "layernorm" else 1,
                     mlp=model.mlp, rope=model.layer_rotates(0),  # a block kind's (GPTConfig.uniform)
                     cp=layout.cp, cp_kind=layout.cp_kind,
                     fp8_cache=impl.fp8_weight_cache, fp8_fused=impl.fp8_fused_casts,
                     fp8_block=impl.fp8_scaling == "block", fp8_current=impl.fp8_scaling == "current",
                     fp8_experts=policy.fp8_linears and impl.fp8_experts,
                     fp8_params=policy.fp8_linears and impl.fp8_param_gather,
                     fp8_recast=policy.fp8_linears and impl.fp8_recast and impl.fp8_scaling == "current",
                     wgrad_fusion=impl.wgrad_fusion, qk_norm=model.qk_norm, post_norms=model.post_norms,
                     residual_scale=model.residual_multiplier != 1,
                     qk_norm_whole=model.qk_norm_whole, pre_norms=model.pre_norms,
                     expert_load=impl.expert_load, expert_streams=EXPERT_STREAMS[impl.expert_gemms],
                     bias_fusion=impl.bias_fusion,
                     ub_chunks=sp and impl.ub_chunks,
                     userbuffers=impl.userbuffers, eager=impl.eager, attention_kernel=impl.attention_kernel,
                     cp_merge=cp_merge(layout, impl.cp_attention), v_dim=model.v_head_dim,
                     rotary=model.rotary_dim, window=model.window_in_use, sinks=model.attention_sinks,
                     documents=impl.document_length,
                     latent=(model.q_lora_rank, model.kv_lora_rank, model.rope_head_dim) if model.is_mla else ())


def cp_merge(layout: Layout, cp_attention: str) -> str:
    """How the attention's steps are merged on this layout: Implementation.cp_attention under context parallelism,
    "fused" without it, and for Transformer Engine's "te" outside its ring (its all-gather class was not read)."""
    if layout.cp == 1 or (cp_attention == "te" and layout.cp_kind != "ring"):
        return "fused"
    return cp_attention
