"""Hardware presets: GPUs, nodes and network adapters, loaded from JSON.

The numbers live in one data file, simulator/costs/hardware.json; this module only reads
and checks them. A calibrated profile (written by `minigpt calibrate`) is a JSON file
with the same schema holding one GPU, and loads the same way as a preset:

    load_hardware("h100-sxm")           # a preset: the GPU in its standard node
    load_hardware("profiles/ours.json") # a file path

Schema (units: FLOP/s, bytes, bytes/s per direction, seconds):

    {"gpus":  {NAME: {"source", "node", "peak_flops": {fp32, tf32, bf16, fp16, fp8},
                      "hbm_bytes", "hbm_bandwidth", "nvlink_bandwidth", "nvlink_latency"}},
     "nodes": {NAME: {"source", "gpus_per_node", "nics_per_node", "nvswitch", "nic"}},
     "nics":  {NAME: {"source", "bandwidth", "latency", "switch_latency", "switch_radix"}}}

A peak FLOP/s entry may be null when the GPU lacks that format (A100: no fp8). Every number must be
finite and within the ranges of simulator/json_file.py (rates 1 to 1e30 per second, latencies 0 to
3600 s, bytes 1 to 1e30, counts 1 to 2**20, fractions 1e-6 to 1), far beyond real hardware and narrow
enough that no simulated step overflows; whatever a file's bytes, loading it gives a Hardware or one
ConfigError naming the file and the field (tests/test_fuzz_parsers.py).

Optional GPU fields, written by `minigpt calibrate`; the presets carry matmul_efficiency, achieved
and attention_efficiency only, taken from published microbenchmarks against their datasheet figures
(values, sources and derivations in docs/efficiency.md):

    "matmul_efficiency": see simulator/costs/compute.py (parse_efficiency_profile)
    "achieved": see simulator/costs/rates/achieved.py (a NIC entry may likewise hold "busbw_fraction")
    "attention_efficiency", "attention_cudnn": see simulator/costs/rates/attention_rates.py (FlashAttention-2's, cuDNN's)
    "collectives": {KIND: {"ranks", "alpha", "beta", "points"?}}  KIND one of all_reduce,
        all_gather, reduce_scatter, p2p: a least-squares fit t = alpha + beta * S over the
        measured points [[S bytes, seconds], ...] (S: the full buffer, parallel/comm.py's
        convention) in a group of `ranks` ranks
    "calibration": a JSON object of notes on the measurement (ranks, cores,
        ranks_per_core, threads_per_rank, the measured block times, ...)
    "measured": a CPU host's measured unit times, core sharing and gloo collectives by
        group size and load: see simulator/costs/host.py

In a calibrated profile every non-null peak_flops entry is a measurement (the best matmul rate
measured in that format, parallel/calibrate/measure.py), not a datasheet figure, and matmul_efficiency
holds one table per measured format. With one rank nothing measures the links: `preset_links`
gives calibrate the datasheet link figures of the preset whose GPU the device's name matches.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

from minigpt.errors import ConfigError
from simulator.costs.rates.achieved import Achieved, fraction, parse_achieved
from simulator.costs.rates.attention_rates import ATTENTION_FIELDS, AttentionEfficiency, parse_attention_efficiency
from simulator.costs.rates.efficiency import FLOP_FORMATS, EfficiencyProfile, parse_efficiency_profile
from simulator.costs.host import MeasuredHost, parse_measured_host
from simulator.json_file import BYTES, COUNT, RATE, SECONDS, finite_number, in_range, read_json_file

PRESETS_FILE = Path(__file__).with_name("hardware.json")
TOP_LEVEL_KEYS = {"about", "assumptions", "gpus", "nodes", "nics"}
COLLECTIVE_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "p2p")
OPTIONAL_GPU_FIELDS = ("matmul_efficiency", "collectives", "calibration", "measured", "achieved", *ATTENTION_FIELDS)
SECONDS_PER_BYTE = (1e-30, 1.0)  # a collective's beta: 1 / bytes per second


@dataclass(frozen=True)
class CollectiveFit:
    """A measured collective: t = alpha + beta * S seconds for a buffer of S bytes among `ranks` ranks."""

    kind: str
    ranks: int
    alpha: float  # seconds
    beta: float  # seconds per byte
    points: tuple[tuple[int, float], ...] = ()  # the measured [bytes, seconds]

    def time(self, nbytes: float) -> float:
        return self.alpha + self.beta * nbytes


@dataclass(frozen=True)
class GPUSpec:
    """One GPU: dense peak FLOP/s per format, HBM, and its NVLink port."""

    name: str
    source: str
    node: str
    peak_flops: dict[str, float | None] = field(hash=False)  # null where the GPU lacks the format
    hbm_bytes: int
    hbm_bandwidth: float
    nvlink_bandwidth: float  # bytes/s per direction, per GPU
    nvlink_latency: float  # seconds per GPU-to-GPU transfer through the NVSwitch
    # Optional, from a calibrated profile (None in the presets):
    matmul_efficiency: EfficiencyProfile | None = field(default=None, hash=False, compare=False)
    collectives: dict[str, CollectiveFit] | None = field(default=None, hash=False, compare=False)
    calibration: dict | None = field(default=None, hash=False, compare=False)
    measured: MeasuredHost | None = field(default=None, hash=False, compare=False)
    # What real kernels and NCCL reach against the datasheet (simulator/costs/rates/achieved.py); None: nothing discounted.
    achieved: Achieved | None = field(default=None, hash=False, compare=False)
    # A fused causal attention kernel's published rates (simulator/costs/rates/attention_rates.py); None: GEMM pricing.
    attention_efficiency: AttentionEfficiency | None = field(default=None, hash=False, compare=False)
    attention_cudnn: AttentionEfficiency | None = field(default=None, hash=False, compare=False)  # cuDNN's, the same way

    @property
    def reached(self) -> Achieved:
        """The achieved fractions, or the datasheet itself (fractions 1, no overhead) when none are given."""
        return self.achieved or Achieved()

    def flops(self, fmt: str) -> float:
        """Dense peak FLOP/s in `fmt`; ConfigError when the GPU has no such tensor cores."""
        if fmt not in self.peak_flops:
            raise ConfigError(f"unknown number format {fmt!r}: choose one of {', '.join(FLOP_FORMATS)}")
        value = self.peak_flops[fmt]
        if value is None:
            usable = ", ".join(name for name, peak in self.peak_flops.items() if peak is not None)
            raise ConfigError(f"GPU {self.name} has no {fmt} tensor cores: choose one of {usable}")
        return value


@dataclass(frozen=True)
class NodeSpec:
    """One server: how many GPUs and NICs, and whether an NVSwitch joins the GPUs."""

    name: str
    source: str
    gpus_per_node: int
    nics_per_node: int
    nvswitch: bool
    nic: str  # the NIC preset the node ships with


@dataclass(frozen=True)
class NICSpec:
    """A network adapter and the switches of its fabric."""

    name: str
    source: str
    bandwidth: float  # bytes/s per direction, per port
    latency: float  # seconds per GPU-to-GPU message, software included
    switch_latency: float  # seconds per switch traversal
    switch_radix: int  # ports per leaf or spine switch
    busbw_fraction: float = 1.0  # NCCL bus bandwidth across nodes / line rate (simulator/costs/rates/achieved.py)


@dataclass(frozen=True)
class Hardware:
    """One machine kind: a GPU, the node that holds it, and the node's NIC."""

    name: str
    gpu: GPUSpec
    node: NodeSpec
    nic: NICSpec


