"""ZeRO 0-3 over data parallel: the same losses and gradient norms as one process, and the memory and traffic
each stage promises.

One spawned group per world size runs every stage (each spawn costs seconds). dp 3 divides no parameter
count evenly: every bucket is padded to a multiple of 3, and the padding must change nothing.
"""

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from distributed import run_ranks
from minigpt.config import GPTConfig
from parallel.run.train import train_on_rank
from job.layout import Layout
from job.train_config import TrainConfig
from parity import history, worst_gap
from simulator.memory import predict_memory

MODEL = GPTConfig(vocab_size=256, seq_len=32, n_layers=2, n_heads=2, d_model=64, d_ff=128)
BASE = TrainConfig(model=MODEL, steps=20, global_batch=8, eval_every=0, eval_batches=1, bucket_mb=0.02, device="cpu")
DP3 = dataclasses.replace(BASE, global_batch=12)  # a global batch that 3 ranks (and 2 micro-batches) divide
# Dynamic loss scaling that moves within 20 steps: it grows every 4 clean steps and overflows at steps 8 and 17.
FP16 = dataclasses.replace(BASE, precision="fp16", loss_scale_window=4)
FP32_TOLERANCE = 1e-4  # relative, per step, over 20 steps
BF16_TOLERANCE = 1e-3  # bf16 sums gradients in another order per layout (8e-5 seen): rounding, not a bug
FP16_TOLERANCE = 1e-3  # fp16 gradients summed in another order (6e-5 seen, on a gradient norm)


def base_of(dp: int) -> TrainConfig:
    return DP3 if dp == 3 else BASE


def run_config(cfg: TrainConfig, out_dir: str) -> dict:
    cfg = dataclasses.replace(cfg, out_dir=out_dir)
    summary = train_on_rank(cfg, torch.device("cpu"))
    if not summary:
        return None
    scales = [json.loads(line)["loss_scale"] for line in Path(out_dir, "metrics.jsonl").read_text().splitlines()]
    return {**history(summary), "loss_scales": scales, "memory": summary["memory_per_rank"],
            "comm": summary["comm_bytes_per_step"]["dp"]}


def every_stage(dp: int, out_dir: str) -> dict:
    """On each rank: train every ZeRO stage (and variants) with this dp; rank 0 reports."""
    base = base_of(dp)
    configs = {f"zero{stage}": dataclasses.replace(base, dp=dp, zero=stage) for stage in range(4)}
    configs["zero2-accumulate"] = dataclasses.replace(base, dp=dp, zero=2, micro_batches=2)
    configs["zero3-accumulate"] = dataclasses.replace(base, dp=dp, zero=3, micro_batches=2)
    if dp == 2:
        configs["zero3-bf16"] = dataclasses.replace(base, dp=dp, zero=3, precision="bf16")
        configs["zero2-fp16"] = dataclasses.replace(FP16, dp=dp, zero=2)
    torch.set_num_threads(1)
    return {name: run_config(cfg, f"{out_dir}/{name}") for name, cfg in configs.items()}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("reference")
    configs = {"fp32": BASE, "bf16": dataclasses.replace(BASE, precision="bf16"), "fp16": FP16, "fp32-dp3": DP3}
    return {name: run_config(cfg, str(out / name)) for name, cfg in configs.items()}


def reference_of(name: str, dp: int) -> str:
    return next((p for p in ("bf16", "fp16") if name.endswith(p)), "fp32-dp3" if dp == 3 else "fp32")


@pytest.fixture(scope="module", params=[2, 3, 4])
def stages(request, tmp_path_factory):
    results = run_ranks(request.param, every_stage, request.param, str(tmp_path_factory.mktemp("zero")))
    return request.param, results[0]


def test_every_stage_matches_one_process(stages, reference):
    dp, results = stages
    gaps = {name: worst_gap(result, reference[reference_of(name, dp)]) for name, result in results.items()}
    print(f"dp={dp} worst relative gaps: " + "; ".join(f"{n} {g}" for n, g in gaps.items()))
    tolerances = {"fp32": FP32_TOLERANCE, "fp32-dp3": FP32_TOLERANCE, "bf16": BF16_TOLERANCE, "fp16": FP16_TOLERANCE}
    for name, gap in gaps.items():
        assert gap.worst < tolerances[reference_of(name, dp)], (name, str(gap))
    if "zero2-fp16" in results:  # the same steps skipped (NaN norms, checked above) and the same scale, step by step
        assert results["zero2-fp16"]["loss_scales"] == reference["fp16"]["loss_scales"]
        assert sum(norm != norm for norm in reference["fp16"]["grad_norms"]) >= 2  # the scaler did skip steps
        assert len(set(reference["fp16"]["loss_scales"])) >= 3  # and grew


