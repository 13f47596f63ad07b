"""simulator/costs/host.py and engine/host.py: a measured CPU host's units, sharing and collectives drive the engine."""

from __future__ import annotations

import copy
import re
import json

import pytest

from minigpt.presets import preset
from minigpt.errors import ConfigError
from simulator.engine.simulate import simulate_step
from simulator.costs.hardware import hardware_to_dict, load_hardware, save_hardware
from job.layout import Layout
from simulator.network.topology import build_cluster
from simulator.stragglers import max_moments, straggler_factor

TINY = preset("tiny")
SIZES = [1, 2, 4, 8]


def unit(tp: int) -> dict:
    """Made-up but shaped like a measurement: a fixed cost plus a cost per sequence, less with tp."""
    entry = {"d_model": TINY.d_model, "n_heads": TINY.n_heads, "d_ff": TINY.d_ff, "seq_len": TINY.seq_len,
             "vocab_size": TINY.vocab_size, "tp": tp, "micro_batches": SIZES}
    for name, fixed, per in (("block_forward", 1e-3, 1e-3), ("block_backward", 2e-3, 2e-3),
                             ("embedding_forward", 1e-4, 1e-4), ("embedding_backward", 2e-4, 2e-4),
                             ("head_forward", 5e-4, 5e-4), ("head_backward", 1e-3, 1e-3)):
        entry[name] = [fixed + per * b / tp for b in SIZES]
    return entry


MEASURED = {
    "cores": 2,
    "units": [unit(1), unit(2)],
    "sharing": [[1, 1, 1.0], [1, 2, 0.6], [2, 1, 1.1], [4, 1, 2.4]],
    "collectives": [
        {"kind": kind, "group": 2, "active": active, "alpha": 1e-4 * active, "beta": 1e-9 * active,
         "points": [[4096, 1e-4 * active + 4096e-9 * active], [2**23, 1e-4 * active + 2**23 * 1e-9 * active]]}
        for kind in ("all_reduce", "all_gather", "reduce_scatter", "p2p") for active in (2, 4)
    ],
}


@pytest.fixture(scope="module")
def hardware(tmp_path_factory):
    data = hardware_to_dict(load_hardware("a100-80gb"))
    name = next(iter(data["gpus"]))
    data["gpus"][name]["measured"] = copy.deepcopy(MEASURED)
    path = tmp_path_factory.mktemp("host") / "host.json"
    path.write_text(json.dumps(data))
    return load_hardware(str(path))


def test_units_interpolate_between_and_extend_beyond_the_measured_sizes(hardware):
    units = hardware.gpu.measured.unit_times(TINY, 1)
    assert units.seconds("block_forward", 4) == pytest.approx(1e-3 + 4e-3)
    assert units.seconds("block_forward", 3) == pytest.approx(1e-3 + 3e-3)  # between 2 and 4
    assert units.seconds("block_forward", 16) == pytest.approx(1e-3 + 16e-3)  # along the last segment
    assert hardware.gpu.measured.unit_times(TINY, 4) is None  # tp 4 was not measured
    assert hardware.gpu.measured.unit_times(preset("small"), 1) is None


def test_sharing_is_measured_where_measured_and_scaled_from_the_nearest_load_elsewhere(hardware):
    host = hardware.gpu.measured
    assert host.slowdown(4, 1) == 2.4 and host.slowdown(1, 2) == 0.6
    # 8 ranks on 2 cores: ideal 4; the nearest measured load (4 x 1) ran 2.4 / 2 = 1.2 x its ideal
    assert host.slowdown(8, 1) == pytest.approx(4 * 1.2)


def test_one_rank_step_is_the_measured_units_times_the_thread_speedup(hardware):
    cluster = build_cluster(hardware, 1, 1)
    result = simulate_step(TINY, Layout(), cluster, "fp32", 8, 8, gpu=hardware)  # one rank: all cores' threads
    units = hardware.gpu.measured.unit_times(TINY, 1)
    per_pass = sum(units.seconds(name, 8) for name in ("embedding_forward", "head_forward", "embedding_backward",
                                                         "head_backward"))
    per_pass += TINY.n_layers * (units.seconds("block_forward", 8) + units.seconds("block_backward", 8))
    assert result.breakdown["compute"] == pytest.approx(0.6 * per_pass)
    single = simulate_step(TINY, Layout(), cluster, "fp32", 8, 8, gpu=hardware, threads_per_rank=1)
    assert single.breakdown["compute"] == pytest.approx(per_pass)


