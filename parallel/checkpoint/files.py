"""A checkpoint's directory and its JSON files, checked without torch.

    <dir>/step-000010/            10 steps done: the next step to run is step 10
        .metadata, __<rank>_0.distcp   torch.distributed.checkpoint's files (the tensors)
        rank-00000.json ...        each rank's own state: RNG, fp8 scaling histories
        state.json                 step, loss scaler, optimizer step count, config, layout,
                                   the caller's extra dict, every other file's size and sha256
        COMPLETE                   written last, by rank 0, after every rank finished:
                                   the step and the sha256 of state.json

A save writes into `step-000010.tmp/` and renames it only once COMPLETE exists, so a
crash mid-save leaves a `.tmp` directory (or nothing), never a checkpoint that looks
complete. The checksums are part of what marks it complete: the marker vouches for
state.json, state.json for every other file, so one flipped byte anywhere is found
(`read_state`, CorruptCheckpoint) before a tensor is loaded. `latest_checkpoint` ignores
`.tmp` directories and any without the marker; `newest_valid_checkpoint` also skips
those that do not verify. `check_checkpoint` is what the CLI calls before any worker
starts: it reads the files and hashes them, without torch.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from dataclasses import MISSING, fields
from pathlib import Path

from minigpt.config import GPTConfig
from minigpt.errors import ConfigError

FORMAT = "minigpt-checkpoint"
VERSION = 2  # 2: sha256 of every file in state.json, and of state.json in the marker
MARKER = "COMPLETE"
STATE_FILE = "state.json"
# What the saved model must share with this run's: its tensors (their shapes, the biases, the query and key norms,
# the experts), and the RoPE base and scaling, the norms' epsilon and the router, which change what the same weights
# compute (dropout, the experts' capacity and the routing losses' coefficients may change on resume)
SHAPE_FIELDS = ("vocab_size", "seq_len", "n_layers", "n_heads", "d_model", "d_ff", "tied_head",
                "n_kv_heads", "mlp", "norm", "positions", "bias", "qkv_bias", "d_head", "qk_norm", "rope_theta",
                "rope_scaling", "rope_yarn", "norm_eps", "n_experts", "top_k", "d_expert", "n_shared_experts",
                "dense_layers", "router", "kv_lora_rank", "q_lora_rank", "rope_head_dim", "d_value", "expert_groups",
                "groups_per_token", "routed_scale", "expert_bias", "window", "full_attention_every",
                "rope_yarn_truncate", "rope_longrope", "rotary_fraction", "nope_every", "post_norms", "embed_scale",
                "query_scale", "rope_local_theta", "rope_linear", "qk_norm_whole", "pre_norms", "attention_sinks",
                "router_bias", "mtp_depth", "renormalize_gates", "group_score_top", "shared_expert_gate", "moe_every",
                "attention_softcap", "logit_softcap", "embed_multiplier", "residual_multiplier",
                "attention_multiplier", "logit_divisor")
STEP_DIR = re.compile(r"step-(\d+)")
HINT = "resume an older one (--resume PATH), or start without --resume"
HASH_BLOCK = 1 << 20  # bytes read at a time while hashing a shard


class CorruptCheckpoint(ConfigError):
    """A checkpoint that is incomplete, truncated or whose bytes changed after the save: one that
    `--resume` skips for an older one (another model shape or format version is not skipped: refused)."""

    def __init__(self, path: Path, reason: str, hint: str = HINT):
        super().__init__(f"checkpoint {path} is {reason}: {hint}")
        self.path, self.reason = path, reason


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


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(HASH_BLOCK), b""):
            digest.update(block)
    return digest.hexdigest()


def file_records(path: Path) -> dict[str, dict]:
    """Every file of a checkpoint directory but the two rank 0 writes last: its size and sha256."""
    return {
        entry.name: {"bytes": entry.stat().st_size, "sha256": sha256_of(entry)}
        for entry in sorted(path.iterdir())
        if entry.is_file() and entry.name not in (STATE_FILE, MARKER)
    }


def publish(tmp: Path, final: Path, state: dict) -> None:
    """Rank 0, after every rank wrote its files: state.json (with every file's checksum), the marker
    (with state.json's), then the rename."""
    write_json(tmp / STATE_FILE, {**state, "files": file_records(tmp)})
    write_json(tmp / MARKER, {"step": state["step"], "state_sha256": sha256_of(tmp / STATE_FILE)})
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


def step_directories(directory: str | os.PathLike) -> list[Path]:
    """Every `step-NNNNNN` directory under `directory` (complete or not; `.tmp` ones left out), newest first."""
    root = Path(directory)
    if not root.is_dir():
        return []
    found = []
    for entry in root.iterdir():
        match = STEP_DIR.fullmatch(entry.name)
        if match and entry.is_dir() and not entry.is_symlink():
            found.append((int(match.group(1)), entry))
    return [entry for _, entry in sorted(found, reverse=True)]


def latest_checkpoint(directory: str | os.PathLike) -> Path | None:
    """The complete checkpoint of the most steps under `directory`; None when there is none."""
    return next((entry for entry in step_directories(directory) if (entry / MARKER).is_file()), None)


def newest_valid_checkpoint(directory: str | os.PathLike, cfg, read=None
                            ) -> tuple[Path | None, dict | None, list[CorruptCheckpoint]]:
    """The newest checkpoint under `directory` that verifies (read_state: complete, every checksum right),
    its state.json, and what was skipped on the way, newest first; (None, None, skipped) when none does.
    A checkpoint of another model shape or format version is not skipped: its ConfigError goes up, as no
    older checkpoint of the same run would be different. `read(path)` in place of read_state(path, cfg)
    checks each one another way (minigpt sample: against the shape the checkpoint itself holds)."""
    skipped = []
    for entry in step_directories(directory):
        try:
            return entry, read_state(entry, cfg) if read is None else read(entry), skipped
        except CorruptCheckpoint as error:
            skipped.append(error)
    return None, None, skipped


def _read_json(path: Path, name: str) -> tuple[object, bytes]:
    try:
        raw = (path / name).read_bytes()
        return json.loads(raw.decode("utf-8")), raw
    except (OSError, ValueError, RecursionError) as error:  # RecursionError: nested too deep
        raise CorruptCheckpoint(path, f"corrupt: cannot read {name} ({' '.join(str(error).split())})") from None


def read_state(path: str | os.PathLike, cfg, verify: bool = True) -> dict:
    """state.json of a complete, untruncated checkpoint of `cfg`'s model shape, or ConfigError
    (CorruptCheckpoint for one that is incomplete, truncated or changed). `verify`: hash every file
    against its sha256 too (state.json's own checksum, in the marker, is always checked)."""
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"checkpoint {path} does not exist: {HINT}")
    if not path.is_dir():
        raise ConfigError(f"checkpoint {path} is not a directory: {HINT}")
    if not (path / MARKER).is_file() and not STEP_DIR.fullmatch(path.name.split(".")[0]):
        raise ConfigError(f"{path} is not a checkpoint (a step-NNNNNN directory with a {MARKER} marker): {HINT}")
    if path.name.endswith(".tmp") or not (path / MARKER).is_file():
        raise CorruptCheckpoint(path, f"incomplete (its save was interrupted, no {MARKER} marker)")
    marker, _ = _read_json(path, MARKER)
    state, raw = _read_json(path, STATE_FILE)
    sealed = isinstance(marker, dict) and "state_sha256" in marker
    if sealed and marker["state_sha256"] != hashlib.sha256(raw).hexdigest():
        raise CorruptCheckpoint(path, f"corrupt: {STATE_FILE} does not match the sha256 in {MARKER}")
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise CorruptCheckpoint(path, f"corrupt: {STATE_FILE} is not a {FORMAT} state file")
    if state.get("version") != VERSION:
        raise ConfigError(f"checkpoint {path} has format version {state.get('version')!r}, this minigpt reads "
                          f"{VERSION}: resume it with the minigpt that saved it, or start without --resume")
    if not sealed:
        raise CorruptCheckpoint(path, f"corrupt: {MARKER} holds no sha256 of {STATE_FILE}")
    for key, kind in (("step", int), ("optimizer_steps", int), ("model", dict), ("files", dict), ("layout", dict)):
        if not isinstance(state.get(key), kind) or isinstance(state.get(key), bool):
            raise CorruptCheckpoint(path, f"corrupt: {STATE_FILE} has no valid {key!r}")
    if not isinstance(state.get("config") or {}, dict):  # the run's settings, absent in older checkpoints
        raise CorruptCheckpoint(path, f"corrupt: {STATE_FILE} has no valid 'config'")
    if marker.get("step") != state["step"]:
        raise CorruptCheckpoint(path, f"corrupt: {MARKER} says step {marker.get('step')!r}, {STATE_FILE} {state['step']}")
    check_model_shape(path, state["model"], cfg.model.as_dict())
    check_files(path, state["files"], verify)
    return state


def check_files(path: Path, files: dict, verify: bool) -> None:
    """Every file state.json lists is there, of the size written and, with `verify`, of the sha256 written."""
    for name, record in files.items():
        if not isinstance(name, str) or "/" in name or "\\" in name or name.startswith(".."):
            raise CorruptCheckpoint(path, f"corrupt: file name {name!r} in {STATE_FILE}")
        if not isinstance(record, dict) or not isinstance(record.get("bytes"), int) or not isinstance(record.get("sha256"), str):
            raise CorruptCheckpoint(path, f"corrupt: {STATE_FILE} has no size and sha256 for {name}")
        file = path / name
        if not file.is_file() or file.is_symlink():
            raise CorruptCheckpoint(path, f"truncated: {name} is missing")
        if file.stat().st_size != record["bytes"]:
            raise CorruptCheckpoint(path, f"truncated: {name} has {file.stat().st_size} bytes, {record['bytes']} were written")
    for name, record in files.items() if verify else ():
        if sha256_of(path / name) != record["sha256"]:
            raise CorruptCheckpoint(path, f"corrupt: {name} does not match its sha256 (its bytes changed after the save)")


def model_fields(model: dict) -> dict:
    """A saved model dict with GPTConfig's defaults for the fields it lacks (a checkpoint saved before
    they existed holds a GPT-2-style model) and n_kv_heads spelled out (None: as many as the heads)."""
    defaults = {field.name: field.default for field in fields(GPTConfig) if field.default is not MISSING}
    full = {**defaults, **model}
    for name in ("rope_scaling", "rope_yarn"):
        if isinstance(full.get(name), list):  # JSON's spelling of the config's tuple
            full[name] = tuple(full[name])
    longrope = full.get("rope_longrope")  # and of LongRoPE's, whose factors are tuples too (any other shape is the
    if isinstance(longrope, list) and len(longrope) == 4 and all(isinstance(f, list) for f in longrope[:2]):  # check's
        full["rope_longrope"] = (tuple(longrope[0]), tuple(longrope[1]), longrope[2], longrope[3])
    if full.get("n_kv_heads") is None:
        full["n_kv_heads"] = full.get("n_heads")
    return full


def check_model_shape(path: Path, saved: dict, wanted: dict) -> None:
    saved, wanted = model_fields(saved), model_fields(wanted)
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


def check_checkpoint(path: str | os.PathLike, cfg) -> dict:
    """Refuse (ConfigError) a missing, incomplete, truncated, changed or other-shape checkpoint; reads and
    hashes its files, without torch. Returns its state.json."""
    return read_state(path, cfg)
