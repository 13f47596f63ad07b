"""Cluster topologies as networkx graphs: GPUs, NVSwitches, NICs, leaf and spine switches.

A cluster is a directed graph: every cable is two edges, one per direction, each with
`bandwidth` (bytes/s) and `latency` (s). Node attribute `type` is one of NODE_TYPES;
GPUs and NICs also carry `node` (server index) and `local` (index inside the server).

Built clusters (`build_cluster`):
- inside a server every GPU has an NVLink edge to the server's NVSwitch (one logical,
  non-blocking switch standing for the NVSwitch chips) at the GPU's NVLink bandwidth;
- every GPU has its own NIC (GPUDirect RDMA; the PCIe hop is not a bottleneck and is
  folded into the GPU-NIC edge, which runs at the NIC's bandwidth);
- NICs plug into leaf switches. "fat-tree": NICs fill leaves in rank order, radix/2
  ports down per leaf. "rail": NIC i of every server goes to rail i's leaf (rail-optimised).
  When there is more than one leaf, spines sit above; every leaf has one uplink to every
  spine and as many spines as its busiest leaf has NICs (capped at radix/2), so the
  fabric is non-blocking. Past radix leaves a spine stands for a group of switches.

Latency convention: an edge's latency is what crossing it costs. GPU<->NVSwitch edges
carry half the GPU's nvlink_latency each (a GPU-to-GPU step costs nvlink_latency),
GPU<->NIC edges half the NIC's per-message latency each, edges into a leaf or spine
switch the switch latency, edges from a switch into a NIC nothing.

Routing (`Cluster.route`): fewest hops, and a GPU is never a transit node, so GPUs of
one server always talk through the NVSwitch (2 hops) and never through NICs; across
servers the path is GPU -> NIC -> leaf (-> spine -> leaf) -> NIC -> GPU. Among equal
paths the choice depends on the destination only, like InfiniBand's D-mod-k tables:
walking back from the destination, a switch picks among its equal-cost predecessors
by the port the path leaves it on (the destination NIC's port on its leaf picks the
spine), so destinations under one leaf come down through different spines.
"""

from __future__ import annotations

import json
from pathlib import Path

import networkx as nx

from minigpt.errors import ConfigError
from simulator.hardware import GPUSpec, Hardware, NICSpec, load_hardware, load_nic

NODE_TYPES = ("gpu", "nvswitch", "nic", "leaf", "spine")
CLUSTER_KINDS = ("fat-tree", "rail")

Edge = tuple[str, str]


