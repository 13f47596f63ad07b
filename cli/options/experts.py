"""The mixture-of-experts flags of `simulate` and `plan`: --ep, --expert-load and (simulate) --ep-overlap and
--ep-dispatcher.

--ep N: expert-parallel size (simulate: the layout's, default 1; plan: fixes it, default searched).
--expert-load X: the routing imbalance the simulator prices (simulator/engine/experts.py), either a number >= 1 (the
busiest expert's routed rows over the mean; 1.0, the default: balanced) or a training run's summary.json (or its run
directory), whose expert_load section (parallel/run/expert_load.py) gives each MoE layer's measured max_over_mean:
the load taken is their mean over the layers (every layer's all-to-alls are synchronous, so a step waits for each
layer's own busiest rank: the sum over layers of their loads, which the mean spreads evenly over them).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Callable

import click

from minigpt.errors import ConfigError

ROUNDING = 1e-9  # a balanced layer's max_over_mean may come out a rounding below 1
EXPERT_LOAD_HELP = ("A mixture of experts' routing imbalance: the busiest expert's routed rows over the mean (a number "
                    ">= 1; 1.0: balanced), or a training run's summary.json (or run directory), whose measured "
                    "max_over_mean per MoE layer is averaged over the layers. Priced on the busiest rank of each "
                    "expert group: its experts' GEMMs and its all-to-alls grow by it (at most ep times); the step "
                    "waits for it.  [default: 1.0]")


def expert_load_option(command: Callable) -> Callable:
    return click.option("--expert-load", "expert_load", metavar="X|SUMMARY.JSON", help=EXPERT_LOAD_HELP)(command)


def ep_dispatcher_option(command: Callable) -> Callable:
    """--ep-dispatcher: simulator/costs/implementation.py's Implementation.dispatcher."""
    from simulator.costs.implementation import DISPATCHERS

    return click.option("--ep-dispatcher", "ep_dispatcher", type=click.Choice(DISPATCHERS), default="alltoall",
                        show_default=True,
                        help="How the experts' rows travel: alltoall, a copy of every routed row to its expert's rank "
                             "(our trainer, Megatron-core's alltoall dispatcher); deepep, each token once per "
                             "destination server over the NICs and rank over NVLink (DeepEP's normal kernels, "
                             "Megatron-core's flex dispatcher).")(command)


def ep_overlap_option(command: Callable) -> Callable:
    """--ep-overlap/--no-ep-overlap: simulator/engine/overlap.py's Overlap.ep (default: the --overlap preset's)."""
    return click.option("--ep-overlap/--no-ep-overlap", "ep_overlap", default=None,
                        help="Hide the experts' dispatch and combine all-to-alls behind the shared experts, run "
                             "beside them (Megatron-core's moe_shared_expert_overlap); default: the preset's (on "
                             "in overlapped only).")(command)


def _number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


def _layer_loads(data: object, where: str) -> dict[str, float]:
    """Each MoE layer's max_over_mean from a summary's expert_load section; one line on anything else."""
    section = data.get("expert_load") if isinstance(data, dict) else None
    layers = section.get("layers") if isinstance(section, dict) else None
    if not isinstance(layers, dict) or not layers:
        raise ConfigError(f"--expert-load {where} has no expert_load per layer: give the summary.json of a training "
                          f"run of a mixture of experts (minigpt train writes it there), or a number >= 1")
    loads = {}
    for layer, entry in layers.items():
        value = entry.get("max_over_mean") if isinstance(entry, dict) else None
        if isinstance(value, float) and 1 - ROUNDING <= value < 1:  # max(shares) x E, rounded below the mean
            value = 1.0
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 1 <= value < math.inf:
            raise ConfigError(f"--expert-load {where}: layer {layer}'s max_over_mean is {value!r}, not a finite number "
                              f">= 1 (no routed choices counted?): give another run's summary or a number")
        loads[layer] = float(value)
    return loads


def read_expert_load(value: str | None) -> tuple[float, str]:
    """(the load, where it comes from) for --expert-load: None is 1.0, balanced; a number is itself; anything else is
    the path of a summary.json (or of the run directory holding it), its layers' mean max_over_mean."""
    from simulator.json_file import read_json_file

    if value is None:
        return 1.0, "balanced (the default)"
    number = _number(value)
    if number is not None:
        if not 1 <= number < math.inf:
            raise ConfigError(f"--expert-load must be a finite number >= 1 (the busiest expert's routed rows over the "
                              f"mean; 1: balanced) or a run's summary.json, got {value}")
        return number, "given"
    path = Path(value)
    if path.is_dir():
        path = path / "summary.json"
    loads = _layer_loads(read_json_file(path, "--expert-load summary"), repr(str(path)))
    load = sum(loads.values()) / len(loads)
    return load, (f"the mean of the measured max_over_mean over {len(loads)} MoE layer{'s' * (len(loads) > 1)} "
                  f"({min(loads.values()):.3g} to {max(loads.values()):.3g}) of {str(path)!r}")
