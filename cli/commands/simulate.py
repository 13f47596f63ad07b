"""`minigpt simulate`: predict a training step (or a scaling curve) on a cluster we do not have.

Torch-free: it only checks flags and prints what simulator/ predicts. The cluster comes
from flags (--gpu, --gpus-per-node, --nodes, --fabric, --topology-kind) or a topology
file (--topology); --hardware loads a calibrated profile in place of the --gpu preset.
Without --nodes the cluster has exactly the layout's tp x cp x pp x dp GPUs. --cp and --cp-kind
(cli/options/context.py) add context parallelism: each rank computes seq/cp tokens and exchanges keys
and values (simulator/engine/context.py), shown as its own row of the step's breakdown; it needs flash
attention, and a sweep keeps it at the given cp. --ep splits a mixture of experts' experts over ep consecutive
ranks of those routing distinct tokens (dp x cp at each tp place; under --sequence-parallel every rank, tp included,
as Megatron-core folds them: job/exchange/experts.py's expert_places), whose all-to-alls
(simulator/engine/experts.py) are the breakdown's "expert all-to-all" row; one layout only, no sweep; --expert-load
(cli/options/experts.py) prices a routing imbalance, a number or a training run's measured one. How a block is
computed (--attention, --recompute, --sp-saved-input: simulator/costs/ops.py) and what overlaps
what (--overlap PRESET, then --tp-overlap, --dp-overlap, --zero3-prefetch, --p2p-overlap, --ep-overlap:
simulator/engine/overlap.py) are flags too; the output says what its numbers rest on, and which algorithm
each collective runs as NCCL would pick it (--nccl-algo forces one: cli/options/collectives.py). A job beyond
simulator/limits.py's stated size (GPUs, layers, schedule slots, sweep points) is refused in
one line before anything is built. --campaign DAYS (cli/options/campaign.py, simulator/campaign/) runs the
predicted step (each point's, with --sweep) for a whole campaign whose servers fail. --plot FILE.png draws the step's
breakdown (cli/tools/plots.py; with --sweep the scaling curve), and --json carries the model's parameter counts.
"""

from __future__ import annotations

import contextlib
import json
import sys
from dataclasses import replace

import click

from cli.options.cluster import (DEFAULT_GPU, check_cluster_names, check_sweep_flags, cluster_options, dp_from_gpus,
                                 mesh_name)
from cli.options.collectives import check_nccl_algo, nccl_algo_option
from cli.options.config_file import config_file_option
from cli.options.context import context_options
from cli.options.campaign import campaign_options, campaign_sweep, check_campaign, run_campaign
from cli.options.experts import ep_dispatcher_option, ep_overlap_option, expert_load_option, read_expert_load
from cli.options.stack import stack_implementation, stack_options
from cli.options.fsdp import fsdp_options, reshards
from cli.options.batch import batch_options, micro_batch_count, stage_layers_option
from cli.options.model import model_from_options, model_options
from cli.output_file import check_output_file
from cli.tools.plots import check_png
from cli.options.precision import precision_option, simulated_precision

from minigpt.config import ATTENTION_KINDS, SIM_RECOMPUTE_MODES
from minigpt.errors import ConfigError, check_path_given, check_positive_int
from simulator.limits import MAX_ZERO3_GATHERS, check_job, check_layers, check_sweep, zero3_gathers
from simulator.costs.op_types import SP_SAVED_INPUTS, check_cp_attention
from simulator.engine.overlap import DP_MODES, DP_SLOWDOWN, P2P_SLOWDOWN, PRESETS as OVERLAP_PRESETS, TP_SLOWDOWN


def _model(options: dict):
    return model_from_options(options)




def _hardware(options: dict, topology_gpu: str | None = None):
    """--hardware, else --gpu, else the GPU a topology file names, else DEFAULT_GPU."""
    from simulator.costs.hardware import load_hardware

    return load_hardware(options["hardware"] or options["gpu"] or topology_gpu or DEFAULT_GPU)