class Cluster:
    """A checked topology graph with rank order and routes."""

    def __init__(self, graph: nx.Graph, origin: str = "cluster") -> None:
        if graph.is_multigraph():
            raise ConfigError(f"{origin}: parallel edges are not supported: merge them into one edge per direction")
        if not graph.is_directed():
            graph = graph.to_directed()
        self.graph = nx.relabel_nodes(graph, {node: str(node) for node in graph}, copy=True)
        self.origin = origin
        self._check()
        gpus = [node for node, data in self.graph.nodes(data=True) if data["type"] == "gpu"]
        self.gpus: list[str] = sorted(gpus, key=lambda gpu: (self.graph.nodes[gpu]["node"], self.graph.nodes[gpu]["local"]))
        self.rank = {gpu: rank for rank, gpu in enumerate(self.gpus)}
        self._bandwidth = {(u, v): float(data["bandwidth"]) for u, v, data in self.graph.edges(data=True)}
        self._latency = {(u, v): float(data["latency"]) for u, v, data in self.graph.edges(data=True)}
        self._routes: dict[Edge, list[Edge]] = {}
        self._ports: dict[str, dict[str, int]] = {}
        self._check_connected()

    # ------------------------------------------------------------ checks

    def _check(self) -> None:
        origin = self.origin
        for node, data in self.graph.nodes(data=True):
            kind = data.get("type")
            if kind not in NODE_TYPES:
                raise ConfigError(f"{origin}: node {node!r} has unknown type {kind!r}: use one of {', '.join(NODE_TYPES)}")
            if kind == "gpu":
                for key in ("node", "local"):
                    value = data.get(key)
                    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                        raise ConfigError(f"{origin}: GPU {node!r} needs a non-negative integer '{key}' attribute, got {value!r}")
        places = [(d["node"], d["local"]) for _, d in self.graph.nodes(data=True) if d["type"] == "gpu"]
        if not places:
            raise ConfigError(f"{origin}: the topology has no GPU: add nodes with type 'gpu'")
        if len(set(places)) != len(places):
            raise ConfigError(f"{origin}: two GPUs share the same (node, local) attributes: give every GPU its own place")
        for u, v, data in self.graph.edges(data=True):
            for key in ("bandwidth", "latency"):
                value = data.get(key)
                if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
                    raise ConfigError(f"{origin}: edge {u!r} -> {v!r} has no numeric '{key}': give every edge bandwidth (bytes/s) and latency (s)")
            if data["bandwidth"] <= 0 or data["latency"] < 0:
                raise ConfigError(f"{origin}: edge {u!r} -> {v!r} needs bandwidth > 0 and latency >= 0, got {data['bandwidth']!r}, {data['latency']!r}")

    def _check_connected(self) -> None:
        first = self.gpus[0]
        for reverse, verb in ((False, "be reached from"), (True, "reach")):
            reached = self._predecessors(first, None, reverse=reverse)
            for gpu in self.gpus:
                if gpu not in reached:
                    raise ConfigError(f"{self.origin}: GPU {gpu!r} cannot {verb} GPU {first!r}: connect every GPU to the network")

    # ------------------------------------------------------------ queries

    def node_of(self, gpu: str | int) -> int:
        """The server index of a GPU (by id or rank)."""
        return self.graph.nodes[self.gpu_id(gpu)]["node"]

    def gpu_id(self, gpu: str | int) -> str:
        """The GPU's node id; an int is read as a rank."""
        if isinstance(gpu, int) and not isinstance(gpu, bool):
            if not 0 <= gpu < len(self.gpus):
                raise ConfigError(f"rank {gpu} is outside the cluster's {len(self.gpus)} GPUs")
            return self.gpus[gpu]
        if gpu not in self.rank:
            raise ConfigError(f"{gpu!r} is not a GPU of this cluster: use a rank (0..{len(self.gpus) - 1}) or a GPU id like {self.gpus[0]!r}")
        return gpu

    @property
    def n_nodes(self) -> int:
        return len({self.graph.nodes[gpu]["node"] for gpu in self.gpus})

    def bandwidth(self, edge: Edge) -> float:
        return self._bandwidth[edge]

    def latency(self, edge: Edge) -> float:
        return self._latency[edge]

    def route(self, src: str | int, dst: str | int) -> list[Edge]:
        """The directed edges from GPU src to GPU dst (empty when src == dst)."""
        src, dst = self.gpu_id(src), self.gpu_id(dst)
        key = (src, dst)
        if key not in self._routes:
            self._routes[key] = self._find_route(src, dst)
        return self._routes[key]

    def route_latency(self, src: str | int, dst: str | int) -> float:
        return sum(self._latency[edge] for edge in self.route(src, dst))

    def route_bandwidth(self, src: str | int, dst: str | int) -> float:
        """The bottleneck bandwidth of the route (inf when src == dst)."""
        return min((self._bandwidth[edge] for edge in self.route(src, dst)), default=float("inf"))

    def _predecessors(self, src: str, dst: str | None, reverse: bool = False) -> dict[str, list[str]]:
        """Breadth-first search from src that never passes through another GPU.

        Stops once dst's depth is complete (dst None: explores everything). With
        reverse=True it follows edges backwards (who can reach src).
        """
        graph = self.graph
        neighbours = graph.predecessors if reverse else graph.successors
        preds: dict[str, list[str]] = {src: []}
        frontier = [src]
        while frontier and dst not in preds:
            reached: dict[str, list[str]] = {}
            for node in frontier:
                if node != src and graph.nodes[node]["type"] == "gpu":
                    continue
                for nxt in neighbours(node):
                    if nxt not in preds:
                        reached.setdefault(nxt, []).append(node)
            preds.update(reached)
            frontier = list(reached)
        return preds

    def _find_route(self, src: str, dst: str) -> list[Edge]:
        """Walk back from dst over shortest-path predecessors, choosing among equals by destination."""
        if src == dst:
            return []
        preds = self._predecessors(src, dst)
        if dst not in preds:
            raise ConfigError(f"{self.origin}: no route from {src!r} to {dst!r}: connect them")
        path, key = [dst], self.rank[dst]
        while path[-1] != src:
            options = sorted(preds[path[-1]])
            path.append(options[key % len(options)])
            key = self._port(path[-1], path[-2])
        path.reverse()
        return list(zip(path[:-1], path[1:]))

    def _port(self, switch: str, towards: str) -> int:
        """The position of `towards` among the sorted successors of `switch` (its port)."""
        if switch not in self._ports:
            self._ports[switch] = {node: index for index, node in enumerate(sorted(self.graph.successors(switch)))}
        return self._ports[switch][towards]

    def summary(self) -> dict:
        kinds: dict[str, int] = {}
        for _, data in self.graph.nodes(data=True):
            kinds[data["type"]] = kinds.get(data["type"], 0) + 1
        return {"nodes": self.n_nodes, "gpus": len(self.gpus), "devices": kinds, "edges": self.graph.number_of_edges()}


