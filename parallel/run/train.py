"""The training loop: one loop for every layout.

`train` starts tp x cp x pp x dp workers through torch's launcher (or runs in this
process for a 1 x 1 x 1 layout, or joins the job when torchrun started us);
every worker runs `train_on_rank`: build the mesh, the model in its precision,
its data-parallel wrapper (ZeRO stage) and the master-weight optimizer, then
step. Rank 0 logs, writes the run directory and returns the summary.
"""

from __future__ import annotations

import dataclasses
import math
import os
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from minigpt.data import BatchLayout, Corpus, Mixture, get_batch, validation_batches
from minigpt.errors import ConfigError, TrainingError
from minigpt.model import ahead
from minigpt.tokenizer import load_tokenizer
from parallel.run.build import Rank, build_rank
from parallel.run.step import StepOutcome
from parallel.device import PeakFlops, describe_device, measure_peak_flops
from parallel.launch.elastic import finish_worker, init_worker, launch
from parallel.launch.rank_start import restart_count
from parallel.launch.torchrun_env import rank_placement
from parallel.launch.watchdog import DEFAULT_TIMEOUT_S
from parallel.memory import ActivationMeter
from parallel.context.chunks import local_part
from parallel.mesh import Mesh, build_mesh
from parallel.run.resume import ResumePoint, resume_point
from parallel.run.expert_load import load_summary, rank_load, run_load, write_load_plot
from parallel.run.loss_plot import LossPlotter, write_loss_plot
from parallel.run.files import RunFiles, default_run_dir, write_json_file
from parallel.run.tensorboard import Board
from job.trace import Trace, breakdown, write_chrome_trace
from job.train_config import TrainConfig
from precision.compute import compute_path, dtype_of, needs_emulation
from precision.optimizer import MasterAdamW, state_bytes
from precision.policy import TEXTBOOK_MIXED_ADAM, policy as precision_policy

StepLog = Callable[[dict], None]
# fp16 steps skipped one after another (gradients overflowing) before the run stops: a dynamic
# loss scale halves on each, so 20 take it from 2^16 to 2^-4, past any scale that could help,
# and a static scale that overflows 20 times running overflows on every batch.
MAX_SKIPPED_IN_A_ROW = 20


def train(cfg: TrainConfig, on_step: StepLog | None = None, resume_from: ResumePoint | None = None,
          plotter: LossPlotter | None = None) -> dict | None:
    """Train for cfg.steps on every rank of the layout; rank 0's summary.

    `on_step` is called on rank 0 after every step; with more than one process
    it must be picklable (a module-level function or class instance). With cfg.resume,
    `resume_from` is the checkpoint to continue, verified here before any worker starts
    (default: the newest of the run that verifies); at or past cfg.steps nothing is run and
    the summary is {"nothing_to_do": <the line saying so>, "first_step", "steps", "checkpoint"}.
    This process writes summary.json and draws loss.png (with `plotter`, started earlier, where given);
    under torchrun a rank other than 0 gets None.
    """
    if cfg.out_dir is None:
        cfg = dataclasses.replace(cfg, out_dir=str(default_run_dir(cfg)))
    checkpoint = None
    if cfg.resume:
        point = resume_from or resume_point(cfg)
        if point.nothing_to_do(cfg.steps):
            if plotter is not None:
                plotter.close()
            return {"nothing_to_do": point.nothing_to_do(cfg.steps), "first_step": point.step, "steps": cfg.steps,
                    "checkpoint": str(point.path), "run_dir": cfg.out_dir, "losses": []}
        checkpoint = str(point.path)
    try:
        summary = launch(run_worker, (cfg, on_step, checkpoint), cfg.world_size,
                         threads_per_rank=cfg.threads_per_rank or 1,
                         watchdog_s=DEFAULT_TIMEOUT_S if cfg.watchdog_s is None else cfg.watchdog_s,
                         max_restarts=cfg.max_restarts)
    except BaseException:
        if plotter is not None:
            plotter.close()
        raise
    if summary is not None:
        run_dir = Path(summary["run_dir"])
        summary["loss_plot"] = _path_or_none(plotter.draw(run_dir) if plotter else write_loss_plot(run_dir))
        if "expert_load" in summary:
            summary["expert_load_plot"] = _path_or_none(write_load_plot(run_dir, summary["expert_load"]))
        write_json_file(run_dir / "summary.json", summary)
    return summary


