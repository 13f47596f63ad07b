"""Zero-bubble (ZB-H1) training: the executor's dispatch table, the split backward, and zb-h1
against 1f1b on the same layouts under ZeRO 2/3, fp16 loss scaling, bf16, fp8 and tensor/sequence
parallelism. The 20-step parity with one process at pp 2 and pp 4 is in tests/test_pipeline.py,
in its shared groups; the layouts here share one 4-rank group.
"""

import dataclasses
import json
from dataclasses import dataclass

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from distributed import run_ranks
from minigpt.config import GPTConfig
from minigpt.errors import ConfigError
from minigpt.model import GPT
from job import schedule_actions
from parallel.pipeline.executor import PipelineExecutor, split_model
from parallel.pipeline.weight_gradients import WeightGradients
from job.schedule import Action, Forward, Schedule, ScheduleConfig, build_schedule
from parallel.run.train import train, train_on_rank
from job.train_config import TrainConfig
from parity import worst_gap

MODEL = GPTConfig(vocab_size=256, seq_len=32, n_layers=4, n_heads=4, d_model=32, d_ff=64)
SHORT = TrainConfig(model=MODEL, steps=3, global_batch=8, micro_batches=4, eval_every=0, eval_batches=1, device="cpu")
PAIRS = {  # zb-h1 and 1f1b on each, three steps
    "pp2-dp2-zero2-fp16": dict(pp=2, dp=2, zero=2, precision="fp16"),
    "pp2-dp2-zero3-bf16": dict(pp=2, dp=2, zero=3, precision="bf16"),
    "tp2-pp2-sequence-parallel": dict(tp=2, pp=2, sequence_parallel=True),
    # fp8: each Linear's gradient quantised (its amax recorded) once, in B; W multiplies that same quantised gradient
    "tp2-pp2-sequence-parallel-fp8": dict(tp=2, pp=2, sequence_parallel=True, precision="fp8"),
    "pp2-dp2-zero3-fp8-full-recompute": dict(pp=2, dp=2, zero=3, precision="fp8", recompute="full"),
}


@dataclass(frozen=True)
class Unknown(Action):
    @property
    def name(self) -> str:
        return "Mystery7"


def executor_for(actions) -> PipelineExecutor:
    torch.manual_seed(0)
    stage = split_model(GPT(MODEL), 1, 0, 1)
    schedule = Schedule(ScheduleConfig(1, 1), (tuple(actions),))
    return PipelineExecutor(stage, schedule, 0, [0], None, torch.device("cpu"), None, None)


def test_dispatch_table_has_an_explicit_entry_for_every_action_type():
    def leaves(cls):
        subclasses = [c for c in cls.__subclasses__() if getattr(schedule_actions, c.__name__, None) is c]
        return [cls] if not subclasses else [leaf for c in subclasses for leaf in leaves(c)]

    table = executor_for([Forward(0, 0)]).dispatch_table()
    assert set(table) == set(leaves(Action))
    assert {table[kind].__name__ for kind in table} == {
        "run_forward", "run_backward", "run_backward_input", "run_backward_weight", "exchange", "run_data_parallel",
        "sync_embedding", "reduce_tied", "optimizer_step"}


def test_an_unknown_action_is_refused_by_name():
    with pytest.raises(ConfigError, match=r"Mystery7 \(Unknown\)"):
        executor_for([Forward(0, 0), Unknown()])
    executor = executor_for([Forward(0, 0)])
    executor.groups = [(Unknown(),)]  # reached at run time too, never marked in silence
    with pytest.raises(ConfigError, match="Unknown"):
        executor.run_step([torch.zeros(1, 32, dtype=torch.long)], [torch.zeros(1, 32, dtype=torch.long)], lambda x: x)


class CountMatmuls(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm):
            self.count += 1
        return func(*args, **(kwargs or {}))


