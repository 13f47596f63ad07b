"""simulator/costs/rates/gemm_model.py: the GEMM model by (m, n, k) reproduces the published sweeps it rests on (and the
points held out of its fit) within the tolerances docs/efficiency.md states, quantises waves over the SMs, tells a
short m from a short k as the sweeps do, and a calibrated profile without a model keeps its smallest-side table."""

import math

import pytest

from minigpt.errors import ConfigError
from simulator.costs.compute import efficiency, gemm_efficiency, matmul_time, tensor_peak
from simulator.costs.rates.efficiency import parse_efficiency_profile
from simulator.costs.rates.gemm_model import TILES, GemmFit, GemmModel, parse_gemm_model, tile_work, wave_utilisation
from simulator.costs.hardware import load_hardware
from simulator.provenance import efficiency_sources
from independent import H200_RUN  # tests/ is on sys.path under pytest

H100, H200, A100 = (load_hardware(name).gpu for name in ("h100-sxm", "h200", "a100-80gb"))

# OpenXLA's measured H100 GEMM table (xla/service/gpu/model/default_matmul_perf_table.txtpb, key sm_90, column
# bf16xbf16->bf16, b = 1; ROCm/xla mirror at commit dc66032216): TFLOP/s of every (m, n, k) with each side
# 512-4096 (docs/efficiency.md, "GEMM model").
OPENXLA_BF16 = {
    (512, 512, 512): 43.6, (512, 512, 1024): 73.4, (512, 512, 2048): 116.3, (512, 512, 4096): 187.5,
    (512, 1024, 512): 85.4, (512, 1024, 1024): 146.5, (512, 1024, 2048): 231.0, (512, 1024, 4096): 300.9,
    (512, 2048, 512): 147.5, (512, 2048, 1024): 241.8, (512, 2048, 2048): 342.8, (512, 2048, 4096): 460.4,
    (512, 4096, 512): 243.6, (512, 4096, 1024): 381.3, (512, 4096, 2048): 530.0, (512, 4096, 4096): 661.6,
    (1024, 512, 512): 84.3, (1024, 512, 1024): 144.0, (1024, 512, 2048): 235.5, (1024, 512, 4096): 312.1,
    (1024, 1024, 512): 149.1, (1024, 1024, 1024): 252.8, (1024, 1024, 2048): 359.8, (1024, 1024, 4096): 472.6,
    (1024, 2048, 512): 244.0, (1024, 2048, 1024): 384.0, (1024, 2048, 2048): 529.5, (1024, 2048, 4096): 665.7,
    (1024, 4096, 512): 347.7, (1024, 4096, 1024): 494.4, (1024, 4096, 2048): 639.1, (1024, 4096, 4096): 751.9,
    (2048, 512, 512): 150.1, (2048, 512, 1024): 257.6, (2048, 512, 2048): 354.1, (2048, 512, 4096): 458.1,
    (2048, 1024, 512): 244.9, (2048, 1024, 1024): 386.8, (2048, 1024, 2048): 535.3, (2048, 1024, 4096): 663.6,
    (2048, 2048, 512): 348.6, (2048, 2048, 1024): 498.0, (2048, 2048, 2048): 641.0, (2048, 2048, 4096): 752.2,
    (2048, 4096, 512): 449.3, (2048, 4096, 1024): 596.5, (2048, 4096, 2048): 725.5, (2048, 4096, 4096): 752.3,
    (4096, 512, 512): 240.1, (4096, 512, 1024): 377.5, (4096, 512, 2048): 531.0, (4096, 512, 4096): 662.0,
    (4096, 1024, 512): 354.6, (4096, 1024, 1024): 497.6, (4096, 1024, 2048): 643.7, (4096, 1024, 4096): 751.7,
    (4096, 2048, 512): 449.6, (4096, 2048, 1024): 604.6, (4096, 2048, 2048): 727.5, (4096, 2048, 4096): 759.4,
    (4096, 4096, 512): 551.8, (4096, 4096, 1024): 685.2, (4096, 4096, 2048): 735.6, (4096, 4096, 4096): 780.2,
}
# Held out of the fit: the cubes and the shapes with two sides 4096 (the old smallest-side table's points).
HELD_OUT = ({(c, c, c) for c in (512, 1024, 2048, 4096)} | {(s, 4096, 4096) for s in (512, 1024, 2048)}
            | {(4096, s, 4096) for s in (512, 1024, 2048)} | {(4096, 4096, s) for s in (512, 1024, 2048)})
