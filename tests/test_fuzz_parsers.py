"""Property-based fuzzing of every input parser but the checkpoint's (tests/test_fuzz_checkpoint.py): whatever
the bytes, a valid object or ConfigError, never another exception; and through the CLI, exit 0 or exit 2 with exactly one line on stderr, no traceback.

Parsers: topology files (node-link JSON and GraphML, simulator/network/topology.py's load_cluster), hardware
profiles (simulator/costs/hardware.py's load_hardware, `simulate --hardware`), userbuffers settings
(simulator/costs/userbuffers.py, `simulate --tp-overlap-cfg`), TOML flag files
(cli/options/config_file.py, `--config`), transformers' config.json (minigpt/hf/: DeepSeek-V3's and Mistral
7B's as released, `--model CONFIG`, `--init-from`) and data files (minigpt/data.py, `train --data`). Each gets (a) arbitrary
bytes and damaged copies of a valid file, and (b) structured-but-wrong documents: the valid document
with random JSON/TOML values put into its real fields (wrong types, NaN, inf, huge numbers, deep nesting,
fields removed or added). Hypothesis runs derandomized (the same examples every run, for CI) without
deadlines, in a bounded number of examples: the whole file takes well under a minute on two cores.
"""

from __future__ import annotations

import datetime
import json
import math

import click
import networkx as nx
import pytest
from hypothesis import given, strategies as st

from cli.options.config_file import read_config_file, value_kind
from cli.main import main
from fuzzing import (CLI, PARSERS, any_bytes, broken_documents, cpu_profile_document, damaged, one_line_or_success, paths,
                     total, write)
from hf_released import DEEPSEEK_V3_RELEASED, MISTRAL_7B_RELEASED
from minigpt.config import GPTConfig
from minigpt.data import TOKENS_FILE, TOKENS_HEADER, Corpus, check_text_file
from minigpt.hf.files import fp8_blocks, read_config_file as read_hf_config_file
from minigpt.hf.layouts import config_from_hf
from simulator.network.cluster import Cluster
from simulator.costs.hardware import Hardware, load_hardware
from simulator.network.topology import build_cluster, load_cluster
from simulator.costs.userbuffers import Userbuffers, read_userbuffers
from tests.independent import ROOT

USERBUFFERS_FILE = ROOT / "bench" / "dgxc_gpt3_175b_userbuffers.json"


# ---------------------------------------------------------------- valid documents to break


def topology_document() -> dict:
    return nx.node_link_data(build_cluster("h100-sxm", 2, 2).graph, edges="edges")


TOPOLOGY = topology_document()
PROFILE = cpu_profile_document()
TOPOLOGY_PATHS, PROFILE_PATHS = paths(TOPOLOGY)[1:], paths(PROFILE)[1:]


@pytest.fixture(scope="module")
def scratch(tmp_path_factory):
    return tmp_path_factory.mktemp("fuzz")


# ---------------------------------------------------------------- topology files

TOPOLOGY_JSON = json.dumps(TOPOLOGY).encode()


@PARSERS
@given(content=any_bytes(TOPOLOGY_JSON))
def test_topology_json_any_bytes(scratch, content):
    total(load_cluster, write(scratch, "t.json", content), Cluster)


@PARSERS
@given(content=broken_documents(TOPOLOGY, TOPOLOGY_PATHS))
def test_topology_json_wrong_fields(scratch, content):
    total(load_cluster, write(scratch, "t.json", content), Cluster)


def graphml_text(graph: nx.Graph) -> bytes:
    return "\n".join(nx.generate_graphml(graph)).encode()


TOPOLOGY_GRAPHML = graphml_text(build_cluster("h100-sxm", 2, 2).graph)
graphml_values = st.one_of(st.integers(-(2**63), 2**63 - 1), st.floats(), st.booleans(), st.text(max_size=8))


