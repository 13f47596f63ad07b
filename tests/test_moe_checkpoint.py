"""Checkpoints of a mixture of experts that reshard across expert parallelism: written at one ep, loaded at another.

Under --ep a rank holds a slice of every MoE layer's stacked experts (parallel/expert/), which the checkpoint stores
as the plain GPT's whole stacks (parallel/checkpoint/layout.py, kind "experts"). One spawned world of 4 ranks trains
three layouts a few steps (ep 2 in dp 4 under ZeRO-3 in bf16, ep 2 x tp 2 under ZeRO-0, ep 1 in dp 4 under ZeRO-1),
saves each, and loads each into its own layout again (an exact resume) and into two others of another ep or shape;
every global tensor (weights, masters, both moments) must come back bit for bit, and training must go on as the
saving run does. Every layout's fresh state is checked against the plain model's initialisation (the oracle for
where each expert lies, and that each element is written once). The test process loads every checkpoint at ep 1
in one process.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from distributed import run_ranks
from job.train_config import TrainConfig
from minigpt.presets import preset
from minigpt.data import Corpus
from parallel.checkpoint.layout import stage_buffers
from parallel.checkpoint.sharded import gather_global_state, load_checkpoint, save_checkpoint
from parallel.run.sample import load_model
from test_checkpoint import one_thread  # noqa: F401 (autouse: this process's runs on one thread)
from test_checkpoint import counters, mismatches, new_rank, tolerance, train, unlike_the_plain_model

MODEL = preset("tiny-moe").with_(seq_len=32, n_layers=2)
BASE = TrainConfig(model=MODEL, steps=10, global_batch=8, eval_every=0, eval_batches=1, device="cpu", lr=1e-3,
                   min_lr=1e-4, bucket_mb=0.02)  # small buckets: ZeRO cuts parameters mid-row (at ep 1 experts too)
SAVED_AT = 3  # steps trained before the save
AFTER = 2  # steps trained after it, by the saving run and by every run that loads it

# Saved with the first layout, loaded into it again and into each of the others.
CASES = {
    "ep2-dp4-zero3-bf16": (
        dict(dp=4, ep=2, zero=3, precision="bf16"),
        {"ep4-dp4-zero1": dict(dp=4, ep=4, zero=1), "ep1-tp2-dp2-zero2": dict(tp=2, dp=2, zero=2)},
    ),
    "ep2-tp2-dp2-zero0": (
        dict(tp=2, dp=2, ep=2),
        {"ep2-dp4-zero0": dict(dp=4, ep=2), "ep2-pp2-dp2-zero1": dict(pp=2, dp=2, ep=2, zero=1, micro_batches=2)},
    ),
    "ep1-dp4-zero1": (
        dict(dp=4, zero=1),
        {"ep2-dp4-zero3": dict(dp=4, ep=2, zero=3), "ep4-dp4-zero2": dict(dp=4, ep=4, zero=2)},
    ),
    # the expert group folded over tp under sequence parallelism: a slice's writer may sit at tp rank 1
    "ep4-tp2-dp2-sp-zero1": (
        dict(tp=2, dp=2, ep=4, zero=1, sequence_parallel=True),
        {"ep2-dp4-zero0": dict(dp=4, ep=2), "ep2-tp2-dp2-sp": dict(tp=2, dp=2, ep=2, sequence_parallel=True)},
    ),
}
LAYOUT_FIELDS = dict(tp=1, pp=1, dp=1, ep=1, zero=0, micro_batches=1, sequence_parallel=False)


def config(saved: dict, changes: dict) -> TrainConfig:
    keep = {key: value for key, value in saved.items() if key not in LAYOUT_FIELDS}
    return dataclasses.replace(BASE, **{**keep, **LAYOUT_FIELDS, **changes})


def layout_of(saved: dict) -> dict:
    return {key: value for key, value in saved.items() if key in LAYOUT_FIELDS}


def loaded_into(path, cfg: TrainConfig, corpus: Corpus, expected: dict, saved_counters: dict) -> dict:
    """A fresh rank of `cfg` loads `path`: its placements against the plain model first, then what it loaded."""
    rank = new_rank(cfg)
    unlike = unlike_the_plain_model(rank, cfg)
    state = load_checkpoint(path, rank, cfg)
    return {
        "unlike_the_plain_model": unlike,
        "counters restored": counters(rank) == saved_counters,
        "mismatches": mismatches(expected, gather_global_state(rank, cfg)),
        "losses": train(rank, cfg, corpus, range(state["step"], state["step"] + AFTER)),
        "state": {key: state[key] for key in ("step", "rank_state_restored", "optimizer_steps")},
    }


def four_ranks(out_dir: str) -> dict | None:
    """Every case on this rank: saved, resumed by the saving run, and loaded into each target; rank 0's report (the
    saved global tensors go to one file: returning many tensors through the launcher is slow)."""
    torch.set_num_threads(1)
    corpus = Corpus.load(None, MODEL.seq_len)
    report, expected = {}, {}
    for case, (saved, targets) in CASES.items():
        cfg = config(saved, layout_of(saved))
        rank = new_rank(cfg)
        unlike = unlike_the_plain_model(rank, cfg)
        train(rank, cfg, corpus, range(SAVED_AT))
        expected[case] = gather_global_state(rank, cfg)
        path = save_checkpoint(f"{out_dir}/{case}", rank, cfg, SAVED_AT)
        saved_counters = counters(rank)
        report[case] = {"path": str(path), "unlike_the_plain_model": unlike,
                        "reference": train(rank, cfg, corpus, range(SAVED_AT, SAVED_AT + AFTER))}
        report[case]["loads"] = {
            target: loaded_into(path, config(saved, changes), corpus, expected[case], saved_counters)
            for target, changes in {"same layout": layout_of(saved), **targets}.items()
        }
    if torch.distributed.get_rank() != 0:
        return None
    torch.save(expected, f"{out_dir}/expected.pt")
    return report


@pytest.fixture(scope="module")
def spawned(tmp_path_factory) -> tuple[dict, dict]:
    """(rank 0's report by case, the saving run's global tensors by case)."""
    out_dir = tmp_path_factory.mktemp("moe-checkpoints")
    report = run_ranks(4, four_ranks, str(out_dir))[0]
    return report, torch.load(out_dir / "expected.pt", weights_only=True)


def test_every_layout_places_each_expert_where_the_plain_model_has_it(spawned):
    report, _ = spawned
    unlike = {(case, target): load["unlike_the_plain_model"]
              for case in report for target, load in report[case]["loads"].items()}
    unlike |= {(case, "saved"): report[case]["unlike_the_plain_model"] for case in report}
    assert len(unlike) == sum(len(targets) + 2 for _, targets in CASES.values())
    assert {where: names[:5] for where, names in unlike.items() if names} == {}


def test_every_layout_loads_what_another_ep_saved(spawned):
    report, expected = spawned
    assert set(report) == set(expected) == set(CASES)
    for case, found in report.items():
        assert any(key.startswith("model.") and ".mlp.experts." in key for key in expected[case])
        assert set(found["loads"]) == {"same layout", *CASES[case][1]}
        for target, load in found["loads"].items():
            assert load["mismatches"] == [], (case, target, load["mismatches"][:5])
            assert load["state"]["step"] == SAVED_AT and load["counters restored"], (case, target)
            assert load["state"]["rank_state_restored"] == (target == "same layout"), (case, target)


def worst(losses: list[float], reference: list[float]) -> float:
    return max(abs(a - b) / b for a, b in zip(losses, reference, strict=True))


def test_training_goes_on_as_the_saving_run_does(spawned):
    """Bit for bit in the saving layout; within the parity tolerance at another ep or shape (the experts' gradients
    are summed in another order there)."""
    report, _ = spawned
    for case, found in report.items():
        assert found["loads"]["same layout"]["losses"] == found["reference"], case  # exact resume
        gaps = {target: worst(load["losses"], found["reference"]) for target, load in found["loads"].items()}
        assert max(gaps.values()) < tolerance(case), (case, gaps)


def test_one_process_loads_every_ep(spawned):
    report, expected = spawned
    corpus = Corpus.load(None, MODEL.seq_len)
    for case, found in report.items():
        cfg = config(CASES[case][0], {})
        rank = new_rank(cfg)
        state = load_checkpoint(found["path"], rank, cfg)
        assert mismatches(expected[case], gather_global_state(rank, cfg)) == [], case
        losses = train(rank, cfg, corpus, range(state["step"], state["step"] + AFTER))
        assert worst(losses, found["reference"]) < tolerance(case), case


BIASED = BASE.model.with_(router="sigmoid", expert_bias=True, expert_bias_rate=0.01)


def biased_pp2(out_dir: str) -> dict:
    """DeepSeek-V3's choice bias at pp 2 (each stage holding one MoE layer's): trained, saved, trained on."""
    torch.set_num_threads(1)
    cfg = dataclasses.replace(BASE, model=BIASED, pp=2, micro_batches=2)
    corpus, rank = Corpus.load(None, MODEL.seq_len), new_rank(cfg)
    train(rank, cfg, corpus, range(SAVED_AT))
    path = save_checkpoint(f"{out_dir}/biased", rank, cfg, SAVED_AT)
    bias = {name: tensor.tolist() for name, tensor in stage_buffers(rank.stage).items()}
    reference = train(rank, cfg, corpus, range(SAVED_AT, SAVED_AT + AFTER))
    resumed = new_rank(cfg)  # the saving layout again: an exact resume
    step = load_checkpoint(path, resumed, cfg)["step"]
    return {"path": str(path), "bias": bias, "reference": reference,
            "resumed": train(resumed, cfg, corpus, range(step, step + AFTER))}


def test_the_choice_bias_is_saved_and_loads_into_another_layout(tmp_path):
    """The bias, a buffer every rank of its stage holds whole, is written once per layer and comes back bit for bit
    in one process (where both layers are one stage's) and in the plain model `minigpt export` reads; training goes on
    as the saving run does, to the bit in the saving layout (pp 2)."""
    ranks = run_ranks(2, biased_pp2, str(tmp_path))
    saved = {name: bias for found in ranks for name, bias in found["bias"].items()}
    assert sorted(saved) == ["blocks.0.mlp.expert_bias", "blocks.1.mlp.expert_bias"]
    assert all(max(bias) > min(bias) for bias in saved.values())  # moved by 3 steps' loads
    assert all(found["resumed"] == found["reference"] for found in ranks)  # bit for bit in the saving layout
    cfg = dataclasses.replace(BASE, model=BIASED)
    rank = new_rank(cfg)
    state = load_checkpoint(ranks[0]["path"], rank, cfg)
    assert {name: tensor.tolist() for name, tensor in stage_buffers(rank.stage).items()} == saved
    plain, _ = load_model(ranks[0]["path"])
    assert {name: plain.get_buffer(name).tolist() for name in saved} == saved
    losses = train(rank, cfg, Corpus.load(None, MODEL.seq_len), range(state["step"], state["step"] + AFTER))
    assert worst(losses, ranks[0]["reference"]) < tolerance("biased"), (losses, ranks[0]["reference"])
