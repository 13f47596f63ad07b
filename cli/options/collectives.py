"""--nccl-algo: which algorithm NCCL runs each collective with, as the NCCL_ALGO environment variable forces it.

auto (the default): every collective call takes the algorithm and protocol NCCL's tuner would pick, the
fastest by the cost model of simulator/network/nccl.py (ring, tree, nvls, nvlstree, collnet, with the
published figures of simulator/network/nccl.json). A named algorithm is used wherever it can run (NVLS
inside one NVSwitch-3 server, trees across servers, all-reduce only but for the ring, collnet where the
fabric reduces in the network) and the ring elsewhere, said so in the output's collectives table.
"""

from __future__ import annotations

from typing import Callable

import click

from minigpt.errors import ConfigError

NCCL_ALGOS = ("auto", "ring", "tree", "nvls", "nvlstree", "collnet")  # simulator.network.nccl.CHOICES (a test checks)
NCCL_ALGO_HELP = ("Collective algorithm, as NCCL_ALGO: auto (the fastest by NCCL's cost model, per call), ring, tree, "
                  "nvls, nvlstree or collnet (used where it can run, the ring elsewhere).")


def nccl_algo_option(command: Callable) -> Callable:
    """--nccl-algo, checked by `check_nccl_algo` (one line and exit 2 on a bad value, not click's usage text)."""
    return click.option("--nccl-algo", "nccl_algo", default="auto", show_default=True, metavar="|".join(NCCL_ALGOS),
                        help=NCCL_ALGO_HELP)(command)


def check_nccl_algo(options: dict) -> str:
    """The --nccl-algo value in lower case; ConfigError (one line, exit 2) when it names no algorithm."""
    value = options.get("nccl_algo") or "auto"
    if value.lower() not in NCCL_ALGOS:
        raise ConfigError(f"--nccl-algo must be one of {', '.join(NCCL_ALGOS)} (as NCCL_ALGO), got {value!r}")
    options["nccl_algo"] = value.lower()
    return options["nccl_algo"]
