"""Which algorithm NCCL would run a collective with, and what it would cost. Torch-free.

NCCL's tuner predicts a time for every algorithm and protocol it may use and runs the fastest
(NVIDIA/nccl src/graph/tuning.cc; the NCCL maintainers: "a model of the latency and bandwidth of each
algorithm/protocol combination ... decides which one should perform best depending on the size").
This module does the same with published figures (simulator/network/nccl.json, docs/efficiency.md,
"Collective algorithms") on top of the topology's own ring (simulator/engine/links.py), so contention
and fabrics keep mattering. A call is a kind (all_reduce, all_gather, reduce_scatter) on n ranks over N
servers, g at most on one; the engine gives the topology ring's time R(S) and its latency part
L_ring (steps x the slowest hop, the network hop L_net = L_ring / steps once N > 1), W = R - L_ring.

Algorithms (all-reduce only, but the ring):
  ring      the topology ring as it is: latency L_ring, bandwidth term W.
  tree      NCCL's double binary tree across servers, a chain inside each (N >= 2): latency
            2 ((g - 1) L_nvlink + ceil(log2 N) L_net) (log-depth); every server sends and receives 2S on
            its network links where the ring moves 2(n-1)/n S, or S on two servers (the tree's two-node
            advantage, NVIDIA/nccl #946): W x n/(n-1) (x n/(2(n-1)) on two servers) / tree_busbw_ratio,
            the published tree over ring bus bandwidth at large sizes.
  nvls      NVLink SHARP on one server of an NVSwitch-3 (or later) node with at least min_gpus ranks:
            the switch reduces; latency 2 L_nvlink, bandwidth the published NVLS algorithm bandwidth
            (busbw x n / (2(n-1)) of the measured n): S / algbw.
  nvlstree  NVLS inside each server (g >= min_gpus), a tree across (N >= 2): latency 2 L_nvlink +
            2 ceil(log2 N) L_net, bandwidth term the larger of NVLS's and the tree's network term.
  collnet   in-network reduction (InfiniBand SHARP) where the fabric has it (off in the presets:
            nccl.json's NICs say why): every server sends S up and gets S back, W x n/(2(n-1)), latency
            2 L_net (+ 2 L_nvlink inside a server).
Protocols: LL moves half the bandwidth (ll_bandwidth: 4 bytes of data per 8-byte store) with the
published small-message floor; Simple the full bandwidth with the Simple floor (the published time of
the first size NCCL runs Simple at, less its transfer; the LL floor where none is published). A call
costs max(floor, latency + bandwidth term / protocol share): nothing finishes below the published
small-message time of its node, and above it the hops and bytes count. Ring and tree floors scale with
the ring's steps against the measured all-reduce's (2 (ranks - 1)); NVLS-family floors do not.
Measured: where nccl.json holds nccl-tests' all-reduce bus bandwidth by size on a node's GPUs
(all_reduce_busbw: Azure's tables for 8x A100 and 8x H200), an all-reduce on that many GPUs of one
server takes at least the measured time at its size (read between the measured sizes), whatever
the algorithm: the links' model reaches the large-message bandwidth from a few MiB on, NCCL only
from about 1 GiB (8x A100: 167 GB/s at 64 MiB, 228 at 1 GiB).
All-gather and reduce-scatter run the ring (NCCL's NVLS for them is not modelled: the published 8x H200
runs chose the ring, and no NVLS figure for them was found). The fastest wins; at equal times LL before
Simple, then the lower time without the floor. A forced algorithm (--nccl-algo, as NCCL_ALGO) is used
wherever it can run; elsewhere (nvls across servers, tree inside one, all-gather) the ring, said so.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from minigpt.errors import ConfigError
from simulator.json_file import COUNT, FRACTION, RATE, SECONDS, in_range, read_json_file

DATA_FILE = Path(__file__).with_name("nccl.json")
ALGORITHMS = ("ring", "tree", "nvls", "nvlstree", "collnet")
CHOICES = ("auto",) + ALGORITHMS
KINDS = ("all_reduce", "all_gather", "reduce_scatter")
PROTOCOLS = ("LL", "Simple")


def ring_steps(kind: str, n: int) -> int:
    return 2 * (n - 1) if kind == "all_reduce" else n - 1


def check_algorithm(name: object) -> str:
    """An --nccl-algo value (any case), or one ConfigError line naming the choices."""
    value = name.lower() if isinstance(name, str) else name
    if value not in CHOICES:
        raise ConfigError(f"--nccl-algo must be one of {', '.join(CHOICES)} (as NCCL_ALGO), got {name!r}")
    return value


# ---------------------------------------------------------------- the data


@dataclass(frozen=True)
class NodeCollectives:
    """What NCCL reaches on one kind of server (nccl.json "nodes"); None where nothing is published."""

    name: str
    small_message: float | None = None  # seconds of a small all-reduce on `small_ranks` GPUs (LL's floor)
    small_ranks: int = 8
    simple_floor: float | None = None  # the Simple protocol's floor (None: small_message's)
    nvls_busbw: float | None = None  # NVLS all-reduce bus bandwidth on `nvls_ranks` GPUs (None: no NVLS)
    nvls_ranks: int = 8
    nvls_min_gpus: int = 5
    # all_reduce_perf's bus bandwidth on `measured_ranks` GPUs of one server at 2^i x first_bytes bytes (empty: none)
    measured_busbw: tuple[float, ...] = ()
    measured_first: int = 1024
    measured_ranks: int = 8

    def measured_seconds(self, nbytes: float, ranks: int) -> float:
        """The time nccl-tests measured for an all-reduce of `nbytes` on this node's `measured_ranks` GPUs, its bus
        bandwidth read between the two measured sizes around it (linear in log2 of the size; the end points held
        beyond them); 0 without a table."""
        if not self.measured_busbw or ranks != self.measured_ranks or nbytes <= 0:
            return 0.0
        place = min(max(math.log2(nbytes / self.measured_first), 0.0), len(self.measured_busbw) - 1.0)
        low = int(place)
        high = min(low + 1, len(self.measured_busbw) - 1)
        busbw = self.measured_busbw[low] + (place - low) * (self.measured_busbw[high] - self.measured_busbw[low])
        return nbytes * 2 * (ranks - 1) / ranks / busbw

    @property
    def nvls_algbw(self) -> float:
        """Bytes of the buffer per second (nccl-tests' algbw): the busbw over 2(n-1)/n of the measured n."""
        return self.nvls_busbw * self.nvls_ranks / (2 * (self.nvls_ranks - 1))


@dataclass(frozen=True)
class Tuning:
    tree_busbw_ratio: float = 1.0
    ll_bandwidth: float = 0.5


@dataclass(frozen=True)
class Catalog:
    nodes: dict
    in_network: dict  # NIC preset -> in-network reduction (bool)
    tuning: Tuning


def _number(value: object, where: str, bounds: tuple[float, float]) -> float:
    if not in_range(value, bounds):
        raise ConfigError(f"{DATA_FILE.name}: {where} must be a number from {bounds[0]:g} to {bounds[1]:g}, got {value!r}")
    return float(value)


def _ranks(value: object, where: str) -> int:
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool) or not 2 <= value <= COUNT[1]:
        raise ConfigError(f"{DATA_FILE.name}: {where} must be a whole number of GPUs >= 2, got {value!r}")
    return value


