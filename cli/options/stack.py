"""`minigpt simulate`'s flags on how the stack runs its kernels: how it scales its fp8 Linears (--fp8-recipe), whether
it keeps and all-gathers their weights in fp8 (--fp8-param-gather), whether its element-wise ops run fused or as
torchtitan's eager code (--elementwise), the format its gradients are reduced in (--grad-reduce), which fused
attention kernel it runs (--attention-kernel), the documents its attention keeps apart (--document-length) and its
optimizer (--optimizer). Each changes
the stack's Implementation (simulator/costs/implementation.py); a job that cannot run them gets one line before any
work."""

from __future__ import annotations

from typing import Callable

import click

from cli.options.precision import optimizer_option
from minigpt.errors import ConfigError
from simulator.costs.implementation import ATTENTION_KERNELS, FP8_RECIPES

RECIPE_HELP = ("How fp8 Linears are scaled: delayed (per tensor from an amax history, reduced over the amax group "
               "each chunk: Megatron-LM's default), current (per tensor from its own amax, taken before the cast) or "
               "mxfp8 (a scale per 32 elements); default: the stack's (--overlap). current and mxfp8 need fused casts "
               "(megatron-core, torchtitan-fsdp2).")
GATHER_HELP = ("Keep the fp8 Linears' weights in fp8 and all-gather them so, a byte each (Megatron-core's "
               "--fp8-param-gather, NeMo's fp8_params: the weights held in fp8; torchtitan's float8 FSDP all-gather: "
               "the gathered units in fp8). Needs --precision fp8, --zero 1-3 and fused casts (megatron-core, "
               "torchtitan-fsdp2), per-tensor scaling.")


ELEMENTWISE_HELP = ("How the element-wise ops (norms, rotary positions, SwiGLU, the loss) run: fused (one kernel "
                    "each: torch.compile, Transformer Engine's kernels, every stack but torchtitan's by default) or "
                    "eager (torchtitan's model code in eager PyTorch, one kernel per aten op: RMSNorm through an fp32 "
                    "copy, RoPE as complex multiplies, grouped-query keys and values copied to every head; "
                    "--overlap torchtitan-fsdp2 only, its default: torchtitan's training.compile = false).")


REDUCE_HELP = ("The format gradients travel in between data-parallel ranks: compute (the precision's: bf16 for bf16 "
               "training, as our executor and Megatron-core by default) or fp32 (FSDP2's reduce_dtype float32: the "
               "torchtitan-fsdp2 preset's default; Megatron-core's --accumulate-allreduce-grads-in-fp32) [default: "
               "the stack's].")


KERNEL_HELP = ("Which fused kernel runs --attention flash, priced by its published H100 table: flash-attn-2 "
               "(FlashAttention-2: torch's SDPA, torchtitan, Transformer Engine with NVTE_FUSED_ATTN=0), cudnn "
               "(cuDNN's fused attention: Transformer Engine's FusedAttention) or te (as Transformer Engine picks: "
               "cudnn on the Hopper presets, flash-attn-2 elsewhere) [default: the stack's (--overlap): te under "
               "megatron-core, flash-attn-2 otherwise]; the same saved tensors either way.")


MODULES_HELP = ("Megatron-core's --recompute-modules beside --recompute none or selective, apart by commas: "
                "layernorm (the block's two norms), moe_act (a mixture of experts' activation), mla_up_proj (latent "
                "attention's up projections), core_attn (the attention core, as --recompute selective); each "
                "module's output freed once read and computed again in the backward [default: none].")


DOCUMENTS_HELP = ("Price a document mask (Llama 3's, `minigpt train --document-mask`): the mean length in tokens of "
                  "the documents packed in each sequence, their ends independent; the attention kernel skips the tiles "
                  "between documents (FlashAttention-2's variable-length kernels, FlexAttention's block masks) "
                  "[default: 0, the causal mask].")


def stack_options(function):
    """--fp8-recipe, --fp8-param-gather, --elementwise, --grad-reduce, --attention-kernel, --recompute-modules,
    --document-length and --optimizer."""
    function = optimizer_option(None)(function)
    function = click.option("--document-length", "document_length", type=int, default=None, metavar="TOKENS",
                            help=DOCUMENTS_HELP)(function)
    function = click.option("--recompute-modules", "recompute_modules", metavar="MODULE[,MODULE...]", default=None,
                            help=MODULES_HELP)(function)
    function = click.option("--attention-kernel", "attention_kernel", type=click.Choice(ATTENTION_KERNELS),
                            default=None, help=KERNEL_HELP)(function)
    function = click.option("--grad-reduce", "grad_reduce", type=click.Choice(("compute", "fp32")), default=None,
                            help=REDUCE_HELP)(function)
    function = click.option("--elementwise", type=click.Choice(("fused", "eager")), default=None,
                            help=ELEMENTWISE_HELP)(function)
    function = click.option("--fp8-param-gather", "fp8_param_gather", is_flag=True, help=GATHER_HELP)(function)
    return click.option("--fp8-recipe", "fp8_recipe", type=click.Choice(tuple(FP8_RECIPES)), default=None,
                        help=RECIPE_HELP)(function)


