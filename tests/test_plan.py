"""`minigpt plan`: the search answers GPT-3 on 1,024 GPUs within a minute, its memory refusals and its
lower bound hold against simulate_step, and on a small case it finds what brute force finds; a mixture of experts'
expert parallelism is searched (or fixed by --ep) with the same guarantees, under a routing imbalance too."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from cli.main import main
from minigpt.presets import build_config
from job.schedule import Backward, Forward, peak_in_flight
from simulator.engine.simulate import step_schedule
from simulator.search.plan import candidate_memory, enumerate_candidates, plan, simulate_candidate
from simulator.engine.costs import action_prices
from simulator.search.bound import BUCKET_MB, ComputeLinks, StepBound, candidate_stack, schedule_shape
from simulator.search.sweep import ClusterSpec

ROOT = Path(__file__).resolve().parents[1]
ACCEPTANCE_S = 60.0


def invoke(*args: str):
    return CliRunner().invoke(main, ["plan", *args])


def test_gpt3_on_1024_gpus_answers_within_a_minute_with_a_layout_that_fits():
    command = [sys.executable, "-m", "cli", "plan", "--model", "gpt3-175b", "--gpus", "1024", "--gpu", "a100-80gb",
               "--json"]
    start = time.perf_counter()
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=2 * ACCEPTANCE_S)
    elapsed = time.perf_counter() - start
    assert done.returncode == 0, done.stderr
    assert elapsed < ACCEPTANCE_S, f"plan took {elapsed:.1f} s"
    data = json.loads(done.stdout)
    best = data["best"][0]
    assert len(data["best"]) == 5 and best["memory_per_gpu_bytes"] <= data["memory_capacity_bytes"]
    assert [b["step_time_s"] for b in data["best"]] == sorted(b["step_time_s"] for b in data["best"])
    search = data["search"]
    assert search["candidates"] == sum(search["refused"].values()) + search["did_not_fit"] + search["fit"]
    assert search["fit"] == search["simulated"] + search["pruned_by_bound"] > search["simulated"]
    assert search["did_not_fit"] > 0 and search["smallest_need_among_those_bytes"] > data["memory_capacity_bytes"]
    # the best, simulated again on its own, fits and takes the step plan reported
    model, spec = build_config("gpt3-175b"), ClusterSpec.of("a100-80gb")
    candidates, _ = enumerate_candidates(model, 1024, spec.gpus_per_node, 1024)
    chosen = next(c for c in candidates if c.as_dict() == {k: best[k] for k in c.as_dict()})
    result = simulate_candidate(model, chosen, spec.build(1024), spec, "bf16", 1024)
    assert result.fits and result.step_time_s == pytest.approx(best["step_time_s"], rel=1e-12)


@pytest.fixture(scope="module")
def tight():
    """A 15B GPT on 16 x a100-40gb: a few hundred layouts fit, more than a hundred do not."""
    model, spec = build_config("gpt3-175b", n_layers=8), ClusterSpec.of("a100-40gb")
    return model, spec, plan(model, 16, spec, 32)


def test_every_layout_rejected_for_memory_does_not_fit_when_simulated(tight):
    model, spec, found = tight
    assert len(found.too_big) > 100 and found.fitting > 100
    cluster = spec.build(16)
    for candidate, need in found.too_big:
        result = simulate_candidate(model, candidate, cluster, spec, "bf16", 32)
        assert not result.fits and result.memory.total == need, candidate.describe()


def test_in_flight_micro_batches_are_those_of_the_schedule_simulate_step_builds():
    model = build_config("gpt2-124m")
    spec = ClusterSpec.of("a100-80gb")
    candidates, _ = enumerate_candidates(model, 64, spec.gpus_per_node, 256)
    shapes = {(c.pp, c.micro_batches, c.schedule, c.virtual_chunks): c for c in candidates if c.pp > 1}
    assert {kind for _, _, kind, _ in shapes} == {"1f1b", "interleaved"} and len(shapes) > 20
    for (pp, m, kind, v), c in shapes.items():
        schedule = step_schedule(model, c.layout, m, kind, BUCKET_MB, "bf16")
        assert list(schedule_shape(pp, m, kind, v).in_flight) == peak_in_flight(schedule), (pp, m, kind, v)
        memory = candidate_memory(model, c, "bf16", spec.hardware.gpu)
        assert memory.total == simulate_candidate(model, c, spec.build(64), spec, "bf16", 256).memory.total


@pytest.fixture(scope="module")
def brute_force():
    """gpt2-124m on 16 GPUs: every candidate simulated (all fit on an 80 GB GPU)."""
    model, spec = build_config("gpt2-124m"), ClusterSpec.of("a100-80gb")
    cluster = spec.build(16)
    candidates, _ = enumerate_candidates(model, 16, spec.gpus_per_node, 16)
    bound = StepBound(model, cluster, spec.hardware, "bf16")
    rows = []
    for c in candidates:
        result = simulate_candidate(model, c, cluster, spec, "bf16", 16)
        assert result.fits
        low = bound.seconds(c.layout, c.micro_batches, c.schedule, c.micro_batch, c.recompute, result.memory)
        rows.append((c, result.step_time_s, low))
    return model, spec, rows


def test_plan_finds_the_brute_force_minimum_and_its_top_five(brute_force):
    model, spec, rows = brute_force
    found = plan(model, 16, spec, 16, top=5)
    assert found.fitting == len(rows) and found.pruned > len(rows) // 2  # the bound saves most replays
    times = sorted(step for _, step, _ in rows)
    assert [r.step_time_s for _, r, _ in found.best] == times[:5]
    assert found.best[0][1].step_time_s == min(times)
    for candidate, step, _ in found.simulated:  # no slower than any other simulated
        assert found.best[0][1].step_time_s <= step


def test_the_lower_bound_never_exceeds_the_simulated_step(brute_force, tight):
    _, _, rows = brute_force
    kinds = {(c.schedule, c.zero, c.recompute, c.pp > 1) for c, _, _ in rows}
    assert len(kinds) >= 30  # every schedule, ZeRO stage and recompute mode, with and without a pipeline
    assert all(0 < low <= step for _, step, low in rows), max(low / step for _, step, low in rows)
    assert max(low / step for _, step, low in rows) > 0.8  # and it is not vacuous
    _, _, found = tight
    assert all(0 < low <= step for _, step, low in found.simulated)
    # GPT-3 on 1,024 GPUs, every 131st candidate: each term of the bound decides somewhere, none passes the step
    model, spec = build_config("gpt3-175b"), ClusterSpec.of("a100-80gb")
    cluster = spec.build(1024)
    bound = StepBound(model, cluster, spec.hardware, "bf16")
    candidates, _ = enumerate_candidates(model, 1024, spec.gpus_per_node, 1024)
    deciding = set()
    for c in candidates[::131]:
        job = (c.layout, c.micro_batches, c.schedule, c.micro_batch, c.recompute,
               candidate_memory(model, c, "bf16", spec.hardware.gpu))
        terms = {"compute": bound.compute_seconds(*job), "data parallel": bound.data_parallel_seconds(*job),
                 "reductions": bound.reduction_seconds(*job), "gathers": bound.gathered_seconds(*job)}
        step = simulate_candidate(model, c, cluster, spec, "bf16", 1024).step_time_s
        assert 0 < max(terms.values()) <= step, c.describe()
        deciding.add(max(terms, key=terms.get))
    assert deciding >= {"compute", "data parallel", "reductions"}, deciding


def test_the_data_parallel_term_is_shared_by_candidates_that_differ_in_what_they_recompute():
    """StepBound prices a layout's data-parallel actions once for every candidate with the same schedule (they differ in
    what they recompute): each candidate's term, from a bound that has priced others, equals a fresh bound's for it."""
    model, spec = build_config("llama3-8b"), ClusterSpec.of("h100-sxm")
    cluster = spec.build(32)
    shared = StepBound(model, cluster, spec.hardware, "fp8")
    candidates, _ = enumerate_candidates(model, 32, spec.gpus_per_node, 32)
    groups: dict = {}
    for c in candidates:
        if c.layout.data_ranks > 1:
            groups.setdefault((c.layout, c.micro_batches, c.schedule), []).append(c)
    mixed = [group for group in groups.values() if len({c.recompute for c in group}) > 1]
    assert mixed
    for group in mixed[::max(1, len(mixed) // 4)]:
        for c in group[:3]:
            job = (c.layout, c.micro_batches, c.schedule, c.micro_batch, c.recompute,
                   candidate_memory(model, c, "fp8", spec.hardware.gpu))
            fresh = StepBound(model, cluster, spec.hardware, "fp8")
            assert shared.data_parallel_seconds(*job) == fresh.data_parallel_seconds(*job) > 0, c.describe()
            # the reductions' term reads this candidate's own compute prices, whatever the bound priced before
            assert shared.reduction_seconds(*job) == fresh.reduction_seconds(*job) > 0, c.describe()


@pytest.mark.parametrize("name, gpus, gpu, precision", [("mixtral-8x7b", 64, "h100-sxm", "bf16"),
                                                       ("llama3-8b", 32, "h100-sxm", "fp8")])
def test_the_bounds_action_prices_are_the_simulators(name, gpus, gpu, precision):
    """The bound reads each rank's actions from action_prices, which skips the data-parallel pricer and the buckets:
    every action's price equals the one rank_costs gives simulate_step, for layouts with ep, cp, pp and fp8."""
    model, spec = build_config(name), ClusterSpec.of(gpu)
    cluster = spec.build(gpus)
    bound = StepBound(model, cluster, spec.hardware, precision)
    candidates, _ = enumerate_candidates(model, gpus, spec.gpus_per_node, gpus)
    sample = candidates[::97]
    assert any(c.layout.cp > 1 for c in sample) and any(c.pp > 1 for c in sample)
    assert name != "mixtral-8x7b" or any(c.layout.ep > 1 for c in sample)
    for c in sample:
        memory = candidate_memory(model, c, precision, spec.hardware.gpu)
        job = (c.layout, c.micro_batches, c.schedule, c.micro_batch, c.recompute, memory)
        forward, backward = StepBound(model, cluster, spec.hardware, precision).chunk_prices(*job)  # its own units
        full = bound.costs(*job)
        light = action_prices(model, c.layout, ComputeLinks(cluster, c.layout, spec.hardware.gpu), spec.hardware.gpu,
                              precision, c.micro_batch, spec.hardware.gpu.matmul_efficiency,
                              candidate_stack(bound.settings, c.recompute), bound.settings)
        assert [rank.actions for rank in full] == light, c.describe()
        assert forward == {chunk: cost.total for rank in full for (kind, chunk), cost in rank.actions.items()
                           if kind is Forward}
        assert backward == {chunk: cost.total for rank in full for (kind, chunk), cost in rank.actions.items()
                            if kind is Backward}


