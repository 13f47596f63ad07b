"""Our pipeline executor against torch's own (torch.distributed.pipelining), same model, batch and ranks.

Both run in the same two gloo processes (one thread each), one after the other, alternating:
a few warm-up steps of each, then rounds of `--steps` timed steps of ours followed by as many of
torch's. Ours is `minigpt train --model small --pp 2 --schedule 1f1b --micro-batches 4`'s step
(`Rank.train_step`, parallel/run/step.py: the schedule's actions, the tied-embedding sync, gradient clipping
and the optimizer). Theirs is PipelineStage + Schedule1F1B on the same two chunks that
parallel/pipeline/executor.py `split_model` cuts (same seed, so the same weights), then the same extra work
done by hand: the tied embedding's gradient summed over the two ranks, the global gradient norm,
clipping and AdamW. Both read the same batches from minigpt/data.py; the first step's losses must
agree (same model, same batch, before any update).

A step's time is rank 0's wall time, from its start to the end of its optimizer step (both sides end
with a collective over the two ranks, so the ranks finish together). Reported: the median of each
side's steps, the ratio ours/theirs per round (the spread is over rounds) and, from our executor's
own trace of the timed steps, where our step's time goes. Not a test: it prints a markdown table.

    python bench/pipeline_vs_torch.py --rounds 6 --steps 3
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
from datetime import date

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage, Schedule1F1B

from job.train_config import TrainConfig
from minigpt.presets import PRESETS
from minigpt.data import Corpus
from minigpt.model import GPT
from parallel.run.build import build_rank, tied_copy
from parallel.launch.elastic import finish_worker, init_worker, launch
from parallel.mesh import build_mesh
from parallel.pipeline.executor import split_model
from parallel.run.train import micro_batches
from precision.policy import policy as precision_policy


class TorchPipeline:
    """torch.distributed.pipelining's 1F1B on our chunk of this rank, plus what our step does besides."""

    def __init__(self, cfg: TrainConfig, pp_rank: int, device: torch.device):
        torch.manual_seed(cfg.seed)
        model = GPT(cfg.model)
        self.stage_model = split_model(model, cfg.pp, pp_rank, 1)
        self.chunk = self.stage_model.chunks[0]
        self.loss_fn = model.loss
        self.cfg, self.pp_rank = cfg, pp_rank
        stage = PipelineStage(self.chunk, pp_rank, cfg.pp, device)
        self.schedule = Schedule1F1B(stage, n_microbatches=cfg.micro_batches, loss_fn=self.loss_fn)
        self.tied = tied_copy(self.stage_model) if cfg.model.tied_head else None
        self.tied_group = dist.new_group([0, cfg.pp - 1]) if cfg.model.tied_head else None
        self.optimizer = torch.optim.AdamW(self.stage_model.parameters(), lr=cfg.lr,
                                           betas=(cfg.beta1, cfg.beta2), weight_decay=cfg.weight_decay)

    def step(self, step: int, inputs: list[torch.Tensor], targets: list[torch.Tensor]) -> tuple[float, float]:
        """One training step: (rank 0's seconds, the micro-batches' mean loss)."""
        start = time.perf_counter()
        losses: list[torch.Tensor] = []
        if self.pp_rank == 0:
            self.schedule.step(torch.cat(inputs))
        elif self.pp_rank == self.cfg.pp - 1:
            self.schedule.step(target=torch.cat(targets), losses=losses)
        else:
            self.schedule.step()
        if self.tied is not None and self.tied.grad is not None:
            dist.all_reduce(self.tied.grad, group=self.tied_group)
        params = [p for p in self.stage_model.parameters() if p.grad is not None]
        squares = torch.stack([p.grad.pow(2).sum() for p in params]).sum()
        if self.tied is not None and self.pp_rank == self.cfg.pp - 1:
            squares = squares - self.tied.grad.pow(2).sum()  # one copy of the tied matrix counts
        loss = torch.stack(losses).mean() if losses else torch.zeros(())
        totals = torch.stack([squares, loss.detach()])
        dist.all_reduce(totals)
        torch.nn.utils.clip_grads_with_norm_(params, self.cfg.grad_clip, totals[0].sqrt())
        for group in self.optimizer.param_groups:
            group["lr"] = self.cfg.learning_rate(step)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return time.perf_counter() - start, float(totals[1])


