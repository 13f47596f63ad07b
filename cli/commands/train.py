"""`minigpt train`: parse and check the flags, then hand the run to parallel.run.train."""

from __future__ import annotations

import dataclasses
import io
import json
import os
import sys
from pathlib import Path

import click

from cli.options import flag, typed
from cli.options.config_file import config_file_option
from cli.options.context import context_options
from cli.options.fsdp import fsdp_options, reshards
from cli.output import print_table
from cli.options.batch import batch_options, micro_batch_count, stage_layers_option
from cli.options.model import hf_tokenizer, model_from_hf, model_from_options, model_options
from cli.options.precision import AUTO, CPU_PRECISION, optimizer_options, precision_option, training_precision
from minigpt.data import check_text_file, document_end, documents_words, is_token_dir, token_header
from minigpt.errors import ConfigError
from minigpt.tokenizer import BYTES, load_tokenizer
from parallel.gpu_files import cuda_devices
from parallel.run.loss_plot import LossPlotter
from parallel.launch.rank_start import in_torchrun, start_rank_server
from parallel.run.resume import ResumePoint, continue_settings, resume_point, resumed_tokenizer
from parallel.run.directory import RunClaim
from parallel.run.files import default_run_dir
from parallel.run.tensorboard import announce as tensorboard_line, available as tensorboard_installed
from parallel.launch.torchrun_env import check_torchrun_variables, tensor_parallel_across_nodes
from parallel.launch.watchdog import DEFAULT_TIMEOUT_S, check_timeout
from job.train_config import DEVICES, TrainConfig, routing_ranks

NEWEST = "<newest>"  # bare --resume: the newest checkpoint of --out that verifies


def build_train_config(options: dict) -> TrainConfig:
    """Flags to a checked TrainConfig; raises ConfigError on any bad value. Torch-free.
    The run directory is resolved (a default one named) but neither checked nor touched here."""
    check_torchrun_variables()  # before data_parallel_size reads WORLD_SIZE
    chosen = resume_choice(options["resume"])
    if chosen is not None and options["out"] is None and Path(chosen).parent.name == "checkpoints":
        options = {**options, "out": str(Path(chosen).parent.parent)}  # --resume RUN/checkpoints/step-N
    if options["no_save"] and options["save_every"]:
        raise ConfigError(f"--no-save keeps no checkpoint, --save-every {options['save_every']} asks for them: "
                          f"give one or the other")
    if options["resume"] not in (None, False) and options["out"] is not None:  # the run's tokenizer, or refused
        options = {**options, "tokenizer": resumed_tokenizer(options["tokenizer"], options["out"], chosen)}
    if options["init_from"] is not None and options["tokenizer"] is None:  # the model's own, where it has one
        options = {**options, "tokenizer": hf_tokenizer(options["init_from"])}
    encoded = one_tokenizer(options["data"])
    if encoded is not None and options["tokenizer"] is None:  # encoded data: the tokenizer that encoded it
        options = {**options, "tokenizer": hf_tokenizer(encoded)}
    model = model_from_hf(options) if options["init_from"] is not None else model_from_options(options)
    dp = data_parallel_size(options)
    cfg = TrainConfig(
        model=model,
        steps=options["steps"],
        global_batch=options["global_batch"],
        micro_batches=micro_batch_count(options["global_batch"], dp, options["micro_batches"],
                                        options["micro_batch_size"]),
        lr=options["lr"],
        min_lr=options["min_lr"] if options["min_lr"] is not None else options["lr"] / 10,
        lr_schedule=options["lr_schedule"], decay_fraction=options["decay_fraction"],
        warmup_steps=options["warmup"],
        weight_decay=options["weight_decay"],
        optimizer=options["optimizer"],
        muon_momentum=options["muon_momentum"],
        grad_clip=options["grad_clip"],
        eval_every=options["eval_every"],
        eval_batches=options["eval_batches"],
        seed=options["seed"],
        data=tuple(options["data"]),
        data_weights=parse_weights(options["data_weights"]),
        document_eod=document_end(options["data"]) if options["document_mask"] else None,
        init_from=options["init_from"],
        tokenizer=options["tokenizer"] or BYTES,
        out_dir=options["out"],
        device=options["device"],
        precision=CPU_PRECISION if options["precision"] == AUTO else options["precision"],  # auto: resolved below
        loss_scale=parse_loss_scale(options["loss_scale"]),
        loss_scale_window=options["loss_scale_window"],
        log_every=options["log_every"],
        tp=options["tp"],
        pp=options["pp"],
        dp=dp,
        cp=options["cp"],
        cp_kind=options["cp_kind"],
        ep=options["ep"],
        zero=options["zero"],
        shard_group=options["shard_group"],
        reshard_after_forward=reshards(options),
        sync_grads_once=options["sync_grads_once"],
        sequence_parallel=options["sequence_parallel"],
        schedule=options["schedule"],
        virtual_chunks=options["virtual_chunks"],
        stage_layers=options["stage_layers"],
        bucket_mb=options["bucket_mb"],
        threads_per_rank=options["threads_per_rank"],
        save_every=options["save_every"] or 0,
        save_final=not options["no_save"],
        resume=options["resume"] not in (None, False),
        recompute=options["recompute"],
        watchdog_s=options["watchdog"],
        max_restarts=options["max_restarts"],
        tensorboard=tensorboard_installed(),  # event files in every run directory, where the package is installed
    )
    check_timeout(options["watchdog"])
    if options["precision"] == AUTO:  # the device's format, looked up (torch) once everything else is valid
        cfg = dataclasses.replace(cfg, precision=training_precision(AUTO, cfg.device, cfg.world_size))
    check_loss_scale_flags(cfg.precision)
    for path in cfg.data:
        check_text_file(path, model.seq_len, load_tokenizer(cfg.tokenizer))
    if cfg.out_dir is None:
        cfg = dataclasses.replace(cfg, out_dir=str(default_run_dir(cfg)))
    return cfg


