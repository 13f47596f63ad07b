"""A run owns its directory: checked before any work, locked for the whole run, cleared only on request.

`claim_run_dir(out, resume, overwrite)` is what the launching process does before any worker
starts (cli/commands/train.py); nothing here imports torch and nothing is written until `take()`:

- the directory must be creatable and writable (its nearest existing ancestor, where it does not
  exist yet), checked by making and removing a probe directory there: the system's answer, for root
  as for anyone (os.access passes root wherever the permission bits would, /proc included);
- a directory that holds anything (`run.lock` aside) is another run: refused unless `--resume`
  continues it or `--overwrite` clears it; `--overwrite` clears only what looks like a minigpt
  run directory (RUN_ENTRIES), never a directory with other files;
- a run that keeps what is there (`--resume`) refuses symlinks inside it that point out of it:
  no output file is ever written through one;
- `run.lock` is held with flock(2) by the launching process from the check to the end of the run,
  so a second run on the same directory is refused (naming the directory and the holder's pid),
  and a crashed run leaves no stale lock: the kernel drops it with the process;
- under torchrun the run's one directory (on a filesystem every node mounts) is claimed by rank 0
  alone, and every other rank checks it the same way without locking it (`lock=False`), so that a
  directory refused is refused on every node at once, before any rank waits for rank 0. The ranks
  check side by side: one's probe directory is no content to another.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
from pathlib import Path

from minigpt.errors import ConfigError

LOCK_FILE = "run.lock"
PROBE_PREFIX = ".minigpt-probe-"  # check_writable's directory, made and removed at once
# What a run writes into its directory (parallel/run/files.py, parallel/run/train.py, job/trace.py,
# parallel/checkpoint*.py), with the temporary names they are written under before a rename.
RUN_ENTRIES = frozenset({
    "config.json", "metrics.jsonl", "summary.json", "trace.json", "loss.png", "checkpoints", LOCK_FILE,
    "simulated.json",  # minigpt compare's simulated trace, beside the run's own
    "compare.png",  # and its picture of predicted against measured (cli/tools/plots.py)
    "tensorboard",  # TensorBoard's event files (parallel/run/tensorboard.py)
    "tokenizer.json", "tokenizer.json.tmp",  # the run's tokenizer (parallel/run/files.py), when it is not bytes
    "config.json.tmp", "summary.json.tmp", "trace.tmp", "loss.png.tmp.png",
})


def is_run_dir(path: Path) -> bool:
    """Every entry is one a run writes, checkpoints/ holds only step directories and tensorboard/ only event files."""
    if not all(entry.name in RUN_ENTRIES or entry.name.startswith(PROBE_PREFIX) for entry in path.iterdir()):
        return False
    for folder, prefix in (("checkpoints", "step-"), ("tensorboard", "events.out.tfevents.")):
        inside = path / folder
        if inside.is_symlink() or (inside.exists() and not inside.is_dir()):
            return False
        if inside.exists() and not all(entry.name.startswith(prefix) for entry in inside.iterdir()):
            return False
    return True


def check_writable(path: Path, flag: str = "--out") -> None:
    """`path` (a directory, or one to be made) can be written: ConfigError saying why not."""
    existing = path
    while not existing.exists() and not existing.is_symlink():
        if existing.parent == existing:
            break
        existing = existing.parent
    where = "" if existing == path else f" (its nearest existing parent {existing})"
    # What the system does, not what os.access says (it passes root on /proc): making a directory there fails,
    # for root as for anyone, under a file (ENOTDIR), on a read-only or pseudo filesystem (EROFS, ENOENT), and
    # for anyone but root without the permissions (EACCES).
    try:
        os.rmdir(tempfile.mkdtemp(prefix=PROBE_PREFIX, dir=existing))
    except OSError as error:
        raise ConfigError(f"{flag} {str(path)!r} is not writable{where}: {error.strerror}: pick another {flag}") from None


def check_symlinks(path: Path, flag: str = "--out") -> None:
    """Refuse any symlink inside the run directory that points out of it (nothing is written through one)."""
    root = path.resolve()
    for folder, dirs, files in os.walk(path):  # does not follow symlinked directories
        for name in dirs + files:
            entry = Path(folder) / name
            if entry.is_symlink():
                target = entry.resolve()
                if target != root and root not in target.parents:
                    raise ConfigError(f"{flag} {str(path)!r}: {entry.relative_to(path)} is a symlink to {target}, "
                                      f"outside the run directory: minigpt never writes through one; remove it")


class RunClaim:
    """The launching process's claim on a run directory: checked on creation, locked and (with
    overwrite) cleared by `take()`, released by `release()` or at exit. A context manager."""

    def __init__(self, out: str | os.PathLike, resume: bool, overwrite: bool, lock: bool = True):
        self.path, self.overwrite = Path(out), overwrite
        self.lock: int | None = None
        self.clear = False  # take() empties the directory (--overwrite of a run directory)
        if resume and overwrite:
            raise ConfigError("--resume continues the run in --out and --overwrite clears it: give one of them")
        if self.path.exists() and not self.path.is_dir():
            raise ConfigError(f"--out {str(out)!r} exists and is not a directory")
        check_writable(self.path)
        if not self.path.is_dir():
            return
        self.lock = self._lock_existing() if lock else None  # lock=False: checked only (a torchrun rank but 0)
        try:
            self._check_contents(resume)
        except BaseException:
            self.release()
            raise

    def _check_contents(self, resume: bool) -> None:
        entries = sorted(entry.name for entry in self.path.iterdir()
                         if entry.name != LOCK_FILE and not entry.name.startswith(PROBE_PREFIX))
        if resume:
            check_symlinks(self.path)
        elif entries and not self.overwrite:
            raise ConfigError(f"--out {str(self.path)!r} is not empty ({', '.join(entries[:4])}"
                              f"{', ...' if len(entries) > 4 else ''}): continue that run with --resume, "
                              f"clear it with --overwrite, or pick a new --out")
        elif entries and not is_run_dir(self.path):
            strangers = [name for name in entries if name not in RUN_ENTRIES] or [
                "checkpoints or tensorboard (a link, a file, or more than step-* or event files in it)"]
            raise ConfigError(f"--out {str(self.path)!r} holds files no minigpt run writes ({', '.join(strangers[:4])}): "
                              f"--overwrite clears only run directories; pick another --out")
        self.clear = bool(entries) and self.overwrite

    def _lock_existing(self) -> int | None:
        """Hold the directory's existing run.lock (None when there is none); refuse one held by a live run."""
        lock = self.path / LOCK_FILE
        if not lock.exists() and not lock.is_symlink():
            return None
        try:
            handle = os.open(lock, os.O_RDWR | os.O_NOFOLLOW)
        except OSError as error:
            raise ConfigError(f"--out {str(self.path)!r}: cannot open {LOCK_FILE} ({error.strerror}): remove it") from None
        return self._flock(handle)

    def _flock(self, handle: int) -> int:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = os.pread(handle, 64, 0).decode("ascii", "replace").strip() or "unknown"
            os.close(handle)
            raise ConfigError(f"--out {str(self.path)!r} is in use by another minigpt run (process {holder}): "
                              f"wait for it to end, or pick another --out") from None
        return handle

    def take(self) -> None:
        """Make the directory, hold its lock (writing this process's id in it) and, with overwrite, clear it."""
        if self.lock is None:
            self.path.mkdir(parents=True, exist_ok=True)
            self.lock = self._flock(os.open(self.path / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644))
        os.ftruncate(self.lock, 0)
        os.pwrite(self.lock, f"{os.getpid()}\n".encode(), 0)
        if self.clear:
            for entry in self.path.iterdir():
                if entry.name == LOCK_FILE:
                    continue
                if entry.is_dir() and not entry.is_symlink():
                    shutil.rmtree(entry)
                else:
                    entry.unlink()  # a file, or a symlink: the link goes, never what it points to

    def release(self) -> None:
        if self.lock is not None:
            os.close(self.lock)  # closing the last descriptor drops the flock
            self.lock = None

    def __enter__(self) -> RunClaim:
        return self

    def __exit__(self, *exc) -> None:
        self.release()
