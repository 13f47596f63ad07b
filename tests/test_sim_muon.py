"""Muon priced (`minigpt simulate --optimizer muon`, simulator/engine/muon.py): the optimizer states a rank keeps
(the momentum alone for its matrices: tests/test_muon.py holds them to training's, rank for rank), the Newton-Schulz
GEMMs of the busiest rank of a stage as training deals the matrices out, the two all-to-alls split between NVLink
and the NICs, and what a user reads."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from cli.main import main
from job.layout import Layout
from job.muon import assign_matrices, newton_schulz_flops, stage_matrices
from minigpt.presets import preset
from precision.policy import policy
from simulator.costs.compute import Matmul
from simulator.costs.hardware import load_hardware
from simulator.costs.implementation import Implementation
from simulator.engine.costs import optimizer_seconds
from simulator.engine.links import LinkCosts
from simulator.engine.muon import muon_bytes, muon_seconds, newton_schulz_seconds, stage_all_to_all
from simulator.engine.simulate import simulate_step
from simulator.network.topology import build_cluster

MUON = Implementation(optimizer="muon")
H100 = load_hardware("h100-sxm").gpu


def step(model, layout, cluster, implementation=None):
    return simulate_step(model, layout, cluster, "bf16", 64, 1, gpu="h100-sxm", implementation=implementation)


def test_the_optimizer_step_is_its_parts():
    """The optimizer step under Muon: AdamW's passes over the weights that are not matrices, Muon's over the
    matrices, the all-to-alls and the busiest rank's Newton-Schulz GEMMs; nothing else of the step moves."""
    model, layout, cluster = preset("llama3-8b"), Layout(dp=16, zero=1), build_cluster("h100-sxm", 8, 2)
    adamw, muon = step(model, layout, cluster), step(model, layout, cluster, MUON)
    gpu, pol = H100, policy("bf16")
    stage = muon.memory.per_stage[0]
    owned = (stage.adam_m - stage.adam_v) // 4
    links = LinkCosts(cluster, layout, gpu)
    expected = optimizer_seconds(stage, pol, gpu) + muon_seconds(model, layout, 0, owned, links, gpu,
                                                                 gpu.matmul_efficiency, pol)
    assert muon.breakdown["optimizer"] == pytest.approx(expected, rel=1e-3, abs=2e-4)  # the norm's reductions beside
    assert muon.breakdown["compute"] == adamw.breakdown["compute"]
    # the second moments left: the embeddings' and the head's, 13% of Llama 3 8B
    assert muon.memory.adam_m == adamw.memory.adam_m and muon.memory.adam_v < adamw.memory.adam_v / 4


def test_newton_schulz_is_five_steps_of_three_gemms_on_the_busiest_rank():
    gpu = H100
    one = newton_schulz_seconds([(14336, 4096)], gpu, None, "bf16")
    gemms = [Matmul("g", 4096, 4096, 14336, "bf16"), Matmul("s", 4096, 4096, 4096, "bf16"),
             Matmul("a", 4096, 14336, 4096, "bf16")]
    assert one == pytest.approx(5 * sum(g.time(gpu) for g in gemms))
    assert newton_schulz_seconds([(14336, 4096)], gpu, None, "fp32") > 5 * one  # no tensor cores in true fp32
    model = preset("llama3-8b")
    shapes = stage_matrices(model, range(model.n_layers), True)
    flops = [sum(newton_schulz_flops(shapes[k]) for k in keys) for keys in assign_matrices(shapes, 64)]
    assert max(flops) <= sum(flops) / 64 + max(newton_schulz_flops(s) for s in shapes.values())  # the greedy bound


def test_the_all_to_all_splits_between_nvlink_and_the_nics():
    """Inside one server the whole exchange crosses NVLink; over two, half of each rank's bytes leave it by its NIC
    (the slower part), and a rank alone sends nothing."""
    gpu = H100
    one = LinkCosts(build_cluster("h100-sxm", 8, 1), Layout(dp=8), gpu)
    two = LinkCosts(build_cluster("h100-sxm", 8, 2), Layout(dp=16), gpu)
    nbytes = 2**30
    assert stage_all_to_all(LinkCosts(build_cluster("h100-sxm", 1, 1), Layout(), gpu), 0, nbytes) == 0.0
    inside, across = stage_all_to_all(one, 0, nbytes), stage_all_to_all(two, 0, nbytes)
    nic = two.flows(("muon_remote", 0), [(0, 8)], nbytes / 2)
    assert across == pytest.approx(max(nic, two.flows(("muon_local", 0), [(0, 1)], nbytes * 7 / 16)))
    assert inside == pytest.approx(one.flows(("muon_local", 0), [(0, 1)], nbytes * 7 / 8))
    assert across > inside  # 50 GB/s a NIC against 450 GB/s of NVLink


def test_muon_bytes_count_its_kernels():
    fp32, bf16 = policy("fp32"), policy("bf16")
    assert muon_bytes(fp32, False) == 23 * 4  # MasterMuon's passes, weights updated in place
    assert muon_bytes(bf16, False) == (2 + 4) + 23 * 4 + (4 + 2)  # the gradient's cast, the compute copy
    assert muon_bytes(bf16, True) < muon_bytes(bf16, False)


def test_simulate_says_muon(tmp_path):
    runner = CliRunner()
    args = ["simulate", "--model", "llama3-8b", "--gpus", "16", "--zero", "1", "--gpu", "h100-sxm"]
    out = runner.invoke(main, args + ["--optimizer", "muon"])
    assert out.exit_code == 0, out.output
    assert "optimizer states (Muon's momentum, Adam m, v)" in out.output and "(bf16, Muon)" in out.output
    assert "Muon on the hidden matrices" in out.output
    data = json.loads(runner.invoke(main, args + ["--optimizer", "muon", "--json"]).output)
    plain = json.loads(runner.invoke(main, args + ["--json"]).output)
    assert data["provenance"]["implementation"]["optimizer"] == "muon"
    assert data["breakdown"]["optimizer"] > plain["breakdown"]["optimizer"]
    bad = runner.invoke(main, args + ["--optimizer", "lion"])
    assert bad.exit_code == 2 and "'lion' is not one of" in bad.output


def test_plan_bounds_muons_step_from_below_and_finds_what_adamw_cannot_fit():
    """`minigpt plan --optimizer muon`: the search's lower bound (with the busiest rank's Newton-Schulz GEMMs) stays
    under every step it simulates, and more of Llama 3 70B's layouts fit on 32 H100s at batch 32 than under AdamW's
    16 bytes a parameter."""
    from simulator.search.plan import ClusterSpec, plan

    spec = ClusterSpec.of("h100-sxm")
    found = plan(preset("llama3-8b"), 16, spec, 32, stack_changes=(("optimizer", "muon"),))
    assert found.simulated and all(0 < low <= step for _, step, low in found.simulated)
    muon = plan(preset("llama3-70b"), 32, spec, 32, stack_changes=(("optimizer", "muon"),))
    adamw = plan(preset("llama3-70b"), 32, spec, 32)
    assert muon.fitting > adamw.fitting