# ---------------------------------------------------------------- builders


def _link(graph: nx.DiGraph, a: str, b: str, bandwidth: float, latency_ab: float, latency_ba: float, kind: str) -> None:
    graph.add_edge(a, b, bandwidth=bandwidth, latency=latency_ab, link=kind)
    graph.add_edge(b, a, bandwidth=bandwidth, latency=latency_ba, link=kind)


def build_cluster(
    gpu: str | GPUSpec | Hardware,
    gpus_per_node: int,
    nodes: int,
    fabric: str | NICSpec | None = None,
    kind: str = "fat-tree",
) -> Cluster:
    """A cluster of `nodes` servers with `gpus_per_node` GPUs each, one NIC per GPU.

    gpu: a preset name, a GPUSpec or a Hardware; fabric: a NIC preset name or NICSpec
    (None: the NIC of the GPU's standard node, or "ndr" for a bare GPUSpec).
    """
    for name, value in (("gpus_per_node", gpus_per_node), ("nodes", nodes)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{name} must be a positive integer, got {value!r}")
    if kind not in CLUSTER_KINDS:
        raise ConfigError(f"unknown cluster kind {kind!r}: choose one of {', '.join(CLUSTER_KINDS)}")
    if isinstance(gpu, str):
        gpu = load_hardware(gpu)
    default_nic = gpu.nic if isinstance(gpu, Hardware) else load_nic("ndr")
    spec = gpu.gpu if isinstance(gpu, Hardware) else gpu
    nic = default_nic if fabric is None else (load_nic(fabric) if isinstance(fabric, str) else fabric)

    graph = nx.DiGraph(name=f"{nodes}x{gpus_per_node} {spec.name} {kind} {nic.name}", kind=kind, gpu=spec.name, fabric=nic.name)
    half_nvlink, half_nic = spec.nvlink_latency / 2, nic.latency / 2
    down_ports = max(1, nic.switch_radix // 2)
    leaf_of_nic: dict[str, str] = {}
    for node in range(nodes):
        switch = f"node{node}/nvswitch"
        graph.add_node(switch, type="nvswitch", node=node)
        for local in range(gpus_per_node):
            gpu_id, nic_id = f"node{node}/gpu{local}", f"node{node}/nic{local}"
            graph.add_node(gpu_id, type="gpu", node=node, local=local)
            graph.add_node(nic_id, type="nic", node=node, local=local)
            _link(graph, gpu_id, switch, spec.nvlink_bandwidth, half_nvlink, half_nvlink, "nvlink")
            _link(graph, gpu_id, nic_id, nic.bandwidth, half_nic, half_nic, "pcie")
            if kind == "fat-tree":
                leaf_of_nic[nic_id] = f"leaf{(node * gpus_per_node + local) // down_ports}"
            else:
                leaves_per_rail = -(-nodes // down_ports)
                leaf_of_nic[nic_id] = f"leaf{local * leaves_per_rail + node // down_ports}"

    nics_on_leaf: dict[str, int] = {}
    for nic_id, leaf in leaf_of_nic.items():
        if leaf not in graph:
            graph.add_node(leaf, type="leaf")
            if kind == "rail":
                graph.nodes[leaf]["rail"] = graph.nodes[nic_id]["local"]
        nics_on_leaf[leaf] = nics_on_leaf.get(leaf, 0) + 1
        _link(graph, nic_id, leaf, nic.bandwidth, nic.switch_latency, 0.0, "infiniband")
    if len(nics_on_leaf) > 1:
        spines = min(down_ports, max(nics_on_leaf.values()))
        for index in range(spines):
            spine = f"spine{index}"
            graph.add_node(spine, type="spine")
            for leaf in nics_on_leaf:
                _link(graph, leaf, spine, nic.bandwidth, nic.switch_latency, nic.switch_latency, "infiniband")
    return Cluster(graph, origin=graph.graph["name"])


# ---------------------------------------------------------------- files


def save_cluster(cluster: Cluster | nx.Graph, path: str | Path) -> Path:
    """Write a topology as node-link JSON (.json) or GraphML (.graphml)."""
    graph = cluster.graph if isinstance(cluster, Cluster) else cluster
    path = Path(path)
    if path.suffix == ".json":
        try:
            data = nx.node_link_data(graph, edges="edges")
        except TypeError:  # networkx < 3.4 names the keyword `link`
            data = nx.node_link_data(graph, link="edges")
        path.write_text(json.dumps(data, indent=1) + "\n")
    elif path.suffix == ".graphml":
        nx.write_graphml(graph, path)
    else:
        raise ConfigError(f"cannot save a topology as {path.name!r}: use a .json (node-link) or .graphml file name")
    return path


def load_cluster(path: str | Path) -> Cluster:
    """Read a topology written by save_cluster (or by hand in the same form) and check it."""
    path = Path(path)
    if path.suffix not in (".json", ".graphml"):
        raise ConfigError(f"cannot read a topology from {path.name!r}: use a .json (node-link) or .graphml file")
    if not path.is_file():
        raise ConfigError(f"topology file {str(path)!r} does not exist: give the path of a .json or .graphml file")
    if path.suffix == ".graphml":
        try:
            graph = nx.read_graphml(path)
        except Exception as error:  # the XML parser and networkx raise several kinds
            raise ConfigError(f"topology file {str(path)!r} is not valid GraphML ({error}): fix or re-save it") from None
        return Cluster(graph, origin=str(path))
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ConfigError(f"topology file {str(path)!r} is not valid JSON (line {error.lineno}: {error.msg}): fix the file") from None
    if not isinstance(data, dict) or "nodes" not in data or not ({"edges", "links"} & data.keys()):
        raise ConfigError(f"topology file {str(path)!r} is not node-link JSON: it needs 'nodes' and 'edges' lists")
    edges_key = "edges" if "edges" in data else "links"
    try:
        try:
            graph = nx.node_link_graph(data, edges=edges_key)
        except TypeError:  # networkx < 3.4
            graph = nx.node_link_graph(data, link=edges_key)
    except (KeyError, TypeError, ValueError, nx.NetworkXError) as error:
        raise ConfigError(f"topology file {str(path)!r} is malformed node-link JSON ({error!r}): fix or re-save it") from None
    return Cluster(graph, origin=str(path))
