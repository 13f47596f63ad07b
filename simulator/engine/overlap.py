"""What hides what in a simulated step, and what hiding costs: explicit overlap settings, with named presets. Torch-free.

`Overlap` holds every choice the engine makes about overlapping communication with compute
(simulator/engine/costs.py applies tp, simulator/engine/dp_overlap.py and data_parallel.py dp,
simulator/engine/replay.py p2p and the parameter gathers):

  tp              False: the tensor-parallel collectives sit between the layer's matmuls and
                  are exposed (our executor; Megatron 2021). True: each pass hides its
                  collectives behind the Linears' GEMMs of the same pass as far as their time
                  allows (Megatron-core / Transformer Engine pipelining the all-gather and
                  reduce-scatter with the GEMMs next to them), the GEMMs slowed by tp_slowdown
                  while a collective runs (below). The attention core and the element-wise
                  kernels hide nothing.
  dp              "executor": our ZeRO code (parallel/data/zero.py, zero3.py), as the schedule lists
                  it: ZeRO 0/1 reduce each bucket as soon as its gradients are ready, in each
                  chunk's last backward, except
                  the bucket of a tied embedding split over stages, reduced after the two
                  copies are summed at the end; ZeRO 2/3 reduce in every backward and wait at
                  its end.
                  "backward": the same, and the tied matrix's bucket too is reduced during the
                  backward (its gradient synced apart, as Megatron does).
                  "after": nothing overlapped: ZeRO 0/1 reduce every bucket after the last
                  backward, before the optimizer; ZeRO 2/3 start each backward's reductions when
                  its compute ends.
  zero3_prefetch  ZeRO-3 units all-gathered ahead of the one computing (our code: 1; 0: a unit's
                  gather is issued only when the unit before it is done).
  p2p             False: a pipeline send and its receive meet and both ranks wait for the
                  transfer (our executor's batched isend/irecv and wait; Megatron 2021). True:
                  sends are asynchronous and receives posted early: the sender goes on at once,
                  the receiver waits only for data that has not arrived yet.
  param_gather    "step": ZeRO 1/2's all-gathers of the updated weights end the step (our code:
                  the step waits for them). "forward": they run on into the next step and each is
                  waited for only by the forward that uses its weights (Megatron-core's
                  overlap_param_gather): exposed only beyond the rank's first forward of the step
                  (and the wait before it), priced once per step as the steady state repeats.
  ep              False: expert parallelism's all-to-alls are each waited for before the computation
                  that needs them (our executor; Megatron-core's default, moe_shared_expert_overlap
                  False: "without this, the shared experts execute after the routed experts"). True:
                  Megatron-core's moe_shared_expert_overlap: a MoE's shared experts run on a stream of
                  their own beside the token dispatcher, fc1 and its activation during the dispatch's
                  all-to-all, fc2 during the combine's, and in the backward (autograd's order arranged
                  to match) fc2's input gradient during the combine's gradient, fc1's during the
                  dispatch's; each all-to-all hides behind its half as far as it lasts (weight
                  gradients left out: zero-bubble schedules move them), the counts' all-to-all before
                  them exposed. A model without shared experts hides nothing (Mixtral, Qwen3-MoE).
                  Priced by simulator/engine/experts.py with dp_slowdown: an NCCL all-to-all is a send
                  and a receive per peer on NCCL's channels, the SMs the data-parallel collectives hold.

The cost of hiding (`tp_slowdown`, `dp_slowdown`, `p2p_slowdown`): a collective runs on the same
GPU as the compute it hides behind. NCCL runs one CTA per channel and a CTA holds its SM
exclusively (NCCL maintainers, NVIDIA/nccl #689), Transformer Engine's userbuffers kernels take
`num_sm` SMs (their GEMMs launched on the rest with set_sm_margin); so while a collective runs the
compute it overlaps runs at (1 - f) of its rate, f = the SMs the communication holds / the GPU's
SMs. A collective of c seconds overlapping compute of g seconds (at full rate) then ends the pair
at max(c, g + f x o), o = min(c, g / (1 - f)) the time they overlap: exposed = max(c - g, f x o).
With f = 0 this is today's max(0, c - g). The values are fractions of an H100 SXM's 132 SMs
(NVIDIA H100 datasheet / Hopper architecture whitepaper), the GPU the stacks below were tuned on;
their derivation and sources are in docs/efficiency.md ("Overlap costs"):

  TP_SLOWDOWN   0.033  Transformer Engine userbuffers, NeMo's GPT-3 175B H100 tp4 config (NVIDIA/NeMo
                       nemo/collections/llm/recipes/tp_overlap_configs/userbuffers.py, the same as
                       NVIDIA's MLPerf v4.0 GPT-3 conf/tp_overlap/h100tp4mbs2.yaml): the ten overlapped
                       GEMMs' num_sm (forward 1, 24, 1, 1; backward 4, 4, 2, 4, 1, 1: 4.3 SMs on
                       average, their collectives moving equal bytes) / 132.
  DP_SLOWDOWN   0.121  NCCL on a DGX with 8 NICs uses 16 SMs (NCCL maintainer, NVIDIA/nccl #689) / 132.
  P2P_SLOWDOWN  0.015  NCCL send/recv: 2 channels per network peer (NCCL_NCHANNELS_PER_NET_PEER,
                       NVIDIA/nccl #1424) / 132.

The memory bandwidth a collective takes (2-3x its link rate through HBM: NVIDIA/nccl #1428) is not
charged separately: the GEMMs that hide collectives are compute-bound. A published measurement of
the whole effect (Lee et al. 2025, arXiv 2507.03114: compute overlapped with collectives slowed by
18.9% on average, 40% at most, on A100, H100, MI250, MI210) is above these SM shares: treat the
values as the lower end.

Presets (`overlap_preset`; each also names the stack's implementation choices, `stack_implementation`):
  "executor"          the default: what parallel/ does (`minigpt compare` measures it): tp exposed,
                      dp "executor", ZeRO-3 prefetch 1, p2p exposed, param_gather "step", ep exposed.
  "megatron-2021"     Narayanan et al. 2021 (Megatron-LM on Selene): tp exposed, the data-parallel
                      reduction after the last backward (not overlapped), p2p exposed, "step".
  "overlapped"        a modern stack, generic: tp hidden behind the Linears, dp reduced during the
                      backward, ZeRO-3 prefetch 1, p2p overlapped, "step", the all-to-alls behind
                      the shared experts (ep True).
  "megatron-core"     Megatron-core / NeMo 2024 (the DGX-Cloud benchmarks' stack): tp comm overlap
                      through TE userbuffers (tp True), the distributed optimizer's gradient
                      reduce-scatter overlapped with the backward (dp "backward") and its parameter
                      all-gather with the next forward (param_gather "forward"), p2p overlapped;
                      gradient-accumulation fusion, fp8 weights cast once per step and the overlapped
                      Linears' GEMMs in userbuffers' chunks (implementation);
                      ep False, Megatron-core's default (--ep-overlap turns it on).
  "torchtitan-fsdp2"  torchtitan with FSDP2 (Liang et al. 2024, arXiv 2410.06511): each unit's
                      all-gather prefetched one unit ahead (zero3_prefetch 1), reduce-scatters
                      overlapped with the backward (dp "backward"), no tp overlap (tp False; async TP
                      is --tp-overlap), torch.distributed.pipelining's asynchronous sends (p2p True),
                      "step"; under pipelining ZeRO-3 does not reshard after the forward unless told to
                      (stack_reshards: torchtitan's default policy).
All presets share the three slowdowns above (they matter only where something overlaps).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from minigpt.errors import ConfigError, check_choice
from simulator.costs.implementation import Implementation
from simulator.costs.userbuffers import Userbuffers

DP_MODES = ("executor", "backward", "after")
PARAM_GATHER_MODES = ("step", "forward")
TP_SLOWDOWN = 0.033  # 4.3 of 132 SMs: TE userbuffers' num_sm (module docstring)
DP_SLOWDOWN = 0.121  # 16 of 132 SMs: NCCL on an 8-NIC DGX
P2P_SLOWDOWN = 0.015  # 2 of 132 SMs: NCCL's channels per network peer
SLOWDOWNS = ("tp_slowdown", "dp_slowdown", "p2p_slowdown")
SETTINGS = ("tp", "dp", "zero3_prefetch", "p2p", "param_gather", "ep", *SLOWDOWNS)


@dataclass(frozen=True)
class Overlap:
    name: str = "executor"
    tp: bool = False
    dp: str = "executor"
    zero3_prefetch: int = 1
    p2p: bool = False
    param_gather: str = "step"
    ep: bool = False  # a MoE's all-to-alls behind its shared experts (Megatron-core's moe_shared_expert_overlap)
    tp_slowdown: float = TP_SLOWDOWN  # fraction of the compute rate lost while a collective overlaps it
    dp_slowdown: float = DP_SLOWDOWN
    p2p_slowdown: float = P2P_SLOWDOWN

    def __post_init__(self) -> None:
        for flag in ("tp", "p2p", "ep"):
            if not isinstance(getattr(self, flag), bool):
                raise ConfigError(f"overlap {flag} must be true or false, got {getattr(self, flag)!r}")
        check_choice("overlap dp", self.dp, DP_MODES)
        check_choice("overlap param_gather", self.param_gather, PARAM_GATHER_MODES)
        prefetch = self.zero3_prefetch
        if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0:
            raise ConfigError(f"the ZeRO-3 prefetch depth must be a whole number of units >= 0, got {prefetch!r}")
        for key in SLOWDOWNS:
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:
                raise ConfigError(f"overlap {key} must be a fraction in [0, 1), got {value!r}")

    @property
    def preset(self) -> str:
        """The preset this overlap comes from ("<preset>+custom" when a setting was changed: that preset)."""
        return self.name.split("+", 1)[0]

    def as_dict(self) -> dict:
        return asdict(self)


def overlapped(comm: float, compute: float, slowdown: float) -> float:
    """Seconds a collective of `comm` s runs beside the `compute` s (at full rate) it overlaps, the compute
    running `slowdown` slower meanwhile: min(comm, compute / (1 - slowdown))."""
    if comm <= 0 or compute <= 0:
        return 0.0
    return min(comm, compute / (1 - slowdown))


def exposed(comm: float, compute: float, slowdown: float) -> float:
    """Seconds a collective of `comm` s adds to the `compute` s (at full rate) it overlaps, the compute
    running `slowdown` slower while both run: max(comm - compute, slowdown x overlapped time)."""
    if comm <= 0:
        return 0.0
    if slowdown <= 0 or compute <= 0:
        return max(0.0, comm - compute)
    return max(comm - compute, slowdown * overlapped(comm, compute, slowdown))


def slowed(start: float, work: float, busy_until: float, slowdown: float) -> float:
    """When `work` s of compute (at full rate) starting at `start` ends, a collective running until
    `busy_until` slowing it by `slowdown` meanwhile."""
    busy = busy_until - start
    if slowdown <= 0 or busy <= 0 or work <= 0:
        return start + work
    return start + work + slowdown * min(busy, work / (1 - slowdown))


PRESETS = {
    "executor": Overlap(),
    "megatron-2021": Overlap("megatron-2021", tp=False, dp="after", zero3_prefetch=1, p2p=False),
    "overlapped": Overlap("overlapped", tp=True, dp="backward", zero3_prefetch=1, p2p=True, ep=True),
    "megatron-core": Overlap("megatron-core", tp=True, dp="backward", zero3_prefetch=1, p2p=True,
                             param_gather="forward"),
    "torchtitan-fsdp2": Overlap("torchtitan-fsdp2", tp=False, dp="backward", zero3_prefetch=1, p2p=True),
}

# How each stack computes, beyond what overlaps: the fields of simulator/costs/implementation.py's Implementation that a
# preset sets (the attention kernel, recomputation and what sequence parallelism saves stay the user's flags).
# wgrad_fusion: the weight gradient accumulated in fp32 inside its GEMM (Megatron's gradient_accumulation_fusion);
# fp8_weight_cache: fp8 weights cast once per step and reused by every micro-batch (Transformer Engine's
# is_first_microbatch, which Megatron-core passes); fp8_fused_casts: amax, cast and transpose in fused kernels
# (Transformer Engine's; torchao's float8 under torch.compile) rather than our executor's torch ops. fp8_scaling: per
# tensor from an amax history (TE's DelayedScaling, Megatron-LM's --fp8-recipe default "delayed", and precision/fp8.py)
# or from the tensor's own amax (torchao's tensorwise recipe, which torchtitan's float8 converter uses: "current");
# --fp8-recipe changes it. ub_chunks: the
# Linears whose collective TE's userbuffers overlap run their GEMMs in chunks of the rows (simulator/costs/ops.py),
# only while the preset overlaps tp (stack_implementation). fused_optimizer: AdamW in one kernel (Megatron-LM has
# used apex's FusedAdam as its Adam (megatron/optimizer/__init__.py); torchtitan's optimizer.implementation defaults to
# "fused", torch's AdamW(fused=True)) rather than our executor's element-wise passes (precision/optimizer.py).
# fp8_amax_group (delayed scaling's): Megatron-core hands Transformer Engine's fp8_autocast its amax reduction group,
# the stage's tp x cp x dp ranks (parallel_state.get_amax_reduction_group: core_v0.6.0, core_v0.7.0, core_v0.9.0 on:
# "data"); our executor keeps each rank's amaxes (precision/fp8.py); torchtitan scales from each tensor's own amax.
# fp8_experts: Megatron-core's TEGroupedMLP runs the routed experts through Transformer Engine's GroupedLinear, in fp8
# under fp8; minigpt/moe.py keeps them 16-bit, and torchtitan's float8 converter leaves MoE experts out by default.
# fp8_recast: torchao's Float8Linear saves the 16-bit input and weight (matmul_with_hp_or_float8_args.forward's
# save_for_backward(input_hp, weight_hp_t)) and casts them again in the backward; Transformer Engine and our executor
# save the e4m3 copies. eager: torchtitan's training.compile defaults to false (train_configs/llama3_8b.toml at
# 9dec370), so its model's element-wise code runs in eager PyTorch (simulator/costs/torchtitan/eager.py);
# --elementwise fused states a compiled run (one fused kernel an op, as every other stack here). grad_reduce_fp32:
# torchtitan's FSDP2 reduces gradients in fp32 (training.mixed_precision_reduce, whose only choice is "float32").
# sp_saved_input: Megatron's column-parallel Linears under sequence parallelism save their input's shard and all-gather
# it again in the backward (Megatron-LM's LinearWithGradAccumulationAndAsyncCommunication, Transformer Engine's
# LayerNormLinear and Linear; under userbuffers the bulk qkv_dgrad / fc1_dgrad overlaps); our executor and torchtitan's
# DTensor Linears keep the gathered input autograd saved. attention_kernel "te": Transformer Engine's DotProductAttention
# picks its backend (simulator/costs/rates/attention_rates.py's te_kernel); torch's SDPA runs FlashAttention-2.
# cp_attention "torch": torchtitan's context parallelism is torch's context_parallel, which merges its per-step SDPA
# calls in eager fp32 kernels (simulator/costs/torchtitan/context.py); "te": Megatron-core's is Transformer Engine's
# DotProductAttention with cp_comm_type "p2p", its steps merged in bf16 (simulator/costs/te_context.py).
# bias_fusion: Megatron-LM fuses fc1's bias into its activation (--bias-gelu-fusion, fused_bias_gelu.py) and proj's and
# fc2's bias, dropout and residual add into one kernel (--bias-dropout-fusion, bias_dropout_add_fused_train), both on by
# default since 2020 (their flags are --no-...); Megatron-core keeps both (bias_activation_fusion, bias_dropout_fusion)
# and Transformer Engine's Linears add qkv's bias in the GEMM's epilogue ("te").
# expert_gemms "te-streams": Megatron-core's TEGroupedMLP (the --moe-grouped-gemm default since core 0.11) runs each
# Linear through Transformer Engine's GroupedLinear, a cuBLAS GEMM per local expert on 4 streams (nvte_multi_tensor_gemm
# falls back to them unless NVTE_USE_CUTLASS_GROUPED_GEMM is set on Hopper); torchtitan's torch._grouped_mm and our
# executor's batched matmul are one kernel each. ddp_buckets "megatron": Megatron-core's DistributedDataParallel sizes its
# buckets by the data-parallel group (max(40M, 1M x dp) parameters when ddp_bucket_size is unset; NeMo leaves it unset).
STACK_FIELDS = ("wgrad_fusion", "fp8_weight_cache", "fp8_fused_casts", "fp8_scaling", "ub_chunks", "fused_optimizer",
                "fp8_amax_group", "fp8_experts", "fp8_recast", "eager", "grad_reduce_fp32", "sp_saved_input",
                "attention_kernel", "zero3_copies", "loss", "cp_attention", "expert_gemms",
                "bias_fusion", "ddp_buckets")  # the Implementation fields a preset sets
_OURS = {name: getattr(Implementation(), name) for name in STACK_FIELDS}  # Implementation's defaults: our executor's
STACK_IMPLEMENTATION = {
    "executor": _OURS,
    # no fp8 in 2021; Megatron-LM's gradient accumulation fusion came later
    "megatron-2021": {**_OURS, "fused_optimizer": True, "loss": "fused", "bias_fusion": "megatron"},
    "overlapped": _OURS,
    "megatron-core": {**_OURS, "wgrad_fusion": True, "fp8_weight_cache": True, "fp8_fused_casts": True,
                      "ub_chunks": True, "fused_optimizer": True, "fp8_amax_group": "data", "fp8_experts": True,
                      "sp_saved_input": "sharded", "attention_kernel": "te", "zero3_copies": "none", "loss": "fused",
                      "cp_attention": "te", "expert_gemms": "te-streams", "bias_fusion": "te", "ddp_buckets": "megatron"},
    "torchtitan-fsdp2": {**_OURS, "fp8_fused_casts": True, "fp8_scaling": "current", "fused_optimizer": True,
                         "fp8_recast": True, "eager": True, "grad_reduce_fp32": True, "zero3_copies": "fsdp2",
                         "loss": "torch", "cp_attention": "torch"},
}


def overlap_preset(name: str) -> Overlap:
    try:
        return PRESETS[name]
    except KeyError:
        raise ConfigError(f"unknown overlap preset {name!r}: choose one of {', '.join(PRESETS)}") from None


def stack_reshards(overlap: Overlap | str, pp: int) -> bool:
    """Whether ZeRO-3 reshards after the forward under `overlap`'s stack when the flags do not say: torchtitan's
    default policy does not under pipelining (its parallelize: reshard_after_forward = not pp_enabled, "to avoid
    per-microbatch all-gathers"), every other stack does (ours; Megatron-core runs no ZeRO-3)."""
    base = overlap.preset if isinstance(overlap, Overlap) else Overlap(name=overlap).preset
    return not (base == "torchtitan-fsdp2" and pp > 1)


def reshards(given: bool | None, zero: int, overlap: Overlap | str | None, pp: int) -> bool:
    """A run's ZeRO-3 reshard after the forward: `given` (the flag), else the stack's default at `pp` stages
    (stack_reshards; `overlap` None, our executor's: it reshards); True for other ZeRO stages unless `given` says
    otherwise (which the layout's check then refuses in one line)."""
    if given is not None or overlap is None or zero != 3:
        return given is not False
    return stack_reshards(overlap, pp)


def stack_implementation(overlap: Overlap | str) -> dict:
    """The implementation choices of the stack an overlap (or preset name) comes from ("<preset>+custom": its preset's)."""
    base = overlap.preset if isinstance(overlap, Overlap) else Overlap(name=overlap).preset
    if base not in STACK_IMPLEMENTATION:
        raise ConfigError(f"unknown overlap preset {base!r}: choose one of {', '.join(PRESETS)}")
    chosen = dict(STACK_IMPLEMENTATION[base])
    tp = overlap.tp if isinstance(overlap, Overlap) else PRESETS[base].tp
    chosen["ub_chunks"] = chosen["ub_chunks"] and tp  # userbuffers chunk the GEMMs to overlap tp's collectives
    return chosen


def stack_default(overlap: Overlap | str, attention: str, recompute: str,
                  sp_saved_input: str | None = None) -> Implementation:
    """How a block is computed under `overlap`'s stack: the flags, with the stack's own choices
    (stack_implementation; `sp_saved_input` None: the stack's too)."""
    chosen = stack_implementation(overlap)
    if sp_saved_input is not None:
        chosen["sp_saved_input"] = sp_saved_input
    return Implementation(attention, recompute, **chosen)


def resolve_overlap(overlap: Overlap | str | None = None, **changes) -> Overlap:
    """A preset (by name, default "executor") with any settings changed; changed settings rename it "<preset>+custom"."""
    base = overlap if isinstance(overlap, Overlap) else overlap_preset(overlap or "executor")
    changes = {key: value for key, value in changes.items() if value is not None}
    unknown = sorted(set(changes) - set(SETTINGS))
    if unknown:
        raise ConfigError(f"unknown overlap setting(s) {', '.join(unknown)}: use {', '.join(SETTINGS)}")
    if not changes or all(getattr(base, key) == value for key, value in changes.items()):
        return base
    name = base.name if base.name.endswith("+custom") else f"{base.name}+custom"
    return replace(base, name=name, **changes)


SM_REFERENCE = 132  # the SMs the slowdowns above are shares of (H100 SXM), for a GPU without a GEMM model


def with_userbuffers(implementation, settings: Overlap, userbuffers: Userbuffers, layout, profile, linear_format: str):
    """The implementation and overlap of a megatron-core stack run with a userbuffers configuration
    (simulator/costs/userbuffers.py): its chunks and SM margins on the Linears' GEMMs, and its tp slowdown (the SMs
    its collectives without a margin take, over the GPU's). Raises ConfigError where it cannot apply."""
    if not (implementation.ub_chunks and layout.tp > 1 and layout.sequence_parallel):
        raise ConfigError("--tp-overlap-cfg describes Transformer Engine's userbuffers, which overlap tensor-parallel "
                          "collectives under sequence parallelism in the megatron-core stack: it needs --overlap "
                          "megatron-core (tp overlapped), --sequence-parallel and --tp > 1")
    model = profile.gemm if profile is not None else None
    sms = model.sms if model is not None else SM_REFERENCE
    if userbuffers.margins() and (model is None or model.fit(linear_format) is None):
        raise ConfigError(f"{userbuffers.origin}: a GEMM with set_sm_margin runs on fewer SMs, which needs the GPU's "
                          f"GEMM model in {linear_format} (its SM count); this hardware has none: drop the margins")
    widest = max(userbuffers.margins().values(), default=0)
    if widest >= sms:
        raise ConfigError(f"{userbuffers.origin}: a margin of {widest} SMs leaves none of the GPU's {sms} to its GEMM")
    # the preset keeps its name: the provenance names the file and prints the slowdown
    return replace(implementation, userbuffers=userbuffers), replace(settings, tp_slowdown=userbuffers.slowdown(sms))