def test_ranks_sharing_cores_slow_compute_and_use_the_measured_collectives(hardware):
    from simulator.engine.host import HostLinks

    two = simulate_step(TINY, Layout(dp=2), build_cluster(hardware, 2, 1), "fp32", 16, 8, gpu=hardware)
    four = simulate_step(TINY, Layout(dp=4), build_cluster(hardware, 4, 1), "fp32", 32, 8, gpu=hardware)
    assert four.breakdown["compute"] == pytest.approx(two.breakdown["compute"] * 2.4 / 1.1)
    links = HostLinks(build_cluster(hardware, 4, 1), Layout(tp=2, dp=2), hardware.gpu.measured)
    assert links.tp_collective("all_reduce", 2**20) == pytest.approx(4e-4 + 4e-9 * 2**20)  # group 2, 4 busy
    assert links.dp_collective(0, "reduce_scatter", 2**20) == pytest.approx(4e-4 + 4e-9 * 2**20)
    assert links.tp_collective("all_reduce", 0) == 0.0


def test_the_measured_object_round_trips_and_bad_entries_are_config_errors(hardware, tmp_path):
    again = load_hardware(str(save_hardware(hardware, tmp_path / "again.json")))
    assert again.gpu.measured == hardware.gpu.measured
    data = json.loads((tmp_path / "again.json").read_text())
    entry = next(iter(data["gpus"].values()))
    for breakage, words in (
        (lambda m: m.pop("cores"), "measured must be a JSON object"),
        (lambda m: m["units"][0].pop("head_backward"), "units[0] must hold exactly"),
        (lambda m: m["units"][0]["block_forward"].pop(), "one time per micro-batch"),
        (lambda m: m["units"][0].update(micro_batches=[2, 1, 4, 8]), "increasing"),
        (lambda m: m["sharing"].append([2, 1]), "sharing[4]"),
        (lambda m: m["collectives"][0].update(kind="broadcast"), "kind must be one of"),
        (lambda m: m["collectives"][0].update(beta=-1), "beta must be"),
        (lambda m: m["collectives"][0].update(cpu_share=1.5), "cpu_share must be a share of one core"),
    ):
        broken = copy.deepcopy(entry["measured"])
        breakage(broken)
        entry_copy = dict(entry, measured=broken)
        path = tmp_path / "broken.json"
        path.write_text(json.dumps(dict(data, gpus={next(iter(data["gpus"])): entry_copy})))
        with pytest.raises(ConfigError, match=re.escape(words)):
            load_hardware(str(path))


def test_collectives_interpolate_between_measured_loads(hardware):
    host = hardware.gpu.measured
    two, four = (host.collective_seconds("all_reduce", 2, busy, 2**20) for busy in (2, 4))
    assert two < four and host.collective_seconds("all_reduce", 2, 3, 2**20) == pytest.approx((two + four) / 2)
    assert host.collective_seconds("all_reduce", 2, 8, 2**20) == four  # beyond the measured loads: the nearest
    assert host.collective_seconds("all_reduce", 4, 4, 2**20) is None  # group 4 was not measured


def test_on_a_cpu_host_communication_does_not_overlap_compute():
    from simulator.engine.dp_overlap import Segment, overlap

    segments = [Segment(1.0, gather=0.5, reduce=0.25), Segment(2.0, reduce=0.25)]
    assert overlap(segments, None, True).end == pytest.approx(3.75)  # the first reduction hides behind compute
    assert overlap(segments, None, True, serial=True).end == pytest.approx(4.0)  # all of it in line


def test_pipeline_ranks_idle_in_bubbles_leave_their_cores_to_the_others(hardware):
    """4 ranks (pp 2 x dp 2) on 2 cores: the busy ranks, on average, are fewer than 4 and the slowdown follows."""
    result = simulate_step(TINY, Layout(pp=2, dp=2), build_cluster(hardware, 4, 1), "fp32", 16, 2, gpu=hardware)
    host = hardware.gpu.measured
    busy = result.host["busy_ranks"]
    assert 2 < busy < 4 and result.host["compute_slowdown"] == pytest.approx(host.slowdown(busy, 1))
    step, bubble = result.step_time_s, [t.seconds["bubble"] for t in result.tallies]
    assert busy == pytest.approx(4 * sum(1 - b / step for b in bubble) / 2, rel=0.05)  # settled
    whole = simulate_step(TINY, Layout(dp=4), build_cluster(hardware, 4, 1), "fp32", 16, 4, gpu=hardware)
    assert whole.host["busy_ranks"] == 4 and whole.host["compute_slowdown"] == 2.4  # no bubbles: all busy


