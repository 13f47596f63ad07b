"""`minigpt simulate`'s fp8 flags: how the stack scales its fp8 Linears (--fp8-recipe) and whether it keeps and
all-gathers their weights in fp8 (--fp8-param-gather). Both change the stack's Implementation
(simulator/costs/implementation.py); a job that cannot run them gets one line before any work."""

from __future__ import annotations

from typing import Callable

import click

from minigpt.errors import ConfigError
from simulator.costs.implementation import FP8_RECIPES

RECIPE_HELP = ("How fp8 Linears are scaled: delayed (per tensor from an amax history, reduced over the amax group "
               "each chunk: Megatron-LM's default), current (per tensor from its own amax, taken before the cast) or "
               "mxfp8 (a scale per 32 elements); default: the stack's (--overlap). current and mxfp8 need fused casts "
               "(megatron-core, torchtitan-fsdp2).")
GATHER_HELP = ("Keep the fp8 Linears' weights in fp8 and all-gather them so, a byte each (Megatron-core's "
               "--fp8-param-gather, NeMo's fp8_params: the weights held in fp8; torchtitan's float8 FSDP all-gather: "
               "the gathered units in fp8). Needs --precision fp8, --zero 1-3 and fused casts (megatron-core, "
               "torchtitan-fsdp2), per-tensor scaling.")


def fp8_options(function):
    """--fp8-recipe and --fp8-param-gather."""
    function = click.option("--fp8-param-gather", "fp8_param_gather", is_flag=True, help=GATHER_HELP)(function)
    return click.option("--fp8-recipe", "fp8_recipe", type=click.Choice(tuple(FP8_RECIPES)), default=None,
                        help=RECIPE_HELP)(function)


def fp8_implementation(options: dict, overlap_of: Callable):
    """The stack's Implementation with its fp8 scaling (--fp8-recipe) and weights (--fp8-param-gather) as asked
    (None: neither asked, the stack's own); `overlap_of()` resolves the stack. One line, before any work, when the
    job has no fp8 Linears or its stack cannot run them that way."""
    recipe, gather = options["fp8_recipe"], options["fp8_param_gather"]
    if recipe is None and not gather:
        return None
    flag = f"--fp8-recipe {recipe}" if recipe is not None else "--fp8-param-gather"
    if options["precision"] != "fp8":
        raise ConfigError(f"{flag} says how fp8 Linears run: it needs --precision fp8")
    if options["sweep"]:
        raise ConfigError(f"--sweep simulates our executor, which scales fp8 from an amax history and gathers its "
                          f"weights in the compute format: drop {flag}, or simulate one layout without --sweep")
    if gather and options["zero"] == 0:
        raise ConfigError("--fp8-param-gather all-gathers the weights in fp8: it needs ZeRO (--zero 1-3: Megatron's "
                          "distributed optimizer, FSDP)")
    from dataclasses import replace

    from simulator.engine.overlap import stack_default

    overlap = overlap_of()
    implementation = stack_default(overlap, options["attention"], options["recompute"], options["sp_saved_input"])
    scaling = FP8_RECIPES[recipe] if recipe is not None else implementation.fp8_scaling
    if (scaling != "tensor" or gather) and not implementation.fp8_fused_casts:
        raise ConfigError(f"{flag} needs fused fp8 casts (Transformer Engine's: --overlap megatron-core; torchao's: "
                          f"torchtitan-fsdp2); the {overlap.name} stack scales from an amax history and gathers its "
                          f"weights in the compute format")
    if gather and scaling == "block":
        raise ConfigError("--fp8-param-gather is modelled for per-tensor scaling only (--fp8-recipe delayed or "
                          "current): MXFP8's transposed copy is quantised again from the 16-bit weights")
    return replace(implementation, fp8_scaling=scaling, fp8_param_gather=gather)
