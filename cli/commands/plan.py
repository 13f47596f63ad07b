"""`minigpt plan`: the fastest training layouts of a model on N GPUs that fit in memory.

Torch-free: it checks flags and prints what simulator/search/plan.py finds. The model flags are
`simulate`'s (cli/options/model.py), the cluster flags too (--gpu, --hardware, --gpus-per-node,
--fabric, --topology-kind, --nics-per-node, --oversubscription: one cluster of --gpus GPUs in whole
servers). The global batch defaults to one sequence per GPU, so every dp divides it; ZeRO-3 comes with FSDP's settings
(simulator/search/plan.py's fsdp_options: the table's "3 kept", "3 kept all step") and ZeRO 1-3 with hybrid sharding
over a server ("1 / N");
--micro-batch-size or --micro-batches fixes the micro-batching, otherwise it is searched. Context parallelism (ring) is
searched too (simulator/search/plan.py's MIN_CP_CHUNK says how far); when no layout fits without it,
one line says which cp the job needs at the least. For a mixture of experts expert parallelism is searched (every
divisor of dp that divides the experts; --ep fixes it) and --expert-load prices a routing imbalance
(cli/options/experts.py), the same for every candidate. --overlap names the stack the job runs on, as `simulate`'s
does (its overlap and its own implementation: Megatron-core's fused casts and weight-gradient fusion, torchtitan's
eager element-wise code and fp32 reductions); under torchtitan-fsdp2 its selective op recompute is searched too.
The stack's kernel flags (--fp8-recipe, --fp8-param-gather, --elementwise, --grad-reduce, --attention-kernel:
cli/options/stack.py) change every candidate as they change `simulate`'s job.

--plot FILE.png draws the listed layouts (cli/tools/plots.py), the path checked before the search.

A model that fits nowhere is bad input too: one line naming the smallest memory need found and the
GPU's capacity, exit code 2 (the flags ask for the impossible; more GPUs, a larger GPU or a smaller
model is the fix), before anything is simulated.
"""

from __future__ import annotations

import contextlib
import json
import sys

import click

from cli.options.batch import batch_options
from cli.options.config_file import config_file_option
from cli.options.experts import ep_dispatcher_option, expert_load_option, read_expert_load
from cli.options.model import model_from_options, model_options
from cli.options.cluster import check_cluster_names, cluster_options
from cli.options.precision import precision_option, simulated_precision
from cli.options.stack import stack_changes, stack_options
from cli.commands.simulate import _hardware, parameter_count
from cli.tools.plots import check_png
from minigpt.errors import ConfigError, check_positive_int
from simulator.engine.overlap import PRESETS as OVERLAP_PRESETS

GIB = 2**30


@contextlib.contextmanager
def _progress():
    """One line of progress on stderr while the search runs, when stderr is a terminal."""
    if not sys.stderr.isatty():
        yield None
        return
    yield lambda stage, done, total: click.echo(f"\rplan: {stage} {done:,}/{total:,}   ", nl=False, err=True)
    click.echo("\r" + " " * 40 + "\r", nl=False, err=True)


def _rows(result) -> list[list]:
    from simulator.report import seconds

    rows = []
    for rank, (candidate, simulated, _) in enumerate(result.best, 1):
        schedule = candidate.schedule + (f" x{candidate.virtual_chunks}" if candidate.virtual_chunks > 1 else "")
        rows.append([rank, candidate.mesh(),
                     "yes" if candidate.sequence_parallel else "no",
                     candidate.zero_label(),
                     f"{candidate.micro_batches} of {candidate.micro_batch}", schedule, candidate.recompute,
                     seconds(simulated.step_time_s), f"{simulated.mfu:.1%}", f"{simulated.memory.total / GIB:.1f}"])
    return rows


def _why_rows(result) -> list[list]:
    from simulator.search.plan import REFUSALS

    rows = [["candidates in all", f"{result.candidates:,}"]]
    rows += [[f"refused: {REFUSALS[key]}", f"{count:,}"] for key, count in sorted(result.refused.items())]
    smallest = result.smallest_too_big
    if smallest:
        need, capacity = smallest[1] / GIB, result.capacity / GIB
        digits = next((d for d in (1, 2, 3) if f"{need:.{d}f}" != f"{capacity:.{d}f}"), 3)  # the need shows above
        rows.append([f"did not fit in memory (the smallest need among them: {need:.{digits}f} GiB per GPU, "
                     f"of {capacity:.{digits}f})", f"{len(result.too_big):,}"])
    rows.append(["fit, simulated, slower", f"{len(result.simulated) - len(result.best):,}"])
    rows.append(["fit, slower by a lower bound (not simulated)", f"{result.pruned:,}"])
    rows.append(["fit, the fastest (above)", f"{len(result.best):,}"])
    return rows