# Azure AI-benchmarking-guide (commit 8fd0c6e1), "GEMM CuBLASLt": TFLOP/s of (m, n, k).
AZURE_SHAPES = ((1024, 1024, 1024), (2048, 2048, 2048), (4096, 4096, 4096), (8192, 8192, 8192), (16384, 16384, 16384),
                (32768, 32768, 32768), (1024, 2145, 1024), (6144, 12288, 12288), (802816, 192, 768))
AZURE_FP8 = {"h100-sxm": (274.1, 1011.3, 1216.9, 1290.1, 1377.3, 1382.2, 410.7, 1351.4, 663.8),
             "h200": (290.8, 1013.4, 1249.1, 1300.6, 1366.3, 1349.5, 407.9, 1318.0, 717.5)}
AZURE_A100_FP16 = dict(zip(AZURE_SHAPES[:5] + AZURE_SHAPES[6:], (119.4, 221.8, 228.0, 253.7, 256.5, 132.8, 250.8, 157.8)))


def rate(gpu, m, n, k, fmt):
    """TFLOP/s the model gives the GEMM on the preset."""
    return gpu.flops(fmt) * gemm_efficiency(m, n, k, fmt, gpu, gpu.matmul_efficiency) / 1e12


def errors(gpu, fmt, published):
    return {shape: rate(gpu, *shape, fmt) / tflops - 1 for shape, tflops in published.items()}


def test_h100_bf16_reproduces_the_openxla_points_held_out_of_its_fit_within_10_percent():
    held = {shape: error for shape, error in errors(H100, "bf16", OPENXLA_BF16).items() if shape in HELD_OUT}
    assert len(held) == 13
    assert max(map(abs, held.values())) < 0.10, held


def test_h100_bf16_reproduces_the_openxla_points_it_was_fitted_to():
    fitted = [error for shape, error in errors(H100, "bf16", OPENXLA_BF16).items() if shape not in HELD_OUT]
    assert len(fitted) == 51
    assert max(map(abs, fitted)) < 0.30  # the worst, small GEMMs with the output in one tile row and a long k
    assert math.sqrt(sum(e * e for e in fitted) / len(fitted)) < 0.085
    large = [error for shape, error in errors(H100, "bf16", OPENXLA_BF16).items() if min(shape) >= 1024]
    assert len(large) == 27 and max(map(abs, large)) < 0.09  # every side 1024-4096: the training-sized ones


def test_h100_bf16_large_gemm_rests_on_bekmans_mamf():
    """Without its fixed cost the model gives MAMF's 794.5 TFLOP/s at MAMF's best shape (how `large` was set)."""
    fit = H100.matmul_efficiency.gemm.fit("bf16")
    seconds = tile_work(2048, 2048, 13312, 1, 132, fit.k0) / (fit.large * H100.flops("bf16"))
    assert 2 * 2048 * 2048 * 13312 / seconds / 1e12 == pytest.approx(794.5, rel=0.002)
    assert rate(H100, 2048, 2048, 13312, "bf16") < 794.5  # the kernel's fixed cost on top


@pytest.mark.parametrize("name, tolerance", [("h100-sxm", 0.12), ("h200", 0.11)])
def test_fp8_reproduces_the_azure_squares_it_was_fitted_to(name, tolerance):
    gpu = load_hardware(name).gpu
    found = errors(gpu, "fp8", dict(zip(AZURE_SHAPES, AZURE_FP8[name])))
    assert max(map(abs, found.values())) < tolerance, found


def test_a100_bf16_reproduces_the_azure_fp16_points_it_was_fitted_to():
    found = errors(A100, "bf16", AZURE_A100_FP16)
    assert max(map(abs, found.values())) < 0.10, found
    assert errors(A100, "fp16", AZURE_A100_FP16) == found  # one tensor-core rate for both (datasheet)


def test_wave_quantisation():
    assert wave_utilisation(132, 132) == 1 and wave_utilisation(133, 132) == pytest.approx(133 / 264)
    assert wave_utilisation(264, 132) == 1 and wave_utilisation(1, 108) == pytest.approx(1 / 108)
    # 133 output tiles of 128 x 128 on 132 SMs run two waves: about twice the time per useful tile of 132 (a short
    # k: splitting it cannot fill the second wave)
    fit = H100.matmul_efficiency.gemm.fit("bf16")
    one, two = (tile_work(m, n, 128, 1, 132, fit.k0) for m, n in ((12 * 128, 11 * 128), (7 * 128, 19 * 128)))
    assert (two / 133) / (one / 132) == pytest.approx(2, rel=0.02)