def test_ranks_blocked_in_collectives_leave_their_cores_but_the_measured_share(hardware, tmp_path):
    """tp 2 x dp 2 on 2 cores: no bubbles, but every rank waits in its tensor-parallel all-reduces. Where calibrate
    measured what a collective computes (cpu_share; at 4 busy ranks on 2 cores a rank also waits for a core, so
    only the rows with at most 2 count), a waiting rank leaves the rest of its core to the others."""
    from simulator.engine.simulate import WAITS, collective_cpu_share, idle_seconds

    cluster, layout = build_cluster(hardware, 4, 1), Layout(tp=2, dp=2)
    unmeasured = simulate_step(TINY, layout, cluster, "fp32", 16, 8, gpu=hardware)
    assert unmeasured.host["busy_ranks"] == 4 and unmeasured.host["compute_slowdown"] == 2.4  # waits count as busy
    data = copy.deepcopy(hardware_to_dict(hardware))  # the fixture's own measured object stays as it is
    for fit in next(iter(data["gpus"].values()))["measured"]["collectives"]:
        fit["cpu_share"] = 0.25 if fit["active"] <= 2 else 0.9
    path = tmp_path / "shares.json"
    path.write_text(json.dumps(data))
    shared = load_hardware(str(path))
    host = shared.gpu.measured
    assert collective_cpu_share(host, WAITS["tp"]) == 0.25  # the 4-busy rows' 0.9 left out
    result = simulate_step(TINY, layout, build_cluster(shared, 4, 1), "fp32", 16, 8, gpu=shared)
    busy, step = result.host["busy_ranks"], result.step_time_s
    waits = {name: 0.25 for name in WAITS}
    assert result.tallies[0].seconds["tp"] > 0 and 1 < busy < 4
    assert busy == pytest.approx(4 * (1 - idle_seconds(result.tallies[0], waits) / step), rel=0.05)  # settled
    assert result.host["compute_slowdown"] == pytest.approx(host.slowdown(busy, 1))
    assert result.breakdown["compute"] < unmeasured.breakdown["compute"]


def test_zero3s_gathers_are_exposed_inside_the_compute_and_the_tail_after_it(hardware):
    """A tally's dp_tail is the exposed data-parallel time after the rank's last compute (what compare's measured
    "dp communication + optimizer" row holds); ZeRO-3's gathers, which every forward and backward waits for on a CPU
    host, are the rest of the exposed dp time."""
    result = simulate_step(TINY, Layout(dp=2, zero=3), build_cluster(hardware, 2, 1), "fp32", 16, 8, gpu=hardware)
    (tally,) = result.tallies
    assert 0 < tally.dp_tail < tally.seconds["dp"]
    plain = simulate_step(TINY, Layout(dp=2), build_cluster(hardware, 2, 1), "fp32", 16, 8, gpu=hardware)
    assert 0 <= plain.tallies[0].dp_tail <= plain.tallies[0].seconds["dp"]


def test_gpus_measured_with_nccl_overlap_communication_with_compute(hardware, tmp_path):
    """The same numbers marked as measured on CUDA: ZeRO-3's gathers hide behind compute again."""
    data = hardware_to_dict(hardware)
    entry = next(iter(data["gpus"].values()))
    entry["measured"] = dict(entry["measured"], device="cuda")
    path = tmp_path / "cuda.json"
    path.write_text(json.dumps(data))
    gpu = load_hardware(str(path))
    cpu_step, gpu_step = (simulate_step(TINY, Layout(dp=2, zero=3), build_cluster(h, 2, 1), "fp32", 16, 8, gpu=h)
                          for h in (hardware, gpu))
    assert gpu_step.breakdown["compute"] == pytest.approx(cpu_step.breakdown["compute"])
    assert gpu_step.step_time_s < cpu_step.step_time_s and gpu_step.breakdown["dp_comm"] < cpu_step.breakdown["dp_comm"]