def _cluster(options: dict, world: int):
    """The cluster and its hardware."""
    from simulator.network.topology import build_cluster, load_cluster, whole_servers

    if options["topology"]:
        if (options["nodes"] or options["gpus_per_node"] or options["fabric"] or options["nics_per_node"]
                or options["oversubscription"] != 1.0):
            raise ConfigError("--topology gives the whole cluster: drop --nodes, --gpus-per-node, --fabric, "
                              "--nics-per-node and --oversubscription")
        cluster = load_cluster(options["topology"])
        return cluster, _hardware(options, cluster.graph.graph.get("gpu"))
    hardware = _hardware(options)
    per_node = options["gpus_per_node"] or hardware.node.gpus_per_node
    nodes = options["nodes"]
    if nodes is None:  # one partly filled server below a server's worth, unless --gpus-per-node says otherwise
        per_node, nodes = whole_servers(world, per_node, f"{mesh_name(options)} x dp = {world} GPUs",
                                        partial=not options["gpus_per_node"])
    return build_cluster(hardware, per_node, nodes, options["fabric"], options["topology_kind"],
                         options["nics_per_node"], options["oversubscription"]), hardware


def _job(options: dict, model, zero: int):
    """The job of a sweep, on the stack the flags name (--overlap and the flags that change one of its settings,
    --attention, --sp-saved-input, the stack's kernel flags: cli/options/stack.py)."""
    from simulator.engine.overlap import stack_default
    from simulator.search.sweep import Job

    overlap = _overlap(options)
    implementation = options["implementation"] or stack_default(overlap, options["attention"], options["recompute"],
                                                                options["sp_saved_input"])
    implementation = replace(implementation, expert_load=options["expert_load"], dispatcher=options["ep_dispatcher"])
    return Job(model, options["precision"], options["global_batch"] or 0, options["micro_batch"], zero,
               options["schedule"], options["virtual_chunks"], options["recompute"], options["sequence_parallel"],
               cp=options["cp"], cp_kind=options["cp_kind"], ep=options["ep"], overlap=overlap,
               implementation=implementation, reshard_after_forward=options["reshard_after_forward"],
               shard_group=options["shard_group"], sync_grads_once=options["sync_grads_once"])


def _overlap(options: dict):
    from simulator.engine.overlap import resolve_overlap

    return resolve_overlap(options["overlap"], tp=options["tp_overlap"], dp=options["dp_overlap"],
                           zero3_prefetch=options["zero3_prefetch"], p2p=options["p2p_overlap"],
                           ep=options["ep_overlap"])


def run_single(options: dict) -> dict:
    from simulator.engine.simulate import simulate_step
    from job.layout import Layout

    model = _model(options)
    layout = Layout(tp=options["tp"] or 1, pp=options["pp"] or 1, dp=options["dp"] or 1, zero=options["zero"],
                    sequence_parallel=options["sequence_parallel"], virtual_chunks=options["virtual_chunks"],
                    cp=options["cp"], cp_kind=options["cp_kind"], shard_group=options["shard_group"],
                    reshard_after_forward=reshards(options, _overlap(options)), ep=options["ep"],
                    sync_grads_once=options["sync_grads_once"], stage_layers=options["stage_layers"])
    layout.check(model)  # the shape's checks (context parallelism's split too), before any cluster is built
    global_batch = options["global_batch"] or options["micro_batch"] * layout.dp * layout.pp
    check_job(model.n_layers, layout.pp, layout.dp, layout.virtual_chunks, global_batch, options["micro_batch"],
              layout.world_size, layout.zero, layout.cp)  # before any cluster or schedule is built
    cluster, hardware = _cluster(options, layout.world_size)
    result = simulate_step(model, layout, cluster, options["precision"], global_batch, options["micro_batch"],
                           options["schedule"], options["virtual_chunks"], options["recompute"], gpu=hardware,
                           attention=options["attention"], overlap=_overlap(options),
                           sp_saved_input=options["sp_saved_input"], nccl_algo=options["nccl_algo"],
                           expert_load=options["expert_load"], ep_dispatcher=options["ep_dispatcher"],
                           userbuffers=options["userbuffers"], implementation=options["implementation"])
    if options["trace"]:
        result.write_chrome_trace(options["trace"])
    report = {"model": model, "result": result, "cluster": cluster.describe(),
              "expert_load_from": options["expert_load_from"]}
    if options["plot"]:
        from cli.tools.plots import draw_step

        report["plot"] = str(draw_step(result, options["plot"]))
    if options["campaign_days"] is not None:
        report["campaign"] = run_campaign(result, options, hardware)
    return report


