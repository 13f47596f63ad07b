"""FSDP's settings as today's stacks run them, one vocabulary for `train`, `simulate` and `compare`.

--no-reshard-after-forward (with --zero 3): a unit's gathered weights stay from its forward to its backward of
the same micro-batch (torch FSDP2's reshard_after_forward=False), so the backward gathers nothing, and its
gradients are reduce-scattered after every micro-batch; under pipelining a unit is gathered once and kept until
the chunk's last backward of the step, its gradients summed over the micro-batches and reduce-scattered once, as
torchtitan does on torch's pipelining. Fewer gathers, more memory.
--sync-grads-once (with both): the same without pipelining, as FSDP2's set_requires_gradient_sync(False) and
set_reshard_after_backward(False) between micro-batches (NeMo Automodel's enable_fsdp_optimizations).
--shard-group N (hybrid sharding, HSDP): ZeRO shards over groups of N consecutive data ranks (dp x cp, in
mesh order: on one server while N x tp fits in it), whole replicas across the groups; gradients are
reduce-scattered inside a group, then all-reduced across the groups; weights are gathered inside a group.
job/train_config.py's check_sharding checks both, in one line.
"""

from __future__ import annotations

from typing import Callable

import click

from minigpt.errors import check_positive_int

RESHARD_HELP = ("ZeRO-3: free a unit's gathered weights after its forward and gather them again for its backward, "
                "or keep them until the backward (under pipelining: until the chunk's last backward of the step, as "
                "torchtitan); --no-reshard-after-forward needs --zero 3. [default: reshard; simulate "
                "under --overlap torchtitan-fsdp2 with --pp > 1: not, torchtitan's own default]")
SYNC_HELP = ("ZeRO-3 without resharding after the forward: keep every unit gathered all step, sum its gradients over "
             "the micro-batches and reduce-scatter them once, after its last backward (FSDP2's gradient sync off "
             "between micro-batches; implied under pipelining); needs --zero 3 --no-reshard-after-forward.")
SHARD_GROUP_HELP = ("Hybrid sharding (HSDP): ZeRO shards over groups of N consecutive data ranks, replicated across "
                    "the groups (gradients reduce-scattered in a group, then all-reduced across); N divides dp x cp "
                    "[default: all of them].")


def shard_group_value(ctx, param, value: int | None) -> int:
    """--shard-group N as TrainConfig and Layout take it: 0 when not given (every data rank)."""
    return 0 if value is None else check_positive_int("--shard-group", value)


def fsdp_options(command: Callable) -> Callable:
    """--shard-group, --reshard-after-forward/--no-reshard-after-forward and --sync-grads-once."""
    command = click.option("--sync-grads-once", "sync_grads_once", is_flag=True, default=False,
                           help=SYNC_HELP)(command)
    command = click.option("--shard-group", "shard_group", type=int, default=None, metavar="N",
                           callback=shard_group_value, help=SHARD_GROUP_HELP)(command)
    return click.option("--reshard-after-forward/--no-reshard-after-forward", "reshard_after_forward", default=None,
                        help=RESHARD_HELP)(command)


def reshards(options: dict, overlap=None) -> bool:
    """The run's ZeRO-3 reshard after the forward: as given, else the stack's default (simulator/engine/overlap.py's
    stack_reshards: torchtitan's does not under pipelining; `overlap` None, our executor's: it does)."""
    from simulator.engine.overlap import reshards as stack_or_given

    return stack_or_given(options.get("reshard_after_forward"), options.get("zero"), overlap, options.get("pp") or 1)
