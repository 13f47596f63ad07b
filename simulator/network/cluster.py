"""A cluster given as a networkx graph (a topology file, or a built cluster drawn out): checks and routes.

A cluster is a directed graph: every cable is two edges, one per direction, each with
`bandwidth` (bytes/s) and `latency` (s). Node attribute `type` is one of NODE_TYPES;
GPUs and NICs also carry `node` (server index) and `local` (index inside the server).
Graph attributes a built cluster writes (all optional in a file): `gpu` (the GPU preset),
`fabric` (the NIC preset), `kind`, `busbw_fraction` (what NCCL reaches across nodes as a
fraction of the line rate, simulator/costs/rates/achieved.py; 1 when absent) and `description`. Numbers are
finite and within simulator/json_file.py's ranges (bandwidth 1 to 1e30 bytes/s, latency 0 to
3600 s), and a graph holds at most simulator/limits.py's MAX_FILE_GPUS GPUs.

Routing (`Cluster.route`): fewest hops, and a GPU is never a transit node, so GPUs of
one server always talk through the NVSwitch (2 hops) and never through NICs; across
servers the path is GPU -> NIC -> leaf (-> spine -> leaf) -> NIC -> GPU. Among equal
paths the choice depends on the destination only, like InfiniBand's D-mod-k tables:
walking back from the destination, a switch picks among its equal-cost predecessors
by the port the path leaves it on (the destination NIC's port on its leaf picks the
spine), so destinations under one leaf come down through different spines.
When no path avoids other GPUs (a rail-only fabric: nothing joins different rails), the
source server's GPU in the destination's position forwards: NVLink first, then its rail.
"""

from __future__ import annotations

import networkx as nx

from minigpt.errors import ConfigError
from simulator.json_file import FRACTION, RATE, SECONDS, in_range
from simulator.limits import check_file_gpus

