"""fp8 recipes (simulator/costs/layers/fp8.py, `minigpt simulate --fp8-recipe`): per-tensor current scaling's amax
pass before each cast, the LayerNorm writing 16 bits and their amax, its amax all-reduces over tp under sequence
parallelism; which stacks scale how; one line for a recipe the job cannot run."""

import json
from dataclasses import replace

import pytest
from click.testing import CliRunner

from cli.main import main
from job.layout import Layout
from minigpt.config import GPTConfig
from minigpt.errors import ConfigError
from precision.policy import policy
from simulator.costs.compute import chunk_times
from simulator.costs.hardware import load_hardware
from simulator.costs.implementation import FP8_RECIPES, Implementation
from simulator.costs.ops import block_ops
from simulator.costs.layers.fp8 import sp_amax_reductions
from simulator.engine.overlap import stack_implementation
from simulator.engine.simulate import simulate_step
from simulator.network.topology import build_cluster

FP8 = policy("fp8")
MODEL = GPTConfig(vocab_size=512, seq_len=128, n_layers=4, n_heads=8, d_model=256, d_ff=1024)
DELAYED = Implementation(**stack_implementation("megatron-core"))
CURRENT = replace(DELAYED, fp8_scaling="current")
H100 = load_hardware("h100-sxm")


def forward_ops(impl, layout=Layout(), model=MODEL):
    return {op.name: op for op in block_ops(model, 2, layout, FP8, impl).forward}


def backward_ops(impl, layout=Layout(), model=MODEL):
    return {op.name: op for op in block_ops(model, 2, layout, FP8, impl).backward}


def test_current_scaling_reads_each_tensor_for_its_amax_before_the_cast():
    rows, d, f = 2 * MODEL.seq_len, MODEL.d_model, MODEL.d_ff
    delayed, current = forward_ops(DELAYED), forward_ops(CURRENT)
    # inputs with no norm before them: an amax kernel reads the 16-bit tensor, then the cast reads it again
    assert current["proj.amax_input"].read == rows * d * 2 and current["proj.amax_input"].written == 0
    assert current["fc2.amax_input"].read == rows * f * 2
    assert "proj.amax_input" not in delayed  # delayed: the amax is taken inside the cast
    assert current["proj.cast_input"].read == delayed["proj.cast_input"].read == rows * d * 2
    # after a LayerNorm: the norm writes 16 bits (and takes their amax as it writes them), then a cast + transpose
    assert current["ln1"].written - delayed["ln1"].written == rows * d  # 2 bytes a value instead of 1
    assert "qkv.amax_input" not in current and current["qkv.cast_input"].read == rows * d * 2
    assert current["qkv.cast_input"].written == 2 * rows * d and "qkv.transpose_input" in delayed
    # every output gradient: amax, then cast (both layouts)
    back = backward_ops(CURRENT)
    for name, width in (("qkv", 3 * d), ("proj", d), ("fc1", f), ("fc2", d)):
        assert back[f"{name}.cast_grad.amax"].read == rows * width * 2
        assert back[f"{name}.cast_grad"].written == 2 * rows * width
    assert not any(name.endswith(".amax") for name in backward_ops(DELAYED))
    # the weights once a step (the cast kept across micro-batches), each with its amax pass
    per_step = {op.name for op in block_ops(MODEL, 2, Layout(), FP8, CURRENT).per_step}
    assert per_step == {f"{n}.cast_weight{k}" for n in ("qkv", "proj", "fc1", "fc2") for k in ("", ".amax")}
    # the saved activations do not change: the same e4m3 copies
    saved = lambda impl: {t.name: t.bytes for t in block_ops(MODEL, 2, Layout(), FP8, impl).saved}  # noqa: E731
    assert saved(CURRENT) == saved(DELAYED)


def test_current_scaling_costs_time_and_reduces_amaxes_over_tp_under_sequence_parallelism():
    sp = Layout(tp=2, sequence_parallel=True)
    times = {name: chunk_times(MODEL, 2, 2, sp, H100.gpu, "fp8", implementation=impl)
             for name, impl in (("delayed", DELAYED), ("current", CURRENT))}
    assert times["current"].forward_s > times["delayed"].forward_s  # the amax passes
    assert times["current"].backward_s > times["delayed"].backward_s
    # two blocks: qkv's and fc1's gathered inputs forward, proj's and fc2's gathered gradients backward
    assert times["current"].sp_amaxes == (4, 4) and times["delayed"].sp_amaxes == (0, 0)
    no_sp = chunk_times(MODEL, 2, 2, Layout(tp=2), H100.gpu, "fp8", implementation=CURRENT)
    assert no_sp.sp_amaxes == (0, 0)  # nothing gathered, nothing to agree on
    block = block_ops(MODEL, 2, sp, FP8, CURRENT)
    assert sp_amax_reductions(block.forward, True) == (2, 2)
    assert sp_amax_reductions(block.forward, False) == (0, 0)


