"""A table of bad inputs: each gives exit code 2, one line on stderr, no traceback, and writes nothing.

Covers `train`, `simulate`, `compare`, `calibrate`, `sample`, `plan`, `claims` and `schedule`, and torchrun's
variables set only in part, or to values no rank could use (a rank whose peers never come: tests/test_torchrun_env.py).
Cases that need files get them from the fixture: a malformed topology, malformed and
unknown-key TOML configs, a binary data file, and a real checkpoint that is then truncated,
has a byte flipped, or is resumed with another model shape; run directories that are
another run's, hold other files, link out of themselves, or are locked by a live run.
"""

import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from cli.main import main
from parallel.run.directory import RunClaim
from simulator.costs.hardware import load_hardware, save_hardware

SMALL = ["--layers", "1", "--seq-len", "32", "--batch-size", "4"]
HARDWARE_PRESETS = Path(__file__).parent.parent / "simulator" / "costs" / "hardware.json"


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("bad-inputs")
    (root / "topology.json").write_text('{"nodes": [{"id": "gpu0"}]}')
    (root / "topology.graphml").write_text("<graphml><broken")
    (root / "topology.txt").write_text("gpu0 -- gpu1")
    (root / "broken.toml").write_text("steps = = 3")
    (root / "unknown.toml").write_text("stepz = 3")
    (root / "nested.toml").write_text("[model]\nlayers = 2")
    (root / "binary.txt").write_bytes(b"\xff\xfe\x00" * 400)
    (root / "short.txt").write_text("to be")
    (root / "presets.json").write_text(HARDWARE_PRESETS.read_text())  # four GPUs: not one profile
    save_hardware(load_hardware("a100-80gb"), root / "profile.json")
    (root / "empty.txt").write_text("")
    run = root / "run"
    result = CliRunner().invoke(main, ["train", *SMALL, "--steps", "2", "--save-every", "2", "--out", str(run)])
    assert result.exit_code == 0, result.output
    truncated = root / "truncated"
    shutil.copytree(run, truncated)
    checkpoint = truncated / "checkpoints" / "step-000002"
    data = sorted(p for p in checkpoint.iterdir() if p.suffix == ".distcp")[0]
    data.write_bytes(data.read_bytes()[:10])
    flipped = root / "flipped"
    shutil.copytree(run, flipped)
    data = next((flipped / "checkpoints" / "step-000002").glob("*.distcp"))
    changed = bytearray(data.read_bytes())
    changed[len(changed) // 2] ^= 0x01  # one bit, the size kept
    data.write_bytes(bytes(changed))
    linked = root / "linked"
    shutil.copytree(run, linked)
    (linked / "metrics.jsonl").unlink()
    (linked / "metrics.jsonl").symlink_to(root / "short.txt")  # out of the run directory
    (root / "foreign").mkdir()
    (root / "foreign" / "notes.txt").write_text("not a run's")
    (root / "foreign" / "config.json").write_text("{}")
    claim = RunClaim(root / "locked", resume=False, overwrite=False)
    claim.take()  # held as a live run holds it, until the module's cases are done
    yield root
    claim.release()


CASES = [
    # train: the model and the run
    ("train", ["--model", "gpt5"], "gpt5"),
    ("train", ["--layers", "-2"], "--layers must be a positive integer"),
    ("train", ["--heads", "5"], "does not divide"),
    ("train", ["--d-model", "0"], "--d-model must be a positive integer"),
    ("train", ["--vocab-size", "255"], "vocab"),
    ("train", ["--dropout", "1.5"], "dropout"),
    ("train", ["--steps", "0"], "steps"),
    ("train", ["--batch-size", "-4"], "--global-batch must be a positive integer"),
    ("train", ["--seq-len", "0"], "--seq-len must be a positive integer"),
    ("train", ["--lr", "0"], "lr"),
    ("train", ["--min-lr", "1", "--lr", "0.1"], "min_lr"),
    ("train", ["--lr-schedule", "step"], "--lr-schedule"),
    ("train", ["--lr-schedule", "wsd", "--decay-fraction", "0"], "decay_fraction must be a number in (0, 1]"),
    ("train", ["--decay-fraction", "nan"], "decay_fraction"),
    ("train", ["--seed", "-1"], "seed"),
    ("train", ["--seed", "99999999999999999999999"], "--seed must be an integer from 0 to 2**64 - 1"),
    ("train", ["--seed", str(2**64)], "--seed must be an integer from 0 to 2**64 - 1"),
    ("train", ["--precision", "fp4"], "fp4"),
    ("train", ["--precision", "fp16", "--loss-scale", "-8"], "loss scale"),
    # train: data
    ("train", ["--data", "{root}/missing.txt"], "does not exist"),
    ("train", ["--data", "{root}/binary.txt"], "not UTF-8"),
    ("train", ["--data", "{root}/short.txt"], "needs at least"),
    ("train", ["--data", "{root}/empty.txt"], "needs at least"),
    # train: layouts
    ("train", ["--dp", "0"], "--dp"),
    ("train", ["--zero", "5"], "--zero"),
    ("train", ["--zero", "3", "--dp", "1"], "nothing would be sharded"),
    ("train", ["--tp", "3"], "does not divide"),
    ("train", ["--pp", "16"], "cannot fill"),
    ("train", ["--dp", "3", "--batch-size", "8"], "divisible"),
    ("train", ["--pp", "2", "--schedule", "interleaved", "--micro-batches", "3", "--batch-size", "6"], "multiple"),
    ("train", ["--schedule", "pipedream"], "unknown schedule"),
    ("train", ["--device", "cuda"], "CUDA"),
    ("train", ["--bucket-mb", "-1"], "bucket"),
    ("train", ["--bucket-mb", "nan"], "bucket"),
    ("train", ["--tp", "0"], "--tp"),
    ("train", ["--pp", "-1"], "--pp"),
    ("train", ["--virtual-chunks", "0"], "virtual"),
    ("train", ["--pp", "2", "--stage-layers", "1,2"], "adds up to 3 blocks but the model has 1"),
    ("train", ["--pp", "2", "--stage-layers", "1,1,2"], "gives 3 chunk(s) but pp x virtual chunks = 2"),
    ("train", ["--pp", "2", "--stage-layers", "4*x"], "whole numbers of blocks"),
    ("train", ["--pp", "3", "--stage-layers", "0,0,1"], "only the first chunk"),
    ("train", ["--threads-per-rank", "0"], "threads per rank"),
    ("train", ["--threads-per-rank", "1000000"], "threads per rank must be at most 1024"),
    ("train", ["--eval-batches", "0"], "eval batches"),
    ("train", ["--weight-decay", "-0.1"], "weight_decay"),
    ("train", ["--grad-clip", "nan"], "grad_clip"),
    ("train", ["--warmup", "-3"], "warmup"),
    ("train", ["--eval-every", "-1"], "eval_every"),
    ("train", ["--save-every", "-2"], "--save-every"),
    ("train", ["--max-restarts", "-1", "--dp", "2", "--save-every", "2"], "--max-restarts must be a whole number >= 0"),
    ("train", ["--max-restarts", "2", "--dp", "2"], "give --save-every N"),
    ("train", ["--max-restarts", "2", "--save-every", "2"], "needs a layout of more than one process"),
    ("train", ["--precision", "fp16", "--loss-scale", "lots"], "loss"),
    ("train", ["--loss-scale-window", "0"], "loss scale window"),
    ("train", ["--tp", "2", "--sequence-parallel", "--seq-len", "33"], "sequence parallelism"),
    # train: context parallelism (SMALL's sequence is 32 tokens)
    ("train", ["--cp", "3"], "equal chunks"),
    ("train", ["--cp", "32"], "chunks of at least one token"),
    ("train", ["--cp", "0"], "--cp"),
    ("train", ["--cp", "2", "--cp-kind", "mesh"], "--cp-kind must be one of ring, allgather"),
    ("train", ["--cp-kind", "allgather"], "--cp-kind says how context-parallel ranks exchange keys and values"),
    # train: FSDP's settings (cli/options/fsdp.py)
    ("train", ["--dp", "4", "--zero", "3", "--shard-group", "3"], "--shard-group 3 does not divide the data-parallel"),
    ("train", ["--no-reshard-after-forward"], "--no-reshard-after-forward keeps ZeRO-3's gathered weights"),
    ("train", ["--dp", "2", "--zero", "2", "--no-reshard-after-forward"], "needs --zero 3, not --zero 2"),
    ("train", ["--dp", "2", "--zero", "3", "--sync-grads-once"], "needs --zero 3 --no-reshard-after-forward"),
    ("train", ["--dp", "2", "--shard-group", "2"], "needs --zero 1, 2 or 3"),
    ("train", ["--dp", "4", "--zero", "3", "--shard-group", "1"], "shards over one rank"),
    ("train", ["--dp", "4", "--zero", "3", "--shard-group", "-2"], "--shard-group must be a positive integer"),
    ("train", ["--cp", "4", "--tp", "16", "--sequence-parallel"], "does not divide"),
    ("train", ["--cp", "2", "--tp", "4", "--sequence-parallel", "--seq-len", "36"], "sequence parallelism cuts each "
     "context-parallel rank's 18 tokens"),
    ("train", ["--d-ff", "0"], "--d-ff must be a positive integer"),
    ("train", ["--rope-theta", "inf", "--positions", "rope"], "rope_theta"),
    # train: config files and checkpoints
    ("train", ["--config", "{root}/broken.toml"], "not valid TOML"),
    ("train", ["--config", "{root}/unknown.toml"], "stepz"),
    ("train", ["--config", "{root}/nested.toml"], "model"),
    ("train", ["--config", "{root}/none.toml"], "does not exist"),
    ("train", ["--resume", "--out", "{root}/nowhere"], "no complete checkpoint"),
    ("train", ["--resume", "--out", "{root}/truncated"], "truncated"),
    ("train", ["--resume", "--out", "{root}/run", "--layers", "2"], "layers"),
    # train: the run directory (parallel/run/directory.py) and checked checkpoints
    ("train", ["--out", "{root}/run"], "is not empty"),
    ("train", ["--out", "{root}/run", "--resume", "--overwrite"], "give one of them"),
    ("train", ["--out", "{root}/foreign", "--overwrite"], "notes.txt"),
    ("train", ["--out", "{root}/locked"], "in use by another minigpt run"),
    ("train", ["--out", "{root}/locked", "--overwrite"], "in use by another minigpt run"),
    ("train", ["--out", "{root}/locked", "--resume"], "in use by another minigpt run"),
    ("train", ["--resume", "--out", "{root}/flipped"], "verifies"),
    ("train", ["--resume", "{root}/flipped/checkpoints/step-000002"], "sha256"),
    ("train", ["--resume", "{root}/flipped/checkpoints/step-000002", "--dp", "2"], "sha256"),
    ("train", ["--resume", "{root}/flipped/checkpoints/step-000002", "--zero", "1"], "sha256"),
    ("train", ["--resume", "{root}/run/checkpoints/step-000009", "--out", "{root}/run"], "does not exist"),
    ("train", ["--resume", "{root}/run/checkpoints", "--out", "{root}/run"], "is not a checkpoint"),
    ("train", ["--resume", "--out", "{root}/linked"], "symlink"),
    ("train", ["--out", "/proc/minigpt-run"], "not writable"),
    ("train", ["--out", "{root}/short.txt/run"], "not a directory"),
    ("train", ["--out", ""], "--out is empty"),
    ("train", ["--out", "{root}/" + "a" * 300 + "/run"], "is too long for a file system, a name of 300 bytes"),
    ("train", ["--out", "{root}/" + "a/" * 2100], "is too long for a file system, 4"),
    ("calibrate", ["--out", "c" * 300 + ".json"], "is too long for a file system, a name of 305 bytes"),
    ("sample", ["--out", "s" * 256], "is too long for a file system, a name of 256 bytes"),
    ("train", ["--out", "  "], "--out is blank"),
    ("train", ["--data", ""], "--data is empty"),
    # simulate
    ("simulate", ["--gpu", "tpu-v9"], "tpu-v9"),
    ("simulate", ["--tp", "8", "--pp", "2", "--dp", "2", "--nodes", "1"], "GPUs"),
    ("simulate", ["--tp", "16"], "server"),
    ("simulate", ["--pp", "4", "--stage-layers", "30*4"], "adds up to 120 blocks but the model has 96"),
    ("simulate", ["--pp", "4", "--stage-layers", "-1,97"], "blocks >= 0"),
    ("simulate", ["--sweep", "--gpus", "8,16", "--global-batch", "64", "--stage-layers", "48,48"], "--stage-layers"),
    ("simulate", ["--topology", "{root}/topology.json"], "topology"),
    ("simulate", ["--topology", "{root}/topology.graphml"], "topology"),
    ("simulate", ["--topology", "{root}/topology.txt"], "topology"),
    ("simulate", ["--layers", "-1"], "layers"),
    ("simulate", ["--micro-batch", "0"], "micro"),
    ("simulate", ["--kv-heads", "0"], "--kv-heads must be a positive integer"),
    ("simulate", ["--gpus-per-node", "0"], "--gpus-per-node"),
    ("simulate", ["--oversubscription", "0.5"], "oversubscription"),
    ("simulate", ["--precision", "fp4"], "fp4"),
    ("simulate", ["--micro-batch-size", "-2"], "micro"),
    ("simulate", ["--zero", "7"], "7"),
    ("simulate", ["--config", "{root}/unknown.toml"], "stepz"),
    # the model's shape: one vocabulary in train, simulate and compare (minigpt/config.py checks it)
    ("train", ["--model", "tiny-llama", "--kv-heads", "3"], "n_kv_heads=3 does not divide n_heads=4"),
    ("train", ["--model", "tiny-llama", "--tp", "4"], "does not divide the 2 key/value heads"),
    ("train", ["--model", "tiny-llama", "--heads", "16", "--d-model", "48"], "even head width"),
    ("train", ["--kv-heads", "0"], "--kv-heads must be a positive integer"),
    ("train", ["--mlp", "relu"], "relu"),
    ("train", ["--positions", "rope", "--rope-theta", "0.5"], "rope_theta"),
    ("train", ["--recompute", "op"], "simulated only"),
    ("train", ["--watchdog", "-1"], "--watchdog must be a number of seconds >= 0"),
    ("train", ["--watchdog", "nan"], "--watchdog must be a number of seconds >= 0"),
    ("train", ["--watchdog", "1"], "shorter than two heartbeats"),
    ("train", ["--model", "llama3-405b", "--batch-size", "1"], "GiB of RAM"),
    ("train", ["--model", "gpt3-175b", "--tp", "2", "--layers", "4", "--batch-size", "2"], "GiB of RAM"),
    ("train", ["--micro-batch-size", "3"], "--micro-batch-size 3 does not divide the global batch 4"),
    ("train", ["--micro-batches", "4", "--micro-batch-size", "2"], "give one of the two"),
    ("simulate", ["--micro-batches", "4"], "needs a fixed dp and --global-batch"),
    ("simulate", ["--global-batch", "64", "--micro-batches", "3", "--dp", "4"], "does not divide the global batch 64"),
    ("compare", ["--hardware", "{root}/profile.json", "--micro-batch-size", "5"], "does not divide"),
    ("compare", ["--hardware", "{root}/profile.json", "--dp", "4", "--zero", "3", "--shard-group", "3"],
     "--shard-group 3 does not divide"),
    ("compare", ["--hardware", "{root}/profile.json", "--dp", "2", "--no-reshard-after-forward"], "needs --zero 3"),
    ("train", ["--recompute", "sometimes"], "--recompute must be none, selective or full"),
    ("simulate", ["--model", "llama3-70b", "--kv-heads", "5"], "n_kv_heads=5 does not divide n_heads=64"),
    ("simulate", ["--model", "llama3-70b", "--tp", "16", "--gpus-per-node", "16"], "does not divide the 8 key/value"),
    ("simulate", ["--model", "llama3-8b", "--d-model", "4128"], "even head width"),
    ("simulate", ["--model", "llama4"], "unknown model preset"),
    ("simulate", ["--norm", "batchnorm"], "batchnorm"),
    ("compare", ["--hardware", "{root}/profile.json", "--model", "tiny-llama", "--kv-heads", "3"], "does not divide"),
    ("compare", ["--hardware", "{root}/profile.json", "--model", "tiny-llama", "--tp", "4"], "key/value heads"),
    ("compare", ["--hardware", "{root}/profile.json", "--recompute", "op"], "simulated only"),
    # compare
    ("compare", ["--hardware", "{root}/none.json"], "does not exist"),
    ("compare", ["--hardware", "{root}/topology.json"], "topology.json"),
    ("compare", [], "--hardware"),
    ("compare", ["--hardware", "{root}/presets.json"], "one GPU"),
    ("compare", ["--hardware", "{root}/profile.json", "--dp", "128", "--batch-size", "128"], "do not fit"),
    ("compare", ["--hardware", "{root}/profile.json", "--steps", "0"], "steps"),
    ("compare", ["--hardware", "{root}/profile.json", "--micro-batches", "0"], "--micro-batches"),
    ("compare", ["--hardware", "{root}/profile.json", "--global-batch", "0"], "--global-batch"),
    ("compare", ["--hardware", "{root}/profile.json", "--model", "tiny-llama", "--positions", "nowhere"], "nowhere"),
    ("compare", ["--hardware", "{root}/profile.json", "--out", "{root}/run"], "is not empty"),
    ("compare", ["--hardware", "{root}/profile.json", "--out", "{root}/locked"], "in use by another minigpt run"),
    ("compare", ["--hardware", "{root}/profile.json", "--out", ""], "--out is empty"),
    ("compare", ["--hardware", "{root}/profile.json", "--matrix", "--out", " "], "--out is blank"),
    ("compare", ["--hardware", "{root}/profile.json", "--threads-per-rank", "1000000"], "at most 1024"),
    # calibrate
    ("calibrate", ["--ranks", "0", "--out", "{root}/profile.json"], "--ranks"),
    ("calibrate", ["--ranks", "4", "--cp", "8", "--out", "{root}/profile-new.json"], "from 2 to --ranks (4)"),
    ("calibrate", ["--cp", "2,x", "--out", "{root}/profile-new.json"], "--cp must be comma-separated integers"),
    ("calibrate", ["--out", "{root}"], "directory"),
    ("calibrate", ["--out", "{root}/profile.txt"], ".json"),
    ("calibrate", ["--out", "{root}/missing/profile.json"], "does not exist"),
    ("calibrate", ["--out", ""], "--out is empty"),
    ("calibrate", ["--out", "{root}/short.txt/profile.json"], "is not a directory"),
    ("calibrate", ["--out", "{root}/profile-new.json", "--threads-per-rank", "1000000"], "at most 1024"),
    # sample: the run it reads, and the seed
    ("sample", ["--out", ""], "--out is empty"),
    ("sample", ["--checkpoint", " "], "--checkpoint is blank"),
    ("sample", ["--out", "{root}/run", "--seed", "99999999999999999999999"], "2**64 - 1"),
    ("sample", ["--out", "{root}/run", "--seed", "-1"], "--seed must be an integer from 0"),
    # plan: an empty name is not the default
    ("plan", ["--gpus", "8", "--hardware", ""], "--hardware is empty"),
    ("plan", ["--gpus", "8", "--gpu", " "], "--gpu is blank"),
    # plan: a format the GPU has no tensor cores for, before the search (not "no layout fits")
    ("plan", ["--model", "llama3-70b", "--gpus", "8", "--gpu", "a100-80gb", "--precision", "fp8"],
     "has no fp8 tensor cores"),
    # claims
    ("claims", ["--only", "nope"], "unknown claim 'nope'"),
    ("claims", ["--only", "swamping", "--markdown", "{root}/claims.md"], "drop --only"),
    ("claims", ["--markdown", ""], "--markdown is empty"),
    ("claims", ["--markdown", "{root}/missing/claims.md"], "does not exist"),
    ("claims", ["--markdown", "{root}"], "is a directory"),
    # schedule
    ("schedule", ["--pp", "0"], "pipeline size"),
    ("schedule", ["--schedule", "zigzag"], "zigzag"),
    ("schedule", ["--pp", "4", "--micro-batches", "6", "--schedule", "interleaved"], "multiple"),
]


@pytest.mark.parametrize("command,args,expected", CASES, ids=[f"{c} {' '.join(a)}" for c, a, _ in CASES])
def test_bad_input_is_one_line_and_exit_2(files, tmp_path, command, args, expected):
    args = [arg.replace("{root}", str(files)) for arg in args]
    before = sorted(p.name for p in files.rglob("*"))
    out = ["--out", str(tmp_path / "never")] if command == "train" and "--out" not in args else []
    result = CliRunner().invoke(main, [command, *(SMALL if command == "train" else []), *args, *out])
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("minigpt: error:"), result.stderr
    assert expected.lower() in lines[0].lower(), lines[0]
    assert "Traceback" not in result.output
    assert not (tmp_path / "never").exists()
    assert sorted(p.name for p in files.rglob("*")) == before  # nothing written next to the inputs


def test_an_out_the_system_will_not_make_is_refused(tmp_path):
    """check_writable asks the system (it makes and removes a probe directory), so that the refusal holds for root,
    whom os.access and permission bits never stop: under a regular file no one can make a directory (ENOTDIR)."""
    blocker = tmp_path / "a-file"
    blocker.write_text("kept")
    result = CliRunner().invoke(main, ["train", *SMALL, "--out", str(blocker / "run" / "deeper")])
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "is not writable (its nearest existing parent" in lines[0], result.stderr
    assert "Not a directory" in lines[0] and "Traceback" not in result.output
    assert blocker.read_text() == "kept" and sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]


