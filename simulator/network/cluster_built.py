"""A cluster built from presets: routes and link figures by arithmetic, the graph drawn only when asked. Torch-free.

Same interface as simulator/network/cluster.py's Cluster (ranks, routes, bandwidth and latency of
the edges on them, `graph`), plus `path(a, b)`: the route between two ranks as tuple nodes
(simulator/network/fabric.py) with each edge's bandwidth, for the engine's fast costing.

Inside a server every GPU has an NVLink edge to the server's NVSwitch (one logical,
non-blocking switch standing for the NVSwitch chips) at the GPU's NVLink bandwidth; GPU
`local` uses NIC local * K // G (K NICs, G GPUs per server: GPUs share a NIC when K < G)
through its own GPU-NIC edge (GPUDirect RDMA; the PCIe hop is folded in and runs at the
NIC's bandwidth); NICs plug into the fabric's leaves; switches join as the Fabric says. On a
rail-only fabric a transfer between different rails first crosses NVLink to the source
server's GPU in the destination's position, then that GPU's rail (Wang et al. 2023).
Graph ids: node{n}/gpu{l}, node{n}/nic{k}, node{n}/nvswitch, leaf{i}, spine{i} (tier 2),
core{i} (tier 3), tier{t}-{i} above; on a rail-only fabric the switches of rail r are rail{r}/...

Latencies: GPU<->NVSwitch edges carry half the GPU's nvlink_latency each (a GPU-to-GPU step
costs nvlink_latency), GPU<->NIC edges half the NIC's per-message latency each, edges into
a leaf or spine the switch latency, edges from a switch into a NIC nothing.
"""

from __future__ import annotations

from functools import cached_property

import networkx as nx

from minigpt.errors import ConfigError
from simulator.network.cluster import Cluster, Edge
from simulator.network.fabric import Fabric, Node
from simulator.costs.hardware import GPUSpec, NICSpec

SWITCH_NAMES = {1: "leaf", 2: "spine", 3: "core"}


