"""The one error class for bad input. Torch-free."""


class ConfigError(ValueError):
    """Bad input: the message says what is wrong and how to fix it.

    The CLI prints it on one line, without a traceback, and exits with code 2.
    """


class TrainingError(RuntimeError):
    """A run that cannot go on (a non-finite loss, a failed rank).

    The CLI prints it on one line and exits with code 1.
    """


class Interrupted(Exception):
    """The run was stopped by a signal (SIGINT: Ctrl-C, SIGTERM: a scheduler or `kill`).

    The CLI prints one line and exits with 128 + the signal's number, as a shell reports it.
    """

    def __init__(self, signal_number: int):
        import signal

        self.signal_number = signal_number
        super().__init__(f"stopped by {signal.Signals(signal_number).name}")


def check_positive_int(name: str, value: object) -> int:
    """`value` when it is an integer >= 1 (a bool is not); otherwise the one ConfigError every
    positive-integer setting raises: "<name> must be a positive integer, got <value>"."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name} must be a positive integer, got {value!r}")
    return value
