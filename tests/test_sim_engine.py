"""simulator/engine/simulate.py and sweep.py: closed forms, the executor's semantics, the two lessons, speed, trace."""

import json
import subprocess
import sys
import time

import networkx as nx
import pytest

from minigpt.config import GPTConfig
from minigpt.presets import build_config, preset
from minigpt.errors import ConfigError
from job.schedule import ScheduleConfig, build_schedule
from simulator.network.collectives import simulate_collective
from simulator.costs.compute import chunk_times
from simulator.engine.simulate import simulate_step
from simulator.engine.costs import RankCosts, optimizer_seconds
from simulator.engine.links import LinkCosts
from simulator.engine.dp_overlap import Segment, overlap
from simulator.engine.replay import replay
from simulator.costs.hardware import load_hardware
from job.layout import Layout
from simulator.engine.overlap import resolve_overlap
from simulator.search.sweep import ClusterSpec, Job, compare_zero, scaling_sweep, zero_verdict
from simulator.network.topology import Cluster, build_cluster
from precision.policy import policy

A100 = load_hardware("a100-80gb")
SMALL = GPTConfig(vocab_size=64, seq_len=256, n_layers=16, n_heads=16, d_model=512, d_ff=2048)
GPT2 = preset("gpt2-124m")


def free_cluster(n: int) -> Cluster:
    """One server of n GPUs whose links cost nothing (1e30 bytes/s, no latency)."""
    graph = nx.DiGraph(gpu="a100-80gb")
    graph.add_node("switch", type="nvswitch", node=0)
    for i in range(n):
        graph.add_node(f"gpu{i}", type="gpu", node=0, local=i)
        graph.add_edge(f"gpu{i}", "switch", bandwidth=1e30, latency=0.0)
        graph.add_edge("switch", f"gpu{i}", bandwidth=1e30, latency=0.0)
    return Cluster(graph)


