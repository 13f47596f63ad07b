"""The context-parallel flags, one vocabulary for `train`, `simulate`, `compare`, `plan` and `calibrate`.

--cp N: context-parallel size. Every sequence is cut into 2 x N equal chunks and rank i of the group holds
chunks i and 2N-1-i (the load-balanced causal split of Megatron-core, torchtitan and Llama 3), so each rank
computes 1/N of every layer's tokens. Its own mesh dimension, between data and tensor parallelism:
tp x cp adjacent ranks form a model replica's slice of a stage, so a cp group stays on a server's NVLink
while tp x cp fits in it and spans servers beyond. Weight gradients are averaged over cp x dp.
--cp-kind: how keys and values travel. ring: each layer passes key/value blocks around the group with p2p,
overlapped with the block at hand (the backward sends dK/dV back the same way); allgather: each layer
gathers the whole sequence's keys and values once (Llama 3's choice with grouped-query attention).
"""

from __future__ import annotations

import functools
from typing import Callable

import click

from cli.options import typed
from job.train_config import CP_KINDS
from minigpt.errors import ConfigError

CP_HELP = ("Context-parallel size: each rank holds 2 of 2 x cp chunks of every sequence. Mesh order pp, dp, "
           "cp, tp (tp innermost): a cp group lies within tp x cp adjacent ranks, inside one server while tp x cp "
           "fits in it; dp and pp span servers.")
CP_KIND_HELP = "How keys and values travel between context-parallel ranks: ring (p2p, overlapped) or allgather."


def context_options(command: Callable) -> Callable:
    """--cp and --cp-kind (the kind is checked by job/train_config.py's check_context_parallel, one line; given
    without context parallelism it is refused, where it would do nothing)."""

    @functools.wraps(command)
    def checked(*args, **kwargs):
        if typed("cp_kind") and kwargs.get("cp") == 1:
            raise ConfigError("--cp-kind says how context-parallel ranks exchange keys and values: it needs --cp 2 "
                              "or more")
        return command(*args, **kwargs)

    with_kind = click.option("--cp-kind", "cp_kind", default="ring", show_default=True, metavar="|".join(CP_KINDS),
                             help=CP_KIND_HELP)(checked)
    return click.option("--cp", "cp", default=1, show_default=True, type=int, help=CP_HELP)(with_kind)