def check_loss_scale_flags(precision: str) -> None:
    """--loss-scale and --loss-scale-window scale fp16's loss (the only format whose policy scales it): given for
    another format they would do nothing, so they are refused."""
    for name in ("loss_scale", "loss_scale_window"):
        if precision != "fp16" and typed(name):
            given = flag(name)
            raise ConfigError(f"{given} scales fp16's loss, and this run computes in {precision}, whose loss is not "
                              f"scaled: drop {given} or train with --precision fp16")


def resume_choice(value: object) -> str | None:
    """--resume's value (or the TOML key's) as the checkpoint chosen: None for the newest, or a PATH."""
    if value in (None, False, True, NEWEST):
        return None
    if not isinstance(value, str) or not value:
        raise ConfigError(f"--resume takes no value (the newest checkpoint that verifies) or a checkpoint "
                          f"directory, got {value!r}")
    return value


def claim_run_dir(cfg: TrainConfig, options: dict) -> RunClaim | None:
    """The launching process's claim on --out (checked, not yet taken); None in a torchrun rank other
    than 0, which checks the directory as rank 0 does (refused on every node alike, before any rank
    waits for rank 0) and leaves claiming it to rank 0 (parallel/run/directory.py)."""
    from parallel.launch.elastic import check_torchrun_world  # torch: only once the flags are valid

    check_torchrun_world(cfg.world_size)  # before the directory is touched
    if not reports():
        RunClaim(cfg.out_dir, resume=cfg.resume, overwrite=options["overwrite"], lock=False)
        return None
    across = tensor_parallel_across_nodes(cfg.tp)
    if across is not None:
        click.echo(f"minigpt: warning: {across}", err=True)
    return RunClaim(cfg.out_dir, resume=cfg.resume, overwrite=options["overwrite"])


def reports() -> bool:
    """Whether this process reports the run (its lines, its JSON): all but a torchrun rank other than 0."""
    return not in_torchrun() or os.environ["RANK"] == "0"


def check_memory(cfg: TrainConfig) -> None:
    """Refuse, in one line, a run the simulator's memory model says this machine cannot hold (cli/tools/
    memory_check.py): the RAM available now on a CPU, the smallest GPU's free memory on CUDA."""
    from cli.tools.memory_check import check_cpu_memory, check_gpu_memory
    from parallel.device import runs_on_cuda, smallest_free_gpu_bytes

    if in_torchrun():  # torchrun's nodes hold the ranks: each has its own memory, not this one's
        return
    if runs_on_cuda(cfg.device, cfg.world_size):
        check_gpu_memory(cfg, smallest_free_gpu_bytes(cfg.world_size))
    else:
        check_cpu_memory(cfg)


def choose_resume(cfg: TrainConfig, options: dict, out) -> ResumePoint | None:
    """The checkpoint a resumed run continues, verified; its skip and resume lines printed."""
    if not cfg.resume:
        return None
    point = resume_point(cfg, resume_choice(options["resume"]))
    if point.skipped_line() and reports():
        click.echo(point.skipped_line(), err=True)
    if not point.nothing_to_do(cfg.steps):
        click.echo(point.resuming_line(cfg.steps), file=out)
    return point