def test_simulator_stays_torch_free():
    code = ("import sys, simulator.engine.simulate, simulator.search.sweep, simulator.report, cli.commands.simulate; "
            "print('torch' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"


# ------------------------------------------------------------------ closed forms


@pytest.mark.parametrize("kind,p,m,v", [("gpipe", 4, 8, 1), ("1f1b", 4, 8, 1), ("1f1b", 8, 3, 1),
                                        ("interleaved", 4, 8, 2), ("interleaved", 4, 12, 3)])
def test_uniform_stages_free_communication_give_the_textbook_bubble(kind, p, m, v):
    """F = 1/v, B = 2/v per chunk, p2p free: every rank idles (p-1)/(v*m+p-1) of the step."""
    config = ScheduleConfig(p, m, kind, v)
    costs = [RankCosts.uniform(config.chunks_of(rank), 1.0 / v, 2.0 / v) for rank in range(p)]
    tallies = replay(build_schedule(config), costs, {(a, b): 0.0 for a in range(p) for b in range(p)})
    step = max(t.end for t in tallies)
    for tally in tallies:
        assert tally.seconds["bubble"] / step == pytest.approx((p - 1) / (v * m + p - 1), abs=1e-12)  # the textbook's
        assert sum(tally.seconds.values()) == pytest.approx(step, rel=1e-12)
    assert tallies[0].seconds["bubble"] == pytest.approx((p - 1) * 3.0 / v)  # interleaving divides the bubble time by v


def test_bubble_of_a_real_model_on_a_free_cluster_is_near_the_closed_form():
    cluster = free_cluster(8)
    model = SMALL.with_(n_layers=32, d_model=1024, d_ff=4096, seq_len=1024)  # blocks dwarf the embedding, the head
    base = simulate_step(model, Layout(pp=8), cluster, "bf16", 16, 1, "1f1b")
    inter = simulate_step(model, Layout(pp=8), cluster, "bf16", 16, 1, "interleaved", 2)
    for result, v in ((base, 1), (inter, 2)):
        b = result.breakdown
        fraction = b["pipeline_bubble"] / (result.step_time_s - b["optimizer"])
        assert fraction == pytest.approx((8 - 1) / (v * 16 + 8 - 1), rel=0.05)  # stages differ a little
        assert b["pp_comm"] < 1e-15 and b["dp_comm"] == b["tp_comm"] == 0
    assert inter.step_time_s < base.step_time_s


def test_single_gpu_step_is_micro_batches_times_forward_plus_backward_plus_optimizer():
    cluster = build_cluster("a100-80gb", 1, 1)
    result = simulate_step(SMALL, Layout(), cluster, "bf16", 6, 2)
    chunk = chunk_times(SMALL, SMALL.n_layers, 2, Layout(), A100.gpu, "bf16", first=True, last=True,
                        profile=A100.gpu.matmul_efficiency)
    optimizer = optimizer_seconds(result.memory.per_stage[0], policy("bf16"), A100.gpu)
    assert result.micro_batches == 3
    assert result.step_time_s == pytest.approx(3 * (chunk.forward_s + chunk.backward_s) + optimizer, rel=1e-12)
    assert result.breakdown["optimizer"] == pytest.approx(optimizer)
    assert result.breakdown["pipeline_bubble"] == 0


def test_the_optimizer_is_priced_by_the_passes_its_implementation_makes():
    """Our executor's MasterAdamW (precision/optimizer.py) moves 104 bytes per parameter in bf16 (its element-wise ops
    kernel by kernel: 2 + 4 to copy the bf16 gradient to fp32, 23 state-size passes, 4 + 2 to write the bf16 weights
    back) and 92 in fp32 (no copies); a fused AdamW (Megatron's, torchtitan's) 28 in both: the gradient, m and v,
    the masters read and written, the weights written. Each at the achieved HBM speed."""
    from simulator.costs.compute import hbm_speed
    from simulator.engine.costs import optimizer_bytes

    assert [optimizer_bytes(policy(p), False) for p in ("fp32", "bf16", "fp16")] == [92, 104, 104]
    assert optimizer_bytes(policy("bf16"), True) == 2 + 2 * (4 + 4) + 2 * 4 + 2 == optimizer_bytes(policy("fp32"), True)
    ours = simulate_step(SMALL, Layout(), build_cluster("a100-80gb", 1, 1), "bf16", 6, 2)
    fused = simulate_step(SMALL, Layout(), build_cluster("a100-80gb", 1, 1), "bf16", 6, 2, overlap="megatron-core")
    owned = ours.memory.per_stage[0].adam_m // 4
    assert ours.breakdown["optimizer"] == pytest.approx(owned * 104 / hbm_speed(A100.gpu))
    assert fused.breakdown["optimizer"] == pytest.approx(owned * 28 / hbm_speed(A100.gpu))


@pytest.mark.parametrize("kind", ["all_reduce", "reduce_scatter", "all_gather"])
def test_dp_ring_collectives_match_the_fluid_model_and_alpha_beta(kind):
    """dp = 16 over two servers: every ring step has a hop through the NICs, so it costs alpha + (S/n)/B of InfiniBand."""
    cluster = build_cluster("a100-80gb", 8, 2, "hdr")
    layout = Layout(dp=16)
    links = LinkCosts(cluster, layout)
    nbytes = 64e6
    fluid = simulate_collective(cluster, kind.replace("_", "-"), list(range(16)), nbytes)
    assert links.dp_collective(0, kind, nbytes) == pytest.approx(fluid, rel=1e-9)
    nic = A100.nic
    alpha, beta = nic.latency + nic.switch_latency, nic.bandwidth  # GPU -> NIC -> leaf -> NIC -> GPU
    steps = 2 * 15 if kind == "all_reduce" else 15
    assert links.dp_collective(0, kind, nbytes) == pytest.approx(steps * (alpha + nbytes / 16 / beta), rel=1e-9)


def test_tp_collective_and_p2p_match_alpha_beta_on_their_links():
    cluster = build_cluster("a100-80gb", 8, 2, "hdr")
    links = LinkCosts(cluster, Layout(tp=8, pp=2))
    gpu, nic, nbytes = A100.gpu, A100.nic, 32e6
    assert links.tp_collective("all_reduce", nbytes) == pytest.approx(
        2 * 7 * (gpu.nvlink_latency + nbytes / 8 / gpu.nvlink_bandwidth), rel=1e-9)
    # the 8 tp ranks of stage 0 each send to their twin on the other server, on their own NICs
    assert links.p2p(0, 1, nbytes) == pytest.approx(nic.latency + nic.switch_latency + nbytes / nic.bandwidth, rel=1e-9)


# ------------------------------------------------------------------ the executor's overlap


def test_overlap_of_reductions_with_compute():
    # three buckets ready along a 3 s backward, each reduction 2 s: the stream ends at 7 s
    segments = [Segment(1.0, reduce=2.0)] * 3
    free = overlap(segments, None, False)
    assert (free.end, free.comm_end, free.exposed) == (3.0, 7.0, 0.0)
    waited = overlap(segments, None, True)  # ZeRO-2: the backward ends with its reductions
    assert waited.end == 7.0 and waited.exposed == 4.0
    limited = overlap(segments, 1, False)  # at most one in flight: compute waits for the oldest
    assert limited.end == 5.0
    prefetched = overlap([Segment(1.0, gather=0.5)] * 3, None, False)  # ZeRO-3: one unit gathered ahead
    assert prefetched.end == 3.5 and prefetched.exposed == 0.5


def test_ddp_reduction_overlaps_the_last_backward_unless_a_tied_head_spans_stages():
    # A vocabulary large enough for the tied matrix's bucket to cost something: with SMALL's 64 tokens the two
    # exposed times differed by 1e-19 s, and once causal attention halved the backward not at all.
    # What hiding costs (Overlap.dp_slowdown) is left out here: this is about what the schedule hides.
    cluster, tied = build_cluster("a100-80gb", 8, 2, "hdr"), SMALL.with_(vocab_size=8192)
    free = resolve_overlap(dp_slowdown=0.0)
    overlapped = simulate_step(tied.with_(tied_head=False), Layout(pp=2, dp=8, zero=0), cluster, "bf16", 32, 1,
                               overlap=free)
    serial = simulate_step(tied, Layout(pp=2, dp=8, zero=0), cluster, "bf16", 32, 1, overlap=free)
    assert overlapped.breakdown["dp_comm"] < 0.95 * serial.breakdown["dp_comm"]
    names = {e[0] for t in serial.timelines for e in t["steps"][0]["events"]}
    assert "EmbeddingSync" in names  # the executor's tied-embedding all-reduce between first and last stage


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_data_parallel_actions_are_priced_once(zero):
    """An action armed around a compute costs its time inside that compute: its own event takes none."""
    cluster = build_cluster("a100-80gb", 8, 8, "hdr")
    result = simulate_step(SMALL, Layout(dp=64, zero=zero), cluster, "bf16", 256, 1, bucket_mb=1)
    events = result.tallies[0].events
    armed = [(a, b) for what, a, b in events if type(what).__name__ in ("GatherParams", "ReduceScatterGrads",
                                                                         "AllReduceGrads")
             and getattr(what, "phase", "") != "update"]
    assert armed and all(b == a for a, b in armed)
    computes = sum(b - a for what, a, b in events if type(what).__name__ in ("Forward", "Backward"))
    assert sum(result.breakdown.values()) == pytest.approx(result.step_time_s, rel=1e-9)
    assert computes <= result.step_time_s


@pytest.mark.parametrize("zero,kind", [(0, "1f1b"), (1, "interleaved"), (2, "1f1b"), (3, "gpipe"), (1, "zb-h1")])
def test_breakdown_adds_up_to_the_step(zero, kind):
    cluster = build_cluster("a100-80gb", 8, 2, "hdr")
    v = 2 if kind == "interleaved" else 1
    result = simulate_step(SMALL, Layout(tp=2, pp=2, dp=4, zero=zero), cluster, "bf16", 32, 1, kind, v)
    assert sum(result.breakdown.values()) == pytest.approx(result.step_time_s, rel=1e-9)
    for per_rank in result.per_rank:
        assert sum(per_rank.values()) == pytest.approx(result.step_time_s, rel=1e-9)
    # The model's FLOPs (config.py's count, which test_config checks against torch's FlopCounterMode) over the step
    # and the 16 GPUs, against the A100's dense bf16 peak from its datasheet, 312 TFLOP/s.
    flops_per_gpu_s = SMALL.train_flops_per_token() * 32 * SMALL.seq_len / result.step_time_s / 16
    assert result.tflops_per_gpu == pytest.approx(flops_per_gpu_s / 1e12, rel=1e-9)
    assert result.mfu == pytest.approx(flops_per_gpu_s / 312e12, rel=1e-9) and 0 < result.mfu < 1 and result.fits


# ------------------------------------------------------------------ the two lessons


def test_lesson_more_gpus_can_stop_helping():
    """A small model, a fixed batch: throughput flattens, then falls; the sweep names where it stops paying."""
    job = Job(GPT2, "bf16", global_batch=64, micro_batch=4, zero=1)
    sweep = scaling_sweep(job, [1, 2, 4, 8, 16, 32, 64, 128], ClusterSpec.of("a100-80gb", fabric="hdr"), "strong")
    stop = sweep.stop
    assert stop is not None and stop.marginal < 0.5
    assert "stops paying at" in sweep.verdict()
    best = max(p.samples_per_s for p in sweep.points)
    assert sweep.points[-1].samples_per_s < best  # 128 GPUs do less than fewer GPUs did
    assert sweep.points[-1].efficiency < 0.5


def test_lesson_zero3_loses_to_ddp_and_zero1_for_a_model_that_fits():
    spec = ClusterSpec.of("a100-80gb", fabric="hdr")
    job = Job(GPT2, "bf16", global_batch=256, micro_batch=2)  # 4 micro-batches: ZeRO-3 gathers the weights in each
    results = compare_zero(job, Layout(dp=32), spec.build(32), spec.hardware)
    assert all(r.fits for r in results.values())
    assert results[3].step_time_s > 1.1 * max(results[0].step_time_s, results[1].step_time_s)
    assert results[3].memory.total < results[1].memory.total < results[0].memory.total  # it does save memory
    assert "slower" in zero_verdict(results)


# ------------------------------------------------------------------ speed, trace, results, bad input


def test_one_trillion_parameters_on_3072_gpus_simulates_in_seconds():
    """Narayanan et al. 2021's 1T shape: 128 layers, width 25600, 160 heads, sequence 2048; tp 8 x pp 64 x dp 6."""
    model = build_config("gpt3-175b", n_layers=128, d_model=25600, n_heads=160)
    cluster = build_cluster("a100-80gb", 8, 384, "hdr")
    import gc

    gc.collect()  # the suite's garbage so far is not this step's to collect
    start = time.process_time()  # CPU time: other jobs on a shared machine do not count
    result = simulate_step(model, Layout(tp=8, pp=64, dp=6, zero=1), cluster, "bf16", 3072, 1, recompute="full")
    elapsed = time.process_time() - start
    assert model.n_params() > 1e12 and result.micro_batches == 512
    # 1.7-2.0 s alone on this project's 2-core VM (2026-12-01), 3.1 s once late in the full suite: 5 s is "seconds"
    # with room for a slower core, and still fails a replay twice as slow as today's
    assert elapsed < 5.0, result.timings
    assert 0.2 < result.mfu < 1 and result.fits


def test_llama3_70b_on_256_h100s_by_hand():
    """tp 8 x pp 4 x dp 8 (`minigpt simulate --model llama3-70b --tp 8 --pp 4 --dp 8 --gpu h100-sxm`): model states
    and activations by hand from the shape; with sequence parallelism and 32 micro-batches a replica, an MFU inside
    the 30-50% that published runs of this class reach (Llama 3 405B: 38-43%, Dubey et al. 2024, table 4): a
    validation, not an input."""
    model, hardware = preset("llama3-70b"), load_hardware("h100-sxm")
    cluster = build_cluster(hardware, 8, 32)
    d, f, t, s = model.d_model, model.d_ff, 8, model.seq_len
    block = 2 * d + (d * model.qkv_width + d * d + 2 * d * f + f * d) // t  # RMSNorm gains, no biases
    first = 20 * block + model.vocab_size * d // t  # 20 blocks and the token embedding (no position embedding)
    # bf16 per token and block: x and ln2's input (2d), the inputs of qkv and fc1 (2d), the rotated qkv, the attention
    # output and SwiGLU's 4f split by t; fp32: one 1/rms per row for each norm, a log-sum-exp per query head
    split = model.qkv_width // t + d // t + 4 * f // t

    def per_token(sp: bool) -> int:
        return 2 * (2 * d // (t if sp else 1) + 2 * d + split) + 4 * 2 // (t if sp else 1) + 4 * model.n_heads // t

    for sp, global_batch, fits in ((False, 32, False), (True, 256, True)):
        result = simulate_step(model, Layout(tp=8, pp=4, dp=8, sequence_parallel=sp), cluster, "bf16", global_batch, 1,
                               gpu=hardware)
        stage = result.memory.per_stage[0]
        assert stage.numel == first and stage.model_states == pytest.approx(16 * first, rel=1e-6)  # 2+2+4+4+4 bytes
        assert stage.activations == 4 * 20 * per_token(sp) * s  # 1F1B: the first stage holds 4 forwards
        assert result.fits is fits and result.memory.stage == 0
    assert 0.30 < result.mfu < 0.50 and result.micro_batches == 32


def test_a_sweep_tries_only_tensor_parallel_sizes_that_divide_the_kv_heads():
    from simulator.search.sweep import candidate_layouts

    llama = preset("tiny-llama")  # 4 heads, 2 key/value heads
    tps = {layout.tp for layout in candidate_layouts(Job(llama, global_batch=8), 8, 8, 8)}
    assert tps == {1, 2}
    every_head = Job(llama.with_(n_kv_heads=4), global_batch=8)
    assert {layout.tp for layout in candidate_layouts(every_head, 8, 8, 8)} == {1, 2, 4}


def test_trace_has_one_track_per_stage_and_the_schedule_names(tmp_path):
    cluster = build_cluster("a100-80gb", 8, 2, "hdr")
    result = simulate_step(SMALL, Layout(tp=2, pp=4, dp=2, zero=1), cluster, "bf16", 16, 1, "interleaved", 2)
    schedule = build_schedule(ScheduleConfig(4, 8, "interleaved", 2, 1))
    events = result.trace_events()
    tracks = {e["tid"] for e in events if e["ph"] == "X" and e["cat"] != "step"}
    assert tracks == {0, 1, 2, 3}
    for rank, actions in enumerate(schedule.actions):
        names = {part for e in events if e["tid"] == rank and e["ph"] == "X" for part in e["name"].split("+")}
        assert {a.name for a in actions} <= names
    path = result.write_chrome_trace(tmp_path / "sim.json")
    assert json.loads(path.read_text())["traceEvents"] == json.loads(json.dumps(events))  # job/trace.py's format


def test_a_layout_that_does_not_fit_is_a_result():
    result = simulate_step(preset("gpt3-175b"), Layout(), build_cluster("a100-80gb", 1, 1), "fp32", 1, 1)
    assert not result.fits and result.memory_margin_bytes < 0
    state = result.job_state_bytes
    assert state["parameters"] == state["gradients"] == 4 * preset("gpt3-175b").n_params()
    assert state["optimizer_states"] == 2 * state["parameters"]
    assert result.gpus_for_state == -(-state["total"] // A100.gpu.hbm_bytes)


@pytest.mark.parametrize("change,message", [
    (dict(global_batch=30), "not a multiple"),
    (dict(layout=Layout(tp=16)), "spans servers"),
    (dict(layout=Layout(dp=4)), "the cluster has 16"),
    (dict(schedule_kind="zigzag"), "unknown schedule"),
    (dict(precision="fp12"), "unknown precision"),
    (dict(recompute="some"), "recompute"),
])
def test_bad_input_is_a_config_error(change, message):
    args = dict(model=SMALL, layout=Layout(tp=2, dp=8), cluster=build_cluster("a100-80gb", 8, 2, "hdr"),
                precision="bf16", global_batch=32, micro_batch=2)
    args.update(change)
    with pytest.raises(ConfigError, match=message):
        simulate_step(**args)


def test_asynchronous_p2p_on_uniform_stages():
    """Sends that do not wait: the bubble shrinks by the transfers the rendezvous made both sides wait for."""
    config = ScheduleConfig(4, 8, "1f1b", 1)
    costs = [RankCosts.uniform(config.chunks_of(rank), 1.0, 2.0) for rank in range(4)]
    p2p = {(a, b): 0.25 for a in range(4) for b in range(4)}
    blocking, overlapped = (replay(build_schedule(config), costs, p2p, p2p_overlapped=o) for o in (False, True))
    assert max(t.end for t in overlapped) < max(t.end for t in blocking)
    settings = resolve_overlap("overlapped", p2p_slowdown=0.2)  # a send slows the sender's compute it overlaps
    costly = replay(build_schedule(config), costs, p2p, p2p_overlapped=True, settings=settings)
    assert sum(t.seconds["pp"] for t in costly) > sum(t.seconds["pp"] for t in overlapped)
    free = replay(build_schedule(config), costs, p2p, p2p_overlapped=True,
                  settings=resolve_overlap("overlapped", p2p_slowdown=0.0))
    assert [t.seconds for t in free] == [t.seconds for t in overlapped]
    for tallies in (blocking, overlapped, costly):
        step = max(t.end for t in tallies)
        for tally in tallies:
            assert sum(tally.seconds.values()) == pytest.approx(step, rel=1e-12) and tally.seconds["bubble"] >= -1e-12


def test_the_sweep_verdict_is_monotone_and_its_baseline_fits():
    """A dip below the threshold that recovers is not where scaling stops; only points that fit count."""
    from types import SimpleNamespace

    from simulator.search.sweep import ScalingPoint, ScalingSweep

    def point(gpus, marginal, fits=True):
        p = ScalingPoint(gpus, 64, SimpleNamespace(fits=fits), 100.0, marginal=marginal)
        p.efficiency = None if not fits else 1.0
        return p

    dip = ScalingSweep("strong", 0.5, [point(8, None), point(16, 0.4), point(32, 0.53), point(64, 0.57)])
    assert dip.stop is None and "still pays up to 64" in dip.verdict()  # the old rule said "stops at 16"
    stops = ScalingSweep("strong", 0.5, [point(8, None), point(16, 0.4), point(32, 0.6), point(64, 0.3),
                                         point(128, 0.2)])
    assert stops.stop.gpus == 64 and "no later point pays again" in stops.verdict()
    unfit = ScalingSweep("strong", 0.5, [point(8, None, fits=False), point(16, None), point(32, 0.9)])
    assert "8 GPUs: no layout fits, left out" in unfit.verdict()


def test_a_sweep_whose_first_point_does_not_fit_starts_from_the_first_that_does():
    from simulator.search.sweep import ClusterSpec, Job, scaling_sweep

    job = Job(preset("gpt3-175b"), precision="bf16", global_batch=64, micro_batch=1, zero=1)
    sweep = scaling_sweep(job, [8, 64], ClusterSpec.of("a100-80gb"), tp=8)
    small, large = sweep.points
    assert not small.result.fits and small.efficiency is None and small.marginal is None
    assert large.result.fits and large.efficiency == 1.0 and large.marginal is None


def test_the_api_keeps_the_stated_limits_too():
    """simulate_step itself refuses a job past simulator/limits.py, not only the command line."""
    from minigpt.errors import ConfigError

    hardware = load_hardware("a100-80gb")
    cluster = build_cluster(hardware, 8, 8, None, "fat-tree")
    with pytest.raises(ConfigError, match="schedule slots"):
        simulate_step(preset("gpt2-124m"), Layout(dp=8, zero=3), cluster, "bf16", 8 * 200_000, 1)