def _node(name: str, entry: object) -> NodeCollectives:
    where = f"nodes.{name}"
    known = {"source", "small_message", "simple_floor", "nvls", "all_reduce_busbw"}
    if not isinstance(entry, dict) or not isinstance(entry.get("source"), str) or set(entry) - known:
        raise ConfigError(f"{DATA_FILE.name}: {where} must be an object of {', '.join(sorted(known))} (source required)")
    fields: dict = {"name": name}
    small = entry.get("small_message")
    if small is not None:
        if not isinstance(small, dict) or set(small) != {"seconds", "ranks"}:
            raise ConfigError(f"{DATA_FILE.name}: {where}.small_message must be {{\"seconds\", \"ranks\"}}")
        fields["small_message"] = _number(small["seconds"], f"{where}.small_message.seconds", SECONDS)
        fields["small_ranks"] = _ranks(small["ranks"], f"{where}.small_message.ranks")
    if entry.get("simple_floor") is not None:
        fields["simple_floor"] = _number(entry["simple_floor"], f"{where}.simple_floor", SECONDS)
    nvls = entry.get("nvls")
    if nvls is not None:
        if not isinstance(nvls, dict) or set(nvls) != {"busbw", "ranks", "min_gpus"}:
            raise ConfigError(f"{DATA_FILE.name}: {where}.nvls must be {{\"busbw\", \"ranks\", \"min_gpus\"}}")
        fields["nvls_busbw"] = _number(nvls["busbw"], f"{where}.nvls.busbw", RATE)
        fields["nvls_ranks"] = _ranks(nvls["ranks"], f"{where}.nvls.ranks")
        fields["nvls_min_gpus"] = _ranks(nvls["min_gpus"], f"{where}.nvls.min_gpus")
    measured = entry.get("all_reduce_busbw")
    if measured is not None:
        if not isinstance(measured, dict) or set(measured) != {"ranks", "first_bytes", "busbw", "source"} or not (
                isinstance(measured["busbw"], list) and measured["busbw"]):
            raise ConfigError(f"{DATA_FILE.name}: {where}.all_reduce_busbw must be {{\"ranks\", \"first_bytes\", "
                              f"\"busbw\": [bytes/s, ...], \"source\"}}")
        fields["measured_busbw"] = tuple(_number(v, f"{where}.all_reduce_busbw.busbw", RATE) for v in measured["busbw"])
        fields["measured_first"] = int(_number(measured["first_bytes"], f"{where}.all_reduce_busbw.first_bytes", COUNT))
        fields["measured_ranks"] = _ranks(measured["ranks"], f"{where}.all_reduce_busbw.ranks")
    return NodeCollectives(**fields)


