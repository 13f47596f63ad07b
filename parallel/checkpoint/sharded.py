"""Sharded checkpoints that load into any layout, written with torch.distributed.checkpoint.

What is saved is the plain GPT's global tensors, whatever the layout that saved them
(parallel/checkpoint/layout.py says where each element a rank holds lies in them):

  model.<name>                   the weights in the compute format (fp32, bf16, fp16)
  optimizer.master.<name>        fp32 masters (only when the policy keeps them apart from the weights)
  optimizer.exp_avg.<name>       AdamW's moments, fp32 (under --optimizer muon, a matrix's exp_avg is Muon's
  optimizer.exp_avg_sq.<name>    momentum and it has no exp_avg_sq: precision/muon.py)
  buffer.<name>                  a MoE layer's choice bias (fp32; every rank of its stage holds it whole, one writes it)

with <name> as in GPT.state_dict() ("blocks.3.attn.qkv.weight") and the full unpadded
shape, so a checkpoint of tp2 x pp2 x dp2 ZeRO 3 loads into dp4 ZeRO 1 or one process,
and DCP's own tools (format_utils.dcp_to_torch_save) turn it into a plain state dict.
Every rank writes its own boxes, no gathering; DCP reshards on load. Step, loss
scaler, optimizer step count, config and layout go to JSON (parallel/checkpoint/files.py),
with each rank's RNG and fp8 scaling histories, restored when the layout is the same.
The data position is the step: batches are pure functions of (seed, step).

Public: save_checkpoint, load_checkpoint, latest_checkpoint, check_checkpoint,
and gather_global_state (every global tensor on every rank: for tests and debugging).
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from minigpt.errors import ConfigError, TrainingError
from parallel.checkpoint.dcp import Boxes, SafeReader, TensorsOnlyLoadPlanner, check_tensors, read_metadata
from parallel.checkpoint.files import (
    FORMAT,
    VERSION,
    check_checkpoint,
    latest_checkpoint,
    publish,
    rank_file_name,
    read_state,
    step_dir_name,
    write_json,
)
from parallel.checkpoint.layout import (BUFFER, Placement, global_shapes, rank_placements, saved_buffers,
                                       stage_buffers)
from precision.fp8 import Fp8Linear
from job.muon import takes_muon

__all__ = ["save_checkpoint", "load_checkpoint", "latest_checkpoint", "check_checkpoint", "gather_global_state"]

ROLES = ("model", "master", "exp_avg", "exp_avg_sq")
KEYS = {"model": "model.", "master": "optimizer.master.", "exp_avg": "optimizer.exp_avg.", "exp_avg_sq": "optimizer.exp_avg_sq."}


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _barrier() -> None:
    if _distributed():
        dist.barrier()


def _role_slice(optimizer, role: str, start: int, end: int) -> torch.Tensor:
    """Elements [start, end) of `weights` laid end to end, of one role of the optimizer's state."""
    if role == "exp_avg_sq" and hasattr(optimizer, "second_moment"):  # Muon's: the AdamW weights' alone
        return optimizer.second_moment(start, end)
    if role in ("exp_avg", "exp_avg_sq"):
        return getattr(optimizer, role)[start:end]
    pieces = optimizer.pieces if role == "model" else optimizer.master_pieces
    for piece, (lo, hi) in zip(pieces, optimizer.bounds):
        if lo <= start and end <= hi:
            return piece[start - lo : end - lo]
    raise AssertionError(f"[{start}, {end}) crosses a piece of the optimizer's weights")


def keeps_role(cfg, name: str, role: str) -> bool:
    """Whether a checkpoint holds `role` of the plain GPT's `name`: all of them, but AdamW's second moment, which
    Muon's matrices do not have (their momentum is the exp_avg role: precision/muon.py)."""
    return not (role == "exp_avg_sq" and cfg.optimizer == "muon" and takes_muon(name))


def _boxes(optimizer, placement: Placement, role: str) -> Boxes:
    pieces = [
        (offsets, _role_slice(optimizer, role, position, position + torch.Size(sizes).numel()).view(sizes))
        for offsets, sizes, position in placement.boxes
    ]
    return Boxes(placement.shape, pieces[0][1].dtype, pieces)


def _layout(cfg) -> dict:
    return {"tp": cfg.tp, "pp": cfg.pp, "dp": cfg.dp, "cp": cfg.cp, "cp_kind": cfg.cp_kind, "zero": cfg.zero,
            "virtual_chunks": cfg.virtual_chunks, "world_size": cfg.world_size, "ep": cfg.ep}


# ---------------------------------------------------------------------------- each rank's own state


def _tensor_to_json(tensor: torch.Tensor) -> str:
    raw = tensor.detach().cpu().reshape(-1).view(torch.uint8).clone()  # a storage of exactly its bytes
    return base64.b64encode(bytes(raw.untyped_storage())).decode("ascii")


