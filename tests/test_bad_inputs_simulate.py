"""A table of bad inputs to `minigpt simulate` (and the files every command reads): each gives exit code 2,
one line on stderr, no traceback, and writes nothing; the refusals of oversized jobs come at once.

Two kinds of rows: jobs beyond simulator/limits.py's stated size (GPUs, layers, schedule slots, sweep points,
topology files), refused before anything is built; and files the parsers once traced back on (topologies
that are not UTF-8, nested deeply or of the wrong JSON types, profiles with infinite or vanishing numbers,
TOML with dates, inf, floats or booleans where integers belong), each found by hand or by
tests/test_fuzz_parsers.py and kept here as a row.
"""

from __future__ import annotations

import json
import os
import time

import networkx as nx
import pytest
from click.testing import CliRunner

from cli.main import main
from simulator.costs.hardware import hardware_to_dict, load_hardware
from simulator.limits import MAX_FILE_BYTES, MAX_FILE_GPUS, MAX_GPUS, MAX_LAYERS, MAX_SCHEDULE_SLOTS, check_job
from simulator.network.topology import build_cluster

SMALL_TRAIN = ["--layers", "1", "--seq-len", "32", "--batch-size", "4"]
INSTANT_S = 10.0  # a refusal takes well under a second; the bound leaves room for a busy machine


def node_link() -> dict:
    return nx.node_link_data(build_cluster("h100-sxm", 2, 2).graph, edges="edges")


def profile() -> dict:
    return hardware_to_dict(load_hardware("a100-80gb"))


def edited(document: dict, edit) -> str:
    edit(document)
    return json.dumps(document)  # NaN and Infinity as Python writes them


def _gpu(data: dict) -> dict:
    return data["gpus"]["a100-80gb"]


def _measured(**changes) -> dict:
    unit = {"d_model": 64, "n_heads": 4, "d_ff": 256, "seq_len": 64, "vocab_size": 256, "tp": 1, "micro_batches": [1, 2],
            **{name: [1e-3, 2e-3] for name in ("block_forward", "block_backward", "embedding_forward",
                                                "embedding_backward", "head_forward", "head_backward")}}
    measured = {"cores": 2, "units": [unit], "sharing": [[1, 1, 1.0]],
                "collectives": [{"kind": "p2p", "group": 2, "active": 2, "alpha": 1e-4, "beta": 1e-9,
                                 "points": [[4096, 1e-4], [8192, 2e-4]]}]}
    for key, value in changes.items():
        if key == "unit":
            unit.update(value)
        elif key == "collective":
            measured["collectives"][0].update(value)
        else:
            measured[key] = value
    return measured


