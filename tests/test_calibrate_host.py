"""parallel/calibrate/host.py and device.py without starting ranks: the plans, the pieces' shapes,
the profile's assembly, the device's clock and each measurement on an explicit device."""

from __future__ import annotations

import pytest
import torch

from minigpt.presets import preset
from minigpt.errors import ConfigError
from parallel.calibrate.measure import fit_alpha_beta, make_plan
from parallel.calibrate.device import AloneCollectives, piece_model, piece_step, tp_sizes, variants
from parallel.calibrate.host import build_measured, collective_points, group_pairs, powers_up_to


def test_the_loads_and_group_sizes():
    assert powers_up_to(8, 2) == [2, 4, 8] and powers_up_to(6, 2) == [2, 4, 6] and powers_up_to(1, 2) == []
    assert group_pairs(8) == [(2, 2), (4, 2), (4, 4), (8, 2), (8, 4), (8, 8)]
    assert group_pairs(6) == [(2, 2), (4, 2), (4, 4), (6, 2), (6, 6)]
    assert group_pairs(3) == [(2, 2), (3, 3)] and group_pairs(1) == []
    assert tp_sizes(preset("tiny"), 8) == [1, 2, 4]  # 4 heads: no tp 8
    assert tp_sizes(preset("tiny"), 2) == [1, 2] and tp_sizes(preset("tiny"), 1) == [1]
    assert tp_sizes(preset("small"), 8) == [1, 2]  # 6 heads


