"""The cluster flags `simulate` and `plan` share: which GPU (a preset or a measured profile) and how its
servers and network are built (simulator/network/topology.py's build_cluster)."""

from __future__ import annotations

from typing import Callable

import click

from cli.options import typed
from minigpt.errors import ConfigError, check_path_given, check_positive_int

DEFAULT_GPU = "a100-80gb"
TOPOLOGY_KINDS = ["fat-tree", "rail", "rail-only"]  # simulator.network.topology.CLUSTER_KINDS (a test checks they agree)
NAMED = {"gpu": "a GPU preset's name", "hardware": "a profile file or a GPU preset's name",
         "fabric": "a network adapter preset's name"}


def cluster_options(gpu_default: str = DEFAULT_GPU) -> Callable:
    """--gpu (its default described by `gpu_default`), --hardware, --gpus-per-node, --fabric, --topology-kind,
    --nics-per-node and --oversubscription."""
    options = [
        click.option("--gpu", help=f"GPU preset of simulator/costs/hardware.json (default: {gpu_default})."),
        click.option("--hardware", help="A hardware profile (JSON file or preset name) in place of --gpu."),
        click.option("--gpus-per-node", "gpus_per_node", type=int, help="GPUs per server (default: the GPU's DGX node)."),
        click.option("--fabric", help="Network adapter preset: hdr or ndr (default: the node's)."),
        click.option("--topology-kind", "topology_kind", type=click.Choice(TOPOLOGY_KINDS), default="fat-tree",
                     show_default=True, help="fat-tree; rail: rail-optimised (NIC i of every node on rail i's "
                     "leaves); rail-only: one tree per rail, no spine between rails (traffic crosses rails over "
                     "NVLink)."),
        click.option("--nics-per-node", "nics_per_node", type=int, help="NICs per server (default: the node's)."),
        click.option("--oversubscription", type=float, default=1.0, show_default=True,
                     help="Leaf oversubscription, e.g. 2 for 2:1 (1: non-blocking)."),
    ]

    def decorate(command: Callable) -> Callable:
        for option in reversed(options):
            command = option(command)
        return command

    return decorate


def check_cluster_names(options: dict) -> None:
    """An empty --gpu, --hardware or --fabric is refused: it would quietly stand for the default."""
    for name, what in NAMED.items():
        if options[name] is not None:
            check_path_given(f"--{name}", options[name], what)


def mesh_name(options: dict) -> str:
    """The model-parallel dimensions a job's flags multiply, as its messages name them (cp only when it is used)."""
    return "tp x cp x pp" if (options["cp"] or 1) > 1 else "tp x pp"


def dp_from_gpus(options: dict) -> None:
    """`minigpt simulate --gpus N` without --sweep: the job's GPU count. It sets dp (N over tp x cp x pp) when --dp
    is not given and must equal tp x cp x pp x dp when it is; one count (a comma-separated list is a sweep's)."""
    given = options["gpus"]
    if given is None or options["sweep"]:
        return
    try:
        gpus = int(given)
    except ValueError:
        raise ConfigError(f"--gpus {given!r}: one run takes one GPU count (a comma-separated list is --sweep's)") \
            from None
    check_positive_int("--gpus", gpus)
    mesh, size = mesh_name(options), (options["tp"] or 1) * (options["cp"] or 1) * (options["pp"] or 1)
    if options["dp"] is None:
        if gpus % size:
            raise ConfigError(f"--gpus {gpus} is not a multiple of {mesh} = {size}: change --gpus or the layout")
        options["dp"] = gpus // size
    elif size * options["dp"] != gpus:
        raise ConfigError(f"--gpus {gpus} but {mesh} x dp = {size * options['dp']}: drop --dp (--gpus sets it) "
                          "or make them agree")


def check_sweep_flags(options: dict) -> None:
    """--threshold and --scaling shape a sweep (--sweep): on one run they would do nothing, so they are refused."""
    if options["sweep"]:
        return
    for name in ("threshold", "scaling"):
        if typed(name):
            raise ConfigError(f"--{name} describes a sweep: add --sweep and its --gpus counts")
