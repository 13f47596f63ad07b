"""The batch flags, one vocabulary for `train`, `simulate`, `compare` and `plan`.

--global-batch (alias --batch-size): sequences per optimizer step, over every data-parallel replica.
--micro-batches: how many micro-batches each replica accumulates in a step.
--micro-batch-size (alias --micro-batch): sequences in one micro-batch on one replica.
Either of the last two sets the other: global batch = micro-batches x micro-batch size x dp.
--stage-layers: the blocks of each pipeline chunk (Megatron's pipeline_model_parallel_layout, torchtitan's layers
per stage), e.g. 5,4*6,3 for 8 chunks; by default the blocks are split evenly (job/schedule.py's chunk_layers).
"""

from __future__ import annotations

from typing import Callable

import click

from minigpt.errors import ConfigError, check_positive_int


def batch_options(global_default: int | None, global_help: str) -> Callable:
    options = [
        click.option("--global-batch", "--batch-size", "global_batch", type=int, default=global_default,
                     show_default=global_default is not None, help=global_help),
        click.option("--micro-batches", "micro_batches", type=int,
                     help="Micro-batches each data-parallel replica accumulates per step [default: 1, or what "
                          "--micro-batch-size makes it]."),
        click.option("--micro-batch-size", "--micro-batch", "micro_batch_size", type=int,
                     help="Sequences per micro-batch on one replica (sets --micro-batches: global batch / "
                          "(size x dp))."),
    ]

    def decorate(command: Callable) -> Callable:
        for option in reversed(options):
            command = option(command)
        return command

    return decorate


STAGE_LAYERS_HELP = ("Blocks of each pipeline chunk, in global chunk order (pp x virtual chunks of them; N*K "
                     "repeats N K times), e.g. 4,4*14,1: Megatron's pipeline layout. Only the first and last chunk "
                     "may hold none. [default: as even as the layers allow]")


def stage_layers_value(ctx, param, value: str | None) -> tuple[int, ...]:
    """--stage-layers as TrainConfig and Layout take it: () when not given; 'N*K' stands for K chunks of N blocks.
    The count per chunk and the sum are checked against the model by job/schedule.py's check_stage_layers."""
    if value is None:
        return ()
    sizes: list[int] = []
    for item in value.split(","):
        count, _, times = item.strip().partition("*")
        try:
            blocks, repeat = int(count), int(times) if times else 1
        except ValueError:
            raise ConfigError(f"--stage-layers takes whole numbers of blocks, as 4,4*14,1; got {value!r}") from None
        if blocks < 0 or not 1 <= repeat <= 100_000:
            raise ConfigError(f"--stage-layers takes blocks >= 0 and repeats from 1 to 100,000, got {item.strip()!r}")
        sizes += [blocks] * repeat
    return tuple(sizes)


def stage_layers_option(command: Callable) -> Callable:
    return click.option("--stage-layers", "stage_layers", default=None, metavar="N,N,...",
                        callback=stage_layers_value, help=STAGE_LAYERS_HELP)(command)


def micro_batch_count(global_batch: int, dp: int, count: int | None, size: int | None) -> int:
    """The micro-batches per replica the flags ask for: --micro-batches, or the global batch over
    (--micro-batch-size x dp); one line (ConfigError) when they disagree or do not divide."""
    for name, value in (("--global-batch", global_batch), ("--micro-batches", count), ("--micro-batch-size", size)):
        if value is not None:
            check_positive_int(name, value)
    if size is None:
        return 1 if count is None else count
    per_replica = global_batch // dp if dp > 0 and global_batch % dp == 0 else None
    if per_replica is None or per_replica % size:
        raise ConfigError(f"--micro-batch-size {size} does not divide the global batch {global_batch} over dp {dp} "
                          f"({global_batch / dp:g} sequences per replica): change one of them")
    if count is not None and count * size != per_replica:
        raise ConfigError(f"--micro-batches {count} x --micro-batch-size {size} is not the {per_replica} sequences "
                          f"per replica (global batch {global_batch} over dp {dp}): give one of the two")
    return per_replica // size