def whole_and_split(pp: int, rank: int):
    """Gradients of one chunk by a whole backward and by input-then-weight halves, and the GEMMs each ran."""
    found = []
    for split in (False, True):
        torch.manual_seed(0)
        chunk = split_model(GPT(MODEL), pp, rank, 1).chunks[0]
        generator = torch.Generator().manual_seed(1)
        x = torch.randn(2, MODEL.seq_len, MODEL.d_model, generator=generator, requires_grad=True)
        targets = torch.randint(0, MODEL.vocab_size, (2, MODEL.seq_len), generator=generator)
        grad = None if chunk.last else torch.randn(2, MODEL.seq_len, MODEL.d_model, generator=generator)
        halves = WeightGradients([chunk]) if split else None
        out = halves.forward(chunk, x, (0, rank)) if split else chunk(x)
        out = chunk.loss(out, targets) if chunk.last else out
        with CountMatmuls() as counter:
            if split:
                input_grad = halves.input_gradient((0, rank), out, grad, x)
                assert all(p.grad is None for p in chunk.parameters()), "a weight gradient ran in B"
                in_b = counter.count
                halves.weight_gradients((0, rank), lambda params: None)
                counts = [in_b, counter.count - in_b]
            else:
                out.backward(grad)
                input_grad, counts = x.grad, [counter.count]
        found.append((input_grad, [p.grad for p in chunk.parameters()], counts))
    return found


@pytest.mark.parametrize("pp,rank", [(4, 1), (2, 1)], ids=["middle-chunk", "last-chunk"])
def test_split_backward_gives_the_whole_backwards_gradients_and_splits_its_matmuls(pp, rank):
    (whole_x, whole_w, [whole]), (split_x, split_w, [input_only, weight_only]) = whole_and_split(pp, rank)
    assert torch.equal(whole_x, split_x)
    assert all(torch.equal(a, b) for a, b in zip(whole_w, split_w))
    linears = 4 * MODEL.n_layers // pp + (rank == pp - 1)  # qkv, proj, fc1, fc2 of each block (+ the head)
    assert weight_only == linears and input_only + weight_only == whole


def test_zb_h1_on_one_process_is_1f1b(tmp_path):
    """One chunk, embedding and tied head together: its BackwardInput does nothing, its
    BackwardWeight the whole backward (the first chunk has no input gradient to send)."""
    losses = {kind: train(dataclasses.replace(SHORT, schedule=kind, out_dir=str(tmp_path / kind)))["losses"]
              for kind in ("1f1b", "zb-h1")}
    assert losses["1f1b"] == losses["zb-h1"]


def run_pairs(out_dir: str) -> dict:
    torch.set_num_threads(1)
    found = {}
    for name, extra in PAIRS.items():
        for kind in ("1f1b", "zb-h1"):
            cfg = dataclasses.replace(SHORT, schedule=kind, out_dir=f"{out_dir}/{name}-{kind}", **extra)
            summary = train_on_rank(cfg, torch.device("cpu"))
            if summary is not None:
                found[(name, kind)] = {key: summary[key] for key in ("losses", "grad_norms", "loss_scale",
                                                                     "skipped_steps", "trace")}
    return found


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    return run_ranks(4, run_pairs, str(tmp_path_factory.mktemp("zb-pairs")))[0]


def test_zb_h1_trains_as_1f1b_under_zero_precision_and_tensor_parallelism(pairs):
    for name in PAIRS:
        ours, theirs = pairs[(name, "zb-h1")], pairs[(name, "1f1b")]
        gap = worst_gap(ours, theirs)
        print(f"{name}: zb-h1 against 1f1b, worst relative gaps: {gap}")
        assert gap.worst <= 1e-6, (name, str(gap), ours["losses"], theirs["losses"])
        assert (ours["loss_scale"], ours["skipped_steps"]) == (theirs["loss_scale"], theirs["skipped_steps"])


def test_zb_h1_trace_holds_both_halves_of_every_backward(pairs):
    for name in PAIRS:
        events = json.loads(open(pairs[(name, "zb-h1")]["trace"]).read())["traceEvents"]
        names = {e["name"] for e in events if e.get("cat") == "compute"}
        schedule = build_schedule(ScheduleConfig(2, SHORT.micro_batches, "zb-h1"))
        wanted = {a.name for actions in schedule.actions for a in actions if a.name.startswith(("F", "Bi", "W"))}
        assert wanted <= names and not any(n.startswith("B") and not n.startswith("Bi") for n in names), name


def test_calibrate_times_the_split_backward_and_leaves_the_model_as_it_was():
    """parallel/calibrate/device.py's split_runs: zero-bubble's two halves of a block's backward, per block, each a
    pass of its own; the forward hooks they need are gone afterwards, so the unit's other timings run unhooked."""
    from parallel.calibrate.device import piece_model, split_runs

    model = piece_model(MODEL, 1)
    runs = split_runs(MODEL, 1, 2, model, repeats=3, min_total_s=0.0)
    assert len(runs) >= 3 and all(first > 0 and second > 0 for first, second in runs)
    assert not any(module._forward_hooks for module in model.modules())
    assert all(p.grad is None for p in model.parameters())
