"""Which checkpoint a resumed run continues from, checked in the launching process. Torch-free.

`--resume` takes the newest checkpoint of the run that verifies (complete, every file of the
size and sha256 written: parallel/checkpoint/files.py) and says which newer ones it skipped and
why; `--resume PATH` takes that checkpoint or refuses it. Either way the workers load a
checkpoint already verified, and a corrupt one is refused in one line before any of them starts.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from job.muon import OPTIMIZERS
from job.train_config import LR_SCHEDULES, WSD_SCHEDULES, TrainConfig
from minigpt.errors import ConfigError
from minigpt.tokenizer import BYTES, FILE_NAME, load_tokenizer
from parallel.checkpoint.files import CorruptCheckpoint, check_checkpoint, newest_valid_checkpoint


@dataclass(frozen=True)
class ResumePoint:
    path: Path
    step: int  # steps done: the next step to run
    skipped: tuple[CorruptCheckpoint, ...] = ()
    settings: dict = field(default_factory=dict)  # the saving run's TrainConfig, as state.json holds it

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
        return ResumePoint(Path(chosen), state["step"], settings=state.get("config") or {})
    path, state, skipped = newest_valid_checkpoint(cfg.checkpoint_dir, cfg)
    if path is not None:
        return ResumePoint(path, state["step"], tuple(skipped), state.get("config") or {})
    if skipped:
        reasons = "; ".join(f"{error.path.name} is {error.reason}" for error in skipped)
        raise ConfigError(f"--resume: no checkpoint in {cfg.checkpoint_dir} verifies ({reasons}): "
                          f"start afresh with --overwrite")
    raise ConfigError(f"--resume: no complete checkpoint in {cfg.checkpoint_dir}; train without --no-save, or with --save-every N")


def continue_settings(cfg, point: ResumePoint, save_every_given: bool):
    """`cfg` with the saved run's --save-every unless the flag was given, and the lines that say what the
    resumed run does differently from the saved one (its learning-rate schedule when --steps changed)."""
    from dataclasses import replace

    lines = []
    saved_optimizer = point.settings.get("optimizer", "adamw")  # written before Muon: AdamW's
    if saved_optimizer != cfg.optimizer and saved_optimizer in OPTIMIZERS:
        raise ConfigError(f"--resume: {point.path} was trained with --optimizer {saved_optimizer}, whose state "
                          f"--optimizer {cfg.optimizer} cannot take up: resume with --optimizer {saved_optimizer}, "
                          f"or start a new run from its weights (`minigpt export`, then --init-from)")
    saved_every = point.settings.get("save_every")
    if not save_every_given and _whole(saved_every) and saved_every != cfg.save_every:
        cfg = replace(cfg, save_every=saved_every)
        lines.append(f"resume: checkpoints every {saved_every} steps, as the run did (--save-every changes it)")
    saved_steps, saved_warmup = point.settings.get("steps"), point.settings.get("warmup_steps")
    if not _whole(saved_warmup):
        saved_warmup = None  # the default warmup: also what an unreadable saved setting falls back to
    if _whole(saved_steps) and saved_steps > 0 and saved_steps != cfg.steps:
        before = replace(cfg, steps=saved_steps, warmup_steps=saved_warmup)
        last = before.learning_rate(min(point.step, saved_steps) - 1) if point.step > 0 else before.learning_rate(0)
        lines.append(f"resume: --steps {cfg.steps} where the run was started with {saved_steps}: the learning rate "
                     f"follows a {cfg.steps}-step schedule from here ({cfg.learning_rate(point.step):.2e} at step "
                     f"{point.step}; the run's last step used {last:.2e})")
    saved = _schedule(point.settings.get("lr_schedule", TrainConfig.lr_schedule),
                      point.settings.get("decay_fraction", TrainConfig.decay_fraction))
    if saved != _schedule(cfg.lr_schedule, cfg.decay_fraction) and saved[0] in LR_SCHEDULES:
        lines.append(f"resume: --lr-schedule {' '.join(map(str, _schedule(cfg.lr_schedule, cfg.decay_fraction)))} "
                     f"where the run was started with {' '.join(map(str, saved))}: the learning rate follows it from "
                     f"here ({cfg.learning_rate(point.step):.2e} at step {point.step})")
    saved_masked = point.settings.get("document_eod") is not None  # a hand-edited state.json may hold anything
    if saved_masked != (cfg.document_eod is not None):
        said = {True: "within documents", False: "across documents"}
        lines.append(f"resume: attention {said[cfg.document_eod is not None]} where the run attended "
                     f"{said[saved_masked]} (--document-mask changes it)")
    return cfg, lines


def _schedule(kind, fraction) -> tuple:
    """A learning-rate schedule as it shapes the rates: wsd with its decay fraction, the others alone."""
    return (kind, fraction) if kind in WSD_SCHEDULES else (kind,)


def resumed_tokenizer(given: str | None, out: str | os.PathLike, chosen: str | os.PathLike | None = None) -> str | None:
    """The tokenizer a resumed run trains with: the run's own (its tokenizer.json, written at its start; none: bytes,
    returned as None, which leaves the model's vocabulary as its flags say) when --tokenizer is left out, `given`
    when it is the same tokenizer (the same canonical JSON), ConfigError when it is another. The run is the one
    holding checkpoint `chosen` (RUN/checkpoints/step-N), else `out`."""
    run = Path(chosen).parent.parent if chosen is not None and Path(chosen).parent.name == "checkpoints" else Path(out)
    own = str(run / FILE_NAME) if (run / FILE_NAME).is_file() else None
    if given is None:
        return own
    if load_tokenizer(given).fingerprint != load_tokenizer(own).fingerprint:
        raise ConfigError(f"--resume: --tokenizer {given!r} is not the tokenizer the run in {str(run)!r} was trained "
                          f"with ({own or BYTES}): leave --tokenizer out to continue with the run's")
    return given


def _whole(value) -> bool:
    """A saved setting that is a whole number >= 0 (a hand-edited state.json may hold anything)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