def run_worker(args: tuple[TrainConfig, StepLog | None, str | None]) -> dict | None:
    cfg, on_step, checkpoint = args
    restart = restart_count()
    if restart:  # the elastic agent started the ranks again after a failure: on from the newest valid checkpoint
        cfg, checkpoint = restarted(cfg, restart)
    device = init_worker(None if cfg.device == "auto" else cfg.device)
    if cfg.threads_per_rank:
        torch.set_num_threads(cfg.threads_per_rank)
    try:
        return train_on_rank(cfg, device, on_step, checkpoint)
    finally:
        finish_worker()


def restarted(cfg: TrainConfig, restart: int) -> tuple[TrainConfig, str | None]:
    """(the run's settings, the checkpoint) for the ranks started again after a failure: resuming from the newest
    checkpoint of the run that verifies (every rank finds the same one: no rank writes while they look), or
    from the start when none was written yet; rank 0 says which on stderr."""
    try:
        point = resume_point(cfg)
    except ConfigError:  # no complete checkpoint yet: the run starts over, in its own directory
        point = None
    if os.environ.get("RANK", "0") == "0":
        where = f"from {point.path.name}" if point else "from the start (no complete checkpoint yet)"
        print(f"minigpt: restart {restart} of {cfg.max_restarts} after a failure: resuming {where}", file=sys.stderr,
              flush=True)
    if point is None:
        return dataclasses.replace(cfg, resume=False), None
    return dataclasses.replace(cfg, resume=True), str(point.path)


def evaluate(rank: Rank, corpus: Corpus, cfg: TrainConfig, device: torch.device) -> tuple[float, dict | None]:
    """Validation loss on fixed batches, the same whatever the layout, and for a mixture each source's (its own
    fixed batches; the loss then the mean of theirs in the mixture's shares). Each data-parallel replica takes its
    share of every batch (the batch is the replicas' micro-batches, so it divides evenly) and the replicas
    average their means; the ranks of a replica (tensor, pipeline) run it together, as ZeRO-3 needs."""
    rank.stage.eval()
    sources = corpus.val if isinstance(corpus.val, Mixture) else None
    streams = sources.streams if sources is not None else (corpus.val,)
    losses = [_validation_loss(rank, stream, cfg, device) for stream in streams]
    rank.stage.train()
    rank.data_parallel.end_step()
    if sources is None:
        return losses[0], None
    return math.fsum(share * loss for share, loss in zip(sources.shares, losses)), dict(zip(sources.names, losses))


def validate(rank: Rank, corpus: Corpus, cfg: TrainConfig, device: torch.device) -> dict:
    """evaluate's numbers as a step's record holds them: val_loss, and a mixture's val_by_source."""
    loss, by_source = evaluate(rank, corpus, cfg, device)
    return {"val_loss": loss, **({"val_by_source": by_source} if by_source else {})}


def _validation_loss(rank: Rank, tokens, cfg: TrainConfig, device: torch.device) -> float:
    """The mean loss of `tokens`' fixed validation batches, over every data-parallel replica: batches of the global
    batch's size, the same sequences whatever the layout and the micro-batches, each run a micro-batch at a time
    (the pipeline's buffers are a micro-batch's)."""
    micro = cfg.global_batch // cfg.micro_batches  # every replica's micro-batch together
    share, first = micro // cfg.dp, rank.mesh.dp_rank * (micro // cfg.dp)
    mesh = rank.mesh
    losses = [
        rank.executor.evaluate(*(context_part(t[start + first:start + first + share], mesh).to(device) for t in (x, y)))
        for x, y in validation_batches(tokens, cfg.model.seq_len, cfg.global_batch, cfg.eval_batches, cfg.seed)
        for start in range(0, cfg.global_batch, micro)
    ]
    loss = torch.tensor(sum(losses) / len(losses), dtype=torch.float64, device=device)
    if mesh.data_group() is not None:  # each context-parallel rank's mean is over as many tokens
        dist.all_reduce(loss, group=mesh.data_group())
        loss /= mesh.data_ranks
    return float(loss)


def context_part(tokens: torch.Tensor, mesh: Mesh) -> torch.Tensor:
    """This context-parallel rank's two chunks of each sequence (all of it without context parallelism)."""
    return tokens if mesh.cp == 1 else local_part(tokens, mesh.cp_rank, mesh.cp, dim=1)


def context_targets(targets: torch.Tensor, mesh: Mesh, mtp_depth: int) -> torch.Tensor:
    """This context-parallel rank's targets; with multi-token prediction modules every depth's, moved ahead over the
    whole sequences before the cut ((1 + D, batch, its tokens): minigpt/model.py's `ahead` reads them so), as a
    module's tokens ahead may sit on another rank."""
    if mesh.cp == 1 or not mtp_depth:
        return context_part(targets, mesh)
    return torch.stack([context_part(ahead(targets, k), mesh) for k in range(mtp_depth + 1)])