def test_each_stage_shards_what_it_promises(stages):
    """The ZeRO paper's accounting, in fp32 here: P weights, P gradients, 2P moments (no separate masters)."""
    dp, results = stages
    full = MODEL.n_params() * 4  # fp32 bytes of one copy of every parameter
    slack = 1.05  # padding of buckets to a multiple of dp

    def rank0(name):
        return results[name]["memory"][0]

    zero0, zero1, zero2, zero3 = (rank0(f"zero{s}") for s in range(4))
    assert full <= zero0["adam_m"] <= full * slack and full <= zero0["gradients"] <= full * slack
    for memory in (zero1, zero2, zero3):
        assert full / dp <= memory["adam_m"] <= full / dp * slack  # optimizer states sharded from stage 1
    assert full <= zero1["gradients"] <= full * slack  # stage 1 keeps full gradients
    for memory in (zero2, zero3):
        assert full / dp <= memory["gradients"] <= full / dp * slack  # sharded from stage 2
    assert zero2["comm_buffers"] < full  # never a full gradient's worth of buckets at once
    for stage, memory in ((1, zero1), (3, zero3)):  # the simulator's model of our buffers (ZeRO-2: below)
        predicted = predict_memory(MODEL, Layout(dp=dp, zero=stage), "fp32", base_of(dp).global_batch // dp,
                                   bucket_mb=BASE.bucket_mb)
        assert memory["comm_buffers"] == predicted.comm_buffers, (stage, memory["comm_buffers"], predicted.comm_buffers)
    predicted = predict_memory(MODEL, Layout(dp=dp, zero=2), "fp32", base_of(dp).global_batch // dp,
                               bucket_mb=BASE.bucket_mb)
    # ZeRO-2's staging depends on which gradients of a bucket come in first: exact at dp 2, 3.5% over at dp 4
    assert zero2["comm_buffers"] <= predicted.comm_buffers <= zero2["comm_buffers"] * 1.05
    for memory in (zero0, zero1, zero2):
        assert full <= memory["parameters"] <= full * slack
    assert full / dp <= zero3["parameters"] <= full / dp * slack
    if "zero3-bf16" in results:  # mixed precision: the paper's 16P/N for stage 3 (2 + 2 + 4 + 4 + 4 bytes)
        bf16 = rank0("zero3-bf16")
        states = sum(bf16[k] for k in ("parameters", "gradients", "master_weights", "adam_m", "adam_v"))
        assert 16 * MODEL.n_params() / dp <= states <= 16 * MODEL.n_params() / dp * slack
        assert bf16["parameters"] * 2 == bf16["master_weights"]  # bf16 weights, fp32 masters
    for name in results:  # every rank holds the same shard sizes
        shapes = {(m["parameters"], m["gradients"], m["adam_m"], m["master_weights"]) for m in results[name]["memory"]}
        assert len(shapes) == 1, name


def test_traffic_per_step(stages):
    """Volume per rank per step: about 2P for stages 0-2, 3P for stage 3 (the ZeRO paper, section 7)."""
    dp, results = stages
    full = MODEL.n_params() * 4

    def volume(name, kind=None):
        comm = results[name]["comm"]
        kinds = [kind] if kind else [k for k in comm if k != "all_reduce" or name == "zero0"]
        return sum(comm.get(k, {"volume": 0})["volume"] for k in kinds)

    for name in ("zero0", "zero1", "zero2"):
        assert 2 * full <= volume(name) <= 2 * full * 1.05, name
    # Slightly under 3P: the embedding and the final unit stay gathered from forward to backward.
    assert 0.85 * 3 * full <= volume("zero3") <= 3 * full * 1.05
    assert volume("zero2-accumulate", "reduce_scatter") == 2 * volume("zero2", "reduce_scatter")
    for name in ("zero1", "zero2", "zero3"):  # beyond the gradients, only the gradient norm
        assert results[name]["comm"]["all_reduce"]["bytes"] == 4