@st.composite
def graphml_documents(draw) -> bytes:
    """The valid cluster with random typed values (GraphML's int, long, double, boolean, string) in its
    node and edge attributes, or a valid file with part of its text replaced."""
    graph = build_cluster("h100-sxm", 2, 2).graph.copy()
    for _ in range(draw(st.integers(1, 3))):
        if draw(st.booleans()):
            node = draw(st.sampled_from(sorted(graph.nodes)))
            graph.nodes[node][draw(st.sampled_from(["type", "node", "local", "x"]))] = draw(graphml_values)
        else:
            edge = draw(st.sampled_from(sorted(graph.edges)))
            graph.edges[edge][draw(st.sampled_from(["bandwidth", "latency"]))] = draw(graphml_values)
    try:
        return graphml_text(graph)
    except (ValueError, nx.NetworkXError):  # networkx cannot write a value of this type: a damaged file instead
        return draw(damaged(TOPOLOGY_GRAPHML))


@PARSERS
@given(content=st.one_of(any_bytes(TOPOLOGY_GRAPHML), graphml_documents()))
def test_topology_graphml_any_bytes_and_values(scratch, content):
    total(load_cluster, write(scratch, "t.graphml", content), Cluster)


@CLI
@given(content=st.one_of(broken_documents(TOPOLOGY, TOPOLOGY_PATHS), any_bytes(TOPOLOGY_JSON)))
def test_simulate_topology_is_exit_0_or_one_line(scratch, content):
    path = write(scratch, "cli.json", content)
    one_line_or_success(["simulate", "--topology", str(path), "--model", "tiny", "--dp", "4", "--json"])


@CLI
@given(content=st.one_of(graphml_documents(), any_bytes(TOPOLOGY_GRAPHML)))
def test_simulate_graphml_is_exit_0_or_one_line(scratch, content):
    path = write(scratch, "cli.graphml", content)
    one_line_or_success(["simulate", "--topology", str(path), "--model", "tiny", "--dp", "4", "--json"])


# ---------------------------------------------------------------- userbuffers settings (simulate --tp-overlap-cfg)

USERBUFFERS = {key: value for key, value in json.loads(USERBUFFERS_FILE.read_text()).items() if key != "source"}
USERBUFFERS_JSON = json.dumps(USERBUFFERS).encode()
USERBUFFERS_PATHS = paths(USERBUFFERS)[1:]
USERBUFFERS_YAML = "".join(f"{name}:\n" + "".join(f"  {key}: {value}\n" for key, value in settings.items())
                           for name, settings in USERBUFFERS.items()).encode()  # Megatron's --tp-comm-overlap-cfg


@PARSERS
@given(named=st.one_of(
    st.tuples(st.just("ub.json"), st.one_of(any_bytes(USERBUFFERS_JSON), broken_documents(USERBUFFERS, USERBUFFERS_PATHS))),
    st.tuples(st.just("ub.yaml"), any_bytes(USERBUFFERS_YAML))))
def test_userbuffers_any_bytes_and_wrong_fields(scratch, named):
    total(lambda p: read_userbuffers(str(p)), write(scratch, *named), Userbuffers)


@CLI
@given(content=st.one_of(broken_documents(USERBUFFERS, USERBUFFERS_PATHS), any_bytes(USERBUFFERS_JSON)))
def test_simulate_tp_overlap_cfg_is_exit_0_or_one_line(scratch, content):
    path = write(scratch, "cli-ub.json", content)
    one_line_or_success(["simulate", "--tp-overlap-cfg", str(path), "--model", "tiny", "--tp", "2",
                         "--sequence-parallel", "--overlap", "megatron-core", "--gpu", "h100-sxm", "--json"])


# ---------------------------------------------------------------- hardware profiles

PROFILE_JSON = json.dumps(PROFILE).encode()


@PARSERS
@given(content=any_bytes(PROFILE_JSON))
def test_profile_any_bytes(scratch, content):
    total(lambda p: load_hardware(str(p)), write(scratch, "p.json", content), Hardware)


@PARSERS
@given(content=broken_documents(PROFILE, PROFILE_PATHS))
def test_profile_wrong_fields(scratch, content):
    total(lambda p: load_hardware(str(p)), write(scratch, "p.json", content), Hardware)


@CLI
@given(content=st.one_of(broken_documents(PROFILE, PROFILE_PATHS), any_bytes(PROFILE_JSON)))
def test_simulate_hardware_is_exit_0_or_one_line(scratch, content):
    path = write(scratch, "cli-profile.json", content)
    one_line_or_success(["simulate", "--hardware", str(path), "--model", "tiny", "--dp", "2", "--json"])