def run_sweep(options: dict) -> dict:
    from simulator.search.sweep import DEFAULT_THRESHOLD, ClusterSpec, compare_zero, scaling_sweep

    if options["topology"]:
        raise ConfigError("--sweep builds a cluster per GPU count: use --gpu/--gpus-per-node/--fabric, not --topology")
    if options["dp"]:
        raise ConfigError("in a sweep dp follows from the GPU count: drop --dp (fix --tp and --pp, or let the sweep choose)")
    if options["nccl_algo"] != "auto":
        raise ConfigError("--sweep lets NCCL choose every collective's algorithm: drop --nccl-algo, or simulate one "
                          "layout without --sweep")
    if options["stage_layers"]:
        raise ConfigError("--sweep picks each GPU count's pp, and --stage-layers places the blocks of one: drop "
                          "--stage-layers, or simulate one layout without --sweep")
    if options["tp_overlap_cfg"]:
        raise ConfigError("--sweep picks each GPU count's layout, and a userbuffers file describes one tp: drop "
                          "--tp-overlap-cfg, or simulate one layout without --sweep")
    if not options["gpus"]:
        raise ConfigError("--sweep needs the GPU counts: e.g. --gpus 8,16,32,64")
    try:
        counts = [int(n) for n in options["gpus"].split(",") if n.strip()]
    except ValueError:
        raise ConfigError(f"--gpus must be comma-separated whole numbers, got {options['gpus']!r}") from None
    check_sweep(counts)
    model = _model(options)
    check_layers(model.n_layers)
    hardware = _hardware(options)
    spec = ClusterSpec.of(hardware, options["gpus_per_node"], options["fabric"], options["topology_kind"],
                          options["nics_per_node"], options["oversubscription"])
    if not options["global_batch"]:
        raise ConfigError("--sweep needs --global-batch (strong scaling keeps it, weak scaling starts from it)")
    job = _job(options, model, options["zero"])
    threshold = DEFAULT_THRESHOLD if options["threshold"] is None else options["threshold"]
    with _progress(len(counts)) as tick:
        sweep = scaling_sweep(job, counts, spec, options["scaling"], threshold, options["tp"], options["pp"],
                              progress=tick)
    at = sweep.stop or sweep.points[-1]  # where communication starts to decide
    lay = at.result.layout  # ZeRO-3 only where its gathers stay within simulator/limits.py's MAX_ZERO3_GATHERS
    stages = tuple(z for z in range(4) if zero3_gathers(z, lay.dp, at.result.micro_batches, model.n_layers)
                   <= MAX_ZERO3_GATHERS)
    zero = compare_zero(job, lay, spec.build(at.gpus), hardware, at.global_batch, stages) if lay.dp > 1 else {}
    report = {"model": model, "sweep": sweep, "zero": zero, "zero_at": at, "campaign_days": options["campaign_days"]}
    if options["plot"]:
        from simulator.report import plot_sweep

        report["plot"] = str(plot_sweep(sweep, options["plot"]))
    if options["campaign_days"] is not None:
        report["campaign_sweep"] = campaign_sweep(sweep, options, hardware)
    return report


@contextlib.contextmanager
def _progress(total: int):
    """A progress bar on stderr while a sweep runs, when stderr is a terminal; a no-op otherwise."""
    if not sys.stderr.isatty():
        yield lambda done, total: None
        return
    with click.progressbar(length=total, label="simulating", file=sys.stderr) as bar:
        yield lambda done, total: bar.update(1)


