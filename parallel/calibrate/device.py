"""`minigpt calibrate` on the device in use: its clock, what it is, and what it computes alone.

The ranks measure on the device parallel.launch.elastic.init_worker gives them: one CUDA GPU per rank
with NCCL when there is a GPU for every local rank (and --device is not cpu), else the CPU
with gloo. Every tensor and module is made on that device, and every timer reads `stamp`,
which first waits for the device's queued work (`synchronize`: torch.cuda.synchronize on a
GPU, nothing on a CPU), so each timed interval holds exactly the kernels issued inside it.

Rank 0 measures these alone (parallel/calibrate/measure.py), one device's own numbers, timed by
parallel/calibrate/kernels.py (the one home of kernel timing: CUDA events on a GPU, perf_counter on a CPU):
- matmuls, per number format (`formats`: every one of fp32, tf32, bf16, fp16, fp8 on a GPU; fp32 alone
  on a CPU unless asked): square (n x n) @ (n x n) and GPT-shaped (2n x n) @ (n x 4n) (tokens x d @
  d x 4d, the fc1 shape), the median of `repeats` timed runs each, for n in plan.matmul_sizes on a
  CPU and plan.cuda_matmul_sizes on a GPU (larger, so the best rate nears the GPU's rate); fp32 with
  TF32 off, tf32 with it on; fp8 is torch._scaled_mm of e4m3 operands without fast accumulation, as
  precision/fp8.py calls it. A format the device refuses (fp8 before Hopper) is recorded as refused.
  On a CPU 16-bit training does not use these kernels: precision/compute.py emulates 16-bit matmuls
  with fp32 ones, so a CPU's bf16/fp16 rates here are torch's native CPU kernels (the dry run's
  per-format code path), not what a CPU training run computes with (its fp8 does call _scaled_mm).
- launch latency: the median time of an 8 x 8 fp32 matmul (back to back: a GPU's launch rate).
- memory bandwidth: a large fp32 tensor copy, (read + write bytes) / seconds, as compute.py's
  roofline counts bytes moved.
- one block of the model preset (tiny by default) at its shape: forward and backward seconds.

The model's pieces as one tensor-parallel rank runs them (`piece_model`, `piece_step`) are
here too: parallel/calibrate/host.py times them for the profile's "measured" units, and
`threads_ratio` times one of them on every core's thread against one thread (the sharing
table's threads row, and `minigpt compare`'s check that it still holds).
"""

from __future__ import annotations

import contextlib
import math
import statistics
import time

import torch

from parallel.calibrate.kernels import matmul_mode, time_elementwise, time_gemm
from parallel.calibrate.noise import spread
from parallel.comm import Collectives, Done
from parallel.device import synchronize
from job.train_config import shape_allows

TENSOR_PARALLEL = (1, 2, 4, 8)
CONTEXT_PARALLEL = (2, 4, 8)  # context-parallel sizes whose units are measured (each at tp 1)


def stamp(device: torch.device) -> float:
    """time.perf_counter() once the device has done its queued work: every timer here reads this."""
    synchronize(device)  # a no-op on a CPU
    return time.perf_counter()


def strict_fp32(device: torch.device):
    """fp32 matmuls in true fp32 on a GPU (TF32 off) while inside; the setting is restored after."""
    return matmul_mode("fp32", device)


def describe(device: torch.device) -> dict:
    """What this rank measured on: {"type", "name", "backend", "memory_bytes" (a GPU's, else None), and on a GPU
    "sms", its streaming multiprocessors (the GEMM model's waves: simulator/costs/rates/gemm_fit.py)}."""
    import torch.distributed as dist

    on_gpu = device.type == "cuda"
    backend = dist.get_backend() if dist.is_initialized() else ("nccl" if on_gpu else "gloo")
    if not on_gpu:
        return {"type": "cpu", "name": "cpu", "backend": str(backend), "memory_bytes": None}
    properties = torch.cuda.get_device_properties(device)
    return {"type": "cuda", "name": torch.cuda.get_device_name(device), "backend": str(backend),
            "memory_bytes": int(properties.total_memory), "sms": int(properties.multi_processor_count)}


