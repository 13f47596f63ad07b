"""`--config FILE.toml`: a command's flags as a TOML file; flags on the command line override it.

Keys are the flags' names, with dashes or underscores (`batch-size = 32` or
`batch_size = 32`). One file serves every command: top-level keys go to each command that takes
them (a command skips the others' flags and names them once on stderr), and a table named after a
command (`[simulate]`, `[train]`) gives that command its own values over them. Each value has its flag's type: an integer flag takes a TOML integer, a
number flag an integer or a finite float, an on/off flag true or false, any other flag a string
(or a number, read as its text). An unknown key, a value of the wrong type (a date, a float or a
boolean where an integer belongs, inf or nan), a malformed file or a missing one is bad input:
one line, exit code 2, before any work starts, whatever the file's bytes (tests/test_fuzz_parsers.py).
"""

from __future__ import annotations

import datetime
import math
import sys
from pathlib import Path

import click

from minigpt.errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib


MAX_CONFIG_BYTES = 2**20  # a file of flags; TOML's reader recurses, so nothing larger is read


def _read_toml(path: str) -> dict:
    """The TOML document at `path`, or ConfigError naming the file, whatever its bytes."""
    try:
        file = Path(path)
        if not file.is_file():
            raise ConfigError(f"--config {path!r} does not exist or is not a file")
        if file.stat().st_size > MAX_CONFIG_BYTES:
            raise ConfigError(f"--config {path!r} has more than {MAX_CONFIG_BYTES:,} bytes: it holds flags, keep it short")
        text = file.read_bytes().decode("utf-8")
    except ConfigError:
        raise
    except UnicodeDecodeError as error:
        raise ConfigError(f"--config {path!r} is not valid TOML: not UTF-8 (byte {error.start})") from None
    except (OSError, ValueError) as error:  # unreadable, or a name the file system refuses
        raise ConfigError(f"cannot read --config {path!r}: {getattr(error, 'strerror', None) or error}") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as error:
        raise ConfigError(f"--config {path!r} is not valid TOML: {' '.join(str(error).split())}") from None
    except RecursionError:
        raise ConfigError(f"--config {path!r} is nested too deeply: its keys are flags, with plain values") from None
    except ValueError as error:  # an integer of thousands of digits
        raise ConfigError(f"--config {path!r} is not valid TOML: {' '.join(str(error).split())[:200]}") from None


def value_kind(param: click.Parameter) -> str:
    """What a TOML value for this flag must be: "flag", "integer", "number", "text" (a string or a
    number, as on the command line) or "name" (a choice or a path: a string)."""
    if isinstance(param.type, click.types.BoolParamType):
        return "flag"
    if isinstance(param.type, click.types.IntParamType):
        return "integer"
    if isinstance(param.type, click.types.FloatParamType):
        return "number"
    return "text" if isinstance(param.type, click.types.StringParamType) else "name"


def _finite(value: int | float) -> bool:
    try:
        return math.isfinite(value)
    except OverflowError:  # an integer too large for a float
        return False


def check_value(path: str, key: str, value: object, param: click.Parameter) -> object:
    """`value` when it has the type the flag takes (module docstring); ConfigError naming the key otherwise."""
    kind = value_kind(param)
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if (isinstance(value, float) or kind == "number") and number and not _finite(value):
        problem = f"{value} is not a finite number"  # inf, nan, or an integer too large for a float
    elif isinstance(value, (datetime.date, datetime.time)):
        problem = f"a date or time ({value.isoformat()}) is not a value of any flag"
    elif kind == "flag" and not isinstance(value, bool):
        problem = f"it is an on/off flag: give true or false, not {value!r}"
    elif kind == "integer" and (not number or isinstance(value, float)):
        problem = f"it takes an integer, not {value!r}"
    elif kind == "number" and not number:
        problem = f"it takes a number, not {value!r}"
    elif kind == "text" and not (isinstance(value, str) or number):
        problem = f"it takes a string, not {value!r}"
    elif kind == "name" and not isinstance(value, str):
        problem = f"it takes a string, not {value!r}"
    elif isinstance(value, str) and "\0" in value:  # no flag, and no path, can hold one
        problem = "a NUL character is not part of any flag's value"
    else:
        return value
    raise ConfigError(f"--config {path!r}: key {key!r}: {problem}")


def flag_names(command: click.Command) -> dict[str, click.Parameter]:
    """Every name a TOML key may give for one of `command`'s flags: each of its spellings (--batch-size and
    --global-batch), without dashes' difference from underscores (`--json` is `json`). An on/off pair is
    named by its first spelling (`untied = false`, never `tied = true`)."""
    names = {}
    for param in command.params:
        if param.name in ("config", "help") or not isinstance(param, click.Option):
            continue
        for opt in param.opts:
            names[opt.lstrip("-").replace("-", "_")] = param
    return names


def read_config_file(path: str, command: click.Command, others: list[click.Command] = ()) -> dict:
    """The flags a TOML file gives `command`: its top-level keys, then its own table ([train], [simulate], ...)
    over them. A top-level key only other commands take is skipped and named once on stderr (one file serves
    every command); a key no command takes, or a bad value, is ConfigError."""
    data = _read_toml(path)
    tables = {other.name for other in others} | {command.name}
    own = data.get(command.name, {})
    if not isinstance(own, dict):
        raise ConfigError(f"--config {path!r}: [{command.name}] must be a table of flags, not {own!r}")
    params = flag_names(command)
    elsewhere = {name for other in others for name in flag_names(other)}
    values, skipped = {}, []
    for key, value in [(k, v) for k, v in data.items() if k not in tables] + list(own.items()):
        name = key.replace("-", "_")
        if name not in params and name in elsewhere and key not in own and not isinstance(value, (dict, list)):
            skipped.append(key)
            continue
        if name not in params or isinstance(value, (dict, list)):
            valid = ", ".join(sorted({param.opts[0].lstrip("-") for param in params.values()}))
            raise ConfigError(f"--config {path!r}: unknown or non-scalar key {key!r}; the keys are the flags: {valid}")
        param = params[name]
        values[param.name] = check_value(path, key, value, param)
    if skipped:
        click.echo(f"--config {path}: {command.name} does not take {', '.join(skipped)} (other commands' flags): "
                   f"skipped", err=True)
    return values


def config_file_option(command: click.Command) -> click.Command:
    """Add --config to a click command (apply it last, on top of the other options)."""

    def load(ctx: click.Context, param: click.Parameter, value: str | None) -> None:
        if value is not None:
            root = ctx.find_root().command
            every = [root.get_command(ctx, name) for name in root.list_commands(ctx)] \
                if isinstance(root, click.Group) else []
            others = [c for c in every if c is not None and c.name != ctx.command.name]
            ctx.default_map = {**(ctx.default_map or {}), **read_config_file(value, ctx.command, others)}

    option = click.Option(
        ["--config"], type=str, is_eager=True, expose_value=False, callback=load,
        help="A TOML file of this command's flags; flags given here override it.",
    )
    command.params.insert(0, option)
    return command
