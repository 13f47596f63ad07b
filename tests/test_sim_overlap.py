"""simulator/engine/overlap.py: what hides what (presets and settings), and what hiding costs the compute it hides
behind (the slowdowns), alone and in a simulated step."""

from dataclasses import replace

import pytest

from job.layout import Layout
from minigpt.config import GPTConfig
from minigpt.errors import ConfigError
from simulator.costs.hardware import load_hardware
from simulator.costs.implementation import Implementation
from simulator.engine.dp_overlap import Segment, overlap
from simulator.engine.overlap import resolve_overlap
from simulator.engine.simulate import simulate_step
from simulator.network.topology import build_cluster

A100 = load_hardware("a100-80gb")
SMALL = GPTConfig(vocab_size=64, seq_len=256, n_layers=16, n_heads=16, d_model=512, d_ff=2048)


def test_overlap_presets_and_settings():
    from simulator.engine.overlap import Overlap, overlap_preset, resolve_overlap

    assert resolve_overlap() == Overlap() == overlap_preset("executor")
    assert resolve_overlap("overlapped") == Overlap("overlapped", tp=True, dp="backward", zero3_prefetch=1, p2p=True,
                                                      ep=True)
    assert overlap_preset("megatron-2021").dp == "after" and not overlap_preset("megatron-2021").tp
    custom = resolve_overlap("overlapped", p2p=False)
    assert custom.name == "overlapped+custom" and not custom.p2p and custom.tp
    assert resolve_overlap("overlapped", p2p=True).name == "overlapped"  # no change, no new name
    for bad in (lambda: overlap_preset("magic"), lambda: Overlap(dp="sometimes"), lambda: Overlap(zero3_prefetch=-1),
                lambda: resolve_overlap(nvlink=True)):
        with pytest.raises(ConfigError):
            bad()


def test_zero3_prefetch_depth():
    segments = [Segment(1.0, gather=0.5)] * 3
    assert overlap(segments, None, False, prefetch=1).end == 3.5  # our code: one unit ahead, the first gather exposed
    assert overlap(segments, None, False, prefetch=0).end == 4.5  # every gather waited for


def test_the_default_is_the_executor_and_every_result_says_what_it_rests_on():
    cluster = build_cluster("a100-80gb", 8, 2, "hdr")
    layout = Layout(tp=2, pp=2, dp=4, zero=1)
    default = simulate_step(SMALL, layout, cluster, "bf16", 32, 1)
    explicit = simulate_step(SMALL, layout, cluster, "bf16", 32, 1, overlap="executor", attention="flash")
    assert default.step_time_s == explicit.step_time_s and default.overlap.name == "executor"
    data = default.as_dict()["provenance"]
    assert data["overlap"]["name"] == "executor" and data["implementation"]["attention"] == "flash"
    assert data["matmul_efficiency"]["bf16"]["kind"] == "GEMM model"  # the preset's fit (simulator/costs/rates/gemm_model.py)
    assert set(data["achieved"]) >= {"hbm_fraction", "kernel_overhead", "nvlink_fraction", "source"}
    bare = replace(A100.gpu, matmul_efficiency=None, achieved=None)
    fallback = simulate_step(SMALL, layout, cluster, "bf16", 32, 1, gpu=bare).provenance
    assert fallback["matmul_efficiency"]["bf16"]["kind"] == "fallback curve" and fallback["kernel_overhead_s"] == 0