def test_the_a100_wave_dip_at_2048_that_nvidias_figure_shows():
    """NVIDIA's CUDA 11 blog figure (TF32 series): on 108 SMs the 2048 cube runs below both 1792 and 2304 (256 tiles
    of 128 x 128 fill 2.4 waves, 196 and 324 fill 1.8 and exactly 3). The model's tiles and waves (its share of
    the SMs' time, the kernel's fixed cost aside) put it there too, less deep (2% below 1792 against the figure's
    20%: splitting k refills the waves at the price of k0 per slice; docs/efficiency.md)."""
    k0 = A100.matmul_efficiency.gemm.fit("bf16").k0
    share = {c: 2 * c**3 / tile_work(c, c, c, 1, 108, k0) for c in (1792, 2048, 2304)}
    assert share[2048] < share[1792] and share[2048] < 0.9 * share[2304]


def test_a_short_k_costs_more_than_a_short_m_as_the_sweep_says():
    for side in (512, 1024):
        short_m, short_k = OPENXLA_BF16[(side, 4096, 4096)], OPENXLA_BF16[(4096, 4096, side)]
        assert short_k < short_m  # the sweep: a tile's fixed cost along k
        assert rate(H100, 4096, 4096, side, "bf16") < rate(H100, side, 4096, 4096, "bf16")


def test_efficiency_grows_with_k_and_stays_below_large():
    for gpu, fmt in ((H100, "bf16"), (H100, "fp8"), (A100, "bf16")):
        fit = gpu.matmul_efficiency.gemm.fit(fmt)
        values = [gemm_efficiency(4096, 4096, k, fmt, gpu, gpu.matmul_efficiency) for k in (256, 1024, 4096, 16384, 65536)]
        assert values == sorted(values) and 0 < values[0] and values[-1] < fit.large


def test_training_shapes_are_priced_by_their_three_sides_not_their_smallest():
    """GPT-3 on tp4: fp8 at 2048 x 12288 x 12288 is not priced as the 2048 cube (0.511 of peak) any more."""
    cube = gemm_efficiency(2048, 2048, 2048, "fp8", H100, H100.matmul_efficiency)
    wide = gemm_efficiency(2048, 12288, 12288, "fp8", H100, H100.matmul_efficiency)
    assert wide > 1.2 * cube
    assert wide > gemm_efficiency(2048, 12288, 12288, "bf16", H100, H100.matmul_efficiency) * 0.75


def test_matmul_time_and_batches_use_the_model():
    m, n, k = 4096, 4096, 4096
    expected = 2 * m * n * k / (tensor_peak(H100, "bf16") * gemm_efficiency(m, n, k, "bf16", H100,
                                                                             H100.matmul_efficiency))
    assert matmul_time(2 * m * n * k, m, n, k, H100, "bf16", profile=H100.matmul_efficiency) == pytest.approx(
        expected + H100.matmul_efficiency.launch_latency)
    # a batch of GEMMs fills the SMs as one GEMM of batch x the tiles
    small = gemm_efficiency(256, 256, 4096, "bf16", H100, H100.matmul_efficiency)
    assert gemm_efficiency(256, 256, 4096, "bf16", H100, H100.matmul_efficiency, batch=32) > 2 * small


def test_formats_without_a_fit_and_calibrated_profiles_keep_their_tables():
    profile = H100.matmul_efficiency
    assert profile.gemm.fit("tf32") is None  # tf32 keeps OpenXLA's smallest-side table
    assert gemm_efficiency(512, 4096, 4096, "tf32", H100, profile) == efficiency(512, "tf32", profile)
    measured = parse_efficiency_profile({"bf16": [[64, 0.2], [8192, 0.8]], "launch_latency": 3e-6})
    assert measured.gemm is None
    assert gemm_efficiency(300, 5000, 7000, "bf16", H100, measured) == efficiency(300, "bf16", measured)
    sources = efficiency_sources(H100, ["bf16", "tf32", "fp8"], profile)
    assert sources["bf16"]["kind"] == sources["fp8"]["kind"] == "GEMM model" and "SMs" in sources["bf16"]["source"]
    assert sources["tf32"]["kind"] == "cited table"


def test_the_presets_carry_the_sms_of_their_datasheets():
    assert {load_hardware(name).gpu.matmul_efficiency.gemm.sms for name in ("a100-40gb", "a100-80gb")} == {108}
    assert {load_hardware(name).gpu.matmul_efficiency.gemm.sms for name in ("h100-sxm", "h200")} == {132}
    assert H200.matmul_efficiency.gemm.fit("bf16") == H100.matmul_efficiency.gemm.fit("bf16")  # the same GH100
    assert H200.matmul_efficiency.gemm.fit("fp8") != H100.matmul_efficiency.gemm.fit("fp8")  # measured on each
    assert TILES == ((128, 128), (128, 256), (256, 128))