# ---------------------------------------------------------------- TOML flag files

SIMULATE_KEYS = ["layers", "hidden", "dp", "micro-batch", "global-batch", "zero", "precision", "sequence-parallel",
                 "dropout", "oversubscription", "topology", "schedule", "zero3-prefetch", "tp-overlap", "json",
                 "topology-kind"]
TRAIN_KEYS = ["steps", "batch-size", "lr", "seed", "data", "precision", "resume", "untied", "loss-scale", "out"]
toml_scalars = st.one_of(
    st.integers(-(2**63), 2**63 - 1), st.integers(0, 4), st.floats(), st.booleans(), st.text(max_size=10),
    st.sampled_from(["bf16", "fp16", "gpipe", "1f1b", "dynamic", "1024"]),
    st.dates(), st.times(), st.datetimes(timezones=st.sampled_from([None, datetime.timezone.utc])),
    st.sampled_from([math.nan, math.inf, -math.inf, 2.5, 0, -1, 2**40]),
)
toml_values = st.recursive(toml_scalars, lambda inner: st.lists(inner, max_size=3)
                           | st.dictionaries(st.from_regex(r"[a-z]{1,4}", fullmatch=True), inner, max_size=2),
                           max_leaves=5)


def command(name: str):
    return main.get_command(None, name)


def toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return "nan" if value != value else ("inf" if value > 0 else "-inf") if math.isinf(value) else repr(value)
    if isinstance(value, (int, datetime.date, datetime.time)):
        return value.isoformat() if not isinstance(value, int) else str(value)
    if isinstance(value, str):
        return json.dumps(value)  # a TOML basic string (a lone surrogate's escape is refused, as TOML wants)
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    return "{" + ", ".join(f"{k} = {toml_value(v)}" for k, v in value.items()) + "}"


RIGHT_TYPED = {  # a value of the type the flag takes (cli/options/config_file.py's kinds), often out of its range
    "flag": st.booleans(),
    "integer": st.one_of(st.integers(-(2**63), 2**63 - 1), st.integers(-1, 8)),
    "number": st.one_of(st.floats(allow_nan=False, allow_infinity=False), st.integers(-1, 8)),
    "text": st.one_of(st.text(max_size=8), st.sampled_from(["bf16", "fp16", "gpipe", "1f1b", "dynamic", "1024"])),
}


@st.composite
def toml_documents(draw, name: str, keys: list[str]) -> str:
    """Real flag names of command `name` (and a few unknown ones) with values of the flag's type or of any
    TOML type, or deep nesting."""
    entries = {}
    for key in draw(st.lists(st.sampled_from(keys + ["stepz", "model.x"]), min_size=1, max_size=3, unique=True)):
        param = next((p for p in command(name).params if p.name == key.replace("-", "_")), None)
        right = RIGHT_TYPED["text" if param is None else value_kind(param).replace("name", "text")]
        entries[key] = draw(st.one_of(right, toml_values))
    text = "\n".join(f'"{key}" = {toml_value(value)}' for key, value in entries.items())
    if draw(st.integers(0, 5)) == 0:
        depth = draw(st.sampled_from([10, 2000]))
        text += "\nlayers = " + "[" * depth + "]" * depth
    return text


def read_and_convert(path, name: str) -> dict:
    """read_config_file, then what click does with each value it returns (a flag's default): convert it with the
    flag's type. click's own refusal (a value out of an IntRange, an unknown choice) is one line and exit 2 at
    the command line; any other exception (a date given to int(), int(inf)) is the bug this test looks for."""
    values = read_config_file(str(path), command(name))
    context = click.Context(command(name))
    for key, value in values.items():
        param = next(p for p in command(name).params if p.name == key)
        try:
            param.type_cast_value(context, value)
        except click.BadParameter:
            pass
    return values


@PARSERS
@given(content=st.one_of(st.binary(max_size=256), toml_documents("simulate", SIMULATE_KEYS)))
def test_toml_for_simulate(scratch, content):
    total(lambda p: read_and_convert(p, "simulate"), write(scratch, "c.toml", content), dict)