def test_communication_is_charged_in_line_only_where_each_rank_has_its_own_cores(hardware):
    from simulator.engine.host import host_compute

    host = hardware.gpu.measured  # 2 cores
    assert host_compute(host, TINY, Layout(dp=2), 1).serial  # one core each: gloo's copies take it from compute
    assert not host_compute(host, TINY, Layout(dp=4), 1).serial  # 4 ranks take turns: comm progresses meanwhile
    assert not host_compute(host, TINY, Layout(dp=2), 2).serial


def test_units_are_found_only_in_the_format_they_were_measured_in(hardware, tmp_path):
    host = hardware.gpu.measured
    assert host.unit_times(TINY, 1, dtype="fp32") is host.unit_times(TINY, 1)  # no "dtype": written as fp32
    assert host.unit_times(TINY, 1, dtype="bf16") is None  # never fp32 times for a bf16 simulation
    data = copy.deepcopy(hardware_to_dict(hardware))  # the profile's own objects are shared with `hardware`
    gpu = next(iter(data["gpus"].values()))
    gpu["measured"]["units"] = [dict(unit(1), dtype="bf16"), dict(unit(2), dtype="fp32")]
    path = tmp_path / "typed.json"
    path.write_text(json.dumps(data))
    typed = load_hardware(str(path)).gpu.measured
    assert typed.unit_times(TINY, 1, dtype="bf16").dtype == "bf16" and typed.unit_times(TINY, 1, dtype="fp32") is None
    assert typed.unit_times(TINY, 2, dtype="fp32").dtype == "fp32"
    gpu["measured"]["units"][0]["dtype"] = "int8"
    path.write_text(json.dumps(data))
    with pytest.raises(ConfigError, match=re.escape("units[0].dtype must be one of fp32, tf32, bf16, fp16, fp8")):
        load_hardware(str(path))


def test_a_simulation_uses_units_of_the_format_it_computes_in(hardware, tmp_path):
    """fp32 units price a bf16 step on a CPU host (16-bit is emulated there by fp32 matmuls), never on GPUs."""
    def step(h, precision):
        return simulate_step(TINY, Layout(dp=2), build_cluster(h, 2, 1), precision, 16, 8, gpu=h)

    assert step(hardware, "bf16").host["units_measured"] and step(hardware, "fp32").host["units_measured"]
    data = copy.deepcopy(hardware_to_dict(hardware))
    entry = next(iter(data["gpus"].values()))
    entry["measured"] = dict(entry["measured"], device="cuda")
    path = tmp_path / "cuda-fp32-units.json"
    path.write_text(json.dumps(data))
    gpu = load_hardware(str(path))
    assert step(gpu, "fp32").host["units_measured"]
    assert not step(gpu, "bf16").host["units_measured"]  # the roofline in bf16 instead of fp32 times


def test_a_unit_is_the_shape_it_was_measured_on(hardware, tmp_path):
    """The shape's options are keys: a tiny-llama unit never prices the tiny GPT or the reverse; a unit without
    them (written before they were keys, as MEASURED's) was a GPT-2-style block."""
    llama = preset("tiny-llama")
    host = hardware.gpu.measured
    assert host.unit_times(TINY, 1) is not None and host.unit_times(llama, 1) is None
    assert host.unit_times(TINY.with_(n_kv_heads=2), 1) is None and host.unit_times(TINY.with_(bias=False), 1) is None
    data = copy.deepcopy(hardware_to_dict(hardware))
    gpu = next(iter(data["gpus"].values()))
    options = {"kv_heads": 2, "mlp": "swiglu", "norm": "rmsnorm", "positions": "rope", "bias": False}
    shaped = dict(unit(1), d_ff=llama.d_ff, **options)
    explicit_gpt = dict(unit(2), kv_heads=4, mlp="gelu", norm="layernorm", positions="learned", bias=True)
    gpu["measured"]["units"] = [shaped, explicit_gpt]
    path = tmp_path / "llama.json"
    path.write_text(json.dumps(data))
    measured = load_hardware(str(path)).gpu.measured
    assert measured.unit_times(llama, 1).series == measured.units[0].series
    assert measured.unit_times(TINY, 1) is None and measured.unit_times(llama.with_(d_ff=TINY.d_ff), 1) is None
    assert measured.unit_times(TINY, 2) is measured.units[1]  # the defaults, written out, are the same GPT
    for change in options:  # one option off: another shape
        other = dict(shaped, **{change: {"kv_heads": 4, "mlp": "gelu", "norm": "layernorm", "positions": "learned",
                                         "bias": True}[change]})
        gpu["measured"]["units"] = [other]
        path.write_text(json.dumps(data))
        assert load_hardware(str(path)).gpu.measured.unit_times(llama, 1) is None, change
    for breakage, words in ((dict(kv_heads=3), "kv_heads must be a positive integer dividing n_heads=4"),
                            (dict(kv_heads=True), "kv_heads must be"), (dict(mlp="relu"), "mlp must be one of"),
                            (dict(norm="batchnorm"), "norm must be one of"),
                            (dict(positions="alibi"), "positions must"), (dict(bias="no"), "bias must be true or false")):
        gpu["measured"]["units"] = [dict(shaped, **breakage)]
        path.write_text(json.dumps(data))
        with pytest.raises(ConfigError, match=re.escape(f"units[0].{words}")):
            load_hardware(str(path))