def ours_breakdown(events: list[tuple[str, str, float, float]], seconds: float) -> dict[str, float]:
    """Seconds of a step of ours by kind: compute, p2p (the bubble and the exposed transfers), dp
    (gradient sync and optimizer), other (Python between actions)."""
    kinds = {"compute": 0.0, "p2p": 0.0, "dp": 0.0}
    for _, kind, start, end in events:
        if kind in kinds:
            kinds[kind] += end - start
    kinds["other"] = max(0.0, seconds - sum(kinds.values()))
    return kinds


def worker(args: tuple[TrainConfig, int, int, int]) -> dict | None:
    cfg, warmup, rounds, steps = args
    device = init_worker("cpu")
    torch.set_num_threads(1)
    try:
        mesh = build_mesh(cfg.pp, cfg.dp, cfg.tp, device, cfg.cp)
        corpus = Corpus.load(cfg.data, cfg.model.seq_len)
        ours = build_rank(cfg, mesh, device, precision_policy(cfg.precision))
        theirs = TorchPipeline(cfg, mesh.pp_rank, device)
        result = {"ours": [], "theirs": [], "rounds": [], "first_loss": {}, "breakdown": {}}
        step_of = {"ours": 0, "theirs": 0}

        def one(side: str) -> float:
            step = step_of[side]
            step_of[side] += 1
            inputs, targets = micro_batches(corpus, cfg, step, mesh, device)
            if side == "ours":
                outcome = ours.train_step(cfg, step, inputs, targets)
                seconds, loss = outcome.seconds, outcome.loss
                if step >= warmup:
                    for kind, value in ours_breakdown(outcome.events, seconds).items():
                        result["breakdown"].setdefault(kind, []).append(value)
            else:
                seconds, loss = theirs.step(step, inputs, targets)
            if step == 0:
                result["first_loss"][side] = loss
            return seconds

        for _ in range(warmup):
            one("ours")
            one("theirs")
        for _ in range(rounds):
            timed = {side: [one(side) for _ in range(steps)] for side in ("ours", "theirs")}
            for side, times in timed.items():
                result[side] += times
            result["rounds"].append(statistics.median(timed["ours"]) / statistics.median(timed["theirs"]))
        return result if mesh.rank == 0 else None
    finally:
        finish_worker()


def table(result: dict) -> str:
    ours, theirs = statistics.median(result["ours"]), statistics.median(result["theirs"])
    ratios = sorted(result["rounds"])
    quartiles = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
    parts = {kind: statistics.median(values) for kind, values in result["breakdown"].items()}
    loss_ours, loss_theirs = result["first_loss"]["ours"], result["first_loss"]["theirs"]
    lines = [
        "| executor | median step ms | steps timed |",
        "|---|---|---|",
        f"| ours (parallel/pipeline/executor.py, 1F1B) | {ours * 1000:.1f} | {len(result['ours'])} |",
        f"| torch.distributed.pipelining Schedule1F1B | {theirs * 1000:.1f} | {len(result['theirs'])} |",
        "",
        f"ours / theirs: **{ours / theirs:.3f}** (medians); per round {statistics.median(ratios):.3f} median, "
        f"middle half {quartiles[0]:.3f} to {quartiles[2]:.3f}, all {ratios[0]:.3f} to {ratios[-1]:.3f} "
        f"over {len(ratios)} rounds",
        "",
        f"first-step loss: ours {loss_ours:.6f}, torch {loss_theirs:.6f} "
        f"(difference {abs(loss_ours - loss_theirs):.1e})",
        "",
        "ours, rank 0, median ms per step: " + ", ".join(f"{k} {v * 1000:.1f}" for k, v in parts.items()),
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small", choices=sorted(PRESETS))
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps of each side first")
    parser.add_argument("--rounds", type=int, default=6, help="alternations: ours, then theirs")
    parser.add_argument("--steps", type=int, default=3, help="timed steps of each side per round")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as out:
        cfg = TrainConfig(model=PRESETS[args.model], steps=1000, global_batch=args.batch_size,
                          micro_batches=args.micro_batches, pp=2, schedule="1f1b", device="cpu",
                          out_dir=out, threads_per_rank=1)
        result = launch(worker, (cfg, args.warmup, args.rounds, args.steps), cfg.world_size, threads_per_rank=1)
    if args.json:
        print(json.dumps(result))
        return
    print(f"{platform.processor() or platform.machine()}, torch {torch.__version__}, {date.today()}, "
          f"--model {args.model} --pp 2 --schedule 1f1b --micro-batches {args.micro_batches} "
          f"--batch-size {args.batch_size}, 2 gloo ranks x 1 thread\n")
    print(table(result))


if __name__ == "__main__":
    main()