CPU_ZERO_DP = 2  # on a CPU without --dp, ZeRO > 0 gets the smallest group it can shard over


def data_parallel_size(options: dict) -> int:
    """--dp as given, else what fills the job: under torchrun the world over tp x pp, with a GPU per
    rank the GPUs over tp x pp, on a CPU 1 (CPU_ZERO_DP with a ZeRO stage, which needs a group to
    shard over). A ZeRO stage over one rank would do nothing: refused, never silently run as ZeRO-0."""
    dp, zero, cp = options["dp"], options["zero"], options["cp"]
    model_parallel = options["tp"] * options["pp"] * cp
    if model_parallel < 1:  # a bad --tp, --pp or --cp: TrainConfig says which
        return 1 if dp is None else dp
    if dp is None:
        dp = default_data_parallel(model_parallel, 0 if cp > 1 else zero, options["device"])
        routing = routing_ranks(dp, cp, options["tp"], options["sequence_parallel"])
        if options["ep"] > 1 and routing % options["ep"] and not in_torchrun():  # the experts' group needs ep of them
            dp = options["ep"]
    if dp * cp == 1 and zero in (1, 2, 3):
        raise ConfigError(f"--zero {zero} shards over the data-parallel group (dp x cp), but it has one rank: "
                          f"nothing would be sharded; give --dp 2 or more, or --zero 0")
    return dp