def micro_batches(corpus: Corpus, cfg: TrainConfig, step: int, mesh: Mesh, device: torch.device):
    """This rank's inputs and targets of every micro-batch of a step: its data-parallel replica's sequences,
    and of them its context-parallel chunks."""
    layout = BatchLayout(cfg.global_batch, cfg.micro_batches, cfg.dp)
    inputs, targets = [], []
    for micro in range(cfg.micro_batches):
        x, y = get_batch(corpus.train, cfg.model.seq_len, layout, cfg.seed, step, micro, mesh.dp_rank)
        x, y = context_part(x, mesh), context_targets(y, mesh, cfg.model.mtp_depth)
        inputs.append(x.to(device))
        targets.append(y.to(device))
    return inputs, targets


@dataclass
class History:
    """What rank 0's summary needs from the steps run so far."""

    first_step: int
    losses: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)  # before clipping, over the whole model
    step_times: list[float] = field(default_factory=list)
    val_history: list[dict] = field(default_factory=list)
    comm_per_step: dict = field(default_factory=dict)
    skipped_in_a_row: int = 0  # steps the loss scaler skipped, up to the latest


def train_on_rank(cfg: TrainConfig, device: torch.device, on_step: StepLog | None = None,
                  checkpoint: str | None = None) -> dict | None:
    """One rank's run. With cfg.resume, `checkpoint` is the one the launching process verified
    (None: the newest that verifies, verified again here)."""
    mesh = build_mesh(cfg.pp, cfg.dp, cfg.tp, device, cfg.cp, cfg.shard_group)
    corpus = Corpus.load(cfg.data, cfg.model.seq_len, load_tokenizer(cfg.tokenizer), cfg.data_weights)
    policy = precision_policy(cfg.precision)
    rank = build_rank(cfg, mesh, device, policy)
    # Emulated 16-bit matmuls run as fp32 matmuls, so the CPU's fp32 rate is their peak.
    # Timed once, by rank 0, whose log is the only one to report MFU.
    peak_dtype = torch.float32 if needs_emulation(policy, device) else dtype_of(policy.compute)
    peak = PeakFlops(measure_peak_flops(device, peak_dtype) if mesh.rank == 0 else 0.0, peak_dtype)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    activations = ActivationMeter(device, rank.data_parallel.parameter_storages)
    start_step = 0
    if cfg.saves or cfg.resume:
        # torch.distributed.checkpoint takes about a second to import in every rank: only runs that use it pay
        from parallel.checkpoint.sharded import load_checkpoint, save_checkpoint
    if cfg.resume:
        path = checkpoint or resume_point(cfg).path
        start_step = load_checkpoint(path, rank, cfg, verify=checkpoint is None)["step"]
        if start_step >= cfg.steps:
            raise ConfigError(ResumePoint(Path(path), start_step).nothing_to_do(cfg.steps))
    run = open_run(cfg, corpus, start_step) if mesh.rank == 0 else None
    history, trace = History(start_step), Trace(mesh.rank)
    try:
        for step in range(start_step, cfg.steps):
            inputs, targets = micro_batches(corpus, cfg, step, mesh, device)
            outcome = rank.train_step(cfg, step, inputs, targets, activations if step == start_step else None)
            trace.add_step(step, outcome.start, outcome.end, outcome.events, outcome.tp_seconds, outcome.ep_seconds)
            history.skipped_in_a_row = history.skipped_in_a_row + 1 if outcome.result.skipped else 0
            check_finite(policy.name, rank.scaler, step, outcome, history)
            history.losses.append(outcome.loss)
            history.grad_norms.append(outcome.result.grad_norm)
            history.step_times.append(outcome.seconds)
            history.comm_per_step = outcome.comm
            held = ranks_memory(mesh, rank, activations) if step == start_step else None  # all ranks' bytes, once
            record_out = step_log(cfg, step, outcome, peak, held)
            if (step + 1) % cfg.eval_interval == 0 or step == cfg.steps - 1:
                history.val_history.append({"step": step, **(validation := validate(rank, corpus, cfg, device))})
                record_out |= validation
            if cfg.saves_at(step):
                record_out["checkpoint"] = str(save_checkpoint(cfg.checkpoint_dir, rank, cfg, step + 1))
            if run:
                run.log(record_out)
                if on_step is not None:
                    on_step(record_out)
    finally:
        if run:
            run.close()

    if run is not None and device.type == "cpu" and peak.best_achieved > peak.measured:
        # a step beat the start's timing, which other work on the cores made low (the launch's own imports):
        # timed once more, now that the cores are the run's
        peak.measured = max(peak.measured, measure_peak_flops(device, peak_dtype))
    memory = rank_memory(rank.data_parallel, rank.optimizer, activations)
    # one gather for what the summary needs of every rank: its bytes, where it ran, its timeline
    ranks = gather_from_all(mesh, {"memory": memory, "placement": rank_placement(), "timeline": trace.as_dict()})
    memory_per_rank, placement, timelines = ([r[key] for r in ranks] for key in ("memory", "placement", "timeline"))
    loads = gather_from_all(mesh, rank_load(rank.stage, mesh, cfg.sequence_parallel)) if cfg.model.is_moe else []
    if run is None:
        return None
    trace_path = write_chrome_trace(Path(cfg.out_dir) / "trace.json", timelines)
    summary = summarize(cfg, rank, corpus, history, peak)
    summary.update({
        "memory_per_rank": memory_per_rank,
        "bytes_per_param": {
            "measured": bytes_per_param(memory, cfg.model.n_params()),
            "policy": policy.bytes_per_param(),
            "textbook_mixed_adam": TEXTBOOK_MIXED_ADAM,
        },
        "time_breakdown": breakdown(timelines),
        "trace": str(trace_path),
        "run_dir": str(run.path),
        "placement": placement,  # each rank's host, node and local rank: tp's groups inside a node (parallel/mesh.py)
    })
    if loads:
        summary["expert_load"] = load_summary(run_load(loads))
    return summary