def test_overlap_presets_hide_what_they_say():
    cluster = build_cluster("a100-80gb", 8, 2, "hdr")
    model = SMALL.with_(tied_head=False)
    layout = Layout(tp=2, pp=2, dp=4, zero=1)
    runs = {name: simulate_step(model, layout, cluster, "bf16", 32, 1, overlap=name, bucket_mb=1)
            for name in ("executor", "megatron-2021", "overlapped")}
    executor, megatron, modern = (runs[n].breakdown for n in ("executor", "megatron-2021", "overlapped"))
    assert modern["tp_comm"] < executor["tp_comm"] == megatron["tp_comm"] > 0  # hidden behind the Linears' GEMMs
    assert megatron["dp_comm"] > executor["dp_comm"]  # after the last backward: nothing hidden
    assert modern["pp_comm"] < executor["pp_comm"]  # asynchronous sends
    assert runs["overlapped"].step_time_s < runs["executor"].step_time_s
    assert megatron["compute"] < executor["compute"]  # Megatron's bias + GeLU and bias + dropout + add kernels
    for result in runs.values():
        assert sum(result.breakdown.values()) == pytest.approx(result.step_time_s, rel=1e-9)
    tied = SMALL  # our executor reduces a tied matrix's bucket after the two copies are summed; "backward" before
    serial, overlapped = (simulate_step(tied, Layout(pp=2, dp=8), cluster, "bf16", 32, 1, overlap=o, bucket_mb=1)
                          for o in ("executor", resolve_overlap("executor", dp="backward")))
    assert overlapped.per_rank[1]["dp_comm"] < serial.per_rank[1]["dp_comm"]  # the head's bucket: ready early
    zero3 = [simulate_step(model, Layout(tp=2, pp=2, dp=4, zero=3), cluster, "bf16", 32, 1,
                           overlap=resolve_overlap(zero3_prefetch=depth)) for depth in (0, 1)]
    assert zero3[0].breakdown["dp_comm"] > zero3[1].breakdown["dp_comm"]


def test_an_overlapped_collective_slows_the_compute_it_hides_behind():
    from simulator.engine.overlap import exposed, slowed

    # hidden (c < g): the compute lasts f x c longer; f = 0 is the free overlap, max(0, c - g)
    assert exposed(1.0, 4.0, 0.0) == 0.0 and exposed(5.0, 4.0, 0.0) == 1.0 and exposed(0.0, 4.0, 0.2) == 0.0
    assert exposed(1.0, 4.0, 0.2) == pytest.approx(0.2)
    # the collective outlasts the slowed compute (c >= g / (1 - f)): only what sticks out, as before
    assert exposed(6.0, 4.0, 0.2) == pytest.approx(2.0)
    # in between: slowed for the 4.5 s the collective runs (3.6 s of its work done), the rest at full rate: 4.9 s
    assert exposed(4.5, 4.0, 0.2) == pytest.approx(0.9) and exposed(4.5, 4.0, 0.0) == pytest.approx(0.5)
    assert slowed(2.0, 3.0, 2.5, 0.2) == pytest.approx(5.1) and slowed(2.0, 3.0, 1.0, 0.2) == 5.0
    # the data-parallel stream: the second segment's compute overlaps the first's reduction (1 s)
    segments = [Segment(2.0, reduce=1.0), Segment(2.0)]
    free, costly = overlap(segments, None, False), overlap(segments, None, False, slowdown=0.25)
    assert free.end == 4.0 and free.exposed == 0.0
    assert costly.end == pytest.approx(4.25) and costly.exposed == pytest.approx(0.25)
    # a gather prefetched under a unit's compute slows that unit (ZeRO-3), and only the one it overlaps
    gathered = overlap([Segment(1.0, gather=0.5)] * 3, None, False, slowdown=0.1)
    assert gathered.end == pytest.approx(3.5 + 2 * 0.1 * 0.5)
    assert overlap(segments, None, True, serial=True, slowdown=0.25).end == 5.0  # gloo on a CPU host: in turn


def test_overlap_slowdown_in_a_simulated_step():
    cluster = build_cluster("a100-80gb", 8, 2, "hdr")
    model = SMALL.with_(tied_head=False)
    layout = Layout(tp=2, pp=2, dp=4, zero=1)

    def run(preset, **changes):
        return simulate_step(model, layout, cluster, "bf16", 32, 1, bucket_mb=1,
                             overlap=resolve_overlap(preset, **changes)).breakdown

    free = run("overlapped", tp_slowdown=0.0, dp_slowdown=0.0, p2p_slowdown=0.0)
    costly = run("overlapped")
    assert costly["compute"] == free["compute"]  # the slowdown is charged to the collective that causes it
    assert costly["tp_comm"] > free["tp_comm"] and costly["dp_comm"] > free["dp_comm"]
    assert run("overlapped", tp_slowdown=0.3)["tp_comm"] > costly["tp_comm"]
    assert run("overlapped", p2p_slowdown=0.3)["pp_comm"] > run("overlapped", p2p_slowdown=0.0)["pp_comm"]
    exposed_tp = run("executor", tp_slowdown=0.0)
    assert run("executor", tp_slowdown=0.5)["tp_comm"] == exposed_tp["tp_comm"]  # nothing hidden, nothing slowed
    after = run("megatron-2021")  # ZeRO-1 reductions after the last backward: they overlap no compute
    assert after == run("megatron-2021", dp_slowdown=0.5)


