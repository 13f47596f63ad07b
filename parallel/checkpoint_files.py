"""A checkpoint's directory and its JSON files, checked without torch.

    <dir>/step-000010/            10 steps done: the next step to run is step 10
        .metadata, __<rank>_0.distcp   torch.distributed.checkpoint's files (the tensors)
        rank-00000.json ...        each rank's own state: RNG, fp8 scaling histories
        state.json                 step, loss scaler, optimizer step count, config, layout,
                                   the caller's extra dict, every file's size
        COMPLETE                   written last, by rank 0, after every rank finished

A save writes into `step-000010.tmp/` and renames it only once COMPLETE exists, so a
crash mid-save leaves a `.tmp` directory (or nothing), never a checkpoint that looks
complete. `latest_checkpoint` ignores `.tmp` directories and any without the marker.
`check_checkpoint` is what the CLI calls before any worker starts: it reads JSON only.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

from minigpt.errors import ConfigError

FORMAT = "minigpt-checkpoint"
VERSION = 1
MARKER = "COMPLETE"
STATE_FILE = "state.json"
SHAPE_FIELDS = ("vocab_size", "seq_len", "n_layers", "n_heads", "d_model", "d_ff", "tied_head")
STEP_DIR = re.compile(r"step-(\d+)")


def step_dir_name(step: int) -> str:
    return f"step-{step:06d}"


def rank_file_name(rank: int) -> str:
    return f"rank-{rank:05d}.json"


def write_json(path: Path, obj: dict) -> None:
    """Write and fsync: the bytes are on disk before anything that vouches for them."""
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(obj, handle, indent=1)
        handle.write("\n")
        handle.flush()
        os.fsync(handle.fileno())


def sync_directory(path: Path) -> None:
    """Make a rename inside `path` durable (a no-op where directories cannot be opened)."""
    try:
        descriptor = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(descriptor)
    except OSError:
        pass
    finally:
        os.close(descriptor)


def file_sizes(path: Path) -> dict[str, int]:
    """Every file of a checkpoint directory but the two rank 0 writes last."""
    return {
        entry.name: entry.stat().st_size
        for entry in sorted(path.iterdir())
        if entry.is_file() and entry.name not in (STATE_FILE, MARKER)
    }


def publish(tmp: Path, final: Path, state: dict) -> None:
    """Rank 0, after every rank wrote its files: state.json, the marker, then the rename."""
    write_json(tmp / STATE_FILE, {**state, "files": file_sizes(tmp)})
    write_json(tmp / MARKER, {"step": state["step"]})
    sync_directory(tmp)
    old = None
    if final.exists():  # the same step saved again: move the old one out of sight first
        old = final.with_name(final.name + ".old.tmp")
        if old.exists():
            shutil.rmtree(old)
        final.rename(old)
    tmp.rename(final)
    sync_directory(final.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def latest_checkpoint(directory: str | os.PathLike) -> Path | None:
    """The complete checkpoint of the most steps under `directory`; None when there is none."""
    root = Path(directory)
    if not root.is_dir():
        return None
    found = []
    for entry in root.iterdir():
        match = STEP_DIR.fullmatch(entry.name)
        if match and entry.is_dir() and (entry / MARKER).is_file():
            found.append((int(match.group(1)), entry))
    return max(found)[1] if found else None


def read_state(path: str | os.PathLike, cfg) -> dict:
    """state.json of a complete, untruncated checkpoint of `cfg`'s model shape, or ConfigError."""
    path = Path(path)
    hint = "pass a directory that latest_checkpoint() returns, or start without --resume"
    if not path.exists():
        raise ConfigError(f"checkpoint {path} does not exist: {hint}")
    if not path.is_dir():
        raise ConfigError(f"checkpoint {path} is not a directory: {hint}")
    if path.name.endswith(".tmp") or not (path / MARKER).is_file():
        raise ConfigError(f"checkpoint {path} is incomplete (its save was interrupted, no {MARKER} marker): {hint}")
    try:
        state = json.loads((path / STATE_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise ConfigError(f"checkpoint {path} is corrupt: cannot read {STATE_FILE} ({error}): {hint}") from None
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise ConfigError(f"checkpoint {path} is corrupt: {STATE_FILE} is not a {FORMAT} state file: {hint}")
    if state.get("version") != VERSION:
        raise ConfigError(
            f"checkpoint {path} has format version {state.get('version')!r}, this minigpt reads {VERSION}: {hint}"
        )
    for key, kind in (("step", int), ("optimizer_steps", int), ("model", dict), ("files", dict), ("layout", dict)):
        if not isinstance(state.get(key), kind) or isinstance(state.get(key), bool):
            raise ConfigError(f"checkpoint {path} is corrupt: {STATE_FILE} has no valid {key!r}: {hint}")
    check_model_shape(path, state["model"], cfg.model.as_dict())
    for name, size in state["files"].items():
        if "/" in name or "\\" in name or name.startswith(".."):
            raise ConfigError(f"checkpoint {path} is corrupt: file name {name!r} in {STATE_FILE}: {hint}")
        file = path / name
        if not file.is_file():
            raise ConfigError(f"checkpoint {path} is truncated: {name} is missing: {hint}")
        if file.stat().st_size != size:
            raise ConfigError(
                f"checkpoint {path} is truncated: {name} has {file.stat().st_size} bytes, {size} were written: {hint}"
            )
    return state


def check_model_shape(path: Path, saved: dict, wanted: dict) -> None:
    differences = [
        f"{field} {saved.get(field)!r} there, {wanted[field]!r} here"
        for field in SHAPE_FIELDS
        if saved.get(field) != wanted[field]
    ]
    if differences:
        raise ConfigError(
            f"checkpoint {path} holds a model of another shape ({'; '.join(differences)}): "
            f"train with the checkpoint's model shape, or start without --resume"
        )


def check_checkpoint(path: str | os.PathLike, cfg) -> None:
    """Refuse (ConfigError) a missing, incomplete, truncated or other-shape checkpoint; reads JSON only."""
    read_state(path, cfg)
