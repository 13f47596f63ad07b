"""The one error class for bad input. Torch-free."""


class ConfigError(ValueError):
    """Bad input: the message says what is wrong and how to fix it.

    The CLI prints it on one line, without a traceback, and exits with code 2.
    """


class TrainingError(RuntimeError):
    """A run that cannot go on (a non-finite loss, a failed rank).

    The CLI prints it on one line and exits with code 1.
    """


def check_positive_int(name: str, value: object) -> int:
    """`value` when it is an integer >= 1 (a bool is not); otherwise the one ConfigError every
    positive-integer setting raises: "<name> must be a positive integer, got <value>"."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name} must be a positive integer, got {value!r}")
    return value