def test_the_pieces_are_one_tensor_parallel_ranks_modules_and_communicate_nothing():
    from dataclasses import replace

    assert variants(preset("tiny"), 8) == [(1, False, 1), (2, False, 1), (2, True, 1), (4, False, 1), (4, True, 1),
                                           (1, False, 2), (1, False, 4), (1, False, 8)]  # 128 tokens: 16 chunks at cp 8
    assert variants(preset("tiny").with_(seq_len=24), 8)[-2:] == [(1, False, 2), (1, False, 4)]  # 24 % 16: no cp 8
    assert variants(preset("tiny"), 8, ())[-1] == (4, True, 1)  # calibrate --cp 1: no context-parallel unit
    from parallel.calibrate.measure import make_plan

    assert make_plan(4, cp=(1,)).context_parallel == () and make_plan(4, cp=(4, 2)).context_parallel == (2, 4)
    assert make_plan(8).context_parallel == (2, 4, 8)
    config = replace(preset("tiny"), vocab_size=257)
    model = piece_model(config, 2)
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    assert shapes["tok_emb.weight"] == (129, 128)  # 257 padded to 258, half on this rank
    assert {s for n, s in shapes.items() if "qkv" in n and n.endswith("weight")} == {(3 * 128 // 2, 128)}
    assert {s for n, s in shapes.items() if "fc2" in n and n.endswith("weight")} == {(128, 256)}
    for sp in (False, True):
        for piece in ("block", "embedding", "head"):
            forward, backward = piece_step(piece, config, 2, 1, sequence_parallel=sp)()
            assert forward > 0 and backward > 0
    moe = preset("tiny-moe").with_(seq_len=16, n_layers=3, dense_layers=1)  # a MoE unit times its MoE blocks only
    moe_model = piece_model(moe, 1)
    calls = []
    for block in moe_model.blocks:
        block.register_forward_hook(lambda module, args, out, mlp=type(block.mlp).__name__: calls.append(mlp))
    assert all(t > 0 for t in piece_step("block", moe, 1, 1, moe_model)()) and calls == ["MoE", "MoE"]
    with torch.no_grad():  # under sequence parallelism a rank holds half the sequence between the layers
        assert piece_model(config, 2, True).embed(torch.zeros(1, config.seq_len, dtype=torch.long)).shape[1] == 64
    group = AloneCollectives(4)
    full, shard = torch.arange(8.0), torch.tensor([5.0, 6.0])
    group.all_gather(full, shard)
    assert full.tolist() == [5.0, 6.0] * 4 and group.calls == {}  # a local copy, nothing counted or sent
    group.reduce_scatter(shard, torch.arange(8.0))
    assert shard.tolist() == [0.0, 1.0]


def host(rank: int, units=None, busy=None, threads_ratio=None, collectives=None) -> dict:
    sharing = {"busy": busy or {}}
    if threads_ratio is not None:
        sharing["threads_ratio"] = threads_ratio
    return {"cores": 2, "units": units, "sharing": sharing, "collectives": collectives or {}, "seconds": {}}


def test_the_measured_field_is_assembled_from_every_rank():
    plan = make_plan(4, quick=True)
    series = {f"{p}_{w}": [1e-3, 2e-3, 4e-3] for p in ("block", "embedding", "head") for w in ("forward", "backward")}
    hosts = [
        host(0, {("tiny", 1, False, 1, "fp32"): series, ("tiny", 2, False, 1, "fp32"): series},
             {1: 0.010, 2: 0.012, 4: 0.020}, threads_ratio=0.6,
             collectives={("all_reduce", 2, 2, 4096): 1e-3, ("all_reduce", 2, 2, 2**20): 2e-3,
                          ("p2p", 2, 2, 4096): 1e-4, ("all_reduce", 4, 4, 4096): 3e-3}),
        host(1, None, {2: 0.014, 4: 0.024},
             collectives={("all_reduce", 2, 2, 4096): 1.5e-3, ("all_reduce", 2, 2, 2**20): 1e-3,
                          ("p2p", 2, 2, 4096): 2e-4, ("all_reduce", 4, 4, 4096): 2e-3}),
    ]
    points = collective_points(hosts)
    assert points[("all_reduce", 2, 2)] == [[4096, 1.5e-3], [2**20, 2e-3]]  # the slowest rank per size
    measured = build_measured(hosts, plan, fit_alpha_beta)
    assert measured["cores"] == 2 and [u["tp"] for u in measured["units"]] == [1, 2]
    assert measured["units"][0]["micro_batches"] == [1, 4, 16] and measured["units"][0]["vocab_size"] == 256
    assert measured["sharing"] == [[1, 1, 1.0], [2, 1, pytest.approx(1.3)], [4, 1, pytest.approx(2.2)],
                                   [1, 2, pytest.approx(0.6)]]
    assert [(c["kind"], c["group"], c["active"]) for c in measured["collectives"]] == [
        ("all_reduce", 2, 2), ("p2p", 2, 2), ("all_reduce", 4, 4)]
    for fit in measured["collectives"]:
        assert fit["alpha"] >= 0 and fit["beta"] > 0


def test_units_carry_their_format_and_price_only_a_run_in_it():
    """On a GPU calibrate times the units in fp32 and bf16 (UNIT_FORMATS): each unit says its format, and a bf16
    simulation finds the bf16 one, an fp32 simulation the fp32 one (never the other's). The bf16 piece model is the
    bf16 policy's cast of the same model, and its step runs (here on the CPU, where training would emulate it)."""
    from parallel.calibrate.device import piece_model, piece_step
    from parallel.calibrate.host import UNIT_FORMATS
    from simulator.costs.host import parse_measured_host

    assert UNIT_FORMATS == {"cpu": ("fp32",), "cuda": ("fp32", "bf16")}
    fp32 = {f"{p}_{w}": [1e-3, 2e-3, 4e-3] for p in ("block", "embedding", "head") for w in ("forward", "backward")}
    bf16 = {name: [t / 4 for t in times] for name, times in fp32.items()}
    plan = make_plan(1, quick=True)
    units = {("tiny", 1, False, 1, "fp32"): fp32, ("tiny", 1, False, 1, "bf16"): bf16}
    measured = build_measured([host(0, units, {1: 0.01})], plan, fit_alpha_beta)
    assert [u["dtype"] for u in measured["units"]] == ["bf16", "fp32"]
    parsed = parse_measured_host(measured, "profile")
    for fmt, series in (("fp32", fp32), ("bf16", bf16)):
        assert parsed.unit_times(preset("tiny"), 1, dtype=fmt).series["block_forward"] == tuple(series["block_forward"])
    assert parsed.unit_times(preset("tiny"), 1, dtype="fp16") is None
    model = piece_model(preset("tiny"), 1, precision="bf16")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    forward, backward = piece_step("block", preset("tiny"), 1, 2, model)()
    assert forward > 0 and backward > 0


def test_units_carry_the_shape_the_simulator_keys_them_by():
    """build_measured writes every option simulator/costs/host.py keys a unit by: a tiny-llama profile prices tiny-llama
    and never the tiny GPT of the same width, and the reverse; tp must divide the kv heads to be measured."""
    from simulator.costs.host import parse_measured_host

    assert variants(preset("tiny-llama"), 8)[:3] == [(1, False, 1), (2, False, 1), (2, True, 1)]  # 2 kv heads: no tp 4
    assert (4, False, 1) in variants(preset("tiny"), 8)
    series = {f"{p}_{w}": [1e-3, 2e-3, 4e-3] for p in ("block", "embedding", "head") for w in ("forward", "backward")}
    # MoE: sp as a dense block's (each tp rank routes its slice); cp too (it routes its own chunks there:
    # parallel/calibrate/ rehearses the cp group)
    assert variants(preset("tiny-moe"), 8) == [(1, False, 1), (2, False, 1), (2, True, 1), (4, False, 1), (4, True, 1),
                                              (1, False, 2), (1, False, 4), (1, False, 8)]
    for name, other in (("tiny-llama", "tiny"), ("tiny", "tiny-llama"), ("tiny-moe", "tiny"), ("tiny", "tiny-moe")):
        plan = make_plan(2, quick=True, model=name)
        units = {(name, 1, False, 1, "fp32"): series, (name, 2, True, 1, "fp32"): series}
        measured = build_measured([host(0, units, {1: 0.01})], plan, fit_alpha_beta)
        config = preset(name)
        assert {k: measured["units"][0][k] for k in ("kv_heads", "mlp", "norm", "positions", "bias")} == {
            "kv_heads": config.kv_heads, "mlp": config.mlp, "norm": config.norm, "positions": config.positions,
            "bias": config.bias}
        assert ("experts" in measured["units"][0]) == config.is_moe  # a MoE block is a shape of its own
        parsed = parse_measured_host(measured, "profile")
        assert parsed.unit_times(config, 1) is not None and parsed.unit_times(config, 2, True).sequence_parallel
        assert parsed.unit_times(preset(other), 1) is None


# ---------------------------------------------------------------- the device (CPU here; CUDA's branches faked)


CPU, CUDA = torch.device("cpu"), torch.device("cuda", 0)
H200 = {"type": "cuda", "name": "NVIDIA H200", "backend": "nccl", "memory_bytes": 150 * 10**9, "sms": 132}


def small_plan(ranks: int = 1, **changes):
    from dataclasses import replace

    return replace(make_plan(ranks, quick=True), matmul_sizes=(32, 64), micro_batches=(1, 2), repeats=2,
                   min_run_s=0.001, copy_bytes=2**20, micro_batch=2, **changes)


def test_the_clock_waits_for_a_gpu_and_not_for_a_cpu(monkeypatch):
    from parallel.calibrate.device import stamp
    from parallel.device import synchronize

    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append(device))
    synchronize(CPU)
    before = stamp(CPU)
    assert calls == [] and stamp(CPU) >= before  # a no-op on the CPU
    stamp(CUDA)
    synchronize(CUDA)
    assert calls == [CUDA, CUDA]  # a timer read on a GPU waits for its queued kernels


def test_tf32_is_off_only_while_a_gpus_fp32_matmuls_are_timed():
    from parallel.calibrate.device import strict_fp32

    saved = torch.backends.cuda.matmul.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = True
        with strict_fp32(CUDA):
            assert torch.backends.cuda.matmul.allow_tf32 is False
        assert torch.backends.cuda.matmul.allow_tf32 is True  # restored
        with strict_fp32(CPU):
            assert torch.backends.cuda.matmul.allow_tf32 is True  # a CPU has no TF32: left alone
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved


def test_the_device_decides_sizes_and_its_description(monkeypatch):
    from parallel.calibrate.device import copy_bytes, describe, matmul_sizes

    plan = make_plan(1)
    assert matmul_sizes(plan, CPU) == (64, 128, 256, 512, 1024) and max(matmul_sizes(plan, CUDA)) == 8192
    assert make_plan(1, quick=True).cuda_matmul_sizes == (256, 1024, 4096)
    assert copy_bytes(small_plan(), CPU) == 2**20 and copy_bytes(small_plan(), CUDA) == 256 * 2**20  # past the L2
    assert describe(CPU) == {"type": "cpu", "name": "cpu", "backend": "gloo", "memory_bytes": None}

    class Properties:
        total_memory = H200["memory_bytes"]
        multi_processor_count = H200["sms"]

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: Properties())
    assert describe(CUDA) == H200


