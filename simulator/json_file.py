"""Reading a JSON input file whatever its bytes: a decoded document, or ConfigError naming the file. Torch-free.

The hardware profiles (simulator/costs/hardware.py) and the node-link topologies (simulator/network/topology.py)
come through here, so that every byte string ends in one of two ways: a JSON document of dicts,
lists, strings, bools, None, ints and floats nested at most MAX_DEPTH deep, or a ConfigError that
names the file and says what is wrong with it (missing, unreadable, not UTF-8, not JSON, an integer
of thousands of digits, nested too deeply, larger than simulator/limits.py's MAX_FILE_BYTES).
What the document means is the caller's to check, field by field, so that its messages name the
field: NaN, Infinity and numbers beyond a float's range (1e400) decode as non-finite floats, and
every number a caller uses goes through `finite_number`, or `in_range` with one of the ranges below.
"""

from __future__ import annotations

import json
import math
import stat
from pathlib import Path

from minigpt.errors import ConfigError
from simulator.limits import MAX_FILE_BYTES

MAX_DEPTH = 64  # the deepest our files go is 5 (a profile's measured units); nothing real comes near

# The widest values the numbers of a hardware profile or topology may take: far beyond any real device,
# and narrow enough that no simulated step overflows to inf or vanishes to 0 (a peak of 5e-324 FLOP/s
# would make every step infinite). Bounds are inclusive.
RATE = (1.0, 1e30)  # FLOP/s, bytes/s
SECONDS = (0.0, 3600.0)  # latencies, overheads, measured times
FRACTION = (1e-6, 1.0)  # efficiencies and achieved fractions
BYTES = (1.0, 1e30)  # memory, message sizes
COUNT = (1, 2**20)  # GPUs or NICs per server, switch ports, cores, ranks
SHARE = (0.0, 1.0)  # the share of one core a thread got (a calibration's measured noise)
RELATIVE = (0.0, 1e6)  # relative spreads and bounds: (slowest - fastest) / median of repeated runs


def read_bytes(path: str | Path, what: str, max_bytes: int = MAX_FILE_BYTES) -> bytes:
    """The file's bytes; ConfigError when it is missing, a directory, a pipe or device (which could block),
    unreadable, not a usable path, or larger than `max_bytes` (checked before reading)."""
    try:
        status = Path(path).stat()
        if stat.S_ISDIR(status.st_mode):
            raise IsADirectoryError
        regular, size = stat.S_ISREG(status.st_mode), status.st_size
        data = Path(path).read_bytes() if regular and size <= max_bytes else None  # a FIFO would block: not read
    except FileNotFoundError:
        raise ConfigError(f"{what} {str(path)!r} does not exist: give the path of an existing file") from None
    except IsADirectoryError:
        raise ConfigError(f"{what} {str(path)!r} is a directory: give the path of a file") from None
    except OSError as error:
        raise ConfigError(f"cannot read {what} {str(path)!r}: {error.strerror or error}") from None
    except ValueError:  # a NUL byte in the path
        raise ConfigError(f"{what} {str(path)!r} is not a usable file name") from None
    if not regular:
        raise ConfigError(f"{what} {str(path)!r} is not a regular file (a device or a pipe): give the path of a file")
    if data is None:
        raise ConfigError(f"{what} {str(path)!r} has {size:,} bytes, more than the {max_bytes:,} it may have "
                          "(simulator/limits.py)")
    return data


def decode_utf8(data: bytes, path: str | Path, what: str) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ConfigError(f"{what} {str(path)!r} is not UTF-8 text (byte {error.start}): save it as UTF-8") from None


def parse_json(text: str, origin: str, what: str = "file") -> object:
    """`text` as JSON with the limits of the module docstring; ConfigError naming `origin` otherwise."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as error:
        raise ConfigError(f"{what} {origin!r} is not valid JSON (line {error.lineno}: {error.msg}): fix the file") from None
    except RecursionError:
        raise ConfigError(f"{what} {origin!r} is nested more than {MAX_DEPTH} levels deep: no valid file is") from None
    except ValueError as error:  # an integer of more digits than Python converts (4,300)
        raise ConfigError(f"{what} {origin!r} is not valid JSON ({' '.join(str(error).split())[:120]})") from None
    check_depth(data, f"{what} {origin!r}")
    return data


def check_depth(data: object, where: str, limit: int = MAX_DEPTH) -> None:
    """ConfigError when lists and objects nest more than `limit` levels deep (walked without recursion)."""
    stack = [(data, 1)]
    while stack:
        value, depth = stack.pop()
        children = value.values() if isinstance(value, dict) else value if isinstance(value, list) else ()
        for child in children:
            if isinstance(child, (dict, list)):
                if depth + 1 > limit:
                    raise ConfigError(f"{where} is nested more than {limit} levels deep: no valid file is")
                stack.append((child, depth + 1))


def read_json_file(path: str | Path, what: str) -> object:
    """The JSON document in the file at `path` (`what` names the kind of file in messages)."""
    return parse_json(decode_utf8(read_bytes(path, what), path, what), str(path), what)


def in_range(value: object, bounds: tuple[float, float]) -> bool:
    """Whether `value` is a number (not a bool) within `bounds`, both ends included."""
    number = finite_number(value)
    return number is not None and bounds[0] <= number <= bounds[1]


def finite_number(value: object) -> float | None:
    """`value` as a finite float when it is an int or float (not a bool) that is one; else None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        number = float(value)
    except OverflowError:
        return None
    return number if math.isfinite(number) else None