def _print_single(report: dict) -> None:
    from cli.output import format_table
    from simulator import report as rep

    model, result = report["model"], report["result"]
    active = f" ({parameter_count(model.active_params())} active)" if model.is_moe else ""
    click.echo(f"{parameter_count(model.n_params())}-parameter GPT{active} ({model.describe()}) on "
               f"{rep.headline(result)}")
    click.echo(f"cluster: {report['cluster']}")
    if model.is_moe:
        click.echo(f"expert load: {result.provenance['experts']['expert_load']:.2f} ({report['expert_load_from']})")
    click.echo("")
    click.echo(format_table(["step", "seconds", "share"], rep.step_rows(result)))
    click.echo(f"(breakdown of the slowest pipeline rank, {result.critical_rank}; it adds up to the step)")
    if result.collectives:
        click.echo("")
        click.echo(format_table(rep.COLLECTIVE_HEADERS, rep.collective_rows(result)))
        click.echo(rep.collective_note(result))
    click.echo("")
    click.echo(format_table([f"memory per GPU (stage {result.memory.stage})", "GiB", ""], rep.memory_rows(result)))
    for line in [rep.memory_why(result)] + [f"note: {note}" for note in result.memory.notes]:
        if line:
            click.echo(line)
    click.echo("")
    click.echo(format_table(["training state of the whole model", "decimal GB (1e9 bytes)"], rep.job_rows(result)))
    click.echo(rep.job_verdict(result, model.n_params()))
    click.echo("")
    click.echo(format_table(["what these numbers rest on", ""], rep.provenance_rows(result)))
    if "campaign" in report:
        from simulator.campaign.report import campaign_rows, campaign_note

        click.echo("")
        click.echo(format_table([f"campaign of {report['campaign']['days']:g} days", "", ""],
                                campaign_rows(report["campaign"])))
        click.echo(campaign_note(report["campaign"]))


def _fsdp_words(sweep) -> str:
    """FSDP's settings of a sweep's points, when any is set (every point has the job's)."""
    layouts = [p.result.layout for p in sweep.points]
    kept = [lay for lay in layouts if not lay.reshard_after_forward]
    words = [f"ZeRO-3 without resharding after the forward at {len(kept)} of {len(layouts)} points"] if kept else []
    words += ["gradients reduced once a step (--sync-grads-once)"] if layouts[0].sync_grads_once else []
    words += [f"hybrid sharding over groups of {layouts[0].shard_group} data ranks"] if layouts[0].shard_group else []
    return "".join(f"; {w}" for w in words)


def _print_sweep(report: dict) -> None:
    from cli.output import format_table
    from simulator import report as rep
    from simulator.search.sweep import zero_verdict

    sweep = report["sweep"]
    stack = _stack(sweep)["overlap"]["name"]
    click.echo(f"{sweep.scaling} scaling of a {parameter_count(report['model'].n_params())}-parameter GPT "
               f"(best layout at each GPU count unless --tp/--pp fix it), overlap {stack}{_fsdp_words(sweep)}")
    click.echo(format_table(rep.SWEEP_HEADERS, rep.sweep_rows(sweep)))
    click.echo(sweep.verdict())
    if report["zero"]:
        best = report["zero_at"]
        lay = best.result.layout
        click.echo("")
        cp = f" x cp {lay.cp}" if lay.cp > 1 else ""
        ep = f" (ep {lay.ep})" if lay.ep > 1 else ""
        click.echo(f"ZeRO stages at {best.gpus} GPUs (tp {lay.tp}{cp} x pp {lay.pp} x dp {lay.dp}{ep}):")
        click.echo(format_table(rep.ZERO_HEADERS, rep.zero_rows(report["zero"])))
        click.echo(zero_verdict(report["zero"]))
    if "campaign_sweep" in report:
        from simulator.campaign.report import SWEEP_HEADERS, campaign_sweep_rows

        with_failures, campaigns = report["campaign_sweep"]
        click.echo("")
        click.echo(f"each point's best layout run for a campaign of {report['campaign_days']:g} days:")
        click.echo(format_table(SWEEP_HEADERS, campaign_sweep_rows(with_failures, campaigns)))
        click.echo(f"with failures, checkpoints and restarts: {with_failures.verdict()}")


def _stack(sweep) -> dict:
    """The overlap and implementation every point of a sweep ran with (its first point's provenance)."""
    provenance = sweep.points[0].result.provenance
    return {"overlap": provenance["overlap"], "implementation": provenance["implementation"]}


