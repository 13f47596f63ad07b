"""The `minigpt` click group: every command, and one place that turns bad input into exit code 2."""

from __future__ import annotations

import gc
import signal
import sys

import click

from minigpt.errors import ConfigError, Interrupted, TrainingError

EXIT_BAD_INPUT = 2
STOPPED = "the run ended early; its checkpoints so far are kept (--resume continues)"  # train's: it checkpoints
EXIT_RUN_FAILED = 1
LINE_BREAKS = "\n\r\v\f\x1c\x1d\x1e\x85\u2028\u2029"  # what str.splitlines() splits on


def one_line(message: object) -> str:
    """`message` as one printable line: line breaks (a file name or a value quoted from a file may
    hold them) shown as escapes, and what UTF-8 cannot encode (a lone surrogate) escaped."""
    text = "".join(ch.encode("unicode_escape").decode("ascii") if ch in LINE_BREAKS else ch for ch in str(message))
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def _raise_interrupted(signal_number: int, frame) -> None:
    raise Interrupted(signal_number)


def stopped(args: list[str] | None) -> str:
    """What a stop by a signal leaves, for the command in `args` (sys.argv's when None): train's checkpoints, or,
    for every other command (none checkpoints), that it did not finish."""
    words = sys.argv[1:] if args is None else args
    command = next((word for word in words if word in COMMANDS), None)
    return STOPPED if command in (None, "train") else f"minigpt {command} ended before it finished"


# Each command's module, imported when the command is used (or listed): `minigpt train` does not pay for
# importing simulate's, plan's and compare's modules.
COMMANDS = {
    "train": "cli.commands.train",
    "numerics": "cli.commands.numerics",
    "schedule": "cli.commands.schedule",
    "simulate": "cli.commands.simulate",
    "plan": "cli.commands.plan",
    "calibrate": "cli.commands.calibrate",
    "compare": "cli.commands.compare",
    "sample": "cli.commands.sample",
    "export": "cli.commands.export",
    "claims": "cli.commands.claims",
    "tokenizer": "cli.commands.tokenizer",
}


class Group(click.Group):
    """A click group whose bad-input errors are one line on stderr and exit code 2, and whose commands are
    imported when first used (COMMANDS).

    click's own usage errors (unknown option, malformed value) and ConfigError
    raised by our validation both end here, before any worker starts.
    """

    def list_commands(self, ctx) -> list[str]:
        return sorted({*super().list_commands(ctx), *COMMANDS})

    def get_command(self, ctx, name: str):
        if name not in self.commands and name in COMMANDS:
            import importlib

            self.add_command(getattr(importlib.import_module(COMMANDS[name]), name))
        return super().get_command(ctx, name)

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        previous = signal.signal(signal.SIGTERM, _raise_interrupted)  # a scheduler's stop: one line, as Ctrl-C
        try:
            result = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except (click.exceptions.Abort, KeyboardInterrupt):  # Ctrl-C in this process (click turns it into Abort)
            click.echo(f"minigpt: {Interrupted(signal.SIGINT)}: {stopped(args)}", err=True)
            sys.exit(128 + signal.SIGINT)
        except Interrupted as error:
            click.echo(f"minigpt: {error}: {stopped(args)}", err=True)
            sys.exit(128 + error.signal_number)
        except click.ClickException as error:
            click.echo(f"minigpt: error: {one_line(error.format_message())}", err=True)
            sys.exit(EXIT_BAD_INPUT)
        except ConfigError as error:
            click.echo(f"minigpt: error: {one_line(error)}", err=True)
            sys.exit(EXIT_BAD_INPUT)
        except TrainingError as error:
            click.echo(f"minigpt: run failed: {one_line(error)}", err=True)
            sys.exit(EXIT_RUN_FAILED)
        except OSError as error:  # the machine refused a write after the checks: a full disk, a read-only mount
            where = f" {error.filename}" if error.filename else ""
            click.echo(f"minigpt: run failed: cannot write{where}: {one_line(error.strerror or error)}", err=True)
            sys.exit(EXIT_RUN_FAILED)
        finally:
            signal.signal(signal.SIGTERM, previous)
        if not standalone_mode:
            return result
        sys.exit(result if isinstance(result, int) else 0)


@click.group(cls=Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="minigpt")
def main() -> None:
    """minigpt: train a small GPT with in-repo mixed precision and 3D parallelism,
    and predict how the same job behaves on clusters you do not have."""


def run(**options) -> None:
    """The console script `minigpt` (and `python -m cli`): the command, then the interpreter's exit.

    The command has closed its files and waited for its processes by the time it returns or raises; what
    is left is the interpreter's last garbage collections, which walk every object torch's import made:
    about half a second of CPU here. Frozen first (gc.freeze), they skip them; the exit is otherwise the same.
    """
    try:
        main(**options)
    finally:
        gc.freeze()