def matmul_sizes(plan, device: torch.device, fmt: str = "fp32") -> tuple[int, ...]:
    """The sizes a format's GEMMs are timed at. On a CPU only fp32 is what training runs (precision/compute.py
    emulates 16-bit matmuls with fp32 ones), and torch's CPU kernels of the other formats are far slower than
    fp32 (bf16 about 100x; fp8's _scaled_mm took 163 s for one 1024 x 512 x 2048 GEMM here): they are timed at
    the plan's smallest size alone, which takes their path (a dry run of what a GPU measures) in seconds."""
    if device.type == "cuda":
        return plan.cuda_matmul_sizes
    return plan.matmul_sizes if fmt == "fp32" else plan.matmul_sizes[:1]


def copy_bytes(plan, device: torch.device) -> int:
    """The copy's size: on a GPU at least 256 MiB, well past its L2 cache (50-60 MB on an H100 or H200)."""
    return max(plan.copy_bytes, 256 * 2**20) if device.type == "cuda" else plan.copy_bytes


def measure_matmuls(plan, device: torch.device, formats: tuple[str, ...] = ("fp32",)) -> dict:
    """{"rates": {format: {"square": {n: FLOP/s}, "gpt": {n: FLOP/s}}}, "spread": {format: the largest
    spread of its runs}, "refused": {format: why}, "launch_latency": s} on `device`."""
    rates: dict[str, dict[str, dict[int, float]]] = {}
    spreads: dict[str, float] = {}
    refused: dict[str, str] = {}
    torch.manual_seed(0)
    for fmt in formats:
        try:
            rates[fmt], spreads[fmt] = format_rates(plan, device, fmt)
        except (RuntimeError, ValueError) as error:  # e.g. fp8 on a GPU before Hopper
            refused[fmt] = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    latency = time_gemm("fp32", 8, 8, 8, device, plan.min_run_s, plan.repeats)["seconds"]
    return {"rates": rates, "spread": spreads, "refused": refused, "launch_latency": latency}


def format_rates(plan, device: torch.device, fmt: str) -> tuple[dict[str, dict[int, float]], float]:
    """One format's FLOP/s by smallest side per shape, and the largest spread of its measurements."""
    rates: dict[str, dict[int, float]] = {"square": {}, "gpt": {}}
    worst = 0.0
    for n in matmul_sizes(plan, device, fmt):
        for shape, (m, k, cols) in (("square", (n, n, n)), ("gpt", (2 * n, n, 4 * n))):
            result = time_gemm(fmt, m, cols, k, device, plan.min_run_s, plan.repeats)
            rates[shape][n] = result["flops_per_s"]
            worst = max(worst, result["spread"])
    return rates, worst


def measure_copy(plan, device: torch.device) -> float:
    """Bytes per second moved by a large fp32 copy (read + write)."""
    return time_elementwise("copy", "fp32", copy_bytes(plan, device), device, plan.min_run_s,
                            plan.repeats)["bytes_per_s"]


def measure_block(plan, device: torch.device) -> dict:
    """Forward and backward seconds of one block of plan.model at its shape, fp32 (medians of plan.repeats runs
    after a warm-up), and the spread of the runs' forward + backward."""
    from minigpt.presets import preset
    from minigpt.model import Block

    config = preset(plan.model)
    torch.manual_seed(0)
    block = Block(config).to(device)
    x = torch.randn(plan.micro_batch, config.seq_len, config.d_model, device=device, requires_grad=True)
    forwards, backwards = [], []
    for i in range(plan.repeats + 1):
        start = stamp(device)
        out = block(x)
        middle = stamp(device)
        out.sum().backward()
        end = stamp(device)
        if i:  # the first is a warm-up
            forwards.append(middle - start)
            backwards.append(end - middle)
        block.zero_grad(set_to_none=True)
        x.grad = None
    return {"model": plan.model, "micro_batch": plan.micro_batch, "seq_len": config.seq_len,
            "d_model": config.d_model, "forward_s": statistics.median(forwards),
            "backward_s": statistics.median(backwards),
            "spread": spread([f + b for f, b in zip(forwards, backwards)])}  # noise.py's convention


# ---------------------------------------------------------------- the model's pieces