TORCHRUN_ENVIRONMENT = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": "29555"}
PART_OF_IT = [("RANK", "WORLD_SIZE"), ("MASTER_ADDR",), ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")]
COMMANDS = {"train": ["train", *SMALL, "--steps", "2"], "compare": ["compare", "--hardware", "PROFILE"],
            "calibrate": ["calibrate", "--quick"]}


@pytest.mark.parametrize("command", list(COMMANDS))
@pytest.mark.parametrize("given", PART_OF_IT, ids=["+".join(names) for names in PART_OF_IT])
def test_torchrun_variables_set_in_part_are_refused(files, tmp_path, monkeypatch, command, given):
    for name in TORCHRUN_ENVIRONMENT:
        monkeypatch.delenv(name, raising=False)
    for name in given:
        monkeypatch.setenv(name, TORCHRUN_ENVIRONMENT[name])
    out = tmp_path / ("profile.json" if command == "calibrate" else "run")
    args = [arg.replace("PROFILE", str(files / "profile.json")) for arg in COMMANDS[command]]
    result = CliRunner().invoke(main, [*args, "--out", str(out)])
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("minigpt: error: torchrun's variables are set only in part"), lines
    missing = [name for name in TORCHRUN_ENVIRONMENT if name not in given]
    assert f"({', '.join(given)} set, {', '.join(missing)} not)" in lines[0]
    assert "unset RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT to run on this machine" in lines[0]
    assert "Traceback" not in result.output and not out.exists()


@pytest.mark.parametrize("name, value, expected", [
    ("RANK", "2", "RANK='2' must be an integer from 0 to 1"),
    ("WORLD_SIZE", "two", "WORLD_SIZE='two' must be an integer >= 1"),
    ("MASTER_PORT", "70000", "MASTER_PORT='70000' must be an integer from 1 to 65535"),
    ("MASTER_ADDR", " ", "MASTER_ADDR is empty"),
    ("MINIGPT_RENDEZVOUS_TIMEOUT", "soon", "MINIGPT_RENDEZVOUS_TIMEOUT must be a number of seconds > 0"),
])
def test_torchrun_variables_that_no_rank_could_use_are_refused(tmp_path, monkeypatch, name, value, expected):
    for variable, setting in {**TORCHRUN_ENVIRONMENT, name: value}.items():
        monkeypatch.setenv(variable, setting)
    result = CliRunner().invoke(main, ["train", *SMALL, "--steps", "2", "--out", str(tmp_path / "run")])
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and expected in lines[0], lines
    assert not (tmp_path / "run").exists()


def test_the_table_is_long_enough():
    assert len(CASES) >= 30


@pytest.mark.parametrize("value", [0, -3, True, 2.0, "4", None])
def test_every_positive_integer_setting_is_checked_by_one_function(value):
    from job.train_config import TrainConfig
    from minigpt.errors import ConfigError, check_positive_int
    from job.layout import Layout

    with pytest.raises(ConfigError, match=rf"^--ranks must be a positive integer, got {value!r}$"):
        check_positive_int("--ranks", value)
    with pytest.raises(ConfigError, match="^steps must be a positive integer"):  # True was accepted as 1
        TrainConfig(steps=value)
    with pytest.raises(ConfigError, match="^pp must be a positive integer"):
        Layout(pp=value)
    assert check_positive_int("--ranks", 3) == 3


def test_one_bucket_size_conversion_for_executor_and_simulator():
    from job.train_config import bucket_numel

    assert bucket_numel(25.0, 4) == 25 * 2**20 // 4
    assert bucket_numel(1.0, 2) == 2**19
    assert bucket_numel(1e-9, 4) == 1  # never an empty bucket


def test_loss_scale_flags_on_a_format_that_scales_nothing_are_refused():
    """--loss-scale / --loss-scale-window only scale fp16's loss; on bf16 or fp32 they were dropped silently."""
    from click.testing import CliRunner

    from cli.main import main

    for args, flag in ((["--precision", "bf16", "--loss-scale", "1024"], "--loss-scale"),
                       (["--precision", "fp32", "--loss-scale-window", "10"], "--loss-scale-window")):
        result = CliRunner().invoke(main, ["train", *args, "--steps", "1"])
        assert result.exit_code == 2, result.output
        assert f"{flag} scales fp16's loss" in result.output, result.output


def test_a_command_stopped_by_a_signal_says_what_it_leaves():
    """SIGTERM or Ctrl-C: train's line says its checkpoints are kept; every other command checkpoints nothing, so
    its line says only that it did not finish (a stopped plan once spoke of checkpoints and --resume)."""
    from cli.main import STOPPED, stopped

    assert stopped(["train", "--steps", "5"]) == STOPPED and stopped(["--config", "x.toml"]) == STOPPED
    assert stopped(["plan", "--model", "llama3-70b"]) == "minigpt plan ended before it finished"
    assert stopped(["simulate", "--sweep"]) == "minigpt simulate ended before it finished"


def test_sigterm_stops_a_plan_in_one_line():
    """A long search (Llama 3 70B at 128K tokens on 256 B200s: minutes) stopped by a scheduler's SIGTERM: exit 143,
    one line naming the signal and the command, no traceback."""
    import signal
    import subprocess
    import sys
    import time

    process = subprocess.Popen([sys.executable, "-m", "cli", "plan", "--model", "llama3-70b", "--gpus", "256",
                                "--global-batch", "1024", "--seq-len", "131072", "--gpu", "b200"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        time.sleep(6)  # past the imports, inside the search
        assert process.poll() is None, "the search ended before the signal"
        process.send_signal(signal.SIGTERM)
        _, stderr = process.communicate(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 128 + signal.SIGTERM, stderr[-1000:]
    assert stderr.strip() == "minigpt: stopped by SIGTERM: minigpt plan ended before it finished", stderr[-1000:]


def test_a_signal_inside_a_simulation_is_the_same_stop():
    """A SIGTERM that lands inside SimPy's replay (simulate, plan) reaches the CLI as the same Interrupted: SimPy
    re-raises an exception as type(error)(*error.args), which once failed on Interrupted's message (a traceback)."""
    import pickle
    import signal

    import simpy

    from minigpt.errors import Interrupted

    def stopped_here(env):
        yield env.timeout(1)
        raise Interrupted(signal.SIGTERM)

    env = simpy.Environment()
    env.process(stopped_here(env))
    with pytest.raises(Interrupted) as caught:
        env.run()
    assert caught.value.signal_number == signal.SIGTERM and str(caught.value) == "stopped by SIGTERM"
    assert pickle.loads(pickle.dumps(caught.value)).signal_number == signal.SIGTERM
