"""simulator/costs/userbuffers.py: Transformer Engine's tp overlap settings, the chunks and SM margins they give the
Linears' GEMMs, the GEMM model on fewer SMs, and `minigpt simulate --tp-overlap-cfg` (bad files: one line, exit 2)."""

import json
import math
import time
from dataclasses import replace

import pytest
from click.testing import CliRunner

from cli.main import main
from job.layout import Layout
from minigpt.config import GPTConfig
from minigpt.errors import ConfigError
from precision.policy import policy
from simulator.costs.compute import op_time
from simulator.costs.rates.gemm_model import tile_work
from simulator.costs.hardware import load_hardware
from simulator.costs.op_types import Gemm, Implementation
from simulator.costs.ops import block_ops
from simulator.costs.userbuffers import OVERLAPS, TE_1X, UB_MAX_SM, parse_userbuffers, read_userbuffers
from simulator.engine.overlap import TP_SLOWDOWN, stack_implementation
from simulator.engine.simulate import simulate_step
from simulator.network.topology import build_cluster
from tests.independent import ROOT

DGXC_FILE = ROOT / "bench" / "dgxc_gpt3_175b_userbuffers.json"

# NVIDIA/dgxc-benchmarking v25.01's GPT-3 175B userbuffers settings (H100, tp 4), as the DGX-Cloud bench reads them
DGXC = {key: value for key, value in json.loads(DGXC_FILE.read_text()).items() if key != "source"}
H100 = load_hardware("h100-sxm")
MODEL = GPTConfig(vocab_size=512, seq_len=2048, n_layers=8, n_heads=32, d_model=4096, d_ff=16384)
SP4 = Layout(tp=4, sequence_parallel=True)
CORE = Implementation(**stack_implementation("megatron-core"))


def test_a_configuration_gives_each_gemm_its_chunks_and_margin():
    ub = parse_userbuffers(DGXC, "dgxc")
    assert [(gemm, ub.chunks(gemm, 4), ub.margin(gemm)) for gemm in
            ("qkv", "proj", "fc1", "fc2", "proj.input_grad", "fc2.input_grad", "qkv.input_grad", "fc1.weight_grad")] == [
        ("qkv", 4, 0), ("proj", 4, 24), ("fc1", 4, 0), ("fc2", 4, 20), ("proj.input_grad", 4, 0),
        ("fc2.input_grad", 2, 0), ("qkv.input_grad", 1, 0), ("fc1.weight_grad", 1, 0)]  # aggregate: two slices a GEMM
    assert ub.chunks("head.weight_grad", 4) == 1 and ub.margin("head") == 0  # not overlapped
    # the collectives without a margin hold 4 + 8 + 2 + 4 (bulk) + 4 x 1 (ring exchange) SMs over the ten overlaps
    assert ub.competing_sms() == pytest.approx(2.2)
    assert ub.slowdown(132) == pytest.approx(2.2 / 132)
    assert ub.margins() == {"proj_fprop": 24, "fc2_fprop": 20}
    assert "proj_fprop leaves 24 SMs, fc2_fprop leaves 20 SMs" in ub.describe()


def test_left_out_settings_take_transformer_engines_defaults():
    ub = parse_userbuffers({"fc2_fprop": {"method": "ring_exchange", "num_sm": 1, "set_sm_margin": True}}, "nemo")
    # TE 2.1: pipeline and bulk 16 SMs with the margin, ring exchange 1 SM without, pipeline in 4 splits
    assert ub.margin("proj") == 16 and ub.chunks("proj", 8) == 4
    assert ub.margin("qkv.weight_grad") == 16 and ub.margin("qkv") == 0 and ub.chunks("qkv", 8) == 8
    assert ub.chunks("fc2", 8) == 8 and ub.margin("fc2") == 1  # a ring-exchange reduce-scatter: tp chunks
    assert ub.competing_sms() == pytest.approx(4 / 10)  # the four all-gathers' single SMs
    assert [name for name, _ in TE_1X.overlaps] == list(OVERLAPS) and not TE_1X.margins()


