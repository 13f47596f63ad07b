"""The one error class for bad input. Torch-free."""

import os


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

    The CLI prints one line and exits with 128 + the signal's number, as a shell reports it. Its args are the
    signal's number alone, so that whatever rebuilds an exception from its args gets the same one back: SimPy
    re-raises an exception from inside a simulation as type(error)(*error.args), and pickle does the same.
    """

    def __init__(self, signal_number: int):
        super().__init__(signal_number)
        self.signal_number = signal_number

    def __str__(self) -> str:
        import signal

        return f"stopped by {signal.Signals(self.signal_number).name}"


def check_positive_int(name: str, value: object) -> int:
    """`value` when it is an integer >= 1 (a bool is not); otherwise the one ConfigError every
    positive-integer setting raises: "<name> must be a positive integer, got <value>"."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name} must be a positive integer, got {value!r}")
    return value


def check_choice(name: str, value: object, choices) -> object:
    """`value` when it is one of `choices`; otherwise "<name> must be one of <choices>, got <value>"."""
    if value not in choices:
        raise ConfigError(f"{name} must be one of {', '.join(choices)}, got {value!r}")
    return value


# torch.manual_seed and torch.Generator.manual_seed take 64 bits: 0 to 2**64 - 1, and negatives down to -2**63 as the
# same bits (-1 seeds as 2**64 - 1), so a negative seed would only be another name for a large one.
# minigpt/data.py hashes the seed's decimal text, which takes any integer: torch sets the bound.
MAX_SEED = 2**64 - 1


def check_seed(name: str, value: object) -> int:
    """`value` when it is an integer torch's generators take as themselves: 0 to MAX_SEED."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_SEED:
        raise ConfigError(f"{name} must be an integer from 0 to 2**64 - 1 ({MAX_SEED}: torch's generators take "
                          f"64 bits), got {value!r}")
    return value


# A fixed bound, not a multiple of this machine's cores: a config file means the same on every machine (torchrun's
# nodes are not the machine that checked the flags), and 1024 is above the hardware threads of any one host made
# today (2 sockets x 192 cores x 2 SMT = 768). Far above it, torch's and OpenMP's thread pools fail for memory
# (a MemoryError or a crash) before the first step.
MAX_THREADS_PER_RANK = 1024


def check_threads_per_rank(name: str, value: object) -> int:
    """`value` when it is an integer from 1 to MAX_THREADS_PER_RANK."""
    check_positive_int(name, value)
    if value > MAX_THREADS_PER_RANK:
        raise ConfigError(f"{name} must be at most {MAX_THREADS_PER_RANK} (more threads than any one machine runs at "
                          f"once), got {value}")
    return value


NAME_MAX = 255  # bytes in one file name on Linux's file systems (ext4, xfs, btrfs, tmpfs)
PATH_MAX = 4096  # bytes in a whole path, its terminating NUL included


def check_path_given(name: str, value: object, what: str = "a path") -> object:
    """`value` unless it is an empty or blank string, which would name the working directory unasked."""
    if isinstance(value, str) and not value.strip():
        raise ConfigError(f"{name} is {'blank' if value else 'empty'} ({value!r}): give {what}")
    return value


def check_output_path(name: str, value: object, what: str = "a path") -> object:
    """check_path_given, and for a path to be written, one the system will take: a longer name fails with
    ENAMETOOLONG only when the command writes, after its work (inputs say so as they are read)."""
    check_path_given(name, value, what)
    if isinstance(value, str):
        size = len(os.fsencode(value))
        longest = max(len(os.fsencode(part)) for part in value.split("/"))
        if longest > NAME_MAX or size >= PATH_MAX:
            where = f"a name of {longest} bytes (at most {NAME_MAX})" if longest > NAME_MAX else \
                f"{size} bytes (at most {PATH_MAX - 1})"
            raise ConfigError(f"{name} {value[:60]!r}... is too long for a file system, {where}: give {what}")
    return value
