"""The GB200 NVL72 presets (`gb200`, node `gb200-nvl72`): the GB200's own published figures, and a rack of 72 GPUs
as one NVLink domain.

Every expected number is typed here from its source (docs/efficiency.md, "GB200"), not read back from
simulator/costs/hardware.json or simulator/network/nccl.json."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from cli.main import main
from job.layout import Layout
from simulator.costs.hardware import PRESETS_FILE, load_hardware, save_hardware
from simulator.costs.rates.gemm_model import tile_work
from nccl_calls import links, tp_call  # tests/ is on sys.path under pytest

GIB = 2**30


def test_the_gb200_holds_its_published_figures_each_with_its_source(tmp_path):
    hardware = load_hardware("gb200")
    gpu, node = hardware.gpu, hardware.node
    # NVIDIA's Blackwell technical brief, Table 2, the NVL72 rack over 72 (dense): BF16 2.5 PF, FP8 5 PF, TF32 1.25 PF,
    # FP32 80 TF;
    # the NVL72 datasheet: 13.4 TB of HBM3e at 576 TB/s over 72 GPUs (186GB, 8 TB/s each), NVLink 5 900 GB/s a way
    assert gpu.flops("bf16") == gpu.flops("fp16") == 2.5e15 and gpu.flops("fp8") == 5e15
    assert gpu.flops("tf32") == 1.25e15 and gpu.flops("fp32") == 80e12
    assert gpu.hbm_bytes == 186 * 2**30 and gpu.hbm_bandwidth == 8e12 and gpu.nvlink_bandwidth == 900e9
    for words in ("technical brief", "Table 2", "1,200 W", "13.4 TB", "576 TB/s", "186GB", "130 TB/s", "MLCommons"):
        assert words in gpu.source, words
    # Bekman's GB200 MAMF sets the large-tile rate on its 152 SMs (VeOmni #986; MAMF's best shapes fill 152 SMs in
    # whole waves of 128 x 256 tiles): the model without its fixed cost gives MAMF at MAMF's shape; the shape terms are
    # H100 SXM's (no GB200 sweep is published) and the source says so
    gemm, h100 = gpu.matmul_efficiency.gemm, load_hardware("h100-sxm").gpu.matmul_efficiency.gemm
    assert gemm.sms == 152 and gemm.fit("bf16") == gemm.fit("fp16")
    assert (4096 // 128) * (9728 // 256) == 8 * 152 and (19456 // 128) * (5120 // 256) == 20 * 152
    for fmt, (m, n, k), mamf in (("bf16", (4096, 9728, 2048), 1822.0e12), ("fp8", (19456, 5120, 1536), 3615.6e12)):
        fit = gemm.fit(fmt)
        seconds = tile_work(m, n, k, 1, 152, fit.k0) / (fit.large * gpu.flops(fmt))
        assert 2 * m * n * k / seconds == pytest.approx(mamf, rel=0.002)
        assert (fit.k0, fit.fixed) == (h100.fit(fmt).k0, h100.fit(fmt).fixed)
    raw = json.loads(PRESETS_FILE.read_text())
    for words in ("MAMF", "1822.0", "3615.6", "H100 SXM's", "VeOmni #986"):
        assert words in raw["gpus"]["gb200"]["matmul_efficiency"]["gemm_model"]["source"], words
    # cuDNN's kernels measured by NVIDIA on a GB200: its norm's bandwidth, its attention over the GB200's own peak
    achieved = raw["gpus"]["gb200"]["achieved"]["source"]
    assert gpu.reached.hbm_fraction == round(6424.6 / 8000, 2) and "6,424.6" in achieved
    assert gpu.attention_cudnn.causal == load_hardware("b200").gpu.attention_cudnn.causal
    forward, backward = 1574e12, 1332e12  # TFLOP/s at 8K tokens; the backward does 2.5 times the forward's FLOPs
    assert dict(dict(gpu.attention_cudnn.causal)[128])[8192] == pytest.approx(3.5 / (1 / forward + 2.5 / backward) / 2.5e15,
                                                                        abs=5e-4)
    assert gpu.reached.nvlink_fraction == pytest.approx(682.2 / 900, abs=5e-4)  # the B200's ring, the same NVLink 5
    assert "reused" in achieved
    # the rack: 72 GPUs in one NVLink domain, one 400 Gb/s NIC each (four OSFP InfiniBand ports a 4-GPU tray)
    assert node.name == "gb200-nvl72" and node.gpus_per_node == node.nics_per_node == 72 and node.nvswitch
    assert hardware.nic.name == "ndr"
    for words in ("GB200 NVL72", "Mission Control", "four OSFP InfiniBand ports", "ConnectX-7", "--gpus-per-node"):
        assert words in node.source, words
    assert load_hardware(save_hardware(hardware, tmp_path / "gb200.json")) == hardware


def rack_all_reduce(gpus: int, nbytes: float) -> dict:
    return tp_call(links("gb200", 72, 1, Layout(tp=gpus)), nbytes)


def test_a_whole_rack_all_reduces_at_coreweaves_measured_bus_bandwidth():
    """coreweave/nccl-tests #43: all_reduce_perf over the 72 GPUs of one NVL72 rack, 834.57 GB/s busbw at 8 GiB and
    839.16 at 4 GiB (out of place)."""
    for nbytes, published in ((8 * GIB, 834.57e9), (4 * GIB, 839.16e9)):
        call = rack_all_reduce(72, nbytes)
        assert call["algorithm"] == "nvls"
        assert nbytes * 2 * 71 / 72 / call["seconds"] == pytest.approx(published, rel=0.05)


def simulate_json(per_node: int) -> dict:
    result = CliRunner().invoke(main, ["simulate", "--model", "qwen3-30b-a3b", "--gpu", "gb200", "--ep", "64",
                                       "--gpus", "128", "--global-batch", "128", "--micro-batch", "1", "--seq-len", "4096",
                                       "--overlap", "megatron-core", "--gpus-per-node", str(per_node),
                                       "--nics-per-node", str(per_node), "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


def test_an_expert_group_of_64_stays_on_the_racks_nvlink():
    """The point of the NVL72: 64 expert-parallel ranks in one NVLink domain (64 of each rack's 72, two racks; the
    README's command). The same GPUs as 8-GPU servers send most of the all-to-all through the NICs, and the exposed
    all-to-all grows (README: 38 ms against 471)."""
    rack, servers = simulate_json(64), simulate_json(8)
    for data, spanned in ((rack, 1), (servers, 8)):
        group = [c for c in data["collectives"] if c["group"] == "ep"]
        assert group and all(c["servers"] == spanned for c in group)
    assert servers["breakdown"]["ep_comm"] > 3 * rack["breakdown"]["ep_comm"] > 0
    assert rack["breakdown"]["compute"] == pytest.approx(servers["breakdown"]["compute"])


def test_jobs_that_do_not_fill_whole_racks_are_refused_in_one_line_or_take_part_of_each():
    result = CliRunner().invoke(main, ["simulate", "--model", "llama3-8b", "--gpu", "gb200", "--gpus", "128"])
    assert result.exit_code == 2 and "72" in result.output and "Traceback" not in result.output
    assert len(result.output.strip().splitlines()) == 1
    result = CliRunner().invoke(main, ["simulate", "--model", "llama3-8b", "--gpu", "gb200", "--gpus", "128",
                                       "--gpus-per-node", "64", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["n_gpus"] == 128
    result = CliRunner().invoke(main, ["simulate", "--model", "llama3-8b", "--gpu", "gb200", "--gpus", "100",
                                       "--gpus-per-node", "64"])  # the flag given: the one line says what to change
    assert result.exit_code == 2 and "a --gpus-per-node that divides 100" in result.output
    assert len(result.output.strip().splitlines()) == 1