def test_mamf_caps_the_blackwell_gemms_the_borrowed_k0_had_run_past_it():
    """B200 and GB200: `large` set at MAMF's short-k best shape with the H100's k0 gave long-k GEMMs more than MAMF (the
    GB200's fp8 tiles 19% more at k 12,288); MAMF, the best a search over shapes found, now caps every shape. At MAMF's
    own shape the tiles' time still gives MAMF; the GH100 presets carry no ceiling."""
    for name, fmt, mamf_tflops, (m, n, k) in (("gb200", "fp8", 3615.6, (19456, 5120, 1536)),
                                              ("gb200", "bf16", 1822.0, (4096, 9728, 2048)),
                                              ("b200", "fp8", 3432.5, (15360, 4096, 3072)),
                                              ("b200", "bf16", 1745.0, (1792, 16128, 3072))):
        gpu = load_hardware(name).gpu
        gemm, peak = gpu.matmul_efficiency.gemm, gpu.flops(fmt)
        fit = gemm.fit(fmt)
        assert fit.mamf == pytest.approx(mamf_tflops * 1e12 / peak, abs=1e-4)
        long_k = 2 * 19456 * 5120 * 12288 / (tile_work(19456, 5120, 12288, 1, gemm.sms, fit.k0) / (fit.large * peak))
        assert long_k > mamf_tflops * 1e12  # what the tiles alone gave
        capped = gemm.seconds(19456, 5120, 12288, fmt, peak)
        assert capped == pytest.approx(2 * 19456 * 5120 * 12288 / (fit.mamf * peak) + fit.fixed, rel=1e-12)
        at_mamf = gemm.seconds(m, n, k, fmt, peak) - fit.fixed
        assert 2 * m * n * k / at_mamf == pytest.approx(mamf_tflops * 1e12, rel=0.002)
        # under a collective's SM margin the ceiling shrinks with the SMs left, as the tiles' rate does
        margin = gemm.seconds(19456, 5120, 12288, fmt, peak, margin=16) - fit.fixed
        assert margin == pytest.approx(2 * 19456 * 5120 * 12288 / (fit.mamf * peak * (gemm.sms - 16) / gemm.sms))
    gb200 = load_hardware("gb200").gpu.matmul_efficiency.gemm.fit("fp8")
    tiles_share = 2 * 19456 * 5120 * 12288 * gb200.large / tile_work(19456, 5120, 12288, 1, 152, gb200.k0)
    assert tiles_share == pytest.approx(0.858, abs=0.002)  # 19% above MAMF's 0.7231, as docs/efficiency.md says
    for gpu in (H100, H200, A100):
        assert all(fit.mamf == 1.0 for _, fit in gpu.matmul_efficiency.gemm.fits)
        assert "mamf" not in efficiency_sources(gpu, ["bf16"], gpu.matmul_efficiency)["bf16"]
    b200 = load_hardware("b200").gpu  # the provenance names the ceiling where there is one
    assert efficiency_sources(b200, ["fp8"], b200.matmul_efficiency)["fp8"]["mamf"] == pytest.approx(3432.5 / 4500, abs=1e-4)


def test_a_model_round_trips_and_bad_ones_name_the_field():
    model = GemmModel(132, (("bf16", GemmFit(0.8, 64.0, 5e-6)),), "a sweep")
    assert parse_gemm_model(model.as_dict(), "x") == model
    capped = GemmModel(132, (("bf16", GemmFit(0.8, 64.0, 5e-6, 0.75)),), "a sweep and a search")
    assert capped.as_dict()["bf16"]["mamf"] == 0.75 and parse_gemm_model(capped.as_dict(), "x") == capped
    for bad, field in (({"sms": 0, "bf16": {"large": 0.8, "k0": 1, "fixed": 0}}, "sms"),
                       ({"sms": 132, "bf16": {"large": 1.5, "k0": 1, "fixed": 0}}, "bf16"),
                       ({"sms": 132, "bf16": {"large": 0.8, "k0": -1, "fixed": 0}}, "bf16"),
                       ({"sms": 132, "bf16": {"large": 0.8, "k0": 1}}, "bf16"),
                       ({"sms": 132, "bf16": {"large": 0.8, "k0": 1, "fixed": 0, "mamf": 1.2}}, "bf16"),
                       ({"sms": 132, "bf16": {"large": 0.8, "k0": 1, "fixed": 0, "ceiling": 0.7}}, "bf16"),
                       ({"sms": 132, "int4": {"large": 0.8, "k0": 1, "fixed": 0}}, "int4")):
        with pytest.raises(ConfigError, match=field):
            parse_gemm_model(bad, "gemm_model")
    with pytest.raises(ConfigError, match="gemm_model"):
        parse_efficiency_profile({"gemm_model": {"sms": "many"}})


