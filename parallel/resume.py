"""Which checkpoint a resumed run continues from, checked in the launching process. Torch-free.

`--resume` takes the newest checkpoint of the run that verifies (complete, every file of the
size and sha256 written: parallel/checkpoint_files.py) and says which newer ones it skipped and
why; `--resume PATH` takes that checkpoint or refuses it. Either way the workers load a
checkpoint already verified, and a corrupt one is refused in one line before any of them starts.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from minigpt.errors import ConfigError
from parallel.checkpoint_files import CorruptCheckpoint, check_checkpoint, newest_valid_checkpoint


@dataclass(frozen=True)
class ResumePoint:
    path: Path
    step: int  # steps done: the next step to run
    skipped: tuple[CorruptCheckpoint, ...] = ()

    def skipped_line(self) -> str | None:
        """One line naming the newer checkpoints passed over and why; None when none was."""
        if not self.skipped:
            return None
        return "resume: skipped " + "; ".join(f"{error.path.name} ({error.reason})" for error in self.skipped)

    def resuming_line(self, steps: int) -> str:
        return f"resuming {self.path} at step {self.step} of {steps}"

    def nothing_to_do(self, steps: int) -> str | None:
        """The line a run prints and ends with (exit 0) when the checkpoint is at or past --steps."""
        if self.step < steps:
            return None
        return (f"checkpoint {self.path} is at step {self.step} and --steps is {steps}: nothing left to do "
                f"(raise --steps to train further)")


def resume_point(cfg, chosen: str | os.PathLike | None = None) -> ResumePoint:
    """The checkpoint `cfg` resumes: `chosen` when given, else the newest of cfg.checkpoint_dir that
    verifies. ConfigError (one line) when there is none, or the chosen one does not verify."""
    if chosen is not None:
        state = check_checkpoint(chosen, cfg)
        return ResumePoint(Path(chosen), state["step"])
    path, state, skipped = newest_valid_checkpoint(cfg.checkpoint_dir, cfg)
    if path is not None:
        return ResumePoint(path, state["step"], tuple(skipped))
    if skipped:
        reasons = "; ".join(f"{error.path.name} is {error.reason}" for error in skipped)
        raise ConfigError(f"--resume: no checkpoint in {cfg.checkpoint_dir} verifies ({reasons}): "
                          f"start afresh with --overwrite")
    raise ConfigError(f"--resume: no complete checkpoint in {cfg.checkpoint_dir}; train with --save-every first")
