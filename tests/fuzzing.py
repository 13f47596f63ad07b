"""What every fuzz test shares: hypothesis settings (derandomized, bounded), strategies that break a valid
JSON document field by field or byte by byte, and the checks that a parser is total (a result or one
ConfigError) and that a command is exit 0 or one line with exit 2."""

from __future__ import annotations

import copy
import json
import math
import os

from click.testing import CliRunner
from hypothesis import HealthCheck, event, settings, strategies as st

from cli.main import main
from minigpt.errors import ConfigError
from simulator.costs.hardware import hardware_to_dict, load_hardware

SCALE = float(os.environ.get("MINIGPT_FUZZ_SCALE", "1"))  # e.g. 20 for a long local hunt; CI runs 1
PARSER_EXAMPLES = int(1000 * SCALE)  # per parser-level test
CLI_EXAMPLES = int(200 * SCALE)  # per CLI-level test (each runs a command)
settings.register_profile("fuzz-parsers", derandomize=True, deadline=None, database=None, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                                 HealthCheck.function_scoped_fixture])
PARSERS = settings(settings.get_profile("fuzz-parsers"), max_examples=PARSER_EXAMPLES)
CLI = settings(settings.get_profile("fuzz-parsers"), max_examples=CLI_EXAMPLES)

DEEP = "__deep__"  # a string value replaced, in the serialized text, by lists nested `depth` deep


def paths(value, prefix=()) -> list[tuple]:
    """Every place in a JSON document: the keys and indices leading to each value."""
    found = [prefix]
    if isinstance(value, dict):
        for key, child in value.items():
            found += paths(child, prefix + (key,))
    elif isinstance(value, list):
        for index, child in enumerate(value[:3]):  # the first few entries of a list stand for all
            found += paths(child, prefix + (index,))
    return found


# ---------------------------------------------------------------- strategies

NASTY_NUMBERS = [0, -1, 1, 2, 0.5, -0.0, 1e-300, 5e-324, 1e300, 1.7e308, 2**31, 2**63, 2**64, 10**30, 10**400,
                 -(10**400), math.nan, math.inf, -math.inf]
numbers = st.one_of(st.integers(), st.floats(), st.sampled_from(NASTY_NUMBERS))
scalars = st.one_of(st.none(), st.booleans(), numbers, st.text(max_size=12), st.sampled_from(["", "gpu", "a\nb", DEEP]))
json_values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3)
                           | st.dictionaries(st.text(max_size=6), inner, max_size=3), max_leaves=8)


def dumps(document, depth: int) -> str:
    text = json.dumps(document)  # NaN and Infinity as Python writes them; 10**400 as its digits
    return text.replace(json.dumps(DEEP), "[" * depth + "]" * depth)


@st.composite
def broken_documents(draw, document: dict, places: list[tuple]) -> str:
    """`document` with one to three fields replaced, removed or joined by unknown ones, serialized."""
    document = copy.deepcopy(document)
    for _ in range(draw(st.integers(1, 3))):
        place = draw(st.sampled_from(places))
        parent = document
        try:
            for key in place[:-1]:
                parent = parent[key]
            action = draw(st.sampled_from(["replace", "replace", "replace", "remove", "add"]))
            if action == "replace":
                parent[place[-1]] = draw(json_values)
            elif action == "remove":
                del parent[place[-1]]
            elif isinstance(parent, dict):
                parent[draw(st.text(max_size=6))] = draw(json_values)
        except (KeyError, IndexError, TypeError):  # an earlier mutation changed the way there
            continue
    return dumps(document, draw(st.sampled_from([1, 30, 70, 2000, 100_000])))


@st.composite
def damaged(draw, valid: bytes) -> bytes:
    """A valid file cut short, or with a few bytes overwritten by arbitrary ones."""
    data = bytearray(valid)
    if draw(st.booleans()):
        return bytes(data[: draw(st.integers(0, len(data)))])
    for _ in range(draw(st.integers(1, 4))):
        at = draw(st.integers(0, len(data) - 1))
        data[at: at + 1] = draw(st.binary(min_size=0, max_size=4))
    return bytes(data)


def any_bytes(valid: bytes):
    return st.one_of(st.binary(max_size=512), damaged(valid))


def write(directory, name: str, content: bytes | str):
    path = directory / name
    path.write_bytes(content.encode("utf-8", "surrogatepass") if isinstance(content, str) else content)
    return path


def total(parse, path, kind):
    """parse(path) is a `kind` or raises ConfigError with a message; any other exception fails the test."""
    try:
        result = parse(path)
    except ConfigError as error:
        assert str(error).strip(), "a ConfigError must say what is wrong"
        event("refused")  # --hypothesis-show-statistics tells how the examples ended
        return None
    assert isinstance(result, kind), type(result)
    event("accepted")
    return result


def strict_json(text: str):
    """JSON without NaN or Infinity (which json.dumps writes for a non-finite float, and no reader takes)."""
    def refuse(name):
        raise AssertionError(f"the output holds {name}: a number in the input made a result non-finite")

    return json.loads(text, parse_constant=refuse)


def one_line_or_success(args: list[str]) -> None:
    """Through the CLI: exit 0 (with --json, finite JSON), or exit 2 with exactly one line on stderr;
    never a traceback."""
    result = CliRunner().invoke(main, args)
    event(f"exit {result.exit_code}")
    assert result.exit_code in (0, 2), (result.exit_code, result.output, result.exception)
    assert "Traceback" not in result.output
    if result.exit_code == 2:
        lines = result.stderr.splitlines()
        assert len(lines) == 1 and lines[0].startswith("minigpt: error:"), result.stderr
    elif "--json" in args:
        strict_json(result.stdout)


def cpu_profile_document() -> dict:
    """A calibrated CPU host profile with every optional part, so that mutations reach every sub-parser."""
    data = hardware_to_dict(load_hardware("a100-80gb"))
    gpu = next(iter(data["gpus"].values()))
    gpu["collectives"] = {"all_reduce": {"ranks": 2, "alpha": 1e-5, "beta": 1e-10, "points": [[1024, 2e-5]]}}
    gpu["calibration"] = {"ranks": 2, "cores": 2, "ranks_per_core": 1.0}
    sizes = [1, 2]
    unit = {"d_model": 64, "n_heads": 4, "d_ff": 256, "seq_len": 64, "vocab_size": 256, "tp": 1, "micro_batches": sizes,
            "dtype": "fp32", **{name: [1e-3, 2e-3] for name in ("block_forward", "block_backward", "embedding_forward",
                                                                "embedding_backward", "head_forward", "head_backward")}}
    gpu["measured"] = {"cores": 2, "device": "cpu", "units": [unit], "sharing": [[1, 1, 1.0], [2, 1, 2.0]],
                       "collectives": [{"kind": "all_reduce", "group": 2, "active": 2, "alpha": 1e-4, "beta": 1e-9,
                                        "points": [[4096, 1e-4], [8192, 2e-4]]}],
                       "reliability": {"cpu_share_before": 0.98, "cpu_share_alone": 0.97, "cpu_share_after": None,
                                       "spread_block": 0.05, "spread_units": 0.1, "spread_matmuls": 0.3,
                                       "confidence": 0.07, "reliable": True, "allowed_busy": False, "why": "quiet",
                                       "note": "test"}}
    return data
