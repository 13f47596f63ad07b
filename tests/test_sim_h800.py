"""The H800 preset (`h800`, node `hgx-h800`): DeepSeek-V3's GPU, an H100 SXM whose NVLink is cut to 400 GB/s.

Every expected number is typed here from its source (docs/efficiency.md, "H800"), not read back from
simulator/costs/hardware.json or simulator/network/nccl.json."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from job.layout import Layout
from simulator.costs.hardware import PRESETS_FILE, load_hardware, save_hardware
from nccl_calls import links, tp_call  # tests/ is on sys.path under pytest

GIB = 2**30


def test_the_h800_holds_its_published_figures_each_with_its_source(tmp_path):
    hardware = load_hardware("h800")
    gpu, node, h100 = hardware.gpu, hardware.node, load_hardware("h100-sxm").gpu
    # arXiv 2505.09343: NVLink from 900 GB/s to 400 GB/s (both ways), so 200 GB/s a way; compute and HBM the H100 SXM's
    assert gpu.nvlink_bandwidth == 200e9
    assert gpu.flops("bf16") == 989.4e12 and gpu.flops("fp8") == 1978.9e12 and gpu.flops("tf32") == 494.7e12
    assert gpu.hbm_bytes == 80 * 2**30 and gpu.hbm_bandwidth == 3.35e12
    for words in ("400 GB/s", "2505.09343", "2412.19437", "2,048 H800", "datasheet", "docs/efficiency.md"):
        assert words in gpu.source, words
    # DeepSeek's node: 8 GPUs on NVSwitch, eight 400G InfiniBand CX7 NICs
    assert node.name == "hgx-h800" and node.gpus_per_node == node.nics_per_node == 8 and node.nvswitch
    assert hardware.nic.name == "ndr"
    for words in ("eight 400G InfiniBand CX7", "2505.09343", "not a DGX datasheet"):
        assert words in node.source, words
    # the H100 SXM's measurements, reused, each saying so
    assert gpu.matmul_efficiency.points == h100.matmul_efficiency.points
    assert gpu.attention_efficiency.causal == h100.attention_efficiency.causal
    assert replace(gpu.reached, source="") == replace(h100.reached, source="")
    raw = json.loads(PRESETS_FILE.read_text())["gpus"]["h800"]
    for key in ("matmul_efficiency", "achieved", "attention_efficiency", "attention_cudnn"):
        assert "reused from the h100-sxm preset" in raw[key]["source"], key
    assert "160 GB/s" in raw["achieved"]["source"]  # DeepSeek-V3's report's NVLink figure, 0.80 of 200
    assert load_hardware(save_hardware(hardware, tmp_path / "h800.json")) == hardware


def test_a_server_all_reduce_runs_at_the_h800s_own_nvlink():
    """8 GPUs of one server, 1 GiB: the H100's NVLink SHARP (measured at 18 links) is not the H800's; its ring runs
    at 0.81 of its 200 GB/s, DeepSeek's 160 GB/s."""
    h800 = tp_call(links("h800", 8, 1, Layout(tp=8)), GIB)
    h100 = tp_call(links("h100-sxm", 8, 1, Layout(tp=8)), GIB)
    assert h800["algorithm"] != "nvls" and h100["algorithm"] == "nvls"
    busbw = GIB * 2 * 7 / 8 / h800["seconds"]
    assert busbw == pytest.approx(0.81 * 200e9, rel=0.05)
    assert h800["seconds"] > 2 * h100["seconds"]


def test_tensor_parallelism_pays_for_the_narrower_nvlink():
    """Llama 3 70B at tp 8 x pp 2 on two servers: its tensor-parallel collectives stay on NVLink, 2.25 times
    narrower on the H800, on the same compute."""
    from simulator.engine.simulate import simulate_step
    from simulator.network.topology import build_cluster
    from minigpt.presets import preset

    model = preset("llama3-70b").with_(seq_len=4096)

    def step(gpu: str) -> float:
        return simulate_step(model, Layout(tp=8, pp=2), build_cluster(gpu, 8, 2), "bf16", 16, 1).step_time_s

    assert step("h800") > 1.05 * step("h100-sxm")