TOPOLOGIES = {  # name: text of a .json node-link file
    "deep.json": '{"nodes": ' + "[" * 100_000 + "]" * 100_000 + ', "edges": []}',
    "nodes-int.json": '{"nodes": 3, "edges": []}',
    "node-not-object.json": '{"nodes": [1, 2], "edges": []}',
    "id-list.json": '{"nodes": [{"id": [1]}], "edges": []}',
    "graph-int.json": edited(node_link(), lambda d: d.update(graph=5)),
    "directed-text.json": edited(node_link(), lambda d: d.update(directed="yes")),
    "multigraph.json": edited(node_link(), lambda d: d.update(multigraph=True)),
    "edge-unknown-node.json": edited(node_link(), lambda d: d["edges"][0].update(source="nowhere")),
    "bandwidth-text.json": edited(node_link(), lambda d: d["edges"][0].update(bandwidth="fast")),
    "latency-inf.json": edited(node_link(), lambda d: d["edges"][0].update(latency=float("inf"))),
    "bandwidth-nan.json": edited(node_link(), lambda d: d["edges"][0].update(bandwidth=float("nan"))),
    "bandwidth-tiny.json": edited(node_link(), lambda d: d["edges"][0].update(bandwidth=5e-324)),
    "latency-1e400.json": edited(node_link(), lambda d: d["edges"][0].update(latency=10**400)),
    "busbw-tiny.json": edited(node_link(), lambda d: d["graph"].update(busbw_fraction=5e-324)),
    "gpu-list.json": edited(node_link(), lambda d: d["graph"].update(gpu=["a100-80gb"])),
    "too-many-gpus.json": json.dumps({"nodes": [{"id": f"g{i}", "type": "gpu", "node": i, "local": 0}
                                                for i in range(MAX_FILE_GPUS + 1)], "edges": []}),
}
PROFILES = {  # name: text of a hardware profile
    "nic-latency-inf.json": edited(profile(), lambda d: d["nics"]["hdr"].update(latency=float("inf"))),
    "peak-inf.json": edited(profile(), lambda d: _gpu(d)["peak_flops"].update(bf16=float("inf"))),
    "peak-nan.json": edited(profile(), lambda d: _gpu(d)["peak_flops"].update(bf16=float("nan"))),
    "peak-tiny.json": edited(profile(), lambda d: _gpu(d)["peak_flops"].update(bf16=5e-324)),
    "hbm-1e400.json": edited(profile(), lambda d: _gpu(d).update(hbm_bytes=10**400)),
    "radix-inf.json": edited(profile(), lambda d: d["nics"]["hdr"].update(switch_radix=float("inf"))),
    "nvlink-zero.json": edited(profile(), lambda d: _gpu(d).update(nvlink_bandwidth=0)),
    "units-int.json": edited(profile(), lambda d: _gpu(d).update(measured=_measured(units=5))),
    "micro-batches-text.json": edited(profile(), lambda d: _gpu(d).update(
        measured=_measured(unit={"micro_batches": ["a", 1]}))),
    "points-twice.json": edited(profile(), lambda d: _gpu(d).update(
        measured=_measured(collective={"points": [[4096, 1e-4], [4096, 2e-4]]}))),
    "collective-points-inf.json": edited(profile(), lambda d: _gpu(d).update(
        collectives={"p2p": {"ranks": 2, "alpha": 0, "beta": 1e-9, "points": [[1e400, 1]]}})),
    "efficiency-zero.json": edited(profile(), lambda d: _gpu(d).update(
        matmul_efficiency={"bf16": [[64, 0.0]]})),
    "achieved-tiny.json": edited(profile(), lambda d: _gpu(d).update(
        achieved={"hbm_fraction": 1e-9, "source": "made up"})),
    "deep-profile.json": "[" * 100_000 + "]" * 100_000,
}
TOMLS = {  # name: TOML text
    "date.toml": "layers = 1979-05-27",
    "datetime.toml": "layers = 1979-05-27T07:32:00Z",
    "time.toml": "dp = 07:32:00",
    "inf.toml": "layers = inf",
    "nan.toml": "dropout = nan",
    "float.toml": "layers = 2.5",
    "bool.toml": "layers = true",
    "text-for-int.toml": 'dp = "3"',
    "int-for-flag.toml": "json = 1",
    "deep.toml": "layers = " + "[" * 5000 + "]" * 5000,
    "huge-int.toml": "layers = " + "9" * 5000,
    "float-too-large.toml": "oversubscription = 1e400",
}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("bad-simulate")
    for name, text in {**TOPOLOGIES, **PROFILES, **TOMLS}.items():
        (root / name).write_text(text)
    (root / "latin1.json").write_bytes('{"nodes": [], "edges": [], "graph": {"name": "caf\u00e9"}}'.encode("latin-1"))
    (root / "latin1-profile.json").write_bytes(b'{"about": "\xe9"}')
    (root / "latin1.toml").write_bytes(b'precision = "\xe9"')
    (root / "latin1.graphml").write_bytes(b"\xff\xfe<graphml/>")
    (root / "deep.graphml").write_text("<graphml>" + "<a>" * 50_000 + "</a>" * 50_000 + "</graphml>")
    graphml = "\n".join(nx.generate_graphml(build_cluster("h100-sxm", 2, 2).graph))
    (root / "inf.graphml").write_text(_graphml_with_infinite_bandwidth(graphml))
    for name in ("huge.json", "huge-profile.json"):
        with open(root / name, "wb") as file:
            file.truncate(MAX_FILE_BYTES + 1)  # sparse: refused by its size, never read
    (root / "a-directory.json").mkdir()
    (root / "a-directory.txt").mkdir()
    for name in ("pipe.json", "pipe.toml", "pipe.txt", "pipe.graphml"):
        os.mkfifo(root / name)  # reading one would wait for a writer forever: refused unread
    return root


def _graphml_with_infinite_bandwidth(text: str) -> str:
    """The first edge's bandwidth replaced by INF, which GraphML's double type reads as inf."""
    key = next(line for line in text.splitlines() if 'attr.name="bandwidth"' in line).split('id="')[1].split('"')[0]
    start = text.index(f'<data key="{key}">', text.index("<edge "))
    end = text.index("</data>", start)
    return text[:start] + f'<data key="{key}">INF' + text[end:]