def test_a_mixture_of_experts_is_priced_by_its_own_unit_and_the_measured_all_to_all(hardware, tmp_path):
    """A MoE block is a shape of its own: its unit ("experts") prices the MoE blocks, the dense unit of the same sizes
    the dense first blocks; without a MoE unit the roofline prices the model and the host says so (never the dense
    unit, as a MoE model once was); the experts' all-to-alls take the measured all_to_all."""
    from simulator.engine.host import HostLinks, host_compute

    moe = preset("tiny-moe")
    experts = {"n_experts": 8, "top_k": 2, "d_expert": 256, "n_shared_experts": 0, "router": "softmax",
               "capacity_factor": None}
    moe_unit = dict(unit(1), experts=experts)
    for name in ("block_forward", "block_backward"):
        moe_unit[name] = [3 * t for t in moe_unit[name]]
    data = copy.deepcopy(hardware_to_dict(hardware))
    gpu = next(iter(data["gpus"].values()))
    gpu["measured"]["units"].append(moe_unit)
    gpu["measured"]["collectives"].append({"kind": "all_to_all", "group": 2, "active": 2, "alpha": 1e-3, "beta": 1e-9})
    path = tmp_path / "moe.json"
    path.write_text(json.dumps(data))
    host = load_hardware(str(path)).gpu.measured
    assert host.unit_times(moe, 1).series == host.units[-1].series and host.unit_times(TINY, 1) is host.units[0]
    assert host.unit_times(moe.with_(top_k=1), 1) is None and host.unit_times(moe.with_(d_expert=128), 1) is None
    mixed = moe.with_(dense_layers=1)  # a dense first block: the dense unit's
    compute = host_compute(host, mixed, Layout(), 1)
    roofline = (1.0, 2.0, 0.0)
    assert compute.chunk(1, False, False, 4, "none", roofline, moe=True)[0] == pytest.approx(3 * (1e-3 + 4e-3))
    assert compute.chunk(1, False, False, 4, "none", roofline, moe=False)[0] == pytest.approx(1e-3 + 4e-3)
    assert compute.chunk(0, True, False, 4, "none", roofline)[0] == pytest.approx(1e-4 + 4e-4) and not compute.missing
    unmeasured = host_compute(hardware.gpu.measured, moe, Layout(), 1)  # the dense unit only: the roofline, said
    assert unmeasured.units is None and "mixture of experts' blocks" in unmeasured.missing
    for other in (moe.with_(router_bias=True), TINY.with_(positions="rope", attention_sinks=True),
                  TINY.with_(window=8, full_attention_every=2)):  # what a unit's key does not tell apart: said
        priced = host_compute(host, other, Layout(), 1)
        assert priced.units is None and "roofline" in priced.missing
    result = simulate_step(moe, Layout(), build_cluster(hardware, 1, 1), "fp32", 8, 8, gpu=hardware)
    assert not result.host["units_measured"] and "roofline" in result.provenance["compute"]
    links = HostLinks(build_cluster(hardware, 2, 1), Layout(dp=2, ep=2), host)
    assert links.all_to_all(0, 2**20) == pytest.approx(1e-3 + 2**20 * 1e-9)
    step = simulate_step(moe, Layout(dp=2, ep=2), build_cluster(hardware, 2, 1), "fp32", 16, 8,
                         gpu=load_hardware(str(path)))
    assert step.host["units_measured"] and step.breakdown["ep_comm"] > 0
    gpu["measured"]["units"][-1]["experts"] = dict(experts, top_k=9)
    path.write_text(json.dumps(data))
    with pytest.raises(ConfigError, match=re.escape("units[2].experts.top_k must be at most n_experts=8")):
        load_hardware(str(path))