def test_every_measurement_runs_on_the_device_it_is_given():
    from parallel.calibrate.device import measure_block, measure_copy, measure_matmuls, timed_runs
    from parallel.calibrate.host import measure_host

    plan = small_plan()
    matmuls = measure_matmuls(plan, CPU, ("fp32", "bf16", "fp8"))
    assert list(matmuls["rates"]) == ["fp32", "bf16", "fp8"] and matmuls["refused"] == {}
    assert sorted(matmuls["rates"]["fp32"]["square"]) == [32, 64] and matmuls["launch_latency"] > 0
    assert all(rate > 0 for shapes in matmuls["rates"].values() for shape in shapes.values() for rate in shape.values())
    assert all(spread >= 0 for spread in matmuls["spread"].values())
    refused = measure_matmuls(plan, CPU, ("fp32", "tf32"))  # a CPU has no TF32: recorded, not measured
    assert list(refused["rates"]) == ["fp32"] and "CUDA" in refused["refused"]["tf32"]
    assert measure_copy(plan, CPU) > 0
    block = measure_block(plan, CPU)
    assert block["forward_s"] > 0 and block["backward_s"] > 0 and block["micro_batch"] == 2
    step = piece_step("head", preset("tiny"), 1, 2, device=CPU)
    runs = timed_runs(step, 2, 0.0)
    assert len(runs) == 2 and all(f > 0 and b > 0 for f, b in runs)
    host_result = measure_host(plan, CPU)  # one rank, no process group: units and sharing
    assert host_result["cores"] >= 1 and set(host_result["units"]) == {("tiny", 1, False, 1, "fp32")}
    assert list(host_result["sharing"]["busy"]) == [1] and host_result["collectives"] == {}


