"""How a stack computes a block (`Implementation`): the attention kernel, what is recomputed, what sequence
parallelism saves, how fp8 Linears and weight gradients run, the optimizer's kernels, a mixture of experts' routing
and dispatcher. Torch-free. Every default is our executor's; simulator/engine/overlap.py's presets set the others,
simulator/costs/ops.py and layers/fp8.py price each choice (simulator/costs/op_types.py re-exports these names)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from minigpt.config import check_attention, check_recompute
from minigpt.errors import ConfigError, check_choice
from job.muon import OPTIMIZERS
from precision.policy import FORMAT_BYTES
from simulator.costs.userbuffers import Userbuffers

SP_SAVED_INPUTS = ("gathered", "sharded")
FP8_SCALINGS = ("tensor", "current", "block")
FP8_RECIPES = {"delayed": "tensor", "current": "current", "mxfp8": "block"}  # --fp8-recipe: Implementation.fp8_scaling
FP8_AMAX_GROUPS = ("none", "tp_cp", "data")  # over whom delayed scaling's amaxes are all-reduced (Implementation)
DISPATCHERS = ("alltoall", "deepep")  # how a MoE's rows travel between the expert group's ranks (Implementation)
# which fused attention kernel runs "flash" (Implementation): "te" is Transformer Engine's own choice, cuDNN's where the
# GPU's preset carries its table (the Hopper presets), FlashAttention-2 elsewhere (attention_rates.kernel_table)
ATTENTION_KERNELS = ("flash-attn-2", "cudnn", "te")
ZERO3_COPIES = ("staging", "fsdp2", "none")  # the compute-stream copies around ZeRO-3's collectives (Implementation)
LOSSES = ("ours", "torch", "fused")  # the cross-entropy's code (Implementation.loss)
CP_ATTENTIONS = ("fused", "torch", "te")  # how context parallelism's steps are merged (Implementation.cp_attention)
# how a mixture of experts' local experts run their GEMMs (Implementation.expert_gemms): as one grouped kernel, or a
# cuBLAS GEMM per expert on Transformer Engine's 4 compute streams (transformer_engine/common/util/multi_stream.cpp:
# num_compute_streams = 4; multi_stream_cublas_gemm launches GEMM i on stream i % 4)
EXPERT_STREAMS = {"grouped": 0, "te-streams": 4}
BIAS_FUSIONS = ("none", "megatron", "te")  # which bias adds run inside other kernels (Implementation.bias_fusion)
# Megatron-core's recompute_modules the simulator describes (simulator/costs/recorder.py's MODULES)
RECOMPUTE_MODULES = ("layernorm", "moe_act", "mla_up_proj", "core_attn")
DDP_BUCKETS = ("ddp", "megatron")  # how the data-parallel gradients are cut into reductions (Implementation.ddp_buckets)
MEGATRON_BUCKET_FLOOR, MEGATRON_BUCKET_PER_RANK = 40_000_000, 1_000_000  # parameters: Megatron-core's rule


@dataclass(frozen=True)
class Implementation:
    """How the block is computed: attention kernel, what is recomputed, what sequence parallelism saves, and how
    fp8 Linears and weight gradients run (simulator/costs/ops.py explains each; every default is our executor's).

    fp8_experts       a mixture of experts' routed experts run their grouped GEMMs in fp8 as well (Transformer
                      Engine's GroupedLinear, Megatron-core's TEGroupedMLP); False: 16-bit, as minigpt/moe.py runs them.
    fp8_weight_cache  the fp8 copies of the weights are cast once per step and kept across micro-batches
                      (Transformer Engine's is_first_microbatch, which Megatron-core passes); False: cast in
                      every micro-batch's forward and saved by it for its backward (precision/fp8.py).
    fp8_fused_casts   Transformer Engine's kernels: amax inside the cast, cast + transpose in one pass, the
                      LayerNorm writing the e4m3 input of the Linear after it (LayerNormLinear); False: our
                      executor's torch ops (precision/fp8.py's Fp8Meta.quantize, through an fp32 copy).
    fp8_scaling       "tensor" (per-tensor delayed scaling, an amax history), "current" (per-tensor current
                      scaling: each tensor's own amax, taken before its cast; needs fused casts) or "block" (MXFP8:
                      one scale per 32 elements, both directions quantised from the 16-bit tensor; needs fused casts).
    fp8_amax_group    over whom per-tensor delayed scaling all-reduces (max) the amaxes of a model chunk's fp8
                      Linears, once when its forward leaves the fp8 region and once at the end of its backward
                      (Transformer Engine's fp8_autocast): "none" (each rank keeps its own: our executor), "tp_cp"
                      (the stage's tp x cp ranks: Megatron-core 0.8, --tp-only-amax-red), "data" (tp x cp x dp:
                      Megatron-core's default; simulator/engine/costs.py prices it, docs/efficiency.md).
    fp8_recast        the fp8 Linears save their 16-bit input and the backward casts input and weight again
                      (torchao's Float8Linear, with its per-tensor current scaling); False: the e4m3 copies are saved.
    fp8_param_gather  the fp8 Linears' weights are kept in fp8 and all-gathered in fp8 by ZeRO (Megatron-core's
                      --fp8-param-gather, NeMo's fp8_params, torchtitan's enable_fsdp_float8_all_gather): one byte a
                      weight in memory and in the gathers; with fp8_weight_cache the step's cast becomes a transpose.
    wgrad_fusion      the weight-gradient GEMM accumulates into the fp32 main gradient itself (Megatron-core's
                      gradient_accumulation_fusion): no separate accumulation kernel.
    fused_optimizer   AdamW as one fused kernel (apex's FusedAdam, torch's AdamW(fused=True)); False: our executor's
                      MasterAdamW, a pass over memory per element-wise op (simulator/engine/costs.py's optimizer_bytes).
    ub_chunks         under sequence parallelism, the Linears whose collective Transformer Engine's userbuffers
                      overlap run as GEMMs on chunks of the rows, one after another (simulator/costs/ops.py,
                      "userbuffers' chunks"); False: one GEMM each (our executor).
    expert_load       a mixture of experts' routing imbalance: the busiest expert's routed rows over the mean (1.0:
                      balanced), applied to the busiest rank of the expert group (simulator/costs/layers/moe.py's
                      received_rows: its experts' rows; simulator/engine/experts.py: its all-to-alls).
    document_length   the mean length, in tokens, of the documents a document mask keeps each token's attention within
                      (Llama 3's; `minigpt train --document-mask`): the kernel skips the tiles between documents, as
                      FlashAttention-2's variable-length kernels (Transformer Engine's THD format) and FlexAttention's
                      block masks do (simulator/costs/layers/attention.py's document_share); 0: none, the causal mask.
    optimizer         adamw, or muon (`minigpt train --optimizer muon`, precision/muon.py): the hidden matrices'
                      updates orthogonalised by Newton-Schulz on the rank of the pipeline stage each is dealt to, the
                      pieces sent there and back by all-to-alls; no second moment for them (simulator/engine/muon.py).
    grad_reduce_fp32  gradients travel between data-parallel ranks in fp32 (FSDP2's MixedPrecisionPolicy with
                      reduce_dtype float32: torchtitan's only choice, training.mixed_precision_reduce, and NeMo
                      Automodel's); False: in the precision policy's reduce format (bf16 training: bf16, as our
                      executor, Megatron-core's default and NeMo's grad_sync_dtype bf16 reduce).
    eager             the element-wise code runs as torchtitan's model writes it in eager PyTorch (torch.compile off):
                      one kernel per aten op, RMSNorm through an fp32 copy, RoPE as complex multiplies, grouped-query
                      keys and values copied to every head (simulator/costs/torchtitan/eager.py); False: one fused
                      kernel each.
    expert_gemms      how a MoE's local experts run each Linear (EXPERT_STREAMS): "grouped", one kernel whose tiles
                      cover every expert (our executor's batched matmul, torch's grouped_mm) or "te-streams"
                      (Transformer Engine's GroupedLinear, Megatron-core's TEGroupedMLP: one cuBLAS GEMM per
                      expert, round robin on 4 streams, so at most 4 experts' tiles share the SMs at once:
                      multi_stream_cublas_gemm in transformer_engine/common/gemm/cublaslt_gemm.cu).
    bias_fusion       where the Linears' biases and the residual branches' dropout run (BIAS_FUSIONS): "none" (each
                      a kernel of its own: our executor's description), "megatron" (Megatron-LM's defaults,
                      --bias-gelu-fusion and --bias-dropout-fusion: fc1's bias inside the activation's kernel,
                      proj's and fc2's bias, the dropout and the residual add one kernel, bias_dropout_add_fused_train;
                      qkv's bias a kernel of its own) or "te" (Megatron-core on Transformer Engine: the same, and
                      qkv's bias added and reduced by its GEMMs' cuBLASLt epilogues).
    dispatcher        how a MoE's rows travel between the expert group's ranks (DISPATCHERS): "alltoall", a copy
                      of every routed row to its expert's rank (our executor's, Megatron-core's alltoall dispatcher); "deepep", each token once per destination rank and server,
                      forwarded over NVLink inside the server (DeepEP's normal kernels; Megatron-core's flex
                      dispatcher, its hybridep: simulator/engine/experts.py).
    attention_kernel  which fused kernel runs the "flash" attention (ATTENTION_KERNELS), priced by its published table
                      (simulator/costs/rates/attention_rates.py): "flash-attn-2" (Dao's FlashAttention-2: our
                      executor's torch SDPA, torchtitan's, NVTE_FUSED_ATTN=0 under Transformer Engine) or "cudnn"
                      (cuDNN's fused attention: Transformer Engine's FusedAttention, which it prefers on Hopper)
                      or "te" (as Transformer Engine picks: cudnn on a GPU whose preset has cuDNN's table, the
                      Hopper presets, else flash-attn-2; the megatron-core stack's); the same ops and saved tensors
                      either way.
    zero3_copies      the copies ZeRO-3 makes on the compute stream around its collectives (ZERO3_COPIES):
                      "staging" (our parallel/data/zero3.py: gathers into the parameters' own storage; each unit's
                      gradients copied into a zero-filled staging buffer, divided there, and the reduced piece added
                      to the rank's shard), "fsdp2" (torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py: each
                      gathered unit copied out of the all-gather buffer into its parameters, split_with_sizes_copy
                      after the compute stream waits for the gather; each unit's gradients copied into the
                      reduce-scatter's buffer in the reduction's format, chunk_cat, before the reduce-scatter stream
                      waits for it: the torchtitan-fsdp2 stack's) or "none" (buffers the collectives run on in place:
                      the megatron-core stack's)
    loss              the cross-entropy's code, which decides what its backward holds beside the saved fp32
                      log-probabilities (LOSSES; simulator/memory.py's loss_gradient_bytes): "ours" (minigpt/model.py's
                      F.cross_entropy on fp32 logits; under tp, parallel/tensor/layers.py's VocabParallelCrossEntropy),
                      "torch" (torch's F.cross_entropy on fp32 logits: torchtitan's) or "fused" (Megatron's
                      vocab-parallel cross entropy, which makes the gradient in place of its saved softmax)
    cp_attention      how the attention's blocks under context parallelism are merged (CP_ATTENTIONS): "fused"
                      (the kernel's own online softmax, nothing more priced: our executor's description), "torch"
                      (torch's context_parallel as torchtitan runs it: one SDPA call a step, its output merged in
                      fp32 by eager kernels, k and v copied, the gradients accumulated in fp32:
                      simulator/costs/torchtitan/context.py) or "te" (Transformer Engine's ring, Megatron-core's:
                      one fused attention call a step, the outputs merged in bf16 by compiled kernels, dq and the
                      travelling dk, dv added in bf16: simulator/costs/te_context.py; under --cp-kind allgather,
                      whose TE class was not read, as "fused")
    ddp_buckets       how the data-parallel gradients are cut into buckets, each one reduction (DDP_BUCKETS): "ddp"
                      (torch DDP's and our executor's bucket_cap_mb, 25 MiB, TrainConfig.bucket_mb) or "megatron"
                      (Megatron-core's DistributedDataParallel when ddp_bucket_size is unset: max(40,000,000,
                      1,000,000 x the data-parallel size with context parallelism) parameters a bucket, "so that
                      chunks used in NCCL ring-reduce implementations ... remain bandwidth-bound rather than
                      latency-bound")"""

    attention: str = "flash"
    recompute: str = "none"
    sp_saved_input: str = "gathered"
    fp8_weight_cache: bool = False
    fp8_fused_casts: bool = False
    fp8_scaling: str = "tensor"
    wgrad_fusion: bool = False
    expert_load: float = 1.0
    document_length: int = 0
    ub_chunks: bool = False
    dispatcher: str = "alltoall"
    fused_optimizer: bool = False
    userbuffers: Userbuffers | None = None
    fp8_amax_group: str = "none"
    fp8_experts: bool = False
    fp8_param_gather: bool = False
    fp8_recast: bool = False
    eager: bool = False
    grad_reduce_fp32: bool = False
    attention_kernel: str = "flash-attn-2"
    zero3_copies: str = "staging"
    loss: str = "ours"
    cp_attention: str = "fused"
    expert_gemms: str = "grouped"
    bias_fusion: str = "none"
    ddp_buckets: str = "ddp"
    recompute_modules: tuple[str, ...] = ()  # Megatron-core's --recompute-modules beside recompute (none, selective)
    optimizer: str = "adamw"

    def __post_init__(self) -> None:
        check_attention(self.attention)
        check_recompute(self.recompute)
        if self.sp_saved_input not in SP_SAVED_INPUTS:
            raise ConfigError(f"sp_saved_input must be one of {', '.join(SP_SAVED_INPUTS)}, got {self.sp_saved_input!r}")
        for name in ("fp8_weight_cache", "fp8_fused_casts", "wgrad_fusion", "ub_chunks", "fused_optimizer", "fp8_experts",
                     "fp8_param_gather", "fp8_recast", "eager", "grad_reduce_fp32"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be true or false, got {getattr(self, name)!r}")
        check_choice("--ep-dispatcher", self.dispatcher, DISPATCHERS)
        check_choice("fp8_scaling", self.fp8_scaling, FP8_SCALINGS)
        check_choice("fp8_amax_group", self.fp8_amax_group, FP8_AMAX_GROUPS)
        check_choice("--attention-kernel", self.attention_kernel, ATTENTION_KERNELS)
        check_choice("zero3_copies", self.zero3_copies, ZERO3_COPIES)
        check_choice("loss", self.loss, LOSSES)
        check_choice("cp_attention", self.cp_attention, CP_ATTENTIONS)
        check_choice("expert_gemms", self.expert_gemms, tuple(EXPERT_STREAMS))
        check_choice("bias_fusion", self.bias_fusion, BIAS_FUSIONS)
        check_choice("ddp_buckets", self.ddp_buckets, DDP_BUCKETS)
        check_choice("--optimizer", self.optimizer, OPTIMIZERS)
        for module in self.recompute_modules:
            check_choice("--recompute-modules", module, RECOMPUTE_MODULES)
        if self.recompute_modules and self.recompute not in ("none", "selective"):
            raise ConfigError(f"--recompute-modules with --recompute {self.recompute}: that recomputation already "
                              f"decides what each block keeps (use it with none or selective)")
        if self.attention_kernel == "cudnn" and self.attention != "flash":
            raise ConfigError(f"--attention-kernel {self.attention_kernel} is a fused attention kernel: it needs "
                              f"--attention flash")
        if self.fp8_scaling != "tensor" and not self.fp8_fused_casts:
            raise ConfigError(f"fp8_scaling {self.fp8_scaling!r} needs fp8_fused_casts: only fused quantisers "
                              "(Transformer Engine's, --overlap megatron-core) scale per block or from the tensor's "
                              "own amax; our executor scales per tensor from an amax history")
        if self.eager and self.attention != "flash":
            raise ConfigError("--elementwise eager describes torchtitan's code, which runs scaled_dot_product_attention's "
                              "flash kernel: use --attention flash (or --elementwise fused)")
        if self.fp8_param_gather and (self.fp8_scaling == "block" or not self.fp8_fused_casts):
            raise ConfigError("fp8_param_gather keeps the weights in per-tensor fp8, which needs fused casts "
                              "(--overlap megatron-core or torchtitan-fsdp2) and per-tensor scaling (not mxfp8)")
        load = self.expert_load
        if isinstance(load, bool) or not isinstance(load, (int, float)) or not 1 <= load < math.inf:
            raise ConfigError(f"the expert load (the busiest expert's routed rows over the mean) must be a finite "
                              f"number >= 1 (1: balanced), got {load!r}")
        if isinstance(self.document_length, bool) or not isinstance(self.document_length, int) \
                or self.document_length < 0:
            raise ConfigError(f"--document-length must be a whole number of tokens >= 0 (0: no document mask), got "
                              f"{self.document_length!r}")

    def bucket_params(self, data_ranks: int) -> int | None:
        """Parameters a data-parallel reduction takes at once over `data_ranks` (dp x cp) under Megatron-core's rule
        (ddp_buckets "megatron"); None: DDP's bucket_cap_mb."""
        if self.ddp_buckets != "megatron":
            return None
        return max(MEGATRON_BUCKET_FLOOR, MEGATRON_BUCKET_PER_RANK * data_ranks)

    @property
    def reduce_bytes(self) -> int | None:
        """A gradient element's bytes in the data-parallel reductions: 4 under grad_reduce_fp32, else None (the
        precision policy's reduce format)."""
        return FORMAT_BYTES["fp32"] if self.grad_reduce_fp32 else None

    def as_dict(self) -> dict:
        return {"attention": self.attention, "recompute": self.recompute, "sp_saved_input": self.sp_saved_input,
                "fp8_weight_cache": self.fp8_weight_cache, "fp8_fused_casts": self.fp8_fused_casts,
                "fp8_scaling": self.fp8_scaling, "wgrad_fusion": self.wgrad_fusion, "ub_chunks": self.ub_chunks,
                "fused_optimizer": self.fused_optimizer, "fp8_amax_group": self.fp8_amax_group,
                "fp8_experts": self.fp8_experts, "fp8_param_gather": self.fp8_param_gather, "fp8_recast": self.fp8_recast,
                "eager": self.eager, "grad_reduce_fp32": self.grad_reduce_fp32, "attention_kernel": self.attention_kernel,
                "zero3_copies": self.zero3_copies, "loss": self.loss, "cp_attention": self.cp_attention,
                "expert_gemms": self.expert_gemms, "bias_fusion": self.bias_fusion, "ddp_buckets": self.ddp_buckets,
                **({"recompute_modules": list(self.recompute_modules)} if self.recompute_modules else {}),
                **({"document_length": self.document_length} if self.document_length else {}),
                **({"optimizer": self.optimizer} if self.optimizer != "adamw" else {}),
                **({"userbuffers": self.userbuffers.describe()} if self.userbuffers is not None else {})}
