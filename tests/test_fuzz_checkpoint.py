"""Property-based fuzzing of a checkpoint's metadata: whatever its state.json, COMPLETE marker, rank file or
DCP .metadata hold, every reader gives a result or one ConfigError, never another exception.

A real checkpoint of one process is saved once; each example damages one of its files (arbitrary bytes, a
valid file cut short or with bytes overwritten, or the valid JSON with wrong values in its real fields) and
then reseals it: the checksums are recomputed as if the save had written those bytes, so the damage gets
past the sha256 check (which a plain flip never would) and reaches the parser behind it. Readers: the
launching process's (`--resume`: resume_point, continue_settings; `minigpt sample`'s newest-valid search),
a rank's load (load_checkpoint into a live one-process rank) and sample's load_model.
"""

from __future__ import annotations

import hashlib
import json
import shutil

import pytest
import torch
from hypothesis import event, given, settings, strategies as st

from fuzzing import PARSER_EXAMPLES, SCALE, any_bytes, broken_documents, paths
from minigpt.config import GPTConfig
from minigpt.data import Corpus
from minigpt.errors import ConfigError
from parallel.run.build import build_rank
from parallel.checkpoint.sharded import load_checkpoint, save_checkpoint
from parallel.checkpoint.files import MARKER, STATE_FILE, rank_file_name
from parallel.mesh import build_mesh
from parallel.run.resume import continue_settings, resume_point
from parallel.run.sample import find_checkpoint, load_model
from parallel.run.train import micro_batches
from job.train_config import TrainConfig
from precision.policy import policy as precision_policy

MODEL = GPTConfig(seq_len=16, n_layers=1, n_heads=2, d_model=16, d_ff=32)
CFG = TrainConfig(model=MODEL, steps=4, global_batch=2, eval_every=0, eval_batches=1, device="cpu", save_every=1)
LOAD_EXAMPLES = int(150 * SCALE)  # each loads tensors through DCP into a live rank
LAUNCHER = settings(settings.get_profile("fuzz-parsers"), max_examples=PARSER_EXAMPLES)
LOADER = settings(settings.get_profile("fuzz-parsers"), max_examples=LOAD_EXAMPLES)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A one-process rank after one step, its checkpoint, and the checkpoint's files as saved."""
    torch.manual_seed(0)
    device = torch.device("cpu")
    rank = build_rank(CFG, build_mesh(1, 1, 1, device), device, precision_policy(CFG.precision))
    inputs, targets = micro_batches(Corpus.load(None, MODEL.seq_len), CFG, 0, rank.mesh, device)
    rank.train_step(CFG, 0, inputs, targets)
    path = save_checkpoint(tmp_path_factory.mktemp("saved") / "checkpoints", rank, CFG, 1)
    files = {entry.name: entry.read_bytes() for entry in path.iterdir()}
    return Saved(rank, path, files)


class Saved(tuple):
    """(rank, path, files), shown in a failing example's report by its path alone."""

    def __new__(cls, rank, path, files):
        return super().__new__(cls, (rank, path, files))

    def __repr__(self) -> str:
        return f"Saved({self[1]})"


STATE_DOCUMENT_NAMES = (STATE_FILE, MARKER, rank_file_name(0))


def write_damaged(saved, work, name: str, content: bytes) -> object:
    """A copy of the checkpoint with `name` holding `content`, resealed: state.json lists every other file's
    new size and sha256 (when it still parses as a dict with a files dict) and the marker the sha256 of
    state.json (unless the marker itself is the file damaged)."""
    _, path, files = saved
    target = work / "checkpoints" / path.name
    if target.parent.exists():
        shutil.rmtree(target.parent)
    target.mkdir(parents=True)
    for file, data in files.items():
        (target / file).write_bytes(content if file == name else data)
    if name != STATE_FILE:
        state = json.loads(files[STATE_FILE])
        state["files"] = {file: {"bytes": (target / file).stat().st_size,
                                 "sha256": hashlib.sha256((target / file).read_bytes()).hexdigest()}
                          for file in state["files"]}
        (target / STATE_FILE).write_text(json.dumps(state))
    if name != MARKER:
        marker = json.loads(files[MARKER])
        marker["state_sha256"] = hashlib.sha256((target / STATE_FILE).read_bytes()).hexdigest()
        (target / MARKER).write_text(json.dumps(marker))
    return target


@st.composite
def damage(draw, files: dict, names: tuple[str, ...]) -> tuple[str, bytes]:
    """One file of `names` and what it holds instead: bytes for any file, broken documents for the JSON ones."""
    name = draw(st.sampled_from(names))
    if name in STATE_DOCUMENT_NAMES and draw(st.booleans()):
        document = json.loads(files[name])
        return name, draw(broken_documents(document, paths(document)[1:])).encode("utf-8", "surrogatepass")
    return name, draw(any_bytes(files[name]))


def refused_or(read) -> None:
    try:
        read()
    except ConfigError as error:
        assert str(error).strip() and "\n" not in str(error).strip(), repr(str(error))
        event("refused")
        return
    event("accepted")


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("fuzz-checkpoint")


@LAUNCHER
@given(data=st.data())
def test_the_launchers_readers_refuse_any_metadata_in_one_line(saved, work, data):
    name, content = data.draw(damage(saved[2], STATE_DOCUMENT_NAMES))
    path = write_damaged(saved, work, name, content)
    cfg = TrainConfig(model=MODEL, steps=3, global_batch=2, eval_every=0, device="cpu", resume=True,
                      out_dir=str(path.parent.parent))

    def resume():
        point = resume_point(cfg, path if data.draw(st.booleans()) else None)
        point.resuming_line(cfg.steps), point.nothing_to_do(cfg.steps), point.skipped_line()
        continue_settings(cfg, point, save_every_given=False)

    refused_or(resume)
    refused_or(lambda: find_checkpoint(out=str(path.parent.parent)))


@LOADER
@given(data=st.data())
def test_a_rank_and_sample_load_any_metadata_or_refuse_it(saved, work, data):
    rank, _, files = saved
    names = (*STATE_DOCUMENT_NAMES, ".metadata")
    name, content = data.draw(damage(files, names))
    path = write_damaged(saved, work, name, content)
    refused_or(lambda: load_checkpoint(path, rank, CFG))
    refused_or(lambda: load_model(path))