def test_on_cuda_the_gpus_are_the_cores_and_there_is_no_threads_row(monkeypatch):
    import parallel.calibrate.host as calibrate_host

    real_sharing, seen = calibrate_host.measure_sharing, {}

    def sharing(plan, rank, ranks, cores, device, noise=None):
        seen["cores"] = cores
        return real_sharing(plan, rank, ranks, 4, device, noise)  # as if with 4 cores: still no threads row on a GPU

    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(calibrate_host, "measure_units", lambda plan, rank, ranks, device, noise=None: {})
    monkeypatch.setattr(calibrate_host, "piece_step", lambda *args, **kwargs: lambda: (1e-3, 2e-3))  # no tensors
    monkeypatch.setattr(calibrate_host, "measure_sharing", sharing)
    result = calibrate_host.measure_host(small_plan(), CUDA)
    assert result["cores"] == 1 and seen["cores"] == 1  # one rank: one GPU
    assert result["sharing"]["busy"] == {1: pytest.approx(3e-3)} and "threads_ratio" not in result["sharing"]
    assert set(result["sharing"]["runs"]) == {1}  # each busy count's runs: the variation of a rank's time
    assert "threads_ratio" in real_sharing(small_plan(), 0, 1, 4, CPU)


def fake_rank(rank: int, device: dict, sizes=(256, 1024, 4096), busy=None, formats=("fp32",), refused=None) -> dict:
    """One rank's measurements as measure_rank returns them (fake numbers, real shapes): fp32 at
    4e13 (square) and 5e13 (GPT-shaped) FLOP/s at the largest size, other formats a multiple of it."""
    series = {f"{p}_{w}": [1e-4, 2e-4, 5e-4] for p in ("block", "embedding", "head") for w in ("forward", "backward")}
    collectives = {(kind, 2, 2, size): 1e-5 + size / 1e11 for kind in ("all_reduce", "all_gather", "reduce_scatter",
                                                                        "p2p") for size in (4096, 2**20, 8 * 2**20)}
    units = {("tiny", 1, False, 1, "fp32"): series, ("tiny", 2, False, 1, "fp32"): series} if rank == 0 else None
    result = {"device": device, "host": host(rank, units, busy or {1: 0.010, 2: 0.0101}, collectives=collectives)}
    result["host"]["seconds"] = {"matmuls_copy_block": 1.0, "units": 1.0}
    if rank == 0:
        scale = {"fp32": 1, "tf32": 8, "bf16": 16, "fp16": 16, "fp8": 32}
        rates = {fmt: {"square": {n: 4e13 * scale[fmt] * n / 4096 for n in sizes},
                       "gpt": {n: 5e13 * scale[fmt] * n / 4096 for n in sizes}} for fmt in formats}
        result.update(matmuls={"rates": rates, "spread": {fmt: 0.01 for fmt in formats}, "refused": refused or {},
                               "launch_latency": 5e-6},
                      copy_bandwidth=4e12, block={"model": "tiny", "micro_batch": 8, "seq_len": 128, "d_model": 128,
                                                  "forward_s": 1e-4, "backward_s": 2e-4})
    return result