def test_a_simulated_step_prices_the_tp_reductions_and_no_delayed_ones():
    cluster = build_cluster(H100, 8, 2)
    layout = Layout(tp=4, dp=4, zero=1, sequence_parallel=True)

    def run(impl):
        return simulate_step(MODEL, layout, cluster, "fp8", 8, 1, overlap="megatron-core", implementation=impl)

    delayed, current, mxfp8 = run(DELAYED), run(CURRENT), run(replace(DELAYED, fp8_scaling="block"))
    calls = {c["group"]: c for c in current.collectives if c["group"].startswith("amax")}
    assert set(calls) == {"amax_tp"} and calls["amax_tp"]["ranks"] == 4 and calls["amax_tp"]["bytes"] == 4
    micro_batches = 8 // layout.dp
    # per micro-batch: 4 blocks x (2 forward + 2 backward) reductions of one fp32 amax over the tp group
    assert current.breakdown["amax_comm"] == pytest.approx(micro_batches * 4 * 4 * calls["amax_tp"]["seconds"])
    assert {c["group"] for c in delayed.collectives if c["group"].startswith("amax")} == {"amax_data"}
    assert mxfp8.breakdown["amax_comm"] == 0
    assert current.breakdown["compute"] > delayed.breakdown["compute"]
    assert current.provenance["implementation"]["fp8_scaling"] == "current"


def test_the_stacks_and_the_recipes():
    assert FP8_RECIPES == {"delayed": "tensor", "current": "current", "mxfp8": "block"}
    assert stack_implementation("megatron-core")["fp8_scaling"] == "tensor"  # Megatron-LM's --fp8-recipe default
    assert stack_implementation("torchtitan-fsdp2")["fp8_scaling"] == "current"  # torchao's tensorwise
    assert stack_implementation("executor")["fp8_scaling"] == "tensor"  # precision/fp8.py
    with pytest.raises(ConfigError, match="'current' needs fp8_fused_casts"):
        Implementation(fp8_scaling="current")


def invoke(*args):
    return CliRunner().invoke(main, ["simulate", "--model", "tiny", "--gpu", "h100-sxm", *args])


def test_the_flag_and_its_refusals():
    base = ("--tp", "2", "--dp", "4", "--sequence-parallel", "--precision", "fp8", "--overlap", "megatron-core")
    results = {recipe: invoke(*base, "--fp8-recipe", recipe, "--json") for recipe in FP8_RECIPES}
    assert all(r.exit_code == 0 for r in results.values()), {k: r.output for k, r in results.items()}
    scaling = {k: json.loads(r.output)["provenance"]["implementation"]["fp8_scaling"] for k, r in results.items()}
    assert scaling == FP8_RECIPES
    assert "--fp8-recipe" in invoke("--help").output
    for args, words in ((("--precision", "bf16", "--fp8-recipe", "current"), "needs --precision fp8"),
                        (("--precision", "fp8", "--fp8-recipe", "mxfp8"), "needs fused fp8 casts"),
                        (("--precision", "fp8", "--fp8-recipe", "per-block"), "Invalid value for '--fp8-recipe'")):
        result = invoke(*args)
        assert result.exit_code == 2 and words in result.output, result.output
        assert len(result.output.strip().splitlines()) == 1


def test_torchao_saves_the_16_bit_tensors_and_casts_them_again_in_the_backward():
    titan = Implementation(**stack_implementation("torchtitan-fsdp2"))
    rows, d, f = 2 * MODEL.seq_len, MODEL.d_model, MODEL.d_ff
    shapes = {"qkv": (3 * d, d), "proj": (d, d), "fc1": (f, d), "fc2": (d, f)}  # (n, k) of each Linear's weight
    ops = block_ops(MODEL, 2, Layout(), FP8, titan)
    saved = {s.name for s in ops.saved}
    assert not any(name.endswith("_fp8") for name in saved) and {"qkv.input", "fc1.input", "gelu.output"} <= saved
    forward, backward = {op.name: op for op in ops.forward}, {op.name: op for op in ops.backward}
    for name, (n, k) in shapes.items():  # amax (read 2 bytes a value), then one row-wise copy (1 byte)
        assert (forward[f"{name}.cast_weight"].read, forward[f"{name}.cast_weight"].written) == (2 * n * k, n * k)
        assert (backward[f"{name}.recast_weight"].read, backward[f"{name}.recast_weight"].written) == (2 * n * k, n * k)
        assert backward[f"{name}.recast_input.amax"].read == 2 * rows * k
        assert (backward[f"{name}.recast_input"].read, backward[f"{name}.recast_input"].written) == (2 * rows * k,
                                                                                                     rows * k)
    # against saving the e4m3 copies (an input's and both of the weight's): those go, the 16-bit inputs of qkv, fc1
    # and fc2 come (proj's, the attention output, was saved anyway)
    kept = block_ops(MODEL, 2, Layout(), FP8, replace(titan, fp8_recast=False))
    copies = sum(rows * k + 2 * n * k for n, k in shapes.values())
    assert kept.saved_bytes - ops.saved_bytes == copies - 2 * (rows * d + rows * d + rows * f)
    # weights gathered in fp8 (--fp8-param-gather): used as they are in the forward, transposed in the backward
    gathered = block_ops(MODEL, 2, Layout(), FP8, replace(titan, fp8_param_gather=True))
    assert not any(".cast_weight" in op.name for op in gathered.forward)
    transpose = {op.name: op for op in gathered.backward}["qkv.transpose_weight"]
    assert (transpose.read, transpose.written) == (3 * d * d, 3 * d * d)
