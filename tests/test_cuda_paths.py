"""What a CUDA/NCCL run needs, checked on the CPU: tensors reach collectives on the rank's device,
and the step clock resolves device events onto the host's time axis.

NCCL reduces only CUDA tensors; a tensor made without a device lands on the CPU and fails
there ("No backend type associated with device type cpu"), while gloo takes it happily. So the
spawned ranks run real training steps and evaluations under `torch.device("meta")`: a tensor
made without an explicit device lands on "meta" instead of silently on the CPU, and a spy on
torch.distributed's collectives (and P2POp construction) fails any tensor that is not on the
rank's device, or in a format NCCL does not carry, naming the call and the code that made it.
"""

from __future__ import annotations

import dataclasses
import math
import traceback
from collections import Counter
from contextlib import contextmanager

import pytest
import torch
import torch.distributed as dist

import parallel.comm
from distributed import run_ranks
from minigpt.config import GPTConfig
from parallel.run.build import build_rank
from parallel.checkpoint.sharded import gather_global_state
from parallel.clock import StepClock
from parallel.comm import BlockedTime, Collectives
from parallel.device import measure_peak_flops
from parallel.mesh import build_mesh
from job.train_config import TrainConfig
from precision.policy import policy as precision_policy

# Everything of torch.distributed that takes tensors and our code could call (P2POp: below).
COLLECTIVES = (
    "all_reduce", "all_gather_into_tensor", "all_gather_single", "reduce_scatter_tensor", "reduce_scatter_single",
    "all_gather", "reduce_scatter", "broadcast", "reduce", "gather", "scatter", "all_to_all_single",
    "send", "recv", "isend", "irecv",
)
# What NCCL carries (torch's ncclDataType mapping; bool travels as uint8).
NCCL_DTYPES = {torch.int8, torch.uint8, torch.int32, torch.int64, torch.bool,
               torch.float16, torch.bfloat16, torch.float32, torch.float64}

MODEL = GPTConfig(vocab_size=256, seq_len=16, n_layers=4, n_heads=2, d_model=16, d_ff=32)
BASE = TrainConfig(model=MODEL, steps=2, global_batch=8, micro_batches=2, eval_batches=1, device="cpu")
LAYOUTS = {
    "tp2-pp2-fp16-dynamic-scaler": dataclasses.replace(BASE, tp=2, pp=2, precision="fp16"),
    "dp2-tp2-zero3-bf16-sequence-parallel": dataclasses.replace(BASE, dp=2, tp=2, zero=3, precision="bf16",
                                                                 sequence_parallel=True),
    "pp2-dp2-zero1-interleaved": dataclasses.replace(BASE, pp=2, dp=2, zero=1, schedule="interleaved",
                                                     virtual_chunks=2),
    "dp4-zero2-fp16-static-scale": dataclasses.replace(BASE, dp=4, zero=2, precision="fp16", loss_scale=1024.0),
    # experts split over ep 2 inside dp 4: the routed rows' all-to-alls, their counts, the experts' gradient reduction
    "dp4-ep2-zero1-moe-bf16": dataclasses.replace(BASE, dp=4, ep=2, zero=1, precision="bf16", model=MODEL.with_(
        n_experts=4, top_k=2, d_expert=16, aux_loss_coef=0.01)),
    # Muon's pieces sent to the ranks their matrices are dealt to and back (parallel/run/muon.py)
    "dp2-tp2-zero1-muon-bf16": dataclasses.replace(BASE, dp=2, tp=2, zero=1, precision="bf16", optimizer="muon"),
}


# ---------------------------------------------------------------------------- the spy


def _tensors(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in _tensors(item)]
    return []


