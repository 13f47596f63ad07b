"""Muon (--optimizer muon: precision/muon.py, parallel/run/muon.py, job/muon.py).

The update itself against a textbook Muon written here from the papers, parameter by parameter with torch
(Jordan et al. 2024's Newton-Schulz quintic, Nesterov momentum; Liu et al. 2025's 0.2 sqrt(max(A, B)) scale and
decoupled weight decay; AdamW for what is not a hidden matrix). Then every layout against one process on the same
global batch, 20 steps (losses, gradient norms, and the final weights): the matrices cut by tensor parallelism
(fused qkv sections, rows, columns), by ZeRO's pieces at any element (1, 2, 3, hybrid), by pipeline stages and by
expert parallelism are made whole, orthogonalised once on one rank of the stage, and handed back. A checkpoint
saved by one layout resumes in one process exactly; the state a rank holds is what the simulator predicts.
"""

from __future__ import annotations

from functools import partial

import pytest
import torch

from distributed import every_layout, one_thread, run_worlds
from job.train_config import TrainConfig
from minigpt.presets import preset
from model_states import held_states, predicted_states
from parallel.run.muon import orthogonalized
from parity import assert_runs_match

MODELS = {"llama": preset("tiny-llama").with_(seq_len=32),
          "moe": preset("tiny-moe").with_(seq_len=32)}
TOLERANCE = 1e-5  # relative, every step, losses and gradient norms (fp32)
WEIGHTS_TOLERANCE = 1e-5  # the final masters, largest difference over the largest weight
LAYOUTS = {
    2: {"dp2": ("llama", dict(dp=2)), "dp2-zero1": ("llama", dict(dp=2, zero=1)),
        "dp2-zero3": ("llama", dict(dp=2, zero=3)), "tp2-sp": ("llama", dict(tp=2, sequence_parallel=True)),
        "pp2": ("llama", dict(pp=2, micro_batches=2)), "cp2": ("llama", dict(cp=2)),
        "moe-dp2-ep2-zero1": ("moe", dict(dp=2, ep=2, zero=1))},
    4: {"tp2-dp2-zero2": ("llama", dict(tp=2, dp=2, zero=2)),
        "pp2-tp2": ("llama", dict(pp=2, tp=2, micro_batches=2)),
        "dp4-shard2-zero3": ("llama", dict(dp=4, zero=3, shard_group=2)),
        "moe-tp2-sp-dp2-ep2": ("moe", dict(tp=2, sequence_parallel=True, dp=2, ep=2, zero=1))},
}
SAVED_BY, SAVED_AT = "dp2-zero1", 10


def config(model: str, **layout) -> TrainConfig:
    return TrainConfig(model=MODELS[model], steps=20, global_batch=8, eval_every=0, eval_batches=1, device="cpu",
                       lr=1e-3, min_lr=1e-4, optimizer="muon", **layout)


def trained(cfg: TrainConfig, save: str | None = None, steps: range | None = None, load: str | None = None) -> dict:
    """This rank's losses and gradient norms over `steps` (all), the whole masters (rank 0), the states it holds;
    a checkpoint saved after SAVED_AT steps into `save`, or the run started from the one at `load`."""
    from minigpt.data import Corpus
    from parallel.checkpoint.sharded import gather_global_state, load_checkpoint, save_checkpoint
    from parallel.run.train import micro_batches
    from test_checkpoint import new_rank

    rank, corpus = new_rank(cfg), Corpus.load(None, cfg.model.seq_len)
    if load is not None:
        load_checkpoint(load, rank, cfg)
    found = {"losses": [], "grad_norms": []}
    for step in steps or range(cfg.steps):
        if save is not None and step == SAVED_AT:
            save_checkpoint(save, rank, cfg, step)
        inputs, targets = micro_batches(corpus, cfg, step, rank.mesh, torch.device("cpu"))
        outcome = rank.train_step(cfg, step, inputs, targets)
        found["losses"].append(outcome.loss)
        found["grad_norms"].append(outcome.result.grad_norm)
    state = gather_global_state(rank, cfg)
    masters = {key: value.clone() for key, value in state.items() if key.startswith("master.")}
    first = not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0
    return found | {"masters": masters if first else None, "states": held_states(rank), "stage": rank.mesh.pp_rank}


def world_runs(save_dir: str, world: int) -> dict:
    torch.set_num_threads(1)
    return {name: trained(config(model, **layout), save=save_dir if name == SAVED_BY else None)
            for name, (model, layout) in LAYOUTS[world].items()}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    return str(tmp_path_factory.mktemp("muon-checkpoints"))


@pytest.fixture(scope="module")
def spawned(saved):
    return run_worlds(partial(world_runs, saved), LAYOUTS)


@pytest.fixture(scope="module")
def references():
    with one_thread():
        return {model: trained(config(model)) for model in MODELS}