def test_a_cuda_profile_says_cuda_nccl_and_the_gpu(tmp_path):
    import json

    from parallel.calibrate.measure import build_profile
    from simulator.costs.hardware import load_hardware

    plan = make_plan(2, quick=True)
    profile = build_profile([fake_rank(0, H200), fake_rank(1, H200, busy={2: 0.0102})], plan, "cuda-calibrated",
                            16, "2030-01-01")
    gpu = profile["gpus"]["cuda-calibrated"]
    assert "CUDA" in gpu["source"] and "NVIDIA H200" in gpu["source"] and "nccl" in gpu["source"]
    assert "TF32 off" in gpu["source"] and gpu["peak_flops"]["fp32"] == 5e13 and gpu["peak_flops"]["tf32"] is None
    assert gpu["hbm_bytes"] == H200["memory_bytes"] and gpu["hbm_bandwidth"] == 4e12
    assert [n for n, _ in gpu["matmul_efficiency"]["fp32"]] == [256, 1024, 4096]
    note = gpu["calibration"]
    assert (note["backend"], note["device"], note["device_name"]) == ("nccl", "cuda", "NVIDIA H200")
    assert note["cores"] == 2 and note["ranks_per_core"] == 1.0 and not note["oversubscribed"]  # the GPUs, not 16 cores
    assert note["plan"]["matmul_sizes"] == [256, 1024, 4096] and "allow_tf32 = False" in note["peak_note"]
    assert [row[:2] for row in gpu["measured"]["sharing"]] == [[1, 1], [2, 1]]  # no [1, cores] threads row
    path = tmp_path / "cuda.json"
    path.write_text(json.dumps(profile))
    hardware = load_hardware(str(path))
    assert hardware.gpu.calibration["backend"] == "nccl"
    from simulator.engine.simulate import simulate_step  # the simulator takes it as it takes a CPU profile
    from job.layout import Layout
    from simulator.network.topology import build_cluster

    result = simulate_step(preset("tiny"), Layout(dp=2), build_cluster(hardware, 2, 1), "fp32", 16, 8,
                           profile=hardware.gpu.matmul_efficiency, gpu=hardware)
    assert result.step_time_s > 0 and result.host["compute_slowdown"] == pytest.approx(1.015)  # (1.01 + 1.02) / 2

    cpu = {"type": "cpu", "name": "cpu", "backend": "gloo", "memory_bytes": None}
    with pytest.raises(Exception, match="different devices"):
        build_profile([fake_rank(0, H200), fake_rank(1, cpu)], plan, "x", 16, "2030-01-01")
    cpu_gpu = build_profile([fake_rank(0, cpu, sizes=(64, 256, 512)), fake_rank(1, cpu)], plan, "x", 16,
                            "2030-01-01")["gpus"]["x"]
    assert cpu_gpu["calibration"]["backend"] == "gloo" and cpu_gpu["calibration"]["cores"] == 16
    assert "on the CPU" in cpu_gpu["source"] and cpu_gpu["peak_flops"]["tf32"] == cpu_gpu["peak_flops"]["fp32"]