NODE_TYPES = ("gpu", "nvswitch", "nic", "leaf", "spine")

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
        check_file_gpus(len(places), origin)
        for u, v, data in self.graph.edges(data=True):
            for key in ("bandwidth", "latency"):
                value = data.get(key)
                if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
                    raise ConfigError(f"{origin}: edge {u!r} -> {v!r} has no numeric '{key}': give every edge bandwidth (bytes/s) and latency (s)")
            if not in_range(data["bandwidth"], RATE) or not in_range(data["latency"], SECONDS):
                raise ConfigError(f"{origin}: edge {u!r} -> {v!r} needs bandwidth > 0 and latency >= 0 (bandwidth "
                                  f"{RATE[0]:g} to {RATE[1]:g} bytes/s, latency at most {SECONDS[1]:g} s), "
                                  f"got {data['bandwidth']!r}, {data['latency']!r}")
        attributes = self.graph.graph
        fraction = attributes.get("busbw_fraction", 1.0)
        if not in_range(fraction, FRACTION):
            raise ConfigError(f"{origin}: graph attribute busbw_fraction must be a fraction in (0, 1] (at least "
                              f"{FRACTION[0]:g}), got {fraction!r}")
        if not isinstance(attributes.get("gpu", ""), str):
            raise ConfigError(f"{origin}: graph attribute gpu must name a GPU preset or profile, got {attributes['gpu']!r}")

    def _check_connected(self) -> None:
        """Every GPU reaches and is reached by the first one (GPUs may forward, as in a rail-only fabric)."""
        first = self.gpus[0]
        for reverse, verb in ((False, "be reached from"), (True, "reach")):
            reached = self._predecessors(first, None, reverse=reverse, transit=True)
            for gpu in self.gpus:
                if gpu not in reached:
                    raise ConfigError(f"{self.origin}: GPU {gpu!r} cannot {verb} GPU {first!r}: connect every GPU to the network")

    # ------------------------------------------------------------ queries

    @property
    def attributes(self) -> dict:
        """The graph's own attributes (gpu, fabric, kind, busbw_fraction, description: all optional)."""
        return self.graph.graph

    @property
    def n_gpus(self) -> int:
        return len(self.gpus)

    @property
    def busbw_fraction(self) -> float:
        """NCCL bus bandwidth across nodes over the line rate (1 when the cluster does not say)."""
        return float(self.attributes.get("busbw_fraction", 1.0))

    def describe(self) -> str:
        return str(self.attributes.get("description") or self.attributes.get("name") or self.origin)

    def node_of(self, gpu: str | int) -> int:
        """The server index of a GPU (by id or rank)."""
        return self.graph.nodes[self.gpu_id(gpu)]["node"]

    def gpu_id(self, gpu: str | int) -> str:
        """The GPU's node id; an int is read as a rank."""
        if isinstance(gpu, int) and not isinstance(gpu, bool):
            if not 0 <= gpu < self.n_gpus:
                raise ConfigError(f"rank {gpu} is outside the cluster's {self.n_gpus} GPUs")
            return self.gpus[gpu]
        if gpu not in self.rank:
            raise ConfigError(f"{gpu!r} is not a GPU of this cluster: use a rank (0..{self.n_gpus - 1}) or a GPU id like {self.gpus[0]!r}")
        return gpu

    @property
    def n_nodes(self) -> int:
        return len({self.graph.nodes[gpu]["node"] for gpu in self.gpus})

    def bandwidth(self, edge: Edge) -> float:
        return self._bandwidth[edge]

    def latency(self, edge: Edge) -> float:
        return self._latency[edge]

    def link_kind(self, edge: Edge) -> str:
        """"nvlink" for an edge to or from an NVSwitch, "network" for the rest (NIC, switches)."""
        nodes = self.graph.nodes
        return "nvlink" if "nvswitch" in (nodes[edge[0]]["type"], nodes[edge[1]]["type"]) else "network"

    def route(self, src: str | int, dst: str | int) -> list[Edge]:
        """The directed edges from GPU src to GPU dst (empty when src == dst)."""
        src, dst = self.gpu_id(src), self.gpu_id(dst)
        key = (src, dst)
        if key not in self._routes:
            self._routes[key] = self._find_route(src, dst)
        return self._routes[key]

    def route_latency(self, src: str | int, dst: str | int) -> float:
        return sum(self.latency(edge) for edge in self.route(src, dst))

    def route_bandwidth(self, src: str | int, dst: str | int) -> float:
        """The bottleneck bandwidth of the route (inf when src == dst)."""
        return min((self.bandwidth(edge) for edge in self.route(src, dst)), default=float("inf"))

    def _predecessors(self, src: str, dst: str | None, reverse: bool = False, transit: bool = False) -> dict[str, list[str]]:
        """Breadth-first search from src that never passes through another GPU (unless `transit`), nor
        from a GPU through a NIC to a GPU (GPUs sharing a NIC talk over NVLink).

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
                kind = graph.nodes[node]["type"]
                if not transit and node != src and kind == "gpu":
                    continue
                # a NIC is no switch: what came up from a GPU goes on to the network, not back to a GPU
                up_from_gpu = kind == "nic" and not transit and all(graph.nodes[p]["type"] == "gpu" for p in preds[node])
                for nxt in neighbours(node):
                    if nxt not in preds and not (up_from_gpu and graph.nodes[nxt]["type"] == "gpu"):
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
            via = self._forwarder(src, dst)
            if via is None:
                raise ConfigError(f"{self.origin}: no route from {src!r} to {dst!r}: connect them")
            return self.route(src, via) + self.route(via, dst)
        path, key = [dst], self.rank[dst]
        while path[-1] != src:
            options = sorted(preds[path[-1]])
            path.append(options[key % len(options)])
            key = self._port(path[-1], path[-2])
        path.reverse()
        return list(zip(path[:-1], path[1:]))

    def _forwarder(self, src: str, dst: str) -> str | None:
        """The GPU of src's server in dst's position, when it is neither and reaches dst without forwarding."""
        nodes = self.graph.nodes
        place = (nodes[src]["node"], nodes[dst]["local"])
        via = next((gpu for gpu in self.gpus if (nodes[gpu]["node"], nodes[gpu]["local"]) == place), None)
        if via is None or via in (src, dst) or dst not in self._predecessors(via, dst):
            return None
        return via

    def _port(self, switch: str, towards: str) -> int:
        """The position of `towards` among the sorted successors of `switch` (its port)."""
        if switch not in self._ports:
            self._ports[switch] = {node: index for index, node in enumerate(sorted(self.graph.successors(switch)))}
        return self._ports[switch][towards]

    def summary(self) -> dict:
        kinds: dict[str, int] = {}
        for _, data in self.graph.nodes(data=True):
            kinds[data["type"]] = kinds.get(data["type"], 0) + 1
        return {"nodes": self.n_nodes, "gpus": self.n_gpus, "devices": kinds, "edges": self.graph.number_of_edges(),
                "fabric": self.describe()}
