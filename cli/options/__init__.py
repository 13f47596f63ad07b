"""Flags shared by several commands (batch, cluster, model, precision) and the --config file. Import nothing of
cli/ but each other: commands import them."""

from __future__ import annotations

import click


def typed(name: str) -> bool:
    """Whether the running command's parameter `name` was typed on the command line (not its default, nor a --config
    file's value): a flag that would do nothing in the job at hand is refused only when typed."""
    context = click.get_current_context(silent=True)
    return context is not None and context.get_parameter_source(name) is click.core.ParameterSource.COMMANDLINE


def flag(name: str) -> str:
    """The running command's option `name` as it was typed: its click spelling (the --no-... one of an on/off pair
    when it was turned off), for a message that names it."""
    context = click.get_current_context()
    param = next(p for p in context.command.params if p.name == name)
    off = getattr(param, "secondary_opts", None) and context.params.get(name) is False
    return (param.secondary_opts if off else param.opts)[0]