def _json(report: dict) -> dict:
    extra = {"plot": report["plot"]} if "plot" in report else {}
    if "result" in report:
        moe = {"expert_load_from": report["expert_load_from"]} if report["model"].is_moe else {}
        campaign = {"campaign": report["campaign"]} if "campaign" in report else {}
        return {**report["result"].as_dict(), "cluster": report["cluster"], **moe, **campaign, **extra}
    from simulator.search.sweep import zero_verdict

    data = {"sweep": report["sweep"].as_dict(), **_stack(report["sweep"]), "parameters": parameter_counts(report["model"]),
            **extra}
    if "campaign_sweep" in report:
        with_failures, campaigns = report["campaign_sweep"]
        data["campaign_sweep"] = {"sweep": with_failures.as_dict(), "campaigns": {str(n): c for n, c in
                                                                                 campaigns.items()}}
    if report["zero"]:
        data["zero_comparison"] = {"gpus": report["zero_at"].gpus, "verdict": zero_verdict(report["zero"]),
                                   "stages": {str(s): r.as_dict() for s, r in report["zero"].items()}}
    return data


def parameter_counts(model) -> dict:
    """The model's parameters (minigpt/config.py): in all, those one token goes through (a mixture of experts' top_k
    experts; all of a dense model's), and by part: what one simulation's report carries (simulator/engine/simulate.py)."""
    return {**model.param_breakdown(), "active": model.active_params()}


def check_paths(options: dict) -> None:
    """The files simulate reads name something, and the ones it writes can be written there (--plot: a PNG), before
    any work; --trace only for one step (a sweep simulates many)."""
    check_cluster_names(options)
    if options["topology"] is not None:
        check_path_given("--topology", options["topology"], "a cluster file's path")
    options["userbuffers"] = None
    if options["tp_overlap_cfg"] is not None:
        from simulator.costs.userbuffers import read_userbuffers

        check_path_given("--tp-overlap-cfg", options["tp_overlap_cfg"], "a YAML or JSON file's path")
        options["userbuffers"] = read_userbuffers(options["tp_overlap_cfg"])
    if options["trace"] is not None and options["sweep"]:
        raise ConfigError("--trace writes the simulated step of one layout, and a sweep simulates many: drop --trace "
                          "(--plot draws the sweep)")
    if options["trace"] is not None:
        check_output_file("--trace", options["trace"], "trace.json")
    if options["plot"] is not None:
        check_png("--plot", options["plot"], "scaling.png" if options["sweep"] else "step.png")


def check_context(options: dict, model) -> None:
    """--cp and --cp-kind, one line each: the split (job/train_config.py) and the attention it needs; --ep and the
    experts (job/train_config.py's check_expert_parallel: a MoE model, E and the ranks routing distinct tokens
    divisible by ep); --expert-load, read into options["expert_load"] and where it comes from
    (cli/options/experts.py, simulator/engine/experts.py's check_expert_load)."""
    from job.train_config import check_context_parallel, check_expert_parallel
    from simulator.engine.experts import check_dispatcher, check_expert_load

    check_context_parallel(model, options["cp"], options["cp_kind"])
    check_cp_attention(options["cp"], options["attention"])
    dp = options["dp"] or (1 if not options["sweep"] else options["ep"])  # a sweep's points check their own dp
    check_expert_parallel(model, options["ep"], dp, options["cp"], options["tp"] or 1, options["sequence_parallel"])
    check_dispatcher(model, options["ep"], options["ep_dispatcher"])
    given, options["expert_load_from"] = read_expert_load(options["expert_load"])
    options["expert_load"] = check_expert_load(model, given)
    if options["expert_load"] != given:
        options["expert_load_from"] += f"; {given:.3g} capped at the capacity factor {model.capacity_factor:g}"


def parameter_count(n: int) -> str:
    """842,496 -> '0.84M', 174,604,259,328 -> '174.6B'."""
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6)):
        if n >= size:
            return f"{n / size:.3g}{unit}" if n < 100 * size else f"{n / size:.1f}{unit}"
    return f"{n / 1e6:.2f}M"