class AloneCollectives(Collectives):
    """A tensor-parallel group of `size` ranks seen from rank 0, that communicates nothing.

    Every call does only its local share of work (all-reduce nothing, all-gather and
    reduce-scatter one copy), so parallel/tensor/parallelize.py's real modules run on one rank alone and
    their compute can be timed apart from their communication, which the profile measures
    separately (host.py's collectives)."""

    def __init__(self, size: int) -> None:
        super().__init__(None, "alone")
        self.size, self.rank = size, 0

    def all_reduce(self, tensor, op=None, async_op: bool = False):
        return Done() if async_op else None

    def all_gather(self, output, shard, async_op: bool = False):
        output.view(self.size, -1).copy_(shard.reshape(1, -1).expand(self.size, -1))
        return Done() if async_op else None

    def reduce_scatter(self, shard, full, async_op: bool = False):
        shard.copy_(full.reshape(self.size, -1)[self.rank].view_as(shard))
        return Done() if async_op else None


def tp_sizes(config, ranks: int) -> list[int]:  # tensor-parallel sizes this model and these ranks allow
    return [tp for tp in TENSOR_PARALLEL if tp <= ranks and shape_allows(config, tp)]


def variants(config, ranks: int, context_parallel: tuple[int, ...] = CONTEXT_PARALLEL) -> list[tuple[int, bool, int]]:
    """(tp, sequence_parallel, cp) measured: every tp that fits, with and without sequence parallelism, and
    each context-parallel size asked for (up to the ranks) that splits the sequence, at tp 1."""
    tensor = [(tp, sp, 1) for tp in tp_sizes(config, ranks) for sp in ((False, True) if tp > 1 else (False,))
              if shape_allows(config, tp, sp)]
    return tensor + [(1, False, cp) for cp in context_parallel if 1 < cp <= ranks and shape_allows(config, cp=cp)]


def piece_model(config, tp: int, sequence_parallel: bool = False, device: torch.device | None = None, cp: int = 1,
                precision: str = "fp32"):
    """The GPT made tensor-parallel by parallel/tensor/parallelize.py over a group that communicates nothing, and
    with cp > 1 context-parallel as rank 0 of a ring that sends nothing (parallel/context/ring.py's Rehearsal:
    the blocks, merges and receive buffers a rank computes; the passes are measured apart), on `device`, in the
    compute format of `precision`'s policy as training puts it there (precision/compute.py's apply_precision)."""
    from minigpt.model import GPT
    from parallel.context.apply import apply_context_parallel
    from parallel.context.ring import Rehearsal
    from parallel.tensor.parallelize import parallelize
    from precision.compute import apply_precision
    from precision.policy import policy

    model = GPT(config)
    if cp > 1:
        apply_context_parallel(model, Rehearsal(cp), "ring")
    parallelize(model, AloneCollectives(tp), sequence_parallel)
    device = device or torch.device("cpu")
    return model.to(device) if precision == "fp32" else apply_precision(model, policy(precision), device)