def test_latent_attention_is_priced_by_its_own_unit(hardware, tmp_path):
    """Multi-head latent attention is a shape of its own ("latent" in a unit): its unit prices it, an ordinary unit
    of the same sizes never does, nor the reverse; a latent of other widths is another shape; a bad one is refused."""
    base = preset("tiny-llama").with_(n_kv_heads=None, n_layers=TINY.n_layers, seq_len=TINY.seq_len,
                                      d_ff=TINY.d_ff, d_head=32)
    latent = base.with_(kv_lora_rank=32, q_lora_rank=64, rope_head_dim=16)
    shape = {"kv_heads": 4, "mlp": "swiglu", "norm": "rmsnorm", "positions": "rope", "bias": False, "d_head": 32}
    widths = {"kv_lora_rank": 32, "q_lora_rank": 64, "rope_head_dim": 16, "v_head_dim": 32}
    data = copy.deepcopy(hardware_to_dict(hardware))
    gpu = next(iter(data["gpus"].values()))
    gpu["measured"]["units"] = [dict(unit(1), **shape, latent=widths), dict(unit(2), **shape)]
    path = tmp_path / "latent.json"
    path.write_text(json.dumps(data))
    host = load_hardware(str(path)).gpu.measured
    assert host.unit_times(latent, 1) is host.units[0] and host.unit_times(base, 2) is host.units[1]
    assert host.unit_times(latent, 2) is None and host.unit_times(base, 1) is None
    assert host.unit_times(latent.with_(q_lora_rank=0), 1) is None and host.unit_times(latent.with_(d_value=16), 1) is None
    gpu["measured"]["units"][0]["latent"] = dict(widths, rope_head_dim=0)
    path.write_text(json.dumps(data))
    with pytest.raises(ConfigError, match=re.escape("units[0].latent.rope_head_dim must be a positive integer")):
        load_hardware(str(path))


def test_a_synchronous_step_waits_for_its_slowest_rank_as_the_measured_variation_says(hardware, tmp_path):
    """With the variation calibrate measured (a rank's coefficient of variation with k ranks busy), the compute of
    a k-rank step is the unvaried one times 1 + cv E[max of k standard normals]: for two ranks E = 1 / sqrt(pi).
    One rank waits for no one; a profile without the field varies nothing."""
    import math

    data = hardware_to_dict(hardware)
    name = next(iter(data["gpus"]))
    data["gpus"][name]["measured"]["variation"] = [[1, 1, 0.05], [2, 1, 0.1], [4, 1, 0.2]]
    (tmp_path / "varied.json").write_text(json.dumps(data))
    varied = load_hardware(str(tmp_path / "varied.json"))
    host = varied.gpu.measured
    assert host.variation_cv(2, 1) == 0.1 and host.variation_cv(3, 1) == pytest.approx(0.15)
    assert host.variation_cv(8, 1) == 0.2 and hardware.gpu.measured.variation_cv(2, 1) == 0.0

    def step(gpu, dp: int):
        return simulate_step(TINY, Layout(dp=dp), build_cluster(gpu, dp, 1), "fp32", 8 * dp, 8, gpu=gpu)

    plain, waiting = step(hardware, 2), step(varied, 2)
    factor = 1 + 0.1 / math.sqrt(math.pi)
    assert waiting.breakdown["compute"] == pytest.approx(plain.breakdown["compute"] * factor)
    assert waiting.host["straggler_factor"] == pytest.approx(factor) and waiting.host["straggler_cv"] == 0.1
    assert step(varied, 1).breakdown["compute"] == pytest.approx(step(hardware, 1).breakdown["compute"])
    four = step(varied, 4).host["straggler_factor"]
    assert four == pytest.approx(1 + 0.2 * 1.0293754)  # E[max of 4] (Harter's tables: 1.02938)
    data["gpus"][name]["measured"]["variation"] = [[2, 1, -0.1]]
    (tmp_path / "broken.json").write_text(json.dumps(data))
    with pytest.raises(ConfigError, match=re.escape("variation[0] coefficient of variation")):
        load_hardware(str(tmp_path / "broken.json"))