def open_run(cfg: TrainConfig, corpus: Corpus, first_step: int) -> RunFiles:
    """Rank 0's run directory, config.json written: metrics.jsonl (appended to when resumed), and TensorBoard's
    event files where the run asks for them, from `first_step` on (parallel/run/tensorboard.py)."""
    run = RunFiles(Path(cfg.out_dir), resume=cfg.resume)
    tokenizer = run.write_tokenizer(load_tokenizer(cfg.tokenizer))  # RUN/tokenizer.json, unless bytes
    run.write_json("config.json", {"train": cfg.as_dict(), "data": corpus.source, "tokenizer": tokenizer})
    if cfg.tensorboard:
        run.events = Board(run.path, first_step)
    return run


def check_finite(policy_name: str, scaler, step: int, outcome: StepOutcome, history: History) -> None:
    """Without a loss scaler to skip bad steps, a non-finite loss or gradient ends the run. With one
    (fp16), so do a non-finite loss on the run's first step (the forward pass overflows: no loss
    scale can help) and MAX_SKIPPED_IN_A_ROW steps skipped one after another."""
    if scaler is None and (outcome.result.skipped or not math.isfinite(outcome.loss)):
        raise TrainingError(
            f"step {step}: the loss is {outcome.loss} and the gradients are "
            f"{'not finite' if outcome.result.skipped else 'finite'} under {policy_name}: "
            f"lower --lr or use another precision"
        )
    if scaler is not None and step == history.first_step and not math.isfinite(outcome.loss):
        raise TrainingError(
            f"step {step}: the loss is {outcome.loss} on the run's first step under {policy_name}: the forward "
            f"pass is not finite, which no loss scale can help: lower --lr or use another precision"
        )
    if scaler is not None and history.skipped_in_a_row >= MAX_SKIPPED_IN_A_ROW:
        raise TrainingError(
            f"step {step}: {history.skipped_in_a_row} steps in a row skipped under {policy_name} (the loss is "
            f"{outcome.loss}, the gradients overflow at loss scale {outcome.result.loss_scale:g}): "
            f"lower --lr or use another precision"
        )


def step_log(cfg: TrainConfig, step: int, outcome: StepOutcome, peak: PeakFlops,
             memory_per_rank: list[dict] | None = None) -> dict:
    """One line of metrics.jsonl. MFU is against the peak known after this step (<= 1: PeakFlops). The first step
    a run (or a resumed run) takes carries every rank's bytes by category, `memory_per_rank` (ranks_memory)."""
    tokens_per_s = cfg.tokens_per_step / outcome.seconds
    mfu = peak.observe(cfg.model.train_flops_per_token() * tokens_per_s / cfg.world_size)
    return {
        "step": step,
        "loss": outcome.loss,
        "lr": cfg.learning_rate(step),
        "grad_norm": outcome.result.grad_norm,
        "loss_scale": outcome.result.loss_scale,
        "skipped": outcome.result.skipped,
        "step_time_s": outcome.seconds,
        "tokens_per_s": tokens_per_s,
        "mfu": mfu,
        "peak_flops": peak.value,
        **({} if memory_per_rank is None else {"memory_per_rank": memory_per_rank}),
    }


