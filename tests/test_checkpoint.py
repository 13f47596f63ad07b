"""Sharded checkpoints: saved by one layout, loaded by another (and by one process), exactly.

One spawned world of 4 ranks trains three layouts a few steps, saves each, and loads each
into other layouts in the same world; every global tensor (weights, masters, both moments)
must come back bit for bit, and training must go on as the saving run does. The test
process then loads the same checkpoints into one process. The rest (atomicity, refusals)
runs in this process on a checkpoint of one process.
"""

from __future__ import annotations

import dataclasses
import json
import pickle
import random
import shutil

import pytest
import torch

from distributed import run_ranks
from minigpt.config import GPTConfig
from minigpt.data import Corpus
from minigpt.errors import ConfigError
from minigpt.model import GPT
from parallel.run.build import build_rank
from parallel.checkpoint.sharded import (
    check_checkpoint,
    gather_global_state,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from parallel.checkpoint.files import sha256_of
from parallel.checkpoint.layout import decompose
from parallel.mesh import build_mesh
from parallel.run.train import micro_batches
from job.train_config import TrainConfig
from precision.compute import dtype_of
from precision.policy import policy as precision_policy

MODEL = GPTConfig(vocab_size=257, seq_len=32, n_layers=4, n_heads=4, d_model=32, d_ff=64)
BASE = TrainConfig(model=MODEL, steps=10, global_batch=8, micro_batches=2, eval_every=0, eval_batches=1,
                   bucket_mb=0.02, device="cpu")  # small buckets: ZeRO cuts parameters mid-row
SAVED_AT = 3  # steps trained before the save
AFTER = 2  # steps trained after it, by the saving run and by every run that loads it


# Saved with the first layout, loaded into each of the others and into the saving layout again.
CASES = {
    "tp2-dp2-zero3-bf16-untied": (
        dict(tp=2, dp=2, zero=3, precision="bf16", model=MODEL.with_(tied_head=False)),
        {"dp4-zero1": dict(dp=4, zero=1), "pp2-tp2": dict(pp=2, tp=2)},
    ),
    "pp2-dp2-zero1-tied": (
        dict(pp=2, dp=2, zero=1),
        {"tp4": dict(tp=4), "tp2-dp2-zero3": dict(tp=2, dp=2, zero=3),
         "pp4-stages-0-2-1-1": dict(pp=4, stage_layers=(0, 2, 1, 1))},
    ),
    # multi-token prediction under pipelining: the last stage's own copy of the untied embedding, never saved
    "pp2-mtp-untied": (
        dict(pp=2, dp=2, model=MODEL.with_(tied_head=False, mtp_depth=1)),
        {"dp4-zero3": dict(dp=4, zero=3)},
    ),
    "tp2-pp2-fp16-tied": (
        dict(tp=2, pp=2, precision="fp16"),
        {"pp4": dict(pp=4), "pp2-interleaved-dp2-zero2": dict(pp=2, dp=2, zero=2, schedule="interleaved", virtual_chunks=2)},
    ),
}
LAYOUT_FIELDS = dict(tp=1, pp=1, dp=1, zero=0, schedule=BASE.schedule, virtual_chunks=1, stage_layers=())


def counters(rank) -> dict:
    return {"optimizer_steps": rank.optimizer.steps, "scaler": rank.scaler.state_dict() if rank.scaler else None}


def layout_of(saved: dict) -> dict:
    return {key: value for key, value in saved.items() if key in LAYOUT_FIELDS}


def config_of(saved: dict, changes: dict) -> TrainConfig:
    keep = {key: value for key, value in saved.items() if key not in LAYOUT_FIELDS}
    return dataclasses.replace(BASE, **{**keep, **LAYOUT_FIELDS, **changes})


def new_rank(cfg: TrainConfig):
    device = torch.device("cpu")
    return build_rank(cfg, build_mesh(cfg.pp, cfg.dp, cfg.tp, device, cfg.cp, cfg.shard_group), device,
                      precision_policy(cfg.precision))


def train(rank, cfg: TrainConfig, corpus: Corpus, steps: range) -> list[float]:
    """The training loop's steps (parallel/run/train.py), losses averaged over the layout."""
    losses = []
    for step in steps:
        inputs, targets = micro_batches(corpus, cfg, step, rank.mesh, torch.device("cpu"))
        losses.append(rank.train_step(cfg, step, inputs, targets).loss)
    return losses


def mismatches(expected: dict, got: dict) -> list[str]:
    return sorted(key for key in expected if not torch.equal(expected[key], got[key]))


def unlike_the_plain_model(rank, cfg: TrainConfig) -> list[str]:
    """A fresh rank's global tensors against GPT's own initialisation: the oracle for where each
    element of a shard belongs (saving and loading share that mapping, so they cannot check it)."""
    got = gather_global_state(rank, cfg)
    torch.manual_seed(cfg.seed)  # as build_rank does
    dtype = dtype_of(precision_policy(cfg.precision).compute)
    return [
        name for name, param in GPT(cfg.model).named_parameters()
        if not torch.equal(got[f"model.{name}"], param.detach().to(dtype).float())
        or not torch.equal(got[f"master.{name}"], param.detach().to(dtype).float())
    ]


def four_ranks(out_dir: str) -> dict | None:
    torch.set_num_threads(1)
    corpus = Corpus.load(None, MODEL.seq_len)
    report = {}
    for case, (saved, targets) in CASES.items():
        cfg = config_of(saved, layout_of(saved))
        rank = new_rank(cfg)
        unlike = {case: unlike_the_plain_model(rank, cfg)}
        train(rank, cfg, corpus, range(SAVED_AT))
        expected = gather_global_state(rank, cfg)
        path = save_checkpoint(f"{out_dir}/{case}", rank, cfg, SAVED_AT, {"case": case})
        saved_counters = counters(rank)
        reference = train(rank, cfg, corpus, range(SAVED_AT, SAVED_AT + AFTER))
        loads = {}
        for target, changes in {"same layout": layout_of(saved), **targets}.items():
            target_cfg = config_of(saved, changes)
            loaded = new_rank(target_cfg)
            unlike[target] = unlike_the_plain_model(loaded, target_cfg)
            state = load_checkpoint(path, loaded, target_cfg)
            loads[target] = {
                "counters restored": counters(loaded) == saved_counters,
                "mismatches": mismatches(expected, gather_global_state(loaded, target_cfg)),
                "losses": train(loaded, target_cfg, corpus, range(state["step"], state["step"] + AFTER)),
                "state": {key: state[key] for key in ("step", "extra", "rank_state_restored", "optimizer_steps")},
            }
        if torch.distributed.get_rank() == 0:  # one file: returning 200 tensors through the launcher is slow
            torch.save(expected, f"{out_dir}/{case}-expected.pt")
        report[case] = {"path": str(path), "expected": f"{out_dir}/{case}-expected.pt", "reference": reference,
                        "loads": loads, "unlike_the_plain_model": unlike}
    return report if torch.distributed.get_rank() == 0 else None


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """This process's runs are tiny: a second thread only spins against the spawned ranks and other jobs."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def spawned(tmp_path_factory):
    report = run_ranks(4, four_ranks, str(tmp_path_factory.mktemp("checkpoints")))[0]
    for case in report.values():
        case["expected"] = torch.load(case["expected"], weights_only=True)
    return report


def tolerance(case: str) -> float:
    return 1e-4 if "16" not in case else 1e-2  # 16-bit compute rounds each layout's sums differently


def test_every_layout_places_each_element_where_the_plain_model_has_it(spawned):
    for case, report in spawned.items():
        assert len(report["unlike_the_plain_model"]) == 1 + len(CASES[case][1]) + 1
        for layout, names in report["unlike_the_plain_model"].items():
            assert names == [], (case, layout, names[:5])


def test_every_layout_loads_what_another_saved(spawned):
    assert set(spawned) == set(CASES)
    for case, report in spawned.items():
        for target, load in report["loads"].items():
            assert load["mismatches"] == [], (case, target, load["mismatches"][:5])
            assert load["state"]["step"] == SAVED_AT and load["state"]["extra"] == {"case": case}
            assert load["state"]["optimizer_steps"] > 0 and load["counters restored"], (case, target)
            assert load["state"]["rank_state_restored"] == (target == "same layout")


def test_training_goes_on_as_the_saving_run_does(spawned):
    for case, report in spawned.items():
        assert report["loads"]["same layout"]["losses"] == report["reference"], case  # exact resume
        for target, load in report["loads"].items():
            gaps = [abs(a - b) / b for a, b in zip(load["losses"], report["reference"])]
            assert max(gaps) < tolerance(case), (case, target, gaps)


def test_one_process_loads_every_layout(spawned):
    corpus = Corpus.load(None, MODEL.seq_len)
    for case, report in spawned.items():
        saved = CASES[case][0]
        cfg = config_of(saved, {})
        rank = new_rank(cfg)
        assert unlike_the_plain_model(rank, cfg) == []
        state = load_checkpoint(report["path"], rank, cfg)
        assert mismatches(report["expected"], gather_global_state(rank, cfg)) == [], case
        losses = train(rank, cfg, corpus, range(state["step"], state["step"] + AFTER))
        gaps = [abs(a - b) / b for a, b in zip(losses, report["reference"])]
        assert max(gaps) < tolerance(case), (case, gaps)


def test_another_precision_takes_the_masters(spawned):
    """fp32 saves no separate masters (the weights are); bf16 saves them: either loads into the other."""
    for case, precision in (("pp2-dp2-zero1-tied", "bf16"), ("tp2-dp2-zero3-bf16-untied", "fp32")):
        cfg = dataclasses.replace(config_of(CASES[case][0], {}), precision=precision)
        rank = new_rank(cfg)
        load_checkpoint(spawned[case]["path"], rank, cfg)
        got = gather_global_state(rank, cfg)
        expected = spawned[case]["expected"]
        for key in expected:
            if key.startswith(("master.", "exp_avg")):
                assert torch.equal(got[key], expected[key]), (case, key)


def test_the_checkpoint_is_the_plain_models_state_dict(spawned):
    """Names and unpadded shapes of GPT's state dict, the qkv rows in their own order."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    path = spawned["tp2-dp2-zero3-bf16-untied"]["path"]
    out = f"{path}-plain.pt"
    dcp_to_torch_save(path, out)
    tensors = torch.load(out, weights_only=True)
    model = GPT(MODEL.with_(tied_head=False))
    plain = {key.removeprefix("model."): value.float() for key, value in tensors.items() if key.startswith("model.")}
    model.load_state_dict(plain)
    expected = spawned["tp2-dp2-zero3-bf16-untied"]["expected"]
    for name, value in plain.items():
        assert torch.equal(value, expected[f"model.{name}"]), name


def test_one_process_resumes_fp8_exactly(tmp_path):
    """Same layout: RNG and fp8 scaling histories come back too, so the losses go on bit for bit."""
    cfg = dataclasses.replace(BASE, precision="fp8")
    corpus = Corpus.load(None, MODEL.seq_len)
    rank = new_rank(cfg)
    train(rank, cfg, corpus, range(2))
    path = save_checkpoint(tmp_path, rank, cfg, 2)
    reference = train(rank, cfg, corpus, range(2, 4))
    resumed = new_rank(cfg)
    state = load_checkpoint(path, resumed, cfg)
    assert state["rank_state_restored"] and train(resumed, cfg, corpus, range(2, 4)) == reference


def test_boxes_tile_any_run_of_elements():
    generator = random.Random(0)
    for _ in range(500):
        shape = tuple(generator.randint(1, 5) for _ in range(generator.randint(1, 4)))
        numel = torch.Size(shape).numel()
        start = generator.randrange(numel)
        end = generator.randint(start + 1, numel)
        flat = torch.zeros(numel, dtype=torch.long)
        position = start
        for first, offsets, sizes in decompose(shape, start, end):
            assert first == position  # in order, each a contiguous run
            index = torch.arange(numel).view(shape)[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))]
            assert torch.equal(index.flatten(), torch.arange(first, first + index.numel()))
            flat[index.flatten()] += 1
            position += index.numel()
        assert position == end and flat[start:end].eq(1).all() and flat.sum() == end - start