def test_update_gathers_hidden_by_the_next_forward():
    cluster = build_cluster("a100-80gb", 8, 2, "hdr")
    model = SMALL.with_(tied_head=False)
    layout = Layout(tp=2, pp=2, dp=4, zero=1)
    step, forward = (simulate_step(model, layout, cluster, "bf16", 32, 1, bucket_mb=1,
                                   overlap=resolve_overlap("megatron-core", param_gather=mode))
                     for mode in ("step", "forward"))
    assert forward.breakdown["dp_comm"] < step.breakdown["dp_comm"]
    assert forward.step_time_s < step.step_time_s
    assert sum(forward.breakdown.values()) == pytest.approx(forward.step_time_s, rel=1e-9)
    zero0 = [simulate_step(model, Layout(tp=2, pp=2, dp=4, zero=0), cluster, "bf16", 32, 1, bucket_mb=1,
                           overlap=resolve_overlap("megatron-core", param_gather=mode)).step_time_s
             for mode in ("step", "forward")]
    assert zero0[0] == zero0[1]  # no update gathers without a sharded optimizer


def test_stack_presets_state_their_settings():
    from simulator.engine.overlap import (DP_SLOWDOWN, P2P_SLOWDOWN, PRESETS, TP_SLOWDOWN, Overlap, overlap_preset,
                                          stack_implementation)

    # the SMs the communication holds, of an H100 SXM's 132 (docs/efficiency.md, "Overlap costs")
    assert TP_SLOWDOWN == round((1 + 24 + 1 + 1 + 4 + 4 + 2 + 4 + 1 + 1) / 10 / 132, 3)  # TE userbuffers num_sm
    assert DP_SLOWDOWN == round(16 / 132, 3) and P2P_SLOWDOWN == round(2 / 132, 3)  # NCCL channels
    assert list(PRESETS) == ["executor", "megatron-2021", "overlapped", "megatron-core", "torchtitan-fsdp2"]
    for preset in PRESETS.values():
        assert (preset.tp_slowdown, preset.dp_slowdown, preset.p2p_slowdown) == (TP_SLOWDOWN, DP_SLOWDOWN, P2P_SLOWDOWN)
    assert overlap_preset("megatron-core") == Overlap("megatron-core", tp=True, dp="backward", zero3_prefetch=1,
                                                      p2p=True, param_gather="forward")
    assert overlap_preset("torchtitan-fsdp2") == Overlap("torchtitan-fsdp2", tp=False, dp="backward",
                                                         zero3_prefetch=1, p2p=True, param_gather="step")
    assert overlap_preset("executor").param_gather == "step" and not overlap_preset("executor").tp
    assert stack_implementation("megatron-core") == {"wgrad_fusion": True, "fp8_weight_cache": True,
                                                     "fp8_fused_casts": True, "fp8_scaling": "tensor",
                                                     "ub_chunks": True, "fused_optimizer": True,
                                                     "fp8_amax_group": "data", "fp8_experts": True,
                                                     "fp8_recast": False, "eager": False,
                                                     "grad_reduce_fp32": False, "sp_saved_input": "sharded",
                                                     "attention_kernel": "te", "zero3_copies": "none",
                                                     "loss": "fused",  # Megatron's in-place vocab-parallel loss
                                                     "cp_attention": "te",  # Transformer Engine's ring, in bf16
                                                     "expert_gemms": "te-streams",  # TE's GroupedLinear, 4 streams
                                                     "bias_fusion": "te",  # Megatron's fusions, TE's bias epilogues
                                                     "ddp_buckets": "megatron"}  # max(40M, 1M x dp) parameters
    # userbuffers chunk the GEMMs only to overlap tp's collectives: not when the preset's tp overlap is turned off
    assert stack_implementation(resolve_overlap("megatron-core", tp=False))["ub_chunks"] is False
    assert stack_implementation(resolve_overlap("torchtitan-fsdp2", tp=True)) == {
        "wgrad_fusion": False, "fp8_weight_cache": False, "fp8_fused_casts": True, "fp8_scaling": "current",
        "ub_chunks": False, "fused_optimizer": True, "fp8_amax_group": "none",  # torchao's tensorwise scaling
        "fp8_experts": False, "fp8_recast": True,  # torchao saves the 16-bit tensors and casts them again
        "eager": True,  # torchtitan's training.compile = false: its element-wise code in eager PyTorch
        "grad_reduce_fp32": True,  # FSDP2's reduce_dtype, torchtitan's training.mixed_precision_reduce
        "sp_saved_input": "gathered", "attention_kernel": "flash-attn-2",  # DTensor Linears' autograd; torch's SDPA
        "zero3_copies": "fsdp2",  # FSDP2's copies out of and into its collectives' buffers
        "loss": "torch",  # torch's F.cross_entropy on fp32 logits
        "cp_attention": "torch",  # torch's context_parallel: its steps merged by eager fp32 kernels
        "expert_gemms": "grouped",  # torch's grouped_mm: one kernel
        "bias_fusion": "none",  # Llama has no biases; torch.compile fuses what there is (--elementwise fused)
        "ddp_buckets": "ddp"}  # FSDP2 reduces per unit; the setting is DDP's (ZeRO 0-2 under this stack)
    assert stack_implementation("executor") == {  # precision/fp8.py and our ZeRO code: Implementation's defaults
        name: getattr(Implementation(), name) for name in ("wgrad_fusion", "fp8_weight_cache", "fp8_fused_casts",
                                                           "fp8_scaling", "ub_chunks", "fused_optimizer",
                                                           "fp8_amax_group", "fp8_experts", "fp8_recast",
                                                           "eager", "grad_reduce_fp32", "sp_saved_input",
                                                           "attention_kernel", "zero3_copies", "loss",
                                                           "cp_attention", "expert_gemms", "bias_fusion",
                                                           "ddp_buckets")}
    for bad in (lambda: Overlap(tp_slowdown=1.0), lambda: Overlap(dp_slowdown=-0.1), lambda: Overlap(p2p_slowdown=True),
                lambda: Overlap(param_gather="never"), lambda: stack_implementation("magic")):
        with pytest.raises(ConfigError):
            bad()
    assert resolve_overlap(resolve_overlap("megatron-core", tp=False), p2p=False).name == "megatron-core+custom"