@PARSERS
@given(content=st.one_of(st.binary(max_size=256), toml_documents("train", TRAIN_KEYS)))
def test_toml_for_train(scratch, content):
    total(lambda p: read_and_convert(p, "train"), write(scratch, "c.toml", content), dict)


@CLI
@given(content=st.one_of(st.binary(max_size=128), toml_documents("simulate", SIMULATE_KEYS)))
def test_simulate_config_is_one_line(scratch, content):
    """A file that reads is then refused for --micro-batch 0 (given on the line, it wins): nothing simulates,
    but click has converted every value of the file first."""
    path = write(scratch, "cli.toml", content)
    one_line_or_success(["simulate", "--config", str(path), "--micro-batch", "0"])


@CLI
@given(content=st.one_of(st.binary(max_size=128), toml_documents("train", TRAIN_KEYS)))
def test_train_config_is_one_line(scratch, content):
    path = write(scratch, "cli.toml", content)
    one_line_or_success(["train", "--config", str(path), "--steps", "0", "--out", str(scratch / "never")])
    assert not (scratch / "never").exists()


# ---------------------------------------------------------------- transformers config.json (--model, --init-from)


def places_of(document: dict) -> list[tuple]:
    """Every field of a config.json, the nested ones (its rotary scaling, quantization) too."""
    return [(key,) for key in document] + [(key, inner) for key, value in document.items() if isinstance(value, dict)
                                           for inner in value]


HF_DOCUMENTS = (DEEPSEEK_V3_RELEASED, MISTRAL_7B_RELEASED)


def read_hf_shape(path) -> GPTConfig:
    """What --model CONFIG and --init-from read of a config.json: the shape, and the weights' quantization."""
    hf = read_hf_config_file(path)
    fp8_blocks(hf)
    return config_from_hf(hf)


@PARSERS
@given(content=st.one_of(st.binary(max_size=256), *(broken_documents(d, places_of(d)) for d in HF_DOCUMENTS)))
def test_transformers_config_json(scratch, content):
    total(read_hf_shape, write(scratch, "config.json", content), GPTConfig)


# ---------------------------------------------------------------- data files


@PARSERS
@given(content=st.one_of(st.binary(max_size=2048), st.text(min_size=10, max_size=200).map(str.encode)))
def test_data_file_any_bytes(scratch, content):
    """Corpus.load is what training reads the file with: any UTF-8 text long enough for seq_len 1
    (20 bytes) is a corpus, anything else one ConfigError."""
    path = write(scratch, "d.txt", content)
    corpus = total(lambda p: Corpus.load(p, 1), path, Corpus)
    assert corpus is None or len(corpus.train) + len(corpus.val) == len(content)


TOKENS_DOCUMENT = {"format": "minigpt-tokens", "version": 1, "dtype": "uint16", "tokens": 40,
                   "tokenizer": {"name": "bytes", "vocab_size": 256, "fingerprint": "bytes"},
                   "sources": [{"path": "a.txt", "bytes": 40, "tokens": 40, "sha256": "0" * 64}]}


@PARSERS
@given(header=st.one_of(any_bytes(json.dumps(TOKENS_DOCUMENT).encode()), broken_documents(TOKENS_DOCUMENT, paths(TOKENS_DOCUMENT))),
       stream=st.binary(max_size=160))
def test_token_directory_any_header_and_ids(scratch, header, stream):
    """A token directory's header and ids, either broken: the check before training and Corpus.load (what every rank
    reads it with) accept it whole or raise ConfigError, nothing else."""
    directory = scratch / "tokens"
    directory.mkdir(exist_ok=True)
    write(directory, TOKENS_HEADER, header)
    write(directory, TOKENS_FILE, stream)
    total(lambda p: check_text_file(p, 1), directory, type(None))
    total(lambda p: Corpus.load(p, 1), directory, Corpus)


@CLI
@given(content=st.binary(max_size=2048))
def test_train_data_is_one_line(scratch, content):
    """With --seq-len 4096 no file this short is long enough: every one is refused, in one line."""
    path = write(scratch, "cli.txt", content)
    one_line_or_success(["train", "--data", str(path), "--seq-len", "4096", "--layers", "1",
                         "--out", str(scratch / "never")])
    assert not (scratch / "never").exists()