def parse_catalog(data: object) -> Catalog:
    """nccl.json, checked: every problem a ConfigError naming the field."""
    if not isinstance(data, dict) or not {"nodes", "nics", "algorithms"} <= set(data):
        raise ConfigError(f"{DATA_FILE.name}: needs 'nodes', 'nics' and 'algorithms'")
    nodes, nics, algorithms = data["nodes"], data["nics"], data["algorithms"]
    if not isinstance(nodes, dict) or not isinstance(nics, dict) or not isinstance(algorithms, dict):
        raise ConfigError(f"{DATA_FILE.name}: 'nodes', 'nics' and 'algorithms' must be JSON objects")
    in_network = {}
    for name, entry in nics.items():
        if not isinstance(entry, dict) or not isinstance(entry.get("in_network_reduction"), bool):
            raise ConfigError(f"{DATA_FILE.name}: nics.{name}.in_network_reduction must be true or false")
        in_network[name] = entry["in_network_reduction"]
    tuning = Tuning(_number(algorithms.get("tree_busbw_ratio"), "algorithms.tree_busbw_ratio", FRACTION),
                    _number(algorithms.get("ll_bandwidth"), "algorithms.ll_bandwidth", FRACTION))
    return Catalog({name: _node(name, entry) for name, entry in nodes.items()}, in_network, tuning)


@lru_cache(maxsize=1)
def catalog() -> Catalog:
    """The published figures of simulator/network/nccl.json (read once)."""
    return parse_catalog(read_json_file(DATA_FILE, "NCCL collectives file"))


# ---------------------------------------------------------------- one call


@dataclass(frozen=True)
class Call:
    """One collective as the topology sees it (simulator/engine/links.py fills it in)."""

    kind: str
    ranks: int
    servers: int
    per_server: int  # the most ranks of the group on one server
    nbytes: float
    ring_seconds: float  # the topology ring, latency included
    ring_latency: float  # its steps x the slowest hop
    nvlink_latency: float  # one GPU-to-GPU step through the NVSwitch


@dataclass(frozen=True)
class Choice:
    algorithm: str
    protocol: str
    seconds: float
    note: str = ""  # why a forced algorithm was not used


Option = tuple  # (seconds, protocol rank, seconds without the floor, algorithm, protocol): the pick is the least


def option(algorithm: str, protocol: str, floor: float, latency: float, wire: float) -> Option:
    """One algorithm and protocol: max(floor, latency + wire), ties to LL, then to the faster without the floor."""
    unfloored = latency + wire
    return (floor if floor > unfloored else unfloored), (0 if protocol == "LL" else 1), unfloored, algorithm, protocol