def _rank_state(rank) -> dict:
    state = {"rank": rank.mesh.rank, "torch_rng": _tensor_to_json(torch.get_rng_state())}
    if rank.mesh.device.type == "cuda":
        state["cuda_rng"] = _tensor_to_json(torch.cuda.get_rng_state(rank.mesh.device))
    state["fp8"] = {
        name: {
            "history_len": module.meta.history_len,
            "margin": module.meta.margin,
            "amax_history": {role: t.tolist() for role, t in module.meta.amax_history.items()},
            "scale": {role: t.tolist() for role, t in module.meta.scale.items()},
        }
        for name, module in rank.stage.named_modules()
        if isinstance(module, Fp8Linear)
    }
    return state


def _restore_rank_state(rank, state: dict) -> None:
    def rng(text: str) -> torch.Tensor:
        return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)

    torch.set_rng_state(rng(state["torch_rng"]))
    if rank.mesh.device.type == "cuda" and "cuda_rng" in state:
        torch.cuda.set_rng_state(rng(state["cuda_rng"]), rank.mesh.device)
    modules = dict(rank.stage.named_modules())
    for name, meta in state["fp8"].items():
        if not isinstance(modules.get(name), Fp8Linear):
            continue  # saved under the fp8 policy, resumed under another
        modules[name].meta.load_state_dict({
            "history_len": meta["history_len"],
            "margin": meta["margin"],
            "amax_history": {role: torch.tensor(v, dtype=torch.float32, device=rank.mesh.device)
                             for role, v in meta["amax_history"].items()},
            "scale": {role: torch.tensor(v, dtype=torch.float32, device=rank.mesh.device)
                      for role, v in meta["scale"].items()},
        })


# ---------------------------------------------------------------------------- save


def _cause(error: BaseException) -> str:
    """One line on why a save failed: DCP gathers each rank's exception into a CheckpointException."""
    failures = getattr(error, "failures", None)
    if failures:
        first = next(iter(failures.values()))
        error = first[0] if isinstance(first, tuple) else first
    return " ".join(f"{type(error).__name__}: {error}".split())[:200]


def save_checkpoint(directory: str | os.PathLike, rank, cfg, step: int, extra: dict | None = None) -> Path:
    """Save this rank's share of the training state as `<directory>/step-NNNNNN`; every rank calls it.

    `step`: steps completed, the next step to run. `extra`: JSON-serialisable, returned by
    load_checkpoint. Returns the checkpoint's path once it is complete on disk.
    """
    extra = {} if extra is None else extra
    json.dumps(extra)  # not serialisable: fail before anything is written, on every rank alike
    final = Path(directory) / step_dir_name(step)
    tmp = final.with_name(final.name + ".tmp")
    if rank.mesh.rank == 0:
        if tmp.exists():  # left by a save that crashed
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
    _barrier()
    optimizer = rank.optimizer
    roles = ROLES if not optimizer.masters_are_weights else ("model", "exp_avg", "exp_avg_sq")
    tensors = {
        KEYS[role] + placement.name: _boxes(optimizer, placement, role)
        for placement in rank_placements(rank, cfg)
        if placement.writes
        for role in roles
        if keeps_role(cfg, placement.name, role)
    } | {BUFFER + name: tensor for name, tensor in stage_buffers(rank.stage).items()}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # DCP's note on single-process use
            dcp.save(tensors, storage_writer=dcp.FileSystemWriter(tmp, single_file_per_rank=True, sync_files=True),
                     no_dist=not _distributed())
        write_json(tmp / rank_file_name(rank.mesh.rank), _rank_state(rank))
    except (OSError, CheckpointException) as error:  # a full disk, a file system gone read-only
        if rank.mesh.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # nothing half-written stays behind
        raise TrainingError(f"step {step}: cannot write checkpoint {final} ({_cause(error)}); nothing of it is "
                            f"left, the checkpoints before it are kept") from None
    _barrier()
    if rank.mesh.rank == 0:
        publish(tmp, final, {
            "format": FORMAT,
            "version": VERSION,
            "step": step,
            "optimizer_steps": optimizer.steps,
            "scaler": {**rank.scaler.state_dict(), "dynamic": rank.scaler.dynamic} if rank.scaler is not None else None,
            "precision": rank.policy.name,
            "model": cfg.model.as_dict(),
            "layout": _layout(cfg),
            "config": cfg.as_dict(),
            "extra": extra,
        })
    _barrier()
    return final


# ---------------------------------------------------------------------------- load


def _one_line(path: Path, error: BaseException) -> ConfigError:
    """A failed DCP read as one ConfigError (a ConfigError raised inside DCP comes back as it was)."""
    causes = [cause for cause, _ in error.failures.values()] if isinstance(error, CheckpointException) else [error]
    for cause in causes:
        if isinstance(cause, ConfigError):
            return cause
    cause = causes[0] if causes else error
    text = " ".join(f"{type(cause).__name__}: {cause}".split())[:200]
    return ConfigError(f"checkpoint {path} is corrupt: reading its tensors failed ({text}): use another checkpoint")