def _caller() -> str:
    """The innermost frame of the project's own code: where the offending call was made."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        if any(part in frame.filename for part in ("/parallel/", "/precision/", "/minigpt/")):
            return f"{frame.filename.rsplit('/', 2)[-2]}/{frame.filename.rsplit('/', 1)[-1]}:{frame.lineno} {frame.line}"
    return "(outside the project)"


class CollectiveSpy:
    """Checks the device and format of every tensor handed to torch.distributed; counts the calls."""

    def __init__(self, device: torch.device):
        self.device = device
        self.calls: Counter[str] = Counter()

    def check(self, name: str, args: tuple, kwargs: dict) -> None:
        self.calls[name] += 1
        for tensor in _tensors(list(args) + list(kwargs.values())):
            if tensor.device != self.device or tensor.dtype not in NCCL_DTYPES:
                raise AssertionError(
                    f"{name} got a {tensor.dtype} tensor on {tensor.device} at {_caller()}; "
                    f"NCCL needs it on the rank's device ({self.device}) and in a format it carries"
                )

    @contextmanager
    def installed(self):
        originals = {name: getattr(dist, name) for name in COLLECTIVES if hasattr(dist, name)}
        real_p2p = dist.P2POp

        def wrap(name, function):
            def spied(*args, **kwargs):
                self.check(name, args, kwargs)
                return function(*args, **kwargs)
            return spied

        wrapped = {name: wrap(name, function) for name, function in originals.items()}
        unwrapped = {id(spied): originals[name] for name, spied in wrapped.items()}

        def p2p_op(op, tensor, *args, **kwargs):
            op = unwrapped.get(id(op), op)  # P2POp accepts only torch's own isend and irecv
            self.check(f"P2POp({op.__name__})", (tensor,), {})
            return real_p2p(op, tensor, *args, **kwargs)

        for name, spied in wrapped.items():
            setattr(dist, name, spied)
        dist.P2POp = p2p_op
        try:
            yield self
        finally:
            for name, function in originals.items():
                setattr(dist, name, function)
            dist.P2POp = real_p2p


# ---------------------------------------------------------------------------- on the ranks


def batches(cfg: TrainConfig, step: int, dp_rank: int, device: torch.device):
    """Random token ids for one step of this data-parallel rank, made (on `device`) before the meta region."""
    generator = torch.Generator().manual_seed(1000 * step + dp_rank)
    size = (cfg.global_batch // (cfg.micro_batches * cfg.dp), cfg.model.seq_len)
    draw = [torch.randint(0, cfg.model.vocab_size, size, generator=generator, device="cpu").to(device)
            for _ in range(2 * cfg.micro_batches)]
    return draw[: cfg.micro_batches], draw[cfg.micro_batches :]


def steps_under_meta(cfg: TrainConfig, spy: CollectiveSpy) -> dict:
    device = spy.device
    rank = build_rank(cfg, build_mesh(cfg.pp, cfg.dp, cfg.tp, device, cfg.cp), device, precision_policy(cfg.precision))
    losses, evaluations = [], []
    eval_inputs, eval_targets = batches(cfg, cfg.steps, 0, device)  # the same on every rank
    for step in range(cfg.steps):
        inputs, targets = batches(cfg, step, rank.mesh.dp_rank, device)
        with torch.device("meta"):  # a tensor made without a device lands here, not on the CPU
            outcome = rank.train_step(cfg, step, inputs, targets)
            rank.stage.eval()
            evaluations.append(rank.executor.evaluate(eval_inputs[0], eval_targets[0]))
            rank.stage.train()
            rank.data_parallel.end_step()
        losses.append(outcome.loss)
    with torch.device("meta"):
        state = gather_global_state(rank, cfg)
    return {"losses": losses, "evaluations": evaluations, "skipped": outcome.result.skipped,
            "state_finite": all(bool(t.isfinite().all()) for t in state.values()), "events": len(outcome.events)}


def every_layout() -> dict:
    torch.set_num_threads(1)
    device = torch.device("cpu")  # gloo's; on a GPU machine the same code runs on cuda:<local rank>
    found = {}
    for name, cfg in LAYOUTS.items():
        spy = CollectiveSpy(device)
        with spy.installed():
            found[name] = steps_under_meta(cfg, spy)
        found[name]["calls"] = dict(spy.calls)
    return found


# ---------------------------------------------------------------------------- the tests


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return run_ranks(4, every_layout)


def test_every_collective_gets_tensors_on_the_ranks_device(ranks):
    """The spy raised on no rank (a failure names the rank, the call and the line); and it saw
    every kind of traffic the layouts make, so it was in the way of all of them."""
    calls = Counter()
    for rank in ranks:
        for layout in rank.values():
            calls.update(layout["calls"])
    for name in ("all_reduce", "P2POp(isend)", "P2POp(irecv)", "send", "recv", "all_to_all_single"):
        assert calls[name] > 0, (name, calls)
    assert calls["all_gather_single"] + calls["all_gather_into_tensor"] > 0, calls
    assert calls["reduce_scatter_single"] + calls["reduce_scatter_tensor"] > 0, calls


def test_the_steps_under_the_spy_really_trained(ranks):
    for name in LAYOUTS:
        results = [rank[name] for rank in ranks]
        for r in results:  # every rank agrees on the step's loss and the validation loss
            assert r["losses"] == pytest.approx(results[0]["losses"], rel=1e-6), name
            assert r["evaluations"] == pytest.approx(results[0]["evaluations"], rel=1e-6), name
        # An untrained model on uniformly random bytes predicts about uniformly: every loss is ln 256 = 5.545, and
        # the validation of the same batch moves between the two steps, as the first update changed the weights (by
        # 6e-4 to 1e-2 here; weight decay alone, with the Adam step dropped, moves it by 1e-5 at most).
        assert all(abs(x - math.log(256)) < 0.1 for r in results for x in r["losses"] + r["evaluations"]), name
        assert abs(results[0]["evaluations"][1] - results[0]["evaluations"][0]) > 1e-4, name
        assert all(r["state_finite"] and r["events"] > 0 for r in results), name
    assert not ranks[0]["dp4-zero2-fp16-static-scale"]["skipped"]  # its update and all-gathers ran


def test_the_spy_and_the_meta_device_catch_a_tensor_made_without_a_device():
    spy = CollectiveSpy(torch.device("cpu"))
    with spy.installed(), torch.device("meta"):
        flag = torch.zeros((), dtype=torch.float64)  # what mean_over did before it named its device
        with pytest.raises(AssertionError, match="all_reduce got a torch.float64 tensor on meta"):
            dist.all_reduce(flag)
        with pytest.raises(AssertionError, match="fp8|float8"):
            dist.all_reduce(torch.zeros(2, dtype=torch.float8_e4m3fn, device="cpu"))
    assert dist.all_reduce is not None and "spied" not in dist.all_reduce.__name__  # uninstalled


# ---------------------------------------------------------------------------- the step clock


class FakeEvent:
    """A CUDA event on a fake GPU timeline: record() reads the next time from `gpu_ms`."""

    def __init__(self, gpu_ms: list[float]):
        self.gpu_ms, self.at = gpu_ms, None

    def record(self) -> None:
        self.at = self.gpu_ms.pop(0)

    def elapsed_time(self, other: "FakeEvent") -> float:
        return other.at - self.at


def test_clock_on_cpu_is_perf_counter():
    clock = StepClock(torch.device("cpu"))
    start = clock.start()
    first, second = clock.stamp(), clock.stamp()
    end = clock.finish()
    assert isinstance(first, float) and start <= first <= second <= end
    assert clock.resolve([("F0", "compute", first, second)]) == [("F0", "compute", first, second)]


def test_clock_on_cuda_resolves_events_onto_the_host_axis(monkeypatch):
    synchronized = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: synchronized.append(device))
    gpu_ms = [5000.0, 5000.5, 5012.5, 5013.0]  # the anchor, then three boundaries
    clock = StepClock(torch.device("cuda", 0), new_event=lambda: FakeEvent(gpu_ms))
    with pytest.raises(RuntimeError, match="started"):
        clock.seconds(FakeEvent([1.0]))
    start = clock.start()
    forward_start, forward_end, backward_end = clock.stamp(), clock.stamp(), clock.stamp()
    end = clock.finish()
    assert len(synchronized) == 2 and end >= start  # the device is idle at both ends of the step
    events = clock.resolve([("F0", "compute", forward_start, forward_end), ("B0", "compute", forward_end, backward_end)])
    (_, _, f0, f1), (_, _, b0, b1) = events
    assert f0 == pytest.approx(start + 0.0005) and f1 == pytest.approx(start + 0.0125)
    assert (b0, b1) == (f1, pytest.approx(start + 0.013))
    assert f1 - f0 == pytest.approx(0.012)  # the GPU's 12 ms, whatever the host did meanwhile


def test_blocked_time_sums_host_seconds_and_event_spans():
    gpu_ms = [0.0, 2.0, 10.0, 13.5]
    spans = tuple((FakeEvent(gpu_ms), FakeEvent(gpu_ms)) for _ in range(2))
    for start, end in spans:
        start.record()
        end.record()
    assert BlockedTime(0.25, spans).seconds() == pytest.approx(0.25 + 0.002 + 0.0035)
    assert BlockedTime().seconds() == 0.0


def test_collectives_time_blocking_calls_with_events_on_cuda(monkeypatch):
    """On CUDA a blocking collective's time is the stream's, between events around the call; a
    snapshot taken mid-step (the training loop's, before the optimizer's reductions) keeps only
    the calls made before it."""
    gpu_ms = [1.0, 3.0, 10.0, 10.5]
    monkeypatch.setattr(parallel.comm, "cuda_timing_event", lambda: FakeEvent(gpu_ms))
    comm = Collectives(None, "tp", torch.device("cuda", 0))
    calls = []
    comm._timed(lambda *args, **kwargs: calls.append(args), "first", async_op=False)
    during_compute = comm.blocked()
    comm._timed(lambda *args, **kwargs: calls.append(args), "second", async_op=False)
    assert calls == [("first",), ("second",)]
    assert during_compute.seconds() == pytest.approx(0.002)
    assert comm.seconds == pytest.approx(0.0025)
    comm.reset_counters()
    assert comm.seconds == 0.0
    on_cpu = Collectives(None, "tp", torch.device("cpu"))
    on_cpu._timed(lambda *args, **kwargs: None, async_op=False)
    assert on_cpu.blocked().spans == () and on_cpu.seconds >= 0.0


def test_peak_flops_on_cpu_is_measured_and_cheap():
    import time

    start = time.perf_counter()
    peak = measure_peak_flops(torch.device("cpu"), torch.float32)
    assert math.isfinite(peak) and peak > 1e8  # a 1024^3 fp32 matmul on any CPU
    assert time.perf_counter() - start < 10