class _Blocks(torch.nn.Module):
    """Blocks run in turn, as a pipeline chunk runs them: what a unit's block series are timed on."""

    index = 0

    def __init__(self, blocks):
        super().__init__()
        self.blocks = torch.nn.ModuleList(blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def unit_blocks(config, model) -> _Blocks:
    """The blocks a unit is timed on, in turn as a chunk runs them (their weights do not all stay in cache): every
    block, a mixture of experts' MoE blocks only (its unit is theirs; its dense first blocks are a dense shape's)."""
    return _Blocks([b for i, b in enumerate(model.blocks) if config.is_moe_layer(i) or not config.is_moe])


def between_layers(config, tp: int, batch: int, model, sequence_parallel: bool, device: torch.device, cp: int,
                   requires_grad: bool = False) -> torch.Tensor:
    """A random tensor of the rows a rank holds between the layers (its cp share of each sequence, its tp share of
    that under sequence parallelism), in the model's compute format."""
    rows = config.seq_len // cp // (tp if sequence_parallel else 1)
    dtype = next(model.parameters()).dtype  # the activations' format: the compute format's
    return torch.randn(batch, rows, config.d_model, device=device, dtype=dtype, requires_grad=requires_grad)


def piece_step(piece: str, config, tp: int, batch: int, model=None, sequence_parallel: bool = False,
               device: torch.device | None = None, cp: int = 1):
    """A function timing one forward and one backward of `piece` ("block", "embedding" or "head")
    as training runs it on one tensor-parallel (and context-parallel) rank: () -> (forward s, backward s); a
    block's time is that of all the model's blocks (a mixture of experts': its MoE blocks) run in turn, divided by
    their number."""
    device = device or torch.device("cpu")
    seq = config.seq_len // cp  # a context-parallel rank's two chunks
    model = model if model is not None else piece_model(config, tp, sequence_parallel, device, cp)
    shard = (config, tp, batch, model, sequence_parallel, device, cp)
    x = None if piece == "embedding" else between_layers(*shard, requires_grad=True)
    grad = None if piece == "head" else between_layers(*shard)
    blocks = unit_blocks(config, model)
    if piece == "block":
        forward = lambda: blocks(x)  # noqa: E731
    elif piece == "embedding":
        idx = torch.randint(config.vocab_size, (batch, seq), device=device)
        forward = lambda: model.embed(idx)  # noqa: E731
    else:
        targets = torch.randint(config.vocab_size, (batch, seq), device=device)
        forward = lambda: model.loss(model.logits(x), targets)  # noqa: E731

    per = len(blocks.blocks) if piece == "block" else 1

    def step() -> tuple[float, float]:
        if x is not None:
            x.grad = None
        start = stamp(device)
        out = forward()
        middle = stamp(device)
        out.backward(grad)
        return (middle - start) / per, (stamp(device) - middle) / per

    return step


def split_runs(config, tp: int, batch: int, model, repeats: int, min_total_s: float, sequence_parallel: bool = False,
               device: torch.device | None = None, cp: int = 1) -> list[tuple[float, float]]:
    """(input half, weight half) seconds of a block's backward split as zero-bubble's schedules run it
    (parallel/pipeline/weight_gradients.py: the activation gradients, then the weights' module by module), after a
    forward that keeps what the split needs; each run all the model's blocks (a mixture's MoE blocks) in turn, per
    block, after a warm-up (timed_runs' counts). The model's modules are left as they were."""
    from parallel.pipeline.weight_gradients import WeightGradients

    device = device or torch.device("cpu")
    shard = (config, tp, batch, model, sequence_parallel, device, cp)
    x, grad = between_layers(*shard, requires_grad=True), between_layers(*shard)
    chunk = unit_blocks(config, model)
    halves = WeightGradients([chunk])
    per = len(chunk.blocks)

    def step() -> tuple[float, float]:
        out = halves.forward(chunk, x, (0, 0))
        start = stamp(device)
        halves.input_gradient((0, 0), out, grad, x)
        middle = stamp(device)
        halves.weight_gradients((0, 0), lambda params: None)
        return (middle - start) / per, (stamp(device) - middle) / per

    try:
        return timed_runs(step, repeats, min_total_s)
    finally:
        halves.detach()
        model.zero_grad(set_to_none=True)


def timed_runs(step, repeats: int, min_total_s: float) -> list[tuple[float, float]]:
    """(forward, backward) seconds of each run after a warm-up: at least `repeats` runs, more
    (up to 5x) for short pieces so the runs last about min_total_s."""
    step()
    first = step()
    runs = min(max(repeats, math.ceil(min_total_s / max(sum(first), 1e-7))), 5 * repeats)
    return [first] + [step() for _ in range(runs - 1)]


def threads_ratio(step, cores: int, pairs: int, on_cores=None) -> float:
    """A CPU step's seconds on `cores` threads over its seconds on one: the median over `pairs` pairs of runs,
    one thread then every core's, taken in turn so that the machine's own drift (15% from minute to minute on
    this project's VM) moves both sides of each pair alike. step: () -> (forward s, backward s) (piece_step's);
    on_cores: a context manager entered around every many-thread run (noise.Noise.timed_on_cores). The
    threads' first run, a warm-up, is not counted. Leaves torch at one thread."""
    torch.set_num_threads(cores)
    step()
    ratios = []
    for _ in range(pairs):
        torch.set_num_threads(1)
        one = sum(step())
        torch.set_num_threads(cores)
        with on_cores() if on_cores is not None else contextlib.nullcontext():
            many = sum(step())
        ratios.append(many / one)
    torch.set_num_threads(1)
    return statistics.median(ratios)