@pytest.mark.parametrize("data, words", [
    ([], "JSON object"),
    ({"proj_wgrad": {}}, "unknown overlap(s) proj_wgrad"),
    ({"qkv_fprop": {"method": "pipeline"}}, "qkv_fprop.method must be ring_exchange"),
    ({"qkv_dgrad": {"method": "ring_exchange"}}, "qkv_dgrad.method must be bulk"),
    ({"proj_fprop": {"num_sm": UB_MAX_SM + 1}}, "proj_fprop.num_sm must be a whole number from 0 to 32"),
    ({"proj_fprop": {"num_sm": 2.0}}, "num_sm must be a whole number"),
    ({"proj_fprop": {"set_sm_margin": "yes"}}, "set_sm_margin must be true or false"),
    ({"proj_fprop": {"num_splits": 0}}, "num_splits must be a whole number from 1"),
    ({"proj_fprop": {"sms": 4}}, "unknown key(s) sms"),
    ({"proj_fprop": {"atomic_gemm": True}}, "atomic GEMMs are not modelled"),
    ({"proj_fprop": 24}, "must be a JSON object of TE's settings"),
    ({"source": 3}, "source must be text"),
])
def test_bad_configurations_say_what_is_wrong(data, words):
    with pytest.raises(ConfigError, match=None) as raised:
        parse_userbuffers(data, "cfg.json")
    assert words in str(raised.value) and "\n" not in str(raised.value)


def test_a_gemm_on_fewer_sms_runs_its_waves_over_the_rest():
    model = H100.gpu.matmul_efficiency.gemm
    peak = H100.gpu.flops("bf16")
    fit = model.fit("bf16")
    assert model.seconds(8192, 8192, 8192, "bf16", peak, margin=0) == model.seconds(8192, 8192, 8192, "bf16", peak)
    for m, n, k in ((8192, 8192, 8192), (2048, 12288, 12288), (512, 12288, 3072)):
        times = [model.seconds(m, n, k, "bf16", peak, margin=margin) for margin in (0, 8, 16, 24)]
        assert times == sorted(times) and times[0] < times[-1]
        for margin, seconds in zip((8, 16, 24), times[1:]):  # the model's own waves over 132 - margin SMs, by hand
            sms = 132 - margin
            assert seconds == pytest.approx(tile_work(m, n, k, 1, sms, fit.k0) / (fit.large * peak * sms / 132)
                                            + fit.fixed)
    # many waves: the time grows as the SMs shrink, within the last wave's quantisation
    big = [model.seconds(16384, 16384, 8192, "bf16", peak, margin=margin) for margin in (0, 24)]
    assert big[1] / big[0] == pytest.approx(132 / 108, rel=0.05)
    with pytest.raises(ConfigError, match="SM margin must be a whole number from 0 to 131"):
        model.seconds(1024, 1024, 1024, "bf16", peak, margin=132)


def test_block_ops_carry_the_configurations_chunks_and_margins():
    def gemms(impl):
        ops = block_ops(MODEL, 1, SP4, policy("bf16"), impl)
        return {op.name: (op.chunks, op.sm_margin) for op in ops.forward + ops.backward if isinstance(op, Gemm)}

    plain = gemms(CORE)
    assert gemms(replace(CORE, userbuffers=TE_1X)) == plain  # TE 1.x's defaults are the preset's chunks, no margin
    dgxc = gemms(replace(CORE, userbuffers=parse_userbuffers(DGXC, "dgxc")))
    assert dgxc["proj"] == (4, 24) and dgxc["fc2"] == (4, 20) and dgxc["fc2.input_grad"] == (2, 0)
    assert {name: value for name, value in dgxc.items() if name not in ("proj", "fc2", "fc2.input_grad")} == \
        {name: value for name, value in plain.items() if name not in ("proj", "fc2", "fc2.input_grad")}
    assert gemms(replace(CORE, userbuffers=parse_userbuffers(DGXC, "dgxc"), ub_chunks=False))["proj"] == (1, 0)
    priced = Gemm("proj", 2048, 4096, 4096, "bf16", sm_margin=24)
    assert op_time(priced, H100.gpu, H100.gpu.matmul_efficiency) > op_time(replace(priced, sm_margin=0), H100.gpu,
                                                                          H100.gpu.matmul_efficiency)
    with pytest.raises(ConfigError, match="needs the GPU's GEMM model"):
        op_time(priced, H100.gpu, None)