def default_data_parallel(model_parallel: int, zero: int, device: str) -> int:
    if in_torchrun():  # the world torchrun started
        return max(1, int(os.environ["WORLD_SIZE"]) // model_parallel)
    if device != "cpu":
        gpus = cuda_devices()
        if gpus >= model_parallel:
            return gpus // model_parallel
    return CPU_ZERO_DP if zero in (1, 2, 3) else 1


def parse_loss_scale(text: str) -> float | None:
    if text == "dynamic":
        return None
    try:
        return float(text)
    except ValueError:
        raise ConfigError(f"--loss-scale must be 'dynamic' or a number, got {text!r}") from None


def one_tokenizer(sources) -> str | None:
    """The first token directory among the --data sources (None: none); ConfigError where two were encoded by
    different tokenizers (a mixture is read in one tokenizer's ids)."""
    encoded = [path for path in sources if is_token_dir(path)]
    tokenizers = {path: token_header(path)["tokenizer"] for path in encoded}
    for path, tokenizer in tokenizers.items():
        if tokenizer["fingerprint"] != tokenizers[encoded[0]]["fingerprint"]:
            raise ConfigError(f"--data {encoded[0]!r} and {path!r} were encoded by different tokenizers "
                              f"({tokenizers[encoded[0]].get('name')!r}, {tokenizer.get('name')!r}): a mixture is read "
                              f"in one tokenizer's ids; encode every source with one")
    return encoded[0] if encoded else None


def parse_weights(text: str | None) -> tuple[float, ...]:
    """--data-weights' comma-separated numbers (none: ())."""
    if text is None:
        return ()
    try:
        return tuple(float(part) for part in text.split(","))
    except ValueError:
        raise ConfigError(f"--data-weights must be numbers separated by commas (one per --data), got {text!r}") \
            from None


def format_step(record: dict) -> str:
    line = (
        f"step {record['step']:>5}  loss {record['loss']:.4f}  lr {record['lr']:.2e}  "
        f"{record['tokens_per_s']:>9,.0f} tok/s  {record['step_time_s'] * 1000:7.1f} ms  "
        f"MFU {record['mfu']:6.1%}"
    )
    if record["loss_scale"] != 1.0:
        line += f"  scale {record['loss_scale']:g}"
    if record["skipped"]:
        line += "  (skipped: overflow)"
    if "val_loss" in record:
        line += f"  val {record['val_loss']:.4f}"
    return line


class StepPrinter:
    """Rank 0's per-step output: a log line every `every` steps, a progress bar between
    them on a terminal. A class, not a closure, so that it can travel to a spawned rank."""

    def __init__(self, every: int, steps: int, to_stderr: bool):
        self.every, self.steps, self.to_stderr = every, steps, to_stderr

    def __call__(self, record: dict) -> None:
        log = sys.stderr if self.to_stderr else sys.stdout
        interactive = log.isatty()
        step = record["step"]
        if step % self.every == 0 or step == self.steps - 1 or "val_loss" in record:
            click.echo(("\r" if interactive else "") + format_step(record), file=log)
        elif interactive:
            bar = "#" * int(30 * (step + 1) / self.steps)
            click.echo(f"\r[{bar:<30}] {step + 1}/{self.steps} loss {record['loss']:.4f}", file=log, nl=False)


def mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


@config_file_option
@click.command()
@click.option("--tp", default=1, show_default=True, type=int, help="Tensor-parallel size.")
@click.option("--pp", default=1, show_default=True, type=int, help="Pipeline-parallel size.")
@click.option("--dp", type=int, help="Data-parallel size (tp x cp x pp x dp processes) [default: the GPUs over "
              "tp x cp x pp on CUDA, torchrun's world over them, on a CPU 1, or 2 with --zero 1-3 and no --cp].")
@context_options
@click.option("--ep", default=1, show_default=True, type=int,
              help="Expert-parallel size: a mixture of experts' experts split over ep consecutive ranks of those "
                   "routing distinct tokens (dp x cp; x tp under --sequence-parallel); it must divide them and the "
                   "experts [default dp on a CPU: ep].")
@click.option("--zero", default=0, show_default=True, type=int, help="ZeRO stage over the data-parallel group (dp x cp): 0-3.")
@fsdp_options
@click.option("--schedule", default="1f1b", show_default=True, help="Pipeline schedule: gpipe, 1f1b, interleaved or zb-h1 (zero bubble: input and weight gradients split).")
@click.option("--virtual-chunks", default=1, show_default=True, type=int, help="Model chunks per pipeline rank (interleaved).")
@stage_layers_option
@click.option("--sequence-parallel", is_flag=True, help="Shard LayerNorm and dropout regions along the sequence (tp > 1).")
@click.option("--bucket-mb", default=25.0, show_default=True, type=float, help="Gradient bucket size in MiB.")
@click.option("--threads-per-rank", type=int, help="CPU threads per rank [default: 1 with several ranks].")
@model_options("tiny")
@click.option("--recompute", default="none", show_default=True, help="Activation recomputation: none, "
              "selective (the attention core runs again in the backward, Korthikanti et al. 2022) or full (every "
              "block keeps its input alone and runs again in the backward).")
@click.option("--steps", default=100, show_default=True, type=int, help="Optimizer steps.")
@batch_options(16, "Global batch: sequences per step over every data-parallel replica.")
@optimizer_options
@click.option("--eval-every", type=int, help="Steps between validations [default: 5 per run; 0: at the end].")
@click.option("--eval-batches", default=4, show_default=True, type=int)
@click.option("--seed", default=0, show_default=True, type=int)
@click.option("--data", type=str, multiple=True, help="A UTF-8 text file, or a token directory (`minigpt tokenizer "
              "encode`: memory-mapped, its tokenizer the run's unless --tokenizer); given again, a mixture of the "
              "sources [default: the embedded Shakespeare corpus].")
@click.option("--data-weights", "data_weights", type=str, metavar="W1,W2,...", help="The mixture's weights, one per "
              "--data (normalised to shares) [default: each source's training tokens].")
@click.option("--document-mask", "document_mask", is_flag=True, help="Attention within each document of a sequence "
              "(Llama 3's document mask): --data token directories encoded with --eod.")
@click.option("--init-from", "init_from", type=str, metavar="DIR", help="Start from the weights and shape of a Hugging "
              "Face model directory (transformers' GPT-2 or Llama: config.json, model.safetensors; `minigpt export` "
              "writes one); the optimizer starts fresh.")
@click.option("--out", type=str, help="Run directory [default: runs/<time>-<shape>].")
@click.option("--device", default="auto", show_default=True, type=click.Choice(DEVICES))
@precision_option
@click.option("--loss-scale", default="dynamic", show_default=True, help="fp16 loss scale: 'dynamic' or a static number.")
@click.option("--loss-scale-window", default=1000, show_default=True, type=int, help="Clean steps before a dynamic scale doubles.")
@click.option("--save-every", type=int, help="Checkpoint every N steps and at the end (0: at the end only) [default: 0, "
              "or with --resume the run's own].")
@click.option("--no-save", is_flag=True, help="No checkpoint at all, not even the final one that `minigpt sample` and "
              "`minigpt export` read.")
@click.option("--resume", is_flag=False, flag_value=NEWEST, default=None, type=click.UNPROCESSED, metavar="[PATH]",
              help="Continue the run in --out from its newest checkpoint that verifies, or from checkpoint PATH.")
@click.option("--overwrite", is_flag=True, help="Clear --out first (only a minigpt run directory; never with --resume).")
@click.option("--log-every", type=int, help="Steps between log lines [default: 20 lines per run].")
@click.option("--watchdog", type=float, default=DEFAULT_TIMEOUT_S, show_default=True, help="Seconds a rank may stop "
              "responding (stopped, frozen) before the run ends naming it; 0: off.")
@click.option("--max-restarts", "max_restarts", type=int, default=0, show_default=True,
              help="Restart every rank after a failure, at most this many times, each time from the newest checkpoint "
                   "that verifies (torch's elastic agent; needs --save-every).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object at the end, nothing else on stdout.")
def train(as_json: bool, **options) -> None:
    """Train a GPT on the embedded corpus (or --data)."""
    cfg = build_train_config(options)
    start_rank_server_early(cfg)
    plotter = start_plotter()
    try:
        check_and_run(cfg, options, as_json, plotter)
    finally:
        if plotter is not None:
            plotter.close()


def check_and_run(cfg: TrainConfig, options: dict, as_json: bool, plotter: LossPlotter | None) -> None:
    from parallel.device import check_device  # torch is imported only once the flags are valid

    check_device(cfg.device, cfg.world_size)
    if cfg.init_from is not None:  # every tensor of the shape there, at its size: read from the files' headers
        from minigpt.hf.files import check_hf_dir

        check_hf_dir(cfg.init_from)  # the context was checked where the shape was read (model_from_hf)
    check_memory(cfg)
    out = (sys.stderr if as_json else sys.stdout) if reports() else io.StringIO()  # torchrun: rank 0 speaks
    claim = claim_run_dir(cfg, options)
    try:
        point = choose_resume(cfg, options, out)
        if point is not None and not point.nothing_to_do(cfg.steps):
            cfg, lines = continue_settings(cfg, point, options["save_every"] is not None or options["no_save"])
            for line in lines:
                click.echo(line, file=out)
        if point is not None and point.nothing_to_do(cfg.steps):
            click.echo(point.nothing_to_do(cfg.steps), file=out)
            if as_json and reports():
                click.echo(json.dumps({"nothing_to_do": point.nothing_to_do(cfg.steps), "first_step": point.step,
                                       "steps": cfg.steps, "checkpoint": str(point.path), "run_dir": cfg.out_dir}))
            return
        join_torchrun_group(cfg)
        if claim is not None:
            claim.take()
        run_and_report(cfg, options, point, as_json, out, plotter)
    finally:
        if claim is not None:
            claim.release()


def join_torchrun_group(cfg: TrainConfig) -> None:
    """Under torchrun, meet the other ranks (a rendezvous bounded by parallel/launch/torchrun_env.py) before rank 0 makes,
    locks or clears --out: a rank whose peers never come leaves nothing behind. The rank joins once."""
    if in_torchrun():
        from parallel.launch.elastic import init_worker

        init_worker(None if cfg.device == "auto" else cfg.device)


def start_plotter() -> LossPlotter | None:
    """The process that draws loss.png, started now: it imports matplotlib on one core while this process
    imports torch on the other. None in a torchrun rank other than 0, which reports nothing."""
    if not reports():
        return None
    return LossPlotter.start()


def start_rank_server_early(cfg: TrainConfig) -> None:
    """A run of several local ranks starts the server they are forked from now (parallel/launch/rank_start.py):
    it imports torch on one core while this process imports it on the other. A run that saves or resumes
    checkpoints has it import torch.distributed.checkpoint too, once, instead of every rank (a second each)."""
    if cfg.world_size > 1 and not in_torchrun():
        checkpoints = ("parallel.checkpoint.sharded",) if cfg.saves or cfg.resume else ()
        start_rank_server("parallel.run.train", "cli.main", *checkpoints)  # cli.main: the console script a rank runs


def run_and_report(cfg: TrainConfig, options: dict, point: ResumePoint | None, as_json: bool, out,
                   plotter: LossPlotter | None) -> None:
    from job.layout import Layout
    from parallel.run.train import train as run_training

    m = cfg.model
    click.echo(
        f"training {m.n_params():,} parameters" + (f", {m.active_params():,} active" if m.is_moe else "") +
        f" ({m.describe()}) for {cfg.steps} steps of {cfg.tokens_per_step:,} "
        f"tokens" + ("" if cfg.recompute == "none" else f", {cfg.recompute} recomputation") +
        ("" if cfg.document_eod is None else f", attention within documents ({documents_words(cfg.data)})") +
        ("" if cfg.optimizer == "adamw" else ", Muon on the hidden matrices (AdamW for the rest)") +
        ("" if cfg.tokenizer == BYTES else f", tokenizer {cfg.tokenizer} (vocabulary {m.vocab_size:,})"),
        file=out,
    )
    context = f" x cp {cfg.cp} ({cfg.cp_kind})" if cfg.cp > 1 else ""
    group = f"dp x cp group of {cfg.data_ranks}" if cfg.cp > 1 else f"dp group of {cfg.dp}"
    experts = f", the experts split over ep {cfg.ep}" if cfg.ep > 1 else ""
    if cfg.shard_group:
        group = f"shard groups of {cfg.shard_group} ({cfg.data_ranks // cfg.shard_group} replicas, hybrid)"
    if not cfg.reshard_after_forward:
        group += ", no resharding after the forward" + (", gradients synced once a step" if cfg.sync_grads_once else "")
    placed = Layout.of(cfg).placement
    stages = f" x pp {cfg.pp}" + (f" (blocks per chunk {placed})" if placed else "")
    click.echo(f"layout: tp {cfg.tp}{context}{stages} x dp {cfg.dp} = {cfg.world_size} process"
               f"{'es' if cfg.world_size > 1 else ''}, ZeRO-{cfg.zero}"
               f"{'' if cfg.zero == 0 else ' over the ' + group}{experts}"
               f"{'' if options['dp'] is not None else ' (dp chosen: --dp sets it)'}, {cfg.precision}"
               f"{' (auto: bf16 on a GPU, fp32 on a CPU)' if options['precision'] == AUTO else ''}", file=out)
    click.echo(tensorboard_line(cfg.out_dir, cfg.tensorboard), file=out)
    summary = run_training(cfg, on_step=StepPrinter(cfg.log_interval, cfg.steps, to_stderr=as_json), resume_from=point,
                           plotter=plotter)
    if summary is None:  # a torchrun rank other than 0: rank 0 reports
        return
    if as_json:
        click.echo(json.dumps(summary))
        return
    print_table(
        ["metric", "value"],
        [
            ["device", summary["device"]],
            ["parameters", f"{summary['n_params']:,}"],
            [f"final loss (mean of the last {summary['final_loss_steps']} steps)", f"{summary['final_loss']:.4f}"],
            ["validation loss", f"{summary['val_loss']:.4f}"],
            *[[f"  of {source}", f"{loss:.4f}"] for source, loss in (summary.get("val_by_source") or {}).items()],
            ["median step time", f"{summary['step_time_s'] * 1000:.1f} ms"],
            ["tokens/s", f"{summary['tokens_per_s']:,.0f}"],
            [f"MFU (vs measured {summary['peak_flops_dtype']} matmul peak)", f"{summary['mfu']:.1%}"],
            ["run directory", summary["run_dir"]],
        ],
    )
    if summary.get("peak_note"):
        click.echo(f"MFU's peak: {summary['peak_note']}")
    if summary.get("expert_load"):
        busiest = ", ".join(f"{v['max_over_mean']:.2f}" for v in summary["expert_load"]["layers"].values())
        picture = f" (drawn in {summary['expert_load_plot']})" if summary.get("expert_load_plot") else ""
        click.echo(f"expert load: the busiest expert's share of the routed choices over the mean, by MoE layer: "
                   f"{busiest} (1.00 balanced){picture}")
    layout = summary["layout"]
    click.echo(
        f"\nmemory per rank (tp {layout['tp']} x pp {layout['pp']} x dp {layout['dp']}, ZeRO {layout['zero']}, "
        f"{summary['precision']['name']})"
    )
    roles = list(summary["memory_per_rank"][0])
    print_table(["rank"] + roles, [[rank] + [mib(m[r]) for r in roles] for rank, m in enumerate(summary["memory_per_rank"])])
    for group, counters in summary["comm_bytes_per_step"].items():
        if counters:
            click.echo(f"\ncommunication per step on rank 0 ({group} group)")
            print_table(
                ["collective", "bytes", "ZeRO volume", "calls"],
                [[kind, mib(c["bytes"]), mib(c["volume"]), c["calls"]] for kind, c in counters.items()],
            )