def test_the_bounds_shared_units_price_as_a_fresh_bound_does():
    """StepBound prices each unit once for all the layouts it searches (rank_costs' unit_memo): every candidate's
    chunk prices equal those of a bound that has seen no other layout."""
    model, spec = build_config("mixtral-8x7b"), ClusterSpec.of("h100-sxm")
    cluster = spec.build(64)
    shared = StepBound(model, cluster, spec.hardware, "bf16")
    candidates, _ = enumerate_candidates(model, 64, spec.gpus_per_node, 64)
    priced_apart = 0
    for c in candidates[::157]:
        job = (c.layout, c.micro_batches, c.schedule, c.micro_batch, c.recompute,
               candidate_memory(model, c, "bf16", spec.hardware.gpu))
        fresh = StepBound(model, cluster, spec.hardware, "bf16")
        assert shared.chunk_prices(*job) == fresh.chunk_prices(*job), c.describe()
        priced_apart += len(fresh.units)
    assert len(shared.units) < priced_apart  # units shared between layouts were priced once


def test_json_and_table_say_why_the_others_lost():
    result = invoke("--model", "gpt2-124m", "--gpus", "8", "--top", "3", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert len(data["best"]) == 3 and data["global_batch"] == 8  # one sequence per GPU by default
    assert data["search"]["slower"] == data["search"]["fit"] - 3
    assert {b["micro_batch"] for b in data["best"]} != {2}
    fixed = json.loads(invoke("--model", "gpt2-124m", "--gpus", "8", "--micro-batch-size", "2", "--json").output)
    assert {b["micro_batch"] for b in fixed["best"]} == {2}
    table = invoke("--model", "gpt2-124m", "--gpus", "8")
    assert table.exit_code == 0, table.output
    for words in ("why the others lost", "candidates in all", "fit, slower by a lower bound", "MFU", "GiB per GPU"):
        assert words in table.output


def test_the_smallest_need_that_did_not_fit_reads_above_the_capacity():
    from types import SimpleNamespace

    from cli.commands.plan import _why_rows
    gib = 2**30
    for need, shown in ((80.3, "80.3 GiB per GPU, of 80.0)"), (80.04, "80.04 GiB per GPU, of 80.00)"),
                        (80.0004, "80.000 GiB per GPU, of 80.000)")):
        result = SimpleNamespace(candidates=10, refused={}, smallest_too_big=(None, need * gib), capacity=80 * gib,
                                 too_big=[1, 2], simulated=[1], best=[1], pruned=7)
        (row,) = [r for r in _why_rows(result) if r[0].startswith("did not fit")]
        assert row[0].endswith(shown) and row[1] == "2"


def test_plan_stays_torch_free():
    code = "import sys, cli.commands.plan, simulator.search.plan, simulator.search.bound; print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "False"


@pytest.mark.parametrize("args, words", [
    (["--model", "gpt2-124m", "--gpus", "12"], "whole servers of 8"),
    (["--model", "gpt-9", "--gpus", "8"], "gpt-9"),
    (["--model", "gpt2-124m", "--gpus", "8", "--top", "0"], "--top"),
    (["--model", "gpt2-124m", "--gpus", "0"], "--gpus"),
    (["--model", "gpt3-175b", "--gpus", "8", "--gpu", "a100-40gb"], "smallest need is"),
])
def test_bad_input_is_one_line_and_exit_code_2(args, words):
    result = invoke(*args)
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("minigpt: error:") and words in lines[0], result.output
    if words == "smallest need is":
        assert "GiB per GPU" in lines[0] and "holds 40.0 GiB" in lines[0]


# ---------------------------------------------------------------- a mixture of experts: ep searched


@pytest.mark.parametrize("load", [1.0, 2.0])
def test_a_mixture_of_experts_plan_searches_ep_and_finds_the_brute_force_minimum(load):
    """tiny-moe on 8 GPUs, every candidate simulated: ep among the divisors of the ranks routing distinct tokens (dp x
    cp, x tp under sequence parallelism) that divide the 8 experts, memory as
    simulate_step has it, the bound below every step, and plan's best the brute-force minimum."""
    model, spec = build_config("tiny-moe"), ClusterSpec.of("h100-sxm")
    cluster = spec.build(8)
    candidates, _ = enumerate_candidates(model, 8, spec.gpus_per_node, 16)
    assert {(c.dp, c.ep) for c in candidates} >= {(8, 8), (8, 4), (4, 4), (2, 2), (1, 1)}
    assert all(c.dp * (c.tp if c.sequence_parallel else 1) % c.ep == 0 and model.n_experts % c.ep == 0 and c.cp == 1
               for c in candidates)
    assert any(c.sequence_parallel and c.ep > c.dp for c in candidates)  # under SP the expert group folds over tp
    bound = StepBound(model, cluster, spec.hardware, "bf16", load)
    steps = []
    for c in candidates:
        memory = candidate_memory(model, c, "bf16", spec.hardware.gpu, load)
        result = simulate_candidate(model, c, cluster, spec, "bf16", 16, load)
        assert result.memory.total == memory.total, c.describe()
        low = bound.seconds(c.layout, c.micro_batches, c.schedule, c.micro_batch, c.recompute, memory)
        assert 0 < low <= result.step_time_s, c.describe()
        steps.append(result.step_time_s)
    found = plan(model, 8, spec, 16, expert_load=load)
    assert found.best[0][1].step_time_s == min(steps) and found.expert_load == load
    assert found.pruned > len(candidates) // 2


def test_mixtral_on_64_gpus_answers_fast_with_expert_parallelism():
    start = time.perf_counter()
    result = invoke("--model", "mixtral-8x7b", "--gpus", "64", "--gpu", "h100-sxm", "--json")
    elapsed = time.perf_counter() - start
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert elapsed < ACCEPTANCE_S and data["best"][0]["ep"] > 1 and data["expert_load"] == 1.0
    assert data["expert_parallelism"].startswith("ep searched")
    # --ep fixes it, and the table names each layout's ep (on a small MoE: the searches above are the slow part)
    fixed = json.loads(invoke("--model", "tiny-moe", "--gpus", "8", "--ep", "2", "--json").output)
    assert {b["ep"] for b in fixed["best"]} == {2} and fixed["expert_parallelism"] == "ep fixed at 2"
    table = invoke("--model", "tiny-moe", "--gpus", "8", "--ep", "2", "--top", "1")
    assert "(ep 2)" in table.output and "expert load 1.00, balanced" in table.output


def test_a_mixture_of_experts_plans_with_context_parallelism():
    data = json.loads(invoke("--model", "tiny-moe", "--gpus", "8", "--cp", "2", "--json").output)
    assert data["best"] and {b["cp"] for b in data["best"]} == {2}


@pytest.mark.parametrize("args, words", [
    (["--model", "gpt2-124m", "--gpus", "8", "--ep", "2"], "this model is dense"),
    (["--model", "tiny-moe", "--gpus", "8", "--ep", "3"], "does not divide the 8 experts"),
    (["--model", "tiny-moe", "--gpus", "8", "--ep", "0"], "--ep"),
    (["--model", "tiny-moe", "--gpus", "4", "--ep", "8", "--global-batch", "4"],
     "with ranks routing distinct tokens a multiple of --ep 8"),
])
def test_a_bad_ep_is_one_line_and_exit_code_2(args, words):
    result = invoke(*args)
    lines = result.output.strip().splitlines()
    assert result.exit_code == 2 and len(lines) == 1 and words in lines[0], result.output


STACKS = [("torchtitan-fsdp2", ()), ("megatron-core", ()),
          # the stack's kernel flags: torchtitan compiled, Megatron-core on flash-attn with fp32 reductions
          ("torchtitan-fsdp2", (("eager", False),)),
          ("megatron-core", (("attention_kernel", "flash-attn-2"), ("grad_reduce_fp32", True)))]


@pytest.fixture(scope="module", params=STACKS, ids=lambda stack: "+".join([stack[0], *(k for k, _ in stack[1])]))
def stack_brute_force(request):
    """A Llama 3 of 8 blocks on 8 H100s under a stack's preset and flags: every candidate simulated under it."""
    overlap, changes = request.param
    model, spec = build_config("llama3-8b", n_layers=8, seq_len=2048), ClusterSpec.of("h100-sxm")
    cluster = spec.build(8)
    candidates, _ = enumerate_candidates(model, 8, spec.gpus_per_node, 8, op_recompute=overlap == "torchtitan-fsdp2")
    bound = StepBound(model, cluster, spec.hardware, "bf16", overlap=overlap, changes=changes)
    rows = []
    for c in candidates:
        result = simulate_candidate(model, c, cluster, spec, "bf16", 8, overlap=overlap, changes=changes)
        memory = candidate_memory(model, c, "bf16", spec.hardware.gpu, overlap=overlap, changes=changes)
        assert memory.total == result.memory.total, c.describe()  # the check plan makes is simulate_step's
        if result.fits:
            rows.append((c, result.step_time_s, bound.seconds(c.layout, c.micro_batches, c.schedule, c.micro_batch,
                                                              c.recompute, result.memory)))
    return overlap, changes, model, spec, rows


def test_a_stack_preset_plans_as_it_simulates_and_finds_the_brute_force_minimum(stack_brute_force):
    overlap, changes, model, spec, rows = stack_brute_force
    assert all(0 < low <= step for _, step, low in rows), max(low / step for _, step, low in rows)
    op = [c for c, _, _ in rows if c.recompute == "op"]
    if overlap == "torchtitan-fsdp2":  # torchtitan's op policy searched where it is described: tp 1, cp 1
        assert op and all(c.tp == 1 and c.cp == 1 for c in op)
        assert any(c.tp > 1 for c, _, _ in rows)
    else:
        assert not op
    found = plan(model, 8, spec, 8, top=3, overlap=overlap, stack_changes=changes)
    assert found.overlap == overlap and found.fitting == len(rows) and found.stack_changes == changes
    assert [r.step_time_s for _, r, _ in found.best] == sorted(step for _, step, _ in rows)[:3]
    # the stack changes the answer: the same candidates under our executor's overlap price otherwise, and the
    # stack's flags change it again
    other = plan(model, 8, spec, 8, top=3, overlap=overlap if changes else "executor")
    assert [r.step_time_s for _, r, _ in other.best] != [r.step_time_s for _, r, _ in found.best]


def test_plan_takes_the_stacks_flags_as_simulate_does():
    """--attention-kernel (and the other stack flags) change every candidate: plan's best step is `simulate`'s of
    the same layout with the same flag; what the stack cannot run is one line before the search."""
    base = ["--model", "tiny-llama", "--gpus", "8", "--gpu", "h100-sxm", "--dropout", "0", "--overlap",
            "megatron-core", "--top", "1", "--json"]
    done = invoke(*base, "--attention-kernel", "flash-attn-2")
    assert done.exit_code == 0, done.output
    data = json.loads(done.output)
    assert data["stack_changes"] == {"attention_kernel": "flash-attn-2"}
    best = data["best"][0]
    layout = ["--tp", str(best["tp"]), "--pp", str(best["pp"]), "--dp", str(best["dp"]), "--cp", str(best["cp"]),
              "--zero", str(best["zero"]), "--micro-batch", str(best["micro_batch"]), "--schedule", best["schedule"],
              "--virtual-chunks", str(best["virtual_chunks"]), "--recompute", best["recompute"],
              *(["--sequence-parallel"] if best["sequence_parallel"] else [])]
    alone = CliRunner().invoke(main, ["simulate", "--model", "tiny-llama", "--gpu", "h100-sxm", "--dropout", "0",
                                      "--overlap", "megatron-core", "--global-batch", str(data["global_batch"]),
                                      "--attention-kernel", "flash-attn-2", *layout, "--json"])
    assert alone.exit_code == 0, alone.output
    assert json.loads(alone.output)["step_time_s"] == best["step_time_s"]
    for args, words in ((("--elementwise", "eager"), "needs --overlap torchtitan-fsdp2"),
                        (("--fp8-recipe", "mxfp8"), "needs --precision fp8"),
                        (("--attention-kernel", "cudnn", "--gpu", "a100-80gb"), "which a100-80gb has none of")):
        bad = invoke(*base, *args)
        assert bad.exit_code == 2 and words in bad.output and len(bad.output.strip().splitlines()) == 1, bad.output


def test_plan_with_fp8_weights_gathered_searches_zero_only():
    result = invoke("--model", "tiny-llama", "--gpus", "8", "--gpu", "h100-sxm", "--dropout", "0", "--precision",
                    "fp8", "--overlap", "megatron-core", "--fp8-param-gather", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["stack_changes"] == {"fp8_param_gather": True, "fp8_scaling": "tensor"}
    assert data["best"] and all(row["zero"] > 0 for row in data["best"])
    assert data["search"]["refused"]["fp8 weights all-gathered (--fp8-param-gather): ZeRO 0 gathers none"] > 0


def test_plan_names_the_stack_and_refuses_an_unknown_one():
    base = ["--model", "tiny-llama", "--gpus", "8", "--gpu", "h100-sxm", "--dropout", "0"]
    done = invoke(*base, "--overlap", "torchtitan-fsdp2", "--json")
    assert done.exit_code == 0, done.output
    data = json.loads(done.output)
    assert data["overlap"] == "torchtitan-fsdp2"
    text = invoke(*base, "--overlap", "megatron-core").output
    assert "the megatron-core stack" in text
    bad = invoke(*base, "--overlap", "deepspeed")
    assert bad.exit_code == 2 and "deepspeed" in bad.output and "Traceback" not in bad.output


def test_the_bound_cuts_the_gradients_as_the_stack_does():
    """The bound prices the data-parallel reductions in the stack's own buckets (Megatron-core's max(40M, 1M x dp)
    parameters), as simulate_step does: over 1,024 data-parallel ranks fewer, larger reductions than DDP's 25 MiB, and
    still no more than the simulated step."""
    from job.layout import Layout
    from minigpt.config import GPTConfig
    from simulator.costs.hardware import load_hardware
    from simulator.engine.simulate import simulate_step
    from simulator.network.topology import build_cluster

    model = GPTConfig(vocab_size=256000, seq_len=4096, n_layers=32, n_heads=48, n_kv_heads=8, d_model=6144,
                      d_ff=24576, mlp="relu2", positions="rope", tied_head=False, bias=False)  # Nemotron-4 15B
    hardware, layout = load_hardware("h100-sxm"), Layout(tp=2, dp=1024, zero=1, sequence_parallel=True)
    cluster = build_cluster(hardware, 8, 256)
    result = simulate_step(model, layout, cluster, "bf16", 8192, 2, overlap="megatron-core", gpu=hardware)
    megatron = StepBound(model, cluster, hardware, "bf16", overlap="megatron-core")
    ddp = StepBound(model, cluster, hardware, "bf16", overlap="megatron-core", changes=(("ddp_buckets", "ddp"),))
    job = (layout, 4, "1f1b", 2, "none", result.memory)
    assert megatron.data_parallel_seconds(*job) < 0.5 * ddp.data_parallel_seconds(*job)
    assert 0 < megatron.seconds(*job) <= result.step_time_s


def test_plan_searches_fsdp_settings_and_says_how_to_run_them():
    """ZeRO-3 candidates come kept, kept all step and hybrid-sharded over a server's data ranks (simulator/search/
    plan.py's fsdp_options); the table labels them and says what the labels mean, and each is the step `minigpt
    simulate` gives the same layout with the flags that ask for it."""
    args = ["--model", "tiny", "--gpus", "16", "--gpu", "h100-sxm", "--global-batch", "64", "--top", "400"]
    data = json.loads(invoke(*args, "--json").output)
    zero3 = [b for b in data["best"] if b["zero"] == 3]
    kinds = {(b["reshard_after_forward"], b["sync_grads_once"], b["shard_group"] > 0) for b in zero3}
    assert kinds == {(r, s, g) for r, s in ((True, False), (False, False), (False, True)) for g in (False, True)}
    assert all(b["shard_group"] in (0, 8 // b["tp"]) for b in zero3)
    table = invoke(*args).output
    assert "3 kept all step / " in table and "ZeRO 3 kept: a unit not resharded" in table
    assert "ZeRO Z / N: hybrid sharding (--shard-group N)" in table
    for b in [next(b for b in zero3 if b["sync_grads_once"] and b["shard_group"]),
              next(b for b in zero3 if not b["reshard_after_forward"] and not b["sync_grads_once"])]:
        flags = ["--tp", b["tp"], "--pp", b["pp"], "--dp", b["dp"], "--cp", b["cp"], "--zero", 3,
                 "--micro-batch", b["micro_batch"], "--schedule", b["schedule"], "--virtual-chunks",
                 b["virtual_chunks"], "--recompute", b["recompute"], "--no-reshard-after-forward",
                 *(["--sequence-parallel"] if b["sequence_parallel"] else []),
                 *(["--sync-grads-once"] if b["sync_grads_once"] else []),
                 *(["--shard-group", b["shard_group"]] if b["shard_group"] else [])]
        result = CliRunner().invoke(main, ["simulate", "--model", "tiny", "--gpu", "h100-sxm", "--global-batch", "64",
                                           "--json", *map(str, flags)])
        assert result.exit_code == 0, result.output
        assert json.loads(result.output)["step_time_s"] == pytest.approx(b["step_time_s"], rel=1e-12)


def test_the_reductions_term_waits_for_the_compute_that_makes_the_gradients():
    """A MoE over 64 data ranks, no pipeline: its gradient reductions cannot start before the forward that precedes
    the backward issuing them, and the routed experts' own reduction, issued with the optimizer step, not before the
    last compute. The bound's reductions term says so, tops the other two terms, and stays under the step."""
    model, spec = build_config("mixtral-8x7b"), ClusterSpec.of("h100-sxm")
    cluster = spec.build(64)
    bound = StepBound(model, cluster, spec.hardware, "bf16")
    candidates, _ = enumerate_candidates(model, 64, spec.gpus_per_node, 64)
    c = next(c for c in candidates if (c.tp, c.pp, c.dp, c.ep, c.zero, c.micro_batches, c.recompute, c.shard_group)
             == (1, 1, 64, 8, 1, 1, "none", 0))
    job = (c.layout, c.micro_batches, c.schedule, c.micro_batch, c.recompute,
           candidate_memory(model, c, "bf16", spec.hardware.gpu))
    step = simulate_candidate(model, c, cluster, spec, "bf16", 64).step_time_s
    compute, dp, reductions = (bound.compute_seconds(*job), bound.data_parallel_seconds(*job),
                               bound.reduction_seconds(*job))
    assert max(compute, dp) < 0.6 * step  # each alone says little here: the reductions come after the compute
    assert 1.4 * max(compute, dp) < reductions <= step


def test_the_gathers_term_follows_the_first_micro_batch_through_the_stages():
    """Pipelined ZeRO-3 kept all step: each chunk's first forward waits for the gathers it issues as it starts, and
    the next stage for it. Over 1,024 A100s GPT-3's gathers take longer than the chunks' compute: the bound's gathers
    term tops its compute term by a quarter and stays under the simulated step."""
    model, spec = build_config("gpt3-175b"), ClusterSpec.of("a100-80gb")
    cluster = spec.build(1024)
    bound = StepBound(model, cluster, spec.hardware, "bf16")
    candidates, _ = enumerate_candidates(model, 1024, spec.gpus_per_node, 1024)
    c = next(c for c in candidates if (c.tp, c.cp, c.pp, c.dp, c.zero, c.reshard_after_forward, c.micro_batch,
                                       c.schedule, c.recompute, c.sequence_parallel, c.shard_group)
             == (2, 2, 8, 32, 3, False, 1, "interleaved", "none", True, 0))
    job = (c.layout, c.micro_batches, c.schedule, c.micro_batch, c.recompute,
           candidate_memory(model, c, "bf16", spec.hardware.gpu))
    step = simulate_candidate(model, c, cluster, spec, "bf16", 1024).step_time_s
    compute, gathers = bound.compute_seconds(*job), bound.gathered_seconds(*job)
    assert 1.25 * compute < gathers <= step  # 12.6 s, 16.2 s, 26.0 s