def _fp8_flag(options: dict) -> str | None:
    """The fp8 flag given, as typed (--fp8-recipe, else --fp8-param-gather), or None."""
    if options["fp8_recipe"] is not None:
        return f"--fp8-recipe {options['fp8_recipe']}"
    return "--fp8-param-gather" if options["fp8_param_gather"] else None


def asked_flags(options: dict) -> list[str]:
    """The stack flags given, as typed (none: the stack's own choices)."""
    named = {"--elementwise": options["elementwise"], "--grad-reduce": options["grad_reduce"],
             "--attention-kernel": options["attention_kernel"], "--recompute-modules": options.get("recompute_modules"),
             "--document-length": options.get("document_length"), "--optimizer": options.get("optimizer")}
    return [flag for flag in (_fp8_flag(options), *(f"{name} {value}" for name, value in named.items()
                                                    if value is not None and value != "")) if flag]


def stack_changes(options: dict, overlap, base=None) -> dict:
    """The Implementation fields the stack flags change under `overlap` (a resolved Overlap) over `base` (its
    Implementation; None: the stack's with flash attention, no recompute): fp8 scaling and weights (--fp8-recipe,
    --fp8-param-gather), element-wise kernels (--elementwise), the reductions' format (--grad-reduce) and the fused
    attention kernel (--attention-kernel); empty when none is given. One line, before any work, when the job or its
    stack cannot run them that way (options["zero"] None: searched, as by plan)."""
    recipe, gather = options["fp8_recipe"], options["fp8_param_gather"]
    elementwise, reduce, kernel = options["elementwise"], options["grad_reduce"], options["attention_kernel"]
    fp8_flag = _fp8_flag(options)
    if fp8_flag and options["precision"] != "fp8":
        raise ConfigError(f"{fp8_flag} says how fp8 Linears run: it needs --precision fp8")
    if gather and options.get("zero") == 0:
        raise ConfigError("--fp8-param-gather all-gathers the weights in fp8: it needs ZeRO (--zero 1-3: Megatron's "
                          "distributed optimizer, FSDP)")
    if elementwise == "eager" and overlap.preset != "torchtitan-fsdp2":
        raise ConfigError(f"--elementwise eager describes torchtitan's model code in eager PyTorch: it needs --overlap "
                          f"torchtitan-fsdp2 (the {overlap.name} stack's element-wise ops are its own kernels)")
    from dataclasses import replace

    from simulator.engine.overlap import stack_default

    base = base or stack_default(overlap, "flash", "none")
    changes = _fp8_changes(base, fp8_flag, recipe, gather, overlap.name) if fp8_flag else {}
    if elementwise is not None:
        changes["eager"] = elementwise == "eager"
    if reduce is not None:
        changes["grad_reduce_fp32"] = reduce == "fp32"
    if kernel is not None:
        changes["attention_kernel"] = kernel
    if options.get("recompute_modules"):
        changes["recompute_modules"] = tuple(m.strip() for m in str(options["recompute_modules"]).split(","))
    if options.get("document_length") is not None:
        changes["document_length"] = options["document_length"]
    if options.get("optimizer") is not None:
        changes["optimizer"] = options["optimizer"]
    replace(base, **changes)  # the Implementation's own checks, one line each
    return changes


def stack_implementation(options: dict, overlap_of: Callable):
    """The stack's Implementation with what the stack flags change (stack_changes), or None when none is given (the
    stack's own); `overlap_of()` resolves the stack, once."""
    if not asked_flags(options):
        return None
    from dataclasses import replace

    from simulator.engine.overlap import stack_default

    overlap = overlap_of()
    implementation = stack_default(overlap, options["attention"], options["recompute"], options["sp_saved_input"])
    return replace(implementation, **stack_changes(options, overlap, implementation))


def _fp8_changes(implementation, flag: str, recipe: str | None, gather: bool, stack: str) -> dict:
    """The fp8 fields of `implementation` scaling its fp8 Linears by `recipe` (None: the stack's) and keeping their
    weights in fp8 when `gather`, or one line when the stack cannot."""
    scaling = FP8_RECIPES[recipe] if recipe is not None else implementation.fp8_scaling
    if (scaling != "tensor" or gather) and not implementation.fp8_fused_casts:
        raise ConfigError(f"{flag} needs fused fp8 casts (Transformer Engine's: --overlap megatron-core; torchao's: "
                          f"torchtitan-fsdp2); the {stack} stack scales from an amax history and gathers its "
                          f"weights in the compute format")
    if gather and scaling == "block":
        raise ConfigError("--fp8-param-gather is modelled for per-tensor scaling only (--fp8-recipe delayed or "
                          "current): MXFP8's transposed copy is quantised again from the 16-bit weights")
    return {"fp8_scaling": scaling, "fp8_param_gather": gather}