def micro_batch_size(options: dict) -> int:
    """--micro-batch-size, or the global batch over (--micro-batches x dp) of a single run; 1 by default."""
    size, count = options.pop("micro_batch_size"), options.pop("micro_batches")
    if count is None:
        return 1 if size is None else size
    if options["sweep"] or options["global_batch"] is None:
        raise ConfigError("--micro-batches needs a fixed dp and --global-batch; in a sweep (or without a global "
                          "batch) give --micro-batch-size")
    dp = options["dp"] or 1
    for name, value in (("--micro-batches", count), ("--global-batch", options["global_batch"]), ("--dp", dp)):
        check_positive_int(name, value)
    if size is None and options["global_batch"] % (dp * count):
        raise ConfigError(f"--micro-batches {count} x dp {dp} does not divide the global batch "
                          f"{options['global_batch']}: change one of them")
    return options["global_batch"] // (dp * micro_batch_count(options["global_batch"], dp, count, size))


@config_file_option
@click.command()
@model_options("gpt3-175b")
@batch_options(None, "Global batch: sequences per step (default: micro-batch size x dp x pp).")
@click.option("--tp", type=int, help="Tensor-parallel size (default 1; in a sweep: searched).")
@click.option("--pp", type=int, help="Pipeline stages (default 1; in a sweep: searched).")
@click.option("--dp", type=int, help="Data-parallel replicas (default 1).")
@click.option("--zero", type=click.IntRange(0, 3), default=0, show_default=True, help="ZeRO stage.")
@fsdp_options
@click.option("--schedule", default="1f1b", show_default=True, help="gpipe, 1f1b, interleaved or zb-h1.")
@click.option("--virtual-chunks", "virtual_chunks", type=int, default=1, show_default=True)
@stage_layers_option
@click.option("--recompute", type=click.Choice(SIM_RECOMPUTE_MODES), default="none", show_default=True,
              help="Activation recomputation: none, selective (the attention core, Korthikanti et al. 2022), full, "
                   "or op (torchtitan's selective op policy: all but the attention's and every other matmul's "
                   "outputs recomputed; dense bias-free blocks, 16-bit, no tp or cp).")
@click.option("--attention", type=click.Choice(ATTENTION_KINDS), default="flash", show_default=True,
              help="flash (fused, no s x s tensor in memory; its backward recomputes the scores) or unfused "
                   "(scores, softmax and dropout materialised).")
@click.option("--sp-saved-input", "sp_saved_input", type=click.Choice(SP_SAVED_INPUTS), default=None,
              help="With --sequence-parallel, what the column-parallel Linears keep: the gathered input (our "
                   "executor, torchtitan) or its shard, gathered again in the backward (Megatron, Transformer "
                   "Engine) [default: the stack's (--overlap): sharded under megatron-core, gathered "
                   "otherwise].")
@click.option("--overlap", type=click.Choice(list(OVERLAP_PRESETS)), default="executor", show_default=True,
              help="What hides what, and what hiding costs: executor (our code: tp and p2p exposed, dp as our "
                   "ZeRO code, update gathers end the step), megatron-2021 (tp and p2p exposed, dp after the last "
                   "backward), overlapped (a generic modern stack: tp, dp, p2p hidden), megatron-core (TE tp "
                   "overlap, dp reduce-scatter in the backward, param all-gather in the next forward, p2p "
                   "overlapped) or torchtitan-fsdp2 (FSDP2 prefetch 1, reduce-scatter in the backward, no tp "
                   "overlap, async p2p). An overlapped collective slows the compute it hides behind by the share "
                   f"of SMs it holds (tp {TP_SLOWDOWN:.1%}, dp {DP_SLOWDOWN:.1%}, p2p {P2P_SLOWDOWN:.1%}: "
                   "simulator/engine/overlap.py). The flags below (and --ep-overlap) change one setting of it.")
@click.option("--tp-overlap/--no-tp-overlap", "tp_overlap", default=None,
              help="Hide tensor-parallel collectives behind the Linears' GEMMs (default: the preset's).")
@click.option("--tp-overlap-cfg", "tp_overlap_cfg", type=click.Path(dir_okay=False),
              help="Transformer Engine's userbuffers settings for the megatron-core stack: the YAML file Megatron-LM's "
                   "--tp-comm-overlap-cfg reads (.yaml, .yml) or the same as JSON (per overlap: method, num_sm, "
                   "set_sm_margin, num_splits, aggregate). A GEMM with set_sm_margin runs on the SMs its collective leaves; the others' SMs "
                   "set the tp slowdown (simulator/costs/userbuffers.py).")