def test_a_measured_stragglers_factor_is_the_steps_factor_at_its_rank_count(hardware, tmp_path):
    """calibrate's stragglers rows (the slowest of runs taken in step over their mean) take the place of the
    variation rows: at a measured rank count the step's straggler factor is the measured one; between counts the
    coefficient of variation each implies is interpolated; a factor below 1 is refused."""
    data = hardware_to_dict(hardware)
    name = next(iter(data["gpus"]))
    data["gpus"][name]["measured"]["variation"] = [[2, 1, 0.5]]  # an old profile's pooled spread: not used
    data["gpus"][name]["measured"]["stragglers"] = [[2, 1, 1.1], [4, 1, 1.05]]
    (tmp_path / "stragglers.json").write_text(json.dumps(data))
    host = load_hardware(str(tmp_path / "stragglers.json")).gpu.measured
    two, four = 0.1 / max_moments(2)[0], 0.05 / max_moments(4)[0]
    assert host.variation_cv(2, 1) == pytest.approx(two) and host.variation_cv(4, 1) == pytest.approx(four)
    assert host.variation_cv(3, 1) == pytest.approx((two + four) / 2)
    assert straggler_factor(host.variation_cv(4, 1), 4) == pytest.approx(1.05)
    data["gpus"][name]["measured"]["stragglers"] = [[2, 1, 0.9]]
    (tmp_path / "broken.json").write_text(json.dumps(data))
    with pytest.raises(ConfigError, match=re.escape("stragglers: a slowest rank's factor is at least 1")):
        load_hardware(str(tmp_path / "broken.json"))


def test_zero_bubbles_halves_are_priced_from_the_measured_halves(hardware, tmp_path):
    """A unit with its block's backward timed in zero-bubble's two halves (parallel/calibrate/device.py's split_runs)
    prices a split chunk's BackwardInput and BackwardWeight with them, their sum above the whole backward; a unit
    without them (older profiles) halves the backward."""
    from job.schedule import BackwardInput, BackwardWeight, ScheduleConfig
    from simulator.engine.costs import rank_costs
    from simulator.engine.host import host_compute
    from simulator.engine.links import LinkCosts
    from simulator.memory import predict_memory

    data = hardware_to_dict(load_hardware("a100-80gb"))
    measured = next(iter(data["gpus"].values()))["measured"] = copy.deepcopy(MEASURED)  # as the fixture's
    for entry in measured["units"]:
        entry["block_backward_input"] = [1.5e-3 + 1.5e-3 * b / entry["tp"] for b in SIZES]  # 0.75 + 0.6 of the
        entry["block_backward_weight"] = [1.2e-3 + 1.2e-3 * b / entry["tp"] for b in SIZES]  # whole: 1.35 x it
    path = tmp_path / "split.json"
    path.write_text(json.dumps(data))
    split = load_hardware(str(path))
    layout, schedule = Layout(pp=2), ScheduleConfig(2, 4, "zb-h1")
    cluster = build_cluster(split, 2, 1)
    blocks = TINY.n_layers // 2  # the last stage's: its blocks and the head
    prices = {}
    for name, hw in (("halves", hardware), ("measured", split)):
        host = host_compute(hw.gpu.measured, TINY, layout, 1, "fp32")
        memory = predict_memory(TINY, layout, "fp32", 2)
        costs = rank_costs(TINY, layout, schedule, LinkCosts(cluster, layout), hw.gpu, "fp32", 2, "none", None,
                           memory, 25.0, host=host)
        prices[name] = (costs[1].actions[(BackwardInput, 1)].compute, costs[1].actions[(BackwardWeight, 1)].compute)
    units = split.gpu.measured.unit_times(TINY, 1)
    slowdown = split.gpu.measured.slowdown(2, 1)
    head = units.seconds("head_backward", 2) / 2
    assert prices["measured"][0] == pytest.approx(slowdown * (blocks * units.seconds("block_backward_input", 2) + head))
    assert prices["measured"][1] == pytest.approx(slowdown * (blocks * units.seconds("block_backward_weight", 2) + head))
    whole = slowdown * (blocks * units.seconds("block_backward", 2) + 2 * head)
    assert prices["halves"] == pytest.approx((whole / 2, whole / 2))
    assert sum(prices["measured"]) == pytest.approx(slowdown * (1.35 * blocks * units.seconds("block_backward", 2)
                                                                 + 2 * head))
    bad = copy.deepcopy(data)
    del next(iter(bad["gpus"].values()))["measured"]["units"][0]["block_backward_weight"]
    path.write_text(json.dumps(bad))
    with pytest.raises(ConfigError, match="both halves"):
        load_hardware(str(path))