def summarize(cfg: TrainConfig, rank: Rank, corpus: Corpus, history: History, peak: PeakFlops) -> dict:
    """Rank 0's summary of the run, less what needs every rank (memory, timelines)."""
    device, policy, scaler = rank.mesh.device, rank.policy, rank.scaler
    step_time_s = statistics.median(history.step_times)
    tokens_per_s = cfg.tokens_per_step / step_time_s
    flops_per_token = cfg.model.train_flops_per_token()
    finite = [loss for loss in history.losses if math.isfinite(loss)]
    # the last quarter of the run, at most 20 steps: an 8-step run's final loss is not its starting loss
    tail = finite[-min(20, max(1, len(finite) // 4)) :] or [math.nan]
    return {
        "config": cfg.as_dict(),
        "data": corpus.source,
        "device": describe_device(device),
        "world_size": cfg.world_size,
        "layout": {
            "tp": cfg.tp,
            "pp": cfg.pp,
            "dp": cfg.dp,
            "cp": cfg.cp,
            "cp_kind": cfg.cp_kind,
            "ep": cfg.ep,
            "zero": rank.data_parallel.stage,
            "shard_group": rank.mesh.shard_ranks,  # ZeRO's group: every data rank, or a hybrid shard group
            "reshard_after_forward": cfg.reshard_after_forward,
            "sequence_parallel": cfg.sequence_parallel,
            "schedule": cfg.schedule,
            "virtual_chunks": cfg.virtual_chunks,
        },
        "precision": policy.as_dict(),
        "compute_path": compute_path(policy, device),
        "n_params": cfg.model.n_params(),
        "first_step": history.first_step,
        "losses": history.losses,
        "grad_norms": history.grad_norms,
        "final_loss": sum(tail) / len(tail),
        "final_loss_steps": len(tail),
        "val_loss": history.val_history[-1]["val_loss"],
        "val_history": history.val_history,
        **({"val_by_source": history.val_history[-1]["val_by_source"]}
           if "val_by_source" in history.val_history[-1] else {}),
        "skipped_steps": scaler.skipped_steps if scaler else 0,
        "loss_scale": scaler.scale if scaler else None,
        "comm_bytes_per_step": history.comm_per_step,
        "step_time_s": step_time_s,
        "tokens_per_s": tokens_per_s,
        "flops_per_token": flops_per_token,
        **peak.as_dict(),  # peak_flops (what MFU divides by), how it was measured, peak_note
        "peak_memory_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
        "mfu": flops_per_token * tokens_per_s / (peak.value * cfg.world_size),  # the median step: <= the best
    }


def _path_or_none(path: Path | None) -> str | None:
    return None if path is None else str(path)


def rank_memory(data_parallel, optimizer: MasterAdamW, activations: ActivationMeter) -> dict:
    """This rank's bytes by category, measured from the live tensors."""
    held = data_parallel.memory()
    states = state_bytes(optimizer)
    return {
        "parameters": held["parameters"],
        "gradients": held["gradients"],
        "master_weights": states.get("master", 0),
        "adam_m": states["adam_m"],
        "adam_v": states["adam_v"],
        "activations": activations.bytes,
        "comm_buffers": held["comm_buffers"],
    }


def ranks_memory(mesh: Mesh, rank: Rank, activations: ActivationMeter) -> list[dict]:
    """Every rank's bytes by category (rank_memory), gathered: a collective every rank joins."""
    return gather_from_all(mesh, rank_memory(rank.data_parallel, rank.optimizer, activations))


def bytes_per_param(memory: dict, n_params: int) -> dict[str, float]:
    """Rank 0's model-state bytes per model parameter, by role (for the single-rank view)."""
    return {
        "compute": memory["parameters"] / n_params,
        "grad": memory["gradients"] / n_params,
        "master": memory["master_weights"] / n_params,
        "adam_m": memory["adam_m"] / n_params,
        "adam_v": memory["adam_v"] / n_params,
    }


def gather_from_all(mesh: Mesh, value: dict) -> list[dict]:
    if mesh.world_size == 1:
        return [value]
    values: list = [None] * mesh.world_size
    dist.all_gather_object(values, value)
    return values