def _print(result) -> None:
    from cli.output import format_table

    model = result.model
    click.echo(f"{parameter_count(model.n_params())}-parameter GPT ({model.describe()}) on {result.n_gpus} x "
               f"{result.gpu}, {result.precision}, global batch {result.global_batch}: the {len(result.best)} "
               f"fastest layouts that fit")
    if result.context_note:
        click.echo(result.context_note)
    if model.is_moe:
        click.echo(f"mixture of experts: {result.expert_note} (dp N (ep M): M of the N data-parallel ranks split "
                   f"them); expert load {result.expert_load:.2f}, {result.expert_load_from}; dispatcher "
                   f"{result.dispatcher}")
    click.echo(format_table(["#", "layout", "SP", "ZeRO", "micro-batches", "schedule", "recompute", "step", "MFU",
                             f"GiB per GPU (of {result.capacity / GIB:.1f})"], _rows(result)))
    listed = [candidate for candidate, _, _ in result.best]
    if any(not candidate.reshard_after_forward for candidate in listed):
        click.echo("ZeRO 3 kept: a unit not resharded after its forward (--no-reshard-after-forward), gathered to its "
                   "backward; all step: to its chunk's last backward of the step, gradients reduced once (under "
                   "pipelining, or --sync-grads-once)")
    if any(candidate.shard_group for candidate in listed):
        click.echo("ZeRO Z / N: hybrid sharding (--shard-group N), the states ZeRO-Z shards sharded over N data ranks, "
                   "replicated across the groups, the gradients all-reduced between them")
    click.echo("")
    click.echo(format_table(["why the others lost", "layouts"], _why_rows(result)))
    seconds = sum(result.seconds.values())
    stack = "our executor's overlap" if result.overlap == "executor" else f"the {result.overlap} stack"
    if result.stack_changes:
        stack += " with " + ", ".join(f"{name} {value}" for name, value in result.stack_changes)
    click.echo(f"step times: simulate_step (flash attention, {stack}) for {len(result.simulated):,} of "
               f"the {result.fitting:,} layouts that fit, in increasing order of a lower bound on their step "
               f"(simulator/search/bound.py) until it passed the slowest of the {result.top} best; memory checked for all; "
               f"{seconds:.1f} s")


def _stack_changes(options: dict) -> tuple[tuple[str, object], ...]:
    """What the stack flags change in every candidate's implementation (cli/options/stack.py), checked before the
    search; ZeRO is searched, so --fp8-param-gather keeps the ZeRO candidates only (simulator/search/plan.py)."""
    from simulator.engine.overlap import resolve_overlap

    return tuple(sorted(stack_changes({**options, "zero": None}, resolve_overlap(options["overlap"])).items()))


def _spec(options: dict):
    from simulator.search.sweep import ClusterSpec

    return ClusterSpec.of(_hardware(options), options["gpus_per_node"], options["fabric"], options["topology_kind"],
                          options["nics_per_node"], options["oversubscription"])


@config_file_option
@click.command()
@model_options("gpt3-175b")
@batch_options(None, "Global batch: sequences per step [default: one per GPU].")
@click.option("--gpus", type=int, required=True, help="GPUs in the cluster (whole servers).")
@click.option("--cp", type=int, help="Fix context parallelism (ring) at this size [default: searched: powers of two "
              "whose chunks hold at least 512 tokens].")
@click.option("--ep", type=int, help="Fix a mixture of experts' expert parallelism at this size [default: searched: "
              "every divisor of dp that divides the experts].")
@expert_load_option
@ep_dispatcher_option
@precision_option
@click.option("--overlap", type=click.Choice(list(OVERLAP_PRESETS)), default="executor", show_default=True,
              help="The stack every candidate runs on, as `minigpt simulate --overlap` takes it (executor, "
                   "megatron-2021, overlapped, megatron-core, torchtitan-fsdp2): what hides what, and the stack's own "
                   "implementation; torchtitan-fsdp2 also searches --recompute op where it is described.")
@stack_options
@click.option("--top", type=int, default=5, show_default=True, help="How many of the fastest layouts to print.")
@cluster_options()
@click.option("--plot", type=click.Path(dir_okay=False), help="Draw the listed layouts' step time and memory per GPU "
              "to this PNG.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def plan(**options) -> None:
    """Search tp, sequence parallelism, context parallelism (ring), pp, dp, expert parallelism (a mixture of experts'),
    ZeRO stage (with FSDP's settings: ZeRO-3 kept after the forward or all step, hybrid sharding over a server),
    micro-batch size, schedule and recompute for the fastest layouts that fit in memory, as the simulator
    predicts them, and say why the others lost."""
    from precision.policy import policy as precision_policy
    from cli.tools.plots import draw_plan
    from simulator.search.plan import plan as search

    model = model_from_options(options)
    load, load_from = read_expert_load(options["expert_load"])
    check_cluster_names(options)
    if options["plot"] is not None:
        check_png("--plot", options["plot"], "plan.png")
    for name in ("gpus", "top", "global_batch", "micro_batch_size", "micro_batches", "gpus_per_node",
                 "nics_per_node", "cp", "ep"):
        if options[name] is not None:
            check_positive_int(f"--{name.replace('_', '-')}", options[name])
    if not 1.0 <= options["oversubscription"] < float("inf"):
        raise ConfigError(f"--oversubscription must be a ratio >= 1 (2 for 2:1), got {options['oversubscription']}")
    options["precision"] = simulated_precision(options["precision"], _hardware(options) if options["hardware"] else None)
    precision_policy(options["precision"])
    changes = _stack_changes(options)
    spec = _spec(options)
    with _progress() as tick:
        result = search(model, options["gpus"], spec, options["global_batch"] or options["gpus"],
                        options["precision"], options["top"], options["micro_batch_size"], options["micro_batches"],
                        progress=tick, cp=options["cp"], ep=options["ep"], expert_load=load,
                        dispatcher=options["ep_dispatcher"], overlap=options["overlap"], stack_changes=changes)
    if result.expert_load != load:
        load_from += f"; {load:.3g} capped at the capacity factor {model.capacity_factor:g}"
    result.expert_load_from = load_from
    plot = {"plot": str(draw_plan(result, options["plot"]))} if options["plot"] else {}
    if options["as_json"]:
        click.echo(json.dumps({"model_parameters": model.n_params(), **result.as_dict(), **plot}))
        return
    _print(result)
    if plot:
        click.echo(f"picture: {plot['plot']}")
