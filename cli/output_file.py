"""The file a command writes at its end (simulate --trace and --plot, calibrate --out, claims --markdown),
checked before any work: a path that names something, not a directory, in a directory that exists and
takes a new file. Torch-free."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from minigpt.errors import ConfigError, check_output_path


def check_output_file(flag: str, value: str, example: str) -> Path:
    """`value` as a Path that can be written; ConfigError saying why not. `example`: a file name to suggest."""
    check_output_path(flag, value, "a file path")
    path = Path(value)
    if path.is_dir():
        raise ConfigError(f"{flag} {value!r} is a directory: give a file path such as {value.rstrip('/')}/{example}")
    parent = path.parent
    if parent.exists() and not parent.is_dir():
        raise ConfigError(f"{flag} {value!r}: {str(parent)!r} is not a directory: choose another path")
    if not parent.is_dir():
        raise ConfigError(f"{flag} {value!r}: the directory {str(parent)!r} does not exist: create it first")
    try:  # what the system says, for root as for anyone: os.access grants root everything
        descriptor, probe = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".probe", dir=parent)
        os.close(descriptor)
        os.unlink(probe)
    except OSError as error:
        raise ConfigError(f"{flag} {value!r}: cannot write in {str(parent)!r} ({error.strerror}): "
                          f"choose another path") from None
    if path.exists() and not os.access(path, os.W_OK):
        raise ConfigError(f"{flag} {value!r} exists and is not writable: choose another path")
    return path