# ---------------------------------------------------------------------------- atomicity and refusals


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    cfg = BASE
    rank = new_rank(cfg)
    train(rank, cfg, Corpus.load(None, MODEL.seq_len), range(1))
    root = tmp_path_factory.mktemp("one")
    return cfg, rank, save_checkpoint(root / "run", rank, cfg, 1)


def copy_of(path, tmp_path, name="step-000001"):
    target = tmp_path / "copies" / name
    shutil.copytree(path, target)
    return target


def reseal(path) -> None:
    """Record the files' current sizes and checksums in state.json, and its checksum in the marker, as if
    they had been saved so: what gets past the checksums must still be refused by the reader."""
    state = json.loads((path / "state.json").read_text())
    state["files"] = {name: {"bytes": (path / name).stat().st_size, "sha256": sha256_of(path / name)}
                      for name in state["files"]}
    (path / "state.json").write_text(json.dumps(state))
    (path / "COMPLETE").write_text(json.dumps({"step": state["step"], "state_sha256": sha256_of(path / "state.json")}))


def test_latest_ignores_tmp_and_unmarked_directories(one_process, tmp_path):
    _, _, path = one_process
    root = tmp_path / "run"
    good = copy_of(path, tmp_path, "step-000003")
    shutil.move(str(good), root / "step-000003")
    shutil.copytree(root / "step-000003", root / "step-000009.tmp")  # a save that crashed before the rename
    shutil.copytree(root / "step-000003", root / "step-000007")
    (root / "step-000007" / "COMPLETE").unlink()  # no marker
    (root / "notes").mkdir()
    assert latest_checkpoint(root) == root / "step-000003"
    assert latest_checkpoint(tmp_path / "nowhere") is None
    for bad in ("step-000009.tmp", "step-000007"):
        with pytest.raises(ConfigError, match="incomplete"):
            check_checkpoint(root / bad, BASE)