# ---------------------------------------------------------------- checking fields


def _where(section: str, name: str) -> str:
    return f"{section}.{name}"


def _check_keys(entry: object, expected: set[str], where: str, origin: str) -> dict:
    if not isinstance(entry, dict):
        raise ConfigError(f"{origin}: {where} must be a JSON object, got {type(entry).__name__}")
    missing = sorted(expected - entry.keys())
    if missing:
        raise ConfigError(f"{origin}: {where} is missing {', '.join(missing)}: add them (see simulator/costs/hardware.json)")
    unknown = sorted(entry.keys() - expected)
    if unknown:
        raise ConfigError(f"{origin}: {where} has unknown field(s) {', '.join(unknown)}: expected {', '.join(sorted(expected))}")
    return entry


def _number(value: object, where: str, origin: str, bounds: tuple[float, float] = RATE, *,
            allow_zero: bool = False) -> float:
    """A finite number within `bounds` (simulator/json_file.py: no value there makes a step overflow)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{origin}: {where} must be a number, got {value!r}")
    if finite_number(value) is None:
        raise ConfigError(f"{origin}: {where} must be finite, got {value!r}")
    if value < 0 or (value == 0 and not allow_zero):
        bound = "non-negative" if allow_zero else "positive"
        raise ConfigError(f"{origin}: {where} must be {bound}, got {value!r}")
    if not in_range(value, (0.0 if allow_zero else bounds[0], bounds[1])):
        raise ConfigError(f"{origin}: {where} must be between {bounds[0]:g} and {bounds[1]:g}, got {value!r}")
    return value


def _integer(value: object, where: str, origin: str, bounds: tuple[float, float] = COUNT) -> int:
    number = _number(value, where, origin, bounds)
    if isinstance(number, float) and not number.is_integer():
        raise ConfigError(f"{origin}: {where} must be a whole number, got {value!r}")
    return int(number)


def _text(value: object, where: str, origin: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(f"{origin}: {where} must be a non-empty string, got {value!r}")
    return value


def _parse_gpu(name: str, entry: object, origin: str) -> GPUSpec:
    where = _where("gpus", name)
    fields = {"source", "node", "peak_flops", "hbm_bytes", "hbm_bandwidth", "nvlink_bandwidth", "nvlink_latency"}
    if isinstance(entry, dict):
        fields |= set(OPTIONAL_GPU_FIELDS) & entry.keys()
    entry = _check_keys(entry, fields, where, origin)
    flops = _check_keys(entry["peak_flops"], set(FLOP_FORMATS), f"{where}.peak_flops", origin)
    peak: dict[str, float | None] = {}
    for fmt in FLOP_FORMATS:
        value = flops[fmt]
        if value is None and fmt != "fp32":
            peak[fmt] = None
        else:
            peak[fmt] = float(_number(value, f"{where}.peak_flops.{fmt}", origin, RATE))
    return GPUSpec(
        name=name,
        source=_text(entry["source"], f"{where}.source", origin),
        node=_text(entry["node"], f"{where}.node", origin),
        peak_flops=peak,
        hbm_bytes=_integer(entry["hbm_bytes"], f"{where}.hbm_bytes", origin, BYTES),
        hbm_bandwidth=float(_number(entry["hbm_bandwidth"], f"{where}.hbm_bandwidth", origin, RATE)),
        nvlink_bandwidth=float(_number(entry["nvlink_bandwidth"], f"{where}.nvlink_bandwidth", origin, RATE)),
        nvlink_latency=float(_number(entry["nvlink_latency"], f"{where}.nvlink_latency", origin, SECONDS,
                                     allow_zero=True)),
        matmul_efficiency=_parse_efficiency(entry.get("matmul_efficiency"), where, origin),
        collectives=_parse_collectives(entry.get("collectives"), where, origin),
        calibration=_parse_calibration(entry.get("calibration"), where, origin),
        measured=_parse_measured(entry.get("measured"), where, origin),
        achieved=parse_achieved(entry.get("achieved"), f"{origin}: {where}"),
        **{key: parse_attention_efficiency(entry.get(key), f"{origin}: {where}", key) for key in ATTENTION_FIELDS},
    )


def _parse_efficiency(data: object, where: str, origin: str):
    if data is None:
        return None
    return parse_efficiency_profile(data, f"{origin}: {where}")


def _parse_measured(data: object, where: str, origin: str):
    if data is None:
        return None
    return parse_measured_host(data, f"{origin}: {where}")


def _parse_collectives(data: object, where: str, origin: str) -> dict[str, CollectiveFit] | None:
    if data is None:
        return None
    where = f"{where}.collectives"
    if not isinstance(data, dict):
        raise ConfigError(f"{origin}: {where} must be a JSON object of {', '.join(COLLECTIVE_KINDS)}")
    fits = {}
    for kind, fit in data.items():
        if kind not in COLLECTIVE_KINDS:
            raise ConfigError(f"{origin}: {where} has unknown collective {kind!r}: use {', '.join(COLLECTIVE_KINDS)}")
        at = f"{where}.{kind}"
        fields = {"ranks", "alpha", "beta"} | ({"points"} & fit.keys() if isinstance(fit, dict) else set())
        fit = _check_keys(fit, fields, at, origin)
        ranks = _integer(fit["ranks"], f"{at}.ranks", origin)
        if ranks < 2:
            raise ConfigError(f"{origin}: {at}.ranks must be at least 2, got {ranks}")
        points = fit.get("points", [])
        if not isinstance(points, list) or not all(
            isinstance(p, list) and len(p) == 2 and in_range(p[0], BYTES) and in_range(p[1], SECONDS) and p[1] > 0
            for p in points
        ):
            raise ConfigError(f"{origin}: {at}.points must be [[bytes, seconds], ...] of positive numbers "
                              f"(bytes up to {BYTES[1]:g}, seconds up to {SECONDS[1]:g})")
        fits[kind] = CollectiveFit(
            kind=kind,
            ranks=ranks,
            alpha=float(_number(fit["alpha"], f"{at}.alpha", origin, SECONDS, allow_zero=True)),
            beta=float(_number(fit["beta"], f"{at}.beta", origin, SECONDS_PER_BYTE)),
            points=tuple((int(b), float(t)) for b, t in points),
        )
    return fits


def _parse_calibration(data: object, where: str, origin: str) -> dict | None:
    if data is None:
        return None
    if not isinstance(data, dict):
        raise ConfigError(f"{origin}: {where}.calibration must be a JSON object of notes")
    if "ranks_per_core" in data:
        _number(data["ranks_per_core"], f"{where}.calibration.ranks_per_core", origin, (1 / COUNT[1], COUNT[1]))
    return data


def _parse_node(name: str, entry: object, origin: str) -> NodeSpec:
    where = _where("nodes", name)
    entry = _check_keys(entry, {"source", "gpus_per_node", "nics_per_node", "nvswitch", "nic"}, where, origin)
    if not isinstance(entry["nvswitch"], bool):
        raise ConfigError(f"{origin}: {where}.nvswitch must be true or false, got {entry['nvswitch']!r}")
    return NodeSpec(
        name=name,
        source=_text(entry["source"], f"{where}.source", origin),
        gpus_per_node=_integer(entry["gpus_per_node"], f"{where}.gpus_per_node", origin),
        nics_per_node=_integer(entry["nics_per_node"], f"{where}.nics_per_node", origin),
        nvswitch=entry["nvswitch"],
        nic=_text(entry["nic"], f"{where}.nic", origin),
    )


def _parse_nic(name: str, entry: object, origin: str) -> NICSpec:
    where = _where("nics", name)
    fields = {"source", "bandwidth", "latency", "switch_latency", "switch_radix"}
    entry = _check_keys(entry, fields | ({"busbw_fraction"} & entry.keys() if isinstance(entry, dict) else set()),
                        where, origin)
    radix = _integer(entry["switch_radix"], f"{where}.switch_radix", origin)
    if radix < 2:
        raise ConfigError(f"{origin}: {where}.switch_radix must be at least 2 ports, got {radix}")
    return NICSpec(
        name=name,
        source=_text(entry["source"], f"{where}.source", origin),
        bandwidth=float(_number(entry["bandwidth"], f"{where}.bandwidth", origin, RATE)),
        latency=float(_number(entry["latency"], f"{where}.latency", origin, SECONDS, allow_zero=True)),
        switch_latency=float(_number(entry["switch_latency"], f"{where}.switch_latency", origin, SECONDS,
                                     allow_zero=True)),
        switch_radix=radix,
        busbw_fraction=fraction(entry.get("busbw_fraction", 1.0), f"{origin}: {where}.busbw_fraction"),
    )


# ---------------------------------------------------------------- catalogs


@dataclass(frozen=True)
class Catalog:
    """Everything one hardware file holds, checked."""

    gpus: dict[str, GPUSpec]
    nodes: dict[str, NodeSpec]
    nics: dict[str, NICSpec]

    def hardware(self, gpu_name: str, origin: str = "hardware") -> Hardware:
        if gpu_name not in self.gpus:
            raise ConfigError(f"unknown hardware {gpu_name!r}: choose one of {', '.join(self.gpus)} or give a profile file path")
        gpu = self.gpus[gpu_name]
        node = self.nodes[gpu.node]
        return Hardware(name=gpu_name, gpu=gpu, node=node, nic=self.nics[node.nic])

    def nic(self, name: str) -> NICSpec:
        if name not in self.nics:
            raise ConfigError(f"unknown network fabric {name!r}: choose one of {', '.join(self.nics)}")
        return self.nics[name]


def parse_catalog(data: object, origin: str) -> Catalog:
    """Check a decoded hardware file; every problem raises ConfigError naming the field."""
    if not isinstance(data, dict):
        raise ConfigError(f"{origin}: a hardware file must hold a JSON object with gpus, nodes and nics")
    unknown = sorted(data.keys() - TOP_LEVEL_KEYS)
    if unknown:
        raise ConfigError(f"{origin}: unknown top-level key(s) {', '.join(unknown)}: expected {', '.join(sorted(TOP_LEVEL_KEYS))}")
    sections = {}
    for section in ("gpus", "nodes", "nics"):
        entries = data.get(section)
        if not isinstance(entries, dict) or not entries:
            raise ConfigError(f"{origin}: '{section}' must be a non-empty JSON object of named entries")
        sections[section] = entries
    nics = {name: _parse_nic(name, entry, origin) for name, entry in sections["nics"].items()}
    nodes = {name: _parse_node(name, entry, origin) for name, entry in sections["nodes"].items()}
    gpus = {name: _parse_gpu(name, entry, origin) for name, entry in sections["gpus"].items()}
    for node in nodes.values():
        if node.nic not in nics:
            raise ConfigError(f"{origin}: nodes.{node.name}.nic names {node.nic!r}, which is not in nics ({', '.join(nics)})")
    for gpu in gpus.values():
        if gpu.node not in nodes:
            raise ConfigError(f"{origin}: gpus.{gpu.name}.node names {gpu.node!r}, which is not in nodes ({', '.join(nodes)})")
    return Catalog(gpus=gpus, nodes=nodes, nics=nics)


def read_catalog(path: str | Path) -> Catalog:
    """A hardware file, read and checked: whatever its bytes, a Catalog or ConfigError (simulator/json_file.py)."""
    return parse_catalog(read_json_file(path, "hardware file"), str(path))


_presets: Catalog | None = None


def presets() -> Catalog:
    """The built-in catalog from simulator/costs/hardware.json (read once)."""
    global _presets
    if _presets is None:
        _presets = read_catalog(PRESETS_FILE)
    return _presets


def preset_names() -> list[str]:
    return list(presets().gpus)


def load_hardware(name_or_path: str | Path) -> Hardware:
    """A preset name (a GPU of hardware.json) or the path of a profile file holding one GPU."""
    if not isinstance(name_or_path, (str, Path)):
        raise ConfigError(f"hardware must be a preset name or a profile path, got {name_or_path!r}")
    text = str(name_or_path)
    if isinstance(name_or_path, str) and text in presets().gpus:
        return presets().hardware(text)
    if not (text.endswith(".json") or _exists(text)):
        raise ConfigError(f"unknown hardware {text!r}: choose one of {', '.join(preset_names())} or give a profile file path (.json)")
    catalog = read_catalog(text)
    if len(catalog.gpus) != 1:
        raise ConfigError(
            f"profile {text!r} holds {len(catalog.gpus)} GPUs ({', '.join(catalog.gpus)}): a profile describes one GPU, keep one"
        )
    return catalog.hardware(next(iter(catalog.gpus)), origin=text)


def _exists(text: str) -> bool:
    try:
        return Path(text).exists()
    except (OSError, ValueError):  # a name too long for the file system, or holding a NUL byte
        return False


# The presets' GPUs by the name torch.cuda.get_device_name() gives them. Only the SXM parts the presets
# describe: PCIe and NVL boards (other clocks, power and links) and GH200 (another memory) match nothing.
DEVICE_NAME_PATTERNS = (
    (r"\bh200\b", "h200"),  # "NVIDIA H200"
    (r"\bh100\b", "h100-sxm"),  # "NVIDIA H100 80GB HBM3" (SXM5)
    (r"\ba100-sxm4-80gb\b", "a100-80gb"),  # "NVIDIA A100-SXM4-80GB"
    (r"\ba100-sxm4-40gb\b", "a100-40gb"),  # "NVIDIA A100-SXM4-40GB"
)


def preset_for_device(device_name: str) -> str | None:
    """The preset whose GPU a CUDA device name (torch.cuda.get_device_name) is, or None."""
    name = device_name.lower()
    if re.search(r"pcie|\bnvl\b", name):
        return None
    return next((preset for pattern, preset in DEVICE_NAME_PATTERNS if re.search(pattern, name)), None)


def preset_links(device_name: str) -> dict | None:
    """The link figures (NVLink, node, NIC), datasheet peaks and attention table of the preset matching
    `device_name`, as plain JSON-ready data for `minigpt calibrate` with one rank; None when no preset matches."""
    name = preset_for_device(device_name)
    if name is None:
        return None
    hardware = presets().hardware(name)
    node, nic = asdict(hardware.node), asdict(hardware.nic)
    del node["name"], nic["name"]
    return {"preset": name, "gpu_source": hardware.gpu.source, "peak_flops": dict(hardware.gpu.peak_flops),
            "nvlink_bandwidth": hardware.gpu.nvlink_bandwidth, "nvlink_latency": hardware.gpu.nvlink_latency,
            "node_name": hardware.node.name, "node": node, "nic_name": hardware.nic.name, "nic": nic,
            "attention_efficiency": (None if hardware.gpu.attention_efficiency is None
                                     else hardware.gpu.attention_efficiency.as_dict())}


def load_nic(name: str) -> NICSpec:
    """A NIC preset by name ("hdr", "ndr")."""
    return presets().nic(name)


def hardware_to_dict(hardware: Hardware) -> dict:
    """The profile-file form of `hardware` (the schema of hardware.json, one GPU)."""

    def entry(spec) -> dict:
        data = asdict(spec)
        del data["name"]
        return data

    def gpu_entry(gpu: GPUSpec) -> dict:
        data = {name: getattr(gpu, name) for name in
                ("source", "node", "peak_flops", "hbm_bytes", "hbm_bandwidth", "nvlink_bandwidth", "nvlink_latency")}
        data["peak_flops"] = dict(gpu.peak_flops)
        if gpu.matmul_efficiency is not None:  # tables, source, the GEMM model (simulator/costs/rates/efficiency.py)
            data["matmul_efficiency"] = gpu.matmul_efficiency.as_dict()
        if gpu.collectives is not None:
            data["collectives"] = {
                kind: {"ranks": fit.ranks, "alpha": fit.alpha, "beta": fit.beta, "points": [list(p) for p in fit.points]}
                for kind, fit in gpu.collectives.items()
            }
        if gpu.calibration is not None:
            data["calibration"] = gpu.calibration
        if gpu.measured is not None:
            data["measured"] = gpu.measured.raw
        if gpu.achieved is not None:
            data["achieved"] = gpu.achieved.as_dict()
        for key in ATTENTION_FIELDS:
            if getattr(gpu, key) is not None:
                data[key] = getattr(gpu, key).as_dict()
        return data

    return {
        "about": f"hardware profile {hardware.name}",
        "gpus": {hardware.gpu.name: gpu_entry(hardware.gpu)},
        "nodes": {hardware.node.name: entry(hardware.node)},
        "nics": {hardware.nic.name: entry(hardware.nic)},
    }


def save_hardware(hardware: Hardware, path: str | Path) -> Path:
    """Write `hardware` as a profile file that `load_hardware(path)` reads back equal."""
    path = Path(path)
    path.write_text(json.dumps(hardware_to_dict(hardware), indent=2) + "\n")
    return path