LIMITS = [  # jobs beyond simulator/limits.py: refused before anything is built
    ("simulate", ["--dp", "1000000"], f"{MAX_GPUS:,}"),
    ("simulate", ["--nodes", "1000000"], f"{MAX_GPUS:,}"),
    ("simulate", ["--layers", "1000000"], f"{MAX_LAYERS:,}"),
    ("simulate", ["--gpus-per-node", "1000000", "--dp", "1000000"], "GPUs"),
    ("simulate", ["--tp", "8", "--pp", "32", "--dp", "1024"], "262,144 GPUs"),
    ("simulate", ["--nodes", "16385", "--gpus-per-node", "8", "--dp", "131080"], "GPUs"),
    ("simulate", ["--pp", "8", "--global-batch", "100000000"], "schedule slots"),
    ("simulate", ["--pp", "64", "--virtual-chunks", "4", "--schedule", "interleaved", "--layers", "256",
                  "--global-batch", "65536"], f"{MAX_SCHEDULE_SLOTS:,}"),
    ("simulate", ["--dp", "8", "--zero", "3", "--layers", "1024", "--global-batch", "1024"], "ZeRO-3"),
    ("simulate", ["--sweep", "--gpus", "8,1000000", "--global-batch", "64"], f"{MAX_GPUS:,}"),
    ("simulate", ["--sweep", "--gpus", ",".join(str(8 * i) for i in range(1, 41)), "--global-batch", "64"], "at most 32"),
    ("simulate", ["--sweep", "--gpus", "131072,98304,65536", "--global-batch", "131072"], "over its points"),
    ("simulate", ["--sweep", "--gpus", "8,16", "--global-batch", "64", "--layers", "5000"], f"{MAX_LAYERS:,}"),
    ("simulate", ["--sweep", "--gpus", "8,16", "--global-batch", "100000000", "--model", "gpt2-124m"],
     "schedule slots"),
    ("simulate", ["--topology", "{root}/too-many-gpus.json"], f"{MAX_FILE_GPUS:,}"),
    ("simulate", ["--topology", "{root}/huge.json"], "more than"),
    ("simulate", ["--hardware", "{root}/huge-profile.json"], "more than"),
]
TOPOLOGY_ROWS = [
    ("simulate", ["--topology", "{root}/latin1.json"], "not UTF-8"),
    ("simulate", ["--topology", "{root}/latin1.graphml"], "GraphML"),
    ("simulate", ["--topology", "{root}/deep.graphml"], "GraphML"),
    ("simulate", ["--topology", "{root}/inf.graphml"], "bandwidth"),
    ("simulate", ["--topology", "{root}/a-directory.json"], "directory"),
    ("simulate", ["--topology", "{root}/pipe.json"], "not a regular file"),
    ("simulate", ["--topology", "{root}/pipe.graphml"], "not a regular file"),
    ("simulate", ["--topology", "{root}/" + "x" * 5000 + ".json"], "topology file"),
    ("simulate", ["--topology", "{root}/deep.json"], "nested"),
    ("simulate", ["--topology", "{root}/nodes-int.json"], "node-link"),
    ("simulate", ["--topology", "{root}/node-not-object.json"], "nodes[0]"),
    ("simulate", ["--topology", "{root}/id-list.json"], "'id'"),
    ("simulate", ["--topology", "{root}/graph-int.json"], "'graph'"),
    ("simulate", ["--topology", "{root}/directed-text.json"], "'directed'"),
    ("simulate", ["--topology", "{root}/multigraph.json"], "parallel edges"),
    ("simulate", ["--topology", "{root}/edge-unknown-node.json"], "nowhere"),
    ("simulate", ["--topology", "{root}/bandwidth-text.json"], "bandwidth"),
    ("simulate", ["--topology", "{root}/latency-inf.json"], "latency"),
    ("simulate", ["--topology", "{root}/bandwidth-nan.json"], "bandwidth"),
    ("simulate", ["--topology", "{root}/bandwidth-tiny.json"], "bandwidth"),
    ("simulate", ["--topology", "{root}/latency-1e400.json"], "latency"),
    ("simulate", ["--topology", "{root}/busbw-tiny.json"], "busbw_fraction"),
    ("simulate", ["--topology", "{root}/gpu-list.json"], "graph attribute gpu"),
]
PROFILE_ROWS = [
    ("simulate", ["--hardware", "{root}/latin1-profile.json"], "not UTF-8"),
    ("simulate", ["--hardware", "{root}/deep-profile.json"], "nested"),
    ("simulate", ["--hardware", "{root}/a-directory.json"], "directory"),
    ("simulate", ["--hardware", "{root}/pipe.json"], "not a regular file"),
    ("simulate", ["--hardware", "x" * 5000], "unknown hardware"),
    ("simulate", ["--hardware", "{root}/nic-latency-inf.json"], "nics.hdr.latency must be finite"),
    ("simulate", ["--hardware", "{root}/peak-inf.json"], "peak_flops.bf16 must be finite"),
    ("simulate", ["--hardware", "{root}/peak-nan.json"], "peak_flops.bf16 must be finite"),
    ("simulate", ["--hardware", "{root}/peak-tiny.json"], "peak_flops.bf16 must be between"),
    ("simulate", ["--hardware", "{root}/hbm-1e400.json"], "hbm_bytes must be finite"),
    ("simulate", ["--hardware", "{root}/radix-inf.json"], "switch_radix must be finite"),
    ("simulate", ["--hardware", "{root}/nvlink-zero.json"], "nvlink_bandwidth must be positive"),
    ("simulate", ["--hardware", "{root}/units-int.json"], "measured.units must be a JSON list"),
    ("simulate", ["--hardware", "{root}/micro-batches-text.json"], "micro_batches"),
    ("simulate", ["--hardware", "{root}/points-twice.json"], "each size once"),
    ("simulate", ["--hardware", "{root}/collective-points-inf.json"], "collectives.p2p.points"),
    ("simulate", ["--hardware", "{root}/efficiency-zero.json"], "matmul_efficiency.bf16"),
    ("simulate", ["--hardware", "{root}/achieved-tiny.json"], "hbm_fraction"),
    ("compare", ["--hardware", "{root}/peak-inf.json"], "peak_flops.bf16"),
]
TOML_ROWS = [
    ("simulate", ["--config", "{root}/date.toml"], "date"),
    ("simulate", ["--config", "{root}/datetime.toml"], "date"),
    ("simulate", ["--config", "{root}/time.toml"], "date or time"),
    ("simulate", ["--config", "{root}/inf.toml"], "finite"),
    ("simulate", ["--config", "{root}/nan.toml"], "finite"),
    ("simulate", ["--config", "{root}/float.toml"], "integer"),
    ("simulate", ["--config", "{root}/bool.toml"], "integer"),
    ("simulate", ["--config", "{root}/text-for-int.toml"], "integer"),
    ("simulate", ["--config", "{root}/int-for-flag.toml"], "true or false"),
    ("simulate", ["--config", "{root}/deep.toml"], "nested"),
    ("simulate", ["--config", "{root}/huge-int.toml"], "not valid TOML"),
    ("simulate", ["--config", "{root}/float-too-large.toml"], "finite"),
    ("simulate", ["--config", "{root}/latin1.toml"], "UTF-8"),
    ("simulate", ["--config", "{root}/" + "x" * 5000 + ".toml"], "--config"),
    ("train", ["--config", "{root}/date.toml"], "date"),
    ("train", ["--config", "{root}/float.toml"], "integer"),
    ("train", ["--config", "{root}/bool.toml"], "integer"),
    ("train", ["--config", "{root}/inf.toml"], "finite"),
    ("train", ["--data", "{root}/a-directory.txt"], "not a file"),
    ("train", ["--data", "{root}/pipe.txt"], "not a file"),
    ("simulate", ["--config", "{root}/pipe.toml"], "not a file"),
    ("train", ["--data", "{root}/" + "x" * 5000 + ".txt"], "data file"),
]
SWEEP = ["--sweep", "--gpus", "8,16", "--global-batch", "64"]
OUTPUT_ROWS = [  # what simulate writes, and the names it reads, checked before anything is simulated
    ("simulate", ["--trace", ""], "--trace is empty"),
    ("simulate", ["--trace", "{root}/missing/trace.json"], "the directory"),
    ("simulate", ["--trace", "{root}/date.toml/trace.json"], "is not a directory"),
    ("simulate", ["--trace", "{root}/a-directory.json"], "is a directory"),
    ("simulate", ["--trace", "/proc/minigpt-trace.json"], "cannot write in '/proc'"),
    ("simulate", [*SWEEP, "--trace", "{root}/trace.json"], "drop --trace"),
    ("simulate", ["--plot", "{root}/step.svg"], "ending in .png"),  # one step's breakdown, or a sweep's curve: a PNG
    ("simulate", [*SWEEP, "--plot", "{root}/a-directory.json"], "is a directory"),
    ("simulate", [*SWEEP, "--plot", "{root}/missing/scaling.png"], "does not exist"),
    ("simulate", [*SWEEP, "--plot", " "], "--plot is blank"),
    ("simulate", ["--topology", ""], "--topology is empty"),
    ("simulate", ["--hardware", ""], "--hardware is empty"),
    ("simulate", ["--gpu", ""], "--gpu is empty"),
    ("simulate", ["--fabric", " "], "--fabric is blank"),
]
FSDP_ROWS = [  # cli/options/fsdp.py's flags, checked by job/train_config.py's check_sharding
    ("simulate", ["--dp", "4", "--zero", "3", "--shard-group", "3"], "--shard-group 3 does not divide"),
    ("simulate", ["--dp", "4", "--zero", "2", "--no-reshard-after-forward"], "needs --zero 3"),
    ("simulate", ["--dp", "4", "--shard-group", "2"], "needs --zero 1, 2 or 3"),
    ("simulate", ["--dp", "4", "--zero", "3", "--shard-group", "0"], "--shard-group must be a positive integer"),
    ("simulate", [*SWEEP, "--zero", "2", "--no-reshard-after-forward"], "needs --zero 3"),  # a sweep checks the same
    ("simulate", ["--dp", "4", "--zero", "3", "--sync-grads-once"], "needs --zero 3 --no-reshard-after-forward"),
    ("simulate", [*SWEEP, "--sync-grads-once"], "needs --zero 3 --no-reshard-after-forward"),
    ("simulate", [*SWEEP, "--zero", "3", "--shard-group", "7"], "--shard-group 7, which must divide the data ranks"),
]
SHAPE_ROWS = [  # a sweep's fixed split that the model's shape refuses: its own reason, not the limits' message
    ("simulate", [*SWEEP, "--model", "tiny-moe", "--tp", "8"], "does not divide the 4 attention heads"),
    ("simulate", [*SWEEP, "--seq-len", "100", "--cp", "8"], "which 100 tokens are not"),
]
CASES = LIMITS + TOPOLOGY_ROWS + PROFILE_ROWS + TOML_ROWS + OUTPUT_ROWS + FSDP_ROWS + SHAPE_ROWS