@click.option("--dp-overlap", "dp_overlap", type=click.Choice(DP_MODES), default=None,
              help="Data-parallel gradient reduction: executor (our ZeRO code), backward (bucket by bucket during "
                   "the backward) or after (after the last backward, not overlapped); default: the preset's.")
@click.option("--zero3-prefetch", "zero3_prefetch", type=click.IntRange(min=0), default=None,
              help="ZeRO-3 units gathered ahead (default: the preset's, 1).")
@click.option("--p2p-overlap/--no-p2p-overlap", "p2p_overlap", default=None,
              help="Asynchronous pipeline sends, receives posted early (default: the preset's).")
@context_options
@click.option("--ep", default=1, show_default=True, type=int,
              help="Expert-parallel size: a mixture of experts' experts split over ep consecutive ranks of those "
                   "routing distinct tokens (dp x cp; x tp under --sequence-parallel); it must divide them and the "
                   "experts.")
@expert_load_option
@ep_overlap_option
@ep_dispatcher_option
@precision_option
@stack_options
@click.option("--sequence-parallel", "sequence_parallel", is_flag=True, help="Megatron sequence parallelism.")
@cluster_options(f"{DEFAULT_GPU}, or a topology file's GPU")
@nccl_algo_option
@click.option("--nodes", type=int, help="Servers (default: as many as the layout needs).")
@click.option("--topology", type=click.Path(dir_okay=False), help="A cluster file (node-link JSON or GraphML).")
@click.option("--trace", type=click.Path(dir_okay=False), help="Write the simulated step as a Chrome trace.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@click.option("--sweep", is_flag=True, help="Sweep GPU counts (--gpus) and name where adding GPUs stops paying.")
@click.option("--scaling", type=click.Choice(["strong", "weak"]), default="strong", show_default=True)
@click.option("--gpus", help="GPUs of the job (dp: them over tp x cp x pp); with --sweep the counts to sweep, "
              "e.g. 8,16,32,64.")
@click.option("--threshold", type=float, help="Marginal efficiency (added GPU / GPU already there) under which "
              "adding GPUs stops paying (default: simulator.search.sweep.DEFAULT_THRESHOLD, half of linear scaling).")
@click.option("--plot", type=click.Path(dir_okay=False), help="Draw one step's breakdown (with --sweep: the scaling "
              "curve) to this PNG.")
@campaign_options
def simulate(**options) -> None:
    """Predict step time, its breakdown, TFLOP/s, MFU and memory per GPU of a training job on a
    simulated cluster; with --sweep, the scaling curve and where adding GPUs stops paying."""
    model = model_from_options(options)  # the model's flags first, each on one line
    dp_from_gpus(options)  # before anything reads dp (--ep's check does)
    check_context(options, model)
    check_paths(options)
    check_nccl_algo(options)
    check_campaign(options)
    check_sweep_flags(options)
    if options["sp_saved_input"] is not None and not options["sequence_parallel"]:
        raise ConfigError("--sp-saved-input says what sequence parallelism's Linears keep: it needs --sequence-parallel")
    options["micro_batch"] = micro_batch_size(options)
    for name in ("global_batch", "micro_batch", "tp", "pp", "dp",
                 "gpus_per_node", "nodes", "nics_per_node"):
        if options[name] is not None:
            check_positive_int(f"--{name.replace('_', '-')}", options[name])
    if not 1.0 <= options["oversubscription"] < float("inf"):
        raise ConfigError(f"--oversubscription must be a ratio >= 1 (2 for 2:1), got {options['oversubscription']}")
    options["precision"] = simulated_precision(options["precision"], _hardware(options) if options["hardware"] else None)
    options["implementation"] = stack_implementation(options, lambda: _overlap(options))
    report = run_sweep(options) if options["sweep"] else run_single(options)
    if options["as_json"]:
        click.echo(json.dumps(_json(report)))
    elif options["sweep"]:
        _print_sweep(report)
    else:
        _print_single(report)
    if "plot" in report and not options["as_json"]:
        click.echo(f"picture: {report['plot']}")