def test_userbuffers_run_the_overlapped_linears_in_chunks_priced_chunk_by_chunk():
    """Transformer Engine's userbuffers (initialize_ub's defaults): the ring exchange (qkv and fc1 forward, proj and
    fc2 input gradients) in tp chunks, the pipelined reduce-scatter (proj and fc2 forward) in 4; the bulk overlaps
    (qkv and fc1 input gradients) and every weight gradient whole. Each chunk is a GEMM of its own shape."""
    from job.layout import Layout
    from minigpt.config import GPTConfig
    from precision.policy import policy
    from simulator.costs.compute import op_time
    from simulator.costs.op_types import Gemm, Implementation
    from simulator.costs.ops import UB_PIPELINE_SPLITS, block_ops

    gpu = load_hardware("h100-sxm").gpu
    model = GPTConfig(vocab_size=512, seq_len=2048, n_layers=2, n_heads=32, d_model=4096, d_ff=16384)
    sp8 = Layout(tp=8, sequence_parallel=True)
    gemms = lambda layout, **impl: {op.name: op for op in (lambda o: o.forward + o.backward)(  # noqa: E731
        block_ops(model, 1, layout, policy("bf16"), Implementation(**impl))) if isinstance(op, Gemm)}
    plain, chunked = gemms(sp8), gemms(sp8, ub_chunks=True)
    expected = {"qkv": 8, "fc1": 8, "proj.input_grad": 8, "fc2.input_grad": 8, "proj": UB_PIPELINE_SPLITS,
                "fc2": UB_PIPELINE_SPLITS}
    assert {name: op.chunks for name, op in chunked.items() if op.chunks > 1} == expected
    assert all(op.chunks == 1 for op in plain.values())
    assert gemms(Layout(tp=8), ub_chunks=True) == gemms(Layout(tp=8))  # userbuffers need sequence parallelism
    overhead = gpu.reached.kernel_overhead
    for name, chunks in expected.items():
        op, whole = chunked[name], plain[name]
        assert op.flops == whole.flops and op.bytes - whole.bytes == (chunks - 1) * op.n * op.k * 2  # weight re-read
        one = Gemm(name, op.m // chunks, op.n, op.k, op.dtype)
        piece = one.flops / (tensor_peak(gpu, "bf16") * gemm_efficiency(one.m, one.n, one.k, "bf16", gpu,
                                                                        gpu.matmul_efficiency))
        assert op_time(op, gpu, gpu.matmul_efficiency) == pytest.approx(chunks * (piece + overhead), rel=1e-12)
        assert op_time(op, gpu, gpu.matmul_efficiency) > op_time(whole, gpu, gpu.matmul_efficiency)


def test_the_model_with_the_sustained_share_meets_the_h200_measurements_it_was_not_fitted_to():
    """Held-out validation on our own H200 (docs/measurements/h200-2026-12-04/kernels.json, bench/gpu_kernels.py: each
    GEMM timed in 5 runs of at least 20 ms, long enough for the 700 W limit to hold the clock): the GEMMs of Llama 3
    8B/70B/405B at tp 1-8 with every side at least 1024, priced by the model fitted to H100 sweeps times the sustained
    share. bf16: within 6% each, 2% on average; fp8 (fitted to Azure's H200 bursts): 2-15% slow on each, never fast.
    The gpt2-124m GEMMs (a side of 768 or less) are left out: there the model is up to 27% slow (docs/results.md)."""
    import json
    from statistics import fmean

    rows = json.loads((H200_RUN / "kernels.json").read_text())["gemm"]["shapes"]
    for fmt, worst, mean in (("bf16", 0.06, 0.02), ("fp8", 0.15, 0.10)):
        measured = [r for r in rows if r["format"] == fmt and min(r["m"], r["n"], r["k"]) >= 1024]
        assert len(measured) == 58 and {r["model"] for r in measured} == {"llama3-8b", "llama3-70b", "llama3-405b"}
        errors = [gemm_efficiency(r["m"], r["n"], r["k"], fmt, H200, H200.matmul_efficiency) * tensor_peak(H200, fmt)
                  / r["flops_per_s"] - 1 for r in measured]
        assert max(map(abs, errors)) < worst and abs(fmean(errors)) < mean, (fmt, min(errors), max(errors))
        if fmt == "fp8":
            assert max(errors) < 0