def worst_weight_gap(ours: dict, theirs: dict) -> float:
    scale = max(float(value.abs().max()) for value in theirs.values())
    return max(float((ours[key] - value).abs().max()) for key, value in theirs.items()) / scale


ALL = every_layout(LAYOUTS)


@pytest.mark.parametrize("world, name", ALL, ids=[name for _, name in ALL])
def test_every_layout_matches_one_process(spawned, references, world, name):
    reference = references[LAYOUTS[world][name][0]]
    assert_runs_match(spawned[name], reference, f"muon {name}", TOLERANCE)
    gap = worst_weight_gap(spawned[name][0]["masters"], reference["masters"])
    print(f"muon {name}: final weights {gap:.1e}")
    assert gap <= WEIGHTS_TOLERANCE, name


@pytest.mark.parametrize("world, name", ALL, ids=[name for _, name in ALL])
def test_model_states_per_rank_are_the_simulators(spawned, world, name):
    """Muon's momentum where AdamW keeps its first moment, AdamW's second moment for the other weights alone, on
    the rank that owns them: as simulator/memory.py predicts them, rank for rank (the most loaded of a stage)."""
    model, layout = LAYOUTS[world][name]
    cfg = config(model, **layout)
    for stage in {run["stage"] for run in spawned[name]}:
        held = [run["states"] for run in spawned[name] if run["stage"] == stage]
        worst = {key: max(states[key] for states in held) for key in held[0]}
        assert worst == predicted_states(cfg, stage), name


def test_a_checkpoint_of_one_layout_resumes_in_one_process(spawned, references, saved):
    """dp 2 ZeRO-1's checkpoint at step 10 (momentum in pieces, the second moments of the AdamW weights alone)
    loads into one process, which trains steps 10 to 19 as the uninterrupted reference did."""
    from parallel.checkpoint.files import step_dir_name

    model = LAYOUTS[2][SAVED_BY][0]
    path = f"{saved}/{step_dir_name(SAVED_AT)}"
    with one_thread():
        resumed = trained(config(model), steps=range(SAVED_AT, 20), load=path)
    reference = references[model]
    tail = {key: reference[key][SAVED_AT:] for key in ("losses", "grad_norms")}
    assert_runs_match([resumed], tail, "muon resumed", TOLERANCE)
    assert worst_weight_gap(resumed["masters"], reference["masters"]) <= WEIGHTS_TOLERANCE


# ---------------------------------------------------------------------------- the update, against the papers


