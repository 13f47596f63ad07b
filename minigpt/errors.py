"""The one error class for bad input. Torch-free."""


class ConfigError(ValueError):
    """Bad input: the message says what is wrong and how to fix it.

    The CLI prints it on one line, without a traceback, and exits with code 2.
    """


class TrainingError(RuntimeError):
    """A run that cannot go on (a non-finite loss, a failed rank).

    The CLI prints it on one line and exits with code 1.
    """