def load_checkpoint(path: str | os.PathLike, rank, cfg, verify: bool = True) -> dict:
    """Fill this rank's weights, masters and moments from the checkpoint at `path`; every rank calls it.

    Returns the saved non-tensor state: step (the next step to run), optimizer_steps,
    scaler, precision, model, layout, config, extra, and rank_state_restored (RNG and
    fp8 histories, restored only when the layout is the same). ConfigError for a missing,
    incomplete, truncated or corrupt checkpoint, or one of another model shape.
    `verify`: hash every file against its checksum first (False where the launching process
    already did, before any worker started: parallel/run/train.py).
    """
    path = Path(path)
    state = read_state(path, cfg, verify=verify)
    metadata = read_metadata(path)
    shapes = global_shapes(cfg.model)
    separate = all(KEYS["master"] + name in metadata.state_dict_metadata for name in shapes)
    sources = {"master": KEYS["master"] if separate else KEYS["model"], "exp_avg": KEYS["exp_avg"],
               "exp_avg_sq": KEYS["exp_avg_sq"]}
    wanted = {prefix + name: shape for role, prefix in sources.items() for name, shape in shapes.items()
              if keeps_role(cfg, name, role)}
    check_tensors(path, metadata, wanted | {BUFFER + name: shape for name, shape in saved_buffers(cfg.model).items()})

    optimizer = rank.optimizer
    with torch.no_grad():
        for tensor in (*optimizer.master_pieces, optimizer.exp_avg, optimizer.exp_avg_sq):
            tensor.zero_()  # padding, and anything no box covers, stays zero
        targets = {
            prefix + placement.name: _boxes(optimizer, placement, role)
            for placement in rank_placements(rank, cfg)
            for role, prefix in sources.items()
            if keeps_role(cfg, placement.name, role)
        } | {BUFFER + name: tensor for name, tensor in stage_buffers(rank.stage).items()}
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)  # DCP's notes on single-process use
                dcp.load(targets, storage_reader=SafeReader(path), planner=TensorsOnlyLoadPlanner(),
                         no_dist=not _distributed())
        except (Exception, CheckpointException) as error:  # CheckpointException: every rank's failure
            raise _one_line(path, error) from None
        if not optimizer.masters_are_weights:
            for piece, master in zip(optimizer.pieces, optimizer.master_pieces):
                piece.copy_(master)  # the compute weights, as every optimizer step leaves them
    optimizer.steps = state["optimizer_steps"]
    saved_scaler = state.get("scaler")
    if rank.scaler is not None and isinstance(saved_scaler, dict) and saved_scaler.get("dynamic") == rank.scaler.dynamic:
        rank.scaler.load_state_dict(saved_scaler)  # a scaler of the other kind (static vs dynamic) starts afresh
    rank.data_parallel.after_update()  # ZeRO 1 and 2: all-gather the weights this rank does not own
    restored = {"ep": 1, **state["layout"]} == _layout(cfg)  # written before "ep" was recorded: ep 1
    if restored:
        try:
            own = json.loads((path / rank_file_name(rank.mesh.rank)).read_text(encoding="utf-8"))
            _restore_rank_state(rank, own)
        except Exception as error:  # whatever the file holds in place of RNG states and fp8 histories
            text = " ".join(f"{type(error).__name__}: {error}".split())[:200]
            raise ConfigError(f"checkpoint {path} is corrupt: {rank_file_name(rank.mesh.rank)} ({text})") from None
    _barrier()
    return {**{key: state.get(key) for key in
               ("step", "optimizer_steps", "scaler", "precision", "model", "layout", "config", "extra")},
            "path": str(path), "rank_state_restored": restored}


# ---------------------------------------------------------------------------- inspection


def gather_global_state(rank, cfg) -> dict[str, torch.Tensor]:
    """Every global tensor of the checkpoint's roles, in fp32, on every rank (all-reduced: tests and debugging).

    Keys "model.<name>", "master.<name>" (the weights when there are no separate masters),
    "exp_avg.<name>", "exp_avg_sq.<name>". Memory: the whole model four times, on every rank.
    """
    optimizer = rank.optimizer
    placements = {p.name: p for p in rank_placements(rank, cfg) if p.writes}
    shapes = global_shapes(cfg.model)
    total = len(ROLES) * sum(torch.Size(shape).numel() for shape in shapes.values())
    buffer = torch.zeros(total, dtype=torch.float32, device=rank.mesh.device)
    found, offset = {}, 0
    for name, shape in shapes.items():
        for role in ROLES:
            full = buffer[offset : offset + torch.Size(shape).numel()].view(shape)
            offset += full.numel()
            if name in placements and keeps_role(cfg, name, role):
                for offsets, tensor in _boxes(optimizer, placements[name], role).pieces:
                    full[tuple(slice(o, o + s) for o, s in zip(offsets, tensor.shape))] = tensor.float()
            found[f"{role}.{name}"] = full
    if _distributed():
        dist.all_reduce(buffer)  # each element written by exactly one rank
    return found