def textbook_newton_schulz(g: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """Jordan et al. 2024's zeropower_via_newtonschulz5, in fp32, as their post writes it."""
    a, b, c = (3.4445, -4.7750, 2.0315)
    x = g / (g.norm() + 1e-7)
    transposed = g.size(0) > g.size(1)
    if transposed:
        x = x.T
    for _ in range(steps):
        s = x @ x.T
        x = a * x + (b * s + c * s @ s) @ x
    return x.T if transposed else x


def test_orthogonalized_is_newton_schulz_with_moonlights_scale():
    torch.manual_seed(0)
    for rows, cols in ((24, 40), (40, 24), (32, 32)):
        g = torch.randn(rows, cols)
        expected = textbook_newton_schulz(g) * 0.2 * max(rows, cols) ** 0.5
        assert torch.allclose(orthogonalized(g), expected, atol=1e-5), (rows, cols)
        singular = torch.linalg.svdvals(orthogonalized(g) / (0.2 * max(rows, cols) ** 0.5))
        # the quintic's band around 1, not the exact polar factor (a square Gaussian's smallest are still rising)
        assert singular.min() > 0.3 and singular.max() < 1.25 and 0.7 < singular.median() < 1.2
    stack = torch.randn(3, 16, 8)  # a stack of experts: each its own matrix
    assert torch.allclose(orthogonalized(stack), torch.stack([orthogonalized(m) for m in stack]), atol=1e-6)


def test_a_piece_alone_is_not_its_rows_of_the_whole():
    """Why the pieces must be made whole: orthogonalising a tensor-parallel shard or a ZeRO piece by itself gives
    another update (what the parity tests would see)."""
    torch.manual_seed(0)
    g = torch.randn(32, 16)
    assert not torch.allclose(orthogonalized(g[:16]), orthogonalized(g)[:16], atol=1e-2)


def test_one_step_is_the_textbook_rule():
    """MasterMuon on a 6 x 10 matrix and a vector laid end to end (the matrix's decayed, the vector's not), over
    three steps: the matrix moves by lr x (its Nesterov update orthogonalised and scaled) after decoupled decay,
    the vector as torch.optim.AdamW moves it."""
    from precision.muon import MasterMuon

    torch.manual_seed(0)
    matrix, vector = torch.randn(6, 10), torch.randn(5)
    weights = torch.cat([matrix.reshape(-1), vector])

    def orthogonalize(update):
        update[:60] = orthogonalized(update[:60].view(6, 10)).reshape(-1)

    muon = MasterMuon(weights, [(0, 60)], orthogonalize, momentum=0.9, lr=0.02, betas=(0.9, 0.95),
                      weight_decay=0.1, decay_ranges=[(0, 60)])
    reference = torch.nn.Parameter(vector.clone())
    adamw = torch.optim.AdamW([reference], lr=0.02, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    expected, momentum = matrix.clone(), torch.zeros(6, 10)
    for _ in range(3):
        grads = torch.randn(65)
        muon.step(grads, grad_clip=0.0)
        momentum = 0.9 * momentum + grads[:60].view(6, 10)
        nesterov = grads[:60].view(6, 10) + 0.9 * momentum
        expected = expected * (1 - 0.02 * 0.1) - 0.02 * textbook_newton_schulz(nesterov) * 0.2 * 10**0.5
        reference.grad = grads[60:].clone()
        adamw.step()
    assert torch.allclose(muon.masters[:60].view(6, 10), expected, atol=1e-6)
    assert torch.allclose(muon.masters[60:], reference.detach(), atol=1e-6)
    assert muon.exp_avg_sq.numel() == 5  # a second moment for the vector alone


def test_the_simulators_matrices_are_the_models():
    """job/muon.py's torch-free shapes of every preset's matrices (what the simulator prices) are the model's own,
    each expert of a stack apart."""
    from job.muon import matrices, stage_matrices
    from minigpt.presets import PRESETS
    from parallel.checkpoint.layout import global_shapes

    for name, model in PRESETS.items():
        assert stage_matrices(model, range(model.n_layers), True) == matrices(global_shapes(model)), name


def test_matrices_are_dealt_out_by_work():
    from job.muon import assign_matrices, newton_schulz_flops

    shapes = {("a", -1): (64, 64), ("b", -1): (32, 32), ("c", -1): (32, 32), ("d", 0): (16, 64), ("d", 1): (16, 64)}
    assigned = assign_matrices(shapes, 2)
    assert sorted(k for keys in assigned for k in keys) == sorted(shapes)
    loads = [sum(newton_schulz_flops(shapes[k]) for k in keys) for keys in assigned]
    assert assigned[0] == [("a", -1)] and max(loads) == newton_schulz_flops((64, 64))
    assert assign_matrices(shapes, 1) == [sorted(shapes, key=lambda k: (-newton_schulz_flops(shapes[k]), k))]


def test_the_iteration_in_bf16_is_the_fp32_ones_within_its_rounding():
    """On a GPU training in 16 bits the iteration runs in bf16 (parallel/run/muon.py's iteration_format), as the
    reference code does: its update stays within bf16's rounding of the fp32 one (a few percent of its largest
    entry), and comes back in fp32."""
    torch.manual_seed(0)
    g = torch.randn(3, 16, 32)
    exact, rounded = orthogonalized(g), orthogonalized(g, torch.bfloat16)
    assert rounded.dtype == torch.float32
    assert float((exact - rounded).abs().max()) < 0.06 * float(exact.abs().max())


def test_a_matrix_moves_as_under_torchs_own_muon(monkeypatch):
    """torch.optim.Muon (torch's own since 2.9: its momentum an average, (1 - m) times ours, which the iteration's
    normalisation takes out; Moonlight's scale as adjust_lr_fn "match_rms_adamw") and MasterMuon move a 24 x 40
    matrix alike over three steps: to fp32's rounding with both iterating in fp32 (torch's iteration, always bf16,
    replaced by the textbook's: the momentum, the scale and the decay are then the only rule compared), and within
    bf16's rounding with both in bf16, each its own iteration."""
    import torch.optim._muon as torch_muon
    from precision.muon import MasterMuon

    def run(dtype) -> tuple[float, float]:
        torch.manual_seed(0)
        matrix = torch.randn(24, 40)
        theirs = torch.nn.Parameter(matrix.clone())
        reference = torch.optim.Muon([theirs], lr=0.02, weight_decay=0.1, momentum=0.95,
                                     adjust_lr_fn="match_rms_adamw")

        def orthogonalize(update):
            update[:] = orthogonalized(update.view(24, 40), dtype).reshape(-1)

        ours = MasterMuon(matrix.reshape(-1).clone(), [(0, matrix.numel())], orthogonalize, momentum=0.95, lr=0.02,
                          weight_decay=0.1)
        for _ in range(3):
            grad = torch.randn(24, 40)
            theirs.grad = grad.clone()
            reference.step()
            ours.step(grad.reshape(-1), grad_clip=0.0)
        gap = float((ours.masters.view(24, 40) - theirs.detach()).abs().max())
        return gap, float((theirs.detach() - matrix).abs().max())

    gap, moved = run(torch.bfloat16)
    assert gap < 0.05 * moved
    monkeypatch.setattr(torch_muon, "_zeropower_via_newtonschulz",
                        lambda grad, coefficients, steps, eps: textbook_newton_schulz(grad.float(), steps))
    gap, moved = run(torch.float32)
    assert gap < 1e-5 * moved