def test_saving_again_replaces_and_leaves_no_tmp(one_process):
    cfg, rank, path = one_process
    again = save_checkpoint(path.parent, rank, cfg, 1)
    assert again == path and check_checkpoint(path, cfg)["step"] == 1
    assert sorted(p.name for p in path.parent.iterdir()) == ["step-000001"]


def test_refusals(one_process, tmp_path):
    cfg, rank, path = one_process
    with pytest.raises(ConfigError, match="does not exist"):
        check_checkpoint(tmp_path / "missing", cfg)
    with pytest.raises(ConfigError, match="d_model 32 there, 64 here"):
        check_checkpoint(path, dataclasses.replace(cfg, model=MODEL.with_(d_model=64)))
    with pytest.raises(ConfigError, match="tied_head True there, False here"):
        load_checkpoint(path, rank, dataclasses.replace(cfg, model=MODEL.with_(tied_head=False)))

    truncated = copy_of(path, tmp_path)
    data = next(truncated.glob("*.distcp"))
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    with pytest.raises(ConfigError, match="truncated"):
        check_checkpoint(truncated, cfg)
    reseal(truncated)  # sizes agree again: DCP's read must fail, and say so in one line
    with pytest.raises(ConfigError, match="corrupt: reading its tensors failed"):
        load_checkpoint(truncated, rank, cfg)

    shutil.rmtree(truncated)
    garbage = copy_of(path, tmp_path)
    (garbage / ".metadata").write_bytes(b"not a pickle")
    reseal(garbage)
    with pytest.raises(ConfigError, match="cannot read its tensor metadata"):
        load_checkpoint(garbage, rank, cfg)

    shutil.rmtree(garbage)
    hostile = copy_of(path, tmp_path)
    canary = tmp_path / "canary"
    (hostile / ".metadata").write_bytes(pickle.dumps(Hostile(str(canary))))
    reseal(hostile)
    with pytest.raises(ConfigError, match="not part of checkpoint metadata"):
        load_checkpoint(hostile, rank, cfg)
    assert not canary.exists()  # nothing from the file ran

    shutil.rmtree(hostile)
    no_state = copy_of(path, tmp_path)
    (no_state / "state.json").write_text("{")
    with pytest.raises(ConfigError, match="corrupt"):
        check_checkpoint(no_state, cfg)

    shutil.rmtree(no_state)
    odd_settings = copy_of(path, tmp_path)  # found by tests/test_fuzz_checkpoint.py: "config": true
    state = json.loads((odd_settings / "state.json").read_text())
    (odd_settings / "state.json").write_text(json.dumps({**state, "config": True}))
    reseal(odd_settings)
    with pytest.raises(ConfigError, match="no valid 'config'"):
        check_checkpoint(odd_settings, cfg)


class Hostile:
    """Unpickling this would create a directory."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        import os

        return os.mkdir, (self.path,)