class NcclModel:
    """The algorithms a node and fabric offer, their predicted times, and the pick (see the module docstring)."""

    def __init__(self, node: NodeCollectives | None, in_network: bool = False, tuning: Tuning | None = None,
                 algorithm: str = "auto") -> None:
        self.node = node or NodeCollectives("unknown")
        self.in_network = in_network
        self.tuning = tuning or catalog().tuning
        self.algorithm = check_algorithm(algorithm)

    @classmethod
    def for_hardware(cls, node: str, nic: str | None, algorithm: str = "auto",
                     in_network: bool | None = None) -> "NcclModel":
        """The model for a GPU's node preset and a NIC preset (unknown names: no published figures, the
        links' own latencies; in_network None: the NIC's entry)."""
        data = catalog()
        sharp = data.in_network.get(nic, False) if in_network is None else in_network
        return cls(data.nodes.get(node), sharp, data.tuning, algorithm)

    # ------------------------------------------------------------ floors

    def floor(self, protocol: str, steps: int | None) -> float:
        """The published floor of a call of `steps` ring steps (None: an NVLS-family call, not scaled)."""
        node = self.node
        base = node.small_message if protocol == "LL" else (node.simple_floor or node.small_message)
        if base is None:
            return 0.0
        return base if steps is None else base * min(1.0, steps / (2 * (node.small_ranks - 1)))

    # ------------------------------------------------------------ the options

    def options(self, call: Call) -> list[Option]:
        n, servers, g = call.ranks, call.servers, call.per_server
        steps = ring_steps(call.kind, n)
        wire = max(0.0, call.ring_seconds - call.ring_latency)
        ll, floor = self.tuning.ll_bandwidth, self.floor
        found = [option("ring", "LL", floor("LL", steps), call.ring_latency, wire / ll),
                 option("ring", "Simple", floor("Simple", steps), call.ring_latency, wire)]
        if call.kind != "all_reduce":
            return found
        node, nvlink = self.node, call.nvlink_latency
        nvls = node.nvls_busbw is not None
        if servers == 1:
            if nvls and n >= node.nvls_min_gpus:
                found.append(option("nvls", "Simple", floor("Simple", None), 2 * nvlink, call.nbytes / node.nvls_algbw))
            return found
        hop = call.ring_latency / steps  # the slowest hop of a synchronous ring step: one across servers
        depth = math.ceil(math.log2(servers))
        traffic = n / (2 * (n - 1)) if servers == 2 else n / (n - 1)
        tree, latency = wire * traffic / self.tuning.tree_busbw_ratio, 2 * ((g - 1) * nvlink + depth * hop)
        found += [option("tree", "LL", floor("LL", steps), latency, tree / ll),
                  option("tree", "Simple", floor("Simple", steps), latency, tree)]
        if nvls and g >= node.nvls_min_gpus:
            found.append(option("nvlstree", "Simple", floor("Simple", None), 2 * nvlink + 2 * depth * hop,
                                max(call.nbytes / node.nvls_algbw, tree)))
        if self.in_network:
            found.append(option("collnet", "Simple", floor("Simple", None), (2 * nvlink if g > 1 else 0.0) + 2 * hop,
                                wire * n / (2 * (n - 1))))
        return found

    def why_not(self, call: Call) -> str:
        """Why the forced algorithm has no option for `call`."""
        if call.kind != "all_reduce":
            return f"NCCL runs {call.kind.replace('_', '-')} on the ring here"
        if self.algorithm in ("nvls", "nvlstree") and self.node.nvls_busbw is None:
            return f"no NVLink SHARP on {self.node.name}"
        if self.algorithm == "nvls":
            return (f"NVLS needs one server of at least {self.node.nvls_min_gpus} GPUs, not {call.ranks} on "
                    f"{call.servers}")
        if self.algorithm == "collnet" and not self.in_network:
            return "the fabric reduces nothing in the network"
        if call.servers == 1:
            return "it runs across servers"
        return f"NVLS+tree needs at least {self.node.nvls_min_gpus} GPUs of the group on a server, not {call.per_server}"

    def choose(self, call: Call) -> Choice:
        """The algorithm and protocol NCCL would run `call` with (the forced one where it can run)."""
        if call.kind not in KINDS:
            raise ConfigError(f"unknown collective {call.kind!r}: choose one of {', '.join(KINDS)}")
        options, note = self.options(call), ""
        if self.algorithm != "auto":
            forced = [o for o in options if o[3] == self.algorithm]
            if not forced:
                note = f"{self.algorithm} cannot run this call ({self.why_not(call)}): ring"
            options = forced or [o for o in options if o[3] == "ring"]
        seconds, _, _, algorithm, protocol = min(options)
        if call.kind == "all_reduce" and call.servers == 1:  # no algorithm beats what NCCL's own choice was measured at
            seconds = max(seconds, self.node.measured_seconds(call.nbytes, call.ranks))
        return Choice(algorithm, protocol, seconds, note)
