"""`--config FILE.toml`: a command's flags as a TOML file; flags on the command line override it.

Keys are the flags' names, with dashes or underscores (`batch-size = 32` or
`batch_size = 32`). An unknown key, a malformed file or a missing one is bad input:
one line, exit code 2, before any work starts.
"""

from __future__ import annotations

import sys
from pathlib import Path

import click

from minigpt.errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib


def read_config_file(path: str, command: click.Command) -> dict:
    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"--config {path!r} does not exist or is not a file")
    try:
        data = tomllib.loads(file.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as error:
        raise ConfigError(f"--config {path!r} is not valid TOML: {' '.join(str(error).split())}") from None
    names = {param.name for param in command.params if param.name not in ("config", "help")}
    values = {}
    for key, value in data.items():
        name = key.replace("-", "_")
        if name == "json":
            name = "as_json"
        if name not in names or isinstance(value, (dict, list)):
            valid = ", ".join(sorted(("json" if n == "as_json" else n).replace("_", "-") for n in names))
            raise ConfigError(f"--config {path!r}: unknown or non-scalar key {key!r}; the keys are the flags: {valid}")
        values[name] = value
    return values


def config_file_option(command: click.Command) -> click.Command:
    """Add --config to a click command (apply it last, on top of the other options)."""

    def load(ctx: click.Context, param: click.Parameter, value: str | None) -> None:
        if value is not None:
            ctx.default_map = {**(ctx.default_map or {}), **read_config_file(value, ctx.command)}

    option = click.Option(
        ["--config"], type=str, is_eager=True, expose_value=False, callback=load,
        help="A TOML file of this command's flags; flags given here override it.",
    )
    command.params.insert(0, option)
    return command
