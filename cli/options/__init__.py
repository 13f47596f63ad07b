"""Flags shared by several commands (batch, cluster, model, precision) and the --config file. Import nothing of
cli/ but each other: commands import them."""

from __future__ import annotations

import click


def typed(name: str) -> bool:
    """Whether the running command's parameter `name` was typed on the command line (not its default, nor a --config
    file's value): a flag that would do nothing in the job at hand is refused only when typed."""
    context = click.get_current_context(silent=True)
    return context is not None and context.get_parameter_source(name) is click.core.ParameterSource.COMMANDLINE