def test_megatron_core_sizes_its_gradient_buckets_by_the_data_parallel_group():
    """Megatron-core's DistributedDataParallel, ddp_bucket_size unset (NeMo's recipes): max(40M, 1M x dp x cp)
    parameters a bucket, so that a ring over many ranks stays bandwidth-bound; our executor keeps DDP's 25 MiB. On
    NVIDIA's Nemotron-4 15B run over 1,024 data-parallel ranks (bench/published_runs.json "dgxc_nemotron4_h100") the
    reductions are fewer and the exposed data-parallel time falls."""
    from job.layout import Layout
    from precision.policy import policy
    from simulator.costs.hardware import load_hardware
    from simulator.costs.op_types import Implementation
    from simulator.engine.simulate import ddp_bucket_mb, simulate_step
    from simulator.network.topology import build_cluster

    bf16 = policy("bf16")
    assert ddp_bucket_mb(Implementation(), Layout(dp=1024), bf16) == 25.0
    megatron = Implementation(ddp_buckets="megatron")
    assert ddp_bucket_mb(megatron, Layout(dp=8), bf16) == 40_000_000 * 2 / 2**20  # the floor
    assert ddp_bucket_mb(megatron, Layout(dp=512, cp=2), bf16) == 1_024_000_000 * 2 / 2**20
    with pytest.raises(ConfigError, match="ddp_buckets"):
        Implementation(ddp_buckets="huge")
    from minigpt.config import GPTConfig

    nemotron = GPTConfig(vocab_size=256000, seq_len=4096, n_layers=32, n_heads=48, n_kv_heads=8, d_model=6144,
                         d_ff=24576, mlp="relu2", positions="rope", tied_head=False, bias=False)
    layout = Layout(tp=2, dp=1024, zero=1, sequence_parallel=True)
    hardware = load_hardware("h100-sxm")
    cluster = build_cluster(hardware, 8, 256)
    step = {mb: simulate_step(nemotron, layout, cluster, "bf16", 8192, 2, overlap="megatron-core", gpu=hardware,
                              bucket_mb=mb) for mb in (None, 25.0)}
    assert step[None].breakdown["dp_comm"] < 0.5 * step[25.0].breakdown["dp_comm"]
    assert step[None].breakdown["compute"] == pytest.approx(step[25.0].breakdown["compute"])