@pytest.mark.parametrize("command,args,expected", CASES,
                         ids=[f"{c} {' '.join(a)}"[:90] for c, a, _ in CASES])
def test_bad_input_is_one_line_and_exit_2(files, tmp_path, command, args, expected):
    args = [arg.replace("{root}", str(files)) for arg in args]
    before = sorted(p.name for p in files.rglob("*"))
    out = ["--out", str(tmp_path / "never")] if command in ("train", "compare") else []
    start = time.perf_counter()
    result = CliRunner().invoke(main, [command, *(SMALL_TRAIN if command == "train" else []), *args, *out])
    elapsed = time.perf_counter() - start
    assert result.exit_code == 2, (result.output, result.exception)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("minigpt: error:"), result.stderr
    assert expected.lower() in lines[0].lower(), lines[0]
    assert "Traceback" not in result.output
    assert elapsed < INSTANT_S, f"{elapsed:.1f} s to refuse"
    assert not (tmp_path / "never").exists()
    assert sorted(p.name for p in files.rglob("*")) == before  # nothing written next to the inputs


def test_jobs_at_the_limits_are_accepted_and_built_by_arithmetic():
    """The limits refuse only what is beyond them: a job at every limit at once passes the checks, and a
    cluster of MAX_GPUS is built (by arithmetic, no graph) at once."""
    pp, dp = 128, MAX_GPUS // (8 * 128)  # tp 8
    check_job(MAX_LAYERS, pp=pp, dp=dp, virtual_chunks=1, global_batch=dp * MAX_SCHEDULE_SLOTS // pp, micro_batch=1,
              n_gpus=MAX_GPUS)  # MAX_SCHEDULE_SLOTS // pp micro-batches per replica
    start = time.perf_counter()
    cluster = build_cluster("h100-sxm", 8, MAX_GPUS // 8)
    assert cluster.n_gpus == MAX_GPUS and time.perf_counter() - start < INSTANT_S


def test_the_table_is_long_enough():
    assert len(CASES) >= 60