class BuiltCluster(Cluster):
    """A cluster of identical servers on a Fabric (see the module docstring)."""

    def __init__(self, fabric: Fabric, gpu: GPUSpec, nic: NICSpec) -> None:
        self.fabric, self.spec, self.nic = fabric, gpu, nic
        per_node, nodes = fabric.gpus_per_node, fabric.nodes
        name = f"{nodes}x{per_node} {gpu.name} {fabric.kind} {nic.name}"
        self.origin = name
        self._attributes = {
            "name": name, "kind": fabric.kind, "gpu": gpu.name, "fabric": nic.name,
            "nics_per_node": fabric.nics_per_node, "oversubscription": fabric.oversubscription,
            "busbw_fraction": nic.busbw_fraction, "description": fabric.describe(),
        }
        self._routes: dict[tuple[int, int], list[Edge]] = {}
        self._edges: dict[Edge, tuple[float, float]] = {}  # the named edges of routes given out: (bandwidth, latency)

    # ------------------------------------------------------------ the Cluster interface

    @property
    def attributes(self) -> dict:
        return self._attributes

    @property
    def n_gpus(self) -> int:
        return self.fabric.nodes * self.fabric.gpus_per_node

    @property
    def n_nodes(self) -> int:
        return self.fabric.nodes

    @cached_property
    def gpus(self) -> list[str]:
        return [self.name(("gpu", rank)) for rank in range(self.n_gpus)]

    @cached_property
    def rank(self) -> dict[str, int]:
        return {gpu: rank for rank, gpu in enumerate(self.gpus)}

    def rank_of(self, gpu: str | int) -> int:
        """A rank, from a rank or a GPU id ("node3/gpu5")."""
        if isinstance(gpu, int) and not isinstance(gpu, bool):
            if not 0 <= gpu < self.n_gpus:
                raise ConfigError(f"rank {gpu} is outside the cluster's {self.n_gpus} GPUs")
            return gpu
        node, _, local = str(gpu).removeprefix("node").partition("/gpu")
        if not (node.isdigit() and local.isdigit() and int(node) < self.fabric.nodes
                and int(local) < self.fabric.gpus_per_node and gpu == f"node{int(node)}/gpu{int(local)}"):
            raise ConfigError(f"{gpu!r} is not a GPU of this cluster: use a rank (0..{self.n_gpus - 1}) or a GPU id like 'node0/gpu0'")
        return int(node) * self.fabric.gpus_per_node + int(local)

    def route(self, src: str | int, dst: str | int) -> list[Edge]:
        key = (self.rank_of(src), self.rank_of(dst))
        if key not in self._routes:
            self._routes[key] = self._named(self.path(*key)[0])
        return self._routes[key]

    def gpu_id(self, gpu: str | int) -> str:
        return self.name(("gpu", self.rank_of(gpu)))

    def node_of(self, gpu: str | int) -> int:
        return self.rank_of(gpu) // self.fabric.gpus_per_node

    def bandwidth(self, edge: Edge) -> float:
        """An edge's bandwidth: known once a route has used it, else read off the drawn graph."""
        return self._edges[edge][0] if edge in self._edges else float(self.graph.edges[edge]["bandwidth"])

    def latency(self, edge: Edge) -> float:
        return self._edges[edge][1] if edge in self._edges else float(self.graph.edges[edge]["latency"])

    def link_kind(self, edge: Edge) -> str:
        return "nvlink" if edge[0].endswith("/nvswitch") or edge[1].endswith("/nvswitch") else "network"

    def _named(self, edges: list[tuple[tuple[Node, Node], float, bool]]) -> list[Edge]:
        named = []
        for (u, v), bandwidth, _ in edges:
            edge = (self.name(u), self.name(v))
            self._edges[edge] = (bandwidth, self.edge_latency(u, v))
            named.append(edge)
        return named

    def summary(self) -> dict:
        f = self.fabric
        devices = {"gpu": self.n_gpus, "nvswitch": f.nodes, "nic": f.nodes * f.nics_per_node,
                   "leaf": f.switch_counts[0]}
        if f.tiers > 1:
            devices["spine"] = sum(f.switch_counts[1:])
        edges = 2 * (2 * self.n_gpus + f.nodes * f.nics_per_node + f.switch_link_count())
        return {"nodes": f.nodes, "gpus": self.n_gpus, "devices": devices, "edges": edges, "fabric": self.describe(),
                "tiers": f.tiers, "switches_per_tier": list(f.switch_counts), "nics_per_node": f.nics_per_node,
                "leaf_oversubscription": f.leaf_oversubscription}

    # ------------------------------------------------------------ structure

    def name(self, node: Node) -> str:
        """The graph id of a tuple node."""
        kind = node[0]
        if kind == "gpu":
            return f"node{node[1] // self.fabric.gpus_per_node}/gpu{node[1] % self.fabric.gpus_per_node}"
        if kind == "nic":
            return f"node{node[1] // self.fabric.nics_per_node}/nic{node[1] % self.fabric.nics_per_node}"
        if kind == "nvs":
            return f"node{node[1]}/nvswitch"
        _, tree, tier, index = node
        prefix = f"rail{tree}/" if self.fabric.kind == "rail-only" else ""
        return f"{prefix}{SWITCH_NAMES.get(tier, f'tier{tier}-')}{index}"

    def edge_latency(self, u: Node, v: Node) -> float:
        if u[0] == "nvs" or v[0] == "nvs":
            return self.spec.nvlink_latency / 2
        if u[0] == "gpu" or v[0] == "gpu":
            return self.nic.latency / 2
        return 0.0 if v[0] == "nic" else self.nic.switch_latency

    @cached_property
    def capacities(self) -> tuple[float, float, float, float]:
        """Bandwidth of an edge by its class (fabric.LINK_CLASSES)."""
        nic = self.nic.bandwidth
        return self.spec.nvlink_bandwidth, nic, nic, self.fabric.top_cables * nic

    def latency_of(self, units: tuple[int, int, int]) -> float:
        """Seconds of a route of (NVLink steps, NIC messages, switch traversals)."""
        steps, messages, switches = units
        return steps * self.spec.nvlink_latency + messages * self.nic.latency + switches * self.nic.switch_latency

    def path(self, a: int, b: int) -> tuple[list[tuple[tuple[Node, Node], float, bool]], float]:
        """The route from rank a to rank b: ((from, to), bandwidth, over NVLink) per edge, and its latency."""
        numbers: list[int] = []
        units = self.fabric.route(a, b, numbers)
        capacities, decode = self.capacities, self.fabric.decode
        return [(decode(e), capacities[e & 3], e & 3 == 0) for e in numbers], self.latency_of(units)

    @cached_property
    def graph(self) -> nx.DiGraph:
        """The cluster as a networkx graph (cluster.py's form), drawn on first use."""
        f, gpu, nic = self.fabric, self.spec, self.nic
        graph = nx.DiGraph(**self._attributes)
        per_node, k = f.gpus_per_node, f.nics_per_node

        def link(u: Node, v: Node, bandwidth: float, kind: str) -> None:
            a, b = self.name(u), self.name(v)
            graph.add_edge(a, b, bandwidth=bandwidth, latency=self.edge_latency(u, v), link=kind)
            graph.add_edge(b, a, bandwidth=bandwidth, latency=self.edge_latency(v, u), link=kind)

        for node in range(f.nodes):
            graph.add_node(self.name(("nvs", node)), type="nvswitch", node=node)
            for local in range(k):
                tree, leaf, _ = f.nic_place(node * k + local)
                graph.add_node(self.name(("nic", node * k + local)), type="nic", node=node, local=local)
                leaf_id = self.name(("sw", tree, 1, leaf))
                if leaf_id not in graph:
                    graph.add_node(leaf_id, type="leaf", tier=1, **({"rail": local} if f.kind != "fat-tree" else {}))
                link(("nic", node * k + local), ("sw", tree, 1, leaf), nic.bandwidth, "infiniband")
            for local in range(per_node):
                rank = node * per_node + local
                graph.add_node(self.name(("gpu", rank)), type="gpu", node=node, local=local)
                link(("gpu", rank), ("nvs", node), gpu.nvlink_bandwidth, "nvlink")
                link(("gpu", rank), ("nic", node * k + f.nic_of(local)), nic.bandwidth, "pcie")
        for tree, tier, below, above, cables in f.switch_links():
            upper = ("sw", tree, tier + 1, above)
            if self.name(upper) not in graph:
                graph.add_node(self.name(upper), type="spine", tier=tier + 1)
            link(("sw", tree, tier, below), upper, cables * nic.bandwidth, "infiniband")
        return graph