def test_several_models_are_timed_in_one_calibration():
    plan = make_plan(2, quick=True, model="tiny,tiny-llama")
    assert (plan.model, plan.unit_models) == ("tiny", ("tiny", "tiny-llama"))
    series = {f"{p}_{w}": [1e-3, 2e-3, 4e-3] for p in ("block", "embedding", "head") for w in ("forward", "backward")}
    units = {("tiny-llama", 1, False, 1, "fp32"): series, ("tiny", 2, False, 1, "fp32"): series,
             ("tiny", 1, False, 1, "fp32"): series}
    measured = build_measured([host(0, units, {1: 0.01})], plan, fit_alpha_beta)
    assert [(u["mlp"], u["tp"]) for u in measured["units"]] == [("gelu", 1), ("gelu", 2), ("swiglu", 1)]
    for bad, words in (("tiny,tiny", "twice"), ("tiny,llama9", "llama9")):
        with pytest.raises(ConfigError, match=words):
            make_plan(2, quick=True, model=bad)


def test_the_stragglers_row_is_the_slowest_rank_of_runs_taken_in_step_over_their_mean():
    """measured["stragglers"]: per busy count of two or more, the mean over run indices (runs taken in step) of the
    slowest busy rank's run over the mean of every run. Ranks that take turns (one slow where the other is fast)
    wait for the slowest of each pair of runs, not for the pooled spread."""
    plan = make_plan(2, quick=True)
    zero, one = host(0, {}, {1: 0.010, 2: 0.011}), host(1, {}, {2: 0.013})
    zero["sharing"]["runs"] = {1: [0.010, 0.010, 0.010], 2: [0.010, 0.016]}
    one["sharing"]["runs"] = {2: [0.016, 0.010]}
    measured = build_measured([zero, one], plan, fit_alpha_beta)
    assert measured["stragglers"] == [[2, 1, pytest.approx(0.016 / 0.013)]]
    assert "variation" not in measured
    one["sharing"]["runs"] = {2: [0.010, 0.016]}  # both slow at once: nobody waits
    assert build_measured([zero, one], plan, fit_alpha_beta)["stragglers"] == [[2, 1, pytest.approx(1.0)]]


def test_the_failure_costs_are_fitted_from_the_checkpoint_points_and_the_ranks_start(tmp_path):
    """measured["failure_costs"] (parallel/calibrate/storage.py): write and read lines over all ranks' bytes, the
    start from the launch to the last rank up, the launcher's monitor interval; the simulator reads them back."""
    import json

    from parallel.calibrate.measure import build_profile
    from parallel.launch.elastic import MONITOR_INTERVAL_S
    from simulator.costs.hardware import load_hardware

    cpu = {"type": "cpu", "name": "cpu", "backend": "gloo", "memory_bytes": None}
    ranks = [fake_rank(0, cpu, sizes=(64, 256, 512)), fake_rank(1, cpu)]
    ranks[0]["checkpoint"] = {"write": [[2**21, 0.003], [2**24, 0.017]], "read": [[2**21, 0.002], [2**24, 0.009]]}
    profile = build_profile(ranks, make_plan(2, quick=True), "x", 2, "2030-01-01", start_s=3.25)
    costs = profile["gpus"]["x"]["measured"]["failure_costs"]
    assert costs["start_s"] == 3.25 and costs["monitor_s"] == MONITOR_INTERVAL_S
    assert costs["write"]["beta"] == pytest.approx(0.014 / (2**24 - 2**21))  # two points: the line through them
    path = tmp_path / "p.json"
    path.write_text(json.dumps(profile))
    measured = load_hardware(str(path)).gpu.measured.failure_costs
    assert measured.write.seconds(2**23) == pytest.approx(0.003 + 0.014 * (2**23 - 2**21) / (2**24 - 2**21))
    assert measured.restart_seconds(2**24) == pytest.approx(MONITOR_INTERVAL_S + 3.25 + 0.009)
    assert "failure_costs" not in build_profile(ranks, make_plan(2, quick=True), "x", 2, "2030-01-01")["gpus"]["x"][
        "measured"]  # no start measured: no failure costs