def test_a_simulated_step_with_the_configuration():
    cluster = build_cluster("h100-sxm", 8, 2)
    layout = Layout(tp=4, pp=2, dp=2, zero=1, sequence_parallel=True)

    def run(userbuffers=None, overlap="megatron-core", lay=layout):
        return simulate_step(MODEL, lay, cluster, "bf16", 16, 1, overlap=overlap, sp_saved_input="sharded",
                             userbuffers=userbuffers)

    plain, dgxc = run(), run(parse_userbuffers(DGXC, "dgxc"))
    assert dgxc.breakdown["compute"] > plain.breakdown["compute"]  # proj and fc2 forward on 108 and 112 SMs
    assert dgxc.overlap.tp_slowdown == pytest.approx(2.2 / 132) and plain.overlap.tp_slowdown == TP_SLOWDOWN
    assert dgxc.provenance["implementation"]["userbuffers"].startswith("userbuffers dgxc: proj_fprop leaves 24 SMs")
    no_margin = parse_userbuffers({**DGXC, "proj_fprop": {**DGXC["proj_fprop"], "set_sm_margin": 0},
                                   "fc2_fprop": {**DGXC["fc2_fprop"], "set_sm_margin": 0},
                                   "fc2_dgrad": {"method": "ring_exchange"}}, "free")  # TE 1.x's chunks, no margin
    assert run(no_margin).breakdown["compute"] == pytest.approx(plain.breakdown["compute"], rel=1e-12)
    for overlap, lay in (("executor", layout), ("megatron-core", replace(layout, sequence_parallel=False))):
        with pytest.raises(ConfigError, match="needs --overlap megatron-core"):
            run(parse_userbuffers(DGXC, "dgxc"), overlap, lay)


def test_simulate_reads_the_file_and_refuses_a_bad_one(tmp_path):
    good, bad = tmp_path / "ub.json", tmp_path / "bad.json"
    good.write_text(json.dumps(DGXC))
    bad.write_text(json.dumps({"proj_fprop": {"method": "bulk"}}))
    args = ["simulate", "--model", "gpt2-124m", "--tp", "4", "--sequence-parallel", "--overlap", "megatron-core",
            "--precision", "bf16", "--gpu", "h100-sxm", "--json"]
    result = CliRunner().invoke(main, [*args, "--tp-overlap-cfg", str(good)])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert "proj_fprop leaves 24 SMs" in data["provenance"]["implementation"]["userbuffers"]
    assert math.isclose(data["overlap"]["tp_slowdown"], 2.2 / 132)
    for extra, words in (([str(bad)], "proj_fprop.method must be pipeline or ring_exchange"),
                         ([str(tmp_path / "missing.json")], "missing.json"),
                         ([str(good), "--overlap", "executor"], "needs --overlap megatron-core"),
                         ([str(good), "--sweep", "--gpus", "4,8"], "drop --tp-overlap-cfg")):
        refused = CliRunner().invoke(main, [*args, "--tp-overlap-cfg", *extra])
        assert refused.exit_code == 2 and words in refused.output, refused.output
        assert len(refused.output.strip().splitlines()) == 1 and "Traceback" not in refused.output
    help_text = CliRunner().invoke(main, ["simulate", "--help"]).output
    assert "--tp-overlap-cfg" in help_text and "set_sm_margin" in help_text


def test_megatrons_yaml_file_reads_as_its_json(tmp_path):
    """The file Megatron-LM's --tp-comm-overlap-cfg takes, as it is: YAML with the overlaps at its top."""
    lines = []
    for name, settings in DGXC.items():
        lines.append(f"{name}:")
        lines += [f"  {key}: {value}" for key, value in settings.items()]
    path = tmp_path / "ub_cfg.yaml"
    path.write_text("\n".join(lines) + "\n")
    from_yaml = read_userbuffers(str(path))
    assert from_yaml.overlaps == parse_userbuffers(DGXC, "dgxc").overlaps and from_yaml.origin == str(path)
    for text, words in (("qkv_dgrad: [unclosed\n", "is not valid YAML (line"), ("- just a list\n", "JSON object"),
                        ("proj_fprop:\n  num_sm: yes\n", "num_sm must be a whole number"),
                        ("a: &x [*x]\n", "unknown overlap(s) a")):
        path.write_text(text)
        with pytest.raises(ConfigError) as raised:
            read_userbuffers(str(path))
        assert words in str(raised.value) and "\n" not in str(raised.value), str(raised.value)


def test_a_yaml_bomb_is_refused_at_once(tmp_path):
    """Aliases nest a value that would print as 9^8 numbers: the refusal shows a bounded part of it."""
    levels = ["    - &a0 [1, 1, 1, 1, 1, 1, 1, 1, 1]"]
    levels += [f"    - &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, 9)]
    path = tmp_path / "bomb.yaml"
    path.write_text("qkv_dgrad:\n  method:\n" + "\n".join(levels) + "\n")
    import yaml

    assert len(yaml.safe_load(path.read_text())["qkv_dgrad"]["method"][8]) == 9  # the bomb, by reference
    start = time.perf_counter()
    with pytest.raises(ConfigError, match="qkv_dgrad.method must be bulk"):
        read_userbuffers(str(path))
    assert time.perf_counter() - start < 5
